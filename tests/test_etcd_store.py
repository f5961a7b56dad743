"""The etcd engine's adapter (``ftcomm._membership._etcd_store``): the store
engine's calls answer on etcd as on a c10d store, a member's own keys live
with its lease, an answer lost in a failover writes nothing twice, and a
watch wakes a waiting member."""

from __future__ import annotations

import http.client
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from torch._C._distributed_c10d import TCPStore

from ftcomm._etcd import Etcd, EtcdError
from ftcomm._membership._etcd_store import Changes, EtcdStore, Lease, lease_ttl
from ftcomm._membership._rule import Member
from ftcomm._membership._watch import MISSING, Superseded, Watcher, read
from ftcomm.testing import EtcdCluster


def _script(store: Any) -> list[Any]:
    """Every kind of call the store engine makes, as it makes them."""
    out: list[Any] = [
        read(store, "gen"),
        store.compare_set("world/1", "", "w1"),  # written once
        store.compare_set("world/1", "", "w2"),  # the first stays
        store.compare_set("absent", "x", "y"),  # missing: expected back, nothing set
        read(store, "absent"),
        store.compare_set("world/1", "w1", "w3"),
    ]
    store.append("roster", "a\n")
    store.append("roster", "b\n")
    store.set("at/m0", "t 1.2.3.4:5")
    out.append(store.multi_get(["roster", "at/m0", "world/1"]))
    out.append(store.compare_set("gen", MISSING, MISSING))
    out.append(store.delete_key("roster"))
    out.append(read(store, "roster"))
    return out


def test_every_call_answers_as_a_c10d_store_does(ftcomm_etcd: EtcdCluster) -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))
    try:
        expected = _script(client)
    finally:
        del client, server
    etcd = EtcdStore(ftcomm_etcd.client(), "job/")
    assert _script(etcd) == expected
    assert sorted(etcd.list_keys()) == ["at/m0", "world/1"]
    etcd.set_timeout(timedelta(seconds=3))
    # keys outside its root are not its own
    ftcomm_etcd.client().put(b"jobs", b"other")
    assert sorted(EtcdStore(ftcomm_etcd.client(), "job/").list_keys()) == ["at/m0", "world/1"]
    scoped = EtcdStore(ftcomm_etcd.client(), "", scope="job/")
    assert sorted(scoped.list_keys()) == ["job/at/m0", "job/world/1"]


def test_a_missing_key_reads_empty_in_a_multi_get(ftcomm_etcd: EtcdCluster) -> None:
    etcd = EtcdStore(ftcomm_etcd.client(), "job/")
    etcd.set("hb/a", "t 1")
    assert etcd.multi_get(["hb/a", "hb/gone"]) == [b"t 1", b""]
    assert etcd.multi_get([]) == []


def test_the_lease_ttl_follows_the_heartbeat_timeout() -> None:
    assert lease_ttl(1.0) == 2
    assert lease_ttl(2.5) == 5
    assert lease_ttl(0.2) == 2  # etcd grants no shorter


def test_a_members_keys_go_with_its_lease_and_come_back_while_no_one_took_them(
    ftcomm_etcd: EtcdCluster,
) -> None:
    raw = ftcomm_etcd.client()
    lease = Lease(ftcomm_etcd.client(), 2)
    mine = EtcdStore(ftcomm_etcd.client(), "job/", lease=lease)
    assert mine.compare_set("hb/m0", "", "t 0") == b"t 0"
    mine.set("at/m0", "t 1.2.3.4:5")
    mine.set("roster", "not leased")
    first = raw.get(b"job/hb/m0")
    assert first is not None
    assert first.lease != 0
    assert raw.get(b"job/roster").lease == 0  # type: ignore[union-attr]
    raw.revoke(first.lease)  # as if it had run out: the member was stopped that long
    assert raw.get(b"job/hb/m0") is None
    assert raw.get(b"job/at/m0") is None
    lease.expired(first.lease)
    # its next beat takes the key back, under a new lease, with the others it held
    assert mine.compare_set("hb/m0", "t 0", "t 1") == b"t 1"
    again = raw.get(b"job/hb/m0")
    assert again is not None
    assert again.lease not in (0, first.lease)
    assert raw.get(b"job/at/m0").value == b"t 1.2.3.4:5"  # type: ignore[union-attr]
    # a key read, not written, by this member is never taken
    assert mine.compare_set("hb/other", MISSING, MISSING) == MISSING.encode()
    assert raw.get(b"job/hb/other") is None


def test_a_key_another_incarnation_took_is_never_taken_back(ftcomm_etcd: EtcdCluster) -> None:
    raw = ftcomm_etcd.client()
    old = Watcher(
        EtcdStore(ftcomm_etcd.client(), "job/", lease=Lease(ftcomm_etcd.client(), 2)),
        Member("m0", "old"),
        interval=0.1,
        timeout=1.0,
    )
    old.store.compare_set("hb/m0", "", "old 0")
    old.beat()
    held = raw.get(b"job/hb/m0")
    assert held is not None
    raw.revoke(held.lease)  # ran out
    newer = EtcdStore(ftcomm_etcd.client(), "job/", lease=Lease(ftcomm_etcd.client(), 2))
    assert newer.compare_set("hb/m0", "", "new 0") == b"new 0"  # the key was free
    with pytest.raises(Superseded, match="another incarnation"):
        old.beat()
    assert raw.get(b"job/hb/m0").value == b"new 0"  # type: ignore[union-attr]


class _CreatedFirst:
    """An etcd client on which another incarnation creates ``key`` just
    before this one's create (the race the take-back loses)."""

    def __init__(self, client: Etcd, key: bytes, theirs: bytes) -> None:
        self._client, self._key, self._theirs = client, key, theirs
        self.armed = self.raced = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def create(self, key: bytes, value: bytes, lease: int = 0) -> tuple[bool, bytes]:
        if key == self._key and self.armed and not self.raced:
            self.raced = True
            self._client.put(key, self._theirs)
        return self._client.create(key, value, lease)  # type: ignore[no-any-return]


def test_a_take_back_that_another_incarnation_beat_is_superseded(
    ftcomm_etcd: EtcdCluster,
) -> None:
    """Forced: this member's key is gone (its lease alive: no grant puts it
    back), and another incarnation creates it between this one's failed
    compare and its take-back: this one is superseded, the other's value
    stays. Without the race, the take-back puts the key back."""
    raw = ftcomm_etcd.client()
    lease = Lease(ftcomm_etcd.client(), 2)
    racing = _CreatedFirst(ftcomm_etcd.client(), b"job/hb/m0", b"new 0")
    old = Watcher(
        EtcdStore(racing, "job/", lease=lease),  # type: ignore[arg-type]
        Member("m0", "old"),
        interval=0.1,
        timeout=1.0,
    )
    old.store.compare_set("hb/m0", "", "old 0")
    lease.id()  # renewed now: the next beat's id() is the same lease, no repair
    raw.delete(b"job/hb/m0")
    old.beat()  # taken back: no one else had it
    held = raw.get(b"job/hb/m0")
    assert held is not None
    assert (held.value, held.lease) == (b"old 1", lease.id())
    raw.delete(b"job/hb/m0")
    racing.armed = True
    with pytest.raises(Superseded, match="'new 0'"):
        old.beat()
    assert racing.raced  # (in the take-back's create: the lease was alive)
    assert raw.get(b"job/hb/m0").value == b"new 0"  # type: ignore[union-attr]
    assert lease.held(b"job/hb/m0") == b"old 1"  # its note taken back: not its value


def test_a_lease_is_renewed_as_its_member_writes(ftcomm_etcd: EtcdCluster) -> None:
    raw = ftcomm_etcd.client()
    lease = Lease(ftcomm_etcd.client(), 2)
    mine = EtcdStore(ftcomm_etcd.client(), "job/", lease=lease)
    mine.set("hb/m0", "t 0")
    first = lease.id()
    until = time.monotonic() + 4.0  # twice the TTL
    n = 0
    while time.monotonic() < until:
        n += 1
        mine.compare_set("hb/m0", f"t {n - 1}", f"t {n}")
        time.sleep(0.2)
    held = raw.get(b"job/hb/m0")
    assert held is not None
    assert held.value == f"t {n}".encode()
    assert held.lease == first == lease.id()  # renewed, never granted again


def test_a_key_of_a_live_lease_that_went_or_went_stale_is_put_back(
    ftcomm_etcd: EtcdCluster,
) -> None:
    """A member's srv key deleted, or left holding an older value: its next
    renewal puts the value it noted back (a failed write, a grant that put
    back only some keys, leave a live member's key wrong)."""
    raw = ftcomm_etcd.client()
    lease = Lease(ftcomm_etcd.client(), 2)
    mine = EtcdStore(ftcomm_etcd.client(), "job/", lease=lease)
    mine.set("srv/m0", "t1 1.2.3.4:5")
    raw.delete(b"job/srv/m0")
    deadline = time.monotonic() + 5.0
    while raw.get(b"job/srv/m0") is None:  # (etcd's state)
        assert time.monotonic() < deadline, "never put back"
        lease.id()
        time.sleep(0.05)
    assert raw.get(b"job/srv/m0").value == b"t1 1.2.3.4:5"  # type: ignore[union-attr]
    raw.put(b"job/srv/m0", b"t0 1.2.3.4:5", lease=lease.id())  # stale, its own lease
    while raw.get(b"job/srv/m0").value != b"t1 1.2.3.4:5":  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "never repaired"
        lease.id()
        time.sleep(0.05)
    raw.put(b"job/srv/m0", b"other")  # no lease: not its own, left alone
    for _ in range(3):
        lease.id()
        time.sleep(lease.ttl / 3)
    assert raw.get(b"job/srv/m0").value == b"other"  # type: ignore[union-attr]


def test_many_keys_are_read_in_transactions_etcd_takes(ftcomm_etcd: EtcdCluster) -> None:
    """etcd refuses a transaction of more than 128 operations: a roster of
    200 ids is read in two."""
    store = EtcdStore(ftcomm_etcd.client(), "job/")
    for i in range(0, 200, 3):
        store.set(f"hb/m{i}", f"t {i}")
    values = store.multi_get([f"hb/m{i}" for i in range(200)])
    assert values == [f"t {i}".encode() if i % 3 == 0 else b"" for i in range(200)]


class _LoseFirstAnswer:
    """An etcd client whose first ``path`` call takes effect but loses its
    answer: the call is sent again, as ``Etcd.call`` does in a failover."""

    def __init__(self, client: Etcd, path: str) -> None:
        self._client = client
        self._path = path
        self.lost = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def txn(self, *args: Any) -> Any:
        answer = self._client.txn(*args)
        if self.lost == 0:
            self.lost += 1
            return self._client.txn(*args)  # the retry, after the lost answer
        return answer


def test_an_append_whose_answer_was_lost_appends_once(ftcomm_etcd: EtcdCluster) -> None:
    lossy = _LoseFirstAnswer(ftcomm_etcd.client(), "/v3/kv/txn")
    store = EtcdStore(lossy, "job/")  # type: ignore[arg-type]
    store.append("fate/1", "kept\n")
    assert lossy.lost == 1
    store.append("fate/1", "m1\tt\n")
    assert read(EtcdStore(ftcomm_etcd.client(), "job/"), "fate/1") == b"kept\nm1\tt\n"


def test_a_compare_set_whose_answer_was_lost_reads_its_win(ftcomm_etcd: EtcdCluster) -> None:
    lossy = _LoseFirstAnswer(ftcomm_etcd.client(), "/v3/kv/txn")
    store = EtcdStore(lossy, "job/")  # type: ignore[arg-type]
    assert store.compare_set("world/1", "", "mine") == b"mine"
    assert lossy.lost == 1


def test_a_change_wakes_a_waiting_member_and_a_heartbeat_does_not(
    ftcomm_etcd: EtcdCluster,
) -> None:
    changes = Changes(ftcomm_etcd.endpoints, b"job/", (b"hb/",), silence=5.0, name="t-watch")
    changes.start()
    try:
        stop = threading.Event()
        assert changes.changed.wait(5.0)  # made: a change may have been missed
        changes.wait(stop, 0)
        raw = ftcomm_etcd.client()
        raw.put(b"job/hb/m0", b"t 1")
        started = time.monotonic()
        assert not changes.wait(stop, 0.5)
        assert time.monotonic() - started >= 0.45  # a heartbeat woke no one
        threading.Timer(0.2, raw.put, (b"job/ready/2", b"m0\n")).start()
        started = time.monotonic()
        changes.wait(stop, 5.0)
        assert 0.15 <= time.monotonic() - started < 4.0
        stop.set()
        assert changes.wait(stop, 5.0)  # stop ends a wait at once
    finally:
        changes.close()


def test_the_watch_compacts_etcds_history_older_than_it_keeps(ftcomm_etcd: EtcdCluster) -> None:
    """Every heartbeat is a revision: the watch compacts those older than
    its history (1 s here, 5 minutes by default)."""
    raw = ftcomm_etcd.client()
    first = raw.put(b"job/hb/m0", b"t 0")
    changes = Changes(
        ftcomm_etcd.endpoints,
        b"job/",
        (b"hb/",),
        silence=5.0,
        name="t-watch",
        compact=ftcomm_etcd.client(),
        keep_history=1.0,
        compact_min=1,
    )
    changes.start()
    try:
        deadline = time.monotonic() + 10.0
        n = 0
        while changes.compacted < first:
            assert time.monotonic() < deadline, "never compacted"
            n += 1
            raw.put(b"job/hb/m0", f"t {n}".encode())
            time.sleep(0.05)
    finally:
        changes.close()
    with pytest.raises(EtcdError, match="compacted"):
        raw.call("/v3/kv/range", {"key": "am9iL2hiL20w", "revision": str(changes.compacted - 1)})


def test_a_watch_closed_as_it_connects_ends_and_watches_nothing(
    ftcomm_etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forced: close() comes while the watch's thread connects (before, it
    then watched on, and close() waited for the stream to fall silent)."""
    connecting, go = threading.Event(), threading.Event()
    real = http.client.HTTPConnection.connect

    def slow_connect(self: http.client.HTTPConnection) -> None:
        connecting.set()
        go.wait(10)
        real(self)

    monkeypatch.setattr(http.client.HTTPConnection, "connect", slow_connect)
    changes = Changes(ftcomm_etcd.endpoints, b"job/", (b"hb/",), silence=5.0, name="t-watch")
    changes.start()
    assert connecting.wait(10)
    closer = threading.Thread(target=changes.close)
    closer.start()
    go.set()
    closer.join(5.0)
    assert not closer.is_alive(), "close() hung"
    assert changes._conn is None  # it never watched
