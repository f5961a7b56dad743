"""DDP under ``python -m ftcomm run``: a member is killed mid-training, the others train on,
and the launcher brings it back with the state.

    python -m ftcomm run --nproc 3 examples/ddp_launched.py

Each member is a process the launcher started: ``Membership.from_env()`` finds the engine, the
job and the member's id in its environment; the membership configures an ``ftcomm.Group``, and
torch's ``DistributedDataParallel`` runs over ``ProcessGroupGloo.of(group)``, a c10d view of it.

In its first life, m1 SIGKILLs itself at step ``KILL_STEP``. The survivors' ``backward()`` fails;
``with pg.raising()`` turns torch's untyped ``RuntimeError`` into the group's ``CommError``. They
``recover()`` into a world of two and train on. The launcher restarts m1 under its id (and
signals no one else); its ``join()`` is seen by the others' ``pending()``: all ``recover()`` into
a world of three, and ``sync_state()`` gives m1 the model, the optimizer's momentum and the step.

After every ``recover()`` each member builds a new ``DistributedDataParallel``. A reducer whose
backward failed keeps that step's state: measured here, torch 2.13's reused reducer averaged the
next step's gradients over the old world's size (three) in a world of two. A new one is cheap
for a model this size (its buckets are made again) and starts clean; its construction also
broadcasts rank 0's parameters, the same ones ``sync_state()`` just gave every member.

Every step checks DDP's averaged gradient against the whole batch's, computed locally: a step
averaged over a wrong world, or a gradient reduced twice, fails the check. Each member prints
one JSON line at the end; it exits 1 if a check failed.
"""

import asyncio
import json
import os
import signal
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import ftcomm
from ftcomm.c10d import ProcessGroupGloo

torch.set_num_threads(1)  # several members on a small machine
STEPS, KILL_STEP, N, LR, STEP_TIME, STEP_TIMEOUT = 40, 10, 48, 0.05, 0.05, 5.0


def out(line: str) -> None:
    """One write per line: the members share the launcher's stdout, and print() may write
    a line and its newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def say(who: str, text: str) -> None:
    out(f"[{who}] {text}")


async def main() -> int:
    members = ftcomm.Membership.from_env(join_window=10.0, heartbeat_timeout=0.5)
    me, life = members.member_id, int(os.environ.get("FTCOMM_RESTART_COUNT", "0"))
    full = members.max_size or 1
    torch.manual_seed(0)  # the same data and initial weights on all (a newcomer's are replaced)
    x = torch.randn(N, 8)
    y = x @ torch.linspace(-1.0, 1.0, 8)[:, None] + 0.3  # what the model is to learn
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    report: dict[str, object] = {"member": me, "life": life, "generations": [], "errors": []}
    wrong: list[int] = []  # steps whose averaged gradient was not the whole batch's
    async with members, ftcomm.Group("gloo", timeout=30) as group:
        pg = ProcessGroupGloo.of(group)

        async def settle(
            world: ftcomm.World, step: int
        ) -> tuple[ftcomm.World, int, DistributedDataParallel]:
            state, got = await members.sync_state(
                {"model": model.state_dict(), "opt": opt.state_dict()}, step
            )
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            report["generations"].append(world.generation)  # type: ignore[attr-defined]
            if world.rank == 0:
                say(me, f"generation {world.generation} at step {got}: {' '.join(world.members)}")
            return world, got, DistributedDataParallel(model, process_group=pg)  # a clean reducer

        world, step, ddp = await settle(await members.join(group), 0)
        while step < STEPS or world.size < full:
            if me == "m1" and life == 0 and step >= KILL_STEP:
                say(me, f"step {step}: sending myself SIGKILL")
                signal.raise_signal(signal.SIGKILL)
            await asyncio.sleep(STEP_TIME)  # a step's compute (it leaves the CPUs to a newcomer)
            shard = slice(world.rank * N // world.size, (world.rank + 1) * N // world.size)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x[shard]), y[shard])
            issued = time.monotonic()
            try:
                with pg.raising():  # torch's RuntimeError -> the group's CommError
                    loss.backward()
            except ftcomm.CommError as exc:  # a member died or hangs: go on without it
                report["errors"].append(type(exc).__name__)  # type: ignore[attr-defined]
                say(
                    me,
                    f"step {step}: backward raised {type(exc).__name__} after "
                    f"{time.monotonic() - issued:.2f} s; recover()",
                )
                world, step, ddp = await settle(await members.recover(group), step)
                continue
            whole = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), model.weight)[0]
            if not torch.allclose(model.weight.grad, whole, atol=1e-5):
                wrong.append(step)
            opt.step()
            step += 1
            if await members.pending():  # a newcomer waits, or a member died: the same on all
                world, step, ddp = await settle(await members.recover(group), step)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    report.update(steps=step, size=world.size, wrong_steps=wrong, params=params.tolist())
    out(json.dumps(report))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
