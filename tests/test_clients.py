"""torch's own clients over a registered facade group, under a default group
(every torchrun job): FSDP2 (with and without mixed precision), DTensor and
DCP on a DeviceMesh made from the group, each run twice in the same ranks,
once over the facade and once over torch's own Gloo group of the same
members, and the two compared."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftcomm import c10d
from ftcomm.testing import RankContext, run_world

FACADES = ("ProcessGroupGloo", "ProcessGroupBabyGloo")


def _fsdp_step(mesh: Any, rank: int, mixed: bool) -> dict[str, Any]:
    """One FSDP2 step of a two-layer model, the same seed on every rank and
    a batch of each rank's own: the gradients and parameters every rank
    ends with (the full tensors: gathered over the mesh)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": policy} if mixed else {"mesh": mesh}
    fully_shard(model[0], **kwargs)
    fully_shard(model, **kwargs)
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
            return {
                "torch": want,
                "ftcomm": _clients(pg, ctx.rank, Path(tmp) / "ftcomm"),
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
