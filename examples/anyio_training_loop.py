"""An async training loop on anyio: collectives at once, a deadline scope, recovery.

Each step issues one allreduce per parameter from an anyio task group and
an allgather of the loss, all at once, under one deadline
(``anyio.fail_after``). ``group.allreduce(t)`` issues the op when it is
called (``tg.start_soon`` calls it at once), so the ops go on the wire in
the same order on every rank, however the tasks are scheduled.

At step ``--hang-at``, rank 1 stalls (as a hung peer would) and issues
nothing. Rank 0's deadline scope cancels its tasks; cancelling a task
awaiting an op aborts the group, and ``fail_after`` raises ``TimeoutError``.
Both ranks then configure again under a fresh prefix and go on. At the
end each rank prints its ``group.stats()``::

    python examples/anyio_training_loop.py [--steps 6] [--hang-at 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import sys
from multiprocessing.queues import Queue

import anyio
import torch

import ftcomm

PARAMS = [(64, 32), (32,), (32, 8), (8,)]  # a small model's parameter shapes
STEP_DEADLINE = 1.5  # seconds: a whole step's collectives


def comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a deadline or a communication failure (or a task
    group's group of them)."""
    if isinstance(exc, (TimeoutError, ftcomm.CommError)):
        return True
    inner = getattr(exc, "exceptions", None)  # an ExceptionGroup
    return inner is not None and all(comm_failure(e) for e in inner)


async def train(
    store: str, rank: int, world_size: int, steps: int, hang_at: int
) -> dict[str, object]:
    params = [torch.full(shape, 1.0) for shape in PARAMS]
    epoch = 0
    recovered_at = []
    async with ftcomm.Group("gloo", timeout=10) as group:
        await group.configure(f"{store}/anyio/q{epoch}", rank, world_size)
        for step in range(steps):
            if rank == 1 and step == hang_at:
                await anyio.sleep(STEP_DEADLINE + 0.5)  # hung: rank 0's deadline passes
            grads = [torch.full_like(p, float(rank + 1)) for p in params]
            loss = torch.tensor([float(step + rank)])
            try:
                with anyio.fail_after(STEP_DEADLINE):
                    async with anyio.create_task_group() as tg:
                        for grad in grads:
                            tg.start_soon(group.allreduce, grad)  # issued here, in order
                        losses = group.allgather(loss)  # a Work, issued now: awaited below
                    mean_loss = sum(t.item() for t in await losses) / world_size
            except Exception as exc:
                if not comm_failure(exc):
                    raise
                # The group is aborted. Meet again under a fresh prefix; a
                # real trainer would also agree on who is still there.
                print(
                    f"rank {rank}: step {step} failed ({type(exc).__name__}); reconfiguring",
                    file=sys.stderr,
                )
                epoch += 1
                await group.configure(f"{store}/anyio/q{epoch}", rank, world_size)
                recovered_at.append(step)
                continue
            for p, g in zip(params, grads, strict=True):
                p -= 0.01 * g / world_size
            assert mean_loss == step + 0.5  # (step + 0 + step + 1) / 2
        print(f"rank {rank}:\n{group.stats()}", file=sys.stderr)
        return {
            "rank": rank,
            "recovered_at": recovered_at,
            "weights": [p.sum().item() for p in params],
            "stats": group.stats().as_dict(),
        }


def rank_main(store: str, rank: int, args: argparse.Namespace, reports: Queue[str]) -> None:
    report = anyio.run(train, store, rank, 2, args.steps, args.hang_at)
    reports.put(json.dumps(report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hang-at", type=int, default=3, help="the step rank 1 stalls at")
    parser.add_argument("--json", action="store_true", help="one JSON line per rank")
    args = parser.parse_args()
    spawn = multiprocessing.get_context("spawn")
    reports: Queue[str] = spawn.Queue()
    with ftcomm.serve_store() as server:
        ranks = [
            spawn.Process(target=rank_main, args=(server.address, r, args, reports))
            for r in range(2)
        ]
        for p in ranks:
            p.start()
        lines: list[str] = []  # one report per rank, unless one died
        while len(lines) < len(ranks):
            try:
                lines.append(reports.get(timeout=0.5))
            except queue.Empty:
                if not any(p.is_alive() for p in ranks) and reports.empty():
                    break
        for p in ranks:
            p.join()
    if args.json:
        for line in sorted(lines):
            print(line)
    return 0 if all(p.exitcode == 0 for p in ranks) else 1


if __name__ == "__main__":
    sys.exit(main())
