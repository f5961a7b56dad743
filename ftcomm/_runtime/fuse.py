"""Small allreduces fused into one native op: a :class:`Batch` and its members.

Owns :class:`Batch` (an open run of fusible allreduces, sent as **one**
native allreduce of a private flat buffer at a cut point; its states are in
its docstring), :class:`MemberOp` (a member's view of it: each keeps its own
``Work``, seq, deadline and result, its tensor written once, by the copy
back, only if the batch succeeded and no settler abandoned it) and
:class:`AloneMark`. Where a batch is cut, and why every rank cuts alike:
``_issue.py`` and docs/fusion.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .loop import LoopPoller
from .native import Done, NativeOp, without_tracebacks
from .table import EARLY, AbandonAbort, CutPoint, OpRecord, complete, end_all, peek

if TYPE_CHECKING:
    from .table import OpTable

OPEN, SENT, DONE, DROPPED = "open", "sent", "done", "dropped"

TRANSITIONS: dict[tuple[str, str], str] = {
    ("send", OPEN): SENT,
    ("drop", OPEN): DROPPED,
    ("conclude", SENT): DONE,
}

MAX_OP_FRACTION = 16
"""An allreduce joins a batch only if its tensor holds at most 1/16 of the
batch's byte cap (``fuse_bytes``): larger ops go on the wire at once."""

CopyBack = Callable[[list[torch.Tensor], torch.Tensor], None]
"""``copy_back(tensors, flat)``: write each tensor's slice of ``flat`` into it
(done before the batch is DONE: a device backend waits for the copies)."""


def copy_back_cpu(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """The default :data:`CopyBack`: every slice in one call, on this thread.
    One-dimensional members (each exactly its slice's shape, so nothing is
    resized) take ``split_with_sizes_copy``, which makes no view per member
    (a third less time for 1000 of them); others a view each and one
    ``_foreach_copy_``."""
    sizes = [t.numel() for t in tensors]
    # As a native op writes them: not recorded by autograd (a parameter that
    # requires grad is written as c10d writes it, whatever its shape), and in
    # inference mode, where tensors made in it (an eval loop's metrics) may
    # be written as well as any other.
    with torch.inference_mode():
        if all(t.dim() == 1 for t in tensors):
            torch.split_with_sizes_copy(flat, sizes, out=tensors)
            return
        views = flat.split(sizes)  # type: ignore[no-untyped-call]
        torch._foreach_copy_([t.view(-1) for t in tensors], views)


class Batch(CutPoint):
    """An open run of fusible allreduces of one key (dtype and reduce op; host
    tensors only), and then the one native op they share.

    Its life, under its own lock, every transition in :meth:`_go`
    (:data:`TRANSITIONS`)::

        event       from   to       who
        ---------   ----   -------  ------------------------------------------
        send        OPEN   SENT     the group, under its issue lock, before
                                    the native issue (so an abandon meanwhile
                                    is seen)
        drop        OPEN   DROPPED  a member's settler (abandon), before it was
                                    sent
        conclude    SENT   DONE     the first to see the native op ended (a
                                    poll, a peek, its completion callback) or
                                    refused; the copy back happens here, under
                                    the lock

    A member's outcome is read only once the batch is DONE or DROPPED.
    """

    __slots__ = (
        "_abandoned",
        "_announced",
        "_armed",
        "_callbacks",
        "_copy_back",
        "_ended",
        "_error",
        "_first",
        "_flat",
        "_lock",
        "_native",
        "_polled_at",
        "_sleepers",
        "_spin_loop",
        "_spinner",
        "_timed_out",
        "_want_arm",
        "deadline",
        "dtype",
        "end_window",
        "ended_at",
        "members",
        "nbytes",
        "op",
        "sender",
        "state",
        "table",
        "tensors",
    )

    def __init__(
        self,
        table: OpTable,
        dtype: torch.dtype,
        op: Any,
        sender: Callable[[Batch], None],
        copy_back: CopyBack = copy_back_cpu,
    ) -> None:
        self.table = table
        self.dtype = dtype
        self.op = op  # the reduce op
        self.sender = sender  # sends this batch in program order (the group's issue lock)
        self._copy_back = copy_back
        self.members: list[OpRecord[Any]] = []
        self.tensors: list[torch.Tensor] = []
        self.nbytes = 0
        self.deadline = float("inf")  # the earliest of its members'
        self.state = OPEN
        self._lock = threading.Lock()
        self._native: NativeOp | None = None
        self._flat: torch.Tensor | None = None
        self._first: OpRecord[Any] | None = None  # the earliest deadline's member, once asked
        self._error: BaseException | None = None  # the native op's, or its refusal
        self._abandoned = False  # a member's settler gave up on it while SENT
        self._timed_out = False  # its native op failed at the batch's deadline
        self._callbacks: list[tuple[MemberOp, Done]] = []
        self._armed = False  # on the native op's completion callback
        self._want_arm = False  # arm it once sent (arm() came before)
        self._announced = False
        self._ended = threading.Event()  # DONE or DROPPED: blocked threads wake
        self._spinner = False  # a member's await polls it (the others sleep)
        self._spin_loop: asyncio.AbstractEventLoop | None = None
        # awaits asleep until it is over (or a member failed): (loop, future)
        self._sleepers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._polled_at = 0.0
        self.ended_at: float | None = None
        self.end_window: float | None = None

    def __repr__(self) -> str:
        return f"<ftcomm batch of {len(self.members)} allreduce {self.state}>"

    def _go(self, event: str) -> None:
        """The one place a batch changes state (under its lock)."""
        to = TRANSITIONS.get((event, self.state))
        if to is None:  # a bug in ftcomm
            raise RuntimeError(f"batch: {event!r} is not allowed in state {self.state!r}")
        self.state = to

    # -- the group's side (under its issue lock) -----------------------------
    def add(self, work: OpRecord[Any], tensor: torch.Tensor, nbytes: int) -> None:
        """A member joins (OPEN); its native op is a :class:`MemberOp` of this."""
        self.members.append(work)
        self.tensors.append(tensor)
        self.nbytes += nbytes
        if work.deadline < self.deadline:
            self.deadline = work.deadline

    def begin_send(self) -> bool:
        """OPEN -> SENT; False if a settler dropped it first."""
        with self._lock:
            if self.state is not OPEN:
                return False
            self._go("send")
            self.sender = _sent  # let go of the group: a kept op must not keep it
            return True

    def pack(self) -> torch.Tensor:
        """The flat buffer the native op reduces in place: a private copy, so
        only the copy back writes into the members' tensors."""
        ts = self.tensors
        with torch.no_grad():  # a plain buffer, even from tensors that require grad
            if len(ts) == 1:
                flat = ts[0].reshape(-1).clone()
            elif all(t.dim() == 1 for t in ts):  # one call, no view per tensor
                flat = torch.cat(ts)
            else:
                flat = torch.cat([t.view(-1) for t in ts])
        self._flat = flat
        return flat

    def sent(self, native: NativeOp) -> Callable[[], None] | None:
        """The native op is on the wire. If a settler abandoned the batch while
        it was being issued, stop it now (the settler's intent). Returns what
        to run once the issue lock is released (arming the completion
        callback, which may run at once and run the members' callbacks)."""
        with self._lock:
            self._native = native
            self._polled_at = time.perf_counter()
            abandoned = self._abandoned
            arm = (self._want_arm or bool(self._callbacks)) and not self._armed
            self._armed = self._armed or arm
        if abandoned:
            abandon = getattr(native, "abandon", None)
            if abandon is not None:
                abandon()
        if arm:
            return lambda: native.on_done(self._native_done)
        return None

    def refuse(self, error: BaseException) -> Callable[[], None]:
        """The native issue failed: DONE with ``error``. Returns what to run
        once the issue lock is released (the members' callbacks)."""
        with self._lock:
            self._error = error
            self.ended_at, self.end_window = time.perf_counter(), 0.0
            self._go("conclude")
            self._ended.set()
        self.wake_sleepers()
        return self._announce

    # -- a member's native op ------------------------------------------------
    def flush(self) -> None:
        """Send it now if it is still open (a member is being looked at)."""
        if self.state is OPEN:
            self.sender(self)

    def _over(self) -> bool:
        """DONE or DROPPED (one read of the state)."""
        state = self.state
        return state is DONE or state is DROPPED

    def poll(self) -> bool:
        if self._over():
            return True
        native = self._native
        if native is None:  # OPEN, being issued, or concluded just now
            return self._over()
        if not native.poll():
            self._polled_at = time.perf_counter()
            return False
        if self._conclude():
            self._announce()
        return True

    def peek(self) -> bool:
        """:meth:`poll` without running anyone's callbacks (a break uses it)."""
        if self._over():
            return True
        native = self._native
        if native is None:  # OPEN, being issued, or concluded just now
            return self._over()
        if not peek(native):
            return False
        self._conclude()  # the copy back, if it succeeded; callbacks come from its own
        return True

    def on_done(self, member: MemberOp, callback: Done) -> None:
        with self._lock:
            if self.state is SENT or self.state is OPEN:
                self._callbacks.append((member, callback))
                native = self._native
                arm = native is not None and not self._armed
                self._armed = self._armed or arm
                now = False
            else:
                arm, now = False, True
        if now:
            callback(self.outcome_for(member.work))
        elif arm:
            assert native is not None  # for mypy: checked under the lock
            native.on_done(self._native_done)

    def arm(self) -> None:
        """Have the native op's completion callback end the batch, and its
        members with it (``end_all``, or a break), for members nobody polls:
        their waiters (``asyncio.gather``'s done-callbacks, a blocked thread)
        sleep. One callback for the batch, not one per member."""
        if self._armed:  # set once, under the lock: the other members' calls
            return
        with self._lock:
            if self._armed or self._over():
                return
            native = self._native
            if native is None:  # OPEN or being issued: sent() arms it
                self._want_arm = True
                return
            self._armed = True
        native.on_done(self._native_done)

    def abandon(self) -> bool:
        """A member's settler gives the batch up (the group is breaking):
        nothing will be copied back. Stops the native op if it is on the
        wire; whether it was stopped and ends shortly (see NativeOp)."""
        native: NativeOp | None = None
        with self._lock:
            state = self.state
            if state is OPEN:
                # The settler breaks the group next, which ends every member;
                # callbacks (a race with an observer) are not needed for that.
                self._go("drop")
                self.sender = _sent
                # the group keeps it until the next send: not its ops and tensors
                self.tensors, self.members = [], []
                self._announced, self._callbacks = True, []
                self._ended.set()
                sleepers, self._sleepers = self._sleepers, []
            elif state is SENT:
                self._abandoned = True
                native = self._native  # None while being issued: sent() stops it
        if state is OPEN:
            _wake(sleepers)
        if native is None:
            return False
        abandon = getattr(native, "abandon", None)
        return bool(abandon()) if abandon is not None else False

    def wait(self, seconds: float) -> bool:
        """Block up to ``seconds`` until the batch is over; whether it is."""
        if self._over():
            return True
        native = self._native
        wait = getattr(native, "wait", None) if native is not None else None
        if wait is not None:
            if wait(seconds):
                self.poll()
        else:
            self.arm()
            self._ended.wait(seconds)
        return self._over()

    def poll_on(self, loop: asyncio.AbstractEventLoop, spin: float) -> None:
        """For members whose waiters are done-callbacks on ``loop``
        (``asyncio.gather``): have ``loop`` poll the batch, once per
        iteration for ``spin`` seconds, as an awaiting member does, then
        arm the native completion callback. Nobody else polls: without
        this, Gloo's thread would end the batch, and wait up to the
        interpreter's switch interval (5 ms) for the GIL the loop holds
        while it registers the other members' callbacks."""
        if not self.take_spin(loop):  # polled already (an await, an earlier call)
            if loop is not self._spin_loop:
                self.arm()  # that poller may be held up: the callback ends it too
            return
        LoopPoller(loop, spin, self.poll, self._poller_left).start()

    def _poller_left(self) -> None:
        """The loop's poll of :meth:`poll_on` is over: an await polls it from
        now on, or the native completion callback ends it."""
        self.spinner_left()
        self.arm()

    # -- awaits of many members (fuse.py's answer to 1000 tasks spinning) -----
    def take_spin(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether the calling await (on ``loop``) should poll the batch (the
        first one does); the others :meth:`sleep` until it is over."""
        if self._spinner:
            return False
        self._spinner, self._spin_loop = True, loop
        return True

    def spinner_left(self) -> None:
        """The polling await ended without the batch (closed, cancelled):
        the sleepers wake, and one of them polls it from now on."""
        self._spinner = False
        self.wake_sleepers()

    def sleep(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None] | None:
        """A future (on ``loop``, the caller's) completed once the batch is
        over or one of its members failed; ``None`` if it is over already.
        The spinning await ends the batch: by its poll, or, once its spin
        is over, by the native completion callback it arms; if it is
        cancelled, the group is aborted, and a member's failure wakes these."""
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._over():
                return None
            self._sleepers.append((loop, fut))
        if loop is not self._spin_loop:
            # On another loop than the polling await (which may be held up),
            # the native completion callback ends it too.
            self.arm()
        return fut

    def wake_sleepers(self) -> None:
        """Wake every sleeping await (the batch is over, or a member failed:
        each then looks at its own op). Any thread; runs no user code."""
        with self._lock:
            sleepers, self._sleepers = self._sleepers, []
        if sleepers:
            _wake(sleepers)

    # -- the end -------------------------------------------------------------
    def _native_done(self, error: BaseException | None) -> None:
        """The native op's completion callback (any thread). Its outcome is
        the one passed: a Gloo work's own is not readable yet (native.py)."""
        self._conclude((error,))
        self._announce()

    def _conclude(self, given: tuple[BaseException | None] | None = None) -> bool:
        """SENT -> DONE, once: the native outcome (``given`` by its callback,
        else read from it) and, on a success nobody abandoned, the copy back.
        Whether this call did it."""
        with self._lock:
            if self.state is not SENT:
                return False
            native = self._native
            assert native is not None  # SENT with a native op: it was seen ended
            now = time.perf_counter()
            error = native.outcome() if given is None else given[0]
            if error is None and not self._abandoned:
                flat = self._flat
                assert flat is not None  # packed before the issue
                try:
                    self._copy_back(self.tensors, flat)
                except Exception as exc:  # a device error: the members fail with it
                    # Without its traceback: its frames (this one's native op,
                    # the flat buffer, the batch and its tensors) would live
                    # as long as the error, in errored() until configure().
                    error = without_tracebacks(exc)
            self._error = error
            self._timed_out = error is not None and time.monotonic() >= self.deadline - EARLY
            ended_at = getattr(native, "ended_at", None)
            if ended_at is not None:  # the native op's own (a worker's reply, an event's poll)
                self.ended_at = ended_at
                self.end_window = getattr(native, "end_window", None) or 0.0
            else:
                self.ended_at = now
                self.end_window = 0.0 if given is not None else now - self._polled_at
            self._go("conclude")
            # Let go of the native op (and through it the native group): an
            # op its caller keeps must not keep the group's sockets open.
            self._flat, self._native = None, None
            self._ended.set()
        self.wake_sleepers()
        return True

    def _earliest(self) -> OpRecord[Any]:
        """The member whose deadline is the batch's (the first such)."""
        first = self._first
        if first is None:
            first = self._first = min(self.members, key=lambda w: w.deadline)
        return first

    def _announce(self) -> None:
        """Once DONE or DROPPED (once): on a success, end every member that
        has not ended, under one hold of the group's lock; then call the
        members' completion callbacks."""
        with self._lock:
            if self._announced:
                return
            self._announced = True
            callbacks, self._callbacks = self._callbacks, []
            succeeded = self.state is DONE and self._error is None and not self._abandoned
            failed = self.state is DONE and self._error is not None and not self._abandoned
        if succeeded:
            ended_at, window = self.ended_at, self.end_window
            assert ended_at is not None  # set when it concluded
            end_all(self.table, self.members, ended_at, window or 0.0)
        elif failed and self.members:
            # The batch's own failure breaks the group now, through the member
            # whose deadline is the batch's (a timeout: its CommTimeout), not
            # whenever someone looks at it: its batch-mates then end with the
            # same typed error, each naming its own op and seq.
            first = self._earliest()
            complete(first, self.outcome_for(first))
        for member, callback in callbacks:
            callback(self.outcome_for(member.work))
        # The members' tensors are theirs again: a member kept by its caller
        # must not keep the whole batch's.
        self.tensors = []

    def outcome_for(self, work: OpRecord[Any]) -> BaseException | None:
        """A member's outcome (DONE or DROPPED): ``None`` only if the batch
        succeeded, was copied back, and nobody abandoned it."""
        state = self.state
        if state is DONE and self._error is None and not self._abandoned:
            return None
        cause = self.table.error or self.table.stopping  # a break in the making, too
        why = f" ({cause.message})" if cause is not None else ""
        ctx: dict[str, Any] = {"rank": self.table.rank, "op": work.op, "seq": work.seq}
        if state is DROPPED:
            aborted = AbandonAbort(f"{work.op} was aborted before its batch was sent{why}", **ctx)
        elif self._abandoned:
            aborted = AbandonAbort(f"{work.op} was aborted: the group broke{why}", **ctx)
        elif self._timed_out and work is not (first := self._earliest()):
            aborted = AbandonAbort(
                f"{work.op} was aborted: its batch's native op timed out at the deadline "
                f"of {first.op} seq={first.seq}",
                **ctx,
            )
        else:
            return self._error  # the native error: each member maps it (its own op, seq)
        aborted.__cause__ = cause
        # Not the group's error (an AbandonAbort): the settler that gave the
        # batch up (or the member whose deadline passed) breaks the group
        # with the real cause.
        return aborted


def _sent(batch: Batch) -> None:
    """A sent (or dropped) batch's sender: nothing left to send."""


class AloneMark(CutPoint):
    """Held by a fusible op that went on its own (``OpRecord._batch``): the first
    look at it is a cut point, after which the next fusible op goes at once
    again (docs/fusion.md)."""

    __slots__ = ("_config",)
    kept_after_end = True

    def __init__(self, config: Any) -> None:
        self._config = weakref.ref(config)  # an op kept must not keep its group

    def flush(self) -> None:
        # Without the issue lock: a look may come from a callback that runs
        # while this thread holds it (a break during a verified op's issue
        # ends ops and calls their callbacks), and must not deadlock there.
        # None is needed: a look only ever sets the flag, and each issue
        # reads it once (under the lock) before it may write it, so a look
        # during an issue acts as if made just before or just after it --
        # which of the two is timing either way for a look from another
        # thread than the one issuing, lock or no lock.
        config = self._config()
        if config is not None:
            config.fuse_alone = True


def _set_all(futures: list[asyncio.Future[None]]) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_result(None)


def _wake(sleepers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]) -> None:
    """Complete the futures, one call per loop (on that loop's thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
    for loop, fut in sleepers:
        by_loop.setdefault(loop, []).append(fut)
    for loop, futures in by_loop.items():
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            _set_all(futures)
        else:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_set_all, futures)


class MemberOp:
    """One member's view of its batch: the native op its :class:`Work` holds."""

    __slots__ = ("batch", "work")

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.work: OpRecord[Any]  # set once its Work is made

    def poll(self) -> bool:
        return self.batch.poll()

    def peek(self) -> bool:
        return self.batch.peek()

    def outcome(self) -> BaseException | None:
        return self.batch.outcome_for(self.work)

    def on_done(self, callback: Done) -> None:
        self.batch.on_done(self, callback)

    def abandon(self) -> bool:
        return self.batch.abandon()

    def member_failed(self) -> None:
        """Its op ended with an error (``OpRecord``'s end): the batch's
        sleeping awaits wake and look at their own ops."""
        self.batch.wake_sleepers()

    def wait(self, seconds: float) -> bool:
        return self.batch.wait(seconds)

    @property
    def ended_at(self) -> float | None:
        return self.batch.ended_at

    @property
    def end_window(self) -> float | None:
        return self.batch.end_window
