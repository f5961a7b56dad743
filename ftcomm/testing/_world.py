"""Worlds: an async function run on N ranks, each a real (spawned) process.

A fresh TCPStore per world on loopback, a wall-clock bound on the whole world
(a hang fails the test, not the suite), each rank's return value or exception
with its traceback, a leak check inside every rank (fds, threads, blocked
ftcomm workers, owner-loop stalls), an optional :class:`FaultPlan` applied
inside the ranks, and every process joined or killed before it returns.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import TCPStore

from ._faults import FaultPlan, Kind, install

_DOOMED_GRACE = 2.0

LOOPS = ("asyncio", "uvloop")
"""The event loops a world's ranks can run on."""


@dataclass
class RankContext:
    """What a rank's function gets: who it is, and where the world's store is."""

    rank: int
    world_size: int
    port: int
    world_id: str
    loop: str
    backend: str = "gloo"
    """The backend the test asked for: ``ftcomm.Group(ctx.backend)``."""
    _store: Any = field(default=None, repr=False)

    def addr(self, name: str = "g0") -> str:
        """A store address unique to this world: ``127.0.0.1:port/<world>/<name>``."""
        return f"127.0.0.1:{self.port}/{self.world_id}/{name}"

    @property
    def store(self) -> Any:
        """A plain store client, for signalling between ranks in a test."""
        if self._store is None:
            self._store = TCPStore(
                "127.0.0.1",
                self.port,
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(seconds=30),
            )
        return self._store

    def signal(self, key: str) -> None:
        """Tell every rank that ``key`` happened (see :meth:`wait_for`)."""
        self.store.set(f"{self.world_id}/sig/{key}", b"1")

    async def wait_for(self, key: str, timeout: float = 30.0) -> None:
        """Wait until some rank has called ``signal(key)``.

        Raises:
            TimeoutError: nobody did within ``timeout`` seconds.
        """
        full = f"{self.world_id}/sig/{key}"
        deadline = time.monotonic() + timeout
        while not self.store.check([full]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rank signalled {key!r} within {timeout} s")
            await asyncio.sleep(0.005)

    def wait_for_blocking(self, key: str, timeout: float = 30.0) -> None:
        """:meth:`wait_for` for a sync rank function: blocks this thread.

        Raises:
            TimeoutError: nobody signalled ``key`` within ``timeout`` seconds.
        """
        try:
            self.store.wait([f"{self.world_id}/sig/{key}"], timedelta(seconds=timeout))
        except RuntimeError as exc:  # torch's DistStoreError
            raise TimeoutError(f"no rank signalled {key!r} within {timeout} s") from exc


@dataclass
class RankFailure:
    """A rank's exception (``None`` if it did not pickle) and its traceback text."""

    rank: int
    error: BaseException | None
    text: str


RankFn = Callable[..., Any]
"""``async def fn(ctx: RankContext, *args) -> value`` (a module-level function), or
a plain ``def`` for sync code such as the c10d facade: it then runs on the rank's
main thread, inside its event loop's first step."""


async def rank_coroutine(fn: RankFn, ctx: RankContext, args: tuple[Any, ...]) -> Any:
    """Run ``fn``, awaiting it if it is a coroutine function."""
    if inspect.iscoroutinefunction(fn):
        return await fn(ctx, *args)
    return fn(ctx, *args)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _threads() -> set[int]:
    return {t.ident or 0 for t in threading.enumerate() if not t.name.startswith("ftcomm-")}


def _stat(pid: object) -> list[str]:
    """``/proc/<pid>/stat`` past the command name (state, ppid, ...); [] if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _children(zombies: bool = False, *, descendants: bool = False) -> set[int]:
    """Child processes of this process, from /proc: live ones, or also
    zombies (exited, never reaped); with ``descendants``, their children
    too, and so on (ranks are the forkserver's children, not ours)."""
    parents, found = {str(os.getpid())}, set[str]()
    stats = [(entry, _stat(entry)) for entry in os.listdir("/proc") if entry.isdigit()]
    while parents:
        parents = {
            entry
            for entry, fields in stats
            if fields[1:2] and fields[1] in parents and (zombies or fields[0] != "Z")
        } - found
        found |= parents
        if not descendants:
            break
    return {int(entry) for entry in found}


# Ranks start from a fork server that has imported torch (about 1.7 s of CPU
# per process otherwise, most of a small world's run time on 2 cores). A
# forked rank has the environment the server started with, and what torch,
# ftcomm or a test's module read from it at import (OMP_NUM_THREADS,
# FTCOMM_SPIN_US, ...) is read then: so the server is used only while the
# environment is the one it started with, but for the variables below (read
# at run time, once _rank_main has put the harness's environment in place);
# after any other change, ranks are spawned, as before.
_PRELOAD = ["torch", "torch.distributed"]
_LATE_ENV = frozenset({"FTCOMM_LOOP", "FTCOMM_DEBUG", "PYTEST_CURRENT_TEST"})
_server_env: dict[str, str] | None = None
_FOREIGN: dict[str, str] = {}  # the fork server was started by someone else


def _mp_context() -> Any:
    """Where ranks start: the fork server (Linux) that this module started,
    while the environment is the one it started with; else a fresh
    interpreter (spawn)."""
    global _server_env
    if sys.platform != "linux":  # elsewhere, forking after torch is imported is not safe
        return mp.get_context("spawn")
    env = {k: v for k, v in os.environ.items() if k not in _LATE_ENV}
    if _server_env is None:
        from multiprocessing import forkserver

        server: Any = getattr(forkserver, "_forkserver", None)
        if server is None or getattr(server, "_forkserver_address", None) is not None:
            _server_env = _FOREIGN  # not ours: what it imported, and with what, is unknown
        else:
            preload = list(getattr(server, "_preload_modules", []))
            forkserver.set_forkserver_preload(preload + [m for m in _PRELOAD if m not in preload])
            forkserver.ensure_running()  # now, with the environment recorded
            _server_env = env
    if _server_env is _FOREIGN or env != _server_env:
        return mp.get_context("spawn")
    return mp.get_context("forkserver")


def _segments() -> set[str]:
    """ftcomm's shared-memory segments in ``/dev/shm`` (every process's)."""
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith("ftcomm-")}
    except FileNotFoundError:  # pragma: no cover - Linux always has it
        return set()


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed since it was listed
        return ""


def _settled(left: Callable[[], set[str]], cap: float = 2.0) -> set[str]:
    """What ``left()`` still finds after at most ``cap`` s. A Gloo device
    (its listening socket, epoll and pipe) may be let go on a thread of its
    own (a Gloo worker returning from a completion callback) just after the
    rank's code saw its op end; what is still open after ``cap`` is a leak.
    Only waited for when an epoll is among the new fds: other leaks are
    reported at once."""
    limit = time.monotonic() + cap
    found = left()
    while found and time.monotonic() < limit:
        time.sleep(0.01)
        found = left()
    return found


def _leaks(rt: Any, fds: set[str], threads: set[int], children: set[int]) -> str | None:
    """What the rank left behind, once ftcomm's blocking work has ended."""
    # A finished call leaves the pool's books just after its future completes.
    # Bounded by the calls' own deadlines: a configure against a broken store may
    # block its control thread up to 2 * timeout + 2 s (see Group.configure).
    rt.workers.wait_idle(15.0)
    rt.control.wait_idle(15.0)
    rt.callbacks.wait_idle(15.0)
    rt.reaper.wait_short(10.0)
    if rt.workers.busy or rt.control.busy:
        return f"{rt.workers.busy + rt.control.busy} ftcomm worker call(s) still blocked"
    if _children() - children:
        return f"child processes left running: {sorted(_children() - children)}"
    if _children(zombies=True) - children:
        return f"child processes left unreaped: {sorted(_children(zombies=True) - children)}"
    mine = {name for name in _segments() if name.startswith(f"ftcomm-{os.getpid()}-")}
    if mine:
        return f"shared-memory segments left in /dev/shm: {sorted(mine)}"
    if rt.reaper.pending:
        # A native group with an op in flight until its own (long) timeout:
        # in-process Gloo cannot be stopped earlier, by design. Its sockets
        # are the reaper's until then, so there is nothing to compare.
        return None
    new_fds = _fds() - fds
    if any(_link(fd) == "anon_inode:[eventpoll]" for fd in new_fds):
        new_fds = _settled(lambda: _fds() - fds)  # a native group's epoll: see _settled
    if new_fds:
        paths = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in new_fds]
        return f"fds left open: {paths}"
    new_threads = _threads() - threads
    if new_threads:
        return f"threads left running: {threading.enumerate()}"
    return None


def _world_error(failures: list[str], plan: FaultPlan | None) -> WorldError:
    if plan is not None:
        failures.append(f"plan: {plan}")
    return WorldError("\n\n".join(failures))


def _rank_main(
    fn: RankFn,
    ctx: RankContext,
    args: tuple[Any, ...],
    plan: FaultPlan | None,
    conn: Any,
    control: Any,
    env: dict[str, str],
) -> None:
    # A rank forked from the fork server has the server's environment: take
    # the harness's (FTCOMM_LOOP, FTCOMM_DEBUG, the test's own variables).
    os.environ.clear()
    os.environ.update(env)
    try:
        from .._runtime.loop import get_runtime

        injector = install(plan, ctx.rank, control) if plan is not None else None
        rt = get_runtime()
        fds, threads, children = _fds(), _threads(), _children()
        if ctx.loop == "uvloop":
            import uvloop

            value: Any = uvloop.run(rank_coroutine(fn, ctx, args))
        else:
            value = asyncio.run(rank_coroutine(fn, ctx, args))
        ctx._store = None  # the harness's own signalling client
        stalls = [s.stack for s in rt.watchdog.stalls] if rt.watchdog else []
        if stalls:
            raise AssertionError(f"owner loop stalled {len(stalls)} time(s):\n{stalls[0]}")
        leaked = _leaks(rt, fds, threads, children)
        if leaked:
            raise AssertionError(f"rank {ctx.rank} left behind: {leaked}")
        fired = [f.op for f in injector.applied] if injector is not None else []
        payload: tuple[str, Any, list[int]] = ("ok", value, fired)
    except BaseException as exc:
        text = "".join(traceback.format_exception(exc))
        try:
            pickle.dumps(exc)
            payload = ("err", RankFailure(ctx.rank, exc, text), [])
        except Exception:
            payload = ("err", RankFailure(ctx.rank, None, text), [])
    # Plain pickle: tensors travel by value, not as shared-memory handles that
    # die with this process.
    conn.send_bytes(pickle.dumps(payload))
    conn.close()


def _stopped(pid: int | None) -> bool:
    """Whether the process is stopped (SIGSTOP), from /proc where there is one."""
    return _stat(pid)[:1] == ["T"]


class _StoreServer:
    """The world's TCPStore, which a rank's fault plan may break.

    A thread answers the ranks' control pipes: on ``"break_store"`` it drops
    the server, so that no new store connection succeeds from then on (every
    later ``configure()`` fails; connections already made keep working).
    """

    def __init__(self) -> None:
        self._server: Any = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        self.port: int = self._server.port
        self.fired: set[int] = set()  # ranks whose kill or stop fault has fired
        self._thread: threading.Thread | None = None

    def serve(self, controls: list[Any]) -> None:
        """Answer the ranks' control pipes (``controls[rank]``) on a thread."""
        self._thread = threading.Thread(
            target=self._answer, args=(dict(enumerate(controls)),), name="world-store-control"
        )
        self._thread.daemon = True
        self._thread.start()

    def _answer(self, controls: dict[int, Any]) -> None:
        by_conn = {conn: rank for rank, conn in controls.items()}
        while by_conn:
            ready: list[Any] = mp_connection.wait(list(by_conn))
            for conn in ready:
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    del by_conn[conn]  # the rank is gone
                    continue
                if request == "break_store":
                    self.break_()
                elif isinstance(request, tuple) and request[0] == "fired":
                    self.fired.add(by_conn[conn])
                try:
                    conn.send("done")
                except OSError:  # it died right after asking
                    del by_conn[conn]

    def break_(self) -> None:
        """Stop taking connections (those already made keep working)."""
        self._server = None

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(10)
        self._server = None


class WorldError(AssertionError):
    """A world failed: a rank raised, died unexpectedly, hung, or leaked.

    The message holds every failing rank's traceback and the fault plan.
    """


def run_world(
    fn: RankFn,
    world_size: int,
    *,
    loop: str = "asyncio",
    timeout: float = 60.0,
    expect_exit: dict[int, int] | None = None,
    args: tuple[Any, ...] = (),
    plan: FaultPlan | None = None,
    backend: str = "gloo",
    mode: str = "process",
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks; return their values in rank order.

    A rank that raised makes this raise :class:`WorldError` with every rank's
    traceback (and the plan), unless the rank is listed in ``expect_exit``
    (rank -> expected exit code, negative for a signal): its value is then
    ``None``. Ranks that ``plan`` kills or stops may die by SIGKILL; once every
    other rank is done, the harness SIGKILLs those still stopped or hung.

    ``mode="thread"`` runs the ranks as threads of this process instead (one
    event loop and one Gloo group each): no process start-up, so a world
    costs milliseconds, but a rank cannot be killed or stopped and a leak is
    only checked in the process as a whole.

    Raises:
        WorldError: a rank raised, died unexpectedly, hung, or left something behind.
        ValueError: an unknown ``loop`` or ``mode``, or kill/stop faults in thread mode.
    """
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    if mode == "thread":
        from ._thread_world import run_thread_world

        return run_thread_world(fn, world_size, loop, args, plan, timeout, backend)
    if mode != "process":
        raise ValueError(f"mode must be 'process' or 'thread', got {mode!r}")
    expect_exit = dict(expect_exit or {})
    if plan is not None:
        outside = sorted({f.rank for f in plan.faults if f.rank >= world_size})
        if outside:
            raise ValueError(f"the plan has faults on ranks {outside} of a world of {world_size}")
    doomed = plan.ranks_that(Kind.KILL, Kind.STOP) if plan is not None else set()
    ctx_mp = _mp_context()
    store = _StoreServer()
    world_id = uuid.uuid4().hex[:12]
    procs: list[Any] = []
    conns: list[Any] = []
    controls: list[Any] = []
    env_before = {name: os.environ.get(name) for name in ("FTCOMM_LOOP", "FTCOMM_DEBUG")}
    os.environ["FTCOMM_LOOP"] = loop
    os.environ.setdefault("FTCOMM_DEBUG", "1")
    try:
        for rank in range(world_size):
            parent, child = ctx_mp.Pipe(duplex=False)
            control, rank_control = ctx_mp.Pipe()
            conns.append(parent)
            controls.append(control)
            ctx = RankContext(rank, world_size, store.port, world_id, loop, backend)
            proc = ctx_mp.Process(
                target=_rank_main,
                args=(fn, ctx, args, plan, child, rank_control, dict(os.environ)),
                name=f"rank{rank}",
            )
            try:
                proc.start()
            finally:
                child.close()
                rank_control.close()
            procs.append(proc)
        store.serve(controls)
    except BaseException:  # a rank could not start: take down those that did
        _tear_down(procs, conns, controls, store)
        raise
    finally:
        for name, before in env_before.items():
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before
    results: list[Any] = [None] * world_size
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    # The ranks a plan may kill or stop come last: by then every other rank
    # is done, and one that has not reported within a short grace is stopped
    # or hung by design -- if its fault has fired.
    order = [r for r in range(world_size) if r not in doomed] + sorted(doomed)
    try:
        for rank in order:
            proc, conn = procs[rank], conns[rank]
            wait = max(0.0, deadline - time.monotonic())
            if rank in doomed:
                wait = 0.0 if _stopped(proc.pid) else min(wait, _DOOMED_GRACE)
            status: str = "hung"
            value: Any = None
            fired: list[int] = []
            if conn.poll(wait):
                try:
                    status, value, fired = pickle.loads(conn.recv_bytes())
                except EOFError:
                    status = "eof"
            elif not proc.is_alive():
                status = "eof"
            if rank in doomed and status in ("eof", "hung") and rank in store.fired:
                proc.kill()
                proc.join(5)
                if proc.exitcode != -signal.SIGKILL:
                    failures.append(f"rank {rank} (doomed by the plan) exit code {proc.exitcode}")
                continue
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
                failures.append(f"rank {rank} did not finish within {timeout} s (killed)")
                continue
            if rank in expect_exit:
                if proc.exitcode != expect_exit[rank]:
                    failures.append(
                        f"rank {rank} exit code {proc.exitcode}, expected {expect_exit[rank]}"
                    )
                continue
            if status == "ok":
                results[rank] = value
                if plan is not None:
                    unfired = plan.unfired(rank, fired)
                    if unfired:
                        failures.append(
                            f"rank {rank} finished without reaching its faults at ops {unfired}"
                        )
            elif status == "err":
                failures.append(f"rank {rank} raised:\n{value.text}")
            else:
                failures.append(f"rank {rank} died with exit code {proc.exitcode}")
    finally:
        _tear_down(procs, conns, controls, store)
    if failures:
        raise _world_error(failures, plan)
    return results


def _tear_down(
    procs: list[Any], conns: list[Any], controls: list[Any], store: _StoreServer
) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        proc.close()
    for conn in conns:
        conn.close()
    store.close()  # every rank is gone: its control pipes are at EOF
    for conn in controls:
        conn.close()
