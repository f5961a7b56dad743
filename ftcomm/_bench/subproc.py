"""The cases whose collectives run in a worker process: ftcomm's
subprocess backend (subproc), the same moving large storages into shared
memory (sub+move), and the c10d facade's ProcessGroupBabyGloo (baby).
"""

from __future__ import annotations

from datetime import timedelta

from .groups import _c10d_runner, _group_runner
from .runner import _OP_TIMEOUT, ChildEnv, Runner


async def _open_subprocess(env: ChildEnv) -> Runner:
    return await _group_runner(
        env, "subproc", "subprocess-bench", subprocess=True, spare_worker=False
    )


async def _open_subprocess_moved(env: ChildEnv) -> Runner:
    """The subprocess backend opted in to moving large storages into shared
    memory (after a tensor's first op, it is reduced in place)."""
    return await _group_runner(
        env,
        "sub+move",
        "subprocess-move-bench",
        subprocess=True,
        spare_worker=False,
        share_min_bytes=1 << 20,
    )


async def _open_baby(env: ChildEnv) -> Runner:
    from ..c10d import ProcessGroupBabyGloo

    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=_OP_TIMEOUT))
    return _c10d_runner(env, "baby", "baby-bench", pg)
