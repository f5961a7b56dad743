"""Teardown with an op in flight on a group whose own timeout is 30 s.

``configure`` again, ``abort()`` and ``shutdown()`` must return in under 2 s
(``configure``: plus its own connect), end the in-flight op with
``CommAborted``, be safe to call twice, and the rank's process must then
exit promptly and cleanly (it would take 30 s if anything waited for the
native op).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import ftcomm
from ftcomm.testing import LOOPS, RankContext, run_world


async def teardown_in_flight(ctx: RankContext, how: str) -> dict[str, Any]:
    g = ftcomm.Group("gloo", timeout=30)
    await g.configure(ctx.addr("a"), ctx.rank, 2)
    await g.allreduce(torch.ones(1))
    if ctx.rank == 1:
        await ctx.wait_for("torn-down")
        if how == "configure":
            await g.configure(ctx.addr("b"), 1, 2)
            await g.allreduce(torch.ones(1))
        await g.shutdown()
        return {}
    work = g.allreduce(torch.ones(1))  # rank 1 never joins: in flight for 30 s
    started = time.monotonic()
    if how == "configure":
        ctx.signal("torn-down")
        await g.configure(ctx.addr("b"), 0, 2)
    elif how == "abort":
        await g.abort()
        await g.abort()
    else:
        await g.shutdown()
        await g.shutdown()
    took = time.monotonic() - started
    try:
        await work
    except ftcomm.CommAborted as exc:
        work_error = type(exc).__name__
    if how == "configure":
        value = (await g.allreduce(torch.ones(1))).item()
    else:
        ctx.signal("torn-down")
        value = None
    errored = type(g.errored()).__name__
    await g.shutdown()
    await g.shutdown()
    return {
        "took": took,
        "work_error": work_error,
        "value": value,
        "errored": errored,
        "pid": os.getpid(),
    }


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("how", ["configure", "abort", "shutdown"])
def test_teardown_with_op_in_flight(how: str, loop: str) -> None:
    started = time.monotonic()
    result = run_world(teardown_in_flight, 2, loop=loop, args=(how,), timeout=60)[0]
    world_took = time.monotonic() - started
    # configure's time holds its own connect: rank 1 coming, and a store
    # connect that can wait 1 s on a reverse DNS lookup (tests/conftest.py)
    assert result["took"] < (4.0 if how == "configure" else 2.0), result
    assert result["work_error"] == "CommAborted"
    if how == "configure":
        assert result["value"] == 2.0
    # The world (spawn, run, exit) took far less than the 30 s native timeout:
    # nothing, at exit included, waited for the op that was in flight.
    assert world_took < 20.0


EXIT_SCRIPT = """
import asyncio, socket, ftcomm
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
async def main():
    g = ftcomm.Group("gloo")
    try:
        await g.configure(f"127.0.0.1:{port}/nobody", 0, 1, timeout=0.3)
    except ftcomm.CommTimeout:
        print("timed out")
asyncio.run(main())
"""


@pytest.mark.slow
def test_exit_while_a_store_connect_still_retries_is_clean() -> None:
    """The interpreter exits while c10d still retries the store connect.

    Before the exit grace, the retry returning into a finalizing interpreter
    aborted the process ("terminate called without an active exception") in
    about one run in three.
    """
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "timed out" in proc.stdout
