"""Worlds whose ranks are threads of this process (``run_world(mode="thread")``).

Each rank gets a thread with its own event loop and runs ``fn(ctx)`` there;
its ftcomm groups are ordinary Gloo groups (torch allows one per thread). No
process starts, so a world costs milliseconds instead of seconds. What a
thread cannot do: be killed or stopped, so plans with those faults are
refused. A rank still running at the world's bound has its task cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
import time
import traceback
import uuid
from typing import Any

from .._runtime import faults as _seam
from .._runtime.loop import get_runtime, new_event_loop
from .._runtime.native import NativeOp
from ._base import (
    HarnessStore,
    RankContext,
    RankFn,
    child_pids,
    exception_line,
    find_leaks,
    open_fds,
    rank_coroutine,
    release_store,
    thread_ids,
    world_error,
)
from ._faults import FaultPlan, Injector, Kind


class _DirectControl:
    """The control pipe of a process rank, as plain calls on the store."""

    def __init__(self, store: HarnessStore) -> None:
        self._store = store

    def send(self, request: object) -> None:
        if request == "break_store":
            self._store.break_()

    def recv(self) -> str:
        return "done"


class _PerThread:
    """One seam for the process: each rank thread's own injector."""

    def __init__(self) -> None:
        self.by_thread: dict[int, Injector] = {}

    def __call__(self, op: str, issue: _seam.Issue, backend: object) -> NativeOp:
        injector = self.by_thread.get(threading.get_ident())
        return issue() if injector is None else injector(op, issue, backend)


def run_thread_world(
    fn: RankFn,
    world_size: int,
    loop: str,
    args: tuple[Any, ...],
    plan: FaultPlan | None,
    timeout: float,
    backend: str,
) -> list[Any]:
    if plan is not None and plan.ranks_that(Kind.KILL, Kind.STOP):
        raise ValueError("kill and stop faults need run_world(mode='process')")
    rt = get_runtime()
    _first_store_of_the_process()
    base_fds, base_threads, base_children = open_fds(), thread_ids(), child_pids()
    store = HarnessStore()
    world_id = uuid.uuid4().hex[:12]
    results: list[Any] = [None] * world_size
    returned: set[int] = set()  # ranks whose function has ended (they may be closing)
    failures: dict[int, str] = {}
    tasks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = {}
    dispatch = _PerThread()
    previous = _seam.set_injector(dispatch) if plan is not None else None

    def rank_main(rank: int) -> None:
        ctx = RankContext(rank, world_size, store.port, world_id, loop, backend)
        injector = None
        if plan is not None:
            injector = Injector(plan.for_rank(rank), _DirectControl(store))
            dispatch.by_thread[threading.get_ident()] = injector
        ev = new_event_loop(loop)
        executor = _Executor(f"world-{world_id}-rank{rank}-executor")
        ev.set_default_executor(executor)
        try:
            task = ev.create_task(rank_coroutine(fn, ctx, args))
            tasks[rank] = (ev, task)
            try:
                results[rank] = ev.run_until_complete(task)
            finally:
                returned.add(rank)
            if injector is not None and plan is not None:
                unfired = plan.unfired(rank, (f.op for f in injector.applied))
                if unfired:
                    failures[rank] = f"finished without reaching its faults at ops {unfired}"
        except BaseException as exc:
            failures[rank] = f"raised: {exception_line(exc)}\n" + "".join(
                traceback.format_exception(exc)
            )
        finally:
            try:
                left = _close(ev, executor, max(deadline, time.monotonic() + CLOSE_GRACE))
            except BaseException as exc:  # a leftover task stopped the loop, say
                left = f"its loop's close raised: {exception_line(exc)}"
            if left is not None:
                failures.setdefault(rank, f"returned, but {left}")
            release_store(ctx)  # after the close, as the process world does

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"world-rank{r}", daemon=True)
        for r in range(world_size)
    ]
    deadline = time.monotonic() + timeout  # the world's bound, read by rank_main's close
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for rank, thread in enumerate(threads):
            if not thread.is_alive():
                continue
            closing = rank in returned  # its close names what it waits for
            running = tasks.get(rank)
            if running is not None and not closing:  # past the bound: cancel its task
                with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                    running[0].call_soon_threadsafe(running[1].cancel)
            thread.join(10 + CLOSE_GRACE)
            if thread.is_alive():
                where = "in its loop's close" if closing else "outside its event loop"
                failures.setdefault(
                    rank, f"did not finish within {timeout} s (still running, blocked {where})"
                )
            elif not closing:
                failures.setdefault(rank, f"did not finish within {timeout} s (cancelled)")
    finally:
        if plan is not None:
            _seam.set_injector(previous)
        store.close()
    if not failures:
        leaked = find_leaks(rt, base_fds, base_threads, base_children)
        if leaked:
            failures[-1] = f"the world left behind: {leaked}"
    if failures:
        raise world_error(
            [f"rank {r} {text}" if r >= 0 else text for r, text in sorted(failures.items())], plan
        )
    return results


@functools.cache
def _first_store_of_the_process() -> None:
    """Start and stop a store once, before any world counts fds: torch's
    first TCPStore server in a process opens a pipe it keeps for the
    process's life, which is no rank's leak. (Counting the world's store's
    own fds as the baseline instead would hide a rank's fd that reused a
    number the store freed: a ``break_store`` fault drops the server.)"""
    HarnessStore().close()


CLOSE_GRACE = 2.0
"""How long a rank's loop close may wait for what the rank left (its tasks'
cancellation, its executor calls) once the world's bound has passed."""
MIN_WAIT = 0.1  # a step of the loop, at least, for what ends at once


class _Executor(concurrent.futures.ThreadPoolExecutor):
    """A rank loop's default executor (``asyncio.to_thread``,
    ``run_in_executor(None, ...)``), with threads the close can find by name
    (``prefix``: the world's id and the rank's). An executor a rank installs
    itself is the rank's to shut down: the close does not wait for it."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        super().__init__(thread_name_prefix=prefix)

    def threads(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith(self.prefix + "_")]


def _close(ev: asyncio.AbstractEventLoop, executor: _Executor, until: float) -> str | None:
    """Close a rank's loop as ``asyncio.run`` closes its own (the process
    world's ranks run under it): cancel the tasks the rank left, finish its
    async generators, and join its executor's threads, then close; each wait
    bounded by ``until`` (monotonic), where ``asyncio.run`` waits forever.
    Returns what the rank left that would not end by then, or None."""
    try:
        left = asyncio.all_tasks(ev)
        for task in left:
            task.cancel()
        if left:
            timeout = max(MIN_WAIT, until - time.monotonic())
            ev.run_until_complete(asyncio.wait(left, timeout=timeout))
            stuck = [task for task in left if not task.done()]
            if stuck:
                return f"left {len(stuck)} task(s) that would not end when cancelled: {stuck}"
            for task in left:  # as asyncio.run: a leftover task's error is logged
                if not task.cancelled() and task.exception() is not None:
                    ev.call_exception_handler(
                        {
                            "message": "a task the rank left raised as its loop closed",
                            "exception": task.exception(),
                            "task": task,
                        }
                    )
        # asyncio.wait, not wait_for: a generator whose aclose() swallows its
        # cancel would hold wait_for past any bound (3.11).
        closing = ev.create_task(ev.shutdown_asyncgens())
        timeout = max(MIN_WAIT, until - time.monotonic())
        ev.run_until_complete(asyncio.wait({closing}, timeout=timeout))
        if not closing.done():
            return "left async generators that would not close"
        executor.shutdown(wait=False)  # the queued calls run, as under asyncio.run
        for thread in executor.threads():
            thread.join(max(0.0, until - time.monotonic()))
        running = [t for t in executor.threads() if t.is_alive()]
        if running:
            return f"left executor calls running (asyncio.to_thread, run_in_executor): {running}"
        return None
    finally:
        ev.close()
