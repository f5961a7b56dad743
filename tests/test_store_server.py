"""A store out of the box: ``serve_store``, ``python -m ftcomm store``,
``configure("env://...")``, ranks on two loopback "hosts", and torchrun."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import PrefixStore, TCPStore

import ftcomm
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


def test_serve_store_rejects_bad_arguments_by_name() -> None:
    with pytest.raises(TypeError, match="port must be an int"):
        ftcomm.serve_store(port="29500")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"port must be in 0\.\.65535"):
        ftcomm.serve_store(port=70000)
    with pytest.raises(ValueError, match="does not resolve"):
        ftcomm.serve_store("no-such-host.invalid")
    with ftcomm.serve_store() as server, pytest.raises(OSError, match="in use"):
        ftcomm.serve_store(port=server.port)  # in use
    with ftcomm.serve_store("::1") as v6:
        assert v6.address == f"[::1]:{v6.port}"


def test_env_addresses_read_torchruns_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="needs MASTER_ADDR and MASTER_PORT"):
        parse_env_addr("env://")
    monkeypatch.setenv("MASTER_ADDR", "::1")
    monkeypatch.setenv("MASTER_PORT", "nope")
    with pytest.raises(ValueError, match="MASTER_PORT='nope' is not an integer"):
        parse_env_addr("env://")
    monkeypatch.setenv("MASTER_PORT", "29500")
    env = parse_env_addr("env://run/q1")
    assert (str(env.addr), env.rank, env.world_size) == ("[::1]:29500/run/q1", None, None)
    assert parse_env_addr("env://").addr.prefix == "ftcomm"  # not torch's own keys
    with pytest.raises(ValueError, match="takes a prefix"):
        parse_env_addr("env://?rank=0")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (parse_env_addr("env://").rank, parse_env_addr("env://").world_size) == (1, 2)


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
    try:
        assert store.stdout is not None
        first = store.stdout.readline()
        assert first.startswith("ftcomm store serving on 127.0.0.2:"), first
        port = int(first.rsplit(":", 1)[1])
        ranks = []
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
        store.send_signal(signal.SIGTERM)
        out, err = store.communicate(timeout=10)
    assert store.returncode == 0, err
    assert "ftcomm store stopped" in out


@pytest.mark.slow
def test_torchrun_drives_the_async_loop_and_the_facades_ddp() -> None:
    """examples/torchrun_training.py under ``torchrun --nproc-per-node 2``:
    configure("env://...") meets in torchrun's own store, the async loop's
    allreduces sum both ranks, and DDP over ProcessGroupGloo ends with the
    same weights on both ranks."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
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
