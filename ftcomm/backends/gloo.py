"""In-process c10d Gloo on CPU tensors.

Facts of torch 2.13 this backend is built around (DESIGN.md):

* ``abort()`` and ``shutdown()`` do nothing, but a per-op ``timeout`` fires on
  time. Every collective is issued with the remaining deadline as its own
  timeout, so a hung op ends by itself no later than its deadline.
* Send, recv, ``reduce_scatter`` and ``_reduce_scatter_base`` return works
  with no future that complete only inside ``wait()``: they are waited on a
  worker thread with the remaining deadline (one thread hop, about 50-100 µs,
  which the other collectives do not pay).
* The backend has no ``allgather_into_tensor_coalesced`` and no
  ``reduce_scatter_tensor_coalesced``: they are issued as one
  ``_allgather_base`` / ``_reduce_scatter_base`` per tensor, all in flight at
  once, and end together. The cost is one native op per tensor instead of one
  fused op (no extra copies).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)
from torch.distributed import ReduceOp

from .._runtime.loop import get_runtime
from .._runtime.native import NativeOp, ThreadOp, WorkOp, WorksOp
from .._store import StoreAddr, connect_store
from ._base import Backend, ConnectSpec

_MIN_NATIVE_TIMEOUT = 0.001


def _td(seconds: float) -> timedelta:
    # Gloo reads a zero timeout as "use the default": never hand it zero.
    return timedelta(seconds=max(seconds, _MIN_NATIVE_TIMEOUT))


def _device(addr: StoreAddr) -> object:
    """Where Gloo listens: the store's loopback address, else Gloo's default."""
    pg_gloo: Any = dist.ProcessGroupGloo
    if addr.is_loopback:
        host = "127.0.0.1" if addr.host == "localhost" else addr.host
        return pg_gloo.create_device(hostname=host)
    return pg_gloo.create_default_device()


def _wait_all(works: list[dist.Work], deadline: float) -> None:
    for work in works:
        work.wait(_td(deadline - time.monotonic()))


def _waited(works: list[dist.Work], timeout: float) -> NativeOp:
    """An op over works that only progress inside ``wait()``."""
    deadline = time.monotonic() + timeout
    return ThreadOp(get_runtime().run_blocking(_wait_all, works, deadline, until=deadline))


class GlooBackend(Backend):
    name: ClassVar[str] = "gloo"
    device_type: ClassVar[str] = "cpu"
    dtypes: ClassVar[frozenset[torch.dtype] | None] = frozenset(
        {
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int8,
            torch.uint8,
            torch.int32,
            torch.int64,
            torch.bool,
            torch.complex64,
            torch.complex128,
        }
    )
    reduce_ops: ClassVar[frozenset[ReduceOp.RedOpType]] = frozenset(
        {
            ReduceOp.SUM,
            ReduceOp.PRODUCT,
            ReduceOp.MIN,
            ReduceOp.MAX,
            ReduceOp.BAND,
            ReduceOp.BOR,
            ReduceOp.BXOR,
        }
    )

    def __init__(self, pg: Any, store: object, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        # Any: torch's stubs for ProcessGroupGloo lack most backend methods.
        self._pg: Any = pg
        self._store: object | None = store
        self._options: dict[tuple[object, ...], Any] = {}

    def _opts(self, kind: type, timeout: float, reduce_op: object = None, root: int = 0) -> Any:
        """An options object, built once per (kind, timeout, op, root) and reused.

        c10d copies what it needs out of the options when it issues the op and
        ftcomm never changes one after building it, so reusing them is safe; it
        saves building a pybind object and a timedelta on every small op.
        """
        key = (kind, timeout, reduce_op, root)
        opts = self._options.get(key)
        if opts is None:
            if len(self._options) >= 64:  # many distinct per-op timeouts: start over
                self._options.clear()
            opts = kind()
            opts.timeout = _td(timeout)
            if reduce_op is not None:
                opts.reduceOp = reduce_op
            if kind is BroadcastOptions:
                opts.rootRank = root
                opts.rootTensor = 0
            self._options[key] = opts
        return opts

    @classmethod
    def connect(cls, spec: ConnectSpec) -> GlooBackend:
        store = connect_store(spec.store, spec.timeout)
        pg_gloo: Any = dist.ProcessGroupGloo
        opts = pg_gloo._Options()
        opts._timeout = timedelta(seconds=spec.timeout)
        opts._devices = [_device(spec.store)]
        if spec.global_ranks is not None:
            opts.global_ranks_in_group = list(spec.global_ranks)
        opts.group_name = f"ftcomm:{spec.replica_id}:{spec.quorum_id}:{spec.store.prefix}"
        pg = pg_gloo(store, spec.rank, spec.world_size, opts)
        return cls(pg, store, spec.rank, spec.world_size)

    def close(self) -> list[object]:
        pg, store = self._pg, self._store
        self._pg = self._store = None
        return [obj for obj in (pg, store) if obj is not None]

    @property
    def pg(self) -> Any:
        pg = self._pg
        if pg is None:
            raise RuntimeError("the Gloo group was closed")
        return pg

    def allreduce(
        self, tensors: Sequence[torch.Tensor], op: ReduceOp.RedOpType, timeout: float
    ) -> NativeOp:
        if len(tensors) == 1:
            opts = self._opts(AllreduceOptions, timeout, op)
            return WorkOp(self.pg.allreduce(list(tensors), opts))
        copts = self._opts(AllreduceCoalescedOptions, timeout, op)
        return WorkOp(self.pg.allreduce_coalesced(list(tensors), copts))

    def allgather(
        self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, timeout: float
    ) -> NativeOp:
        opts = self._opts(AllgatherOptions, timeout)
        return WorkOp(self.pg.allgather([list(outputs)], [tensor], opts))

    def allgather_into_tensor(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], timeout: float
    ) -> NativeOp:
        opts = self._opts(AllgatherOptions, timeout)
        pg = self.pg
        return WorksOp(
            [pg._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        )

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float) -> NativeOp:
        opts = self._opts(BroadcastOptions, timeout, root=root)
        return WorkOp(self.pg.broadcast([tensor], opts))

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOp.RedOpType,
        timeout: float,
    ) -> NativeOp:
        opts = self._opts(ReduceScatterOptions, timeout, op)
        return _waited([self.pg.reduce_scatter([output], [list(inputs)], opts)], timeout)

    def reduce_scatter_tensor(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        op: ReduceOp.RedOpType,
        timeout: float,
    ) -> NativeOp:
        opts = self._opts(ReduceScatterOptions, timeout, op)
        pg = self.pg
        return _waited(
            [pg._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)],
            timeout,
        )

    def alltoall_base(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        timeout: float,
    ) -> NativeOp:
        opts = self._opts(AllToAllOptions, timeout)
        work = self.pg.alltoall_base(output, tensor, output_split_sizes, input_split_sizes, opts)
        return WorkOp(work)

    def barrier(self, timeout: float) -> NativeOp:
        opts = self._opts(BarrierOptions, timeout)
        return WorkOp(self.pg.barrier(opts))

    def send(self, tensor: torch.Tensor, dst: int, tag: int, timeout: float) -> NativeOp:
        return _waited([self.pg.send([tensor], dst, tag)], timeout)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, timeout: float) -> NativeOp:
        return _waited([self.pg.recv([tensor], src, tag)], timeout)
