"""Recover from a dead rank: three ranks train, one is SIGKILLed, two carry on.

The parent process plays the supervisor (what an elastic agent or a lighthouse
does in a real job): it hosts the TCPStore, spawns three ranks, SIGKILLs rank 2
when it reaches ``KILL_STEP``, and tells the survivors the new membership (store
prefix, new rank, world size) over a per-rank pipe.

Each rank trains ``Linear(4, 1)`` with data-parallel SGD on its own shard of a
synthetic regression set: after ``backward()`` it sums ``[grads..., loss]``
across ranks with one ``allreduce`` that has a ``STEP_TIMEOUT`` deadline, divides
by the world size and steps. When rank 2 dies, the survivors' allreduce raises a
typed ftcomm error within the deadline; they wait for the new membership,
configure a fresh group on a new store prefix, take the model state (parameters
and step) from the new rank 0 and redo the failed step.

Run ``python examples/recover_from_dead_rank.py``; it exits 0 only if the run
recovered (rank 2 died by SIGKILL, ranks 0 and 1 finished with the same
parameters and a lower loss).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import re
import signal
import sys
import time
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Literal, TypedDict

import torch
from torch._C._distributed_c10d import TCPStore  # torch.distributed.TCPStore, typed
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import ftcomm

WORLD = 3
VICTIM = 2
STEPS = 30
KILL_STEP = 10
STEP_TIMEOUT = 2.0  # deadline of every collective, seconds
ERROR_BOUND = STEP_TIMEOUT + 1.0  # the failed step must end within this
CONFIGURE_TIMEOUT = 30.0  # the first configure waits for three cold interpreters
MEMBERSHIP_TIMEOUT = 20.0  # how long a survivor waits for the supervisor's verdict
DEMO_TIMEOUT = 55.0  # the parent kills everything after this
LR = 0.1
SAMPLES_PER_RANK = 64
SEED = 0


class VictimReady(TypedDict):
    kind: Literal["victim-ready"]
    rank: int
    step: int


class StepFailed(TypedDict):
    kind: Literal["failed"]
    rank: int
    step: int
    error: str
    latency: float


class Finished(TypedDict):
    kind: Literal["done"]
    rank: int
    new_rank: int
    world: int
    steps: int
    first_loss: float
    final_loss: float
    params: list[float]


Report = VictimReady | StepFailed | Finished


class Membership(TypedDict):
    epoch: int
    rank: int
    world: int


def brief(exc: ftcomm.CommError) -> str:
    """The gist of an ftcomm error: the backend's first sentence, else ftcomm's message."""
    if exc.__cause__ is None:
        return exc.message
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc.__cause__))  # drop Gloo's [file.cc:line]
    return text.split(". ")[0]


def say(t0: float, who: str, text: str) -> None:
    # One write per line, so lines from the four processes do not interleave.
    sys.stdout.write(f"{time.monotonic() - t0:6.2f}s [{who}] {text}\n")
    sys.stdout.flush()


# -- ranks ---------------------------------------------------------------------
def make_shard(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of one fixed dataset: y = x @ w + b + noise."""
    gen = torch.Generator().manual_seed(1234)
    true_w = torch.tensor([[1.5], [-2.0], [0.5], [3.0]])
    x = torch.randn(WORLD * SAMPLES_PER_RANK, 4, generator=gen)
    y = x @ true_w + 0.7 + 0.01 * torch.randn(WORLD * SAMPLES_PER_RANK, 1, generator=gen)
    rows = slice(rank * SAMPLES_PER_RANK, (rank + 1) * SAMPLES_PER_RANK)
    return x[rows], y[rows]


def recv_membership(conn: Connection) -> Membership:
    """Block until the supervisor publishes the new membership (on a worker thread)."""
    if not conn.poll(MEMBERSHIP_TIMEOUT):
        raise TimeoutError(f"no new membership within {MEMBERSHIP_TIMEOUT:g} s")
    member: Membership = conn.recv()
    return member


async def take_state_from_root(group: ftcomm.Group, model: torch.nn.Module, step: int) -> int:
    """Make every rank's parameters and step those of rank 0; return the step."""
    state = torch.cat([parameters_to_vector(model.parameters()), torch.tensor([float(step)])])
    await group.broadcast(state, root=0)  # a fresh buffer: params change only on success
    vector_to_parameters(state[:-1], model.parameters())
    return int(state[-1].item())


async def train(rank: int, port: int, t0: float, conn: Connection) -> None:
    who = f"rank {rank}"
    x, y = make_shard(rank)
    torch.manual_seed(SEED)  # the same initial weights on every rank
    model = torch.nn.Linear(4, 1)
    group = ftcomm.Group("gloo", timeout=STEP_TIMEOUT, configure_timeout=CONFIGURE_TIMEOUT)
    async with group:
        await group.configure(f"127.0.0.1:{port}/run/q0", rank, WORLD)
        say(t0, who, f"configured as rank {group.rank}/{group.size()} on /run/q0; training")
        step, first_loss, loss_now = 0, float("nan"), float("nan")
        while step < STEPS:
            started = time.monotonic()
            model.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            torch.autograd.backward(loss)
            if rank == VICTIM and step == KILL_STEP:
                say(t0, who, f"step {step}: reporting to the parent, which will SIGKILL me")
                conn.send(VictimReady(kind="victim-ready", rank=rank, step=step))
                # SIGKILL lands while we wait here; wake only if the parent is gone.
                await asyncio.to_thread(conn.poll, DEMO_TIMEOUT)
                raise RuntimeError("the parent did not kill me")
            # One buffer per step, new each time: a failed op may still write into it.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            buf = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
            try:
                await group.allreduce(buf, timeout=STEP_TIMEOUT)
            except ftcomm.CommError as exc:
                latency = time.monotonic() - started
                verdict = "within" if latency <= ERROR_BOUND else "OVER"
                say(
                    t0,
                    who,
                    f"step {step}: allreduce raised {type(exc).__name__} after {latency:.2f} s "
                    f"({verdict} the {ERROR_BOUND:g} s bound): {brief(exc)}",
                )
                conn.send(
                    StepFailed(
                        kind="failed",
                        rank=rank,
                        step=step,
                        error=type(exc).__name__,
                        latency=latency,
                    )
                )
                member = await asyncio.to_thread(recv_membership, conn)
                prefix = f"/run/q{member['epoch']}"
                await group.configure(f"127.0.0.1:{port}{prefix}", member["rank"], member["world"])
                step = await take_state_from_root(group, model, step)
                say(
                    t0,
                    who,
                    f"reconfigured as rank {group.rank}/{group.size()} on {prefix} in "
                    f"{time.monotonic() - started - latency:.2f} s; redoing step {step}",
                )
                continue
            world = group.size()
            buf /= world
            with torch.no_grad():
                offset = 0
                for p in model.parameters():
                    p.sub_(buf[offset : offset + p.numel()].view_as(p), alpha=LR)
                    offset += p.numel()
            loss_now = buf[-1].item()
            if step == 0:
                first_loss = loss_now
            if step % 10 == 0 or step == STEPS - 1:
                say(t0, who, f"step {step}: loss {loss_now:.5f} (world {world})")
            step += 1
        params = parameters_to_vector(model.parameters()).tolist()
        say(t0, who, f"finished {STEPS} steps as rank {group.rank}/{group.size()}")
        conn.send(
            Finished(
                kind="done",
                rank=rank,
                new_rank=group.rank,
                world=group.size(),
                steps=step,
                first_loss=first_loss,
                final_loss=loss_now,
                params=params,
            )
        )


def rank_main(rank: int, port: int, t0: float, conn: Connection) -> None:
    torch.set_num_threads(1)  # three ranks on two cores
    asyncio.run(train(rank, port, t0, conn))


# -- supervisor ----------------------------------------------------------------
# One pipe per rank, not a shared multiprocessing.Queue: a Queue's writers share
# a lock, and a rank SIGKILLed while holding it would hang every other writer.
def supervise(
    t0: float, procs: dict[int, BaseProcess], conns: dict[int, Connection]
) -> tuple[list[Report], bool]:
    """Run the job to its end: kill the victim on cue, publish membership on a death.

    Returns what the ranks reported, and whether every rank exited (closed its
    pipe) before the demo deadline.
    """
    seen: list[Report] = []
    finished: set[int] = set()
    rank_of: dict[object, int] = {conn: rank for rank, conn in conns.items()}
    open_conns = dict(conns)
    epoch = 0
    while open_conns:
        remaining = t0 + DEMO_TIMEOUT - time.monotonic()
        if remaining <= 0:
            say(t0, "parent", f"the demo did not finish within {DEMO_TIMEOUT:g} s")
            return seen, False
        for conn in wait(list(open_conns.values()), timeout=remaining):
            rank = rank_of[conn]
            try:
                report: Report = open_conns[rank].recv()
            except EOFError:  # the rank is gone: finished, crashed or killed
                del open_conns[rank]
                if rank in finished:
                    continue
                procs[rank].join(2.0)
                code = procs[rank].exitcode
                alive = sorted(open_conns)
                epoch += 1
                say(
                    t0,
                    "parent",
                    f"rank {rank} {describe_exit(code)}; new membership /run/q{epoch}: "
                    f"old ranks {alive} -> ranks {list(range(len(alive)))}",
                )
                for new_rank, old_rank in enumerate(alive):
                    member = Membership(epoch=epoch, rank=new_rank, world=len(alive))
                    with contextlib.suppress(OSError):  # it died too: its EOF comes next
                        open_conns[old_rank].send(member)
                continue
            seen.append(report)
            if report["kind"] == "done":
                finished.add(rank)
            elif report["kind"] == "victim-ready":
                say(t0, "parent", f"rank {rank} is at step {report['step']}: SIGKILL")
                procs[rank].kill()
    return seen, True


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def check(t0: float, exits: dict[int, int | None], seen: list[Report]) -> bool:
    """Print the summary; True only if the job recovered from the dead rank."""
    survivors = [r for r in range(WORLD) if r != VICTIM]
    failed = {e["rank"]: e for e in seen if e["kind"] == "failed"}
    done = {e["rank"]: e for e in seen if e["kind"] == "done"}
    cued = any(e["kind"] == "victim-ready" and e["step"] == KILL_STEP for e in seen)
    checks: list[tuple[str, bool]] = [
        (
            f"rank {VICTIM} {describe_exit(exits[VICTIM])} "
            + (f"at step {KILL_STEP}" if cued else "(never reached the kill step)"),
            cued and exits[VICTIM] == -signal.SIGKILL,
        )
    ]
    for r in survivors:
        checks.append((f"rank {r} {describe_exit(exits[r])}", exits[r] == 0))
        f = failed.get(r)
        checks.append(
            (
                f"rank {r} step {f['step']}: {f['error']} after {f['latency']:.2f} s "
                f"(bound {ERROR_BOUND:g} s)"
                if f
                else f"rank {r} saw no communication error",
                f is not None and f["step"] == KILL_STEP and f["latency"] <= ERROR_BOUND,
            )
        )
        d = done.get(r)
        checks.append(
            (
                f"rank {r} finished {d['steps']} steps as rank {d['new_rank']}/{d['world']}"
                if d
                else f"rank {r} did not finish",
                d is not None and d["steps"] == STEPS and d["world"] == len(survivors),
            )
        )
    finals = [done[r] for r in survivors if r in done]
    same = len(finals) == len(survivors) and all(d["params"] == finals[0]["params"] for d in finals)
    checks.append((f"ranks {survivors} hold identical final parameters", same))
    if finals:
        first, last = finals[0]["first_loss"], finals[0]["final_loss"]
        checks.append((f"loss went down: {first:.4f} -> {last:.6f}", last < first))
    say(t0, "parent", "summary:")
    for text, ok in checks:
        print(f"    {'ok  ' if ok else 'FAIL'} {text}", flush=True)
    if finals:
        params = ", ".join(f"{p:+.3f}" for p in finals[0]["params"])
        print(f"    final [w, b] = [{params}] (true: +1.5, -2.0, +0.5, +3.0, +0.7)", flush=True)
    return all(ok for _, ok in checks)


def main() -> int:
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    store = TCPStore(
        host_name="127.0.0.1",
        port=0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=CONFIGURE_TIMEOUT),
    )
    procs: dict[int, BaseProcess] = {}
    conns: dict[int, Connection] = {}
    exits: dict[int, int | None] = {}
    grace = 0.0  # on an error or a timeout, kill at once
    try:
        say(t0, "parent", f"store on 127.0.0.1:{store.port}; spawning {WORLD} ranks")
        for rank in range(WORLD):
            conns[rank], child_end = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main, args=(rank, store.port, t0, child_end), name=f"rank{rank}"
            )
            proc.start()
            procs[rank] = proc
            child_end.close()  # the rank holds the only other end: its exit reads as EOF
        seen, all_exited = supervise(t0, procs, conns)
        if all_exited:
            grace = 10.0  # every rank has closed its pipe: let it finish exiting
    finally:
        for rank, p in procs.items():
            p.join(grace)
            if p.exitcode is None:
                p.kill()
                p.join(5)
            exits[rank] = p.exitcode
            p.close()
        for conn in conns.values():
            conn.close()
        del store  # the last reference: the store server shuts down
    recovered = check(t0, exits, seen)
    verdict = "RECOVERED" if recovered else "DID NOT RECOVER"
    say(t0, "parent", f"{verdict} from the loss of rank {VICTIM} in {time.monotonic() - t0:.1f} s")
    return 0 if recovered else 1


if __name__ == "__main__":
    sys.exit(main())
