"""An op's record and how it ends: :class:`OpRecord`, settled once.

Owns: the fields of one issued op that decide its end (its native op, its
published outcome, its waiters) and every step of that end. What a caller
does with an op (``await``, ``wait()``, done-callbacks, ``cancel()``) is the
:class:`~ftcomm.Work` handle over it, in ``work.py``; the ops in flight and
their deadline timer are ``table.py``'s.

Rules this module keeps:

1. Every op ends exactly once: success, or one ftcomm error. The first of the
   native completion, the deadline sweeper, a cancellation or an abort to
   settle it wins (under the table's lock); the others find it settled.
   An op's life is a table of three states, kept by :meth:`OpRecord._settle`
   alone (the table's lock guards both steps)::

       PENDING  --claim (first settler)-->  SETTLING  --publish-->  ENDED

   SETTLING is invisible: every observer (``await``, ``wait()``, ``done()``,
   ``exception()``, done-callbacks) still sees the op pending, and waits for
   ENDED. A success goes from PENDING to ENDED in one step. On an error the
   settler first abandons the native op (after which nothing writes into the
   op's tensors); then, under the lock, breaks the table (``errored()``) and
   publishes the outcome, as **one** assignment of ``OpRecord._end``; then ends
   the other ops in flight the same way, and only then wakes the waiters of
   all of them. So no observer can see an op ended before its error is
   there, hold its error (or the group's) while the native op may still
   write, or find a sibling ended but unpublished. A settler that will break
   the table names its error as the table's ``stopping`` cause when it
   claims the op: a failure its own stop causes elsewhere (another op's
   sockets shut, a verified op's check) that breaks the table first breaks
   it with that cause, so ``errored()`` says why the group was stopped.
2. An op that has not completed by its deadline ends with ``CommTimeout``,
   breaks its :class:`~ftcomm._runtime.table.OpTable`, and every other op in
   flight ends with ``CommAborted``. A broken table refuses new ops at once.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..errors import CommAborted, CommError, CommFailed, CommTimeout
from .observe import timed
from .table import Broken, log, peek, wake_all

if TYPE_CHECKING:
    import asyncio

    from .native import NativeOp
    from .table import OpTable

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
    """One issued op's record, and the one place it ends (rules 1 and 2).

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
        self._batch: CutPoint | None = None

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
        """End this op once (see the state table at the top); with ``breaks``,
        also break the table. Returns whether this call was the one that
        ended it."""
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
            self._claimed = True  # PENDING -> SETTLING
            table.inflight.pop(self.seq, None)
            if breaks and isinstance(error, CommError):
                stopping = table.stopping
                if stopping is None:
                    table.stopping = error  # what a failure the stop causes breaks with
                elif table.error is None and type(error) is CommFailed:
                    # Failed while another settler stops the group: by that
                    # stop (its sockets shut), as the ops its break ends.
                    error = self._aborted_by(stopping)
        try:
            return self._stop_and_publish(error, breaks)
        except BaseException:  # left before it broke the table: no stale cause
            with table.lock:
                if table.error is None and table.stopping is error:
                    table.stopping = None
            raise

    def _aborted_by(self, cause: CommError) -> CommAborted:
        return aborted_by(cause, **self._ctx())

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
                observer.op_ended_locked(self, latency, timed(latency, window), end.error)
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
        else:
            error = self._aborted_by(cause)
        return self._settle_quietly(error, False) or []


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
            bulk.batch_ended_locked(ended[0].op, ended, ended_at, window)
    wake_all(wakeups)
