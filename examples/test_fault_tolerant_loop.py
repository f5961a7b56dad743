"""A user's test: my training loop survives losing a rank.

Runs with plain ``pytest`` once ftcomm is installed: its pytest plugin gives
the ``ftcomm_world`` fixture (worlds of spawned ranks on loopback) and the
``ftcomm_faults`` marker (what goes wrong, where). The training loop below is
the code under test; it does not know about the fault.
"""

from __future__ import annotations

import pytest
import torch

import ftcomm
from ftcomm.testing import Fault, RankContext
from ftcomm.testing.pytest_plugin import World

STEPS = 6


async def train(ctx: RankContext) -> list[float]:
    """Data-parallel steps; after a failed collective, go on with the survivors."""
    group = ftcomm.Group(ctx.backend, timeout=1.0, configure_timeout=20)
    await group.configure(ctx.addr("attempt0"), ctx.rank, ctx.world_size)
    members = list(range(ctx.world_size))
    sums: list[float] = []
    step = 0
    while step < STEPS:
        try:
            sums.append((await group.allreduce(torch.tensor([1.0]))).item())
        except ftcomm.CommError:
            # A real job asks its membership service; here rank 2 is the one lost.
            members = [r for r in members if r != 2]
            await group.configure(ctx.addr("attempt1"), members.index(ctx.rank), len(members))
            continue
        step += 1
    await group.shutdown()
    return sums


@pytest.mark.ftcomm_faults(Fault.kill(rank=2, op=3))
def test_training_survives_a_killed_rank(ftcomm_world: World) -> None:
    results = ftcomm_world.run(train, 3)  # once on asyncio, once on uvloop
    assert results[2] is None  # killed at its 4th collective
    for sums in results[:2]:
        assert sums == [3.0, 3.0, 3.0, 2.0, 2.0, 2.0]  # three ranks, then two
