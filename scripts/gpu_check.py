"""``make gpu-check OUT=dir``: ftcomm's NCCL backend on one GPU, in one command.

Runs every scenario of tests/gpu_scenarios.py (the GPU tests and a bench
against raw c10d NCCL), each in a process of its own with a time limit (a
scenario that hangs or crashes the process is recorded, not fatal, and
torch's once-per-process settings start fresh), and writes into ``dir``:

* ``gpu_check.log``: everything the scenarios printed, with what passed;
* ``gpu_check.json``: the figures, one entry per scenario, and what one GPU
  leaves unverified.

Exit status 0 when every scenario passed, 1 when one failed, 2 without a
GPU. ``--fake`` runs the scenarios that can on the CPU, over the fake
device layer (tests/fake_accel.py): it checks this script and the
scenarios' logic, not the GPU.

Needs nothing beyond ftcomm's own requirements (torch, anyio, uvloop): no
pytest, so that a machine without network can run it from the tree.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

LIMITS = {  # seconds per scenario, start-up included (all together: under 8 minutes)
    "every_collective": 40,
    "busy_stream_deadline": 70,
    "init_absent_peer": 40,
    "subprocess_ws1": 70,
    "facade_ws1": 40,
    "bench": 90,
    "fsdp2_example": 120,  # where the machine has 4 GPUs (else skipped at once)
}


def run_one(name: str, port: int, fake: bool) -> dict[str, Any]:
    """Run scenario ``name`` in this process; its figures, or its failure."""
    import gpu_scenarios
    import torch

    if fake:
        from fake_accel import FakeDevice

        from ftcomm.backends import accelerator
        from ftcomm.backends._accel_device import NCCL

        device = FakeDevice(NCCL)
        accelerator.device_calls = lambda flavor: device  # type: ignore[assignment]
        rig: gpu_scenarios.Rig = gpu_scenarios.FakeRig(device)
    else:
        rig = gpu_scenarios.Rig()
    scenario = gpu_scenarios.SCENARIOS[name]
    start = time.monotonic()
    try:
        if asyncio.iscoroutinefunction(scenario):
            figures = asyncio.run(scenario(rig, port))
        else:
            figures = scenario(rig, port)
        result: dict[str, Any] = {"passed": True, "figures": figures}
    except gpu_scenarios.Skipped as exc:
        result = {"passed": True, "skipped": str(exc)}
    except BaseException as exc:  # a scenario's failure is its result
        traceback.print_exc()
        result = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
    result["seconds"] = round(time.monotonic() - start, 2)
    result["torch"] = torch.__version__
    return result


def _run_limited(cmd: list[str], limit: float) -> tuple[str, int | None]:
    """Run ``cmd`` in a session of its own; its output (stdout, then
    stderr) and exit code, or ``None`` if it ran past ``limit`` seconds: then
    the whole session is killed (a scenario's worker process too), and what
    it printed is kept."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath()},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    return (out or b"").decode(errors="replace") + (err or b"").decode(errors="replace"), code


def _pythonpath() -> str:
    """The tree first, for the scenario and the worker processes it starts
    (ftcomm is not installed on a GPU machine)."""
    rest = os.environ.get("PYTHONPATH", "")
    return str(ROOT) + (os.pathsep + rest if rest else "")


def environment(fake: bool) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "fake": fake}
    if not fake and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
        except Exception as exc:
            env["nccl"] = f"unknown ({exc})"
    return env


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="gpu-check-out", help="folder for the results")
    parser.add_argument("--fake", action="store_true", help="the fake device layer, on the CPU")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", help="run these scenarios only")
    args = parser.parse_args(argv)
    if args.one:  # a child: one scenario, its result as the last line
        result = run_one(args.one, args.port, args.fake)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "gpu_check.log").open("w") as log:
        return _check(args, out, log)


def _check(args: argparse.Namespace, out: Path, log: Any) -> int:
    """Run the scenarios (see :func:`main`), saying what happens in ``log``."""
    import torch
    from torch.distributed import TCPStore

    def say(text: str) -> None:
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    env = environment(args.fake)
    say(f"environment: {json.dumps(env)}")
    if not args.fake and not torch.cuda.is_available():
        say("no CUDA device: nothing to check (run it on a GPU machine, or with --fake)")
        (out / "gpu_check.json").write_text(json.dumps({"environment": env, "gpu": False}))
        return 2
    import gpu_scenarios

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    names = args.only or list(gpu_scenarios.SCENARIOS)
    results: dict[str, Any] = {}
    for name in names:
        cmd = [sys.executable, __file__, "--one", name, "--port", str(server.port)]
        if args.fake:
            cmd.append("--fake")
        say(f"== {name} (limit {LIMITS[name]} s)")
        start = time.monotonic()
        output, code = _run_limited(cmd, LIMITS[name])
        lines = output.splitlines()
        for line in lines:
            if not line.startswith("RESULT "):
                say(f"  | {line}")
        found = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
        if found:
            result = found[-1]
        elif code is None:
            result = {"passed": False, "error": f"no result within {LIMITS[name]} s (killed)"}
        else:
            result = {"passed": False, "error": f"the process exited with {code} and no result"}
        result.setdefault("seconds", round(time.monotonic() - start, 2))
        results[name] = result
        verdict = "SKIPPED" if "skipped" in result else "PASSED" if result["passed"] else "FAILED"
        say(f"   {verdict}: {json.dumps(result)}")
    summary = {
        "environment": env,
        "gpu": not args.fake,
        "results": results,
        "unverified": gpu_scenarios.UNVERIFIED,
    }
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    failed = [n for n, r in results.items() if not r["passed"]]
    skipped = [n for n, r in results.items() if "skipped" in r]
    ran = len(names) - len(skipped)
    say(
        f"{ran - len(failed)}/{ran} passed"
        + (f"; failed: {failed}" if failed else "")
        + (f"; skipped: {skipped}" if skipped else "")
    )
    del server
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
