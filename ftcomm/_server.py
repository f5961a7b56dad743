"""A store to configure against: :func:`serve_store` and ``python -m ftcomm store``.

Owns :class:`StoreServer`, :func:`serve_store` and the ``store`` command: a
c10d ``TCPStore`` hosted in this process, which must outlive every rank so
the survivors of a failure can meet again. It listens only on the address
asked for, loopback by default (it binds the socket itself; c10d's server
listens on every interface), and has no authentication. See docs/running.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any

from torch._C._distributed_c10d import TCPStore

from ._runtime.deadline import to_seconds
from ._store import StoreAddr

DEFAULT_HOST = "127.0.0.1"
_BACKLOG = 2048  # every rank connects at once after a failure


class StoreServer:
    """A running store server (see :func:`serve_store`).

    Attributes:
        host: the address it listens on (an IP address).
        port: its port.
    """

    def __init__(self, host: str, port: int, store: Any) -> None:
        self.host = host
        self.port = port
        self._store: Any = store

    def __repr__(self) -> str:
        state = "serving" if self._store is not None else "closed"
        return f"<ftcomm.StoreServer {self.address} {state}>"

    @property
    def address(self) -> str:
        """``host:port`` (``[v6]:port`` for IPv6): a store address without its prefix."""
        return StoreAddr(self.host, self.port, "").host_port

    def addr(self, prefix: str) -> str:
        """The ``host:port/prefix`` to ``configure()`` a group with.

        Use a fresh prefix for every configuration (``run/q0``, ``run/q1``, ...).

        Raises:
            TypeError: ``prefix`` is not a str.
        """
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        return f"{self.address}/{prefix}"

    @property
    def serving(self) -> bool:
        """Whether it still serves (not closed)."""
        return self._store is not None

    def close(self) -> None:
        """Stop serving (ranks connected to it lose their store). Idempotent."""
        self._store = None

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _address(host: str) -> tuple[socket.AddressFamily, str]:
    """``host`` as (family, IP address); a name is resolved once, here."""
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"host must be a host name or an IP address, got {host!r}")
    host = host.strip().removeprefix("[").removesuffix("]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ValueError(f"host {host!r} does not resolve ({exc.strerror})") from None
        family, _, _, _, sockaddr = infos[0]
        return family, str(sockaddr[0])
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    return family, str(ip)


def serve_store(host: str = DEFAULT_HOST, port: int = 0, *, timeout: float = 300.0) -> StoreServer:
    """Host a c10d ``TCPStore`` for ``Group.configure()`` in this process.

    Args:
        host: the address to listen on, loopback by default; an interface's
            (``0.0.0.0`` or ``::`` for all) lets other machines in, with no
            authentication (docs/running.md).
        port: the port; 0 picks a free one (read it from ``.port``).
        timeout: how long the server's own blocking calls may wait, in seconds.

    It serves until :meth:`StoreServer.close` (or the ``with`` block ends,
    or the object is dropped). Ranks configure against
    ``server.addr("run/q0")``.

    Raises:
        TypeError: ``port`` is not an int, or ``timeout`` neither a number
            nor a ``timedelta``.
        ValueError: a port outside 0..65535, a host that is not a non-empty
            str or does not resolve, or a timeout below 1 ms, NaN, infinite
            or over 1e9 seconds.
        OSError: the address cannot be bound (in use, not this machine's).
    """
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int, got {type(port).__name__}")
    if not 0 <= port < 65536:
        raise ValueError(f"port must be in 0..65535, got {port}")
    seconds = to_seconds(timeout, "timeout")
    if seconds < 0.001:  # c10d keeps milliseconds: less is no timeout at all
        raise ValueError(f"timeout must be at least 1 ms, got {seconds:g} seconds")
    family, ip = _address(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        v6 = ipaddress.ip_address(ip) if family == socket.AF_INET6 else None
        if isinstance(v6, ipaddress.IPv6Address) and (v6.is_unspecified or v6.ipv4_mapped):
            # '::' is every address, IPv4 ones included (as the docs say), and
            # '::ffff:a.b.c.d' is an IPv4 one: not IPv6-only.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((ip, port))
        sock.listen(_BACKLOG)
        bound = int(sock.getsockname()[1])
        fd = sock.detach()  # the store owns it from here: it closes it when dropped
    except BaseException:
        sock.close()
        raise
    store = TCPStore(
        ip,
        bound,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=seconds),
        master_listen_fd=fd,
    )
    return StoreServer(ip, bound, store)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ftcomm store",
        description=(
            "Host a store for ftcomm groups until interrupted. Ranks configure() "
            "against HOST:PORT/PREFIX. The store has no authentication: give it a "
            "non-loopback --host only on a private network."
        ),
    )
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on ({DEFAULT_HOST}; 0.0.0.0 or :: for every interface)",
    )
    p.add_argument("--port", type=int, default=29500, help="port (29500; 0 picks a free one)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ftcomm store``: serve until SIGINT or SIGTERM."""
    args = parser().parse_args(argv)
    try:
        server = serve_store(args.host, args.port)
    except (OSError, ValueError) as exc:
        print(
            f"python -m ftcomm store: cannot listen on {args.host}:{args.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ip = ipaddress.ip_address(server.host)
    # a wildcard is not an address to connect to: ranks use this machine's own
    where = f"<this machine's address>:{server.port}" if ip.is_unspecified else server.address
    with server:
        _say(f"ftcomm store serving on {server.address}")
        _say(f"  ranks: await group.configure('{where}/run/q0', rank, world_size)")
        if not ip.is_loopback:
            _say("  no authentication: anyone who reaches this port can join a group")
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    _say("ftcomm store stopped")
    return 0


def _say(line: str) -> None:
    """Print a line; a reader that went away (``| head``) does not stop the store."""
    try:
        print(line, flush=True)
    except (BrokenPipeError, ValueError):
        with contextlib.suppress(OSError):  # later lines, and the exit's flush, go nowhere
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
