"""etcd clusters on loopback, for tests of the etcd engine (ftcomm's and yours).

Owns: :class:`EtcdCluster` (1 or 3 etcd processes from the system's
``etcd`` binary, each on loopback ports of its own, their data in a
temporary folder; started, waited for until a leader is elected, killed,
restarted, and gone at the end) and :func:`etcd_missing`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from types import TracebackType

from .._etcd import Etcd

ETCD_ENV = "FTCOMM_ETCD"
"""The etcd binary to run (default: ``etcd`` on ``PATH``)."""

HEARTBEAT_MS = 100
ELECTION_MS = 500
"""A leader's heartbeat and the election timeout: short, for tests (etcd's
defaults are 100 and 1000 ms)."""


def _binary() -> str | None:
    return os.environ.get(ETCD_ENV) or shutil.which("etcd")


def etcd_missing() -> str | None:
    """Why an etcd cluster cannot run here (``None``: it can)."""
    binary = _binary()
    if binary is None:
        return "etcd is not installed (apt-get install etcd-server, or FTCOMM_ETCD=/path/to/etcd)"
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError as exc:
        return f"etcd at {binary} does not run: {exc}"
    version = next((line.split()[-1] for line in out.splitlines() if "Version:" in line), "")
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if major_minor < (3, 4):
        return f"etcd at {binary} is {version or 'of no known version'}; ftcomm needs 3.4 or later"
    return None


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@dataclass
class EtcdNode:
    """One member of a cluster: its name, ports and process (``None``: down)."""

    name: str
    client_port: int
    peer_port: int
    proc: subprocess.Popen[bytes] | None = None
    log: str = ""

    @property
    def endpoint(self) -> tuple[str, int]:
        return ("127.0.0.1", self.client_port)


@dataclass
class EtcdCluster:
    """``nodes`` etcd processes on loopback (1 or 3), as a context manager.

    ``address(prefix)`` is what ``Membership`` takes; ``kill(i)`` and
    ``start_node(i)`` take a node down and back; ``leader()`` is the
    index of the node that leads now.

    Raises (on entering):
        RuntimeError: etcd is missing (:func:`etcd_missing`), or the
            cluster did not elect a leader within ``timeout``.
    """

    nodes: int = 1
    timeout: float = 30.0
    members: list[EtcdNode] = field(default_factory=list)
    _folder: str = ""

    def __enter__(self) -> EtcdCluster:
        why = etcd_missing()
        if why is not None:
            raise RuntimeError(why)
        if self.nodes < 1:
            raise ValueError(f"an etcd cluster needs at least one node, got {self.nodes}")
        self._folder = tempfile.mkdtemp(prefix="ftcomm-etcd-")
        ports = _free_ports(2 * self.nodes)
        self.members = [
            EtcdNode(f"n{i}", ports[2 * i], ports[2 * i + 1]) for i in range(self.nodes)
        ]
        try:
            for i in range(self.nodes):
                self.start_node(i)
            self.wait_for_leader(self.timeout)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return [m.endpoint for m in self.members]

    def address(self, prefix: str = "") -> str:
        """``etcd://127.0.0.1:p1,127.0.0.1:p2[/prefix]``."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"etcd://{hosts}" + (f"/{prefix}" if prefix else "")

    def client(self, timeout: float = 5.0) -> Etcd:
        return Etcd(self.endpoints, timeout)

    def start_node(self, i: int) -> None:
        """Start node ``i`` (again, with its data: it rejoins the cluster)."""
        node = self.members[i]
        if node.proc is not None and node.proc.poll() is None:
            return
        binary = _binary()
        assert binary is not None
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        node.log = os.path.join(self._folder, f"{node.name}.log")
        argv = [
            binary,
            "--name", node.name,
            "--data-dir", os.path.join(self._folder, node.name),
            "--listen-client-urls", f"http://127.0.0.1:{node.client_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{node.client_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{node.peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{node.peer_port}",
            "--initial-cluster", initial,
            "--initial-cluster-token", os.path.basename(self._folder),
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
            "--log-level", "error",
        ]  # fmt: skip
        with open(node.log, "ab") as log:
            node.proc = subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
            )

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (its data stays: :meth:`start_node` brings it back)."""
        node = self.members[i]
        if node.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                node.proc.send_signal(signal.SIGKILL)
            node.proc.wait()
            node.proc = None

    def leader(self, timeout: float = 5.0) -> int:
        """The index of the node that leads now (waits for an election).

        Raises:
            RuntimeError: no live node names a leader within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        probe = self.client()
        while True:
            ids: dict[int, int] = {}  # member id -> node index
            leads: set[int] = set()
            for i, node in enumerate(self.members):
                if node.proc is None or node.proc.poll() is not None:
                    continue
                try:
                    status = probe.status(*node.endpoint, timeout=0.5)
                except Exception:  # down, or still starting
                    continue
                ids[int(status["header"]["member_id"])] = i
                leads.add(int(status.get("leader", 0)))
            named = [ids[lead] for lead in leads if lead in ids]
            if len(leads) == 1 and named:  # every live node names the same live leader
                return named[0]
            if time.monotonic() >= deadline:
                raise RuntimeError(f"no etcd leader within {timeout:g} s:\n{self.logs()}")
            time.sleep(0.05)

    def wait_for_leader(self, timeout: float) -> int:
        return self.leader(timeout)

    def logs(self) -> str:
        out = []
        for node in self.members:
            with contextlib.suppress(OSError), open(node.log, errors="replace") as f:
                out.append(f"{node.name}: {f.read()[-2000:]}")
        return "\n".join(out)

    def close(self) -> None:
        for i in range(len(self.members)):
            self.kill(i)
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = ""
