"""A facade's ranks in torch's tables whatever the order of its configure(),
torch's init_process_group() and its register() (issue 35): found by an
exchange where configure came before the default group; where register came
before it too, a member whose entry is untrue raises, naming what to do,
until register() or configure() finds the ranks. tests/test_client_matrix.py
runs every client in the order configure, init, register."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ftcomm
from ftcomm import c10d
from ftcomm.testing import RankContext, run_world


@contextlib.contextmanager
def _facade(timeout: float) -> Iterator[c10d.ProcessGroupGloo]:
    """A facade group, shut down at the end, with the default group."""
    pg = c10d.ProcessGroupGloo(timeout=timeout)
    try:
        yield pg
    finally:
        pg.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def _default_group(ctx: RankContext) -> None:
    store = dist.PrefixStore(f"{ctx.world_id}/default", ctx.store)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size)


def _addressed(pg: dist.ProcessGroup, rank: int) -> dict[str, Any]:
    """What rank-addressed torch functions give over ``pg`` (global ranks)."""
    got = torch.zeros(1)
    if rank == 0:
        dist.send(torch.tensor([7.0]), dst=1, group=pg)
    else:
        dist.recv(got, src=0, group=pg)
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1, group=pg)
    return {
        "ranks": dist.get_process_group_ranks(pg),
        "recv": got.item(),
        "broadcast": b.item(),
        "group rank of global 1": dist.get_group_rank(pg, 1),
    }


def registered_before_the_default_group(ctx: RankContext, swapped: bool) -> dict[str, Any]:
    """configure(), register(), then the default group: ``swapped`` gives each
    process the other's rank in the group, so that the entry made without a
    default group (global = group ranks) is untrue."""
    out: dict[str, Any] = {}
    with _facade(20) as pg:
        group_rank = 1 - ctx.rank if swapped else ctx.rank
        pg.configure(ctx.addr(), "0", group_rank, 2)
        pg.register("early")
        _default_group(ctx)
        if swapped:  # the entry is untrue of both: each raises at its next op
            with pytest.raises(ftcomm.CommAborted, match=r"configure\(\) it again"):
                dist.broadcast(torch.zeros(1), src=0, group=pg)
            with pytest.raises(ftcomm.CommAborted):  # the group is aborted
                pg.allreduce([torch.zeros(1)]).wait()
            pg.configure(ctx.addr("again"), "0", group_rank, 2)  # finds the ranks
        out.update(_addressed(pg, ctx.rank))
        out["errored"] = pg.errored()
    return out


@pytest.mark.parametrize("swapped", [False, True], ids=["same ranks", "swapped ranks"])
def test_a_group_registered_before_the_default_group(swapped: bool) -> None:
    ranks = run_world(registered_before_the_default_group, 2, args=(swapped,), timeout=60)
    for rank, out in enumerate(ranks):
        assert out["errored"] is None
        assert out["recv"] == (7.0 if rank == 1 else 0.0)
        assert out["broadcast"] == 1.0  # global rank 1's value, wherever it sits in the group
        assert out["ranks"] == ([1, 0] if swapped else [0, 1])
        assert out["group rank of global 1"] == (0 if swapped else 1)


def configured_before_the_default_group(ctx: RankContext) -> dict[str, Any]:
    """configure() with swapped ranks, the default group, then register():
    rank 0 registers first and alone, and times out naming its peer (group
    rank 0); then both register, and the ranks are right."""
    out: dict[str, Any] = {}
    with _facade(20) as pg:
        pg.configure(ctx.addr(), "0", 1 - ctx.rank, 2)
        _default_group(ctx)
        pg.set_timeout(timedelta(seconds=1.5))  # register()'s
        if ctx.rank == 0:
            started = time.monotonic()
            with pytest.raises(ftcomm.CommTimeout, match=r"group rank\(s\) \[0\] did not") as info:
                pg.register("late")
            out["took"] = time.monotonic() - started
            out["message"] = str(info.value)
            with pytest.raises(ValueError, match="not registered"):
                pg.unregister()  # nothing was entered
            ctx.signal("gave up")
        else:
            ctx.wait_for_blocking("gave up")
        pg.set_timeout(timedelta(seconds=20))
        one = torch.ones(1)
        pg.allreduce([one]).wait()  # the group is as it was
        out["allreduce"] = one.item()
        pg.register("late")  # both now: rank 0's second try, rank 1's first
        out.update(_addressed(pg, ctx.rank))
        out["errored"] = pg.errored()
    return out


def test_register_after_the_default_group_waits_for_every_member() -> None:
    ranks = run_world(configured_before_the_default_group, 2, timeout=60)
    first = ranks[0]
    assert 1.5 <= first["took"] < 1.5 + 5.0, first  # the group's timeout, and a store connect
    assert "Call register() on every member" in first["message"]
    for rank, out in enumerate(ranks):
        assert out["errored"] is None
        assert out["allreduce"] == 2.0
        assert out["ranks"] == [1, 0]
        assert out["recv"] == (7.0 if rank == 1 else 0.0)
        assert out["broadcast"] == 1.0


def three_registered_before_the_default_group(ctx: RankContext) -> dict[str, Any]:
    """Group ranks [0, 2, 1] for default ranks [0, 1, 2], registered before
    the default group: the entry (global = group ranks) is true of rank 0
    only. Ranks 1 and 2 raise and abort at their next op, so rank 0's ends
    at once too; configure() again finds the ranks."""
    out: dict[str, Any] = {}
    with _facade(20) as pg:
        pg.configure(ctx.addr("first"), "0", [0, 2, 1][ctx.rank], 3)
        pg.register("early")
        _default_group(ctx)  # no local holds its store: the barrier's error keeps this frame
        started = time.monotonic()
        try:
            pg.barrier().wait()
        except ftcomm.CommError as exc:
            out["barrier"] = (type(exc).__name__, str(exc))
        out["barrier took"] = time.monotonic() - started
        pg.configure(ctx.addr("again"), "0", [0, 2, 1][ctx.rank], 3)
        out["ranks"] = dist.get_process_group_ranks(pg)
        got = torch.zeros(1)
        if ctx.rank == 0:
            dist.send(torch.tensor([5.0]), dst=2, group=pg)
        elif ctx.rank == 2:
            dist.recv(got, src=0, group=pg)
        out["recv"] = got.item()
        b = torch.tensor([float(ctx.rank)])
        dist.broadcast(b, src=2, group=pg)
        out["broadcast"] = b.item()
        pg.unregister()
    return out


def test_members_an_early_entry_is_untrue_of_abort_and_configure_finds_the_ranks() -> None:
    ranks = run_world(three_registered_before_the_default_group, 3, timeout=60)
    name, _ = ranks[0]["barrier"]
    assert name == "CommFailed"  # its peers aborted: at once, not at the 20 s deadline
    for rank in (1, 2):
        name, message = ranks[rank]["barrier"]
        assert name == "CommAborted"
        assert "configure() it again on every member" in message
        assert f"default-group rank is {rank}, not its group rank {3 - rank}" in message
    for rank, out in enumerate(ranks):
        assert out["barrier took"] < 10.0, out
        assert out["ranks"] == [0, 2, 1]
        assert out["recv"] == (5.0 if rank == 2 else 0.0)
        assert out["broadcast"] == 2.0


def wrapped_after_the_default_group(ctx: RankContext) -> dict[str, Any]:
    """The inner group configured (swapped ranks) and registered before the
    default group, a wrapper of it registered after: the wrapper's register
    finds the ranks, and both entries get them."""
    with _facade(20) as inner:
        inner.configure(ctx.addr(), "0", 1 - ctx.rank, 2)
        inner.register("inner")
        _default_group(ctx)
        outer = c10d.ProcessGroupWrapper(pg=inner)
        outer.register("outer")
        out = {
            "outer": dist.get_process_group_ranks(outer),
            "inner": dist.get_process_group_ranks(inner),
        }
        outer.barrier().wait()
        inner.barrier().wait()
        outer.unregister()
        inner.unregister()
        return out


def test_a_wrapper_registered_after_the_default_group_settles_its_group_too() -> None:
    for out in run_world(wrapped_after_the_default_group, 2, timeout=60):
        assert out == {"outer": [1, 0], "inner": [1, 0]}


@pytest.fixture
def fake_default_group() -> Any:
    """torch's fake backend as the default group, this process its rank 1 of 2."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def make() -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def test_one_member_groups_registered_early_are_this_rank_once_there_is_a_default(
    fake_default_group: Any,
) -> None:
    """A one-member group's (and a wrapper's) entry is known here: this
    rank alone. Its ops go on, and no wrapper's error is swallowed."""
    dummy = c10d.ProcessGroupDummy()
    swallowing = c10d.ErrorSwallowingProcessGroupWrapper(c10d.ProcessGroupDummy())
    try:
        dummy.register("dummy")
        swallowing.register("swallowing")
        fake_default_group()
        t = torch.ones(1)
        dummy.broadcast([t]).wait()
        swallowing.barrier().wait()
        assert swallowing.error() is None
        assert dist.get_process_group_ranks(dummy) == [1]
        assert dist.get_process_group_ranks(swallowing) == [1]
        # torch's destroy_process_group() forgets every registered group: so
        # does the check, and the next default group's ops go on
        dist.destroy_process_group()
        fake_default_group()
        dummy.configure("unused", "0", 0, 1)
        dummy.broadcast([t]).wait()
    finally:
        dummy.shutdown()
        swallowing.shutdown()


def test_a_settle_that_a_reconfigure_overtook_changes_nothing() -> None:
    """Forced interleaving: a configure replaces the pending exchange while
    register()'s exchange runs (its superseded() is asked before and after
    the exchange). The settle raises and leaves the new exchange pending,
    never writing the old configuration's ranks."""
    from ftcomm.c10d import _registry

    ranks = _registry.MemberRanks()
    newer = _registry.Exchange("unused", 0, 2, None, lambda: False)
    asked: list[bool] = []

    def superseded() -> bool:
        asked.append(True)
        if len(asked) == 1:
            return False  # register()'s first look: still current
        ranks._pending = newer  # a configure came meanwhile (as MemberRanks.configure sets it)
        return True

    # one member: the exchange needs no store, so only the interleaving is under test
    ranks._pending = _registry.Exchange("unused", 0, 1, None, superseded)
    with pytest.raises(ftcomm.CommAborted, match="meanwhile"):
        ranks.settle(True, 5.0)
    assert len(asked) == 2
    assert ranks._pending is newer
    assert ranks.found() is None
    assert ranks.pending()  # the newer configuration's exchange, of two members
