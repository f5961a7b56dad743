"""The c10d facade: torchft's classes on ftcomm's core, where c10d users put a group.

World size 1 in this process (dummy and Gloo), every collective at world
size 3 in real processes, ``torch.distributed.*`` and functional collectives
on a registered group, DDP against a single-process reference, deadlines
against a hung peer, and a rank that leaves mid-run.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from helpers import ScriptedOp, StoreServer, free_port, issue
from torch._C._distributed_c10d import AllgatherOptions

import ftcomm
from ftcomm import c10d
from ftcomm._runtime.loop import get_runtime
from ftcomm._runtime.table import OpTable
from ftcomm.c10d._work import Finish, OpWork
from ftcomm.testing import Fault, FaultPlan, RankContext, run_world

SEED_CLASSES = [
    "ProcessGroup",
    "ProcessGroupWrapper",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupXCCL",
    "ProcessGroupDummy",
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedProcessGroup",
]


_prefixes = iter(range(10**6))


def addr(server: StoreServer) -> str:
    return f"127.0.0.1:{server.port}/t{next(_prefixes)}"


@pytest.fixture
def gloo1(store: StoreServer) -> Iterator[c10d.ProcessGroupGloo]:
    pg = c10d.ProcessGroupGloo(timeout=timedelta(seconds=10))
    pg.configure(addr(store), "0", 0, 1)
    yield pg
    pg.shutdown()


@pytest.fixture
def dummy() -> Iterator[c10d.ProcessGroupDummy]:
    pg = c10d.ProcessGroupDummy(0, 1)
    yield pg
    pg.shutdown()


# -- the surface ----------------------------------------------------------------
def test_every_seed_class_is_a_documented_c10d_process_group() -> None:
    for name in SEED_CLASSES:
        cls = getattr(c10d, name)
        assert issubclass(cls, dist.ProcessGroup), name
        assert (cls.__doc__ or "").strip(), name
        assert name in c10d.__all__
    assert callable(c10d.create_store_client)
    for name in c10d.__all__:
        assert getattr(c10d, name).__doc__, name


def test_create_store_client_scopes_to_the_prefix(store: StoreServer) -> None:
    client = c10d.create_store_client(f"127.0.0.1:{store.port}/a/b", timedelta(seconds=5))
    client.set("k", b"v")
    raw = c10d.create_store_client(f"127.0.0.1:{store.port}/", timedelta(seconds=5))
    assert raw.get("a/b/k") == b"v"
    del client, raw
    with pytest.raises(ValueError, match="store_addr"):
        c10d.create_store_client("no-port", timedelta(seconds=1))
    with pytest.raises(ValueError, match="timeout"):
        c10d.create_store_client(f"127.0.0.1:{store.port}/a", timedelta(seconds=-1))


# -- world size 1, in this process --------------------------------------------------
def all_ops_ws1(pg: c10d.ProcessGroup) -> dict[str, list[float]]:
    """Every collective on a one-rank group; each checked through wait() and the future."""
    out: dict[str, list[float]] = {}

    def run(name: str, work: dist.Work, result: Any) -> None:
        assert isinstance(work, dist.Work), name
        assert work.wait() is True, name
        assert work.is_completed(), name
        value = work.get_future().wait()
        if result is not None:
            assert value is result or value == result, name
        flat = result
        while isinstance(flat, list):
            flat = flat[0]
        if isinstance(flat, torch.Tensor):
            out[name] = flat.flatten().tolist()

    t = torch.tensor([1.0, 2.0])
    ts = [t]
    run("allreduce", pg.allreduce(ts, dist.AllreduceOptions()), ts)
    ts2 = [torch.tensor([3.0])]
    run("allreduce_op", pg.allreduce(ts2, dist.ReduceOp.MAX), ts2)
    co = [torch.ones(2), torch.ones(3)]
    run("allreduce_coalesced", pg.allreduce_coalesced(co, dist.AllreduceCoalescedOptions()), co)
    outs = [[torch.zeros(2)]]
    run("allgather", pg.allgather(outs, [t], AllgatherOptions()), outs)
    outs2 = [torch.zeros(2)]
    run(
        "allgather_into_tensor_coalesced",
        pg.allgather_into_tensor_coalesced(outs2, [t], AllgatherOptions()),
        outs2,
    )
    o = torch.zeros(2)
    run("_allgather_base", pg._allgather_base(o, t, AllgatherOptions()), [o])
    b = [torch.tensor([5.0])]
    run("broadcast", pg.broadcast(b, dist.BroadcastOptions()), b)
    run("broadcast_one", pg.broadcast_one(b[0], 0), b)
    rs_out = [torch.zeros(2)]
    rs = pg.reduce_scatter(rs_out, [[torch.tensor([7.0, 8.0])]], dist.ReduceScatterOptions())
    run("reduce_scatter", rs, rs_out)
    rsc = [torch.zeros(1)]
    work = pg.reduce_scatter_tensor_coalesced(
        rsc, [torch.tensor([9.0])], dist.ReduceScatterOptions()
    )
    run("reduce_scatter_tensor_coalesced", work, rsc)
    rsb = torch.zeros(2)
    work = pg._reduce_scatter_base(rsb, torch.tensor([4.0, 6.0]), dist.ReduceScatterOptions())
    run("_reduce_scatter_base", work, [rsb])
    a_out = torch.zeros(3)
    a2a = pg.alltoall_base(a_out, torch.tensor([1.0, 2.0, 3.0]), [], [], dist.AllToAllOptions())
    run("alltoall_base", a2a, [a_out])
    run("barrier", pg.barrier(dist.BarrierOptions()), None)
    return out


WS1_EXPECTED = {
    "allreduce": [1.0, 2.0],
    "allreduce_op": [3.0],
    "allreduce_coalesced": [1.0, 1.0],
    "allgather": [1.0, 2.0],
    "allgather_into_tensor_coalesced": [1.0, 2.0],
    "_allgather_base": [1.0, 2.0],
    "broadcast": [5.0],
    "broadcast_one": [5.0],
    "reduce_scatter": [7.0, 8.0],
    "reduce_scatter_tensor_coalesced": [9.0],
    "_reduce_scatter_base": [4.0, 6.0],
    "alltoall_base": [1.0, 2.0, 3.0],
}


def test_every_op_at_world_size_1_dummy(dummy: c10d.ProcessGroupDummy) -> None:
    assert all_ops_ws1(dummy) == WS1_EXPECTED
    assert (dummy.size(), dummy.rank(), dummy.getBackendName()) == (1, 0, "ftcomm-dummy")
    assert dummy.errored() is None
    dummy.configure("ignored:1/x", "0", 0, 1)
    assert dummy.configure_count == 1


def test_every_op_at_world_size_1_gloo(gloo1: c10d.ProcessGroupGloo) -> None:
    assert all_ops_ws1(gloo1) == WS1_EXPECTED
    assert (gloo1.size(), gloo1.rank(), gloo1.getBackendName()) == (1, 0, "ftcomm-gloo")
    assert gloo1.num_active_work() == 0
    assert isinstance(gloo1.parent, ftcomm.Group)


def test_the_dummy_writes_lists_sized_for_another_world_into_any_output(
    dummy: c10d.ProcessGroupDummy,
) -> None:
    """A call sized for another world (torchft's managed dummy) copies each
    input to its output as a native op writes: into a parameter, unrecorded,
    and into a tensor made in inference mode."""
    with torch.inference_mode():
        made_in_inference = torch.zeros(2)
    weight = torch.nn.Parameter(torch.zeros(2))
    src = torch.tensor([1.0, 2.0])
    for out in (made_in_inference, weight):
        dummy.allgather([[out, torch.zeros(2)]], [src]).wait()  # lists for a world of 2
        assert out.tolist() == [1.0, 2.0]  # paired with the one input
    assert weight.grad_fn is None
    assert dummy.errored() is None


def test_dummy_is_world_size_1_only() -> None:
    with pytest.raises(ValueError, match="rank 0 and world size 1"):
        c10d.ProcessGroupDummy(0, 2)
    with pytest.raises(ValueError, match="rank 0 and world size 1"):
        c10d.ProcessGroupDummy(1, 1)


def test_set_timeout_reaches_the_next_configure(gloo1: c10d.ProcessGroupGloo) -> None:
    gloo1.set_timeout(timedelta(seconds=1))  # the group was built with 10 s
    started = time.monotonic()
    with pytest.raises(ftcomm.CommError):
        gloo1.configure(f"127.0.0.1:{free_port()}/nobody", "0", 0, 1)
    assert time.monotonic() - started < 1 + 1.5


def test_unconfigured_group_says_so() -> None:
    pg = c10d.ProcessGroupGloo()
    assert "unconfigured" in repr(pg)
    assert pg.errored() is None
    assert pg.num_active_work() == 0
    with pytest.raises(ftcomm.NotConfigured, match="allreduce"):
        pg.allreduce([torch.ones(1)], dist.AllreduceOptions())
    with pytest.raises(ftcomm.NotConfigured):
        pg.size()
    pg.abort()
    pg.shutdown()  # both fine on an unconfigured group


def test_repr_names_class_and_state(gloo1: c10d.ProcessGroupGloo) -> None:
    text = repr(gloo1)
    assert text.startswith("ProcessGroupGloo(")
    assert "rank=0/1" in text
    assert " ready" in text
    gloo1.abort(errored=False)
    assert "errored" in repr(gloo1)
    assert repr(c10d.ProcessGroup(0, 1)) == "ProcessGroup()"
    wrapped = c10d.ProcessGroupWrapper(pg=gloo1)
    assert repr(wrapped) == f"ProcessGroupWrapper(pg={gloo1!r})"


def test_base_class_is_a_contract() -> None:
    base = c10d.ProcessGroup(0, 1)
    with pytest.raises(NotImplementedError, match="allreduce"):
        base.allreduce([torch.ones(1)], dist.AllreduceOptions())
    with pytest.raises(NotImplementedError, match="configure"):
        base.configure("h:1/p", "0", 0, 1)
    assert base.errored() is None
    base.abort()
    base.shutdown()


def test_wrapper_without_backend_needs_a_pg() -> None:
    with pytest.raises(NotImplementedError, match="pass pg="):
        c10d.ProcessGroupWrapper().configure("127.0.0.1:1/p", "0", 0, 1)
    with pytest.raises(TypeError, match=r"pg must be an ftcomm\.c10d ProcessGroup"):
        c10d.ProcessGroupWrapper(pg=object())  # type: ignore[arg-type]


def test_wrapper_passes_everything_to_its_pg(store: StoreServer) -> None:
    inner = c10d.ProcessGroupGloo(timeout=10)
    pg = c10d.ProcessGroupWrapper(pg=inner)
    try:
        pg.configure(addr(store), "0", 0, 1)
        assert (pg.size(), pg.rank(), pg.getBackendName()) == (1, 0, "ftcomm-gloo")
        assert pg.parent is inner
        t = torch.ones(2)
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        pg.abort()
        assert isinstance(inner.errored(), ftcomm.CommAborted)
        assert pg.errored() is inner.errored()
    finally:
        pg.shutdown()
    assert inner.errored() is None  # shut down: unconfigured, nothing errored


@pytest.mark.parametrize(
    "cls",
    [
        c10d.ProcessGroupNCCL,
        c10d.ProcessGroupXCCL,
        c10d.ProcessGroupBabyNCCL,
        c10d.ProcessGroupBabyXCCL,
    ],
)
def test_accelerator_groups_construct_and_fail_clearly(
    cls: type[c10d.ProcessGroupWrapper],
) -> None:
    pg = cls(timeout=timedelta(seconds=5))
    name = cls._backend
    baby = "baby-" if cls._subprocess else ""
    assert pg.getBackendName() == f"ftcomm-{baby}{name}"
    # This torch (a CPU build) has neither; with one, see tests/test_accelerator.py.
    with pytest.raises(RuntimeError, match=f"needs a torch build with {name.upper()}"):
        pg.configure("127.0.0.1:1/p", "0", 0, 1)
    assert pg.errored() is None


# -- works ----------------------------------------------------------------------------
def test_future_and_wait_agree_on_errors(gloo1: c10d.ProcessGroupGloo) -> None:
    gloo1.abort()
    with pytest.raises(ftcomm.CommAborted):
        gloo1.allreduce([torch.ones(1)], dist.AllreduceOptions())
    assert isinstance(gloo1.errored(), ftcomm.CommAborted)


@pytest.fixture
def table() -> Iterator[OpTable]:
    t = OpTable(get_runtime(), rank=0, on_break=lambda error, until: None)
    yield t
    t.break_(ftcomm.CommAborted("test over"))


def test_op_work_waits_and_completes_its_future(table: OpTable) -> None:
    op = ScriptedOp()
    value = [torch.ones(1)]
    work = OpWork(issue(table, op, timeout=30), value)
    fut = work.get_future()
    assert work.get_future() is fut  # one future per work
    assert not work.is_completed()
    assert not fut.done()
    finisher = threading.Timer(0.05, op.finish)
    finisher.start()
    assert work.wait() is True
    finisher.join()
    assert work.is_completed()
    assert work.is_success()
    assert fut.wait() is value
    assert work.result() is value


def test_op_work_error_reaches_wait_and_future(table: OpTable) -> None:
    op = ScriptedOp()
    work = OpWork(issue(table, op, timeout=30), [])
    fut = work.get_future()
    op.finish(RuntimeError("connection reset by peer"))
    with pytest.raises(ftcomm.CommFailed, match="connection reset") as waited:
        work.wait()
    # A torch future holds C++ errors (DDP's reducer reads them in C++): a
    # RuntimeError that names the ftcomm error and carries its message.
    with pytest.raises(RuntimeError, match=re.escape(f"CommFailed: {waited.value}")):
        fut.wait()
    assert table.error is waited.value


def test_op_work_wait_timeout_is_a_deadline(table: OpTable) -> None:
    op = ScriptedOp()  # never finishes
    work = OpWork(issue(table, op, timeout=30), [])
    fut = work.get_future()
    started = time.monotonic()
    with pytest.raises(ftcomm.CommTimeout, match=r"wait\(timeout=0\.2 s\)"):
        work.wait(timedelta(seconds=0.2))
    assert 0.19 <= time.monotonic() - started < 1.2
    assert isinstance(table.error, ftcomm.CommTimeout)  # the group is aborted
    with pytest.raises(RuntimeError, match="CommTimeout: allreduce did not complete"):
        fut.wait()
    with pytest.raises(ValueError, match="timeout"):
        work.wait(-1.0)


def test_op_work_refuses_to_block_the_owner_loop(table: OpTable) -> None:
    op = ScriptedOp()
    work = OpWork(issue(table, op, timeout=30), [])

    async def wait_on_loop() -> bool:
        return bool(work.wait())

    rt = get_runtime()
    with pytest.raises(RuntimeError, match="owner loop"):
        rt.call(wait_on_loop())
    op.finish()
    assert rt.call(wait_on_loop()) is True  # an ended op returns at once, anywhere


def test_a_deadline_completes_the_future_while_every_worker_is_blocked(
    table: OpTable,
) -> None:
    """Hung point-to-point waits can fill ftcomm's worker pool; a future settled
    by a deadline must not queue behind them."""
    rt = get_runtime()
    release = threading.Event()
    blockers = [rt.run_blocking(release.wait, 30) for _ in range(16)]
    try:
        work = OpWork(issue(table, ScriptedOp(), timeout=0.2), [])
        fut = work.get_future()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="CommTimeout"):
            fut.wait()
        assert time.monotonic() - started < 2.0
    finally:
        release.set()
        for blocker in blockers:
            blocker.result(5)


def test_op_work_future_callbacks_never_run_on_the_owner_loop(table: OpTable) -> None:
    """A deadline settles the op on the owner loop; a slow user callback must
    not stall it (the watchdog would fail this test)."""
    op = ScriptedOp()
    work = OpWork(issue(table, op, timeout=0.1), [])
    ran = threading.Event()
    names: list[str] = []

    def callback(_: object) -> None:
        names.append(threading.current_thread().name)
        time.sleep(0.3)  # a callback doing real work, longer than the stall threshold
        ran.set()

    work.get_future().add_done_callback(callback)
    assert ran.wait(10)
    assert names
    assert names[0] != "ftcomm-owner"
    assert isinstance(table.error, ftcomm.CommTimeout)


def test_timeout_arguments_are_checked(gloo1: c10d.ProcessGroupGloo) -> None:
    work = gloo1.allreduce([torch.ones(1)], dist.AllreduceOptions())
    assert work.wait(timedelta(0)) is True  # c10d's "no timeout"
    with pytest.raises(TypeError, match="timeout"):
        gloo1.set_timeout("1s")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        gloo1.set_timeout(timedelta(seconds=-1))
    gloo1.set_timeout(timedelta(seconds=3))
    assert gloo1.parent.timeout == 3.0  # type: ignore[union-attr]


# -- registry: functional collectives and torch.distributed ------------------------------
def test_register_and_unregister(dummy: c10d.ProcessGroupDummy) -> None:
    with pytest.raises(ValueError, match="register"):
        _ = dummy.group_name
    assert dummy.register("reg1") is dummy
    assert dummy.group_name == "ftcomm-dummy:reg1"
    x = fc.all_reduce(torch.ones(2), "sum", dummy)
    assert torch.equal(fc.wait_tensor(x), torch.ones(2))
    y = fc.all_reduce(torch.full((2,), 3.0), "sum", "ftcomm-dummy:reg1")
    assert torch.equal(fc.wait_tensor(y), torch.full((2,), 3.0))
    with pytest.raises(ValueError, match="registered already"):
        dummy.register("reg1")
    other = c10d.ProcessGroupDummy()
    try:
        with pytest.raises(ValueError, match="registered already"):
            other.register("reg1")
    finally:
        other.shutdown()
    dummy.unregister()
    with pytest.raises(ValueError, match="register"):
        _ = dummy.group_name
    with pytest.raises(RuntimeError, match="ftcomm-dummy:reg1"):
        fc.all_reduce(torch.ones(2), "sum", "ftcomm-dummy:reg1")
    with pytest.raises(ValueError, match="not registered"):
        dummy.unregister()
    # unregister() does not shut the group down (torchft's did)
    assert dummy.allreduce([torch.ones(1)], dist.AllreduceOptions()).wait()
    with pytest.raises(TypeError, match="name"):
        dummy.register(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        dummy.register("")


def test_ddp_at_world_size_1(dummy: c10d.ProcessGroupDummy) -> None:
    grads = ddp_grads(dummy, rank=0, world_size=1)
    assert_close_to_reference(grads, world_size=1)


# -- DDP -----------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _batch(rank: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10 + rank


def ddp_grads(pg: dist.ProcessGroup, rank: int, world_size: int) -> list[torch.Tensor]:
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    for _ in range(2):  # the second step runs on the reducer's rebuilt buckets
        ddp.zero_grad()
        ddp(_batch(rank)).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_close_to_reference(grads: list[torch.Tensor], world_size: int) -> None:
    model = _model()
    batch = torch.cat([_batch(r) for r in range(world_size)])
    # DDP averages per-rank means: the mean over the concatenated batch.
    model(batch).pow(2).mean().backward()
    ref = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(ref) == len(grads)
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def ddp_rank(ctx: RankContext) -> list[torch.Tensor]:
    pg = c10d.ProcessGroupGloo(timeout=20)
    try:
        pg.configure(ctx.addr(), "0", ctx.rank, ctx.world_size)
        return ddp_grads(pg, ctx.rank, ctx.world_size)
    finally:
        pg.shutdown()


def test_ddp_at_world_size_2_matches_a_single_process() -> None:
    results = run_world(ddp_rank, 2, timeout=90)
    for grads in results:
        assert_close_to_reference(grads, world_size=2)


# -- every collective at world size 3, and torch.distributed / functional on top ----------
def collectives_rank(ctx: RankContext) -> dict[str, Any]:
    r, n = ctx.rank, ctx.world_size
    pg = c10d.ProcessGroupGloo(timeout=20)
    out: dict[str, Any] = {}
    try:
        pg.configure(ctx.addr(), "0", r, n)
        assert (pg.rank(), pg.size()) == (r, n)
        t = torch.tensor([float(r), 1.0])
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        out["allreduce"] = t.tolist()
        m = [torch.tensor([float(r)])]
        out["allreduce_max"] = pg.allreduce(m, dist.ReduceOp.MAX).get_future().wait()[0].tolist()
        co = [torch.full((2,), float(r)), torch.full((1,), 1.0)]
        pg.allreduce_coalesced(co, dist.AllreduceCoalescedOptions()).wait()
        out["allreduce_coalesced"] = [c.tolist() for c in co]
        outs = [[torch.zeros(1) for _ in range(n)]]
        pg.allgather(outs, [torch.tensor([float(r)])], AllgatherOptions()).wait()
        out["allgather"] = [o.item() for o in outs[0]]
        big = torch.zeros(n)
        pg._allgather_base(big, torch.tensor([float(r * 10)]), AllgatherOptions()).wait()
        out["_allgather_base"] = big.tolist()
        cat = [torch.zeros(n)]
        pg.allgather_into_tensor_coalesced(
            cat, [torch.tensor([r + 0.5])], AllgatherOptions()
        ).wait()
        out["allgather_into_tensor_coalesced"] = cat[0].tolist()
        b = torch.tensor([float(r)])
        opts = dist.BroadcastOptions()
        opts.rootRank = n - 1
        pg.broadcast([b], opts).wait()
        out["broadcast"] = b.item()
        rs = [torch.zeros(1)]
        ins = [[torch.tensor([float(10 * d + r)]) for d in range(n)]]
        pg.reduce_scatter(rs, ins, dist.ReduceScatterOptions()).wait()
        out["reduce_scatter"] = rs[0].item()
        rsb = torch.zeros(1)
        pg._reduce_scatter_base(
            rsb, torch.arange(n, dtype=torch.float32), dist.ReduceScatterOptions()
        ).wait()
        out["_reduce_scatter_base"] = rsb.item()
        a2a = torch.zeros(n)
        src = torch.tensor([float(100 * r + d) for d in range(n)])
        pg.alltoall_base(a2a, src, [], [], dist.AllToAllOptions()).wait()
        out["alltoall_base"] = a2a.tolist()
        pg.barrier(dist.BarrierOptions()).wait()
        ring = torch.tensor([float(r)])
        got = torch.zeros(1)
        send = pg.send([ring], (r + 1) % n, 7)
        pg.recv([got], (r - 1) % n, 7).wait()
        send.wait()
        out["ring"] = got.item()

        # torch.distributed and functional collectives on the registered group
        pg.register("world3")
        x = torch.tensor([1.0, float(r)])
        dist.all_reduce(x, group=pg)
        out["dist.all_reduce"] = x.tolist()
        parts = [torch.zeros(1) for _ in range(n)]
        dist.all_gather(parts, torch.tensor([float(r)]), group=pg)
        out["dist.all_gather"] = [p.item() for p in parts]
        y = torch.tensor([float(r)])
        dist.broadcast(y, src=1, group=pg)  # no default group: global == group ranks
        out["dist.broadcast"] = y.item()
        whole = torch.zeros(n)
        dist.all_gather_into_tensor(whole, torch.tensor([float(r)]), group=pg)
        out["dist.all_gather_into_tensor"] = whole.tolist()
        mine = torch.zeros(1)
        dist.reduce_scatter_tensor(mine, torch.ones(n) * (r + 1), group=pg)
        out["dist.reduce_scatter_tensor"] = mine.item()
        dist.barrier(group=pg)
        w = dist.all_reduce(torch.ones(1), group=pg, async_op=True)
        assert w is not None
        assert w.wait()
        out["fc.all_reduce"] = fc.wait_tensor(
            fc.all_reduce(torch.tensor([float(r)]), "sum", pg)
        ).tolist()
        out["fc.all_reduce_by_name"] = fc.wait_tensor(
            fc.all_reduce(torch.tensor([1.0]), "max", pg.group_name)
        ).tolist()
        out["fc.all_gather_tensor"] = fc.wait_tensor(
            fc.all_gather_tensor(torch.tensor([float(r)]), 0, pg)
        ).tolist()
        out["fc.reduce_scatter_tensor"] = fc.wait_tensor(
            fc.reduce_scatter_tensor(torch.ones(n) * r, "sum", 0, pg)
        ).tolist()
        pg.unregister()
        return out
    finally:
        pg.shutdown()


@pytest.mark.slow
def test_every_collective_at_world_size_3() -> None:
    n = 3
    results = run_world(collectives_rank, n, timeout=90)
    total = float(sum(range(n)))
    for r, out in enumerate(results):
        assert out["allreduce"] == [total, float(n)]
        assert out["allreduce_max"] == [float(n - 1)]
        assert out["allreduce_coalesced"] == [[total] * 2, [float(n)]]
        assert out["allgather"] == [0.0, 1.0, 2.0]
        assert out["_allgather_base"] == [0.0, 10.0, 20.0]
        assert out["allgather_into_tensor_coalesced"] == [0.5, 1.5, 2.5]
        assert out["broadcast"] == float(n - 1)
        assert out["reduce_scatter"] == float(sum(10 * r + s for s in range(n)))
        assert out["_reduce_scatter_base"] == float(r * n)
        assert out["alltoall_base"] == [float(100 * s + r) for s in range(n)]
        assert out["ring"] == float((r - 1) % n)
        assert out["dist.all_reduce"] == [float(n), total]
        assert out["dist.all_gather"] == [0.0, 1.0, 2.0]
        assert out["dist.broadcast"] == 1.0
        assert out["dist.all_gather_into_tensor"] == [0.0, 1.0, 2.0]
        assert out["dist.reduce_scatter_tensor"] == float(sum(range(1, n + 1)))
        assert out["fc.all_reduce"] == [total]
        assert out["fc.all_reduce_by_name"] == [1.0]
        assert out["fc.all_gather_tensor"] == [0.0, 1.0, 2.0]
        assert out["fc.reduce_scatter_tensor"] == [total]


# -- deadlines against a hung peer ---------------------------------------------------------
DEADLINE = 0.5


def hung_peer_rank(ctx: RankContext) -> dict[str, Any]:
    pg = c10d.ProcessGroupGloo(timeout=30)
    report: dict[str, Any] = {}
    threads: list[str] = []  # where the future's callback ran
    done = threading.Event()
    future_text = ""
    try:
        for i, variant in enumerate(("opts", "wait", "set_timeout", "future", "abort")):
            pg.configure(ctx.addr(f"h{i}"), "0", ctx.rank, 2)
            pg.allreduce([torch.ones(1)], dist.AllreduceOptions()).wait()  # both healthy
            if ctx.rank == 1:
                ctx.wait_for_blocking(f"h{i}-done")
                continue
            t = torch.ones(1)
            started = time.monotonic()
            try:
                if variant == "opts":
                    opts = dist.AllreduceOptions()
                    opts.timeout = timedelta(seconds=DEADLINE)
                    pg.allreduce([t], opts).wait()
                elif variant == "wait":
                    pg.allreduce([t], dist.AllreduceOptions()).wait(timedelta(seconds=DEADLINE))
                elif variant == "set_timeout":
                    pg.set_timeout(
                        timedelta(seconds=DEADLINE)
                    )  # the next op, not the next configure
                    pg.allreduce([t], dist.AllreduceOptions()).wait()
                elif variant == "abort":  # another thread aborts a 30 s op
                    aborter = threading.Timer(DEADLINE, pg.abort)
                    aborter.start()
                    try:
                        pg.allreduce([t], dist.AllreduceOptions()).wait()
                    finally:
                        aborter.join()
                        pg.abort()  # twice: a no-op
                else:
                    opts = dist.AllreduceOptions()
                    opts.timeout = timedelta(seconds=DEADLINE)
                    fut = pg.allreduce([t], opts).get_future()
                    fut.add_done_callback(
                        lambda _: (threads.append(threading.current_thread().name), done.set())
                    )
                    try:
                        fut.wait()
                    except RuntimeError as exc:  # the future's C++ error names the ftcomm one
                        future_text = str(exc)
                    raise pg.errored() or AssertionError("the future failed, errored() is None")
            except ftcomm.CommError as exc:
                error = exc
            else:
                raise AssertionError(f"{variant}: an op against a hung peer returned")
            elapsed = time.monotonic() - started
            errored = pg.errored()
            # errored() says the group is aborted after the error the caller
            # got (its cause), or is the abort's own
            same = (
                isinstance(errored, ftcomm.CommAborted)  # the abort's own
                if variant == "abort"
                else errored is error  # what the test raised
                if variant == "future"
                else errored is not None
                and errored.__cause__ is error
                and type(errored) is type(error)
                and "aborted" in str(errored)
            )
            entry = {"error": type(error).__name__, "elapsed": elapsed, "errored": same}
            if variant == "future":
                assert done.wait(5)
                entry["callback_thread"] = threads[0]
                entry["future_text"] = future_text
            try:
                pg.allreduce([torch.ones(1)], dist.AllreduceOptions())
            except ftcomm.CommAborted:
                entry["next"] = "CommAborted"
            report[variant] = entry
            pg.set_timeout(timedelta(seconds=30))
            ctx.signal(f"h{i}-done")
        pg.configure(ctx.addr("after"), "0", ctx.rank, 2)
        t = torch.ones(1)
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        assert t.item() == 2.0
        assert pg.errored() is None
        return report
    finally:
        pg.shutdown()


@pytest.mark.slow
def test_hung_peer_every_deadline_kind() -> None:
    report = run_world(hung_peer_rank, 2, timeout=90)[0]
    assert set(report) == {"opts", "wait", "set_timeout", "future", "abort"}
    for name, entry in report.items():
        assert entry["error"] == ("CommAborted" if name == "abort" else "CommTimeout"), (
            name,
            entry,
        )
        assert DEADLINE - 0.01 <= entry["elapsed"] < DEADLINE + 1.0, (name, entry)
        assert entry["errored"], (name, entry)  # errored() names the error the caller got
        assert entry["next"] == "CommAborted", (name, entry)
    # A deadline settles on the owner loop: user callbacks run elsewhere.
    assert report["future"]["callback_thread"] != "ftcomm-owner"
    assert "CommTimeout: allreduce did not complete" in report["future"]["future_text"]


# -- resiliency: one rank leaves mid-run -------------------------------------------------------
LEAVER_TIMEOUT = 2.0


def leaver_rank(ctx: RankContext, how: str) -> dict[str, Any] | None:
    # Configures get a generous timeout (each connects to the store, which
    # can wait a second on a reverse DNS lookup: tests/conftest.py); the ops
    # under test get LEAVER_TIMEOUT.
    pg = c10d.ProcessGroupGloo(timeout=30)
    try:
        pg.configure(ctx.addr("all"), "0", ctx.rank, 3)
        pg.set_timeout(timedelta(seconds=LEAVER_TIMEOUT))
        for step in range(3):
            t = torch.ones(2)
            pg.allreduce([t], dist.AllreduceOptions()).wait()
            assert t.tolist() == [3.0, 3.0], step
        if ctx.rank == 2 and how == "shutdown":
            pg.shutdown()
            return None
        # In "kill", rank 2 dies at its next op (the plan's op 3).
        started = time.monotonic()
        try:
            for _ in range(3):
                pg.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()
        except ftcomm.CommError as exc:
            failed = type(exc).__name__
        else:
            raise AssertionError("the survivors' op succeeded without rank 2")
        elapsed = time.monotonic() - started
        errored = pg.errored()
        pg.set_timeout(timedelta(seconds=30))
        pg.configure(ctx.addr("survivors"), "0", ctx.rank, 2)
        t = torch.ones(2)
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        return {
            "failed": failed,
            "elapsed": elapsed,
            "errored": type(errored).__name__,
            "after": t.tolist(),
        }
    finally:
        pg.shutdown()


@pytest.mark.parametrize("how", ["shutdown", "kill"])
def test_survivors_fail_fast_and_reconfigure(how: str) -> None:
    plan = FaultPlan.of(Fault.kill(2, 3)) if how == "kill" else None
    expect = {2: -9} if how == "kill" else None
    results = run_world(leaver_rank, 3, args=(how,), plan=plan, expect_exit=expect, timeout=60)
    for survivor in results[:2]:
        assert survivor is not None
        assert survivor["failed"] in ("CommFailed", "CommTimeout"), survivor
        assert survivor["elapsed"] < LEAVER_TIMEOUT + 1.0, survivor
        assert survivor["errored"] == survivor["failed"], survivor
        assert survivor["after"] == [2.0, 2.0]


# -- bad input: a clear error naming the problem; the group and the tensors untouched -------
def _bad_calls() -> dict[str, tuple[type[Exception], str, Any]]:
    t = torch.ones(2)
    opts = dist.AllreduceOptions()
    rooted = dist.BroadcastOptions()
    rooted.rootTensor = 1
    far = dist.BroadcastOptions()
    far.rootRank = 5
    band = dist.AllreduceOptions()  # the options path checks the op like any other
    band.reduceOp = dist.ReduceOp.BAND
    return {
        "bitwise on floats": (
            ValueError,
            "integer or bool",
            lambda pg: pg.allreduce([torch.ones(2)], band),
        ),
        "two tensors": (ValueError, "exactly one", lambda pg: pg.allreduce([t, t], opts)),
        "not a list": (TypeError, "tensors must be a list", lambda pg: pg.allreduce(42, opts)),
        "no tensors": (ValueError, "exactly one", lambda pg: pg.allreduce([], opts)),
        "bad opts": (TypeError, "opts", lambda pg: pg.allreduce([t], "sum")),
        "wrong opts": (TypeError, "opts", lambda pg: pg.allreduce([t], dist.BarrierOptions())),
        "int tensor avg": (
            ValueError,
            "AVG.* needs floating point",
            lambda pg: pg.allreduce([torch.ones(2, dtype=torch.int64)], dist.ReduceOp.AVG),
        ),
        "root tensor": (ValueError, "rootTensor", lambda pg: pg.broadcast([t], rooted)),
        "root rank": (ValueError, "root", lambda pg: pg.broadcast([t], far)),
        "allgather outs": (
            ValueError,
            "out",
            lambda pg: pg.allgather([[torch.ones(2), torch.ones(2)]], [t], AllgatherOptions()),
        ),
        "allgather shape": (
            ValueError,
            "out",
            lambda pg: pg.allgather([[torch.ones(3)]], [t], AllgatherOptions()),
        ),
        "alltoall splits": (
            ValueError,
            "split",
            lambda pg: pg.alltoall_base(
                torch.ones(2), torch.ones(2), [1, 1], [2], dist.AllToAllOptions()
            ),
        ),
        "send to self": (ValueError, "dst", lambda pg: pg.send([t], 0, 0)),
        "recv from self": (ValueError, "src", lambda pg: pg.recv([t], 0, 0)),
        "numpy": (TypeError, "tensor", lambda pg: pg.allreduce([t.numpy()], opts)),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_is_refused_and_harmless(gloo1: c10d.ProcessGroupGloo, case: str) -> None:
    error, pattern, call = _bad_calls()[case]
    before = torch.ones(2)
    with pytest.raises(error, match=pattern):
        call(gloo1)
    assert gloo1.errored() is None
    assert gloo1.num_active_work() == 0
    t = torch.ones(2)
    assert gloo1.allreduce([t], dist.AllreduceOptions()).wait()  # still usable
    assert torch.equal(t, before)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        pytest.param(("127.0.0.1/nope", "0", 0, 1), {}, ValueError, "has no port", id="no port"),
        pytest.param(("127.0.0.1:1/p", "0", 2, 2), {}, ValueError, "rank must be < world_size",
                     id="rank past the world"),
        pytest.param(("127.0.0.1:1/p", "0", 0, 0), {}, ValueError, "world_size must be >= 1",
                     id="world_size 0"),
        pytest.param(("127.0.0.1:1/p", 0, 0, 1), {}, TypeError, "replica_id must be a str",
                     id="replica_id not a str"),
        pytest.param(("127.0.0.1:1/p", "0", "0", 1), {}, TypeError, "rank must be an int",
                     id="rank not an int"),
        pytest.param(("127.0.0.1:1/p", "0", 0, 1), {"global_ranks": [3, 3]}, ValueError,
                     "global_ranks", id="repeated global_ranks"),
    ],
)  # fmt: skip
def test_bad_configure_keeps_the_previous_configuration(
    gloo1: c10d.ProcessGroupGloo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    before = repr(gloo1)
    with pytest.raises(error, match=match):
        gloo1.configure(*args, **kwargs)
    assert repr(gloo1) == before
    assert gloo1.allreduce([torch.ones(1)], dist.AllreduceOptions()).wait()


def test_configure_on_an_unreachable_store_fails_in_time() -> None:
    pg = c10d.ProcessGroupGloo(timeout=timedelta(seconds=1))
    port = free_port()
    started = time.monotonic()
    with pytest.raises(ftcomm.CommError, match=f"127.0.0.1:{port}"):
        pg.configure(f"127.0.0.1:{port}/p", "0", 0, 1)
    assert time.monotonic() - started < 1 + 1.5
    assert pg.errored() is None
    pg.shutdown()


# -- DDP survives a dead peer: the error surfaces, the survivors carry on -------------------
DRILL_TIMEOUT = 3.0


def ddp_drill_rank(ctx: RankContext) -> dict[str, Any]:
    r = ctx.rank
    pg = c10d.ProcessGroupGloo(timeout=30)  # for the configures (see leaver_rank)
    try:
        pg.configure(ctx.addr("three"), "0", r, 3)
        pg.set_timeout(timedelta(seconds=DRILL_TIMEOUT))
        model = _model()
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
        for _ in range(2):
            ddp.zero_grad()
            ddp(_batch(r)).pow(2).mean().backward()
        if r == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            for _ in range(3):  # the peer's death surfaces at the latest by the deadline
                ddp.zero_grad()
                ddp(_batch(r)).pow(2).mean().backward()
        except RuntimeError as exc:
            failed = f"{type(exc).__name__}: {exc}"
        else:
            raise AssertionError("backward succeeded without rank 2")
        elapsed = time.monotonic() - started
        errored = pg.errored()
        # The trainer's recovery: reconfigure the same group, rebuild DDP on it.
        pg.set_timeout(timedelta(seconds=30))
        pg.configure(ctx.addr("two"), "0", r, 2)
        grads = ddp_grads(pg, r, 2)
        return {
            "failed": failed,
            "elapsed": elapsed,
            "errored": type(errored).__name__,
            "grads": grads,
        }
    finally:
        pg.shutdown()


@pytest.mark.slow
def test_ddp_survivors_recover_from_a_dead_peer() -> None:
    results = run_world(ddp_drill_rank, 3, expect_exit={2: -9}, timeout=90)
    for survivor in results[:2]:
        assert survivor["errored"] in ("CommFailed", "CommTimeout"), survivor
        assert survivor["errored"] in survivor["failed"] or "rank=" in survivor["failed"]
        assert survivor["elapsed"] < DRILL_TIMEOUT + 1.0, survivor
        assert_close_to_reference(survivor["grads"], world_size=2)


# -- DeviceMesh, with a default process group (torchft's setting) ----------------------------
def device_mesh_rank(ctx: RankContext) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    store = dist.PrefixStore(f"{ctx.world_id}/default", ctx.store)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size)
    pg = c10d.ProcessGroupGloo(timeout=20)
    try:
        # group ranks the other way round from the global ones
        pg.configure(ctx.addr(), "0", ctx.world_size - 1 - ctx.rank, ctx.world_size)
        pg.register("mesh")
        out: dict[str, Any] = {"ranks": dist.get_process_group_ranks(pg)}
        mesh = DeviceMesh.from_group(pg, "cpu")
        out.update(mesh_group_is_pg=mesh.get_group() is pg, mesh=mesh.mesh.tolist())
        del mesh  # DeviceMesh holds the default group in reference cycles
        total = torch.tensor([ctx.rank + 1.0])
        dist.all_reduce(total, group=pg)
        out["all_reduce"] = total.tolist()
        t = torch.tensor([float(ctx.rank)])
        dist.broadcast(t, src=0, group=pg)  # global rank 0
        u = torch.tensor([float(ctx.rank)])
        dist.broadcast(u, group_src=0, group=pg)  # group rank 0: global rank 1
        out["broadcast"] = (t.item(), u.item())
        out["group_rank"] = dist.get_rank(pg)
        pg.unregister()
        return out
    finally:
        pg.shutdown()
        dist.destroy_process_group()


def test_device_mesh_and_dist_calls_see_the_groups_real_ranks() -> None:
    """Under a default group, the registered group is entered with its
    members' global ranks (found at configure): src is global, group_src
    the group's, and DeviceMesh's mesh names the real ranks."""
    results = run_world(device_mesh_rank, 2, timeout=60)
    for rank, out in enumerate(results):
        assert out == {
            "ranks": [1, 0],
            "mesh_group_is_pg": True,
            "mesh": [1, 0],
            "all_reduce": [3.0],
            "broadcast": (0.0, 1.0),
            "group_rank": 1 - rank,
        }


def wrapped_after_configure_rank(ctx: RankContext) -> dict[str, Any]:
    store = dist.PrefixStore(f"{ctx.world_id}/default", ctx.store)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size)
    inner = c10d.ProcessGroupGloo(timeout=20)
    try:
        inner.configure(ctx.addr(), "0", 1 - ctx.rank, 2)  # group ranks the other way round
        wrapper = c10d.ErrorSwallowingProcessGroupWrapper(inner)  # built after the configure
        wrapper.register("wrapped")
        out: dict[str, Any] = {"ranks": dist.get_process_group_ranks(wrapper)}
        t = torch.tensor([float(ctx.rank)])
        dist.broadcast(t, src=1, group=wrapper)  # global rank 1: group rank 0
        out.update(broadcast=t.item(), error=wrapper.error())
        # the wrapped group configured again, directly: the wrapper follows
        inner.configure(ctx.addr("again"), "0", ctx.rank, 2)
        out["ranks again"] = dist.get_process_group_ranks(wrapper)
        u = torch.tensor([float(ctx.rank)])
        dist.broadcast(u, src=1, group=wrapper)
        out["broadcast again"] = u.item()
        wrapper.unregister()
        return out
    finally:
        inner.shutdown()
        dist.destroy_process_group()


def test_a_wrapper_registered_after_its_group_was_configured_has_its_ranks() -> None:
    """The wrapper's ranks are the wrapped group's as they are now, not a
    copy taken at the wrapper's own configure (review: it was entered as
    this rank alone, and the peers translated src differently)."""
    results = run_world(wrapped_after_configure_rank, 2, timeout=60)
    assert (
        results
        == [
            {
                "ranks": [1, 0],
                "broadcast": 1.0,
                "error": None,
                "ranks again": [0, 1],
                "broadcast again": 1.0,
            }
        ]
        * 2
    )


def default_group_on_one_side_rank(ctx: RankContext) -> list[float]:
    if ctx.rank == 0:  # a default world of its own; its peer has none
        store = dist.PrefixStore(f"{ctx.world_id}/own", ctx.store)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    pg = c10d.ProcessGroupGloo(timeout=20)
    try:
        pg.configure(ctx.addr(), "0", ctx.rank, 2)
        t = torch.tensor([ctx.rank + 1.0])
        pg.allreduce([t]).wait()
        return t.tolist()
    finally:
        pg.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_members_with_and_without_a_default_group_configure_alike() -> None:
    """configure()'s exchange of default-group ranks runs on every member,
    default group or not (review: only the member with one ran it, so its
    peer's first op met that exchange and both timed out)."""
    assert run_world(default_group_on_one_side_rank, 2, timeout=60) == [[3.0], [3.0]]


def exchange_superseded_rank(ctx: RankContext, how: str) -> dict[str, Any]:
    """Rank 1 is slow to its exchange of default-group ranks; meanwhile rank
    0's configure is superseded, by abort() or by another configure()."""
    from ftcomm.c10d import _registry

    store = dist.PrefixStore(f"{ctx.world_id}/default", ctx.store)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size)
    connect, reached = _registry.connect_store, threading.Event()

    def slow_or_seen(*args: Any) -> Any:
        if ctx.rank == 1:
            time.sleep(5)  # rank 0's configure would wait up to its 20 s for this
        reached.set()
        return connect(*args)

    _registry.connect_store = slow_or_seen  # type: ignore[assignment]
    pg = c10d.ProcessGroupGloo(timeout=20)
    out: dict[str, Any] = {}
    try:
        if ctx.rank == 1:
            pg.configure(ctx.addr("g0"), "0", 1, 2)
            return out
        ended: list[Any] = []

        def first() -> None:
            try:
                pg.configure(ctx.addr("g0"), "0", 0, 2)
                ended.append("returned")
            except ftcomm.CommError as exc:
                ended.append(exc)
            ended.append(time.monotonic())

        thread = threading.Thread(target=first)
        thread.start()
        assert reached.wait(20)  # the first configure is at its exchange
        superseded_at = time.monotonic()
        if how == "abort":
            pg.abort()
        else:
            pg.configure(ctx.addr("g1"), "0", 0, 1)
        thread.join(30)
        out["first"] = type(ended[0]).__name__
        out["took"] = ended[1] - superseded_at
        out["errored"] = type(pg.errored()).__name__ if pg.errored() else None
        if how == "configure":  # the newer configuration is untouched
            t = torch.ones(1)
            pg.allreduce([t]).wait()
            out["after"] = t.item()
        return out
    finally:
        pg.shutdown()
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["abort", "configure"])
def test_a_configure_superseded_during_its_rank_exchange_ends_at_once(how: str) -> None:
    """Review: the exchange ignored abort() (configure went on to its
    timeout), and a superseded configure that timed out aborted the newer
    configuration."""
    out = run_world(exchange_superseded_rank, 2, args=(how,), timeout=90)[0]
    assert out["first"] == "CommAborted", out
    assert out["took"] < 3.0, out  # not the 5 s rank 1 takes, nor the 20 s timeout
    if how == "abort":
        assert out["errored"] == "CommAborted", out
    else:
        assert (out["errored"], out["after"]) == (None, 1.0), out


# -- a work's finish step (all_to_all's copy out), and all_to_all at one rank ------------
def test_a_finish_step_runs_once_and_a_second_caller_waits_for_it() -> None:
    """Forced interleaving: the first caller is held inside the step; the
    second (wait() and the future on two threads, say) must not return
    before the step ended, and the step runs once."""
    entered, release, runs = threading.Event(), threading.Event(), []

    def step() -> None:
        runs.append(1)
        entered.set()
        release.wait(10)

    finish = Finish(step)
    first = threading.Thread(target=finish.run, args=(True,))
    first.start()
    assert entered.wait(10)
    calling, order = threading.Event(), []

    def second_caller() -> None:
        calling.set()
        finish.run(True)
        order.append("second returned")

    second = threading.Thread(target=second_caller)
    second.start()
    assert calling.wait(10)
    # the second caller is in run() or about to be: give it time to return
    # wrongly, then end the step; it must return only after that
    second.join(0.2)
    order.append("step ended")
    release.set()
    first.join(10)
    second.join(10)
    assert order == ["step ended", "second returned"]
    assert runs == [1]


def test_a_finish_step_that_fails_fails_every_caller_alike() -> None:
    def step() -> None:
        raise RuntimeError("the copy out failed")

    finish = Finish(step)
    errors = []
    for _ in range(3):
        with pytest.raises(RuntimeError, match="the copy out failed") as info:
            finish.run(True)
        errors.append(info.value)
    assert errors[0] is errors[1] is errors[2]
    assert finish.error is errors[0]


def test_all_to_all_at_one_rank_and_on_the_dummy(gloo1: c10d.ProcessGroupGloo) -> None:
    # outputs that require grad, as c10d's own backends allow
    out = torch.zeros(3, requires_grad=True)
    work = gloo1.alltoall([out], [torch.arange(3.0)])
    assert work.is_completed() or work.wait()
    assert work.is_success()
    assert out.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="input_tensors must hold 1 tensors"):
        gloo1.alltoall([torch.zeros(1)], [])
    with pytest.raises(TypeError, match=r"input_tensors\[0\] must be a tensor, got str"):
        gloo1.alltoall([torch.zeros(1)], ["x"])  # type: ignore[list-item]
    assert gloo1.errored() is None
    # ManagedProcessGroup over the dummy sizes its lists for the manager's world
    dummy = c10d.ProcessGroupDummy(0, 1)
    try:
        outs = [torch.zeros(2) for _ in range(3)]
        dummy.alltoall(outs, [torch.full((2,), float(i)) for i in range(3)]).wait()
        assert [t.tolist() for t in outs] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    finally:
        dummy.shutdown()


def test_a_facade_answers_torchs_backend_look_with_a_stand_in_without_capabilities() -> None:
    """torch looks for a group's native backend (init_process_group's
    device_id, FSDP2's allocation, split_group): a facade has none torch
    could drive, and says so for every device rather than failing."""
    for pg, name in (
        (c10d.ProcessGroupNCCL(), "ftcomm-nccl"),
        (c10d.ProcessGroupGloo(), "ftcomm-gloo"),
    ):
        for device in (torch.device("cpu"), torch.device("cuda", 0)):
            native = pg._get_backend(device)
            assert native.name() == name
            capabilities = ("splitting", "coalescing", "tensor_alloc", "time_estimate")
            assert [getattr(native, f"supports_{c}") for c in capabilities] == [False] * 4
