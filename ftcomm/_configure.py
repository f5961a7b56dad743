"""The connect step: how a :class:`~ftcomm.Group` builds, rebuilds and gives
up its native group.

Owns ``configure()``: its argument checks, the store address and ranks
(``env://`` included), the connect on a control thread within the configure
timeout, the op table of each configuration, and the one place a failed
connect becomes an ftcomm error. The transitions themselves (begin, ready,
fail) are ``GroupCore``'s (``_state.py``). See docs/configure.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ReduceOp

from . import _validate as v
from ._runtime.deadline import Timeout, resolve
from ._runtime.fuse import AloneMark
from ._runtime.loop import get_runtime, require_asyncio, wake_threadsafe
from ._runtime.observe import Observer
from ._runtime.table import OpTable
from ._state import Attempt, Config, GroupCore
from ._store import (
    ENV_SCHEME,
    Stopped,
    StoreAddr,
    env_int,
    parse_env_addr,
    parse_store_addr,
)
from ._verify import Chain
from .backends import Backend, ConnectSpec
from .errors import CommAborted, CommError, CommFailed, CommTimeout, PrefixReused

if TYPE_CHECKING:
    from .backends.subprocess import Launcher

_SUM = ReduceOp.SUM

# A configure that fails with one of these ran out of time: TimeoutError
# (ftcomm's own connects raise it, the store's too: see _store.py) and c10d's
# store error, raised by its waits for the peers' keys when they time out.
# c10d's DistNetworkError is not here: it means a timeout or a broken
# connection alike, and _store.py tells the two apart where it can.
_TIMEOUTS: tuple[type[BaseException], ...] = (TimeoutError, torch.distributed.DistStoreError)
_TIMEOUT_NAMES = frozenset(t.__name__ for t in _TIMEOUTS)

# The connect's steps whose own TimeoutError is configure's deadline passing
# (each waits until that deadline): the store, meeting the other ranks, a
# worker process's start and its connect. Which of the two timers fires
# first is the machine's doing, and the error says the same either way.
_OWN_DEADLINE_STEPS = frozenset({"store", "meet", "worker", "worker-connect"})


def _connect_error(exc: Exception, where: str, rank: int) -> CommError:
    """The one place a failed connect becomes an ftcomm error: by the type of
    what the backend raised (a worker's error by its type's name), never by
    the clock. The native message is kept: it is what a user can act on."""
    if isinstance(exc, CommError):
        return exc.at(rank, "configure", None)
    remote_type = getattr(exc, "remote_type", None)  # raised in a subprocess worker
    if remote_type == PrefixReused.__name__:  # the worker's own words, as its own class
        said = str(exc).partition(": ")[2]
        return PrefixReused(
            re.sub(r" \[rank=\d+ op=configure\]$", "", said), rank=rank, op="configure"
        )
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
            "built in time (a peer unreachable on its own address, or a slow start); "
            "try again at a fresh prefix"
        )
    elif progress.detail:  # meeting the other ranks, a worker starting, ...
        why = f"{progress.detail} (store {spec.store})"
    elif progress.step == "starting":  # its thread had not run yet
        why = (
            f"this rank's connect had not begun (a busy machine, or a timeout too short) "
            f"(store {spec.store})"
        )
    else:
        why = f"store {spec.store}"
    return CommTimeout(
        f"configure timed out after {seconds:g} seconds: {why}", rank=spec.rank, op="configure"
    )


def connect_in_process(
    cls: type[Backend], spec: ConnectSpec, cancel: concurrent.futures.Future[Any]
) -> Backend:
    """Build the group in this process; ``cancel`` stops a backend that can
    be stopped while it connects (NCCL/XCCL abort their communicator).
    Others finish, and the group disposes of what they built."""
    return cls.connect(spec, cancel)


def _begin_connect(
    connect: Callable[[ConnectSpec, concurrent.futures.Future[Any]], Backend],
    spec: ConnectSpec,
    stop: concurrent.futures.Future[Any],
) -> Backend:
    """A connect's control thread: it begins ``connect`` only if nobody gave
    it up while the call waited for its thread (the call's future is running
    by now: too late to cancel)."""
    if stop.done():
        raise Stopped
    return connect(spec, stop)


def _finish(fut: concurrent.futures.Future[Any]) -> None:
    """Complete ``fut`` unless it is (any thread, any number of times)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        fut.set_result(None)


class Configurer:
    """A group's connect step: :meth:`configure` and its steps.

    Args:
        core: the group's state, whose transitions a configure drives.
        observer: the group's stats and events.
        backend: the backend's name.
        backend_cls: the backend's class.
        connect: builds the native group (blocks; run on a control thread).
        launcher: the worker processes' launcher (``subprocess=True``), or ``None``.
        verify: whether each collective is checked first (``verify=True``).
        configure_timeout: the default deadline of a configure, in seconds.
    """

    def __init__(
        self,
        core: GroupCore,
        observer: Observer,
        backend: str,
        backend_cls: type[Backend],
        connect: Callable[[ConnectSpec, concurrent.futures.Future[Any]], Backend],
        launcher: Launcher | None,
        verify: bool,
        configure_timeout: float,
    ) -> None:
        self._core = core
        self._observer = observer
        self.backend = backend
        self.backend_cls = backend_cls
        self._connect = connect
        self.launcher = launcher
        self._verify = verify
        self._configure_timeout = configure_timeout
        self._runtime = get_runtime()

    def check(
        self,
        store_addr: str,
        rank: int | None,
        world_size: int | None,
        replica_id: str,
        quorum_id: int | None,
        group_rank: int | None,
        group_world_size: int | None,
        global_ranks: Sequence[int] | None,
        timeout: Timeout | None,
        device_id: int | torch.device | None,
    ) -> ConnectSpec:
        """The connect that :meth:`ftcomm.Group.configure`'s arguments ask for
        (its signature and defaults are there, once), checked before anything
        is torn down: first that the caller runs asyncio, then each argument.

        Raises:
            RuntimeError: no running asyncio loop (trio).
            TypeError, ValueError: a bad argument, named (see ``Group.configure``).
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
        return ConnectSpec(
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

    async def configure(self, spec: ConnectSpec) -> None:
        """Build the configuration :meth:`check` gave (``Group.configure``)."""
        rank, addr = spec.rank, spec.store
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
                live.break_(error.at(rank, None, None))

        backend.watch(on_break)
        if self.launcher is not None and self.launcher.keep_spare:
            self._runtime.run_control(self._refill_for, config)

    def _device_index(self, device_id: object) -> int | None:
        """``configure()``'s ``device_id`` as an index (the caller's current
        device where not given, read on this thread: the connect runs on
        another)."""
        if device_id is None:
            return self.backend_cls.caller_device()
        if self.backend not in ("nccl", "xccl"):
            raise ValueError(f"device_id is for the nccl and xccl backends, not {self.backend!r}")
        if isinstance(device_id, torch.device):
            if device_id.index is None:
                return self.backend_cls.caller_device()
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
        # timed out or cancelled. This attempt alone completes it (_finish);
        # the connect only reads it. Not begun then, the connect never begins
        # (_begin_connect); begun, a backend that can stops at its next step
        # (in-process Gloo also inside its native construction: StoppableStore).
        stop: concurrent.futures.Future[Any] = concurrent.futures.Future()
        attempt.superseded.add_done_callback(lambda _: _finish(stop))
        # A thread of its own (never queued behind connects that were given
        # up and hold theirs until the native construction returns), unless
        # nothing can stop this backend's construction (XCCL): then the
        # bounded pool, so that retries cannot pile up threads for good.
        control = self._runtime.control
        if self.backend_cls.stoppable_connect:
            cf = control.spawn(_begin_connect, self._connect, spec, stop, until=until)
        else:
            cf = control.submit(_begin_connect, self._connect, spec, stop, until=until)
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
            backend: Backend = wrapped.result()
            return backend
        except TimeoutError as exc:
            if isinstance(exc, CommError) or spec.progress.step not in _OWN_DEADLINE_STEPS:
                raise _connect_error(exc, where, spec.rank) from exc
            # the connect's own deadline (in the store, or a worker's start), a
            # moment after ours: say it as ours
            raise _configure_timeout(seconds, spec, exc) from (spec.progress.cause or exc.__cause__)
        except Exception as exc:  # arguments were checked: this is the store or a peer
            if getattr(exc, "remote_type", None) in _TIMEOUT_NAMES:
                raise _configure_timeout(seconds, spec, exc) from exc  # a worker's deadline
            raise _connect_error(exc, where, spec.rank) from exc

    def _refill_for(self, config: Config) -> None:
        """Start a spare worker if ``config`` is still the group's (a control thread)."""
        launcher = self.launcher
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
