"""The store engine's sweep (``_membership._sweep``): a job's keys stay
bounded however many generations it runs through, a member stopped through
two generations or more is dropped rather than waiting or forming a world
of its own."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from helpers import memberships

import ftcomm
from ftcomm._membership import _sweep

JOB = "ftcomm/members/job/"
GROUPS = "ftcomm/groups/job/"


@pytest.fixture
def store() -> Any:
    with ftcomm.serve_store() as server:
        yield server


def _keys(store: Any) -> list[str]:
    """Every key of the store, through the server's own store object (no
    client of the test's own: no socket to leave behind)."""
    return list(store._store.list_keys())


class _Scoped:
    """The server's store object, scoped to the job (as an engine's client is)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return bytes(self._inner.compare_set(JOB + key, expected, desired))

    def set(self, key: str, value: str) -> None:
        self._inner.set(JOB + key, value)


async def _swept_below(store: Any, floor: int) -> None:
    """Until the sweep raised ``floor`` that far and deleted every key of
    the generations below (it runs on rank 0's watcher thread, after its
    next round, and raises the floor first: a store's state, nothing to
    await)."""
    deadline = time.monotonic() + 15.0
    while _sweep.floor(_Scoped(store._store)) < floor or min(_generations_left(store)) < floor:
        assert time.monotonic() < deadline, f"never swept below {floor}"
        await asyncio.sleep(0.02)


def _generations_left(store: Any) -> set[int]:
    """The generations that still have a key of the job or of its groups."""
    found: set[int] = set()
    for key in _keys(store):
        if key.startswith(JOB):
            g = _sweep.generation_of(key[len(JOB) :])
        elif key.startswith(GROUPS):
            g = _sweep.group_generation_of(key[len(GROUPS) :])
        else:
            continue
        if g is not None:
            found.add(g)
    return found


@pytest.mark.asyncio
async def test_a_job_keeps_only_its_last_two_generations_keys(store: Any) -> None:
    """Eight generations in a row: once the last is kept, only it and the
    one before have keys (the job's and its groups'), and the number of
    keys is what two generations hold, not eight."""
    members = memberships(store, "a", "b", "c", join_window=0.5)
    groups = [ftcomm.Group("gloo", timeout=15) for _ in members]
    async with members[0], members[1], members[2], groups[0], groups[1], groups[2]:
        worlds = await asyncio.gather(*(m.join(g) for m, g in zip(members, groups, strict=True)))
        counts = []
        for _ in range(7):
            sums = await asyncio.gather(*(g.allreduce(torch.ones(1)) for g in groups))
            assert [s.item() for s in sums] == [3.0] * 3
            worlds = await asyncio.gather(
                *(m.recover(g) for m, g in zip(members, groups, strict=True))
            )
            last = worlds[0].generation
            await _swept_below(store, last - 1)
            assert _generations_left(store) == {last - 1, last}
            counts.append(len(_keys(store)))
        assert last == 8
        assert len(set(counts[1:])) == 1, f"the key count still grows: {counts}"
        sums = await asyncio.gather(*(g.allreduce(torch.ones(1)) for g in groups))
        assert [s.item() for s in sums] == [3.0] * 3


@pytest.mark.asyncio
async def test_a_member_stopped_through_swept_generations_is_dropped_at_once(
    store: Any,
) -> None:
    """c stays out (stopped, as far as the others can tell: its heartbeat
    goes on) while a and b run through generations 2, 3 and 4; generation
    2, the one c comes back to, is swept. Its recover() must say Evicted at
    once, not wait for a generation 2 no one else will join nor form one
    of its own; and a world put back into a swept generation's key (a
    proposal written just as the sweep went by) is never taken, and goes
    with the next sweep."""
    a, b, c = memberships(store, "a", "b", "c", join_window=0.5)
    ga, gb, gc = (ftcomm.Group("gloo", timeout=15) for _ in range(3))
    async with a, b, c, ga, gb, gc:
        await asyncio.gather(a.join(ga), b.join(gb), c.join(gc))
        for generation in (2, 3, 4):
            worlds = await asyncio.gather(a.recover(ga), b.recover(gb))
            assert {(w.generation, tuple(sorted(w.members))) for w in worlds} == {
                (generation, ("a", "b"))
            }
        await _swept_below(store, 3)
        # a proposal for generation 2 that came just as it was swept
        stale = f'{{"generation": 2, "members": [["c", "{c._engine.me.token}"]]}}'
        store._store.set(JOB + "world/2", stale)
        started = time.monotonic()
        with pytest.raises(ftcomm.Evicted, match="was dropped") as caught:
            await c.recover(gc)
        assert time.monotonic() - started < 5.0, "it waited instead of being told"
        assert (caught.value.generation, caught.value.current) == (1, 4)
        assert not any(k.startswith(JOB + "ready/2") for k in _keys(store))
        # the next generation's sweep takes the stale world away
        worlds = await asyncio.gather(a.recover(ga), b.recover(gb))
        await _swept_below(store, worlds[0].generation - 1)
        assert JOB + "world/2" not in _keys(store)
        # and c comes back as a newcomer, at the next generation
        gc2 = ftcomm.Group("gloo", timeout=15)
        async with gc2:
            joining = asyncio.create_task(c.join(gc2))
            ready = f"{JOB}ready/{worlds[0].generation + 1}"
            deadline = time.monotonic() + 15.0
            while b"+c\t" not in (_value(store, ready) or b""):  # a store's state
                assert time.monotonic() < deadline, "c never came"
                assert not joining.done(), joining
                await asyncio.sleep(0.02)
            worlds = await asyncio.gather(a.recover(ga), b.recover(gb), joining)
            assert {tuple(sorted(w.members)) for w in worlds} == {("a", "b", "c")}
            sums = await asyncio.gather(*(g.allreduce(torch.ones(1)) for g in (ga, gb, gc2)))
            assert [s.item() for s in sums] == [3.0] * 3


def _value(store: Any, key: str) -> bytes | None:
    return bytes(store._store.get(key)) if store._store.check([key]) else None


# -- the sweep's parts, against a store -----------------------------------------


def test_keys_are_read_for_their_generation() -> None:
    assert [
        _sweep.generation_of(k)
        for k in ("world/12", "chk/3/15", "ready/7", "hb/m1", "roster", "gen", "world/x", "floor")
    ] == [12, 3, 7, None, None, None, None, None]
    assert [
        _sweep.group_generation_of(k)
        for k in ("g4/0/1", "g12/ftcomm/met/3/n", "g4", "gx/0/1", "h4/0/1")
    ] == [4, 12, None, None, None]


def test_the_floor_only_rises(store: Any) -> None:
    scoped = _Scoped(store._store)
    assert _sweep.floor(scoped) == 0
    assert _sweep.raise_floor(scoped, 5) == 5
    assert _sweep.raise_floor(scoped, 3) == 5
    assert _sweep.floor(scoped) == 5


def test_a_sweep_deletes_at_most_its_share_and_the_rest_next_time(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner = store._store
    job = torch.distributed.PrefixStore("ftcomm/members/job", inner)
    groups = torch.distributed.PrefixStore("ftcomm/groups/job", inner)
    for g in range(1, 6):
        job.set(f"world/{g}", "w")
        job.set(f"ready/{g}", "r")
        groups.set(f"g{g}/0/0", "x")
    job.set("hb/a", "t 1")
    monkeypatch.setattr(_sweep, "MAX_DELETES", 5)
    assert _sweep.sweep(job, groups, 4) == 5  # generations 1-3: 6 job keys, 3 group keys
    assert _sweep.sweep(job, groups, 4) == 4
    assert _sweep.sweep(job, groups, 4) == 0
    left = sorted(k for k in inner.list_keys() if "/job/" in k)
    assert left == sorted(
        ["ftcomm/members/job/floor", "ftcomm/members/job/hb/a"]
        + [f"ftcomm/members/job/{n}/{g}" for n in ("world", "ready") for g in (4, 5)]
        + [f"ftcomm/groups/job/g{g}/0/0" for g in (4, 5)]
    )


def test_a_store_that_cannot_list_its_keys_is_not_swept() -> None:
    class Old:
        def compare_set(self, *_: Any) -> bytes:
            raise AssertionError("an old store was written to")

    assert not _sweep.can_sweep(Old())
    assert _sweep.sweep(Old(), None, 10) == 0
