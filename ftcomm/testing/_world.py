"""Worlds: an async function run on N ranks, each a real (spawned) process.

Owns: :func:`run_world` (which hands ``mode="thread"`` to
``_thread_world.py``), the fork server ranks start from, a rank process's
main, and the teardown that joins or kills every rank (and removes a
network world's namespaces). What a world gives a test (its store, its
bound, its leak checks, its faults): docs/testing.md, "Worlds".
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import functools
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from typing import Any

from ..backends.gloo import HOST_ENV
from ._base import (
    HarnessStore,
    RankContext,
    RankFailure,
    RankFn,
    child_pids,
    exception_line,
    find_leaks,
    on_baseline,
    open_fds,
    proc_stat,
    rank_coroutine,
    release_store,
    thread_ids,
    world_error,
)
from ._faults import NETWORK_KINDS, FaultPlan, Kind, install
from ._net import Network, NetworkFailed, enter, network_missing
from ._thread_world import run_thread_world

_DOOMED_GRACE = 2.0
_DUMP_SIGNAL = signal.SIGUSR1
"""Makes a rank write every thread's stack to its stacks file (``faulthandler``:
at once, whatever its threads are doing)."""
_TASKS_SIGNAL = signal.SIGUSR2
"""Makes a rank write its event loop's tasks' stacks there (once its main
thread runs Python again: a loop that waits does at once)."""
_DUMP_GRACE = 3.0
_DUMP_LIMIT = 10_000
"""Characters kept of each part of a hung rank's dump (threads, tasks)."""
_DUMPED = "(end)"


def _dump_tasks(out: Any, signum: int, frame: Any) -> None:
    """SIGUSR2's handler: never raises into the code it interrupted."""
    try:
        _write_tasks(out)
    except Exception as exc:
        with contextlib.suppress(Exception):
            print(f"(the tasks could not be written: {exc!r})\n{_DUMPED}", file=out, flush=True)


def _write_tasks(out: Any) -> None:
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no loop running on this thread
        print(f"no event loop runs on the main thread\n{_DUMPED}", file=out, flush=True)
        return
    print(f"\n{len(tasks)} asyncio task(s), each down its awaits:", file=out)
    for task in tasks:
        print(f"{task!r:.300}", file=out)
        awaited: Any = task.get_coro()
        for _ in range(64):  # cr_await: the coroutine it awaits; gi_yieldfrom for generators
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None:
                code = frame.f_code
                where = f'"{code.co_filename}", line {frame.f_lineno}, in {code.co_name}'
                print(f"  File {where}", file=out)
            awaited = (
                getattr(awaited, "cr_await", None)
                or getattr(awaited, "gi_yieldfrom", None)
                or getattr(awaited, "ag_await", None)
            )
            if awaited is None:
                break
    print(_DUMPED, file=out, flush=True)


LOOPS = ("asyncio", "uvloop")
"""The event loops a world's ranks can run on."""


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


def _rank_main(
    fn: RankFn,
    ctx: RankContext,
    args: tuple[Any, ...],
    plan: FaultPlan | None,
    conn: Any,
    control: Any,
    env: dict[str, str],
    stacks_path: str,
    netns: str | None,
) -> None:
    # A rank forked from the fork server has the server's environment: take
    # the harness's (FTCOMM_LOOP, FTCOMM_DEBUG, the test's own variables).
    os.environ.clear()
    os.environ.update(env)
    try:
        if netns is not None:
            # Its own host, first, before ftcomm, Gloo or the code under test
            # start a thread: those inherit this thread's namespace. (A rank
            # forked from the fork server has no other thread; a spawned one
            # may have a BLAS pool from an import, which makes no socket.)
            # Gloo listens on the rank's own address there.
            enter(netns)
            os.environ[HOST_ENV] = ctx.host_of(ctx.rank)
        # the harness asks a rank that hangs where it is, before the kill;
        # only once ".armed" is there (the signals' default action is to end it)
        thread_dump = open(stacks_path + ".threads", "w")  # noqa: SIM115 - the process's life
        faulthandler.register(_DUMP_SIGNAL, file=thread_dump, all_threads=True)
        task_dump = open(stacks_path + ".tasks", "w")  # noqa: SIM115
        signal.signal(_TASKS_SIGNAL, functools.partial(_dump_tasks, task_dump))
        open(stacks_path + ".armed", "w").close()
        from .._runtime.loop import get_runtime

        injector = install(plan, ctx.rank, control) if plan is not None else None
        rt = get_runtime()
        fds, threads, children = open_fds(), thread_ids(), child_pids()

        def rebase() -> None:  # ctx.baseline(): what is open now stays open
            fds.update(open_fds())
            threads.update(thread_ids())

        on_baseline(ctx, rebase)
        if ctx.loop == "uvloop":
            import uvloop

            value: Any = uvloop.run(rank_coroutine(fn, ctx, args))
        else:
            value = asyncio.run(rank_coroutine(fn, ctx, args))
        release_store(ctx)
        stalls = [str(s) for s in rt.watchdog.stalls] if rt.watchdog else []
        if stalls:
            raise AssertionError(f"owner loop stalled {len(stalls)} time(s):\n{stalls[0]}")
        leaked = find_leaks(rt, fds, threads, children)
        if leaked:
            raise AssertionError(f"rank {ctx.rank} left behind: {leaked}")
        fired = [f.op for f in injector.applied] if injector is not None else []
        payload: tuple[str, Any, list[int]] = ("ok", value, fired)
    except BaseException as exc:
        at = time.monotonic()
        text = "".join(traceback.format_exception(exc))
        line = exception_line(exc)
        try:
            pickle.dumps(exc)
            payload = ("err", RankFailure(ctx.rank, exc, text, at, line), [])
        except Exception:
            payload = ("err", RankFailure(ctx.rank, None, text, at, line), [])
    # Plain pickle: tensors travel by value, not as shared-memory handles that
    # die with this process.
    conn.send_bytes(pickle.dumps(payload))
    conn.close()


def _stopped(pid: int | None) -> bool:
    """Whether the process is stopped (SIGSTOP), from /proc where there is one."""
    return proc_stat(pid)[:1] == ["T"]


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
    network: bool | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks; return their values in rank order.

    A rank that raised makes this raise :class:`WorldError` with every rank's
    traceback (and the plan), unless the rank is listed in ``expect_exit``:
    its value is then ``None``. Ranks that ``plan`` kills or stops may die by
    SIGKILL; once every other rank is done, the harness SIGKILLs those still
    stopped or hung. See docs/testing.md.

    Args:
        fn: the async function every rank awaits, given its
            :class:`RankContext` (at a module's top level: spawned ranks
            import it).
        world_size: how many ranks the world has.
        loop: the ranks' event loop, one of :data:`LOOPS`.
        timeout: the wall-clock bound on the whole world, in seconds.
        expect_exit: rank -> the exit code it must end with (negative for a
            signal).
        args: more positional arguments for ``fn``.
        plan: the faults to inject (docs/testing.md, "Faults as data").
        backend: the backend name the ranks read as ``ctx.backend``.
        mode: ``"process"`` (a spawned process per rank) or ``"thread"`` (a
            thread of this process per rank: docs/testing.md, "Worlds").
        network: whether each rank is a host of its own (``None``: where
            ``plan`` holds a network fault; docs/testing.md, "Network faults").

    Raises:
        WorldError: a rank raised, died unexpectedly, hung, or left something behind.
        ValueError: an unknown ``loop`` or ``mode``, kill/stop or network
            faults in thread mode, network faults with ``network=False``, or
            faults on a rank outside the world.
        TypeError: ``network`` is neither a bool nor ``None``.
        RuntimeError: a network world cannot run here, or its namespaces
            could not be made (the command's own words).
    """
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    if network is not None and not isinstance(network, bool):
        raise TypeError(f"network must be a bool or None, got {type(network).__name__}")
    network_faults = plan is not None and bool(plan.ranks_that(*NETWORK_KINDS))
    if network is False and network_faults:
        raise ValueError("the plan has network faults: they need network=True (or left out)")
    network = network_faults if network is None else network
    if network and mode == "thread":
        raise ValueError("network faults and network=True need run_world(mode='process')")
    if mode not in ("process", "thread"):
        raise ValueError(f"mode must be 'process' or 'thread', got {mode!r}")
    if plan is not None:
        outside = sorted({f.rank for f in plan.faults if f.rank >= world_size})
        if outside:
            raise ValueError(f"the plan has faults on ranks {outside} of a world of {world_size}")
    if mode == "thread":
        return run_thread_world(fn, world_size, loop, args, plan, timeout, backend)
    expect_exit = dict(expect_exit or {})
    doomed = plan.ranks_that(Kind.KILL, Kind.STOP) if plan is not None else set()
    ctx_mp = _mp_context()
    started = time.monotonic()
    if network:
        missing = network_missing()
        if missing is not None:
            raise NetworkFailed(f"a world with network=True cannot run here: {missing}")
    stacks_dir = tempfile.mkdtemp(prefix="ftcomm-world-")  # a hung rank's stacks
    world_id = uuid.uuid4().hex[:12]
    procs: list[Any] = []
    conns: list[Any] = []
    controls: list[Any] = []
    net: Network | None = None
    store: HarnessStore | None = None
    # From here on, whatever happens (a rank that cannot start, an interrupt),
    # every process is taken down and the network removed.
    try:
        net = Network(world_size) if network else None
        store = HarnessStore(net)
        env_before = {name: os.environ.get(name) for name in ("FTCOMM_LOOP", "FTCOMM_DEBUG")}
        os.environ["FTCOMM_LOOP"] = loop
        os.environ.setdefault("FTCOMM_DEBUG", "1")
        try:
            for rank in range(world_size):
                parent, child = ctx_mp.Pipe(duplex=False)
                control, rank_control = ctx_mp.Pipe()
                conns.append(parent)
                controls.append(control)
                hosts = net.hosts if net is not None else ()
                ctx = RankContext(
                    rank, world_size, store.port, world_id, loop, backend, store.host, hosts
                )
                proc = ctx_mp.Process(
                    target=_rank_main,
                    args=(
                        fn,
                        ctx,
                        args,
                        plan,
                        child,
                        rank_control,
                        dict(os.environ),
                        os.path.join(stacks_dir, f"rank{rank}.stacks"),
                        net.namespaces[rank] if net is not None else None,
                    ),
                    name=f"rank{rank}",
                )
                try:
                    proc.start()
                finally:
                    child.close()
                    rank_control.close()
                procs.append(proc)
            store.serve(controls)
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
        dumps: dict[int, str] | None = None
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
                except Exception as exc:  # an exception that pickles, but does not unpickle
                    line = f"(its result could not be read: {exc!r})"
                    status, value = "err", RankFailure(rank, None, line, None, line)
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
                if dumps is None:  # every rank still running, at once, before any kill
                    dumps = _dump_stacks(
                        {r: p for r, p in enumerate(procs) if p.is_alive()}, stacks_dir
                    )
                stacks = dumps.get(rank, "(no stacks: it was not running at the bound)")
                proc.kill()
                proc.join(5)
                failures.append(
                    f"rank {rank} did not finish within {timeout} s (killed)\n"
                    f"where its threads and tasks were:\n{stacks}"
                )
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
                when = f" {value.at - started:.1f} s in" if value.at is not None else ""
                failures.append(f"rank {rank} raised{when}: {value.line}\n{value.text}")
            else:
                failures.append(f"rank {rank} died with exit code {proc.exitcode}")
    finally:
        _tear_down(procs, conns, controls, store, stacks_dir, net)
    if failures:
        raise world_error(failures, plan)
    return results


def _dump_stacks(procs: dict[int, Any], stacks_dir: str) -> dict[int, str]:
    """Where each of ``procs`` (rank -> process, hung) is: every thread's
    stack and each task's awaits, asked of all at once (so that none shows
    the aftermath of another's kill) and waited for, bounded. A rank that
    has not set its handlers up yet, or is stopped, is not asked."""
    paths = {r: os.path.join(stacks_dir, f"rank{r}.stacks") for r in procs}
    armed = {r for r, path in paths.items() if os.path.exists(path + ".armed")}
    stopped = {r for r, proc in procs.items() if _stopped(proc.pid)}
    asked = {r: procs[r] for r in armed - stopped}
    for proc in asked.values():
        with contextlib.suppress(OSError):
            os.kill(proc.pid, _DUMP_SIGNAL)
            os.kill(proc.pid, _TASKS_SIGNAL)
    deadline = time.monotonic() + _DUMP_GRACE
    # the threads are written at once; the tasks once the main thread runs Python
    while time.monotonic() < deadline and not all(
        _read(paths[r] + ".tasks").endswith(_DUMPED + "\n") for r in asked
    ):
        time.sleep(0.05)
    dumps = {}
    for rank, path in paths.items():
        if rank not in armed:
            dumps[rank] = "(no stacks: it had not started the function)"
        elif rank in stopped:
            dumps[rank] = "(no stacks: it is stopped)"
        else:
            threads = _read(path + ".threads") or "(no thread stacks: it did not answer)\n"
            tasks = _read(path + ".tasks") or "(no tasks: its main thread did not run Python)\n"
            dumps[rank] = _cut(threads) + _cut(tasks)
    return dumps


def _read(path: str) -> str:
    """A file's text ('' where it is not there); partly written is fine."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _cut(text: str) -> str:
    return text if len(text) <= _DUMP_LIMIT else text[:_DUMP_LIMIT] + "\n... (cut)\n"


def _tear_down(
    procs: list[Any],
    conns: list[Any],
    controls: list[Any],
    store: HarnessStore | None,
    stacks_dir: str,
    net: Network | None,
) -> None:
    try:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            proc.close()
        for conn in conns:
            conn.close()
        if store is not None:
            store.close()  # every rank is gone: its control pipes are at EOF
        for conn in controls:
            conn.close()
        shutil.rmtree(stacks_dir, ignore_errors=True)
    finally:
        if net is not None:  # last: the ranks and the store were its users
            net.close()
