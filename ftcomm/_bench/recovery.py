"""The recovery part, at world size 1 in the parent process: the time
from configure to the end of the first op (in-process, with a new worker,
with a spare worker, torchft's baby) and from a worker's SIGKILL to its
group's WorkerDied; and its table.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._runtime.loop import get_runtime
from ..group import config_of, configurer_of
from .report import percentile
from .runner import _OP_TIMEOUT, HOST, Seconds
from .torchft_rows import close_torchft_baby


async def _first_op(group: Any, addr: str) -> float:
    """Seconds from ``configure`` to the end of the first allreduce."""
    started = time.perf_counter()
    await group.configure(addr, 0, 1)
    await group.allreduce(torch.ones(1))
    return time.perf_counter() - started


async def _spare_ready(group: Any, timeout: float = 30.0) -> None:
    """Wait until the group's spare worker has said READY (it imports torch first)."""
    import select

    await asyncio.to_thread(get_runtime().control.wait_idle, timeout)
    launcher = configurer_of(group).launcher
    fd = launcher.spare_fd if launcher is not None else None
    if fd is not None:
        await asyncio.to_thread(select.select, [fd], [], [], timeout)


class _KilledOnPurpose(logging.Filter):
    """Drops ftcomm's log records of the aborts the bench causes itself (a
    worker it kills, by the store address of that group); every other record
    passes, so an abort nobody caused is still printed."""

    def __init__(self) -> None:
        super().__init__()
        self.stores: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "ftcomm_store", None) not in self.stores


_KILLED_ON_PURPOSE = _KilledOnPurpose()


async def _recovery(port: int, samples: int, torchft: bool) -> dict[str, Seconds]:
    import ftcomm

    out: dict[str, Seconds] = {}
    n = iter(range(1 << 30))
    # Kept for the rest of the process: a record may be logged after the kill is seen.
    logging.getLogger("ftcomm").addFilter(_KILLED_ON_PURPOSE)

    def addr() -> str:
        return f"{HOST}:{port}/recovery-{next(n)}"

    for _ in range(samples):
        async with ftcomm.Group("gloo", timeout=_OP_TIMEOUT) as g:
            out.setdefault("in-process gloo", []).append(await _first_op(g, addr()))
        async with ftcomm.Group(
            "gloo", subprocess=True, spare_worker=False, timeout=_OP_TIMEOUT
        ) as g:
            out.setdefault("subproc, new worker", []).append(await _first_op(g, addr()))
    async with ftcomm.Group("gloo", subprocess=True, timeout=_OP_TIMEOUT) as g:
        await g.configure(addr(), 0, 1)
        for _ in range(samples):
            await _spare_ready(g)
            out.setdefault("subproc, spare worker", []).append(await _first_op(g, addr()))
        for _ in range(samples):
            await _spare_ready(g)
            victim = addr()
            _KILLED_ON_PURPOSE.stores.add(victim)
            await _first_op(g, victim)
            cfg: Any = config_of(g)
            worker = cfg.backend.worker
            killed = time.perf_counter()
            os.kill(worker.pid, 9)
            await asyncio.wrap_future(worker.exited)
            out.setdefault("dead worker noticed", []).append(time.perf_counter() - killed)
            if not isinstance(g.errored(), ftcomm.WorkerDied):
                raise RuntimeError(f"a killed worker gave {g.errored()!r}, not WorkerDied")
    if torchft:
        pgs: Any = importlib.import_module("torchft.process_group")
        for _ in range(samples):
            pg = pgs.ProcessGroupBabyGloo(timeout=timedelta(seconds=_OP_TIMEOUT))
            started = time.perf_counter()
            pg.configure(addr(), "0", 0, 1)
            pg.allreduce([torch.ones(1)], dist.AllreduceOptions()).wait()
            out.setdefault("torchft baby", []).append(time.perf_counter() - started)
            close_torchft_baby(pg)
    return out


def format_recovery(times: Mapping[str, Seconds]) -> str:
    lines = [
        "recovery (world size 1, this process):",
        f"{'what':<28} {'p50_ms':>9} {'max_ms':>9}",
    ]
    for what, values in times.items():
        lines.append(f"{what:<28} {percentile(values, 50) * 1e3:9.1f} {max(values) * 1e3:9.1f}")
    lines.append(
        "(configure: to the end of the first allreduce; 'dead worker noticed': from "
        "SIGKILL to the worker reaped and the group errored with WorkerDied)"
    )
    return "\n".join(lines)
