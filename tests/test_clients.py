"""torch's own clients over a registered facade group, under a default group
(every torchrun job): FSDP2 (with and without mixed precision), DTensor and
DCP on a DeviceMesh made from the group, each run twice in the same ranks,
once over the facade and once over torch's own Gloo group of the same
members, and the two compared; and examples/fsdp2_fault_tolerant.py, whose
replicas survive one of them killed and restarted."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftcomm import c10d
from ftcomm.testing import RankContext, run_world

FACADES = ("ProcessGroupGloo", "ProcessGroupBabyGloo")


def _fsdp_step(
    mesh: Any, rank: int, mixed: bool, divide_factor: float | None = None
) -> dict[str, Any]:
    """One FSDP2 step of a two-layer model, the same seed on every rank and
    a batch of each rank's own: the gradients and parameters every rank
    ends with (the full tensors: gathered over the mesh). A divide factor
    other than the mesh's size makes FSDP2 reduce with PREMUL_SUM."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": policy} if mixed else {"mesh": mesh}
    fully_shard(model[0], **kwargs)
    fully_shard(model, **kwargs)
    if divide_factor is not None:  # each FSDP module's own (the call is not recursive)
        for module in (model[0], model):
            module.set_gradient_divide_factor(divide_factor)  # type: ignore[operator]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    model(torch.randn(4, 8)).square().sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr]
    optimizer.step()
    return {"grads": grads, "params": [p.full_tensor().detach() for p in model.parameters()]}


def _dtensor(mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    sharded = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    mine = torch.arange(8.0).reshape(4, 2) * (mesh.get_local_rank() + 1)  # a pending sum
    return {
        "local": sharded.to_local().clone(),
        "full": sharded.full_tensor(),  # allgather
        "to_columns": sharded.redistribute(mesh, [Shard(1)]).to_local().clone(),  # alltoall
        "summed": DTensor.from_local(mine, mesh, [Partial()]).full_tensor(),  # allreduce
        "scattered": DTensor.from_local(mine, mesh, [Partial()])
        .redistribute(mesh, [Shard(0)])  # reduce_scatter
        .to_local()
        .clone(),
    }


def _dcp(mesh: Any, group: dist.ProcessGroup, path: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    saved = {"w": distribute_tensor(torch.arange(8.0) * 3, mesh, [Shard(0)]), "step": 7}
    dcp.save(saved, checkpoint_id=str(path), process_group=group)
    loaded = {"w": distribute_tensor(torch.zeros(8), mesh, [Shard(0)]), "step": 0}
    dcp.load(loaded, checkpoint_id=str(path), process_group=group)
    return {"w": loaded["w"].full_tensor(), "step": loaded["step"]}


def _clients(group: dist.ProcessGroup, rank: int, path: Path) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, "cpu")
    try:
        return {
            "fsdp": _fsdp_step(mesh, rank, mixed=False),
            "fsdp_mixed": _fsdp_step(mesh, rank, mixed=True),
            "dtensor": _dtensor(mesh),
            "dcp": _dcp(mesh, group, path),
        }
    finally:
        del mesh  # DeviceMesh holds the default group in reference cycles


def clients_rank(ctx: RankContext, facade: str, tmp: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    store = dist.PrefixStore(f"{ctx.world_id}/default", ctx.store)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size)
    pg = getattr(c10d, facade)(timeout=30)
    try:
        pg.configure(ctx.addr(), "0", ctx.rank, ctx.world_size)
        pg.register("clients")
        reference = dist.new_group(backend="gloo")  # torch's own, the same members
        want = _clients(reference, ctx.rank, Path(tmp) / "torch")
        # torch's clients keep the groups they ran on in caches of their own
        # (seen for each of FSDP2, DTensor and DCP): torch's group stays open
        # while this process lives. The leak check covers the ftcomm run.
        del reference
        gc.collect()
        ctx.baseline()
        try:
            got = _clients(pg, ctx.rank, Path(tmp) / "ftcomm")
            # FSDP2 with a divide factor of 4 on 2 ranks: a PREMUL_SUM(1/4),
            # which torch's own Gloo refuses; the mean halved, bit for bit
            mesh = DeviceMesh.from_group(pg, "cpu")
            quarter = _fsdp_step(mesh, ctx.rank, mixed=False, divide_factor=4.0)["grads"]
            del mesh
            halved = [g / 2 for g in want["fsdp"]["grads"]]
            return {
                "torch": want,
                "ftcomm": got,
                "premul": (quarter, halved),
                "errored": pg.errored(),
            }
        finally:
            pg.unregister()
    finally:
        pg.shutdown()
        dist.destroy_process_group()
        # FSDP's modules, DTensors and meshes hold the groups in reference
        # cycles: torch's own group's sockets close when they are collected
        gc.collect()


def _assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, where
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)
    else:
        assert got == want, where


@pytest.mark.slow
@pytest.mark.parametrize("facade", FACADES)
def test_fsdp2_dtensor_and_dcp_match_torchs_own_group(facade: str, tmp_path: Path) -> None:
    ranks = run_world(clients_rank, 2, args=(facade, str(tmp_path)), timeout=120)
    for rank, out in enumerate(ranks):
        assert out["errored"] is None, out["errored"]
        _assert_same(out["ftcomm"], out["torch"], f"rank {rank}")
        _assert_same(*out["premul"], f"rank {rank}, divide factor 4")
    ftcomm_0, ftcomm_1 = ranks[0]["ftcomm"], ranks[1]["ftcomm"]
    # Not a pair of no-ops: the step reduced both ranks' batches, so the
    # ranks agree on gradients they could not have computed alone, and the
    # parameters moved.
    _assert_same(ftcomm_0["fsdp"], ftcomm_1["fsdp"], "ranks 0 and 1")
    assert any(g.abs().sum() > 0 for g in ftcomm_0["fsdp"]["grads"])
    full = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(ftcomm_0["dtensor"]["full"], full)
    assert torch.equal(ftcomm_1["dtensor"]["local"], full[3:])
    assert torch.equal(ftcomm_1["dtensor"]["to_columns"], full[:, 1:])
    pending = torch.arange(8.0).reshape(4, 2)
    assert torch.equal(ftcomm_0["dtensor"]["summed"], 3 * pending)  # ranks' factors 1 + 2
    assert torch.equal(ftcomm_1["dtensor"]["scattered"], 3 * pending[2:])
    assert torch.equal(ftcomm_0["dcp"]["w"], torch.arange(8.0) * 3)
    assert ftcomm_1["dcp"]["step"] == 7


# -- HSDP: FSDP2 inside each replica, the replicate dimension an ftcomm group ------------------
def _hsdp_model(mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    return model


def _train(
    model: torch.nn.Module,
    rank: int,
    steps: range,
    failed: Callable[[], bool] = lambda: False,
) -> None:
    """SGD steps on a batch of this rank's own per step; a step whose
    reduction ``failed()`` is skipped (its gradients dropped)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, 8)).square().sum().backward()
        if not failed():
            optimizer.step()
        optimizer.zero_grad()


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach() for p in model.parameters()]


def hsdp_rank(ctx: RankContext) -> dict[str, Any] | None:
    """Two replicas of two ranks: mesh [[0, 1], [2, 3]] (replicate, shard).
    The shard dimension is each replica's torch group; the replicate one an
    ftcomm group per shard index (ErrorSwallowing: a replica that dies makes
    the survivors' step a no-op they can see, not an exception inside
    backward, which leaves FSDP's state half-way). Replica 1 dies after
    three steps; replica 0 skips the failed step, reconfigures its
    replicate groups alone and trains on with the same model and mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    r = ctx.rank
    replica, shard = divmod(r, 2)
    store = dist.PrefixStore(f"{ctx.world_id}/default", ctx.store)
    dist.init_process_group("gloo", store=store, rank=r, world_size=4)
    # torch's own groups, every rank creating each (new_group's rule); see
    # clients_rank for why they are left out of the leak check
    shard_pg = [dist.new_group([0, 1]), dist.new_group([2, 3])][replica]
    torch_replicate = [dist.new_group([0, 2]), dist.new_group([1, 3])][shard]
    layout = {"mesh": [[0, 1], [2, 3]], "mesh_dim_names": ("replicate", "shard")}
    reference = DeviceMesh.from_group([torch_replicate, shard_pg], "cpu", **layout)
    want = _hsdp_model(reference)
    _train(want, r, range(3))
    out: dict[str, Any] = {"want3": _full(want)}
    del want, reference
    gc.collect()
    ctx.baseline()

    replicate = c10d.ErrorSwallowingProcessGroupWrapper(c10d.ProcessGroupGloo(timeout=20))
    try:
        replicate.configure(ctx.addr(f"replicate{shard}"), "0", replica, 2)
        replicate.register(f"replicate{shard}")
        mesh = DeviceMesh.from_group([replicate, shard_pg], "cpu", **layout)

        def failed() -> bool:
            """Whether any rank of this replica saw its replicate group fail:
            the replica's ranks skip a step together or not at all."""
            flag = torch.tensor([replicate.error() is not None], dtype=torch.int32)
            dist.all_reduce(flag, dist.ReduceOp.MAX, group=shard_pg)
            return bool(flag.item())

        model = _hsdp_model(mesh)
        _train(model, r, range(3), failed)
        out["got3"] = _full(model)
        if replica == 1:
            os._exit(0)  # the replica dies between two steps
        _train(model, r, range(3, 4), failed)  # its replicate allreduce fails
        out["error"] = type(replicate.error()).__name__
        out["after_failed_step"] = _full(model)
        replicate.configure(ctx.addr(f"replicate{shard}-alone"), "0", 0, 1)
        _train(model, r, range(4, 6), failed)
        out["got6"] = _full(model)
        out["errored"] = replicate.error()
        # What replica 0 alone does from the same parameters: FSDP over its
        # shard group only, torch's own.
        alone = _hsdp_model(DeviceMesh.from_group(shard_pg, "cpu"))
        with torch.no_grad():
            for p, value in zip(alone.parameters(), out["got3"], strict=True):
                p.to_local().copy_(value.chunk(2)[shard])  # Shard(0), even sizes
        _train(alone, r, range(4, 6))
        out["want6"] = _full(alone)
        replicate.unregister()
        del mesh, model, alone
        return out
    finally:
        replicate.shutdown()
        dist.destroy_process_group()
        gc.collect()


@pytest.mark.slow
def test_hsdp_over_an_ftcomm_replicate_group_goes_on_after_a_replica_dies() -> None:
    ranks = run_world(hsdp_rank, 4, expect_exit={2: 0, 3: 0}, timeout=120)
    for rank in (0, 1):
        out = ranks[rank]
        # before the fault: as torch's own replicate groups would have it
        _assert_same(out["got3"], out["want3"], f"rank {rank}, step 3")
        # the failed step is seen and changes nothing
        assert out["error"] == "CommFailed", out["error"]
        _assert_same(out["after_failed_step"], out["got3"], f"rank {rank}, failed step")
        # then: the survivors' replica trains as a replica of its own would
        assert out["errored"] is None, out["errored"]
        _assert_same(out["got6"], out["want6"], f"rank {rank}, step 6")
        assert not all(torch.equal(a, b) for a, b in zip(out["got6"], out["got3"], strict=True))
    _assert_same(ranks[0]["got6"], ranks[1]["got6"], "ranks 0 and 1")
    assert ranks[2:] == [None, None]


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fsdp2_fault_tolerant.py"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_fsdp2_example_carries_on_and_the_restarted_replica_rejoins_with_the_state() -> None:
    """Two replicas of two FSDP2 shards; replica 1 is killed at step 10 and
    restarted; it gets replica 0's parameters and Adam state, and both end
    with the same bits (the example checks each of these and exits 1 else)."""
    # a session of its own: on a timeout its spawned replicas go with it
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--timeout", "150"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the example ran past 180 s:\n{out}")
    assert proc.returncode == 0, out
    assert "RECOVERED" in out, out
    assert "FAIL" not in out, out
    assert "allreduce raised CommFailed" in out, out  # the kill was seen, not missed
