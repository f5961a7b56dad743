"""The exact identification and severing of an in-process Gloo group's sockets.

What this proves, on loopback, with real sockets and real Gloo devices:

* ``sever()`` shuts a recorded pair socket down (the peer reads EOF), once,
  and never touches a descriptor number that was closed and reused by another
  socket since (the inode check), leaking no descriptor either way.
* ``make_device`` finds the one listening socket a Gloo device makes, and
  gives no address when more than one new listener appeared (never a guess).
* ``find_pairs`` finds a connection accepted by the member's listener, and
  gives ``None`` when a member's listener is unknown or a pair is missing.
* End to end, two ``GlooBackend`` ranks on two threads find their pairs, and
  severing one rank fails the other rank's allreduce in well under its
  timeout instead of hanging until it.
* The listener addresses round-trip through the store encoding.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import StoreServer
from torch.distributed import ReduceOp

from ftcomm._store import parse_store_addr
from ftcomm.backends._base import ConnectSpec
from ftcomm.backends._gloo_pairs import (
    PairSockets,
    _borrowed,
    _Pair,
    _same,
    decode_addr,
    encode_addr,
    find_pairs,
    make_device,
    socket_inodes,
)
from ftcomm.backends.gloo import GlooBackend

LOOPBACK = "127.0.0.1"


def _listener() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((LOOPBACK, 0))
    s.listen()
    return s


def _connected(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    """(client, accepted): one TCP connection to ``listener``."""
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    for s in (client, accepted):
        s.settimeout(5.0)
    return client, accepted


def _pair_of(sock: socket.socket) -> _Pair:
    local, peer = sock.getsockname(), sock.getpeername()
    return _Pair(sock.fileno(), os.fstat(sock.fileno()).st_ino, local[:2], peer[:2])


def _both_ways(a: socket.socket, b: socket.socket) -> None:
    a.sendall(b"x")
    assert b.recv(1) == b"x"
    b.sendall(b"y")
    assert a.recv(1) == b"y"


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    s = _listener()
    yield s
    s.close()


def test_sever_never_touches_a_reused_descriptor(listener: socket.socket) -> None:
    client, accepted = _connected(listener)
    stale = _pair_of(client)
    client.close()
    accepted.close()
    fresh, fresh_peer = _connected(listener)
    if fresh.fileno() != stale.fd:  # force the reuse of the number
        os.dup2(fresh.fileno(), stale.fd)
        moved = socket.socket(fileno=stale.fd)
        fresh.close()
        fresh = moved
        fresh.settimeout(5.0)
    try:
        assert os.fstat(stale.fd).st_ino != stale.inode  # another socket, same number
        fds = set(os.listdir("/proc/self/fd"))
        with _borrowed(stale.fd, stale.inode) as sock:
            assert sock is None
        pairs = PairSockets([stale])
        assert pairs.sever() == 0
        assert pairs.severed
        assert set(os.listdir("/proc/self/fd")) == fds  # the duplicates were closed
        _both_ways(fresh, fresh_peer)
    finally:
        fresh.close()
        fresh_peer.close()


def test_sever_shuts_the_pair_down_once(listener: socket.socket) -> None:
    client, accepted = _connected(listener)
    with client, accepted:
        _both_ways(client, accepted)
        fds = set(os.listdir("/proc/self/fd"))
        pairs = PairSockets([_pair_of(client)])
        assert len(pairs) == 1
        assert not pairs.severed
        assert pairs.sever() == 1
        assert accepted.recv(1) == b""  # EOF at the peer
        with pytest.raises(BrokenPipeError):  # shut down for writing here too
            client.sendall(b"z")
        assert pairs.sever() == 0
        assert pairs.abort() is True
        assert set(os.listdir("/proc/self/fd")) == fds
        assert client.fileno() >= 0  # shut down, never closed: Gloo owns it


def _gloo_device() -> Any:
    pg_gloo: Any = dist.ProcessGroupGloo
    return pg_gloo.create_device(hostname=LOOPBACK)


def test_make_device_finds_the_gloo_listener() -> None:
    device, addr = make_device(_gloo_device)
    try:
        assert addr is not None
        assert addr[0] == LOOPBACK
        with socket.create_connection(addr, timeout=5.0) as probe:  # it listens
            assert probe.getpeername()[:2] == addr
    finally:
        del device


def test_make_device_gives_no_address_when_the_listener_is_ambiguous() -> None:
    extra: list[socket.socket] = []

    def two_listeners() -> Any:
        extra.append(_listener())
        return _gloo_device()

    device, addr = make_device(two_listeners)
    try:
        assert device is not None
        assert addr is None
    finally:
        del device
        extra[0].close()
    device, addr = make_device(lambda: "no listener")
    assert (device, addr) == ("no listener", None)


def test_find_pairs(listener: socket.socket) -> None:
    own = listener.getsockname()[:2]
    other = (LOOPBACK, 1)
    before = socket_inodes()
    assert find_pairs(before, [own, other], 0) is None  # nothing new: a pair missing
    client, accepted = _connected(listener)
    with client, accepted:
        # A pair that would match, but a member's listener is unknown.
        assert find_pairs(before, [own, None], 0) is None
        single = find_pairs(before, [own], 0)  # alone: no pairs, whatever is open
        assert single is not None
        assert len(single) == 0
        found = find_pairs(before, [own, other], 0)
        assert found is not None
        assert [p.fd for p in found._pairs] == [accepted.fileno()]  # accepted by ours
        # As rank 1, whose peer (rank 0) listens on ``own``: the client end.
        found = find_pairs(before, [own, other], 1)
        assert found is not None
        assert [p.fd for p in found._pairs] == [client.fileno()]


def test_two_gloo_ranks_find_their_pairs_and_sever_fails_the_peer(
    store: StoreServer,
) -> None:
    addr = parse_store_addr(f"{LOOPBACK}:{store.port}/gloo-pairs")
    backends: list[Any] = [None, None]
    errors: list[BaseException] = []

    def connect(rank: int) -> None:
        try:
            backends[rank] = GlooBackend.connect(ConnectSpec(addr, rank, 2, 10.0))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert not errors, errors
    try:
        for b in backends:
            assert b.aborts_for_real
            assert len(b._pairs) >= 1
        ok = [b.allreduce([torch.ones(2)], ReduceOp.SUM, 5.0) for b in backends]
        assert all(op.wait(5.0) and op.outcome() is None for op in ok)
        del ok
        assert backends[0].sever() is True
        start = time.monotonic()
        op = backends[1].allreduce([torch.ones(2)], ReduceOp.SUM, 5.0)
        assert op.wait(5.0)
        took = time.monotonic() - start
        assert op.poll()
        error = op.outcome()
        assert error is not None  # failed, not completed
        assert "closed" in str(error).lower(), error  # by the peer, not a timeout
        assert took < 2.0, took
        del op, error
    finally:
        for b in backends:
            if b is not None:
                b.close()
        backends.clear()


def test_addresses_round_trip() -> None:
    for addr in [(LOOPBACK, 29500), ("::1", 5), ("fe80::1%eth0", 65535)]:
        assert decode_addr(encode_addr(addr).encode()) == addr
    assert decode_addr(b"garbage") is None
    assert decode_addr(b"host port") is None
    assert decode_addr(b" 5") is None  # no host
    assert _same(("::ffff:127.0.0.1", 5), (LOOPBACK, 5))
    assert not _same(("::ffff:127.0.0.1", 5), (LOOPBACK, 6))
    assert not _same(("127.0.0.2", 5), (LOOPBACK, 5))


def test_a_malformed_published_address_is_unknown_not_an_error() -> None:
    for value in ("h ²", "h 99999", "h 0", "h -1", "h 1e3"):
        assert decode_addr(value.encode()) is None, value


def test_finding_the_sockets_never_touches_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sockets are described from the kernel's table, not through duplicates
    of their descriptors: that disturbed Gloo groups being built on other
    threads at the same moment (one group in ~30 lost a connection, 8
    groups built at once per process), and could flip another library's
    socket to non-blocking."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        before = socket_inodes()
        with socket.create_connection(listener.getsockname()):
            accepted, _ = listener.accept()
            with accepted:

                def no_dup(fd: int) -> int:
                    raise AssertionError(f"discovery duplicated descriptor {fd}")

                monkeypatch.setattr(os, "dup", no_dup)
                own = listener.getsockname()[:2]
                pairs = find_pairs(before, [own, ("127.0.0.1", 1)], 0)
                device, address = make_device(lambda: socket.socket())
                device.close()
    assert pairs is not None
    assert len(pairs) == 1  # the accepted end: its local address is our listener
    assert address is None  # no listening socket was made
