"""The in-process cases: raw c10d Gloo (the baseline every ratio is
against), ftcomm's Group (plain, with ``stats=False``, with ``verify=True``)
and ftcomm's c10d facade, each issuing ops on the caller's thread.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore

from .groups import _c10d_runner, _group_runner, _Views
from .runner import _OP_TIMEOUT, HOST, WORLD_SIZE, BlockingRunner, ChildEnv, Runner


async def _open_raw(env: ChildEnv) -> Runner:
    pg_gloo: Any = dist.ProcessGroupGloo
    opts = pg_gloo._Options()
    opts._timeout = timedelta(seconds=_OP_TIMEOUT)
    opts._devices = [pg_gloo.create_device(hostname=HOST)]
    pg: Any = pg_gloo(PrefixStore("raw", env.store), env.rank, WORLD_SIZE, opts)
    # The burst row on a group of its own, for every case: 1000 ops at once
    # warm a Gloo group up (measured: an ftcomm group's single-op p50 went
    # from ~200 µs to 130-180 µs after unfused bursts), and the single-op row
    # must not depend on which case's bursts ran on its group.
    burst_pg: Any = pg_gloo(PrefixStore("raw-burst", env.store), env.rank, WORLD_SIZE, opts)

    def allreduce(t: torch.Tensor) -> None:
        pg.allreduce([t]).wait()

    views = _Views()

    def allreduce_burst(t: torch.Tensor) -> None:
        for view in views.of(t):  # one after another: what raw c10d can do
            burst_pg.allreduce([view]).wait()

    return BlockingRunner("raw", {"allreduce": allreduce, "allreduce_burst": allreduce_burst})


async def _open_ftcomm(env: ChildEnv) -> Runner:
    return await _group_runner(env, "ftcomm", "ftcomm-bench", burst=True)


async def _open_stats_off(env: ChildEnv) -> Runner:
    return await _group_runner(env, "stats-off", "stats-off-bench", stats=False)


async def _open_verified(env: ChildEnv) -> Runner:
    """``verify=True``: a descriptor allgather before every op."""
    return await _group_runner(env, "verify", "verify-bench", verify=True)


async def _open_facade(env: ChildEnv) -> Runner:
    from ..c10d import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=timedelta(seconds=_OP_TIMEOUT))
    return _c10d_runner(env, "facade", "facade-bench", pg)
