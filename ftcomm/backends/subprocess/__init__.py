"""The subprocess backend: the native group runs in a child process.

Gloo's own ``abort()`` does nothing (docs/gloo.md); here abort is total: the
group's worker process is killed, and nothing writes anywhere any more. Owns
:class:`SubprocessBackend` (a configured group whose ops go to a worker) and
:class:`Launcher`, what a :class:`~ftcomm.Group` holds with ``subprocess=True``:
every ``configure()`` gets a fresh worker, by default one started ahead (a
*spare*). See docs/subprocess.md; its modules: docs/design.md's map.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from ..._protocol import Scalar
from ..._runtime.loop import get_runtime
from ..._runtime.native import NativeOp
from ..._validate import ReduceOpArg
from ...errors import CommError, ProtocolError
from .. import backend_class
from .._base import Backend, ConnectSpec
from ._client import Call, WorkerProcess, starting
from ._device import PoolClosed
from ._layout import CARRIED
from ._ops import reduce_options

__all__ = ["MAX_TENSORS", "Launcher", "SubprocessBackend"]

MAX_TENSORS = 1 << 12
"""The most tensors one OP frame carries (the protocol's cap: ``Op`` refuses
more). A call with more is refused up front, before anything is staged."""


class SubprocessBackend(Backend):
    """A configured group whose native half runs in a worker process.

    Issuing an op stages its tensors (copies CPU inputs into shared memory,
    or names shared storages and CUDA IPC handles) and writes one OP frame,
    on the caller's thread; the reply copies CPU outputs back.
    """

    inner: ClassVar[type[Backend]]
    copies_in_flight: ClassVar[bool] = True

    def __init__(self, worker: WorkerProcess, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.worker = worker

    @classmethod
    def connect(
        cls, spec: ConnectSpec, cancel: concurrent.futures.Future[Any] | None = None
    ) -> SubprocessBackend:
        """Start a worker and configure it (no spare: see :class:`Launcher`)."""
        return Launcher(cls.inner.name, spare=False).connect(spec, cancel)

    def close(self) -> list[object]:
        self.worker.kill()  # its death is read (and reaped) on the owner loop
        return []

    def closed(self) -> concurrent.futures.Future[None]:
        return self.worker.exited

    def watch(self, on_break: Callable[[CommError], None]) -> None:
        self.worker.on_break = on_break
        death = self.worker.death
        if death is not None:
            on_break(death)

    def _op(
        self,
        op: str,
        tensors: Sequence[tuple[torch.Tensor, str]],
        timeout: float,
        what: str = "tensors",
        **options: Scalar,
    ) -> Call:
        """Stage ``tensors`` and send the OP (``what`` names them, for errors).

        Raises:
            ValueError: more tensors than one OP carries, or an op that does
                not fit in a frame; nothing was staged or sent.
            OSError: no room in ``/dev/shm`` for the op's tensors (the message
                names its free space); nothing was staged or sent, and the
                group stays usable.
        """
        if len(tensors) > MAX_TENSORS:
            raise ValueError(
                f"{op}: {what}: {len(tensors)} tensors, more than the {MAX_TENSORS} that one op "
                "of the subprocess backend carries; split them into several ops"
            )
        worker = self.worker
        try:
            staged = worker.pool.stage(tensors)
        except PoolClosed as exc:  # the worker is gone
            return worker.failed(exc)
        except OSError as exc:  # /dev/shm is full, or no fds are left
            if worker.death is not None:
                return worker.failed(exc)
            raise OSError(exc.errno, f"{op}: {exc.strerror}") from exc
        options["timeout"] = timeout
        options.update(staged.options)
        return worker.submit(op, staged, options)

    def allreduce(
        self, tensors: Sequence[torch.Tensor], op: ReduceOpArg, timeout: float
    ) -> NativeOp:
        items = [(t, "inout") for t in tensors]
        return self._op("allreduce", items, timeout, "tensors", **reduce_options(op))

    def allgather(
        self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, timeout: float
    ) -> NativeOp:
        items = [(tensor, "in"), *((o, "out") for o in outputs)]
        return self._op("allgather", items, timeout, "outputs (and the input)")

    def allgather_into_tensor(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], timeout: float
    ) -> NativeOp:
        items = [*((o, "out") for o in outputs), *((i, "in") for i in inputs)]
        return self._op("allgather_into_tensor", items, timeout, "outputs and inputs")

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float) -> NativeOp:
        role = "in" if root == self.rank else "out"
        return self._op("broadcast", [(tensor, role)], timeout, root=root)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOpArg,
        timeout: float,
    ) -> NativeOp:
        items = [(output, "out"), *((i, "in") for i in inputs)]
        return self._op(
            "reduce_scatter",
            items,
            timeout,
            "inputs (and the output)",
            **reduce_options(op),
        )

    def reduce_scatter_tensor(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        op: ReduceOpArg,
        timeout: float,
    ) -> NativeOp:
        items = [*((o, "out") for o in outputs), *((i, "in") for i in inputs)]
        return self._op(
            "reduce_scatter_tensor",
            items,
            timeout,
            "outputs and inputs",
            **reduce_options(op),
        )

    def alltoall_base(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        timeout: float,
    ) -> NativeOp:
        return self._op(
            "alltoall_base",
            [(output, "out"), (tensor, "in")],
            timeout,
            output_split_sizes=tuple(output_split_sizes),
            input_split_sizes=tuple(input_split_sizes),
        )

    def barrier(self, timeout: float) -> NativeOp:
        return self._op("barrier", [], timeout)

    def send(self, tensor: torch.Tensor, dst: int, tag: int, timeout: float) -> NativeOp:
        return self._op("send", [(tensor, "in")], timeout, peer=dst, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, timeout: float) -> NativeOp:
        return self._op("recv", [(tensor, "out")], timeout, peer=src, tag=tag)


@functools.cache
def subprocess_class(name: str) -> type[SubprocessBackend]:
    """The subprocess variant of backend ``name``: same name, dtypes, reduce ops.

    Raises:
        ValueError, NotImplementedError: as :func:`~ftcomm.backends.backend_class`.
    """
    inner = backend_class(name)
    return type(
        f"Subprocess{inner.__name__}",
        (SubprocessBackend,),
        {
            "inner": inner,
            "name": inner.name,
            # CPU tensors go through shared memory, CUDA ones by IPC handle;
            # the pool refuses other devices (no XPU IPC in torch 2.13).
            "device_type": inner.device_type,
            "dtypes": CARRIED if inner.dtypes is None else inner.dtypes & CARRIED,
            "reduce_ops": inner.reduce_ops,
            "int_avg": inner.int_avg,
        },
    )


class Launcher:
    """Starts and configures workers for one group; keeps a spare ready.

    Args:
        backend: the backend the workers run (``"gloo"``, ``"dummy"``, ...).
        spare: keep one worker started ahead (one idle process), so that
            ``configure()`` does not wait for a new process to start Python
            and import torch (about a second: docs/performance.md); the group starts it
            with :meth:`refill` once each configuration is up.
        share_min_bytes: move a CPU storage into shared memory, in place, when
            a tensor of at least this many bytes brings it back for another
            op, and use it in place from then on (``None``, the default:
            always copy; see :class:`._pool.Pool`, rule 3).

    Raises:
        ValueError, NotImplementedError: as :func:`~ftcomm.backends.backend_class`.
    """

    def __init__(
        self, backend: str, *, spare: bool = True, share_min_bytes: int | None = None
    ) -> None:
        self.cls = subprocess_class(backend)
        self.backend = backend
        self.keep_spare = spare
        self.share_min_bytes = share_min_bytes
        self._lock = threading.Lock()
        self._spare: WorkerProcess | None = None
        self._generation = 0  # close() bumps it: a refill started before does not count

    def __repr__(self) -> str:
        return f"<ftcomm.Launcher {self.backend} spare={self._spare!r}>"

    def connect(
        self, spec: ConnectSpec, cancel: concurrent.futures.Future[Any] | None = None
    ) -> SubprocessBackend:
        """Configure a worker (a spare if there is one); blocks, on a control thread.

        ``cancel``: once it completes (its ``configure()`` was superseded by
        ``abort()`` or ``shutdown()``), the worker is killed and this raises
        at once instead of waiting for the peers.

        Raises:
            TimeoutError: the worker did not start or configure in ``spec.timeout``.
            EOFError: the worker exited, or ``cancel`` completed.
            ProtocolError: the worker broke the protocol.
            RemoteError: building the group failed in the worker (the store,
                a peer, or bad arguments).
        """
        deadline = time.monotonic() + spec.timeout
        with self._lock:
            spare, self._spare = self._spare, None
        starting(spec.progress)
        if spare is not None:
            try:
                spare.ready(deadline)
            except TimeoutError:  # still starting at the deadline: so is configure
                spare.abandon()
                raise
            except (EOFError, OSError, ProtocolError):  # it died while it waited
                spare.abandon()
                spare = None
        worker = spare or WorkerProcess(self.backend, get_runtime())
        try:
            if cancel is not None:
                cancel.add_done_callback(lambda _: worker.kill())  # now, if it is done
            worker.configure(spec, deadline)
        except BaseException:
            worker.abandon()
            raise
        worker.pool.share_min_bytes = self.share_min_bytes
        worker.start()
        backend = self.cls(worker, spec.rank, spec.world_size)
        # A group dropped without shutdown() must not keep its worker running.
        weakref.finalize(backend, worker.kill)
        return backend

    @property
    def generation(self) -> int:
        """Bumped by every :meth:`close`."""
        return self._generation

    def refill(self, generation: int | None = None) -> None:
        """Start a spare if there is none (blocks for a fork/exec: a control
        thread), unless :meth:`close` ran since ``generation`` (read by the
        caller before it decided to refill) or runs meanwhile."""
        with self._lock:
            if self._spare is not None or not self.keep_spare:
                return
            if generation is not None and generation != self._generation:
                return
            generation = self._generation
        spare: WorkerProcess | None = WorkerProcess(self.backend, get_runtime())
        with self._lock:
            if self._spare is None and self._generation == generation:
                self._spare, spare = spare, None
        if spare is not None:  # closed meanwhile, or another refill won
            spare.abandon()

    @property
    def spare_pid(self) -> int | None:
        """The spare worker's pid, if one is waiting."""
        spare = self._spare
        return spare.pid if spare is not None else None

    @property
    def spare_fd(self) -> int | None:
        """The spare worker's channel, readable once it has said READY (or
        died), if one is waiting."""
        spare = self._spare
        return spare.channel.fd if spare is not None else None

    def close(self) -> None:
        """Stop the spare, and make a refill in progress give up (non-blocking;
        the spare is reaped off the caller's thread)."""
        with self._lock:
            spare, self._spare = self._spare, None
            self._generation += 1
        if spare is not None:
            spare.kill()
            get_runtime().run_blocking(spare.abandon)
