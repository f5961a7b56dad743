"""ftcomm's etcd client (``ftcomm._etcd``) against real etcd clusters on
loopback (``ftcomm.testing.EtcdCluster``, the ``ftcomm_etcd`` fixture): its
calls, its leases, its failover when the leader dies, and its deadline when
no node answers."""

from __future__ import annotations

import http.client
import os
import subprocess
import threading
import time
from typing import Any

import pytest
from helpers import open_sockets

from ftcomm import _etcd as _etcd_module
from ftcomm._etcd import Etcd, EtcdError, EtcdUnavailable, prefix_end
from ftcomm.testing import EtcdCluster, etcd_missing, partition_missing


def test_keys_are_set_read_and_deleted(ftcomm_etcd: EtcdCluster) -> None:
    etcd = ftcomm_etcd.client()
    assert etcd.get(b"job/a") is None
    revision = etcd.put(b"job/a", b"1")
    got = etcd.get(b"job/a")
    assert got is not None
    assert (got.key, got.value, got.mod_revision) == (b"job/a", b"1", revision)
    etcd.put(b"job/b", b"\x00\xff")  # bytes, not text
    etcd.put(b"joc", b"outside the prefix")
    assert [(kv.key, kv.value) for kv in etcd.get_prefix(b"job/")] == [
        (b"job/a", b"1"),
        (b"job/b", b"\x00\xff"),
    ]
    assert etcd.delete(b"job/a") == 1
    assert etcd.delete(b"job/a") == 0
    assert etcd.delete_prefix(b"job/") == 1
    assert etcd.get_prefix(b"job/") == []
    assert etcd.get(b"joc") is not None


def test_create_sets_a_key_once_and_says_who_won(ftcomm_etcd: EtcdCluster) -> None:
    etcd = ftcomm_etcd.client()
    assert etcd.create(b"world/1", b"mine") == (True, b"mine")
    assert etcd.create(b"world/1", b"theirs") == (False, b"mine")
    # a retry after an answer lost on the way back finds its own value: its win
    assert etcd.create(b"world/1", b"mine") == (True, b"mine")


def test_a_key_on_a_lease_goes_with_it(ftcomm_etcd: EtcdCluster) -> None:
    etcd = ftcomm_etcd.client()
    lease = etcd.grant(2.0)
    etcd.put(b"hb/m0", b"alive", lease=lease)
    got = etcd.get(b"hb/m0")
    assert got is not None
    assert got.lease == lease
    assert 0 < etcd.keepalive(lease) <= 2
    etcd.revoke(lease)
    assert etcd.get(b"hb/m0") is None
    assert etcd.keepalive(lease) == 0  # expired (revoked): renewed no more
    etcd.revoke(lease)  # again: nothing


def test_a_lease_not_renewed_expires_with_its_keys(ftcomm_etcd: EtcdCluster) -> None:
    etcd = ftcomm_etcd.client()
    lease = etcd.grant(1.0)
    etcd.put(b"hb/m1", b"alive", lease=lease)
    deadline = time.monotonic() + 10.0  # 1 s, and the leader's look at its leases
    while etcd.get(b"hb/m1") is not None:  # etcd's state: nothing to await
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.05)


def test_a_bad_request_is_refused_not_retried(ftcomm_etcd: EtcdCluster) -> None:
    etcd = ftcomm_etcd.client()
    started = time.monotonic()
    with pytest.raises(EtcdError, match="etcd refused /v3/kv/put"):
        etcd.call("/v3/kv/put", {"key": "not base64!"})
    assert time.monotonic() - started < 2.0


def test_no_endpoint_answers_in_time_is_unavailable() -> None:
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens once it is closed
    etcd = Etcd([("127.0.0.1", port)], timeout=1.0)
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable, match=f"127.0.0.1:{port}"):
        etcd.get(b"k")
    assert 1.0 <= time.monotonic() - started < 2.0


@pytest.mark.ftcomm_etcd(nodes=3)
def test_calls_go_on_through_the_leaders_death(ftcomm_etcd: EtcdCluster) -> None:
    """A client whose endpoint is the leader: the leader is SIGKILLed, and
    each call still succeeds within its deadline, on another node, once the
    others elected a new leader; the node comes back with its data."""
    first, etcd = _leader_first(ftcomm_etcd)
    etcd.put(b"k", b"before")
    ftcomm_etcd.kill(first)
    started = time.monotonic()
    etcd.put(b"k", b"after")
    took = time.monotonic() - started
    assert took < 10.0
    got = etcd.get(b"k")
    assert got is not None
    assert got.value == b"after"
    assert ftcomm_etcd.leader() != first
    ftcomm_etcd.start_node(first)
    back = Etcd([ftcomm_etcd.endpoints[first]], timeout=10.0)
    deadline = time.monotonic() + 10.0
    while (kv := _get_or_none(back, b"k")) is None or kv != b"after":
        assert time.monotonic() < deadline, "the node never caught up"
        time.sleep(0.05)


def _leader_first(cluster: EtcdCluster) -> tuple[int, Etcd]:
    """The leader's index, and a client that tries the leader first."""
    first = cluster.leader()
    ordered = [cluster.endpoints[first]] + [
        e for i, e in enumerate(cluster.endpoints) if i != first
    ]
    return first, Etcd(ordered, timeout=10.0)


def _get_or_none(etcd: Etcd, key: bytes) -> bytes | None:
    try:
        got = etcd.get(key)
    except EtcdUnavailable:
        return None
    return got.value if got is not None else None


@pytest.mark.ftcomm_etcd(nodes=3)
def test_a_cluster_without_a_quorum_is_unavailable_by_the_deadline(
    ftcomm_etcd: EtcdCluster,
) -> None:
    etcd = ftcomm_etcd.client(timeout=2.0)
    etcd.put(b"k", b"v")
    ftcomm_etcd.kill(0)
    ftcomm_etcd.kill(1)
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable):
        etcd.put(b"k", b"w")  # one node of three: no leader, no write
    assert time.monotonic() - started < 3.0


def test_prefix_end_is_the_first_key_after_the_prefix() -> None:
    assert prefix_end(b"job/") == b"job0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_a_missing_etcd_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTCOMM_ETCD", "/nonexistent/etcd")
    why = etcd_missing()
    assert why is not None
    assert "/nonexistent/etcd" in why
    with pytest.raises(RuntimeError, match="/nonexistent/etcd"), EtcdCluster(1):
        pass


def _tables() -> str:
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout


@pytest.mark.ftcomm_etcd(nodes=3)
def test_a_partitioned_leader_is_cut_off_and_healed(ftcomm_etcd: EtcdCluster) -> None:
    """The leader, partitioned: its clients' calls go on within their
    deadline on the others, which elect a new leader; healed, it answers
    again and follows."""
    why = partition_missing()
    if why is not None:
        pytest.skip(why)
    first, etcd = _leader_first(ftcomm_etcd)
    etcd.put(b"k", b"before")
    ftcomm_etcd.partition(first)
    table = f"ftcomm_etcd_{os.getpid()}_{first}"
    assert table in _tables()
    started = time.monotonic()
    etcd.put(b"k", b"during")
    assert time.monotonic() - started < 10.0
    with pytest.raises(TimeoutError, match="no answer"):  # silent, not refused
        etcd.status(*ftcomm_etcd.endpoints[first], timeout=0.5)
    assert ftcomm_etcd.leader() != first
    ftcomm_etcd.heal(first)
    assert table not in _tables()
    back = Etcd([ftcomm_etcd.endpoints[first]], timeout=10.0)
    deadline = time.monotonic() + 10.0
    while _get_or_none(back, b"k") != b"during":
        assert time.monotonic() < deadline, "the node never caught up"
        time.sleep(0.05)
    ftcomm_etcd.partition(first)
    ftcomm_etcd.close()  # a partition left at the close goes with it
    assert f"ftcomm_etcd_{os.getpid()}_" not in _tables()


def test_a_kept_connection_is_used_again_and_one_gone_stale_is_made_anew(
    ftcomm_etcd: EtcdCluster,
) -> None:
    before = open_sockets()
    plain = ftcomm_etcd.client()
    plain.put(b"k", b"1")
    assert open_sockets() == before  # each call its own connection, closed after
    etcd = Etcd(ftcomm_etcd.endpoints, timeout=10.0, keep=True)
    etcd.put(b"k", b"2")
    assert open_sockets() == before + 1
    etcd.get(b"k")
    assert open_sockets() == before + 1  # the same one
    ftcomm_etcd.kill(0)  # the node closes it: stale, not the node's fault
    ftcomm_etcd.start_node(0)
    ftcomm_etcd.leader(timeout=10.0)
    got = etcd.get(b"k")
    assert got is not None
    assert got.value == b"2"
    assert open_sockets() == before + 1
    etcd.close()
    assert open_sockets() == before


def test_two_calls_at_once_each_use_a_connection_and_one_is_kept(
    ftcomm_etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forced: a call paused in its request while another on another thread
    completes and keeps its connection; the first then closes its own
    rather than drop the kept one unclosed (a ResourceWarning, an fd)."""
    paused, go = threading.Event(), threading.Event()
    real = http.client.HTTPConnection

    made: list[http.client.HTTPConnection] = []

    class Pausing(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        def request(self, *args: Any, **kwargs: Any) -> None:
            if not paused.is_set():
                paused.set()
                go.wait(10)
            super().request(*args, **kwargs)

    before = open_sockets()
    etcd = Etcd(ftcomm_etcd.endpoints, timeout=10.0, keep=True)
    monkeypatch.setattr(_etcd_module.http.client, "HTTPConnection", Pausing)
    first = threading.Thread(target=etcd.put, args=(b"a", b"1"))
    first.start()
    assert paused.wait(10)
    etcd.put(b"b", b"2")  # the other call: kept its connection
    go.set()
    first.join(10)
    assert not first.is_alive()
    assert open_sockets() == before + 1  # one kept, the other closed
    kept = list(etcd._conns.values())
    assert len(kept) == 1
    assert [c.sock is None for c in made if c is not kept[0]] == [True]  # closed, not dropped
    etcd.close()
    assert open_sockets() == before


class _Stale:
    """A kept connection the endpoint closed."""

    sock = None
    timeout = 1.0

    def request(self, *args: Any, **kwargs: Any) -> None:
        raise http.client.RemoteDisconnected("closed by the endpoint (the test)")

    def close(self) -> None:
        pass


class _AlwaysStale(dict):  # type: ignore[type-arg]
    """Kept connections that are always stale (another call keeps one)."""

    def pop(self, key: Any, default: Any = None) -> Any:
        return _Stale()


def test_kept_connections_stale_twice_in_a_row_fail_over_not_crash() -> None:
    """Forced: both tries of a request find a kept connection gone stale:
    the try fails as a refused endpoint does (before, an UnboundLocalError
    escaped every handler)."""
    etcd = Etcd([("127.0.0.1", 9)], timeout=0.3, keep=True)
    etcd._conns = _AlwaysStale()  # type: ignore[assignment]
    with pytest.raises(EtcdUnavailable, match="closed the connection"):
        etcd.get(b"k")
