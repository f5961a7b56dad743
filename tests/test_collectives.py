"""Every collective of the contract, checked against expected values.

World sizes 1, 2 and 3 in real processes, on both event loops; the dummy
backend in this process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ftcomm
from ftcomm.testing import LOOPS, RankContext, run_world


async def every_collective(ctx: RankContext) -> dict[str, Any]:
    r, n = ctx.rank, ctx.world_size
    async with ftcomm.Group("gloo", timeout=20) as g:
        await g.configure(ctx.addr(), r, n)
        assert (g.rank, g.size()) == (r, n)
        out: dict[str, Any] = {}

        t = torch.arange(4, dtype=torch.float32) + r
        assert (await g.allreduce(t)) is t
        out["allreduce"] = t
        out["allreduce_max"] = await g.allreduce(torch.tensor([float(r)]), "max")
        out["allreduce_coalesced"] = await g.allreduce_coalesced(
            [torch.full((2,), float(r + 1)), torch.full((3,), 10.0 * (r + 1))]
        )
        out["allgather"] = await g.allgather(torch.tensor([r, 10 * r]))
        outs = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
        gathered = await g.allgather(torch.tensor([r, r]), out=outs)
        assert all(a is b for a, b in zip(gathered, outs, strict=True))
        out["allgather_into_tensor_coalesced"] = await g.allgather_into_tensor_coalesced(
            [torch.empty(2 * n), torch.empty(n, dtype=torch.int32)],
            [torch.full((2,), float(r)), torch.tensor([r + 100], dtype=torch.int32)],
        )
        out["broadcast"] = await g.broadcast(torch.tensor([float(r)] * 3), root=n - 1)
        out["reduce_scatter"] = await g.reduce_scatter(
            torch.empty(2), [torch.full((2,), float(dst * 10 + r)) for dst in range(n)]
        )
        out["reduce_scatter_tensor_coalesced"] = await g.reduce_scatter_tensor_coalesced(
            [torch.empty(2), torch.empty(1)],
            [torch.arange(2 * n, dtype=torch.float32) * (r + 1), torch.ones(n)],
        )
        # Equal splits: slot d of rank r's input goes to rank d.
        out["alltoall"] = await g.alltoall_base(
            torch.empty(n), torch.tensor([float(100 * r + d) for d in range(n)])
        )
        # Uneven splits: rank r sends d+1 copies of its value to rank d.
        in_splits = [d + 1 for d in range(n)]
        out_splits = [r + 1] * n
        out["alltoall_uneven"] = await g.alltoall_base(
            torch.empty(sum(out_splits)),
            torch.full((sum(in_splits),), float(r)),
            out_splits,
            in_splits,
        )
        assert (await g.barrier()) is None
        if n > 1:
            # A ring: send to the next rank, receive from the previous one.
            nxt, prv = (r + 1) % n, (r - 1) % n
            recv = g.recv(torch.empty(2), prv, tag=7)
            send = g.send(torch.tensor([float(r), 42.0]), nxt, tag=7)
            assert (await send) is None
            out["recv"] = await recv
        assert g.errored() is None
        assert g.num_active_work() == 0
        return out


def expected(r: int, n: int) -> dict[str, Any]:
    ranks = range(n)
    exp: dict[str, Any] = {
        "allreduce": sum(torch.arange(4, dtype=torch.float32) + k for k in ranks),
        "allreduce_max": torch.tensor([float(n - 1)]),
        "allreduce_coalesced": [
            torch.full((2,), float(sum(k + 1 for k in ranks))),
            torch.full((3,), 10.0 * sum(k + 1 for k in ranks)),
        ],
        "allgather": [torch.tensor([k, 10 * k]) for k in ranks],
        "allgather_into_tensor_coalesced": [
            torch.tensor([float(k) for k in ranks for _ in range(2)]),
            torch.tensor([k + 100 for k in ranks], dtype=torch.int32),
        ],
        "broadcast": torch.tensor([float(n - 1)] * 3),
        "reduce_scatter": torch.full((2,), float(sum(r * 10 + k for k in ranks))),
        "reduce_scatter_tensor_coalesced": [
            torch.arange(2 * n, dtype=torch.float32)[2 * r : 2 * r + 2] * sum(k + 1 for k in ranks),
            torch.tensor([float(n)]),
        ],
        "alltoall": torch.tensor([float(100 * k + r) for k in ranks]),
        "alltoall_uneven": torch.tensor([float(k) for k in ranks for _ in range(r + 1)]),
    }
    if n > 1:
        exp["recv"] = torch.tensor([float((r - 1) % n), 42.0])
    return exp


def assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, list):
        assert isinstance(got, list), where
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
        return
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert torch.equal(got, want), f"{where}: {got} != {want}"


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_collective(world_size: int, loop: str) -> None:
    results = run_world(every_collective, world_size, loop=loop)
    for rank, got in enumerate(results):
        want = expected(rank, world_size)
        assert set(got) == set(want)
        for name in want:
            assert_same(got[name], want[name], f"rank {rank} {name}")


@pytest.mark.asyncio
async def test_dummy_backend_gives_world_of_one_results() -> None:
    async with ftcomm.Group("dummy") as g:
        await g.configure("127.0.0.1:1/unused", 0, 1)
        t = torch.tensor([1.0, 2.0])
        assert torch.equal(await g.allreduce(t), torch.tensor([1.0, 2.0]))
        gathered = await g.allgather(torch.tensor([5]))
        assert [x.tolist() for x in gathered] == [[5]]
        coalesced = await g.allgather_into_tensor_coalesced([torch.empty(2)], [torch.ones(2)])
        assert coalesced[0].tolist() == [1.0, 1.0]
        rs = await g.reduce_scatter(torch.empty(2), [torch.tensor([3.0, 4.0])])
        assert rs.tolist() == [3.0, 4.0]
        rst = await g.reduce_scatter_tensor_coalesced([torch.empty(2)], [torch.tensor([7.0, 8.0])])
        assert rst[0].tolist() == [7.0, 8.0]
        a2a = await g.alltoall_base(torch.empty(3), torch.tensor([1.0, 2.0, 3.0]))
        assert a2a.tolist() == [1.0, 2.0, 3.0]
        assert (await g.broadcast(torch.tensor([9.0]))).tolist() == [9.0]
        assert await g.barrier() is None
        assert g.errored() is None


async def _outputs_of_every_kind(g: ftcomm.Group, every: bool) -> dict[str, list[float]]:
    """The ops whose outputs ftcomm writes itself (before or instead of the
    native op), into outputs made in inference mode and parameters; with
    ``every``, also those the dummy writes and Gloo writes natively (c10d's
    own allgather cannot write into an inference tensor: raw c10d fails
    there as well)."""

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():  # an eval loop's buffers
            made_in_inference = torch.zeros(2)
        return made_in_inference, torch.nn.Parameter(torch.zeros(2))

    got: dict[str, list[float]] = {}
    for i, out in enumerate(outputs()):
        src = torch.tensor([3.0, 4.0])
        got[f"reduce_scatter {i}"] = (await g.reduce_scatter(out, [src])).tolist()
        (rst,) = await g.reduce_scatter_tensor_coalesced([outputs()[i]], [src])
        got[f"reduce_scatter_tensor {i}"] = rst.tolist()
        if every:
            (ag,) = await g.allgather(src, out=[outputs()[i]])
            got[f"allgather {i}"] = ag.tolist()
            got[f"alltoall_base {i}"] = (await g.alltoall_base(outputs()[i], src)).tolist()
    return got


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["gloo", "dummy"])
async def test_outputs_made_in_inference_mode_or_parameters_are_written(
    backend: str, store: Any
) -> None:
    """Written as a native op writes them: unrecorded by autograd, and into
    tensors made under torch.inference_mode() too; no op fails, the group
    stays sound."""
    async with ftcomm.Group(backend, timeout=20) as g:
        await g.configure(f"127.0.0.1:{store.port}/outputs", 0, 1)
        got = await _outputs_of_every_kind(g, every=backend == "dummy")
        assert len(got) == (8 if backend == "dummy" else 4)
        assert set(map(tuple, got.values())) == {(3.0, 4.0)}, got
        assert g.errored() is None
