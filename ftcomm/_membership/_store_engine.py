"""The embedded engine: membership agreed in a c10d ``TCPStore``.

Owns: the keys of one job in the store, and the blocking calls that read
and write them (run on ftcomm's control threads, never on a loop).

Its keys, under ``ftcomm/members/<job>/``, who writes each and how, and
why ``world/<g>`` is written once: docs/membership.md, "The store
engine's keys". Every read is :func:`_watch.read`, which never blocks;
old generations' keys are deleted only by ``_sweep``.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._store import ConnectProgress, StoreAddr, connect_store, why_unreachable
from ..errors import Evicted, MembershipError, MembershipTimeout
from . import _paths, _sweep
from ._engine import Stopped
from ._reach import Listener, listen_host
from ._rule import (
    EMPTY,
    Member,
    WorldRecord,
    candidates,
    decide,
    enough_ready,
    missing,
    parse_ready,
    parse_roster,
    ready_line,
)
from ._sweep import swept
from ._watch import (
    KEPT,
    LEFT,
    Superseded,
    Watcher,
    at_key,
    beat_key,
    fate_key,
    gives_up,
    quit_key,
    raise_to,
    read,
    suspect_key,
)

log = logging.getLogger("ftcomm")

CHECK_KEEP = 16
"""``pending()`` keys kept per generation: a member more than this many
calls behind another would find its key gone (the group's collectives
between two calls keep members within one call of each other)."""


POLL_CAP = 0.005
"""Seconds between an agreeing member's looks at the store, at most, per
four member ids on the roster (up to 50 ms): every member polls at once, and
one store thread answers them all."""


def _poll_cap(members: int) -> float:
    return min(POLL_CAP * max(1.0, members / 4), 0.05)


OP_TIMEOUT = 30.0
"""Seconds a store op may take before the engine calls the store gone."""
SWEEP_CONNECT = 5.0
"""Seconds the sweeper's own client may take to connect (on its own thread)."""


class StoreEngine:
    """One member's view of a job in a store (its keys: docs/membership.md,
    "The store engine's keys")."""

    def __init__(
        self,
        addr: StoreAddr,
        job: str,
        me: Member,
        *,
        heartbeat_interval: float,
        heartbeat_timeout: float,
    ) -> None:
        self.addr = addr
        self.job = job
        self.me = me
        self._interval = heartbeat_interval
        self._timeout = heartbeat_timeout
        self.prefix = f"{addr.prefix + '/' if addr.prefix else ''}ftcomm/members/{job}/"
        self._store: Any = None  # the calls' client (one call at a time)
        self._closing = threading.Lock()  # close() may come from two threads at once
        self.watcher: Watcher | None = None
        self.registered = False

    def __repr__(self) -> str:
        return f"store {self.addr.host_port}"

    # -- opening and closing ----------------------------------------------

    def open(self, timeout: float, stop: threading.Event) -> None:
        """Connect (twice: the watcher has its own client), check the id is
        free, and start beating.

        Raises:
            MembershipError: the store does not answer (refused at once).
            ValueError: a live member already uses this id.
        """
        plain = StoreAddr(self.addr.host, self.addr.port, "")
        timeout = max(timeout, 0.01)
        try:
            with socket.create_connection(
                (plain.host, plain.port), timeout=min(timeout, 2.0)
            ) as probe:
                local = str(probe.getsockname()[0])
        except OSError as exc:
            raise MembershipError(
                f"the membership store at {plain.host_port} does not answer: {why_unreachable(exc)}"
            ) from exc
        try:
            progress = ConnectProgress()
            prefixed = StoreAddr(plain.host, plain.port, self.prefix.rstrip("/"))
            # open()'s own deadline bounds the connects and the claim (a
            # store that takes connections and never answers); then the
            # ops get OP_TIMEOUT. They never wait on the server's side: it
            # only bounds a server that stalls (see _watch.alive).
            self._store = connect_store(prefixed, timeout, progress)
            # no local keeps a client: a failed open's traceback must not hold one
            self.watcher = Watcher(
                connect_store(prefixed, timeout, progress),
                self.me,
                interval=self._interval,
                timeout=self._timeout,
            )
            self.watcher.sweeper = _sweep.Sweeper(
                lambda: connect_store(plain, SWEEP_CONNECT),
                _base(self.addr),
                self.job,
                name=f"sweep-{self.me.id}",
            )
            self._claim(stop)
            for client in (self._store, self.watcher.store):
                client.set_timeout(timedelta(seconds=OP_TIMEOUT))
        except (TimeoutError, RuntimeError, OSError) as exc:
            exc.with_traceback(None)  # its frames hold the clients
            raise MembershipError(
                f"the membership store at {plain.host_port} does not answer: {exc}"
            ) from exc
        self._start(listen_host(plain.host, local))

    def _start(self, host: str) -> None:
        """Listen on ``host``, say where (:meth:`_announce`), start beating.

        Raises:
            MembershipError: it cannot listen there, or the store failed.
        """
        assert self.watcher is not None
        try:
            self.watcher.listener = Listener(host)
        except OSError as exc:
            raise MembershipError(
                f"member {self.me.id!r} cannot listen on {host!r} (FTCOMM_GLOO_HOST, or the "
                f"address that reaches the store): {exc}"
            ) from None
        try:
            self._announce(self.me)
        except (RuntimeError, OSError) as exc:
            raise failed(exc) from None
        self.watcher.start()

    def _announce(self, me: Member) -> None:
        """Say where incarnation ``me``'s listener is (``at/<id>``)."""
        listener = self.watcher.listener if self.watcher is not None else None
        assert listener is not None
        self._store.set(at_key(me.id), f"{me.token} {listener.address}")

    def _claim(self, stop: threading.Event) -> None:
        """Take ``hb/<id>``: free, left, gone (on etcd, its lease ran out),
        or silent for a whole timeout.

        Raises:
            ValueError: its heartbeat moves (a live member has this id).
        """
        key = beat_key(self.me.id)
        held = read(self._store, key)
        if held is not None and not held.decode(errors="replace").endswith(" " + LEFT):
            until = time.monotonic() + self._timeout
            while time.monotonic() < until:
                if stop.wait(min(self._interval, 0.05)):
                    raise Stopped
                now = read(self._store, key)
                if now is None:
                    held = None  # gone with its lease: its member is
                    break
                if now != held:
                    raise ValueError(
                        f"member_id {self.me.id!r} is in use in job {self.job!r}: a live "
                        "member with that id is beating its heartbeat (give each member "
                        "its own id, or stop the other one first)"
                    )
        mine = f"{self.me.token} 0"
        expected = held.decode(errors="replace") if held is not None else ""
        got = self._store.compare_set(key, expected, mine)
        if got != mine.encode() and expected and read(self._store, key) is None:
            got = self._store.compare_set(key, "", mine)  # it went meanwhile
        if got != mine.encode():
            raise ValueError(f"member_id {self.me.id!r} is in use in job {self.job!r}")

    def register(self) -> None:
        """Add this member to the roster: a newcomer for the next generation
        (again after it was dropped: its earlier entry was used up).

        Raises:
            MembershipError: the store failed, or another incarnation of
                this id took its heartbeat (this one was given up for dead).
        """
        self._raise_if_broken()
        try:
            held = (read(self._store, beat_key(self.me.id)) or b"").decode(errors="replace")
            if held.partition(" ")[0] != self.me.token:
                raise MembershipError(
                    f"member {self.me.id!r} of job {self.job!r} was given up for dead, and "
                    f"another incarnation took its id ({held!r}): open a new Membership"
                )
            self._store.append("roster", self.me.line())
        except (RuntimeError, OSError) as exc:
            if isinstance(exc, MembershipError):
                raise
            raise failed(exc) from exc
        self.registered = True

    def close(self) -> None:
        """Stop beating and say this member left. Idempotent."""
        with self._closing:
            watcher, self.watcher = self.watcher, None
            if watcher is not None:
                watcher.stop(leave=self.registered)
            self._store = None

    def broken(self) -> BaseException | None:
        return self.watcher.error if self.watcher is not None else None

    def alive(self, member: Member) -> bool:
        return self.watcher.alive(member) if self.watcher is not None else False

    def _raise_if_broken(self) -> None:
        """Raises: MembershipError: the watcher lost the store (or its id)."""
        error = self.broken()
        if isinstance(error, Superseded):
            raise MembershipError(str(error))
        if error is not None:
            raise MembershipError(f"lost the membership store: {error}") from error

    # -- agreeing ---------------------------------------------------------

    def group_addr(self, record: WorldRecord) -> str:
        """Where generation ``record``'s group meets: a prefix of its own."""
        base = _base(self.addr)
        return f"{self.addr.host_port}/{base}ftcomm/groups/{self.job}/g{record.generation}"

    def agree(
        self,
        prev: WorldRecord,
        stop: threading.Event,
        *,
        member_of: int | None,
        min_size: int,
        max_size: int,
        window: float,
        deadline: float,
    ) -> WorldRecord:
        """Wait for (or make) the first generation after ``prev`` that has
        this member; ``member_of``: the generation it was last a member of.

        Raises:
            Evicted: a generation after ``member_of`` was formed without it.
            MembershipTimeout: no such generation by ``deadline``.
            MembershipError: the store went away.
            Stopped: ``stop`` was set.
        """
        assert self.watcher is not None
        watcher = self.watcher
        target: int | None = None
        enough_since: float | None = None
        delay = 0.0005
        refusals = _paths.Absent(watcher, self._interval)  # a refusal is a death
        floors = _sweep.FloorCheck()
        try:
            while True:
                t = prev.generation + 1
                barred = self._cut_of(prev)  # (a generation given up for paths cut)
                if len(set(prev.members) - barred) < min_size:
                    barred = set()  # the rest could never form one: all try again

                def alive(m: Member, barred: set[Member] = barred) -> bool:
                    return m not in barred and watcher.alive(m)

                decided = read(self._store, f"world/{t}")
                if floors.swept(self._store, t, decided is not None, time.monotonic()):
                    # over, a later one kept (_sweep): stopped through two or
                    # more; a newcomer too (a world that took its roster
                    # line may have gone with it): _form registers it again
                    raise swept(self.me.id, self.job, member_of, self._generation())
                if decided is not None:
                    record = WorldRecord.decode(decided)
                    self._advance(t)
                    if self.me in record.members:
                        if self._generation() > t:
                            # the others went on past it (this member was
                            # slow to read it): a member of t, on to the next
                            prev, member_of, target, enough_since = record, t, None, None
                            continue
                        if stop.is_set():  # cancelled as it was formed: give it up
                            target = t
                            raise Stopped
                        watcher.follow(t)
                        if gives_up(read(self._store, fate_key(t)), record):
                            # a member gave it up before it could be kept:
                            # on to the next, with the quitters dead
                            self._note_quitters(record)
                            prev, member_of, target, enough_since = record, t, None, None
                            continue
                        return record
                    if member_of is not None and self.me in barred:
                        raise Evicted(
                            f"member {self.me.id!r} was left out of job {self.job!r}: in "
                            f"generation {prev.generation} it could not exchange data with "
                            f"the others (a network fault), and generation {t} was formed "
                            f"without it ({', '.join(record.ids) or 'no one'}). join() again "
                            "once it can reach them (it waits until it can)",
                            member_id=self.me.id,
                            generation=member_of,
                            current=t,
                            cut_off=True,
                        )
                    if member_of is not None:
                        raise Evicted(
                            f"member {self.me.id!r} was dropped from job {self.job!r}: "
                            f"generation {t} was formed without it "
                            f"({', '.join(record.ids) or 'no one'}); its heartbeat "
                            "stopped or it did not come in time. join() again to come "
                            "back as a newcomer",
                            member_id=self.me.id,
                            generation=member_of,
                            current=t,
                        )
                    prev, target, enough_since = record, None, None  # not admitted: the next
                    continue
                if stop.is_set():  # before it says it is ready, not only after
                    raise Stopped
                if target != t:
                    self._store.append(f"ready/{t}", ready_line(self.me, True))
                    target = t
                text = read(self._store, f"ready/{t}") or b""
                roster_text = read(self._store, "roster") or b""
                ready = parse_ready(text)
                roster = parse_roster(roster_text)
                # before anyone is left out as dead, a last look at their beats
                # (the watcher reads them only every interval)
                silent = [m for m in {*prev.members, *ready} if not watcher.alive(m)]
                if silent:
                    watcher.refresh(self._store, silent)
                now = time.monotonic()
                refusals.probe(self._store, self.me, prev, ready)
                if enough_ready(prev, roster, ready, alive, min_size):
                    enough_since = now if enough_since is None else enough_since
                else:
                    enough_since = None
                proposal = decide(
                    prev,
                    roster,
                    ready,
                    alive,
                    me=self.me,
                    window_passed=enough_since is not None and now - enough_since >= window,
                    min_size=min_size,
                    max_size=max_size,
                )
                if proposal is not None and log.isEnabledFor(logging.DEBUG):
                    log.debug(
                        "ftcomm: membership %s/%s proposes generation %d: %s (ready: %s; "
                        "dead: %s; window passed: %s)",
                        self.job,
                        self.me.id,
                        t,
                        proposal.ids,
                        sorted(m.id for m in ready),
                        sorted(m.id for m in {*prev.members, *roster} if not alive(m)),
                        enough_since is not None and now - enough_since >= window,
                    )
                if proposal is not None:
                    self._store.compare_set(f"world/{t}", "", proposal.encode())
                    continue  # read back whichever proposal won
                if now >= deadline:
                    here, absent = missing(prev, roster, ready, alive)
                    raise MembershipTimeout(
                        f"no generation {t} of job {self.job!r} was formed in time: "
                        f"{len(here)} ready ({', '.join(here) or 'none'}), need at least "
                        f"{min_size}; alive but not ready: {', '.join(absent) or 'none'}"
                    )
                self._raise_if_broken()
                if self._pause(stop, min(delay, max(deadline - now, 0.0))):
                    raise Stopped
                delay = min(delay * 2, self._poll_cap(len({m.id for m in roster})))
        except Stopped:
            if target is not None:
                with contextlib.suppress(Exception):
                    self._store.append(f"ready/{target}", ready_line(self.me, False))
                # A decider may have read the ready line before it went, and
                # write its world after any look of ours: quit the generation
                # whether or not it is formed yet (see abandon()).
                self._quit(target)
            raise
        except MembershipTimeout:
            if target is None:
                raise
            with contextlib.suppress(Exception):
                self._store.append(f"ready/{target}", ready_line(self.me, False))
                # formed as the deadline passed: taken after all (one formed
                # after this look waits for this member's retry, which takes it)
                decided = read(self._store, f"world/{target}")
                late = WorldRecord.decode(decided) if decided is not None else None
                if (
                    late is not None
                    and self.me in late.members
                    and target >= _sweep.floor(self._store)
                    and not gives_up(read(self._store, fate_key(target)), late)
                ):
                    watcher.follow(target)
                    return late
            raise
        except (RuntimeError, OSError, ValueError) as exc:
            if isinstance(exc, MembershipError):
                raise
            raise failed(exc) from exc
        finally:
            refusals.close()

    def _pause(self, stop: threading.Event, seconds: float) -> bool:
        """Between two looks of ``agree``: whether ``stop`` was set."""
        return stop.wait(seconds)

    def _poll_cap(self, members: int) -> float:
        """The longest pause of ``agree`` with ``members`` on the roster."""
        return _poll_cap(members)

    def _cut_of(self, record: WorldRecord) -> set[Member]:
        """The members of ``record`` left out for paths cut, where it was
        given up (``cut/<g>``, ``_paths``)."""
        out = _paths.left_out(self._store, record)
        if out and gives_up(read(self._store, fate_key(record.generation)), record):
            return out
        return set()

    def reach_check(
        self, record: WorldRecord, stop: threading.Event, timeout: float
    ) -> tuple[set[Member], set[Member]]:
        """As ``record``'s group is configured: every path of its world
        checked; who is left out of the next generation, and whom this
        member reached (``_paths.check``).

        Raises:
            MembershipError: the store failed.
        """
        assert self.watcher is not None
        try:
            return _paths.check(self._store, self.watcher, self.me, record, stop, timeout)
        except (RuntimeError, OSError, ValueError) as exc:
            raise failed(exc) from exc

    def admit(self, stop: threading.Event, deadline: float, timeout: float) -> None:
        """Before a newcomer registers: wait until it reaches every member
        of the latest generation that answers (``_paths.wait_reachable``).

        Raises:
            MembershipTimeout: some stay silent past ``deadline``.
            MembershipError: the store failed.
            Stopped: ``stop`` was set.
        """
        pause = 0.05
        while True:
            latest = self.latest()
            left = max(deadline - time.monotonic(), 0.01)
            try:
                assert self.watcher is not None
                silent = _paths.wait_reachable(
                    self._store, self.watcher, self.me.id, latest, stop, min(timeout, left)
                )
            except (RuntimeError, OSError) as exc:
                raise failed(exc) from exc
            if not silent:
                return
            now = time.monotonic()
            if now >= deadline:
                raise _paths.no_way_in(self.me.id, self.job, silent, latest.generation)
            if stop.wait(min(pause, deadline - now)):
                raise Stopped
            pause = min(pause * 2, 1.0)

    def watch(
        self, record: WorldRecord, on_broken: Callable[[str], None], reached: set[Member]
    ) -> None:
        """``record``'s group is configured: watch its world (``Watcher.watch``).

        Raises:
            MembershipError: the store failed.
        """
        assert self.watcher is not None
        others = [m for m in record.members if m != self.me]
        try:
            where = _paths.addresses(self._store, others, self.me.id)
        except (RuntimeError, OSError) as exc:
            raise failed(exc) from exc
        self.watcher.watch(record.generation, record.members, where, on_broken, reached)

    def unwatch(self) -> None:
        if self.watcher is not None:
            self.watcher.unwatch()

    def recovering(self, record: WorldRecord) -> None:
        """This member leaves ``record``'s world to recover it: every member
        still watching it aborts its group (an op of theirs may never end
        by itself: Gloo does not fail a receive cut short by a peer's
        abort). Best effort: the recover reports a store that failed."""
        with contextlib.suppress(Exception):
            line = f"{self.me.id}\tleft it to form the next generation\n"
            self._store.append(suspect_key(record.generation), line)

    def abandon(self, record: WorldRecord) -> None:
        """Tell ``record``'s other members this one will not configure it
        (its call was cancelled): they give it up and form the next one.

        This incarnation is then done with: the member goes on as a new
        one, so that a retried ``join()`` is a newcomer the others let in
        (its old token is in ``record`` and barred), and a retried
        ``recover()`` is told it was dropped, rather than taking back the
        generation it gave up.
        """
        if self.me in record.members:
            self._quit(record.generation)

    def keep(self, record: WorldRecord) -> bool:
        """This member configured ``record``'s group: whether the generation
        stands (the first verdict on it decides, see ``fate/<g>``).

        Raises:
            MembershipError: the store failed.
        """
        kept = self._verdict(record, KEPT + "\n")
        if kept and record.rank_of(self.me) == 0 and self.watcher is not None:
            self.watcher.sweep(record.generation - 1)
        return kept

    def lost(self, record: WorldRecord, member: Member) -> bool:
        """This member saw ``member`` of ``record`` dead as it configured it:
        whether the generation is given up (False: it was kept first, and
        this member's configure is about to succeed too).

        Raises:
            MembershipError: the store failed.
        """
        return not self._verdict(record, member.line())

    def given_up(self, record: WorldRecord) -> bool:
        """Whether a verdict gave ``record`` up, as the watcher last read
        them (``read_fate``): no store round trip."""
        watcher = self.watcher
        if watcher is None:
            return False
        return watcher.below_floor(record.generation) or gives_up(
            watcher.fate(record.generation), record
        )

    def read_fate(self, record: WorldRecord | None) -> None:
        if self.watcher is not None:
            self.watcher.read_fate(record.generation if record is not None else None)

    def _verdict(self, record: WorldRecord, line: str) -> bool:
        """Add ``line`` to ``record``'s verdicts: whether it stands."""
        key = fate_key(record.generation)
        try:
            self._store.append(key, line)
            if not gives_up(read(self._store, key), record):
                return True
            self._note_quitters(record)
        except (RuntimeError, OSError, ValueError) as exc:
            raise failed(exc) from exc
        return False

    def _note_quitters(self, record: WorldRecord) -> None:
        """Count ``record``'s members that quit it dead now, not only after
        the watcher's next round."""
        assert self.watcher is not None
        text = read(self._store, quit_key(record.generation))
        gone = set(parse_roster(text)) & set(record.members) if text is not None else set()
        self.watcher.quit_seen(record.generation, gone)

    def _quit(self, generation: int) -> None:
        """Give ``generation`` up (unless it was kept already), append this
        incarnation to ``quit/<generation>`` and go on as a new one."""
        watcher = self.watcher
        if watcher is None:
            return
        with contextlib.suppress(Exception):  # best effort: the store may be gone
            # the verdict before the line: a member that reads the line
            # finds the verdict
            self._store.append(fate_key(generation), self.me.line())
            self._store.append(quit_key(generation), self.me.line())
            renewed = Member.fresh(self.me.id)
            if watcher.renew(renewed):
                self.me = renewed
                if watcher.listener is not None:
                    self._announce(renewed)

    def _generation(self) -> int:
        """The latest generation with a record (0 before the first)."""
        held = read(self._store, "gen")
        return _int(held) if held is not None else 0

    def _advance(self, t: int) -> None:
        """Move ``gen`` up to ``t`` (never down).

        Raises:
            ValueError: ``gen`` holds what ftcomm did not write.
        """
        raise_to(self._store, "gen", t, lambda held: _int(held) if held is not None else 0)

    def latest(self) -> WorldRecord:
        """The latest generation's record (:data:`EMPTY` before the first).

        Raises:
            MembershipError: the store failed, or holds what ftcomm did not write.
        """
        try:
            g = self._generation()
            text = read(self._store, f"world/{g}") if g else None
            return WorldRecord.decode(text) if text is not None else EMPTY
        except (RuntimeError, OSError, ValueError) as exc:
            if isinstance(exc, MembershipError):
                raise
            raise failed(exc) from exc

    def check(self, record: WorldRecord, k: int, *, max_size: int, deadline: float) -> bool:
        """``pending()`` call ``k`` of generation ``record``: the first
        caller's view decides for everyone. Due where a member died, or a
        newcomer is ready for the next generation and there is room for it.

        A few store round trips (``deadline`` unused: each is bounded by
        the clients' op timeout).

        Raises:
            MembershipError: the store went away.
        """
        assert self.watcher is not None
        self._raise_if_broken()
        if self.watcher.below_floor(record.generation):
            return True  # over (a later one kept): recover() says it was dropped
        try:
            ready = parse_ready(read(self._store, f"ready/{record.generation + 1}") or b"")
            found = candidates(record, self.watcher.roster(), self.watcher.alive)
            died = len(found.survivors) < len(record.members)
            room = len(found.survivors) < max_size
            due = died or (room and any(m in ready for _, m in found.newcomers))
            key = f"chk/{record.generation}/{k}"
            said = self._store.compare_set(key, "", "1" if due else "0")
            if k >= CHECK_KEEP:
                self._store.delete_key(f"chk/{record.generation}/{k - CHECK_KEEP}")
        except (RuntimeError, OSError, ValueError) as exc:
            raise failed(exc) from exc
        return bool(said == b"1")


def _int(text: bytes) -> int:
    """Raises: ValueError: not a generation number."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not a generation number: {text!r:.80}") from None


def _base(addr: StoreAddr) -> str:
    return f"{addr.prefix}/" if addr.prefix else ""


def failed(exc: BaseException) -> MembershipError:
    """The error for a store op that failed. ``exc`` loses its traceback:
    its frames hold the store's client, and the error is kept (by a future,
    a caller) long after the engine let the client go."""
    exc.with_traceback(None)
    return MembershipError(f"the membership store failed: {exc}")
