"""Reduce 200 per-parameter statistics at once, unfused and fused.

Each step a trainer wants, say, the squared norm of every parameter's
gradient summed over the ranks: 200 one-float allreduces, issued together
and awaited with ``asyncio.gather``. Unfused, each is its own native op.
With ``Group(fuse=True)`` they wait in one batch, sent as one allreduce
when the first of them is awaited (docs/design.md, "Fusing small
collectives"). Both ranks check every sum; rank 0 prints both times::

    python examples/fused_statistics.py [--params 200] [--steps 20] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time

import torch

import ftcomm

WORLD = 2


async def one_step(group: ftcomm.Group, stats: list[torch.Tensor], rank: int) -> None:
    for i, t in enumerate(stats):
        t.fill_(float(i + rank))  # this rank's statistic of parameter i
    await asyncio.gather(*[group.allreduce(t) for t in stats])
    for i, t in enumerate(stats):  # every rank's sum, in every tensor
        want = float(sum(i + r for r in range(WORLD)))
        if t.item() != want:
            raise AssertionError(f"parameter {i}: {t.item()} != {want}")


async def timed(addr: str, rank: int, params: int, steps: int, fuse: bool) -> float:
    """The median seconds of one step's ``params`` concurrent allreduces."""
    async with ftcomm.Group("gloo", timeout=30.0, fuse=fuse) as group:
        await group.configure(addr, rank, WORLD)
        stats = [torch.zeros(1) for _ in range(params)]
        await one_step(group, stats, rank)  # warm up
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            await one_step(group, stats, rank)
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def rank_main(store: str, rank: int, params: int, steps: int, out: multiprocessing.Queue) -> None:
    async def both() -> dict[str, float]:
        unfused = await timed(f"{store}/unfused", rank, params, steps, fuse=False)
        fused = await timed(f"{store}/fused", rank, params, steps, fuse=True)
        return {"unfused_ms": unfused * 1e3, "fused_ms": fused * 1e3}

    out.put((rank, asyncio.run(both())))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", action="store_true", help="print rank 0's times as JSON")
    args = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()
    with ftcomm.serve_store() as server:
        procs = [
            ctx.Process(target=rank_main, args=(server.address, r, args.params, args.steps, out))
            for r in range(WORLD)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120)
            if proc.exitcode != 0:
                print(f"a rank failed (exit code {proc.exitcode})", file=sys.stderr)
                for other in procs:
                    other.kill()
                return 1
    results = dict(out.get(timeout=5) for _ in procs)
    times = results[0]
    if args.json:
        print(json.dumps(times))
    else:
        print(
            f"{args.params} concurrent one-float allreduces, {WORLD} ranks, median of "
            f"{args.steps} steps: unfused {times['unfused_ms']:.1f} ms, "
            f"fused {times['fused_ms']:.1f} ms "
            f"({times['unfused_ms'] / times['fused_ms']:.1f}x faster)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
