"""A store out of the box: ``serve_store``, ``python -m ftcomm store``,
``configure("env://...")``, ranks on two loopback "hosts", and torchrun."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import PrefixStore, TCPStore

import ftcomm
from ftcomm._configure import _store_and_ranks
from ftcomm._store import parse_env_addr
from ftcomm.backends._gloo_pairs import LISTENER_KEY, decode_addr

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_serve_store_listens_on_the_address_asked_for_only() -> None:
    """c10d's own server listens on every interface; this one on loopback
    only (127.0.0.2 is this machine too, and is refused), until closed."""
    with ftcomm.serve_store() as server:
        assert server.host == "127.0.0.1"
        assert server.addr("run/q0") == f"127.0.0.1:{server.port}/run/q0"
        client = TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
        client.set("k", b"v")
        assert client.get("k") == b"v"
        del client
        assert _refused("127.0.0.2", server.port)
        assert "serving" in repr(server)
    assert not server.serving
    assert _refused("127.0.0.1", server.port)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param({"port": "29500"}, TypeError, "port must be an int", id="port a str"),
        pytest.param({"port": 70000}, ValueError, r"port must be in 0\.\.65535", id="port 70000"),
        pytest.param({"host": "no-such-host.invalid"}, ValueError, "does not resolve", id="host"),
        pytest.param({"timeout": "x"}, TypeError, "timeout must be seconds", id="timeout a str"),
        pytest.param({"timeout": 0}, ValueError, "timeout must be at least 1 ms", id="timeout 0"),
    ],
)
def test_serve_store_rejects_bad_arguments_by_name(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ftcomm.serve_store(**kwargs)


def test_serve_store_refuses_a_port_in_use() -> None:
    with ftcomm.serve_store() as server, pytest.raises(OSError, match="in use"):
        ftcomm.serve_store(port=server.port)


def test_serve_store_listens_on_ipv6_and_on_every_address() -> None:
    with ftcomm.serve_store("::1") as v6:
        assert v6.address == f"[::1]:{v6.port}"
    with ftcomm.serve_store("::") as anywhere:  # every address, IPv4 ones too
        for host in ("127.0.0.1", "::1"):
            socket.create_connection((host, anywhere.port), timeout=2).close()


def test_env_addresses_read_torchruns_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for var in ("TORCHELASTIC_RESTART_COUNT",):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="needs MASTER_ADDR and MASTER_PORT"):
        parse_env_addr("env://")
    monkeypatch.setenv("MASTER_ADDR", "[::1]")
    monkeypatch.setenv("MASTER_PORT", "nope")
    with pytest.raises(ValueError, match="MASTER_PORT='nope' is not an integer"):
        parse_env_addr("env://")
    for port in ("0", "65536"):
        monkeypatch.setenv("MASTER_PORT", port)
        with pytest.raises(ValueError, match=r"MASTER_PORT must be in 1\.\.65535"):
            parse_env_addr("env://")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert str(parse_env_addr("env://run/q1")) == "[::1]:29500/run/q1"  # brackets taken off
    assert parse_env_addr("env://").prefix == "ftcomm"  # not torch's own keys
    for bad in ("127.0.0.1:29500", "tcp://10.0.0.1", "a host", "host/x", "[::1", "host]"):
        monkeypatch.setenv("MASTER_ADDR", bad)
        with pytest.raises(ValueError, match=r"MASTER_ADDR=.* is not a host name or an IP"):
            parse_env_addr("env://")
    monkeypatch.setenv("MASTER_ADDR", "fdaa::1")  # a bare IPv6 address is one
    assert parse_env_addr("env://").host == "fdaa::1"
    for query in ("env://?rank=0", "env://run/q0?rank=1"):
        with pytest.raises(ValueError, match="takes a prefix"):
            parse_env_addr(query)
    # under a one-node torchrun, each restart of its workers meets at a prefix
    # of its own; across nodes the restart counts may differ: no suffix
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert parse_env_addr("env://run/q1").prefix == "run/q1/attempt_2"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert parse_env_addr("env://run/q1").prefix == "run/q1"


@pytest.mark.asyncio
async def test_configure_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``env://``: the store from MASTER_ADDR/PORT, the world size from
    WORLD_SIZE; a rank given as an argument wins over RANK (two ranks here
    share one environment). Missing ones are named before anything happens."""
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    group = ftcomm.Group("gloo", timeout=10)
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        await group.configure("env://q0")
    with pytest.raises(TypeError, match="configure\\(\\) needs rank"):
        await group.configure("127.0.0.1:1/q0")
    with ftcomm.serve_store() as server:
        monkeypatch.setenv("MASTER_ADDR", server.host)
        monkeypatch.setenv("MASTER_PORT", str(server.port))
        with pytest.raises(ValueError, match="needs world_size: pass it, or set WORLD_SIZE"):
            await group.configure("env://q0", 0)
        assert group.state is ftcomm.State.UNCONFIGURED  # refused before anything
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "2")
        with pytest.raises(ValueError, match="RANK=2 is not a rank of a world of 2"):
            await group.configure("env://q0")
        monkeypatch.setenv("RANK", "x")  # not read where the rank is given
        assert _store_and_ranks("env://q0", 1, None)[1:] == (1, 2)
        monkeypatch.setenv("RANK", "0")
        other = ftcomm.Group("gloo", timeout=10)
        async with group, other:
            await asyncio.gather(group.configure("env://q0"), other.configure("env://q0", 1))
            assert (group.rank, other.rank, other.size()) == (0, 1, 2)
            a, b = torch.ones(3), torch.full((3,), 2.0)
            await asyncio.gather(group.allreduce(a), other.allreduce(b))
            assert a.tolist() == b.tolist() == [3.0, 3.0, 3.0]
            assert f"{server.address}/q0" in repr(group)


def _listener_host(store_port: int, prefix: str, rank: int) -> str:
    client = TCPStore("127.0.0.2", store_port, is_master=False, timeout=timedelta(seconds=10))
    addr = decode_addr(PrefixStore(prefix, client).get(LISTENER_KEY.format(rank=rank)))
    assert addr is not None
    return addr[0]


@pytest.mark.slow
def test_the_multi_host_recipe_on_two_loopback_hosts() -> None:
    """examples/multi_host.py as its docstring runs it: ``python -m ftcomm
    store`` on 127.0.0.2, rank 0's Gloo on 127.0.0.2 and rank 1's on
    127.0.0.3; the store stops cleanly on SIGTERM."""
    store = subprocess.Popen(
        [sys.executable, "-m", "ftcomm", "store", "--host", "127.0.0.2", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ranks: list[subprocess.Popen[str]] = []
    try:
        assert store.stdout is not None
        first = store.stdout.readline()
        assert first.startswith("ftcomm store serving on 127.0.0.2:"), first
        port = int(first.rsplit(":", 1)[1])
        for rank in (0, 1):
            env = dict(os.environ, FTCOMM_GLOO_HOST=f"127.0.0.{rank + 2}", MASTER_ADDR="127.0.0.2")
            env.update(MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
            ranks.append(
                subprocess.Popen(
                    [sys.executable, str(EXAMPLES / "multi_host.py"), "--prefix", "mh/q0"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=60) for p in ranks]
        for p, (out, err) in zip(ranks, outs, strict=True):
            assert p.returncode == 0, out + err
        reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        # sum over 5 steps of (0 + s) + (1 + s), s = 0..4
        assert [r["total"] for r in reports] == [25.0, 25.0]
        assert [r["rank"] for r in reports] == [0, 1]
        assert [_listener_host(port, "mh/q0", r) for r in (0, 1)] == ["127.0.0.2", "127.0.0.3"]
        assert _refused("127.0.0.1", port)  # the store: on 127.0.0.2 only
    finally:
        for p in ranks:  # on a failure above: nothing left behind to hide it
            if p.poll() is None:
                p.kill()
                p.communicate()
        store.send_signal(signal.SIGTERM)
        out, err = store.communicate(timeout=10)
    assert store.returncode == 0, err
    assert "ftcomm store stopped" in out


RESTARTED = """
import asyncio, os, torch, ftcomm

async def main():
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    async with ftcomm.Group("gloo", timeout=30) as g:
        await g.configure("env://restarts")
        total = await g.allreduce(torch.ones(1))
        print(f"attempt {attempt} rank {rank} sum {total.item():g}", flush=True)
        if attempt == 0 and rank == 1:
            os._exit(1)  # a rank dies: torchrun stops the other and restarts both

asyncio.run(main())
"""


@pytest.mark.slow
def test_torchrun_restarted_workers_meet_at_a_prefix_of_their_own(tmp_path: Path) -> None:
    """torchrun's store outlives a restart of its workers: configure("env://x")
    after a restart is not refused as a reused prefix (it meets at
    x/attempt_1)."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("no torchrun next to this interpreter (torch installed elsewhere)")
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    done = subprocess.run(
        [
            *(torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"),
            *("--no-python", sys.executable, str(script)),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # (the ranks' lines may interleave: each is found by itself)
    said = sorted(re.findall(r"attempt (\d+) rank (\d+) sum (\d+)", done.stdout))
    assert said[-2:] == [("1", "0", "2"), ("1", "1", "2")], done.stdout


@pytest.mark.slow
def test_torchrun_drives_the_async_loop_and_the_facades_ddp() -> None:
    """examples/torchrun_training.py under ``torchrun --nproc-per-node 2``:
    configure("env://...") meets in torchrun's own store, the async loop's
    allreduces sum both ranks, and DDP over ProcessGroupGloo ends with the
    same weights on both ranks."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("no torchrun next to this interpreter (torch installed elsewhere)")
    proc = subprocess.run(
        [
            *(torchrun, "--standalone", "--nproc-per-node", "2", "--no-python"),
            *(sys.executable, str(EXAMPLES / "torchrun_training.py"), "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = sorted(
        (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world_size"] == 2 for r in reports)
    assert all(r["allreduce"] == [1.0, 3.0, 5.0] for r in reports)  # (0+s)+(1+s)
    assert reports[0]["ddp_weights"] == reports[1]["ddp_weights"]
    assert "Traceback" not in proc.stderr


def test_the_anyio_loop_recovers_from_a_stalled_peer() -> None:
    """examples/anyio_training_loop.py: collectives at once from a task
    group under a deadline scope; rank 1 stalls at step 2, rank 0's deadline
    aborts the group, both configure again and end with the same weights;
    each one's stats() counts the failed ops and the abort."""
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "anyio_training_loop.py"),
            "--steps",
            "4",
            "--hang-at",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = sorted(
        (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )
    assert [r["recovered_at"] for r in reports] == [[2], [2]]
    assert reports[0]["weights"] == reports[1]["weights"]
    stats = reports[0]["stats"]
    assert stats["configures"] == 2
    assert stats["aborts"] == {"CommAborted": 1}  # rank 0's deadline: a cancel
    assert stats["ops"]["allreduce"]["count"] == 4 * 4  # 4 parameters, 4 steps
    assert sum(stats["ops"]["allreduce"]["failed"].values()) == 4  # step 2's
    assert "rank 0:\nop " in proc.stderr  # the stats table is printed
