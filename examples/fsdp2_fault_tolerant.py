"""Two replicas of an FSDP2 model: one is killed mid-training, the other trains on, and the
restarted one comes back with the state.

Each replica is a torch job of its own: SHARDS processes with their own default group, the model
sharded over them with ``fully_shard`` (FSDP2). Across replicas, the fault-tolerant dimension of
HSDP, each shard index averages its gradient shards over an ``ftcomm.Group`` with a deadline.
Shard 0 of each replica is the replica's member of ``ftcomm.Membership``: it tells its replica's
other shards what was decided (over their own group), and each of them configures its group for
that world at an address of its own.

At step KILL_STEP both processes of replica 1 SIGKILL themselves. Replica 0's allreduce fails on
every shard: it skips that step, ``recover()``s alone and trains on. The parent restarts replica
1, whose ``join()`` replica 0's ``pending()`` sees: both ``recover()`` into one world, and each
shard of replica 1 gets its shard of the parameters and of Adam's state, and the step, from
replica 0 (``ftcomm.sync_state``). Exit 0 when the replicas end with the same parameters and
optimizer state, bit for bit, shard by shard, and the loss went down.

    python examples/fsdp2_fault_tolerant.py                # CPU: Gloo in and across replicas
    python examples/fsdp2_fault_tolerant.py --device cuda  # NCCL: one GPU per process (4)
"""

import argparse
import asyncio
import contextlib
import functools
import hashlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ftcomm

REPLICAS, SHARDS, STEPS, KILL_STEP, TOGETHER, N, LR = 2, 2, 30, 10, 10, 64, 0.02
STEP_TIMEOUT, ALONE = 5.0, 60.0  # an allreduce's deadline; how long replica 0 waits alone
MEMBERSHIP_TIMEOUT, REPLICA_TIMEOUT = 40.0, 90.0  # shard 0's calls; the others wait longer


def say(t0: float, who: str, text: str) -> None:
    print(f"{time.monotonic() - t0:6.2f}s [{who}] {text}", flush=True)


class Replica:
    """One process of a replica: its shard of the model, its group across replicas, and (on
    shard 0) the replica's membership."""

    def __init__(self, replica: int, shard: int, life: int, device: torch.device, t0: float):
        self.replica, self.shard, self.life, self.device, self.t0 = replica, shard, life, device, t0
        self.who = f"replica{replica} shard{shard}"
        torch.manual_seed(0)  # the same data and initial weights everywhere
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        ).to(device)
        mesh = init_device_mesh(device.type, (SHARDS,))  # this replica's own processes
        for layer in (self.model[0], self.model[2], self.model):
            fully_shard(layer, mesh=mesh)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.Adam(self.params, lr=LR)
        for p in self.params:  # a step with zero gradients: Adam's state exists, as on the others
            p.grad = torch.zeros_like(p)
        self.opt.step()
        self.x = torch.randn(N, 8, device=device)
        self.y = self.x.sin().sum(1, keepdim=True)  # what the model is to learn
        self.generations: list[int] = []
        self.errors: list[str] = []
        self.synced: int | None = None  # the step it got where it was behind
        self.reunited = False  # in a full world again after the failure (or restarted)

    def together(self, ok: bool) -> bool:
        """Whether every process of this replica is ok (a collective of the replica's own)."""
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    async def tell(self, ask: Callable[[], Awaitable[Any]] | None) -> Any:
        """Shard 0's answer to ``ask()`` (its membership's), on every process of this replica;
        a membership error is raised on every one of them alike."""
        box: list[Any] = [None]
        if ask is not None:
            try:
                box[0] = await ask()
            except ftcomm.MembershipError as exc:
                box[0] = f"{type(exc).__name__}: {exc}"
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise RuntimeError(f"{self.who}: shard 0's membership failed: {box[0]}")
        return box[0]

    def state(self) -> dict[str, Any]:
        """This shard's parameters and Adam's state, as the model and the optimizer hold
        them (DTensors): ``sync_state`` writes a replica behind's local shards in place."""
        adam = [self.opt.state[p] for p in self.params]
        return {"params": list(self.params), "adam": adam}

    def digest(self) -> str:
        state = self.state()
        flat = [_local(t).detach().reshape(-1).double().cpu() for t in state["params"]]
        flat += [_local(t).reshape(-1).double().cpu() for a in state["adam"] for t in a.values()]
        return hashlib.sha256(torch.cat(flat).numpy().tobytes()).hexdigest()[:16]

    async def regroup(
        self, members: ftcomm.Membership | None, group: ftcomm.Group, step: int, joining: bool
    ) -> tuple[ftcomm.World, int]:
        """Join or recover (shard 0), configure every shard's group for that world, and copy
        the state to the replica behind; again until every shard of this replica got there."""
        got = step

        async def form(joining: bool) -> ftcomm.World:
            assert members is not None
            if not joining:
                try:
                    return await members.recover(group)
                except ftcomm.Evicted:  # the other went on without it: back as a newcomer
                    pass
            return await members.join(group)

        while True:
            world: ftcomm.World = await self.tell(
                functools.partial(form, joining) if members is not None else None
            )
            joining, ok = False, True
            try:
                if members is None:  # shard 0's group is configured by its membership
                    addr = f"{world.store_addr}/shard{self.shard}"
                    await group.configure(addr, world.rank, world.size)
                _, got = await ftcomm.sync_state(group, self.state(), step, timeout=30)
            except ftcomm.CommError as exc:
                ok = False
                self.errors.append(type(exc).__name__)
            if self.together(ok):
                break
        if got != step:  # this shard's parameters and Adam's state were written in place
            self.synced = got
        self.generations.append(world.generation)
        self.reunited |= world.size == REPLICAS and bool(self.errors or self.life)
        if self.shard == 0:
            say(self.t0, self.who, f"generation {world.generation} at step {got}: {world.members}")
        return world, got

    async def train(self, address: str) -> dict[str, Any]:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        losses: list[float] = []
        async with contextlib.AsyncExitStack() as stack:
            members = None
            if self.shard == 0:
                members = ftcomm.Membership(
                    address,
                    "fsdp2",
                    f"replica{self.replica}",
                    min_size=1,
                    max_size=REPLICAS,
                    join_window=10.0,
                    heartbeat_timeout=2.0,
                    timeout=MEMBERSHIP_TIMEOUT,
                )
                await stack.enter_async_context(members)
            group = ftcomm.Group(backend, timeout=STEP_TIMEOUT, configure_timeout=30)
            await stack.enter_async_context(group)
            world, step = await self.regroup(members, group, 0, joining=True)
            since, alone = step, time.monotonic()
            # train on while replica 1 is away (it comes back); then at least TOGETHER steps
            while step < max(STEPS, since + TOGETHER) or (
                world.size < REPLICAS and not self.reunited
            ):
                if world.size < REPLICAS and time.monotonic() - alone > ALONE:
                    raise RuntimeError(f"{self.who}: alone for {ALONE:g} s: no replica came back")
                if self.replica == 1 and self.life == 0 and step >= KILL_STEP and world.size > 1:
                    say(self.t0, self.who, f"step {step}: SIGKILL")
                    os.kill(os.getpid(), signal.SIGKILL)
                part = N // (world.size * SHARDS)  # this process's samples
                first = (world.rank * SHARDS + self.shard) * part
                rows = slice(first, first + part)
                loss = torch.nn.functional.mse_loss(self.model(self.x[rows]), self.y[rows])
                loss.backward()  # FSDP2: the gradients reduce-scattered over this replica
                grads = [_local(p.grad) for p in self.params]
                flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
                try:  # HSDP's replicate dimension, with a deadline
                    await group.allreduce(flat, op="avg")
                    ok = True
                except ftcomm.CommError as exc:
                    ok = False
                    self.errors.append(type(exc).__name__)
                    say(self.t0, self.who, f"step {step}: allreduce raised {type(exc).__name__}")
                agreed = self.together(ok)
                if agreed:  # every shard's gradients averaged: take the step
                    offset = 0
                    for g in grads:
                        g.copy_(flat[offset : offset + g.numel()].view_as(g))
                        offset += g.numel()
                    self.opt.step()
                    losses.append(flat[-1].item())
                    step += 1
                self.opt.zero_grad()
                # a step boundary: regroup after a failure, or when shard 0's pending() says
                # a newcomer waits (all members ask it at the same steps, and get one answer)
                if agreed and not await self.tell(members.pending if members else None):
                    continue
                world, step = await self.regroup(members, group, step, joining=False)
                since, alone = step, time.monotonic()
        return {
            "generations": self.generations,
            "errors": self.errors,
            "synced": self.synced,
            "losses": losses,
            "step": step,
            "digest": self.digest(),
        }


def _local(t: Any) -> torch.Tensor:
    """The local shard of a DTensor (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def rank_main(
    replica: int, shard: int, life: int, device: str, address: str, t0: float, out: "mp.Queue[Any]"
) -> None:
    torch.set_num_threads(1)  # four processes on two cores
    dev = torch.device(device)
    if dev.type == "cuda":  # one GPU per process
        dev = torch.device("cuda", replica * SHARDS + shard)
        torch.cuda.set_device(dev)
    host, port = address.rsplit(":", 1)
    server = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo",
        store=dist.PrefixStore(f"replica{replica}/life{life}", server),
        rank=shard,
        world_size=SHARDS,
        timeout=timedelta(seconds=REPLICA_TIMEOUT),
    )
    try:
        report = asyncio.run(Replica(replica, shard, life, dev, t0).train(address))
    finally:
        dist.destroy_process_group()
    out.put(((replica, shard, life), report))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=float, default=150.0, help="for the whole run, seconds")
    args = parser.parse_args()
    device, timeout = args.device, args.timeout
    if device == "cuda" and torch.cuda.device_count() < REPLICAS * SHARDS:
        print(
            f"--device cuda needs {REPLICAS * SHARDS} GPUs (one per process), "
            f"this machine has {torch.cuda.device_count()}"
        )
        return 2
    ctx, t0, out = mp.get_context("spawn"), time.monotonic(), mp.get_context("spawn").Queue()
    reports: dict[tuple[int, int, int], dict[str, Any]] = {}
    procs: dict[tuple[int, int, int], Any] = {}
    with ftcomm.serve_store() as server:

        def start(replica: int, life: int) -> None:
            for shard in range(SHARDS):
                key = (replica, shard, life)
                args = (*key, device, server.address, t0, out)
                procs[key] = ctx.Process(target=rank_main, args=args, name=f"replica{key}")
                procs[key].start()

        try:
            for replica in range(REPLICAS):
                start(replica, 0)
            for shard in range(SHARDS):  # replica 1 kills itself at KILL_STEP: restart it
                procs[(1, shard, 0)].join(max(t0 + timeout - time.monotonic(), 0.0))
            say(t0, "parent", "replica 1 is gone: restarting it")
            start(1, 1)
            while len(reports) < len(procs) - SHARDS:  # all but the killed ones report
                if time.monotonic() > t0 + timeout:
                    say(t0, "parent", f"not every process finished within {timeout:g} s")
                    break
                with contextlib.suppress(queue.Empty):
                    key, report = out.get(timeout=1.0)
                    reports[key] = report
                    continue
                if all(p.exitcode is not None for p in procs.values()):
                    say(t0, "parent", "every process ended, not all of them with a report")
                    break
        finally:
            # every one reported: each ends by itself (closing its membership, groups
            # and queue takes seconds on a busy machine); else they are killed at once
            end = time.monotonic() + (30 if len(reports) == len(procs) - SHARDS else 0)
            for proc in procs.values():
                proc.join(max(end - time.monotonic(), 0))
                proc.kill()
                proc.join()
    exits = {key: proc.exitcode for key, proc in procs.items()}
    killed = {k: -signal.SIGKILL for k in exits if k[0] == 1 and k[2] == 0}
    final = {(r, s): rep for (r, s, life), rep in reports.items() if not (r == 1 and life == 0)}
    digests = {
        s: {final[(r, s)]["digest"] for r in range(REPLICAS) if (r, s) in final}
        for s in range(SHARDS)
    }
    losses = reports.get((0, 0, 0), {}).get("losses") or [0.0]
    back = [final.get((1, s), {}).get("synced") for s in range(SHARDS)]
    checks = {
        f"exits {exits}": exits == {k: killed.get(k, 0) for k in exits},
        "replica 0 saw the failure: "
        + str({s: final.get((0, s), {}).get("errors") for s in range(SHARDS)}): all(
            final.get((0, s), {}).get("errors") for s in range(SHARDS)
        ),
        f"restarted replica 1 got the state at steps {back}": len(set(back)) == 1
        and (back[0] or 0) > KILL_STEP,
        f"the same parameters and Adam state, shard by shard: {digests}": len(final)
        == REPLICAS * SHARDS
        and all(len(d) == 1 for d in digests.values()),
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}": losses[-1] < losses[0],
    }
    for text, ok in checks.items():
        print(f"    {'ok  ' if ok else 'FAIL'} {text}")
    ok = all(checks.values())
    say(t0, "parent", "RECOVERED" if ok else "DID NOT RECOVER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
