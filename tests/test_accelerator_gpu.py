"""The GPU scenarios (tests/gpu_scenarios.py, which ``make gpu-check`` runs):
on a GPU where there is one, else over the fake device layer, so that the
scenarios' own logic is tested on every machine."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import fake_accel
import gpu_scenarios
import pytest
import torch
from helpers import StoreServer

from ftcomm.backends import accelerator
from ftcomm.backends._accel_device import NCCL

ROOT = Path(__file__).resolve().parent.parent
GPU = torch.cuda.is_available() and accelerator.device_calls(NCCL).available()


@pytest.mark.parametrize("name", list(gpu_scenarios.SCENARIOS))
def test_scenario(name: str, store: StoreServer, monkeypatch: pytest.MonkeyPatch) -> None:
    if GPU:
        rig: gpu_scenarios.Rig = gpu_scenarios.Rig()
    else:
        rig = gpu_scenarios.FakeRig(fake_accel.install(monkeypatch, NCCL))
    scenario = gpu_scenarios.SCENARIOS[name]
    try:
        if asyncio.iscoroutinefunction(scenario):
            figures = asyncio.run(scenario(rig, store.port))
        else:
            figures = scenario(rig, store.port)
    except gpu_scenarios.Skipped as exc:
        pytest.skip(str(exc))
    assert isinstance(figures, dict)
    assert figures


def test_the_gpu_check_says_when_there_is_no_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if GPU:
        pytest.skip("there is a GPU")
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None
    assert spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main([str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().out
    assert json.loads((tmp_path / "gpu_check.json").read_text())["gpu"] is False


def test_the_gpu_check_runs_its_scenarios_and_writes_figures(tmp_path: Path) -> None:
    args = [] if GPU else ["--fake"]
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_check.py"),
            str(tmp_path),
            *args,
            "--only",
            "every_collective",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["results"]["every_collective"]["passed"] is True
    assert summary["results"]["every_collective"]["figures"] == {"collectives": 12}
    assert "1/1 passed" in (tmp_path / "gpu_check.log").read_text()


def test_the_gpu_check_records_a_scenario_this_machine_cannot_run_as_skipped(
    tmp_path: Path,
) -> None:
    """fsdp2_example needs 4 GPUs: with fewer (or the fake layer) it is
    skipped, said so, and not counted as passed."""
    if GPU and torch.cuda.device_count() >= gpu_scenarios.EXAMPLE_GPUS:
        pytest.skip("this machine can run it")
    fake = [] if GPU else ["--fake"]
    script = str(ROOT / "scripts" / "gpu_check.py")
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path), *fake, "--only", "fsdp2_example"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())["results"]["fsdp2_example"]
    assert "needs 4 GPUs" in result["skipped"]
    assert "figures" not in result
    assert "0/0 passed; skipped: ['fsdp2_example']" in (tmp_path / "gpu_check.log").read_text()
