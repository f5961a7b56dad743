"""Smoke test of ``python -m ftcomm bench``: it runs, exits 0 and prints ratios."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_bench_runs_and_prints_ratios() -> None:
    tiny = ["--iters", "50", "--big-iters", "2", "--big-mib", "1", "--rounds", "2", "--warmup", "5"]
    tiny += ["--recovery-samples", "1", "--no-torchft"]  # torchft's rows: make bench
    proc = subprocess.run(
        [sys.executable, "-m", "ftcomm", "bench", *tiny, "--timeout", "50"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"^allreduce 1xfp32\s+raw\s+\d+\.\d+\s+\d+\.\d+\s*$", out, re.M), out
    assert re.search(r"^allreduce 1xfp32\s+ftcomm\s+[\d.]+\s+[\d.]+\s+\d+\.\d+x$", out, re.M), out
    assert re.search(r"^allreduce 1xfp32\s+facade\s+[\d.]+\s+[\d.]+\s+\d+\.\d+x$", out, re.M), out
    assert re.search(r"^allreduce 1MiB fp32\s+ftcomm\s.*\(bw ratio \d+\.\d+x\)$", out, re.M), out
    for impl in ("subproc", "baby"):
        assert re.search(rf"^allreduce 1xfp32\s+{impl}\s+[\d.]+\s+[\d.]+\s+\d+\.\d+x$", out, re.M)
    assert re.search(r"^dead worker noticed\s+\d+\.\d+\s+\d+\.\d+$", out, re.M), out
    assert re.search(r"^subproc, spare worker\s+\d+\.\d+", out, re.M), out
    assert "torchft rows skipped: --no-torchft" in out, out


def test_no_command_prints_usage_and_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ftcomm", "frobnicate"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2
    assert "usage: python -m ftcomm" in proc.stderr
