"""A user's test: my training loop survives losing a member, with no supervisor.

Runs with plain ``pytest`` once ftcomm is installed: its pytest plugin gives
the ``ftcomm_world`` fixture (worlds of spawned ranks on loopback) and the
``ftcomm_faults`` marker (what goes wrong, where). The training loop below is
the code under test; it does not know about the fault. ``ftcomm.Membership``
on the world's own store decides who is left after it.
"""

from __future__ import annotations

import pytest
import torch

import ftcomm
from ftcomm.testing import Fault, RankContext
from ftcomm.testing.pytest_plugin import World

STEPS = 6


async def train(ctx: RankContext) -> list[tuple[int, float]]:
    """Data-parallel steps; after a failed collective, recover with the survivors."""
    address = f"{ctx.host}:{ctx.port}/{ctx.world_id}"  # the world's store
    members = ftcomm.Membership(address, "train", f"m{ctx.rank}", min_size=2, max_size=3)
    sums: list[tuple[int, float]] = []  # (generation, sum) per step
    async with members, ftcomm.Group(ctx.backend, timeout=5.0) as group:
        world = await members.join(group)
        while len(sums) < STEPS:
            try:
                total = await group.allreduce(torch.tensor([1.0]))
            except ftcomm.CommError:
                world = await members.recover(group)  # the survivors, in a new generation
                continue
            sums.append((world.generation, total.item()))
    return sums


@pytest.mark.ftcomm_faults(Fault.kill(rank=2, op=3))
def test_training_survives_a_killed_rank(ftcomm_world: World) -> None:
    results = ftcomm_world.run(train, 3)  # once on asyncio, once on uvloop
    assert results[2] is None  # killed at its 4th collective
    for sums in results[:2]:
        assert sums == [(1, 3.0)] * 3 + [(2, 2.0)] * 3  # three members, then two
