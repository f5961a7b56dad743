"""How each :class:`~ftcomm.backends.Backend` call travels in an OP frame.

Both ends read this one table: the parent lays a call's tensors out in the
order given here (with the role each plays: copied in, copied back, or
both), and the worker rebuilds the call from the same order. Every OP
carries ``timeout`` (the seconds left to the op's deadline), which the worker
gives the native op as its own timeout. The frames: docs/protocol.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed import ReduceOp

from ..._protocol import Scalar
from ..._runtime.native import NativeOp
from ..._validate import PremulSum, ReduceOpArg
from .._base import Backend

_REDUCE_OPS: dict[str, ReduceOp.RedOpType] = dict(ReduceOp.RedOpType.__members__)


def reduce_options(op: ReduceOpArg) -> dict[str, Scalar]:
    """A reduce op as an OP frame's options: its name, and PREMUL_SUM's factor."""
    if isinstance(op, PremulSum):
        return {"reduce_op": "PREMUL_SUM", "premul_factor": op.factor}
    return {"reduce_op": str(op.name)}


def _reduce_op(options: Mapping[str, Scalar]) -> ReduceOpArg:
    name = options["reduce_op"]
    if not isinstance(name, str) or name not in _REDUCE_OPS:
        raise ValueError(f"unknown reduce op {name!r}")
    if name == "PREMUL_SUM":
        factor = options.get("premul_factor")
        if type(factor) is not float:
            raise ValueError(f"PREMUL_SUM needs a float premul_factor, got {factor!r}")
        return PremulSum(factor)
    return _REDUCE_OPS[name]


def _int(options: Mapping[str, Scalar], key: str) -> int:
    value = options[key]
    if type(value) is not int:
        raise ValueError(f"option {key} must be an int, got {value!r}")
    return value


def _ints(options: Mapping[str, Scalar], key: str) -> list[int]:
    value = options[key]
    if not isinstance(value, tuple):
        raise ValueError(f"option {key} must be a list of int, got {value!r}")
    return list(value)


def _halves(ts: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if len(ts) % 2:
        raise ValueError("expected as many outputs as inputs")
    k = len(ts) // 2
    return list(ts[:k]), list(ts[k:])


Call = Callable[[Backend, Sequence[torch.Tensor], Mapping[str, Scalar], float], NativeOp]


def _allreduce(
    b: Backend, ts: Sequence[torch.Tensor], o: Mapping[str, Scalar], t: float
) -> NativeOp:
    return b.allreduce(ts, _reduce_op(o), t)


def _allgather(
    b: Backend, ts: Sequence[torch.Tensor], o: Mapping[str, Scalar], t: float
) -> NativeOp:
    return b.allgather(ts[1:], ts[0], t)


def _allgather_into(
    b: Backend, ts: Sequence[torch.Tensor], o: Mapping[str, Scalar], t: float
) -> NativeOp:
    outputs, inputs = _halves(ts)
    return b.allgather_into_tensor(outputs, inputs, t)


def _broadcast(
    b: Backend, ts: Sequence[torch.Tensor], o: Mapping[str, Scalar], t: float
) -> NativeOp:
    return b.broadcast(ts[0], _int(o, "root"), t)


def _reduce_scatter(
    b: Backend, ts: Sequence[torch.Tensor], o: Mapping[str, Scalar], t: float
) -> NativeOp:
    return b.reduce_scatter(ts[0], ts[1:], _reduce_op(o), t)


def _reduce_scatter_tensor(
    b: Backend, ts: Sequence[torch.Tensor], o: Mapping[str, Scalar], t: float
) -> NativeOp:
    outputs, inputs = _halves(ts)
    return b.reduce_scatter_tensor(outputs, inputs, _reduce_op(o), t)


def _alltoall_base(
    b: Backend, ts: Sequence[torch.Tensor], o: Mapping[str, Scalar], t: float
) -> NativeOp:
    outs, ins = _ints(o, "output_split_sizes"), _ints(o, "input_split_sizes")
    return b.alltoall_base(ts[0], ts[1], outs, ins, t)


def _barrier(b: Backend, ts: Sequence[torch.Tensor], o: Mapping[str, Scalar], t: float) -> NativeOp:
    return b.barrier(t)


def _send(b: Backend, ts: Sequence[torch.Tensor], o: Mapping[str, Scalar], t: float) -> NativeOp:
    return b.send(ts[0], _int(o, "peer"), _int(o, "tag"), t)


def _recv(b: Backend, ts: Sequence[torch.Tensor], o: Mapping[str, Scalar], t: float) -> NativeOp:
    return b.recv(ts[0], _int(o, "peer"), _int(o, "tag"), t)


CALLS: dict[str, Call] = {
    "allreduce": _allreduce,
    "allgather": _allgather,
    "allgather_into_tensor": _allgather_into,
    "broadcast": _broadcast,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "alltoall_base": _alltoall_base,
    "barrier": _barrier,
    "send": _send,
    "recv": _recv,
}
"""The worker's side: op name -> the backend call, from the frame's tensors."""


def run(
    backend: Backend, op: str, tensors: Sequence[torch.Tensor], options: Mapping[str, Scalar]
) -> NativeOp:
    """Issue ``op`` on ``backend`` (the worker's side).

    Raises:
        ValueError: an op or option this table does not know.
        RuntimeError: the native group rejected the call.
    """
    call = CALLS.get(op)
    if call is None:
        raise ValueError(f"unknown op {op!r}")
    timeout = options.get("timeout")
    if type(timeout) is not float and type(timeout) is not int:
        raise ValueError(f"option timeout must be a number, got {timeout!r}")
    return call(backend, tensors, options, float(timeout))
