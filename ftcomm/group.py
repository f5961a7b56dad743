"""The async :class:`Group`: configure, collectives, abort.

Every collective validates its arguments, issues the native op on the calling
thread at once (so issue order is call order on every rank) and returns a
:class:`~ftcomm.Work`. The group's state lives in one ``GroupCore``
(``_state.py``: one lock, named states, a transition table), with one
``Config`` per ``configure()``; tearing it down (abort, shutdown, configure
again) never blocks: in-flight ops end with ``CommAborted`` and the native group goes to
the reaper thread.
"""

from __future__ import annotations

import asyncio
import collections.abc
import concurrent.futures
import contextlib
import contextvars
import functools
import threading
import time
import weakref
from collections.abc import Callable, Generator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
from torch.distributed import ReduceOp

from . import _validate as v
from ._collectives import Collectives
from ._runtime import faults
from ._runtime.deadline import Timeout, resolve, to_seconds
from ._runtime.driven import Drivers, TaskDriven
from ._runtime.fuse import MAX_OP_FRACTION, AloneMark, Batch, MemberOp, copy_back_cpu
from ._runtime.loop import get_runtime, require_asyncio, wake_threadsafe
from ._runtime.native import NativeOp, without_tracebacks
from ._runtime.observe import Event, GroupStats, Observer, Subscription
from ._runtime.settle import aborted_by
from ._runtime.table import Broken, OpTable
from ._runtime.work import Work
from ._state import Attempt, Config, GroupCore, State, Teardown, all_of
from ._store import ENV_SCHEME, StoreAddr, env_int, parse_env_addr, parse_store_addr
from ._verify import Chain, VerifiedOp, describe, reduce_code
from .backends import Backend, ConnectSpec, backend_class

if TYPE_CHECKING:
    from .backends.subprocess import Launcher
from .errors import CommAborted, CommError, CommFailed, CommTimeout, NotConfigured

R = TypeVar("R")
_SUM = ReduceOp.SUM
_STRIDED = torch.strided

_BATCH_SCOPES: contextvars.ContextVar[tuple[BatchScope, ...]] = contextvars.ContextVar(
    "ftcomm_batch_scopes", default=()
)
"""The :meth:`Group.batch` blocks the current context is in (a task started
inside one copies it, and is in the block while the block lasts)."""


# A configure that fails with one of these ran out of time: TimeoutError
# (ftcomm's own connects raise it, the store's too: see _store.py) and c10d's
# store error, raised by its waits for the peers' keys when they time out.
# c10d's DistNetworkError is not here: it means a timeout or a broken
# connection alike, and _store.py tells the two apart where it can.
_TIMEOUTS: tuple[type[BaseException], ...] = (TimeoutError, torch.distributed.DistStoreError)
_TIMEOUT_NAMES = frozenset(t.__name__ for t in _TIMEOUTS)


def _connect_error(exc: Exception, where: str, rank: int) -> CommError:
    """The one place a failed connect becomes an ftcomm error: by the type of
    what the backend raised (a worker's error by its type's name), never by
    the clock. The native message is kept: it is what a user can act on."""
    if isinstance(exc, CommError):
        return exc._located(rank, "configure", None)
    remote_type = getattr(exc, "remote_type", None)  # raised in a subprocess worker
    timed_out = isinstance(exc, _TIMEOUTS) or remote_type in _TIMEOUT_NAMES
    cls = CommTimeout if timed_out else CommFailed
    return cls(f"configure failed ({where}): {exc}", rank=rank, op="configure")


def _configure_timeout(
    seconds: float, spec: ConnectSpec, raised: Exception | None = None
) -> CommTimeout:
    """The error of a ``configure()`` whose deadline passed: what the connect
    was waiting for then (``spec.progress``), and what to do about it.
    ``raised``: the connect's own timeout, where it came first (a worker's
    is set to come a moment before ours, and says what it waited for)."""
    progress = spec.progress
    if getattr(raised, "remote_type", None) is not None:
        why = f"{str(raised).partition(': ')[2] or raised} (store {spec.store})"
    elif progress.step == "store" and not progress.detail and raised is not None:
        why = str(raised)  # the store took the connection, and then did not answer
    elif progress.step == "store":
        why = f"the store at {spec.store} did not answer: {progress.detail or 'no reply'}"
    elif progress.step == "native":
        why = (
            f"every rank came to the store {spec.store}, but the native group was not "
            "built in time (a peer unreachable on its own address, a slow start, or a "
            "prefix reused from an earlier configuration?)"
        )
    elif progress.detail:  # meeting the other ranks, a worker starting, ...
        why = f"{progress.detail} (store {spec.store})"
    else:
        why = f"store {spec.store}"
    return CommTimeout(
        f"configure timed out after {seconds:g} seconds: {why}", rank=spec.rank, op="configure"
    )


def _connect_in_process(
    cls: type[Backend], spec: ConnectSpec, cancel: concurrent.futures.Future[Any]
) -> Backend:
    """Build the group in this process; ``cancel`` stops a backend that can
    be stopped while it connects (NCCL/XCCL abort their communicator).
    Others finish, and the group disposes of what they built."""
    return cls.connect(spec, cancel)


def _finish(fut: concurrent.futures.Future[Any]) -> None:
    """Complete ``fut`` unless it is (any thread, any number of times)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        fut.set_result(None)


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


class BatchScope:
    """What :meth:`Group.batch` returns: a block (``async with`` or ``with``)
    in which the group's small allreduces are fused; leaving it flushes.

    Raises:
        RuntimeError: entered again while entered.
    """

    __slots__ = ("_token", "active", "group")

    def __init__(self, group: Group) -> None:
        self.group = group
        self.active = False  # cleared at the block's end: tasks started in it see it
        self._token: contextvars.Token[tuple[BatchScope, ...]] | None = None

    def __enter__(self) -> BatchScope:
        if self._token is not None or self.active:
            raise RuntimeError("this group.batch() block is already entered: make another")
        self._token = _BATCH_SCOPES.set((*_BATCH_SCOPES.get(), self))
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        token, self._token = self._token, None
        self.active = False
        try:
            self.group.flush()
        finally:
            if token is not None:
                # An exit in another context (an async generator finalised
                # by the loop) cannot reset it: the block is over all the same.
                with contextlib.suppress(ValueError):
                    _BATCH_SCOPES.reset(token)

    async def __aenter__(self) -> BatchScope:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)


class Group(Collectives):
    """A fault-tolerant process group whose collectives are awaitable.

    Args:
        backend: ``"gloo"`` (CPU tensors), ``"nccl"`` (CUDA tensors),
            ``"xccl"`` (Intel XPU tensors) or ``"dummy"`` (world size 1, no
            communication). An NCCL/XCCL op ends when its device work has;
            its deadline aborts the communicator (docs/errors.md).
        subprocess: run the native group in a worker process, one per
            configuration. Aborts are then total: a deadline, a cancel,
            ``abort()`` or ``configure()`` kills the worker, so nothing writes
            into the tensors afterwards; and the worker's death is an error
            at once (``WorkerDied``). Tensors are copied through shared memory,
            and results copied back only on success; a tensor already in
            shared memory (``t.share_memory_()``) is used in place, without
            copies (docs/design.md); ``share_min_bytes`` moves large ones.
        timeout: default deadline of every op, in seconds or a timedelta.
        configure_timeout: how long ``configure()`` may take (default: ``timeout``).
        spare_worker: with ``subprocess=True``, keep one worker started ahead
            so that ``configure()`` after a failure does not wait for Python
            and torch to start (about 1.7 s here). Costs one idle process.
        share_min_bytes: with ``subprocess=True``, opt in to moving large
            CPU storages into shared memory: when a tensor of at least this
            many bytes comes back for another op, its storage is moved in
            place (``Tensor.share_memory_()``: same tensor objects, same
            values, new memory) and used in place from then on, instead of
            being copied in and out on every op (at 16 MiB: ~1.1x raw Gloo's
            bandwidth instead of ~0.75x). Only for storages nothing else
            aliases: the old memory is freed, so a ``np.from_dlpack(t)``
            array or a native kernel still reading it on another thread
            would read freed memory; and a storage in shared memory can no
            longer be resized (FSDP-style ``resize_``). An op that fails may
            also have written part of its result, as on in-process Gloo. Storages torch does
            not own (``from_numpy``) and pinned memory are never moved.
            ``None`` (the default): always copy.
        verify: (Gloo only) before each collective, check that every rank issued the
            same op (name, dtype, shape, root or reduce op), with one small
            allgather; if not, the op fails with ``CommFailed`` naming both
            sides, on every rank, nothing of it is sent, and the group is
            errored. Without it, ranks that disagree can crash the process
            in Gloo (``std::terminate``) or, for an allgather, get garbage
            (docs/errors.md). Costs one small op per collective (about
            doubling a small op's latency; docs/design.md). Send and recv
            are not checked.
        stats: keep per-op statistics (:meth:`stats`): on by default; an
            op's end then costs one histogram increment (docs/design.md,
            "What a group did"). Events and log lines come either way.
        fuse: fuse small allreduces: one of a host tensor of at most
            ``fuse_bytes / 16`` bytes is not issued at once (but for the
            first after a cut point, which goes on its own) and joins the
            group's open batch,
            sent as one native allreduce when the program looks at one of
            its ops (``await``, ``wait()``, ``done()``, a callback), issues
            an op that cannot join it, fills it, or calls :meth:`flush`
            (:meth:`batch` fuses within a block on a group without it).
            1000 concurrent one-float allreduces then cost about one.
            Every rank must make the same calls in the same order, the
            looks included (docs/design.md, "Fusing small collectives").
            Off by default: an op then goes on the wire when it is issued.
        fuse_bytes: a batch's byte cap (default 1 MiB): reaching it sends
            the batch; larger allreduces than 1/16 of it are never fused.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an unknown backend, a bad timeout, a negative
            ``share_min_bytes``, or ``verify=True`` with NCCL/XCCL.
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
        self._fuse = fuse
        self._fuse_bytes = fuse_bytes
        self._fuse_op_bytes = fuse_bytes // MAX_OP_FRACTION
        self._verify = verify
        self._timeout = to_seconds(timeout, "timeout")
        self._configure_timeout = resolve(configure_timeout, self._timeout, "configure_timeout")
        self._launcher: Launcher | None = None
        # connect(spec, cancel): build the native group; blocks (a control thread).
        self._connect: Callable[[ConnectSpec, concurrent.futures.Future[Any]], Backend]
        if verify and backend in ("nccl", "xccl"):  # an argument: checked first
            raise ValueError(f"verify=True is not available with {backend!r} yet (gloo only)")
        self._backend_cls = backend_class(backend)
        self._backend_cls.check_usable()
        if subprocess:
            from .backends.subprocess import Launcher

            self._launcher = Launcher(backend, spare=spare_worker, share_min_bytes=share_min_bytes)
            self._connect = self._launcher.connect
        else:
            self._connect = functools.partial(_connect_in_process, self._backend_cls)
        self.subprocess = subprocess
        self.backend = backend
        self._runtime = get_runtime()
        self._core = GroupCore()
        # Issue order is call order: one op at a time goes from "checked" to
        # "on the wire". Not the state lock: issuing may wait on a native
        # call, and transitions never wait.
        self._issue_lock = threading.Lock()
        self._observer = Observer(self._core.lock, self._runtime.events.post, stats=stats)

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

    @property
    def _config(self) -> Config | None:
        return self._core.config

    async def __aenter__(self) -> Group:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    # -- configuration -----------------------------------------------------
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

        Use a fresh store prefix each time (``host:port/prefix``; IPv6 as
        ``[::1]:port/prefix``). A previous configuration is torn down first
        without blocking: its in-flight ops end with ``CommAborted``.
        Someone must host the store: ``python -m ftcomm store``,
        :func:`ftcomm.serve_store`, or torchrun's agent.

        ``store_addr="env://prefix"`` (or ``"env://"``: prefix ``ftcomm``)
        takes the store from ``MASTER_ADDR``/``MASTER_PORT`` and, where
        ``rank``/``world_size`` are not given, ``RANK``/``WORLD_SIZE``: under
        ``torchrun`` its agent hosts that store. Pass ``rank`` and
        ``world_size`` to reconfigure with the survivors.

        ``device_id`` (NCCL/XCCL only): the device index the communicator
        uses; by default the calling thread's current device
        (``torch.cuda.set_device``).

        Raises:
            TypeError, ValueError: a bad argument (checked before anything is
                torn down: the previous configuration stays as it was), a
                ``device_id`` for a backend without devices, or ``env://``
                with ``MASTER_ADDR``/``MASTER_PORT`` (or ``RANK``/``WORLD_SIZE``,
                where not given) missing from the environment.
            CommTimeout: the store or the peers did not answer within the
                configure timeout.
            CommFailed: the store or the native group construction failed.
            CommAborted: ``shutdown()`` or another ``configure()`` superseded this one.
            RuntimeError: awaited without a running asyncio loop (trio).
        """
        require_asyncio("configure()")
        self._runtime.watch_caller()  # debug mode: is the caller's loop ever held?
        addr, given_rank, given_world = _store_and_ranks(store_addr, rank, world_size)
        world_size = v.check_int(given_world, "world_size", minimum=1)
        rank = v.check_rank(given_rank, "rank", world_size)
        if not isinstance(replica_id, str):
            raise TypeError(f"replica_id must be a str, got {type(replica_id).__name__}")
        if quorum_id is not None:
            v.check_int(quorum_id, "quorum_id", maximum=None)
        if group_world_size is not None:
            v.check_int(group_world_size, "group_world_size", minimum=1)
        if group_rank is not None:
            v.check_int(group_rank, "group_rank", minimum=0)
            if group_world_size is not None and group_rank >= group_world_size:
                raise ValueError(
                    f"group_rank must be < group_world_size ({group_world_size}), got {group_rank}"
                )
        ranks: tuple[int, ...] | None = None
        if global_ranks is not None:
            if isinstance(global_ranks, (str, bytes)) or not isinstance(global_ranks, Sequence):
                raise TypeError(
                    f"global_ranks must be a list of int, got {type(global_ranks).__name__}"
                )
            ranks = tuple(
                v.check_int(r, f"global_ranks[{i}]", minimum=0) for i, r in enumerate(global_ranks)
            )
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"global_ranks must not repeat a rank, got {list(ranks)}")
            if len(ranks) != world_size:
                raise ValueError(
                    f"global_ranks must hold world_size ({world_size}) ranks, got {len(ranks)}"
                )
        seconds = resolve(timeout, self._configure_timeout, "timeout")
        device = self._device_index(device_id)
        if self.backend == "dummy" and world_size != 1:
            raise ValueError(f"the dummy backend has world_size 1, got {world_size}")
        spec = ConnectSpec(
            addr,
            rank,
            world_size,
            seconds,
            replica_id,
            quorum_id,
            group_rank,
            group_world_size,
            ranks,
            device,
        )
        started = time.monotonic()
        try:
            await self._build(spec, started)
        except (Exception, asyncio.CancelledError) as exc:
            self._observer.configure_failed(rank, str(addr), time.monotonic() - started, exc)
            raise

    async def _build(self, spec: ConnectSpec, started: float) -> None:
        """Tear the old configuration down, build the new one from ``spec``
        (``configure()`` began at ``started``)."""
        rank, world_size, seconds = spec.rank, spec.world_size, spec.timeout
        attempt, teardown = self._core.begin(
            CommAborted("the group was reconfigured", rank=rank, op="configure")
        )
        try:
            teardown.run()  # may run the old ops' done-callbacks: user code
            backend = await self._connect_within(spec, seconds, attempt)
        except BaseException as exc:
            self._core.fail(attempt)
            if attempt.superseded_by is not None and not isinstance(exc, asyncio.CancelledError):
                raise self._core.superseded(attempt, rank) from exc
            raise
        table = OpTable(
            self._runtime,
            rank,
            lambda _, until: self._runtime.dispose(*backend.close(), until=until),
            lock=self._core.lock,
            on_error=self._core.table_broke,
            observer=self._observer,
            store=str(spec.store),
        )
        chain = None
        if self._verify:
            chain = Chain(
                lambda outs, t, seconds: backend.allgather(outs, t, seconds),
                rank,
                world_size,
                table.break_,
            )
        sum_ok = _SUM in backend.reduce_ops
        config = Config(backend, table, str(spec.store), sum_ok, chain)
        config.alone_mark = AloneMark(config)
        if backend.short_allreduce and sum_ok and chain is None and backend.device_type == "cpu":
            config.short_dtypes = backend.dtypes

        def on_ready() -> None:  # under the lock: its event comes before any of its ops'
            store = str(spec.store)
            self._observer.configured(rank, world_size, store, time.monotonic() - started)

        if not self._core.ready(attempt, config, on_ready):
            self._runtime.dispose(*backend.close())
            raise self._core.superseded(attempt, rank)
        # Weakly: the worker's reader holds this callback, and must not keep a
        # group that was dropped without shutdown() (and its worker) alive.
        table_ref = weakref.ref(table)

        def on_break(error: CommError) -> None:
            live = table_ref()
            if live is not None:
                live.break_(error._located(rank, None, None))

        backend.watch(on_break)
        if self._launcher is not None and self._launcher.keep_spare:
            self._runtime.run_control(self._refill_for, config)

    def _device_index(self, device_id: object) -> int | None:
        """``configure()``'s ``device_id`` as an index (the caller's current
        device where not given, read on this thread: the connect runs on
        another)."""
        if device_id is None:
            return self._backend_cls.caller_device()
        if self.backend not in ("nccl", "xccl"):
            raise ValueError(f"device_id is for the nccl and xccl backends, not {self.backend!r}")
        if isinstance(device_id, torch.device):
            if device_id.index is None:
                return self._backend_cls.caller_device()
            return device_id.index
        return v.check_int(device_id, "device_id", minimum=0)

    async def _connect_within(self, spec: ConnectSpec, seconds: float, attempt: Attempt) -> Backend:
        """Build the native group on a control thread, within ``seconds``,
        unless ``attempt`` is superseded first (then stop waiting at once).

        Raises the ftcomm error for what went wrong (see :func:`_connect_error`).
        """
        # c10d's store client may retry once more after the timeout: allow it.
        until = time.monotonic() + 2 * seconds + 2.0
        # Completes when nobody waits for this connect any more: superseded,
        # timed out or cancelled. A backend that can, stops connecting then.
        stop: concurrent.futures.Future[Any] = concurrent.futures.Future()
        attempt.superseded.add_done_callback(lambda _: _finish(stop))
        # A thread of its own (never queued behind connects that were given
        # up and hold theirs until the native construction returns), unless
        # nothing can stop this backend's construction (XCCL): then the
        # bounded pool, so that retries cannot pile up threads for good.
        control = self._runtime.control
        if self._backend_cls.stoppable_connect:
            cf = control.spawn(self._connect, spec, stop, until=until)
        else:
            cf = control.submit(self._connect, spec, stop, until=until)
        wrapped = asyncio.wrap_future(cf)
        # Not wrap_future: cancelling that wrapper would cancel the attempt's future.
        loop = asyncio.get_running_loop()
        superseded: asyncio.Future[Any] = loop.create_future()
        attempt.superseded.add_done_callback(lambda _: wake_threadsafe(loop, superseded))
        waiting: set[asyncio.Future[Any]] = {wrapped, superseded}
        try:
            await asyncio.wait(waiting, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled, possibly in the very iteration the group landed
            _finish(stop)
            self._orphan(wrapped, cf)
            raise
        where = f"store {spec.store}"
        if not wrapped.done():
            _finish(stop)
            self._orphan(wrapped, cf)
            if attempt.superseded_by is not None:
                raise self._core.superseded(attempt, spec.rank)
            progress = spec.progress
            raise _configure_timeout(seconds, spec) from progress.cause
        try:
            return wrapped.result()
        except TimeoutError as exc:
            if isinstance(exc, CommError) or spec.progress.step not in ("store", "meet"):
                raise _connect_error(exc, where, spec.rank) from exc
            # the connect's own deadline in the store, a moment after ours: say it as ours
            raise _configure_timeout(seconds, spec, exc) from (spec.progress.cause or exc.__cause__)
        except Exception as exc:  # arguments were checked: this is the store or a peer
            if getattr(exc, "remote_type", None) in _TIMEOUT_NAMES:
                raise _configure_timeout(seconds, spec, exc) from exc  # a worker's deadline
            raise _connect_error(exc, where, spec.rank) from exc

    def _refill_for(self, config: Config) -> None:
        """Start a spare worker if ``config`` is still the group's (a control thread)."""
        launcher = self._launcher
        if launcher is None:
            return
        # Read before the check: shutdown() clears the configuration before it
        # closes the launcher, so either the check fails or refill() sees the
        # generation move and gives up.
        generation = launcher.generation
        if self._core.config is config:
            launcher.refill(generation)

    def _orphan(self, wrapped: asyncio.Future[Backend], cf: Any) -> None:
        """Nobody will read this connect: dispose of its group whenever it lands."""
        wrapped.cancel()  # a call already running is not stopped; its result is unread
        cf.add_done_callback(self._dispose_orphan)  # runs at once if it has landed

    def _dispose_orphan(self, cf: Any) -> None:
        if not cf.cancelled() and cf.exception() is None:
            self._runtime.dispose(*cf.result().close())

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
        if self._launcher is not None:
            self._launcher.close()
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

    def flush(self) -> None:
        """Send the open batch of fused allreduces now (``fuse=True``, or in a
        :meth:`batch` block), as one native op; a no-op without one. A point
        of the program's order: call it at the same place on every rank.
        Any thread.

        Raises:
            Nothing: a batch the group refuses fails its ops (their awaits
            raise), as an op refused at issue would.
        """
        cfg = self._core.config
        if cfg is None:
            return
        batch = cfg.batch
        if batch is not None:
            self._flush_batch(cfg, batch)
        else:
            with self._issue_lock:
                cfg.fuse_alone = True  # a cut point, with nothing to send

    def batch(self) -> BatchScope:
        """A block whose small allreduces are fused, on a group made without
        ``fuse=True`` (with it, a block that ends with a flush)::

            async with group.batch():
                works = [group.allreduce(t) for t in stats]
            await asyncio.gather(*works)   # sent at the block's end, as one op

        The block ends with :meth:`flush`; inside it, looking at an op sends
        its batch as ``fuse=True`` does. It applies to the task (context)
        that entered it, and to tasks started inside it while it lasts:
        ops other tasks issue meanwhile cut the batch (an op that cannot
        join it). ``with`` works too, from a thread.

        Raises:
            RuntimeError: the same block object entered twice.
        """
        return BatchScope(self)

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the default deadline of ops issued from now on.

        Raises:
            TypeError, ValueError: a bad timeout.
        """
        self._timeout = to_seconds(timeout, "timeout")

    @property
    def timeout(self) -> float:
        """The default deadline of new ops, in seconds."""
        return self._timeout

    @property
    def rank(self) -> int:
        """This process's rank in the current configuration.

        Raises:
            NotConfigured: the group is not configured.
        """
        return self._configured("rank").backend.rank

    def size(self) -> int:
        """The world size of the current configuration.

        Raises:
            NotConfigured: the group is not configured.
        """
        return self._configured("size").backend.world_size

    def num_active_work(self) -> int:
        """How many ops of the current configuration have not ended yet."""
        cfg = self._core.config
        return cfg.table.active() if cfg is not None else 0

    def allreduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp.RedOpType | str = _SUM,
        *,
        timeout: Timeout | None = None,
    ) -> Work[torch.Tensor]:
        # The short path: the common small op (a dense contiguous CPU tensor of
        # a dtype the backend sends, the default op and deadline, no verify,
        # no batch() block; with fuse=True, one that goes on its own) is
        # checked and issued here, in one frame and one call into the backend
        # (through the fault seam where a test set one). Measured, 2 ranks each
        # pinned to a core: the layers it skips cost ~10 µs on a ~120 µs op. It
        # does what Collectives.allreduce does for such an op
        # (tests/test_short_path.py holds the two to one outcome); any other
        # call goes there.
        #
        # The batch and fuse_alone are read here without the issue lock, as
        # hints that send an op that will join a batch to the long path early
        # (once a batch is open, its members skip the checks below); both are
        # read again under the lock before the short path issues.
        cfg = self._core._config  # GroupCore.config, read without its property's call
        if (
            cfg is not None
            and (dtypes := cfg.short_dtypes) is not None
            and cfg.batch is None
            and op is _SUM
            and timeout is None
            and not _BATCH_SCOPES.get()
            and type(tensor) is torch.Tensor
            and tensor.is_cpu
            and not tensor.is_nested
            and tensor.layout is _STRIDED
            and tensor.dtype in dtypes
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()
        ):
            fusible = (
                self._fuse and tensor.nelement() * tensor.element_size() <= self._fuse_op_bytes
            )
            if fusible and not cfg.fuse_alone:
                return Collectives.allreduce(self, tensor, op, timeout=timeout)  # joins a batch
            table = cfg.table
            not_issued: tuple[CommError, Broken] | None = None
            with self._issue_lock:
                # On the long path: an open batch (it goes first), a fusible
                # op that joins a batch (not the first since a cut point), and
                # an errored table (it refuses).
                if cfg.batch is None and table.error is None and (cfg.fuse_alone or not fusible):
                    # A fusible op goes on its own, and the next one joins a
                    # batch until its first look; any other op is a cut point.
                    cfg.fuse_alone = not fusible
                    seconds = self._timeout
                    issued = time.perf_counter()  # for its latency
                    deadline = time.monotonic() + seconds
                    backend = cfg.backend
                    inject = faults.injector  # tests: the fault seam, as on the long path
                    try:
                        if inject is None:
                            native = backend.allreduce_sum(tensor, seconds)
                        else:
                            native = inject(
                                "allreduce", lambda: backend.allreduce_sum(tensor, seconds), backend
                            )
                    except (CommError, RuntimeError) as exc:
                        not_issued = self._not_issued_locked(table, "allreduce", exc)
                    else:
                        work = Work(
                            table, "allreduce", table.next_seq(), deadline, native, tensor, issued
                        )
                        if fusible:  # its first look is a cut point (set before anyone sees it)
                            work._batch = cfg.alone_mark
                        table.track(work, seconds)
                        return work
            if not_issued is not None:
                self._raise_not_issued(table, "allreduce", *not_issued)
        return Collectives.allreduce(self, tensor, op, timeout=timeout)

    allreduce.__doc__ = Collectives.allreduce.__doc__

    def _check_open(self, op: str) -> None:
        """Raise what issuing ``op`` now would raise at once: ``NotConfigured``,
        or ``CommAborted`` on an errored group (for ops that never reach a
        native group: the c10d dummy's)."""
        table = self._configured(op).table
        error = table.error
        if error is not None:
            raise _refused(op, error, table.rank) from error

    def _configured(self, op: str) -> Config:
        cfg = self._core.config
        if cfg is None:
            error = self._core.errored()
            if error is not None:
                raise _refused(op, error, None) from error
            state = self._core.state
            raise NotConfigured(
                f"{op} needs a configured group ({state.value}): await group.configure(...) first",
                op=op,
            )
        return cfg

    def _issue(
        self,
        cfg: Config,
        op: str,
        timeout: Timeout | None,
        result: R,
        start: Callable[[Backend, float], NativeOp],
        check: Sequence[torch.Tensor] | None = (),
        extra: int = 0,
        cut: bool = True,
    ) -> Work[R]:
        # Group.allreduce's short path does what this does for a plain op, in
        # one frame: a change here is a change there (tests/test_short_path.py).
        seconds = self._timeout if timeout is None else to_seconds(timeout)
        table = cfg.table
        not_issued: tuple[CommError, Broken] | None = None
        sent: Callable[[], object] | None = None
        try:
            with self._issue_lock:
                if cfg.batch is not None:  # an op that cannot join it: the batch goes first
                    sent = self._send_locked(cfg)
                if cut:  # an op that cannot join a batch: the next fusible op goes at once
                    cfg.fuse_alone = True
                error = table.error
                if error is not None:
                    raise _refused(op, error, table.rank) from error
                issued = time.perf_counter()  # for its latency
                deadline = time.monotonic() + seconds
                try:
                    native = self._start_locked(cfg, op, start, check, extra, deadline, seconds)
                except (CommError, RuntimeError) as exc:
                    not_issued = self._not_issued_locked(table, op, exc)
                else:
                    work = Work(table, op, table.next_seq(), deadline, native, result, issued)
                    table.track(work, seconds)
        finally:
            if sent is not None:
                sent()
        if not_issued is None:
            return work
        self._raise_not_issued(table, op, *not_issued)

    def _not_issued_locked(
        self, table: OpTable, op: str, exc: CommError | RuntimeError
    ) -> tuple[CommError, Broken]:
        """Under the issue lock: the native group refused to issue ``op``
        (``exc``): break the table (marked under the locks; the ops it ends,
        and their callbacks, which may issue ops, end with the issue lock
        released, in :meth:`_raise_not_issued`). Returns the op's error and
        the break."""
        refused = self._refused(table, op, exc)
        if getattr(exc, "_by_abandon", False):
            # Another op's abandon() stopped the native group; its
            # settler is breaking the table with the real cause.
            raise refused from exc.__cause__
        with table._lock:
            return refused, table._break_locked(refused)

    @staticmethod
    def _raise_not_issued(table: OpTable, op: str, refused: CommError, broken: Broken) -> NoReturn:
        """After :meth:`_not_issued_locked`, with the issue lock released: end
        the ops the break ended, and raise the op's error (or, if another
        error broke the table first, ``CommAborted`` naming it)."""
        table._after_break(broken, time.monotonic())
        if broken.cause is refused:
            raise refused from refused.__cause__
        aborted = CommAborted(
            f"{op} refused: the group broke while it was issued ({broken.cause.message})",
            rank=table.rank,
            op=op,
        )
        raise aborted from broken.cause

    def _start_locked(
        self,
        cfg: Config,
        op: str,
        start: Callable[[Backend, float], NativeOp],
        check: Sequence[torch.Tensor] | None,
        extra: int,
        deadline: float,
        seconds: float,
    ) -> NativeOp:
        """Issue one native op (under the issue lock): behind the descriptor
        check with ``verify=True``, through the fault seam in tests."""
        if cfg.chain is not None and check is not None:
            start = self._verified(cfg.chain, op, check, extra, deadline, start)
        inject = faults.injector
        if inject is None:
            return start(cfg.backend, seconds)
        return inject(op, lambda: start(cfg.backend, seconds), cfg.backend)

    # -- fusing (fuse.py; docs/design.md, "Fusing small collectives") ---------
    def _fusing(self, tensor: torch.Tensor) -> bool:
        """Whether an allreduce of ``tensor`` joins the open batch: a small
        one in host memory (the copy back of device tensors would need its
        stream ordered: not done yet)."""
        # _BATCH_SCOPES is () where no block is open, the usual case: no call
        if not self._fuse and not (_BATCH_SCOPES.get() and self._in_block()):
            return False
        return tensor.is_cpu and tensor.nelement() * tensor.element_size() <= self._fuse_op_bytes

    def _in_block(self) -> bool:
        """Whether the calling context is in a :meth:`batch` block of this group."""
        scopes = _BATCH_SCOPES.get()
        return bool(scopes) and any(s.group is self and s.active for s in scopes)

    def _enqueue(
        self, cfg: Config, tensor: torch.Tensor, rop: ReduceOp.RedOpType, timeout: Timeout | None
    ) -> Work[torch.Tensor]:
        """A small allreduce, fused: it joins the open batch (one of its key:
        dtype and reduce op; else the open one is sent first, a cut point);
        a batch that reaches ``fuse_bytes`` is sent. With ``fuse=True``, the
        first one after a cut point goes at once, on its own (docs/design.md,
        "Fusing small collectives"); a plain lone op goes so by
        Group.allreduce's short path, which must keep to these rules."""
        seconds = self._timeout if timeout is None else to_seconds(timeout)
        table = cfg.table
        dtype = tensor.dtype
        nbytes = tensor.nelement() * tensor.element_size()
        after: Callable[[], object] | None = None
        work: Work[torch.Tensor] | None = None
        try:
            with self._issue_lock:
                batch = cfg.batch
                if batch is not None and (
                    batch.dtype is not dtype
                    or batch.op != rop
                    or batch.nbytes + nbytes > self._fuse_bytes
                ):
                    after = self._send_locked(cfg)  # a cut point: the open one goes first
                    batch = None
                error = table.error
                if error is not None:
                    raise _refused("allreduce", error, table.rank) from error
                if batch is None and cfg.fuse_alone and self._fuse and not self._in_block():
                    # The first fusible op since a cut point goes on its own,
                    # below (a lone op awaited before the next is issued waits
                    # for nothing); its first look is a cut point.
                    cfg.fuse_alone = False
                else:
                    if batch is None:
                        batch = cfg.batch = Batch(
                            table, dtype, rop, lambda b: self._flush_batch(cfg, b), copy_back_cpu
                        )
                    member = MemberOp(batch)
                    work = Work(
                        table,
                        "allreduce",
                        table.next_seq(),
                        time.monotonic() + seconds,
                        member,
                        tensor,
                        time.perf_counter(),
                    )
                    member.work = work
                    work._batch = batch
                    batch.add(work, tensor, nbytes)
                    table.track(work, seconds)
                    if batch.nbytes >= self._fuse_bytes and after is None:
                        after = self._send_locked(cfg)  # full (a new batch never is)
        finally:
            if after is not None:
                after()
        if work is not None:
            return work
        alone = self._issue_allreduce(cfg, tensor, rop, timeout, cut=False)
        alone._batch = cfg.alone_mark
        return alone

    def _flush_batch(self, cfg: Config, batch: Batch) -> None:
        """Send ``batch`` if it is still ``cfg``'s open one."""
        after = None
        with self._issue_lock:
            if cfg.batch is batch:
                after = self._send_locked(cfg)
        if after is not None:
            after()

    def _send_locked(self, cfg: Config) -> Callable[[], object] | None:
        """Send the open batch as one native allreduce (under the issue lock,
        in program order); what to run once the lock is released (a refused
        batch breaks the group: its ops end, and their callbacks run)."""
        batch, cfg.batch = cfg.batch, None
        table = cfg.table
        cfg.fuse_alone = True  # a cut point
        if batch is None:
            return None
        if table.error is not None:  # broken: its ops are ending (or end at track)
            batch.abandon()
            return None
        if not batch.begin_send():  # a settler dropped it: the group is breaking
            return None
        rop = batch.op
        deadline = batch.deadline  # its members' earliest
        seconds = max(deadline - time.monotonic(), 0.001)
        try:
            flat = batch.pack()
            native = self._start_locked(
                cfg,
                "allreduce",
                lambda b, s: b.allreduce([flat], rop, s),
                # verify=True checks the members, not the flat buffer: ranks
                # whose batches differ but add up to as many elements would
                # otherwise mix their data unseen (and a lone op of 5 elements
                # would pass for a batch of 2 and 3).
                batch.tensors,
                reduce_code(rop),
                deadline,
                seconds,
            )
        except BaseException as exc:  # the peers sent it: the group is broken
            # Whatever it was (a refusal, no room in /dev/shm, no memory for
            # the flat buffer, an interrupt), the peers issued this op and we
            # did not: the group is broken, and the ops fail. The call that
            # made the cut (an await, an issue, a flush) does not raise it,
            # but for an interrupt, raised again once the lock is released.
            interrupt = None if isinstance(exc, Exception) else exc
            if interrupt is None:
                refused = self._refused(table, "allreduce", exc)  # type: ignore[arg-type]
            else:
                refused = CommFailed(
                    f"allreduce was interrupted while its batch was sent ({type(exc).__name__})",
                    rank=table.rank,
                    op="allreduce",
                )
            if getattr(exc, "_by_abandon", False):
                return batch.refuse(refused)  # the settler that stopped the group breaks it
            with table._lock:
                broken = table._break_locked(refused)
            if broken.cause is not refused:
                # Refused because the group is being stopped (another op's
                # deadline or cancel shut its sockets): its ops are aborted
                # by that, as the ops its break ends.
                refused = aborted_by(broken.cause, rank=table.rank, op="allreduce")
            announce = batch.refuse(refused)

            def after() -> None:
                try:
                    table._after_break(broken, time.monotonic())
                finally:
                    announce()
                if interrupt is not None:
                    raise interrupt

            return after
        return batch.sent(native)

    @staticmethod
    def _verified(
        chain: Chain,
        op: str,
        check: Sequence[torch.Tensor],
        extra: int,
        deadline: float,
        start: Callable[[Backend, float], NativeOp],
    ) -> Callable[[Backend, float], NativeOp]:
        """``start`` behind a descriptor check (``verify=True``; under the issue lock)."""
        desc = describe(op, chain.next_seq(), check, extra)

        def verified(backend: Backend, seconds: float) -> NativeOp:
            vop = VerifiedOp(desc, lambda s: start(backend, s), deadline)
            return chain.submit(vop)

        return verified

    @staticmethod
    def _refused(table: OpTable, op: str, exc: Exception) -> CommError:
        """The error of an op the native group refused to issue. Arguments
        were checked before, so this is a broken group (Gloo: "Application
        timeout caused pair closure"); a CommError from below (a dead worker)
        says what broke.

        The error is kept (``errored()``, until ``configure()``): ``exc``
        and the errors chained to it lose their tracebacks, whose frames
        hold the refused op's tensors (a batch's members and flat buffer, a
        staging segment) and the native group."""
        exc = without_tracebacks(exc)
        if isinstance(exc, CommError):
            return exc._located(table.rank, op, None)
        failed = CommFailed(f"{op} could not be issued: {exc}", rank=table.rank, op=op)
        failed.__cause__ = exc
        return failed


def _store_and_ranks(
    store_addr: object, rank: object, world_size: object
) -> tuple[StoreAddr, object, object]:
    """``configure()``'s store address, rank and world size: from the
    environment for ``env://`` (where not given), else as given."""
    if isinstance(store_addr, str) and store_addr.startswith(ENV_SCHEME):
        addr = parse_env_addr(store_addr)
        found = {}
        for name, given, var in (("rank", rank, "RANK"), ("world_size", world_size, "WORLD_SIZE")):
            if given is None:
                found[name] = env_int(var)
                if found[name] is None:
                    raise ValueError(
                        f"configure({store_addr!r}) needs {name}: pass it, or set {var} "
                        "in the environment (torchrun does)"
                    )
        world = found.get("world_size", world_size)
        env_rank = found.get("rank")
        if "world_size" in found and isinstance(world, int) and world < 1:
            raise ValueError(f"the environment's WORLD_SIZE={world} is not a world size")
        if env_rank is not None and isinstance(world, int) and not 0 <= env_rank < world:
            raise ValueError(
                f"the environment's RANK={env_rank} is not a rank of a world of {world}"
            )
        return addr, found.get("rank", rank), world
    parsed = parse_store_addr(store_addr)
    for name, given in (("rank", rank), ("world_size", world_size)):
        if given is None:
            raise TypeError(
                f"configure() needs {name} (only an env:// store address reads it "
                "from the environment)"
            )
    return parsed, rank, world_size


def _refused(op: str, error: CommError, rank: int | None) -> CommAborted:
    """The error an op issued on a group that ``error`` broke raises."""
    return CommAborted(
        f"{op} refused: the group is errored ({error.message}); call configure()",
        rank=rank,
        op=op,
    )
