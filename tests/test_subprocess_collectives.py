"""Every collective with ``subprocess=True``: the native group in a worker process.

The same contract as tests/test_collectives.py (its rank function and its
expected values, with every ``ftcomm.Group`` made a subprocess group), plus
what the worker process adds: the dummy backend giving what it gives in
process, 64 ops in flight at once on one worker, the caller's tensors
(views with a storage offset, zero elements, inputs never written), and the
c10d facade ``ProcessGroupBabyGloo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from helpers import subprocess_backend
from test_collectives import assert_same, every_collective, expected

import ftcomm
from ftcomm import c10d
from ftcomm.testing import RankContext, inspect, run_world

TIMEOUT = 20  # each op's and configure's deadline: generous for a 2-core machine
_Group = ftcomm.Group  # the real class, whatever the patch below puts in its place


def _is_my_child(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()


@contextlib.contextmanager
def worker_groups(backend: str | None = None) -> Iterator[list[int]]:
    """Make every ``ftcomm.Group(...)`` built meanwhile a subprocess group (no spare),
    on ``backend`` if given; yields the pids of the workers they configured, each
    checked to be a live child of this process that is not this process."""
    pids: list[int] = []

    class WorkerGroup(_Group):
        def __init__(self, name: str = "gloo", **kwargs: Any) -> None:
            super().__init__(backend or name, subprocess=True, spare_worker=False, **kwargs)

        async def configure(self, *args: Any, **kwargs: Any) -> None:
            await super().configure(*args, **kwargs)
            worker = subprocess_backend(self).worker
            assert worker.pid != os.getpid()
            assert _is_my_child(worker.pid)
            assert worker.proc.poll() is None  # running, not exited
            pids.append(worker.pid)

    with mock.patch.object(ftcomm, "Group", WorkerGroup):
        yield pids


def _check_every_collective(results: list[dict[str, Any]], world_size: int) -> None:
    for rank, got in enumerate(results):
        want = expected(rank, world_size)
        assert set(got) == set(want)
        for name in want:
            assert_same(got[name], want[name], f"rank {rank} {name}")


# -- every collective, in real worlds -----------------------------------------------------
async def every_collective_in_a_worker(ctx: RankContext) -> dict[str, Any]:
    with worker_groups() as pids:
        out = await every_collective(ctx)
    assert len(pids) == 1, pids  # one configure, one worker
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "loop"), [(1, "asyncio"), (3, "asyncio"), (2, "uvloop")], ids=str
)
def test_every_collective_in_a_worker(world_size: int, loop: str) -> None:
    results = run_world(every_collective_in_a_worker, world_size, loop=loop, timeout=90)
    _check_every_collective(results, world_size)


# -- the dummy backend in a worker, in this process -------------------------------------------
@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_dummy_in_a_worker_gives_the_in_process_results() -> None:
    # The dummy backend never contacts the store: port 1 is never dialled.
    ctx = RankContext(rank=0, world_size=1, port=1, world_id="x", loop="asyncio")
    with worker_groups("dummy") as pids:
        in_worker = await every_collective(ctx)
    assert len(pids) == 1
    with mock.patch.object(ftcomm, "Group", lambda _name, **kw: _Group("dummy", **kw)):
        in_process = await every_collective(ctx)
    want = expected(0, 1)
    assert set(in_worker) == set(in_process) == set(want)
    for name in want:
        assert_same(in_worker[name], in_process[name], f"{name}: worker vs in-process")
        assert_same(in_worker[name], want[name], name)


# -- pipelining: 64 ops in flight on one worker ------------------------------------------------
PIPELINED = 64


async def pipelined_rank(ctx: RankContext) -> list[torch.Tensor]:
    r, n = ctx.rank, ctx.world_size
    async with ftcomm.Group(
        "gloo", subprocess=True, spare_worker=False, timeout=TIMEOUT, configure_timeout=60
    ) as g:
        await g.configure(ctx.addr(), r, n)
        worker = subprocess_backend(g).worker
        if r > 0:  # the others issue only once rank 0 has all of its ops in flight
            await ctx.wait_for("rank0-issued")
        # Distinct shapes as well as values: a reply given to the wrong op shows.
        tensors = [torch.full((i % 7 + 1,), float(i) * (r + 1)) for i in range(PIPELINED)]
        works = [g.allreduce(t) for t in tensors]
        if r == 0:
            # Nobody else has issued anything yet: no allreduce can have ended.
            assert g.num_active_work() == PIPELINED
            assert worker.in_flight == PIPELINED
            ctx.signal("rank0-issued")
        results = await asyncio.gather(*works)
        assert all(got is t for got, t in zip(results, tensors, strict=True))
        assert g.num_active_work() == 0
        assert worker.in_flight == 0
        assert worker.dropped == 0  # every reply matched an op in flight
        assert g.errored() is None
        return results


def test_pipelined_ops_each_get_their_own_result() -> None:
    n = 2
    results = run_world(pipelined_rank, n, timeout=90)
    weight = sum(k + 1 for k in range(n))
    for rank, tensors in enumerate(results):
        assert len(tensors) == PIPELINED
        for i, t in enumerate(tensors):
            want = torch.full((i % 7 + 1,), float(i) * weight)
            assert_same(t, want, f"rank {rank} op {i}")


# -- the caller's tensors -------------------------------------------------------------------------
async def caller_tensors_rank(ctx: RankContext) -> list[str]:
    r, n = ctx.rank, ctx.world_size
    peer = (r + 1) % n
    ranks = range(n)
    checked: list[str] = []
    async with ftcomm.Group(
        "gloo", subprocess=True, spare_worker=False, timeout=TIMEOUT, configure_timeout=60
    ) as g:
        await g.configure(ctx.addr(), r, n)

        # A contiguous view that starts past its storage's first element: only
        # its own elements are read and written.
        base = torch.arange(10, dtype=torch.float32) + 100 * r
        view = base[3:7]
        assert view.is_contiguous()
        assert view.storage_offset() == 3
        assert (await g.allreduce(view)) is view
        want = torch.arange(10, dtype=torch.float32) + 100 * r
        want[3:7] = sum(torch.arange(3, 7, dtype=torch.float32) + 100 * k for k in ranks)
        assert_same(base, want, "offset view")
        # A row of a matrix, and a tensor whose size-1 dim has an odd stride.
        m = torch.arange(12, dtype=torch.int64).reshape(3, 4) * (r + 1)
        row = m[1]
        assert (await g.allreduce(row)) is row
        want_m = torch.arange(12, dtype=torch.int64).reshape(3, 4) * (r + 1)
        want_m[1] = torch.arange(4, 8) * sum(k + 1 for k in ranks)
        assert_same(m, want_m, "matrix row")
        odd = torch.empty_strided((4, 1), (1, 9))
        odd.copy_(torch.arange(4.0).reshape(4, 1) + r)
        assert odd.is_contiguous()
        await g.allreduce(odd)
        assert_same(odd, sum(torch.arange(4.0).reshape(4, 1) + k for k in ranks), "odd stride")
        checked.append("offset views")

        # Zero elements: alone, next to a tensor with elements, and gathered.
        empty = torch.empty(0)
        assert (await g.allreduce(empty)) is empty
        assert empty.shape == (0,)
        empty2 = torch.empty(0, 3, dtype=torch.int32)
        assert (await g.allreduce(empty2)).shape == (0, 3)
        mixed = [torch.empty(0), torch.full((2,), float(r + 1)), torch.empty(2, 0)]
        got = await g.allreduce_coalesced(mixed)
        assert [t.shape for t in got] == [(0,), (2,), (2, 0)]
        assert_same(got[1], torch.full((2,), float(sum(k + 1 for k in ranks))), "mixed")
        gathered = await g.allgather(torch.empty(0, dtype=torch.int64))
        assert [(t.shape, t.dtype) for t in gathered] == [((0,), torch.int64)] * n
        checked.append("zero elements")

        # Non-contiguous tensors are refused (the contract: backends may assume
        # contiguous ones), as in process: nothing is sent, nothing is written,
        # and the group stays usable.
        grid = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        for bad in (grid.t(), grid.flatten()[::2], torch.ones(1).expand(3)):
            assert not bad.is_contiguous()
            with pytest.raises(ValueError, match="contiguous"):
                g.allreduce(bad)
        assert_same(grid, torch.arange(6, dtype=torch.float32).reshape(2, 3), "refused")
        assert g.num_active_work() == 0
        assert g.errored() is None
        assert (await g.allreduce(torch.ones(2))).tolist() == [float(n)] * 2
        checked.append("non-contiguous")

        # Inputs only: the caller's tensor is read when the op is issued and
        # never written, even if the caller changes it before the op ends.
        src = torch.tensor([float(r), 42.0])
        ptr = src.data_ptr()
        recv = g.recv(torch.empty(2), (r - 1) % n, tag=3)
        assert (await g.send(src, peer, tag=3)) is None
        assert_same(src, torch.tensor([float(r), 42.0]), "send input")
        assert src.data_ptr() == ptr
        assert_same(await recv, torch.tensor([float((r - 1) % n), 42.0]), "recv")
        src2 = torch.tensor([float(r), 7.0])
        recv = g.recv(torch.empty(2), (r - 1) % n, tag=4)
        send = g.send(src2, peer, tag=4)
        src2.fill_(-1.0)  # after issue: the peer still gets what was there
        await send
        assert_same(src2, torch.full((2,), -1.0), "send input changed after issue")
        assert_same(await recv, torch.tensor([float((r - 1) % n), 7.0]), "recv of issued")
        checked.append("send input")

        inp = torch.tensor([r, 10 * r])
        out = await g.allgather(inp)
        assert_same(inp, torch.tensor([r, 10 * r]), "allgather input")
        assert_same(out, [torch.tensor([k, 10 * k]) for k in ranks], "allgather")
        inp2 = torch.tensor([r, 20 * r])
        work = g.allgather(inp2)
        inp2.fill_(-7)
        assert_same(await work, [torch.tensor([k, 20 * k]) for k in ranks], "allgather issued")
        assert_same(inp2, torch.full((2,), -7), "allgather input changed after issue")
        checked.append("allgather input")

        # Written back as a native op writes: into tensors made in inference
        # mode (an eval loop's metrics), and into a parameter, unrecorded.
        with torch.inference_mode():
            metric = torch.full((3,), float(r + 1))
        weight = torch.nn.Parameter(torch.full((2, 2), float(r + 1)))
        want_sum = float(sum(k + 1 for k in ranks))
        assert (await g.allreduce(metric)) is metric
        assert_same(metric, torch.full((3,), want_sum), "inference tensor")
        assert (await g.allreduce(weight)) is weight
        assert weight.requires_grad
        assert weight.grad_fn is None
        assert_same(weight.detach(), torch.full((2, 2), want_sum), "parameter")
        checked.append("inference and parameters")

        assert g.num_active_work() == 0
        assert g.errored() is None
        assert subprocess_backend(g).worker.dropped == 0
    return checked


def test_caller_tensors_are_copied_in_and_out_correctly() -> None:
    results = run_world(caller_tensors_rank, 2, timeout=90)
    want = [
        "offset views",
        "zero elements",
        "non-contiguous",
        "send input",
        "allgather input",
        "inference and parameters",
    ]
    assert results == [want, want]


# -- the c10d facade: ProcessGroupBabyGloo ------------------------------------------------------
def _facade_allreduce(pg: c10d.ProcessGroup, r: int, n: int) -> list[list[float]]:
    t = torch.tensor([float(r), 1.0])
    work = pg.allreduce([t], dist.AllreduceOptions())
    assert work.wait() is True
    assert work.is_completed()
    u = torch.tensor([float(r + 1)])
    value = pg.allreduce([u], dist.ReduceOp.MAX).get_future().wait()
    assert isinstance(value, list)
    assert value[0] is u
    assert pg.num_active_work() == 0
    return [t.tolist(), u.tolist()]


def baby_gloo_rank(ctx: RankContext) -> dict[str, Any]:
    r, n = ctx.rank, ctx.world_size
    pg = c10d.ProcessGroupBabyGloo(timeout=TIMEOUT)
    out: dict[str, Any] = {}
    try:
        assert pg.getBackendName() == "ftcomm-baby-gloo"
        pg.configure(ctx.addr("a"), "0", r, n)
        assert (pg.rank(), pg.size()) == (r, n)
        first = inspect(pg._group).backend.worker  # type: ignore[union-attr]
        assert first.pid != os.getpid()
        assert _is_my_child(first.pid)
        out["first"] = _facade_allreduce(pg, r, n)
        assert pg.errored() is None

        pg.configure(ctx.addr("b"), "0", r, n)
        second = inspect(pg._group).backend.worker  # type: ignore[union-attr]
        assert second.pid not in (first.pid, os.getpid())
        assert _is_my_child(second.pid)
        # The first worker was killed and reaped (by its group, not by a failure).
        assert first.exited.result(10) is None
        assert first.proc.returncode is not None
        assert second.proc.poll() is None
        out["second"] = _facade_allreduce(pg, r, n)
        assert pg.errored() is None
        assert pg.num_active_work() == 0
        assert pg.getBackendName() == "ftcomm-baby-gloo"
        return out
    finally:
        pg.shutdown()


def test_baby_gloo_facade_allreduces_and_reconfigures_on_a_fresh_worker() -> None:
    n = 2
    results = run_world(baby_gloo_rank, n, timeout=90)
    total = float(sum(range(n)))
    for out in results:
        for key in ("first", "second"):
            assert out[key] == [[total, float(n)], [float(n)]], key
