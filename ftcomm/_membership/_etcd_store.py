"""The store engine's calls, made of etcd: the etcd engine's adapter.

Owns: :class:`EtcdStore` (the subset of a c10d store the store engine,
its watcher, paths and sweeper call: ``set``, ``compare_set``, ``append``,
``multi_get``, ``delete_key``, ``list_keys``, ``set_timeout``), one
member's :class:`Lease`, and :class:`Changes` (an etcd watch that wakes an
agreeing member when a key it reads changes). So the store engine's rule,
and the guarantees its tests prove, hold on etcd as they are. Where etcd
differs from a c10d store: docs/membership.md, "The etcd engine".
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

from .._etcd import (
    Etcd,
    EtcdError,
    absent,
    holds,
    prefix_range,
    put_op,
    range_op,
    ranged,
    unb64,
    unchanged,
)

log = logging.getLogger("ftcomm")

LEASED = ("hb/", "at/", "srv/")
"""The keys a member's lease holds: its heartbeat, its listener's and its
store's addresses."""

KEEP_HISTORY = 300.0
"""Seconds of etcd's history a member's watch keeps when it compacts: what
Kubernetes' API server keeps (it compacts every 5 minutes)."""

COMPACT_MIN = 1000
"""Revisions a member's watch lets pass between two compactions of its own
(each member compacts: the first one's is enough, the others' are no error)."""

COMPACT_TIMEOUT = 2.0
"""Seconds a compaction may take (it runs on the watch's thread, which
close() joins)."""

MAX_TXN_OPS = 128
"""Operations etcd takes in one transaction (its ``--max-txn-ops`` default)."""

MIN_TTL = 2
"""etcd's shortest lease, in seconds (it grants no less than 1.5 election
timeouts: 1.5 s at its defaults)."""


def lease_ttl(heartbeat_timeout: float) -> int:
    """A member's lease TTL: twice the heartbeat timeout (a member is
    called dead by its silence first; the lease then clears its keys)."""
    return max(MIN_TTL, math.ceil(2 * heartbeat_timeout))


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Lease:
    """One member's lease, shared by its clients (one lock): granted at
    first use, renewed every third of its TTL as the member writes its
    keys, and granted again after it ran out, with the keys it held put
    back (each only where no one created it meanwhile)."""

    def __init__(self, client: Etcd, ttl: int) -> None:
        self._client = client
        self.ttl = ttl
        self._lock = threading.Lock()  # guards every field below
        self._id = 0
        self._renewed = 0.0
        self._held: dict[bytes, bytes] = {}
        self._repaired: set[bytes] = set()  # the keys a renewal puts back (not hb: beaten)

    def id(self) -> int:
        """A live lease (granted or renewed now where due).

        Raises:
            EtcdUnavailable, EtcdError: etcd did not grant or renew it.
        """
        with self._lock:
            now = time.monotonic()
            if self._id and now - self._renewed < self.ttl / 3:
                return self._id
            if self._id and self._client.keepalive(self._id) > 0:
                self._renewed = now
                self._put_back([k for k in self._held if k in self._repaired])
                return self._id
            self._grant(now)
            return self._id

    def _put_back(self, keys: list[bytes]) -> None:
        """Put back each of ``keys`` (held by this lease) that is gone, or
        holds a value older than the last noted (a write that failed, a
        grant that put back some keys only): each only where no one wrote
        it since read, and no other lease holds it. Under ``_lock``."""
        if not keys:
            return
        _, answers = self._client.txn([], [range_op(k) for k in keys], [])
        for key, answer in zip(keys, answers, strict=False):
            found, value = ranged(answer), self._held[key]
            if not found:
                self._client.create(key, value, self._id)
            elif found[0].value != value and found[0].lease == self._id:
                self._client.txn(
                    [unchanged(key, found[0].mod_revision)], [put_op(key, value, self._id)], []
                )

    def _grant(self, now: float) -> None:
        lapsed = bool(self._id)
        self._id, self._renewed = self._client.grant(self.ttl), now
        if lapsed:
            log.warning("ftcomm: membership: a lease ran out; its keys are put back")
        self._put_back(list(self._held))

    def expired(self, lease: int) -> None:
        """etcd said ``lease`` is gone: the next :meth:`id` grants another."""
        with self._lock:
            if self._id == lease:
                self._renewed = -math.inf  # its keepalive answers 0: granted again

    def held(self, key: bytes) -> bytes | None:
        """What this lease's ``key`` holds, as last noted (``None``: not one)."""
        with self._lock:
            return self._held.get(key)

    def note(self, key: bytes, value: bytes | None, *, repair: bool = True) -> None:
        """``key`` is to hold ``value`` under this lease (``None``: no longer):
        noted before it is written, so that a grant or a repair meanwhile
        puts back this value, not the one before. ``repair``: a renewal
        puts it back where it went or holds another value (not for a key
        its member rewrites every beat)."""
        with self._lock:
            if value is None:
                self._held.pop(key, None)
                self._repaired.discard(key)
                return
            self._held[key] = value
            if repair:
                self._repaired.add(key)
            else:
                self._repaired.discard(key)


class EtcdStore:
    """A c10d store's calls (those the store engine makes) on etcd, keys
    under ``root``. ``lease``: the member's, for its own keys (:data:`LEASED`);
    ``scope``: where :meth:`list_keys` looks, under ``root``.

    Raises (every call): EtcdUnavailable (a ``ConnectionError``), EtcdError
    (a ``RuntimeError``), as the store engine expects of a store.
    """

    def __init__(
        self, client: Etcd, root: str, *, lease: Lease | None = None, scope: str = ""
    ) -> None:
        self._client = client
        self._root = root.encode()
        self._lease = lease
        self._scope = scope.encode()

    def __repr__(self) -> str:
        return f"<EtcdStore {self._client!r} {self._root.decode()!r}>"

    def close(self) -> None:
        """Close the connections its client keeps."""
        self._client.close()

    def note(self, key: str, value: str | bytes) -> None:
        """``key`` (one of this member's) is to hold ``value``: its lease puts
        it back from now on, should the write that follows fail."""
        if self._lease is not None and self._leased(key):
            self._lease.note(self._root + key.encode(), _bytes(value))

    def set_timeout(self, timeout: timedelta) -> None:
        self._client.timeout = timeout.total_seconds()

    def _leased(self, key: str) -> bool:
        return self._lease is not None and key.startswith(LEASED)

    def set(self, key: str, value: str | bytes) -> None:
        full, data = self._root + key.encode(), _bytes(value)
        if not self._leased(key):
            self._client.put(full, data)
            return
        assert self._lease is not None
        self._lease.note(full, data)
        lease = self._lease.id()
        try:
            self._client.put(full, data, lease)
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise
            self._lease.expired(lease)
            self._client.put(full, data, self._lease.id())

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """As a c10d store's: ``desired`` written where ``key`` holds
        ``expected`` (``""``: where it does not exist); what ``key`` holds
        after, or ``expected`` where it does not exist (nothing written).
        A key of this member's lease that ran out (its process was stopped
        that long) counts as holding what it held, and the write puts it
        back under a new lease unless another incarnation created it first:
        the store engine's rule, where a stopped member's key stays."""
        full, want, new = self._root + key.encode(), _bytes(expected), _bytes(desired)
        if want == new and want:
            # a read (``_watch.read``): what it would write is what it
            # compares with, so it changes nothing. A range is a read for
            # etcd; a transaction that may write goes through raft.
            kv = self._client.get(full)
            return kv.value if kv is not None else want
        owner = self._lease if self._leased(key) else None
        prior = owner.held(full) if owner is not None else None
        if owner is not None:
            owner.note(full, new, repair=False)  # (taken back below where it is not ours)
        held = new
        try:
            held = self._swap(full, want, new, owner, prior)
        finally:
            if owner is not None and held != new:
                owner.note(full, prior, repair=False)
        return held

    def _swap(
        self, full: bytes, want: bytes, new: bytes, owner: Lease | None, prior: bytes | None
    ) -> bytes:
        for _ in range(2):  # once more where the lease ran out as it was used
            lease = owner.id() if owner is not None else 0
            compare = absent(full) if want == b"" else holds(full, want)
            try:
                won, answers = self._client.txn(
                    [compare], [put_op(full, new, lease)], [range_op(full)]
                )
                if won:
                    return new
                found = ranged(answers[0]) if answers else []
                if found:
                    return found[0].value
                if owner is None or prior != want:
                    return want  # (c10d's answer for a missing key)
                # this member's key, gone with a lease that ran out: taken
                # back, unless another incarnation created it first
                return self._client.create(full, new, lease)[1]
            except EtcdError as exc:
                if owner is None or "lease not found" not in str(exc):
                    raise
                owner.expired(lease)
        raise EtcdError(f"etcd: the lease of {full.decode(errors='replace')!r} ran out twice")

    def append(self, key: str, value: str | bytes) -> None:
        """Add ``value`` at the end of ``key``'s (a read, then a write only
        where no one wrote it between: again while others append)."""
        full, line = self._root + key.encode(), _bytes(value)
        while True:
            kv = self._client.get(full)
            old = kv.value if kv is not None else b""
            compare = unchanged(full, kv.mod_revision) if kv is not None else absent(full)
            won, answers = self._client.txn([compare], [put_op(full, old + line)], [range_op(full)])
            if won:
                return
            found = ranged(answers[0]) if answers else []
            if found and found[0].value.startswith(old + line):
                return  # ours went in: its answer was lost, and the retry found it

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Each key's value, ``b""`` where it does not exist (a c10d store
        would wait for it): a heartbeat gone with its lease reads as no
        one's, so its member is dead (``_watch.Watcher.alive``). One round
        trip per :data:`MAX_TXN_OPS` keys."""
        values: list[bytes] = []
        for at in range(0, len(keys), MAX_TXN_OPS):
            part = keys[at : at + MAX_TXN_OPS]
            _, answers = self._client.txn([], [range_op(self._root + k.encode()) for k in part], [])
            if len(answers) != len(part):
                raise EtcdError(f"etcd answered {len(answers)} reads of {len(part)}")
            for answer in answers:
                found = ranged(answer)
                values.append(found[0].value if found else b"")
        return values

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._root + key.encode()) > 0

    def list_keys(self) -> list[str]:
        """Every key under ``root`` + ``scope``, less ``root``."""
        found = self._client.get_prefix(self._root + self._scope, keys_only=True)
        return [kv.key[len(self._root) :].decode(errors="replace") for kv in found]


class Changes:
    """An etcd watch of every key under ``prefix`` but those under ``quiet``
    (the heartbeats, which move every interval): :attr:`changed` is set
    when one changes, and whenever the watch is (re)made, so that a reader
    that waits on it never misses a change. On a thread of its own, from
    one endpoint to the next; ``silence`` seconds without a word (not even
    a heartbeat's) and it watches anew.

    With ``compact`` (a client), it also compacts etcd's history: every
    revision older than ``keep_history`` seconds (as the watch saw them go
    by) goes, once ``compact_min`` revisions passed since its last. Every
    heartbeat is a revision; without compaction etcd's database grows
    until its quota stops every write. A revision already
    compacted (by another member, or by etcd's own auto-compaction) is no
    error.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        prefix: bytes,
        quiet: Sequence[bytes],
        silence: float,
        name: str,
        *,
        compact: Etcd | None = None,
        keep_history: float = KEEP_HISTORY,
        compact_min: int = COMPACT_MIN,
    ) -> None:
        self._endpoints = list(endpoints)
        self._prefix = prefix
        self._quiet = tuple(quiet)
        self._silence = silence
        self._compact = compact
        self._keep_history = keep_history
        self._compact_min = compact_min
        self._seen: list[tuple[float, int]] = []  # (when, revision): samples, oldest first
        self.compacted = 0  # the revision compacted to last (0: none yet)
        self.changed = threading.Event()
        self._lock = threading.Lock()  # guards _closed and _conn
        self._closed = False
        self._conn: http.client.HTTPConnection | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        """Wait up to ``seconds`` for a change, looking at ``stop`` every
        50 ms; whether ``stop`` was set. The change is then taken: a later
        one wakes the next wait."""
        until = time.monotonic() + seconds
        while not stop.is_set():
            left = until - time.monotonic()
            if left <= 0 or self.changed.wait(min(left, 0.05)):
                break
        self.changed.clear()
        return stop.is_set()

    def _run(self) -> None:
        at, pause = 0, 0.05
        while True:
            host, port = self._endpoints[at]
            conn = http.client.HTTPConnection(host, port, timeout=min(self._silence, 2.0))
            try:
                conn.connect()  # before it is published: close() cuts what it sees
                with self._lock:
                    if self._closed:
                        return
                    self._conn = conn
                assert conn.sock is not None
                conn.sock.settimeout(self._silence)
                self._watch(conn)
                pause = 0.05
            except (OSError, http.client.HTTPException, ValueError) as exc:
                log.debug("ftcomm: membership: the etcd watch at %s:%d ended: %s", host, port, exc)
            finally:
                conn.close()
            self.changed.set()  # what changed while no watch was made is not known
            with self._lock:
                self._conn = None
                if self._closed:
                    return
            at = (at + 1) % len(self._endpoints)
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _watch(self, conn: http.client.HTTPConnection) -> None:
        create = {"create_request": prefix_range(self._prefix)}
        conn.request("POST", "/v3/watch", json.dumps(create))
        response = conn.getresponse()
        if response.status != 200:
            raise http.client.HTTPException(f"etcd answered {response.status}")
        while not self._closed:
            line = response.readline()
            if not line:
                return  # the endpoint closed it
            result = json.loads(line).get("result", {})
            if result.get("created") or result.get("canceled"):
                self.changed.set()
                if result.get("canceled"):
                    return
            for event in result.get("events", []):
                key = unb64(event.get("kv", {}).get("key", ""))[len(self._prefix) :]
                if not key.startswith(self._quiet):
                    self.changed.set()
            revision = int(result.get("header", {}).get("revision", 0))
            if self._compact is not None and revision:
                self._compact_history(time.monotonic(), revision)

    def _compact_history(self, now: float, revision: int) -> None:
        """Note ``revision`` (a sample every tenth of ``keep_history``), and
        compact to the newest sample older than ``keep_history``."""
        if not self._seen or now - self._seen[-1][0] >= self._keep_history / 10:
            self._seen.append((now, revision))
        old = [r for t, r in self._seen if now - t >= self._keep_history]
        if not old or self._closed:
            return
        self._seen = [(t, r) for t, r in self._seen if now - t < self._keep_history]
        if old[-1] - self.compacted < self._compact_min:
            return  # (a few revisions: not worth a cluster-wide compaction)
        assert self._compact is not None
        try:
            self._compact.call("/v3/kv/compaction", {"revision": str(old[-1])})
        except (EtcdError, ConnectionError) as exc:  # compacted already, or not now
            log.debug("ftcomm: membership: etcd compaction to %d: %s", old[-1], exc)
        self.compacted = old[-1]  # (tried: the next try is COMPACT_MIN later)

    def close(self) -> None:
        """End the watch and its thread (a read in flight is cut off; a
        connect in flight ends within 2 s, then sees it is closed)."""
        with self._lock:
            self._closed = True
            conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        if self._thread.ident is not None:
            self._thread.join()
        if self._compact is not None:
            self._compact.close()
