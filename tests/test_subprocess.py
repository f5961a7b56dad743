"""The subprocess backend: worker lifecycle, its death, stale replies, drills.

In-process tests drive one worker through a world-size-1 Gloo group (a real
store server in this process); drills run 2-rank worlds in real processes on
the fault-injection harness (``Fault.worker_*``, ``Fault.corrupt_frame``),
and every one ends with a fresh ``configure`` and a correct op on a new
worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from helpers import StoreServer, subprocess_backend

import ftcomm
from ftcomm import CommAborted, CommTimeout, NotConfigured, ProtocolError, WorkerDied
from ftcomm._protocol import Done, Ready
from ftcomm._runtime.loop import get_runtime
from ftcomm.backends.subprocess._client import WorkerProcess
from ftcomm.backends.subprocess._pool import Pool
from ftcomm.testing import Fault, FaultPlan, Kind, RankContext, inspect, run_world
from ftcomm.testing._base import shm_segments

# What these check runs on ftcomm's owner loop and in the worker: asyncio only.
pytestmark = pytest.mark.one_loop


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _is_child(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()


async def _until_dead(worker: WorkerProcess, timeout: float = 5.0) -> None:
    await asyncio.wait_for(asyncio.wrap_future(worker.exited), timeout)


@pytest_asyncio.fixture
async def group(store: StoreServer) -> AsyncIterator[ftcomm.Group]:
    async with ftcomm.Group(
        "gloo", subprocess=True, spare_worker=False, timeout=10, configure_timeout=60
    ) as g:
        await g.configure(f"127.0.0.1:{store.port}/g0", 0, 1)
        yield g


# -- lifecycle -------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_configure_starts_a_worker_and_shutdown_reaps_it(store: StoreServer) -> None:
    g = ftcomm.Group("gloo", subprocess=True, spare_worker=False, timeout=10, configure_timeout=60)
    await g.configure(f"127.0.0.1:{store.port}/a", 0, 1)
    worker = subprocess_backend(g).worker
    assert _is_child(worker.pid)
    assert "subprocess" in repr(g)
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(await g.allreduce(t), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    await g.shutdown()
    assert worker.exited.done()
    assert not _alive(worker.pid)
    assert worker.proc.returncode == -signal.SIGKILL
    with pytest.raises(NotConfigured):
        g.allreduce(t)
    await g.shutdown()  # twice: a no-op


@pytest.mark.asyncio
async def test_each_configure_gets_a_fresh_worker_the_spare_when_there_is_one(
    store: StoreServer,
) -> None:
    rt = get_runtime()
    async with ftcomm.Group("gloo", subprocess=True, timeout=10, configure_timeout=60) as g:
        await g.configure(f"127.0.0.1:{store.port}/a", 0, 1)
        first = subprocess_backend(g).worker
        launcher = inspect(g).launcher
        assert launcher is not None
        # The spare is started on a control thread once the configuration is up.
        assert await asyncio.to_thread(rt.control.wait_idle, 10.0)
        spare = launcher.spare_pid
        assert spare is not None
        assert spare != first.pid
        assert _is_child(spare)

        await g.configure(f"127.0.0.1:{store.port}/b", 0, 1)
        second = subprocess_backend(g).worker
        assert second.pid == spare  # the spare became the worker
        await _until_dead(first)  # the old worker was killed and reaped
        assert torch.equal(await g.allreduce(torch.ones(3)), torch.ones(3))
        assert await asyncio.to_thread(rt.control.wait_idle, 10.0)
        assert launcher.spare_pid not in (None, first.pid, second.pid)
    # shutdown (by the context manager) stopped the worker and the spare
    assert await asyncio.to_thread(rt.workers.wait_idle, 10.0)
    assert launcher.spare_pid is None
    assert not _alive(second.pid)
    assert not _alive(spare)


@pytest.mark.asyncio
async def test_worker_death_while_idle_errors_the_group_at_once(group: ftcomm.Group) -> None:
    worker = subprocess_backend(group).worker
    events: list[ftcomm.Event] = []
    group.subscribe(events.append)
    started = time.monotonic()
    os.kill(worker.pid, signal.SIGKILL)
    await _until_dead(worker)
    noticed = time.monotonic() - started
    error = group.errored()
    assert isinstance(error, WorkerDied)
    assert (error.signal, error.exitcode, error.pid) == (signal.SIGKILL, None, worker.pid)
    assert noticed < 1.0, noticed  # within 100 ms here; generous for a loaded CI machine
    with pytest.raises(CommAborted, match="errored"):
        group.allreduce(torch.ones(1))
    assert group.stats().aborts == {"WorkerDied": 1}
    assert get_runtime().events.wait_idle(10.0)
    assert [(e.kind, type(e.error)) for e in events] == [
        ("worker_died", WorkerDied),
        ("aborted", WorkerDied),
    ]


@pytest.mark.asyncio
async def test_worker_death_mid_op_fails_the_op_with_worker_died(group: ftcomm.Group) -> None:
    worker = subprocess_backend(group).worker
    os.kill(worker.pid, signal.SIGSTOP)  # the op cannot complete: it stays in flight
    works = [group.allreduce(torch.ones(2)), group.broadcast(torch.ones(2), root=0)]
    assert not any(w.done() for w in works)
    assert group.num_active_work() == 2
    started = time.monotonic()
    os.kill(worker.pid, signal.SIGKILL)
    for work in works:
        with pytest.raises(WorkerDied, match="SIGKILL") as info:
            await work
        assert info.value.op in ("allreduce", "broadcast")
        assert info.value.seq is not None
    assert time.monotonic() - started < 1.0
    assert group.num_active_work() == 0


@pytest.mark.asyncio
async def test_abort_kills_the_worker_and_configure_recovers(
    group: ftcomm.Group, store: StoreServer
) -> None:
    worker = subprocess_backend(group).worker
    os.kill(worker.pid, signal.SIGSTOP)
    work = group.allreduce(torch.ones(2))
    await group.abort()
    assert worker.exited.done()  # abort() returns once the worker is reaped
    with pytest.raises(CommAborted):
        await work
    assert isinstance(group.errored(), CommAborted)
    await group.configure(f"127.0.0.1:{store.port}/g1", 0, 1)
    assert subprocess_backend(group).worker.pid != worker.pid
    assert torch.equal(await group.allreduce(torch.full((2,), 3.0)), torch.full((2,), 3.0))


@pytest.mark.asyncio
async def test_deadline_kills_a_stopped_worker(group: ftcomm.Group) -> None:
    worker = subprocess_backend(group).worker
    os.kill(worker.pid, signal.SIGSTOP)
    t = torch.ones(4)
    before = t.clone()
    started = time.monotonic()
    with pytest.raises(CommTimeout):
        await group.allreduce(t, timeout=0.3)
    assert 0.29 <= time.monotonic() - started < 1.3
    await _until_dead(worker)
    assert worker.proc.returncode == -signal.SIGKILL
    assert torch.equal(t, before)  # a failed op never writes into the caller's tensor


@pytest.mark.asyncio
async def test_cancel_kills_the_worker(group: ftcomm.Group) -> None:
    worker = subprocess_backend(group).worker
    os.kill(worker.pid, signal.SIGSTOP)
    t = torch.ones(2)
    with pytest.raises(TimeoutError):  # the cancel scope cancels the awaiting task
        async with asyncio.timeout(0.2):
            await group.allreduce(t, timeout=30)
    await _until_dead(worker)
    assert worker.proc.returncode == -signal.SIGKILL
    assert isinstance(group.errored(), CommAborted)
    assert torch.equal(t, torch.ones(2))


# -- replies -----------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_reply_to_no_op_in_flight_is_dropped(group: ftcomm.Group) -> None:
    worker = subprocess_backend(group).worker
    rt = get_runtime()
    os.kill(worker.pid, signal.SIGSTOP)  # hold the real reply back
    t = torch.full((3,), 2.0)
    work = group.allreduce(t)
    (op_id,) = worker._calls
    # A reply for an op id nobody sent, as a late reply from an abandoned op would be.
    await asyncio.wrap_future(rt.submit(_on_loop(worker._on_frames, [Done(op_id + 1000)])))
    assert worker.dropped == 1
    assert not work.done()
    os.kill(worker.pid, signal.SIGCONT)
    assert torch.equal(await work, torch.full((3,), 2.0))
    # The same reply again (a duplicate): dropped, and the op keeps its result.
    await asyncio.wrap_future(rt.submit(_on_loop(worker._on_frames, [Done(op_id)])))
    assert worker.dropped == 2
    assert work.exception() is None


@pytest.mark.asyncio
async def test_an_unexpected_frame_from_the_worker_is_a_protocol_error(
    group: ftcomm.Group,
) -> None:
    worker = subprocess_backend(group).worker
    rt = get_runtime()
    await asyncio.wrap_future(rt.submit(_on_loop(worker._on_frames, [Ready(worker.pid)])))
    await _until_dead(worker)
    error = group.errored()
    assert isinstance(error, ProtocolError)
    assert "unexpected Ready" in str(error)


async def _on_loop(fn: Any, *args: Any) -> None:
    fn(*args)


@pytest.mark.asyncio
async def test_configure_that_fails_leaves_no_worker(store: StoreServer) -> None:
    # World size 2 with nobody else joining: the worker's group construction
    # times out; the worker is killed and reaped (the leak fixture checks).
    async with ftcomm.Group(
        "gloo", subprocess=True, spare_worker=False, timeout=10, configure_timeout=60
    ) as g:
        with pytest.raises((CommTimeout, ftcomm.CommFailed)):
            await g.configure(f"127.0.0.1:{store.port}/lonely", 0, 2, timeout=2.5)
        assert g.errored() is None
        assert inspect(g).config is None


# -- drills: real processes, the harness's worker faults ---------------------------------------
FAULT_AT = 1  # op 0 succeeds, op 1 meets the fault
EXPECTED = {
    "worker_kill": ("WorkerDied", ("CommFailed", "CommTimeout")),
    "worker_stop": ("CommTimeout", ("CommFailed", "CommTimeout")),
    "worker_close": ("WorkerDied", ("CommFailed", "CommTimeout")),
    "corrupt_frame": ("ProtocolError", ("CommFailed", "CommTimeout")),
}


async def survive_worker_fault(ctx: RankContext, deadline: float) -> dict[str, Any]:
    r, n = ctx.rank, ctx.world_size
    out: dict[str, Any] = {}
    async with ftcomm.Group("gloo", subprocess=True, timeout=deadline, configure_timeout=30) as g:
        await g.configure(ctx.addr("g0"), r, n)
        out["pid0"] = subprocess_backend(g).worker.pid
        assert torch.equal(await g.allreduce(torch.ones(2)), torch.full((2,), float(n)))
        t = torch.full((2,), float(r + 1))
        started = time.monotonic()
        try:
            await g.allreduce(t)
            out["error"] = None
        except ftcomm.CommError as exc:
            out["error"] = type(exc).__name__
        out["elapsed"] = time.monotonic() - started
        out["errored"] = type(g.errored()).__name__
        out["untouched"] = bool(torch.equal(t, torch.full((2,), float(r + 1))))
        await g.configure(ctx.addr("g1"), r, n)
        out["pid1"] = subprocess_backend(g).worker.pid
        result = await g.allreduce(torch.full((3,), float(10 * r + 7)))
        out["after"] = result.tolist()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_drill_worker_fault_then_recover(kind: str) -> None:
    deadline = 2.0
    plan = FaultPlan.of(Fault(Kind(kind), 0, FAULT_AT))
    results = run_world(survive_worker_fault, 2, args=(deadline,), plan=plan, timeout=60)
    expected = float(sum(10 * r + 7 for r in range(2)))
    faulted, peer = EXPECTED[kind]
    for rank, out in enumerate(results):
        assert out["after"] == [expected] * 3, (rank, out)
        assert out["pid1"] != out["pid0"], (rank, out)
        assert out["untouched"], (rank, out)  # the failed op wrote nothing back
    r0, r1 = results
    assert r0["error"] == faulted, r0
    assert r0["errored"] == faulted, r0
    assert r1["error"] in peer, r1
    if faulted == "CommTimeout":
        assert deadline - 0.01 <= r0["elapsed"] < deadline + 1.0, r0
    else:
        assert r0["elapsed"] < 1.0, r0  # noticed at once, not at the deadline


async def stale_reply(ctx: RankContext) -> dict[str, Any]:
    """Op 1 times out on rank 0 (rank 1 joins late); op 2 must carry op 2's data."""
    r, n = ctx.rank, ctx.world_size
    out: dict[str, Any] = {}
    async with ftcomm.Group("gloo", subprocess=True, timeout=10, configure_timeout=60) as g:
        await g.configure(ctx.addr("g0"), r, n)
        first = torch.full((4,), 100.0 + r)
        if r == 0:
            try:
                await g.allreduce(first, timeout=0.5)
                out["op1"] = "ok"
            except CommTimeout:
                out["op1"] = "CommTimeout"
            ctx.signal("timed-out")
        else:
            await ctx.wait_for("timed-out")
            try:  # rank 0's worker is gone: this fails, it cannot succeed
                await g.allreduce(first, timeout=5)
                out["op1"] = "ok"
            except ftcomm.CommError as exc:
                out["op1"] = type(exc).__name__
        await g.configure(ctx.addr("g1"), r, n)
        second = torch.full((4,), float(r + 1))
        out["op2"] = (await g.allreduce(second)).tolist()
        out["op1_tensor"] = first.tolist()
    return out


@pytest.mark.slow
def test_drill_stale_reply_never_reaches_a_later_op() -> None:
    r0, r1 = run_world(stale_reply, 2, timeout=60)
    assert r0["op1"] == "CommTimeout", r0
    assert r1["op1"] in ("CommFailed", "CommTimeout"), r1
    assert r0["op2"] == r1["op2"] == [3.0] * 4, (r0, r1)  # op 2's sum, not op 1's (201)
    assert r0["op1_tensor"] == [100.0] * 4
    assert r1["op1_tensor"] == [101.0] * 4


async def crash_with_a_worker(ctx: RankContext, record: str) -> None:
    async with ftcomm.Group(
        "gloo", subprocess=True, spare_worker=False, timeout=10, configure_timeout=60
    ) as g:
        await g.configure(ctx.addr(), ctx.rank, ctx.world_size)
        await g.allreduce(torch.ones(1 << 16))  # a segment in the pool
        worker = subprocess_backend(g).worker
        await asyncio.to_thread(Path(record).write_text, f"{worker.pid} {os.getpid()}")
        await g.allreduce(torch.ones(4))  # the plan SIGKILLs this rank here


def test_a_crashed_parent_takes_its_worker_and_segments_with_it(tmp_path: Path) -> None:
    record = tmp_path / "pids"
    plan = FaultPlan.of(Fault.kill(0, 1))
    run_world(
        crash_with_a_worker, 1, args=(str(record),), plan=plan, expect_exit={0: -9}, timeout=60
    )
    worker_pid, rank_pid = map(int, record.read_text().split())
    try:
        pidfd = os.pidfd_open(worker_pid)
    except ProcessLookupError:
        pidfd = None  # gone already
    if pidfd is not None:
        try:  # readable once the worker has exited: it saw its socket close
            readable, _, _ = select.select([pidfd], [], [], 5.0)
        finally:
            os.close(pidfd)
        assert readable, f"worker {worker_pid} outlived its parent"
    assert not {s for s in shm_segments() if s.startswith(f"ftcomm-{rank_pid}-")}


# -- found by review: each failed before its fix --------------------------------------------------
@pytest.mark.asyncio
async def test_an_op_cancelled_while_its_outputs_are_copied_back_writes_nothing_after(
    group: ftcomm.Group, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from ftcomm.backends.subprocess import _client

    monkeypatch.setattr(_client, "_CHUNK", 4096)  # a long copy-back, 4 KiB at a time
    n = 16 << 20  # 64 MiB
    out = torch.zeros(n)
    work = group.allgather(torch.ones(n), out=[out])
    call = work._native
    worker = subprocess_backend(group).worker
    seen: dict[str, Any] = {}

    def cancel_mid_copy(native: object) -> None:  # another thread, while this one copies
        deadline = time.monotonic() + 20
        while not getattr(native, "_copying", False) and time.monotonic() < deadline:
            os.sched_yield()
        seen["cancelled"] = work.cancel()
        seen["snapshot"] = out.clone()

    canceller = threading.Thread(target=cancel_mid_copy, args=(call,))
    canceller.start()
    try:
        with pytest.raises(CommAborted):
            await work
    finally:
        canceller.join(30)
    assert seen["cancelled"] is True
    assert torch.equal(out, seen["snapshot"])  # nothing written once cancel() returned
    assert not torch.equal(out, torch.ones(n))  # and the copy was indeed cut short
    await _until_dead(worker)
    del call  # it holds the op's segment (an fd) until collected


def _sync_chain(pg: Any) -> str:
    """A future callback that waits for another op: it must not deadlock."""
    from torch.distributed import AllreduceOptions

    seen: list[str] = []

    def then(_: Any) -> None:
        pg.allreduce([torch.ones(2)], AllreduceOptions()).wait()
        seen.append("ok")

    fut = pg.allreduce([torch.ones(2)], AllreduceOptions()).get_future()
    fut.then(then).wait()
    return seen[0]


def test_a_future_callback_may_wait_for_another_op(store: StoreServer) -> None:
    from ftcomm.c10d import ProcessGroupBabyGloo

    # configure's deadline is the facade's timeout: generous (a worker starts
    # slowly on a loaded machine); the ops' is 5 s, which the chain must beat
    pg = ProcessGroupBabyGloo(timeout=60.0)
    try:
        pg.configure(f"127.0.0.1:{store.port}/cb", "0", 0, 1)
        pg.set_timeout(5.0)
        started = time.monotonic()
        assert _sync_chain(pg) == "ok"
        assert time.monotonic() - started < 4.0  # not ended by the 5 s deadline
        assert pg.errored() is None
    finally:
        pg.shutdown()


_DROP_A_GROUP = """
import asyncio, gc, json, sys, ftcomm
from ftcomm.testing import inspect
from torch._C._distributed_c10d import TCPStore
async def main():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    g = ftcomm.Group("gloo", subprocess=True, spare_worker=False, timeout=10, configure_timeout=60)
    await g.configure(f"127.0.0.1:{store.port}/drop", 0, 1)
    worker = inspect(g).backend.worker
    del g
    gc.collect()
    await asyncio.wait_for(asyncio.wrap_future(worker.exited), 10)
    print(json.dumps({"pid": worker.pid, "code": worker.proc.returncode}))
asyncio.run(main())
"""


def test_a_group_dropped_without_shutdown_does_not_keep_its_worker() -> None:
    # In a fresh interpreter: what a long test session keeps alive (captured
    # logs, tracebacks of earlier tests) must not decide this.
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _DROP_A_GROUP],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == -signal.SIGKILL  # killed when the group was collected
    assert not _alive(out["pid"])


@pytest.mark.asyncio
async def test_a_dead_spare_is_replaced_not_used(store: StoreServer) -> None:
    rt = get_runtime()
    async with ftcomm.Group("gloo", subprocess=True, timeout=10, configure_timeout=60) as g:
        await g.configure(f"127.0.0.1:{store.port}/a", 0, 1)
        assert await asyncio.to_thread(rt.control.wait_idle, 10.0)
        launcher = inspect(g).launcher
        assert launcher is not None
        spare = launcher.spare_pid
        assert spare is not None
        os.kill(spare, signal.SIGKILL)
        await g.configure(f"127.0.0.1:{store.port}/b", 0, 1)
        assert subprocess_backend(g).worker.pid != spare
        assert torch.equal(await g.allreduce(torch.ones(2)), torch.ones(2))


_EXIT_WITH_OP_IN_FLIGHT = """
import asyncio, os, signal, sys, torch, ftcomm
from ftcomm.testing import inspect
from torch._C._distributed_c10d import TCPStore
async def main():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    g = ftcomm.Group("gloo", subprocess=True, spare_worker=False, timeout=30, configure_timeout=60)
    await g.configure(f"127.0.0.1:{store.port}/x", 0, 1)
    worker = inspect(g).backend.worker
    os.kill(worker.pid, signal.SIGSTOP)
    g.allreduce(torch.ones(1 << 16))  # a linked segment, never answered
    print(os.getpid(), worker.pid, flush=True)
    if sys.argv[1] == "fork":  # a forked child keeps the parent's socket end open
        if os.fork() == 0:
            os.read(0, 1)  # until the test closes our stdin
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)
asyncio.run(main())
"""


@pytest.mark.parametrize("how", ["exit", "fork"])
def test_the_parent_going_away_takes_worker_and_segments_with_it(how: str) -> None:
    import subprocess
    import sys

    with subprocess.Popen(
        [sys.executable, "-c", _EXIT_WITH_OP_IN_FLIGHT, how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        parent, worker = map(int, proc.stdout.readline().split())
        pidfd = os.pidfd_open(worker) if _alive(worker) else None
        proc.wait(30)
        if pidfd is not None:
            if how == "fork":  # a stopped worker only sees its parent's exit once resumed
                os.kill(worker, signal.SIGCONT)
            try:
                readable, _, _ = select.select([pidfd], [], [], 10.0)
            finally:
                os.close(pidfd)
            assert readable, f"worker {worker} outlived its parent ({how})"
        assert not {s for s in shm_segments() if s.startswith(f"ftcomm-{parent}-")}
        # leaving the block closes our end of its stdin: a forked child ends


# -- tensors already in shared memory: passed in place, by file descriptor ------------------------
async def shared_in_place(ctx: RankContext) -> dict[str, Any]:
    r, n = ctx.rank, ctx.world_size
    async with ftcomm.Group(
        "gloo", subprocess=True, spare_worker=False, timeout=20, configure_timeout=60
    ) as g:
        await g.configure(ctx.addr(), r, n)
        worker = subprocess_backend(g).worker
        t = torch.arange(8, dtype=torch.float32) + r
        t.share_memory_()
        ptr = t.data_ptr()
        sums = [(await g.allreduce(t)).clone() for _ in range(3)]
        out: dict[str, Any] = {
            "sums": [s.tolist() for s in sums],
            "same_storage": t.data_ptr() == ptr,
            "segments": worker.pool.segments,  # nothing was copied
            "storages_sent": len(worker.pool.shared._sent),  # its fd went once
        }
        # A view at an offset into the same storage: broadcast from rank 0.
        view = t[2:5]
        view.fill_(float(100 + r))
        await g.broadcast(view, root=0)
        out["view"] = view.tolist()
        out["around"] = [t[1].item(), t[5].item()]
        out["storages_sent_after_view"] = len(worker.pool.shared._sent)
    return out


def test_shared_tensors_are_reduced_in_place_without_copies() -> None:
    results = run_world(shared_in_place, 2, timeout=60)
    base = [float(2 * i + 1) for i in range(8)]  # (i + 0) + (i + 1)
    for rank, out in enumerate(results):
        assert out["sums"] == [base, [2 * x for x in base], [4 * x for x in base]], out
        assert out["same_storage"], out
        assert out["segments"] == 0, out
        assert out["storages_sent"] == 1, out
        assert out["view"] == [100.0] * 3, (rank, out)
        assert out["around"] == [4 * base[1], 4 * base[5]], (rank, out)
        assert out["storages_sent_after_view"] == 1, out


# -- large storages that come back: moved into shared memory, then in place ----------------
async def moved_in_place(ctx: RankContext) -> dict[str, Any]:
    import numpy as np

    r, n = ctx.rank, ctx.world_size
    out: dict[str, Any] = {}
    async with ftcomm.Group(
        "gloo",
        subprocess=True,
        spare_worker=False,
        timeout=20,
        share_min_bytes=1 << 20,
        configure_timeout=60,
    ) as g:
        await g.configure(ctx.addr(), r, n)
        worker = subprocess_backend(g).worker
        big = torch.full((1 << 18,), float(r + 1))  # 1 MiB: moved on its second op
        ptr = big.data_ptr()
        await g.allreduce(big)  # 3.0 everywhere
        out["shared_after_first"] = big.is_shared()
        await g.allreduce(big)  # moved, then reduced in place: 6.0
        out["shared_after_second"] = big.is_shared() and big.data_ptr() != ptr
        segments = worker.pool.segments
        view = big[100:200]  # a view of the moved storage, in place too
        view.fill_(float(10 * (r + 1)))
        await g.allreduce(view)
        out["values"] = [big[0].item(), big[150].item(), big[-1].item()]
        out["new_segments"] = worker.pool.segments - segments  # nothing copied
        out["storages_sent"] = len(worker.pool.shared._sent)
        # Memory torch does not own is never moved: numpy keeps seeing the result.
        arr = np.full(1 << 18, float(r + 1), dtype=np.float32)
        wrapped = torch.from_numpy(arr)
        for _ in range(3):
            await g.allreduce(wrapped)
        out["numpy"] = (wrapped.is_shared(), float(arr[0]))
    async with ftcomm.Group(
        "gloo", subprocess=True, spare_worker=False, timeout=20, configure_timeout=60
    ) as g:
        await g.configure(ctx.addr("never"), r, n)
        t = torch.full((1 << 18,), float(r + 1))
        for _ in range(3):
            await g.allreduce(t)
        out["never"] = (t.is_shared(), t[0].item())  # the default: always copied
    return out


def test_a_large_storage_used_again_moves_into_shared_memory() -> None:
    results = run_world(moved_in_place, 2, timeout=60)
    for out in results:
        assert not out["shared_after_first"], out
        assert out["shared_after_second"], out
        assert out["values"] == [6.0, 30.0, 6.0], out
        assert out["new_segments"] == 0, out
        assert out["storages_sent"] == 1, out
        assert out["numpy"] == (False, 3.0 * 2 * 2), out
        assert out["never"] == (False, 3.0 * 2 * 2), out


def test_a_storage_an_op_still_copies_is_not_moved() -> None:
    pool = Pool(share_min_bytes=4096)
    t = torch.ones(1024)  # 4 KiB
    try:
        first = pool.stage([(t, "inout")])  # seen once: copied
        second = pool.stage([(t, "inout")])  # seen again, but `first` copies it
        assert not t.is_shared()
        assert first.copy_back
        assert second.copy_back
        first.unpin()
        first.unpin()  # idempotent
        second.unpin()
        third = pool.stage([(t, "inout")])  # nothing copies it now: moved
        assert t.is_shared()
        assert torch.equal(t, torch.ones(1024))
        assert not third.copy_back
        assert len(third.fds) == 1
        assert third.pins == ()
    finally:
        pool.close()


def test_small_foreign_or_unwanted_storages_are_never_moved() -> None:
    import numpy as np

    pool, never = Pool(share_min_bytes=4096), Pool(share_min_bytes=None)
    small = torch.ones(1023)  # under 4 KiB
    foreign = torch.from_numpy(np.ones(1024, dtype=np.float32))
    big = torch.ones(1024)
    try:
        for _ in range(3):
            for p, t in ((pool, small), (pool, foreign), (never, big)):
                staged = p.stage([(t, "inout")])
                assert staged.copy_back
                staged.unpin()
        assert [small.is_shared(), foreign.is_shared(), big.is_shared()] == [False] * 3
    finally:
        pool.close()
        never.close()


def test_a_storage_named_twice_by_one_op_is_not_moved_by_it() -> None:
    pool = Pool(share_min_bytes=1024)
    t = torch.zeros(1024)
    try:
        first = pool.stage([(t[:512], "in"), (t, "out")])  # an in-place allgather's shape
        first.unpin()
        assert not t.is_shared()  # one op: copied, even though it named t twice
        second = pool.stage([(t[:512], "in"), (t, "out")])
        assert t.is_shared()
        assert not second.copy_back
    finally:
        pool.close()


def test_a_small_view_does_not_move_its_large_storage() -> None:
    pool = Pool(share_min_bytes=4096)
    big = torch.zeros(1 << 16)  # 256 KiB storage
    try:
        for _ in range(3):
            pool.stage([(big[:16], "inout")]).unpin()  # 64 bytes each time
        assert not big.is_shared()
    finally:
        pool.close()


def test_a_storage_whose_move_failed_stays_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def full(self: torch.UntypedStorage) -> torch.UntypedStorage:
        calls.append(self.nbytes())
        raise RuntimeError("unable to open shared memory object: No space left on device")

    monkeypatch.setattr(torch.UntypedStorage, "share_memory_", full)
    pool = Pool(share_min_bytes=1024)
    t = torch.ones(1024)
    try:
        for _ in range(4):
            staged = pool.stage([(t, "inout")])  # never raises: falls back to the copy
            assert staged.copy_back
            staged.unpin()
        assert calls == [4096]  # tried once, on the second op; not again
        assert not t.is_shared()
    finally:
        pool.close()


def test_an_op_waits_for_a_move_of_its_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    real = torch.UntypedStorage.share_memory_
    moving, release = threading.Event(), threading.Event()

    def slow(self: torch.UntypedStorage) -> torch.UntypedStorage:
        moving.set()
        assert release.wait(10)
        return real(self)

    monkeypatch.setattr(torch.UntypedStorage, "share_memory_", slow)
    pool = Pool(share_min_bytes=1024)
    t = torch.ones(1024)
    results: dict[str, Any] = {}
    try:
        pool.stage([(t, "inout")]).unpin()  # seen once
        mover = threading.Thread(target=lambda: results.update(a=pool.stage([(t, "in")])))
        other = threading.Thread(target=lambda: results.update(b=pool.stage([(t, "in")])))
        mover.start()
        assert moving.wait(10)
        other.start()  # the same storage, mid-move: must neither copy nor pin it
        other.join(0.3)
        assert other.is_alive(), "an op staged a storage that was being moved"
        release.set()
        mover.join(10)
        other.join(10)
        assert t.is_shared()
        assert not results["a"].copy_back
        assert not results["b"].copy_back  # in place once the move was done
        assert results["a"].pins == results["b"].pins == ()
    finally:
        release.set()
        pool.close()


def test_an_interrupted_move_leaves_nothing_marked_moving(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from ftcomm.backends.subprocess import _pool

    pool = Pool(share_min_bytes=1024)
    a, b = torch.ones(1024), torch.ones(1024)
    pool.stage([(a, "in"), (b, "in")]).unpin()  # both seen once

    def interrupted(self: torch.UntypedStorage) -> torch.UntypedStorage:
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.UntypedStorage, "share_memory_", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.stage([(a, "in"), (b, "in")])  # the first move is interrupted
        assert not _pool._moving
        monkeypatch.undo()
        staged: list[object] = []
        thread = threading.Thread(target=lambda: staged.append(pool.stage([(b, "in")])))
        thread.start()
        thread.join(10)
        assert staged, "an op waited for a move that nobody was making"
    finally:
        pool.close()


def test_a_shared_storage_dying_inside_the_lock_does_not_deadlock() -> None:
    import threading

    pool = Pool()
    result: list[bool] = []

    def collect_inside() -> None:
        with pool.shared._lock:
            pool.shared._died(12345)  # a finalizer run by a collection, as stage() may
        result.append(True)

    thread = threading.Thread(target=collect_inside)
    thread.start()
    thread.join(5)
    pool.close()
    assert result == [True], "a finalizer under the lock deadlocked"


@pytest.mark.asyncio
async def test_a_forked_child_leaves_its_parents_worker_alone(group: ftcomm.Group) -> None:
    worker = subprocess_backend(group).worker
    pid = os.fork()
    if pid == 0:  # the child: what its exit would run (weakref finalizers at exit)
        try:
            worker._finalizer()
        finally:
            os._exit(0)
    _, status = await asyncio.to_thread(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _alive(worker.pid)
    assert torch.equal(await group.allreduce(torch.ones(2)), torch.ones(2))


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.asyncio
async def test_the_worker_unmaps_shared_storages_that_died(group: ftcomm.Group) -> None:
    import gc

    worker = subprocess_backend(group).worker
    await group.allreduce(torch.ones(1))
    before = _fd_count(worker.pid)
    # A full collection in a long-lived test process holds the GIL, and so
    # the owner loop, for half a second (seen in CI): the objects made
    # before this test are set aside, and each collection below is quick.
    gc.freeze()
    try:
        for i in range(20):
            t = torch.full((1024,), float(i))
            t.share_memory_()
            storage = weakref.ref(t.untyped_storage())
            assert torch.equal(await group.allreduce(t), torch.full((1024,), float(i)))
            del t
            # The storage dies: the next op tells the worker. (Seen in CI: the
            # op's call, on the thread that read its reply, can hold it a
            # moment after the await; then its death came after the next op.)
            deadline = time.monotonic() + 10
            while storage() is not None:
                assert time.monotonic() < deadline, "a shared storage outlived its op"
                gc.collect()
                await asyncio.sleep(0.001)
    finally:
        gc.unfreeze()
    await group.allreduce(torch.ones(1))  # carries the last one's release
    assert worker.pool.shared.take_dead() == ()  # every death was passed on
    # Each mapping holds an fd in the worker: released ones are closed.
    assert _fd_count(worker.pid) <= before + 2


@pytest.mark.asyncio
async def test_a_storage_that_dies_after_the_next_op_is_released_by_the_one_after(
    group: ftcomm.Group,
) -> None:
    """The interleaving CI met, forced: a shared storage outlives the op after
    its own (held here, as the thread that read a reply can hold its call a
    moment); its release then rides with the op after that one."""
    import gc

    worker = subprocess_backend(group).worker
    t = torch.full((1024,), 2.0)
    t.share_memory_()
    await group.allreduce(t)
    mapped = _torch_storages_mapped(worker.pid)
    assert mapped >= 1  # the worker maps the caller's storage
    held = t.untyped_storage()
    del t
    try:
        await group.allreduce(torch.ones(1))  # staged while the storage lives
        assert _torch_storages_mapped(worker.pid) == mapped
    finally:
        del held
        gc.collect()
    await group.allreduce(torch.ones(1))  # carries the release
    assert worker.pool.shared.take_dead() == ()
    assert _torch_storages_mapped(worker.pid) == mapped - 1  # the worker unmapped it


def _torch_storages_mapped(pid: int) -> int:
    """The worker's fds on torch's shared storages (``/dev/shm/torch_*``), not
    on ftcomm's own segments."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed since it was listed
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return sum(link.startswith("/dev/shm/torch_") for link in links)


@pytest.mark.asyncio
async def test_ops_awaited_after_other_work_are_timed_by_their_replies(
    group: ftcomm.Group,
) -> None:
    """A worker's reply says when its op ended: ops issued together and
    awaited later (after other work) are timed to their replies, not to the
    await, and none is counted untimed."""
    works = [group.allreduce(torch.ones(4)) for _ in range(3)]
    await asyncio.sleep(0.3)  # "compute": nobody looks at the ops meanwhile
    for work in works:
        await work
    stats = group.stats().ops["allreduce"]
    assert (stats.count, stats.untimed) == (3, 0)
    assert stats.max is not None
    assert stats.max < 0.3  # timed to their replies, not to the await after 0.3 s


class _RaisingLock:
    """A copy-back lock whose taking fails (as a bug below would)."""

    def __enter__(self) -> None:
        raise RuntimeError("injected: the copy-back's lock failed")

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.mark.asyncio
async def test_a_copy_back_that_fails_unexpectedly_fails_its_op_without_holding_frames(
    group: ftcomm.Group, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The op's error carries no traceback: its frames would hold the worker
    and its segments' mappings until a garbage collection (no_leaks checks
    that nothing holds them once the group is shut down)."""
    # pytest's log capture would keep the logged traceback (and its frames)
    # until the test's report: the log line goes to stderr instead
    monkeypatch.setattr(logging.getLogger("ftcomm"), "propagate", False)
    original = WorkerProcess._copy_back

    def copy_back(worker: Any, call: Any) -> None:
        call._copy_lock = _RaisingLock()
        original(worker, call)

    monkeypatch.setattr(WorkerProcess, "_copy_back", copy_back)
    with pytest.raises(ftcomm.CommFailed, match="injected") as info:
        await group.allreduce(torch.ones(1 << 16))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.__cause__.__traceback__ is None
