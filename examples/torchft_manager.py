"""torchft's Manager over ftcomm.c10d: a replica is killed mid-step, the other
commits no failed step, the killed one comes back and heals, and both end
with the same weights.

Two replicas (processes) train a small model; their gradients are averaged
by torchft's ``Manager.allreduce`` over an ``ftcomm.c10d.ProcessGroupGloo``,
the only line that differs from a plain torchft job. (Not torchft's
``DistributedDataParallel``: in torchft 0.2.0 its comm hook asserts, and
``backward()`` raises, when an allreduce fails, whatever the process group;
docs/migrating.md says more.) The lighthouse runs in this process, on loopback.
At step ``--kill-at`` replica 1 kills itself with SIGKILL while replica 0 is
in the step's allreduce: replica 0's allreduce fails at once (its peer's
connections close), the Manager reports the error and does not commit the
step. This script restarts replica 1, which heals from replica 0 (the
checkpoint goes over the same ftcomm group, torchft's ``PGTransport``), and
both train on to ``--steps``.

Needs torchft (``pip install 'ftcomm[torchft]'``)::

    python examples/torchft_manager.py [--steps 6] [--kill-at 2]

It prints each replica's steps (committed or not, and why), and exits 0
only if the weights are equal and no failed step was committed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from datetime import timedelta
from typing import Any

TIMEOUT = timedelta(seconds=10)


def replica(
    replica_id: int,
    store_port: int,
    lighthouse: str,
    steps: int,
    kill_at: int | None,
    results: Any,
) -> None:
    """One replica's training loop (a process of its own)."""
    import torch
    from torch import nn, optim
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.manager import Manager

    from ftcomm.c10d import ProcessGroupGloo

    torch.manual_seed(0)  # both replicas start from the same weights
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = optim.SGD(model.parameters(), lr=0.1)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    pg = ProcessGroupGloo(timeout=TIMEOUT)  # the one ftcomm line
    manager = Manager(
        pg=pg,
        min_replica_size=2,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica{replica_id}",
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        timeout=TIMEOUT,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=TIMEOUT,
        checkpoint_transport=PGTransport(pg, timeout=TIMEOUT, device=torch.device("cpu")),
    )
    data = torch.Generator().manual_seed(1000 + replica_id)
    try:
        while manager.current_step() < steps:
            manager.start_quorum()
            optimizer.zero_grad()
            batch = torch.randn(16, 4, generator=data)
            step = manager.current_step()
            model(batch).pow(2).mean().backward()
            if step == kill_at:
                # Mid-step: the quorum of both replicas is formed, and replica
                # 0 is in (or on its way into) this step's allreduce.
                manager.wait_quorum()
                os.kill(os.getpid(), signal.SIGKILL)
            # Averaged over the replicas in the quorum; a failure is reported
            # to the manager (wait() returns False), never raised here.
            works = [manager.allreduce(p.grad) for p in model.parameters()]
            for work in works:
                work.wait()
            error = manager.errored()
            committed = manager.should_commit()
            if committed:
                optimizer.step()
            results.put(("step", replica_id, step, committed, repr(error) if error else None))
        weights = {k: v.tolist() for k, v in model.state_dict().items()}  # no shared fds
        results.put(("done", replica_id, weights))
    finally:
        manager.shutdown(wait=False)


def run(steps: int = 6, kill_at: int = 2, *, verbose: bool = True) -> dict[str, Any]:
    """Run the job; return each replica's steps and final weights."""
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    say = print if verbose else (lambda *_: None)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=10,
        heartbeat_timeout_ms=1000,
    )
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()

    def start(rid: int, kill: int | None) -> Any:
        p = ctx.Process(
            target=replica,
            args=(rid, stores[rid].port, lighthouse.address(), steps, kill, results),
            name=f"replica{rid}",
        )
        p.start()
        return p

    procs = [start(0, None), start(1, kill_at)]
    report: dict[str, Any] = {"steps": {0: [], 1: []}, "weights": {}, "restarts": 0}
    deadline = time.monotonic() + 120
    try:
        while len(report["weights"]) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("the job did not finish within 120 s")
            try:
                msg = results.get(timeout=0.1)
            except queue.Empty:
                for rid, p in enumerate(procs):
                    if p.exitcode is None or rid in report["weights"]:
                        continue
                    if p.exitcode == -signal.SIGKILL and report["restarts"] == 0:
                        say(f"replica{rid} was killed (SIGKILL): restarting it")
                        report["restarts"] += 1
                        procs[rid] = start(rid, None)
                    else:
                        raise RuntimeError(f"replica{rid} exited with {p.exitcode}") from None
                continue
            if msg[0] == "step":
                _, rid, step, committed, error = msg
                report["steps"][rid].append((step, committed, error))
                if committed or error:
                    state = "committed" if committed else f"not committed: {error}"
                    say(f"replica{rid} step {step}: {state}")
                # else: no quorum of two yet (the other replica is starting)
            else:
                report["weights"][msg[1]] = msg[2]
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        lighthouse.shutdown()
    return report


def check(report: dict[str, Any]) -> list[str]:
    """What went wrong, in words (empty: the job did what it should)."""
    problems = []
    for rid, records in report["steps"].items():
        for step, committed, error in records:
            if error is not None and committed:
                problems.append(f"replica{rid} committed step {step}, which failed: {error}")
    if not any(error for _, _, error in report["steps"][0]):
        problems.append("replica 0 never saw its peer die")
    w0, w1 = report["weights"][0], report["weights"][1]
    for name in w0:
        if w0[name] != w1[name]:
            problems.append(f"the replicas' {name} differ")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-at", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="end with the report as JSON")
    args = parser.parse_args()
    report = run(args.steps, args.kill_at)
    problems = check(report)
    if args.json:
        print(
            json.dumps(
                {"steps": report["steps"], "restarts": report["restarts"], "problems": problems}
            )
        )
    for p in problems:
        print("PROBLEM:", p)
    if not problems:
        print("ok: no failed step was committed, and both replicas hold the same weights")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
