"""The runtime's own rules, with a scripted native op instead of a network.

Only the native op is faked (``ScriptedOp``); the OpTable, Work, deadline
sweeper, owner loop and threads under test are the real ones.
"""

from __future__ import annotations

import asyncio
import collections.abc
import gc
import threading
import time
import tracemalloc
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from helpers import ScriptedOp, issue

import ftcomm
from ftcomm._runtime import loop as loop_mod
from ftcomm._runtime import threads
from ftcomm._runtime.deadline import to_seconds
from ftcomm._runtime.driven import Drivers, TaskDriven
from ftcomm._runtime.loop import Runtime, get_runtime
from ftcomm._runtime.table import OpTable
from ftcomm._runtime.threads import Handoff, WorkerPool
from ftcomm._runtime.work import Work


@pytest.fixture
def table() -> Iterator[OpTable]:
    t = OpTable(get_runtime(), rank=0, on_break=lambda error, until: None)
    yield t
    t.break_(ftcomm.CommAborted("test over"))


@pytest.mark.asyncio
async def test_completed_op_gives_its_result(table: OpTable) -> None:
    op = ScriptedOp()
    work = issue(table, op, 5.0)
    asyncio.get_running_loop().call_later(0.01, op.finish)  # ends after the spin
    assert await work == "result"
    assert table.error is None
    assert len(table) == 0


@pytest.mark.asyncio
async def test_deadline_raises_comm_timeout_and_breaks_the_table(table: OpTable) -> None:
    hung, other = ScriptedOp(), ScriptedOp()
    started = time.monotonic()  # before the issue: the deadline counts from there
    work = issue(table, hung, 0.2)
    bystander = issue(table, other, 30.0)
    with pytest.raises(ftcomm.CommTimeout, match=r"allreduce .*seq=1") as info:
        await work
    elapsed = time.monotonic() - started
    assert 0.19 <= elapsed < 0.2 + 1.0  # the deadline, and a loaded box's delays
    assert isinstance(info.value, TimeoutError)
    assert table.error is info.value
    with pytest.raises(ftcomm.CommAborted):
        await bystander
    hung.finish()  # a late completion changes nothing
    assert work.exception() is info.value


@pytest.mark.asyncio
async def test_unobserved_success_survives_a_break(table: OpTable) -> None:
    finished = ScriptedOp(done=True)
    work = issue(table, finished, 30.0)
    table.break_(ftcomm.CommAborted("abort"))
    assert await work == "result"


@pytest.mark.asyncio
async def test_native_failure_before_deadline_is_comm_failed(table: OpTable) -> None:
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    asyncio.get_running_loop().call_later(
        0.01, op.finish, RuntimeError("Connection closed by peer")
    )
    with pytest.raises(ftcomm.CommFailed, match="Connection closed by peer") as info:
        await work
    assert isinstance(info.value.__cause__, RuntimeError)
    assert table.error is info.value


@pytest.mark.asyncio
async def test_cancelling_the_awaiting_task_aborts_and_reraises(table: OpTable) -> None:
    work = issue(table, ScriptedOp(), 30.0)
    task = asyncio.ensure_future(_await(work))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert isinstance(table.error, ftcomm.CommAborted)
    assert "cancelled" in str(table.error)


async def _await(work: Work[object]) -> object:
    return await work


@pytest.mark.asyncio
async def test_cancel_after_completion_does_not_abort(table: OpTable) -> None:
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    task = asyncio.ensure_future(_await(work))
    await asyncio.sleep(0.01)
    op.finish()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert table.error is None
    assert await work == "result"


@pytest.mark.asyncio
async def test_work_cancel(table: OpTable) -> None:
    work = issue(table, ScriptedOp(), 30.0)
    assert work.cancel() is True
    assert work.cancel() is False
    with pytest.raises(ftcomm.CommAborted, match=r"Work\.cancel"):
        await work


def test_exactly_one_settler_wins_a_race(table: OpTable) -> None:
    for _ in range(200):
        op = ScriptedOp()
        work = issue(table, op, 30.0)
        barrier = threading.Barrier(4)
        wins: list[bool] = []

        def settle(
            i: int, work: Work[object], barrier: threading.Barrier, wins: list[bool]
        ) -> None:
            barrier.wait()
            wins.append(work._settle(None if i % 2 else RuntimeError("x")))

        threads = [threading.Thread(target=settle, args=(i, work, barrier, wins)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wins.count(True) == 1
        assert len(table) == 0


@pytest.mark.slow
@pytest.mark.asyncio
async def test_timers_and_memory_stay_flat_over_100k_ops() -> None:
    """At most one deadline timer per table, whatever the op count; no growth.

    The owner loop here is stock asyncio, whose pending timers can be counted.
    Timeouts shrink from op to op (60 s down to 10 s), faster than time
    passes, so every op's deadline comes before the armed one: every op wakes
    the owner loop, which must move its one timer, not add another.
    """
    rt = Runtime("asyncio")
    table = OpTable(rt, rank=0, on_break=lambda error, until: None)

    def timers() -> int:
        """Live timers (asyncio sweeps cancelled ones lazily, in batches)."""

        async def count() -> int:
            scheduled = rt.loop._scheduled  # type: ignore[attr-defined]
            return sum(1 for handle in scheduled if not handle.cancelled())

        return rt.submit(count()).result(5)

    counts = []
    try:
        tracemalloc.start()
        for i in range(100_000):
            timeout = 60.0 - i * 0.0005
            assert await issue(table, ScriptedOp(done=True), timeout) == "result"
            if i % 10_000 == 0:
                counts.append(timers())
            if i == 10_000:
                gc.collect()
                base_mem, _ = tracemalloc.get_traced_memory()
        gc.collect()
        end_mem, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        table.break_(ftcomm.CommAborted("test over"))
        rt.close()
    assert len(table) == 0
    assert max(counts) <= 2, counts  # the table's one timer (+ the debug watchdog's beat)
    assert end_mem - base_mem < 256 * 1024, f"grew by {end_mem - base_mem} bytes"


@dataclass
class Watched:
    """A runtime in debug mode (0.05 s threshold), its watchdog, and the
    owner thread's watch, whose kernel counters a test mocks."""

    rt: Runtime
    watchdog: Any
    owner: Any

    def block_the_loop(self, then: Callable[[], object] = lambda: None) -> None:
        """A callback that calls ``then`` and blocks the loop for 0.3 s."""
        done = threading.Event()
        self.rt.call_soon(lambda: (then(), time.sleep(0.3), done.set()))
        assert done.wait(5)


@pytest.fixture
def watched() -> Iterator[Watched]:
    rt = Runtime("asyncio")
    try:
        rt.set_debug(0.05)
        watchdog = rt.watchdog
        assert watchdog is not None
        yield Watched(rt, watchdog, watchdog._watched[rt.thread_id or -1])
    finally:
        rt.close()


def test_watchdog_excuses_time_the_owner_thread_queued_for_a_cpu(watched: Watched) -> None:
    # On an oversubscribed machine the owner thread can sit runnable but off
    # the CPU. The kernel's counters are mocked to say it queued the whole
    # time, so a 0.3 s late beat is not the callback's stall.
    watched.owner.clock.read = lambda: (0.0, time.monotonic())
    watched.block_the_loop()
    assert watched.watchdog.stalls == []


def test_watchdog_excuses_the_main_threads_cpu_queueing_while_the_owner_is_off_the_cpu(
    watched: Watched,
) -> None:
    # The trainer's main thread, preempted mid-bytecode, keeps the GIL: the
    # owner loop waits for it, off the CPU and not queued itself. The
    # counters are mocked: the owner neither runs nor queues, the main
    # thread queues the whole time, so a 0.3 s late beat is the machine's.
    watched.owner.clock.read = lambda: (0.0, 0.0)
    watched.owner.holder.read = lambda: (0.0, time.monotonic())
    watched.block_the_loop()
    assert watched.watchdog.stalls == []


@pytest.mark.parametrize(
    ("now", "held", "excused"),
    [
        # off the CPU 1 s, the holder queued 0.4 s while the beat was overdue
        ((1.0, 0.0, 0.0, 0.9), 0.4, 0.4),
        # on a CPU the whole second: the holder's queueing did not delay it
        ((1.0, 1.0, 0.0, 0.9), 0.9, 0.0),
        # queued itself 0.5 s, off the CPU 0.3 s, the holder queued 0.9 s
        ((1.0, 0.2, 0.5, 0.9), 0.9, 0.8),
        # the holder queued, but not while the beat was overdue: its own only
        ((1.0, 0.0, 0.2, 0.9), 0.0, 0.2),
        # no counters (not Linux): nothing excused
        ((1.0, 0.0, 0.0, 0.0), 0.0, 0.0),
    ],
)
def test_watchdog_excuses_only_the_machines_part_of_a_late_beat(
    now: tuple[float, float, float, float], held: float, excused: float
) -> None:
    assert loop_mod._excused((0.0, 0.0, 0.0, 0.0), now, held) == pytest.approx(excused)


def test_watchdog_counts_the_holders_queueing_only_while_the_beat_is_overdue(
    watched: Watched,
) -> None:
    # The main thread queued for a CPU before the callback began, and not
    # since: a callback blocked for 0.3 s (off the CPU, not queued) is its own.
    queueing = threading.Event()
    queueing.set()
    until = [0.0]

    def holder() -> tuple[float, float]:
        if queueing.is_set():
            until[0] = time.monotonic()
        return 0.0, until[0]

    watched.owner.clock.read = lambda: (0.0, 0.0)
    watched.owner.holder.read = holder
    watched.block_the_loop(then=queueing.clear)
    assert watched.watchdog.stalls, "a callback blocked for 0.3 s went unnoticed"


def test_watchdog_reports_a_blocked_callback_while_another_thread_holds_the_gil() -> None:
    # Waiting for a running GIL holder is not excused: it cannot be told apart
    # from a callback blocked with the GIL released (here time.sleep), the very
    # thing the watchdog is for. Another thread holds the GIL for 0.4 s of
    # the callback's 0.6 s, longer than the 0.3 s threshold: an excuse for
    # that time would hide the stall.
    import ctypes

    libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL, for a set time
    rt = Runtime("asyncio")
    try:
        rt.set_debug(0.3)
        watchdog = rt.watchdog
        assert watchdog is not None
        inside, done = threading.Event(), threading.Event()

        def blocked_callback() -> None:
            inside.set()
            time.sleep(0.6)
            done.set()

        rt.call_soon(blocked_callback)
        assert inside.wait(5)
        libc.usleep(400_000)
        assert done.wait(5)
        assert watchdog.stalls, "a callback blocked for 0.6 s went unnoticed"
        assert "blocked_callback" in watchdog.stalls[0].stack
    finally:
        rt.close()


def test_watchdog_reports_a_callback_that_holds_the_gil_on_a_cpu() -> None:
    # The other side of the excuse: a callback running C code that holds the
    # GIL stops the watchdog too, but it is on a CPU the whole time.
    rt = Runtime("asyncio")
    try:
        rt.set_debug(0.1)
        watchdog = rt.watchdog
        assert watchdog is not None
        if watchdog._watched[rt.thread_id or -1].clock.read() == (0.0, 0.0):
            pytest.skip("no /proc/self/task/<tid>/schedstat: GIL holders are excused")
        done = threading.Event()
        rt.call_soon(lambda: (sum(range(30_000_000)), time.sleep(0.05), done.set()))
        assert done.wait(10)
        assert watchdog.stalls, "a callback on a CPU for ~0.3 s went unnoticed"
        assert watchdog.stalls[0].seconds > 0.1
    finally:
        rt.close()


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_watchdog_reports_a_callers_loop_held_by_a_blocking_call(kind: str) -> None:
    """A trainer's own loop that awaits ftcomm is watched too (debug mode):
    a blocking call there delays every op it awaits. Reported with its stack
    (not as an owner-loop stall); an idle wait is not reported."""
    rt = Runtime("asyncio")
    loop = loop_mod.new_event_loop(kind)
    try:
        rt.set_debug(0.1)
        watchdog = rt.watchdog
        assert watchdog is not None

        async def blocking_trainer_step() -> None:
            rt.watch_caller()
            await asyncio.sleep(0.3)  # idle: waiting for events
            time.sleep(0.4)  # noqa: ASYNC251 (held: a blocking call on the loop)

        loop.run_until_complete(blocking_trainer_step())
        assert watchdog.stalls == []
        # the blocking call, once (a suspended coroutine is on no stack: an
        # idle wait the box made late would not name it)
        held = [s for s in watchdog.caller_stalls if "blocking_trainer_step" in s.stack]
        assert len(held) == 1, watchdog.caller_stalls
        assert held[0].seconds > 0.1
    finally:
        loop.close()
        rt.close()


def test_the_watchdog_reads_other_threads_frames_with_the_collector_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """python/cpython#106883 (3.11): a collection started inside
    sys._current_frames() can deadlock the process; the watchdog's read
    pauses the collector, and leaves one the program turned off, off."""
    seen: list[bool] = []
    real, me = loop_mod.sys._current_frames, threading.get_ident()

    def frames() -> dict[int, Any]:
        if threading.get_ident() != me:  # a watchdog of this process's runtime
            return real()
        seen.append(gc.isenabled())
        return {}

    monkeypatch.setattr(loop_mod.sys, "_current_frames", frames)
    assert gc.isenabled()
    assert loop_mod.current_frames() == {}
    assert (seen, gc.isenabled()) == ([False], True)
    gc.disable()
    try:
        loop_mod.current_frames()
        assert (seen, gc.isenabled()) == ([False, False], False)
    finally:
        gc.enable()


def test_the_scheduler_counters_are_read_from_the_kernel() -> None:
    clock = loop_mod.CpuClock(threading.get_native_id())
    try:
        if clock.read() == (0.0, 0.0):
            pytest.skip("no /proc/self/task/<tid>/schedstat on this kernel")
        on_cpu, queued = clock.read()
        sum(range(2_000_000))  # about 20 ms on a CPU
        on_cpu2, queued2 = clock.read()
        assert on_cpu2 - on_cpu > 0.005
        assert queued2 >= queued >= 0.0
    finally:
        clock.close()
    assert clock.read() == (0.0, 0.0)  # closed: no fd, no figures
    assert loop_mod.CpuClock(None).read() == (0.0, 0.0)


def test_watchdog_reports_a_callback_that_holds_the_loop() -> None:
    rt = Runtime("asyncio")
    try:
        rt.set_debug(0.05)
        assert rt.watchdog is not None
        done = threading.Event()
        rt.call_soon(lambda: (time.sleep(0.3), done.set()))
        assert done.wait(5)
        assert rt.watchdog.stalls, "a 0.3 s callback went unnoticed"
        assert "time.sleep" in rt.watchdog.stalls[0].stack or "sleep" in rt.watchdog.stalls[0].stack
    finally:
        rt.close()


def test_call_from_the_loop_thread_is_refused() -> None:
    rt = get_runtime()

    async def inner() -> str:
        async def noop() -> None:
            return None

        try:
            rt.call(noop())
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    assert "deadlock" in rt.call(inner(), timeout=5)


def test_worker_pool_runs_blocking_calls_side_by_side() -> None:
    pool = WorkerPool("test-pool", max_workers=2)
    try:
        a, b = threading.Event(), threading.Event()
        # Each call waits for the other: they deadlock if queued on one thread.
        fa = pool.submit(lambda: (a.set(), b.wait(5))[1])
        fb = pool.submit(lambda: (b.set(), a.wait(5))[1])
        assert fa.result(5) is True
        assert fb.result(5) is True
        assert pool.wait_idle(5)
    finally:
        pool.close()


def test_a_failed_worker_call_does_not_keep_its_arguments() -> None:
    """The error a worker hands over carries no frames: they would hold the
    call's arguments (a Gloo group's works) until the garbage collector ran."""

    class Native:
        pass

    def fail(arg: Native) -> None:
        raise RuntimeError("timed out")

    pool = WorkerPool("test-pool", max_workers=1)
    gc.disable()
    try:
        native = Native()
        ref = weakref.ref(native)
        fut = pool.submit(fail, native)
        with pytest.raises(RuntimeError, match="timed out"):
            fut.result(5)
        assert pool.wait_idle(5)
        del native
        assert ref() is None, "the failed call's frame still holds its argument"
        assert fut.exception() is not None
    finally:
        gc.enable()
        pool.close()


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (float("nan"), ValueError),
        (-1, ValueError),
        (float("inf"), ValueError),
        ("1", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_bad_timeouts_are_rejected(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="timeout"):
        to_seconds(value)


@pytest.mark.asyncio
async def test_a_timer_that_fires_early_is_armed_again(table: OpTable) -> None:
    """uvloop may run a timer up to 1 ms early; the deadline must still hold."""
    rt = get_runtime()
    work = issue(table, ScriptedOp(), 0.3)

    async def fire_early() -> bool:
        await asyncio.sleep(0)  # after track()'s call_soon(_rearm) has run
        if table._timer is None:
            return False
        table._timer.cancel()  # the real handle "fires" now, 0.3 s early
        table._on_timer()
        return table.timer_armed

    assert await asyncio.wrap_future(rt.submit(fire_early()))
    started = time.monotonic()
    with pytest.raises(ftcomm.CommTimeout):
        await work
    assert time.monotonic() - started < 0.3 + 1.0


@pytest.mark.asyncio
async def test_an_op_issued_as_the_table_breaks_ends_at_once(table: OpTable) -> None:
    """The table broke on another thread while this op was being issued."""
    work: Work[object] = Work(
        table, "allreduce", table.next_seq(), time.monotonic() + 30, ScriptedOp(), 1
    )
    table.break_(ftcomm.CommAborted("broke meanwhile"))
    table.track(work, 30.0)
    with pytest.raises(ftcomm.CommAborted, match="broke meanwhile"):
        await work
    assert len(table) == 0


class SettledWhilePolled(ScriptedOp):
    """The op is settled by another thread right as it is polled."""

    work: Work[object] | None = None

    def poll(self) -> bool:
        assert self.work is not None
        settler = threading.Thread(target=self.work._complete, args=(None,))
        settler.start()
        settler.join()
        return True


def test_done_survives_a_settle_during_its_poll(table: OpTable) -> None:
    op = SettledWhilePolled()
    work = issue(table, op, 30.0)
    op.work = work
    assert work.done() is True
    assert work.exception() is None


def test_an_idle_table_lets_its_timer_go(table: OpTable) -> None:
    """A group dropped without shutdown() must not be kept alive by its timer."""
    rt = get_runtime()

    async def run_one() -> object:
        return await issue(table, ScriptedOp(done=True), 0.05)

    assert rt.call(run_one(), timeout=5) == "result"
    deadline = time.monotonic() + 5.0
    while table.timer_armed or table._armed_at is not None:
        assert time.monotonic() < deadline, "the sentinel timer never let go"
        time.sleep(0.01)  # polling a condition the owner loop changes, bounded
    # ... and the next op arms it again and is still watched.
    with pytest.raises(ftcomm.CommTimeout):
        rt.call(_await(issue(table, ScriptedOp(), 0.05)), timeout=5)


def test_hung_worker_calls_do_not_starve_configure() -> None:
    """p2p waits fill the worker pool; configure's connect has its own threads."""
    rt = get_runtime()
    release = threading.Event()
    blocked = [rt.run_blocking(release.wait, 10) for _ in range(rt.workers._max + 2)]
    try:
        assert rt.run_control(lambda: "connected").result(5) == "connected"
    finally:
        release.set()
    assert all(f.result(5) for f in blocked)


class _BlocksItsDrop:
    """Held in a Handoff, so that the reaper's is its last reference: its
    drop blocks the reaper thread until ``release`` is set."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def __del__(self) -> None:
        self.release.wait(10)


def test_reaper_batches_end_no_sooner_than_the_one_before() -> None:
    rt = get_runtime()
    assert rt.reaper.wait_idle(5)  # nothing ahead from an earlier test
    release = threading.Event()
    rt.dispose(Handoff(_BlocksItsDrop(release)), until=time.monotonic() + 30)
    rt.dispose(object())  # queued behind the blocker: it cannot end "soon"
    try:
        started = time.monotonic()
        assert rt.reaper.wait_short(1.0) is True
        assert time.monotonic() - started < 0.5
    finally:
        release.set()
    assert rt.reaper.wait_idle(5)


def test_a_batch_does_not_inherit_the_end_of_one_already_dropped() -> None:
    """CI finding: a batch took the latest end of every batch ever handed
    over, dropped or not. A group let go after an earlier op's long
    deadline then read as one that ends late, so a leak check (which waits
    only for what ends soon) looked before it was dropped, and skipped."""
    rt = get_runtime()
    release = threading.Event()
    rt.dispose(object(), until=time.monotonic() + 60)  # an op's long deadline
    assert rt.reaper.wait_idle(5)  # dropped: it holds up nothing now
    rt.dispose(Handoff(_BlocksItsDrop(release)))  # nothing in flight: it ends soon
    try:
        assert rt.reaper.wait_short(0.3) is False
    finally:
        release.set()
    assert rt.reaper.wait_short(5.0) is True
    assert rt.reaper.pending == 0


def test_a_batch_behind_one_that_ends_late_ends_soon_once_that_one_has_ended() -> None:
    """Review finding: a batch's end inherited when it was handed over
    stayed after the batch ahead of it was dropped."""
    rt = get_runtime()
    first, second = threading.Event(), threading.Event()
    assert rt.reaper.wait_idle(5)  # nothing ahead from an earlier test
    rt.dispose(Handoff(_BlocksItsDrop(first)), until=time.monotonic() + 60)
    rt.dispose(Handoff(_BlocksItsDrop(second)))
    try:
        assert rt.reaper.wait_short(0.3) is True  # behind one that ends late: late too
        first.set()
        end = time.monotonic() + 5
        while rt.reaper.pending > 1 and time.monotonic() < end:
            time.sleep(0.01)  # the first batch's removal follows its drop
        assert rt.reaper.pending == 1
        assert rt.reaper.wait_short(0.3) is False  # now first in line: it ends soon
    finally:
        first.set()
        second.set()
    assert rt.reaper.wait_idle(5)


def test_a_parked_batch_is_not_waited_for_and_holds_up_no_later_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review finding: a parked batch's late end made the batches after it
    read as late too, though a parked batch waits beside the queue."""
    monkeypatch.setattr(threads, "SOLE_WAIT", 0.05)
    reaper = threads.Reaper(name="ftcomm-test-reaper")
    kept, release = _BlocksItsDrop(threading.Event()), threading.Event()
    kept.release.set()  # its own drop, once we let go, does not block
    reaper.dispose(Handoff(kept), until=time.monotonic() + 60)  # we still hold it
    try:
        deadline = time.monotonic() + 5
        while reaper.wait_unparked(0.0):  # until it parked it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        reaper.dispose(Handoff(_BlocksItsDrop(release)))
        assert reaper.wait_short(0.3) is False  # ends soon: waited for
        assert reaper.wait_short(0.3) is False
    finally:
        release.set()
        del kept
        assert reaper.wait_idle(10)
        reaper.close()


def test_call_passes_on_a_timeout_error_raised_by_the_coroutine() -> None:
    """concurrent.futures.TimeoutError is TimeoutError: do not take one for the other."""

    async def raises() -> None:
        raise ftcomm.CommTimeout("from the coroutine")

    with pytest.raises(ftcomm.CommTimeout, match="from the coroutine"):
        get_runtime().call(raises(), timeout=5)


@pytest.mark.asyncio
async def test_a_slow_op_finished_on_another_thread_wakes_its_awaiter(table: OpTable) -> None:
    """Past the spin, the awaiter sleeps; the backend's thread must wake it."""
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    finisher = threading.Timer(0.05, op.finish)  # like Gloo's worker thread
    finisher.start()
    try:
        assert await work == "result"
    finally:
        finisher.join()
    assert table.error is None


def test_wait_blocks_a_plain_thread_until_the_op_ends(table: OpTable) -> None:
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    finisher = threading.Timer(0.05, op.finish)  # past the spin: the waiter sleeps
    finisher.start()
    try:
        assert work.wait() == "result"
    finally:
        finisher.join()
    assert work.wait() == "result"  # ended: returns at once


def test_wait_raises_the_ops_error(table: OpTable) -> None:
    work = issue(table, ScriptedOp(), 0.1)
    started = time.monotonic()
    with pytest.raises(ftcomm.CommTimeout):
        work.wait()
    assert time.monotonic() - started < 0.1 + 1.0


def test_wait_timeout_bounds_the_wait_not_the_op(table: OpTable) -> None:
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    with pytest.raises(TimeoutError, match=r"did not end within 0\.05 s") as info:
        work.wait(timeout=0.05)
    assert not isinstance(info.value, ftcomm.CommError)
    assert not work.done()  # the op goes on
    op.finish()
    assert work.wait(timeout=5) == "result"


@pytest.mark.asyncio
async def test_wait_refuses_to_block_a_running_loop(table: OpTable) -> None:
    work = issue(table, ScriptedOp(done=True), 30.0)
    with pytest.raises(RuntimeError, match="would block the running event loop"):
        work.wait()
    assert await work == "result"


class _SlowPop(dict):  # type: ignore[type-arg]
    """Gives up the GIL inside _settle, widening any window a reader could see."""

    def pop(self, *args: object) -> object:
        time.sleep(0.001)
        return super().pop(*args)


def test_an_awaiter_that_sees_the_error_sees_errored_set() -> None:
    """The op's end becomes visible to lock-free spinners only after the table broke."""
    rt = get_runtime()
    for _ in range(30):
        table = OpTable(rt, rank=0, on_break=lambda error, until: None)
        table.inflight = _SlowPop()
        work = issue(table, ScriptedOp(), 30.0)
        saw: list[object] = []

        def waiter(
            work: Work[object] = work, table: OpTable = table, saw: list[object] = saw
        ) -> None:
            try:
                work.wait(timeout=5)
            except ftcomm.CommError:
                saw.append(table.error)

        thread = threading.Thread(target=waiter)
        thread.start()
        work.cancel()  # settles while the waiter spins
        thread.join(5)
        assert len(saw) == 1
        assert saw[0] is not None, "the awaiter saw CommAborted before errored() was set"


def test_tracking_an_op_that_already_ended_watches_nothing(table: OpTable) -> None:
    work: Work[object] = Work(
        table, "allreduce", table.next_seq(), time.monotonic() + 0.05, ScriptedOp(), 1
    )
    work._settle(None)
    table.track(work, 0.05)
    assert len(table) == 0  # else the sweeper would find it past its deadline forever


@pytest.mark.parametrize("bad", [float("nan"), -1.0, "1"])
def test_thread_wait_checks_its_timeout(table: OpTable, bad: object) -> None:
    op = ScriptedOp()
    work = issue(table, op, timeout=30)
    with pytest.raises((TypeError, ValueError), match="timeout"):
        work.wait(bad)  # type: ignore[arg-type]
    op.finish()
    assert work.wait(0.5) == "result"


class _Driven(TaskDriven, collections.abc.Coroutine):  # type: ignore[type-arg]
    """The coroutine protocol over an await of one future (as a Work's)."""

    __slots__ = ("__weakref__", "_drivers", "fut")

    def __init__(self, fut: asyncio.Future[int]) -> None:
        self._drivers: Drivers | None = None
        self.fut = fut

    def __await__(self) -> Generator[Any, None, int]:
        return (yield from asyncio.shield(self.fut))  # one future per await


@pytest.mark.asyncio
async def test_one_object_driven_by_one_task_then_by_several() -> None:
    """TaskDriven keeps one task's await without a dict, several in one, and
    forgets each once it ended (no task kept); a cancelled driver ends only
    its own await."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    one = _Driven(fut)
    task = asyncio.ensure_future(one)
    await asyncio.sleep(0)
    assert type(one._drivers) is tuple
    assert one._drivers[0] is task
    fut.set_result(7)
    assert await task == 7
    assert one._drivers is None
    fut = loop.create_future()
    many = _Driven(fut)
    tasks = [asyncio.ensure_future(many) for _ in range(3)]
    await asyncio.sleep(0)
    assert isinstance(many._drivers, dict)
    assert set(many._drivers) == set(tasks)
    tasks[1].cancel()
    await asyncio.sleep(0)
    assert not fut.cancelled()  # its own await only
    fut.set_result(9)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results[0] == 9
    assert results[2] == 9
    assert isinstance(results[1], asyncio.CancelledError)
    assert many._drivers == {}
