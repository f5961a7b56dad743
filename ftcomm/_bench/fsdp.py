"""The FSDP2 rows: a training step of a small model sharded with FSDP2 over
two ranks, on a DeviceMesh of torch's own Gloo group and on one of ftcomm's
facade group (``ProcessGroupGloo``, registered), the two taking turns in one
run; the figure is a step's time on rank 0 (p50, p90) and its ratio to
torch's.

Owns: the step (:func:`_step`), the two ranks' processes (spawned, each with
a default group, as in a torchrun job) and the rows' table
(:func:`format_fsdp`) and JSON (:func:`fsdp_json`).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .report import percentile
from .runner import HOST, spawn_ranks

WORLD = 2
LAYERS = 4
WIDTH = 512
BATCH = 32
IMPLS = ("torch", "ftcomm")
"""torch's own Gloo group (the baseline), then ftcomm's facade group."""
_WARMUP = 3
"""Steps of each model before its timed ones (lazy init, first all-gathers)."""


class FsdpFailed(Exception):
    """A rank failed, or did not answer in time."""


@dataclass
class Rows:
    """Each implementation's step times (seconds, rank 0's)."""

    steps: int
    rounds: int
    times: dict[str, list[float]]

    def ratio(self) -> float:
        return percentile(self.times["ftcomm"], 50) / percentile(self.times["torch"], 50)


def _model(mesh: Any) -> Any:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]
    model = torch.nn.Sequential(*layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model: Any, optimizer: Any, batch: Any) -> None:
    """One step: forward, backward (FSDP2's reduce-scatters), the update."""
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _rank(rank: int, port: int, steps: int, rounds: int, conn: Connection) -> None:
    try:
        import torch
        import torch.distributed as dist
        from torch._C._distributed_c10d import PrefixStore, TCPStore
        from torch.distributed.device_mesh import DeviceMesh

        from ..c10d import ProcessGroupGloo

        torch.set_num_threads(1)  # two ranks on what may be two cores
        store = TCPStore(HOST, port, is_master=False, wait_for_workers=False)
        dist.init_process_group(
            "gloo", store=PrefixStore("default", store), rank=rank, world_size=WORLD
        )
        groups = {"torch": dist.new_group(backend="gloo")}
        facade = ProcessGroupGloo(timeout=60)
        facade.configure(f"{HOST}:{port}/fsdp-ftcomm", "0", rank, WORLD)
        facade.register("bench-fsdp")
        groups["ftcomm"] = facade
        models = {impl: _model(DeviceMesh.from_group(groups[impl], "cpu")) for impl in IMPLS}
        optimizers = {impl: torch.optim.SGD(models[impl].parameters(), lr=1e-3) for impl in IMPLS}
        batch = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
        for impl in IMPLS:
            for _ in range(_WARMUP):
                _step(models[impl], optimizers[impl], batch)
        times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        for _ in range(rounds):  # the two take turns: the machine's swings hit both
            for impl in IMPLS:
                for _ in range(steps):
                    started = time.perf_counter()
                    _step(models[impl], optimizers[impl], batch)
                    times[impl].append(time.perf_counter() - started)
        conn.send(("times", times))
        facade.unregister()
        facade.shutdown()
        dist.destroy_process_group()
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise


def measure(steps: int, rounds: int, timeout: float = 300.0) -> Rows:
    """Run both ranks; rank 0's step times, each implementation's.

    Raises:
        FsdpFailed: a rank raised (its traceback in the message), exited
            without an answer, or none came within ``timeout`` seconds.
    """
    from .._server import serve_store

    server = serve_store(HOST)  # loopback only
    try:
        args = [(rank, server.port, steps, rounds) for rank in range(WORLD)]
        answers = spawn_ranks(_rank, args, timeout, FsdpFailed)
    finally:
        server.close()
    return Rows(steps, rounds, answers[0])


def format_fsdp(rows: Rows) -> str:
    lines = [
        f"fsdp2 step ({WORLD} ranks, {LAYERS} x Linear({WIDTH}), batch {BATCH}, CPU Gloo; "
        "a DeviceMesh of each group, taking turns):",
        f"{'what':<24}{'p50_ms':>9}{'p90_ms':>9}{'ratio':>10}",
    ]
    for impl, label in zip(IMPLS, ("torch's gloo group", "ftcomm ProcessGroupGloo"), strict=True):
        p50, p90 = (percentile(rows.times[impl], q) * 1e3 for q in (50, 90))
        ratio = "" if impl == "torch" else f"{rows.ratio():9.2f}x"
        lines.append(f"{label:<24}{p50:9.1f}{p90:9.1f}{ratio:>10}")
    lines.append(
        f"({rows.rounds} rounds of {rows.steps} steps each, rank 0's times; ratio: ftcomm's "
        "p50 over torch's)"
    )
    return "\n".join(lines)


def fsdp_json(rows: Rows) -> dict[str, Any]:
    return {
        "world_size": WORLD,
        "model": f"{LAYERS} x Linear({WIDTH})",
        "batch": BATCH,
        "steps_per_round": rows.steps,
        "rounds": rows.rounds,
        "rows": [
            {
                "impl": impl,
                "p50_ms": percentile(rows.times[impl], 50) * 1e3,
                "p90_ms": percentile(rows.times[impl], 90) * 1e3,
            }
            for impl in IMPLS
        ],
        "ratio_p50": rows.ratio(),
    }
