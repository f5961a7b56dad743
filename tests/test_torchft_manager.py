"""torchft's Manager as a client of ftcomm.c10d (needs the torchft extra:
``pip install 'ftcomm[torchft]'``; ``make test`` installs it).

Both scenarios are examples a user can run, run here as they would run them,
each in a process of its own (torchft leaves threads and its lighthouse's
sockets behind in the process that ran it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="the torchft extra is not installed")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
def test_a_killed_replica_commits_nothing_failed_and_heals() -> None:
    """Two replica processes, torchft's Manager over ftcomm's Gloo: replica 1
    is killed (SIGKILL) mid-step; replica 0's step fails and is not
    committed; replica 1 restarts and heals; both end with the same weights."""
    proc = _run("torchft_manager.py", "--steps", "5", "--kill-at", "2", "--json", timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("{")))
    assert report["problems"] == []
    assert report["restarts"] == 1
    steps0 = report["steps"]["0"]
    failed = [(step, error) for step, committed, error in steps0 if error]
    assert failed, steps0  # replica 0 felt its peer die ...
    assert all(not committed for _, committed, error in steps0 if error)  # ... committed none
    assert all("CommFailed" in error or "CommTimeout" in error for _, error in failed), failed
    # and committed every step, 0 to 4, once each
    assert [step for step, committed, _ in steps0 if committed] == list(range(5))


def test_injected_errors_under_torchfts_ddp() -> None:
    """``report_future_error(e, wait_raises=False)`` fails a step of torchft's
    DDP: backward() completes, the Manager holds the error and does not
    commit; the steps around it commit."""
    proc = _run("torchft_ddp_faults.py", timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert lines[0] == "step 0: committed=True error=None"
    assert lines[1].startswith("step 1: committed=False error=")
    assert "injected at step 1" in lines[1]
    assert lines[2] == "step 2: committed=True error=None"


def test_an_error_from_wait_makes_torchfts_ddp_assert() -> None:
    """The upstream limit docs/migrating.md names: in torchft 0.2.0 an op
    whose wait() raises (every real failure, on any process group) makes
    DDP's comm hook assert. If this fails, torchft fixed it: say so there."""
    proc = _run("torchft_ddp_faults.py", "--wait-raises", timeout=90)
    assert proc.returncode != 0
    assert "assert fut._fut" in proc.stderr, proc.stderr[-3000:]
