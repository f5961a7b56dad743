"""etcd clusters on loopback, for tests of the etcd engine (ftcomm's and yours).

Owns: :class:`EtcdCluster` (etcd processes from the system's ``etcd``
binary, each on loopback ports of its own, their data in a temporary
folder; started, waited for until a leader is elected, killed, restarted,
partitioned, and gone at the end), :func:`etcd_missing` and
:func:`partition_missing`. See docs/testing.md, "etcd clusters".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import TracebackType

from .._etcd import Etcd

ETCD_ENV = "FTCOMM_ETCD"
"""The etcd binary to run (default: ``etcd`` on ``PATH``)."""

MAX_NODES = 7
"""Nodes a cluster may have (each runs under a uid of its own, as root)."""

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


def partition_missing() -> str | None:
    """Why :meth:`EtcdCluster.partition` cannot run here (``None``: it can)."""
    if sys.platform != "linux":
        return "partitioning an etcd node needs Linux (nftables)"
    if os.geteuid() != 0:
        return "partitioning an etcd node needs root (nftables, and a uid for each node)"
    if shutil.which("nft") is None:
        return "nft is not installed (apt-get install nftables; make install does it as root)"
    return None


_TABLE = "ftcomm_etcd_"
"""The nftables tables (family ``inet``, in this namespace) of partitions:
``ftcomm_etcd_<pid>_<node>``, removed by :meth:`EtcdCluster.heal`, at the
cluster's close, and by the next cluster where their process is gone."""


def _node_uid(i: int) -> int:
    """The uid node ``i`` of this process's clusters runs as (root only): a
    partition's rule tells that node's packets from every other's by it."""
    return 200_000 + (os.getpid() % 1_000_000) * MAX_NODES + i


def _nft(script: str) -> None:
    proc = subprocess.run(
        ["nft", "-f", "-"], input=script, capture_output=True, text=True, timeout=20, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"nft: {(proc.stderr or proc.stdout).strip()}")


def _sweep_tables() -> None:
    """Delete partition tables whose process is gone (killed before its close)."""
    try:
        listed = subprocess.run(
            ["nft", "list", "tables"], capture_output=True, text=True, timeout=20, check=False
        ).stdout
    except OSError:
        return
    for line in listed.splitlines():
        name = line.split()[-1] if line.startswith("table inet ") else ""
        pid = name[len(_TABLE) :].split("_")[0] if name.startswith(_TABLE) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(RuntimeError, OSError):
                _nft(f"delete table inet {name}\n")


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
    partitioned: bool = False

    @property
    def endpoint(self) -> tuple[str, int]:
        return ("127.0.0.1", self.client_port)


@dataclass
class EtcdCluster:
    """``nodes`` etcd processes on loopback, as a context manager.

    ``address(prefix)`` is what ``Membership`` takes; ``kill(i)`` and
    ``start_node(i)`` take a node down and back; ``partition(i)`` and
    ``heal(i)`` cut it off and back (root and nftables:
    :func:`partition_missing`); ``leader()`` is the index of the node that
    leads now. See docs/testing.md, "etcd clusters".

    Args:
        nodes: how many etcd processes, 1 to :data:`MAX_NODES` (3 for a
            quorum that outlives one node).
        timeout: seconds entering waits for the cluster to elect a leader.

    Raises (on entering):
        RuntimeError: etcd is missing (:func:`etcd_missing`), or the
            cluster did not elect a leader within ``timeout``.
        ValueError: ``nodes`` is not between 1 and :data:`MAX_NODES`.
    """

    nodes: int = 1
    timeout: float = 30.0
    members: list[EtcdNode] = field(default_factory=list)
    _folder: str = ""

    def __enter__(self) -> EtcdCluster:
        why = etcd_missing()
        if why is not None:
            raise RuntimeError(why)
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"an etcd cluster here has 1 to {MAX_NODES} nodes, got {self.nodes}")
        if partition_missing() is None:
            _sweep_tables()
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
        # as root, each node runs as a uid of its own (partition() tells its
        # packets apart by it), in a data folder it owns
        uid = _node_uid(i) if os.geteuid() == 0 else None
        if uid is not None:
            data = os.path.join(self._folder, node.name)
            os.makedirs(data, mode=0o700, exist_ok=True)
            os.chown(data, uid, uid)
            os.chmod(self._folder, 0o711)
        with open(node.log, "ab") as log:
            node.proc = subprocess.Popen(
                argv,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
                user=uid,
                group=uid,
                extra_groups=[] if uid is not None else None,
            )

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (its data stays: :meth:`start_node` brings it back)."""
        node = self.members[i]
        if node.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                node.proc.send_signal(signal.SIGKILL)
            node.proc.wait()
            node.proc = None

    def partition(self, i: int) -> None:
        """Cut node ``i`` off: no packet reaches it, from its peers or its
        clients, and none leaves it (they vanish: no reset, no error), until
        :meth:`heal`. Its process runs on, as a node behind a cut link does.

        Raises:
            RuntimeError: it cannot be done here (:func:`partition_missing`).
        """
        why = partition_missing()
        if why is not None:
            raise RuntimeError(why)
        node = self.members[i]
        ports = f"{node.client_port}, {node.peer_port}"
        _nft(
            f"table inet {_TABLE}{os.getpid()}_{i} {{\n"
            "  chain out {\n"
            "    type filter hook output priority filter; policy accept;\n"
            f"    meta skuid {_node_uid(i)} drop\n"
            f"    tcp dport {{ {ports} }} drop\n"
            "  }\n"
            "}\n"
        )
        node.partitioned = True

    def heal(self, i: int) -> None:
        """Undo :meth:`partition` of node ``i`` (none: nothing)."""
        node = self.members[i]
        if node.partitioned:
            _nft(f"delete table inet {_TABLE}{os.getpid()}_{i}\n")
            node.partitioned = False

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
            with contextlib.suppress(RuntimeError, OSError):
                self.heal(i)
            self.kill(i)
        if partition_missing() is None:
            _sweep_tables()
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = ""
