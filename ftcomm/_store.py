"""Store addresses: ``host:port/prefix`` parsing and the store client (the
ranks' meeting in it: ``_meet``). See docs/configure.md and docs/running.md."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import logging
import os
import platform
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed import DistNetworkError

log = logging.getLogger("ftcomm")


@dataclass(frozen=True, slots=True)
class StoreAddr:
    """A parsed ``host:port/prefix`` (``[v6addr]:port/prefix`` for IPv6)."""

    host: str
    port: int
    prefix: str

    def __str__(self) -> str:
        return f"{self.host_port}/{self.prefix}"

    @property
    def host_port(self) -> str:
        """``host:port``, an IPv6 host in brackets."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_store_addr(value: object, name: str = "store_addr") -> StoreAddr:
    """Parse ``host:port/prefix``; the prefix may contain ``/`` and may be empty.

    An IPv6 host is written ``[addr]:port/prefix``, or bare as torchft takes
    it (``fdaa::1:29500/prefix``: the port is the field after the last ``:``).

    Raises:
        TypeError: ``value`` is not a str.
        ValueError: it is empty, has a scheme (``tcp://``) or whitespace in its
            host and port, or its host, port or brackets are malformed; the
            message says how to write it.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str 'host:port/prefix', got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{name} must be 'host:port/prefix', got an empty string")
    scheme, sep, _ = value.partition("://")
    if sep and scheme == "env":
        raise ValueError(f"{name} {value!r}: env:// is for configure() (it reads the environment)")
    if sep:
        raise ValueError(
            f"{name} {value!r} has a scheme: write 'host:port/prefix' (drop '{scheme}://')"
        )
    hostport, _, prefix = value.partition("/")
    if hostport != "".join(hostport.split()):
        raise ValueError(f"{name} {value!r}: its host and port must not contain whitespace")
    if hostport.startswith("["):
        host, sep, rest = hostport[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{name} {value!r}: an IPv6 host is written '[addr]:port/prefix'")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{name} {value!r}: {host!r} is not an IPv6 address") from None
        port_text = rest[1:]
    else:
        host, sep, port_text = hostport.rpartition(":")
        if not sep:
            raise ValueError(f"{name} {value!r} has no port: expected 'host:port/prefix'")
        before, _, port_first = host.rpartition(":")
        if ":" in host and port_first.isdigit() and not port_text.isdigit() and ":" not in before:
            # 'host:port:prefix': the prefix comes after a '/'
            raise ValueError(
                f"{name} {value!r}: the prefix follows a '/', as in "
                f"'{host}/{port_text}{'/' + prefix if prefix else ''}'"
            )
        if ":" in host and not _is_ipv6(host):
            raise ValueError(f"{name} {value!r}: put an IPv6 host in brackets, '[{host}]:port'")
        # else a bare IPv6 host, as torchft takes it: the port follows the last ':'
    if not host:
        raise ValueError(f"{name} {value!r} has no host: expected 'host:port/prefix'")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(
            f"{name} {value!r}: port must be an integer in 1..65535, got {port_text!r}"
        )
    return StoreAddr(host, int(port_text), prefix)


ENV_SCHEME = "env://"
DEFAULT_ENV_PREFIX = "ftcomm"


def env_int(name: str) -> int | None:
    """The integer in environment variable ``name``; ``None`` if unset or empty.

    Raises:
        ValueError: it is not an integer (the message names the variable).
    """
    text = os.environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"the environment's {name}={text!r} is not an integer") from None


def parse_env_addr(value: str, name: str = "store_addr") -> StoreAddr:
    """``env://`` or ``env://prefix``: the store at ``MASTER_ADDR:MASTER_PORT``
    (which ``torchrun`` sets, and whose agent hosts the store), under
    ``prefix`` (``"ftcomm"`` when empty). ``RANK`` and ``WORLD_SIZE`` are
    read by whoever needs them (:func:`env_int`). Under a one-node torchrun
    (``LOCAL_WORLD_SIZE`` equal to ``WORLD_SIZE``) the prefix ends with
    ``/attempt_<TORCHELASTIC_RESTART_COUNT>``: the agent's store outlives a
    restart of its workers, which then meet at a prefix of their own (not
    at one they built a group at, where they would be refused:
    ``PrefixReused``). Across nodes the agents' restart counts may differ
    (a node that restarts for another's failure does not count it), so no
    suffix there: the caller puts a generation of its own in the prefix.

    Raises:
        ValueError: ``MASTER_ADDR`` or ``MASTER_PORT`` is unset or malformed
            (a port in ``MASTER_ADDR``, a scheme, whitespace), or the prefix
            has a query; the message names what to fix.
    """
    prefix = value[len(ENV_SCHEME) :] or DEFAULT_ENV_PREFIX
    if "?" in prefix:
        raise ValueError(
            f"{name} {value!r}: env:// takes a prefix (env://run/q1), not query "
            "parameters; pass rank and world_size as arguments"
        )
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v, "").strip()]
    if missing:
        raise ValueError(
            f"{name} {value!r} needs {' and '.join(missing)} in the environment "
            "(torchrun sets them; else host a store with `python -m ftcomm store` "
            "and export its address)"
        )
    text = os.environ["MASTER_ADDR"].strip()
    host = text.removeprefix("[").removesuffix("]")
    if (
        not host
        or text.startswith("[") != text.endswith("]")
        or "[" in host
        or "]" in host
        or "/" in host
        or "".join(host.split()) != host
        or (":" in host and not _is_ipv6(host))
    ):
        raise ValueError(
            f"the environment's MASTER_ADDR={text!r} is not a host name or an IP address "
            "(the port goes in MASTER_PORT)"
        )
    port = env_int("MASTER_PORT")
    if port is None or not 0 < port < 65536:
        raise ValueError(f"the environment's MASTER_PORT must be in 1..65535, got {port}")
    attempt = env_int("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None and env_int("LOCAL_WORLD_SIZE") == env_int("WORLD_SIZE"):
        prefix = f"{prefix}/attempt_{attempt}"
    return StoreAddr(host, port, prefix)


def resolve_store_addr(value: object, name: str = "store_addr") -> StoreAddr:
    """A store address: ``host:port/prefix`` (:func:`parse_store_addr`), or
    ``env://prefix`` (:func:`parse_env_addr`)."""
    if isinstance(value, str) and value.startswith(ENV_SCHEME):
        return parse_env_addr(value, name)
    return parse_store_addr(value, name)


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


class ConnectProgress:
    """How far a connect got: what its deadline's error names.

    Written by the connecting thread, read by the owner loop when the
    deadline passes (plain attribute stores: a reader sees each one whole).
    """

    __slots__ = ("cause", "detail", "step")

    def __init__(self) -> None:
        self.step = "starting"
        """``"store"`` (reaching the store), ``"meet"`` (waiting for the other
        ranks in it), ``"native"`` (building the native group); ``"worker"``
        and ``"worker-connect"`` (a subprocess worker starting, connecting);
        or ``"starting"``."""
        self.detail = ""
        """What the step is waiting for, in words (``"rank 1 of 2 has not ..."``)."""
        self.cause: BaseException | None = None
        """The last error that kept the step from finishing (a refused connection)."""


class Stopped(Exception):
    """A connect that nobody waits for any more stopped early."""


def stop_requested(stop: concurrent.futures.Future[Any] | None, wait: float = 0.0) -> bool:
    if stop is None:
        if wait > 0:
            time.sleep(wait)
        return False
    if wait > 0:
        concurrent.futures.wait([stop], timeout=wait)
    return stop.done()


def why_unreachable(exc: BaseException) -> str:
    """A store connection's failure, in words a user can act on."""
    if isinstance(exc, ConnectionRefusedError):
        return (
            "connection refused: nothing listens on that port; is the store hosted there "
            "(python -m ftcomm store, ftcomm.serve_store()) and running?"
        )
    if isinstance(exc, socket.gaierror):
        return f"the host name does not resolve ({exc.strerror})"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "no answer to the connection (an unreachable host, or a firewall drops it)"
    if isinstance(exc, OSError):
        return f"the connection failed ({exc.strerror or exc})"
    return f"{type(exc).__name__}: {exc}"


def _wait_listening(
    addr: StoreAddr,
    timeout: float,
    deadline: float,
    progress: ConnectProgress,
    stop: concurrent.futures.Future[Any] | None,
) -> None:
    """Wait until the store's port takes connections, trying from here.

    c10d's client retries on its own, but logs each failure (a C++ stack) to
    stderr and keeps no cause; trying here first, a client is only built
    once someone listens, and the last failure is kept for the error.
    """
    if stop_requested(stop):  # given up before it began: not even one try
        raise Stopped
    delay = 0.01
    while True:
        remaining = deadline - time.monotonic()
        try:
            # Each try bounded: a host that drops the connection leaves a cause
            # for the deadline's error, and a stop is seen within 0.5 s.
            sock = socket.create_connection(
                (addr.host, addr.port), timeout=min(max(remaining, 0.01), 0.5)
            )
        except OSError as exc:
            progress.cause = exc
            progress.detail = why_unreachable(exc)
            log.debug("ftcomm: the store at %s: %s", addr, progress.detail)
        else:
            sock.close()
            progress.cause = None
            progress.detail = ""
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            assert progress.cause is not None
            raise TimeoutError(
                f"the store at {addr} did not answer within {timeout:g} s: {progress.detail}"
            ) from progress.cause
        if stop_requested(stop, min(delay, remaining)):
            raise Stopped
        delay = min(delay * 2, 0.5)


def connect_store(
    addr: StoreAddr,
    timeout: float,
    progress: ConnectProgress | None = None,
    stop: concurrent.futures.Future[Any] | None = None,
) -> Store:
    """A client of the TCPStore at ``addr``, scoped to its prefix.

    Blocks for ``timeout`` seconds at most, also against a server that takes
    the connection and never answers (see :class:`_StuckReadGuard`).

    Raises:
        TimeoutError: nobody answered within ``timeout`` (its message and
            ``__cause__`` say why: refused, no such host, no answer).
        Stopped: ``stop`` completed first.
        torch.distributed.DistNetworkError: the connection broke.
    """
    started = time.monotonic()
    progress = progress or ConnectProgress()
    progress.step, progress.detail = "store", ""
    _wait_listening(addr, timeout, started + timeout, progress, stop)
    # The store's ops keep the whole timeout; the connect, what is left of it.
    guard = _StuckReadGuard(addr, max(started + timeout - time.monotonic(), 0.01))
    try:
        with guard:
            store = TCPStore(
                host_name=addr.host,
                port=addr.port,
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout),
            )
    except DistNetworkError as exc:
        # c10d raises this one type both for a store that never answered
        # within the timeout (it retries until then) and for a connection
        # that broke: only the first is a timeout.
        if guard.fired or time.monotonic() - started >= timeout:
            raise TimeoutError(
                f"the store at {addr} did not answer within {timeout:g} s: {exc}"
            ) from exc
        raise
    if guard.fired:  # the reply came as the guard shut the socket: unusable
        raise TimeoutError(f"the store at {addr} did not answer within {timeout:g} s")
    return PrefixStore(addr.prefix, store) if addr.prefix else store


# Linux syscalls a thread blocked reading a socket sits in, by machine.
_READ_SYSCALLS = {
    "x86_64": frozenset({0, 45, 47}),  # read, recvfrom, recvmsg
    "aarch64": frozenset({63, 207, 212}),
}.get(platform.machine(), frozenset())


class _StuckReadGuard:
    """Ends a store connect that is stuck past its deadline reading the store.

    c10d's store client (torch 2.13) handshakes with the server after it
    connects and waits for the reply with no timeout: against a server that
    accepts and never answers (hung, stopped), the constructor blocks for
    good, whatever timeout it was given. That blocks the configure thread,
    and, when the read returns into a finalizing interpreter at exit, aborts
    the process. So from the deadline on, every 50 ms, this reads which
    syscall the connecting thread is in (``/proc/self/task/<tid>/syscall``);
    if it is a read on a TCP socket whose peer is the store's address, it
    shuts that socket down, and the constructor raises. Nothing else is ever
    touched: the socket is the one that thread is reading, and its peer is
    checked. Where ``/proc`` or the syscall table is not known, it does nothing.
    """

    def __init__(self, addr: StoreAddr, timeout: float) -> None:
        self._addr = addr
        self._timeout = timeout
        self._tid = threading.get_native_id()
        self._done = threading.Event()
        # Held across "still stuck? then cut it", and to end the guard: a
        # connect that returns meanwhile is either cut (and fired is set
        # before connect_store reads it) or never touched.
        self._cut_lock = threading.Lock()
        self.fired = False
        """Whether it shut the store's socket down (the connect is then a timeout)."""
        self._peers: frozenset[str] = frozenset()
        if _READ_SYSCALLS:
            with contextlib.suppress(OSError, UnicodeError):
                self._peers = frozenset(
                    _plain_ip(str(info[4][0]))
                    for info in socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)
                )

    def __enter__(self) -> _StuckReadGuard:
        if self._peers:
            threading.Thread(target=self._watch, name="ftcomm-store-guard", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cut_lock:
            self._done.set()

    def _watch(self) -> None:
        if self._done.wait(self._timeout):
            return
        while not self._done.is_set():
            self._unstick()
            self._done.wait(0.05)

    def _reading(self) -> int | None:
        """The fd the connecting thread is blocked reading, if it is."""
        try:
            with open(f"/proc/self/task/{self._tid}/syscall") as f:
                fields = f.read().split()
            if len(fields) < 2 or not fields[0].isdigit():
                return None  # running, or not in a syscall
            return int(fields[1], 16) if int(fields[0]) in _READ_SYSCALLS else None
        except (OSError, ValueError):
            return None

    def _unstick(self) -> None:
        fd = self._reading()
        if fd is None:
            return
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return
        with sock, contextlib.suppress(OSError):
            if sock.type != socket.SOCK_STREAM or sock.family not in _INET:
                return
            host, port = sock.getpeername()[:2]
            if port != self._addr.port or _plain_ip(host) not in self._peers:
                return
            # Still blocked reading that fd: our dup is the socket it reads
            # (a thread blocked in a read holds its file; the fd cannot have
            # moved to another file between the two reads of /proc).
            with self._cut_lock:
                if self._reading() == fd and not self._done.is_set():
                    self.fired = True
                    sock.shutdown(socket.SHUT_RDWR)


_INET = (socket.AF_INET, socket.AF_INET6)


def _plain_ip(host: str) -> str:
    """``::ffff:1.2.3.4`` -> ``1.2.3.4``; other addresses unchanged."""
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ip)
    return host
