"""The runners that several families of cases build on: an ftcomm
:class:`~ftcomm.Group` awaited op by op (and its burst row), a c10d-style group
blocking op by op, and the burst row's one-element views.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from .runner import _OP_TIMEOUT, WORLD_SIZE, AwaitingRunner, BlockingRunner, ChildEnv, Runner


class _Views:
    """The burst row's one-element tensors: views of the case's tensor, made
    once (a user's 1000 small tensors exist before they are reduced; making
    1000 views costs 0.5 ms, which raw and ftcomm alike are not timed for)."""

    def __init__(self) -> None:
        self._of: tuple[torch.Tensor, Sequence[torch.Tensor]] | None = None

    def of(self, t: torch.Tensor) -> Sequence[torch.Tensor]:
        if self._of is None or self._of[0] is not t:
            self._of = (t, t.split(1))  # type: ignore[no-untyped-call]
        return self._of[1]


async def _group_runner(
    env: ChildEnv,
    impl: str,
    prefix: str,
    burst: bool = False,
    single: bool = True,
    gather: Callable[..., Awaitable[object]] = asyncio.gather,
    **kwargs: Any,
) -> Runner:
    """An ftcomm.Group on Gloo (``kwargs``: its options), awaited op by op
    (``single``); ``burst``: it also runs the burst row, awaiting the ops
    with ``gather``."""
    import ftcomm

    groups: list[ftcomm.Group] = []

    async def new_group(name: str) -> ftcomm.Group:
        group = ftcomm.Group("gloo", timeout=_OP_TIMEOUT, **kwargs)
        groups.append(group)
        await group.configure(env.store_addr(name), env.rank, WORLD_SIZE)
        return group

    async def close() -> None:
        errors: list[BaseException] = []
        for group in groups:
            try:
                await group.shutdown()
            except Exception as exc:  # the others are shut down all the same
                errors.append(exc)
        if errors:
            raise errors[0]

    ops: dict[str, Callable[[torch.Tensor], Awaitable[object]]] = {}
    try:
        if single:
            ops["allreduce"] = (await new_group(prefix)).allreduce
        if burst:
            burst_group = await new_group(f"{prefix}-burst")  # its own: see latency._open_raw
            views = _Views()

            async def allreduce_burst(t: torch.Tensor) -> None:
                # every op issued before any is awaited (fused with fuse=True)
                await gather(*[burst_group.allreduce(view) for view in views.of(t)])

            ops["allreduce_burst"] = allreduce_burst
    except BaseException:
        await close()  # a group made before the one that failed
        raise
    return AwaitingRunner(impl, ops, close)


def _c10d_runner(
    env: ChildEnv,
    impl: str,
    prefix: str,
    pg: Any,
    close: Callable[[], object] | None = None,
) -> Runner:
    """A c10d-style group (ftcomm's facade, or torchft's), blocking op by op;
    ``close`` ends it (default: its ``shutdown``)."""
    from torch.distributed import AllreduceOptions

    pg.configure(env.store_addr(prefix), "0", env.rank, WORLD_SIZE)

    def allreduce(t: torch.Tensor) -> None:
        pg.allreduce([t], AllreduceOptions()).wait()  # what torch.distributed.all_reduce does

    return BlockingRunner(impl, {"allreduce": allreduce}, close or getattr(pg, "shutdown", None))
