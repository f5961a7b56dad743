"""The awaitable :class:`Work`: the handle a caller holds on one issued op.

Owns every way of looking at an op -- ``await``, ``wait()``, ``done()``,
``result()``/``exception()``, done-callbacks, ``cancel()``, asyncio's future
protocol -- and how a look waits: the await's spin (polls, yielding the core
between them, then a sleep until the native completion or the sweeper), the
loop's poll, a thread's block. How the op ends, and its table's deadline
timer, are the op core's (``table.py``: ``OpRecord``, ``OpTable``). See docs/ops.md.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import CommAborted, CommTimeout
from . import table as core
from .deadline import to_seconds
from .driven import Drivers, TaskDriven
from .fuse import MemberOp
from .loop import (
    HOLD_SECONDS,
    SPINNERS,
    LoopPoller,
    require_asyncio,
    sched_yield,
    wake_threadsafe,
)
from .table import CutPoint, LoopCall, OpRecord, Outcome, ThreadCall, log

if TYPE_CHECKING:
    from .fuse import Batch
    from .native import NativeOp
    from .table import OpTable

R = TypeVar("R")

SPIN_SECONDS = float(os.environ.get("FTCOMM_SPIN_US", "2000")) / 1e6
"""How long ``await work`` polls before it sleeps on the completion callback."""

WAIT_SLICE = 0.01
"""How long a blocked thread sleeps in a native wait before it rechecks the op."""


# The errors of ops' own cancels (Work.cancel): the op (weakly) and the
# message, by the error, which holds no mark of its own (its class and
# attributes are what its caller and errored() see). Weakly: gone with the
# error. A lookup or an insert is one dict operation under the GIL.
_CANCELS: weakref.WeakKeyDictionary[CommAborted, tuple[weakref.ref[Any], Any]] = (
    weakref.WeakKeyDictionary()
)


class Work(OpRecord[R], TaskDriven, collections.abc.Coroutine[Any, Any, R]):
    """The awaitable handle of one issued collective.

    The op is already on the wire when you get this. ``await work`` returns its
    result (the output tensor or tensors, ``None`` for barrier and send);
    :meth:`wait` does the same for a thread without an event loop.

    Every way of looking at an op (``await``, :meth:`wait`, :meth:`done`,
    :meth:`exception`, :meth:`add_done_callback`, the c10d work and future)
    sees the same outcome, from any thread, whenever it looks; an op whose
    error is out never writes into its tensors afterwards (on backends that
    can stop their native op; docs/ops.md).

    Where an event loop runs, a work is also an asyncio future of that loop
    (``asyncio.isfuture`` is true): ``asyncio.gather(*works)``,
    ``asyncio.wait_for(work, t)``, ``asyncio.shield(work)`` and
    ``asyncio.as_completed`` use it as it is, with no task per op.
    ``asyncio.wait`` refuses works (it refuses anything that is also a
    coroutine, and a work is one, for ``create_task``): give it tasks
    (``asyncio.create_task(work)``), or use ``as_completed``.
    Cancelling ``gather`` cancels its works (:meth:`cancel`: the group is
    aborted); ``shield`` keeps the op going.

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
        RuntimeError: awaited without a running asyncio loop (trio): the op
            goes on, bound by its deadline.

    An aborted in-process Gloo op is stopped by shutting its group's
    connections down; its error is out only once it has ended (a millisecond
    or two). Where the group's connections could not be identified (a
    ``RuntimeWarning`` said so at ``configure()``), it cannot be stopped and
    may write into its tensors until its own timeout: do not reuse the
    tensors of an op that did not succeed there.
    """

    __slots__ = ("_arming", "_cancel_requested", "_cb_armed", "_drivers")

    @property
    def _asyncio_future_blocking(self) -> bool | None:
        """asyncio's mark of a future (``asyncio.isfuture``): where a loop
        runs, ``asyncio.gather`` and ``ensure_future`` take a work as it is,
        without a task per op. Where none runs (``loop.run_until_complete(work)``,
        a gather built before the loop starts), ``None``: a work is then a
        coroutine to them, wrapped in a task as before."""
        return False if asyncio._get_running_loop() is not None else None

    @_asyncio_future_blocking.setter
    def _asyncio_future_blocking(self, value: bool) -> None:
        """asyncio sets it on futures a coroutine yields: nothing to keep."""

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
        # Not super(): its lookup costs ~100 ns, on the path of every op issued.
        OpRecord.__init__(self, table, op, seq, deadline, native, result, issued, mark)
        self._arming = False  # on_done being registered: a call now is not "as it happened"
        self._cb_armed = False  # the native completion callback is registered
        self._cancel_requested: tuple[Any] | None = None  # (msg,) once cancel() was called
        self._drivers: Drivers | None = None

    def __repr__(self) -> str:
        end = self._end
        state = "pending" if end is None else repr(end)
        return f"<ftcomm.Work {self.op} seq={self.seq} {state}>"

    # -- public ------------------------------------------------------------
    def done(self) -> bool:
        """Whether the op has ended (it may have failed). An op waiting in an
        open batch (``Group(fuse=True)``) is sent first."""
        if self._batch is not None:
            self._flush()
        return self._done()

    def _flush(self) -> None:
        """Send the open batch this op waits in: someone looks at the op (a
        point of the program's own order; docs/fusion.md)."""
        batch = self._batch
        if batch is not None:
            self._batch = None
            batch.flush()

    def cancel(self, msg: Any | None = None) -> bool:
        """Cancel the op: abort it and its group. Returns False if it had
        already ended (or another thread is ending it: it then ends as that
        thread says).

        The op ends with ``CommAborted`` (``await``, :meth:`wait` and
        :meth:`exception` give it; it names this cancel), and, as for an
        ``asyncio.Future``, :meth:`cancelled` is then true and :meth:`result`
        raises ``asyncio.CancelledError`` (with ``msg``). The group is
        errored until ``configure()``: :meth:`~ftcomm.Group.errored` is that
        ``CommAborted``, and its other ops in flight end with
        ``CommAborted`` (cancelled too if ``cancel()`` is then called on
        them). So cancelling ``asyncio.gather`` of works raises
        ``CancelledError``, and ``asyncio.wait_for(work, t)``
        on Python 3.11 ``TimeoutError`` (from 3.12 it cancels its task
        instead, which aborts the op as a cancelled await does).

        Called on a thread other than the owner loop's, it returns once the
        op's error is out: after its native op was stopped (a millisecond
        or two for Gloo, at most about 1.5 s).
        """
        self._cancel_requested = (msg,)  # one cancel's break ends ops it was asked of
        if self._done():  # not a look: a member of an open batch is dropped, never sent
            return False
        why = "" if msg is None else f": {msg}"
        error = CommAborted(f"{self.op} was cancelled with Work.cancel(){why}", **self._ctx())
        # The mark of this op's own cancel (weakly: the error outlives the op
        # in the group's errored()); see cancelled().
        _CANCELS[error] = (weakref.ref(self), msg)
        ended = self._abort(error)
        self._until_published()
        return ended

    def cancelled(self) -> bool:
        """Whether :meth:`cancel` ended the op, or was called on it once the
        break of another op's :meth:`cancel` had ended it (cancelling
        ``asyncio.gather`` cancels each of its works in turn; the first
        one's break ends the others). Not whether it failed, nor whether a
        task awaiting it was cancelled."""
        end = self._end
        return (
            end is not None and end.error is not None and self._cancel_mark(end.error) is not None
        )

    def _cancel_mark(self, error: BaseException | None) -> tuple[Any] | None:
        """``(msg,)`` if ``error`` is this op's own cancel, or, for an op
        :meth:`cancel` was called on, the ``CommAborted`` of a cancel's break
        (another op's, first); else None."""
        mark = _CANCELS.get(error) if isinstance(error, CommAborted) else None
        if mark is not None:
            return (mark[1],) if mark[0]() is self else None
        requested = self._cancel_requested
        by_cancel = (  # aborted_by(cause), a batch-mate's abort: by a cancel's break
            type(error) is CommAborted
            and isinstance(error.__cause__, CommAborted)
            and error.__cause__ in _CANCELS
        )
        return requested if requested is not None and by_cancel else None

    def result(self) -> R:
        """The op's result (as ``await work`` returns it), once it has ended.

        Raises:
            asyncio.InvalidStateError: the op has not ended yet.
            asyncio.CancelledError: :meth:`cancel` ended it (as an
                ``asyncio.Future``'s would).
            CommTimeout, CommFailed, CommAborted: as ``await work``.
        """
        error = self._looked_up()
        if error is not None:
            if self._cancel_mark(error) is not None:
                cancelled = self._make_cancelled_error()
                cancelled.__context__ = error
                raise cancelled
            raise error.with_traceback(None)  # see __await__
        return self._result

    def exception(self) -> BaseException | None:
        """The op's error, or ``None`` if it succeeded (for an op
        :meth:`cancel` ended, its ``CommAborted``).

        Raises:
            asyncio.InvalidStateError: the op has not ended yet.
        """
        return self._looked_up()

    def _looked_up(self) -> BaseException | None:
        """A look at the op (its open batch is sent): its error, or None.
        Raises ``InvalidStateError`` if it has not ended."""
        if self._batch is not None:  # a look, ended or not: a cut point either way
            self._flush()
        end = self._end
        if end is None:
            if not self._done():
                raise asyncio.InvalidStateError(f"{self!r} has not ended")
            end = self._outcome()
        return end.error

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop running in the calling thread. A work belongs to no
        loop: asyncio's functions that take futures (``asyncio.gather``,
        ``wait_for``, ``shield``, ``as_completed``) use it as a future of the
        loop they run on, without a task per op.

        Raises:
            RuntimeError: no event loop runs in this thread.
        """
        loop = asyncio._get_running_loop()
        if loop is None:
            raise RuntimeError(f"{self!r}.get_loop(): no event loop runs in this thread")
        return loop

    def add_done_callback(
        self, fn: Callable[[Work[R]], object], *, context: contextvars.Context | None = None
    ) -> None:
        """Have ``fn(work)`` called once the op has ended.

        On a thread whose event loop is running, as ``asyncio.Future`` does:
        ``fn`` is scheduled on that loop (soon, if the op has ended), in
        ``context`` (by default a copy of the current one); its exceptions go
        to the loop's exception handler. The ops of a fused batch that end
        together wake their loop once. Should that loop be closed by then,
        ``fn`` runs on the thread that ends the op instead (a loop stopped
        for good never runs it, as with asyncio's own futures).

        Elsewhere (a thread without a running loop): ``fn`` is called now, on
        this thread, if the op has ended, else on the thread that ends it (a
        backend's thread, the owner loop), in ``context`` if one is given
        (in a copy of it if it is in use just then: by another callback, on
        another thread or around this one), else in that thread's; it must
        be quick and must not block.
        Exceptions it raises there are logged (called now, they propagate).

        A look at the op: its open batch, if any, is sent.
        """
        loop = asyncio._get_running_loop()
        if loop is None:
            self._when_done(ThreadCall(fn, self, context))
            return
        if context is None:
            context = contextvars.copy_context()
        if self._batch is not None:
            self._flush()
        if self._end is None and self._add_waiter(self._native, LoopCall(loop, fn, self, context)):
            return
        loop.call_soon(fn, self, context=context)  # ended: soon, as a future's would be

    def remove_done_callback(self, fn: Callable[[Work[R]], object]) -> int:
        """Remove every registration of ``fn`` not yet run (called or, on a
        loop, scheduled); how many were removed."""
        with self._table.lock:
            registered = list(self._waiters or ())
        # fn's __eq__ is user code: compared here, not under the group's lock
        matching = {
            id(w)
            for w in registered
            if type(w) in (LoopCall, ThreadCall) and (w.fn is fn or w.fn == fn)  # type: ignore[attr-defined]
        }
        if not matching:
            return 0
        with self._table.lock:
            waiters = self._waiters or []
            kept = [w for w in waiters if id(w) not in matching]
            self._waiters = kept
        return len(waiters) - len(kept)

    def _make_cancelled_error(self) -> asyncio.CancelledError:
        """asyncio's futures protocol (``asyncio.gather``)."""
        msg = self._cancel_message
        return asyncio.CancelledError() if msg is None else asyncio.CancelledError(msg)

    @property
    def _cancel_message(self) -> Any | None:
        """asyncio's futures protocol: the message given to :meth:`cancel`."""
        end = self._end
        mark = None if end is None else self._cancel_mark(end.error)
        return None if mark is None else mark[0]

    def __await__(self) -> Generator[Any, None, R]:
        # A plain generator, not a coroutine chain: it resumes once per loop
        # iteration while it spins, and every frame it passes costs time
        # measured in the small-op bench.
        if self._batch is not None:  # a look, ended or not: a cut point either way
            self._flush()
        if self._end is None:
            if asyncio._get_running_loop() is None:
                require_asyncio("awaiting", self.op)  # raises; the op goes on, its deadline holds
            native = self._native
            spinner: Batch | None = None
            try:
                if type(native) is MemberOp:
                    spinner = yield from self._member_turn(native)
                    native = self._native
                if native is not None:
                    yield from self._spin(native)
                    if self._end is None:
                        yield from self._sleep_until_ended(native).__await__()
            except BaseException as exc:
                if spinner is not None and self._end is None:
                    spinner.spinner_left()  # closed or cancelled: another await takes over
                # A raised error keeps this frame in its traceback (a task
                # keeps its cancel, the op its error): no native op may be
                # held by the frame from here.
                native = spinner = None
                if isinstance(exc, asyncio.CancelledError):
                    self._cancelled_while_awaited()
                raise
            native = spinner = None  # the op's error, raised below: as above
        end = self._end
        if end is None:
            end = self._outcome()  # raises: a bug in ftcomm
        if end.error is not None:
            # One error object, raised by every look at the op and kept by
            # errored(): each raise starts its traceback afresh (as asyncio's
            # futures do), or every raise would add its frames to it.
            raise end.error.with_traceback(None)
        return self._result

    # -- awaiting ----------------------------------------------------------
    def _cancel_before_start(self) -> None:
        self._cancelled_while_awaited()

    def _cancelled_while_awaited(self) -> None:
        """An awaiting task was cancelled: abort the op (and its group) unless
        it has ended (not a look: a member of an open batch is dropped, never
        sent)."""
        if not self._done():
            self._abort(CommAborted(f"{self.op} was cancelled while in flight", **self._ctx()))
            self._until_published()

    def _outcome(self) -> Outcome:
        end = self._end
        if end is None:  # a caller skipped the wait: a bug in ftcomm, not the user's
            raise RuntimeError(f"{self!r}: outcome read before the op ended")
        return end

    def _spin(self, native: NativeOp) -> Generator[None, None, None]:
        """Poll the op until it ends or its spin (:data:`SPIN_SECONDS`) is
        over, yielding the core between polls and running the event loop
        once per turn. An await that is the only one spinning on this
        thread's loop keeps polling for up to :data:`HOLD_SECONDS` before
        each turn of the loop (measured, 2 ranks each pinned to a core: 0.16
        turns of the loop per lone op instead of 20-50, and the op about 2.5
        µs faster); with several, each turn is one poll, so that no await
        holds another up. It stops as soon as the op's end is out, whoever
        published it (a break, an abort, the deadline's sweep)."""
        spinning = SPINNERS.count  # spinners(), without the call
        spinning[0] += 1
        try:
            spin_until = time.perf_counter() + getattr(native, "spin", SPIN_SECONDS)
            while self._end is None:
                hold_until = time.perf_counter() + HOLD_SECONDS if spinning[0] == 1 else 0.0
                while self._end is None:
                    if native.poll():
                        self._complete(native.outcome())
                        return  # ended, or being settled by another thread
                    self._pending_at = now = time.perf_counter()
                    if now >= spin_until:
                        return
                    # Give this core to a runnable thread first (the backend's
                    # own worker, usually): on 2 cores a spin that only yields
                    # to the event loop starves it and turns p90 from 0.2 ms
                    # into 4 ms.
                    sched_yield()
                    if now >= hold_until:
                        break
                else:
                    return  # ended by another party while this await held the loop
                yield  # what asyncio.sleep(0) does: run the loop once, then resume
        finally:
            spinning[0] -= 1
            del native  # a cancel's traceback keeps this frame

    def _member_turn(self, native: MemberOp) -> Generator[Any, None, Batch | None]:
        """An await of a fused op, before it polls: the batch if this await
        is the one that polls it (then spins on it); else, with another
        await polling the batch, one look at the op, then sleep until the
        batch is over (one future per await, woken together, rather than
        1000 tasks polling it), and ``None``."""
        loop = asyncio.get_running_loop()
        try:
            if native.batch.take_spin(loop):
                return native.batch
            if native.poll():
                self._complete(native.outcome())
                return None
            fut = native.batch.sleep(loop)
        finally:
            del native  # a raised error's traceback keeps this frame
        # _end_locked sets _end before it wakes the sleepers (under the
        # batch's lock): an end that came before we slept is seen here.
        if fut is not None and self._end is None:
            yield from fut
        return None

    async def _sleep_until_ended(self, native: NativeOp) -> None:
        loop = asyncio.get_running_loop()
        self._table.runtime.watch_caller()  # debug mode: a held loop delays this op
        fut: asyncio.Future[None] = loop.create_future()
        try:
            waiting = self._add_waiter(native, lambda: wake_threadsafe(loop, fut))
        finally:
            del native  # a raised error's (or a cancel's) traceback keeps this frame
        if waiting:
            await fut

    def _add_waiter(self, native: NativeOp | None, wake: Callable[[], object]) -> bool:
        """Have ``wake()`` called once the op's end is published; False if it is."""
        with self._table.lock:
            if self._end is not None:
                return False
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(wake)
            live = not self._claimed and native is not None
            # A done-callback on a loop has that loop poll the op (the first
            # such loop), and arm the native callback once its spin is over;
            # any other waiter, or a callback on another loop, arms it now.
            loop = wake.loop if type(wake) is LoopCall else None
            poll = live and loop is not None and self._poll_loop is None
            if poll:
                self._poll_loop = loop
            other = loop is None or loop is not self._poll_loop  # not the polling loop
            arm = live and not poll and other and not self._cb_armed
            self._cb_armed = self._cb_armed or arm
        if poll or arm:
            assert native is not None  # for mypy: checked under the lock above
            spin = getattr(native, "spin", SPIN_SECONDS)
            if type(native) is MemberOp:  # the batch's end ends its members
                if poll:
                    assert loop is not None  # for mypy
                    native.batch.poll_on(loop, spin)
                else:
                    native.batch.arm()
            elif poll:
                assert loop is not None  # for mypy
                self._poll_on(loop, native, spin)
            else:
                self._arm(native)
        return True

    def _arm(self, native: NativeOp) -> None:
        """Register the native completion callback (under ``_cb_armed``)."""
        self._arming = True  # an op ended already is ended at once, on this thread
        try:
            native.on_done(self._native_done)
        finally:
            self._arming = False

    def _arm_once(self, native: NativeOp) -> None:
        """:meth:`_arm`, unless another waiter did.

        Also a ``LoopPoller``'s give-up from its finalizer, which a garbage
        collection may run on a thread that holds the group's lock: an op
        claimed already (so ended, or ending) needs nothing, and the lock
        is not taken for it (``_claimed`` only ever turns true)."""
        if self._claimed:
            return
        with self._table.lock:
            arm = not self._cb_armed and not self._claimed
            self._cb_armed = True
        if arm:
            self._arm(native)

    def _poll_on(self, loop: asyncio.AbstractEventLoop, native: NativeOp, spin: float) -> None:
        """For an op whose first waiter is a done-callback on ``loop``
        (``asyncio.wait_for``, ``gather``): have ``loop`` poll it once per
        iteration for ``spin`` seconds, as ``await`` does, then arm the
        native completion callback, whose thread hop and loop wake-up cost a
        small op about 150 µs more. Should ``loop`` stop before its poll ran
        out, the callback is armed by the next waiter of another kind, or
        else the op is ended by its deadline's sweep (a success if it had
        completed): that loop would not run the callback anyway."""
        LoopPoller(
            loop, spin, lambda: self._poll_once(native), lambda: self._arm_once(native)
        ).start()

    def _poll_once(self, native: NativeOp) -> bool:
        """One poll of the native op: whether the op has ended (or is being
        ended) now."""
        if self._end is not None:
            return True
        if native.poll():
            self._complete(native.outcome())
            return True
        self._pending_at = time.perf_counter()
        return False

    def _native_done(self, native_error: BaseException | None) -> None:
        """The native op's completion callback (any thread): it ends now,
        unless the backend calls back when a poll of its own saw the end
        (``polled_end``: an accelerator's event watcher, up to 2 ms late)."""
        if not self._arming and not getattr(self._native, "polled_end", False):
            self._pending_at = time.perf_counter()
        self._complete(native_error)

    def wait(
        self, timeout: float | timedelta | None = None, *, abort_on_timeout: bool = False
    ) -> R:
        """Block this thread until the op ends; return its result or raise its error.

        For code without an event loop (threads, the c10d facade). The op's
        own deadline still applies; ``timeout`` only bounds this wait, unless
        ``abort_on_timeout`` makes it a deadline (c10d's ``Work.wait(timeout)``):
        then an op still running after ``timeout`` ends with ``CommTimeout``
        and its group is aborted.

        Raises:
            RuntimeError: called, before the op ended, on a thread whose event
                loop is running (it would block that loop: ``await`` the work).
            TimeoutError: ``timeout`` seconds passed first; the op goes on.
            TypeError, ValueError: a bad ``timeout`` (NaN, negative, ...).
            CommTimeout, CommFailed, CommAborted: as ``await work``.
        """
        if self._batch is not None:  # a look, whether or not it may block here
            self._flush()
        if self._end is None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                raise RuntimeError("Work.wait() would block the running event loop: await it")
        return self._wait(timeout, abort_on_timeout=abort_on_timeout)

    def _wait(self, timeout: float | timedelta | None, *, abort_on_timeout: bool) -> R:
        """:meth:`wait` for a caller that may block a running loop (the c10d
        facade: c10d's ``wait()`` blocks whatever thread calls it)."""
        if self._batch is not None:
            self._flush()
        if timeout is not None:
            timeout = to_seconds(timeout, "timeout")
        if not self._block(timeout):
            if not abort_on_timeout:
                raise TimeoutError(f"{self!r} did not end within {timeout} s")
            if not self.done():
                self._abort(
                    CommTimeout(
                        f"{self.op} did not complete within wait(timeout={timeout:g} s)",
                        **self._ctx(),
                    )
                )
            self._block(None)  # published at once, or by the thread settling it
        error = self._outcome().error
        if error is not None:
            raise error.with_traceback(None)  # see __await__
        return self._result

    def _block(self, timeout: float | None) -> bool:
        """Block this thread until the op's end is published or ``timeout``
        passes; whether it ended.

        Polls for a short spin first, yielding the core between polls (on 2
        cores, a thread that sleeps and is woken costs more than the backend
        thread needs to finish a small op). Then a native op that can block a
        thread (c10d's own ``wait``) is waited on in slices of at most
        ``WAIT_SLICE`` seconds, so an abort or a deadline settled elsewhere is
        seen within a slice; others, and an op another thread is settling,
        sleep until its end is published.
        """
        native = self._native
        if self._end is not None or native is None:
            return True
        now = time.perf_counter()
        end = None if timeout is None else now + timeout
        spin = getattr(native, "spin", SPIN_SECONDS)
        spin_until = now + (spin if timeout is None else min(spin, timeout))
        natively_done = False
        while self._end is None:
            if native.poll():
                natively_done = True
                break
            self._pending_at = now = time.perf_counter()
            if now >= spin_until:
                break
            sched_yield()
        wait = getattr(native, "wait", None)
        if not natively_done and wait is not None:
            while self._end is None and not self._claimed:
                budget = WAIT_SLICE if end is None else min(WAIT_SLICE, end - time.perf_counter())
                if budget <= 0:
                    return False
                ended = wait(budget)  # c10d's wait returns as the op ends
                self._pending_at = time.perf_counter()  # its end, or a moment it still ran
                if ended:
                    natively_done = True
                    break
        if natively_done:
            self._complete(native.outcome())  # a no-op if another settler claimed it
        if self._end is not None:
            return True
        # Not ended natively yet, or another thread is settling it: sleep
        # until the end is published (the settler wakes every waiter).
        ended = threading.Event()
        left = None if end is None else max(0.0, end - time.perf_counter())
        return not self._add_waiter(native, ended.set) or ended.wait(left)

    def _order_stream(self) -> bool:
        """:func:`order_stream`."""
        if self._batch is not None:
            self._flush()
        native = self._native
        if self._end is not None or native is None or not getattr(native, "stream_ordered", False):
            return False
        native.join_stream()  # type: ignore[attr-defined]
        return True

    def _abort_unlooked(self, why: str) -> bool:
        """Abort the op unless it has ended, with ``CommAborted`` saying
        ``why``; whether it did. Not a look: an op in an open batch is
        dropped, not sent."""
        if self._done():
            return False
        self._abort(CommAborted(f"{self.op} {why}", **self._ctx()))
        return True

    def _when_done(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` once the op's end is published: at once if it
        is, else on the thread that publishes it. A look at the op (it sends
        its batch): for the user's callbacks and futures."""
        if self._batch is not None:
            self._flush()
        self._on_end(callback)

    def _until_published(self) -> None:
        """After this thread aborted the op (or found it being ended): block,
        briefly, until its end is published, so that a caller who gets the
        error (or a ``CancelledError``) back finds its tensors no longer
        written. Only a stopped Gloo op is still running here, for a
        millisecond or two; past :data:`core.STOP_WAIT` it is published anyway
        (:meth:`_overdue`)."""
        if self._end is not None or self._table.runtime.in_loop_thread():
            return  # on the owner loop, blocking would hold up _overdue itself
        if not self._block(core.STOP_WAIT + 0.5):
            log.warning(
                "ftcomm: %r did not end within %g s of its group being stopped",
                self,
                core.STOP_WAIT + 0.5,
            )


# -- for the layers above the op core (ftcomm.gather, the c10d facade) -----------
# What they do with a Work beyond its public calls: package-internal.


def look_at(works: Iterable[Work[Any]]) -> None:
    """Look at each of ``works``, in order: every open batch one waits in is
    sent (a point of the program's order, as an ``await`` is)."""
    for work in works:
        if work._batch is not None:
            work._flush()


def abort_unended(works: Iterable[Work[Any]], why: str) -> None:
    """Abort every op of ``works`` not ended (each breaks its group) with
    ``CommAborted`` saying ``why``, then wait, once for all, until their
    errors are out. Not a look: an op in an open batch is dropped, not sent."""
    aborted = [work for work in works if work._abort_unlooked(why)]
    for work in aborted:
        work._until_published()


def outcome(work: Work[Any]) -> Outcome:
    """The op's published outcome (it has ended)."""
    return work._outcome()


def wait_blocking(work: Work[R], seconds: float | None, *, abort_on_timeout: bool) -> R:
    """:meth:`Work.wait` for a caller that may block a running loop (c10d's
    ``wait()`` blocks whatever thread calls it)."""
    return work._wait(seconds, abort_on_timeout=abort_on_timeout)


def when_done(work: Work[Any], callback: Callable[[], object]) -> None:
    """Call ``callback()`` once the op's end is published (a look at it)."""
    work._when_done(callback)


def order_stream(work: Work[Any]) -> bool:
    """c10d's ``wait()`` for an accelerator op that has not ended: make the
    calling thread's current stream wait for its device work, instead of
    the CPU (the owner loop still holds its deadline). Whether it did.
    A look at the op either way, whether it waits or not."""
    return work._order_stream()
