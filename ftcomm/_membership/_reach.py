"""Whether members can reach each other: a listening socket, and probes.

Owns: :class:`Listener`, a TCP socket each member holds open for its
life (on the address its Gloo group uses), whose backlog its watcher
drains; and :class:`Probes`, connects to other members' listeners made
without blocking, each ending in a :class:`Reach`. What a refusal and a
silence mean to the members: docs/membership.md, "The model".
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Hashable, Mapping
from typing import Generic, TypeVar

from ..backends.gloo import HOST_ENV

K = TypeVar("K", bound=Hashable)

_LINGER_RESET = struct.pack("ii", 1, 0)

PROBE_TIMEOUT = 1.5
"""Seconds a probe waits for its handshake at least (one SYN retransmitted
at 1 s, and its answer); longer where the heartbeat timeout is."""

CHECK_TIMEOUT = 2.5
"""Seconds a configure's check waits for each handshake at least (two
SYNs, and their answers): its verdict leaves members out."""


class Reach(enum.Enum):
    """How a probe ended.

    ====================  =================================================
    ``OK``                the handshake completed: the path works both ways
    ``REFUSED``           the host answered that nothing listens there: the
                          member's process is gone (its listener closed with
                          it), the evidence of a death that needs no timeout
    ``SILENT``            no answer within the probe's time (or the network
                          said it has no route): the path is cut, or the
                          host is down
    ====================  =================================================

    A stopped (SIGSTOP) process still answers: its kernel completes the
    handshake. One lost SYN costs TCP a second (its first retransmission),
    so a probe's time is longer than that (:data:`PROBE_TIMEOUT`), and one
    silent probe alone never decides.
    """

    OK = "ok"
    REFUSED = "refused"
    SILENT = "silent"


def listen_host(store_host: str, local: str) -> str:
    """Where a member listens: ``$FTCOMM_GLOO_HOST`` (where its Gloo group
    listens: a probe then takes the path the group's data takes), else
    ``local`` (this end's address of a connection to the store at
    ``store_host``: the interface that reaches it)."""
    own = os.environ.get(HOST_ENV, "").strip()
    return own or local or store_host


class Listener:
    """A listening socket that nobody serves: the kernel completes each
    handshake, and :meth:`drain` closes what it queued.

    Raises:
        OSError: ``host`` is not an address of this machine.
    """

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock: socket.socket | None = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setblocking(False)
            self._sock.bind((host, 0))
            self._sock.listen(socket.SOMAXCONN)  # a configure's check: n - 1 at once
        except OSError:
            self._sock.close()
            raise
        self.host = host
        self.port: int = self._sock.getsockname()[1]

    @property
    def address(self) -> str:
        """``host:port`` (``[host]:port`` for IPv6)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def drain(self) -> None:
        """Close every connection the backlog holds (probes, already reset)."""
        sock = self._sock
        if sock is None:
            return
        for _ in range(1024):
            try:
                conn, _ = sock.accept()
            except OSError:  # (BlockingIOError: none left)
                return
            conn.close()

    def close(self) -> None:
        """Stop listening: from now on a probe of this member is refused."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def parse_address(text: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port``) as a pair; ``None`` where malformed."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


class Probes(Generic[K]):
    """Connects in flight, at most one per key; :meth:`poll` collects those
    that ended (or ran out of time). Not thread-safe: one owner. A probe
    closes its connection with a reset (``SO_LINGER`` 0), so that no
    ``TIME_WAIT`` piles up on either side."""

    def __init__(self) -> None:
        self._flight: dict[K, tuple[socket.socket, float]] = {}
        self._failed: set[K] = set()  # could not even start: SILENT at the next poll

    def __len__(self) -> int:
        return len(self._flight) + len(self._failed)

    def busy(self, key: K) -> bool:
        return key in self._flight or key in self._failed

    def start(self, key: K, address: tuple[str, int], timeout: float) -> None:
        """Begin a connect to ``address`` that counts as ``SILENT`` after
        ``timeout`` seconds (no-op where one for ``key`` is in flight)."""
        if key in self._flight:
            return
        host, port = address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # out of descriptors: no answer, as a path cut would give
            self._failed.add(key)
            return
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            sock.connect_ex((host, port))  # (an error at once is read again by poll())
        except OSError:  # a name that does not resolve, ...
            sock.close()
            self._failed.add(key)
            return
        self._flight[key] = (sock, time.monotonic() + timeout)

    def poll(self, wait: float = 0.0) -> dict[K, Reach]:
        """The probes that ended, waiting up to ``wait`` seconds for one."""
        ended: dict[K, Reach] = dict.fromkeys(self._failed, Reach.SILENT)
        self._failed.clear()
        if not self._flight:
            return ended
        socks = {sock.fileno(): key for key, (sock, _) in self._flight.items()}
        with contextlib.suppress(InterruptedError):
            poller = select.poll()
            for fd in socks:
                poller.register(fd, select.POLLOUT | select.POLLERR | select.POLLHUP)
            poller.poll(0 if ended else max(wait, 0.0) * 1000)
        now = time.monotonic()
        for key, (sock, until) in list(self._flight.items()):
            answer = _answer(sock)
            if answer is None and now >= until:
                answer = Reach.SILENT
            if answer is not None:
                ended[key] = answer
                del self._flight[key]
                sock.close()
        return ended

    def close(self) -> None:
        """Give up every probe in flight."""
        for sock, _ in self._flight.values():
            sock.close()
        self._flight.clear()
        self._failed.clear()


def _answer(sock: socket.socket) -> Reach | None:
    """How the connect of ``sock`` ended; ``None``: not yet."""
    code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if code == errno.ECONNREFUSED:
        return Reach.REFUSED
    if code != 0:
        return Reach.SILENT  # no route, host unreachable, reset by a middlebox
    try:
        sock.getpeername()
    except OSError:
        return None  # still connecting
    return Reach.OK


def probe_all(
    addresses: Mapping[K, tuple[str, int]], timeout: float, stop: threading.Event | None = None
) -> dict[K, Reach]:
    """Probe every address at once; the answers when all ended (at most
    ``timeout`` seconds), or those in by the time ``stop`` was set."""
    probes: Probes[K] = Probes()
    answers: dict[K, Reach] = {}
    try:
        for key, address in addresses.items():
            probes.start(key, address, timeout)
        while len(probes) and not (stop is not None and stop.is_set()):
            answers.update(probes.poll(0.05))
    finally:
        probes.close()
    return answers
