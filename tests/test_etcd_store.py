"""The etcd engine's adapter (``ftcomm._membership._etcd_store``): the store
engine's calls answer on etcd as on a c10d store, a member's own keys live
with its lease, an answer lost in a failover writes nothing twice, and a
watch wakes a waiting member."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from torch._C._distributed_c10d import TCPStore

from ftcomm._etcd import Etcd
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


def test_a_lease_is_renewed_as_its_member_writes(ftcomm_etcd: EtcdCluster) -> None:
    raw = ftcomm_etcd.client()
    mine = EtcdStore(ftcomm_etcd.client(), "job/", lease=Lease(ftcomm_etcd.client(), 2))
    mine.set("hb/m0", "t 0")
    until = time.monotonic() + 4.0  # twice the TTL
    n = 0
    while time.monotonic() < until:
        n += 1
        mine.compare_set("hb/m0", f"t {n - 1}", f"t {n}")
        time.sleep(0.2)
    assert raw.get(b"job/hb/m0").value == f"t {n}".encode()  # type: ignore[union-attr]


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
