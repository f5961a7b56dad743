"""ftcomm under ``torchrun``: an async loop, then torch's DDP through the facade.

torchrun starts the ranks, hosts the store in its agent and sets
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``; ``configure("env://...")``
reads them, so nothing here names an address::

    torchrun --standalone --nproc-per-node 2 examples/torchrun_training.py

Across machines, the same script with torchrun's multi-node flags
(``--nnodes 2 --rdzv-endpoint HOST:PORT ...``; docs/running.md).

Part 1 awaits collectives with deadlines on an ``ftcomm.Group``. Part 2
swaps ftcomm's process group into ``DistributedDataParallel``, unchanged
otherwise. Each rank prints one JSON line of what it saw (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import timedelta

import torch
from torch.nn.parallel import DistributedDataParallel

import ftcomm
from ftcomm.c10d import ProcessGroupGloo


async def async_part() -> dict[str, object]:
    """A few steps of an async loop: every op awaited with a deadline."""
    async with ftcomm.Group("gloo", timeout=10) as group:
        await group.configure("env://example/async")  # rank, world size: from torchrun
        sums = []
        for step in range(3):
            grad = torch.full((8,), float(group.rank + step))
            await group.allreduce(grad, timeout=5.0)
            sums.append(grad[0].item())
        return {"rank": group.rank, "world_size": group.size(), "allreduce": sums}


def ddp_part(rank: int, world_size: int) -> list[float]:
    """DDP over ftcomm's c10d group: three steps of SGD; the final weights."""
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    pg.configure("env://example/ddp", f"replica-{rank}", rank, world_size)
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = DistributedDataParallel(torch.nn.Linear(4, 1), process_group=pg)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.full((2, 4), float(rank + 1))  # each rank its own data
        for _ in range(3):
            opt.zero_grad()
            model(data).sum().backward()  # gradients averaged across ranks
            opt.step()
        return [round(p, 6) for p in model.module.weight.flatten().tolist()]
    finally:
        pg.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON line per rank")
    args = parser.parse_args()
    seen = asyncio.run(async_part())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seen["ddp_weights"] = ddp_part(rank, world_size)
    if args.json:
        # One write: the ranks share torchrun's stdout, and a line written in
        # one call (under 4 KiB) is never interleaved with another rank's.
        os.write(sys.stdout.fileno(), (json.dumps(seen) + "\n").encode())
    else:
        print(f"rank {rank}: allreduce sums {seen['allreduce']}, weights {seen['ddp_weights']}")


if __name__ == "__main__":
    main()
