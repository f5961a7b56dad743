"""ftcomm.Membership at its edges, in one process over a real engine (a
store, then etcd): calls
cancelled or closed at the worst moment, members slow to read, resumed
after their id was taken, newcomers that cannot come in yet, and states
that cannot be sent. Each race is forced (a store client paused at a
chosen call), not left to chance."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import engine_key, engine_set, memberships

import ftcomm
from ftcomm._membership._rule import Member, WorldRecord, parse_ready, parse_roster

pytestmark = pytest.mark.asyncio


class Engine:
    """Where a test's memberships agree (``address``: a store, or etcd),
    with a plain client of its job's keys (``set``/``read``)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def set(self, name: str, value: str | bytes) -> None:
        engine_set(self.address, "job", name, value)

    def read(self, name: str) -> bytes | None:
        return engine_key(self.address, "job", name)


@pytest.fixture
def store(engine_addr: str) -> Engine:
    """The test's engine: a store of its own, then a prefix in etcd."""
    return Engine(engine_addr)


@pytest.fixture
def tcp_store() -> Any:
    """A store only (a test of how the store engine connects)."""
    with ftcomm.serve_store() as server:
        yield server


def _client(store: Engine) -> Engine:
    return store


def _read(client: Engine, name: str) -> bytes | None:
    return client.read(name)


def _members(store: Any, *ids: str, **kw: Any) -> list[ftcomm.Membership]:
    kw.setdefault("max_size", 2)
    return memberships(store, *ids, **kw)


async def _until(condition: Callable[[], bool], what: str, within: float = 10.0) -> None:
    """Poll ``condition`` (a store's state: there is nothing to wait on)."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.01)


def _membership_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ftcomm-membership")]


class Gate:
    """Wraps a member's store client: the call ``when(name, args)`` picks
    pauses until :meth:`release` (the race's other side happens meanwhile)."""

    def __init__(self, client: Any, when: Callable[[str, tuple[Any, ...]], bool]) -> None:
        self._client, self._when = client, when
        self.paused, self._go = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._client, name)

        def call(*args: Any) -> Any:
            if not self._go.is_set() and self._when(name, args):
                self.paused.set()
                self._go.wait(30)
            return fn(*args)

        return call

    def release(self) -> None:
        self._go.set()


def _pause_at_second_look(member: ftcomm.Membership, generation: int) -> Gate:
    """Gate ``member``'s store client so that its agree pauses as it looks
    at ``world/<generation>`` again, after its ready line went in."""
    ready = threading.Event()

    def second_look(name: str, args: tuple[Any, ...]) -> bool:
        if name == "append" and args[0] == f"ready/{generation}":
            ready.set()
        return name == "compare_set" and args[0] == f"world/{generation}" and ready.is_set()

    engine: Any = member._engine  # type: ignore[attr-defined]
    gate = Gate(engine._store, second_look)
    engine._store = gate
    return gate


async def test_a_join_cancelled_as_its_world_forms_gives_the_world_up(store: Any) -> None:
    """b's ready line is in and a decides a world with b; b's join is
    cancelled before b reads it. b tells that world it quit, and a, instead
    of waiting for b's configure until its deadline, forms the next one."""
    (b,) = _members(store, "b")
    (a,) = _members(store, "a", min_size=1)
    client = _client(store)
    async with a, b, ftcomm.Group("gloo") as ga, ftcomm.Group("gloo") as gb:
        gate = _pause_at_second_look(b, 1)
        joined = asyncio.ensure_future(b.join(gb))
        await asyncio.to_thread(gate.paused.wait, 10)
        started = time.monotonic()
        first = asyncio.ensure_future(a.join(ga))
        await _until(lambda: _read(client, "world/1") is not None, "a decided generation 1")
        assert WorldRecord.decode(_read(client, "world/1") or b"").ids == ("b", "a")
        joined.cancel()
        gate.release()
        with pytest.raises(asyncio.CancelledError):
            await joined
        old = b._me  # type: ignore[attr-defined]
        assert parse_roster(_read(client, "quit/1") or b"") == [old]
        world = await first
        assert (world.generation, world.members) == (2, ("a",))
        assert time.monotonic() - started < 10  # not a's configure deadline (20 s)
        assert b.world is None
        # b goes on as a new incarnation: joined again, it is a newcomer a lets in
        assert b._engine.me.token != old.token  # type: ignore[attr-defined]
        again = asyncio.ensure_future(b.join(gb))
        assert await _pending_soon(a)
        worlds = await asyncio.gather(a.recover(ga), again)
        assert [(w.generation, w.members) for w in worlds] == [(3, ("a", "b"))] * 2
    assert not _membership_threads()


async def test_a_world_written_after_a_cancelled_member_retracted_is_given_up(
    store: Any,
) -> None:
    """The other interleaving: a read b's ready line, then b's join was
    cancelled (b took its line back), then a wrote the world with b. b never
    saw that world; it quit the generation anyway, so a gives it up. (Where
    b decides first, as a loaded machine may have it, b quits the world it
    formed: a gives it up the same way.)"""
    (b,) = _members(store, "b")
    (a,) = _members(store, "a", min_size=1)
    client = _client(store)
    async with a, b, ftcomm.Group("gloo") as ga, ftcomm.Group("gloo") as gb:
        gate = Gate(
            a._engine._store,  # type: ignore[attr-defined]
            lambda name, args: name == "compare_set" and args[:2] == ("world/1", ""),
        )
        a._engine._store = gate  # type: ignore[attr-defined]
        joined = asyncio.ensure_future(b.join(gb))
        await _until(lambda: len(parse_ready(_read(client, "ready/1") or b"")) == 1, "b ready")
        first = asyncio.ensure_future(a.join(ga))
        await asyncio.to_thread(gate.paused.wait, 10)  # a is about to write {b, a}
        joined.cancel()
        with pytest.raises(asyncio.CancelledError):
            await joined
        old = b._me  # type: ignore[attr-defined]
        assert parse_roster(_read(client, "quit/1") or b"") == [old]  # before any world
        gate.release()
        started = time.monotonic()
        world = await first
        assert WorldRecord.decode(_read(client, "world/1") or b"").ids == ("b", "a")
        assert (world.generation, world.members) == (2, ("a",))
        assert time.monotonic() - started < 10  # not a's configure deadline (20 s)


def _hold_after_configure(group: ftcomm.Group) -> tuple[asyncio.Event, asyncio.Event]:
    """Make ``group.configure()`` wait, once configured, for the second
    event it returns (the first says it got there)."""
    real = group.configure
    there, go = asyncio.Event(), asyncio.Event()

    async def configure(*args: Any, **kw: Any) -> None:
        await real(*args, **kw)
        there.set()
        await go.wait()

    group.configure = configure  # type: ignore[method-assign]
    return there, go


async def test_a_world_configured_while_a_member_gave_it_up_is_given_up(store: Any) -> None:
    """b's join is cancelled while its configure is in flight (here: done,
    and not yet returned; with Gloo, a construction a cancel cannot stop
    may complete the peer's). a's configure succeeds all the same; a reads
    that b quit before it takes the world, and forms the next one."""
    (b,) = _members(store, "b")
    (a,) = _members(store, "a", min_size=1)
    client = _client(store)
    async with a, b, ftcomm.Group("gloo") as ga, ftcomm.Group("gloo") as gb:
        a_there, a_go = _hold_after_configure(ga)
        b_there, _ = _hold_after_configure(gb)
        joined = asyncio.ensure_future(b.join(gb))
        first = asyncio.ensure_future(a.join(ga))
        await asyncio.wait_for(asyncio.gather(a_there.wait(), b_there.wait()), 10)
        joined.cancel()
        with pytest.raises(asyncio.CancelledError):
            await joined
        old = b._me  # type: ignore[attr-defined]
        assert parse_roster(_read(client, "quit/1") or b"") == [old]
        a_go.set()
        world = await first
        assert (world.generation, world.members) == (2, ("a",))
        assert not ga.errored()  # configured again, for generation 2
    assert not _membership_threads()


async def test_a_world_kept_before_a_member_gave_it_up_stands(store: Any) -> None:
    """The other order: a's configure of generation 1 succeeded and a kept
    it before b's join was cancelled (b's configure done, not returned).
    b's quit comes too late to undo it: a is in generation 1 with b dead in
    it, and pending() says so, as for any member that died."""
    (b,) = _members(store, "b")
    (a,) = _members(store, "a", min_size=1)
    client = _client(store)
    async with a, b, ftcomm.Group("gloo") as ga, ftcomm.Group("gloo") as gb:
        b_there, _ = _hold_after_configure(gb)
        joined = asyncio.ensure_future(b.join(gb))
        world = await a.join(ga)
        assert (world.generation, sorted(world.members)) == (1, ["a", "b"])
        assert _read(client, "fate/1") == b"kept\n"
        await asyncio.wait_for(b_there.wait(), 10)
        joined.cancel()
        with pytest.raises(asyncio.CancelledError):
            await joined
        # b's quit comes after: the first verdict holds
        assert (_read(client, "fate/1") or b"").decode().splitlines()[0] == "kept"
        assert await _pending_soon(a)
        world = await a.recover(ga)
        assert (world.generation, world.members) == (2, ("a",))
    assert not _membership_threads()


async def test_members_that_configured_agree_on_a_world_a_member_quit_in_between(
    store: Any,
) -> None:
    """a, b and c all configured generation 1; c kept it, then b's join was
    cancelled (b quit 1), and a, its configure not returned yet, saw b dead.
    a must keep it too, as c did: deciding on its own (b dead, or in the
    quit list), a would give up the world c is in."""
    a, b, c = _members(store, "a", "b", "c", max_size=3)
    client = _client(store)
    ga, gb, gc = (ftcomm.Group("gloo") for _ in range(3))
    async with a, b, c, ga, gb, gc:
        a_there, a_go = _hold_after_configure(ga)
        b_there, _ = _hold_after_configure(gb)
        joins = [asyncio.ensure_future(m.join(g)) for m, g in ((a, ga), (b, gb))]
        world_c = await c.join(gc)
        await asyncio.wait_for(asyncio.gather(a_there.wait(), b_there.wait()), 10)
        joins[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await joins[1]
        old_b = b._me  # type: ignore[attr-defined]
        assert parse_roster(_read(client, "quit/1") or b"") == [old_b]
        # a's configure watch sees b dead before a's configure returns:
        # the world was kept first, so a waits for its configure and keeps it
        a_engine: Any = a._engine  # type: ignore[attr-defined]
        asked, lost = threading.Event(), a_engine.lost

        def spy(record: WorldRecord, member: Member) -> bool:
            given_up: bool = lost(record, member)
            asked.set()
            return given_up

        a_engine.lost = spy
        assert await asyncio.to_thread(asked.wait, 10), "a never saw b dead"
        a_go.set()
        world_a = await joins[0]
        assert world_a.generation == world_c.generation == 1
        # b is a dead member of it: both see so, and go on together
        assert await asyncio.gather(_pending_soon(a), _pending_soon(c)) == [True] * 2
        worlds = await asyncio.gather(a.recover(ga), c.recover(gc))
        assert len({(w.generation, w.members) for w in worlds}) == 1
        assert (worlds[0].generation, sorted(worlds[0].members)) == (2, ["a", "c"])
    assert not _membership_threads()


async def test_a_recover_retried_after_a_cancelled_one_is_told_it_was_dropped(
    store: Any,
) -> None:
    """b's recover is cancelled as generation 2 forms with it: b quit 2. Its
    retry must not take 2 back (a gave it up: b would be in a world a left,
    then counted dead in it): it is Evicted, and joins again."""
    a, b = _members(store, "a", "b")
    async with a, b, ftcomm.Group("gloo") as ga, ftcomm.Group("gloo") as gb:
        await asyncio.gather(a.join(ga), b.join(gb))
        gate = _pause_at_second_look(b, 2)
        recovering = asyncio.ensure_future(b.recover(gb))
        await asyncio.to_thread(gate.paused.wait, 10)
        first = asyncio.ensure_future(a.recover(ga))
        client = _client(store)
        await _until(lambda: _read(client, "world/2") is not None, "a decided generation 2")
        recovering.cancel()
        gate.release()
        with pytest.raises(asyncio.CancelledError):
            await recovering
        try:  # not pytest.raises: its info would keep this frame (and the client) alive
            await b.recover(gb)
            evicted = None
        except ftcomm.Evicted as exc:
            evicted = (exc.generation, exc.current)
        assert evicted == (1, 2)
        assert b.world is None
        worlds = await asyncio.gather(first, b.join(gb))
        assert [(w.generation, w.members) for w in worlds] == [(3, ("a", "b"))] * 2
        sums = await asyncio.gather(ga.allreduce(torch.ones(1)), gb.allreduce(torch.ones(1)))
        assert [t.item() for t in sums] == [2.0, 2.0]


async def test_close_during_open_leaves_it_closed(
    tcp_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ftcomm._membership import _store_engine

    connecting, go = threading.Event(), threading.Event()
    real = _store_engine.connect_store

    def slow_connect(*args: Any) -> Any:
        connecting.set()
        go.wait(10)
        return real(*args)

    monkeypatch.setattr(_store_engine, "connect_store", slow_connect)
    (m,) = _members(tcp_store, "m")
    opening = asyncio.ensure_future(m.open())
    await asyncio.to_thread(connecting.wait, 10)
    closing = asyncio.ensure_future(m.close())
    await _until(lambda: m._state == "closed", "close() began")  # type: ignore[attr-defined]
    go.set()
    await closing
    with pytest.raises(ftcomm.MembershipError, match="closed while it opened"):
        await opening
    async with ftcomm.Group("gloo") as group:
        with pytest.raises(RuntimeError, match="this one is closed"):
            await m.join(group)
    assert not _membership_threads()


async def test_a_member_slow_to_read_is_evicted_from_the_latest_generation(store: Any) -> None:
    """c was in generation 2, which never came to be configured; the others
    went on to 3 without it. c, reading from 1 on, is not put into 2: it is
    told it was dropped (before, it took 2 and waited there for good)."""
    (c,) = _members(store, "c")
    a_, b_ = Member("a", "ta"), Member("b", "tb")
    client = _client(store)
    async with c:
        me = c._me  # type: ignore[attr-defined]
        c._engine.register()  # type: ignore[attr-defined]
        one = WorldRecord(1, (a_, b_, me), seen=3)
        client.set("world/1", one.encode())
        client.set("world/2", WorldRecord(2, (a_, b_, me), seen=3).encode())
        client.set("world/3", WorldRecord(3, (a_, b_), seen=3).encode())
        client.set("gen", "3")
        engine: Any = c._engine  # type: ignore[attr-defined]
        with pytest.raises(ftcomm.Evicted, match="generation 3 was formed without it") as info:
            engine.agree(
                one,
                threading.Event(),
                member_of=1,
                min_size=2,
                max_size=3,
                window=1.0,
                deadline=time.monotonic() + 5,
            )
        assert (info.value.generation, info.value.current) == (2, 3)
    del client  # the error's traceback holds this frame: the client's socket goes now


async def test_an_incarnation_whose_id_was_taken_stops_and_says_so(store: Any) -> None:
    """A member given up for dead (its key taken by a new incarnation) never
    beats over the new one, and each of its calls says what happened."""
    (m,) = _members(store, "m", min_size=1, max_size=1, join_window=0.0)
    client = _client(store)
    async with m, ftcomm.Group("gloo") as group:
        await m.join(group)
        client.set("hb/m", "newer 0")
        engine: Any = m._engine  # type: ignore[attr-defined]
        await _until(lambda: engine.broken() is not None, "m saw its id taken")
        assert _read(client, "hb/m") == b"newer 0"
        with pytest.raises(ftcomm.MembershipError, match="another incarnation of member 'm'"):
            await m.pending()
        engine.watcher.error = None  # as if not seen yet: registering looks too
        with pytest.raises(ftcomm.MembershipError, match="given up for dead, and another"):
            await asyncio.to_thread(engine.register)
        assert parse_roster(_read(client, "roster") or b"") == [m._me]  # type: ignore[attr-defined]
    assert _read(client, "hb/m") == b"newer 0"  # its close did not say "left" over it


async def test_pending_counts_only_ready_newcomers_with_room(store: Any) -> None:
    """A newcomer that registered and has not come, or one that waits on a
    full world, makes no step pending: the world would only form itself
    again (before, every step then said True)."""
    a, b, c = _members(store, "a", "b", "c", min_size=1, max_size=2, join_window=0.0)
    client = _client(store)
    async with a, b, c, ftcomm.Group("gloo") as ga, ftcomm.Group("gloo") as gb:
        assert (await a.join(ga)).size == 1
        await asyncio.to_thread(b._engine.register)  # type: ignore[attr-defined]
        watcher: Any = a._engine.watcher  # type: ignore[attr-defined]
        await _until(lambda: any(m.id == "b" for m in watcher.roster()), "a read b's entry")
        assert await a.pending() is False  # registered, not ready
        joining = asyncio.ensure_future(b.join(gb))
        await _until(lambda: len(parse_ready(_read(client, "ready/2") or b"")) == 1, "b ready")
        assert await a.pending() is True
        world, joined = await asyncio.gather(a.recover(ga), joining)
        assert world.members == joined.members == ("a", "b")
        async with ftcomm.Group("gloo") as gc:
            waiting = asyncio.ensure_future(c.join(gc))
            await _until(lambda: len(parse_ready(_read(client, "ready/3") or b"")) == 1, "c ready")
            await _until(lambda: any(m.id == "c" for m in watcher.roster()), "a read c's entry")
            assert await a.pending() is False  # full: max_size 2
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting


async def test_a_cancelled_pending_does_not_count(store: Any) -> None:
    """pending() calls are matched across members by their count: one that
    was cancelled must not shift this member's count off the others'."""
    a, b = _members(store, "a", "b")
    client = _client(store)
    async with a, b, ftcomm.Group("gloo") as ga, ftcomm.Group("gloo") as gb:
        await asyncio.gather(a.join(ga), b.join(gb))
        gate = Gate(a._engine._store, lambda name, args: args[:1] == ("chk/1/0",))  # type: ignore[attr-defined]
        a._engine._store = gate  # type: ignore[attr-defined]
        call = asyncio.ensure_future(a.pending())
        await asyncio.to_thread(gate.paused.wait, 10)
        call.cancel()
        gate.release()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await a.pending() is False
        assert await b.pending() is False
        assert _read(client, "chk/1/0") == b"0"
        assert _read(client, "chk/1/1") is None  # both asked question 0 only


async def test_close_during_a_join_ends_it_with_a_membership_error(store: Any) -> None:
    (a,) = _members(store, "a")
    async with ftcomm.Group("gloo") as group:
        await a.open()
        joining = asyncio.ensure_future(a.join(group))
        await _until(lambda: a._busy == "join" and a._running is not None, "join running")  # type: ignore[attr-defined]
        await a.close()
        # during agree's wait: "closed during the call"; between two of its
        # engine calls (a slow machine): the next one finds it "was closed"
        with pytest.raises(ftcomm.MembershipError, match="was closed"):
            await joining
    assert not _membership_threads()


async def test_waiting_joins_do_not_hold_the_control_threads(store: Any) -> None:
    """Six joins wait at once (more than the 4 control threads): each runs
    on its own thread, so all six are ready at once, and a group's
    configure (which needs a control thread) is not held up behind them."""
    ids = [f"m{i}" for i in range(6)]
    members = _members(store, *ids, min_size=7, max_size=7)
    client = _client(store)
    groups = [ftcomm.Group("gloo") for _ in ids]
    for m in members:
        await m.open()
    try:
        joins = [asyncio.ensure_future(m.join(g)) for m, g in zip(members, groups, strict=True)]
        await _until(lambda: len(parse_ready(_read(client, "ready/1") or b"")) == 6, "6 ready")
        with ftcomm.serve_store() as other:
            async with ftcomm.Group("gloo") as alone:
                await alone.configure(f"{other.address}/solo", 0, 1, timeout=10)
                assert (await alone.allreduce(torch.ones(1))).item() == 1.0
        for j in joins:
            j.cancel()
        await asyncio.gather(*joins, return_exceptions=True)
    finally:
        for m in members:
            await m.close()
        for g in groups:
            await g.shutdown()
    assert not _membership_threads()


async def test_a_restarted_member_is_a_newcomer_of_the_world(store: Any) -> None:
    """The same id, a new incarnation: World.newcomers names it."""
    a, b = _members(store, "a", "b")
    async with a, ftcomm.Group("gloo") as ga:
        async with b, ftcomm.Group("gloo") as gb:
            await asyncio.gather(a.join(ga), b.join(gb))
        (b2,) = _members(store, "b")
        async with b2, ftcomm.Group("gloo") as gb2:
            joining = asyncio.ensure_future(b2.join(gb2))
            assert await _pending_soon(a)
            world, joined = await asyncio.gather(a.recover(ga), joining)
            assert (world.generation, world.members, world.newcomers) == (2, ("a", "b"), ("b",))
            assert joined.newcomers == ("a", "b")


async def _pending_soon(members: ftcomm.Membership, within: float = 10.0) -> bool:
    """``pending()`` at each 'step' until it says True (a training loop's shape)."""
    deadline = time.monotonic() + within
    while not await members.pending():
        assert time.monotonic() < deadline, "nothing became pending"
        await asyncio.sleep(0.02)
    return True


async def test_open_gives_up_on_a_store_that_takes_connections_and_never_answers() -> None:
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)  # the kernel completes connections; no one ever answers
        members = ftcomm.Membership(f"127.0.0.1:{mute.getsockname()[1]}", "job", "m")
        started = time.monotonic()
        with pytest.raises(ftcomm.MembershipError, match="does not answer"):
            await members.open(timeout=1.0)
        assert time.monotonic() - started < 5.0  # 1 s, and the guard's rounds
    assert not _membership_threads()


class Opaque:
    """Not something a state may hold."""


async def test_a_state_that_cannot_be_copied_is_refused_on_every_member(store: Any) -> None:
    a, b = _members(store, "a", "b")
    async with a, b, ftcomm.Group("gloo") as ga, ftcomm.Group("gloo") as gb:
        await asyncio.gather(a.join(ga), b.join(gb))
        mine = {"w": torch.ones(2), "extra": Opaque()}
        results = await asyncio.gather(
            a.sync_state(mine, 5), b.sync_state({"w": torch.zeros(2)}, 0), return_exceptions=True
        )
        assert isinstance(results[0], ValueError)
        assert "state['extra']: a test_membership_edges.Opaque cannot be copied" in str(results[0])
        assert isinstance(results[1], ValueError)
        assert re.search(r"the state of rank \d cannot be copied", str(results[1]))
        # nothing is left on the wire: the group goes on
        sums = await asyncio.gather(ga.allreduce(torch.ones(1)), gb.allreduce(torch.ones(1)))
        assert [s.item() for s in sums] == [2.0, 2.0]
        good = await asyncio.gather(
            a.sync_state({"w": torch.ones(2)}, 5), b.sync_state({"w": torch.zeros(2)}, 0)
        )
        assert good[1][1] == 5
        assert good[1][0]["w"].tolist() == [1.0, 1.0]
