"""Faults as data: what goes wrong, on which rank, at which op.

Owns: :class:`Fault` and its :class:`Kind`, :class:`FaultPlan` (a seeded
plan, :meth:`FaultPlan.random`, replays exactly from its seed), and the
:class:`Injector` the harness installs in a rank's process before the code
under test runs (that code is not edited). Network faults (partition,
isolate, drop, loss) are carried out by the harness, asked through the
rank's control pipe (their rules: ``_net.py``). See docs/testing.md,
"Faults as data".
"""

from __future__ import annotations

import enum
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._protocol import HEADER, MAGIC, VERSION
from .._protocol import Kind as ProtoKind
from .._runtime import faults as _seam
from .._runtime.loop import get_runtime
from .._runtime.native import Done, NativeOp
from .._runtime.table import peek

log = logging.getLogger("ftcomm")


class Kind(enum.StrEnum):
    """What a :class:`Fault` does to its op."""

    KILL = "kill"
    """SIGKILL the rank's process just before it issues the op."""
    STOP = "stop"
    """SIGSTOP the rank's process just before it issues the op (a hung host);
    the harness SIGKILLs it once the other ranks are done."""
    HANG = "hang"
    """The op is never issued and never completes (a rank stuck in its own code);
    the op's deadline then ends it on this rank."""
    DELAY = "delay"
    """The op is issued, and its completion reaches the caller ``seconds`` late."""
    ERROR = "error"
    """The op is issued, and then fails on this rank with ``message``."""
    BREAK_STORE = "break_store"
    """The world's store stops taking connections just before the op (which then
    runs): every later ``configure()``, on any rank, fails."""
    WORKER_KILL = "worker_kill"
    """SIGKILL the group's worker process (``subprocess=True``), then issue the
    op: it fails with ``WorkerDied``."""
    WORKER_STOP = "worker_stop"
    """SIGSTOP the group's worker, then issue the op: its deadline kills the
    worker, and it fails with ``CommTimeout``."""
    WORKER_CLOSE = "worker_close"
    """Close the parent's end of the socket to the worker, then issue the op:
    the worker exits, and the op fails with ``WorkerDied``."""
    CORRUPT_FRAME = "corrupt_frame"
    """Send the worker a malformed frame, then issue the op: the worker
    rejects it and exits, and the op fails with ``ProtocolError``."""
    PARTITION = "partition"
    """Drop every packet between the rank's host and the other ranks' hosts,
    both ways, then issue the op; with ``store=False`` the store's too
    (``store=True`` keeps it: a gray failure). Network faults need a world
    with ``network=True`` and last until ``seconds`` have passed (0: until
    the world ends)."""
    ISOLATE = "isolate"
    """The rank's host loses the network (every packet on its link, both
    ways; its own loopback keeps working), then the op is issued."""
    DROP = "drop"
    """Drop the packets the rank sends to the other ranks (``direction="out"``)
    or those it gets from them (``"in"``), then issue the op."""
    LOSS = "loss"
    """Drop a random share ``rate`` of the packets between the rank and the
    other ranks, both ways, then issue the op."""


WORKER_KINDS = frozenset(
    {Kind.WORKER_KILL, Kind.WORKER_STOP, Kind.WORKER_CLOSE, Kind.CORRUPT_FRAME}
)
NETWORK_KINDS = frozenset({Kind.PARTITION, Kind.ISOLATE, Kind.DROP, Kind.LOSS})
DIRECTIONS = ("out", "in")


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: ``kind`` at op ``op`` of ``rank`` (docs/testing.md).

    Each kind has its constructor: ``Fault.kill(rank, op)``, ``Fault.delay(rank,
    op, seconds)``, ... A fault that fires logs a warning naming it and its op.

    Args:
        kind: what the fault does to its op.
        rank: the rank whose op it strikes.
        op: the index of that op among the rank's ops, counted from 0 over all
            its groups and configurations (not an error's ``seq``, which counts
            from 1 within one configuration).
        seconds: a delay's length, or how long a network fault lasts (0: until
            the world ends).
        message: an error fault's message.
        store: whether a partition keeps the store reachable.
        direction: which way a drop cuts: ``"out"`` or ``"in"``.
        rate: a loss's share of the packets lost, between 0 and 1.

    Raises:
        TypeError: ``kind`` is not a :class:`Kind`, or a network fault's
            argument has the wrong type.
        ValueError: a value out of range, or an argument its kind does not take.
    """

    kind: Kind
    rank: int
    op: int
    seconds: float = 0.0
    message: str = "injected fault"
    store: bool = True
    direction: str = "out"
    rate: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise TypeError(f"kind must be a Kind, got {type(self.kind).__name__}")
        for name in ("rank", "op"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.kind is Kind.DELAY and not self.seconds > 0:
            raise ValueError(f"a delay needs seconds > 0, got {self.seconds!r}")
        self._check_network()

    def _check_network(self) -> None:
        kind = self.kind
        if self.store is not True and kind is not Kind.PARTITION:
            raise ValueError(f"store= is for partition faults, not {kind.value}")
        if self.direction != "out" and kind is not Kind.DROP:
            raise ValueError(f"direction= is for drop faults, not {kind.value}")
        if self.rate != 0.0 and kind is not Kind.LOSS:
            raise ValueError(f"rate= is for loss faults, not {kind.value}")
        if kind not in NETWORK_KINDS:
            return
        if not _is_number(self.seconds):
            raise TypeError(f"seconds must be a number, got {type(self.seconds).__name__}")
        if not 0 <= self.seconds < float("inf"):
            raise ValueError(
                f"seconds must be finite and >= 0 (0: never healed), got {self.seconds}"
            )
        if not isinstance(self.store, bool):
            raise TypeError(f"store must be a bool, got {type(self.store).__name__}")
        if not isinstance(self.direction, str):
            raise TypeError(f"direction must be a str, got {type(self.direction).__name__}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'out' or 'in', got {self.direction!r}")
        if kind is Kind.LOSS:
            if not _is_number(self.rate):
                raise TypeError(f"rate must be a number, got {type(self.rate).__name__}")
            if not 0 < self.rate < 1:
                raise ValueError(f"rate must be > 0 and < 1, got {self.rate}")

    def __str__(self) -> str:
        extra = f" {self.seconds:g}s" if self.kind is Kind.DELAY else ""
        extra += f" {self.message!r}" if self.kind is Kind.ERROR else ""
        if self.kind is Kind.LOSS:
            extra += f" rate {self.rate:g}"
        if self.kind is Kind.DROP:
            extra += f" {self.direction}"
        if self.kind is Kind.PARTITION and not self.store:
            extra += " store cut too"
        if self.kind in NETWORK_KINDS:
            extra += f" for {self.seconds:g}s" if self.seconds > 0 else " until the end"
        return f"{self.kind.value}(rank {self.rank}, op {self.op}{extra})"

    @classmethod
    def kill(cls, rank: int, op: int) -> Fault:
        return cls(Kind.KILL, rank, op)

    @classmethod
    def stop(cls, rank: int, op: int) -> Fault:
        return cls(Kind.STOP, rank, op)

    @classmethod
    def hang(cls, rank: int, op: int) -> Fault:
        return cls(Kind.HANG, rank, op)

    @classmethod
    def delay(cls, rank: int, op: int, seconds: float) -> Fault:
        return cls(Kind.DELAY, rank, op, seconds=seconds)

    @classmethod
    def error(cls, rank: int, op: int, message: str = "injected fault") -> Fault:
        return cls(Kind.ERROR, rank, op, message=message)

    @classmethod
    def break_store(cls, rank: int, op: int) -> Fault:
        return cls(Kind.BREAK_STORE, rank, op)

    @classmethod
    def worker_kill(cls, rank: int, op: int) -> Fault:
        return cls(Kind.WORKER_KILL, rank, op)

    @classmethod
    def worker_stop(cls, rank: int, op: int) -> Fault:
        return cls(Kind.WORKER_STOP, rank, op)

    @classmethod
    def worker_close(cls, rank: int, op: int) -> Fault:
        return cls(Kind.WORKER_CLOSE, rank, op)

    @classmethod
    def corrupt_frame(cls, rank: int, op: int) -> Fault:
        return cls(Kind.CORRUPT_FRAME, rank, op)

    @classmethod
    def partition(cls, rank: int, op: int, seconds: float = 0.0, store: bool = True) -> Fault:
        """Cut ``rank``'s host off from the other ranks' (both ways) at op
        ``op``, for ``seconds`` (0: until the world ends); the store stays
        reachable unless ``store=False``.

        Raises:
            TypeError: ``seconds`` is not a number, or ``store`` not a bool.
            ValueError: ``rank`` or ``op`` < 0, ``seconds`` < 0 or not finite.
        """
        return cls(Kind.PARTITION, rank, op, seconds=seconds, store=store)

    @classmethod
    def isolate(cls, rank: int, op: int, seconds: float = 0.0) -> Fault:
        """``rank``'s host loses the network at op ``op`` (all but its own
        loopback), for ``seconds`` (0: until the world ends).

        Raises:
            TypeError: ``seconds`` is not a number.
            ValueError: ``rank`` or ``op`` < 0, ``seconds`` < 0 or not finite.
        """
        return cls(Kind.ISOLATE, rank, op, seconds=seconds)

    @classmethod
    def drop(cls, rank: int, op: int, seconds: float = 0.0, direction: str = "out") -> Fault:
        """Drop what ``rank`` sends to the other ranks (``direction="out"``)
        or gets from them (``"in"``) from op ``op`` on, for ``seconds``
        (0: until the world ends).

        Raises:
            TypeError: ``seconds`` is not a number, or ``direction`` not a str.
            ValueError: ``rank`` or ``op`` < 0, ``seconds`` < 0 or not
                finite, ``direction`` neither ``"out"`` nor ``"in"``.
        """
        return cls(Kind.DROP, rank, op, seconds=seconds, direction=direction)

    @classmethod
    def loss(cls, rank: int, op: int, rate: float, seconds: float = 0.0) -> Fault:
        """Lose a random share ``rate`` of the packets between ``rank`` and
        the other ranks (each way) from op ``op`` on, for ``seconds`` (0:
        until the world ends).

        Raises:
            TypeError: ``rate`` or ``seconds`` is not a number.
            ValueError: ``rank`` or ``op`` < 0, ``rate`` not strictly
                between 0 and 1, ``seconds`` < 0 or not finite.
        """
        return cls(Kind.LOSS, rank, op, seconds=seconds, rate=rate)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class FaultPlan:
    """The faults of one world, and the seed that made them (if random).

    Args:
        faults: the faults, at most one per rank and op.
        seed: the seed :meth:`random` drew them from (``None``: not drawn).

    Raises:
        TypeError: ``faults`` holds something that is not a :class:`Fault`.
        ValueError: two faults at one rank and op.
    """

    faults: tuple[Fault, ...] = ()
    seed: int | None = None
    _by_key: dict[tuple[int, int], Fault] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_key: dict[tuple[int, int], Fault] = {}
        for fault in self.faults:
            if not isinstance(fault, Fault):
                raise TypeError(f"faults must hold Fault records, got {type(fault).__name__}")
            key = (fault.rank, fault.op)
            if key in by_key:
                raise ValueError(f"two faults at rank {fault.rank}, op {fault.op}")
            by_key[key] = fault
        object.__setattr__(self, "_by_key", by_key)

    @classmethod
    def of(cls, *faults: Fault) -> FaultPlan:
        return cls(tuple(faults))

    @classmethod
    def random(
        cls,
        seed: int,
        world_size: int,
        ops: int,
        *,
        delay_rate: float = 0.05,
        error_rate: float = 0.0,
        max_delay: float = 0.05,
        kills: int = 0,
        spare: Iterable[int] = (0,),
    ) -> FaultPlan:
        """A plan drawn from ``seed``: the same seed gives the same plan.

        Each of the first ``ops`` ops of each rank is delayed with probability
        ``delay_rate`` (by up to ``max_delay`` s) or fails with probability
        ``error_rate``; ``kills`` ranks (never one in ``spare``) are killed at
        a random op.

        Args:
            seed: the seed of the plan's random generator.
            world_size: how many ranks the world has.
            ops: how many of each rank's first ops may get a fault.
            delay_rate: the chance that an op is delayed.
            error_rate: the chance that an op fails.
            max_delay: the longest delay, in seconds.
            kills: how many ranks are killed, each at a random op.
            spare: the ranks never killed.
        """
        rng = random.Random(seed)
        faults: list[Fault] = []
        spared = set(spare)
        killable = [r for r in range(world_size) if r not in spared]
        victims = rng.sample(killable, min(kills, len(killable)))
        for rank in range(world_size):
            # Not at op 0 when there is room: a world that dies before its
            # first collective tests little.
            kill_at = rng.randrange(min(1, ops - 1), ops) if rank in victims and ops else None
            for op in range(ops):
                if op == kill_at:
                    faults.append(Fault.kill(rank, op))
                    break
                draw = rng.random()
                if draw < delay_rate:
                    faults.append(Fault.delay(rank, op, round(rng.uniform(0.001, max_delay), 4)))
                elif draw < delay_rate + error_rate:
                    faults.append(Fault.error(rank, op, f"injected error {rank}/{op}"))
        return cls(tuple(faults), seed)

    def for_rank(self, rank: int) -> dict[int, Fault]:
        """This rank's faults by op index."""
        return {op: f for (r, op), f in self._by_key.items() if r == rank}

    def unfired(self, rank: int, fired: Iterable[int]) -> list[int]:
        """The ops of ``rank``'s faults not in ``fired``, for a plan that must
        fire them all (explicit); a seeded random plan may draw faults past
        where a rank stops, so it has none."""
        if self.seed is not None:
            return []
        return sorted(set(self.for_rank(rank)) - set(fired))

    def ranks_that(self, *kinds: Kind) -> set[int]:
        return {f.rank for f in self.faults if f.kind in kinds}

    def __str__(self) -> str:
        head = f"FaultPlan(seed={self.seed})" if self.seed is not None else "FaultPlan"
        return f"{head}: " + (", ".join(map(str, self.faults)) or "no faults")


# -- inside a rank ---------------------------------------------------------------
class _NeverOp:
    """An op that never completes: only its deadline (or an abort) ends it."""

    def poll(self) -> bool:
        return False

    def outcome(self) -> BaseException | None:
        return None

    def on_done(self, callback: Done) -> None:
        pass


class _LateOp:
    """The real op, whose completion reaches the caller ``seconds`` late."""

    def __init__(self, inner: NativeOp, seconds: float) -> None:
        self._inner = inner
        self._ready_at = time.monotonic() + seconds

    def poll(self) -> bool:
        return time.monotonic() >= self._ready_at and self._inner.poll()

    def peek(self) -> bool:  # poll() without the inner op's side effects
        return time.monotonic() >= self._ready_at and peek(self._inner)

    def outcome(self) -> BaseException | None:
        return self._inner.outcome()

    def on_done(self, callback: Done) -> None:
        def later(error: BaseException | None) -> None:
            wait = self._ready_at - time.monotonic()
            if wait <= 0:
                callback(error)
            else:  # a timer on the owner loop, not a thread per delayed op
                rt = get_runtime()
                rt.call_soon(lambda: rt.loop.call_later(wait, callback, error))

        self._inner.on_done(later)


class _FailedOp:
    """The real op, reported as failed once it ends."""

    def __init__(self, inner: NativeOp, message: str) -> None:
        self._inner = inner
        self._error = RuntimeError(message)

    def poll(self) -> bool:
        return self._inner.poll()

    def peek(self) -> bool:  # poll() without the inner op's side effects
        return peek(self._inner)

    def outcome(self) -> BaseException | None:
        return self._error

    def on_done(self, callback: Done) -> None:
        self._inner.on_done(lambda _: callback(self._error))


class Injector:
    """Applies one rank's faults to the ops its groups issue.

    ``control``: a pipe to the harness, for faults it carries out (the
    store, the network: ``_net.py``).
    """

    def __init__(self, faults: dict[int, Fault], control: Any = None) -> None:
        self.faults = faults
        self.control = control
        self.issued = 0
        self.applied: list[Fault] = []

    def __call__(self, op: str, issue: _seam.Issue, backend: object = None) -> NativeOp:
        index, self.issued = self.issued, self.issued + 1
        fault = self.faults.get(index)
        if fault is None:
            return issue()
        self.applied.append(fault)
        log.warning(
            "ftcomm.testing: %s fires at %s (this rank's op %d, counted from 0 across its "
            "groups; an error's seq counts from 1 in each configuration)",
            fault,
            op,
            index,
        )
        if fault.kind in WORKER_KINDS:
            _hurt_worker(fault.kind, backend)
            return issue()
        if fault.kind in (Kind.KILL, Kind.STOP):
            self._tell(("fired", index))  # the harness tells a planned death from a crash
            os.kill(os.getpid(), signal.SIGKILL if fault.kind is Kind.KILL else signal.SIGSTOP)
            return issue()  # stopped, then continued by someone: carry on
        if fault.kind is Kind.HANG:
            return _NeverOp()
        if fault.kind is Kind.DELAY:
            return _LateOp(issue(), fault.seconds)
        if fault.kind is Kind.BREAK_STORE:
            self._tell("break_store")
            return issue()
        if fault.kind in NETWORK_KINDS:
            reply = self._tell(("network", fault))
            if reply != "done":  # the op fails as not issued, saying why
                raise RuntimeError(f"ftcomm.testing could not apply {fault}: {reply}")
            return issue()
        return _FailedOp(issue(), fault.message)

    def _tell(self, message: object) -> object:
        """Tell the harness, and wait until it has acted; its answer."""
        if self.control is None:
            raise RuntimeError("this fault needs a world run by ftcomm.testing.run_world")
        self.control.send(message)
        answer: object = self.control.recv()
        return answer


def _hurt_worker(kind: Kind, backend: object) -> None:
    from ..backends.subprocess import SubprocessBackend

    if not isinstance(backend, SubprocessBackend):
        raise RuntimeError(f"a {kind.value} fault needs a group with subprocess=True")
    worker = backend.worker
    if kind is Kind.WORKER_KILL:
        os.kill(worker.pid, signal.SIGKILL)
        # Issue only once the worker is gone: the op meets a dead worker.
        worker.proc.wait()
    elif kind is Kind.WORKER_STOP:
        os.kill(worker.pid, signal.SIGSTOP)
    elif kind is Kind.WORKER_CLOSE:
        worker.channel.sock.shutdown(socket.SHUT_RDWR)
    else:
        # A valid header whose payload is not JSON: the worker's decoder
        # refuses it as soon as it has read it.
        bad = b"not json"
        worker.channel.send_bytes(HEADER.pack(MAGIC, VERSION, ProtoKind.OP, 1, len(bad)) + bad)


def install(plan: FaultPlan, rank: int, control: Any = None) -> Injector:
    """Install ``rank``'s faults from ``plan`` in this process."""
    injector = Injector(plan.for_rank(rank), control)
    _seam.set_injector(injector)
    return injector
