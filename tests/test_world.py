"""The multi-rank harness itself: it must report what it is there to catch."""

from __future__ import annotations

import asyncio
import os

import pytest

from ftcomm.testing import RankContext, WorldError, run_world

_held: list[int] = []


async def leaks_an_fd(ctx: RankContext) -> None:
    _held.extend(os.pipe())


async def raises(ctx: RankContext) -> None:
    if ctx.rank == 1:
        raise KeyError("boom on rank 1")


async def hangs(ctx: RankContext) -> None:
    await asyncio.Event().wait()


def test_a_leaked_fd_fails_the_world() -> None:
    with pytest.raises(WorldError, match="fds left open"):
        run_world(leaks_an_fd, 1)


def test_a_rank_error_arrives_with_its_traceback() -> None:
    with pytest.raises(WorldError, match=r"(?s)rank 1 raised.*KeyError: 'boom on rank 1'"):
        run_world(raises, 2)


def test_a_hung_world_is_killed_at_its_bound() -> None:
    with pytest.raises(WorldError, match=r"did not finish within 3\.0 s \(killed\)"):
        run_world(hangs, 1, timeout=3.0)
