"""The state copy over links of their own: three members, each in a network
namespace of its own, joined by a bridge through rate-limited veth pairs.

Owns: the namespaces (made and removed by :func:`links`, named after this
process), the members (``ip netns exec NS python -c ...``, one process
each; rank 0 hosts their c10d store), the rows (:func:`measure`) and their
table and JSON. Needs root and iproute2 (``ip``, ``tc``); :func:`missing`
says why not where either is absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .report import percentile

MEMBERS = 3
GBIT = 2.0
"""Each direction of each member's link, in Gbit/s (``--state-link-gbit``)."""
MIB = 512
ROUNDS = 3
_PORT = 29611
_SUBNET = "10.77.0"
_TIMEOUT = 300.0


class LinksFailed(Exception):
    """A namespace could not be made, or a member failed or did not answer in time."""


def missing() -> str | None:
    """Why the rows cannot run here (``None``: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    return None


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise LinksFailed(f"{' '.join(argv)}: {proc.stderr.strip()}")


@contextlib.contextmanager
def links(gbit: float) -> Iterator[list[str]]:
    """Three namespaces on a bridge, each link limited to ``gbit`` both ways
    (``tc ... tbf`` on every direction, as hosts with their own network cards
    are); yields their names (member ``i`` is ``{_SUBNET}.{i + 1}``). Removed
    after."""
    tag = f"ftc{os.getpid() % 100000}"
    switch, members = f"{tag}sw", [f"{tag}m{i}" for i in range(MEMBERS)]
    made: list[str] = []
    rate = f"{gbit}gbit"
    try:
        for ns in (switch, *members):
            _run("ip", "netns", "add", ns)
            made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for i, ns in enumerate(members):
            inner, outer = f"{tag}a{i}", f"{tag}b{i}"
            _run(
                "ip",
                "link",
                "add",
                inner,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                outer,
                "netns",
                switch,
            )
            _run("ip", "-n", ns, "addr", "add", f"{_SUBNET}.{i + 1}/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", switch, "link", "set", outer, "master", "br0")
            _run("ip", "-n", switch, "link", "set", outer, "up")
            for where, dev in ((ns, inner), (switch, outer)):  # out of the member, into it
                _run("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", rate, "burst", "4mb", "latency", "50ms")  # fmt: skip
        yield members
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


_CHILD = "from ftcomm._bench.links import member; member()"


def member() -> None:
    """A member's process: ``argv``: rank, MiB, rounds; prints its times as JSON."""
    import asyncio

    rank, mib, rounds = (int(a) for a in sys.argv[1:4])
    print(json.dumps(asyncio.run(_member(rank, mib, rounds))), flush=True)


async def _member(rank: int, mib: int, rounds: int) -> dict[str, Any]:
    import torch
    from torch._C._distributed_c10d import TCPStore

    import ftcomm

    from .state_copy import TENSORS

    torch.set_num_threads(1)
    host = f"{_SUBNET}.1"
    store = TCPStore(host, _PORT, MEMBERS, rank == 0, wait_for_workers=False)
    per = mib * (1 << 20) // 4 // TENSORS
    state = {f"t{i}": torch.full((per,), float(rank == 0)) for i in range(TENSORS)}
    times: dict[str, list[float]] = {"1 behind": [], "2 behind": []}
    wrong: list[str] = []
    async with ftcomm.Group("gloo", timeout=120) as every, ftcomm.Group("gloo", timeout=120) as two:
        await every.configure(f"{host}:{_PORT}/every", rank, MEMBERS)
        if rank < 2:
            await two.configure(f"{host}:{_PORT}/two", rank, 2)
        for _ in range(rounds + 1):  # the first round warms up, and is dropped
            for case, group, behind in (("1 behind", two, 1), ("2 behind", every, 2)):
                if rank:
                    for t in state.values():
                        t.zero_()
                await every.allreduce(torch.ones(1))  # all start together
                started = time.perf_counter()
                if rank <= behind:
                    await ftcomm.sync_state(group, state, int(rank == 0))
                times[case].append(time.perf_counter() - started)
                if 0 < rank <= behind and not all(bool(t.eq(1).all()) for t in state.values()):
                    wrong.append(case)
        await every.allreduce(torch.ones(1))
    del store
    return {"times": {c: v[1:] for c, v in times.items()}, "wrong": wrong}


@dataclass
class Rows:
    mib: int
    gbit: float
    times: dict[str, list[float]]

    def p50(self, case: str) -> float:
        return percentile(self.times[case], 50)

    def ratio(self) -> float:
        return self.p50("2 behind") / self.p50("1 behind")


def measure(mib: int, rounds: int, gbit: float) -> Rows:
    """Run the members over rate-limited links: ``sync_state`` to one member
    behind and to two. On one machine's loopback every byte a member
    forwards costs the same cores again; here each link carries it once, and
    the figure is what a chain is for: the time to two members behind over
    the time to one.

    Raises: LinksFailed: a namespace could not be made; a member failed,
        did not answer in time, or did not end with the sender's state.
    """
    with links(gbit) as names, contextlib.ExitStack() as files:
        procs: list[tuple[subprocess.Popen[bytes], Any, Any]] = []
        try:
            for rank, ns in enumerate(names):
                env = {**os.environ, "FTCOMM_GLOO_HOST": f"{_SUBNET}.{rank + 1}"}
                argv = ["ip", "netns", "exec", ns, sys.executable, "-c", _CHILD]
                out, err = (files.enter_context(tempfile.TemporaryFile()) for _ in range(2))
                proc = subprocess.Popen(
                    [*argv, str(rank), str(mib), str(rounds)], stdout=out, stderr=err, env=env
                )
                procs.append((proc, out, err))
            answers = []
            deadline = time.monotonic() + _TIMEOUT
            for rank, (proc, out, err) in enumerate(procs):
                try:
                    code = proc.wait(max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    raise LinksFailed(
                        f"member {rank} did not finish within {_TIMEOUT:g} s"
                    ) from None
                out.seek(0)
                err.seek(0)
                if code != 0:
                    said = err.read().decode(errors="replace")[-3000:]
                    raise LinksFailed(f"member {rank} exited {code}:\n{said}")
                answers.append(json.loads(out.read().decode().strip().splitlines()[-1]))
        finally:
            for proc, _, _ in procs:  # the namespaces go next: no member may outlive them
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    for rank, answer in enumerate(answers):
        if answer["wrong"]:
            raise LinksFailed(f"member {rank} did not get the state sent in {answer['wrong']}")
    times = {
        case: [max(a["times"][case][i] for a in answers) for i in range(rounds)]
        for case in ("1 behind", "2 behind")
    }
    return Rows(mib, gbit, times)


def format_links(rows: Rows) -> str:
    mb = rows.mib * (1 << 20)
    lines = [
        f"state copy over links of their own ({rows.mib} MiB, 3 members in network namespaces, "
        f"each link {rows.gbit:g} Gbit/s each way):",
        f"{'what':<40}{'p50_s':>8}{'GB/s':>8}",
    ]
    for case in ("1 behind", "2 behind"):
        label = f"ftcomm sync_state, {case}"
        lines.append(f"{label:<40}{rows.p50(case):8.3f}{mb / rows.p50(case) / 1e9:8.2f}")
    lines.append(f"two behind take {rows.ratio():.2f}x the time of one (a chain)")
    return "\n".join(lines)


def links_json(rows: Rows) -> dict[str, Any]:
    return {
        "mib": rows.mib,
        "gbit": rows.gbit,
        "rows": [{"case": c, "p50_s": rows.p50(c), "times_s": t} for c, t in rows.times.items()],
        "two_behind_over_one": rows.ratio(),
    }
