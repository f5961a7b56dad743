"""The op core: an op's record, how it ends, and the table of a
configuration's ops, which share one lock.

Owns, in sections: a table's break and the two shapes of a done-callback
(:class:`Broken`, :class:`LoopCall`, :class:`ThreadCall`, :func:`wake_all`);
:class:`OpTable` (the ops in flight, their deadline timer, the break); and
:class:`OpRecord` (one op's end: its states are in its docstring). Past the
line cap by name (tests/test_layers.py): the table and its records share one
lock and each other's privates. Callers hold a ``Work`` (``work.py``). See docs/ops.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..errors import CommAborted, CommError, CommFailed, CommTimeout, ProtocolError, WorkerDied
from .loop import Runtime
from .native import NativeOp
from .observe import timed

if TYPE_CHECKING:
    from .observe import Observer

log = logging.getLogger("ftcomm")


# -- a break, and the two shapes of a done-callback -----------------------------
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


# -- the table of a configuration's ops ----------------------------------------
class OpTable:
    """The ops in flight on one group configuration: their deadlines and their end.

    The op core's shared-lock contract: ``lock`` guards the table and every
    record in it (``inflight``, ``error``, ``stopping``, each op's claim), and
    the group's state with it. ``work.py`` and the layers that break a table
    (the issuer, ``GroupCore``) use its
    unprefixed names -- ``lock``, ``inflight``, ``break_locked()`` and
    ``after_break()`` -- as a package-internal API.

    Deadlines: an op that has not completed by its deadline ends with
    ``CommTimeout`` and breaks the table; every other op in flight ends with
    ``CommAborted`` (one whose native op had ended keeps its own outcome),
    and a broken table refuses new ops at once. The deadline
    is enforced twice: the native op gets the time left as its own timeout,
    and the owner loop keeps **one** timer per table, armed at the earliest
    deadline in flight or, with nothing in flight, one op-timeout ahead (a
    sentinel). A caller wakes the owner loop only when its op's deadline comes
    before the armed time, with at most one wake-up queued, so a steady stream
    of ops costs one wake-up per timeout and one timer per group however many
    ops run. A sentinel that finds the table idle for a whole timeout lets go,
    so the owner loop never keeps a dropped group alive.
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
        self.done_at_stop: frozenset[int] = frozenset()
        """The ops in flight whose native op had already ended when
        ``stopping`` was claimed: a failure of theirs is their own, not the
        stop's (a fused batch's members, a peer's death before). Set and
        cleared with ``stopping``, under the lock."""
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
                work._announce_locked(self.observer)
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


# -- an op's record and its end ------------------------------------------------
R = TypeVar("R")


class AbandonAbort(CommAborted):
    """An op's end that another op's ``abandon()`` caused, by stopping the
    native group they share (a batch-mate's deadline, or an NCCL/XCCL
    communicator aborted for one op). It does not break the table: that
    op's settler breaks it with the real cause, so ``errored()`` names the
    deadline or the cancel, never the stop. Its op's caller sees a plain
    ``CommAborted`` (:func:`as_seen`): the class is ftcomm's own mark."""


def as_seen(error: CommError) -> CommError:
    """``error`` as an op's caller sees it: an :class:`AbandonAbort` as the
    plain ``CommAborted`` it is to them."""
    if not isinstance(error, AbandonAbort):
        return error
    plain = CommAborted(error.message, rank=error.rank, op=error.op, seq=error.seq)
    plain.__cause__ = error.__cause__
    return plain


STOP_WAIT = 1.0
"""How long a stopped native op (Gloo, its sockets shut down) has to end
before its error is published anyway (measured: 1-4 ms, rarely its own
timeout; docs/gloo.md). A cancelled awaiter waits that long at most."""

EARLY = 0.005
"""A native error this close to the deadline counts as the deadline passing."""


class Outcome:
    """How an op ended: ``error`` is ``None`` on success. Published once."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def __repr__(self) -> str:
        return "done" if self.error is None else "failed"


SUCCESS = Outcome(None)


class CutPoint:
    """What ``OpRecord._batch`` may hold besides ``None``: a point of the
    program's order that the op's first look reaches (``flush()``; fusion,
    ``fuse.py``). ``kept_after_end``: whether it stays once the op has ended
    (an op that went on its own: its first look is still a cut point), or is
    let go with the end (a batch: sent or dropped by then)."""

    __slots__ = ()
    kept_after_end = False

    def flush(self) -> None:
        raise NotImplementedError


class OpRecord(Generic[R]):
    """One issued op's record, and how it ends.

    Every op ends exactly once: success, or one ftcomm error. Its life is a
    table of three states, kept by :meth:`_settle`, and for a fused batch's
    successful members by :func:`end_all` (the table's lock guards every
    step)::

        PENDING  --claim (first settler)-->  SETTLING  --publish-->  ENDED

    The first of the native completion, the deadline sweeper, a cancel or a
    break to claim the op wins; the others find it claimed and do nothing. A
    success goes from PENDING to ENDED in one step. On an error the settler
    first abandons the native op (after which nothing writes into the op's
    tensors), lock released; then, under the lock, breaks the table (if the
    error breaks it) and publishes the outcome as **one** assignment of
    ``_end``; then ends the other ops in flight the same way, and only then
    wakes the waiters of all of them. (A native op stopped but still ending,
    as a severed Gloo op, breaks the table at once and is published once it
    has ended, or, overdue, ``STOP_WAIT`` after its abandon, while a send
    may still be blocked: :meth:`_stop_and_publish`, docs/gloo.md.) SETTLING
    is invisible: every observer (``await``, ``wait()``, ``done()``,
    ``exception()``, done-callbacks) sees the op pending until ENDED, so none
    sees an op ended before its error is there, holds its error while the
    native op may still write into its tensors, or finds a sibling ended but
    unpublished. A settler that will break
    the table names its error as the table's cause as it claims the op
    (:attr:`OpTable.stopping`).

    Owned by its table's lock: ``_claimed`` (PENDING -> SETTLING), ``_end``
    (published once), ``_waiters``; ``_native`` is cleared only after
    ``_end`` is published ("no native" means "ended")."""

    __slots__ = (
        "__weakref__",
        "_announced",
        "_batch",
        "_claimed",
        "_end",
        "_issued",
        "_native",
        "_pending_at",
        "_poll_loop",
        "_result",
        "_table",
        "_waiters",
        "deadline",
        "op",
        "seq",
    )

    def __init__(
        self,
        table: OpTable,
        op: str,
        seq: int,
        deadline: float,
        native: NativeOp,
        result: R,
        issued: float | None = None,
        mark: CutPoint | None = None,
    ) -> None:
        self._table = table
        # Its latency, for the statistics (observe.py), in time.perf_counter():
        # when it was issued, and the last time it was seen not ended yet (a
        # poll, a wait slice) or seen end (its native completion callback).
        # Its end is timed only if seen as it happened: see _end_locked.
        self._issued = time.perf_counter() if issued is None else issued
        self._pending_at = self._issued
        self._announced = False  # its "issued" event is out (observe.py; under the lock)
        self.op = op
        self.seq = seq
        self.deadline = deadline
        # Cleared only after _end is published: "no native" means "ended".
        self._native: NativeOp | None = native
        self._result = result
        self._claimed = False  # a settler owns the op (SETTLING or ENDED)
        self._end: Outcome | None = None  # published once, under the lock
        self._waiters: list[Callable[[], object]] | None = None  # wake-ups, any thread
        self._poll_loop: asyncio.AbstractEventLoop | None = None  # polls it (LoopPoller)
        # The cut point its first look reaches (``Group(fuse=True)``,
        # fuse.py): its open batch, sent then; or the mark of a fusible op
        # that went on its own. None once looked at, and for ops of a group
        # that does not fuse.
        self._batch: CutPoint | None = mark

    def _done(self) -> bool:
        """:meth:`~ftcomm.Work.done` without sending its batch (ftcomm's own looks)."""
        native = self._native  # read once: a settler clears it once the end is out
        if self._end is None and native is not None:
            if native.poll():
                self._complete(native.outcome())
            else:
                self._pending_at = time.perf_counter()
        return self._end is not None

    def _add_waiter(self, native: NativeOp | None, wake: Callable[[], object]) -> bool:
        """Have ``wake()`` called once the op's end is published; False if it
        is. How a waiter gets the end noticed (a loop's poll, the native
        completion callback) is the handle's: :class:`~ftcomm.Work`."""
        raise NotImplementedError

    def _on_end(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` once the op's end is published: at once if it
        is, else on the thread that publishes it. For ftcomm's own waits (a
        teardown): not a look at the op (its open batch stays open)."""
        if self._end is not None or not self._add_waiter(self._native, callback):
            callback()

    # -- settling (any thread) ---------------------------------------------
    def _ctx(self) -> dict[str, Any]:
        return {"rank": self._table.rank, "op": self.op, "seq": self.seq}

    def _settle(self, error: BaseException | None, *, breaks: bool = False) -> bool:
        """End this op once (its states: the class docstring); with
        ``breaks``, also break the table. Returns whether this call was the
        one that ended it."""
        wakeups = self._settle_quietly(error, breaks)
        if wakeups is None:
            return False
        if wakeups:
            wake_all(wakeups)
        return True

    def _settle_quietly(
        self, error: BaseException | None, breaks: bool
    ) -> list[Callable[[], object]] | None:
        """:meth:`_settle` without waking anyone: the waiters to wake (this
        op's, and, if it broke the table, those of the ops it ended), or
        ``None`` if another settler had claimed the op."""
        table = self._table
        if error is None:  # nothing to abandon: claim and publish at once
            with table.lock:
                if self._claimed:
                    return None
                self._claimed = True
                table.inflight.pop(self.seq, None)
                return self._end_locked(SUCCESS)
        with table.lock:
            if self._claimed:
                return None
            stopping = table.stopping
            # This op's error will stop the group, the first to: its cause.
            cause = error if breaks and stopping is None and isinstance(error, CommError) else None
            done: frozenset[int] = frozenset()
            if cause is not None:
                # Before the claim: a peek that raises (a bug below) leaves the
                # op pending, as it was (_claimed only ever turns true:
                # work.py reads it without the lock).
                done = frozenset(
                    seq
                    for seq, work in table.inflight.items()
                    if work is not self and work._native is not None and peek(work._native)
                )
            self._claimed = True  # PENDING -> SETTLING
            table.inflight.pop(self.seq, None)
            if cause is not None:
                table.stopping = cause  # what a failure the stop causes breaks with
                table.done_at_stop = done
            elif breaks and stopping is not None and table.error is None:
                # Failed while another settler stops the group.
                error = self._failed_by(stopping, error)
        try:
            return self._stop_and_publish(error, breaks)
        except BaseException:  # left before it broke the table: no stale cause
            with table.lock:
                if table.error is None and table.stopping is error:
                    table.stopping = None
                    table.done_at_stop = frozenset()
            raise

    def _aborted_by(self, cause: CommError) -> CommAborted:
        return aborted_by(cause, **self._ctx())

    def _failed_by(self, stop: CommError, error: BaseException) -> BaseException:
        """``error``, as named once the claimed ``stop`` shut the group's
        sockets: a ``CommFailed`` is the stop's (``CommAborted``), unless
        this op's native op had already ended when the stop was claimed
        (:attr:`OpTable.done_at_stop`: a fused batch's members, a peer's
        death before)."""
        if type(error) is CommFailed and self.seq not in self._table.done_at_stop:
            return self._aborted_by(stop)
        return error

    def _stop_and_publish(
        self, error: BaseException, breaks: bool
    ) -> list[Callable[[], object]] | None:
        """A claimed op (SETTLING) ends with ``error``: stop its native op,
        break the table (``breaks``), publish; see :meth:`_settle_quietly`."""
        table = self._table
        native = self._native
        interrupted: BaseException | None = None
        stopped = False
        abandon = getattr(native, "abandon", None)
        if abandon is not None:  # nothing may be written once the error is out
            try:
                stopped = bool(abandon())
            except Exception:  # a bug below: the op must still end, and its group
                log.exception("ftcomm: abandoning %r failed", self)
            except BaseException as exc:  # KeyboardInterrupt: end the op all the same
                interrupted = exc
        broken: Broken | None = None
        if stopped and native is not None and not peek(native):
            # Stopped for real, but still running for a moment (a Gloo op whose
            # sockets were just shut down): publish once it has ended, on the
            # thread that ends it. The table breaks now, so no new op meets
            # the stopped group.
            if breaks and isinstance(error, CommError):
                with table.lock:
                    broken = table.break_locked(error)
            try:
                native.on_done(lambda _: self._publish(error))
            except BaseException as exc:  # never left SETTLING: publish now
                log.exception("ftcomm: waiting for %r's native end failed", self)
                self._publish(error)
                interrupted = interrupted or (None if isinstance(exc, Exception) else exc)
            del native, abandon
            self._publish_by(STOP_WAIT, error)
            return self._after_settle([], broken, interrupted)
        with table.lock:
            if breaks and isinstance(error, CommError):
                broken = table.break_locked(error)  # errored() set with the end
            waiters = self._end_locked(Outcome(error))
        if native is not None and not peek(native):
            # it may block whoever drops it last, until its native deadline
            table.runtime.dispose(native, until=self.deadline)
        # Waiters may run user code that keeps an error whose traceback reaches
        # this frame: it must not hold the native op (and its group) then.
        del native, abandon
        return self._after_settle(waiters, broken, interrupted)

    def _after_settle(
        self,
        wakeups: list[Callable[[], object]],
        broken: Broken | None,
        interrupted: BaseException | None,
    ) -> list[Callable[[], object]]:
        """End the other ops of a break this op made; every waiter to wake.
        An interrupt caught on the way wakes them all, then is raised."""
        if broken is not None:
            wakeups += self._table.end_broken(broken, self.deadline)
        if interrupted is not None:
            wake_all(wakeups)
            raise interrupted
        return wakeups

    def _publish(self, error: BaseException) -> None:
        """SETTLING -> ENDED for an op whose native op was stopped and has
        now ended (its end callback, any thread): publish and wake."""
        with self._table.lock:
            if self._end is not None:
                return
            waiters = self._end_locked(Outcome(error))
        wake_all(waiters)

    def _announce_locked(self, observer: Observer) -> None:
        """Under the lock, with subscribers: queue this op's ``"issued"``
        event, once (at its track, or before its end where a subscriber
        came since)."""
        if not self._announced:
            self._announced = True
            table = self._table
            observer.issued_locked(table.rank, table.store, self.op, self.seq)

    def _end_locked(self, end: Outcome, record: bool = True) -> list[Callable[[], object]]:
        """Under the table's lock: the op is ENDED with ``end`` (published
        once, with its native op let go); the waiters to wake. ``record``:
        False if the caller records its end in the statistics (end_all)."""
        self._end = end
        mark = self._batch
        if mark is not None and not mark.kept_after_end:
            self._batch = None  # its batch was sent (or dropped): let go of it
        waiters, self._waiters = self._waiters, None
        native, self._native = self._native, None
        self._poll_loop = None  # a loop that polled it is not kept by an op kept
        if end.error is not None:
            failed = getattr(native, "member_failed", None)  # a fused op's (NativeOp)
            if failed is not None:
                failed()  # its batch-mates look at their own ends
        observer = self._table.observer if record else None
        subscribers = None if observer is None else observer.subscribers  # read once
        if observer is not None and (observer.stats_on or subscribers):
            # A native op that knows when it ended says so (a worker's reply);
            # else an end is timed only if it was seen as it happened, to
            # within 1 ms or 1/16 of its latency (an await or wait watching it,
            # its completion callback, a look right after the issue): an op
            # issued, left while the caller computed, and found ended later has
            # no known end.
            ended_at = getattr(native, "ended_at", None)
            if ended_at is None:  # seen here: now, to within the last look at it running
                ended_at = time.perf_counter()
                window = ended_at - self._pending_at
            else:  # the backend's: exact (a worker's reply), or to within an event's poll
                window = getattr(native, "end_window", None) or 0.0
            latency = ended_at - self._issued
            if end.error is None and not subscribers:
                observer.succeeded_locked(self.op, latency, window)  # stats_on: see above
            else:
                if subscribers:
                    self._announce_locked(observer)  # its "issued" goes first
                table = self._table
                observer.op_ended_locked(
                    table.rank,
                    table.store,
                    self.op,
                    self.seq,
                    latency,
                    timed(latency, window),
                    end.error,
                    bool(subscribers),
                )
        return waiters or []

    def _publish_by(self, seconds: float, error: BaseException) -> None:
        """Have the owner loop publish ``error`` in ``seconds`` unless the
        native op has ended by then (:meth:`_overdue`). Gloo sometimes leaves
        a large send blocked after the shutdown until its own timeout
        (measured: 3 in 35 aborts in the middle of a 64 MiB allreduce). The
        timer holds the op weakly; with the owner loop gone (interpreter
        exit) the native op's end publishes it."""
        ref = weakref.ref(self)

        def overdue() -> None:
            work = ref()
            if work is not None:
                work._overdue(error)

        runtime = self._table.runtime
        with contextlib.suppress(RuntimeError):  # the owner loop is closed
            runtime.call_soon(runtime.loop.call_later, seconds, overdue)

    def _overdue(self, error: BaseException) -> None:
        """STOP_WAIT after a stopped op's abandon (owner loop): if its native
        op has still not ended, publish its error all the same, so that no
        observer waits for the native op's own timeout. Such an op was
        blocked sending (it reads its tensors; measured: no write after the
        error in any run)."""
        if self._end is None:
            log.warning(
                "ftcomm: %r's native op has not ended %g s after its group was "
                "stopped; its error is published now (the native op ends by its "
                "own timeout)",
                self,
                STOP_WAIT,
            )
            self._publish(error)

    def _complete(self, native_error: BaseException | None) -> None:
        """The native op ended: settle with its outcome, mapped to ftcomm errors.

        An error the native op reports because another op's ``abandon()``
        stopped their group (an :class:`AbandonAbort`) ends this op without
        breaking the table: that op's settler breaks it with the real cause,
        so ``errored()`` names the deadline (or cancel), not the stop.
        """
        if native_error is None:  # _settle(None), one frame shorter (the small-op path)
            wakeups = self._settle_quietly(None, False)
            if wakeups:
                wake_all(wakeups)
            return
        breaks = not isinstance(native_error, AbandonAbort)
        self._settle(self._native_failure(native_error), breaks=breaks)

    def _native_failure(self, native_error: BaseException) -> CommError:
        """The one place a native op's error becomes an ftcomm error.

        A ``CommError`` raised below the op (a subprocess worker died, a
        frame was malformed) says what happened better than a wrapper would.
        Gloo reports its own timeout as a plain ``RuntimeError``, so it is
        told apart by when it came: the native op's timeout is this op's
        deadline, and an error at the deadline is that deadline passing.
        """
        if isinstance(native_error, CommError):
            return as_seen(native_error.at(self._table.rank, self.op, self.seq))
        error: CommError
        if time.monotonic() >= self.deadline - EARLY:
            error = CommTimeout(f"{self.op} did not complete by its deadline", **self._ctx())
        else:
            error = CommFailed(f"{self.op} failed: {native_error}", **self._ctx())
        error.__cause__ = native_error
        return error

    def _abort(self, error: CommError) -> bool:
        return self._settle(error, breaks=True)

    def _expire(self) -> None:
        """The deadline passed (owner loop)."""
        native = self._native
        if native is not None and native.poll():
            self._complete(native.outcome())
        else:
            self._abort(CommTimeout(f"{self.op} did not complete by its deadline", **self._ctx()))

    def _end_after_break(self, cause: CommError) -> list[Callable[[], object]]:
        """End this op because its table broke (``cause``), unless it has
        ended; the waiters to wake (the caller wakes them)."""
        # peek, not poll: a subprocess call's poll reads the socket and may
        # end other ops on this thread, with their callbacks, mid-break.
        native = self._native
        error: BaseException | None
        if native is not None and peek(native):
            native_error = native.outcome()  # it completed before the break
            error = None if native_error is None else self._native_failure(native_error)
            if error is not None and cause is self._table.stopping:
                # Failed after the stop that broke the table was claimed,
                # before the break looked. (stopping and done_at_stop no
                # longer change once the table is broken: read without the lock.)
                error = self._failed_by(cause, error)
        else:
            error = self._aborted_by(cause)
        return self._settle_quietly(error, False) or []


def complete(record: OpRecord[Any], native_error: BaseException | None) -> None:
    """End ``record`` as its native op's end would (a fused batch ends its
    earliest member so, with the batch's own failure)."""
    record._complete(native_error)


def on_end(record: OpRecord[Any], callback: Callable[[], object]) -> None:
    """Call ``callback()`` once ``record``'s end is published: at once if it
    is, else on the thread that publishes it. Not a look (a teardown waits
    so for the ops it ended: ``GroupCore``)."""
    record._on_end(callback)


def aborted_by(cause: CommError, **ctx: Any) -> CommAborted:
    """The error of an op ended by a break of its group (``cause``);
    ``ctx``: its rank, op and seq."""
    error = CommAborted(f"{ctx['op']} was aborted: the group broke ({cause.message})", **ctx)
    error.__cause__ = cause
    return error


def end_all(table: OpTable, works: list[OpRecord[Any]], ended_at: float, window: float) -> None:
    """End every op of ``works`` that has not ended with success, under one
    hold of the table's lock (a fused batch that succeeded and was copied
    back, seen end at ``ended_at`` to within ``window``: fuse.py), then wake
    their waiters."""
    wakeups: list[Callable[[], object]] = []
    ended: list[OpRecord[Any]] = []
    with table.lock:
        observer = table.observer  # subscribers read with the ends (under the lock)
        # Statistics alone (no events): one pass over the batch, not one call per op.
        bulk = observer if observer is not None and observer.stats_on else None
        if bulk is not None and bulk.subscribers:
            bulk = None
        for work in works:
            if not work._claimed:
                work._claimed = True
                table.inflight.pop(work.seq, None)
                wakeups += work._end_locked(SUCCESS, bulk is None)
                ended.append(work)
        if bulk is not None and ended:
            latencies = [ended_at - work._issued for work in ended]
            bulk.batch_ended_locked(ended[0].op, latencies, window)
    wake_all(wakeups)
