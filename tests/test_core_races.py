"""The group core's promises under forced interleavings (issue 10).

Each race is forced, not hoped for: a thread is paused at a chosen point by
an event inside a stand-in that the code under test calls (only the native op
or a constructor is stood in for; the Work, the op table and the group core
are the real ones), and the other side runs while it is paused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import ScriptedOp, StoreServer, add_callback_off_loop, issue

import ftcomm
from ftcomm import _configure as configure_mod
from ftcomm._runtime import faults
from ftcomm._runtime.loop import get_runtime
from ftcomm._runtime.table import OpTable
from ftcomm._runtime.work import Work
from ftcomm.c10d._work import OpWork
from ftcomm.testing import inspect
from ftcomm.testing._base import child_pids

# How long an observer gets to (wrongly) see an op end while its settler is
# paused. On the code under test it blocks for all of it; it only bounds how
# long the bug, if it came back, would take to show.
WINDOW = 0.3


@pytest.fixture
def table() -> Iterator[OpTable]:
    t = OpTable(get_runtime(), rank=0, on_break=lambda error, until: None)
    yield t
    t.break_(ftcomm.CommAborted("test over"))


class _PauseOnce(dict):  # type: ignore[type-arg]
    """The table's in-flight map; pauses the settler thread once, inside the
    settle (where the table breaks), holding whatever the settler holds."""

    def __init__(self, settler: list[threading.Thread]) -> None:
        super().__init__()
        self.settler = settler
        self.paused = threading.Event()
        self.go = threading.Event()

    def values(self) -> Any:
        settling = self.settler and threading.current_thread() is self.settler[0]
        if settling and not self.paused.is_set():
            self.paused.set()
            self.go.wait(10)
        return super().values()


def _observe_in_thread(fn: Any) -> tuple[threading.Thread, list[object], threading.Event]:
    seen: list[object] = []
    ended = threading.Event()

    def run() -> None:
        try:
            seen.append(fn())
        except BaseException as exc:
            seen.append(exc)
        ended.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, seen, ended


async def _await(work: Work[Any]) -> Any:
    return await work


class _PausingAbandon(ScriptedOp):
    """Pauses the settler in ``abandon()``: SETTLING, with the lock released."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = threading.Event()
        self.go = threading.Event()

    def abandon(self) -> None:
        self.paused.set()
        self.go.wait(10)


@pytest.mark.parametrize("where", ["holding the lock", "in abandon()"])
def test_no_observer_sees_success_while_the_op_is_being_failed(table: OpTable, where: str) -> None:
    """s1: the settler is paused after it claimed the op for a CommTimeout;
    wait(), await and the c10d future must not report the op's result."""
    settler: list[threading.Thread] = []
    native = _PausingAbandon()
    inflight = _PauseOnce(settler)
    if where == "holding the lock":
        table.inflight = inflight
        native.go.set()
    else:
        inflight.paused, inflight.go = native.paused, native.go
    work = issue(table, native, 60.0, result="RESULT")
    future = OpWork(work, ["RESULT"]).get_future()

    thread = threading.Thread(
        target=work._abort, args=(ftcomm.CommTimeout("allreduce did not complete"),)
    )
    settler.append(thread)
    thread.start()
    assert inflight.paused.wait(10)
    waiter = _observe_in_thread(lambda: work.wait(timeout=30))
    awaiter = _observe_in_thread(lambda: asyncio.run(_await(work)))
    try:
        # Neither may end while the op's outcome is not out: on the old code
        # both returned "RESULT" here, and the future held a success.
        assert not waiter[2].wait(WINDOW), f"wait() returned {waiter[1]}"
        assert not awaiter[2].wait(0.01), f"await returned {awaiter[1]}"
        assert not future.done()
        assert not work.done()
    finally:
        inflight.go.set()
        thread.join(10)
        waiter[0].join(10)
        awaiter[0].join(10)
    for _, seen, _ in (waiter, awaiter):
        assert len(seen) == 1
        assert isinstance(seen[0], ftcomm.CommTimeout), seen
    with pytest.raises(RuntimeError, match="CommTimeout"):
        future.wait()
    assert isinstance(work.exception(), ftcomm.CommTimeout)


class _Copying(ScriptedOp):
    """A native op mid copy-back: ``abandon()`` is where it stops writing.
    It records what an observer could see at that moment."""

    def __init__(self) -> None:
        super().__init__()
        self.work: Work[object] | None = None
        self.seen_in_abandon: dict[str, object] = {}

    def abandon(self) -> None:
        work = self.work
        assert work is not None
        self.seen_in_abandon["done"] = work.done()
        try:
            self.seen_in_abandon["exception"] = work.exception()
        except asyncio.InvalidStateError:
            self.seen_in_abandon["exception"] = "pending"
        timed_out = _observe_in_thread(lambda: work.wait(timeout=0.01))
        timed_out[0].join(10)
        self.seen_in_abandon["wait"] = timed_out[1][0]
        self.seen_in_abandon["errored"] = work._table.error


def test_the_error_is_out_only_after_the_native_op_was_abandoned(table: OpTable) -> None:
    """s6: while ``abandon()`` runs, the op still looks pending to everyone."""
    op = _Copying()
    work = issue(table, op, 60.0)
    op.work = work
    assert work.cancel() is True
    assert op.seen_in_abandon["done"] is False
    assert op.seen_in_abandon["exception"] == "pending"
    assert type(op.seen_in_abandon["wait"]) is TimeoutError  # the wait's own bound
    assert op.seen_in_abandon["errored"] is None  # the group's error is not out either
    with pytest.raises(ftcomm.CommAborted):
        work.wait(timeout=5)


def test_a_late_observer_of_a_settling_op_waits_for_its_outcome(table: OpTable) -> None:
    """A done-callback added while the op is being settled (the settler
    paused in ``abandon()``, outside the lock) runs once, after the outcome
    is out, and sees the error."""
    paused, go = threading.Event(), threading.Event()

    class Pausing(ScriptedOp):
        def abandon(self) -> None:
            paused.set()
            go.wait(10)

    work = issue(table, Pausing(), 60.0)
    thread = threading.Thread(target=work.cancel)
    thread.start()
    assert paused.wait(10)
    seen: list[object] = []
    work.add_done_callback(lambda w: seen.append(w.exception()))
    assert seen == []
    assert not work.done()
    go.set()
    thread.join(10)
    assert len(seen) == 1
    assert isinstance(seen[0], ftcomm.CommAborted)


# -- a stress run: every observer of every op agrees ---------------------------


def _race_one_round(rng: random.Random, per_round: int) -> list[str]:
    """One round of the stress run: its disagreements, if any."""
    tbl = OpTable(get_runtime(), rank=0, on_break=lambda error, until: None)
    ops = [ScriptedOp() for _ in range(per_round)]
    works = [issue(tbl, op, 60.0, result=i) for i, op in enumerate(ops)]
    callbacks: list[list[object]] = [[] for _ in works]
    for i, w in enumerate(works):
        w.add_done_callback(lambda w, i=i: callbacks[i].append(w.exception()))
    plan = [rng.random() for _ in works]
    waited: list[tuple[str, object] | None] = [None] * per_round
    start = threading.Barrier(4)

    def finisher() -> None:
        start.wait()
        for i, op in enumerate(ops):
            op.finish(RuntimeError("peer gone") if plan[i] < 0.2 else None)

    def canceller() -> None:
        start.wait()
        for i in reversed(range(len(works))):
            if plan[i] > 0.7:
                works[i].cancel()
            elif plan[i] > 0.6:
                works[i]._expire()

    def waiter() -> None:
        start.wait()
        for i, w in enumerate(works):
            try:
                waited[i] = ("ok", w.wait(timeout=30))
            except ftcomm.CommError as exc:
                waited[i] = ("failed", exc)

    threads = [threading.Thread(target=f) for f in (finisher, canceller, waiter)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join(60)
    disagreements = []
    for i, w in enumerate(works):
        error = w.exception()
        seen = waited[i]
        verdicts = {
            "exception()": error is None,
            "wait()": seen is not None and seen[0] == "ok",
            "callback": callbacks[i] == [None],
        }
        if len(set(verdicts.values())) != 1 or len(callbacks[i]) != 1:
            disagreements.append(f"op {i}: {verdicts} {callbacks[i]}")
        elif error is None and seen != ("ok", i):
            disagreements.append(f"op {i}: wait() gave {seen}")
    tbl.break_(ftcomm.CommAborted("round over"))
    return disagreements


def test_thousands_of_ops_settled_from_three_threads_look_the_same_to_everyone() -> None:
    """Native completions (ok or failed), deadlines and cancels race on 3
    threads while observers look; no op may look failed to one observer and
    succeeded to another."""
    rng = random.Random(10)
    disagreements: list[str] = []
    for _ in range(15):
        disagreements += _race_one_round(rng, 200)
    assert disagreements == []


# -- configure against abort/shutdown on other threads -------------------------


class _PausingTable(OpTable):
    """Built by configure once its native group has landed, before the group
    takes it as its configuration: the configure thread pauses here."""

    paused = threading.Event()
    go = threading.Event()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _PausingTable.paused.set()
        assert _PausingTable.go.wait(10)
        super().__init__(*args, **kwargs)


@pytest.fixture
def pausing_table(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_PausingTable]]:
    _PausingTable.paused = threading.Event()
    _PausingTable.go = threading.Event()
    monkeypatch.setattr(configure_mod, "OpTable", _PausingTable)
    yield _PausingTable
    _PausingTable.go.set()


def _configure_in_thread(g: ftcomm.Group, addr: str) -> tuple[threading.Thread, list[object]]:
    outcome: list[object] = []

    def run() -> None:
        try:
            asyncio.run(g.configure(addr, 0, 1))
            outcome.append("configured")
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("backend", ["dummy", "gloo"])
def test_shutdown_during_configure_wins(
    pausing_table: type[_PausingTable], store: StoreServer, backend: str
) -> None:
    """s7: shutdown() on this thread while configure() is past its connect on
    another: no configuration is live after shutdown() returned."""
    g = ftcomm.Group(backend, timeout=10)
    thread, outcome = _configure_in_thread(g, f"127.0.0.1:{store.port}/s7{backend}")
    assert pausing_table.paused.wait(30)
    g.shutdown()
    assert g.state is ftcomm.State.CLOSED
    pausing_table.go.set()
    thread.join(30)
    assert len(outcome) == 1
    assert isinstance(outcome[0], ftcomm.CommAborted), outcome
    assert "superseded by shutdown()" in str(outcome[0])
    assert inspect(g).config is None
    assert g.state is ftcomm.State.CLOSED
    with pytest.raises(ftcomm.NotConfigured):
        g.barrier()


def test_abort_during_configure_leaves_the_group_errored(
    pausing_table: type[_PausingTable], store: StoreServer
) -> None:
    g = ftcomm.Group("dummy", timeout=10)
    thread, outcome = _configure_in_thread(g, f"127.0.0.1:{store.port}/abort-cfg")
    assert pausing_table.paused.wait(30)
    g.abort()
    pausing_table.go.set()
    thread.join(30)
    assert len(outcome) == 1
    assert isinstance(outcome[0], ftcomm.CommAborted), outcome
    assert "superseded by abort()" in str(outcome[0])
    assert g.state is ftcomm.State.ERRORED
    assert isinstance(g.errored(), ftcomm.CommAborted)
    with pytest.raises(ftcomm.CommAborted, match="refused"):
        g.barrier()
    # ... until the next configure.
    pausing_table.go.set()
    asyncio.run(g.configure(f"127.0.0.1:{store.port}/abort-cfg2", 0, 1))
    assert g.state is ftcomm.State.READY
    assert g.errored() is None
    g.shutdown()


@pytest.mark.asyncio
async def test_abort_and_shutdown_act_without_await() -> None:
    """s2: torch's spelling, ``pg.abort()``, must not be a silent no-op."""
    g = ftcomm.Group("dummy")
    await g.configure("127.0.0.1:1/x", 0, 1)
    previous = faults.set_injector(lambda op, issue, backend: ScriptedOp())  # in flight
    try:
        work = g.barrier()
    finally:
        faults.set_injector(previous)
    assert not work.done()
    g.abort()  # not awaited
    assert isinstance(g.errored(), ftcomm.CommAborted)
    assert g.state is ftcomm.State.ERRORED
    assert work.done()
    closing = g.shutdown()  # not awaited either
    assert g.state is ftcomm.State.CLOSED
    assert closing.done()
    await closing  # and awaiting still works
    await g.abort()


def test_the_state_table_is_what_the_core_enforces() -> None:
    """The table of docs/ops.md, written out again here, is what the core
    does: every pair in it goes where it says, every other pair is refused."""
    from ftcomm._state import GroupCore

    s = ftcomm.State
    u, c, r, e, x = s.UNCONFIGURED, s.CONFIGURING, s.READY, s.ERRORED, s.CLOSED
    expected = {
        **{("begin", st): c for st in s},
        ("ready", c): r,
        ("fail", c): u,
        ("break", r): e,
        ("abort", r): e,
        ("abort", e): e,
        ("abort", c): e,
        ("abort", u): u,
        ("abort", x): x,
        **{("shutdown", st): x for st in s},
    }
    core = GroupCore()
    for state in s:
        for event in ("begin", "ready", "fail", "break", "abort", "shutdown"):
            core._state = state
            with core.lock:
                if (event, state) in expected:
                    core._go(event)
                    assert core.state is expected[(event, state)], (event, state)
                else:
                    with pytest.raises(RuntimeError, match="not allowed"):
                        core._go(event)


@pytest.mark.slow
def test_configure_shutdown_abort_and_ops_from_three_threads() -> None:
    """Thousands of configures, aborts, shutdowns and ops at once: every op
    ends, with one outcome for every observer, and no configuration that
    began before a shutdown becomes live after it."""
    g = ftcomm.Group("dummy", timeout=30)
    log: list[tuple[str, ftcomm.State, ftcomm.State]] = []
    g._core.on_transition = lambda event, before, after: log.append((event, before, after))
    stop = threading.Event()
    errors: list[BaseException] = []
    works: list[Work[Any]] = []
    counts = {"configured": 0, "ops": 0}

    def configurer() -> None:
        loop = asyncio.new_event_loop()
        try:
            for i in range(600):
                try:
                    loop.run_until_complete(g.configure(f"127.0.0.1:1/c{i}", 0, 1))
                    counts["configured"] += 1
                    time.sleep(0.001)  # pacing: leave the issuer a configured group
                except ftcomm.CommAborted:
                    pass
        except BaseException as exc:
            errors.append(exc)
        finally:
            loop.close()
            stop.set()

    def closer() -> None:
        rng = random.Random(3)
        try:
            while not stop.is_set():
                if rng.random() < 0.5:
                    g.abort()
                else:
                    g.shutdown()
                time.sleep(0.002)  # pacing: leave the configured group some ops
        except BaseException as exc:
            errors.append(exc)

    def issuer() -> None:
        try:
            while not stop.is_set():
                try:
                    works.append(g.barrier())
                    counts["ops"] += 1
                except (ftcomm.NotConfigured, ftcomm.CommAborted):
                    pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=f) for f in (configurer, closer, issuer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    g.shutdown()
    assert errors == []
    assert counts["configured"] > 0
    assert counts["ops"] > 0
    assert g.state is ftcomm.State.CLOSED
    assert inspect(g).config is None
    # A "ready" always belongs to an attempt that began after the last
    # shutdown or abort-while-configuring: the core refuses any other.
    last_begin = last_cut = -1
    for i, (event, before, _) in enumerate(log):
        if event == "begin":
            last_begin = i
        elif event == "shutdown" or (event == "abort" and before is ftcomm.State.CONFIGURING):
            last_cut = i
        elif event == "ready":
            assert last_begin > last_cut, f"ready at {i} for an attempt cut at {last_cut}"
    assert any(w.exception() is None for w in works)
    for w in works:
        assert w.done()
        error = w.exception()
        if error is None:
            assert w.wait(timeout=1) is None
        else:
            with pytest.raises(ftcomm.CommError) as info:
                w.wait(timeout=1)
            assert info.value is error


# -- with a worker process: nothing of a configuration outlives shutdown() ----


@pytest.mark.asyncio
async def test_a_refill_queued_before_shutdown_starts_no_spare(store: StoreServer) -> None:
    """configure() queues a spare's start on a control thread; if that runs
    after shutdown() (s7 with ``subprocess=True``), no spare may start."""
    g = ftcomm.Group("dummy", subprocess=True, timeout=30, configure_timeout=60)
    await g.configure(f"127.0.0.1:{store.port}/refill", 0, 1)
    config = inspect(g).config
    launcher = inspect(g).launcher
    assert config is not None
    assert launcher is not None
    await g.shutdown()
    g._configurer._refill_for(config)  # what configure() queued, running late
    assert launcher.spare_pid is None
    assert get_runtime().control.wait_idle(30)
    assert launcher.spare_pid is None


async def _configuring_in_a_worker(
    g: ftcomm.Group, store: StoreServer, prefix: str
) -> asyncio.Future[None]:
    """Start ``g.configure`` as rank 0 of 2 (rank 1 never comes); return its
    task once the worker is started and in the rendezvous (keys in the store)."""
    before = child_pids()
    task = asyncio.ensure_future(g.configure(f"127.0.0.1:{store.port}/{prefix}", 0, 2))
    probe = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
    try:
        deadline = time.monotonic() + 30
        while not (child_pids() - before) or probe.num_keys() == 0:
            assert not task.done(), task
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    finally:
        del probe
    return task


@pytest.mark.asyncio
async def test_abort_kills_a_worker_being_configured(store: StoreServer) -> None:
    """abort() during configure() (a peer that never comes) ends the configure
    at once, not at its timeout, and leaves no worker behind."""
    g = ftcomm.Group("gloo", subprocess=True, spare_worker=False, timeout=60)
    task = await _configuring_in_a_worker(g, store, "abort-sub")
    started = time.monotonic()
    g.abort()
    with pytest.raises(ftcomm.CommAborted, match=r"superseded by abort\(\)"):
        await task
    assert time.monotonic() - started < 10  # the configure timeout is 60 s
    assert g.state is ftcomm.State.ERRORED
    await g.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["shutdown", "abort"])
async def test_configure_stops_waiting_once_superseded(store: StoreServer, how: str) -> None:
    """In process, a Gloo rendezvous cannot be interrupted; configure() still
    returns at once when abort()/shutdown() supersede it, and the group it
    was building is disposed of when it lands (the leak check waits for it)."""
    g = ftcomm.Group("gloo", timeout=2)
    task = asyncio.ensure_future(g.configure(f"127.0.0.1:{store.port}/sup-{how}", 0, 2))
    await asyncio.sleep(0)  # the task runs up to its first await: begin() is behind it
    assert g.state is ftcomm.State.CONFIGURING
    started = time.monotonic()
    getattr(g, how)()
    with pytest.raises(ftcomm.CommAborted, match=rf"superseded by {how}\(\)"):
        await task
    assert time.monotonic() - started < 1.0  # the peer never comes; the timeout is 2 s
    g.shutdown()


# -- Closing -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_closing_that_times_out_leaves_the_backends_future_alone() -> None:
    """Every Closing of one backend waits on the same future: one that gives
    up must not cancel it for the others (nor make their wait() raise)."""
    exited: concurrent.futures.Future[None] = concurrent.futures.Future()
    await ftcomm.Closing(exited, timeout=0.01)
    assert not exited.cancelled()
    other = ftcomm.Closing(exited)
    assert other.done() is False
    assert await asyncio.to_thread(other.wait, 0.01) is False
    exited.set_result(None)
    assert other.done() is True
    await other


def test_abort_and_shutdown_can_be_run_as_coroutines() -> None:
    """They were coroutines once: asyncio.run() and create_task() still take them."""
    g = ftcomm.Group("dummy")
    asyncio.run(g.configure("127.0.0.1:1/coro", 0, 1))

    async def both() -> None:
        await asyncio.create_task(g.abort())

    asyncio.run(both())
    assert g.state is ftcomm.State.ERRORED
    asyncio.run(g.shutdown())
    assert g.state is ftcomm.State.CLOSED


def test_a_siblings_callback_finds_the_breaking_op_ended(table: OpTable) -> None:
    """Op A's cancel ends op B too; B's done-callback runs on A's settler
    thread, and must find A ended (and A.wait() must not wait for the very
    thread it runs on)."""
    a = issue(table, ScriptedOp(), 60.0)
    b = issue(table, ScriptedOp(), 60.0)
    seen: dict[str, object] = {}

    def on_b(w: Work[object]) -> None:
        seen["b"] = w.exception()
        seen["a.done"] = a.done()
        with pytest.raises(ftcomm.CommAborted) as info:
            a.wait(timeout=5)
        seen["a.wait"] = info.value

    b.add_done_callback(on_b)
    assert a.cancel() is True
    assert seen["a.done"] is True
    assert seen["a.wait"] is a.exception()
    assert isinstance(seen["b"], ftcomm.CommAborted)
    assert seen["b"].__cause__ is a.exception()


@pytest.mark.asyncio
async def test_abort_ends_every_op_while_another_thread_settles_one() -> None:
    """Op A is being failed on another thread (paused in its abandon()):
    abort() still ends every other op in flight before it returns."""
    g = ftcomm.Group("dummy", timeout=60)
    await g.configure("127.0.0.1:1/abort-all", 0, 1)
    slow = _PausingAbandon()
    natives = iter([slow, ScriptedOp(), ScriptedOp()])
    previous = faults.set_injector(lambda op, issue, backend: next(natives))
    try:
        a, b, c = (g.allreduce(torch.zeros(1)) for _ in range(3))
    finally:
        faults.set_injector(previous)
    settler = threading.Thread(target=a.cancel)
    settler.start()
    try:
        assert slow.paused.wait(10)
        g.abort()
        assert b.done()
        assert c.done()
        assert g.num_active_work() == 0
        assert not a.done()  # its settler publishes it
    finally:
        slow.go.set()
        settler.join(10)
    assert isinstance(a.exception(), ftcomm.CommAborted)
    await g.shutdown()


# -- callbacks, interrupts and refusals (second review) ---------------------------


def _injecting(*natives: object) -> Any:
    """An injector that hands out ``natives`` in turn; an exception is raised."""
    queue = list(natives)

    def inject(op: str, issue: Any, backend: Any) -> object:
        native = queue.pop(0)
        if isinstance(native, BaseException):
            raise native
        return native

    return inject


@pytest.mark.asyncio
async def test_a_callback_that_issues_an_op_when_an_issue_is_refused_does_not_deadlock() -> None:
    """A refused issue breaks the group and ends the ops in flight; their
    callbacks (a DDP comm hook's then()) may issue an op: not under the issue lock."""
    g = ftcomm.Group("dummy", timeout=60)
    await g.configure("127.0.0.1:1/refused-cb", 0, 1)
    previous = faults.set_injector(
        _injecting(ScriptedOp(), RuntimeError("Application timeout caused pair closure"))
    )
    try:
        first = g.barrier()
        seen: list[BaseException] = []

        def issue_again(_: Work[None]) -> None:
            try:
                g.barrier()
            except ftcomm.CommError as exc:
                seen.append(exc)

        add_callback_off_loop(first, issue_again)  # run by the thread that ends it
        refused = _observe_in_thread(g.barrier)
        refused[0].join(10)
        assert not refused[0].is_alive(), "issuing deadlocked in a callback"
    finally:
        faults.set_injector(previous)
    assert isinstance(refused[1][0], ftcomm.CommFailed)
    assert len(seen) == 1
    assert isinstance(seen[0], ftcomm.CommAborted)
    await g.shutdown()


def test_a_raising_callback_neither_escapes_nor_leaves_waiters_asleep(
    table: OpTable, caplog: pytest.LogCaptureFixture
) -> None:
    a = issue(table, ScriptedOp(), 60.0)
    b = issue(table, ScriptedOp(), 60.0)
    a.add_done_callback(lambda _: {}["user bug"])
    waiter = _observe_in_thread(lambda: b.wait(timeout=30))
    table.break_(ftcomm.CommAborted("aborted"))  # must not raise the KeyError
    waiter[0].join(10)
    assert not waiter[0].is_alive(), "b's waiter was never woken"
    assert isinstance(waiter[1][0], ftcomm.CommAborted)
    assert "a done-callback raised" in caplog.text


@pytest.mark.asyncio
async def test_configure_goes_on_when_an_old_ops_callback_raises() -> None:
    g = ftcomm.Group("dummy", timeout=60)
    await g.configure("127.0.0.1:1/old", 0, 1)
    previous = faults.set_injector(_injecting(ScriptedOp()))
    try:
        old = g.barrier()
    finally:
        faults.set_injector(previous)
    old.add_done_callback(lambda _: {}["user bug"])
    await g.configure("127.0.0.1:1/new", 0, 1)
    assert g.state is ftcomm.State.READY
    assert isinstance(old.exception(), ftcomm.CommAborted)
    await g.shutdown()


def test_an_interrupt_in_abandon_still_ends_the_op(table: OpTable) -> None:
    class Interrupted(ScriptedOp):
        def abandon(self) -> None:
            raise KeyboardInterrupt

    work = issue(table, Interrupted(), 60.0)
    other = issue(table, ScriptedOp(), 60.0)
    with pytest.raises(KeyboardInterrupt):
        work.cancel()
    assert work.done()
    assert isinstance(work.exception(), ftcomm.CommAborted)
    assert table.error is not None
    assert other.done()


def test_a_break_peeks_at_the_ops_it_ends_and_never_polls(table: OpTable) -> None:
    """A subprocess call's poll reads the socket and can end other ops on the
    breaking thread: a break only peeks. An op that had completed keeps its
    success."""
    polled: list[int] = []

    class Peekable(ScriptedOp):
        def poll(self) -> bool:
            polled.append(1)
            return super().poll()

        def peek(self) -> bool:
            return self._done

    natives = [Peekable() for _ in range(3)]
    works = [issue(table, native, 60.0) for native in natives]
    natives[1].finish()  # completed, not yet settled
    table.break_(ftcomm.CommAborted("aborted"))
    assert polled == []
    assert [w.exception() is None for w in works] == [False, True, False]


def test_a_refill_decided_before_close_gives_up() -> None:
    """The group reads the launcher's generation, checks its configuration,
    then refills: a close() in between must win."""
    from ftcomm.backends.subprocess import Launcher

    launcher = Launcher("dummy")
    generation = launcher.generation
    launcher.close()
    launcher.refill(generation)
    assert launcher.spare_pid is None


@pytest.mark.asyncio
async def test_a_cancelled_configure_kills_its_worker(store: StoreServer) -> None:
    """Cancelling configure() (a peer that never comes) kills the worker it
    was configuring, now, not at the configure timeout."""
    g = ftcomm.Group("gloo", subprocess=True, spare_worker=False, timeout=60)
    before = child_pids()
    task = await _configuring_in_a_worker(g, store, "cancel-sub")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 10  # the configure timeout is 60 s
    while child_pids() - before:
        assert time.monotonic() < deadline, "the cancelled configure's worker lives on"
        await asyncio.sleep(0.01)
    assert g.state is ftcomm.State.UNCONFIGURED
    await g.shutdown()


class _Stoppable(ScriptedOp):
    """A native op whose abandon() stops it for real: it ends when the test
    says so, as a Gloo op ends once its sockets are shut down."""

    def __init__(self) -> None:
        super().__init__()
        self.abandoned = threading.Event()

    def abandon(self) -> bool:
        self.abandoned.set()
        return True


def test_a_stopped_op_publishes_its_error_only_once_its_native_op_ended(
    table: OpTable,
) -> None:
    native = _Stoppable()
    work = issue(table, native, 30.0)
    seen: list[bool] = []
    work.add_done_callback(lambda w: seen.append(native.poll()))
    canceller = threading.Thread(target=work.cancel)
    canceller.start()
    assert native.abandoned.wait(5)
    assert table.error is not None  # errored() at once: no new op meets the stopped group
    assert not work.done()  # but the op's own error waits for its native end
    native.finish(RuntimeError("Connection closed by peer"))
    canceller.join(5)
    assert not canceller.is_alive()  # cancel() returned once it was published
    assert seen == [True]  # published after the native op had ended
    assert isinstance(work.exception(), ftcomm.CommAborted)


def test_a_stopped_op_that_never_ends_is_published_after_stop_wait(
    table: OpTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gloo sometimes leaves a big send blocked after the shutdown, until its
    own timeout: no observer may wait that long."""
    from ftcomm._runtime import table as settle

    monkeypatch.setattr(settle, "STOP_WAIT", 0.2)
    native = _Stoppable()
    work = issue(table, native, 30.0)
    started = time.monotonic()
    assert work.cancel()
    took = time.monotonic() - started
    assert work.done()
    assert isinstance(work.exception(), ftcomm.CommAborted)
    assert 0.15 < took < 0.2 + 1.0  # published by the fallback, not the native end
    native.finish(RuntimeError("late"))  # its late end changes nothing
    assert isinstance(work.exception(), ftcomm.CommAborted)


def test_cancel_on_the_owner_loop_does_not_hold_it(
    table: OpTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: cancel() of a stopped op waits for its publication,
    which the owner loop itself may have to make (_overdue): there it must
    not block."""
    from ftcomm._runtime import table as settle

    # Well above the bound below: a loaded box can hold this thread (the
    # GIL, the scheduler) a few tenths of a second.
    monkeypatch.setattr(settle, "STOP_WAIT", 1.5)
    native = _Stoppable()
    work = issue(table, native, 30.0)

    async def cancel_here() -> float:
        started = time.monotonic()
        work.cancel()
        return time.monotonic() - started

    took = get_runtime().call(cancel_here(), timeout=10)
    assert took < 1.0  # returned at once, not after STOP_WAIT
    with pytest.raises(ftcomm.CommAborted):
        work.wait(5)  # then published by _overdue on the owner loop


class _StopFailsOthers(ScriptedOp):
    """``abandon()`` shuts the group's sockets: what that fails elsewhere
    happens on this thread, before the settler goes on (forced), as Gloo's
    threads may do it before the settler's next line. ``stops``: abandon()
    says it stopped the op for real, which then ends by itself (as a Gloo op
    whose sockets were shut) once the settler waits for it."""

    def __init__(self, stopped: Any, stops: bool) -> None:
        super().__init__()
        self.stopped = stopped
        self.stops = stops

    def abandon(self) -> bool:
        self.stopped()
        return self.stops

    def on_done(self, callback: Any) -> None:
        if self.stops and not self._done:
            self.finish(RuntimeError("Connection closed by peer"))
        super().on_done(callback)


@pytest.mark.parametrize("stops", [False, True], ids=["not-stopped", "stopped"])
@pytest.mark.parametrize(
    "how",
    [
        "a sibling op fails",
        "an unwatched sibling op fails",
        "a verified op's check fails",
        "abort() is called",
    ],
)
@pytest.mark.parametrize("cause", ["deadline", "cancel"])
def test_a_failure_the_stop_causes_does_not_replace_the_stops_cause(
    table: OpTable, how: str, cause: str, stops: bool
) -> None:
    """CI saw ``errored()`` say CommFailed ("the check before an op failed:
    Connection closed by peer") after a cancel: the verified op's check
    failed from the cancel's own socket shutdown, and broke the table before
    the canceller did. The cause claimed first is the group's error, and an
    op failed by the stop ends with CommAborted naming it; an abort() made
    meanwhile keeps its own cause."""
    sibling_native = ScriptedOp()
    sibling = issue(table, sibling_native, 60.0)
    if how != "an unwatched sibling op fails":
        sibling._add_waiter(sibling_native, lambda: None)  # its native callback armed
    # else nothing settles it on its native end: the break finds it failed
    closed = RuntimeError("Connection closed by peer [127.0.0.1]:4242")
    aborted = ftcomm.CommAborted("abort() was called")

    def stopped() -> None:
        if how in ("a sibling op fails", "an unwatched sibling op fails"):
            sibling_native.finish(closed)
        elif how == "a verified op's check fails":  # what Chain._break's on_error does
            table.break_(ftcomm.CommFailed(f"the check before an op failed: {closed}"))
        else:  # as Group.abort() does it (_state.py)
            with table.lock:
                broken = table.break_locked(aborted, "abort")
            table.after_break(broken, time.monotonic())

    work = issue(table, _StopFailsOthers(stopped, stops), 60.0)
    expected: type[ftcomm.CommError]
    if cause == "deadline":
        work._expire()
        expected = ftcomm.CommTimeout
    else:
        assert work.cancel() is True
        expected = ftcomm.CommAborted
    with pytest.raises(expected):
        work.wait(timeout=5)
    if how == "abort() is called":
        assert table.error is aborted  # abort()'s own cause, as its docstring says
    else:
        assert type(table.error) is expected, table.error
        assert table.stopping is not None
        assert table.error is table.stopping
    assert sibling.done()
    error = sibling.exception()
    assert type(error) is ftcomm.CommAborted, error
    assert table.error is not None
    assert table.error.message in str(error)  # names the group's cause
    if cause == "cancel" and how != "abort() is called":
        # ended by the cancel's break: cancel() on it then marks it cancelled
        # (as cancelling asyncio.gather of works does, one work at a time)
        assert sibling.cancel() is False
        assert sibling.cancelled()


@pytest.mark.parametrize("settled", ["by the break", "during the abandon"])
@pytest.mark.parametrize("cause", ["deadline", "cancel"])
def test_a_failure_from_before_the_stop_keeps_its_own_error(
    table: OpTable, cause: str, settled: str
) -> None:
    """Review findings: an op nobody looked at failed natively (a peer died)
    before another op's deadline or cancel stopped the group. Whether the
    break finds it failed, or its own end settles it while the settler stops
    the group (a look at it from the abandon: _settle_quietly's path), its
    failure is its own, not the stop's: CommFailed, naming the peer's error,
    and not marked cancelled by a later cancel()."""
    sibling_native = ScriptedOp()
    sibling = issue(table, sibling_native, 60.0)  # unwatched: nothing settles it
    died = RuntimeError("Connection reset by peer [127.0.0.1]:4242")
    sibling_native.finish(died)
    assert sibling.seq in table.inflight  # ended natively, not yet as an op (done() would look)
    look = sibling.done if settled == "during the abandon" else (lambda: None)
    work = issue(table, _StopFailsOthers(look, stops=False), 60.0)
    if cause == "deadline":
        work._expire()
    else:
        assert work.cancel() is True
    error = sibling.exception()
    assert type(error) is ftcomm.CommFailed, error
    assert error.__cause__ is died
    assert sibling.cancel() is False
    assert not sibling.cancelled()


def test_a_peek_that_raises_as_the_stop_is_claimed_leaves_the_op_unclaimed(
    table: OpTable,
) -> None:
    """Review finding: a sibling's peek() raising while the settler records
    which ops had ended (under the lock, after its claim) left the op claimed
    and out of the table, so that nothing could end it, and the stop's cause
    behind for an unrelated break."""

    class BadPeek(ScriptedOp):
        raised = False

        def peek(self) -> bool:
            if not self.raised:  # once: the break that follows peeks it again
                self.raised = True
                raise RuntimeError("a bug in a sibling's peek()")
            return False

    issue(table, BadPeek(), 60.0)
    work = issue(table, ScriptedOp(), 60.0)
    with pytest.raises(RuntimeError, match="sibling's peek"):
        work.cancel()
    assert table.stopping is None
    assert work.seq in table.inflight  # still pending: a break can end it
    peer_died = ftcomm.CommFailed("a peer died")
    table.break_(peer_died)
    assert table.error is peer_died  # named after its own cause, not the cancel
    with pytest.raises(ftcomm.CommAborted, match="a peer died"):
        work.wait(5)


def test_the_fault_wrappers_peek_without_the_inner_ops_side_effects(table: OpTable) -> None:
    """Review finding: the fault wrappers had no peek(), so the stop's record
    of ended ops (under the table's lock) fell back to their poll(), which
    polls the inner op: a subprocess call's poll reads its socket and may
    settle another op on this thread, which takes the lock again."""
    from ftcomm.testing import _faults

    class Inner(ScriptedOp):
        def poll(self) -> bool:
            raise AssertionError("poll() under the table's lock")

        def peek(self) -> bool:
            return False

    late, failed = _faults._LateOp(Inner(), 0.0), _faults._FailedOp(Inner(), "injected")
    assert (late.peek(), failed.peek()) == (False, False)
    issue(table, late, 60.0)
    issue(table, failed, 60.0)
    work = issue(table, ScriptedOp(), 60.0)
    assert work.cancel() is True
    assert isinstance(table.error, ftcomm.CommAborted)


def test_a_settler_that_fails_before_its_break_leaves_no_stale_cause(table: OpTable) -> None:
    """A bug below (here: peek() raises) takes the settler out between its
    claim and its break: the cause it named is dropped, so a later break of
    the table is not named after an op that never broke it."""

    class Broken(ScriptedOp):
        def abandon(self) -> bool:
            return True

        def peek(self) -> bool:
            raise RuntimeError("a bug in a backend's peek()")

    work = issue(table, Broken(), 60.0)
    with pytest.raises(RuntimeError, match="peek"):
        work.cancel()
    assert table.stopping is None
    table.break_(ftcomm.CommFailed("a peer died"))
    assert isinstance(table.error, ftcomm.CommFailed)
