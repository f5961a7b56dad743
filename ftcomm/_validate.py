"""Argument checks shared by every public entry point.

Each check raises ``TypeError`` for a wrong type and ``ValueError`` for a wrong
value, names the argument, and touches nothing: a rejected call leaves the
group and the caller's tensors as they were (docs/errors.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import torch
from torch.distributed import ReduceOp

INT32_MAX = 2**31 - 1
"""Ranks, world sizes and tags cross into C++ as 32-bit ints."""

_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
_COMPLEX_OK = frozenset({ReduceOp.SUM, ReduceOp.AVG})


class TensorRules(Protocol):
    """What a backend accepts: a device type (``"*"`` for any) and dtypes (None: any)."""

    @property
    def device_type(self) -> str: ...

    @property
    def dtypes(self) -> frozenset[torch.dtype] | None: ...


_REDUCE_OPS_BY_NAME: dict[str, ReduceOp.RedOpType] = {
    "sum": ReduceOp.SUM,
    "avg": ReduceOp.AVG,
    "product": ReduceOp.PRODUCT,
    "min": ReduceOp.MIN,
    "max": ReduceOp.MAX,
    "band": ReduceOp.BAND,
    "bor": ReduceOp.BOR,
    "bxor": ReduceOp.BXOR,
}


def check_int(
    value: object, name: str, *, minimum: int | None = None, maximum: int | None = INT32_MAX
) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_rank(value: object, name: str, world_size: int, *, not_self: int | None = None) -> int:
    rank = check_int(value, name, minimum=0)
    if rank >= world_size:
        raise ValueError(f"{name} must be < world_size ({world_size}), got {rank}")
    if not_self is not None and rank == not_self:
        raise ValueError(f"{name} must be another rank than this one ({rank})")
    return rank


def check_tensor(value: object, name: str, rules: TensorRules) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_nested or value.layout != torch.strided:
        kind = "nested" if value.is_nested else str(value.layout)
        raise ValueError(f"{name} must be a dense (strided) tensor, got a {kind} tensor")
    device_type = rules.device_type
    if device_type == "cpu":
        on_device = value.is_cpu  # one call, no torch.device object
    else:
        on_device = device_type == "*" or value.device.type == device_type
    if not on_device:
        raise ValueError(f"{name} must be on {device_type}, got a tensor on {value.device}")
    if rules.dtypes is not None and value.dtype not in rules.dtypes:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in rules.dtypes))
        raise ValueError(
            f"{name} has dtype {value.dtype}, which this backend cannot send ({names})"
        )
    if not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if value.is_conj() or value.is_neg():
        raise ValueError(f"{name} is a lazy conjugate/negative view: call .resolve_conj() first")
    return value


def check_tensor_list(
    value: object, name: str, rules: TensorRules, *, length: int | None = None
) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of torch.Tensor, got {type(value).__name__}")
    tensors = [check_tensor(t, f"{name}[{i}]", rules) for i, t in enumerate(value)]
    if not tensors:
        raise ValueError(f"{name} must not be empty")
    if length is not None and len(tensors) != length:
        raise ValueError(f"{name} must hold {length} tensors, got {len(tensors)}")
    return tensors


def check_like(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    """``t`` must have ``ref``'s dtype and shape."""
    check_dtype(t, name, ref, ref_name)
    if t.shape != ref.shape:
        raise ValueError(
            f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(t.shape)}"
        )


def check_dtype(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")


def check_stacked(
    big: torch.Tensor, big_name: str, small: torch.Tensor, small_name: str, n: int
) -> None:
    """``big`` is ``n`` copies of ``small`` stacked along dim 0."""
    check_dtype(big, big_name, small, small_name)
    if small.dim() == 0:
        raise ValueError(f"{small_name} must have at least one dimension")
    want = (n * small.shape[0], *small.shape[1:])
    if tuple(big.shape) != want:
        raise ValueError(
            f"{big_name} must have shape {want} (world_size x {small_name}.shape[0] rows), "
            f"got {tuple(big.shape)}"
        )


@dataclass(frozen=True, slots=True)
class PremulSum:
    """``ReduceOp.PREMUL_SUM(factor)``: each rank's input times its own
    ``factor``, then summed (FSDP2's reduction when a gradient divide factor
    is set). Where the backend lacks it (Gloo), ftcomm multiplies this
    rank's input in place (an allreduce's tensor, a reduce-scatter's own
    copies of its inputs) and issues a SUM."""

    factor: float

    @property
    def value(self) -> int:
        """torch's number for the op (what :func:`reduce_code` reads)."""
        return int(ReduceOp.PREMUL_SUM.value)

    def __str__(self) -> str:
        return f"PREMUL_SUM({self.factor:g})"


ReduceOpArg: TypeAlias = "ReduceOp.RedOpType | PremulSum"
"""A checked reduce op: a member of torch's, or a PREMUL_SUM with its factor."""


def _premul_sum(value: object, name: str) -> PremulSum:
    """torch's ``ReduceOp.PREMUL_SUM(factor)`` (a float, or a one-element CPU
    tensor: one on a device would be read back with a sync at every op) as
    ftcomm's :class:`PremulSum`."""
    factor = getattr(value, "factor", None)
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1 or factor.device.type != "cpu":
            raise ValueError(f"{name}'s PREMUL_SUM factor must be a float, got a tensor {factor}")
        factor = factor.item()
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise ValueError(f"{name} PREMUL_SUM needs a factor: ReduceOp.PREMUL_SUM(factor)")
    if not math.isfinite(factor):
        raise ValueError(f"{name}'s PREMUL_SUM factor must be finite, got {factor}")
    return PremulSum(float(factor))


def check_reduce_op(
    value: object, supported: frozenset[ReduceOp.RedOpType], backend: str, name: str = "op"
) -> ReduceOpArg:
    """A ``ReduceOp`` member or its lower-case name (``"sum"``, ``"max"`` …),
    or ``ReduceOp.PREMUL_SUM(factor)``."""
    if value is ReduceOp:
        raise TypeError(f"{name} must be a ReduceOp member such as ReduceOp.SUM, got the class")
    if isinstance(value, ReduceOp) and getattr(value, "op", None) == ReduceOp.PREMUL_SUM:
        value = _premul_sum(value, name)
    if isinstance(value, PremulSum):
        if ReduceOp.PREMUL_SUM not in supported:
            raise ValueError(f"{name} {value} is not supported by the {backend} backend")
        return value
    if isinstance(value, str):
        op = _REDUCE_OPS_BY_NAME.get(value.lower())
        if op is None:
            names = ", ".join(_REDUCE_OPS_BY_NAME)
            raise ValueError(f"{name} must be one of {names}, got {value!r}")
    elif isinstance(value, ReduceOp.RedOpType):
        op = value
    elif isinstance(value, ReduceOp):  # ReduceOp(ReduceOp.MAX) compares equal to MAX
        wrapped: object = value
        found = next((m for m in _REDUCE_OPS_BY_NAME.values() if wrapped == m), None)
        if found is None:
            raise ValueError(f"{name} {value!r} is not supported (a custom op)")
        op = found
    else:
        raise TypeError(
            f"{name} must be a torch.distributed.ReduceOp or str, got {type(value).__name__}"
        )
    if op == ReduceOp.PREMUL_SUM:
        raise ValueError(f"{name} PREMUL_SUM needs a factor: ReduceOp.PREMUL_SUM(factor)")
    if op not in supported:
        raise ValueError(f"{name} {op} is not supported by the {backend} backend")
    return op


def check_reduce_dtype(
    op: ReduceOpArg, t: torch.Tensor, name: str, *, int_avg: bool = True
) -> None:
    """torch's own rules: bitwise ops need integers, complex only sums; and,
    where the backend's AVG is ftcomm's (``int_avg`` false: Gloo's, a SUM
    and a division), an average of integers, which it would truncate, is
    refused rather than rounded."""
    if isinstance(op, PremulSum):
        if not (t.is_floating_point() or t.is_complex()):
            raise ValueError(
                f"op {op} needs floating point or complex tensors, {name} is {t.dtype}"
            )
        return
    if op in _BITWISE and (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"op {op} needs integer or bool tensors, {name} is {t.dtype}")
    if op == ReduceOp.AVG and not int_avg and not (t.is_floating_point() or t.is_complex()):
        raise ValueError(
            f"op {op} needs floating point or complex tensors (an integer average is "
            f"not exact), {name} is {t.dtype}"
        )
    if t.is_complex() and op not in _COMPLEX_OK:
        raise ValueError(f"op {op} is not defined on complex tensors ({name} is {t.dtype})")


def scaled_in_place(op: ReduceOpArg, native: bool) -> bool:
    """Whether ``op`` is a SUM whose tensors ftcomm scales in place (AVG's
    outputs after it, PREMUL_SUM's inputs before it) on a backend where
    they are not native."""
    return not native and (op == ReduceOp.AVG or isinstance(op, PremulSum))


def check_apart(tensors: Sequence[torch.Tensor], name: str) -> None:
    """For an AVG or PREMUL_SUM of ftcomm's (a SUM, each tensor scaled in
    place after or before it): no two of ``tensors`` may share memory, or
    the shared part would be scaled twice. Conservative: views whose byte
    ranges in one storage meet are refused, even where they interleave
    without sharing."""
    spans = []
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        start = t.data_ptr()
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        spans.append((start, start + (last + 1) * t.element_size(), i))
    spans.sort()
    for (_, end, i), (start, _, j) in itertools.pairwise(spans):
        if start < end:
            first, second = sorted((i, j))
            raise ValueError(
                f"{name}[{first}] and {name}[{second}] share memory: an AVG or PREMUL_SUM (a "
                "SUM, each tensor scaled in place) would scale it twice; pass distinct tensors"
            )


def check_splits(
    value: object, name: str, world_size: int, dim0: int, tensor_name: str
) -> list[int]:
    """Split sizes for alltoall: ``None`` means equal splits of dim 0."""
    if value is None:
        if dim0 % world_size:
            raise ValueError(
                f"{tensor_name}.shape[0] ({dim0}) must divide by world_size ({world_size}) "
                f"when {name} is not given"
            )
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of int, got {type(value).__name__}")
    sizes = [check_int(v, f"{name}[{i}]", minimum=0) for i, v in enumerate(value)]
    if len(sizes) != world_size:
        raise ValueError(f"{name} must hold world_size ({world_size}) sizes, got {len(sizes)}")
    if sum(sizes) != dim0:
        raise ValueError(f"{name} must add up to {tensor_name}.shape[0] ({dim0}), got {sum(sizes)}")
    return sizes
