"""A :class:`~ftcomm.Work` is an asyncio future of the loop that looks at it:
``asyncio.gather``, ``wait_for``, ``shield`` and ``as_completed`` take it as it
is (no task per op), its done-callbacks run on that loop, and cancelling
them cancels it (its group is aborted), as they do for futures."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import random
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import ScriptedOp, StoreServer, issue

import ftcomm
from ftcomm import CommAborted, CommFailed, CommTimeout
from ftcomm._runtime import faults
from ftcomm._runtime import table as table_module
from ftcomm._runtime import work as work_module
from ftcomm._runtime.loop import get_runtime
from ftcomm._runtime.observe import FOLD_EVERY, Histogram, Observer, timed
from ftcomm._runtime.table import OpRecord, OpTable, Outcome
from ftcomm._runtime.work import Work


@pytest.fixture
def table() -> Iterator[OpTable]:
    t = OpTable(get_runtime(), rank=0, on_break=lambda error, until: None)
    yield t
    t.break_(CommAborted("test over"))


async def _dummy(store: StoreServer, **kwargs: Any) -> ftcomm.Group:
    g = ftcomm.Group("dummy", timeout=10.0, **kwargs)
    await g.configure(f"127.0.0.1:{store.port}/future", 0, 1)
    return g


def _batch_on(g: ftcomm.Group, native: object, n: int) -> list[ftcomm.Work[torch.Tensor]]:
    """A lone first op, then ``n`` ops in one batch whose native op is
    ``native``, sent by the first look."""
    g.allreduce(torch.ones(1))  # goes on its own (a look at it would be a cut point)
    works = [g.allreduce(torch.full((1,), float(i))) for i in range(n)]
    old = faults.set_injector(lambda op, start, backend: native)
    try:
        g.flush()
    finally:
        faults.set_injector(old)
    return works


def _finish_on_a_thread(op: ScriptedOp) -> int | None:
    """End ``op`` on a thread of its own, as a backend's thread would; that
    thread's ident."""
    ender = threading.Thread(target=op.finish)
    ender.start()
    ender.join(10)
    assert not ender.is_alive()
    return ender.ident


class _CountTasks:
    """Counts the tasks made on a loop while installed (its task factory)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.made = loop, 0

    def __enter__(self) -> _CountTasks:
        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
            self.made += 1
            return asyncio.Task(coro, loop=loop, **kw)

        self.loop.set_task_factory(factory)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.set_task_factory(None)


# -- asyncio's functions take works as futures ------------------------------------------
@pytest.mark.asyncio
async def test_asyncio_gather_of_fused_ops_makes_no_task_and_gives_each_its_result(
    store: StoreServer,
) -> None:
    async with await _dummy(store, fuse=True) as g:
        ts = [torch.full((1,), float(i)) for i in range(50)]
        works = [g.allreduce(t) for t in ts]
        assert all(asyncio.isfuture(w) for w in works)
        with _CountTasks(asyncio.get_running_loop()) as tasks:
            results = await asyncio.gather(*works)
        assert tasks.made == 0
        assert [r is t for r, t in zip(results, ts, strict=True)] == [True] * 50
        assert [r.item() for r in results] == [float(i) for i in range(50)]
        assert g.stats().ops["allreduce"].count == 50


@pytest.mark.asyncio
async def test_a_batch_that_ends_on_another_thread_wakes_the_loop_once(
    store: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    posted: list[int] = []
    real = table_module._run_calls

    def counting(loop: asyncio.AbstractEventLoop, calls: list[Any]) -> None:
        posted.append(len(calls))
        real(loop, calls)

    monkeypatch.setattr(table_module, "_run_calls", counting)
    async with await _dummy(store, fuse=True) as g:
        native = ScriptedOp()
        works = _batch_on(g, native, 100)
        gathering = asyncio.gather(*works)
        assert not gathering.done()
        ender = threading.Thread(target=native.finish)  # as Gloo's own thread would
        ender.start()
        await asyncio.wait_for(gathering, 10)
        ender.join(10)
        assert posted == [100]  # one hand-over to the loop for the whole batch


@pytest.mark.asyncio
async def test_asyncio_gather_raises_the_error_of_an_op_that_failed(table: OpTable) -> None:
    ok, late = ScriptedOp(), ScriptedOp()
    works = [issue(table, ok, 30.0), issue(table, late, 0.2)]
    ok.finish()
    with pytest.raises(CommTimeout):
        await asyncio.gather(*works)
    assert isinstance(table.error, CommTimeout)


@pytest.mark.asyncio
async def test_cancelling_asyncio_gather_of_works_cancels_them_and_aborts_the_group(
    store: StoreServer,
) -> None:
    async with await _dummy(store, fuse=True) as g:
        native = ScriptedOp()
        works = _batch_on(g, native, 3)
        await _cancel_a_task_gathering(works)
        assert works[0].cancelled()  # the first one cancelled: its break ends the others
        assert works[1].cancelled()  # ... which count as cancelled, as gather's tasks did
        assert isinstance(works[1].exception(), CommAborted)
        with pytest.raises(asyncio.CancelledError):
            works[0].result()
        errored = g.errored()
        assert isinstance(errored, CommAborted)
        assert "cancelled with Work.cancel()" in str(errored)
        # The cancel's mark is ftcomm's own, not the error's: what a caller
        # sees is a plain CommAborted with its context, and nothing else.
        for error in (works[0].exception(), works[1].exception(), errored):
            assert type(error) is CommAborted
            assert set(vars(error)) == {"message", "rank", "op", "seq"}
        native.finish()


async def _cancel_a_task_gathering(works: list[Any]) -> None:
    """A task awaits ``asyncio.gather(*works)``; cancel it: it is cancelled."""
    started = asyncio.Event()

    async def step() -> None:
        started.set()
        await asyncio.gather(*works)

    task = asyncio.create_task(step())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.asyncio
async def test_asyncio_gather_with_return_exceptions_gives_a_cancelled_op_its_cancel(
    table: OpTable,
) -> None:
    a, b = issue(table, ScriptedOp(), 30.0), issue(table, ScriptedOp(), 30.0)
    assert a.cancel("stop here") is True
    results = await asyncio.gather(a, b, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert results[0].args == ("stop here",)
    assert isinstance(results[1], CommAborted)  # ended by the cancel's break, not cancelled


@pytest.mark.asyncio
async def test_wait_for_a_work_that_does_not_end_in_time_is_a_timeout_that_aborts_it(
    table: OpTable,
) -> None:
    work = issue(table, ScriptedOp(), 30.0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(work, 0.05)
    # 3.11 cancels the work, 3.12 on the task awaiting it: aborted either way
    assert isinstance(work.exception(), CommAborted)  # its own error, as await gives it
    with pytest.raises(CommAborted, match=r"Work\.cancel"):
        await work
    assert isinstance(table.error, CommAborted)


@pytest.mark.asyncio
async def test_shield_keeps_the_op_going_when_its_awaiter_is_cancelled(table: OpTable) -> None:
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    shielded = asyncio.shield(work)
    shielded.cancel()
    with pytest.raises(asyncio.CancelledError):
        await shielded
    assert not work.done()
    assert table.error is None
    op.finish()
    assert await work == "result"
    assert not work.cancelled()


def test_a_poller_let_go_under_the_lock_never_takes_it_for_an_ended_op(
    table: OpTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop stopped with an op's poll queued: the poller's finalizer gives
    up (arms the op's callback) on whatever thread lets it go last -- for a
    loop dropped unclosed, a garbage collection, maybe on a thread in the
    middle of ending another op, holding the group's lock. For an op that
    has ended it must not take that lock; and the op lets go of the loop."""
    # A spin longer than the test: on a loaded machine the loop may stop
    # later than a 2 ms spin lasts, and the poll would be over, not queued.
    monkeypatch.setattr(work_module, "SPIN_SECONDS", 60.0)
    slow = ScriptedOp()
    work = issue(table, slow, 30.0)
    loop = asyncio.new_event_loop()
    try:

        async def give_up_at_once() -> None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(work), 0.0005)  # shield: the op goes on

        loop.run_until_complete(give_up_at_once())
        queued = loop._ready  # type: ignore[attr-defined]  # asyncio's own queue
        assert queued, "the poll is still queued on the stopped loop"
        slow.finish()
        assert work.done()
        assert work._poll_loop is None  # let go at its end

        def let_go_under_the_lock() -> None:
            with table.lock:
                queued.clear()  # the poller's last reference: its finalizer runs here

        thread = threading.Thread(target=let_go_under_the_lock, daemon=True)
        thread.start()
        thread.join(5.0)
        assert not thread.is_alive(), "the finalizer took the lock its thread held"
    finally:
        loop.close()


@pytest.mark.asyncio
async def test_asyncio_wait_takes_tasks_of_works_as_documented(table: OpTable) -> None:
    """asyncio.wait refuses works themselves (they are coroutines too, for
    create_task), as the Work docs say; tasks of them it takes."""
    ops = [ScriptedOp(), ScriptedOp()]
    works = [issue(table, op, 30.0) for op in ops]
    with pytest.raises(TypeError, match="coroutines is forbidden"):
        await asyncio.wait(works)
    tasks = [asyncio.create_task(w) for w in works]
    ops[1].finish()
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    assert done == {tasks[1]}
    assert pending == {tasks[0]}
    ops[0].finish()
    assert await tasks[0] == "result"


@pytest.mark.asyncio
async def test_as_completed_yields_works_in_the_order_they_end(table: OpTable) -> None:
    first, second = ScriptedOp(), ScriptedOp()
    works = [issue(table, first, 30.0, "a"), issue(table, second, 30.0, "b")]
    order = []
    second.finish()
    for next_one in asyncio.as_completed(works):
        order.append(await next_one)
        first.finish()
    assert order == ["b", "a"]


# -- done-callbacks -----------------------------------------------------------------------
_WHO: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


@pytest.mark.asyncio
async def test_a_callback_added_on_a_loop_runs_on_that_loop_in_its_context(
    table: OpTable,
) -> None:
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    loop = asyncio.get_running_loop()
    seen: asyncio.Future[tuple[int, str]] = loop.create_future()
    _WHO.set("registrar")
    work.add_done_callback(lambda w: seen.set_result((threading.get_ident(), _WHO.get())))
    _finish_on_a_thread(op)
    assert not seen.done()  # not on the thread that ended it
    assert await seen == (threading.get_ident(), "registrar")


@pytest.mark.asyncio
async def test_a_callback_added_once_the_op_ended_runs_soon_not_now(table: OpTable) -> None:
    work = issue(table, ScriptedOp(done=True), 30.0)
    assert work.done()
    ran: list[object] = []
    ctx = contextvars.copy_context()
    ctx.run(_WHO.set, "given")
    work.add_done_callback(lambda w: ran.append(_WHO.get()), context=ctx)
    assert ran == []
    await asyncio.sleep(0)  # exactly one loop iteration: call_soon's
    assert ran == ["given"]


@pytest.mark.asyncio
async def test_remove_done_callback_removes_those_not_yet_run(table: OpTable) -> None:
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    ran: list[str] = []

    def removed(_: object) -> None:
        ran.append("removed")

    kept: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    work.add_done_callback(removed)
    work.add_done_callback(removed)
    work.add_done_callback(lambda _: kept.set_result(None))
    assert work.remove_done_callback(removed) == 2
    assert work.remove_done_callback(removed) == 0
    op.finish()
    await kept
    assert ran == []
    assert work.remove_done_callback(removed) == 0  # ended: nothing left to remove


@pytest.mark.asyncio
async def test_a_raising_loop_callback_goes_to_the_loops_handler_and_the_rest_run(
    table: OpTable,
) -> None:
    loop = asyncio.get_running_loop()
    handled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda loop, context: handled.append(context))
    try:
        op = ScriptedOp()
        works = [issue(table, op, 30.0) for _ in range(1)]
        after: asyncio.Future[None] = loop.create_future()
        works[0].add_done_callback(lambda _: {}["user bug"])
        works[0].add_done_callback(lambda _: after.set_result(None))
        _finish_on_a_thread(op)
        await asyncio.wait_for(after, 10)
    finally:
        loop.set_exception_handler(None)
    assert len(handled) == 1
    assert isinstance(handled[0]["exception"], KeyError)
    assert handled[0]["future"] is works[0]


def test_without_a_running_loop_a_callback_runs_on_the_thread_that_ends_the_op(
    table: OpTable,
) -> None:
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    seen: list[int] = []
    work.add_done_callback(lambda _: seen.append(threading.get_ident()))
    ender = _finish_on_a_thread(op)
    assert seen == [ender]
    with pytest.raises(RuntimeError, match="no event loop runs in this thread"):
        work.get_loop()


def test_callbacks_sharing_a_context_all_run_though_one_ends_the_other_op(
    table: OpTable, caplog: pytest.LogCaptureFixture
) -> None:
    """Where no loop runs, a callback given ``context=`` runs in it; one that
    ends another op whose callback has the same context (already entered,
    here) has that callback run in a copy, not dropped. A callback that
    raises RuntimeError is still run once, its error logged."""
    a, b, c = ScriptedOp(), ScriptedOp(), ScriptedOp()
    wa, wb, wc = (issue(table, op, 30.0) for op in (a, b, c))
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var")
    ctx = contextvars.copy_context()
    ctx.run(var.set, "given")
    ran: list[tuple[str, str]] = []

    def on_a(_: Any) -> None:
        ran.append(("a", var.get()))
        b.finish()
        wb.done()  # ends b on this thread, inside ctx

    wa.add_done_callback(on_a, context=ctx)
    wb.add_done_callback(lambda _: ran.append(("b", var.get())), context=ctx)
    a.finish()
    assert wa.done()
    assert ran == [("a", "given"), ("b", "given")]

    def raising(_: Any) -> None:
        ran.append(("c", var.get()))
        raise RuntimeError("the callback's own")

    wc.add_done_callback(raising, context=ctx)
    with caplog.at_level("ERROR", logger="ftcomm"):
        c.finish()
        assert wc.done()
    assert ran[2:] == [("c", "given")]  # once
    assert "the callback's own" in caplog.text


@pytest.mark.asyncio
async def test_each_raise_of_an_ops_error_starts_its_traceback_afresh(table: OpTable) -> None:
    """One error object per op, raised by every look and kept by errored():
    frames do not pile up on it, raise after raise (as with asyncio's futures)."""
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    op.finish(RuntimeError("Connection closed by peer"))

    def frames(error: BaseException) -> int:
        return len(traceback.extract_tb(error.__traceback__))

    async def awaited() -> object:
        return await work

    seen = []
    for _ in range(2):
        with pytest.raises(CommFailed) as by_await:
            await awaited()
        with pytest.raises(CommFailed) as by_result:
            work.result()
        with pytest.raises(CommFailed) as by_wait:
            work.wait()
        seen.append([frames(r.value) for r in (by_await, by_result, by_wait)])
    assert seen[0] == seen[1]


@pytest.mark.asyncio
async def test_get_loop_is_the_loop_that_asks(table: OpTable) -> None:
    work = issue(table, ScriptedOp(done=True), 30.0)
    assert work.get_loop() is asyncio.get_running_loop()


# -- the batch's statistics, in one pass --------------------------------------------------
def test_add_sorted_counts_as_adding_each_value() -> None:

    rng = random.Random(7)
    values = [*sorted(rng.uniform(1e-06, 0.2) for _ in range(2000)), 1e-07, 300.0, 300.0]
    values.sort()
    one_by_one, sorted_add = Histogram(), Histogram()
    for value in values:
        one_by_one.add(value)
    sorted_add.add_sorted(values)
    assert sorted_add.counts == one_by_one.counts
    assert (sorted_add.count, sorted_add.max) == (one_by_one.count, one_by_one.max)
    assert sorted_add.total == pytest.approx(one_by_one.total)


@pytest.mark.parametrize("window", [0.0, 0.0005, 0.002, 0.05])
def test_a_batchs_statistics_match_each_ops_own(window: float) -> None:
    latencies = [0.001 * (i + 1) for i in range(100)]  # 1..100 ms
    bulk, each = (Observer(threading.Lock(), lambda f: f(), stats=True) for _ in range(2))
    bulk.batch_ended_locked("allreduce", latencies, window)
    for seq, latency in enumerate(latencies):  # what each op's own end records
        each.op_ended_locked(0, "", "allreduce", seq, latency, timed(latency, window), None, False)
    b, e = bulk._ops["allreduce"], each._ops["allreduce"]
    assert (b.count, b.untimed) == (e.count, e.untimed)
    assert b.count == 100
    assert b.hist.counts == e.hist.counts
    if window == 0.002:
        assert 0 < b.untimed < 100  # the rule splits this batch


def test_a_subscriber_arriving_as_an_op_ends_never_gets_its_end_without_its_issue() -> None:
    """The end reads the subscribers once: a subscriber that arrives between
    the op's "issued" (not queued: nobody listened) and its end's event gets
    neither, never an end alone. Forced: the first read finds none, every
    later one finds one."""
    got: list[Any] = []

    class Arriving(Observer):
        reads = 0

        @property  # type: ignore[override]
        def subscribers(self) -> tuple[Any, ...]:
            Arriving.reads += 1
            return () if Arriving.reads == 1 else (got.append,)

        @subscribers.setter
        def subscribers(self, value: Any) -> None:
            pass

    lock = threading.Lock()
    observer = Arriving(lock, lambda f: f(), stats=True)
    table = OpTable(get_runtime(), 0, lambda e, u: None, lock=lock, observer=observer, store="s")
    record = OpRecord(table, "allreduce", 1, time.monotonic() + 5, ScriptedOp(), None)
    with lock:
        record._end_locked(Outcome(ftcomm.CommFailed("boom", rank=0, op="allreduce", seq=1)))
    kinds = [event.kind for event in got]
    assert kinds in ([], ["issued", "failed"]), kinds
    assert observer._ops["allreduce"].failed  # the statistics counted it either way


@pytest.mark.parametrize("n", [1, FOLD_EVERY - 1, FOLD_EVERY, 3 * FOLD_EVERY + 5])
def test_noted_successes_give_the_statistics_each_end_records(n: int) -> None:
    """A success is only noted where it ends (no histogram work on the
    small-op path): the statistics read are what recording each end at once
    gives, whenever they are read, and the notes never pile up."""
    rng = random.Random(n)
    ends = [
        (rng.choice(["allreduce", "barrier"]), rng.uniform(1e-6, 0.5), rng.uniform(0.0, 0.05))
        for _ in range(n)
    ]
    noted, each = (Observer(threading.Lock(), lambda f: f(), stats=True) for _ in range(2))

    for seq, (op, latency, window) in enumerate(ends):
        noted.succeeded_locked(op, latency, window)
        assert len(noted._noted) < FOLD_EVERY  # folded as they reach the bound
        each.op_ended_locked(0, "", op, seq, latency, timed(latency, window), None, False)
    got, want = noted.snapshot(0).ops, each.snapshot(0).ops
    assert list(got) == list(want)  # in the order of their first ends, as before
    for kind, stats in got.items():  # the mean: summed in another order
        assert dataclasses.replace(stats, mean=None) == dataclasses.replace(want[kind], mean=None)
        assert stats.mean == pytest.approx(want[kind].mean)
    assert sum(s.count for s in got.values()) == n
    assert noted._noted == []  # the read folded the rest
    assert any(s.untimed for s in got.values()) or n < 10  # both kinds were drawn


def test_noted_kinds_keep_the_order_of_their_first_ends() -> None:
    """``stats().ops`` lists the op kinds in the order they first ended, as
    recording each end at once does, also when a failure (recorded at once)
    comes between a noted success and the fold."""
    noted, each = (Observer(threading.Lock(), lambda f: f(), stats=True) for _ in range(2))

    noted.succeeded_locked("allreduce", 1e-4, 0.0)
    each.op_ended_locked(0, "", "allreduce", 1, 1e-4, True, None, False)
    failure = CommAborted("no")
    for observer in (noted, each):
        observer.op_ended_locked(0, "", "barrier", 2, 1e-4, True, failure, False)
    assert list(noted.snapshot(0).ops) == list(each.snapshot(0).ops) == ["allreduce", "barrier"]


@pytest.mark.asyncio
async def test_an_awaited_failure_keeps_no_native_op_in_its_traceback(table: OpTable) -> None:
    """The op keeps its error, and the error its traceback: no frame in it may
    hold the native op (a Gloo work holds its group's sockets until a
    garbage collection would break the cycle)."""
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    asyncio.get_running_loop().call_soon(op.finish, RuntimeError("the peer went away"))
    with pytest.raises(ftcomm.CommFailed) as raised:
        await work
    frames, tb = [], raised.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert any(f.f_code.co_name == "__await__" for f in frames)  # the frame checked
    ours = [f for f in frames if f.f_globals.get("__name__", "").startswith("ftcomm.")]
    held = [name for f in ours for name, value in f.f_locals.items() if value is op]
    assert ours
    assert held == []


class _Polled(ScriptedOp):
    """A native op whose end only a poll sees until its callback is armed
    (``armed`` counts the callbacks registered)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = 0
        self.was_armed = asyncio.Event()  # made on the test's loop, set on it

    def on_done(self, callback: Any) -> None:
        self.armed += 1
        self.was_armed.set()
        super().on_done(callback)


@pytest.mark.asyncio
async def test_the_loop_of_a_gather_polls_the_batch_instead_of_a_native_thread(
    store: StoreServer,
) -> None:
    """No native callback while the loop's poll sees the end: Gloo's thread
    would wait for the GIL the loop holds while it registers callbacks."""
    async with await _dummy(store, fuse=True) as g:
        native = _Polled()
        works = _batch_on(g, native, 20)
        gathering = asyncio.gather(*works)
        native._done = True  # ended: seen by a poll, no callback run
        results = await asyncio.wait_for(gathering, 10)
        assert [r.item() for r in results] == [float(i) for i in range(20)]
        assert native.armed == 0


@pytest.mark.asyncio
async def test_once_the_loops_spin_is_over_the_native_callback_ends_the_batch(
    store: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(work_module, "SPIN_SECONDS", 0.0)
    async with await _dummy(store, fuse=True) as g:
        native = _Polled()
        works = _batch_on(g, native, 5)
        gathering = asyncio.gather(*works)
        await asyncio.wait_for(native.was_armed.wait(), 10)  # the poll gave up at once
        ender = threading.Thread(target=native.finish)
        ender.start()
        assert len(await asyncio.wait_for(gathering, 10)) == 5
        ender.join(10)
        assert native.armed == 1  # once for the batch, not once per member


@pytest.mark.asyncio
async def test_a_batch_polled_by_an_await_and_gathered_on_its_loop_ends_as_its_native_op(
    store: StoreServer,
) -> None:
    """An await spins on a member; asyncio.gather of the same members on the
    same loop leaves the polling to it. Once that spin is over, the batch's
    native callback must be armed (not left to the deadline)."""
    async with await _dummy(store, fuse=True) as g:
        native = _Polled()
        works = _batch_on(g, native, 2)
        awaiting = asyncio.create_task(_await(works[0]))
        await asyncio.sleep(0)  # its first step: it polls the batch
        gathering = asyncio.gather(*works)
        timer = threading.Timer(0.05, native.finish)  # after the 2 ms spin
        timer.start()
        try:
            assert len(await asyncio.wait_for(gathering, 5)) == 2
            await awaiting
        finally:
            timer.join(10)


async def _await(work: ftcomm.Work[Any]) -> Any:
    return await work


@pytest.mark.asyncio
async def test_an_unrelated_gather_is_not_cancelled_by_another_ops_cancel(
    table: OpTable,
) -> None:
    """Only a work cancel() was called on counts as cancelled: a gather of
    another op of the group raises that op's CommAborted, as awaiting it does."""
    a, b = issue(table, ScriptedOp(), 30.0), issue(table, ScriptedOp(), 30.0)
    assert a.cancel() is True
    with pytest.raises(CommAborted):
        await asyncio.gather(b)
    assert not b.cancelled()


class _Stoppable(ScriptedOp):
    """A native op its abandon() stops for real: it fails ``after`` seconds
    later, on a thread of its own (a Gloo op whose sockets were shut)."""

    def __init__(self, after: float) -> None:
        super().__init__()
        self.after = after
        self.timers: list[threading.Timer] = []

    def abandon(self) -> bool:
        timer = threading.Timer(self.after, self.finish, (RuntimeError("Connection closed"),))
        self.timers.append(timer)
        timer.start()
        return True


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_a_cancelled_gather_is_a_cancel_even_when_a_sibling_is_out_first(
    table: OpTable, how: str
) -> None:
    """The cancelled op's error is out once its native op stopped (50 ms);
    the op its break ends is out first (5 ms): gather must still see a cancel."""
    slow, fast = _Stoppable(0.05), _Stoppable(0.005)
    works = [issue(table, slow, 30.0), issue(table, fast, 30.0)]
    try:
        if how == "cancel":
            await _cancel_a_task_gathering(works)
        else:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await asyncio.gather(*works)
        assert works[0].cancelled()
        assert works[1].cancelled()
        assert isinstance(table.error, CommAborted)
    finally:
        for timer in slow.timers + fast.timers:
            timer.join(10)


def test_where_no_loop_runs_a_work_is_a_coroutine_to_asyncio(table: OpTable) -> None:
    work = issue(table, ScriptedOp(done=True), 30.0)
    assert not asyncio.isfuture(work)  # so run_until_complete wraps it in a task
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(work) == "result"
    finally:
        loop.close()


@pytest.mark.asyncio
async def test_wait_for_polls_an_unfused_op_on_the_loop_as_await_does(table: OpTable) -> None:
    native = _Polled()
    work = issue(table, native, 30.0)
    native._done = True  # ended: seen by a poll, no callback run
    assert await asyncio.wait_for(work, 10) == "result"
    assert native.armed == 0


def test_a_callback_whose_loop_closed_runs_on_the_thread_that_ends_the_op(
    table: OpTable,
) -> None:
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    seen: list[int] = []

    async def register() -> None:
        work.add_done_callback(lambda _: seen.append(threading.get_ident()))

    asyncio.run(register())  # closed with the loop's poll of the op still queued
    ender = _finish_on_a_thread(op)
    assert seen == [ender]  # at once, not at the op's deadline's sweep


def test_a_thread_waiting_for_an_op_a_stopped_loop_was_to_poll_is_woken_as_it_ends(
    table: OpTable,
) -> None:
    """The loop that was to poll it stops (not closed) before it ran: a
    later waiter of another kind arms the native callback itself."""
    op = ScriptedOp()
    work = issue(table, op, 30.0)
    loop = asyncio.new_event_loop()
    try:

        async def register() -> None:
            work.add_done_callback(lambda _: None)

        loop.run_until_complete(register())  # stops with the poll queued
        timer = threading.Timer(0.05, op.finish)
        timer.start()
        assert work.wait(timeout=5) == "result"
        timer.join(10)
    finally:
        loop.close()


@pytest.mark.asyncio
async def test_the_loops_poll_keeps_nothing_alive_once_the_op_ended(table: OpTable) -> None:
    """No reference cycle: a native op (through it, a native group and its
    sockets) is let go as the op ends, not at the next garbage collection."""
    import gc
    import weakref

    native = _Polled()
    gone = weakref.ref(native)
    work = issue(table, native, 30.0)
    native._done = True
    gc.disable()
    try:
        del native
        assert await asyncio.wait_for(work, 10) == "result"
        assert gone() is None
    finally:
        gc.enable()


# -- the await's spin: holding the loop only when alone ----------------------------------
class _CountedPolls(ScriptedOp):
    """A native op that ends at its ``ends_at``-th poll. Its awaits spin on it
    for a minute (``spin``), so that a loaded machine cannot end the spin
    before the test looks."""

    spin = 60.0

    def __init__(self, ends_at: int) -> None:
        super().__init__()
        self.polls, self.ends_at = 0, ends_at

    def poll(self) -> bool:
        self.polls += 1
        if self.polls >= self.ends_at and not self._done:
            self.finish()
        return self._done


async def _loop_turns_during(*awaitables: Any) -> int:
    """How many times the loop ran another task's step while ``awaitables`` ran."""
    turns, over = 0, False

    async def count() -> None:
        nonlocal turns
        while not over:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count())
    try:
        await asyncio.gather(*(asyncio.create_task(_awaited(a)) for a in awaitables))
    finally:
        over = True
        await counter
    return turns


async def _awaited(work: Any) -> Any:
    return await work


@pytest.mark.asyncio
async def test_a_lone_await_polls_between_turns_of_the_loop(
    table: OpTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alone in spinning on its loop, an await polls for a while before the
    loop runs once (HOLD_SECONDS: a minute here, so that the machine's load
    cannot cut a hold short); the spinning count is back to 0 after."""
    from ftcomm._runtime.loop import spinners

    monkeypatch.setattr(work_module, "HOLD_SECONDS", 60.0)
    op = _CountedPolls(ends_at=200)
    turns = await _loop_turns_during(issue(table, op, 30.0))
    assert op.polls == 200
    assert turns <= 4  # the few around the task and gather; one poll per turn: 200
    assert spinners()[0] == 0


@pytest.mark.asyncio
async def test_an_await_stops_polling_once_another_party_ended_the_op(
    table: OpTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An op ended by a break (an abort, a deadline) while its native op still
    runs: its await returns at its next look, neither spinning on nor holding
    the loop until its spin is over."""
    monkeypatch.setattr(work_module, "HOLD_SECONDS", 0.0)  # one poll per turn: countable
    op = _CountedPolls(ends_at=10**9)
    work = issue(table, op, 30.0)
    task = asyncio.create_task(_awaited(work))
    await asyncio.sleep(0)  # it spins
    table.break_(CommAborted("broken under the await"))
    polls = op.polls
    with pytest.raises(CommAborted, match="broken under the await"):
        await task
    assert op.polls == polls  # not one poll after the end was out


def test_an_end_with_statistics_off_is_not_counted_when_a_subscriber_leaves_meanwhile() -> None:
    """``Group(stats=False)`` with a subscriber that leaves while an op ends:
    the end reads the subscribers once, so it is either an event or nothing,
    never a statistic."""

    class Leaving(Observer):
        """Subscribed until the op's end has read ``subscribers`` once."""

        work: Work[Any] | None = None
        reads_after_end = 0

        @property  # type: ignore[override]
        def subscribers(self) -> tuple[Any, ...]:
            if self.work is None or self.work._end is None:
                return (lambda event: None,)
            self.reads_after_end += 1
            return (lambda event: None,) if self.reads_after_end == 1 else ()

        @subscribers.setter
        def subscribers(self, value: tuple[Any, ...]) -> None:
            pass

    t = OpTable(get_runtime(), rank=0, on_break=lambda error, until: None)
    observer = Leaving(t.lock, lambda f: None, stats=False)
    t.observer = observer
    try:
        work = issue(t, ScriptedOp(done=True), 30.0)
        observer.work = work
        assert work.done()
        assert observer.reads_after_end >= 1  # the race was there to lose
        assert observer.snapshot(0).ops == {}
    finally:
        t.break_(CommAborted("test over"))


@pytest.mark.asyncio
async def test_awaits_spinning_together_poll_once_per_turn(table: OpTable) -> None:
    """With two awaits spinning on one loop, neither holds it: each turn of the
    loop is one poll of each op, so other tasks run as often as before."""
    from ftcomm._runtime.loop import spinners

    ops = [_CountedPolls(ends_at=10**9), _CountedPolls(ends_at=10**9)]
    tasks = [asyncio.create_task(_awaited(issue(table, ops[0], 30.0)))]
    await asyncio.sleep(0)  # the first await's first step: alone, it may hold
    tasks.append(asyncio.create_task(_awaited(issue(table, ops[1], 30.0))))
    await asyncio.sleep(0)
    assert spinners()[0] == 2
    before = [op.polls for op in ops]
    for _ in range(20):  # 20 turns of the loop
        await asyncio.sleep(0)
    assert all(abs(op.polls - n - 20) <= 1 for op, n in zip(ops, before, strict=True))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert spinners()[0] == 0


@pytest.mark.asyncio
async def test_a_cancelled_spin_counts_itself_out(table: OpTable) -> None:
    """An await cancelled mid-spin leaves the count (its ``finally`` runs)."""
    from ftcomm._runtime.loop import spinners

    op = _CountedPolls(ends_at=10**9)
    work = issue(table, op, 30.0)
    task = asyncio.create_task(_awaited(work))
    await asyncio.sleep(0)  # the task's first step: it spins, then lets the loop run
    assert op.polls >= 1
    assert spinners()[0] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert isinstance(work.exception(), CommAborted)  # the cancel aborted the op
    assert spinners()[0] == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("asleep", [False, True])
async def test_a_cancelled_await_keeps_no_native_op_in_its_tracebacks(
    table: OpTable, asleep: bool
) -> None:
    """A task keeps its cancel (and what it raised), with the frames it went
    through: none of ftcomm's may hold the native op, which for Gloo holds
    its group's sockets. Cancelled while spinning, and while asleep."""
    from ftcomm._runtime.loop import spinners

    op = _CountedPolls(ends_at=10**9)
    if asleep:  # past its spin, on the completion callback
        op.spin = 0.0
    work = issue(table, op, 30.0)
    task = asyncio.create_task(_awaited(work))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert spinners()[0] == (0 if asleep else 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError) as raised:
        await task
    frames, seen, exc = [], set(), raised.value
    chain: list[BaseException] = [exc]
    while chain:
        e = chain.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        chain += [c for c in (e.__context__, e.__cause__) if c is not None]
        tb = e.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
    ours = [f for f in frames if f.f_globals.get("__name__", "").startswith("ftcomm.")]
    held = [(f.f_code.co_name, n) for f in ours for n, v in f.f_locals.items() if v is op]
    assert ours
    assert held == []
