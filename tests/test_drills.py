"""Drills: the trainer's point of view, with faults injected by a plan.

The code under test (``train``) knows nothing of the plan: it trains, and when
a collective fails it reconfigures with the survivors on a fresh prefix and
redoes the step.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import ftcomm
from ftcomm.testing import Fault, FaultPlan, RankContext, run_world

STEPS = 8
FAULT_STEP = 4
OP_TIMEOUT = 1.0


async def train(ctx: RankContext, survivors: list[int]) -> dict[str, Any]:
    """Sum ``step + rank`` over the ranks each step; on failure, carry on with
    ``survivors`` (what a real job learns from its membership service)."""
    g = ftcomm.Group("gloo", timeout=OP_TIMEOUT, configure_timeout=20)
    await g.configure(ctx.addr("g0"), ctx.rank, ctx.world_size)
    members = list(range(ctx.world_size))
    sums: list[float] = []
    failure: dict[str, Any] | None = None
    step = 0
    while step < STEPS:
        t = torch.tensor([float(step + ctx.rank)])
        started = time.monotonic()
        try:
            sums.append((await g.allreduce(t)).item())
        except ftcomm.CommError as exc:
            failure = {
                "step": step,
                "error": type(exc).__name__,
                "after": time.monotonic() - started,
            }
            members = survivors
            await g.configure(ctx.addr("g1"), members.index(ctx.rank), len(members))
            continue  # redo the step with the survivors
        expected = sum(step + r for r in members)
        assert sums[-1] == expected, (step, sums[-1], expected)
        step += 1
    await g.shutdown()
    return {"sums": sums, "failure": failure, "members": members}


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        (Fault.kill(2, FAULT_STEP), ("CommFailed", "CommTimeout")),
        (Fault.stop(2, FAULT_STEP), ("CommTimeout",)),
    ],
    ids=["sigkill", "sigstop"],
)
def test_survivors_of_a_lost_rank_finish_the_run(fault: Fault, error: tuple[str, ...]) -> None:
    started = time.monotonic()
    results = run_world(train, 3, args=([0, 1],), plan=FaultPlan.of(fault), timeout=60)
    wall = time.monotonic() - started
    assert results[2] is None  # the victim died by SIGKILL (stopped ones are killed at the end)
    for rank in (0, 1):
        r = results[rank]
        assert r["members"] == [0, 1]
        assert r["failure"]["step"] == FAULT_STEP
        assert r["failure"]["error"] in error, r["failure"]
        assert r["failure"]["after"] < OP_TIMEOUT + 1.0  # within the deadline (generous)
        want = [float(sum(s + m for m in range(3))) for s in range(FAULT_STEP)]
        want += [float(s + s + 1) for s in range(FAULT_STEP, STEPS)]
        assert r["sums"] == want
    assert wall < 60


async def abort_configure_cycles(ctx: RankContext, cycles: int) -> int:
    g = ftcomm.Group("gloo", timeout=10)
    ok = 0
    for i in range(cycles):
        await g.abort()
        await g.configure(ctx.addr(f"c{i}"), ctx.rank, ctx.world_size)
        t = await g.allreduce(torch.tensor([float(i + ctx.rank)]))
        ok += t.item() == float(2 * i + 1)
    await g.shutdown()
    return ok


def test_fifty_abort_configure_cycles_all_succeed_and_leak_nothing() -> None:
    # The harness's in-rank check fails the world on any fd, thread or blocked
    # worker left behind after the 50 cycles.
    assert run_world(abort_configure_cycles, 2, args=(50,), timeout=120) == [50, 50]
