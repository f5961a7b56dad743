"""The store engine's sweep (``_membership._sweep``): a job's keys stay
bounded however many generations it runs through, a member stopped through
two generations or more is dropped rather than waiting or forming a world
of its own."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

import pytest
import torch
from helpers import memberships
from torch.distributed import TCPStore

import ftcomm
from ftcomm._membership import _sweep
from ftcomm.testing import etcd_missing

lists_keys = pytest.mark.skipif(
    not hasattr(TCPStore, "list_keys"), reason="the sweep lists keys: torch 2.10 and later"
)

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


async def _swept_to(store: Any, floor: int) -> None:
    """Until the sweep raised ``floor`` that far and deleted every key of
    the generations below ``floor - 1`` (it runs on rank 0's watcher
    thread, after its next round, and raises the floor first: a store's
    state, nothing to await)."""
    deadline = time.monotonic() + 15.0
    while _sweep.floor(_Scoped(store._store)) < floor or min(_generations_left(store)) < floor - 1:
        assert time.monotonic() < deadline, f"never swept to {floor}"
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


@lists_keys
@pytest.mark.asyncio
async def test_a_job_keeps_only_its_last_three_generations_keys(store: Any) -> None:
    """Eight generations in a row: once the last is kept, only it and the
    two before have keys (the job's and its groups'), and the number of
    keys is what three generations hold, not eight."""
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
            if last >= 4:  # (before, nothing can be below floor - 1: no sweep)
                await _swept_to(store, last - 1)
            assert _generations_left(store) == {g for g in (last - 2, last - 1, last) if g > 0}
            counts.append(len(_keys(store)))
        assert last == 8
        assert len(set(counts[2:])) == 1, f"the key count still grows: {counts}"
        sums = await asyncio.gather(*(g.allreduce(torch.ones(1)) for g in groups))
        assert [s.item() for s in sums] == [3.0] * 3


@lists_keys
@pytest.mark.asyncio
async def test_a_member_stopped_through_swept_generations_is_dropped_at_once(
    store: Any,
) -> None:
    """c stays out (stopped, as far as the others can tell: its heartbeat
    goes on) while a and b run through generations 2, 3 and 4; generation
    2, the one c comes back to, is below the floor. Its recover() must say Evicted at
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
        await _swept_to(store, 3)
        # a proposal for generation 2 that came just as it was swept
        stale = f'{{"generation": 2, "members": [["c", "{c._engine.me.token}"]]}}'
        store._store.set(JOB + "world/2", stale)
        started = time.monotonic()
        with pytest.raises(ftcomm.Evicted, match="was dropped") as caught:
            await c.recover(gc)
        assert time.monotonic() - started < 5.0, "it waited instead of being told"
        assert (caught.value.generation, caught.value.current) == (1, 4)
        assert b"+c\t" not in (_value(store, JOB + "ready/2") or b"")  # it never came to 2
        # the next generation's sweep takes the stale world away
        worlds = await asyncio.gather(a.recover(ga), b.recover(gb))
        await _swept_to(store, worlds[0].generation - 1)
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


@lists_keys
@pytest.mark.asyncio
async def test_a_member_resumed_after_its_world_was_swept_is_told_it_is_over(
    store: Any,
) -> None:
    """c's watcher stops (its process stopped, as far as the others can
    tell); a and b go on to generation 4, and the sweep takes generation
    1's keys: the 'left to recover' lines c's watch would have aborted its
    group on, the pending() answers of generation 1. Once c's watcher runs
    again, the floor says its world is over: its group's configuration is
    aborted, pending() is due (not c's own view, written into a swept key),
    and recover() says it was dropped."""
    import threading

    a, b, c = memberships(store, "a", "b", "c", join_window=0.5)
    ga, gb, gc = (ftcomm.Group("gloo", timeout=15) for _ in range(3))
    async with a, b, c, ga, gb, gc:
        await asyncio.gather(a.join(ga), b.join(gb), c.join(gc))
        watcher: Any = c._engine.watcher  # type: ignore[attr-defined]
        resume, rounds, real_tick = threading.Event(), [], watcher.tick

        def stopped_tick() -> None:
            resume.wait(30.0)
            real_tick()
            rounds.append(time.monotonic())

        watcher.tick = stopped_tick
        try:
            for generation in (2, 3, 4):
                worlds = await asyncio.gather(a.recover(ga), b.recover(gb))
                assert {w.generation for w in worlds} == {generation}
            await _swept_to(store, 3)
            assert JOB + "sus/1" not in _keys(store)
        finally:
            resume.set()
        deadline = time.monotonic() + 10.0
        while len(rounds) < 2:  # the watcher's thread: nothing to await
            assert time.monotonic() < deadline, "c's watcher never ran again"
            await asyncio.sleep(0.01)
        with pytest.raises(ftcomm.CommAborted, match="formed without this member"):
            await gc.allreduce(torch.ones(1), timeout=30)
        assert await c.pending()
        assert not [k for k in _keys(store) if k.startswith(JOB + "chk/1/")]  # nothing asked of 1
        with pytest.raises(ftcomm.Evicted, match="formed and kept without it"):
            await c.recover(gc)


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


def _full(store: Any) -> Any:
    return store._store  # the server's own store object: every key, no prefix


@lists_keys
def test_a_sweep_deletes_at_most_its_share_and_the_rest_next_time(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner = _full(store)
    for g in range(1, 6):
        inner.set(f"{JOB}world/{g}", "w")
        inner.set(f"{JOB}ready/{g}", "r")
        inner.set(f"{GROUPS}g{g}/0/0", "x")
        inner.set(f"ftcomm/members/job-g{g}/world/1", "another job's")
    inner.set(f"{JOB}hb/a", "t 1")
    sweeper = _sweep.Sweeper(lambda: inner, "", "job")
    monkeypatch.setattr(_sweep, "MAX_DELETES", 5)
    # floor 5: generations 1-3 go (6 job keys, 3 group keys), 5 at a time
    assert sweeper.sweep_once(5) is True
    assert sweeper.sweep_once(5) is False
    left = sorted(k for k in inner.list_keys() if "/job" in k)
    assert left == sorted(
        [f"{JOB}floor", f"{JOB}hb/a"]
        + [f"{JOB}{n}/{g}" for n in ("world", "ready") for g in (4, 5)]
        + [f"{GROUPS}g{g}/0/0" for g in (4, 5)]
        + [f"ftcomm/members/job-g{g}/world/1" for g in range(1, 6)]
    )
    assert inner.get(f"{JOB}floor") == b"5"


def test_a_store_that_cannot_list_its_keys_still_raises_the_floor(store: Any) -> None:
    class Old:
        """A store client of a torch before 2.10 (no ``list_keys``)."""

        def __init__(self, inner: Any) -> None:
            self.compare_set, self.deleted = inner.compare_set, []

    inner = _full(store)
    inner.set(f"{JOB}world/1", "w")
    old = Old(inner)
    assert _sweep.Sweeper(lambda: old, "", "job").sweep_once(5) is False
    assert inner.get(f"{JOB}floor") == b"5"
    assert inner.check([f"{JOB}world/1"])


class _Dropping:
    """The server's store object, which drops the sweep's first listing (as
    a store that does not know the request would); a module's class: a
    test's own would keep the server's store in a reference cycle."""

    def __init__(self, inner: Any, *, fail: bool, swept: Any) -> None:
        self._inner, self._fail, self._swept = inner, fail, swept

    def __getattr__(self, name: str) -> Any:
        if name == "list_keys" and self._fail:
            raise RuntimeError("the store dropped the connection")
        if name == "delete_key":
            self._swept.set()
        return getattr(self._inner, name)


@lists_keys
def test_a_sweep_runs_on_a_thread_of_its_own_and_a_failed_one_runs_again(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The sweep's client takes its time to connect, then the store drops
    it: the member's heartbeat beats on meanwhile (the sweep never runs on
    its thread), the failure is logged, and the next request connects
    again and sweeps; nothing before generation 3, where no key can go."""
    import threading

    from ftcomm._membership._rule import Member
    from ftcomm._membership._watch import Watcher, beat_key

    inner = _full(store)
    inner.set(f"{JOB}world/1", "w")
    connects: list[float] = []
    swept = threading.Event()

    def connect() -> _Dropping:
        connects.append(time.monotonic())
        time.sleep(1.0)  # a store connect that waits on a DNS lookup
        return _Dropping(inner, fail=len(connects) == 1, swept=swept)

    scoped = torch.distributed.PrefixStore("ftcomm/members/job", inner)
    scoped.set(beat_key("m"), "t 0")
    watcher = Watcher(scoped, Member("m", "t"), interval=0.05, timeout=1.0)
    watcher.sweeper = _sweep.Sweeper(connect, "", "job")
    beats: list[float] = []
    real_beat = watcher.beat

    def beat() -> None:
        real_beat()
        beats.append(time.monotonic())

    watcher.beat = beat  # type: ignore[method-assign]
    watcher.start()
    try:
        watcher.sweep(2)  # nothing can be below 1: no connect, no thread
        watcher.sweep(3)  # connects (1 s), then the store drops it
        deadline = time.monotonic() + 10.0
        while len(connects) < 1 or time.monotonic() - connects[0] < 1.5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        watcher.sweep(3)  # again: a new client, and world/1 goes
        assert swept.wait(10.0), "the sweep never ran again"
        assert watcher.error is None
    finally:
        watcher.stop(leave=False)
        del watcher.beat  # (it held the watcher, and through it the server's store)
        del scoped
    assert len(connects) == 2
    assert "a sweep of old generations failed: the store dropped the connection" in caplog.text
    gaps = [later - earlier for earlier, later in itertools.pairwise(beats)]
    assert max(gaps) < 0.5, f"the heartbeat waited on the sweep: {max(gaps):.2f} s"
    assert not inner.check([f"{JOB}world/1"])
    assert inner.get(f"{JOB}floor") == b"3"


def test_a_sweeper_closed_as_it_connects_touches_no_key_after() -> None:
    """close() while the sweep's client connects: it waits for the connect,
    then the sweep stops before its first store op; no thread, no client."""
    import threading

    entered, release, ops = threading.Event(), threading.Event(), []

    class Recording:
        def __getattr__(self, name: str) -> Any:
            ops.append(name)
            raise AssertionError(f"a store op after close: {name}")

    def connect() -> Recording:
        entered.set()
        release.wait(10.0)
        return Recording()

    sweeper = _sweep.Sweeper(connect, "", "job", name="sweep-test")
    sweeper.request(5)
    assert entered.wait(10.0)
    timer = threading.Timer(0.2, release.set)
    timer.start()
    sweeper.close()
    timer.join()
    assert ops == []
    assert not [t for t in threading.enumerate() if t.name == "ftcomm-membership-sweep-test"]
    assert sweeper._client is None
    sweeper.request(6)  # after close: nothing
    assert not [t for t in threading.enumerate() if t.name == "ftcomm-membership-sweep-test"]


@pytest.mark.asyncio
async def test_a_stale_member_polling_a_generation_is_told_once_the_floor_passes_it(
    store: Any,
) -> None:
    """c, of generation 1, waits for generation 2 (not decided); meanwhile
    the job goes on to 4 without it (a world its agree never read, as if
    it had been stopped): within a floor look or two it is told Evicted,
    not at its deadline."""
    import threading

    from ftcomm._membership._rule import Member, WorldRecord

    inner = _full(store)
    (c,) = memberships(store, "c", max_size=3)
    a_, b_ = Member("a", "ta"), Member("b", "tb")

    async with c:
        engine: Any = c._engine  # type: ignore[attr-defined]
        engine.register()
        one = WorldRecord(1, (a_, b_, engine.me), seen=1)
        for other in ("a", "b"):  # their listeners: another incarnation's (not probed)
            inner.set(f"{JOB}at/{other}", "old 127.0.0.1:1")
        inner.set(f"{JOB}world/1", one.encode())
        inner.set(f"{JOB}gen", "1")

        def later() -> None:  # (world/2, the one c would read, as if swept: never there)
            inner.set(f"{JOB}floor", "3")
            inner.set(f"{JOB}gen", "4")
            for g in (3, 4):
                inner.set(f"{JOB}world/{g}", WorldRecord(g, (a_, b_), seen=1).encode())

        timer = threading.Timer(0.5, later)
        timer.start()
        started = time.monotonic()
        try:
            with pytest.raises(ftcomm.Evicted, match="formed and kept without it") as info:
                await asyncio.to_thread(
                    engine.agree,
                    one,
                    threading.Event(),
                    member_of=1,
                    min_size=2,
                    max_size=3,
                    window=1.0,
                    deadline=time.monotonic() + 20,
                )
        finally:
            timer.join()
        assert time.monotonic() - started < 5.0, "it waited for its deadline"
        assert (info.value.generation, info.value.current) == (1, 4)
        del info  # its traceback holds the engine's frames, and through them its client


@pytest.mark.asyncio
async def test_a_newcomer_whose_world_was_swept_is_told_not_left_waiting(store: Any) -> None:
    """Newcomer y was put into generation 2, stalled before it read it, and
    the others gave 2 up and went on to 4 (2 below the floor). Its roster
    line was used up by 2: waiting at the latest generation, it would
    never be let in. Its agree says Evicted (join() registers it again)."""
    import threading

    from ftcomm._membership._rule import Member, WorldRecord

    inner = _full(store)
    (y,) = memberships(store, "y", max_size=3)
    a_, b_ = Member("a", "ta"), Member("b", "tb")

    async with y:
        engine: Any = y._engine  # type: ignore[attr-defined]
        engine.register()
        me = engine.me
        one = WorldRecord(1, (a_, b_), seen=0)
        for g, record in (
            (3, WorldRecord(3, (a_, b_), seen=1)),
            (4, WorldRecord(4, (a_, b_), seen=1)),
        ):
            inner.set(f"{JOB}world/{g}", record.encode())
        inner.set(f"{JOB}world/2", WorldRecord(2, (a_, b_, me), seen=1).encode())
        inner.set(f"{JOB}gen", "4")
        inner.set(f"{JOB}floor", "3")
        started = time.monotonic()
        with pytest.raises(ftcomm.Evicted):
            await asyncio.to_thread(
                engine.agree,
                one,
                threading.Event(),
                member_of=None,
                min_size=2,
                max_size=3,
                window=0.5,
                deadline=time.monotonic() + 20,
            )
        assert time.monotonic() - started < 5.0


@lists_keys
@pytest.mark.asyncio
async def test_on_etcd_a_job_keeps_its_last_three_generations_keys_and_groups(
    engine_etcd: Any,
) -> None:
    """The same on etcd: the job's keys in etcd, and the groups' in the
    store that rank 0 hosts (its generations' groups meet there), are
    those of the last three generations once the eighth is kept."""
    if engine_etcd is None:
        pytest.skip(str(etcd_missing()))
    address = engine_etcd.address(f"sweep-{uuid.uuid4().hex[:8]}")
    prefix = address.rsplit("/", 1)[1] + "/"
    client = engine_etcd.client()

    def job_generations() -> set[int]:
        keys = [kv.key.decode() for kv in client.get_prefix((prefix + JOB).encode())]
        found = {_sweep.generation_of(k[len(prefix + JOB) :]) for k in keys}
        return {g for g in found if g is not None}

    members = memberships(address, "a", "b", "c", join_window=0.5)
    groups = [ftcomm.Group("gloo", timeout=15) for _ in members]
    async with members[0], members[1], members[2], groups[0], groups[1], groups[2]:
        worlds = await asyncio.gather(*(m.join(g) for m, g in zip(members, groups, strict=True)))
        host = next(m for m in members if m.member_id == worlds[0].members[0])
        served = host._engine._server._store  # type: ignore[attr-defined]

        def group_generations() -> set[int]:
            keys = [k for k in served.list_keys() if k.startswith(prefix + GROUPS)]
            found = {_sweep.group_generation_of(k[len(prefix + GROUPS) :]) for k in keys}
            return {g for g in found if g is not None}

        for _ in range(7):
            worlds = await asyncio.gather(
                *(m.recover(g) for m, g in zip(members, groups, strict=True))
            )
        last = worlds[0].generation
        assert last == 8
        assert worlds[0].members[0] == host.member_id  # rank 0 throughout
        deadline = time.monotonic() + 15.0
        want = {last - 2, last - 1, last}
        while job_generations() != want or group_generations() != want:  # (etcd's state)
            assert time.monotonic() < deadline, (job_generations(), group_generations())
            await asyncio.sleep(0.05)
        sums = await asyncio.gather(*(g.allreduce(torch.ones(1)) for g in groups))
        assert [s.item() for s in sums] == [3.0] * 3
