"""The store engine's look at paths between members: who reaches whom.

Owns: the keys ``at/<id>``, ``reach/<g>`` and ``cut/<g>`` of a job, and the
blocking steps that read and write them: where members listen, a
configure's check of every path of its world and the verdict on who is left
out (:func:`check`), a newcomer's wait until it reaches the world, and a
recover's probes of members that are not there (:class:`Absent`: a refusal
is a death). Store errors go up as they are (the engine turns them into
``MembershipError``). Why a check, and this one: docs/membership.md, "Paths cut".
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import MembershipTimeout
from ._reach import Probes, Reach, parse_address, probe_all
from ._rule import Member, WorldRecord, leave_out, parse_roster
from ._watch import Watcher, at_key, read


def reach_key(generation: int) -> str:
    return f"reach/{generation}"


def cut_key(generation: int) -> str:
    return f"cut/{generation}"


def addresses(store: Any, members: list[Member], me_id: str) -> dict[Member, tuple[str, int]]:
    """Where ``members``' listeners are: those whose ``at`` key this very
    incarnation wrote (every member of a record wrote it before it
    registered; a later incarnation's replaces it). Others are left out."""
    ids = sorted({m.id for m in members if m.id != me_id})
    if not ids:
        return {}
    # a multi_get waits for a missing key: none is (see above)
    values: list[bytes] = store.multi_get([at_key(i) for i in ids])
    held = dict(zip(ids, values, strict=True))
    found: dict[Member, tuple[str, int]] = {}
    for member in members:
        token, _, where = held.get(member.id, b"").decode(errors="replace").partition(" ")
        address = parse_address(where) if token == member.token else None
        if address is not None:
            found[member] = address
    return found


def reports(text: bytes | None, record: WorldRecord) -> dict[Member, set[Member]]:
    """``reach/<g>``'s lines: whom each member of ``record`` reached (a
    member's first line counts; lines of others are left out)."""
    found: dict[Member, set[Member]] = {}
    for line in (text or b"").decode(errors="replace").splitlines():
        fields = line.split("\t")
        pairs = [Member(fields[i], fields[i + 1]) for i in range(0, len(fields) - 1, 2)]
        if pairs and pairs[0] in record.members and pairs[0] not in found:
            found[pairs[0]] = set(pairs[1:])
    return found


def report_line(me: Member, reached: list[Member]) -> str:
    return me.id + "\t" + me.token + "".join(f"\t{m.id}\t{m.token}" for m in reached) + "\n"


def left_out(store: Any, record: WorldRecord) -> set[Member]:
    """``cut/<g>``'s members of ``record`` (the caller checks it was given up)."""
    text = read(store, cut_key(record.generation)) if record.generation else None
    return set(parse_roster(text)) & set(record.members) if text else set()


def check(
    store: Any,
    watcher: Watcher,
    me: Member,
    record: WorldRecord,
    stop: threading.Event,
    timeout: float,
) -> tuple[set[Member], set[Member]]:
    """Probe the other members of ``record``, report, and once every member
    reported (or ``timeout`` past this member's own probes, plus as long
    again, at least a second): who is left out of the next generation, the
    same for every member (empty: every path works, or ``stop`` was set:
    the configure ended first), and whom this member reached."""
    g = record.generation
    others = [m for m in record.members if m != me]
    answers = probe_all(addresses(store, others, me.id), timeout, stop)
    for member, answer in answers.items():
        if answer is Reach.REFUSED:
            watcher.refused_seen(member)
    reached = {m for m in others if answers.get(m) is Reach.OK}
    if stop.is_set():
        return set(), reached
    store.append(reach_key(g), report_line(me, [m for m in others if m in reached]))
    # Only a member that read every report decides (so that no verdict
    # rests on a part of them); the others wait for its verdict.
    until = time.monotonic() + timeout + max(timeout, 1.0)
    pause = 0.01
    while not stop.is_set():
        found = reports(read(store, reach_key(g)), record)
        if len(found) == len(record.members):
            out = leave_out(record.members, found)
            if not out:
                return set(), reached
            held = store.compare_set(cut_key(g), "", "".join(m.line() for m in out))
            return set(parse_roster(held)) & set(record.members), reached
        decided = read(store, cut_key(g))
        if decided:
            return set(parse_roster(decided)) & set(record.members), reached
        if time.monotonic() >= until:
            break  # a member never reported (dead, or gone on): no verdict
        stop.wait(pause)
        pause = min(pause * 2, 0.1)
    return set(), reached


def wait_reachable(
    store: Any,
    watcher: Watcher,
    me_id: str,
    latest: WorldRecord,
    stop: threading.Event,
    timeout: float,
) -> list[str]:
    """Probe the members of ``latest`` (a newcomer, before it registers):
    the ids of those alive that stayed silent (one gone refuses, or its
    heartbeat stopped: no reason to wait for it)."""
    found = addresses(store, [m for m in latest.members if m.id != me_id], me_id)
    answers = probe_all(found, timeout, stop)
    return sorted(m.id for m, a in answers.items() if a is Reach.SILENT and watcher.alive(m))


def no_way_in(me_id: str, job: str, silent: list[str], generation: int) -> MembershipTimeout:
    return MembershipTimeout(
        f"member {me_id!r} cannot reach {', '.join(silent)} of generation {generation} of "
        f"job {job!r}: it waits to come in until it can (a network fault between them)"
    )


class Absent:
    """A recover's probes of the previous world's members that are alive
    but not ready, each at most once per ``every`` seconds: one whose
    listener refuses is dead now, not a heartbeat timeout from now."""

    def __init__(self, watcher: Watcher, every: float) -> None:
        self._watcher = watcher
        self._every = every
        self._probes: Probes[Member] = Probes()
        self._last: dict[Member, float] = {}
        self._where: dict[Member, tuple[str, int]] = {}  # an incarnation's never moves

    def probe(self, store: Any, me: Member, prev: WorldRecord, ready: set[Member]) -> None:
        for member, answer in self._probes.poll().items():
            if answer is Reach.REFUSED:
                self._watcher.refused_seen(member)
        now = time.monotonic()
        due = [
            m
            for m in prev.members
            if m != me
            and m not in ready
            and self._watcher.alive(m)
            and not self._probes.busy(m)
            and now - self._last.get(m, -1e9) >= self._every
        ]
        unknown = [m for m in due if m not in self._where]
        if unknown:
            self._where.update(addresses(store, unknown, me.id))
        for member in due:  # (one with no address is looked for again next time)
            self._last[member] = now
            if member in self._where:
                self._probes.start(member, self._where[member], self._every)

    def close(self) -> None:
        self._probes.close()
