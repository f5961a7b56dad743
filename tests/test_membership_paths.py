"""Paths between members: the probes (``_reach``), the rule that leaves the
fewest out (``_rule.leave_out``), a configure's check of its world's paths
(``_paths.check``) over a real store, and what a refused probe and a
silent heartbeat do to a world at once: a killed member is dead without
waiting out its heartbeat, and a hung one aborts the ops in flight."""

from __future__ import annotations

import asyncio
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ftcomm
from ftcomm._membership import _paths
from ftcomm._membership._reach import Listener, Probes, Reach, parse_address, probe_all
from ftcomm._membership._rule import EXACT_CUT, Member, WorldRecord, leave_out
from ftcomm._membership._watch import Watcher, at_key
from ftcomm.group import abort_config
from ftcomm.testing import Fault, FaultPlan, RankContext, inspect, run_world

# -- probes -------------------------------------------------------------------


@pytest.fixture
def full() -> Iterator[tuple[str, int]]:
    """A listener whose backlog is full: a SYN to it is dropped, as across
    a cut link (no answer, no reset)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    address = server.getsockname()
    waiting = []
    for _ in range(3):
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(address)
        waiting.append(client)
    # the queue holds one: wait until a further connect stays unanswered
    deadline = time.monotonic() + 5
    while probe_all({"x": address}, 0.2)["x"] is not Reach.SILENT:
        assert time.monotonic() < deadline, "the backlog never filled"
    yield address
    for client in waiting:
        client.close()
    server.close()


def test_a_probe_tells_a_listener_a_closed_port_and_a_cut_path_apart(
    full: tuple[str, int],
) -> None:
    alive = Listener("127.0.0.1")
    gone = Listener("127.0.0.1")
    gone_port = gone.port
    gone.close()
    try:
        started = time.monotonic()
        answers = probe_all(
            {
                "alive": ("127.0.0.1", alive.port),
                "gone": ("127.0.0.1", gone_port),
                "cut": full,
            },
            0.3,
        )
        took = time.monotonic() - started
    finally:
        alive.close()
    assert answers == {"alive": Reach.OK, "gone": Reach.REFUSED, "cut": Reach.SILENT}
    assert 0.3 <= took < 2.0  # the silent one waited out its time, no more


def test_a_listener_nobody_serves_keeps_answering_once_drained() -> None:
    listener = Listener("127.0.0.1")
    try:
        where = {"me": ("127.0.0.1", listener.port)}
        for _ in range(3):  # more probes than its backlog holds, drained between
            answers = [probe_all(where, 1.0)["me"] for _ in range(100)]
            assert set(answers) == {Reach.OK}
            listener.drain()
    finally:
        listener.close()
    assert probe_all(where, 1.0)["me"] is Reach.REFUSED  # closed: the member is gone


def test_probes_keep_one_in_flight_per_key(full: tuple[str, int]) -> None:
    probes: Probes[str] = Probes()
    try:
        probes.start("cut", full, 0.2)
        probes.start("cut", full, 60.0)  # ignored: one is in flight
        assert probes.busy("cut")
        assert len(probes) == 1
        deadline = time.monotonic() + 5
        ended: dict[str, Reach] = {}
        while not ended:
            assert time.monotonic() < deadline
            ended = probes.poll(0.05)
        assert ended == {"cut": Reach.SILENT}
        assert not probes.busy("cut")
    finally:
        probes.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:80", ("127.0.0.1", 80)),
        ("[::1]:29500", ("::1", 29500)),
        ("host:", None),
        (":80", None),
        ("nohost", None),
        ("h:x", None),
    ],
)
def test_an_address_is_read_back_or_refused(text: str, expected: Any) -> None:
    assert parse_address(text) == expected


# -- the rule -------------------------------------------------------------------

M = [Member(f"m{i}", f"t{i}") for i in range(6)]


def _all_reach(members: list[Member]) -> dict[Member, set[Member]]:
    return {m: {o for o in members if o != m} for m in members}


def test_every_path_working_leaves_no_one_out() -> None:
    assert leave_out(M[:4], _all_reach(M[:4])) == ()


def test_a_member_cut_from_all_others_is_the_one_left_out() -> None:
    reached = _all_reach(M[:4])
    for m in M[:4]:
        reached[m].discard(M[2])
    reached[M[2]] = set()
    assert leave_out(M[:4], reached) == (M[2],)


def test_one_side_of_a_pair_is_enough_to_count_it_broken() -> None:
    reached = _all_reach(M[:3])
    reached[M[0]].discard(M[1])  # m1 says it reached m0; m0 says not
    out = leave_out(M[:3], reached)
    assert len(out) == 1
    assert out[0] in (M[0], M[1])


def test_a_member_without_a_report_is_judged_by_the_others_reports() -> None:
    reached = _all_reach(M[:3])
    del reached[M[1]]  # its check was slow: its silence says nothing
    assert leave_out(M[:3], reached) == ()
    reached[M[0]].discard(M[1])
    reached[M[2]].discard(M[1])
    assert leave_out(M[:3], reached) == (M[1],)


def test_a_split_in_halves_keeps_one_half_whole() -> None:
    left, right = set(M[:2]), set(M[2:4])
    reached = {m: (left if m in left else right) - {m} for m in M[:4]}
    out = set(leave_out(M[:4], reached))
    assert out == right  # of two answers as small, the later ranks go


def test_the_rule_leaves_out_greedily_beyond_its_exact_search() -> None:
    members = [Member(f"n{i}", "t") for i in range(2 * (EXACT_CUT + 2))]
    half = len(members) // 2
    reached = {
        m: {o for o in (members[:half] if i < half else members[half:]) if o != m}
        for i, m in enumerate(members)
    }
    out = leave_out(members, reached)
    rest = [m for m in members if m not in out]
    assert len(out) == half  # one half whole
    assert all(b in reached[a] for a in rest for b in rest if a != b)


# -- a configure's check, over a real store ----------------------------------------


@pytest.fixture
def store() -> Iterator[Any]:
    with ftcomm.serve_store() as server:
        yield server


def _client(store: Any) -> Any:
    return torch.distributed.TCPStore(
        "127.0.0.1", store.port, is_master=False, wait_for_workers=False
    )


def test_the_check_leaves_out_the_member_no_one_reaches_the_same_for_all(
    store: Any, full: tuple[str, int]
) -> None:
    """m2's listener answers no one (its address is the full backlog): each
    member's check reports, and every one returns m2, written once."""
    members = M[:3]
    record = WorldRecord(generation=4, members=tuple(members))
    clients = [_client(store) for _ in members]
    listeners = [Listener("127.0.0.1") for _ in members[:2]]
    try:
        for member, listener in zip(members[:2], listeners, strict=True):
            clients[0].set(at_key(member.id), f"{member.token} {listener.address}")
        clients[0].set(at_key("m2"), f"{members[2].token} {full[0]}:{full[1]}")
        watchers = [
            Watcher(c, m, interval=0.1, timeout=1.0) for c, m in zip(clients, members, strict=True)
        ]
        results: dict[Member, set[Member]] = {}
        reached: dict[Member, set[Member]] = {}

        def run(i: int) -> None:
            me = members[i]
            results[me], reached[me] = _paths.check(
                clients[i], watchers[i], me, record, threading.Event(), 0.5
            )

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert results == {m: {members[2]} for m in members}
        m0, m1, m2 = members
        assert reached == {m0: {m1}, m1: {m0}, m2: {m0, m1}}
        assert clients[0].get(_paths.cut_key(4)) == members[2].line().encode()
    finally:
        for listener in listeners:
            listener.close()


def test_the_check_ends_at_once_when_told_to_stop(store: Any, full: tuple[str, int]) -> None:
    me, other = M[0], M[1]
    client = _client(store)
    client.set(at_key(other.id), f"{other.token} {full[0]}:{full[1]}")
    stop = threading.Event()
    stop.set()
    record = WorldRecord(generation=1, members=(me, other))
    watcher = Watcher(client, me, interval=0.1, timeout=1.0)
    started = time.monotonic()
    assert _paths.check(client, watcher, me, record, stop, 5.0) == (set(), set())
    assert time.monotonic() - started < 2.0  # not the probe's 5 s
    assert not client.check([_paths.reach_key(1)])  # no report from a check stopped


def test_evicted_keeps_cut_off_through_pickle() -> None:
    error = ftcomm.Evicted("x", member_id="m", generation=1, current=2, cut_off=True)
    back = pickle.loads(pickle.dumps(error))
    assert (back.member_id, back.generation, back.current, back.cut_off) == ("m", 1, 2, True)
    assert not ftcomm.Evicted("x", member_id="m", generation=1, current=2).cut_off


# -- a configuration aborted only while it is the current one ----------------------


@pytest.mark.asyncio
async def test_an_abort_for_an_old_configuration_leaves_the_new_one_alone(store: Any) -> None:
    async with ftcomm.Group("gloo", timeout=10) as group:
        await group.configure(f"{store.address}/a", 0, 1)
        old = inspect(group).config
        await group.configure(f"{store.address}/b", 0, 1)
        assert not abort_config(group, old, "too late")
        assert (await group.allreduce(torch.ones(1))).item() == 1.0
        assert abort_config(group, inspect(group).config, "now")
        with pytest.raises(ftcomm.CommAborted, match="aborted: now"):
            await group.allreduce(torch.ones(1))


# -- what the watch does to a world ---------------------------------------------------

SLOW_HB = 8.0  # a heartbeat timeout no test below waits out


async def _train(ctx: RankContext, steps: int) -> list[Any]:
    """Allreduce each step; after a CommError, recover. The log holds the
    world sizes and, per recovery, (error, seconds the op took, seconds
    recover() took)."""
    log: list[Any] = []
    address = f"{ctx.host}:{ctx.port}/{ctx.world_id}"
    async with (
        ftcomm.Membership(
            address,
            "job",
            f"m{ctx.rank}",
            min_size=2,
            heartbeat_timeout=SLOW_HB,
            join_window=2 * SLOW_HB,
        ) as members,
        ftcomm.Group("gloo", timeout=2 * SLOW_HB) as group,
    ):
        world = await members.join(group)
        done = 0
        while done < steps:
            issued = time.monotonic()
            try:
                await group.allreduce(torch.ones(1))
                done += 1
                log.append(world.size)
            except ftcomm.CommError as exc:
                failed = time.monotonic()
                world = await members.recover(group)
                log.append((type(exc).__name__, failed - issued, time.monotonic() - failed))
    return log


def test_a_killed_member_is_dead_at_once_to_a_recover() -> None:
    """Its listener refuses: the survivors form the next world without it
    at once, not a heartbeat timeout (8 s here) later."""
    results = run_world(_train, 3, plan=FaultPlan.of(Fault.kill(2, 2)), args=(4,), timeout=60)
    assert results[2] is None
    for log in results[:2]:
        assert log[:2] == [3, 3]
        error, _, took = log[2]
        assert error == "CommFailed"
        assert took < SLOW_HB / 2, log  # a configure's time, not the heartbeat's
        assert log[3:] == [2, 2]


async def _hung_peer(ctx: RankContext) -> list[Any]:
    return await _train(ctx, 3)


def test_an_op_waiting_on_a_stopped_member_ends_when_its_heartbeat_does() -> None:
    """Rank 2 is stopped with the op in flight: the op's deadline is 16 s,
    the heartbeat timeout 8 s; the watch aborts the op at the latter."""
    results = run_world(_hung_peer, 3, plan=FaultPlan.of(Fault.stop(2, 1)), timeout=90)
    assert results[2] is None
    errors = {log[1][0] for log in results[:2]}
    assert "CommAborted" in errors
    assert errors <= {"CommAborted", "CommFailed"}
    for log in results[:2]:
        _, op_took, _ = log[1]
        assert op_took < SLOW_HB + 5.0 < 2 * SLOW_HB, log


def test_the_watch_fires_once_for_a_dead_member_of_its_world(store: Any) -> None:
    me, other = M[0], M[1]
    client = _client(store)
    client.set(f"hb/{me.id}", f"{me.token} 0")
    watcher = Watcher(client, me, interval=0.05, timeout=0.3)
    fired: list[str] = []
    watcher.watch(7, (me, other), {}, fired.append)
    watcher.refused_seen(other)
    watcher.tick()
    watcher.tick()
    assert len(fired) == 1
    assert "m1" in fired[0]
    watcher.watch(8, (me,), {}, fired.append)
    watcher.tick()
    assert len(fired) == 1  # nothing dead in the world watched now


def test_a_member_that_left_breaks_the_watched_world_only_after_a_timeout(store: Any) -> None:
    """A member that ends at a step closes its Membership (its beat says
    ``left``) as soon as its last collective is done on its side; the
    others' copies of that collective may still be finishing. Its world is
    not aborted for that until a heartbeat timeout later."""
    me, other = M[0], M[1]
    client = _client(store)
    client.set("roster", me.line() + other.line())
    client.set(f"hb/{me.id}", f"{me.token} 0")
    client.set(f"hb/{other.id}", f"{other.token} 0")
    now = [0.0]
    watcher = Watcher(client, me, interval=0.1, timeout=0.5, clock=lambda: now[0])
    fired: list[tuple[float, str]] = []
    watcher.watch(7, (me, other), {}, lambda why: fired.append((now[0], why)))
    watcher.tick()
    client.set(f"hb/{other.id}", f"{other.token} left")
    while now[0] < 1.0:  # rounds 0.1 s apart (never late: no clock is reset)
        now[0] = round(now[0] + 0.1, 1)
        watcher.tick()
    assert len(fired) == 1, fired
    at, why = fired[0]
    assert at == 0.6, fired  # seen left at 0.1, aborted once the 0.5 s timeout passed
    assert "m1 is dead" in why
    assert not watcher.alive(other)  # (to a recover, it is gone at once)


def test_a_probe_that_cannot_start_is_silent_not_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_more(*args: Any, **kwargs: Any) -> socket.socket:
        raise OSError(24, "Too many open files")

    probes: Probes[str] = Probes()
    monkeypatch.setattr(socket, "socket", no_more)
    probes.start("x", ("127.0.0.1", 9), 1.0)
    monkeypatch.undo()
    assert probes.busy("x")
    assert probes.poll() == {"x": Reach.SILENT}
    assert not probes.busy("x")


def test_a_probe_of_the_world_before_answers_nothing_in_the_next(store: Any) -> None:
    """A probe started while world 6 (with m1) was watched ends after world 7
    (without it) is watched: its refusal must not abort world 7."""
    me, gone = M[0], M[1]
    client = _client(store)
    client.set(f"hb/{me.id}", f"{me.token} 0")
    closed = Listener("127.0.0.1")
    address = ("127.0.0.1", closed.port)
    closed.close()
    watcher = Watcher(client, me, interval=0.05, timeout=0.3)
    fired: list[str] = []
    watcher.watch(6, (me, gone), {gone: address}, fired.append)
    watcher._check_world()  # starts the probe of m1 (no answer read yet)
    assert watcher._probes.busy(gone)
    watcher.watch(7, (me, M[2]), {}, fired.append)
    watcher._check_world()
    watcher._check_world()
    assert fired == []


def test_members_that_did_not_read_every_report_give_no_verdict(store: Any) -> None:
    """m2 never reports (slow, or gone): m0 and m1, which reach each other,
    decide nothing from a part of the reports (m2 would be left out for its
    silence alone) and return no one."""
    members = M[:3]
    record = WorldRecord(generation=9, members=tuple(members))
    clients = [_client(store) for _ in members[:2]]
    listeners = [Listener("127.0.0.1") for _ in members]
    try:
        for member, listener in zip(members, listeners, strict=True):
            clients[0].set(at_key(member.id), f"{member.token} {listener.address}")
        found: dict[Member, set[Member]] = {}

        def run(i: int) -> None:
            watcher = Watcher(clients[i], members[i], interval=0.1, timeout=0.3)
            found[members[i]] = _paths.check(
                clients[i], watcher, members[i], record, threading.Event(), 0.3
            )[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert found == {members[0]: set(), members[1]: set()}
        assert not clients[0].check([_paths.cut_key(9)])
    finally:
        for listener in listeners:
            listener.close()


@pytest.mark.asyncio
async def test_a_cut_that_would_leave_too_few_bars_no_one(store: Any) -> None:
    """Generation 5 of two (min_size 2) was given up with m1 cut: barring it
    would leave one, and no generation could ever form again; both are in
    the next one (whose own check says whether the path works now)."""
    async with (
        ftcomm.Membership(store.address, "job", "m0", min_size=2) as a,
        ftcomm.Membership(store.address, "job", "m1", min_size=2) as b,
    ):
        ea, eb = a._engine, b._engine
        prev = WorldRecord(generation=5, members=(ea.me, eb.me))
        client = _client(store)
        client.set("ftcomm/members/job/cut/5", eb.me.line())
        client.set("ftcomm/members/job/fate/5", eb.me.line())

        def agree(engine: Any, member_of: int) -> WorldRecord:
            return engine.agree(  # type: ignore[no-any-return]
                prev,
                threading.Event(),
                member_of=member_of,
                min_size=2,
                max_size=2,
                window=5.0,
                deadline=time.monotonic() + 10,
            )

        loop = asyncio.get_running_loop()
        worlds = await asyncio.gather(
            loop.run_in_executor(None, agree, ea, 5), loop.run_in_executor(None, agree, eb, 5)
        )
        assert worlds[0] == worlds[1]
        assert worlds[0].generation == 6
        assert set(worlds[0].members) == {ea.me, eb.me}
