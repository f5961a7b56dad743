"""Recover from a failed rank: three ranks train, rank 2 fails, two carry on.

Two ways a peer can fail, one scenario each (``--fault``; both by default):

* ``kill``: rank 2 is SIGKILLed (a dead peer). Its sockets close, so the
  survivors' allreduce fails at once with a typed ftcomm error.
* ``stop``: rank 2 is SIGSTOPped (a hung peer). Its sockets stay open, so
  nothing fails until the deadline: the survivors' allreduce raises
  ``ftcomm.CommTimeout`` at ``STEP_TIMEOUT``. Only then does the parent SIGKILL
  the stopped rank, so that nothing is left behind.

The parent process plays the supervisor (what an elastic agent or a lighthouse
does in a real job): it hosts the TCPStore, spawns three ranks, signals rank 2
when it reaches ``FAULT_STEP``, and, once rank 2 is gone, tells the survivors
the new membership (store prefix, new rank, world size) over a per-rank pipe.

Each rank trains ``Linear(4, 1)`` with data-parallel SGD on its own shard of a
synthetic regression set: after ``backward()`` it sums ``[grads..., loss]``
across ranks with one ``allreduce`` that has a ``STEP_TIMEOUT`` deadline, divides
by the world size and steps. When rank 2 fails, the survivors' allreduce raises
a typed ftcomm error; they wait for the new membership, configure a fresh group
on a new store prefix, take the model state (parameters and step) from the new
rank 0 and redo the failed step.

Run ``python examples/recover_from_dead_rank.py [--fault {kill,stop}]``; each
scenario has its own store and processes, and the demo exits 0 only if every
scenario it ran recovered (rank 2 ended by SIGKILL, stopped first under
``stop``; ranks 0 and 1 saw the expected error in time, and finished with the
same parameters and a lower loss).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Literal, TypedDict, cast

import torch
from torch._C._distributed_c10d import TCPStore  # torch.distributed.TCPStore, typed
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import ftcomm

Fault = Literal["kill", "stop"]
FAULTS: tuple[Fault, ...] = ("kill", "stop")  # the order in which a plain run plays them
FAULT_SIGNAL: dict[Fault, signal.Signals] = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
FAULT_PLOT: dict[Fault, str] = {
    "kill": "SIGKILLed (a dead peer: its sockets close)",
    "stop": "SIGSTOPped (a hung peer: its sockets stay open)",
}

WORLD = 3
VICTIM = 2
STEPS = 30
FAULT_STEP = 10
STEP_TIMEOUT = 2.0  # deadline of every collective, seconds
ERROR_BOUND = STEP_TIMEOUT + 1.0  # kill: the failed step must end within this
TIMEOUT_WINDOW = (STEP_TIMEOUT - 0.05, STEP_TIMEOUT + 1.0)  # stop: CommTimeout lands in here
CONFIGURE_TIMEOUT = 20.0  # the first configure waits for three cold interpreters
MEMBERSHIP_TIMEOUT = 10.0  # how long a survivor waits for the supervisor's verdict
SCENARIO_TIMEOUT = 25.0  # the parent kills everything after this; two fit in a minute
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
    error: str  # the class name, from ftcomm.errors
    latency: float  # seconds from issuing the allreduce to its error


class Finished(TypedDict):
    kind: Literal["done"]
    rank: int
    new_rank: int
    world: int
    steps: int
    first_loss: float
    final_loss: float
    params: list[float]
    aborts: dict[str, int]  # group.stats().aborts: what broke its configurations


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


def judge(fault: Fault, error: str, latency: float) -> tuple[bool, str]:
    """Whether a survivor's failed step ended as ``fault`` should end it, and the rule."""
    if fault == "kill":  # any ftcomm error, soon
        cls = getattr(ftcomm.errors, error, None)
        typed = isinstance(cls, type) and issubclass(cls, ftcomm.CommError)
        return typed and latency <= ERROR_BOUND, f"a CommError within {ERROR_BOUND:g} s"
    low, high = TIMEOUT_WINDOW  # a CommTimeout, at the deadline
    ok = error == "CommTimeout" and low <= latency < high
    return ok, f"a CommTimeout after {low:g}-{high:g} s"


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


async def train(fault: Fault, rank: int, port: int, t0: float, conn: Connection) -> None:
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
            model.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            torch.autograd.backward(loss)
            if rank == VICTIM and step == FAULT_STEP:
                sig = FAULT_SIGNAL[fault].name
                say(t0, who, f"step {step}: reporting to the parent, which will {sig} me")
                conn.send(VictimReady(kind="victim-ready", rank=rank, step=step))
                # The signal lands while we wait here (under stop, a SIGKILL
                # follows later); wake only if the parent is gone.
                await asyncio.to_thread(conn.poll, SCENARIO_TIMEOUT)
                raise RuntimeError(f"the parent did not {sig} me")
            # One buffer per step, new each time: a failed op may still write into it.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            buf = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
            issued = time.monotonic()
            try:
                await group.allreduce(buf, timeout=STEP_TIMEOUT)
            except ftcomm.CommError as exc:
                failed_at = time.monotonic()
                latency = failed_at - issued
                name = type(exc).__name__
                ok, rule = judge(fault, name, latency)
                say(
                    t0,
                    who,
                    f"step {step}: allreduce raised {name} after {latency:.2f} s "
                    f"({'as expected' if ok else 'UNEXPECTED'}: {rule}): {brief(exc)}",
                )
                conn.send(
                    StepFailed(kind="failed", rank=rank, step=step, error=name, latency=latency)
                )
                member = await asyncio.to_thread(recv_membership, conn)
                prefix = f"/run/q{member['epoch']}"
                await group.configure(f"127.0.0.1:{port}{prefix}", member["rank"], member["world"])
                step = await take_state_from_root(group, model, step)
                say(
                    t0,
                    who,
                    f"reconfigured as rank {group.rank}/{group.size()} on {prefix} in "
                    f"{time.monotonic() - failed_at:.2f} s; redoing step {step}",
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
        stats = group.stats()
        table = "\n".join(f"      {line}" for line in str(stats).splitlines())
        say(t0, who, f"finished {STEPS} steps as rank {group.rank}/{group.size()}; stats:\n{table}")
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
                aborts=dict(stats.aborts),
            )
        )


def rank_main(fault: Fault, rank: int, port: int, t0: float, conn: Connection) -> None:
    torch.set_num_threads(1)  # three ranks on two cores
    asyncio.run(train(fault, rank, port, t0, conn))


# -- supervisor ----------------------------------------------------------------
@dataclass
class Scenario:
    """One run of the job with one fault: what the parent saw."""

    fault: Fault
    t0: float = field(default_factory=time.monotonic)
    seen: list[Report] = field(default_factory=list)
    stopped: bool = False  # the victim was seen stopped (state T) after SIGSTOP
    all_exited: bool = False  # every rank closed its pipe before the deadline
    exits: dict[int, int | None] = field(default_factory=dict)


def process_state(pid: int) -> str:
    """The kernel's one-letter state of a process ("T": stopped), or "?" (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]  # the name may hold ") "
    except (OSError, IndexError):
        return "?"


def wait_stopped(pid: int, timeout: float = 1.0) -> bool:
    """Wait until the process ``pid`` is stopped by a signal; False after ``timeout``."""
    until = time.monotonic() + timeout
    while process_state(pid) != "T":
        if time.monotonic() >= until:
            return False
        time.sleep(0.001)
    return True


# One pipe per rank, not a shared multiprocessing.Queue: a Queue's writers share
# a lock, and a rank SIGKILLed or SIGSTOPped while holding it would hang every
# other writer.
def supervise(run: Scenario, procs: dict[int, BaseProcess], conns: dict[int, Connection]) -> None:
    """Run the job to its end: signal the victim on cue, publish membership on a death.

    Under ``stop`` the victim is SIGKILLed once every other live rank has
    reported a failed step: they have timed out on it. Fills ``run.seen``,
    ``run.stopped`` and ``run.all_exited``.
    """
    t0 = run.t0
    failed: set[int] = set()
    hung: int | None = None  # the stopped rank, until it is killed
    rank_of: dict[object, int] = {conn: rank for rank, conn in conns.items()}
    open_conns = dict(conns)
    epoch = 0
    while open_conns:
        remaining = t0 + SCENARIO_TIMEOUT - time.monotonic()
        if remaining <= 0:
            say(t0, "parent", f"the scenario did not finish within {SCENARIO_TIMEOUT:g} s")
            return
        for conn in wait(list(open_conns.values()), timeout=remaining):
            rank = rank_of[conn]
            try:
                report: Report = open_conns[rank].recv()
            except EOFError:  # the rank is gone: finished, crashed or killed
                del open_conns[rank]
                if any(e["kind"] == "done" and e["rank"] == rank for e in run.seen):
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
            run.seen.append(report)
            if report["kind"] == "victim-ready":
                proc = procs[rank]
                if run.fault == "kill":
                    say(t0, "parent", f"rank {rank} is at step {report['step']}: SIGKILL")
                    proc.kill()
                else:
                    assert proc.pid is not None  # started
                    os.kill(proc.pid, signal.SIGSTOP)
                    hung, run.stopped = rank, wait_stopped(proc.pid)
                    state = "it is stopped" if run.stopped else "it is NOT seen stopped"
                    say(
                        t0,
                        "parent",
                        f"rank {rank} is at step {report['step']}: SIGSTOP; {state}, "
                        "its sockets stay open",
                    )
            elif report["kind"] == "failed":
                failed.add(rank)
                waiting = [r for r in open_conns if r != hung and r not in failed]
                if hung is not None and not waiting:
                    say(
                        t0,
                        "parent",
                        f"ranks {sorted(failed)} timed out on rank {hung}: "
                        "SIGKILL the stopped rank",
                    )
                    procs[hung].kill()
                    hung = None
    run.all_exited = True


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def check(run: Scenario) -> bool:
    """Print the summary; True only if the job recovered from the failed rank."""
    exits, seen = run.exits, run.seen
    survivors = [r for r in range(WORLD) if r != VICTIM]
    failed = {e["rank"]: e for e in seen if e["kind"] == "failed"}
    done = {e["rank"]: e for e in seen if e["kind"] == "done"}
    cued = any(e["kind"] == "victim-ready" and e["step"] == FAULT_STEP for e in seen)
    killed = exits[VICTIM] == -signal.SIGKILL
    if not cued:
        victim = f"rank {VICTIM} {describe_exit(exits[VICTIM])} (never reached step {FAULT_STEP})"
    elif run.fault == "kill":
        victim = f"rank {VICTIM} {describe_exit(exits[VICTIM])} at step {FAULT_STEP}"
    else:
        how = "stopped" if run.stopped else "NOT seen stopped"
        victim = f"rank {VICTIM} {how} at step {FAULT_STEP}, then {describe_exit(exits[VICTIM])}"
    stopped_if_due = run.stopped or run.fault == "kill"
    checks: list[tuple[str, bool]] = [(victim, cued and stopped_if_due and killed)]
    for r in survivors:
        checks.append((f"rank {r} {describe_exit(exits[r])}", exits[r] == 0))
        f = failed.get(r)
        if f is None:
            checks.append((f"rank {r} saw no communication error", False))
        else:
            ok, rule = judge(run.fault, f["error"], f["latency"])
            checks.append(
                (
                    f"rank {r} step {f['step']}: {f['error']} after {f['latency']:.2f} s "
                    f"(want {rule})",
                    ok and f["step"] == FAULT_STEP,
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
        if d:
            checks.append(
                (
                    f"rank {r}'s stats() counted the abort: {d['aborts']}",
                    sum(d["aborts"].values()) == 1
                    and set(d["aborts"]) <= {"CommFailed", "CommTimeout"},
                )
            )
    finals = [done[r] for r in survivors if r in done]
    same = len(finals) == len(survivors) and all(d["params"] == finals[0]["params"] for d in finals)
    checks.append((f"ranks {survivors} hold identical final parameters", same))
    if finals:
        first, last = finals[0]["first_loss"], finals[0]["final_loss"]
        checks.append((f"loss went down: {first:.4f} -> {last:.6f}", last < first))
    say(run.t0, "parent", "summary:")
    for text, ok in checks:
        print(f"    {'ok  ' if ok else 'FAIL'} {text}", flush=True)
    if finals:
        params = ", ".join(f"{p:+.3f}" for p in finals[0]["params"])
        print(f"    final [w, b] = [{params}] (true: +1.5, -2.0, +0.5, +3.0, +0.7)", flush=True)
    return all(ok for _, ok in checks)


def run_scenario(fault: Fault) -> bool:
    """Play one scenario with its own store and ranks; True if it recovered."""
    run = Scenario(fault)
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
    grace = 0.0  # on an error or a timeout, kill at once
    try:
        say(run.t0, "parent", f"store on 127.0.0.1:{store.port}; spawning {WORLD} ranks")
        for rank in range(WORLD):
            conns[rank], child_end = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main,
                args=(fault, rank, store.port, run.t0, child_end),
                name=f"rank{rank}",
            )
            proc.start()
            procs[rank] = proc
            child_end.close()  # the rank holds the only other end: its exit reads as EOF
        supervise(run, procs, conns)
        if run.all_exited:
            grace = 10.0  # every rank has closed its pipe: let it finish exiting
    finally:
        for rank, p in procs.items():
            p.join(grace)
            if p.exitcode is None:
                p.kill()  # SIGKILL ends a stopped process too
                p.join(5)
            run.exits[rank] = p.exitcode
            p.close()
        for conn in conns.values():
            conn.close()
        del store  # the last reference: the store server shuts down
    recovered = check(run)
    verdict = "RECOVERED" if recovered else "DID NOT RECOVER"
    say(
        run.t0,
        "parent",
        f"{verdict} from the {FAULT_SIGNAL[fault].name} of rank {VICTIM} "
        f"in {time.monotonic() - run.t0:.1f} s",
    )
    return recovered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--fault",
        choices=FAULTS,
        help="how rank 2 fails: kill (SIGKILL) or stop (SIGSTOP); default: kill, then stop",
    )
    fault = cast("Fault | None", parser.parse_args(argv).fault)
    faults = FAULTS if fault is None else (fault,)
    started = time.monotonic()
    results: dict[Fault, bool] = {}
    for i, f in enumerate(faults):
        if i:
            print(flush=True)
        print(
            f"=== --fault {f}: rank {VICTIM} is {FAULT_PLOT[f]} at step {FAULT_STEP}",
            flush=True,
        )
        results[f] = run_scenario(f)
    code = 0 if all(results.values()) else 1
    if len(faults) > 1:
        parts = ", ".join(
            f"{f}: {'RECOVERED' if ok else 'DID NOT RECOVER'}" for f, ok in results.items()
        )
        print(f"\n=== {parts}; exit {code} ({time.monotonic() - started:.1f} s in all)", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
