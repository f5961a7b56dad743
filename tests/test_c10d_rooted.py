"""torch.distributed's rooted functions over a facade group (reduce,
gather, scatter, their object forms, monitored_barrier), and torch's
backend queries answered as for c10d's own group of that backend."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ftcomm
from ftcomm import c10d
from ftcomm.testing import RankContext, run_world


def _on_facade(
    body: Callable[[RankContext, c10d.ProcessGroupGloo], Any],
    cls: type[c10d.ProcessGroupGloo] = c10d.ProcessGroupGloo,
) -> Any:
    """A rank function: a registered ProcessGroupGloo of the world, ``body``
    run on a thread (the facade's calls block), the group shut down after."""

    async def rank(ctx: RankContext) -> Any:
        def run() -> Any:
            pg = cls(timeout=timedelta(seconds=20))
            try:
                pg.configure(ctx.addr(), "r", ctx.rank, ctx.world_size)
                pg.register(f"rooted-{ctx.world_id}-{ctx.rank}")
                try:
                    return body(ctx, pg)
                finally:
                    pg.unregister()
            finally:
                pg.shutdown()

        return await asyncio.to_thread(run)

    return rank


def _rooted(ctx: RankContext, pg: c10d.ProcessGroupGloo) -> dict[str, Any]:
    r, out = ctx.rank, {}
    mine = torch.full((2,), float(r + 1))
    dist.reduce(mine, dst=1, group=pg)
    out["reduce"] = mine.tolist()
    into = [torch.zeros(2) for _ in range(3)] if r == 0 else None
    dist.gather(torch.full((2,), float(r)), into, dst=0, group=pg)
    out["gather"] = [t.tolist() for t in into] if into is not None else None
    got = torch.zeros(2)
    chunks = [torch.full((2,), 10.0 + d) for d in range(3)] if r == 2 else None
    dist.scatter(got, chunks, src=2, group=pg)
    out["scatter"] = got.tolist()
    objects: list[Any] = [None] * 3 if r == 1 else []
    dist.gather_object({"rank": r}, objects if r == 1 else None, dst=1, group=pg)
    out["gather_object"] = objects
    received: list[Any] = [None]
    dist.scatter_object_list(received, [f"to {d}" for d in range(3)] if r == 0 else None, 0, pg)
    out["scatter_object"] = received[0]
    dist.monitored_barrier(pg, timeout=timedelta(seconds=20))
    out["backend"] = (dist.get_backend(pg), dist.get_backend_config(pg))
    return out


# ProcessGroupBabyGloo runs the same GroupOps over a subprocess group, whose
# allreduce/allgather/alltoall tests/test_subprocess*.py and test_reduce_ops cover
@pytest.mark.parametrize("cls", [c10d.ProcessGroupGloo])
def test_rooted_functions_over_a_facade_group(cls: type[c10d.ProcessGroupGloo]) -> None:
    results = run_world(_on_facade(_rooted, cls), 3, mode="thread", timeout=90)
    for r, out in enumerate(results):
        assert out["reduce"] == ([6.0, 6.0] if r == 1 else [float(r + 1)] * 2)  # others keep theirs
        assert out["gather"] == ([[0.0] * 2, [1.0] * 2, [2.0] * 2] if r == 0 else None)
        assert out["scatter"] == [10.0 + r] * 2
        assert out["gather_object"] == ([{"rank": 0}, {"rank": 1}, {"rank": 2}] if r == 1 else [])
        assert out["scatter_object"] == f"to {r}"
        assert out["backend"] == ("gloo", "cpu:gloo")


def _bad_roots(ctx: RankContext, pg: c10d.ProcessGroupGloo) -> list[float]:
    far = dist.ReduceOptions()
    far.rootRank = 5
    with pytest.raises(ValueError, match="root rank 5 is not a rank of this group"):
        pg.reduce([torch.ones(1)], far)
    gopts = dist.GatherOptions()
    gopts.rootRank = 0
    if ctx.rank == 1:
        with pytest.raises(ValueError, match="must be empty on a rank that is not the root"):
            pg.gather([[torch.zeros(1), torch.zeros(1)]], [torch.ones(1)], gopts)
    sopts = dist.ScatterOptions()
    sopts.rootRank = 0
    if ctx.rank == 0:
        with pytest.raises(ValueError, match=r"must be a torch.float32 tensor of shape \(1,\)"):
            pg.scatter([torch.zeros(1)], [[torch.ones(1), torch.ones(2)]], sopts)
        with pytest.raises(ValueError, match="must be contiguous"):
            pg.scatter([torch.zeros(2, 2).t()], [[torch.ones(2, 2)] * 2], sopts)
    assert pg.errored() is None
    t = torch.ones(1)
    dist.all_reduce(t, group=pg)  # the group is as it was
    return t.tolist()


def test_bad_rooted_calls_are_refused_and_harmless() -> None:
    assert run_world(_on_facade(_bad_roots), 2, mode="thread") == [[2.0], [2.0]]


def _late_barrier(ctx: RankContext, pg: c10d.ProcessGroupGloo) -> str:
    if ctx.rank == 1:  # never comes to the barrier; keeps its group until rank 0 is done
        ctx.wait_for_blocking("done")
        return "absent"
    try:
        dist.monitored_barrier(pg, timeout=timedelta(seconds=0.5))
    except ftcomm.CommTimeout as exc:
        return type(exc).__name__
    finally:
        ctx.signal("done")
    return "passed"


def test_monitored_barrier_raises_at_its_deadline() -> None:
    assert run_world(_on_facade(_late_barrier), 2, mode="thread") == ["CommTimeout", "absent"]


def _two_worlds(ctx: RankContext, given: str) -> dict[str, Any]:
    """Each rank its own one-process default world (as torchft's replica
    groups are each their own job), one facade group across them."""
    store = dist.PrefixStore(f"{ctx.world_id}/own-{ctx.rank}", ctx.store)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    pg = c10d.ProcessGroupGloo(timeout=timedelta(seconds=20))
    try:
        # replica-major numbers (replica * group size + group rank), as torchft's Manager passes
        ranks = [0, 4] if given == "torchft's" else None
        pg.configure(ctx.addr(), "r", ctx.rank, 2, global_ranks=ranks)
        pg.register(f"across-{ctx.world_id}-{ctx.rank}")
        t = torch.ones(1)
        dist.all_reduce(t, group=pg)
        out = {"ranks": dist.get_process_group_ranks(pg), "sum": t.item()}
        pg.unregister()
        return out
    finally:
        pg.shutdown()
        dist.destroy_process_group()


@pytest.mark.parametrize("given", ["none", "torchft's"])
def test_members_of_different_default_worlds_keep_the_one_rank_view(given: str) -> None:
    """Their default ranks repeat (0 and 0) or global_ranks are not theirs:
    no mapping is made up; each is entered alone, as torchft enters it."""
    results = run_world(two_worlds, 2, args=(given,), timeout=60)
    assert results == [{"ranks": [0], "sum": 2.0}] * 2


def _wrapped(ctx: RankContext) -> list[int]:
    store = dist.PrefixStore(f"{ctx.world_id}/default", ctx.store)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size)
    pg = c10d.ErrorSwallowingProcessGroupWrapper(c10d.ProcessGroupGloo(timeout=20))
    try:
        pg.configure(ctx.addr(), "r", ctx.world_size - 1 - ctx.rank, ctx.world_size)
        pg.register(f"wrapped-{ctx.world_id}")
        ranks = dist.get_process_group_ranks(pg)
        pg.unregister()
        return ranks
    finally:
        pg.shutdown()
        dist.destroy_process_group()


def test_a_wrapper_is_registered_with_the_ranks_of_the_group_it_wraps() -> None:
    assert run_world(wrapped, 2, timeout=60) == [[1, 0], [1, 0]]


def _untimed_barrier(ctx: RankContext) -> tuple[str, float]:
    # The group's 1 s is set once it is built: configure keeps the facade's
    # timeout, and its store connect can wait 1 s on a reverse DNS lookup
    # (tests/conftest.py).
    pg = c10d.ProcessGroupGloo(timeout=timedelta(seconds=20))
    try:
        pg.configure(ctx.addr(), "r", ctx.rank, ctx.world_size)
        pg.register(f"untimed-{ctx.world_id}-{ctx.rank}")
        pg.set_timeout(timedelta(seconds=1))
        try:
            if ctx.rank == 1:
                ctx.wait_for_blocking("done")
                return "absent", 0.0
            started = time.monotonic()
            try:
                dist.monitored_barrier(pg)  # torch passes its 30-minute default
            except ftcomm.CommTimeout as exc:
                return type(exc).__name__, time.monotonic() - started
            finally:
                ctx.signal("done")
            return "passed", 0.0
        finally:
            pg.unregister()
    finally:
        pg.shutdown()


def test_monitored_barrier_without_a_timeout_keeps_the_groups_deadline() -> None:
    results = run_world(untimed_barrier, 2, mode="thread", timeout=60)
    assert results[1] == ("absent", 0.0)
    assert results[0][0] == "CommTimeout"
    assert results[0][1] < 1.0 + 2.0  # the group's 1 s, not torch's 30 minutes


async def two_worlds(ctx: RankContext, given: str) -> Any:
    return await asyncio.to_thread(_two_worlds, ctx, given)


async def wrapped(ctx: RankContext) -> Any:
    return await asyncio.to_thread(_wrapped, ctx)


async def untimed_barrier(ctx: RankContext) -> Any:
    return await asyncio.to_thread(_untimed_barrier, ctx)


def _all_to_all(ctx: RankContext, pg: c10d.ProcessGroupGloo) -> dict[str, Any]:
    r, n = ctx.rank, ctx.world_size
    out: dict[str, Any] = {}
    # rank r sends d + 1 values r*10 + d to rank d: sizes differ by pair
    ins = [torch.full((d + 1,), r * 10.0 + d) for d in range(n)]
    outs = [torch.zeros(r + 1) for _ in range(n)]
    dist.all_to_all(outs, ins, group=pg)
    out["sizes"] = [t.tolist() for t in outs]
    # outputs that are not contiguous, filled through the work's future
    grid = torch.zeros(2, n)
    cols = [grid[:, d] for d in range(n)]
    work = dist.all_to_all(cols, [torch.tensor([r, d], dtype=torch.float32) for d in range(n)],
                           group=pg, async_op=True)  # fmt: skip
    out["future"] = [t.tolist() for t in work.get_future().wait()]
    out["grid"] = grid.tolist()
    with pytest.raises(ValueError, match=f"output_tensors must hold {n} tensors"):
        dist.all_to_all([torch.zeros(1)], [torch.zeros(1)] * n, group=pg)
    mixed = [torch.zeros(1, dtype=torch.int64)] * n  # torch's all_to_all checks this first
    with pytest.raises(ValueError, match=r"output_tensors\[0\] is torch.int64 on cpu: every"):
        pg.alltoall(mixed, [torch.zeros(1)] * n)
    assert pg.errored() is None
    t = torch.ones(1)
    dist.all_reduce(t, group=pg)  # the group is as it was
    out["after"] = t.item()
    return out


def test_all_to_all_lists_of_any_sizes_over_a_facade_group() -> None:
    """``dist.all_to_all`` (torch's own Gloo has no list alltoall): one
    alltoall_base of the flattened lists, the outputs filled before wait()
    returns or the future completes; bad lists refused, the group intact."""
    results = run_world(_on_facade(_all_to_all), 3, mode="thread", timeout=60)
    for r, out in enumerate(results):
        assert out["sizes"] == [[s * 10.0 + r] * (r + 1) for s in range(3)]
        assert out["grid"] == [[0.0, 1.0, 2.0], [float(r)] * 3]
        assert out["future"] == [[s, r] for s in (0.0, 1.0, 2.0)]
        assert out["after"] == 3.0
