"""Who is in the next generation: the records and the rule, sans-IO.

Owns: :class:`Member`, :class:`WorldRecord` (what the engine stores for one
generation, and its text form), the roster and ready-list codecs, and
:func:`decide`, the one rule every member applies to the same inputs (and
:func:`leave_out`, who goes for paths cut). Whoever sees the rule hold first
writes the record; the engine makes that write happen once
(``compare_set``), so every member reads the same world. See
docs/membership.md, "The model".
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Member:
    """One incarnation of a member: its id, and a token that is new each run."""

    id: str
    token: str

    @classmethod
    def fresh(cls, member_id: str) -> Member:
        """A new incarnation of ``member_id``."""
        return cls(member_id, uuid.uuid4().hex[:16])

    def line(self) -> str:
        return f"{self.id}\t{self.token}\n"


@dataclass(frozen=True, slots=True)
class WorldRecord:
    """One generation as stored: its members in rank order, and the roster
    entries it has looked at (``seen``) of which ``waiting`` were not
    admitted (over ``max_size``, not ready yet, or not seen alive yet):
    they are the next generation's newcomers, where alive then."""

    generation: int
    members: tuple[Member, ...]
    seen: int = 0
    waiting: tuple[int, ...] = field(default=())

    def encode(self) -> str:
        return json.dumps(
            {
                "generation": self.generation,
                "members": [[m.id, m.token] for m in self.members],
                "seen": self.seen,
                "waiting": list(self.waiting),
            },
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, text: bytes | str) -> WorldRecord:
        """Raises: ValueError: not a record this module wrote."""
        try:
            raw = json.loads(text)
            return cls(
                generation=int(raw["generation"]),
                members=tuple(Member(str(i), str(t)) for i, t in raw["members"]),
                seen=int(raw["seen"]),
                waiting=tuple(int(i) for i in raw["waiting"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a membership record: {text!r:.200}") from exc

    def rank_of(self, member: Member) -> int | None:
        try:
            return self.members.index(member)
        except ValueError:
            return None

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(m.id for m in self.members)


EMPTY = WorldRecord(generation=0, members=())
"""Before the first generation."""

NO_CAP = 1 << 30
"""``max_size`` where there is none."""


def parse_roster(text: bytes | str) -> list[Member]:
    """The roster: one ``id<TAB>token`` line per registration, in order."""
    if isinstance(text, bytes):
        text = text.decode()
    return [Member(*line.split("\t", 1)) for line in text.splitlines() if "\t" in line]


def parse_ready(text: bytes | str) -> set[Member]:
    """A generation's ready list: ``+id<TAB>token`` lines in, ``-...`` out."""
    if isinstance(text, bytes):
        text = text.decode()
    ready: set[Member] = set()
    for line in text.splitlines():
        if len(line) < 2 or "\t" not in line:
            continue
        member = Member(*line[1:].split("\t", 1))
        if line[0] == "+":
            ready.add(member)
        elif line[0] == "-":
            ready.discard(member)
    return ready


def ready_line(member: Member, present: bool) -> str:
    return ("+" if present else "-") + member.line()


@dataclass(frozen=True, slots=True)
class Candidates:
    """Who may be in the next generation (the rule: :func:`decide`)."""

    survivors: tuple[Member, ...]
    newcomers: tuple[tuple[int, Member], ...]  # (roster index, member)
    queued: tuple[int, ...] = ()
    """The roster indices of every newcomer, alive or not: one that looks
    dead now (a slow first beat) is looked at again next time."""

    @property
    def members(self) -> tuple[Member, ...]:
        return self.survivors + tuple(m for _, m in self.newcomers)


def candidates(
    prev: WorldRecord, roster: Sequence[Member], alive: Callable[[Member], bool]
) -> Candidates:
    """The survivors of ``prev`` and the newcomers of ``roster``, alive ones only.

    A newcomer is a roster entry ``prev`` has not seen, or one it left
    waiting; of several entries with one id, the latest counts (a restarted
    member), and none whose id is a survivor's.
    """
    survivors = tuple(m for m in prev.members if alive(m))
    taken = {m.id for m in survivors}
    latest: dict[str, int] = {}
    for index in _unseen(prev, len(roster)):
        latest[roster[index].id] = index  # later entries replace earlier ones
    by_id = {roster[i].id: i for i in range(len(roster))}  # the very latest of each id
    queued = tuple(
        i
        for i in sorted(latest.values())
        if roster[i].id not in taken and by_id[roster[i].id] == i and roster[i] not in prev.members
    )
    newcomers = tuple((i, roster[i]) for i in queued if alive(roster[i]))
    return Candidates(survivors, newcomers, queued)


def _unseen(prev: WorldRecord, size: int) -> Iterable[int]:
    yield from (i for i in prev.waiting if i < size)
    yield from range(prev.seen, size)


def decide(
    prev: WorldRecord,
    roster: Sequence[Member],
    ready: set[Member],
    alive: Callable[[Member], bool],
    *,
    me: Member,
    window_passed: bool,
    min_size: int,
    max_size: int,
) -> WorldRecord | None:
    """The next generation's record, if the rule holds now; else ``None``.

    The rule, for the generation after ``prev`` (the world ``W``; none
    before the first):

    * **candidates**, in rank order: ``W``'s members that are alive, in
      their old order (the *survivors*), then the members of the roster that
      are not in ``W`` and are alive (the *newcomers*), in the order they
      registered. A member is alive while its heartbeat moves.
    * **ready**: the candidates that called ``join()``/``recover()`` for it.
    * It is decided, with the ready candidates (the first ``max_size``),
      once at least ``min_size`` are ready and:

      - where there are survivors: every survivor is ready (the newcomers
        that are come in, the others wait for the next generation: a
        newcomer that registered and never came blocks nothing); or the
        join window has passed and the one deciding (``me``) is a survivor;
      - where there are none (the first generation, or every member of
        ``W`` died): ``max_size`` are ready, or the join window has passed.

      So a newcomer never decides while a member of ``W`` lives and is not
      there: a running world only changes with its own members present (or
      dead), never behind their backs.
    """
    found = candidates(prev, roster, alive)
    everyone = found.members
    chosen = tuple(m for m in everyone if m in ready)[:max_size]
    if len(chosen) < min_size:
        return None
    if found.survivors:
        waited = window_passed and me in prev.members
        if not waited and not all(m in ready for m in found.survivors):
            return None
    elif len(chosen) < max_size and not window_passed:
        return None
    admitted = set(chosen)
    return WorldRecord(
        generation=prev.generation + 1,
        members=chosen,
        seen=len(roster),
        waiting=tuple(i for i in found.queued if roster[i] not in admitted),
    )


def enough_ready(
    prev: WorldRecord,
    roster: Sequence[Member],
    ready: set[Member],
    alive: Callable[[Member], bool],
    min_size: int,
) -> bool:
    """Whether at least ``min_size`` candidates are ready (the join window
    runs from the first moment this holds)."""
    return sum(m in ready for m in candidates(prev, roster, alive).members) >= min_size


def missing(
    prev: WorldRecord,
    roster: Sequence[Member],
    ready: set[Member],
    alive: Callable[[Member], bool],
) -> tuple[list[str], list[str]]:
    """(ready ids, ids of candidates not ready): for a timeout's message."""
    everyone = candidates(prev, roster, alive).members
    return [m.id for m in everyone if m in ready], [m.id for m in everyone if m not in ready]


EXACT_CUT = 4
"""Up to this many members left out, :func:`leave_out` finds the fewest
exactly (``2**4`` branches at most); beyond, it leaves out greedily (the
member with the most broken pairs first): a world split in halves costs
milliseconds, not seconds, at 64 members."""


def leave_out(
    members: Sequence[Member], reached: Mapping[Member, Collection[Member]]
) -> tuple[Member, ...]:
    """The fewest of ``members`` (rank order) to leave out so that every two
    of the rest reached each other (``reached[m]``: whom ``m`` reached, by
    its own report). A pair is broken where either end's report says it
    did not reach the other; a member without a report (its check slow to
    end) is judged by the others' reports alone, never by its silence. Of
    several answers as small, the one found first by trying the later rank
    of each broken pair first. ``()``: every pair works."""

    def missed(a: Member, b: Member) -> bool:
        return a in reached and b not in reached[a]

    broken = [
        (a, b)
        for i, a in enumerate(members)
        for b in members[i + 1 :]
        if missed(a, b) or missed(b, a)
    ]
    if not broken:
        return ()
    for budget in range(1, min(EXACT_CUT, len(members)) + 1):
        found = _cover(broken, budget)
        if found is not None:
            return tuple(m for m in members if m in found)
    out: set[Member] = set()
    left = list(broken)
    while left:
        count: dict[Member, int] = {}
        for a, b in left:
            count[a] = count.get(a, 0) + 1
            count[b] = count.get(b, 0) + 1
        worst = max(reversed(members), key=lambda m: count.get(m, 0))
        out.add(worst)
        left = [(a, b) for a, b in left if worst not in (a, b)]
    return tuple(m for m in members if m in out)


def _cover(broken: Sequence[tuple[Member, Member]], budget: int) -> set[Member] | None:
    """At most ``budget`` members that take part in every broken pair; ``None``: none."""
    if not broken:
        return set()
    if budget == 0:
        return None
    a, b = broken[0]
    for pick in (b, a):
        rest = [pair for pair in broken if pick not in pair]
        found = _cover(rest, budget - 1)
        if found is not None:
            return found | {pick}
    return None
