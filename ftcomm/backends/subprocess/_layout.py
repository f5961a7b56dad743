"""How a tensor descriptor names memory, for both ways a tensor travels.

CPU tensors go through shared memory (:mod:`._shm`) and CUDA tensors by IPC
handle (:mod:`._device`); both name dtypes the protocol's way and both check
that a descriptor stays inside the memory it names (docs/protocol.md).
"""

from __future__ import annotations

import torch

from ..._protocol import DTYPES, TensorDesc

_DTYPES: dict[torch.dtype, str] = {getattr(torch, name): name for name in DTYPES}
BY_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in _DTYPES.items()}
"""The torch dtype of each descriptor dtype name."""
CARRIED = frozenset(_DTYPES)
"""The dtypes a descriptor can name (the protocol's :data:`~ftcomm._protocol.DTYPES`)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The descriptor's name for ``dtype``.

    Raises:
        ValueError: a dtype the protocol cannot carry.
    """
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"the subprocess backend cannot carry {dtype} tensors") from None


def check_reach(desc: TensorDesc, itemsize: int, nbytes: int, what: str) -> None:
    """Refuse a descriptor of a non-empty tensor whose last element lies past
    the ``nbytes`` of memory it names (``what``, for the message).

    Raises:
        ValueError: it reaches past that memory.
    """
    span = 1 + sum((n - 1) * s for n, s in zip(desc.shape, desc.stride, strict=True))
    if min(desc.shape, default=1) and (desc.offset + span) * itemsize > nbytes:
        raise ValueError(f"descriptor reaches past {what} {desc.handle[:80]!r}")
