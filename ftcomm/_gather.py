"""``ftcomm.gather``: await many issued ops in one await, without a task each.

See docs/fusion.md ("Awaiting many ops").
"""

from __future__ import annotations

import asyncio
import collections.abc
from collections.abc import Generator, Sequence
from typing import Any

from ._runtime.driven import Drivers, TaskDriven
from ._runtime.work import Work, abort_unended, look_at
from .errors import CommError

_CANCELLED = "was cancelled in ftcomm.gather()"


def gather(*works: Work[Any], return_exceptions: bool = False) -> Gathering:
    """Await ops already issued, in the order given; their results in that order.

    Unlike ``asyncio.gather``, it registers no callback per op: it awaits
    them in the calling task. The call itself looks at every op, in argument
    order, so each open batch is sent before the first await; it returns or
    raises only once every op has ended (docs/fusion.md).

    Args:
        works: the :class:`Work` of each op (of one group or several).
        return_exceptions: return each failed op's error in its place instead
            of raising the first one.

    Returns:
        An awaitable of the list of results (``await`` it, or hand it to
        ``asyncio.create_task`` or anyio's ``start_soon``).

    Raises:
        TypeError: an argument is not a :class:`Work` (run coroutines with
            ``asyncio.gather``: here they would run one after another);
            raised by the call, before any op is looked at.

    Awaiting raises:
        CommError: the error of the first op (in argument order) that failed
            (``CommTimeout``, ``CommFailed``, ``CommAborted``, ``WorkerDied``,
            ``ProtocolError``), once every op has ended; not with
            ``return_exceptions=True``.
        asyncio.CancelledError: the awaiting task was cancelled (even before
            it first ran): every op not ended is aborted, each with its
            group, as cancelling ``asyncio.gather`` cancels its tasks.
        RuntimeError: awaited without a running asyncio loop (the ops go
            on, bound by their deadlines). Any other error (an interrupt)
            propagates at once, leaving the ops not awaited to their
            deadlines.
    """
    for i, work in enumerate(works):
        if not isinstance(work, Work):
            raise TypeError(
                f"ftcomm.gather() takes the Work of issued ops; argument {i} is a "
                f"{type(work).__name__} (use asyncio.gather for coroutines)"
            )
    look_at(works)  # looks, in argument order: every open batch goes now
    return Gathering(works, return_exceptions)


class Gathering(TaskDriven, collections.abc.Coroutine[Any, Any, list[Any]]):
    """What :func:`gather` returns: awaitable, and a coroutine for the task
    APIs (``create_task``, anyio's ``start_soon``), driven by any number of
    tasks, as a :class:`Work` is."""

    __slots__ = ("__weakref__", "_drivers", "_return_exceptions", "_works")

    def __init__(self, works: Sequence[Work[Any]], return_exceptions: bool) -> None:
        self._works = tuple(works)
        self._return_exceptions = return_exceptions
        self._drivers: Drivers | None = None

    def __repr__(self) -> str:
        return f"<ftcomm.gather of {len(self._works)} ops>"

    def __await__(self) -> Generator[Any, None, list[Any]]:
        works = self._works
        results: list[Any] = [None] * len(works)
        first: CommError | None = None
        at = 0
        try:
            for at, work in enumerate(works):
                try:
                    results[at] = yield from work.__await__()
                except CommError as exc:
                    results[at] = exc
                    if first is None:
                        first = exc
        except asyncio.CancelledError:
            abort_unended(works[at + 1 :], _CANCELLED)  # works[at]: its own await aborted it
            raise
        if first is not None and not self._return_exceptions:
            # The error is the op's own, kept by its group's errored() until
            # configure(), and keeps this frame (its traceback): the frame
            # lets go of the ops and their results before it raises.
            del self, works, results, work
            raise first.with_traceback(None)
        return results

    def _cancel_before_start(self) -> None:
        abort_unended(self._works, _CANCELLED)
