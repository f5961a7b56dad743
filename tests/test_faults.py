"""Faults as data: plans, and each kind applied inside a real world."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch

import ftcomm
from ftcomm._runtime.native import DoneOp
from ftcomm.testing import Fault, FaultPlan, Kind, RankContext, run_world
from ftcomm.testing._faults import Injector

PINNED_SEED_7 = (
    "FaultPlan(seed=7): delay(rank 0, op 2 0.0412s), delay(rank 0, op 3 0.0296s), "
    "delay(rank 0, op 6 0.0215s), delay(rank 0, op 9 0.0287s), delay(rank 0, op 13 0.0297s), "
    "delay(rank 0, op 14 0.0118s), delay(rank 0, op 16 0.0215s), delay(rank 1, op 0 0.029s), "
    "delay(rank 1, op 1 0.0058s), kill(rank 1, op 6)"
)


def test_a_seeded_plan_replays_exactly() -> None:
    a = FaultPlan.random(1234, 3, 200, delay_rate=0.1, error_rate=0.05, kills=1)
    b = FaultPlan.random(1234, 3, 200, delay_rate=0.1, error_rate=0.05, kills=1)
    c = FaultPlan.random(1235, 3, 200, delay_rate=0.1, error_rate=0.05, kills=1)
    assert a == b
    assert str(a) == str(b)
    assert a != c
    assert str(a).startswith("FaultPlan(seed=1234): ")
    # Pinned: a change in how plans are drawn changes every seed's replay.
    assert str(FaultPlan.random(7, 2, 20, delay_rate=0.2, kills=1)) == PINNED_SEED_7
    kinds = {f.kind for f in a.faults}
    assert kinds == {Kind.DELAY, Kind.ERROR, Kind.KILL}
    assert a.ranks_that(Kind.KILL) <= {1, 2}  # rank 0 is spared by default


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Fault.delay(0, 1, 0), ValueError, "seconds > 0"),
        (lambda: Fault.kill(-1, 0), ValueError, "rank must be"),
        (lambda: Fault.kill(0, True), ValueError, "op must be"),
        (lambda: FaultPlan.of(Fault.kill(0, 1), Fault.hang(0, 1)), ValueError, "two faults"),
        (lambda: FaultPlan(("kill",)), TypeError, "Fault records"),  # type: ignore[arg-type]
    ],
)
def test_bad_faults_are_rejected(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


async def delayed_then_failed(ctx: RankContext) -> dict[str, Any]:
    g = ftcomm.Group("gloo", timeout=5, configure_timeout=30)
    await g.configure(ctx.addr(), ctx.rank, 2)
    out: dict[str, Any] = {}
    await g.allreduce(torch.ones(1))  # op 0
    started = time.monotonic()
    out["delayed"] = (await g.allreduce(torch.ones(1))).item()  # op 1: delayed on rank 0
    out["delay"] = time.monotonic() - started
    try:
        await g.allreduce(torch.ones(1))  # op 2: fails on rank 1
        out["op2"] = "ok"
    except ftcomm.CommError as exc:
        out["op2"] = f"{type(exc).__name__}: {exc}"
    out["errored"] = g.errored() is not None
    await g.shutdown()
    return out


def test_delay_and_error_faults_apply_to_their_rank_and_op() -> None:
    # 1 s: rank 1's op must end well before it, even when a loaded box
    # holds one rank's process a few tenths of a second between two ops
    plan = FaultPlan.of(Fault.delay(0, 1, 1.0), Fault.error(1, 2, "disk on fire"))
    r0, r1 = run_world(delayed_then_failed, 2, plan=plan)
    assert r0["delayed"] == r1["delayed"] == 2.0  # a delayed op still gives the right sum
    assert r0["delay"] >= 1.0
    assert r1["delay"] < 1.0
    assert r0["op2"] == "ok"  # the native op did complete; only rank 1 was told otherwise
    assert r0["errored"] is False
    assert r1["op2"].startswith("CommFailed: allreduce failed: disk on fire")
    assert r1["errored"] is True


async def hung_op(ctx: RankContext) -> str:
    # the op's deadline is short; configure's is not (the ranks' processes
    # may start seconds apart on a loaded machine). The hung rank's is the
    # longer one: on a loaded machine rank 0 may issue its op a while after
    # rank 1 did, and rank 1's abort at a deadline that came first would
    # reach rank 0 as the peer closing (CommFailed) before its own deadline.
    g = ftcomm.Group("gloo", timeout=0.5 if ctx.rank == 0 else 3.0, configure_timeout=30)
    await g.configure(ctx.addr(), ctx.rank, 2)
    try:
        await g.allreduce(torch.ones(1))  # op 0: never issued on rank 1
    except ftcomm.CommTimeout:
        return "timeout"
    finally:
        await g.shutdown()
    return "ok"


def test_a_hung_op_ends_at_its_deadline_on_every_rank() -> None:
    # Rank 1 never issues op 0; both ranks time out at their deadline.
    assert run_world(hung_op, 2, plan=FaultPlan.of(Fault.hang(1, 0))) == ["timeout", "timeout"]


async def store_breaks(ctx: RankContext) -> dict[str, Any]:
    g = ftcomm.Group("gloo", timeout=5, configure_timeout=30)
    await g.configure(ctx.addr("a"), ctx.rank, 2)
    sums = [(await g.allreduce(torch.ones(1))).item() for _ in range(3)]  # rank 0 breaks at op 1
    started = time.monotonic()
    try:
        await g.configure(ctx.addr("b"), ctx.rank, 2, timeout=2.0)
        outcome = "configured"
    except ftcomm.CommError as exc:
        outcome = type(exc).__name__
    took = time.monotonic() - started
    await g.shutdown()
    return {"sums": sums, "outcome": outcome, "took": took}


def test_a_broken_store_fails_the_next_configure_on_every_rank() -> None:
    results = run_world(store_breaks, 2, plan=FaultPlan.of(Fault.break_store(0, 1)))
    for r in results:
        assert r["sums"] == [2.0, 2.0, 2.0]  # the configured group needs no store
        assert r["outcome"] in ("CommTimeout", "CommFailed"), r
        assert r["took"] < 2.0 + 1.5


def test_spared_ranks_are_never_killed_whatever_iterable_names_them() -> None:
    for seed in range(50):
        plan = FaultPlan.random(seed, 3, 10, delay_rate=0, kills=2, spare=(r for r in [2]))
        assert 2 not in plan.ranks_that(Kind.KILL)


def test_a_one_op_plan_still_kills() -> None:
    plan = FaultPlan.random(3, 2, 1, delay_rate=0, kills=1)
    assert [str(f) for f in plan.faults] == ["kill(rank 1, op 0)"]


def test_a_fault_that_fires_names_its_op_and_how_ops_are_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fault's op is counted from 0 across the rank's groups, an error's
    seq from 1 per configuration: the warning at firing says which op it hit."""
    injector = Injector({1: Fault.delay(0, 1, 0.001)})
    with caplog.at_level(logging.WARNING, logger="ftcomm"):
        injector("allreduce", lambda: DoneOp())
        assert caplog.records == []  # op 0: no fault
        injector("broadcast", lambda: DoneOp())
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("ftcomm.testing: delay(rank 0, op 1 0.001s) fires at broadcast")
    assert "this rank's op 1, counted from 0" in line
    assert "seq counts from 1 in each configuration" in line
