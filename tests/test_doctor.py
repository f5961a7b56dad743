"""``python -m ftcomm doctor``: the report, its live Gloo abort check, ``--store``,
and its exit status. Kept fast: one live check that passes, one that is made
to fail, one CLI process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
from helpers import StoreServer, free_port

import ftcomm
from ftcomm import _doctor
from ftcomm.backends import gloo


def _json_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = _doctor.main(["--json", *args])
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return code, report


def test_json_report_and_the_live_gloo_abort(capsys: pytest.CaptureFixture[str]) -> None:
    threads = threading.active_count()
    code, report = _json_run(capsys)
    assert code == 0, (report["problems"], report.get("live_check"))
    assert report["ok"] is True
    assert report["problems"] == []
    assert report["ftcomm"] == ftcomm.__version__
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["build"] == (
        f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu"
    )
    gloo_ = report["backends"]["gloo"]
    assert gloo_["in_torch"] is True
    assert gloo_["usable"] is True
    assert set(report["backends"]) == {"gloo", "nccl", "xccl"}
    assert report["backends"]["nccl"]["usable"] == (
        torch.distributed.is_nccl_available() and torch.cuda.is_available()
    )
    assert report["shm"]["total_bytes"] > 0
    assert report["shm"]["free_bytes"] > 0
    assert report["shm"]["usable"] is True
    live = report["live_check"]
    assert live["ran"] is True
    assert live["passed"] is True, live
    assert live["rank0"] == "CommAborted"
    assert live["abort_s"] < _doctor.LIVE_ABORT_BOUND
    assert live["sockets_found"] is True
    assert live["warnings"] == []
    assert live["peer"] == "CommFailed"  # the abort reached the peer
    assert live["tensor_untouched"] is True
    rows = {(r["backend"], r["mode"]): r for r in report["abort_truth_table"]}
    assert ("gloo", "in process") in rows
    assert ("gloo", "subprocess=True") in rows
    assert rows["gloo", "in process"]["here"].startswith("live check: passed")
    assert rows["gloo", "subprocess=True"]["real_abort"] == "yes"
    assert report["store"] is None
    # the live check's threads, if any of its own, are gone (ftcomm's runtime may stay)
    left = [t for t in threading.enumerate() if not t.name.startswith("ftcomm-")]
    assert len(left) <= threads, left


def test_a_local_only_abort_fails_the_live_check(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the group's sockets are not found, the abort stays local: rank 1's
    matching op completes against rank 0's native op. The check must see it."""
    monkeypatch.setattr(gloo, "find_pairs", lambda *_: None)
    monkeypatch.setattr(gloo, "_warned_local", threading.Event())  # warn again, here
    code, report = _json_run(capsys)
    assert code == 1
    live = report["live_check"]
    assert live["passed"] is False
    assert live["sockets_found"] is False
    assert any("could not be identified" in w for w in live["warnings"])
    assert live["peer"] == "completed against the aborted op"
    (problem,) = report["problems"]
    assert "live in-process Gloo abort check failed" in problem["what"]
    assert "subprocess=True" in problem["advice"]


def test_store_nobody_listens_on(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    code = _doctor.main(["--no-live", "--store", f"127.0.0.1:{port}/run"])
    out = capsys.readouterr().out
    assert code == 1
    problem = [line for line in out.splitlines() if f"127.0.0.1:{port}" in line]
    assert any("not reachable" in line and "connection refused" in line for line in problem)
    assert any(line.strip().startswith("do: start a store on") for line in problem), out


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_store_answers(capsys: pytest.CaptureFixture[str], host: str) -> None:
    server = StoreServer(host)
    stderr_before = os.fstat(2)
    try:
        shown = f"[{host}]" if ":" in host else host
        code, report = _json_run(capsys, "--no-live", "--store", f"{shown}:{server.port}/a/b")
    finally:
        server.close()
    stderr_after = os.fstat(2)  # the handshake's quiet stderr is put back
    assert (stderr_after.st_dev, stderr_after.st_ino) == (
        stderr_before.st_dev,
        stderr_before.st_ino,
    )
    assert code == 0, report["problems"]
    store = report["store"]
    assert store["reachable"] is True, store
    assert store["host_port"] == f"{shown}:{server.port}"
    assert store["prefix"] == "a/b"
    assert report["live_check"] == {"ran": False, "reason": "--no-live"}


def test_store_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = StoreServer("127.0.0.1")
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(server.port))
        code, report = _json_run(capsys, "--no-live", "--store", "env://run")
    finally:
        server.close()
    assert code == 0, report["problems"]
    assert report["store"]["reachable"] is True
    assert report["store"]["host_port"] == f"127.0.0.1:{server.port}"


def test_a_bad_store_address_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _doctor.main(["--no-live", "--store", "tcp://127.0.0.1:1"])
    assert exc.value.code == 2
    assert "has a scheme" in capsys.readouterr().err


@pytest.mark.ftcomm_etcd(nodes=3)
def test_an_etcd_cluster_is_healthy_then_not(
    capsys: pytest.CaptureFixture[str], ftcomm_etcd: Any
) -> None:
    """Three nodes: healthy, one leader named by all. Two of them killed:
    the one left answers but names no leader (or one of the dead), and a
    majority of those listed is gone: a problem, with what to do."""
    code, report = _json_run(capsys, "--no-live", "--etcd", ftcomm_etcd.address("job"))
    assert code == 0, report["problems"]
    etcd = report["etcd"]
    assert etcd["healthy"] is True
    assert etcd["prefix"] == "job"
    assert [e["answered"] for e in etcd["endpoints"]] == [True] * 3
    assert {e["leader"] for e in etcd["endpoints"]} == {etcd["leader"]}
    assert all(e["version"].startswith("3.") for e in etcd["endpoints"])
    ftcomm_etcd.kill(0)
    ftcomm_etcd.kill(1)
    code = _doctor.main(["--no-live", "--etcd", ftcomm_etcd.address()])
    out = capsys.readouterr().out
    assert code == 1
    assert "is not healthy" in out
    problem = [line for line in out.splitlines() if "do: start etcd on" in line]
    assert problem, out
    for host, port in ftcomm_etcd.endpoints[:2]:
        assert f"{host}:{port}" in problem[0]


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("127.0.0.1:2379", "must be etcd://host:port"),
        ("etcd://127.0.0.1", "each endpoint must be host:port"),
        ("etcd://127.0.0.1:2379,:1", "each endpoint must be host:port"),
        ("etcd://127.0.0.1:99999", "a port from 1 to 65535"),
    ],
)
def test_a_bad_etcd_address_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], address: str, says: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        _doctor.main(["--no-live", "--etcd", address])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_an_etcd_address_is_read_with_its_endpoints_and_prefix() -> None:
    from ftcomm._etcd import parse_etcd_addr

    addr = parse_etcd_addr("etcd://10.0.0.1:2379,[::1]:2380/jobs/a")
    assert addr.endpoints == (("10.0.0.1", 2379), ("::1", 2380))
    assert addr.prefix == "jobs/a"
    assert str(addr) == "etcd://10.0.0.1:2379,[::1]:2380/jobs/a"


def test_the_human_report(capsys: pytest.CaptureFixture[str]) -> None:
    code = _doctor.main(["--no-live"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    for name in ("gloo", "nccl", "xccl", "subprocess"):
        assert any(line.split()[:1] == [name] for line in lines), (name, out)
    assert torch.__version__ in out
    assert "/dev/shm:" in out
    assert "gloo, in process: real abort: yes" in out
    assert "live check: not run (--no-live)" in out
    assert out.rstrip().endswith("OK: everything ftcomm needs is here")


def test_missing_things_give_advice(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old torch and a small /dev/shm are problems, each with advice; a
    missing uvloop or torchft is a note."""
    torch_info, shm_info, packages_info = (
        _doctor.torch_info,
        _doctor.shm_info,
        _doctor.packages_info,
    )
    monkeypatch.setattr(_doctor, "torch_info", lambda: {**torch_info(), "version": "2.6.0"})
    monkeypatch.setattr(
        _doctor, "shm_info", lambda: {**shm_info(), "free_bytes": 64 << 20, "usable": False}
    )

    def no_optional() -> dict[str, Any]:
        found = packages_info()
        found["uvloop"] = {"importable": False, "version": None}
        found["torchft"] = {"version": None}
        return found

    monkeypatch.setattr(_doctor, "packages_info", no_optional)
    code = _doctor.main(["--no-live"])
    out = capsys.readouterr().out
    assert code == 1
    assert "2 problem(s):" in out
    assert "torch 2.6.0 is older than 2.7" in out
    assert "do: upgrade torch: pip install -U 'torch>=2.7'" in out
    assert "64.0 MiB free" in out
    assert "--shm-size" in out
    assert "- uvloop: not installed (optional)" in out
    assert "- torchft: not installed (optional" in out


def test_the_command_line() -> None:
    """The entry point, live check included: a JSON report on stdout and
    nothing on stderr (no C++ stack, no log of the check's expected failures)."""
    proc = subprocess.run(
        [sys.executable, "-m", "ftcomm", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["torch"]["version"] == torch.__version__
    assert report["ok"] is True
    assert report["live_check"]["passed"] is True
    assert proc.stderr == ""
