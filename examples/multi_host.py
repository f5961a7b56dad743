"""Ranks on several machines, meeting in one store: the recipe.

On one machine (it may run a rank too), host the store where the others
can reach it. It has no authentication: only on a private network::

    python -m ftcomm store --host 10.0.0.1 --port 29500

On every machine, one process per rank::

    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=2 python examples/multi_host.py
    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 RANK=1 WORLD_SIZE=2 python examples/multi_host.py

Gloo listens on the address this machine's host name resolves to (torch's
default; ``GLOO_SOCKET_IFNAME=eth0`` picks an interface), or on
``FTCOMM_GLOO_HOST`` if set. On one machine, the loopback addresses
127.0.0.2 and 127.0.0.3 stand in for two hosts (tests/test_store_server.py
runs it so)::

    python -m ftcomm store --host 127.0.0.2 --port 29500 &
    FTCOMM_GLOO_HOST=127.0.0.2 MASTER_ADDR=127.0.0.2 MASTER_PORT=29500 RANK=0 \\
        WORLD_SIZE=2 python examples/multi_host.py &
    FTCOMM_GLOO_HOST=127.0.0.3 MASTER_ADDR=127.0.0.2 MASTER_PORT=29500 RANK=1 \\
        WORLD_SIZE=2 python examples/multi_host.py

A store outside the ranks outlives any of them: after a failure the
survivors configure again in it under a fresh prefix
(examples/recover_from_dead_rank.py shows the whole recovery).
"""

from __future__ import annotations

import argparse
import asyncio
import json

import torch

import ftcomm


async def main(prefix: str, steps: int) -> dict[str, object]:
    async with ftcomm.Group("gloo", timeout=30) as group:
        await group.configure(f"env://{prefix}")  # the store, rank, world size: from env
        total = torch.zeros(1)
        for step in range(steps):
            grad = torch.full((1024,), float(group.rank + step))
            await group.allreduce(grad, timeout=10.0)
            total += grad[0]
        return {"rank": group.rank, "world_size": group.size(), "total": total.item()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", default="multi-host/q0", help="store prefix (fresh per run)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.prefix, args.steps))), flush=True)
