"""The processes of the chaos soak: a member training with ``ftcomm.Membership``,
and a replica training with torchft's Manager, on the same small model.

Owns: :class:`Settings` (what every process of a soak runs with), the model a
member trains (:class:`Model`: its state, a step's gradient and update, the
digest of its parameters), what a member tells the bench and when (the
messages: :func:`ftcomm_member`), and the two training loops.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import os
import time
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from .fleet import install_dumps, stacks_file
from .membership import _fail, _OnPurpose, _take_env
from .runner import _LOOP_ENV, run_on

TICK = 1.0
"""Seconds between two ``tick`` messages of a member that steps."""
MOMENTUM = 0.9
LR = 0.01


@dataclass(frozen=True)
class Settings:
    """What every process of a soak runs with (pickled to each)."""

    numel: int
    """fp32 parameters of the model (as many of momentum)."""
    heartbeat_timeout: float
    join_window: float
    op_deadline: float
    """Each allreduce's deadline (torchft: its Manager's timeout)."""
    timeout: float
    """Every membership call's deadline (torchft: its quorum's)."""
    loop: str = "asyncio"
    max_size: int | None = None
    stacks: str = ""
    """A folder for each member's stacks, written when the bench asks (a stall)."""


class Model:
    """``numel`` parameters (the same on every member at step 0) and their
    momentum. A step: the gradient (the parameters scaled by a constant of
    the member's own, and a flag: whether this member wants to stop) is
    averaged over the world, then applied with momentum."""

    def __init__(self, numel: int, member: str) -> None:
        self.params = torch.linspace(-1.0, 1.0, numel)
        self.momentum = torch.zeros(numel)
        self.buf = torch.zeros(numel + 1)  # the gradient, then the stop flag
        self._grad = self.buf[:numel]
        index = int("".join(c for c in member if c.isdigit()) or "0")
        self._scale = (index + 1) * 1e-3

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return {"params": self.params, "momentum": self.momentum}

    def gradient(self, stop: bool) -> torch.Tensor:
        torch.mul(self.params, self._scale, out=self._grad)
        self.buf[-1] = 1.0 if stop else 0.0
        return self.buf

    def update(self, divide: float) -> bool:
        """Apply the reduced gradient (divided by ``divide``); whether a
        member of the world asked to stop."""
        if divide != 1:
            self._grad.div_(divide)
        self.momentum.mul_(MOMENTUM).add_(self._grad)
        self.params.sub_(self.momentum, alpha=LR)
        return bool(self.buf[-1].item() > 0)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Take ``state`` (a copy received), unless it is this model's own tensors."""
        for name, mine in self.state.items():
            got = state[name]
            if got is not mine:
                mine.copy_(got)

    def digest(self) -> str:
        h = hashlib.sha256()
        for tensor in (self.params, self.momentum):
            h.update(tensor.numpy().tobytes())
        return h.hexdigest()


class StepLog:
    """When each good step ended: the step held at any time since."""

    def __init__(self) -> None:
        self._times: list[float] = []
        self._steps: list[int] = []

    def add(self, t: float, step: int) -> None:
        self._times.append(t)
        self._steps.append(step)

    def at(self, t: float | None) -> int | None:
        if t is None:
            return None
        i = bisect.bisect_right(self._times, t)
        return self._steps[i - 1] if i else None


class Inbox:
    """The bench's messages, read between steps without blocking."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.stop_at: float | None = None

    def read(self, step: int) -> None:
        while self._conn.poll():
            message = self._conn.recv()
            if message[0] == "go":
                self._conn.send(("went", step))
            elif message[0] == "stop":
                self.stop_at = float(message[1])


def _until_exit(conn: Connection) -> None:
    """Wait for the bench's ``exit`` (or its end of the pipe closing)."""
    try:
        while conn.recv()[0] != "exit":
            pass
    except EOFError:
        pass


def _enter(env: dict[str, str], settings: Settings) -> None:
    """A process forked from the fork server: the bench's environment, one
    torch thread (many members share two cores)."""
    _take_env(env)
    os.environ[_LOOP_ENV] = settings.loop  # ftcomm's owner loop matches the caller's
    torch.set_num_threads(1)


# -- an ftcomm member -----------------------------------------------------------------
def ftcomm_member(
    address: str,
    job: str,
    member: str,
    settings: Settings,
    host: tuple[str, str] | None,
    env: dict[str, str],
    conn: Connection,
) -> None:
    """A member's process: train until the bench says stop, then say how it ended.

    ``host``: the network namespace it lives in and its address there
    (``None``: the bench's own network), entered before any thread starts
    (those inherit it); Gloo listens on that address.

    What a process (this one, and :func:`torchft_replica`) sends the bench
    over ``conn`` (every time is ``time.monotonic()``, one clock for every
    process of the host):

    - ``("gen", generation, size, step, t)``: it is in a new generation (for
      torchft: a new quorum id, or a new count of participants), at ``step``;
    - ``("first", generation, t, before)``: its first good step in that
      generation, and when its good step before it ended (``None``: it had
      none);
    - ``("evicted", t, cut_off)``: the others went on without it (it was
      taken for dead; ``cut_off``: it was alive but could not reach them, a
      network fault): it joins again;
    - ``("timeout", t, text)``: its ``join()``/``recover()`` ran out of time
      (a stall: it calls it again);
    - ``("tick", step, generation)``: every second of steps (it is not stuck);
    - ``("went", step)``: the step it held when the bench said ``go`` (the
      measured window starts there);
    - ``("done", step_at_end, step, digest)``: it stopped with the others at
      ``step``; ``step_at_end``: the step it held at the window's end
      (``None`` if it was not in a world then); ``digest``: its parameters'
      and momentum's SHA-256;
    - ``("error", traceback)`` (membership's ``_fail``).

    The bench sends ``("go",)`` once the world is full, and ``("stop",
    t_end)`` once the window is over and the world is full again: every
    process then sets a flag in its next allreduce, and all stop at the step
    whose reduced flag is set (the same step on all of them). Each stays a
    member until the bench sends ``("exit",)``, once every one of them is done.
    """
    _enter(env, settings)
    if host is not None:
        from ..backends.gloo import HOST_ENV
        from ..testing._net import enter

        enter(host[0])
        os.environ[HOST_ENV] = host[1]
    logging.getLogger("ftcomm").addFilter(_OnPurpose())
    try:
        run_on(settings.loop, _ftcomm_train(address, job, member, settings, conn))
    except BaseException:
        _fail(conn)


async def _ftcomm_train(
    address: str, job: str, member: str, settings: Settings, conn: Connection
) -> None:
    import ftcomm

    model, log, inbox = Model(settings.numel, member), StepLog(), Inbox(conn)
    if settings.stacks:
        install_dumps(stacks_file(settings.stacks, member))
    async with (
        ftcomm.Membership(
            address,
            job,
            member,
            min_size=1,
            max_size=settings.max_size,
            join_window=settings.join_window,
            heartbeat_timeout=settings.heartbeat_timeout,
            timeout=settings.timeout,
        ) as members,
        ftcomm.Group("gloo", timeout=settings.op_deadline) as group,
    ):

        async def regroup(step: int, *, join: bool = False) -> tuple[ftcomm.World, int]:
            """join() or recover(), then the state from the members ahead
            (recover() again while a copy fails; join() again once evicted)."""
            while True:
                try:
                    world = await (members.join(group) if join else members.recover(group))
                except ftcomm.Evicted as exc:  # the others went on without it: come back
                    conn.send(("evicted", time.monotonic(), exc.cut_off))
                    join = True
                    continue
                except ftcomm.MembershipTimeout as exc:  # again, from where it got to
                    conn.send(("timeout", time.monotonic(), str(exc)))
                    continue
                conn.send(("gen", world.generation, world.size, step, time.monotonic()))
                try:
                    state, step = await members.sync_state(model.state, step)
                except ftcomm.CommError:
                    join = False
                    continue
                model.load(state)
                return world, step

        world, step = await regroup(0, join=True)
        first = True
        before: float | None = None
        ticked = time.monotonic()
        while True:
            inbox.read(step)
            buf = model.gradient(inbox.stop_at is not None)
            try:
                await group.allreduce(buf, timeout=settings.op_deadline)
            except ftcomm.CommError:
                world, step = await regroup(step)
                first = True
                continue
            stop = model.update(world.size)
            step += 1
            now = time.monotonic()
            log.add(now, step)
            if first:
                conn.send(("first", world.generation, now, before))
                first = False
            elif now - ticked >= TICK:
                conn.send(("tick", step, world.generation))
                ticked = now
            before = now
            if stop:
                break
            if await members.pending():
                world, step = await regroup(step)
                first = True
        conn.send(("done", log.at(inbox.stop_at), step, model.digest()))
        # still a member until every member is done: one that left now would
        # look dead to those still finishing the last step, and abort theirs
        await asyncio.get_running_loop().run_in_executor(None, _until_exit, conn)


# -- a torchft replica ----------------------------------------------------------------
def torchft_replica(
    lighthouse: str,
    job: str,
    member: str,
    settings: Settings,
    env: dict[str, str],
    conn: Connection,
) -> None:
    """A torchft replica's process: the same model and steps through torchft's
    Manager (its ProcessGroupGloo, its PGTransport for the state)."""
    _enter(env, settings)
    os.environ.setdefault("RUST_LOG", "error")  # before torchft's import
    # the failures the bench causes, logged with their tracebacks; and the
    # warnings of torchft's own PGTransport (a read-only buffer, a deprecation)
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", module=r"torchft\.")
    try:
        _torchft_train(lighthouse, member, settings, conn)
    except BaseException:
        _fail(conn)


def _torchft_train(lighthouse: str, member: str, settings: Settings, conn: Connection) -> None:
    from .torchft_rows import manager_replica

    model, log, inbox = Model(settings.numel, member), StepLog(), Inbox(conn)
    manager, _replica_store = manager_replica(  # (the store: held while it runs)
        lighthouse,
        member,  # torchft adds an id of the incarnation's own
        min_size=1,
        load_state_dict=model.load,
        state_dict=lambda: model.state,
        op_deadline=settings.op_deadline,
        quorum_timeout=settings.timeout,
        heartbeat_timeout=settings.heartbeat_timeout,
    )
    seen: tuple[int, int] | None = None
    before: float | None = None
    try:
        while True:
            inbox.read(manager.current_step())
            manager.start_quorum()
            buf = model.gradient(inbox.stop_at is not None)
            manager.allreduce(buf).wait()  # the average; a failure is the Manager's, not raised
            if not manager.should_commit():
                continue
            stop = model.update(1)
            step, now = manager.current_step(), time.monotonic()
            log.add(now, step)
            quorum = (int(getattr(manager, "_quorum_id", -1)), manager.num_participants())
            if quorum != seen:
                conn.send(("gen", quorum[0], quorum[1], step, now))
                if seen is None or quorum[0] != seen[0]:
                    conn.send(("first", quorum[0], now, before))
                seen = quorum
            before = now
            if stop:
                break
        conn.send(("done", log.at(inbox.stop_at), manager.current_step(), model.digest()))
        _until_exit(conn)  # (see _ftcomm_train)
    finally:
        manager.shutdown(wait=False)
