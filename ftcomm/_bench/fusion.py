"""The fused cases: ``Group(fuse=True)``, whose concurrent small
allreduces are sent as one op, its burst awaited with ``asyncio.gather``
(fused) or with ``ftcomm.gather``, no task per op (fused+fg, burst row only).
"""

from __future__ import annotations

from .groups import _group_runner
from .runner import ChildEnv, Runner


async def _open_fused(env: ChildEnv) -> Runner:
    """``fuse=True``: concurrent small allreduces sent as one op."""
    return await _group_runner(env, "fused", "fused-bench", burst=True, fuse=True)


async def _open_fused_gather(env: ChildEnv) -> Runner:
    """``fuse=True``, the burst awaited with ``ftcomm.gather`` (no task per
    op); its single ops are the fused row's."""
    import ftcomm

    return await _group_runner(
        env, "fused+fg", "fused-fg-bench", burst=True, single=False, gather=ftcomm.gather, fuse=True
    )
