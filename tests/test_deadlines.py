"""The one deadline rule, against a real hung peer.

Rank 1 of a 2-rank world never enters the op. Every way a deadline can reach
rank 0 (per-op ``timeout=``, the group default, ``set_timeout``,
``asyncio.timeout``, anyio's scopes, ``task.cancel()``, ``Work.cancel()``)
must end the op by the deadline, mark the group errored, refuse the next op
at once, and leave the group usable after ``configure`` on a fresh prefix.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch

import ftcomm
from ftcomm.testing import LOOPS, RankContext, run_world

DEADLINE = 0.5


async def _per_op(g: ftcomm.Group) -> None:
    await g.allreduce(torch.ones(1), timeout=DEADLINE)


async def _group_default(g: ftcomm.Group) -> None:
    g.set_timeout(DEADLINE)  # takes effect on the next op
    await g.allreduce(torch.ones(1))


async def _asyncio_timeout(g: ftcomm.Group) -> None:
    await asyncio.wait_for(_wait(g.allreduce(torch.ones(1))), DEADLINE)


async def _wait(work: Awaitable[Any]) -> Any:
    return await work


async def _anyio_fail_after(g: ftcomm.Group) -> None:
    with anyio.fail_after(DEADLINE):
        await g.allreduce(torch.ones(1))


async def _anyio_move_on_after(g: ftcomm.Group) -> None:
    with anyio.move_on_after(DEADLINE) as scope:
        await g.allreduce(torch.ones(1))
    assert scope.cancelled_caught
    raise LookupError("moved on")  # recorded as the outcome below


async def _task_cancel(g: ftcomm.Group) -> None:
    task = asyncio.ensure_future(_wait(g.allreduce(torch.ones(1))))
    asyncio.get_running_loop().call_later(DEADLINE, task.cancel)
    await task


async def _work_cancel(g: ftcomm.Group) -> None:
    work = g.allreduce(torch.ones(1))
    asyncio.get_running_loop().call_later(DEADLINE, work.cancel)
    await work


VARIANTS: dict[str, Callable[[ftcomm.Group], Awaitable[None]]] = {
    "per_op": _per_op,
    "group_default": _group_default,
    "asyncio_timeout": _asyncio_timeout,
    "anyio_fail_after": _anyio_fail_after,
    "anyio_move_on_after": _anyio_move_on_after,
    "task_cancel": _task_cancel,
    "work_cancel": _work_cancel,
}


async def hung_peer(ctx: RankContext) -> dict[str, dict[str, Any]]:
    report: dict[str, dict[str, Any]] = {}
    # anyio loads its asyncio backend on first use (20 ms on an idle box,
    # over a second on a busy one) and only then starts a scope's deadline:
    # load it before any clock below starts.
    anyio.current_time()
    g = ftcomm.Group("gloo", timeout=30)
    for i, (name, variant) in enumerate(VARIANTS.items()):
        await g.configure(ctx.addr(f"v{i}"), ctx.rank, 2)
        await g.allreduce(torch.ones(1))  # both ranks connected and healthy
        if ctx.rank == 1:
            await ctx.wait_for(f"v{i}-done")  # never enters rank 0's op
            continue
        started = time.monotonic()
        try:
            await variant(g)
        except BaseException as exc:
            outcome: BaseException = exc
        else:
            raise AssertionError(f"{name}: the op against a hung peer returned")
        elapsed = time.monotonic() - started
        errored = g.errored()
        next_started = time.monotonic()
        try:
            g.allreduce(torch.ones(1))
        except ftcomm.CommError as exc:
            next_error: BaseException = exc
        next_elapsed = time.monotonic() - next_started
        g.set_timeout(30)
        report[name] = {
            "outcome": type(outcome).__name__,
            "is_timeout_error": isinstance(outcome, TimeoutError),
            "elapsed": elapsed,
            "errored": type(errored).__name__,
            "next": type(next_error).__name__,
            "next_elapsed": next_elapsed,
        }
        ctx.signal(f"v{i}-done")
    # After all that, a fresh configuration works on both ranks.
    await g.configure(ctx.addr("final"), ctx.rank, 2)
    t = await g.allreduce(torch.full((3,), float(ctx.rank + 1)))
    assert t.tolist() == [3.0, 3.0, 3.0]
    assert g.errored() is None
    await g.shutdown()
    return report


EXPECTED = {
    # variant: (what the caller sees, what errored() reports)
    "per_op": ("CommTimeout", "CommTimeout"),
    "group_default": ("CommTimeout", "CommTimeout"),
    "asyncio_timeout": ("TimeoutError", "CommAborted"),
    "anyio_fail_after": ("TimeoutError", "CommAborted"),
    "anyio_move_on_after": ("LookupError", "CommAborted"),
    "task_cancel": ("CancelledError", "CommAborted"),
    "work_cancel": ("CommAborted", "CommAborted"),
}


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
def test_hung_peer_every_deadline_kind(loop: str) -> None:
    report = run_world(hung_peer, 2, loop=loop, timeout=90)[0]
    assert set(report) == set(EXPECTED)
    for name, (outcome, errored) in EXPECTED.items():
        r = report[name]
        assert (r["outcome"], r["errored"]) == (outcome, errored), (name, r)
        # Ended by the deadline (generous bound), and not before it.
        assert DEADLINE - 0.01 <= r["elapsed"] < DEADLINE + 1.0, (name, r)
        # The next op is refused at once (on 2 busy cores, "at once" can be
        # a few tenths of a second).
        assert r["next"] == "CommAborted", (name, r)
        assert r["next_elapsed"] < 0.5, (name, r)
    assert report["per_op"]["is_timeout_error"]
    assert report["group_default"]["is_timeout_error"]
