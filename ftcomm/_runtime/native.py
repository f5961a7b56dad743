"""Adapters from the ways a native op can finish to one small interface.

A :class:`NativeOp` is what a backend returns for an issued op. ftcomm's
:class:`~ftcomm.Work` polls it on the fast path and registers ``on_done`` only
when the op is slow, because a c10d future callback costs about 100 µs per op
on these machines while a poll costs next to nothing (docs/ops.md).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

Done = Callable[[BaseException | None], None]
"""Called once, on any thread, with the op's error or ``None``."""


class NativeOp(Protocol):
    """An issued native op: poll it, read its outcome, or be told when it ends.

    It may also have ``wait(seconds) -> bool``: block the calling thread up to
    ``seconds`` and say whether the op has ended. A thread without an event
    loop (``Work.wait``, the c10d facade) then sleeps there instead of on
    ``on_done``. And ``abandon()``: the op has ended with an error (a
    deadline, an abort); once it returns, nothing may write into the op's
    tensors any more (the subprocess backend stops copying results back).
    And ``peek()``: ``poll()`` without side effects (a subprocess call's
    ``poll`` reads its socket, which may end other ops and run their
    callbacks on the polling thread); a break of the group uses it, and
    ``poll`` where it is missing. An ``abandon()`` that returns True means
    "the native op was stopped and ends by itself shortly (Gloo: its group's
    sockets were shut down)": the op's error is then published only once
    ``on_done`` reports that end, since until then it may still write. And
    ``join_stream()``, after a success:
    make the calling thread's current accelerator stream wait for the op's
    device work (c10d's ``Work.wait()``, which for NCCL orders streams and
    for Gloo returns at once); the subprocess worker calls it on its stream
    before recording the event the caller's stream waits on. And
    ``member_failed()``: the op ended with an error (called once, under the
    group's lock, as its end is published, by ``OpRecord``); a fused op's
    ``MemberOp`` wakes the awaits asleep on its batch with it, so that each
    looks at its own op (``fuse.py``).
    """

    def poll(self) -> bool:
        """Whether the op has finished, successfully or not. Never blocks."""
        ...

    def outcome(self) -> BaseException | None:
        """The op's error, or ``None`` on success. Only after ``poll()`` is true."""
        ...

    def on_done(self, callback: Done) -> None:
        """Call ``callback(outcome)`` once when the op ends (at once if it has)."""
        ...


E = TypeVar("E", bound=BaseException)


def without_tracebacks(exc: E) -> E:
    """``exc``, with it and every exception chained to it (cause and context)
    stripped of their tracebacks. For an error kept after it was raised
    (``errored()`` keeps one until ``configure()``): the frames it passed
    through would keep their tensors, native ops and groups as long."""
    stack: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        error.__traceback__ = None
        stack += (error.__cause__, error.__context__)
    return exc


def _bare(exc: BaseException | None) -> BaseException | None:
    # Drop the tracebacks: their frames hold the native works (and through
    # them the group's sockets) for as long as anyone holds the error.
    return None if exc is None else without_tracebacks(exc)


def write_outputs(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each source into its output, as a native op writes: unrecorded by
    autograd, and into tensors made under ``torch.inference_mode()`` (an eval
    loop's metrics) as into any other. For the outputs ftcomm writes itself."""
    with torch.inference_mode():
        for out, src in pairs:
            out.copy_(src)


def _future_error(fut: torch.futures.Future[Any]) -> BaseException | None:
    try:
        fut.value()
    except Exception as exc:  # the native op's failure, passed on as a value
        return _bare(exc)
    return None


Sever = Callable[[], bool]
"""Stop a native group for real (see :meth:`WorkOp.abandon`); whether it did."""


class WorkOp:
    """One c10d ``Work`` with a future (Gloo collectives).

    ``sever``: how to stop the op's native group for real, if there is one.
    """

    __slots__ = ("_sever", "_work", "poll")

    def __init__(self, work: dist.Work, sever: Sever | None = None) -> None:
        self._work = work
        self._sever = sever
        # NativeOp.poll: c10d's own is_completed (a bool), bound once; a
        # spinning await calls it dozens of times per small op, and a Python
        # frame around each call delays the one that sees the end.
        self.poll: Callable[[], bool] = work.is_completed

    def abandon(self) -> bool:
        """Stop the native group (if it can be): the op then fails by itself
        within milliseconds; True if so (its end must be awaited)."""
        return self._sever is not None and self._sever()

    def outcome(self) -> BaseException | None:
        try:
            self._work.wait()  # returns at once: the work is complete
        except Exception as exc:
            return _bare(exc)
        return None

    def on_done(self, callback: Done) -> None:
        # The future completes (and runs callbacks) before is_completed() turns
        # true, so the callback reads the outcome from the future, not the work.
        self._work.get_future().add_done_callback(lambda fut: callback(_future_error(fut)))

    def wait(self, seconds: float) -> bool:
        # c10d's own wait: the thread sleeps in C++ (GIL released) and wakes
        # when Gloo's worker finishes the op -- raw c10d's latency, no polling.
        # Its timeout only ends the wait; the op goes on. 0 ms means "forever"
        # to c10d, hence the floor.
        try:
            self._work.wait(timedelta(seconds=max(seconds, 0.001)))
        except RuntimeError:  # this wait timed out, or the op failed
            return bool(self._work.is_completed())
        return True

    def join_stream(self) -> None:
        self._work.wait()


class WorksOp:
    """Several c10d works that make up one op (ops Gloo lacks, composed).

    The op ends when *every* member has ended: until then a member may still
    write into the op's tensors, so the op must not be reported ended (nor
    its error handed out) while one is in flight. Its outcome is the error of
    the first failed member in member order, whichever failed first in time,
    so that ``poll``/``outcome`` and ``on_done`` always agree. (Not
    ``torch.futures.collect_all``: it completes at the first failure, and
    reading a sibling's still pending future then trips torch's
    "completed() INTERNAL ASSERT".)
    """

    __slots__ = ("_sever", "_works")

    def __init__(self, works: Sequence[dist.Work], sever: Sever | None = None) -> None:
        self._works = list(works)
        self._sever = sever

    def abandon(self) -> bool:
        """As :meth:`WorkOp.abandon`."""
        return self._sever is not None and self._sever()

    def poll(self) -> bool:
        # A work's future completes before is_completed() turns true, so once
        # this is true, every member's future can be read.
        return all(work.is_completed() for work in self._works)

    def outcome(self) -> BaseException | None:
        return _first_error([work.get_future() for work in self._works])

    def on_done(self, callback: Done) -> None:
        futures = [work.get_future() for work in self._works]
        if not futures:
            callback(None)
            return
        # Once every member's future is complete, all may be read.
        member_done = countdown(len(futures), lambda: callback(_first_error(futures)))
        for fut in futures:
            fut.add_done_callback(member_done)

    def join_stream(self) -> None:
        for work in self._works:
            work.wait()


class ThenOp:
    """An op and a step after it (an AVG that Gloo lacks: a SUM, then a
    division), the pair reported as one op.

    ``after()`` runs once, on the thread the inner op's end reaches, only
    if it succeeded and was not abandoned; the pair ends once it has run,
    so nobody sees the op ended before its outputs are final. An ``after``
    that raises is the op's error. :meth:`abandon` waits for an ``after``
    in progress, and none starts once it returned: from then on nothing
    writes into the op's tensors but what the inner op's own ``abandon``
    says it may still write.
    """

    __slots__ = (
        "_abandoned",
        "_after",
        "_callbacks",
        "_done",
        "_ended",
        "_error",
        "_inner",
        "_lock",
    )

    def __init__(self, inner: NativeOp, after: Callable[[], object]) -> None:
        self._inner = inner
        self._after = after
        self._lock = threading.Lock()  # guards every field below, and after() runs under it
        self._abandoned = False
        self._done = False
        self._error: BaseException | None = None
        self._callbacks: list[Done] = []
        self._ended = threading.Event()
        inner.on_done(self._finish)

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if error is None and not self._abandoned:
                try:
                    self._after()
                except Exception as exc:
                    error = _bare(exc)
            self._error, self._done = error, True
            callbacks, self._callbacks = self._callbacks, []
        self._ended.set()
        for callback in callbacks:
            callback(error)

    def poll(self) -> bool:
        return self._done

    def outcome(self) -> BaseException | None:
        return self._error

    def on_done(self, callback: Done) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self._error)

    def wait(self, seconds: float) -> bool:
        return self._ended.wait(max(seconds, 0.0))

    def abandon(self) -> bool:
        with self._lock:
            self._abandoned = True
        stop = getattr(self._inner, "abandon", None)
        return bool(stop()) if stop is not None else False

    def join_stream(self) -> None:
        join = getattr(self._inner, "join_stream", None)
        if join is not None:
            join()


def divide(tensors: Iterable[torch.Tensor], n: int) -> Callable[[], None]:
    """A step for :class:`ThenOp`: divide each tensor by ``n`` in place
    (a SUM made an AVG), unrecorded by autograd, as a native op writes."""
    targets = list(tensors)

    def run() -> None:
        with torch.inference_mode():
            for t in targets:
                t.div_(n)

    return run


def countdown(n: int, then: Callable[[], object]) -> Callable[[object], None]:
    """A callback to call ``n`` times, from any threads at once: the last
    call runs ``then()``."""
    left = [n]
    lock = threading.Lock()

    def one(_: object) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    return one


def _first_error(futures: Sequence[torch.futures.Future[Any]]) -> BaseException | None:
    """The first error among completed futures, in their order, or ``None``."""
    for fut in futures:
        error = _future_error(fut)
        if error is not None:
            return error
    return None


class ThreadOp:
    """A blocking wait run on a worker thread (Gloo send/recv have no future)."""

    __slots__ = ("_future", "_sever")

    def __init__(self, future: concurrent.futures.Future[Any], sever: Sever | None = None) -> None:
        self._future = future
        self._sever = sever

    def abandon(self) -> bool:
        """As :meth:`WorkOp.abandon`: the blocked wait fails, and the thread ends."""
        return self._sever is not None and self._sever()

    def poll(self) -> bool:
        return self._future.done()

    def outcome(self) -> BaseException | None:
        return _bare(self._future.exception())

    def on_done(self, callback: Done) -> None:
        self._future.add_done_callback(lambda fut: callback(_bare(fut.exception())))

    def wait(self, seconds: float) -> bool:
        concurrent.futures.wait([self._future], timeout=seconds)
        return self._future.done()


class DoneOp:
    """An op that finished when it was issued (the dummy backend, empty ops)."""

    __slots__ = ("_error",)

    def __init__(self, error: BaseException | None = None) -> None:
        self._error = error

    def poll(self) -> bool:
        return True

    def outcome(self) -> BaseException | None:
        return self._error

    def on_done(self, callback: Done) -> None:
        callback(self._error)

    def wait(self, seconds: float) -> bool:
        return True
