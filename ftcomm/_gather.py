"""``ftcomm.gather``: await many issued ops in one await, without a task each."""

from __future__ import annotations

import asyncio
from typing import Any

from ._runtime.work import Work
from .errors import CommError


async def gather(*works: Work[Any], return_exceptions: bool = False) -> list[Any]:
    """Await ops already issued, in the order given; their results in that order.

    ``asyncio.gather`` wraps each awaitable in a task: for 1000 one-float
    allreduces fused into one native op (``Group(fuse=True)``) that is most
    of the time they take (docs/design.md, "Fusing small collectives").
    Each op is on the wire (or in its batch) once issued, so awaiting them
    one after another waits no longer than awaiting them all at once; this
    does that in the calling task. The first await is a look at the first
    op: it sends the batch that op waits in (a cut point, the same on every
    rank).

    Unlike ``asyncio.gather``, it returns or raises only once every op has
    ended: an op's failure breaks its group, and the group's other ops end
    with ``CommAborted`` at once, so nothing is left running unseen.

    Args:
        works: the :class:`Work` of each op (of one group or several).
        return_exceptions: return each failed op's error in its place
            instead of raising the first one.

    Raises:
        TypeError: an argument is not a :class:`Work` (run coroutines with
            ``asyncio.gather``: here they would run one after another).
        CommTimeout, CommFailed, CommAborted: the error of the first op (in
            argument order) that failed, once every op has ended; not with
            ``return_exceptions=True``.
        asyncio.CancelledError: the awaiting task was cancelled: every op
            not ended is cancelled, each aborting its group, as cancelling
            ``asyncio.gather`` cancels its tasks.
        RuntimeError: awaited without a running asyncio loop.
    """
    for i, work in enumerate(works):
        if not isinstance(work, Work):
            raise TypeError(
                f"ftcomm.gather() takes the Work of issued ops; argument {i} is a "
                f"{type(work).__name__} (use asyncio.gather for coroutines)"
            )
    results: list[Any] = [None] * len(works)
    first: CommError | None = None
    at = 0
    try:
        for at, work in enumerate(works):
            try:
                results[at] = await work
            except CommError as exc:
                results[at] = exc
                if first is None:
                    first = exc
    except asyncio.CancelledError:
        for work in works[at + 1 :]:
            work.cancel()  # ends at once if it has ended: returns False
        raise
    if first is not None and not return_exceptions:
        raise first
    return results
