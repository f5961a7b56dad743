"""Every client of torch.distributed that issue 29 measured, over each facade
group, in four setups: no default group; a default group of torch's made
between the facade's configure() and its register() (issue 35); a default
group of torch's made first (every torchrun job); the facade as the default
group itself (``c10d.register_backends()``, then
``init_process_group("ftcomm-gloo")``).
2 ranks on CPU, each checking against values it computes alone: DDP (plain,
fp16_compress_hook, PowerSGD, no_sync), the ``dist.*`` functions, object
collectives, point-to-point, functional collectives, the rooted functions
and ``monitored_barrier``; FSDP2 and DTensor on a DeviceMesh made from the
group where torch makes one (under a default group; without one, torch
refuses: asserted, so that a torch that lifts it is noticed)."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

import ftcomm
from ftcomm import c10d
from ftcomm.testing import RankContext, run_world

FACADES = ("ProcessGroupGloo", "ProcessGroupBabyGloo")
SETUPS = ("none", "default later", "default first", "the default group")
BACKEND = {"ProcessGroupGloo": "ftcomm-gloo", "ProcessGroupBabyGloo": "ftcomm-baby-gloo"}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(rank: int, micro: int = 0) -> torch.Tensor:
    return torch.arange(8.0).reshape(2, 4) * (rank + 1) / 10 + micro


def _grads(batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """One rank's own gradients, accumulated over ``batches`` (no group)."""
    model = _model()
    for x in batches:
        model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _mean(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [sum(gs) / len(gs) for gs in zip(*per_rank, strict=True)]  # type: ignore[misc]


def _ddp(pg: dist.ProcessGroup, rank: int, how: str) -> list[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    ddp = torch.nn.parallel.DistributedDataParallel(_model(), process_group=pg)
    if how == "fp16":
        ddp.register_comm_hook(pg, default_hooks.fp16_compress_hook)
    if how == "powersgd":
        state = powerSGD_hook.PowerSGDState(pg, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        for _ in range(2):  # past start_powerSGD_iter: the compressed path runs
            ddp(_batch(rank)).square().mean().backward()
            ddp.zero_grad()
    if how == "no_sync":
        with ddp.no_sync():
            ddp(_batch(rank, 1)).square().mean().backward()
    ddp(_batch(rank)).square().mean().backward()
    return [p.grad.clone() for p in ddp.parameters()]  # type: ignore[union-attr]


def _dist(pg: dist.ProcessGroup, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
    out["all_reduce avg"] = t.item()
    into = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(into, torch.tensor([float(rank)]), group=pg)
    out["all_gather"] = [x.item() for x in into]
    flat = torch.zeros(2)
    dist.all_gather_into_tensor(flat, torch.tensor([rank * 10.0]), group=pg)
    out["all_gather_into_tensor"] = flat.tolist()
    one = torch.zeros(1)
    dist.reduce_scatter_tensor(one, torch.tensor([1.0, 2.0]) * (rank + 1), group=pg)
    out["reduce_scatter_tensor"] = one.item()
    b = torch.tensor([float(rank)])
    dist.broadcast(b, group_src=1, group=pg)
    out["broadcast"] = b.item()
    swapped = [torch.zeros(1), torch.zeros(1)]
    dist.all_to_all(swapped, [torch.tensor([rank * 10.0 + d]) for d in range(2)], group=pg)
    out["all_to_all"] = [x.item() for x in swapped]
    dist.barrier(group=pg)
    # objects
    objects: list[Any] = [None, None]
    dist.all_gather_object(objects, {"rank": rank}, group=pg)
    out["all_gather_object"] = objects
    box: list[Any] = [f"from {rank}"]
    dist.broadcast_object_list(box, group_src=0, group=pg)
    out["broadcast_object_list"] = box[0]
    # point to point
    peer = 1 - rank
    got = torch.zeros(1)
    if rank == 0:
        dist.send(torch.tensor([7.0]), group_dst=peer, group=pg)
    else:
        dist.recv(got, group_src=peer, group=pg)
    ops = [
        dist.P2POp(dist.isend, torch.tensor([rank + 100.0]), group=pg, group_peer=peer),
        dist.P2POp(dist.irecv, back := torch.zeros(1), group=pg, group_peer=peer),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["p2p"] = (got.item(), back.item())
    # functional collectives
    out["functional"] = fc.wait_tensor(fc.all_reduce(torch.tensor([rank + 1.0]), "sum", pg)).item()
    # rooted
    r = torch.tensor([rank + 1.0])
    dist.reduce(r, group_dst=0, group=pg)
    gathered = [torch.zeros(1), torch.zeros(1)] if rank == 1 else None
    dist.gather(torch.tensor([rank * 5.0]), gathered, group_dst=1, group=pg)
    piece = torch.zeros(1)
    parts = [torch.tensor([40.0]), torch.tensor([41.0])] if rank == 0 else None
    dist.scatter(piece, parts, group_src=0, group=pg)
    out["rooted"] = (r.item(), [x.item() for x in gathered] if gathered else None, piece.item())
    if dist.get_backend(pg) == "gloo":
        dist.monitored_barrier(pg, timeout=timedelta(seconds=20))
    else:  # torch's own check: Gloo's only (a group torch knows as "ftcomm-gloo")
        with pytest.raises(ValueError, match="only implemented for GLOO"):
            dist.monitored_barrier(pg, timeout=timedelta(seconds=20))
    return out


def _mesh_clients(pg: dist.ProcessGroup, rank: int) -> dict[str, Any]:
    """FSDP2 (one SGD step) and a DTensor redistribution on a mesh of ``pg``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(pg, "cpu")
    try:
        model = _model()
        fully_shard(model, mesh=mesh)
        model(_batch(rank)).square().mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad  # type: ignore[operator]
        params = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
        spread = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
        whole = spread.redistribute(mesh, [Replicate()]).to_local()
        return {"fsdp params": params, "dtensor": whole.tolist()}
    finally:
        del mesh  # DeviceMesh holds the default group in reference cycles


def _battery(pg: dist.ProcessGroup, rank: int, with_default: bool) -> dict[str, Any]:
    out: dict[str, Any] = {how: _ddp(pg, rank, how) for how in ("plain", "fp16", "no_sync")}
    out["powersgd"] = _ddp(pg, rank, "powersgd")
    out.update(_dist(pg, rank))
    if with_default:
        out.update(_mesh_clients(pg, rank))
    else:
        from torch.distributed.device_mesh import DeviceMesh

        with pytest.raises((RuntimeError, ValueError)):  # torch needs a default group
            DeviceMesh.from_group(pg, "cpu")
    return out


def matrix_rank(ctx: RankContext, facade: str, setups: tuple[str, ...]) -> dict[str, Any]:
    """The battery in each of ``setups``, in turn: without a default group;
    with one of torch's made first; with one made after configure() and
    before register(). (At most one with a default group a process: torch's
    DTensor caches keep meshes equal to an earlier one, with its group names.)"""
    results: dict[str, Any] = {}
    pg = getattr(c10d, facade)(timeout=30)
    try:
        for setup in setups:
            if setup == "default first":
                store = dist.PrefixStore(f"{ctx.world_id}/default", ctx.store)
                dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=2)
            pg.configure(ctx.addr(setup.replace(" ", "-")), "0", ctx.rank, 2)
            if setup == "default later":
                store = dist.PrefixStore(f"{ctx.world_id}/default", ctx.store)
                dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=2)
            pg.register(f"matrix-{setup.replace(' ', '-')}")
            try:
                results[setup] = _battery(pg, ctx.rank, setup != "none")
            finally:
                pg.unregister()
            results[setup]["errored"] = pg.errored()
    finally:
        pg.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    return results


def as_default_rank(ctx: RankContext, facade: str) -> dict[str, Any]:
    """The battery with the facade as the default group. (A process of its
    own: torch's DTensor caches keep meshes equal to an earlier one, with
    that one's group names.)"""
    results: dict[str, Any] = {}
    assert c10d.register_backends() == c10d.register_backends()  # again: nothing changes
    store = dist.PrefixStore(f"{ctx.world_id}/ftcomm-default", ctx.store)
    dist.init_process_group(
        BACKEND[facade], store=store, rank=ctx.rank, world_size=2, timeout=timedelta(seconds=30)
    )
    try:
        default = dist.group.WORLD
        assert type(default) is getattr(c10d, facade)
        first_prefix = _prefix(default)
        results["the default group"] = _battery(default, ctx.rank, with_default=True)
        results["the default group"]["errored"] = default.errored()
        sub = dist.new_group([0, 1], backend=BACKEND[facade])
        one = torch.ones(1)
        dist.all_reduce(one, group=sub)
        results["the default group"]["new_group"] = (type(sub).__name__, one.item())
    finally:
        dist.destroy_process_group()
    results["shut down"] = repr(default)
    # made again in the same store (torch gives it the same namespace): a
    # prefix of its own, not the last one's
    dist.init_process_group(BACKEND[facade], store=store, rank=ctx.rank, world_size=2)
    try:
        again = torch.tensor([ctx.rank + 1.0])
        dist.all_reduce(again)
        results["again"] = (again.item(), _prefix(dist.group.WORLD) != first_prefix)
    finally:
        dist.destroy_process_group()
    return results


def _close(got: list[torch.Tensor], want: list[torch.Tensor], where: str, **tol: float) -> None:
    assert len(got) == len(want), where
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, msg=where, **tol)


def _fsdp_reference() -> list[torch.Tensor]:
    """One SGD step of the whole model on both ranks' batches (their mean)."""
    model = _model()
    for rank in range(2):
        (model(_batch(rank)).square().mean() / 2).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad  # type: ignore[operator]
    return [p.detach().clone() for p in model.parameters()]


def _check_battery(ranks: list[dict[str, Any]], setup: str, facade: str) -> None:
    """What every rank's battery in ``setup`` must have given."""
    exact = _mean([_grads([_batch(r)]) for r in range(2)])
    accumulated = _mean([_grads([_batch(r, 1), _batch(r)]) for r in range(2)])
    for rank in range(2):
        out, where = ranks[rank][setup], f"{facade}, {setup}, rank {rank}"
        assert out["errored"] is None, where
        _close(out["plain"], exact, f"{where}: DDP")
        _close(out["fp16"], exact, f"{where}: DDP fp16_compress_hook", rtol=1e-3, atol=1e-3)
        _close(out["no_sync"], accumulated, f"{where}: DDP no_sync")
        assert out["all_reduce avg"] == 1.5, where
        assert out["all_gather"] == [0.0, 1.0], where
        assert out["all_gather_into_tensor"] == [0.0, 10.0], where
        assert out["reduce_scatter_tensor"] == [3.0, 6.0][rank], where
        assert out["broadcast"] == 1.0, where
        assert out["all_to_all"] == [float(rank), 10.0 + rank], where
        assert out["all_gather_object"] == [{"rank": 0}, {"rank": 1}], where
        assert out["broadcast_object_list"] == "from 0", where
        assert out["p2p"] == ((0.0 if rank == 0 else 7.0), 100.0 + (1 - rank)), where
        assert out["functional"] == 3.0, where
        reduced = 3.0 if rank == 0 else 2.0  # a rank that is not the root keeps its own
        assert out["rooted"] == (reduced, [0.0, 5.0] if rank == 1 else None, 40.0 + rank)
    # PowerSGD's low-rank gradients are its own: the same on both ranks
    _close(ranks[0][setup]["powersgd"], ranks[1][setup]["powersgd"], f"{setup}: PowerSGD")


@pytest.mark.slow
@pytest.mark.parametrize("facade", FACADES)
def test_every_client_over_a_facade_group_with_and_without_a_default_group(facade: str) -> None:
    ranks = run_world(matrix_rank, 2, args=(facade, ("none", "default first")), timeout=150)
    _check_mesh_clients(ranks, "default first", facade)
    for rank in range(2):
        assert "fsdp params" not in ranks[rank]["none"]
    _check_battery(ranks, "none", facade)
    _check_battery(ranks, "default first", facade)


@pytest.mark.slow
@pytest.mark.parametrize("facade", FACADES)
def test_every_client_over_a_facade_configured_before_the_default_group(facade: str) -> None:
    """configure(), then init_process_group(), then register(): register()
    finds the members' default-group ranks (it was a one-rank view)."""
    # "none" first in each world: torch's first DDP in a process keeps
    # state for the process's life, with the default group's sockets in it
    # where there is one then (torch 2.13; not ftcomm's to close)
    ranks = run_world(matrix_rank, 2, args=(facade, ("none", "default later")), timeout=150)
    _check_mesh_clients(ranks, "default later", facade)
    _check_battery(ranks, "default later", facade)


def _check_mesh_clients(ranks: list[dict[str, Any]], setup: str, facade: str) -> None:
    reference = _fsdp_reference()
    for rank in range(2):
        out = ranks[rank][setup]
        _close(out["fsdp params"], reference, f"{facade}, {setup}, rank {rank}: FSDP2")
        assert out["dtensor"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.slow
@pytest.mark.parametrize("facade", FACADES)
def test_every_client_over_a_facade_that_is_the_default_group(facade: str) -> None:
    """``c10d.register_backends()``, then ``init_process_group("ftcomm-gloo")``:
    no group of torch's at all; DeviceMesh, FSDP2 and DTensor on ftcomm's."""
    ranks = run_world(as_default_rank, 2, args=(facade,), timeout=150)
    _check_battery(ranks, "the default group", facade)
    _check_mesh_clients(ranks, "the default group", facade)
    for rank in range(2):
        out = ranks[rank]["the default group"]
        assert out["new_group"] == (facade, 2.0)
        assert "closed" in ranks[rank]["shut down"]  # destroy_process_group shut it down
        assert ranks[rank]["again"] == (3.0, True)


def _prefix(pg: Any) -> str:
    """Where a configured facade met (its group's store prefix)."""
    found = re.search(r"store=\S+/(ftcomm/backend/[0-9a-f]+)", repr(pg.parent))
    assert found, repr(pg.parent)
    return found.group(1)


def _alone(ctx: RankContext) -> str:
    """Rank 0 of two, the other never comes: CommTimeout at init's timeout,
    and the prefix key taken back (the next making does not read it)."""
    c10d.register_backends()
    store = dist.PrefixStore(f"{ctx.world_id}/alone", ctx.store)
    store.set("marker", "1")  # so that the listing below is seen to see this prefix
    started = time.monotonic()
    with pytest.raises(ftcomm.CommTimeout, match="ranks meet in the store timed out"):
        dist.init_process_group(
            "ftcomm-gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=1)
        )
    took = time.monotonic() - started
    assert 1.0 <= took < 10.0, took
    assert not dist.is_initialized()
    mine = [k for k in ctx.store.list_keys() if k.startswith(f"{ctx.world_id}/alone/")]
    assert f"{ctx.world_id}/alone/marker" in mine, mine
    leftover = [k for k in mine if "ftcomm/backend-prefix" in k]
    return f"timed out, left {leftover}"


def test_a_member_that_never_comes_is_a_timeout_that_leaves_no_key() -> None:
    assert run_world(_alone, 1, timeout=60) == ["timed out, left []"]


def _hash_store(ctx: RankContext) -> str:
    c10d.register_backends()
    with pytest.raises(
        ValueError, match="meet at a TCPStore's address; this job's store is a Hash"
    ):
        dist.init_process_group("ftcomm-gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()
    return "refused"


def test_a_job_store_that_is_not_a_tcp_store_is_refused_clearly() -> None:
    assert run_world(_hash_store, 1, timeout=60) == ["refused"]
