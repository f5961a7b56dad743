"""Op records and the awaitable :class:`Work`.

Rules this module keeps:

1. Every op ends exactly once: success, or one ftcomm error. The first of the
   native completion, the deadline sweeper, a cancellation or an abort to
   settle it wins (under the table's lock); the others find it settled.
2. An op that has not completed by its deadline ends with ``CommTimeout``,
   breaks its :class:`OpTable`, and every other op in flight ends with
   ``CommAborted``. A broken table refuses new ops at once.
3. The deadline is enforced twice: the native op gets the remaining time as
   its own timeout, and the owner loop keeps **one** timer per table, armed at
   the earliest deadline in flight, or, with nothing in flight, one op-timeout
   ahead as a sentinel. A caller wakes the owner loop only when its op's
   deadline comes before the armed time (and at most one wake-up is queued),
   so a steady stream of ops costs the owner loop one wake-up per timeout and
   the timer count stays at one per group however many ops run. A sentinel
   that finds its table idle for a whole timeout lets go, so the owner loop
   never keeps a dropped group alive.
4. Awaiting polls the native op for a short spin (raw speed for small ops),
   yielding the core between polls, then sleeps until the native completion
   or the sweeper wakes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any, Generic, TypeVar

from ..errors import CommAborted, CommError, CommFailed, CommTimeout
from .deadline import to_seconds
from .loop import Runtime
from .native import NativeOp

R = TypeVar("R")

_PENDING, _OK, _FAILED = 0, 1, 2

SPIN_SECONDS = float(os.environ.get("FTCOMM_SPIN_US", "2000")) / 1e6
"""How long ``await work`` polls before it sleeps on the completion callback."""

WAIT_SLICE = 0.01
"""How long a blocked thread sleeps in a native wait before it rechecks the op."""

_EARLY = 0.005
"""A native error this close to the deadline counts as the deadline passing."""

_sched_yield = getattr(os, "sched_yield", lambda: None)


class OpTable:
    """The ops in flight on one group configuration: their deadlines and their end."""

    def __init__(
        self, runtime: Runtime, rank: int, on_break: Callable[[CommError, float], None]
    ) -> None:
        self.runtime = runtime
        self.rank = rank
        self.error: CommError | None = None
        self._on_break = on_break
        self._lock = threading.Lock()
        self._inflight: dict[int, Work[Any]] = {}
        self._seq = 0
        self._armed_at: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._horizon = 0.0  # the latest op's timeout
        self._issued = 0  # ops tracked so far: an idle sentinel disarms if unchanged
        self._issued_at_arm = -1
        self._wake_pending = False

    def __len__(self) -> int:
        return len(self._inflight)

    def active(self) -> int:
        """Ops not ended yet (ends the completed ones nobody has awaited)."""
        return sum(1 for work in list(self._inflight.values()) if not work.done())

    @property
    def timer_armed(self) -> bool:
        """Whether the owner loop holds a deadline timer for this table."""
        return self._timer is not None

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def track(self, work: Work[Any], timeout: float) -> None:
        """Register an issued op (caller's thread).

        The table may have broken while the op was being issued (a deadline,
        a callback or ``abort()`` on another thread): the op then ends at once
        with ``CommAborted``, as it would have had it been in flight.
        """
        with self._lock:
            if work._state != _PENDING:  # ended before it was tracked: nothing to watch
                return
            error = self.error
            if error is None:
                self._inflight[work.seq] = work
                self._issued += 1
        if error is not None:
            work._end_after_break(error)
            return
        self._horizon = timeout
        armed = self._armed_at  # read after the insert: see _rearm
        if (armed is None or work.deadline < armed) and not self._wake_pending:
            # One wake-up in the owner's queue at a time: callers issuing
            # faster than the owner runs must not pile up handles.
            self._wake_pending = True
            self.runtime.call_soon(self._on_wake)

    def break_(self, error: CommError) -> None:
        """Mark the table errored (first error wins) and end every op in flight."""
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            pending = list(self._inflight.values())
        self._after_break(error, pending, time.monotonic())

    def _after_break(self, error: CommError, pending: list[Work[Any]], until: float) -> None:
        """``until``: the latest deadline of a native op the group may still hold."""
        for work in pending:
            work._end_after_break(error)
        self.runtime.call_soon(self._disarm)
        self._on_break(error, max([until, *(w.deadline for w in pending)]))

    # -- owner loop only ---------------------------------------------------
    def _rearm(self) -> None:
        while self.error is None:
            now = time.monotonic()
            earliest: float | None = None
            for work in list(self._inflight.values()):
                if work.deadline <= now:
                    work._expire()
                elif earliest is None or work.deadline < earliest:
                    earliest = work.deadline
            if earliest is None:
                if self._timer is None and self._issued == self._issued_at_arm:
                    # The sentinel fired on a table idle for a whole timeout:
                    # let go (the next op wakes us), so that a group dropped
                    # without shutdown() is not kept alive by our timer.
                    self._armed_at = None
                    if not self._inflight:
                        return
                    continue  # an op slipped in as we let go: watch it
                # Nothing in flight: keep a sentinel timer one op-timeout
                # ahead. An op issued from now on with that timeout ends after
                # it, so its caller need not wake us; the sentinel finds it.
                earliest = now + max(self._horizon, 0.001)
                self._issued_at_arm = self._issued
            if self._timer is None or self._armed_at != earliest:
                if self._timer is not None:
                    self._timer.cancel()
                self._armed_at = earliest
                self._timer = self.runtime.loop.call_later(earliest - now, self._on_timer)
            # A caller inserts its op, then reads _armed_at; we write
            # _armed_at, then read the ops: one of us sees the other. An op
            # that slipped in under the new time is caught here.
            if all(w.deadline >= earliest for w in list(self._inflight.values())):
                return
        self._disarm()

    def _on_wake(self) -> None:
        # Cleared before the scan: a caller that still saw it set had inserted
        # its op before, so the scan finds the op; a later one wakes us again.
        self._wake_pending = False
        self._rearm()

    def _on_timer(self) -> None:
        # The handle has fired: forget it, or _rearm would take it for armed.
        # (uvloop may fire a timer up to 1 ms early; _rearm then arms again.)
        self._timer = None
        self._rearm()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed_at = None


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Work(Generic[R]):
    """The awaitable handle of one issued collective.

    The op is already on the wire when you get this. ``await work`` returns its
    result (the output tensor or tensors, ``None`` for barrier and send);
    :meth:`wait` does the same for a thread without an event loop.

    Attributes:
        op: the collective's name.
        seq: its sequence number within the group configuration (from 1).
        deadline: ``time.monotonic()`` value by which it must end.

    Awaiting raises:
        CommTimeout: the op did not complete by its deadline.
        CommFailed: the native op failed (peer died, connection closed).
        CommAborted: the group was aborted, reconfigured or shut down, or broke
            through another op, while this one was in flight.
        asyncio.CancelledError: the awaiting task was cancelled; the group is
            aborted (unless the op had already completed) and the error is
            re-raised as it is.

    On the in-process Gloo backend an aborted op cannot be stopped: it may
    still write into its tensors until its own timeout. Do not reuse the
    tensors of an op that did not succeed.
    """

    __slots__ = (
        "_cb_armed",
        "_error",
        "_native",
        "_result",
        "_state",
        "_table",
        "_waiters",
        "deadline",
        "op",
        "seq",
    )

    def __init__(
        self, table: OpTable, op: str, seq: int, deadline: float, native: NativeOp, result: R
    ) -> None:
        self._table = table
        self.op = op
        self.seq = seq
        self.deadline = deadline
        self._native: NativeOp | None = native
        self._result = result
        self._state = _PENDING
        self._error: BaseException | None = None
        self._waiters: list[Callable[[], object]] | None = None  # wake-ups, any thread
        self._cb_armed = False

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<ftcomm.Work {self.op} seq={self.seq} {state}>"

    # -- public ------------------------------------------------------------
    def done(self) -> bool:
        """Whether the op has ended (it may have failed)."""
        native = self._native  # read once: another thread may settle and clear it
        if self._state == _PENDING and native is not None and native.poll():
            self._complete(native.outcome())
        return self._state != _PENDING

    def cancel(self) -> bool:
        """Abort the op and its group. Returns False if it had already ended.

        Awaiters of this work then get ``CommAborted``; the group is errored
        until ``configure()``.
        """
        if self.done():
            return False
        return self._abort(
            CommAborted(f"{self.op} was cancelled with Work.cancel()", **self._ctx())
        )

    def exception(self) -> BaseException | None:
        """The op's error, or ``None`` if it succeeded.

        Raises:
            asyncio.InvalidStateError: the op has not ended yet.
        """
        if not self.done():
            raise asyncio.InvalidStateError(f"{self!r} has not ended")
        return self._error

    def __await__(self) -> Generator[Any, None, R]:
        # A plain generator, not a coroutine chain: the spin below resumes
        # once per loop iteration, and every layer it passes costs time
        # measured in the small-op bench.
        if self._state == _PENDING:
            try:
                yield from self._until_ended()
            except asyncio.CancelledError:
                if not self.done():
                    self._abort(
                        CommAborted(f"{self.op} was cancelled while in flight", **self._ctx())
                    )
                raise
        if self._error is not None:
            raise self._error
        return self._result

    # -- awaiting ----------------------------------------------------------
    def _until_ended(self) -> Generator[Any, None, None]:
        native = self._native
        if native is None:
            return
        spin_until = time.perf_counter() + getattr(native, "spin", SPIN_SECONDS)
        while self._state == _PENDING:
            if native.poll():
                self._complete(native.outcome())
                return
            if time.perf_counter() >= spin_until:
                yield from self._sleep_until_ended(native).__await__()
                return
            # Give this core to a runnable thread first (the backend's own
            # worker, usually): on 2 cores a spin that only yields to the event
            # loop starves it and turns p90 from 0.2 ms into 4 ms.
            _sched_yield()
            yield  # what asyncio.sleep(0) does: run the loop once, then resume

    async def _sleep_until_ended(self, native: NativeOp) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if self._add_waiter(native, lambda: loop.call_soon_threadsafe(_wake, fut)):
            await fut

    def _add_waiter(self, native: NativeOp, wake: Callable[[], object]) -> bool:
        """Have ``wake()`` called when the op ends; False if it already has."""
        with self._table._lock:
            if self._state != _PENDING:
                return False
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(wake)
            arm = not self._cb_armed
            self._cb_armed = True
        if arm:
            native.on_done(self._complete)
        return True

    def wait(self, timeout: float | timedelta | None = None) -> R:
        """Block this thread until the op ends; return its result or raise its error.

        For code without an event loop (threads, the c10d facade). The op's
        own deadline still applies; ``timeout`` only bounds this wait.

        Raises:
            RuntimeError: called on a thread whose event loop is running
                (it would block that loop: ``await`` the work instead).
            TimeoutError: ``timeout`` seconds passed first; the op goes on.
            TypeError, ValueError: a bad ``timeout`` (NaN, negative, ...).
            CommTimeout, CommFailed, CommAborted: as ``await work``.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("Work.wait() would block the running event loop: await it")
        if timeout is not None:
            timeout = to_seconds(timeout, "timeout")
        if not self._block(timeout):
            raise TimeoutError(f"{self!r} did not end within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def _block(self, timeout: float | None) -> bool:
        """Block this thread until the op ends or ``timeout`` passes; whether it ended.

        Polls for a short spin first, yielding the core between polls (on 2
        cores, a thread that sleeps and is woken costs more than the backend
        thread needs to finish a small op). Then a native op that can block a
        thread (c10d's own ``wait``) is waited on in slices of at most
        ``WAIT_SLICE`` seconds, so an abort or a deadline settled elsewhere is
        seen within a slice; others sleep on their completion callback.
        """
        native = self._native
        if self._state != _PENDING or native is None:
            return True
        now = time.perf_counter()
        spin = getattr(native, "spin", SPIN_SECONDS)
        spin_until = now + (spin if timeout is None else min(spin, timeout))
        end = None if timeout is None else now + timeout
        while self._state == _PENDING:
            if native.poll():
                self._complete(native.outcome())
                return True
            if time.perf_counter() >= spin_until:
                break
            _sched_yield()
        wait = getattr(native, "wait", None)
        if wait is None:
            ended = threading.Event()
            left = None if end is None else max(0.0, end - time.perf_counter())
            return not self._add_waiter(native, ended.set) or ended.wait(left)
        while self._state == _PENDING:
            budget = WAIT_SLICE if end is None else min(WAIT_SLICE, end - time.perf_counter())
            if budget <= 0:
                return False
            if wait(budget):
                self._complete(native.outcome())  # a no-op if it was settled meanwhile
                return True
        return True

    def _when_done(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` once the op has ended: at once if it has, else
        on the thread that ends it."""
        native = self._native
        if self._state != _PENDING or native is None or not self._add_waiter(native, callback):
            callback()

    def _time_out(self, message: str) -> None:
        """End the op now with ``CommTimeout`` (breaking its group), unless it has ended."""
        if not self.done():
            self._abort(CommTimeout(message, **self._ctx()))

    # -- settling (any thread) ---------------------------------------------
    def _ctx(self) -> dict[str, Any]:
        return {"rank": self._table.rank, "op": self.op, "seq": self.seq}

    def _settle(self, error: BaseException | None, *, breaks: bool = False) -> bool:
        """End this op once; with ``breaks``, also break the table *before*
        any awaiter wakes, so an awaiter always sees ``errored()`` set."""
        table = self._table
        with table._lock:
            if self._state != _PENDING:
                return False
            table._inflight.pop(self.seq, None)
            waiters, self._waiters = self._waiters, None
            native, self._native = self._native, None
            broke: CommError | None = None
            if breaks and table.error is None and isinstance(error, CommError):
                table.error = broke = error
                pending = list(table._inflight.values())
            # _state last: a spinning awaiter reads it without the lock, and
            # once it sees the op ended, the error and errored() must be there.
            self._error = error
            self._state = _OK if error is None else _FAILED
        if broke is not None:
            table._after_break(broke, pending, self.deadline)
        if error is not None and native is not None:
            abandon = getattr(native, "abandon", None)
            if abandon is not None:  # results must not arrive once the error is out
                abandon()
            if not native.poll():
                # it may block whoever drops it last, until its native deadline
                table.runtime.dispose(native, until=self.deadline)
        # Waiters may run user code that keeps an error whose traceback reaches
        # this frame: it must not hold the native op (and its group) then.
        del native
        for wake in waiters or ():
            # A closed loop raises RuntimeError: nobody is waiting there any more.
            with contextlib.suppress(RuntimeError):
                wake()
        return True

    def _complete(self, native_error: BaseException | None) -> None:
        """The native op ended: settle with its outcome, mapped to ftcomm errors."""
        if native_error is None:
            self._settle(None)
            return
        error: CommError
        if isinstance(native_error, CommError):
            # Raised below the op (a subprocess worker died, a frame was
            # malformed): it says what happened better than a wrapper would.
            error = native_error._located(self._table.rank, self.op, self.seq)
        elif time.monotonic() >= self.deadline - _EARLY:
            error = CommTimeout(f"{self.op} did not complete by its deadline", **self._ctx())
            error.__cause__ = native_error
        else:
            error = CommFailed(f"{self.op} failed: {native_error}", **self._ctx())
            error.__cause__ = native_error
        self._settle(error, breaks=True)

    def _abort(self, error: CommError) -> bool:
        return self._settle(error, breaks=True)

    def _expire(self) -> None:
        """The deadline passed (owner loop)."""
        native = self._native
        if native is not None and native.poll():
            self._complete(native.outcome())
        else:
            self._abort(CommTimeout(f"{self.op} did not complete by its deadline", **self._ctx()))

    def _end_after_break(self, cause: CommError) -> None:
        native = self._native
        if native is not None and native.poll():
            self._complete(native.outcome())
            return
        error = CommAborted(
            f"{self.op} was aborted: the group broke ({cause.message})", **self._ctx()
        )
        error.__cause__ = cause
        self._settle(error)
