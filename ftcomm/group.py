"""The async :class:`Group`: one group's parts, and the calls that read or end it.

A ``Group`` holds its state (``_state.py``'s ``GroupCore``), its issuer
(``_issue.py``) and its connect step (``_configure.py``); its collectives come
from its base class, :class:`~ftcomm._collectives.Collectives`. This module
owns construction (argument checks, the backend, the subprocess launcher),
``abort()``, ``shutdown()`` and their :class:`Closing`, ``errored()``,
``stats()``, ``subscribe()``, the default timeout, rank and size. See
docs/ops.md (state, teardown).
"""

from __future__ import annotations

import asyncio
import collections.abc
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from . import _validate as v
from ._collectives import Collectives
from ._collectives import check_open as check_open
from ._configure import Configurer, connect_in_process
from ._issue import BatchScope as BatchScope  # ftcomm.group.BatchScope, as before
from ._issue import Issuer
from ._runtime.deadline import Timeout, resolve, to_seconds
from ._runtime.driven import Drivers, TaskDriven
from ._runtime.fuse import MAX_OP_FRACTION
from ._runtime.loop import get_runtime, wake_threadsafe
from ._runtime.observe import Event, GroupStats, Observer, Subscription
from ._state import Config, GroupCore, State, Teardown, all_of
from .backends import Backend, ConnectSpec, backend_class
from .errors import CommAborted, CommError

if TYPE_CHECKING:
    from .backends.subprocess import Launcher

__all__ = ["BatchScope", "Closing", "Group"]

log = logging.getLogger("ftcomm")


class Closing(TaskDriven, collections.abc.Coroutine[Any, Any, None]):
    """What :meth:`Group.abort` and :meth:`Group.shutdown` return.

    The abort or shutdown has already happened when you get this: the
    group's state says so on every thread, and its ops in flight are ending:
    each publishes its error once nothing can write into its tensors any
    more (at once, or, for an in-process Gloo op whose sockets were just
    shut down, once that native op has failed, a millisecond or two later).
    Awaiting it (or :meth:`wait`, from a thread) waits, bounded, until those
    ops have ended and the native group is closed: with
    ``subprocess=True``, until the worker process has been reaped.
    Forgetting to await it loses nothing but that wait, and no warning is
    given. It is a coroutine too, so ``asyncio.run(g.shutdown())`` and
    ``asyncio.create_task(g.abort())`` work as they did.
    """

    __slots__ = ("_closed", "_drivers", "_timeout")

    def __init__(
        self, closed: concurrent.futures.Future[None] | None, timeout: float = 2.0
    ) -> None:
        self._closed = closed
        self._timeout = timeout
        self._drivers: Drivers | None = None

    def done(self) -> bool:
        """Whether the ops have ended and the native group is closed."""
        return self._closed is None or self._closed.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Block this thread until closed, at most ``timeout`` seconds (default
        2); whether it closed. Returns at once on the owner loop's thread."""
        closed = self._closed
        if closed is None:
            return True
        if not get_runtime().in_loop_thread():
            concurrent.futures.wait([closed], self._timeout if timeout is None else timeout)
        return closed.done()

    def __await__(self) -> Generator[Any, None, None]:
        return self._until_closed().__await__()

    async def _until_closed(self) -> None:
        closed = self._closed
        if closed is None or closed.done():
            return
        # Not wrap_future: cancelling that wrapper on a timeout would cancel
        # the backend's own future, which every other Closing also waits on.
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        closed.add_done_callback(lambda _: wake_threadsafe(loop, fut))
        await asyncio.wait({fut}, timeout=self._timeout)


class Group(Collectives):
    """A fault-tolerant process group whose collectives are awaitable.

    Args:
        backend: ``"gloo"`` (CPU tensors), ``"nccl"`` (CUDA tensors), ``"xccl"``
            (Intel XPU tensors) or ``"dummy"`` (world size 1, no communication)
            (docs/accelerators.md for NCCL/XCCL).
        subprocess: run the native group in a worker process, one per
            configuration, which an abort kills, so that nothing writes into
            the tensors afterwards (docs/subprocess.md).
        timeout: the default deadline of every op, in seconds or a timedelta.
        configure_timeout: how long ``configure()`` may take (default: ``timeout``).
        spare_worker: with ``subprocess=True``, keep one worker started ahead
            (one idle process), so that ``configure()`` after a failure does
            not wait for Python and torch to start (docs/subprocess.md).
        share_min_bytes: with ``subprocess=True``, move a CPU storage that a
            tensor of at least this many bytes brings back for another op into
            shared memory, in place; only for storages nothing else aliases,
            which ftcomm cannot check (``None``, the default: always copy;
            docs/subprocess.md).
        verify: (Gloo only) check with one small allgather before each
            collective that every rank issued the same op, else fail it with
            ``CommFailed`` on every rank, unsent (docs/verify.md).
        stats: keep per-op statistics for :meth:`stats` (on by default; events
            and log lines come either way: docs/observability.md).
        fuse: send small host-tensor allreduces as one native allreduce at the
            next cut point, which every rank must then reach alike (off by
            default; docs/fusion.md).
        fuse_bytes: a fused batch's byte cap (default 1 MiB); allreduces larger
            than 1/16 of it are never fused (docs/fusion.md).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an unknown backend, a bad timeout, a negative
            ``share_min_bytes``, a ``fuse_bytes`` under 16, or ``verify=True``
            with NCCL/XCCL.
        RuntimeError: ``"nccl"`` or ``"xccl"`` where torch was built without
            it or sees no such device.

    Use ``async with Group(...) as group:`` to shut it down on exit.
    """

    def __init__(
        self,
        backend: str = "gloo",
        *,
        subprocess: bool = False,
        timeout: Timeout = 60.0,
        configure_timeout: Timeout | None = None,
        spare_worker: bool = True,
        share_min_bytes: int | None = None,
        verify: bool = False,
        stats: bool = True,
        fuse: bool = False,
        fuse_bytes: int = 1 << 20,
    ) -> None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        flags = (
            ("subprocess", subprocess),
            ("spare_worker", spare_worker),
            ("verify", verify),
            ("stats", stats),
            ("fuse", fuse),
        )
        for name, flag in flags:
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if share_min_bytes is not None:
            v.check_int(share_min_bytes, "share_min_bytes", minimum=0, maximum=None)
        v.check_int(fuse_bytes, "fuse_bytes", minimum=MAX_OP_FRACTION, maximum=None)
        timeout_s = to_seconds(timeout, "timeout")
        configure_s = resolve(configure_timeout, timeout_s, "configure_timeout")
        if verify and backend in ("nccl", "xccl"):  # an argument: checked first
            raise ValueError(f"verify=True is not available with {backend!r} yet (gloo only)")
        backend_cls = backend_class(backend)
        backend_cls.check_usable()
        launcher: Launcher | None = None
        # connect(spec, cancel): build the native group; blocks (a control thread).
        connect: Callable[[ConnectSpec, concurrent.futures.Future[Any]], Backend]
        if subprocess:
            from .backends.subprocess import Launcher

            launcher = Launcher(backend, spare=spare_worker, share_min_bytes=share_min_bytes)
            connect = launcher.connect
        else:
            connect = functools.partial(connect_in_process, backend_cls)
        self.subprocess = subprocess
        self._core = GroupCore()
        self._runtime = get_runtime()
        self._observer = Observer(self._core.lock, self._runtime.events.post, stats=stats)
        super().__init__(Issuer(self._core, timeout_s, fuse, fuse_bytes), backend)
        self._configurer = Configurer(
            self._core, self._observer, backend, backend_cls, connect, launcher, verify, configure_s
        )

    def __repr__(self) -> str:
        cfg = self._core.config
        name = f"{self.backend} subprocess" if self.subprocess else self.backend
        state = self._core.state.value
        if cfg is None:
            return f"<ftcomm.Group {name} {state}>"
        return (
            f"<ftcomm.Group {name} rank={cfg.backend.rank}/{cfg.backend.world_size} "
            f"store={cfg.store_addr} {state}>"
        )

    @property
    def state(self) -> State:
        """Where the group is in its life: see :class:`ftcomm.State`."""
        return self._core.state

    async def __aenter__(self) -> Group:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    async def configure(
        self,
        store_addr: str,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        replica_id: str = "0",
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: Sequence[int] | None = None,
        timeout: Timeout | None = None,
        device_id: int | torch.device | None = None,
    ) -> None:
        """(Re)build the native group; every rank calls it with the same store address.

        A previous configuration is torn down first without blocking: its
        in-flight ops end with ``CommAborted``. Someone must host the store:
        ``python -m ftcomm store``, :func:`ftcomm.serve_store`, or torchrun's
        agent (docs/running.md).

        Args:
            store_addr: ``host:port/prefix`` (IPv6: ``[::1]:port/prefix``) at a
                prefix no earlier configuration used, or ``env://prefix`` for
                the store at ``MASTER_ADDR``/``MASTER_PORT`` (docs/running.md).
            rank: this process's rank (with ``env://``, default: ``RANK``).
            world_size: the number of ranks (with ``env://``, default:
                ``WORLD_SIZE``); pass it and ``rank`` to go on with the survivors.
            replica_id: a label, in the native group's name in torch's logs and tables.
            quorum_id: torchft's quorum number, a label in that name too.
            group_rank: this rank's place in its replica group (torchft's
                argument: checked, not otherwise used).
            group_world_size: the size of that replica group (likewise).
            global_ranks: every member's rank in torch's default process group,
                by group rank, for the native group's own tables.
            timeout: how long this configure may take (default: the group's
                ``configure_timeout``).
            device_id: (NCCL/XCCL only) the device the communicator uses
                (default: the calling thread's current one, ``torch.cuda.set_device``).

        Raises:
            TypeError, ValueError: a bad argument (checked before anything is
                torn down: the previous configuration stays as it was), a
                ``device_id`` for a backend without devices, or ``env://``
                with ``MASTER_ADDR``/``MASTER_PORT`` (or ``RANK``/``WORLD_SIZE``,
                where not given) missing from the environment.
            CommTimeout: the store or the peers did not answer within the
                configure timeout.
            CommFailed: the store or the native group construction failed.
            PrefixReused: this rank built a group at this prefix before, or
                another rank of this configuration was refused there.
            CommAborted: ``shutdown()`` or another ``configure()`` superseded this one.
            RuntimeError: awaited without a running asyncio loop (trio).
        """
        configurer = self._configurer
        spec = configurer.check(
            store_addr,
            rank,
            world_size,
            replica_id,
            quorum_id,
            group_rank,
            group_world_size,
            global_ranks,
            timeout,
            device_id,
        )
        await configurer.configure(spec)

    def abort(self) -> Closing:
        """Abort the group now: in-flight ops end with ``CommAborted``, later
        ops raise it at once, ``errored()`` reports it, until ``configure()``.
        A ``configure()`` in progress (on any thread) is superseded: it raises
        ``CommAborted`` and the group stays errored.

        Acts at once, from any thread, without blocking (``g.abort()`` alone
        is enough, as in torch); safe to call twice or on an unconfigured
        group. The returned :class:`Closing` can be awaited to wait, bounded,
        for the ops to end and the native group to close: with
        ``subprocess=True`` the worker is killed and reaped (a few ms); on
        in-process Gloo the group's connections are shut down, so its ops
        fail here and at every peer within milliseconds (docs/errors.md,
        "Abort truth table").
        """
        cfg = self._core.config
        rank = cfg.backend.rank if cfg is not None else None
        teardown = self._core.abort(CommAborted("the group was aborted by abort()", rank=rank))
        return self._closing(teardown)

    def shutdown(self) -> Closing:
        """Tear the group down now; in-flight ops end with ``CommAborted``, and
        a ``configure()`` in progress on any thread is superseded.

        Afterwards the group is CLOSED (ops raise ``NotConfigured``) and may
        be configured again. Acts at once from any thread without blocking;
        safe to call twice. Await the returned :class:`Closing` to wait,
        bounded, until the native group is closed (with ``subprocess=True``,
        until the worker has been reaped).
        """
        cfg = self._core.config
        rank = cfg.backend.rank if cfg is not None else None
        teardown = self._core.shutdown(CommAborted("the group was shut down", rank=rank))
        launcher = self._configurer.launcher
        if launcher is not None:
            launcher.close()
        return self._closing(teardown)

    @staticmethod
    def _closing(teardown: Teardown) -> Closing:
        backend = teardown.run()
        futures = [teardown.ended(), backend.closed() if backend is not None else None]
        return Closing(all_of([f for f in futures if f is not None]))

    def errored(self) -> CommError | None:
        """The error that broke the current configuration (or the ``abort()``
        that superseded a ``configure()``), or ``None``."""
        return self._core.errored()

    def stats(self) -> GroupStats:
        """What this group did since it was made: per op kind, the ops that
        ended, their failures by error type, and latency percentiles of those
        whose end was seen as it happened (from a fixed-size histogram: within
        1/16 of the value, plus up to 1 ms or 1/16 where the end was seen late;
        ``untimed`` counts the others: ops found ended after other work);
        configures and their durations; aborts by cause; ops in flight now.
        ``print(group.stats())`` shows a table; ``.as_dict()`` gives plain
        values. With ``Group(stats=False)``, ``ops`` stays empty. Any thread;
        raises nothing."""
        cfg = self._core.config
        return self._observer.snapshot(cfg.table.active() if cfg is not None else 0)

    def subscribe(self, callback: Callable[[Event], object]) -> Subscription:
        """Call ``callback(event)`` for every :class:`ftcomm.Event` of this
        group from now on: ops issued, ended and failed, configures, aborts,
        worker deaths, shutdowns, each with rank, op, seq, store and duration.

        It runs on one thread of ftcomm's (``ftcomm-events``), one event at a
        time, in the order they happened (an op's ``"issued"`` before its
        end), outside every lock of ftcomm: it may call the group, and it
        should be quick (a slow one delays the events after it; past
        100,000 waiting, events are dropped and a warning says so). What it
        raises is logged and dropped. To get events on your own loop, forward them:
        ``lambda e: loop.call_soon_threadsafe(queue.put_nowait, e)``.
        Returns a :class:`ftcomm.Subscription`: ``close()`` it (or use it
        in a ``with``) to stop.

        Raises:
            TypeError: ``callback`` is not callable.
        """
        return self._observer.subscribe(callback)

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the default deadline of ops issued from now on.

        Raises:
            TypeError, ValueError: a bad timeout.
        """
        self._issuer.timeout = to_seconds(timeout, "timeout")

    @property
    def timeout(self) -> float:
        """The default deadline of new ops, in seconds."""
        return self._issuer.timeout

    @property
    def rank(self) -> int:
        """This process's rank in the current configuration.

        Raises:
            NotConfigured: the group is not configured.
        """
        return self._issuer.configured("rank").backend.rank

    def size(self) -> int:
        """The world size of the current configuration.

        Raises:
            NotConfigured: the group is not configured.
        """
        return self._issuer.configured("size").backend.world_size

    def num_active_work(self) -> int:
        """How many ops of the current configuration have not ended yet."""
        cfg = self._core.config
        return cfg.table.active() if cfg is not None else 0


# -- for ftcomm's own layers above the group (the c10d facade, Membership,
# the tools, ftcomm.testing.inspect): a group's parts, read through these
# functions rather than its private attributes. Not API: not in __all__.


def config_of(group: Group) -> Config | None:
    """The configuration ``group``'s ops run on now, or ``None``."""
    return group._core.config


def configurer_of(group: Group) -> Configurer:
    """``group``'s connect step (its backend class, its launcher)."""
    return group._configurer


def abort_config(group: Group, config: object, why: str) -> bool:
    """:meth:`Group.abort` where ``config`` (read earlier by
    :func:`config_of`) is still the configuration ops run on; whether it
    was. From any thread, without blocking; a ``configure()`` begun since is
    left alone."""
    if not isinstance(config, Config):
        return False
    error = CommAborted(f"the group was aborted: {why}", rank=config.backend.rank)
    teardown = group._core.abort_if(config, error)
    if teardown is None:
        return False
    # the ops' ends (and their callbacks) on a thread of their own, not the
    # caller's, and never queued behind other control calls
    done = get_runtime().control.spawn(
        lambda _: Group._closing(teardown), threading.Event(), until=time.monotonic() + 5.0
    )
    done.add_done_callback(_log_failure)
    return True


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    """A done-callback: log what a background step raised (nobody awaits it)."""
    if not future.cancelled() and future.exception() is not None:
        log.error("ftcomm: an abort's teardown failed: %r", future.exception())
