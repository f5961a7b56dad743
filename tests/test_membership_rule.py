"""Membership's rule and heartbeats, without processes: the records, the one
rule that decides a generation, and the watcher over a fake store and clock."""

from __future__ import annotations

import random
from typing import Any

import pytest

from ftcomm._membership._rule import (
    EMPTY,
    Member,
    WorldRecord,
    candidates,
    decide,
    parse_ready,
    parse_roster,
    ready_line,
)
from ftcomm._membership._watch import MISSING, Superseded, Watcher, read

A, B, C, D, E = (Member(name, f"t{name}") for name in "abcde")


def everyone_alive(_: Member) -> bool:
    return True


def rule(
    prev: WorldRecord,
    roster: list[Member],
    ready: set[Member],
    *,
    me: Member,
    alive: Any = everyone_alive,
    window: bool = False,
    min_size: int = 2,
    max_size: int = 3,
) -> WorldRecord | None:
    return decide(
        prev,
        roster,
        ready,
        alive,
        me=me,
        window_passed=window,
        min_size=min_size,
        max_size=max_size,
    )


def test_records_round_trip_and_reject_garbage() -> None:
    record = WorldRecord(3, (A, B), seen=4, waiting=(2,))
    assert WorldRecord.decode(record.encode()) == record
    assert WorldRecord.decode(record.encode().encode()) == record
    with pytest.raises(ValueError, match="not a membership record"):
        WorldRecord.decode(b'{"generation": 1}')
    assert parse_roster(A.line() + B.line() + "junk\n") == [A, B]
    lines = ready_line(A, True) + ready_line(B, True) + ready_line(A, False)
    assert parse_ready(lines) == {B}


def test_the_first_generation_waits_for_the_window_or_max_size() -> None:
    roster = [A, B, C]
    assert rule(EMPTY, roster, {A}, me=A, window=True) is None  # below min_size
    assert rule(EMPTY, roster, {A, B}, me=A) is None  # min_size, window open
    two = rule(EMPTY, roster, {A, B}, me=B, window=True)
    assert two == WorldRecord(1, (A, B), seen=3, waiting=(2,))  # C: alive, not ready
    three = rule(EMPTY, roster, {A, B, C}, me=C)
    assert three == WorldRecord(1, (A, B, C), seen=3)  # max_size: at once


def test_survivors_recover_at_once_when_every_candidate_is_there() -> None:
    prev = WorldRecord(1, (A, B, C), seen=3)
    dead_c = lambda m: m != C  # noqa: E731
    record = rule(prev, [A, B, C], {A, B}, me=A, alive=dead_c)
    assert record == WorldRecord(2, (A, B), seen=3)
    # C alive and not there: wait, unless a survivor's window passed
    assert rule(prev, [A, B, C], {A, B}, me=A) is None
    assert rule(prev, [A, B, C], {A, B}, me=A, window=True) == WorldRecord(2, (A, B), seen=3)


def test_a_newcomer_never_changes_a_running_world_behind_its_back() -> None:
    prev = WorldRecord(1, (A, B), seen=2)
    roster = [A, B, C, D, E]
    # three newcomers ready make max_size, but A and B live and are not there
    assert rule(prev, roster, {C, D, E}, me=C, window=True) is None
    assert rule(prev, roster, {B, C, D}, me=C, window=True) is None
    # with the survivors there, the newcomers are let in, in roster order
    record = rule(prev, roster, {A, B, C, D}, me=C)
    assert record == WorldRecord(2, (A, B, C), seen=5, waiting=(3, 4))


def test_newcomers_decide_alone_once_the_old_world_is_dead() -> None:
    prev = WorldRecord(4, (A, B), seen=2)
    alive = lambda m: m in (C, D)  # noqa: E731
    assert rule(prev, [A, B, C, D], {C, D}, me=C, alive=alive) is None
    record = rule(prev, [A, B, C, D], {C, D}, me=C, alive=alive, window=True)
    assert record == WorldRecord(5, (C, D), seen=4)


def test_waiting_newcomers_come_next_and_dead_ones_are_looked_at_again() -> None:
    prev = WorldRecord(2, (A, B, C), seen=5, waiting=(3, 4))
    roster = [A, B, C, D, E]
    found = candidates(prev, roster, lambda m: m != E)
    assert (found.survivors, found.newcomers) == ((A, B, C), ((3, D),))
    assert found.queued == (3, 4)


def test_a_newcomer_seen_dead_at_one_decision_comes_in_at_a_later_one() -> None:
    """A live newcomer whose first beat was not read in time is left out of
    one generation, not forgotten: it waits, and the next one takes it."""
    prev = WorldRecord(1, (A, B), seen=2)
    not_c = lambda m: m != C  # noqa: E731
    two = rule(prev, [A, B, C], {A, B, C}, me=A, alive=not_c, max_size=4)
    assert two == WorldRecord(2, (A, B), seen=3, waiting=(2,))
    three = rule(two, [A, B, C], {A, B, C}, me=A, max_size=4)
    assert three == WorldRecord(3, (A, B, C), seen=3)


def test_a_newcomer_that_is_not_ready_blocks_no_one() -> None:
    """Registered and never come (a cancelled join): the survivors go on at
    once without it, and it waits for a later generation."""
    prev = WorldRecord(1, (A, B), seen=2)
    record = rule(prev, [A, B, C], {A, B}, me=B)
    assert record == WorldRecord(2, (A, B), seen=3, waiting=(2,))


def test_a_restarted_member_is_a_newcomer_and_its_old_self_is_gone() -> None:
    c2 = Member("c", "restarted")
    prev = WorldRecord(1, (A, B, C), seen=3)
    alive = lambda m: m != C  # noqa: E731  (its old token: the heartbeat says c2 now)
    record = rule(prev, [A, B, C, c2], {A, B, c2}, me=A, alive=alive)
    assert record == WorldRecord(2, (A, B, c2), seen=4)


def test_a_dropped_member_that_registers_again_is_a_newcomer() -> None:
    prev = WorldRecord(2, (A, B), seen=3)  # C was dropped from generation 2
    record = rule(prev, [A, B, C, C], {A, B, C}, me=B)
    assert record == WorldRecord(3, (A, B, C), seen=4)
    assert rule(prev, [A, B, C], {A, B, C}, me=B) == WorldRecord(3, (A, B), seen=3)


def test_every_decision_keeps_the_rule() -> None:
    """Random worlds, views and deciders (2000 seeds): a decision has only
    ready, alive candidates, survivors first, between min_size and max_size,
    and never leaves out a live survivor unless a survivor decided by the
    window."""
    decided = sum(_random_decision(seed) for seed in range(2000))
    assert 200 < decided < 1800  # both outcomes were drawn


def _random_decision(seed: int) -> bool:
    rnd = random.Random(seed)
    pool = [Member(f"m{i}", "t") for i in range(7)]
    prev_members = tuple(rnd.sample(pool, rnd.randint(0, 4)))
    prev = WorldRecord(rnd.randint(0, 5), prev_members, seen=len(prev_members))
    roster = list(prev_members) + [m for m in pool if m not in prev_members]
    alive_set = {m for m in pool if rnd.random() < 0.8}
    ready = {m for m in pool if rnd.random() < 0.7}
    me = rnd.choice(sorted(ready | {pool[0]}, key=lambda m: m.id))
    ready.add(me)
    alive_set.add(me)
    min_size = rnd.randint(1, 3)
    max_size = rnd.randint(min_size, 5)
    window = rnd.random() < 0.5
    record = rule(
        prev,
        roster,
        ready,
        me=me,
        alive=alive_set.__contains__,
        window=window,
        min_size=min_size,
        max_size=max_size,
    )
    if record is None:
        return False
    assert record.generation == prev.generation + 1
    assert min_size <= len(record.members) <= max_size
    assert set(record.members) <= ready & alive_set
    survivors = [m for m in prev.members if m in alive_set]
    kept = [m for m in record.members if m in prev.members]
    assert kept == [m for m in survivors if m in kept]  # the old order
    assert record.members[: len(kept)] == tuple(kept)  # survivors first
    if not (window and me in prev.members) and len(record.members) < max_size:
        assert set(survivors) <= set(record.members), seed
    return True


def claimed(store: FakeStore, me: Member, clock: Any) -> Watcher:
    """A watcher for ``me``, whose key ``me`` has claimed (as open() does)."""
    store.set(f"hb/{me.id}", f"{me.token} 0")
    return Watcher(store, me, interval=0.1, timeout=1.0, clock=clock)


class FakeStore:
    """The store calls the watcher makes, over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        held = self.data.get(key)
        if held is None:
            if expected == "":
                self.data[key] = desired.encode()
                return desired.encode()
            return expected.encode()
        if held == expected.encode():
            self.data[key] = desired.encode()
            return desired.encode()
        return held

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.data[k] for k in keys]

    def append(self, key: str, value: str) -> None:
        self.data[key] = self.data.get(key, b"") + value.encode()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_read_never_writes_a_missing_key() -> None:
    store = FakeStore()
    assert read(store, "k") is None
    assert "k" not in store.data
    store.set("k", MISSING + "x")
    assert read(store, "k") == (MISSING + "x").encode()


def test_a_member_is_alive_while_its_heartbeat_moves() -> None:
    store, clock = FakeStore(), Clock()
    store.append("roster", A.line() + B.line() + C.line())
    watcher = claimed(store, A, clock)
    assert watcher.alive(B)  # not seen yet: given a whole timeout
    store.set("hb/b", "tb 1")
    store.set("hb/c", "tc 1")
    for step in range(2, 14):  # b beats, c is silent for over a second
        clock.now += 0.1
        store.set("hb/b", f"tb {step}")
        watcher.tick()
    assert store.data["hb/a"].startswith(b"ta ")
    assert watcher.alive(B)
    assert not watcher.alive(C)
    assert watcher.roster() == [A, B, C]
    store.set("hb/b", "tb left")
    clock.now += 0.1
    watcher.tick()
    assert not watcher.alive(B)  # left: at once
    store.set("hb/c", "other 1")  # c restarted: its old token is gone
    store.append("roster", Member("c", "other").line())
    clock.now += 0.1
    watcher.tick()
    assert not watcher.alive(C)
    assert watcher.alive(Member("c", "other"))


def test_the_watchers_own_pause_is_not_taken_for_a_death() -> None:
    store, clock = FakeStore(), Clock()
    store.append("roster", A.line() + B.line())
    store.set("hb/b", "tb 1")
    watcher = claimed(store, A, clock)
    watcher.tick()
    clock.now += 5.0  # this process was stopped; b beat all along, unseen
    watcher.tick()
    assert watcher.alive(B)
    clock.now += 0.4
    watcher.tick()
    assert watcher.alive(B)
    for _ in range(7):  # now b really is silent, and we are looking
        clock.now += 0.1
        watcher.tick()
    assert not watcher.alive(B)


def test_while_the_watchers_own_round_is_late_no_one_is_called_dead() -> None:
    store, clock = FakeStore(), Clock()
    store.append("roster", A.line() + B.line())
    store.set("hb/b", "tb 1")
    watcher = claimed(store, A, clock)
    watcher.tick()
    clock.now += 0.4
    watcher.tick()
    clock.now += 0.7  # b silent for 1.1 s, but our round is 0.7 s late (a stalled store)
    assert watcher.alive(B)
    watcher.tick()  # the round came back: b's clock starts afresh
    assert watcher.alive(B)
    for _ in range(11):
        clock.now += 0.1
        watcher.tick()
    assert not watcher.alive(B)


def test_a_restarted_member_supersedes_the_old_one_from_its_claim_on() -> None:
    """A new incarnation claims the id's key before it registers (and could
    only once the old one left or went silent): from the round that reads
    its claim the old incarnation is dead; the new one is alive before and
    after it is on the roster."""
    store, clock = FakeStore(), Clock()
    store.append("roster", A.line() + B.line())
    store.set("hb/b", "tb 1")
    watcher = claimed(store, A, clock)
    watcher.tick()
    assert watcher.alive(B)
    b2 = Member("b", "again")
    store.set("hb/b", "again 0")  # claimed; not registered yet
    clock.now += 0.05
    watcher.tick()
    assert not watcher.alive(B)
    assert watcher.alive(b2)
    store.append("roster", b2.line())
    clock.now += 0.05
    watcher.tick()
    assert watcher.alive(b2)
    assert not watcher.alive(B)


def test_an_old_incarnation_that_resumes_stops_at_its_next_beat() -> None:
    """A stopped member that resumes after another took its id never
    writes its key again: its beat finds another's value, and it stops."""
    store, clock = FakeStore(), Clock()
    store.append("roster", A.line())
    watcher = claimed(store, A, clock)
    watcher.tick()
    store.set("hb/a", "newer 0")  # the id was taken while this one was stopped
    with pytest.raises(Superseded, match="another incarnation of member 'a'"):
        watcher.tick()
    assert store.data["hb/a"] == b"newer 0"


def test_a_last_look_before_calling_a_member_dead_counts_a_fresh_beat() -> None:
    """A member resumed after a stop beats again: a watcher that has not
    read it since sees it dead, until refresh() reads the beat now."""
    store, clock = FakeStore(), Clock()
    store.append("roster", A.line() + B.line())
    store.set("hb/b", "tb 1")
    watcher = claimed(store, A, clock)
    for _ in range(12):
        clock.now += 0.1
        watcher.tick()
    assert not watcher.alive(B)
    store.set("hb/b", "tb 2")  # it beat, between two of our rounds
    watcher.refresh(store, [B])
    assert watcher.alive(B)
    watcher.refresh(store, [A])  # our own beat is never read back
    assert watcher.alive(A)


def test_a_renew_after_the_leave_keeps_the_leave() -> None:
    """close() said the member left while a cancelled call's renew was
    still coming: the renew writes nothing, and the key says left."""
    store, clock = FakeStore(), Clock()
    watcher = claimed(store, A, clock)
    assert watcher.renew(Member("a", "second")) is True
    assert store.data["hb/a"] == b"second 0"
    watcher.stop(leave=True)
    assert store.data["hb/a"] == b"second left"
    assert watcher.renew(Member("a", "third")) is False
    assert store.data["hb/a"] == b"second left"
