"""The issuer's short path: the plain small allreduce, issued in one frame.

It must do exactly what the long path (the rest of ``Collectives.allreduce``
and ``Issuer.issue``) does for
such an op, and every other call must take the long path. The equivalence
and refusal tests run the same program with the short path on and off
(``Config.short_dtypes = None``: what a backend without one has) and compare
what the caller can see; the others check which path a call takes, and two
force the interleaving where another task changes the group's fusion state
between the short path's unlocked checks and its lock.
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from typing import Any

import pytest
import torch
from helpers import spy_allreduces
from torch.distributed import ReduceOp

import ftcomm
from ftcomm import CommAborted
from ftcomm._collectives import Collectives
from ftcomm._runtime import faults
from ftcomm._runtime.table import AbandonAbort
from ftcomm.testing import Fault, FaultPlan, RankContext, inspect, run_world


def _long_only(g: ftcomm.Group) -> None:
    inspect(g).config.short_dtypes = None  # type: ignore[union-attr]


def _normal(calls: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [("allreduce", n) for _, n in calls]


# -- which calls take it ----------------------------------------------------------------
async def _routes(ctx: RankContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with ftcomm.Group("gloo", timeout=20) as g:
        await g.configure(ctx.addr("g"), ctx.rank, ctx.world_size)
        calls = spy_allreduces(g)
        x = float(ctx.rank + 1)  # sums to 3.0 on 2 ranks

        async def route(name: str, fn: Any) -> None:
            del calls[:]
            out[name] = (await fn(), list(calls))

        def plain() -> Any:
            return g.allreduce(torch.full((3,), x))

        def param() -> Any:
            return g.allreduce(torch.nn.Parameter(torch.full((3,), x), requires_grad=False))

        await route("plain", plain)
        await route("max", lambda: g.allreduce(torch.full((3,), x), ReduceOp.MAX))
        await route("str op", lambda: g.allreduce(torch.full((3,), x), "sum"))
        await route("timeout", lambda: g.allreduce(torch.full((3,), x), timeout=15))
        await route("subclass", param)
        await route("int64", lambda: g.allreduce(torch.full((3,), int(x))))

        async def in_block() -> Any:
            async with g.batch():
                work = g.allreduce(torch.full((3,), x))
            return await work

        await route("batch block", in_block)
        # bad input: the long path's error, the group untouched
        for name, bad in {
            "non-contiguous": torch.full((3, 2), x).t(),
            "conj view": torch.full((3,), complex(x, 1.0)).conj(),
            "neg view": torch._neg_view(torch.full((3,), x)),
            "int16": torch.full((3,), 1, dtype=torch.int16),
            "nested": _nested(x),
            "not a tensor": [x],
        }.items():
            del calls[:]
            try:
                g.allreduce(bad)  # type: ignore[arg-type]
            except (TypeError, ValueError) as exc:
                out[name] = (type(exc).__name__, str(exc), list(calls))
        await route("after", plain)
        out["errored"] = g.errored()
    return out


def _nested(x: float) -> torch.Tensor:
    """A nested tensor of the strided layout (torch warns it is a prototype)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.full((2,), x)])


def _values(result: Any) -> list[float]:
    return [float(v) for v in result.detach().flatten()]


def test_only_the_plain_op_takes_the_short_path() -> None:
    for r in run_world(_routes, 2, mode="thread", timeout=60):
        assert _values(r["plain"][0]) == [3.0] * 3
        assert r["plain"][1] == [("sum", 3)]
        assert r["subclass"][1] == [("allreduce", 3)]  # check_tensor's own rules
        for name in ("max", "str op", "timeout", "batch block"):
            assert r[name][1] == [("allreduce", 3)], name
        assert _values(r["max"][0]) == [2.0] * 3
        assert _values(r["int64"][0]) == [3.0] * 3
        assert r["int64"][1] == [("sum", 3)]
        assert r["non-contiguous"][:2] == (
            "ValueError",
            "tensor must be contiguous (call .contiguous() first)",
        )
        assert r["conj view"][0] == "ValueError"
        assert "conjugate" in r["conj view"][1]
        assert r["neg view"][0] == "ValueError"
        assert "negative" in r["neg view"][1]
        assert r["int16"][:2] == (
            "ValueError",
            "tensor has dtype torch.int16, which this backend cannot send "
            + "(bfloat16, bool, complex128, complex64, float16, float32, float64, "
            + "int32, int64, int8, uint8)",
        )
        assert r["nested"][0] == "ValueError"
        assert "dense (strided)" in r["nested"][1]
        assert r["not a tensor"][0] == "TypeError"
        for name in ("non-contiguous", "conj view", "neg view", "int16", "nested", "not a tensor"):
            assert r[name][2] == [], name  # nothing was sent
        assert r["after"][1] == [("sum", 3)]
        assert r["errored"] is None


async def _plain_op_calls(ctx: RankContext, verify: bool) -> tuple[list[tuple[str, int]], float]:
    async with ftcomm.Group("gloo", timeout=20, verify=verify) as g:
        await g.configure(ctx.addr("v"), ctx.rank, ctx.world_size)
        calls = spy_allreduces(g)
        t = await g.allreduce(torch.full((2,), float(ctx.rank + 1)))
        return [c for c in calls if c[1] == 2], float(t[0])


def test_verify_takes_the_long_path() -> None:
    """No plan: the fault seam is off, so only ``verify=True`` decides."""
    for calls, value in run_world(_plain_op_calls, 2, mode="thread", args=(True,), timeout=60):
        assert calls == [("allreduce", 2)]  # behind its descriptor check
        assert value == 3.0


def test_the_short_path_goes_through_the_fault_seam() -> None:
    """A test's injector sees the short path's ops as it sees the long
    path's (so fault drills, test_fuse's determinism drill among them, run
    the short path too), and decides how they are issued."""
    seen: list[str] = []

    def injector(op: str, issue: Any, backend: object) -> Any:
        seen.append(op)
        return issue()

    old = faults.set_injector(injector)
    try:
        results = run_world(_plain_op_calls, 2, mode="thread", args=(False,), timeout=60)
    finally:
        faults.set_injector(old)
    for calls, value in results:
        assert calls == [("sum", 2)]
        assert value == 3.0
    assert seen.count("allreduce") == 2  # one per rank


async def _delayed(ctx: RankContext) -> list[float]:
    async with ftcomm.Group("gloo", timeout=20) as g:
        await g.configure(ctx.addr("d"), ctx.rank, ctx.world_size)
        calls = spy_allreduces(g)
        t = await g.allreduce(torch.full((2,), float(ctx.rank + 1)))
        assert calls == [("sum", 2)]
        return _values(t)


def test_a_fault_plan_hurts_a_short_path_op() -> None:
    """A plan's fault lands on the short path's op: a 0.5 s delay on rank 0's
    first op shows in rank 1's wait for it."""
    plan = FaultPlan.of(Fault.delay(0, 0, 0.5))
    started = time.monotonic()
    results = run_world(_delayed, 2, mode="thread", plan=plan, timeout=60)
    assert results == [[3.0, 3.0], [3.0, 3.0]]
    assert time.monotonic() - started >= 0.5


# -- the same outcome either way --------------------------------------------------------
async def _program(ctx: RankContext, short: bool, fuse: bool) -> dict[str, Any]:
    """Plain ops, one-by-one and concurrent, awaited, waited on and
    gathered; with ``fuse``, lone ops, batches and an op too big to fuse."""
    events: list[tuple[str, str, int | None]] = []
    loop = asyncio.get_running_loop()
    all_events = asyncio.Event()
    n_ops = 14
    op_kinds = ("issued", "ended", "failed")

    def on_event(e: ftcomm.Event) -> None:
        if e.kind in op_kinds:
            events.append((e.kind, e.op, e.seq))
            if len(events) == 2 * n_ops:
                loop.call_soon_threadsafe(all_events.set)

    async with ftcomm.Group("gloo", timeout=20, fuse=fuse, fuse_bytes=4096) as g:
        await g.configure(ctx.addr(f"p{short}{fuse}"), ctx.rank, ctx.world_size)
        if not short:
            _long_only(g)
        calls = spy_allreduces(g)
        sub = g.subscribe(on_event)
        x = float(ctx.rank + 1)
        works: list[ftcomm.Work[torch.Tensor]] = []
        marks: list[str] = []  # each op's batch mark as issued, before any look

        def issue(t: torch.Tensor) -> ftcomm.Work[torch.Tensor]:
            w = g.allreduce(t)
            works.append(w)
            marks.append(type(w._batch).__name__)
            return w

        results = [await issue(torch.full((2,), x + i)) for i in range(4)]  # one by one
        burst = [issue(torch.full((1,), x * i)) for i in range(5)]
        results += await asyncio.gather(*burst)
        lone = issue(torch.full((1,), x))
        big = issue(torch.full((2048,), x))  # 8 KiB: past fuse_bytes, a cut point
        small = issue(torch.full((1,), x))  # the first fusible op after it: alone
        results += [await big, await small, await lone]
        big = issue(torch.full((2048,), x))
        small = issue(torch.full((3,), x))
        results += [await big, await asyncio.to_thread(small.wait, 10)]
        assert len(works) == n_ops
        stats = g.stats()
        sub.close()
    await asyncio.wait_for(all_events.wait(), 10)
    return {
        "results": [_values(r)[:4] for r in results],
        "ops": [(w.op, w.seq) for w in works],
        "marks": marks,
        "native": _normal(calls),
        "short calls": sum(c[0] == "sum" for c in calls),
        # (not untimed: whether an end was seen as it happened is timing)
        "counts": {k: (s.count, dict(s.failed)) for k, s in stats.ops.items()},
        "in_flight": stats.in_flight,
        "events": sorted(events),
    }


async def _both(ctx: RankContext, fuse: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    return await _program(ctx, True, fuse), await _program(ctx, False, fuse)


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_the_short_path_does_what_the_long_path_does(fuse: bool) -> None:
    for short, long in run_world(_both, 2, mode="thread", args=(fuse,), timeout=60):
        # every op but the batch's members took the short path
        assert short["short calls"] == (10 if fuse else 14)
        assert long["short calls"] == 0
        del short["short calls"], long["short calls"]
        assert short == long
        assert short["results"][:4] == [[3.0 + 2 * i] * 2 for i in range(4)]
        assert short["results"][4:9] == [[3.0 * i] for i in range(5)]
        assert short["results"][9:14] == [[3.0] * 4, [3.0], [3.0], [3.0] * 4, [3.0] * 3]
        if fuse:
            # alone, the rest of the burst as one batch; after the gather's
            # looks, the lone op alone, then the big one (a cut point), and
            # the small one after it alone again; then big, small alone
            assert short["native"][4:] == [("allreduce", n) for n in (1, 4, 1, 2048, 1, 2048, 3)]
            assert short["marks"] == [
                *["AloneMark"] * 4,
                "AloneMark",
                *["Batch"] * 4,
                "AloneMark",
                "NoneType",
                "AloneMark",
                "NoneType",
                "AloneMark",
            ]
        else:
            assert short["marks"] == ["NoneType"] * 14


# -- refusals ---------------------------------------------------------------------------
async def _refused(ctx: RankContext, short: bool, by_abandon: bool) -> dict[str, Any]:
    async with ftcomm.Group("gloo", timeout=20) as g:
        await g.configure(ctx.addr(f"r{short}{by_abandon}"), ctx.rank, ctx.world_size)
        await g.allreduce(torch.ones(1))
        if not short:
            _long_only(g)
        backend: Any = inspect(g).backend  # type: ignore[union-attr]
        cause = RuntimeError("the stopped group's own words")

        def refuse(*args: Any) -> Any:
            exc: Exception = RuntimeError("Application timeout caused pair closure")
            if by_abandon:  # another op's abandon() stopped the group
                exc = AbandonAbort("the group was aborted")
                exc.__cause__ = cause
            raise exc

        backend.allreduce = backend.allreduce_sum = refuse
        with pytest.raises(ftcomm.CommError) as info:
            g.allreduce(torch.ones(1))
        err = info.value
        errored = g.errored()
        out = {
            "type": type(err).__name__,
            "message": str(err),
            "cause": type(err.__cause__).__name__,
            "errored": None if errored is None else type(errored).__name__,
        }
        if errored is not None:
            with pytest.raises(CommAborted, match="refused: the group is errored"):
                g.allreduce(torch.ones(1))
        return out


@pytest.mark.parametrize("by_abandon", [False, True], ids=["broken", "abandoned"])
def test_a_refused_issue_fails_alike_on_both_paths(by_abandon: bool) -> None:
    async def both(ctx: RankContext) -> tuple[Any, Any]:
        return await _refused(ctx, True, by_abandon), await _refused(ctx, False, by_abandon)

    for short, long in run_world(both, 1, mode="thread", timeout=60):
        assert short == long
        if by_abandon:
            # A stop by another op's abandon() leaves breaking the group to
            # that op; the refused op ends aborted, its cause the stop's own.
            assert short["type"] == "CommAborted"
            assert short["cause"] == "RuntimeError"
            assert short["errored"] is None
        else:
            assert short["type"] == "CommFailed"
            assert "could not be issued" in short["message"]
            assert short["errored"] == "CommFailed"


async def _errored(ctx: RankContext) -> str:
    async with ftcomm.Group("gloo", timeout=20) as g:
        await g.configure(ctx.addr("e"), ctx.rank, ctx.world_size)
        g.abort()
        with pytest.raises(CommAborted) as info:
            g.allreduce(torch.ones(1))
        return str(info.value)


def test_an_errored_group_refuses_a_plain_op() -> None:
    [message] = run_world(_errored, 1, mode="thread", timeout=60)
    assert "allreduce refused: the group is errored" in message


# -- a batch open in another task -------------------------------------------------------
async def _open_batch(ctx: RankContext) -> dict[str, Any]:
    async with ftcomm.Group("gloo", timeout=20) as g:
        await g.configure(ctx.addr("b"), ctx.rank, ctx.world_size)
        calls = spy_allreduces(g)
        x = float(ctx.rank + 1)
        entered, leave = asyncio.Event(), asyncio.Event()
        held: list[ftcomm.Work[torch.Tensor]] = []

        async def blocker() -> None:
            async with g.batch():
                held.extend(g.allreduce(torch.full((1,), x * i)) for i in range(3))
                entered.set()
                await leave.wait()

        task = asyncio.create_task(blocker())
        await entered.wait()
        assert calls == []  # the block's ops wait in its batch
        plain = await g.allreduce(torch.full((2,), x))  # outside the block: a cut point
        order = list(calls)
        leave.set()
        await task
        batched = await asyncio.gather(*held)
    return {"order": order, "plain": _values(plain), "batched": [_values(t) for t in batched]}


def test_a_plain_op_sends_a_batch_open_in_another_task_first() -> None:
    for r in run_world(_open_batch, 2, mode="thread", timeout=60):
        assert r["order"] == [("allreduce", 3), ("allreduce", 2)]  # the batch first
        assert r["plain"] == [3.0, 3.0]
        assert r["batched"] == [[0.0], [3.0], [6.0]]


# -- the options ------------------------------------------------------------------------
async def _timeouts(ctx: RankContext) -> list[float]:
    async with ftcomm.Group("gloo", timeout=20) as g:
        await g.configure(ctx.addr("t"), ctx.rank, ctx.world_size)
        backend: Any = inspect(g).backend  # type: ignore[union-attr]
        seen = []
        for seconds in (20.0, 7.0, 7.0, 20.0):
            g.set_timeout(seconds)
            await g.allreduce(torch.ones(1))
            seen.append(backend._sum_options[1].timeout.total_seconds())
        return seen


def test_the_short_path_follows_set_timeout() -> None:
    for seen in run_world(_timeouts, 2, mode="thread", timeout=60):
        assert seen == [20.0, 7.0, 7.0, 20.0]


def test_allreduce_is_written_once() -> None:
    # The short path is the issuer's; Group has one allreduce, Collectives'.
    assert ftcomm.Group.allreduce is Collectives.allreduce
    assert "CommFailed" in (ftcomm.Group.allreduce.__doc__ or "")


class _GateLock:
    """The group's issue lock, with a gate before the first acquire on one
    thread: that thread has passed the short path's checks and waits there
    while the test changes what the lock guards."""

    def __init__(self, real: Any, thread_name: str) -> None:
        self.real, self.thread_name = real, thread_name
        self.arrived, self.go = threading.Event(), threading.Event()
        self.gated = False

    def __enter__(self) -> None:
        if threading.current_thread().name == self.thread_name and not self.gated:
            self.gated = True
            self.arrived.set()
            assert self.go.wait(10)
        self.real.acquire()

    def __exit__(self, *exc: object) -> None:
        self.real.release()


async def _plain_op_at_the_gate(
    g: ftcomm.Group, tensor: torch.Tensor
) -> tuple[_GateLock, threading.Thread, list[ftcomm.Work[torch.Tensor]]]:
    """Start ``g.allreduce(tensor)`` on a thread; return once it has passed
    the short path's unlocked checks and waits at the issue lock's gate."""
    gate = _GateLock(g._issuer._lock, "plain-op")
    g._issuer._lock = gate  # type: ignore[assignment]
    box: list[ftcomm.Work[torch.Tensor]] = []
    thread = threading.Thread(target=lambda: box.append(g.allreduce(tensor)), name="plain-op")
    thread.start()
    assert await asyncio.to_thread(gate.arrived.wait, 10)
    return gate, thread, box


async def _batch_opened_meanwhile(ctx: RankContext) -> dict[str, Any]:
    async with ftcomm.Group("gloo", timeout=20) as g:
        await g.configure(ctx.addr("m"), ctx.rank, ctx.world_size)
        calls = spy_allreduces(g)
        plain = torch.full((2,), 5.0)
        gate, thread, box = await _plain_op_at_the_gate(g, plain)
        async with g.batch():  # a batch opens while the plain op waits for the lock
            held = g.allreduce(torch.full((1,), 7.0))
            assert calls == []
            gate.go.set()
            await asyncio.to_thread(thread.join, 10)
            order = list(calls)
        await held
        await box[0]
    return {"order": order, "plain": _values(plain), "held": _values(held.result())}


def test_a_batch_opened_while_a_plain_op_waits_for_the_lock_goes_first() -> None:
    """Forced interleaving: the plain op passed its checks with no batch
    open; under the lock it finds one and takes the long path, which sends
    the batch before it."""
    [r] = run_world(_batch_opened_meanwhile, 1, mode="thread", timeout=60)
    assert r == {"order": [("allreduce", 1), ("allreduce", 2)], "plain": [5.0, 5.0], "held": [7.0]}


async def _lone_op_meanwhile(ctx: RankContext) -> dict[str, Any]:
    async with ftcomm.Group("gloo", timeout=20, fuse=True) as g:
        await g.configure(ctx.addr("f"), ctx.rank, ctx.world_size)
        calls = spy_allreduces(g)
        late = torch.full((2,), 5.0)  # it sees fuse_alone set: a lone op, by its unlocked hint
        gate, thread, box = await _plain_op_at_the_gate(g, late)
        lone = g.allreduce(torch.full((1,), 7.0))  # meanwhile another op goes alone
        gate.go.set()
        await asyncio.to_thread(thread.join, 10)
        mark = type(box[0]._batch).__name__
        order = list(calls)
        await lone
        await box[0]
    return {"order": order, "mark": mark, "late": _values(late)}


def test_an_op_that_must_join_a_batch_is_not_sent_alone_on_a_stale_hint() -> None:
    """Forced interleaving: with fuse=True, a plain op passed its unlocked
    checks as the first fusible op since a cut point; another op went alone
    before it got the lock, so under the lock it joins a batch (sent at its
    await) instead of going alone."""
    [r] = run_world(_lone_op_meanwhile, 1, mode="thread", timeout=60)
    assert r == {"order": [("sum", 1)], "mark": "Batch", "late": [5.0, 5.0]}


async def _marks_and_deadlines(ctx: RankContext, short: bool) -> dict[str, Any]:
    async with ftcomm.Group("gloo", timeout=20, fuse=True, fuse_bytes=4096) as g:
        await g.configure(ctx.addr(f"k{short}"), ctx.rank, ctx.world_size)
        if not short:
            _long_only(g)
        assert g._issuer.fuse_op_bytes == 256
        marks, lefts = [], []
        for n in (64, 65, 64):  # 256 bytes: fusible; 260: not (a cut point)
            issued = time.monotonic()
            w = g.allreduce(torch.ones(n))
            marks.append(type(w._batch).__name__)
            lefts.append(w.deadline - issued)
            await w
        # the op's deadline: its issue plus the group's timeout
        return {"marks": marks, "deadlines": [20.0 <= left < 21.0 for left in lefts]}


def test_the_fusible_bound_and_the_deadline_are_the_long_paths() -> None:
    async def both(ctx: RankContext) -> tuple[Any, Any]:
        return await _marks_and_deadlines(ctx, True), await _marks_and_deadlines(ctx, False)

    [(short, long)] = run_world(both, 1, mode="thread", timeout=60)
    assert short == long
    assert short == {"marks": ["AloneMark", "NoneType", "AloneMark"], "deadlines": [True] * 3}
