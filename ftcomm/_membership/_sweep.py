"""Old generations' keys, deleted: the store engine's garbage collector.

Owns: the key ``floor`` of a job (read, raised, and looked at by an
agreeing member: :class:`FloorCheck`), what a member dropped below it is
told (:func:`swept`), and :class:`Sweeper`: once a generation is kept, its
rank 0's sweeper raises ``floor`` and deletes the keys of the generations
below ``floor - 1`` (the job's :data:`PER_GENERATION` keys, and their
groups'). What ``floor`` means to every member, and what stays:
docs/membership.md, "The store engine's keys".
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from ..errors import Evicted
from ._watch import FLOOR, FLOOR_EVERY, parse_floor, raise_to, read

log = logging.getLogger("ftcomm")

PER_GENERATION = ("ready", "world", "quit", "reach", "cut", "sus", "fate", "chk")
"""The first part of each per-generation key of a job: ``<name>/<g>[/...]``."""

MAX_DELETES = 512
"""Keys one sweep (:meth:`Sweeper.sweep_once`) deletes at most; the
sweeper's thread lists the keys again, and sweeps on at once, while keys
are left."""

_JOB_KEY = re.compile(rf"({'|'.join(PER_GENERATION)})/([0-9]+)(/|$)")
_GROUP_KEY = re.compile(r"g([0-9]+)/")


def generation_of(key: str) -> int | None:
    """The generation of a job's per-generation key (``None``: not one)."""
    found = _JOB_KEY.match(key)
    return int(found.group(2)) if found else None


def group_generation_of(key: str) -> int | None:
    """The generation of a key under the job's groups' prefix (``g<n>/...``)."""
    found = _GROUP_KEY.match(key)
    return int(found.group(1)) if found else None


def floor(store: Any) -> int:
    """The job's ``floor`` (0: nothing swept yet); ``store``: scoped to the job."""
    return parse_floor(read(store, FLOOR))


def raise_floor(store: Any, to: int, key: str = FLOOR) -> int:
    """Move ``floor`` (at ``key``) up to ``to``, never down; what it holds after."""
    return raise_to(store, key, to, parse_floor)


def swept(me: str, job: str, member_of: int | None, current: int) -> Evicted:
    """What a member stopped through generations kept and swept is told."""
    return Evicted(
        f"member {me!r} was dropped from job {job!r}: generations after "
        f"{member_of or 'the one it came to'} were formed and kept without it, and the job is "
        f"at {current} (it was stopped or cut off through two generations or more). join() "
        "again to come back as a newcomer",
        member_id=me,
        generation=member_of or 0,
        current=current,
    )


class FloorCheck:
    """An agreeing member's looks at ``floor``: whether the generation it
    reads is below it. It looks when it comes to a generation, after it
    read that generation decided, and every :data:`FLOOR_EVERY` s while it
    waits (a member stopped while it waited may find the world it waited
    for decided, kept past and swept: its key gone)."""

    def __init__(self) -> None:
        self._generation = -1
        self._looked = 0.0

    def swept(self, store: Any, generation: int, decided: bool, now: float) -> bool:
        if decided or generation != self._generation or now - self._looked >= FLOOR_EVERY:
            self._generation, self._looked = generation, now
            return generation < floor(store)
        return False


class Sweeper:
    """Rank 0's sweeps, on a thread of the sweeper's own and through a
    store client of its own, without a prefix: a sweep never runs between
    two heartbeats, one that fails never takes the heartbeat's client with
    it, and one listing finds both the job's keys and its groups'.

    ``connect()`` makes that client (on the sweeper's thread, when it is
    first needed); ``base``: the address's prefix and ``/``, or ``""``.
    """

    def __init__(
        self, connect: Callable[[], Any], base: str, job: str, name: str = "sweep"
    ) -> None:
        self._connect = connect
        self._client: Any = None
        self.job_prefix = f"{base}ftcomm/members/{job}/"
        self.groups_prefix = f"{base}ftcomm/groups/{job}/"
        self._name = f"ftcomm-membership-{name}"
        self._lock = threading.Lock()  # guards the three fields below
        self._wanted = 0  # the floor asked for last
        self._closed = False
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def request(self, floor_to: int) -> None:
        """Sweep up to ``floor_to`` soon (:meth:`sweep_once`, until done),
        on the sweeper's thread. Nothing while no key can be below
        ``floor_to - 1`` (its first two generations): no thread, no client."""
        if floor_to <= 2:
            return
        with self._lock:
            if self._closed:
                return
            self._wanted = max(self._wanted, floor_to)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        done = 0  # the floor swept up to, every key below its floor - 1 gone
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                if self._closed:
                    return
                wanted = self._wanted
            if wanted <= done:
                continue
            try:
                while self.sweep_once(wanted):  # capped: the rest, at once
                    if self._closed:
                        break
                else:
                    done = wanted
            except Exception as exc:  # a later request tries again
                # (as text: the error's frames hold the client)
                log.warning("ftcomm: membership: a sweep of old generations failed: %s", str(exc))
            if self._closed:
                self._client = None  # (on this thread: close() may have come mid-connect)
                return

    def sweep_once(self, floor_to: int) -> bool:
        """Raise ``floor`` to ``floor_to`` and delete the keys of every
        generation below ``floor_to - 1`` (:data:`MAX_DELETES` at most).
        Returns whether keys are left to delete.

        Raises:
            RuntimeError, OSError: the store failed (the client goes: the
                next sweep connects again).
        """
        try:
            if self._client is None:
                self._client = self._connect()
            client = self._client
            if self._closed:
                return False
            if raise_floor(client, floor_to, self.job_prefix + FLOOR) < floor_to:
                return False  # (never: the floor only rises) no key goes before it
            if self._closed or not callable(getattr(client, "list_keys", None)):
                return False
            below = floor_to - 1
            doomed = [key for key in client.list_keys() if self._old(key, below)]
            for key in doomed[:MAX_DELETES]:
                if self._closed:
                    return False
                client.delete_key(key)
            return len(doomed) > MAX_DELETES
        except BaseException:
            self._client = None
            raise

    def _old(self, key: str, below: int) -> bool:
        if key.startswith(self.job_prefix):
            generation = generation_of(key[len(self.job_prefix) :])
        elif key.startswith(self.groups_prefix):
            generation = group_generation_of(key[len(self.groups_prefix) :])
        else:
            return False
        return generation is not None and generation < below

    def close(self) -> None:
        """Stop the thread, after the store op in flight (each is bounded:
        the connect by its timeout, an op by the client's), and let the
        client go."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        self._wake.set()
        if thread is not None:
            thread.join()
        self._client = None  # its connection closes with the last reference
