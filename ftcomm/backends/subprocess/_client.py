"""The parent's handle on one worker process.

Owns :class:`WorkerProcess` (the process, its socket, its shared memory, its
ops in flight by op id, its death; its rules are in its docstring), :class:`Call`
(one op in flight) and how a worker's exit reads as an error. See
docs/subprocess.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from ..._protocol import (
    Configure,
    Done,
    Failed,
    Frame,
    Ready,
    Scalar,
    encode_op,
)
from ..._runtime.loop import Runtime
from ..._store import ConnectProgress
from ...errors import CommAborted, CommError, CommFailed, ProtocolError, WorkerDied
from .._base import ConnectSpec
from . import _worker
from ._channel import Channel
from ._pool import Pool, Staged

log = logging.getLogger("ftcomm")

_ids = itertools.count(1)
_INLINE_COPY = 1 << 20
"""Outputs up to this many bytes are copied back on the owner loop; larger
ones on a worker thread, so the loop is never held for long."""
_CHUNK = 1 << 20
"""Outputs are copied back this many bytes at a time, checking in between
that the op has not been abandoned."""
_EOF_GRACE = 0.5
"""How long a worker that closed its socket may take to exit before it is killed."""
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])


def starting(progress: ConnectProgress) -> None:
    """A worker process is starting for this connect: what its deadline says."""
    progress.step, progress.detail = (
        "worker",
        "the worker process was still starting; a fresh Python and torch take a second "
        "or more: give configure() more time",
    )


def connecting(progress: ConnectProgress) -> None:
    """The worker is READY and builds the group: what its deadline says."""
    progress.step, progress.detail = "worker-connect", "the worker process was still connecting"


def _worker_timeout(remaining: float) -> float:
    """The worker's configure timeout: what is left of ours, less a tenth
    of it (at most 0.2 s) for its error to reach us first."""
    return max(0.0, remaining - min(0.2, 0.1 * remaining))


class RemoteError(RuntimeError):
    """An op failed inside the worker.

    Attributes:
        remote_type: the name of the worker's exception class.
        remote_traceback: the worker's traceback, as text.
    """

    def __init__(self, frame: Failed) -> None:
        super().__init__(f"{frame.type}: {frame.message}")
        self.remote_type = frame.type
        self.remote_traceback = frame.traceback


def describe_exit(code: int) -> tuple[str, int | None, int | None]:
    """(how the worker ended, exit code, signal) from a Popen return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the worker was killed by {name}", None, -code
    what = {
        _worker.EXIT_OK: "exited",
        _worker.EXIT_ORPHANED: "exited: its socket to the parent closed",
        _worker.EXIT_ABORTED: "exited on ABORT",
        _worker.EXIT_PROTOCOL: "exited on a malformed frame",
    }.get(code, "exited")
    return f"the worker {what} (exit code {code})", code, None


class Call:
    """One op sent to the worker: the :class:`~ftcomm._runtime.native.NativeOp`
    of the subprocess backend."""

    __slots__ = (
        "_abandoned",
        "_callbacks",
        "_copy_lock",
        "_copying",
        "_done",
        "_error",
        "_worker",
        "ended_at",
        "op_id",
        "staged",
    )

    def __init__(self, worker: WorkerProcess, op_id: int, staged: Staged) -> None:
        self._worker = worker
        self.op_id = op_id
        self.staged = staged
        self._done = False
        self._copying = False  # a success whose outputs are being copied back
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[BaseException | None], None]] = []
        self._copy_lock = threading.Lock()
        self._abandoned = False  # the op ended with an error: copy nothing back
        self.ended_at: float | None = None
        """``time.perf_counter()`` when it ended (its reply, its copy-back):
        the end its latency is measured to (``Work``, observe.py)."""

    spin = 0.0
    """How long a waiter polls before it sleeps (``Work`` reads it): not at
    all. The op runs in another process that needs the core more than a
    poller does (measured, 2 ranks on 2 cores: p50 ~700 us polling 2 ms,
    ~600 us not polling)."""

    def poll(self) -> bool:
        if self._done:
            return True
        worker = self._worker
        if worker.death is not None:
            return not self._copying
        # Read the reply here if it has come: this thread is spinning on it
        # anyway, and the owner loop need not wake up to hand it over.
        worker.channel.pump()
        return self._done

    def peek(self) -> bool:
        """:meth:`poll` without reading the socket, which may end other calls
        (and run their callbacks) on this thread: what a break uses."""
        if self._done:
            return True
        return self._worker.death is not None and not self._copying

    def outcome(self) -> BaseException | None:
        return self._error if self._done else self._worker.death

    def abandon(self) -> None:
        """The op has ended with an error: never copy its outputs back. Waits for
        a chunk being copied (at most ``_CHUNK`` bytes), so that nothing is
        written into the caller's tensors once this returns."""
        with self._copy_lock:
            self._abandoned = True

    def on_done(self, callback: Callable[[BaseException | None], None]) -> None:
        with self._worker.lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self._error)

    def finish(self, error: BaseException | None, *, copied: bool = False) -> None:
        """End the call once. ``copied``: from the copy-back, which has
        unpinned already; it stops counting as copying in the same step as
        the call ends, so that a worker dying in between cannot make a
        complete success look failed (``poll`` reads ``_copying``)."""
        with self._worker.lock:
            if copied:
                self._copying = False
            if self._done:
                return
            unpin = not self._copying and not copied  # else the copy-back unpins
            self._error = error
            self.ended_at = time.perf_counter()
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        if unpin:
            self.staged.unpin()
        for callback in callbacks:
            callback(error)


def _kill(pidfd: int, lock: threading.Lock, closed: list[bool]) -> None:
    with lock:
        if not closed[0]:
            with contextlib.suppress(ProcessLookupError):  # exited already
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)


def _reap(
    proc: subprocess.Popen[bytes],
    pidfd: int,
    lock: threading.Lock,
    closed: list[bool],
    pool: Pool,
    owner: int,
) -> None:
    """Kill and wait for a worker nobody watches any more (finalizer, exit).

    Only in the process that started it: a forked child that exits runs its
    parent's finalizers too, and must leave the parent's worker alone.
    """
    if os.getpid() != owner:
        return
    _kill(pidfd, lock, closed)
    try:
        proc.wait(5.0)
        reaped = True
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not take 5 s
        log.warning("ftcomm worker %d did not exit after SIGKILL", proc.pid)
        reaped = False
    pool.close(reaped)  # reaped: the IPC references it held can go back (_device.py)
    with lock:
        if not closed[0]:
            closed[0] = True
            os.close(pidfd)


class WorkerProcess:
    """A worker process, its socket, its shared memory and the ops in flight on it.

    Rules:

    1. Op ids come from one process-wide counter and are never reused, so a
       reply can only ever match the request it answers. A reply whose op id
       is not in flight (its op was abandoned, its worker replaced) is dropped
       and counted, never given to another op.
    2. Requests are written by the issuing thread (see :mod:`._channel`);
       replies are read by a thread polling for one, or else by the owner
       loop, which copies outputs back and ends the op (large copies go to a
       worker thread from the loop). Outputs reach the caller's tensors only
       on success.
    3. The worker's exit is seen through a pidfd on the owner loop, at once,
       whether or not an op is in flight. Its end of the socket closing is the
       other sign: the worker is killed if it has not exited a moment later.
       Every op in flight then fails with :class:`~ftcomm.errors.WorkerDied`
       (exit code or signal), or :class:`~ftcomm.errors.ProtocolError` if a
       malformed frame, either way, is why it ended, and the owner hears of it
       through ``on_break``, with or without ops in flight.
    4. Killing is ``pidfd_send_signal``: it can never reach a reused pid. A
       worker still running when its handle is collected, or at interpreter
       exit, is killed too; and a worker whose parent dies sees its socket
       close and exits.
    """

    def __init__(self, backend: str, runtime: Runtime) -> None:
        parent_end, child_end = socket.socketpair()
        env = dict(os.environ)
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + path if path else "")
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __package__,
                    str(child_end.fileno()),
                    backend,
                    str(os.getpid()),
                ],
                pass_fds=(child_end.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        self.pid = self.proc.pid
        self.pidfd = os.pidfd_open(self.pid)
        self.lock = threading.Lock()
        self._pidfd_closed = [False]
        self.channel = Channel(parent_end)
        self.channel.bind(runtime.loop)
        self.pool = Pool()
        self.death: CommError | None = None
        self.exited: concurrent.futures.Future[None] = concurrent.futures.Future()
        """Completes once the worker has exited and been reaped, and its
        socket and shared memory are closed."""
        self.dropped = 0
        """Replies that matched no op in flight (and were dropped)."""
        self.on_break: Callable[[CommError], None] | None = None
        self._calls: dict[int, Call] = {}
        self._ready = False
        self._killed = False  # by us, on purpose
        self._reason: CommError | None = None  # why we killed it, if not on purpose
        self._runtime = runtime
        self._finalizer = weakref.finalize(
            self,
            _reap,
            self.proc,
            self.pidfd,
            self.lock,
            self._pidfd_closed,
            self.pool,
            os.getpid(),
        )

    def __repr__(self) -> str:
        state = "dead" if self.death is not None else "alive"
        return f"<ftcomm worker pid={self.pid} {state} in_flight={len(self._calls)}>"

    # -- handshake (a control thread) ---------------------------------------------
    def ready(self, deadline: float) -> None:
        """Wait for the worker's READY (once).

        Raises:
            TimeoutError: it did not come by ``deadline``.
            EOFError: the worker exited.
            ProtocolError: it sent something else.
        """
        if not self._ready:
            frame = self.channel.read_frame(deadline)
            if not isinstance(frame, Ready) or frame.pid != self.pid:
                raise ProtocolError(f"expected READY from pid {self.pid}, got {frame}")
            self._ready = True

    def configure(self, spec: ConnectSpec, deadline: float) -> None:
        """Wait for READY, then build the group in the worker.

        Raises:
            TimeoutError: the worker did not start or configure by ``deadline``.
            EOFError: the worker exited.
            ProtocolError: it sent a malformed frame.
            RemoteError: building the group failed in the worker.
        """
        starting(spec.progress)
        self.ready(deadline)
        connecting(spec.progress)
        op_id = next(_ids)
        s = spec
        self.channel.send_blocking(
            Configure(
                op_id,
                str(s.store),
                s.rank,
                s.world_size,
                # A little before ours: the worker's own timeout, which says
                # what it waited for, reaches the parent before its deadline.
                _worker_timeout(deadline - time.monotonic()),
                s.replica_id,
                s.quorum_id,
                s.group_rank,
                s.group_world_size,
                s.global_ranks,
                s.device,
            ),
            deadline,
        )
        reply = self.channel.read_frame(deadline)
        if isinstance(reply, Failed) and reply.op_id == op_id:
            raise RemoteError(reply)
        if not isinstance(reply, Done) or reply.op_id != op_id:
            raise ProtocolError(f"expected the reply to CONFIGURE {op_id}, got {reply}")

    def start(self) -> None:
        """Hand the worker to the owner loop: replies and its exit are read there."""
        self._runtime.call_soon(self._watch)

    def _watch(self) -> None:
        loop = self._runtime.loop
        with self.lock:
            if self._pidfd_closed[0]:
                return
            loop.add_reader(self.pidfd, self._exited)
        self.channel.start(loop, self._on_frames, self._on_eof, self._on_protocol_error)

    def abandon(self) -> None:
        """Kill the worker and wait for it here (a thread that may block)."""
        self._killed = True
        self.channel.close()
        self._finalizer()  # kills, reaps, then closes the pool (if not done already)
        self.pool.close()
        self._mark_exited()

    # -- ops (any thread) ---------------------------------------------------------
    def submit(self, op: str, staged: Staged, options: dict[str, Scalar]) -> Call:
        """Send one OP; the returned call ends with the worker's reply.

        The call is registered only once its frame is encoded, and whatever
        happens, nothing of it stays behind: a frame that cannot be encoded
        or that the socket refuses leaves no call in flight, no pin, and its
        segment back in the pool (:meth:`Pool.unstage`).

        Raises:
            ValueError: the op cannot be put in a frame (a payload over the
                protocol's cap, say); nothing was sent.
        """
        op_id = next(_ids)
        try:
            frame = encode_op(op_id, op, staged.descs, options)
        except ProtocolError as exc:
            self.pool.unstage(staged)
            raise ValueError(
                f"{op}: the op does not fit in a frame to the worker: {exc.message}"
            ) from exc
        except BaseException:
            self.pool.unstage(staged)
            raise
        call = Call(self, op_id, staged)
        with self.lock:
            death = self.death
            if death is None:
                self._calls[op_id] = call
        if death is not None:
            call.finish(death)  # its pool is closed: the segment goes with it
            return call
        try:
            self.channel.send_bytes(
                frame,
                staged.fds,
                owner=staged.owners,
                refused=functools.partial(self._refused, call),
            )
        except BaseException as exc:
            # Nothing of the frame went out (send_bytes raises before it
            # writes); a reply cannot come. The segment stays out of the pool
            # all the same (an interrupt may have come after the write).
            with self.lock:
                self._calls.pop(op_id, None)
            if isinstance(exc, OSError):  # the worker is going: the owner loop says how
                call.finish(self.death or WorkerDied("the worker's socket is closed", pid=self.pid))
                return call
            call.finish(CommAborted(f"{op} was interrupted while it was sent to the worker"))
            raise
        return call

    def _refused(self, call: Call, error: OSError) -> None:
        """The socket refused ``call``'s frame (its descriptors): that op
        fails, and only it; the worker never saw it (any thread)."""
        with self.lock:
            if self._calls.pop(call.op_id, None) is None:  # it has ended already
                return
        self.pool.unstage(call.staged)
        call.finish(
            CommFailed(
                f"the op could not be passed to the worker: the socket refused "
                f"its file descriptors ({error})"
            )
        )

    def failed(self, cause: BaseException) -> Call:
        """A call that never went out: it ends at once, with the worker's
        death if there is one, else with ``cause``."""
        call = Call(self, next(_ids), Staged(None, (), []))
        error = self.death or RuntimeError(f"the op could not be staged: {cause}")
        call.finish(error)
        return call

    def kill(self) -> None:
        """Kill the worker on purpose; non-blocking. Its ops end with ``CommAborted``."""
        self._killed = True
        _kill(self.pidfd, self.lock, self._pidfd_closed)

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    # -- owner loop ------------------------------------------------------------------
    def _on_frames(self, frames: list[Frame]) -> None:
        inline = _INLINE_COPY if self.channel.on_loop else None  # None: no limit
        for frame in frames:
            if not isinstance(frame, (Done, Failed)):
                self._on_protocol_error(
                    ProtocolError(f"the worker sent an unexpected {type(frame).__name__} frame")
                )
                return
            if frame.op_id == 0 and isinstance(frame, Failed):
                # The worker rejected something we sent, and exits.
                cls = ProtocolError if frame.type == "ProtocolError" else WorkerDied
                self._reason = cls(f"the worker failed: {frame.type}: {frame.message}")
                self._kill_later()
                return
            with self.lock:
                call = self._calls.pop(frame.op_id, None)
            if call is None:
                if isinstance(frame, Done) and frame.event:  # the worker holds it for us
                    self.pool.device.acknowledge(frame.op_id)
                self.dropped += 1
                log.debug("ftcomm worker %d: dropped a reply to op %d", self.pid, frame.op_id)
                continue
            segment = call.staged.segment
            if segment is not None:
                segment.unlink()  # the worker has it mapped: the name can go
            device = call.staged.device
            if isinstance(frame, Done) and (device is not None) != bool(frame.event):
                error = ProtocolError(
                    f"op {frame.op_id}: a DONE's event does not match its tensors"
                )
                call.finish(error)
                self._on_protocol_error(error)
                return
            if isinstance(frame, Failed):
                # Not back to the pool: a native op that failed by timing out
                # may still be running in the worker, on this segment.
                call.finish(RemoteError(frame))
            elif device is not None:  # CUDA: the caller's stream waits, not the CPU
                try:
                    self.pool.device.replied(frame.op_id, device, frame.event)
                except Exception as exc:  # the event could not be waited on
                    call.finish(exc)
                else:
                    call.finish(None)
            elif not call.staged.copy_back:
                self.pool.give_back(segment)
                call.finish(None)
            else:
                call._copying = True
                nbytes = sum(dst.numel() * dst.element_size() for dst, _ in call.staged.copy_back)
                if inline is None or nbytes <= inline:
                    if inline is not None:
                        inline -= nbytes  # the loop's budget for this batch
                    self._copy_back(call)
                else:
                    self._runtime.run_blocking(self._copy_back, call)

    def _copy_back(self, call: Call) -> None:
        """Copy an op's outputs into the caller's tensors, chunk by chunk,
        unless (and until) the op is abandoned; then end the call."""
        error: Exception | None = None
        try:
            # As a native op writes them: unrecorded by autograd, and into
            # tensors made in inference mode (an eval loop's metrics) too.
            with torch.inference_mode():
                for dst, src in call.staged.copy_back:
                    flat_dst, flat_src = dst.view(-1), src.view(-1)
                    step = max(1, _CHUNK // max(1, dst.element_size()))
                    for start in range(0, flat_dst.numel(), step):
                        with call._copy_lock:
                            if call._abandoned:
                                return  # it has ended already, with an error
                            flat_dst[start : start + step].copy_(flat_src[start : start + step])
        except Exception as exc:  # pragma: no cover - a copy between valid views
            log.exception("ftcomm worker %d: copying op %d's outputs failed", self.pid, call.op_id)
            # This op fails; the other replies of the batch go on. Without its
            # traceback: the op's error must not hold these frames (this
            # worker, its segments' descriptors) until a garbage collection.
            error = exc.with_traceback(None)
        finally:
            # Before the call ends: its waiter may issue the next op on the
            # same storage at once, and must find it unpinned.
            call.staged.unpin()
            self.pool.give_back(call.staged.segment)
        call.finish(error, copied=True)

    def _on_protocol_error(self, error: ProtocolError) -> None:
        self._reason = ProtocolError(f"the worker sent a malformed frame: {error.message}")
        _kill(self.pidfd, self.lock, self._pidfd_closed)

    def _on_eof(self) -> None:
        self._kill_later()

    def _kill_later(self) -> None:
        """Kill the worker if it has not exited in ``_EOF_GRACE`` (any thread)."""
        loop = self._runtime.loop
        self._runtime.call_soon(
            loop.call_later, _EOF_GRACE, _kill, self.pidfd, self.lock, self._pidfd_closed
        )

    def _exited(self) -> None:
        code = self.proc.poll()
        if code is None:  # another thread is reaping it: the pidfd stays readable, so
            return  # the loop calls us again
        text, exitcode, signum = describe_exit(code)
        if self._reason is not None:
            error: CommError = self._reason
        elif self._killed:
            error = CommAborted(f"the worker was stopped by its group ({text})")
        else:
            error = WorkerDied(text, exitcode=exitcode, signal=signum, pid=self.pid)
        self._die(error)

    def _die(self, error: CommError) -> None:
        with self.lock:
            self.death = error  # every call in flight polls as failed from here
            calls = list(self._calls.values())
            self._calls.clear()
            if not self._pidfd_closed[0]:
                self._runtime.loop.remove_reader(self.pidfd)
                self._pidfd_closed[0] = True
                os.close(self.pidfd)
        self._finalizer.detach()
        self.channel.close()
        self.pool.close()
        # Each call is dropped as it ends, not when this frame returns: a call
        # keeps its segment mapped (and the mapping keeps a descriptor open),
        # and whoever `exited` wakes may look for both at once (a leak check,
        # on another thread, while this one still runs).
        while calls:
            calls.pop(0).finish(error)
        on_break = self.on_break
        if on_break is not None and not self._killed:
            on_break(error)
        self._mark_exited()  # last: whoever waits for it sees the group errored

    def _mark_exited(self) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.exited.set_result(None)
