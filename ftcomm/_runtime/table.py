"""The ops in flight on one group configuration: :class:`OpTable`.

Owns: every op's record until the op ends, one deadline timer on the owner
loop (rule 3 below), and the table's break: the first error marks it (the
group's ERRORED state, under the group's lock), then every op in flight ends,
and the native group is handed over, once. How each op ends is
``settle.py``'s; what a caller holds is ``work.py``'s. Also the two shapes
of a done-callback (:class:`LoopCall`, :class:`ThreadCall`) and
:func:`wake_all`, which runs the wake-ups an end collects.

Rule this module keeps (rules 1-2 are ``settle.py``'s):

3. The deadline is enforced twice: the native op gets the remaining time as
   its own timeout, and the owner loop keeps **one** timer per table, armed at
   the earliest deadline in flight, or, with nothing in flight, one op-timeout
   ahead as a sentinel. A caller wakes the owner loop only when its op's
   deadline comes before the armed time (and at most one wake-up is queued),
   so a steady stream of ops costs the owner loop one wake-up per timeout and
   the timer count stays at one per group however many ops run. A sentinel
   that finds its table idle for a whole timeout lets go, so the owner loop
   never keeps a dropped group alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import CommAborted, CommError, ProtocolError, WorkerDied
from .loop import Runtime
from .native import NativeOp

if TYPE_CHECKING:
    from .observe import Observer
    from .settle import OpRecord

log = logging.getLogger("ftcomm")


class Broken:
    """A table's break, decided under its lock: the error that broke it (the
    first one), whether this call broke it, and the ops that were in flight."""

    __slots__ = ("cause", "first", "pending", "why")

    def __init__(
        self, cause: CommError, first: bool, pending: list[OpRecord[Any]], why: str = "break"
    ) -> None:
        self.cause = cause
        self.first = first
        self.pending = pending
        self.why = why
        """The group's state event that broke it: ``"break"`` (an op, a dead
        worker), ``"abort"``, ``"begin"`` (a reconfigure), ``"shutdown"``."""


def wake_all(wakeups: list[Callable[[], object]]) -> None:
    """Run every wake-up, whatever one of them raises: a user's done-callback
    that fails must not leave the waiters after it asleep, nor escape into
    whoever ended the op (an ``abort()``, the owner loop, a Gloo thread).
    Its error is logged; a ``KeyboardInterrupt`` or ``SystemExit`` is raised
    again once every wake-up has run.

    Done-callbacks registered on an event loop (:class:`LoopCall`) are not
    run here: each loop's are handed to it with one thread-safe call, so a
    fused batch of 1000 ops awaited with ``asyncio.gather`` wakes its loop
    once, not 1000 times."""
    interrupted: BaseException | None = None
    by_loop: dict[asyncio.AbstractEventLoop, list[LoopCall]] | None = None
    for wake in wakeups:
        if type(wake) is LoopCall:
            if by_loop is None:
                by_loop = {}
            by_loop.setdefault(wake.loop, []).append(wake)
            continue
        try:
            wake()
        except Exception:
            log.exception("ftcomm: a done-callback raised")
        except BaseException as exc:
            interrupted = interrupted or exc
    if by_loop is not None:
        for loop, calls in by_loop.items():
            try:
                _post(loop, calls)
            except BaseException as exc:  # an interrupt in a closed loop's callback run here
                interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


class LoopCall:
    """A done-callback that runs on an event loop, as ``asyncio.Future``'s do:
    ``fn(work)`` in ``context``, from a callback of ``loop`` (never from
    inside whatever ends the op, even on the loop's own thread), or, if
    ``loop`` is closed by then, on the thread that ends the op. Called
    alone, it posts itself; :func:`wake_all` posts all of one loop's calls
    at once."""

    __slots__ = ("context", "fn", "loop", "work")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fn: Callable[[Any], object],
        work: object,
        context: contextvars.Context,
    ) -> None:
        self.loop = loop
        self.fn = fn
        self.work = work
        self.context = context

    def __call__(self) -> None:
        _post(self.loop, [self])


class ThreadCall:
    """A done-callback registered where no event loop runs: ``fn(work)`` on
    the thread that ends the op (in ``context`` if one was given; in a copy
    of it if it is in use, by a callback running on another thread or one
    that ended this op)."""

    __slots__ = ("context", "fn", "work")

    def __init__(
        self, fn: Callable[[Any], object], work: object, context: contextvars.Context | None
    ) -> None:
        self.fn = fn
        self.work = work
        self.context = context

    def __call__(self) -> None:
        context = self.context
        if context is None:
            self.fn(self.work)
            return
        # Two such callbacks may share a context and run nested (one ends
        # another op) or at once (ops ending on two threads); a context is
        # entered once at a time, so the second runs in a copy of it rather
        # than not at all. Told apart from an error of ``fn`` by whether it ran.
        ran = False

        def call() -> None:
            nonlocal ran
            ran = True
            self.fn(self.work)

        try:
            context.run(call)
        except RuntimeError:
            if ran:
                raise
            context.copy().run(self.fn, self.work)


def _post(loop: asyncio.AbstractEventLoop, calls: list[LoopCall]) -> None:
    """Have ``loop`` run ``calls`` from one of its callbacks (thread-safe);
    if it is closed, run them here (their exceptions logged), as callbacks
    registered where no loop runs are."""
    try:
        if asyncio._get_running_loop() is loop:
            loop.call_soon(_run_calls, loop, calls)
        else:
            loop.call_soon_threadsafe(_run_calls, loop, calls)
    except RuntimeError:  # closed
        wake_all([ThreadCall(call.fn, call.work, call.context) for call in calls])


def _run_calls(loop: asyncio.AbstractEventLoop, calls: list[LoopCall]) -> None:
    """On ``loop``: run each call as a handle of its own would (an error goes
    to the loop's exception handler; an interrupt is raised, and the calls
    after it run in the next iteration)."""
    for i, call in enumerate(calls):
        try:
            call.context.run(call.fn, call.work)
        except (SystemExit, KeyboardInterrupt):
            if i + 1 < len(calls):
                loop.call_soon(_run_calls, loop, calls[i + 1 :])
            raise
        except BaseException as exc:
            loop.call_exception_handler(
                {
                    "message": f"Exception in callback {call.fn!r}",
                    "exception": exc,
                    "future": call.work,
                }
            )


def _independent(error: CommError) -> bool:
    """A failure no op's stop can cause: a subprocess worker's death or a
    malformed frame (stopping an op does not kill its worker)."""
    return isinstance(error, (WorkerDied, ProtocolError))


def _group_aborted(error: CommError) -> CommError:
    """What ``errored()`` reports for a group ``error`` broke: the same class
    and attributes, a message that says the group is aborted (it is: every
    other op ended, the native group was let go), and ``error``, the one its
    op raised, as ``__cause__``. An abort that says so (``abort()``'s own)
    is itself."""
    if isinstance(error, CommAborted) and "aborted" in error.message:
        return error
    message = f"the group is aborted (configure() it again to go on) after: {error.message}"
    aborted = error.at(error.rank, error.op, error.seq, message=message)
    aborted.__cause__ = error
    return aborted


def peek(native: NativeOp) -> bool:
    """Whether ``native`` has ended, without side effects (see NativeOp)."""
    peek = getattr(native, "peek", None)
    return bool(peek()) if peek is not None else native.poll()


class OpTable:
    """The ops in flight on one group configuration: their deadlines and their end.

    The op core's shared-lock contract: ``lock`` guards the table and every
    record in it (``inflight``, ``error``, ``stopping``, each op's claim), and
    the group's state with it. The core's other modules (``settle``, ``work``)
    and the layers that break a table (the issuer, ``GroupCore``) use its
    unprefixed names -- ``lock``, ``inflight``, ``break_locked()`` and
    ``after_break()`` -- as a package-internal API.
    """

    def __init__(
        self,
        runtime: Runtime,
        rank: int,
        on_break: Callable[[CommError, float], None],
        lock: threading.Lock | None = None,
        on_error: Callable[[OpTable], None] | None = None,
        observer: Observer | None = None,
        store: str = "",
    ) -> None:
        self.runtime = runtime
        self.rank = rank
        self.observer = observer
        """The group's statistics and subscribers (``None``: nothing recorded)."""
        self.store = store
        """The configuration's store address, for its events and log lines."""
        self.error: CommError | None = None
        """The error that broke the table: the one its op (or abort) raised."""
        self.reported: CommError | None = None
        """What ``errored()`` reports: ``error``, saying the group is aborted
        (its ``__cause__``); set with it, under the lock."""
        self.stopping: CommError | None = None
        """The cause of a break in the making: an op's settler claimed it to
        break the table and is stopping its native op (``abandon()``) before
        it publishes. A failure that the stop itself causes (another op's
        sockets shut, a verified op's check) may break the table first: it
        breaks it with this cause, so ``errored()`` names the deadline or the
        cancel, never the stop; and an op that fails natively meanwhile ends
        with ``CommAborted`` naming it, as the ops the break ends. Not for
        ``abort()``, ``shutdown()`` or ``configure()`` (their own cause), nor
        a worker's death or a bad frame (no stop causes those). Under the
        lock; set once, before ``error``; cleared if its settler leaves
        without breaking."""
        self._on_break = on_break
        # A group passes its own lock: the table's error is the group's
        # ERRORED state, under the one lock that guards all of it.
        self.lock = threading.Lock() if lock is None else lock
        """Guards the table, its records' claims, and the group's state."""
        self._on_error = on_error  # called under the lock when the table breaks
        self.inflight: dict[int, OpRecord[Any]] = {}
        """The ops not ended yet, by seq (under ``lock``)."""
        self._seq = 0
        self._armed_at: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._horizon = 0.0  # the latest op's timeout
        self._issued = 0  # ops tracked so far: an idle sentinel disarms if unchanged
        self._issued_at_arm = -1
        self._wake_pending = False

    def __len__(self) -> int:
        return len(self.inflight)

    def active(self) -> int:
        """Ops not ended yet (ends the completed ones nobody has awaited)."""
        return sum(1 for work in list(self.inflight.values()) if not work._done())

    @property
    def timer_armed(self) -> bool:
        """Whether the owner loop holds a deadline timer for this table."""
        return self._timer is not None

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def track(self, work: OpRecord[Any], timeout: float) -> None:
        """Register an issued op (caller's thread).

        The table may have broken while the op was being issued (a deadline,
        a callback or ``abort()`` on another thread): the op then ends at once
        with ``CommAborted``, as it would have had it been in flight.
        """
        with self.lock:
            if work._claimed:  # ended before it was tracked: nothing to watch
                return
            error = self.error
            if error is None:
                self.inflight[work.seq] = work
                self._issued += 1
            if self.observer is not None and self.observer.subscribers:
                self.observer.issued_locked(work)
        if error is not None:
            wake_all(work._end_after_break(error))
            return
        self._horizon = timeout
        armed = self._armed_at  # read after the insert: see _rearm
        if (armed is None or work.deadline < armed) and not self._wake_pending:
            # One wake-up in the owner's queue at a time: callers issuing
            # faster than the owner runs must not pile up handles.
            self._wake_pending = True
            self.runtime.call_soon(self._on_wake)

    def break_(self, error: CommError) -> None:
        """Mark the table errored (first error wins) and end every op in flight.

        Ops that another thread is ending at this moment end when it
        publishes their outcome (a few µs; a subprocess copy-back's chunk).
        """
        with self.lock:
            broken = self.break_locked(error)
        self.after_break(broken, time.monotonic())

    def break_locked(self, error: CommError, why: str = "break") -> Broken:
        """Under the lock: mark the table errored unless it is; what to end
        (``why``: the state event that breaks it, see :class:`Broken`)."""
        first = self.error is None
        if first:
            stopping = self.stopping
            if stopping is not None and why == "break" and not _independent(error):
                error = stopping  # the first claimed cause wins
            # errored() first: no thread sees ops refused while it is None
            self.reported = _group_aborted(error)
            self.error = error
            if self._on_error is not None:
                self._on_error(self)
        assert self.error is not None  # for mypy: set just above, or before
        return Broken(self.error, first, list(self.inflight.values()), why)

    def after_break(self, broken: Broken, until: float) -> None:
        """End the ops of ``broken`` and wake their waiters (lock released).

        ``until``: the latest deadline of a native op the group may still hold.
        """
        wake_all(self.end_broken(broken, until))

    def end_broken(self, broken: Broken, until: float) -> list[Callable[[], object]]:
        """End the ops of ``broken`` (and, the first time, hand the native group
        over); their waiters, to be woken by the caller once every op has
        ended, so a waiter never finds a sibling ended but not yet published."""
        wakeups: list[Callable[[], object]] = []
        interrupted: BaseException | None = None
        for work in broken.pending:
            try:
                wakeups += work._end_after_break(broken.cause)
            except BaseException as exc:  # KeyboardInterrupt: end the others all the same
                interrupted = interrupted or exc
        if broken.first:
            with contextlib.suppress(RuntimeError):  # the owner loop is closed (exit)
                self.runtime.call_soon(self._disarm)
            self._on_break(broken.cause, max([until, *(w.deadline for w in broken.pending)]))
        observer = self.observer
        if observer is not None and (broken.first or broken.why == "shutdown"):
            # an errored configuration shut down is a shutdown too
            observer.broke(broken.cause, broken.why, self.store, self.rank, len(broken.pending))
        if interrupted is not None:
            wake_all(wakeups)
            raise interrupted
        return wakeups

    # -- owner loop only ---------------------------------------------------
    def _rearm(self) -> None:
        while self.error is None:
            now = time.monotonic()
            earliest: float | None = None
            for work in list(self.inflight.values()):
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
                    if not self.inflight:
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
            if all(w.deadline >= earliest for w in list(self.inflight.values())):
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
