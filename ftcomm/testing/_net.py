"""Network faults: each rank on a host of its own, and rules that cut its wire.

Owns: :func:`network_missing` (why network faults cannot run here), one
world's network (:class:`Network`, made by the harness and removed whatever
happened), entering a namespace (:func:`enter`: setns(2) on the calling
thread), the nftables rules of each network fault (:func:`rules`), their
application, the timers that heal them, and healing one at once
(:meth:`Network.heal`, for the chaos bench). Needs Linux, root, iproute2
(``ip``) and nftables (``nft``). See docs/testing.md, "Network faults".
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from ._faults import NETWORK_KINDS, Fault, Kind

log = logging.getLogger("ftcomm")

SUBNET = "10.86.0"
HUB_HOST = f"{SUBNET}.254"
"""Where a network world's store listens (the hub's bridge)."""
MAX_RANKS = 253
"""Ranks a network world can hold: .1 to .253 of its /24."""
DEVICE = "eth0"
"""Each rank's link to the hub, in its own namespace."""
_PREFIX = "ftcw"
_NS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_MNT_DETACH = 2
_LOSS_SCALE = 10_000
"""Loss rates are applied in steps of 1/_LOSS_SCALE (``numgen random mod``)."""
_COMMAND_TIMEOUT = 20.0
_counter = itertools.count()
_live: set[str] = set()
"""The tags of this process's worlds whose network is up."""
_live_lock = threading.Lock()

T = TypeVar("T")


class NetworkFailed(RuntimeError):
    """A namespace, link or rule could not be made (the command's own words)."""


# -- what this machine can do ----------------------------------------------------
@functools.cache
def network_missing() -> str | None:
    """Why network faults cannot run here, or ``None`` where they can.

    Checks Linux, root, ``ip`` and ``nft``, then makes a namespace with a
    veth and a loss rule on it (tens of milliseconds, once per process).
    For a test to skip with: ``pytest.skip(network_missing())``.
    """
    if sys.platform != "linux":
        return "network faults need Linux (network namespaces)"
    if os.geteuid() != 0:
        return "network faults need root (network namespaces, nftables)"
    if shutil.which("ip") is None:
        return "ip (iproute2) is not installed"
    if shutil.which("nft") is None:
        return "nft is not installed (apt-get install nftables; make install does it as root)"
    tag = f"{_PREFIX}{os.getpid()}xprobe"
    probe = f"{tag}-p"
    with _live_lock:
        _live.add(tag)
    try:
        _ip("netns", "add", probe)
        try:
            _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
            table = _table("probe", _chain("egress", "p0", "numgen random mod 2 < 1 drop"))
            _nft(probe, table)
        finally:
            _delete_namespace(probe)
    except NetworkFailed as exc:
        return f"network namespaces or nftables do not work here: {exc}"
    finally:
        with _live_lock:
            _live.discard(tag)
    return None


# -- commands ---------------------------------------------------------------------
def _run(argv: list[str], text: str | None = None) -> None:
    try:
        proc = subprocess.run(
            argv,
            input=text,
            capture_output=True,
            text=True,
            check=False,
            timeout=_COMMAND_TIMEOUT,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkFailed(f"{' '.join(argv)}: {exc}") from exc
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip()
        raise NetworkFailed(f"{' '.join(argv)}: {said or f'exit code {proc.returncode}'}")


def _ip(*argv: str, batch: list[str] | None = None) -> None:
    if batch is None:
        _run(["ip", *argv])
    else:
        _run(["ip", *argv, "-batch", "-"], "\n".join(batch) + "\n")


def _nft(namespace: str, text: str) -> None:
    _run(["ip", "netns", "exec", namespace, "nft", "-f", "-"], text)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def enter(namespace: str) -> None:
    """Move the calling thread into network namespace ``namespace`` (one
    ``ip netns add`` made). Sockets it makes from then on, and threads it
    starts, are in that namespace; the process's other threads are not.

    Raises:
        OSError: there is no such namespace, or setns(2) refused.
    """
    fd = os.open(os.path.join(_NS_DIR, namespace), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc().setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {namespace!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_namespace(namespace: str, fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own that has entered ``namespace``;
    its value, or its exception raised here."""
    box: list[T] = []
    error: list[BaseException] = []

    def main() -> None:
        try:
            enter(namespace)
            box.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=main, name=f"world-in-{namespace}", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return box[0]


def _delete_namespace(name: str) -> None:
    """What ``ip netns del`` does, in this process (nothing to start, so
    nothing for an interrupt to cut short): detach its mount, unlink its
    name. The namespace, its links and tables go with its last user."""
    path = os.path.join(_NS_DIR, name)
    _libc().umount2(path.encode(), _MNT_DETACH)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _sweep() -> None:
    """Remove the namespaces of worlds whose process is gone (killed before
    it could clean up), and this process's that belong to no live world."""
    try:
        names = os.listdir(_NS_DIR)
    except OSError:
        return
    with _live_lock:
        live = set(_live)
    for name in names:
        if not name.startswith(_PREFIX) or "-" not in name:
            continue
        tag = name.split("-", 1)[0]
        pid = tag[len(_PREFIX) :].split("x", 1)[0]
        if not pid.isdigit():
            continue
        if int(pid) == os.getpid():
            stale = tag not in live
        else:
            try:
                os.kill(int(pid), 0)
                stale = False
            except ProcessLookupError:
                stale = True
            except PermissionError:
                stale = False
        if stale:
            _delete_namespace(name)


# -- the rules ----------------------------------------------------------------------
def _table(name: str, *chains: str) -> str:
    return f"table netdev {name} {{\n" + "".join(chains) + "}\n"


def _chain(hook: str, device: str, *rules: str) -> str:
    body = "".join(f"    {rule}\n" for rule in rules)
    return (
        f"  chain {hook} {{\n"
        f'    type filter hook {hook} device "{device}" priority filter; policy accept;\n'
        f"{body}  }}\n"
    )


def table_name(fault: Fault) -> str:
    """The nftables table (family ``netdev``) that holds ``fault``'s rules."""
    return f"ftcomm_op{fault.op}"


def rules(fault: Fault, peers: list[str], hub: str = HUB_HOST, device: str = DEVICE) -> str:
    """The nftables script that applies ``fault`` on its rank's ``device``,
    given the other ranks' addresses (``peers``) and the store's (``hub``).

    ``egress`` drops what the rank sends, ``ingress`` what it receives,
    both before any socket sees it: neither end is told.

    Raises:
        ValueError: ``fault`` is not a network fault.
    """
    if fault.kind not in NETWORK_KINDS:
        raise ValueError(f"{fault} is not a network fault")
    if fault.kind is Kind.ISOLATE:  # everything on the wire, ARP too
        out, into = ["drop"], ["drop"]
    else:
        cut = list(peers) + ([hub] if fault.kind is Kind.PARTITION and not fault.store else [])
        where = "{ " + ", ".join(cut) + " }"
        what = "drop"
        if fault.kind is Kind.LOSS:
            share = max(1, min(_LOSS_SCALE - 1, round(fault.rate * _LOSS_SCALE)))
            what = f"numgen random mod {_LOSS_SCALE} < {share} drop"
        out = [f"ip daddr {where} {what}"] if cut else []
        into = [f"ip saddr {where} {what}"] if cut else []
        if fault.kind is Kind.DROP:
            out, into = (out, []) if fault.direction == "out" else ([], into)
    return _table(
        table_name(fault), _chain("egress", device, *out), _chain("ingress", device, *into)
    )


# -- one world's network --------------------------------------------------------------
class Network:
    """One world's hosts: a hub namespace and one namespace per rank.

    Its layout, and how none of it goes in the root namespace:
    docs/testing.md, "Network faults" (its tag, ``ftcw<pid>x<n>``, is unique
    per world of this machine).

    Made at once (:class:`NetworkFailed` if a command fails, after removing
    what was made); :meth:`close` removes it all, and is safe to call twice.
    """

    def __init__(self, world_size: int) -> None:
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"a network world holds 1 to {MAX_RANKS} ranks, got {world_size}")
        _sweep()
        self.tag = f"{_PREFIX}{os.getpid()}x{next(_counter)}"
        self.hub = f"{self.tag}-hub"
        self.namespaces = [f"{self.tag}-r{rank}" for rank in range(world_size)]
        self.hub_host = HUB_HOST
        self.hosts = tuple(f"{SUBNET}.{rank + 1}" for rank in range(world_size))
        self._lock = threading.Lock()
        self._timers: list[threading.Timer] = []
        self._closed = False
        with _live_lock:
            _live.add(self.tag)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip(batch=[f"netns add {name}" for name in (self.hub, *self.namespaces)])
        hub = ["link set lo up", "link add br0 type bridge", f"addr add {HUB_HOST}/24 dev br0"]
        for rank, namespace in enumerate(self.namespaces):
            port = f"r{rank}"
            hub += [
                f"link add {port} type veth peer name {DEVICE} netns {namespace}",
                f"link set {port} master br0",
                f"link set {port} up",
            ]
        _ip("-n", self.hub, batch=[*hub, "link set br0 up"])
        for rank, namespace in enumerate(self.namespaces):
            _ip(
                "-n",
                namespace,
                batch=[
                    "link set lo up",
                    f"addr add {self.hosts[rank]}/24 dev {DEVICE}",
                    f"link set {DEVICE} up",
                ],
            )

    def in_hub(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread in the hub namespace (to make the store there)."""
        return in_namespace(self.hub, fn)

    def fire(self, rank: int, fault: Fault) -> str:
        """Apply ``fault`` to ``rank``'s link, and heal it after
        ``fault.seconds`` if that is > 0. Returns ``"done"``, or why not."""
        peers = [host for r, host in enumerate(self.hosts) if r != rank]
        with self._lock:
            if self._closed:
                return "the world is ending"
            try:
                _nft(self.namespaces[rank], rules(fault, peers, self.hub_host))
            except NetworkFailed as exc:
                return str(exc)
            if fault.seconds > 0:
                timer = threading.Timer(fault.seconds, self._heal, args=(rank, fault))
                timer.name = f"world-heal-r{rank}-op{fault.op}"
                timer.daemon = True
                timer.start()
                self._timers.append(timer)
        return "done"

    def heal(self, rank: int, fault: Fault) -> None:
        """Lift ``fault`` from ``rank``'s link now (one :meth:`fire` applied,
        for good or not yet healed); nothing once the network is closed.

        Raises:
            NetworkFailed: its table could not be deleted (the command's own words).
        """
        with self._lock:
            if not self._closed:
                argv = ["nft", "delete", "table", "netdev", table_name(fault)]
                _run(["ip", "netns", "exec", self.namespaces[rank], *argv])

    def _heal(self, rank: int, fault: Fault) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                argv = ["nft", "delete", "table", "netdev", table_name(fault)]
                _run(["ip", "netns", "exec", self.namespaces[rank], *argv])
            except NetworkFailed as exc:
                log.warning("ftcomm.testing: %s could not be healed: %s", fault, exc)
            else:
                log.warning("ftcomm.testing: %s healed after %g s", fault, fault.seconds)

    def close(self) -> None:
        """Stop the heal timers, then remove every namespace (their links
        and rules with them). Call once every rank's process is gone and the
        store closed: a namespace lives on, unnamed, while anything uses it."""
        with self._lock:
            self._closed = True
            timers, self._timers = self._timers, []
        try:
            for timer in timers:
                timer.cancel()
            for timer in timers:
                timer.join()
        finally:  # whatever happened, and each one whatever the others did
            for name in (*self.namespaces, self.hub):
                try:
                    _delete_namespace(name)
                except OSError as exc:
                    log.warning("ftcomm.testing: network namespace %s not removed: %s", name, exc)
            with _live_lock:
                _live.discard(self.tag)
