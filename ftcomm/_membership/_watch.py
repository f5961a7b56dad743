"""Heartbeats: this member's, beaten, and the others', watched. One thread.

Owns: :class:`Watcher`, the only writer of this member's heartbeat key and
the only reader of everyone else's, and what it concludes (who is alive,
the roster as last read); the watch of a configured world
(:meth:`Watcher.watch`), whose broken paths and dead members abort it; and
the key names and reads the store engine shares (:func:`read`). What a
member sees: docs/membership.md, "The model".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from ._reach import PROBE_TIMEOUT, Listener, Probes, Reach
from ._rule import Member, WorldRecord, parse_roster

log = logging.getLogger("ftcomm")

MISSING = "\x00missing"
"""What :func:`read` gives for a key that is not there."""


def read(store: Any, key: str) -> bytes | None:
    """The value of ``key``, or ``None``: one round trip that never blocks
    (a ``get`` of a missing key waits for it; this ``compare_set`` answers
    its own ``expected`` value instead, and writes nothing)."""
    value: bytes = store.compare_set(key, MISSING, MISSING)
    return None if value == MISSING.encode() else value


def parse_floor(held: bytes | None) -> int:
    """A ``floor`` key's value (0: none, or not a number)."""
    text = held.decode(errors="replace") if held is not None else ""
    return int(text) if text.isascii() and text.isdigit() else 0


def raise_to(store: Any, key: str, to: int, parse: Callable[[bytes | None], int]) -> int:
    """Move the number at ``key`` up to ``to``, never down (``compare_set``
    from the value read, again while others move it); what it holds after."""
    for _ in range(64):
        held = read(store, key)
        now = parse(held)
        if now >= to:
            return now
        expected = held.decode() if held is not None else ""
        if store.compare_set(key, expected, str(to)) == str(to).encode():
            return to
    return parse(read(store, key))


def beat_key(member_id: str) -> str:
    return f"hb/{member_id}"


LEFT = "left"


def quit_key(generation: int) -> str:
    return f"quit/{generation}"


def suspect_key(generation: int) -> str:
    return f"sus/{generation}"


def fate_key(generation: int) -> str:
    return f"fate/{generation}"


FLOOR = "floor"
"""Every generation below it is over: a later one was kept (``_sweep``)."""
FLOOR_EVERY = 1.0
"""Seconds between two looks at ``floor`` (by the watcher, and by an agreeing member)."""


KEPT = "kept"
"""The verdict on a generation (``fate/<g>``) that its configure succeeded."""


def gives_up(verdicts: bytes | None, record: WorldRecord) -> bool:
    """Whether ``verdicts`` (``fate/<g>``'s lines) give ``record`` up: the
    first that decides names one of its members (none decides: not yet)."""
    for line in (verdicts or b"").decode(errors="replace").splitlines():
        if line == KEPT:
            return False
        if any(m in record.members for m in parse_roster(line)):
            return True
    return False


def at_key(member_id: str) -> str:
    """``"<token> <host:port>"``: where that member's listener is (``_reach``)."""
    return f"at/{member_id}"


PROBES_PER_ROUND = 2
"""Members of the watched world each watcher probes per round."""
SILENT_IN_A_ROW = 2
"""Probes of one path silent in a row before it is reported cut."""


@dataclass(eq=False)
class _Watched:
    generation: int
    members: tuple[Member, ...]
    others: tuple[Member, ...]  # the ones it probes, in turn, from the next rank on
    addresses: dict[Member, tuple[str, int]]
    on_broken: Callable[[str], None]
    turn: int = 0
    fired: bool = False
    answered: set[Member] = field(default_factory=set)  # probed OK in this world
    silent: dict[Member, int] = field(default_factory=dict)  # silent probes in a row


class Superseded(ConnectionError):
    """Another incarnation of this member's id took its heartbeat key."""


class Watcher:
    """Beats ``me``'s heartbeat every ``interval`` s and watches the roster's.

    ``tick()`` is one round: beat, read the roster, read every heartbeat.
    ``start()`` runs it on a daemon thread until ``stop()``. A store error
    ends the thread and is kept in :attr:`error`.

    A heartbeat is a key ``hb/<id>`` holding ``"<token> <count>"``, the
    count moving every ``interval``; ``"<token> left"`` once the member
    left. A member is alive (:meth:`alive`) while the watcher sees its key
    move at least every ``timeout`` seconds (by this process's own clock: no
    two hosts' clocks are compared), with its own token (a restarted
    member's new token ends the old incarnation at once), while its listener
    has not refused a connect (``_reach``: its process is gone), and while
    it has not given up the generation the watcher follows (``quit/<g>``:
    it was admitted while its call was being cancelled). A member writes its
    beat with ``compare_set`` from the value it wrote last: once another
    incarnation took the key, the old one (a process stopped for longer than
    the timeout, then resumed) finds out at its next beat and stops
    (:class:`Superseded`), and never takes the key back. The watcher counts
    only time it was itself looking: while its own round is late by more
    than half the timeout (a stopped process, a starved thread, a store slow
    to answer) it calls no one dead, and after such a pause it starts every
    member's clock afresh, so that its own stall is never taken for
    everyone else's death.
    """

    def __init__(
        self,
        store: Any,
        me: Member,
        *,
        interval: float,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.me = me
        self.interval = interval
        self.timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()  # guards every field below it
        self._seen: dict[str, tuple[bytes, float]] = {}  # id -> (value, when it last moved)
        self._roster: list[Member] = []
        self._beat_lock = threading.Lock()  # one writer of the key at a time
        self._beats = 0
        self._written = f"{me.token} 0"  # what this member's key holds, as it last wrote it
        self._last_tick: float | None = None
        self._following: int | None = None  # the generation whose quitters are read
        self._quit: set[Member] = set()  # those that gave it up
        self._refused: set[Member] = set()  # those whose listener refused: gone
        self._watched: _Watched | None = None
        self._probes: Probes[Member] = Probes()  # the watcher thread's
        self._probed: _Watched | None = None  # the world those probes are of
        self._fate_of: int | None = None  # the generation being configured
        self._fate: bytes | None = None  # its verdicts (fate/<g>), as last read
        self.listener: Listener | None = None  # drained every round
        self.sweeper: Any = None  # a _sweep.Sweeper: this member sweeps
        self._floor = 0  # the job's floor, as last read
        self._floor_read = -1e9  # when (by the clock)
        self._warned = False
        self.error: ConnectionError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def store(self) -> Any:
        """The watcher's own client (its thread's: not for other threads' calls)."""
        return self._store

    def swap_store(self, store: Any) -> Any:
        """Put ``store`` in place of the watcher's client, and return the one it
        had (its thread reads the attribute at every call): for the scale
        bench, which counts a heartbeat round's store calls."""
        old, self._store = self._store, store
        return old

    # -- what it concludes ------------------------------------------------

    def alive(self, member: Member) -> bool:
        """Whether ``member`` (this incarnation of it) is alive, as last seen.

        A member not seen yet counts as alive: its heartbeat is then given
        a whole ``timeout`` to move."""
        if member == self.me:
            return True
        if not self._newest(member):
            return False  # a later incarnation registered: it only could once this one was gone
        with self._lock:
            if member in self._quit or member in self._refused:
                return False
            entry = self._seen.get(member.id)
            roster = self._roster
            last_tick = self._last_tick
            now = self._clock()
        if entry is None:
            return True
        if last_tick is None or now - last_tick > self.timeout / 2:
            # Our own round is late (the store is slow to answer: a c10d
            # store server resolves each new client's name on its one
            # thread, and can stall for a resolver's timeout): the silence
            # we would read is ours, not theirs.
            return True
        value, moved = entry
        token, _, count = value.decode(errors="replace").partition(" ")
        if token != member.token:
            # Another incarnation's beat. Each one claims the key before it
            # goes on the roster, and the roster is read before the beats:
            # if this one is on the roster read, its claim was there to be
            # read, and another took the key since (it only could once this
            # one was left or silent). If not, it is newer than that read.
            return member not in roster
        if count == LEFT:
            return False
        return now - moved < self.timeout

    def _newest(self, member: Member) -> bool:
        """Whether no later incarnation of ``member``'s id is on the roster
        (one that is not on it at all is not known to be superseded)."""
        with self._lock:
            latest = [m for m in self._roster if m.id == member.id]
        return not latest or latest[-1] == member or member not in latest

    def roster(self) -> list[Member]:
        with self._lock:
            return list(self._roster)

    def follow(self, generation: int) -> None:
        """From now on, read who gave up ``generation`` (and count them dead)."""
        with self._lock:
            if self._following != generation:
                self._following, self._quit = generation, set()

    def quit_seen(self, generation: int, members: set[Member]) -> None:
        """``members`` gave up ``generation``, as the caller read it (its own
        client): counted dead now, where the watcher follows it, not only
        after its next round."""
        with self._lock:
            if self._following == generation:
                self._quit |= members

    def refused_seen(self, member: Member) -> None:
        """A connect to ``member``'s listener was refused: its process is
        gone, and it is dead from now on (that incarnation)."""
        with self._lock:
            self._refused.add(member)

    def watch(
        self,
        generation: int,
        members: tuple[Member, ...],
        addresses: dict[Member, tuple[str, int]],
        on_broken: Callable[[str], None],
        reached: Collection[Member] = (),
    ) -> None:
        """From the next round on, watch the world of ``members`` (its group
        configured): ``on_broken(reason)`` once, from the watcher's thread,
        when one of them is dead or a path between two of them is cut (of
        those it reached: ``reached``, as the world was configured, and
        every one a probe of the watch reaches).

        Each round probes two of the world's other members in turn (so that
        every path from this member is tried within ``ceil((n - 1) / 2)``
        rounds). The world is broken where any member says a probe of its
        found a path cut that had worked in that world, or that it left the
        world to recover (``sus/<g>``, one ``id<TAB>what`` line each), or
        once the world is below the job's ``floor`` (``_sweep``: a later one
        was kept; its keys may be gone)."""
        mine = members.index(self.me) if self.me in members else -1
        others = tuple(members[(mine + 1 + i) % len(members)] for i in range(len(members)))
        with self._lock:
            self._watched = _Watched(
                generation,
                members,
                tuple(m for m in others if m != self.me and m in addresses),
                dict(addresses),
                on_broken,
                answered=set(reached),
            )

    def unwatch(self) -> None:
        """Watch no world (the next is being formed)."""
        with self._lock:
            self._watched = None

    def read_fate(self, generation: int | None) -> None:
        """From the next round on, read ``generation``'s verdicts (``None``:
        none), for a member configuring it: one member's giving it up then
        ends every member's configure, not only its own."""
        with self._lock:
            if self._fate_of != generation:
                self._fate_of, self._fate = generation, None

    def fate(self, generation: int) -> bytes | None:
        """``generation``'s verdicts as last read (see :meth:`read_fate`)."""
        with self._lock:
            return self._fate if self._fate_of == generation else None

    def _check_world(self) -> None:
        """The watched world's round: its deaths, its cut paths (others'
        reports, then this member's own probes)."""
        with self._lock:
            watched = self._watched
        if watched is not self._probed:  # probes of another world answer nothing here
            self._probes.close()
            self._probed = watched
        if watched is None or watched.fired:
            return
        reason = None
        said = read(self._store, suspect_key(watched.generation))
        if said:
            who, _, what = said.decode(errors="replace").splitlines()[0].partition("\t")
            reason = f"{who} {what}"
        if reason is None and self.below_floor(watched.generation):
            reason = "later generations were formed without this member, and kept"
        dead = next(
            (m for m in watched.members if not self.alive(m) and not self._just_left(m)), None
        )
        if reason is None and dead is not None:
            reason = f"{dead.id} is dead (its heartbeat stopped, or its process is gone)"
        for member, answer in self._probes.poll().items():
            if member not in watched.members:
                continue
            if answer is Reach.REFUSED:
                self.refused_seen(member)
                reason = reason or f"{member.id}'s process is gone (its listener refused)"
            elif answer is Reach.OK:
                watched.answered.add(member)
                watched.silent.pop(member, None)
            elif member in watched.answered:
                # Only a path that worked (a port filtered from the start
                # while the group's data flows must not abort every world),
                # and only twice silent in a row (a lost SYN is not a cut).
                watched.silent[member] = watched.silent.get(member, 0) + 1
                if watched.silent[member] >= SILENT_IN_A_ROW:
                    line = f"{self.me.id}\tcould not reach {member.id}\n"
                    self._store.append(suspect_key(watched.generation), line)
                    reason = reason or f"{self.me.id} could not reach {member.id}"
        if reason is not None:
            with self._lock:
                if self._watched is not watched:
                    return
                watched.fired = True
            self._probes.close()
            try:
                watched.on_broken(reason)
            except Exception:
                log.exception("ftcomm: membership %s: its world's abort failed", self.me.id)
            return
        started, timeout = 0, max(self.timeout, PROBE_TIMEOUT)
        for _ in range(len(watched.others)):
            if started == PROBES_PER_ROUND:
                break
            member = watched.others[watched.turn % len(watched.others)]
            watched.turn += 1
            if not self._probes.busy(member):
                self._probes.start(member, watched.addresses[member], timeout)
                started += 1
        for member in list(watched.silent):  # a silent path is probed again at once
            if not self._probes.busy(member):
                self._probes.start(member, watched.addresses[member], timeout)

    # -- the round --------------------------------------------------------

    def beat(self) -> None:
        """Write this member's heartbeat (the next count).

        Raises:
            Superseded: another incarnation holds the key now.
        """
        with self._beat_lock:
            self._beats += 1
            self._swap(f"{self.me.token} {self._beats}")

    def renew(self, me: Member) -> bool:
        """Beat as ``me``, a new incarnation of this member's id, from now on
        (the old one's key is taken over, not claimed again); False (and
        nothing written) once :meth:`stop` began: its leave stays.

        Raises:
            Superseded: another incarnation holds the key already.
        """
        with self._beat_lock:
            if self._stop.is_set():
                return False
            self._swap(f"{me.token} 0")
            self.me, self._beats = me, 0
            return True

    def _swap(self, value: str) -> None:
        """Raises: Superseded: the key holds what another incarnation wrote."""
        held = self._store.compare_set(beat_key(self.me.id), self._written, value)
        if held != value.encode():
            raise Superseded(
                f"another incarnation of member {self.me.id!r} took its heartbeat "
                f"({held.decode(errors='replace')!r}): this one was given up for dead "
                "(stopped, or cut off, for longer than the heartbeat timeout)"
            )
        self._written = value

    def tick(self) -> None:
        """One round: beat, then read the roster, every member's heartbeat
        and who gave up the generation followed."""
        self.beat()
        text = read(self._store, "roster")
        roster = parse_roster(text) if text is not None else []
        ids = sorted({m.id for m in roster} - {self.me.id})
        # a multi_get waits for a missing key: none is, as each member on
        # the roster claimed its key before it registered, and keys stay
        values: list[bytes] = self._store.multi_get([beat_key(i) for i in ids]) if ids else []
        following, fate_of = self._following, self._fate_of
        quit_text = read(self._store, quit_key(following)) if following is not None else None
        fate_text = read(self._store, fate_key(fate_of)) if fate_of is not None else None
        # the floor only matters to a member stopped through generations: a
        # look every FLOOR_EVERY s, and at once after a late round
        busy = following is not None or fate_of is not None or self._watched is not None
        began = self._clock()
        late = self._last_tick is not None and began - self._last_tick > self.timeout / 2
        due = began - self._floor_read >= FLOOR_EVERY or late
        floor_text = read(self._store, FLOOR) if busy and due else None
        now = self._clock()
        with self._lock:
            gap = now - self._last_tick if self._last_tick is not None else 0.0
            paused = gap > self.timeout / 2
            if paused and not self._warned:
                self._warned = True
                log.warning(
                    "ftcomm: membership %s: its heartbeat round took %.2f s (timeout "
                    "%.2f s): no member is called dead from such a round (a stopped "
                    "process, a starved thread, a slow store)",
                    self.me.id,
                    gap,
                    self.timeout,
                )
            self._last_tick = now
            if following == self._following and quit_text is not None:
                self._quit |= set(parse_roster(quit_text))  # it only grows
            if fate_of == self._fate_of and fate_text is not None:
                self._fate = fate_text  # it only grows (appended)
            if busy and due:
                self._floor_read = now
            if floor_text is not None:
                self._floor = max(self._floor, parse_floor(floor_text))  # it only grows
            for member_id, value in zip(ids, values, strict=True):
                old = self._seen.get(member_id)
                # moved, or we were not looking (then no one's silence counts)
                if old is None or old[0] != value or paused:
                    self._seen[member_id] = (value, now)
            self._roster = roster
        if self.listener is not None:
            self.listener.drain()
        self._check_world()

    def sweep(self, floor_to: int) -> None:
        """Raise the floor to ``floor_to`` and sweep below, on the sweeper's
        own thread (``_sweep``: this member is rank 0 of a generation just
        kept); nothing where this member does not sweep."""
        if self.sweeper is not None:
            self.sweeper.request(floor_to)

    def _just_left(self, member: Member) -> bool:
        """Whether ``member`` left (its ``left`` beat: its Membership
        closed) less than ``timeout`` ago. Its world's group is not aborted
        for that yet: a member that ends at a step closes as soon as its
        last collective is done here, and the others' copies of that
        collective may still be finishing; an op that cannot finish without
        it is aborted once the timeout passed."""
        with self._lock:
            entry = self._seen.get(member.id)
            now = self._clock()
        if entry is None:
            return False
        value, moved = entry
        token, _, count = value.decode(errors="replace").partition(" ")
        return token == member.token and count == LEFT and now - moved < self.timeout

    def below_floor(self, generation: int) -> bool:
        """Whether ``generation`` is over for good (a later one was kept),
        as the floor was last read (every :data:`FLOOR_EVERY` s, and after a
        late round, while a generation is followed, configured or watched)."""
        with self._lock:
            return generation < self._floor

    def refresh(self, store: Any, members: list[Member]) -> None:
        """Read ``members``' heartbeats now, through ``store`` (the caller's
        client: this one is the watcher thread's), before they are called
        dead: a beat written since the last round counts at once."""
        ids = sorted({m.id for m in members if m.id != self.me.id})
        if not ids:
            return
        values: list[bytes] = store.multi_get([beat_key(i) for i in ids])
        now = self._clock()
        with self._lock:
            for member_id, value in zip(ids, values, strict=True):
                old = self._seen.get(member_id)
                if old is not None and old[0] != value:
                    self._seen[member_id] = (value, now)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"ftcomm-membership-{self.me.id}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Superseded as exc:
                self.error = exc.with_traceback(None)
                log.warning("ftcomm: membership %s: %s", self.me.id, exc)
                return
            except Exception as exc:  # the store went away: kept for the next call
                # as a new error, with no traceback and no context: the
                # original's frames would hold this watcher (and its
                # store's socket) in a cycle, and every raise that names
                # it as a cause would grow its traceback
                self.error = ConnectionError(f"{type(exc).__name__}: {exc}")
                log.warning("ftcomm: membership %s lost its store: %s", self.me.id, exc)
                return
            self._stop.wait(self.interval)

    def stop(self, *, leave: bool) -> None:
        """End the thread (within one store round trip); with ``leave``, mark
        this member as gone, so the others need not wait for its silence."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if leave and self.error is None:
            with contextlib.suppress(Exception), self._beat_lock:  # the store may be gone
                self._swap(f"{self.me.token} {LEFT}")
        self._probes.close()
        if self.listener is not None:
            self.listener.close()
        if self.sweeper is not None:
            self.sweeper.close()
        self._store = None  # its connection closes with the last reference
