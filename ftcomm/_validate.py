"""Argument checks shared by every public entry point.

Each check raises ``TypeError`` for a wrong type and ``ValueError`` for a wrong
value, names the argument, and touches nothing: a rejected call leaves the
group and the caller's tensors as they were.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ReduceOp

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


def check_int(value: object, name: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_rank(value: object, name: str, world_size: int, *, not_self: int | None = None) -> int:
    rank = check_int(value, name, minimum=0)
    if rank >= world_size:
        raise ValueError(f"{name} must be < world_size ({world_size}), got {rank}")
    if not_self is not None and rank == not_self:
        raise ValueError(f"{name} must be another rank than this one ({rank})")
    return rank


def check_tensor(value: object, name: str, device_type: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {value.layout}")
    if device_type != "*" and value.device.type != device_type:
        raise ValueError(f"{name} must be on {device_type}, got a tensor on {value.device}")
    if not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return value


def check_tensor_list(
    value: object, name: str, device_type: str, *, length: int | None = None
) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of torch.Tensor, got {type(value).__name__}")
    tensors = [check_tensor(t, f"{name}[{i}]", device_type) for i, t in enumerate(value)]
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


def check_numel(t: torch.Tensor, name: str, expected: int, why: str) -> None:
    if t.numel() != expected:
        raise ValueError(f"{name} must have {expected} elements ({why}), got {t.numel()}")


def check_reduce_op(
    value: object, supported: frozenset[ReduceOp.RedOpType], backend: str, name: str = "op"
) -> ReduceOp.RedOpType:
    """A ``ReduceOp`` member or its lower-case name (``"sum"``, ``"max"`` …)."""
    if isinstance(value, str):
        op = _REDUCE_OPS_BY_NAME.get(value.lower())
        if op is None:
            names = ", ".join(_REDUCE_OPS_BY_NAME)
            raise ValueError(f"{name} must be one of {names}, got {value!r}")
    elif isinstance(value, ReduceOp.RedOpType):
        op = value
    elif isinstance(value, ReduceOp):
        raise TypeError(f"{name} must be a ReduceOp member such as ReduceOp.SUM, got ReduceOp()")
    else:
        raise TypeError(
            f"{name} must be a torch.distributed.ReduceOp or str, got {type(value).__name__}"
        )
    if op not in supported:
        raise ValueError(f"{name} {op} is not supported by the {backend} backend")
    return op


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
