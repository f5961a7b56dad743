"""The worker: a child process that runs one native group for its parent.

Owns :class:`Worker` (its channel, its group, what it mapped: READY, the group
built on CONFIGURE, then every OP as it arrives) and :func:`main`, the process
that ``python -m ftcomm.backends.subprocess`` starts, with its exit codes
(``EXIT_*``, said in :func:`main`). See docs/subprocess.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping

import torch

from ..._protocol import (
    Abort,
    Configure,
    Done,
    Failed,
    Frame,
    Op,
    Ready,
    Scalar,
    Shutdown,
    TensorDesc,
)
from ..._runtime.loop import new_event_loop
from ..._runtime.native import Done as Ended
from ..._runtime.native import NativeOp
from ..._store import parse_store_addr
from ...errors import ProtocolError
from .. import backend_class
from .._base import Backend, ConnectSpec
from . import _ops
from ._channel import Channel
from ._device import IPC_PREFIX, DeviceMappings, cuda_index
from ._mappings import Mappings

SPIN = float(os.environ.get("FTCOMM_WORKER_SPIN_US", "2000")) / 1e6
"""How long the worker polls an op it issued (yielding the core between
polls) before it waits for the op's completion callback, which costs a
wake-up of its own. Measured, 2 ranks on 2 cores, 1-float allreduce p50:
~600 us without polling, ~450 us with 2 ms."""

EXIT_OK = 0
EXIT_CRASHED = 1
EXIT_PROTOCOL = 3
EXIT_ORPHANED = 4
EXIT_ABORTED = 5


def failed(op_id: int, exc: BaseException) -> Failed:
    """The FAILED frame that reports ``exc``."""
    text = "".join(traceback.format_exception(exc))
    return Failed(op_id, type(exc).__name__, str(exc)[:4096], text[-16384:])


class Worker:
    """The worker's state: its channel, its group and the segments it mapped.

    It says READY, builds the group on CONFIGURE, and then runs every OP as
    it arrives: the op is issued on the worker's loop at once (ops pipeline:
    no reply is awaited before the next is read) and its DONE or FAILED is
    written by whichever thread sees it end (the native op's own), without a
    hop back to the loop.
    """

    def __init__(self, channel: Channel, backend_cls: type[Backend], parent: int) -> None:
        self.channel = channel
        self.backend_cls = backend_cls
        self.backend: Backend | None = None
        self.configuring = False
        self.maps = Mappings()
        self.device = DeviceMappings()
        """The caller's CUDA storages (IPC), the worker's streams and events."""
        self.tensors: dict[tuple[TensorDesc, ...], list[torch.Tensor]] = {}
        """Descriptors -> the tensors they map to: the parent reuses its
        segments, so the same descriptors come op after op."""
        self.loop = asyncio.get_running_loop()
        self.exit: asyncio.Future[int] = self.loop.create_future()
        self.parent = parent

    async def run(self) -> int:
        # The parent's exit, seen directly: a process it forked may hold its
        # end of the socket open, so the end of the stream alone is not enough.
        try:
            parent = os.pidfd_open(self.parent)
        except ProcessLookupError:
            return EXIT_ORPHANED
        try:
            if os.getppid() != self.parent:  # it died before we watched it
                return EXIT_ORPHANED
            self.loop.add_reader(parent, self.on_eof)
            self.channel.send(Ready(os.getpid()))
            self.channel.start(self.loop, self.on_frames, self.on_eof, self.on_protocol_error)
            return await self.exit
        finally:
            self.loop.remove_reader(parent)
            os.close(parent)

    def finish(self, code: int) -> None:
        if not self.exit.done():
            self.exit.set_result(code)

    # -- frames -----------------------------------------------------------------
    def on_frames(self, frames: list[Frame]) -> None:
        for frame in frames:
            if self.exit.done():
                return
            if isinstance(frame, Op):
                self.run_op(frame)
            elif isinstance(frame, Configure):
                self.configure(frame)
            elif isinstance(frame, Shutdown):
                self.finish(EXIT_OK)
            elif isinstance(frame, Abort):
                self.finish(EXIT_ABORTED)
            else:
                self.on_protocol_error(
                    ProtocolError(f"a worker does not take {type(frame).__name__} frames")
                )

    def on_eof(self) -> None:
        self.maps.unlink_all()
        self.finish(EXIT_ORPHANED)

    def on_protocol_error(self, error: ProtocolError) -> None:
        self.reply(failed(0, error))
        self.finish(EXIT_PROTOCOL)

    def reply(self, frame: Frame) -> None:
        """Send a reply from any thread; a parent that is gone gets none."""
        with contextlib.suppress(OSError):  # the reader sees the stream end, and exits
            self.channel.send(frame)

    # -- configure ----------------------------------------------------------------
    def configure(self, frame: Configure) -> None:
        if self.backend is not None or self.configuring:
            self.reply(failed(frame.op_id, RuntimeError("this worker is already configured")))
            return
        self.configuring = True
        try:
            spec = ConnectSpec(
                parse_store_addr(frame.store),
                frame.rank,
                frame.world_size,
                frame.timeout,
                frame.replica_id,
                frame.quorum_id,
                frame.group_rank,
                frame.group_world_size,
                frame.global_ranks,
                frame.device,
            )
        except (TypeError, ValueError) as exc:
            self.reply(failed(frame.op_id, exc))
            return
        # Connecting blocks: off the loop, which keeps watching the parent.
        fut = self.loop.run_in_executor(None, self.backend_cls.connect, spec)
        fut.add_done_callback(lambda f: self.configured(frame.op_id, f))

    def configured(self, op_id: int, fut: asyncio.Future[Backend]) -> None:
        exc = fut.exception()
        if exc is not None:
            self.reply(failed(op_id, exc))
            return
        self.backend = fut.result()
        self.reply(Done(op_id))

    # -- ops ------------------------------------------------------------------------
    def storages(self, options: Mapping[str, Scalar]) -> None:
        """Unmap the caller's storages that died, map the ones sent with this OP."""
        release = options.get("release")
        if isinstance(release, tuple) and release:
            for ino in release:
                self.maps.release(ino)
            self.tensors.clear()  # cached views may reach an unmapped storage
        if self.device.update(options):
            self.tensors.clear()
        new = options.get("fds")
        if isinstance(new, tuple) and new:
            fds = self.channel.take_fds(len(new))
            try:
                for ino in new:
                    self.maps.adopt(ino, fds.pop(0))  # closes it
            finally:
                for fd in fds:  # left over by a failure: not ours to keep
                    os.close(fd)

    def run_op(self, frame: Op) -> None:
        op_id = frame.op_id
        backend = self.backend
        try:
            self.storages(frame.options)  # first: its descriptors came with this frame
            if backend is None:
                raise RuntimeError("OP before the group was configured")
            tensors = self.tensors.get(frame.tensors)
            if tensors is None:
                if len(self.tensors) >= 256:
                    self.tensors.clear()
                tensors = [self.tensor(desc) for desc in frame.tensors]
                self.tensors[frame.tensors] = tensors
            # The parent puts an op's CUDA tensors all on one device.
            device = next((i for i in map(cuda_index, frame.tensors) if i is not None), None)
            stream = None
            if device is None:
                native = _ops.run(backend, frame.op, tensors, frame.options)
            else:
                with self.device.issuing(device, frame.options) as stream:
                    native = _ops.run(backend, frame.op, tensors, frame.options)
        except Exception as exc:
            self.reply(failed(op_id, exc))
            return
        once = threading.Lock()

        def ended(error: BaseException | None) -> None:
            if not once.acquire(blocking=False):  # the poll and the callback may both see it
                return
            if error is None and stream is not None:
                try:
                    reply: Frame = Done(op_id, self.device.ended(op_id, stream, native))
                except Exception as exc:
                    reply = failed(op_id, exc)
            else:
                reply = Done(op_id) if error is None else failed(op_id, error)
            self.reply(reply)

        self.watch(native, ended, time.perf_counter() + SPIN)

    def tensor(self, desc: TensorDesc) -> torch.Tensor:
        ipc = desc.handle.startswith(IPC_PREFIX)
        if ipc != (cuda_index(desc) is not None):
            raise ValueError(f"a {desc.device} tensor cannot come as {desc.handle[:40]!r}")
        return self.device.tensor(desc) if ipc else self.maps.tensor(desc)

    def watch(self, native: NativeOp, ended: Ended, until: float) -> None:
        """Poll ``native`` on the loop until ``until``, then wait for its callback.

        A method, not a closure that reschedules itself: such a closure is a
        reference cycle, and would keep the op's tensors (and the caller's
        shared storages they map) until the garbage collector runs.
        """
        if native.poll():
            ended(native.outcome())
        elif time.perf_counter() < until:
            os.sched_yield()  # the core to Gloo's thread first
            self.loop.call_soon(self.watch, native, ended, until)
        else:
            native.on_done(ended)


def main(argv: list[str]) -> int:
    """Run the worker on the inherited socket ``argv[1]`` for backend ``argv[2]``,
    for the parent whose pid is ``argv[3]``; the exit code.

    ``argv[1]`` is one end of a socketpair, the only descriptor the worker
    inherits. The process exits always through ``os._exit`` (a native group
    with an op in flight can block an orderly interpreter exit until the op's
    timeout):

    * on SHUTDOWN (code 0) or ABORT (:data:`EXIT_ABORTED`);
    * when its parent's end closes or its parent exits (:data:`EXIT_ORPHANED`),
      after taking the shared-memory names it mapped out of ``/dev/shm``;
    * on a malformed frame (:data:`EXIT_PROTOCOL`), after a FAILED frame with
      op id 0 that names the problem.

    SIGINT is ignored: a Ctrl-C at the terminal reaches the parent, whose exit
    then ends the worker through its closed socket.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, name, parent = int(argv[1]), argv[2], int(argv[3])
    sock = socket.socket(fileno=fd)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)

    async def serve() -> int:
        return await Worker(Channel(sock, receive_fds=True), backend_class(name), parent).run()

    try:
        code = loop.run_until_complete(serve())
    except BaseException:
        traceback.print_exc()
        code = EXIT_CRASHED
    sys.stdout.flush()
    sys.stderr.flush()
    return code
