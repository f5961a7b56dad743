"""Fusing small allreduces (``Group(fuse=True)``, ``group.batch()``): where a
batch is cut, what each member keeps, and that every rank cuts alike.

The cut rules are checked on the dummy backend (world size 1), whose native
calls are recorded; sums, failures and the determinism drill run on real
Gloo worlds.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ScriptedOp, StoreServer, add_callback_off_loop, spy_allreduces
from torch.distributed import ReduceOp

import ftcomm
from ftcomm import CommAborted, CommFailed, CommTimeout
from ftcomm._runtime import faults
from ftcomm._runtime.table import AbandonAbort
from ftcomm.backends import dummy
from ftcomm.testing import Fault, FaultPlan, RankContext, inspect, run_world

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, list[int]]]]:
    """Every native call of the dummy backend: (op, numel of each tensor)."""
    seen: list[tuple[str, list[int]]] = []
    cls = dummy.DummyBackend

    def recording(name: str) -> Any:
        real = getattr(cls, name)

        def call(self: Any, *args: Any) -> Any:
            first = args[0]
            sizes = [t.numel() for t in first] if isinstance(first, list) else []
            seen.append((name, sizes))
            return real(self, *args)

        return call

    for name in ("allreduce", "broadcast", "barrier"):
        monkeypatch.setattr(cls, name, recording(name))
    return seen


async def _dummy(store: StoreServer, **kwargs: Any) -> ftcomm.Group:
    g = ftcomm.Group("dummy", timeout=10.0, **kwargs)
    await g.configure(f"127.0.0.1:{store.port}/fuse", 0, 1)
    return g


# -- where a batch is cut --------------------------------------------------------------
@pytest.mark.asyncio
async def test_ops_issued_together_go_as_one_op_when_one_is_awaited(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    async with await _dummy(store, fuse=True) as g:
        ts = [torch.ones(3) for _ in range(5)]
        works = [g.allreduce(t) for t in ts]
        # The first goes at once, on its own; the rest wait for a look
        assert calls == [("allreduce", [3])]
        assert await works[2] is ts[2]
        assert calls == [("allreduce", [3]), ("allreduce", [12])]
        for w, t in zip(works, ts, strict=True):
            assert w.done()
            assert await w is t
        assert g.stats().ops["allreduce"].count == 5  # each op is counted as itself


@pytest.mark.asyncio
@pytest.mark.parametrize("shape", [(3,), (2, 2)])  # the copy back's two ways
async def test_inference_tensors_fuse_as_they_go_alone(
    store: StoreServer,
    calls: list[tuple[str, list[int]]],
    shape: tuple[int, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorded = dummy.DummyBackend.allreduce

    def as_two_equal_ranks(self: Any, tensors: list[torch.Tensor], *args: Any) -> Any:
        with torch.inference_mode():  # a native op writes in place, as c10d does
            for t in tensors:
                t.mul_(2)  # the sum over two ranks holding the same values
        return recorded(self, tensors, *args)

    monkeypatch.setattr(dummy.DummyBackend, "allreduce", as_two_equal_ranks)
    async with await _dummy(store, fuse=True) as g:
        with torch.inference_mode():  # an eval loop's metrics
            ts = [torch.full(shape, float(i)) for i in range(4)]
        model = torch.nn.Parameter(torch.ones(shape))  # and a parameter, in the same batch
        got = await asyncio.gather(*[g.allreduce(t) for t in [*ts, model]])
        assert [x is t for x, t in zip(got, [*ts, model], strict=True)] == [True] * 5
        assert len(calls) == 2  # the first alone, the others fused
        assert g.errored() is None
        # written: the lone op in place, the batch's members by the copy back
        assert [float(t.flatten()[0]) for t in ts] == [0.0, 2.0, 4.0, 6.0]
        assert torch.equal(model.detach(), torch.full(shape, 2.0))
        assert model.requires_grad  # written as c10d writes it
        assert model.grad_fn is None
        model.sum().backward()  # and still a leaf autograd can use
        assert model.grad is not None


@pytest.mark.asyncio
async def test_a_look_at_a_lone_op_while_this_thread_issues_does_not_deadlock(
    store: StoreServer,
) -> None:
    """A look may come from a callback that runs while its thread holds the
    issue lock (a verified op's break ends ops and calls their callbacks);
    the look's cut point is made without that lock."""
    async with await _dummy(store, fuse=True) as g:
        lone = g.allreduce(torch.ones(1))  # goes on its own: its first look is a cut
        cfg = inspect(g).config
        assert cfg is not None
        assert cfg.fuse_alone is False  # the next one would join a batch
        seen: list[bool] = []

        def callback_under_the_issue_lock() -> None:
            with g._issuer._lock:
                seen.append(lone.done())

        thread = threading.Thread(target=callback_under_the_issue_lock, daemon=True)
        thread.start()
        thread.join(5.0)
        assert not thread.is_alive(), "a look under the issue lock deadlocked"
        assert seen == [True]
        assert cfg.fuse_alone is True


@pytest.mark.asyncio
async def test_each_cut_point_sends_the_batch(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    async with await _dummy(store, fuse=True, fuse_bytes=1024) as g, g.batch():
        # in a batch() block: no op goes on its own, every cut shows
        f32 = [torch.ones(2) for _ in range(4)]
        g.allreduce(f32[0])
        g.allreduce(f32[1])
        g.broadcast(torch.ones(2))  # an op that cannot join: the batch goes first
        g.allreduce(f32[2])
        g.allreduce(torch.ones(2, dtype=torch.float64))  # another dtype
        g.allreduce(f32[3], ReduceOp.MAX)  # another reduce op
        g.allreduce(torch.ones(64))  # 256 bytes > 1024/16: never fused
        g.allreduce(torch.ones(4))
        g.flush()
        g.flush()  # nothing open: a no-op
        w = g.allreduce(torch.ones(1))
        assert w.done()  # done() looks at it
        g.allreduce(torch.ones(1))
        g.barrier()
        assert calls == [
            ("allreduce", [4]),
            ("broadcast", []),
            ("allreduce", [2]),
            ("allreduce", [2]),
            ("allreduce", [2]),
            ("allreduce", [64]),
            ("allreduce", [4]),
            ("allreduce", [1]),
            ("allreduce", [1]),
            ("barrier", []),
        ]


@pytest.mark.asyncio
async def test_a_full_batch_is_sent_at_its_cap(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    g = await _dummy(store, fuse=True, fuse_bytes=256)  # ops of <= 16 bytes
    async with g, g.batch():
        works = [g.allreduce(torch.ones(4)) for _ in range(40)]  # 16 bytes each
        assert calls == [("allreduce", [64])] * 2  # 16 ops, 256 bytes: sent as it fills
        await asyncio.gather(*works)
        assert calls == [("allreduce", [64])] * 2 + [("allreduce", [32])]


@pytest.mark.asyncio
async def test_a_batch_block_fuses_on_a_group_without_fuse(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    async with await _dummy(store) as g:
        g.allreduce(torch.ones(1))  # fuse=False: on the wire at once
        async with g.batch() as block:
            assert block.group is g  # a public attribute of ftcomm.BatchScope
            works = [g.allreduce(torch.ones(2)) for _ in range(3)]
            assert calls == [("allreduce", [1])]
        assert calls == [("allreduce", [1]), ("allreduce", [6])]  # the block's end sent it
        await asyncio.gather(*works)
        with g.batch():  # from a thread too
            g.allreduce(torch.ones(1))
            g.allreduce(torch.ones(1))
        assert calls[-1] == ("allreduce", [2])
        g.allreduce(torch.ones(1))
        assert calls[-1] == ("allreduce", [1])  # outside the block: unfused again


@pytest.mark.asyncio
async def test_a_batch_block_applies_to_its_own_task_only(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    async with await _dummy(store) as g:
        inside = asyncio.Event()
        done = asyncio.Event()

        async def other() -> None:
            await inside.wait()
            g.allreduce(torch.ones(5))  # not in a block: cuts the batch, goes alone
            done.set()

        task = asyncio.ensure_future(other())
        async with g.batch():
            g.allreduce(torch.ones(1))
            inside.set()
            await done.wait()
            g.allreduce(torch.ones(1))
        await task
        assert calls == [("allreduce", [1]), ("allreduce", [5]), ("allreduce", [1])]


def test_a_thread_waiting_on_an_op_sends_its_batch(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    async def main() -> None:
        async with await _dummy(store, fuse=True) as g:
            works = [g.allreduce(torch.ones(1)) for _ in range(3)]  # one alone, two wait
            called: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            works[1].add_done_callback(called.set_result)  # a callback looks at it too
            assert calls == [("allreduce", [1]), ("allreduce", [2])]
            assert await called is works[1]  # on this loop, as asyncio's futures do
            more = [g.allreduce(torch.ones(1)) for _ in range(3)]  # after a cut: the same
            result: list[object] = []
            thread = threading.Thread(target=lambda: result.append(more[2].wait(5.0)))
            thread.start()
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
            assert calls[-2:] == [("allreduce", [1]), ("allreduce", [2])]
            assert result[0] is more_tensors(more)[2]

    def more_tensors(works: list[ftcomm.Work[torch.Tensor]]) -> list[torch.Tensor]:
        return [w._result for w in works]

    asyncio.run(main())


@pytest.mark.asyncio
async def test_the_first_look_at_a_lone_op_is_a_cut_even_once_it_ended(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    """stats() (any thread, any time) may end an op nobody looked at yet; the
    program's first look at it must still be a cut point, or whether the
    next op goes alone would depend on when stats() ran."""
    async with await _dummy(store, fuse=True) as g:
        a = g.allreduce(torch.ones(1))  # goes alone
        g.stats()  # finds it ended, and ends it
        assert not a._table.inflight
        await a  # the first look: a cut point all the same
        g.allreduce(torch.ones(2))  # so this one goes alone too
        assert calls == [("allreduce", [1]), ("allreduce", [2])]


@pytest.mark.parametrize("bad", [0, 15, -1])
def test_fuse_arguments_are_checked(bad: int) -> None:
    with pytest.raises(ValueError, match="fuse_bytes"):
        ftcomm.Group("dummy", fuse_bytes=bad)
    with pytest.raises(TypeError, match="fuse"):
        ftcomm.Group("dummy", fuse=1)  # type: ignore[arg-type]


# -- what each member keeps --------------------------------------------------------------
@pytest.mark.asyncio
async def test_an_unsent_op_past_its_deadline_times_out_and_aborts_its_batch(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    async with await _dummy(store, fuse=True) as g:
        failed = asyncio.Event()
        loop = asyncio.get_running_loop()
        sub = g.subscribe(
            lambda e: loop.call_soon_threadsafe(failed.set) if e.kind == "aborted" else None
        )
        g.allreduce(torch.ones(1))  # goes on its own; the next two wait in a batch
        ts = [torch.full((2,), 7.0) for _ in range(2)]
        late = g.allreduce(ts[0], timeout=0.2)  # issued, never looked at before its deadline
        other = g.allreduce(ts[1], timeout=30)
        await asyncio.wait_for(failed.wait(), 5.0)
        sub.close()
        with pytest.raises(CommTimeout) as timeout:
            await late
        assert timeout.value.seq == late.seq
        with pytest.raises(CommAborted):
            await other
        assert isinstance(g.errored(), CommTimeout)
        assert calls == [("allreduce", [1])]  # the batch was never sent
        assert all(torch.equal(t, torch.full((2,), 7.0)) for t in ts)


@pytest.mark.asyncio
async def test_abort_ends_the_open_batch_and_leaves_its_tensors(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    async with await _dummy(store, fuse=True) as g:
        ts = [torch.full((2,), 3.0) for _ in range(3)]
        works = [g.allreduce(t) for t in ts]  # the first on its own (and done), two wait
        await g.abort()
        assert await works[0] is ts[0]
        for w in works[1:]:
            with pytest.raises(CommAborted):
                await w
        assert calls == [("allreduce", [2])]
        assert all(torch.equal(t, torch.full((2,), 3.0)) for t in ts[1:])
        with pytest.raises(CommAborted):
            g.allreduce(torch.ones(1))
        await g.configure(f"127.0.0.1:{store.port}/fuse2", 0, 1)  # a fresh batch after it
        assert torch.equal(await g.allreduce(torch.ones(2)), torch.ones(2))


@pytest.mark.asyncio
async def test_cancelling_one_member_aborts_the_group(store: StoreServer) -> None:
    async with await _dummy(store, fuse=True) as g:
        old = faults.set_injector(lambda op, issue, backend: _Never())
        try:  # the batch's native op never ends
            works = [g.allreduce(torch.ones(1)) for _ in range(3)]
            tasks = [asyncio.create_task(w) for w in works]
            await asyncio.sleep(0)  # every task awaits (one polls, the others sleep)
        finally:
            faults.set_injector(old)
        tasks[1].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[1], asyncio.CancelledError)
        assert all(isinstance(r, CommAborted) for r in (results[0], results[2]))
        assert isinstance(g.errored(), CommAborted)


@pytest.mark.asyncio
async def test_cancelling_an_unsent_member_drops_its_batch(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    """cancel() is not a look: a member waiting in an open batch is aborted
    with its batch-mates, and the batch never goes on the wire (a peer
    could otherwise complete an op this rank reports aborted)."""
    async with await _dummy(store, fuse=True) as g:
        g.allreduce(torch.ones(1))  # goes on its own
        ts = [torch.ones(2) for _ in range(3)]
        works = [g.allreduce(t) for t in ts]
        assert works[1].cancel() is True
        assert calls == [("allreduce", [1])]  # the lone op only
        assert works[1].cancelled()
        for w in works:
            assert type(w.exception()) is CommAborted
        assert isinstance(g.errored(), CommAborted)
        assert calls == [("allreduce", [1])]
        assert all(torch.equal(t, torch.ones(2)) for t in ts)


@pytest.mark.asyncio
async def test_a_task_of_an_unsent_member_cancelled_before_it_ran_drops_its_batch(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    async with await _dummy(store, fuse=True) as g:
        g.allreduce(torch.ones(1))  # goes on its own
        works = [g.allreduce(torch.ones(2)) for _ in range(3)]
        task = asyncio.create_task(works[1])
        task.cancel()  # before its first step: the await never looked
        with pytest.raises(asyncio.CancelledError):
            await task
        assert calls == [("allreduce", [1])]
        assert [type(w.exception()) for w in works] == [CommAborted] * 3
        assert calls == [("allreduce", [1])]


def _sent_batch(g: ftcomm.Group, native: object) -> tuple[Any, list[Any]]:
    """A lone first op, then a batch of three sent as ``native``: (lone, batch)."""
    lone = g.allreduce(torch.ones(1))  # goes on its own
    works = [g.allreduce(torch.ones(1), timeout=30) for _ in range(3)]
    old = faults.set_injector(lambda op, issue, backend: native)
    try:
        g.flush()
    finally:
        faults.set_injector(old)
    return lone, works


@pytest.mark.asyncio
async def test_a_batch_that_fails_at_its_deadline_is_the_earliest_members_timeout(
    store: StoreServer,
) -> None:
    """The batch's native op has the earliest deadline of its members. If it
    fails at that deadline (Gloo's own timeout, before the sweeper fires),
    that member ends with CommTimeout and breaks the group with it; the
    others, whose deadlines have not passed, end with CommAborted naming it.
    Forced: the deadlines are moved into the past after the issue, so the
    sweeper (armed for 30 s) cannot end any op first."""
    async with await _dummy(store, fuse=True) as g:
        native = ScriptedOp()
        _, works = _sent_batch(g, native)
        batch = works[1]._native.batch  # type: ignore[union-attr]
        now = time.monotonic()
        works[1].deadline = batch.deadline = now - 0.001  # the earliest: its time is up
        native.finish(RuntimeError("Timed out waiting 30000ms for recv operation to complete"))
        with pytest.raises(CommTimeout) as timed_out:
            await works[1]
        assert timed_out.value.seq == works[1].seq
        for w in (works[0], works[2]):
            with pytest.raises(CommAborted, match=f"deadline of allreduce seq={works[1].seq}"):
                await w
        assert isinstance(g.errored(), CommTimeout)


class _Unstoppable(ScriptedOp):
    """A sent batch's native op that never ends and cannot be stopped."""

    def abandon(self) -> bool:
        return False


@pytest.mark.asyncio
async def test_a_failed_member_wakes_the_awaits_asleep_on_its_batch(store: StoreServer) -> None:
    """Two awaits of one sent batch: the first polls it, the second sleeps
    until the batch is over. The group breaks while the native op never
    ends: each member's failure (its end, published with an error) must
    wake the sleeper, or it would sleep until the native op's own timeout."""
    async with await _dummy(store, fuse=True) as g:
        native = _Unstoppable()
        _, works = _sent_batch(g, native)
        tasks = [asyncio.ensure_future(_outcome(w)) for w in works[:2]]
        for _ in range(3):  # both awaits are in: one polls, one sleeps
            await asyncio.sleep(0)
        assert not any(t.done() for t in tasks)
        g.abort()
        _, pending = await asyncio.wait(tasks, timeout=5)
        assert not pending, "an await asleep on the batch was never woken"
        assert [t.result() for t in tasks] == ["CommAborted", "CommAborted"]


async def _outcome(work: Any) -> str:
    try:
        await work
    except ftcomm.CommError as exc:
        return type(exc).__name__
    return "success"


@pytest.mark.asyncio
async def test_an_ended_member_lets_its_sent_batch_go(store: StoreServer) -> None:
    """A member ended without a look (the group broke) keeps no reference to
    its batch (and so to the batch's tensors and native op); an op that went
    alone keeps its mark: its first look is still a cut point."""
    async with await _dummy(store, fuse=True) as g:
        lone, works = _sent_batch(g, _Unstoppable())
        assert all(w._batch is not None for w in works)
        g.abort()
        assert all(w._end is not None for w in works)
        assert [w._batch for w in works] == [None, None, None]
        assert lone._batch is not None


class _FailsWhenStopped(ScriptedOp):
    """Stopping it fails it at once, on the stopper's thread (a Gloo op whose
    sockets were shut, seen by Gloo before the stopper breaks the group)."""

    def abandon(self) -> bool:
        self.finish(RuntimeError("Connection closed by peer"))
        return False


@pytest.mark.asyncio
@pytest.mark.one_loop
async def test_a_batch_refused_by_another_ops_stop_leaves_the_break_to_that_op() -> None:
    # An accelerator communicator aborted for one op's deadline refuses the
    # batch sent meanwhile with an AbandonAbort: the members fail with a plain
    # CommAborted naming the stop, and the group is left to that op's settler
    # to break (with its deadline), not broken by the refusal.
    g = ftcomm.Group("dummy", fuse=True, timeout=30)
    try:
        await g.configure("127.0.0.1:1/refused-by-a-stop", 0, 1)
        backend: Any = inspect(g).backend
        alone = g.allreduce(torch.ones(1))  # the first fusible op goes on its own
        a, b = g.allreduce(torch.ones(1)), g.allreduce(torch.ones(1))  # a batch
        cause = RuntimeError("the stop's own words")

        def refuse(*args: Any) -> Any:
            stop = AbandonAbort("the NCCL group was aborted")
            stop.__cause__ = cause
            raise stop

        backend.allreduce = refuse
        g.flush()
        assert torch.equal(await alone, torch.ones(1))
        for work in (a, b):
            with pytest.raises(CommAborted, match="the NCCL group was aborted") as info:
                await work
            assert type(info.value) is CommAborted
            assert info.value.__cause__ is cause
            assert (info.value.op, info.value.seq) == ("allreduce", work.seq)
        assert g.errored() is None
    finally:
        await g.shutdown()


@pytest.mark.asyncio
async def test_batch_mates_failed_by_a_members_stop_name_its_cause(store: StoreServer) -> None:
    """Cancelling one member stops the batch's native op; its batch-mates,
    whose callbacks run as it fails (before the canceller breaks the group),
    end with CommAborted naming the cancel, as the group's error does."""
    async with await _dummy(store, fuse=True) as g:
        g.allreduce(torch.ones(1))  # goes on its own
        works = [g.allreduce(torch.ones(1)) for _ in range(3)]
        native = _FailsWhenStopped()
        seen: list[BaseException | None] = []
        old = faults.set_injector(lambda op, issue, backend: native)
        try:  # the first callback is a look: it sends the batch
            for w in works:  # on the thread that ends them
                add_callback_off_loop(w, lambda w: seen.append(w.exception()))
        finally:
            faults.set_injector(old)
        assert works[1].cancel() is True
        assert len(seen) == 3
        errored = g.errored()
        assert isinstance(errored, CommAborted)
        assert "cancelled" in str(errored)
        for w in (works[0], works[2]):
            error = w.exception()
            assert type(error) is CommAborted
            assert "was cancelled with Work.cancel()" in str(error)  # the cause, named
            assert error.__cause__ is not None


class _Never:
    def poll(self) -> bool:
        return False

    def outcome(self) -> BaseException | None:
        return None

    def on_done(self, callback: object) -> None:
        pass


@pytest.mark.asyncio
async def test_a_batch_that_cannot_be_sent_fails_its_ops_not_the_look(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    """Any failure to send a batch (here: no room for it, an OSError) breaks
    the group, as the peers sent the op; its ops fail with CommFailed, each
    its own seq; the await that cut the batch raises its op's error, not
    the OSError."""
    async with await _dummy(store, fuse=True) as g:
        g.allreduce(torch.ones(1))  # goes on its own
        works = [g.allreduce(torch.ones(1)) for _ in range(3)]

        def no_room(op: str, issue: Any, backend: object) -> Any:
            raise OSError(28, "no room in /dev/shm")

        old = faults.set_injector(no_room)
        try:
            with pytest.raises(CommFailed, match="no room") as failed:
                await works[1]
        finally:
            faults.set_injector(old)
        assert failed.value.seq == works[1].seq
        for w in (works[0], works[2]):
            with pytest.raises(CommFailed) as other:
                await w
            assert other.value.seq == w.seq
        assert isinstance(g.errored(), CommFailed)
        g.flush()  # nothing open, a broken group: raises nothing


@pytest.mark.asyncio
async def test_the_error_of_a_refused_batch_keeps_none_of_its_tensors(store: StoreServer) -> None:
    """errored() keeps a refused batch's error until configure(): it must not
    keep the batch (its members' tensors, the flat buffer) through the
    frames of the refusal's traceback."""
    async with await _dummy(store, fuse=True) as g:
        g.allreduce(torch.ones(1))  # goes on its own
        ts = [torch.ones(4) for _ in range(3)]
        works = [g.allreduce(t) for t in ts]
        member = weakref.ref(ts[1])

        staged = {"tensors": ts}

        def stage(tensors: list[torch.Tensor]) -> None:  # a frame holding the tensors
            raise OSError(28, "no room in /dev/shm")

        def no_room(op: str, issue: Any, backend: object) -> Any:
            try:
                stage(staged["tensors"])
            except OSError as exc:  # as the subprocess backend says it: chained
                raise OSError(28, "no room for the batch") from exc

        old = faults.set_injector(no_room)
        try:
            g.flush()
        finally:
            faults.set_injector(old)
        errors = [w.exception() for w in works]  # no await: nothing else holds them
        assert [type(e) for e in errors] == [CommFailed] * 3
        del works, ts, errors
        staged.clear()
        gc.collect()
        assert isinstance(g.errored(), CommFailed)  # kept, with its causes
        assert member() is None


@pytest.mark.asyncio
async def test_a_failed_copy_back_keeps_no_native_op(store: StoreServer) -> None:
    """A copy back that fails (a member resized while its batch was in
    flight) fails the members with CommFailed; its error, kept by errored(),
    holds neither the batch's native op nor its tensors."""
    async with await _dummy(store, fuse=True) as g:
        g.allreduce(torch.ones(1))  # goes on its own
        ts = [torch.ones(4) for _ in range(3)]
        works = [g.allreduce(t) for t in ts]
        box = [ScriptedOp()]  # the batch's native op: the batch holds the only reference
        sent, member = weakref.ref(box[0]), weakref.ref(ts[0])
        old = faults.set_injector(lambda op, issue, backend: box.pop())
        try:
            g.flush()
        finally:
            faults.set_injector(old)
        ts[1].resize_(2)  # the caller resizes a member while it is in flight
        native = sent()
        assert native is not None
        native.finish()
        del native
        errors = [w.exception() for w in works]
        assert [type(e) for e in errors] == [CommFailed] * 3
        del works, ts, errors
        gc.collect()
        assert isinstance(g.errored(), CommFailed)
        assert sent() is None
        assert member() is None


@pytest.mark.asyncio
async def test_callbacks_armed_at_a_send_run_once_the_issue_lock_is_free(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    """Forced interleaving: a callback added to a member while its batch is
    being sent (here: from inside the native issue, under the group's issue
    lock) is armed after the lock is released; it may issue ops itself. Run
    on a thread, so that a regression fails (a deadlock) instead of hanging."""
    async with await _dummy(store, fuse=True) as g:
        g.allreduce(torch.ones(1))  # goes on its own
        works = [g.allreduce(torch.ones(1)) for _ in range(2)]
        from_callback: list[object] = []

        def callback(work: object) -> None:
            from_callback.append(g.allreduce(torch.ones(3)))  # takes the issue lock

        def inject(op: str, issue: Any, backend: object) -> Any:
            if not injected:  # the batch's send only, not the callback's own op
                injected.append(op)
                works[1].add_done_callback(callback)  # a look while the batch is being sent
            return issue()

        injected: list[str] = []

        old = faults.set_injector(inject)
        sent = threading.Event()
        try:
            looker = threading.Thread(target=lambda: (works[0].done(), sent.set()), daemon=True)
            looker.start()
            finished = await asyncio.get_running_loop().run_in_executor(None, sent.wait, 5.0)
        finally:
            faults.set_injector(old)
        assert finished, "the send deadlocked: a callback ran under the issue lock"
        assert len(from_callback) == 1
        assert calls[:2] == [("allreduce", [1]), ("allreduce", [2])]


@pytest.mark.asyncio
async def test_a_task_started_in_a_batch_block_is_out_of_it_once_it_ends(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    async with await _dummy(store) as g:
        go = asyncio.Event()

        async def later() -> None:
            await go.wait()
            g.allreduce(torch.ones(4))  # the block is over: on the wire at once

        async with g.batch():
            task = asyncio.ensure_future(later())  # copies the block's context
        go.set()
        await task
        assert calls == [("allreduce", [4])]


@pytest.mark.asyncio
async def test_wait_on_the_loop_thread_is_a_look_even_though_it_raises(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    async with await _dummy(store, fuse=True) as g:
        a = g.allreduce(torch.ones(1))  # goes alone; the dummy's op ends when looked at
        with pytest.raises(RuntimeError, match="would block"):
            a.wait()
        g.allreduce(torch.ones(2))  # after that look: alone too
        assert calls == [("allreduce", [1]), ("allreduce", [2])]


@pytest.mark.asyncio
async def test_abort_does_not_wait_for_the_issue_lock(store: StoreServer) -> None:
    """abort() acts at once from any thread: the ops it waits for are not
    looked at (a look takes the issue lock, which an issue may hold)."""
    g = await _dummy(store, fuse=True)
    g.allreduce(torch.ones(1))  # went alone, never looked at
    with g._issuer._lock:  # an issue in progress on another thread
        aborter = threading.Thread(target=g.abort, daemon=True)
        aborter.start()
        aborter.join(5.0)
        assert not aborter.is_alive(), "abort() waited for the issue lock"
    await g.shutdown()


class _Gate:
    """A native op that ends when the test says so."""

    def __init__(self) -> None:
        self.ended = False
        self.callbacks: list[Any] = []

    def poll(self) -> bool:
        return self.ended

    def outcome(self) -> BaseException | None:
        return None

    def on_done(self, callback: Any) -> None:
        if self.ended:
            callback(None)
        else:
            self.callbacks.append(callback)

    def open(self) -> None:
        self.ended = True
        for callback in self.callbacks:
            callback(None)


@pytest.mark.asyncio
async def test_when_the_polling_await_goes_a_sleeping_one_takes_over(
    store: StoreServer,
) -> None:
    """Forced interleaving: the await that polls a batch is closed (its
    generator, as a dropped coroutine is); another await asleep on the
    batch is woken and ends when the batch does."""
    async with await _dummy(store, fuse=True) as g:
        g.allreduce(torch.ones(1))  # goes alone
        works = [g.allreduce(torch.ones(1)) for _ in range(2)]
        gate = _Gate()
        old = faults.set_injector(lambda op, issue, backend: gate)
        try:
            poller = works[0].__await__()
            poller.send(None)  # sends the batch, polls it: not ended
        finally:
            faults.set_injector(old)
        sleeper = asyncio.create_task(works[1])
        await asyncio.sleep(0)  # it looks once, then sleeps on the batch
        assert not sleeper.done()
        poller.close()  # the polling await goes away
        await asyncio.sleep(0)
        gate.open()
        assert await asyncio.wait_for(sleeper, 5.0) is works[1]._result


# -- real worlds ---------------------------------------------------------------------------
_SHAPES: tuple[tuple[int, ...], ...] = ((), (2, 3), (4,))  # a scalar, a matrix, a vector


async def _sums(ctx: RankContext, n: int, subprocess: bool) -> dict[str, Any]:
    async with ftcomm.Group("gloo", fuse=True, timeout=20, subprocess=subprocess) as g:
        await g.configure(ctx.addr(), ctx.rank, ctx.world_size)
        ts = [torch.full(_SHAPES[i % 3], float(i + ctx.rank)) for i in range(n)]
        sent = _count_native(g)
        await asyncio.gather(*[g.allreduce(t) for t in ts])
        # one-dimensional members only (the copy back's other way)
        flat = [torch.full((1 + i % 3,), float(i + ctx.rank)) for i in range(n)]
        await asyncio.gather(*[g.allreduce(t) for t in flat])
        ints = [torch.tensor([i * 10 + ctx.rank]) for i in range(4)]
        maxed = await asyncio.gather(*[g.allreduce(t, ReduceOp.MAX) for t in ints])
        return {
            "ok": all(
                torch.equal(t, torch.full(_SHAPES[i % 3], float(2 * i + 1)))
                for i, t in enumerate(ts)
            )
            and all(
                torch.equal(t, torch.full((1 + i % 3,), float(2 * i + 1)))
                for i, t in enumerate(flat)
            ),
            "max": [int(t.item()) for t in maxed],
            "native": sent(),
        }


def _count_native(g: ftcomm.Group) -> Any:
    """Count the group's native allreduces (a lone plain op's short path,
    ``allreduce_sum``, included)."""
    calls = spy_allreduces(g)
    return lambda: len(calls)


def test_fused_sums_are_right_on_gloo() -> None:
    results = run_world(_sums, 2, mode="thread", args=(300, False), timeout=60)
    for r in results:
        assert r == {"ok": True, "max": [1, 11, 21, 31], "native": 6}  # 2 per gather


@pytest.mark.slow
def test_a_subprocess_group_sends_one_frame_per_batch() -> None:
    results = run_world(_sums, 2, args=(100, True), timeout=60)
    for r in results:
        assert r == {"ok": True, "max": [1, 11, 21, 31], "native": 6}  # 2 frames per gather


async def _failing_batch(ctx: RankContext) -> dict[str, Any]:
    async with ftcomm.Group("gloo", fuse=True, timeout=20) as g:
        await g.configure(ctx.addr(), ctx.rank, ctx.world_size)
        ts = [torch.full((2,), 5.0) for _ in range(4)]
        works = [g.allreduce(t) for t in ts]
        results = await asyncio.gather(*works, return_exceptions=True)
        return {
            "errors": [(type(e).__name__, getattr(e, "seq", None)) for e in results],
            "seqs": [w.seq for w in works],
            "untouched": all(torch.equal(t, torch.full((2,), 5.0)) for t in ts[1:]),
        }


def test_a_failed_batch_fails_every_member_with_its_own_seq() -> None:
    plan = FaultPlan.of(Fault.error(0, 1, "injected"))  # rank 0's batch (op 0 went alone)
    results = run_world(_failing_batch, 2, mode="thread", plan=plan, timeout=60)
    r = results[0]
    # the first went on its own, before; aborted by the batch's failure if
    # Gloo (two threads per group) had not finished it yet
    assert r["errors"][0] in {("Tensor", None), ("CommAborted", r["seqs"][0])}
    assert r["errors"][1:] == [("CommFailed", seq) for seq in r["seqs"][1:]]
    assert r["untouched"]  # no copy back: a failed member's tensor is not written


# -- the determinism drill -----------------------------------------------------------------
DRILL_SEEDS = int(os.environ.get("FTCOMM_FUSE_SEEDS", "100"))
_DTYPES = (torch.float32, torch.float64, torch.int64)


async def _drill(ctx: RankContext, seeds: range) -> dict[str, int]:
    """Each seed: the same random program on every rank (fusible allreduces of
    three dtypes and two reduce ops, ops that cannot join, awaits of random
    ops, gathers, flushes, batch blocks); every result is checked."""
    checked = issued = 0
    async with ftcomm.Group("gloo", fuse=True, fuse_bytes=4096, timeout=20) as g:
        await g.configure(ctx.addr(), ctx.rank, ctx.world_size)
        native = _count_native(g)
        ranks = range(ctx.world_size)
        for seed in seeds:
            rng = random.Random(seed)
            pending: list[tuple[ftcomm.Work[Any], torch.Tensor]] = []
            block: Any = None
            for step in range(rng.randint(10, 40)):
                pick = rng.random()
                base = (seed * 31 + step) % 50
                if pick < 0.5:  # a run of fusible ops of one key
                    dtype = rng.choice(_DTYPES)
                    op = rng.choice((ReduceOp.SUM, ReduceOp.MAX))
                    for k in range(rng.randint(1, 8)):
                        shape = (rng.randint(1, 4),)
                        t = torch.full(shape, base + k + ctx.rank, dtype=dtype)
                        vals = [base + k + r for r in ranks]
                        want = sum(vals) if op == ReduceOp.SUM else max(vals)
                        want_t = torch.full(shape, want, dtype=dtype)
                        pending.append((g.allreduce(t, op), want_t))
                        issued += 1
                elif pick < 0.6:  # cannot join
                    kind = rng.randrange(3)
                    if kind == 0:
                        t = torch.full((3,), float(base + ctx.rank))
                        root = rng.randrange(ctx.world_size)
                        want_t = torch.full((3,), float(base + root))
                        pending.append((g.broadcast(t, root), want_t))
                    elif kind == 1:
                        t = torch.full((100,), float(base + ctx.rank))  # > 4096/16 bytes
                        want_t = torch.full((100,), float(sum(base + r for r in ranks)))
                        pending.append((g.allreduce(t), want_t))
                    else:
                        await g.barrier()
                elif pick < 0.75 and pending:
                    work, want_t = pending.pop(rng.randrange(len(pending)))
                    got = await work
                    assert torch.equal(got, want_t), (seed, step, got, want_t)
                    checked += 1
                elif pick < 0.82 and pending:
                    k = rng.randint(1, len(pending))
                    chosen, pending = pending[:k], pending[k:]
                    gots = await asyncio.gather(*[w for w, _ in chosen])
                    for got, (_, want_t) in zip(gots, chosen, strict=True):
                        assert torch.equal(got, want_t), (seed, step)
                        checked += 1
                elif pick < 0.88:
                    g.flush()
                elif block is None:
                    block = g.batch()
                    await block.__aenter__()
                else:
                    await block.__aexit__(None, None, None)
                    block = None
            if block is not None:
                await block.__aexit__(None, None, None)
            for work, want_t in pending:
                got = await work
                assert torch.equal(got, want_t), (seed, "end")
                checked += 1
        return {"checked": checked, "fusible": issued, "native": native()}


@pytest.mark.slow
def test_every_rank_fuses_alike_under_delays() -> None:
    """3 ranks, the same seeded mix, rank-specific delays of native ops (which
    change timing, never order): every result right, no hang."""
    rng = random.Random(15)
    faults = [
        Fault.delay(rank, rng.randrange(DRILL_SEEDS * 12), rng.uniform(0.001, 0.02))
        for rank in range(3)
        for _ in range(max(3, DRILL_SEEDS // 10))
    ]
    plan = FaultPlan.of(*{(f.rank, f.op): f for f in faults}.values())
    results = run_world(_drill, 3, args=(range(DRILL_SEEDS),), plan=plan, timeout=240)
    assert results[0] == results[1] == results[2]  # the same ops, cut the same way
    assert results[0]["checked"] > DRILL_SEEDS * 5
    # fusion happened: far fewer native allreduces than fusible ones issued
    # (the count also holds the large, unfusible ones)
    assert results[0]["native"] < results[0]["fusible"] * 0.6, results[0]


@pytest.mark.slow
def test_the_fused_statistics_example_runs() -> None:
    """examples/fused_statistics.py: 200 concurrent one-float allreduces per
    step, unfused and fused; every sum is checked by both ranks."""
    drop = ("FTCOMM_DEBUG", "FTCOMM_STALL_MS")  # the suite's; a user runs it without
    env = {k: v for k, v in os.environ.items() if k not in drop}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "fused_statistics.py"), "--steps", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "was held" not in proc.stderr, proc.stderr[-3000:]  # no watchdog noise
    times = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(times) == {"unfused_ms", "fused_ms", "fused_ftcomm_gather_ms"}
    assert all(ms > 0 for ms in times.values())


@pytest.mark.parametrize("fuse", [False, True])
def test_the_facade_fuses_only_when_asked(store: StoreServer, fuse: bool) -> None:
    """c10d's one native op per call by default; ``fuse=True`` sends the
    allreduces issued before a wait as one (the first goes on its own)."""
    from ftcomm import c10d

    pg = c10d.ProcessGroupGloo(timeout=10, fuse=fuse)
    try:
        pg.configure(f"127.0.0.1:{store.port}/facade-fuse-{fuse}", "0", 0, 1)
        sent = _count_native(pg._ftcomm_group())
        ts = [torch.full((2,), float(i)) for i in range(5)]
        works = [pg.allreduce([t]) for t in ts]
        for w in works:
            assert w.wait()
        assert [t.tolist() for t in ts] == [[float(i)] * 2 for i in range(5)]
        assert sent() == (2 if fuse else 5)
    finally:
        pg.shutdown()


def test_the_facades_fuse_argument_is_checked() -> None:
    from ftcomm import c10d

    with pytest.raises(TypeError, match="fuse"):
        c10d.ProcessGroupGloo(fuse=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wrapped pg"):
        c10d.ProcessGroupWrapper(pg=c10d.ProcessGroupGloo(), fuse=True)


async def _params(ctx: RankContext) -> dict[str, Any]:
    """Parameters that require grad, written in place as c10d writes them."""
    async with ftcomm.Group("gloo", fuse=True, timeout=20) as g:
        await g.configure(ctx.addr(), ctx.rank, ctx.world_size)
        weight = torch.nn.Parameter(torch.full((2, 2), float(ctx.rank + 1)))
        bias = torch.nn.Parameter(torch.full((3,), float(ctx.rank + 1)))
        scale = torch.nn.Parameter(torch.tensor(float(ctx.rank + 1)))
        first = torch.nn.Parameter(torch.ones(1))  # goes on its own
        await asyncio.gather(
            *[g.allreduce(p.data if p is first else p) for p in (first, weight, bias, scale)]
        )
        return {
            "values": [weight.tolist(), bias.tolist(), scale.item()],
            "requires_grad": [p.requires_grad for p in (weight, bias, scale)],
            "errored": g.errored() is None,
        }


def test_parameters_that_require_grad_fuse_as_c10d_writes_them() -> None:
    """A batch of parameters (a matrix, a vector, a scalar) is written back
    outside autograd, as a native op writes: no in-place error on a leaf."""
    for r in run_world(_params, 2, mode="thread", timeout=60):
        assert r == {
            "values": [[[3.0, 3.0], [3.0, 3.0]], [3.0, 3.0, 3.0], 3.0],
            "requires_grad": [True, True, True],
            "errored": True,
        }


# -- ftcomm.gather ---------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_gather_awaits_issued_ops_in_order_without_a_task_each(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    async with await _dummy(store, fuse=True) as g:
        assert await ftcomm.gather() == []
        ts = [torch.full((2,), float(i)) for i in range(5)]
        loop = asyncio.get_running_loop()
        made: list[object] = []

        def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
            made.append(coro)
            return asyncio.Task(coro, loop=loop, **kwargs)

        loop.set_task_factory(counting)
        try:
            results = await ftcomm.gather(*[g.allreduce(t) for t in ts])
        finally:
            loop.set_task_factory(None)
        assert made == []  # no task per op
        assert len(results) == len(ts)
        assert all(r is t for r, t in zip(results, ts, strict=True))
        assert calls == [("allreduce", [2]), ("allreduce", [8])]  # alone, then the four as one


@pytest.mark.asyncio
async def test_gather_raises_the_first_error_once_every_op_ended(store: StoreServer) -> None:
    async with await _dummy(store, fuse=True) as g:
        native = ScriptedOp()
        done, works = _sent_batch(g, native)  # the lone first op succeeds
        native.finish(RuntimeError("Connection closed by peer"))
        results = await ftcomm.gather(done, *works, return_exceptions=True)
        assert torch.equal(results[0], torch.ones(1))
        assert [type(r) for r in results[1:]] == [CommFailed] * 3
        assert [r.seq for r in results[1:]] == [w.seq for w in works]
        with pytest.raises(CommFailed) as first:
            await ftcomm.gather(done, *works)
        assert first.value.seq == works[0].seq  # the first in argument order
        assert all(w.done() for w in works)


@pytest.mark.asyncio
async def test_the_error_gather_raises_keeps_none_of_the_other_results(store: StoreServer) -> None:
    """errored() keeps the raised error until configure(): the traceback it
    got from gather must not keep the ops that succeeded, nor their tensors."""
    async with await _dummy(store, fuse=True) as g:
        native = ScriptedOp()
        done, works = _sent_batch(g, native)  # the lone first op succeeds
        native.finish(RuntimeError("Connection closed by peer"))
        succeeded = weakref.ref(await done)
        with pytest.raises(CommFailed) as first:
            await ftcomm.gather(done, *works)
        error = first.value
        del done, works, first
        gc.collect()
        assert g.errored() is not None
        assert error.__traceback__ is not None  # raised, with this await's frames
        assert succeeded() is None


@pytest.mark.asyncio
async def test_a_gather_run_as_a_task_keeps_none_of_the_other_results(store: StoreServer) -> None:
    """As above, for a gather handed to asyncio.create_task (its docs say it
    may be): the task's steps pass through frames of their own."""
    async with await _dummy(store, fuse=True) as g:
        native = ScriptedOp()
        done, works = _sent_batch(g, native)  # the lone first op succeeds
        native.finish(RuntimeError("Connection closed by peer"))
        succeeded = weakref.ref(await done)
        task = asyncio.create_task(ftcomm.gather(done, *works))
        with pytest.raises(CommFailed):
            await task
        del done, works, task
        await asyncio.sleep(0)  # the loop lets go of the handle that woke us
        gc.collect()
        assert g.errored() is not None
        assert succeeded() is None


@pytest.mark.asyncio
async def test_gather_sends_every_batch_before_it_awaits_any(
    store: StoreServer, calls: list[tuple[str, list[int]]]
) -> None:
    """Its call looks at every op in argument order: the batches of two
    groups are both on the wire before the first op is awaited (awaiting
    each in turn would send the second group's only once the first's ended)."""
    async with await _dummy(store, fuse=True) as a:
        b = ftcomm.Group("dummy", timeout=10.0, fuse=True)
        await b.configure(f"127.0.0.1:{store.port}/fuse-b", 0, 1)
        async with b:
            ours = [a.allreduce(torch.ones(2)) for _ in range(3)]
            theirs = [b.allreduce(torch.ones(3)) for _ in range(3)]
            assert calls == [("allreduce", [2]), ("allreduce", [3])]  # the lone first ops
            gathering = ftcomm.gather(*ours, *theirs)
            assert calls[2:] == [("allreduce", [4]), ("allreduce", [6])]  # both batches, now
            results = await gathering
            assert [r.tolist() for r in results] == [[1.0] * 2] * 3 + [[1.0] * 3] * 3


@pytest.mark.parametrize("when", ["while it waits", "before it ran"])
@pytest.mark.asyncio
async def test_cancelling_gather_cancels_every_op_not_ended(store: StoreServer, when: str) -> None:
    async with await _dummy(store, fuse=True) as g:
        old = faults.set_injector(lambda op, issue, backend: _Never())
        try:  # no native op ever ends
            works = [g.allreduce(torch.ones(1)) for _ in range(3)]
            task = asyncio.ensure_future(ftcomm.gather(*works))
            if when == "while it waits":
                await asyncio.sleep(0)
        finally:
            faults.set_injector(old)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(w.done() for w in works)
        for w in works:
            assert isinstance(w.exception(), CommAborted)
        assert isinstance(g.errored(), CommAborted)


@pytest.mark.asyncio
async def test_gather_takes_works_only(store: StoreServer) -> None:
    async with await _dummy(store) as g:
        work = g.allreduce(torch.ones(1))
        coro = asyncio.sleep(0)
        with pytest.raises(TypeError, match="argument 1 is a coroutine"):
            await ftcomm.gather(work, coro)  # type: ignore[arg-type]
        coro.close()
        await work
