"""World size 1 and no communication: every op ends at once, locally.

The counterpart of torchft's ``ProcessGroupDummy``: for code that must run a
collective where there is nobody to talk to. Results are what a real group of
one rank would give (an allgather copies the input into the output, and so on).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch.distributed import ReduceOp

from .._runtime.native import DoneOp, NativeOp, write_outputs
from .._validate import ReduceOpArg
from ._base import Backend, ConnectSpec


class DummyBackend(Backend):
    name: ClassVar[str] = "dummy"
    device_type = "*"  # any device: nothing leaves the tensor
    reduce_ops: ClassVar[frozenset[ReduceOp.RedOpType]] = frozenset(
        {
            ReduceOp.SUM,
            ReduceOp.AVG,
            ReduceOp.PRODUCT,
            ReduceOp.MIN,
            ReduceOp.MAX,
            ReduceOp.BAND,
            ReduceOp.BOR,
            ReduceOp.BXOR,
        }
    )

    @classmethod
    def connect(
        cls, spec: ConnectSpec, cancel: concurrent.futures.Future[Any] | None = None
    ) -> DummyBackend:
        if spec.world_size != 1:
            raise ValueError(f"the dummy backend has world_size 1, got {spec.world_size}")
        return cls(spec.rank, spec.world_size)

    def allreduce(
        self, tensors: Sequence[torch.Tensor], op: ReduceOpArg, timeout: float
    ) -> NativeOp:
        return DoneOp()

    def allgather(
        self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, timeout: float
    ) -> NativeOp:
        write_outputs([(outputs[0], tensor)])
        return DoneOp()

    def allgather_into_tensor(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], timeout: float
    ) -> NativeOp:
        write_outputs(
            [(out, inp.reshape(out.shape)) for out, inp in zip(outputs, inputs, strict=True)]
        )
        return DoneOp()

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float) -> NativeOp:
        return DoneOp()

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOpArg,
        timeout: float,
    ) -> NativeOp:
        write_outputs([(output, inputs[0])])
        return DoneOp()

    def reduce_scatter_tensor(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        op: ReduceOpArg,
        timeout: float,
    ) -> NativeOp:
        write_outputs(
            [(out, inp.reshape(out.shape)) for out, inp in zip(outputs, inputs, strict=True)]
        )
        return DoneOp()

    def alltoall_base(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        timeout: float,
    ) -> NativeOp:
        write_outputs([(output, tensor)])
        return DoneOp()

    def barrier(self, timeout: float) -> NativeOp:
        return DoneOp()

    def send(self, tensor: torch.Tensor, dst: int, tag: int, timeout: float) -> NativeOp:
        raise AssertionError("unreachable: a world of one rank has no peer")

    def recv(self, tensor: torch.Tensor, src: int, tag: int, timeout: float) -> NativeOp:
        raise AssertionError("unreachable: a world of one rank has no peer")
