"""The state copy: the member with the highest step sends, the ones behind take it.

Owns: :func:`sync_state`'s plan (one allgather of every member's step, then
point-to-point sends from one source to the members behind) and the wire
form of a state (``torch.save`` bytes, read back with ``weights_only=True``:
tensors and plain containers only, no code runs on load). Imports:
``ftcomm.group`` (the ops it runs on).
"""

from __future__ import annotations

import io
import time
from typing import Any, TypeVar

import torch

from ..group import Group

S = TypeVar("S")

TAG = 0x5EED
"""The p2p tag of the state copy (sizes then bytes), apart from a user's own tags."""


def encode(state: object, step: int) -> torch.Tensor:
    """``(state, step)`` as a 1-D uint8 tensor."""
    buffer = io.BytesIO()
    torch.save({"state": state, "step": step}, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def decode(data: torch.Tensor) -> tuple[Any, int]:
    """Raises: ValueError: the bytes are not a state this module sent."""
    try:
        loaded = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
        return loaded["state"], int(loaded["step"])
    except Exception as exc:
        raise ValueError(f"the state received is not one ftcomm sent: {exc}") from exc


def plan(steps: list[int]) -> tuple[int, list[int]]:
    """(the source rank, the ranks behind it): the lowest rank of those at
    the highest step sends to every rank at a lower one."""
    top = max(steps)
    return steps.index(top), [r for r, s in enumerate(steps) if s < top]


async def sync_state(group: Group, state: S, step: int, deadline: float) -> tuple[S, int]:
    """See :meth:`ftcomm.Membership.sync_state` (this is its work, on ``group``)."""

    def left() -> float:
        return max(deadline - time.monotonic(), 0.0)

    me = group.rank
    mine = torch.tensor([step], dtype=torch.int64)
    gathered = await group.allgather(mine, timeout=left())
    steps = [int(t.item()) for t in gathered]
    source, behind = plan(steps)
    if not behind:
        return state, step
    if me == source:
        data = encode(state, step)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for rank in behind:
            await group.send(size, rank, TAG, timeout=left())
            await group.send(data, rank, TAG, timeout=left())
        return state, step
    if me not in behind:
        return state, step
    size = torch.empty(1, dtype=torch.int64)
    await group.recv(size, source, TAG, timeout=left())
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    await group.recv(data, source, TAG, timeout=left())
    received, at = decode(data)
    return received, at
