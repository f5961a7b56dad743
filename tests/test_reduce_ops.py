"""Reduce ops a native backend lacks, made by ftcomm: AVG on Gloo is a SUM
and a division before the op ends, PREMUL_SUM a SUM and a multiplication,
in every op that reduces, in process and in a subprocess group, through the
async API and the c10d facade."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ftcomm
from ftcomm import c10d
from ftcomm._runtime.native import DoneOp, ThenOp
from ftcomm.testing import RankContext, run_world


async def _averages(ctx: RankContext, subprocess: bool) -> dict[str, list[float]]:
    """Rank r holds r + 1 (3 ranks: the average is 2)."""
    r = float(ctx.rank + 1)
    # no spare worker: the fewest processes starting at once beside other tests
    async with ftcomm.Group("gloo", subprocess=subprocess, spare_worker=False, timeout=20) as g:
        await g.configure(ctx.addr(), ctx.rank, ctx.world_size, timeout=20)
        out: dict[str, list[float]] = {}
        out["allreduce"] = (await g.allreduce(torch.full((3,), r), "avg")).tolist()
        both = await g.allreduce_coalesced(
            [torch.full((2,), r), torch.full((1,), 2 * r)], dist.ReduceOp.AVG
        )
        out["coalesced"] = [v for t in both for v in t.tolist()]
        chunks = [torch.full((2,), r * (d + 1)) for d in range(ctx.world_size)]
        mine = await g.reduce_scatter(torch.zeros(2), chunks, "avg")
        out["reduce_scatter"] = mine.tolist()
        flat = torch.cat(chunks)
        (into,) = await g.reduce_scatter_tensor_coalesced([torch.zeros(2)], [flat], "avg")
        out["reduce_scatter_tensor"] = into.tolist()
        complex_avg = await g.allreduce(torch.full((1,), complex(r, -r)), "avg")
        out["complex"] = [complex_avg.item().real, complex_avg.item().imag]
        out["sum after"] = (await g.allreduce(torch.ones(1))).tolist()  # SUM is SUM still
        return out


@pytest.mark.parametrize("subprocess", [False, True], ids=["in-process", "subprocess"])
def test_avg_on_gloo_is_the_mean_in_every_reducing_op(subprocess: bool) -> None:
    n = 2 if subprocess else 3  # a worker process per rank: fewer of them
    results = run_world(_averages, n, args=(subprocess,), mode="thread", timeout=90)
    mean = (n + 1) / 2  # of 1..n
    for rank, out in enumerate(results):
        assert out["allreduce"] == [mean] * 3
        assert out["coalesced"] == [mean, mean, 2 * mean]
        assert out["reduce_scatter"] == [mean * (rank + 1)] * 2  # mean of r * (rank + 1)
        assert out["reduce_scatter_tensor"] == [mean * (rank + 1)] * 2
        assert out["complex"] == [mean, -mean]
        assert out["sum after"] == [float(n)]


async def _premul_sums(ctx: RankContext, subprocess: bool) -> dict[str, list[float]]:
    """Rank r holds r + 1; PREMUL_SUM(0.5): half of the sum (2 ranks: 1.5)."""
    r = float(ctx.rank + 1)
    half = dist.ReduceOp.PREMUL_SUM(0.5)
    async with ftcomm.Group("gloo", subprocess=subprocess, spare_worker=False, timeout=20) as g:
        await g.configure(ctx.addr(), ctx.rank, ctx.world_size, timeout=20)
        out: dict[str, list[float]] = {}
        out["allreduce"] = (await g.allreduce(torch.full((3,), r), half)).tolist()
        both = await g.allreduce_coalesced([torch.full((2,), r), torch.full((1,), 2 * r)], half)
        out["coalesced"] = [v for t in both for v in t.tolist()]
        chunks = [torch.full((2,), r * (d + 1)) for d in range(ctx.world_size)]
        out["reduce_scatter"] = (await g.reduce_scatter(torch.zeros(2), chunks, half)).tolist()
        (into,) = await g.reduce_scatter_tensor_coalesced(
            [torch.zeros(2)], [torch.cat(chunks)], half
        )
        out["reduce_scatter_tensor"] = into.tolist()
        # a factor as torch also takes it: a one-element tensor
        quarter = dist._make_nccl_premul_sum(torch.tensor([0.25]))
        out["tensor factor"] = (await g.allreduce(torch.full((1,), r), quarter)).tolist()
        # each rank's own factor scales its own input (NCCL's PREMUL_SUM):
        # 1 x 1 + 1 x 2 on both ranks, not each rank's factor times the sum
        own = dist.ReduceOp.PREMUL_SUM(float(ctx.rank + 1))
        out["own factors"] = (await g.allreduce(torch.ones(1), own)).tolist()
        mine = await g.reduce_scatter(torch.zeros(1), [torch.ones(1)] * ctx.world_size, own)
        out["own factors, reduce_scatter"] = mine.tolist()
        # scaled before the sum: 2 x 40000 is past float16's range, 2 x 20000 is not
        big = torch.full((1,), 40000.0, dtype=torch.float16)
        out["float16"] = (await g.allreduce(big, half)).tolist()
        out["sum after"] = (await g.allreduce(torch.ones(1))).tolist()  # SUM is SUM still
        return out


@pytest.mark.parametrize("subprocess", [False, True], ids=["in-process", "subprocess"])
def test_premul_sum_on_gloo_is_the_scaled_sum_in_every_reducing_op(subprocess: bool) -> None:
    results = run_world(_premul_sums, 2, args=(subprocess,), mode="thread", timeout=90)
    for rank, out in enumerate(results):
        assert out["allreduce"] == [1.5] * 3
        assert out["coalesced"] == [1.5, 1.5, 3.0]
        assert out["reduce_scatter"] == [1.5 * (rank + 1)] * 2
        assert out["reduce_scatter_tensor"] == [1.5 * (rank + 1)] * 2
        assert out["tensor factor"] == [0.75]
        assert out["own factors"] == out["own factors, reduce_scatter"] == [3.0]
        assert out["float16"] == [40000.0]
        assert out["sum after"] == [2.0]


async def _bad_premul(ctx: RankContext) -> dict[str, str]:
    out: dict[str, str] = {}
    async with ftcomm.Group("gloo", timeout=10) as g:
        await g.configure(ctx.addr(), ctx.rank, ctx.world_size)
        t = torch.ones(2, dtype=torch.int64)
        cases = {
            "no factor": (torch.ones(2), dist.ReduceOp.PREMUL_SUM),
            "integers": (t, dist.ReduceOp.PREMUL_SUM(0.5)),
            "nan": (torch.ones(2), dist.ReduceOp.PREMUL_SUM(float("nan"))),
            # a factor on a device (meta here: CUDA on a GPU) would be read
            # back with a device sync on every op
            "device factor": (
                torch.ones(2),
                dist._make_nccl_premul_sum(torch.tensor([0.5], device="meta")),
            ),
        }
        for name, (tensor, op) in cases.items():
            try:
                g.allreduce(tensor, op)
            except ValueError as exc:
                out[name] = str(exc)
        out["untouched"] = str(t.tolist())
        out["after"] = str((await g.allreduce(torch.ones(1))).tolist())
    async with ftcomm.Group("dummy") as d:
        await d.configure("127.0.0.1:1/x", 0, 1)
        try:
            d.allreduce(torch.ones(1), dist.ReduceOp.PREMUL_SUM(0.5))
        except ValueError as exc:
            out["dummy"] = str(exc)
    return out


def test_a_premul_sum_without_a_float_factor_or_on_integers_is_refused() -> None:
    for out in run_world(_bad_premul, 2, mode="thread"):
        assert "PREMUL_SUM needs a factor" in out["no factor"], out
        assert "needs floating point or complex tensors" in out["integers"], out
        assert "factor must be finite" in out["nan"], out
        assert "factor must be a float" in out["device factor"], out
        assert "not supported by the dummy backend" in out["dummy"], out
        assert (out["untouched"], out["after"]) == ("[1, 1]", "[2.0]")


async def _int_avg(ctx: RankContext) -> str:
    async with ftcomm.Group("gloo", timeout=10) as g:
        await g.configure(ctx.addr(), ctx.rank, ctx.world_size)
        t = torch.ones(2, dtype=torch.int64)
        with pytest.raises(ValueError, match="needs floating point or complex tensors"):
            g.allreduce(t, "avg")
        assert t.tolist() == [1, 1]
        return str((await g.allreduce(t)).tolist())


def test_an_integer_average_is_refused_not_truncated() -> None:
    assert run_world(_int_avg, 2, mode="thread") == ["[2, 2]", "[2, 2]"]


async def _aliased_avg(ctx: RankContext) -> dict[str, Any]:
    """Rank r holds r + 1 (2 ranks: the mean is 1.5)."""
    r = float(ctx.rank + 1)
    async with ftcomm.Group("gloo", timeout=10) as g:
        await g.configure(ctx.addr(), ctx.rank, ctx.world_size)
        out: dict[str, Any] = {}
        t = torch.full((2,), r)
        base = torch.full((3,), r)
        for name, tensors in {"same": [t, t], "overlap": [base[0:2], base[1:3]]}.items():
            try:
                g.allreduce_coalesced(tensors, "avg")
            except ValueError as exc:
                out[name] = str(exc)
        pairs = [torch.zeros(2), torch.zeros(2)]
        try:
            inputs = [torch.full((4,), r), torch.full((4,), r)]
            g.reduce_scatter_tensor_coalesced([pairs[0], pairs[0]], inputs, "avg")
        except ValueError as exc:
            out["outputs"] = str(exc)
        out["untouched"] = t.tolist() + base.tolist() + pairs[0].tolist()
        # views side by side in one storage are apart: each is divided once
        halves = torch.full((4,), r)
        await g.allreduce_coalesced([halves[:2], halves[2:]], "avg")
        out["halves"] = halves.tolist()
        out["sum"] = (await g.allreduce_coalesced([t, t])).__len__()  # SUM: torch's own
        return out


def test_an_average_of_tensors_that_share_memory_is_refused() -> None:
    """ftcomm's AVG divides each tensor in place after the SUM: memory two
    of them share would be divided twice (the mean of 1 and 2 came out as
    0.75). It is refused before anything is issued, the tensors untouched."""
    for out in run_world(_aliased_avg, 2, mode="thread"):
        assert out["same"].startswith("tensors[0] and tensors[1] share memory"), out
        assert out["overlap"].startswith("tensors[0] and tensors[1] share memory"), out
        assert out["outputs"].startswith("outputs[0] and outputs[1] share memory"), out
        assert out["halves"] == [1.5] * 4
        assert out["sum"] == 2
    ranks = run_world(_aliased_avg, 2, mode="thread")
    assert [out["untouched"] for out in ranks] == [[1.0] * 5 + [0.0] * 2, [2.0] * 5 + [0.0] * 2]


def _facade_avg(ctx: RankContext) -> list[float]:
    pg = c10d.ProcessGroupGloo()
    try:
        pg.configure(ctx.addr(), "r", ctx.rank, ctx.world_size)
        t = torch.full((2,), float(ctx.rank))
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
        out = torch.zeros(1)
        dist.reduce_scatter_single(out, torch.full((2,), float(ctx.rank)), dist.ReduceOp.AVG, pg)
        # FSDP2's reduction with a divide factor: PREMUL_SUM(1 / factor)
        scaled = torch.full((2,), float(ctx.rank + 1))
        dist.all_reduce(scaled, op=dist.ReduceOp.PREMUL_SUM(0.25), group=pg)
        into = torch.zeros(1)
        whole = torch.full((2,), float(ctx.rank + 1))
        dist.reduce_scatter_single(into, whole, dist.ReduceOp.PREMUL_SUM(0.25), pg)
        return [*t.tolist(), *out.tolist(), *scaled.tolist(), *into.tolist()]
    finally:
        pg.shutdown()


async def _facade_avg_async(ctx: RankContext) -> list[float]:
    import asyncio

    return await asyncio.to_thread(_facade_avg, ctx)


def test_the_facade_takes_avg_and_premul_sum_as_torch_passes_them() -> None:
    assert run_world(_facade_avg_async, 2, mode="thread") == [[0.5, 0.5, 0.5, 0.75, 0.75, 0.75]] * 2


class _Manual:
    """A native op that ends when the test says."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []
        self.abandoned = False

    def poll(self) -> bool:
        return False

    def outcome(self) -> BaseException | None:
        return None

    def on_done(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def abandon(self) -> bool:
        self.abandoned = True
        return True

    def end(self, error: BaseException | None = None) -> None:
        for callback in self.callbacks:
            callback(error)


def test_then_runs_once_after_success_and_never_after_abandon() -> None:
    steps: list[str] = []
    inner = _Manual()
    op = ThenOp(inner, lambda: steps.append("after"))
    seen: list[Any] = []
    op.on_done(seen.append)
    assert not op.poll()
    inner.end()
    assert (steps, op.poll(), op.outcome(), seen) == (["after"], True, None, [None])
    op.on_done(seen.append)  # late: at once
    assert seen == [None, None]

    inner = _Manual()
    op = ThenOp(inner, lambda: steps.append("late"))
    assert op.abandon() is True
    assert inner.abandoned
    inner.end()  # the inner op's late success: its outputs are no one's now
    assert "late" not in steps
    assert op.poll()

    failed = ThenOp(DoneOp(RuntimeError("peer gone")), lambda: steps.append("never"))
    assert isinstance(failed.outcome(), RuntimeError)
    assert "never" not in steps

    broken = ThenOp(DoneOp(), lambda: 1 / 0)
    assert isinstance(broken.outcome(), ZeroDivisionError)


def test_abandon_waits_for_an_after_in_progress() -> None:
    """Forced: the after step is paused mid-way; abandon() must not return
    before it finished (it writes the op's tensors)."""
    inside, go = threading.Event(), threading.Event()
    finished: list[bool] = []

    def after() -> None:
        inside.set()
        go.wait(10)
        finished.append(True)

    inner = _Manual()
    op = ThenOp(inner, after)
    ender = threading.Thread(target=inner.end)
    ender.start()
    assert inside.wait(10)
    returned = threading.Event()
    abandoner = threading.Thread(target=lambda: (op.abandon(), returned.set()))
    abandoner.start()
    assert not returned.wait(0.2)  # held while the step runs
    go.set()
    assert returned.wait(10)
    assert finished == [True]
    ender.join()
    abandoner.join()


def test_an_integer_average_is_refused_only_where_avg_is_ftcomms() -> None:
    from ftcomm._validate import check_reduce_dtype
    from ftcomm.backends import backend_class

    ints = torch.ones(2, dtype=torch.int32)
    assert backend_class("gloo").int_avg is False
    with pytest.raises(ValueError, match="needs floating point"):
        check_reduce_dtype(dist.ReduceOp.AVG, ints, "t", int_avg=False)
    check_reduce_dtype(dist.ReduceOp.AVG, ints, "t", int_avg=True)  # NCCL's own AVG takes them
