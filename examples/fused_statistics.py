"""Reduce 200 per-parameter statistics at once, unfused and fused.

Each step a trainer wants, say, the squared norm of every parameter's
gradient summed over the ranks: 200 one-float allreduces, issued together
and awaited with ``asyncio.gather``. Unfused, each is its own native op.
With ``Group(fuse=True)`` they wait in one batch, sent as one allreduce
when the first of them is awaited (docs/fusion.md). A ``Work`` is an
asyncio future, so ``asyncio.gather`` makes no task per op;
``ftcomm.gather`` awaits them in the calling task, without even a
done-callback each. Both ranks check every sum; rank 0
prints the three times::

    python examples/fused_statistics.py [--params 200] [--steps 20] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

import ftcomm
from ftcomm.testing import RankContext, run_world

WORLD = 2


async def one_step(
    group: ftcomm.Group, stats: list[torch.Tensor], rank: int, gather: Any = asyncio.gather
) -> None:
    for i, t in enumerate(stats):
        t.fill_(float(i + rank))  # this rank's statistic of parameter i
    await gather(*[group.allreduce(t) for t in stats])
    for i, t in enumerate(stats):  # every rank's sum, in every tensor
        want = float(sum(i + r for r in range(WORLD)))
        if t.item() != want:
            raise AssertionError(f"parameter {i}: {t.item()} != {want}")


async def timed(
    addr: str, rank: int, params: int, steps: int, fuse: bool, gather: Any = asyncio.gather
) -> float:
    """The median seconds of one step's ``params`` concurrent allreduces."""
    async with ftcomm.Group("gloo", timeout=30.0, fuse=fuse) as group:
        await group.configure(addr, rank, WORLD)
        stats = [torch.zeros(1) for _ in range(params)]
        await one_step(group, stats, rank, gather)  # warm up
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            await one_step(group, stats, rank, gather)
            times.append(time.perf_counter() - start)
        return statistics.median(times)


async def rank_main(ctx: RankContext, params: int, steps: int) -> dict[str, float]:
    """One rank: the same steps unfused, fused, and fused awaited with
    ``ftcomm.gather``; its median times in ms."""
    unfused = await timed(ctx.addr("unfused"), ctx.rank, params, steps, fuse=False)
    fused = await timed(ctx.addr("fused"), ctx.rank, params, steps, fuse=True)
    fg = await timed(ctx.addr("fg"), ctx.rank, params, steps, fuse=True, gather=ftcomm.gather)
    return {
        "unfused_ms": unfused * 1e3,
        "fused_ms": fused * 1e3,
        "fused_ftcomm_gather_ms": fg * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", action="store_true", help="print rank 0's times as JSON")
    args = p.parse_args(argv)
    # The unfused step holds its event loop for ~0.2 s while it issues 200
    # native ops (what fusion saves): ftcomm's debug watchdog, which the test
    # harness turns on by default, would report each such step as a stall.
    os.environ.setdefault("FTCOMM_DEBUG", "0")
    # Two ranks on this machine, with a store of their own (ftcomm.testing)
    times = run_world(rank_main, WORLD, args=(args.params, args.steps), timeout=120)[0]
    if args.json:
        print(json.dumps(times))
    else:
        print(
            f"{args.params} concurrent one-float allreduces, {WORLD} ranks, median of "
            f"{args.steps} steps: unfused {times['unfused_ms']:.1f} ms, "
            f"fused {times['fused_ms']:.1f} ms "
            f"({times['unfused_ms'] / times['fused_ms']:.1f}x faster), fused with ftcomm.gather "
            f"{times['fused_ftcomm_gather_ms']:.1f} ms "
            f"({times['unfused_ms'] / times['fused_ftcomm_gather_ms']:.1f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
