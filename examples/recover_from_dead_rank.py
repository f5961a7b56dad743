"""Recover from a dead member with ``ftcomm.Membership``: three train, one fails, one joins.

At step ``FAULT_STEP`` m2 SIGKILLs itself (``--fault kill``: a crash, so the survivors' allreduce
fails at once) or SIGSTOPs itself (``--fault stop``: a hang, so theirs times out; the parent
SIGKILLs m2 at the end). m0 and m1 ``recover()`` into generation 2; the parent starts m3, whose
``join()`` their ``pending()`` sees: all ``recover()`` into generation 3, ``sync_state()`` hands
m3 the model and the step. Both faults by default, each on its own store; exit 0 if both went so.
"""

import argparse
import asyncio
import multiprocessing as mp
import queue
import signal
import sys
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any, TypedDict

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import ftcomm

torch.set_num_threads(1)  # four members on two cores
FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
FULL, STEPS, FAULT_STEP, LR, N, STEP_TIME = 3, 60, 10, 0.1, 192, 0.05  # N: samples
STEP_TIMEOUT, SCENARIO_TIMEOUT = 2.0, 40.0  # an allreduce's deadline; the parent's, seconds
WANT = {"kill": ("CommFailed", "at once"), "stop": ("CommTimeout", "at the deadline")}  # m0, m1 see


class Report(TypedDict):  # what a member that finished sends the parent, with its id
    generations: list[int]
    errors: list[tuple[str, str]]  # (error class, when it came after the allreduce: when())
    losses: list[float]  # one per step it took part in
    params: list[float]


def when(took: float) -> str:
    """An allreduce's error time in words: a loaded machine's delays are not a wrong answer."""
    if took < STEP_TIMEOUT / 2:
        return "at once"
    if STEP_TIMEOUT - 0.01 <= took < STEP_TIMEOUT + 1.0:
        return "at the deadline"
    return f"after {took:.1f} s"


def say(t0: float, who: str, text: str) -> None:  # one write a line: no interleaving
    print(f"{time.monotonic() - t0:6.2f}s [{who}] {text}", flush=True)


async def train(address: str, me: str, fault: str, t0: float, regrouped: Event) -> Report:
    torch.manual_seed(0)  # the same data and initial weights on all (a newcomer's are replaced)
    x, model = torch.randn(N, 4), torch.nn.Linear(4, 1)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]]) + 0.7  # what the model is to learn
    params = list(model.parameters())
    report = Report(generations=[], errors=[], losses=[], params=[])
    members = ftcomm.Membership(
        address, "demo", me, min_size=2, max_size=FULL, join_window=10.0, heartbeat_timeout=0.5
    )
    async with members, ftcomm.Group("gloo", timeout=30) as group:

        async def settle(world: ftcomm.World, step: int) -> tuple[ftcomm.World, int]:
            state, got = await members.sync_state(model.state_dict(), step)  # from the one ahead
            model.load_state_dict(state)
            if world.rank == 0:
                who, new = " ".join(world.members), " ".join(world.newcomers) or "none"
                say(t0, me, f"generation {world.generation} at step {got}: {who} (joined: {new})")
            report["generations"].append(world.generation)
            return world, got

        world, step = await settle(await members.join(group), 0)
        while step < STEPS or world.size < FULL:
            if me == "m2" and world.generation == 1 and step == FAULT_STEP:
                say(t0, me, f"step {step}: sending myself {FAULTS[fault].name}")
                signal.raise_signal(FAULTS[fault])
            await asyncio.sleep(STEP_TIME)  # a step's compute (it leaves the CPUs to a newcomer)
            shard = slice(world.rank * N // world.size, (world.rank + 1) * N // world.size)
            loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
            grads = parameters_to_vector(torch.autograd.grad(loss, params))
            buf, issued = torch.cat([grads, loss.detach()[None]]), time.monotonic()
            try:
                await group.allreduce(buf, timeout=STEP_TIMEOUT)
            except ftcomm.CommError as exc:  # a member died or hangs: go on without it
                took, name = time.monotonic() - issued, type(exc).__name__
                report["errors"].append((name, when(took)))
                say(t0, me, f"step {step}: allreduce raised {name} after {took:.2f} s; recover()")
                world, step = await settle(await members.recover(group), step)
                regrouped.set()  # the parent starts a replacement
                continue
            buf /= world.size  # the mean over all the members' samples
            vector_to_parameters(parameters_to_vector(params) - LR * buf[:-1], params)
            report["losses"].append(buf[-1].item())
            step += 1
            if await members.pending():  # newcomers wait, or a member died: the same on all
                world, step = await settle(await members.recover(group), step)
    return {**report, "params": parameters_to_vector(params).tolist()}


def member_main(me: str, out: "Queue[tuple[str, Report]]", address: str, *args: Any) -> None:
    out.put((me, asyncio.run(train(address, me, *args))))


def scenario(fault: str) -> bool:
    """Play one fault on a store of its own; True if the job recovered as it should."""
    ctx, t0, reports = mp.get_context("spawn"), time.monotonic(), dict[str, Report]()
    out, regrouped = ctx.Queue(), ctx.Event()
    print(f"=== --fault {fault}: m2 gets {FAULTS[fault].name} at step {FAULT_STEP}", flush=True)
    with ftcomm.serve_store() as server:
        common = (out, server.address, fault, t0, regrouped)
        procs = {m: ctx.Process(target=member_main, args=(m, *common)) for m in ("m0", "m1", "m2")}
        try:
            for proc in procs.values():
                proc.start()
            if regrouped.wait(SCENARIO_TIMEOUT):
                procs["m3"] = ctx.Process(target=member_main, args=("m3", *common))
                procs["m3"].start()
            while len(reports) < FULL:
                me, report = out.get(timeout=max(t0 + SCENARIO_TIMEOUT - time.monotonic(), 0.1))
                reports[me] = report
        except queue.Empty:
            say(t0, "parent", f"not every member finished within {SCENARIO_TIMEOUT:g} s")
        finally:
            hung = procs["m2"].is_alive()  # stop: still there, stopped
            for key, proc in procs.items():
                proc.join(10 if len(reports) == FULL and key != "m2" else 0)
                proc.kill()  # SIGKILL ends a stopped process too: nothing is left behind
                proc.join()
    exits = {k: p.exitcode for k, p in procs.items()}
    story = {m: (r["generations"], r["errors"]) for m, r in reports.items()}
    runs = [r["losses"] for r in reports.values() if r["losses"]] or [[0.0]]
    first, last = max(run[0] for run in runs), max(run[-1] for run in runs)
    same = len({str(r["params"]) for r in reports.values()}) == 1
    survivor = ([1, 2, 3], [WANT[fault]])
    checks = {  # what the parent saw, and whether it is what this fault should do
        f"m2 {'hung until SIGKILLed' if hung else 'died'}; exits {exits}": hung == (fault == "stop")
        and exits == {"m0": 0, "m1": 0, "m2": -signal.SIGKILL, "m3": 0},
        f"generations, errors: {story}": story == {"m0": survivor, "m1": survivor, "m3": ([3], [])},
        f"the same parameters on all, loss {first:.3f} -> {last:.1e}": same and last < first,
    }
    for text, ok in checks.items():
        print(f"    {'ok  ' if ok else 'FAIL'} {text}")
    ok = all(checks.values())
    say(t0, "parent", f"{'RECOVERED' if ok else 'DID NOT RECOVER'} from {FAULTS[fault].name}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--fault", choices=FAULTS, help="how m2 fails (default: kill, then stop)")
    fault, started = parser.parse_args().fault, time.monotonic()
    results = {f: scenario(f) for f in ([fault] if fault else FAULTS)}
    print(f"=== recovered: {results} ({time.monotonic() - started:.1f} s in all)")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
