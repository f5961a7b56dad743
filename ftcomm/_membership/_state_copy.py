"""The state copy: the member with the highest step sends, the ones behind take it.

Owns: :func:`sync_state` (public as ``ftcomm.sync_state``, and the work of
``Membership.sync_state``), its plan (one allgather of every member's step,
then point-to-point sends from one source to the members behind) and the wire
form of a state (``torch.save`` bytes, read back with ``weights_only=True``
and ``map_location="cpu"``: tensors and plain containers only, no code runs
on load). The sender reads its own bytes back the same way before it sends:
a state the receivers would refuse is refused there, and they are told so
(a size of -1) rather than left with bytes they cannot load. On an
accelerator group the sizes and bytes go as tensors on its device.
Imports: ``ftcomm.group`` (the ops it runs on).
"""

from __future__ import annotations

import io
import time
from typing import Any, TypeVar

import torch

from .._runtime.deadline import Timeout, resolve
from ..group import Group

S = TypeVar("S")

TAG = 0x5EED
"""The p2p tag of the state copy (sizes then bytes), apart from a user's own tags."""


REFUSED = -1
"""The size a sender sends for a state it cannot send."""


def encode(state: object, step: int) -> torch.Tensor:
    """``(state, step)`` as a 1-D uint8 tensor (on the CPU).

    Raises:
        ValueError: ``state`` is not one a receiver can load (it holds
            something other than tensors and plain containers).
    """
    buffer = io.BytesIO()
    try:
        torch.save({"state": state, "step": step}, buffer)
    except Exception as exc:
        raise ValueError(f"the state cannot be saved: {exc}") from exc
    data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    try:
        _load(data)
    except Exception as exc:
        raise ValueError(
            "the state holds what a receiver would refuse to load (only tensors and "
            f"plain containers are sent, loaded with weights_only=True): {exc}"
        ) from exc
    return data


def _load(data: torch.Tensor) -> tuple[Any, int]:
    loaded = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True, map_location="cpu")
    return loaded["state"], int(loaded["step"])


def decode(data: torch.Tensor) -> tuple[Any, int]:
    """Raises: ValueError: the bytes are not a state this module sent."""
    try:
        return _load(data.cpu())
    except Exception as exc:
        raise ValueError(f"the state received is not one ftcomm sent: {exc}") from exc


def device_of(group: Group) -> torch.device:
    """Where ``group``'s tensors live: its accelerator's device, else the CPU."""
    config = group._config
    device = getattr(config.backend, "device", None) if config is not None else None
    return device if isinstance(device, torch.device) else torch.device("cpu")


def plan(steps: list[int]) -> tuple[int, list[int]]:
    """(the source rank, the ranks behind it): the lowest rank of those at
    the highest step sends to every rank at a lower one."""
    top = max(steps)
    return steps.index(top), [r for r, s in enumerate(steps) if s < top]


STEP_MAX = 2**63 - 1
"""The largest step: steps go over the group as int64."""


def check_step(step: object) -> int:
    """Raises: TypeError, ValueError: ``step`` is not an int in 0..STEP_MAX."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if not 0 <= step <= STEP_MAX:
        raise ValueError(f"step must be >= 0 and fit in an int64, got {step}")
    return step


async def sync_state(
    group: Group, state: S, step: int, *, timeout: Timeout | None = None
) -> tuple[S, int]:
    """Give the ranks of ``group`` that are behind the state of the rank furthest ahead.

    Every rank of the configured ``group`` calls it, like a collective, with
    its own ``state`` (a ``state_dict``, or any nesting of tensors and plain
    values) and ``step``. The lowest rank at the highest step sends to every
    rank at a lower step; each returns ``(state, step)``: its own where it
    was not behind, else what it got (new CPU tensors: load them, e.g.
    ``model.load_state_dict(state)``). The bytes are read back with
    ``weights_only=True``: no code runs on the receivers.

    :meth:`ftcomm.Membership.sync_state` is this call on the membership's
    group; call this one on a group the membership does not configure
    itself (another shard's group of the same world, say).

    Args:
        timeout: a deadline for the whole copy (default: ``group``'s).

    Raises:
        CommError: the group failed during the copy (``NotConfigured``: it
            is not configured).
        ValueError: ``step`` is negative or over ``2**63 - 1``; the state
            of the rank that sends holds what cannot be loaded with
            ``weights_only=True`` (raised there, and on the ranks behind,
            which keep theirs); or what came is not a state.
        TypeError: ``group`` is not an :class:`ftcomm.Group`; ``step`` is
            not an int.
    """
    if not isinstance(group, Group):
        raise TypeError(f"group must be an ftcomm.Group, got {type(group).__name__}")
    check_step(step)
    deadline = time.monotonic() + resolve(timeout, group.timeout)
    return await copy_state(group, state, step, deadline)


async def copy_state(group: Group, state: S, step: int, deadline: float) -> tuple[S, int]:
    """:func:`sync_state`'s work, bound by ``deadline`` (a ``time.monotonic()`` value)."""

    def left() -> float:
        return max(deadline - time.monotonic(), 0.0)

    me, device = group.rank, device_of(group)
    mine = torch.tensor([step], dtype=torch.int64, device=device)
    gathered = await group.allgather(mine, timeout=left())
    steps = [int(t.item()) for t in gathered]
    source, behind = plan(steps)
    if not behind:
        return state, step
    if me == source:
        refused: ValueError | None = None
        try:
            data = encode(state, step).to(device)
        except ValueError as exc:
            refused, data = exc, torch.empty(0, dtype=torch.uint8, device=device)
        size = torch.tensor(
            [REFUSED if refused is not None else data.numel()], dtype=torch.int64, device=device
        )
        for rank in behind:
            await group.send(size, rank, TAG, timeout=left())
            if refused is None:
                await group.send(data, rank, TAG, timeout=left())
        if refused is not None:
            raise refused
        return state, step
    if me not in behind:
        return state, step
    size = torch.empty(1, dtype=torch.int64, device=device)
    await group.recv(size, source, TAG, timeout=left())
    count = int(size.item())
    if count == REFUSED:
        raise ValueError(
            f"rank {source}, the one furthest ahead, could not send its state (it "
            "holds what cannot be loaded with weights_only=True): see its error"
        )
    data = torch.empty(count, dtype=torch.uint8, device=device)
    await group.recv(data, source, TAG, timeout=left())
    return decode(data)
