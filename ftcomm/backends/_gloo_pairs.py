"""The TCP sockets of one in-process Gloo group, found exactly, and severed.

Owns :func:`make_device` (Gloo's listener: the one new ``LISTEN`` socket),
:func:`find_pairs` (the pair sockets: connected, a member's listener at one
end) and :class:`PairSockets`, whose ``sever`` (``shutdown(SHUT_RDWR)``) is
the real abort that ``ProcessGroupGloo.abort()`` is not. Where the pairs
cannot be established the group has none, and its aborts stay local. How
they are found, and what a sever does: docs/gloo.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ftcomm")

Addr = tuple[str, int]

_DEVICE_LOCK = threading.Lock()
"""Held while a Gloo device (and its listening socket) is made, so that the
sockets appearing meanwhile are that device's, not another group's."""

LISTENER_KEY = "ftcomm/gloo/listener/{rank}"
"""Where each member publishes its listener's ``host port`` in the group's store."""


def socket_inodes() -> dict[int, int]:
    """The process's socket descriptors and their inodes."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            fd = int(name)
            st = os.stat(f"/proc/self/fd/{fd}")
        except (OSError, ValueError):  # closed meanwhile
            continue
        if stat.S_ISSOCK(st.st_mode):
            found[fd] = st.st_ino
    return found


@contextlib.contextmanager
def _borrowed(fd: int, inode: int) -> Iterator[socket.socket | None]:
    """A socket object over a duplicate of ``fd`` if it is still the socket
    with ``inode``, else ``None``. The duplicate is closed afterwards (Gloo's
    own descriptor never is)."""
    try:
        dup = os.dup(fd)
    except OSError:  # closed
        yield None
        return
    sock: socket.socket | None = None
    try:
        if os.fstat(dup).st_ino == inode:  # else another file has the number now
            sock = socket.socket(fileno=dup)
    except OSError:
        pass
    if sock is None:
        os.close(dup)
        yield None
        return
    try:
        yield sock
    finally:
        sock.close()  # the duplicate only


_TCP_LISTEN = "0A"


def _tcp_table() -> dict[int, tuple[Addr, Addr | None, bool]]:
    """Every TCP socket of this network namespace by inode: (local address,
    peer address or None, listening), read from ``/proc/self/net/tcp{,6}``.

    Reading the kernel's table touches no socket. (Describing a socket
    through a duplicate of its descriptor did: Gloo groups being built on
    other threads at that moment lost connections.)
    """
    table: dict[int, tuple[Addr, Addr | None, bool]] = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/self/net/{name}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            try:
                inode = int(fields[9])
                local = _hex_addr(fields[1], family)
                remote = _hex_addr(fields[2], family)
            except (ValueError, OSError):
                continue
            listening = fields[3] == _TCP_LISTEN
            peer = None if listening or remote[1] == 0 else remote
            table[inode] = (local, peer, listening)
    return table


def _hex_addr(text: str, family: int) -> Addr:
    """``0100007F:1F90`` (the kernel prints the address as 32-bit words in
    host order) to ``("127.0.0.1", 8080)``."""
    ip, _, port = text.partition(":")
    raw = bytes.fromhex(ip)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw), int(port, 16)


def _new_since(
    before: dict[int, int], after: dict[int, int]
) -> list[tuple[int, int, tuple[Addr, Addr | None, bool]]]:
    """The TCP sockets in ``after`` that were not in ``before`` (a descriptor
    whose number was reused counts as new), with (fd, inode, description)."""
    table = _tcp_table()
    return [
        (fd, inode, table[inode])
        for fd, inode in after.items()
        if before.get(fd) != inode and inode in table
    ]


def make_device(factory: Callable[[], Any]) -> tuple[Any, Addr | None]:
    """Call ``factory()`` (Gloo's ``create_device``) and find its listener:
    the device and the listener's address, or ``None`` if it is not exactly
    one new listening socket."""
    with _DEVICE_LOCK:
        before = socket_inodes()
        device = factory()
        after = socket_inodes()
    listeners = [local for _, _, (local, _, listening) in _new_since(before, after) if listening]
    if len(listeners) != 1:
        log.debug("ftcomm: %d new listening sockets with the Gloo device", len(listeners))
        return device, None
    return device, listeners[0]


def encode_addr(addr: Addr) -> str:
    return f"{addr[0]} {addr[1]}"


def decode_addr(value: bytes) -> Addr | None:
    """An address as :func:`encode_addr` wrote it; ``None`` for anything else."""
    host, _, text = value.decode("utf-8", "replace").rpartition(" ")
    try:
        port = int(text, 10) if text.isascii() and text.isdigit() else 0
    except ValueError:
        return None
    if not host or not 0 < port < 65536:
        return None
    return host, port


def _same(a: Addr, b: Addr) -> bool:
    """Whether two addresses are one endpoint (an IPv4 address may show as
    ``::ffff:a.b.c.d`` on a dual-stack socket)."""
    if a[1] != b[1]:
        return False
    return a[0].removeprefix("::ffff:") == b[0].removeprefix("::ffff:")


@dataclass(frozen=True)
class _Pair:
    fd: int
    inode: int
    local: Addr
    peer: Addr


class PairSockets:
    """One group's pair sockets; :meth:`sever` shuts them all down, once.

    Thread-safe; :meth:`sever` is idempotent and never blocks on the network.
    """

    def __init__(self, pairs: Sequence[_Pair]) -> None:
        self._pairs = list(pairs)
        self._lock = threading.Lock()
        self._severed = False

    def __len__(self) -> int:
        return len(self._pairs)

    @property
    def severed(self) -> bool:
        return self._severed

    def abort(self) -> bool:
        """:meth:`sever`; True (the op's end is then near: see NativeOp)."""
        self.sever()
        return True

    def sever(self) -> int:
        """Shut down every pair socket still open; how many were shut down
        by this call (0 if another call did it)."""
        with self._lock:
            if self._severed:
                return 0
            self._severed = True
            count = 0
            for pair in self._pairs:
                with _borrowed(pair.fd, pair.inode) as sock:
                    if sock is None:
                        continue  # Gloo closed it already
                    with contextlib.suppress(OSError):  # not connected any more
                        sock.shutdown(socket.SHUT_RDWR)
                        count += 1
            return count


def find_pairs(
    before: dict[int, int], listeners: Sequence[Addr | None], rank: int
) -> PairSockets | None:
    """The pair sockets of a group built since ``before`` was taken.

    ``listeners``: every member's listener address, by rank (``None`` where
    unknown). ``None`` if a member's address is unknown or fewer sockets than
    peers match: the group's sockets are then not known exactly.
    """
    world = len(listeners)
    if world <= 1:
        return PairSockets([])
    if any(addr is None for addr in listeners):
        return None
    own = listeners[rank]
    assert own is not None  # for mypy: checked above
    others = [a for r, a in enumerate(listeners) if r != rank and a is not None]
    pairs = []
    for fd, inode, (local, peer, listening) in _new_since(before, socket_inodes()):
        if listening or peer is None:
            continue
        if _same(local, own) or any(_same(peer, other) for other in others):
            pairs.append(_Pair(fd, inode, local, peer))
    if len(pairs) < world - 1:
        log.debug("ftcomm: found %d of %d Gloo pair sockets", len(pairs), world - 1)
        return None
    return PairSockets(pairs)
