"""One end of the parent <-> worker socketpair: a thin shell around the codec.

Owns :class:`Channel`: frames out from any thread, in on one event loop or on
a thread that waits for a reply, file descriptors with them, and the backlog
of frames waiting for room in the socket. See docs/subprocess.md; the frames
themselves: docs/protocol.md.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..._protocol import MAX_PAYLOAD, Decoder, Frame, encode
from ...errors import ProtocolError

log = logging.getLogger("ftcomm")

_READ = 1 << 16
_MAX_FDS = 64

Refused = Callable[[OSError], None]
"""Told (on the loop, or the sending thread) that a frame's descriptors were
refused, and the frame dropped."""


@dataclass(slots=True)
class _Queued:
    """A frame (or its unsent rest) waiting for room in the socket."""

    data: bytes
    fds: tuple[int, ...] = ()
    owner: object = None
    """Keeps ``fds`` open until they are sent."""
    refused: Refused | None = None


class Channel:
    """Frames over one connected stream socket.

    Frames go out from any thread: ``send`` writes straight to the
    non-blocking socket under a lock (one syscall, no hop to the loop), and
    only when the socket's buffer is full does the rest wait in a backlog that
    the loop flushes, in order, since later frames queue behind it. Frames
    come in on one event loop (``add_reader``: no stream objects, no task per
    read), which hands them to the owner's callbacks together with
    end-of-stream and protocol errors. Before :meth:`start`, a thread may also
    exchange frames synchronously with a deadline (the READY/CONFIGURE
    handshake). A thread waiting for a reply may read too (:meth:`pump`).

    A frame may carry file descriptors (``SCM_RIGHTS``). One waiting in the
    backlog keeps whatever owns them alive until they are out (an fd number
    alone can be closed, or even reused, meanwhile). A frame whose descriptors
    the kernel refuses (``EBADF``, ``ETOOMANYREFS``, ...) is dropped whole
    (nothing of it was written: its descriptors go with its first byte), and
    its sender hears of it (``refused``); the frames behind it go on. Only the
    peer going away ends the channel.
    """

    def __init__(
        self, sock: socket.socket, max_payload: int = MAX_PAYLOAD, *, receive_fds: bool = False
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self._decoder = Decoder(max_payload)
        self._early: list[Frame] = []  # decoded by read_frame() past the one it returned
        self._lock = threading.Lock()
        self._pump_lock = threading.Lock()
        self._loop_thread: int | None = None
        self._backlog: collections.deque[_Queued] = collections.deque()
        self._fds: list[int] = []  # received with SCM_RIGHTS, not yet taken
        self._receive_fds = receive_fds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._reading = False
        self._on_frames: Callable[[list[Frame]], None] = lambda frames: None
        self._on_eof: Callable[[], None] = lambda: None
        self._on_error: Callable[[ProtocolError], None] = lambda error: None

    # -- before start(): a thread with a deadline ------------------------------
    def send_blocking(self, frame: Frame, deadline: float) -> None:
        """Write one frame, waiting for room until ``deadline`` (monotonic).

        Raises:
            TimeoutError: no room before the deadline.
            OSError: the peer is gone.
        """
        view = memoryview(encode(frame))
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the worker did not take a frame in time")
            _, writable, _ = select.select([], [self.fd], [], left)
            if writable:
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    view = view[self.sock.send(view) :]

    def read_frame(self, deadline: float) -> Frame:
        """Block until one frame arrives or ``deadline`` (monotonic) passes.

        Raises:
            TimeoutError: nothing complete arrived in time.
            EOFError: the peer closed its end.
            ProtocolError: the peer sent a malformed frame.
        """
        while not self._early:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the worker did not answer in time")
            readable, _, _ = select.select([self.fd], [], [], left)
            if not readable:
                continue
            try:
                data = self.sock.recv(_READ)
            except (BlockingIOError, InterruptedError):
                continue
            except ConnectionError:
                data = b""
            if not data:
                raise EOFError("the worker closed its end")
            self._early.extend(self._decoder.feed(data))
        return self._early.pop(0)

    # -- on a loop --------------------------------------------------------------
    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Name the loop that flushes a backlog (any thread, before :meth:`start`)."""
        self._loop = loop

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        on_frames: Callable[[list[Frame]], None],
        on_eof: Callable[[], None],
        on_error: Callable[[ProtocolError], None],
    ) -> None:
        """Read on ``loop`` from now on (call on its thread)."""
        with self._lock:
            if self._closed:
                return
            self._loop = loop
            self._loop_thread = threading.get_ident()
        self._on_frames, self._on_eof, self._on_error = on_frames, on_eof, on_error
        self._reading = True
        loop.add_reader(self.fd, self._readable)
        if self._early:
            early, self._early = self._early, []
            on_frames(early)

    def _readable(self) -> None:
        self.pump()

    def pump(self) -> bool:
        """Read and hand on what has arrived, without blocking, from any thread.

        The loop does this when the socket turns readable; a thread that is
        spinning on a reply may do it too and save a wake-up of the loop.
        Frames go to ``on_frames`` on the thread that read them (one reader
        at a time reads; a second one returns at once); the end of the stream
        and protocol errors always go to the loop. Returns whether frames came.
        """
        if not self._pump_lock.acquire(blocking=False):
            return False
        try:
            if not self._reading:
                return False
            try:
                data = self._recv() if self._receive_fds else self.sock.recv(_READ)
            except (BlockingIOError, InterruptedError):
                return False
            except ProtocolError as exc:
                self._end(exc)
                return False
            except OSError:  # reset by a peer that died: the same as its end closing
                data = b""
            if not data:
                self._end(None)
                return False
            try:
                frames = self._decoder.feed(data)
            except ProtocolError as exc:
                self._end(exc)
                return False
        finally:
            self._pump_lock.release()
        # Handed on outside the lock: what they wake may run user code (a
        # future's callbacks) that must not hold up the loop's reads. Two
        # readers may hand on their batches in either order; replies are
        # matched by op id, so order does not matter.
        if frames:
            self._on_frames(frames)
        return bool(frames)

    def _recv(self) -> bytes:
        """``recv`` that also keeps the descriptors that came with the bytes."""
        data, ancillary, flags, _ = self.sock.recvmsg(
            _READ, socket.CMSG_SPACE(_MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
        )
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError(f"more than {_MAX_FDS} descriptors came with one read")
        return data

    def _end(self, error: ProtocolError | None) -> None:
        loop = self._loop
        if loop is None:  # pragma: no cover - reading implies a loop
            return
        if threading.get_ident() != self._loop_thread:
            loop.call_soon_threadsafe(self._end, error)
            return
        if not self._reading:
            return
        self._stop_reading()
        if error is None:
            self._on_eof()
        else:
            self._on_error(error)

    def _stop_reading(self) -> None:
        if self._reading and self._loop is not None:
            self._reading = False
            self._loop.remove_reader(self.fd)

    @property
    def on_loop(self) -> bool:
        """Whether the calling thread is the loop's."""
        return threading.get_ident() == self._loop_thread

    def send(self, frame: Frame) -> None:
        """Write one frame from any thread, in call order; never blocks.

        Raises:
            ConnectionError: the channel is closed or the peer is gone.
        """
        self.send_bytes(encode(frame))

    def send_bytes(
        self,
        data: bytes,
        fds: Sequence[int] = (),
        *,
        owner: object = None,
        refused: Refused | None = None,
    ) -> None:
        """Write raw bytes (a frame, or on purpose, a corrupt one), and with
        them the file descriptors ``fds`` (``SCM_RIGHTS``: the peer gets copies).

        ``owner`` keeps ``fds`` open while the frame waits in the backlog.
        If the kernel refuses the descriptors, the frame is dropped and
        ``refused`` is called with the error, on this thread or later on the
        loop (without it, the error is raised here, or logged there).

        Raises:
            ConnectionError: the channel is closed or the peer is gone
                (nothing was written).
            OSError: the descriptors were refused and ``refused`` is ``None``
                (nothing was written).
            RuntimeError: the frame had to wait, and no loop was bound
                (:meth:`bind`) to flush it.
        """
        with self._lock:
            if self._closed:
                raise ConnectionResetError("the channel to the worker is closed")
            if self._backlog:  # in order: behind what waits already
                self._backlog.append(_Queued(data, tuple(fds), owner, refused))
                return
            try:
                sent = self._send(data, fds)
            except OSError as exc:
                if not fds or isinstance(exc, ConnectionError):
                    raise
                # This frame's descriptors: nothing of it went out. Without its
                # traceback, which would hold this frame (and ``refused``).
                error = exc.with_traceback(None)
            else:
                if sent == len(data):
                    return
                # The descriptors travel with the first byte sent.
                rest = _Queued(data[sent:]) if sent else _Queued(data, tuple(fds), owner, refused)
                self._backlog.append(rest)
                loop = self._loop
                if loop is None:
                    raise RuntimeError("Channel.send() before bind(): use send_blocking()")
                loop.call_soon_threadsafe(self._arm)
                return
        if refused is None:
            raise error
        try:
            refused(error)
        finally:
            del error

    def _send(self, data: bytes, fds: Sequence[int]) -> int:
        try:
            if fds:
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                return self.sock.sendmsg([data], rights)
            return self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0

    def _arm(self) -> None:
        with self._lock:
            if self._backlog and not self._closed and self._loop is not None:
                self._loop.add_writer(self.fd, self._flush)

    def _flush(self) -> None:
        dropped: list[tuple[_Queued, OSError]] = []
        try:
            with self._lock:
                while self._backlog:
                    queued = self._backlog[0]
                    try:
                        sent = self._send(queued.data, queued.fds)
                    except OSError as exc:
                        if queued.fds and not isinstance(exc, ConnectionError):
                            self._backlog.popleft()  # this frame only: the next ones go on
                            dropped.append((queued, exc.with_traceback(None)))
                            continue
                        self._backlog.clear()  # the peer is gone: the reader reports it
                        break
                    if sent < len(queued.data):
                        if sent:  # its descriptors are out: nothing to keep or refuse
                            self._backlog[0] = _Queued(queued.data[sent:])
                        return
                    self._backlog.popleft()
                if self._loop is not None:
                    self._loop.remove_writer(self.fd)
        finally:
            for queued, error in dropped:  # outside the lock: they may send again
                try:
                    if queued.refused is None:
                        raise error
                    queued.refused(error)
                except Exception:
                    log.exception("ftcomm: a frame's descriptors were refused; it was dropped")
            dropped.clear()  # what they hold goes now, not with a garbage collection

    def take_fds(self, n: int) -> list[int]:
        """The next ``n`` descriptors received (their frame has arrived).

        Raises:
            ProtocolError: fewer than ``n`` came.
        """
        if n > len(self._fds):
            raise ProtocolError(f"a frame names {n} descriptors, {len(self._fds)} came")
        taken, self._fds = self._fds[:n], self._fds[n:]
        return taken

    def close(self) -> None:
        """Stop reading and writing and close the socket (the loop's thread, or
        before :meth:`start`). Safe to call twice."""
        with self._pump_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            self._backlog.clear()
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.remove_writer(self.fd)
                if self._reading:
                    loop.remove_reader(self.fd)
            self._reading = False
            self.sock.close()
