"""The shared runner: two spawned ranks time every case's ops in rounds.

Owns what is measured and what comes back (:class:`Workload`, :class:`Plan`,
:class:`Report`), the two ways a case issues and times ops on a rank
(:class:`BlockingRunner`, :class:`AwaitingRunner`), and the run itself: the
parent's (:func:`_run_children`) and each rank's (:func:`_measure`). A case
reaches the ranks in the plan, as the module-level function that opens it
(:attr:`Plan.opens`, pickled by name).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from .._server import serve_store

WORLD_SIZE = 2
HOST = "127.0.0.1"
_STORE_TIMEOUT = timedelta(seconds=60)
_OP_TIMEOUT = 60.0
_TURN_WARMUP = 2
"""Untimed ops before each turn but a round's first (which has ``warmup``)."""
_LOOP_ENV = "FTCOMM_LOOP"

Seconds = list[float]


# -- what is measured ------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One op at one size, timed per op.

    ``iters`` and ``warmup`` count ops per case per round; ``bandwidth``
    reports GB/s (bytes / p50) instead of the tail.
    """

    label: str
    op: str
    numel: int
    iters: int
    warmup: int
    bandwidth: bool = False
    burst: int = 0
    """``> 0``: one timed sample is ``burst`` one-element ops on views of the
    tensor (the ``"allreduce_burst"`` op); its ratio is a speed-up over raw."""
    chunk: int = 0
    """``> 0``: within a round, the cases take turns every ``chunk`` ops
    (``warmup`` ops before the first turn, two before each later one), not
    one block of ``iters`` each."""

    @property
    def nbytes(self) -> int:
        return self.numel * 4  # fp32


@dataclass(frozen=True)
class Plan:
    """Everything a child needs to run its part (pickled to it)."""

    loop: str
    rounds: int
    cases: tuple[str, ...]
    workloads: tuple[Workload, ...]
    pin: bool = False
    """Each rank on one CPU of its own (``--pin``; see :func:`pin_rank`)."""
    opens: Mapping[str, Opener] = field(default_factory=dict, repr=False, compare=False)
    """How each case builds its runner on a rank, by name: the ``open`` of its
    case (module-level functions: they are pickled by name). Every case of
    ``cases`` has one (checked before any rank starts)."""

    def __post_init__(self) -> None:
        missing = [case for case in self.cases if case not in self.opens]
        if missing:  # a bug in the bench, said here rather than in a child
            raise ValueError(f"no opener for the cases {missing} in the plan")


@dataclass
class Report:
    """Rank 0's latencies (seconds per op), keyed by (workload label, case), and
    what failed on any rank without stopping the run (a case that did not close
    cleanly)."""

    latencies: dict[tuple[str, str], Seconds] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


# -- runners: how one implementation issues and times ops ------------------------------
class Runner:
    """An implementation, set up on this rank, ready to time ops."""

    ops: Mapping[str, Any]

    async def time_ops(self, op: str, tensor: torch.Tensor, iters: int) -> Seconds:
        """Issue ``op`` on ``tensor`` ``iters`` times, one after another; each op's seconds."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release the implementation's group (every rank, after the last barrier)."""


T = TypeVar("T")


def run_on(loop: str, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on a new event loop of kind ``loop`` (a
    bench process's: ``"uvloop"`` or ``"asyncio"``)."""
    if loop == "uvloop":
        import uvloop

        result: T = uvloop.run(coro)
        return result
    return asyncio.run(coro)


def _pick(ops: Mapping[str, Any], op: str, impl: str) -> Any:
    try:
        return ops[op]
    except KeyError:
        raise ValueError(f"the {impl} case has no {op!r} op") from None


class BlockingRunner(Runner):
    """Ops that block the caller until they end (``pg.allreduce([t]).wait()``)."""

    def __init__(
        self,
        impl: str,
        ops: Mapping[str, Callable[[torch.Tensor], object]],
        close: Callable[[], object] | None = None,
    ) -> None:
        self.impl = impl
        self.ops = ops
        self._close = close

    async def time_ops(self, op: str, tensor: torch.Tensor, iters: int) -> Seconds:
        fn: Callable[[torch.Tensor], object] = _pick(self.ops, op, self.impl)
        clock = time.perf_counter
        out = [0.0] * iters
        for i in range(iters):
            start = clock()
            fn(tensor)
            out[i] = clock() - start
        return out

    async def close(self) -> None:
        if self._close is not None:
            self._close()


class AwaitingRunner(Runner):
    """Ops awaited on the running event loop (``await group.allreduce(t)``)."""

    def __init__(
        self,
        impl: str,
        ops: Mapping[str, Callable[[torch.Tensor], Awaitable[object]]],
        close: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.impl = impl
        self.ops = ops
        self._close = close

    async def time_ops(self, op: str, tensor: torch.Tensor, iters: int) -> Seconds:
        fn: Callable[[torch.Tensor], Awaitable[object]] = _pick(self.ops, op, self.impl)
        clock = time.perf_counter
        out = [0.0] * iters
        for i in range(iters):
            start = clock()
            await fn(tensor)
            out[i] = clock() - start
        return out

    async def close(self) -> None:
        if self._close is not None:
            await self._close()


@dataclass(frozen=True)
class ChildEnv:
    """What a case may use to set itself up on one rank."""

    rank: int
    port: int
    store: Store  # a client of the parent's store, shared by the cases

    def store_addr(self, prefix: str) -> str:
        return f"{HOST}:{self.port}/{prefix}"


Opener = Callable[[ChildEnv], Awaitable[Runner]]
"""What builds a case's runner on a rank (a case's ``open``)."""


# -- child side ------------------------------------------------------------------------
class _Barrier:
    """A store barrier between phases, independent of every case's group."""

    def __init__(self, store: Store) -> None:
        self._store = PrefixStore("bench-barrier", store)
        self._n = 0

    def __call__(self) -> None:
        self._n += 1
        key = f"b{self._n}"
        if self._store.add(key, 1) == WORLD_SIZE:
            self._store.set(f"{key}/open", "1")
        self._store.wait([f"{key}/open"])


async def _self_check(runner: Runner, impl: str) -> None:
    """An allreduce of ones must give the world size: a broken case must not look fast."""
    for op in runner.ops:  # each op on its own group (the burst row's is another)
        t = torch.ones(4, dtype=torch.float32)
        await runner.time_ops(op, t, 1)
        if not bool(torch.all(t == WORLD_SIZE)):
            raise RuntimeError(f"{impl}: {op} of ones gave {t.tolist()}, not {WORLD_SIZE}")


async def _measure(rank: int, port: int, plan: Plan, store: Store) -> Report:
    """One rank's part of the main table: it opens one runner per case of the
    plan (raw Gloo, ftcomm, torchft when it is installed, ...) and checks each
    (:func:`_self_check`), then times every workload in rounds, alternating
    the order of the cases from round to round, with a store barrier before
    every phase, so that drift on these noisy 2-core machines hits all the
    cases alike."""
    env = ChildEnv(rank, port, store)
    barrier = _Barrier(store)
    runners: dict[str, Runner] = {}
    report = Report()
    # One tensor per case and workload, kept across rounds: a case may change
    # its tensor's memory (sub+move moves it into shared memory) without
    # touching another's. They stay 0: no inf or denormals.
    tensors = {
        (w.label, impl): torch.zeros(w.numel, dtype=torch.float32)
        for w in plan.workloads
        for impl in plan.cases
    }
    try:
        for impl in plan.cases:
            runners[impl] = await plan.opens[impl](env)
            await _self_check(runners[impl], impl)
        for rnd in range(plan.rounds):
            order = list(plan.cases) if rnd % 2 == 0 else list(reversed(plan.cases))
            for w in plan.workloads:
                for turn, n in enumerate(_turns(w)):
                    for impl in order:
                        runner = runners[impl]
                        if w.op not in runner.ops:  # a workload only some cases run
                            continue
                        barrier()
                        tensor = tensors[(w.label, impl)]
                        # a later turn starts after the other cases' turns:
                        # a couple of untimed ops, so that p99 is not its start
                        warm = w.warmup if turn == 0 else min(w.warmup, _TURN_WARMUP)
                        if warm:
                            await runner.time_ops(w.op, tensor, warm)
                        lat = await runner.time_ops(w.op, tensor, n)
                        report.latencies.setdefault((w.label, impl), []).extend(lat)
        barrier()  # nobody tears down while a peer is still in an op
    finally:
        for impl, runner in runners.items():
            try:
                await runner.close()
            except Exception as exc:  # the times stand; the failure is reported with them
                report.failures.append(
                    f"rank {rank}, {impl}: close failed: {type(exc).__name__}: {exc}"
                )
    return report


def _turns(w: Workload) -> list[int]:
    """How many ops each case times per turn in one round of ``w``."""
    if w.chunk <= 0 or w.chunk >= w.iters:
        return [w.iters]
    whole, rest = divmod(w.iters, w.chunk)
    return [w.chunk] * whole + ([rest] if rest else [])


def pin_rank(rank: int) -> int:
    """Pin this process to one of the CPUs it may use, the ``rank``-th
    (cycling): every thread it has (importing torch starts some) and, by
    inheritance, every thread it starts later (Gloo's); torch's intra-op
    pool is cut to one thread to match. Returns that CPU. Linux only."""
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[rank % len(cpus)]
    os.sched_setaffinity(0, {cpu})  # this thread, and so the ones it starts
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), {cpu})
    torch.set_num_threads(1)
    return cpu


def _unpinnable() -> str | None:
    """Why ``--pin`` cannot work here, or ``None``."""
    if not hasattr(os, "sched_setaffinity"):
        return "--pin needs os.sched_setaffinity (Linux)"
    usable = len(os.sched_getaffinity(0))
    if usable < WORLD_SIZE:
        return f"--pin needs {WORLD_SIZE} CPUs, one per rank; this process may use {usable}"
    return None


def _child(rank: int, port: int, plan: Plan, conn: Connection) -> None:
    """A rank's process: measure, send its report (times: rank 0's only), exit
    (at once on failure)."""
    try:
        if plan.pin:  # first: the threads started below inherit it
            pin_rank(rank)
        os.environ[_LOOP_ENV] = plan.loop  # ftcomm's owner loop matches the caller's
        store = TCPStore(
            host_name=HOST,
            port=port,
            is_master=False,
            wait_for_workers=False,
            timeout=_STORE_TIMEOUT,
        )
        report = run_on(plan.loop, _measure(rank, port, plan, store))
        conn.send(report if rank == 0 else Report(failures=report.failures))
        conn.close()
    except BaseException:
        # A native op may still be in flight: a normal exit could block on the
        # group's destructor until its timeout. Leave now; the parent sees the code.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


# -- parent side -----------------------------------------------------------------------
class BenchFailed(Exception):
    """A child failed or the run took too long."""


def _run_children(plan: Plan, timeout: float) -> Report:
    """The main table's run: two ranks on loopback, each a spawned process
    (:func:`_child`); the parent hosts the ``TCPStore``, which the ranks
    join as clients, and returns rank 0's per-op latencies with every rank's
    failures (``report`` makes the table of medians, tails and ratios
    against raw Gloo).

    Raises:
        BenchFailed: a rank failed, or the run took longer than ``timeout``.
    """
    ctx = multiprocessing.get_context("spawn")
    store = serve_store(HOST)  # loopback only
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: dict[Connection, int] = {}
    try:
        for rank in range(WORLD_SIZE):
            recv_end, send_end = ctx.Pipe(duplex=False)
            child = ctx.Process(
                target=_child,
                args=(rank, store.port, plan, send_end),
                name=f"ftcomm-bench-rank{rank}",
            )
            procs.append(child)
            conns[recv_end] = rank
            child.start()
            send_end.close()  # the child holds the only write end: its exit gives EOF
        return _collect(procs, conns, time.monotonic() + timeout)
    finally:
        end_children(procs, conns)
        store.close()


def spawn_ranks(
    target: Callable[..., None],
    args: Sequence[tuple[Any, ...]],
    timeout: float,
    failed: type[Exception],
) -> list[Any]:
    """Run ``target(*args[rank], conn)`` in one spawned process per rank; each
    sends ``(kind, value)`` on ``conn`` (``kind`` ``"error"``: ``value`` is its
    traceback). Returns each rank's value, in rank order; the processes are
    reaped either way.

    Raises:
        failed: a rank raised (its traceback in the message), exited without
            an answer, or none came within ``timeout`` seconds.
    """
    ctx = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    conns: list[Connection] = []
    try:
        for rank_args in args:
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(*rank_args, send_end), daemon=True)
            proc.start()
            send_end.close()  # the child holds the only write end: its exit gives EOF
            procs.append(proc)
            conns.append(recv_end)
        deadline = time.monotonic() + timeout
        answers = []
        for rank, conn in enumerate(conns):
            if not conn.poll(max(deadline - time.monotonic(), 0.0)):
                raise failed(f"rank {rank} did not finish within {timeout:g} s")
            try:
                kind, value = conn.recv()
            except EOFError:
                raise failed(f"rank {rank} exited without an answer") from None
            if kind == "error":
                raise failed(f"rank {rank} failed:\n{value}")
            answers.append(value)
        return answers
    finally:
        end_children(procs, conns)


def end_children(
    procs: Sequence[multiprocessing.process.BaseProcess], conns: Iterable[Connection]
) -> None:
    """Stop the ranks still running (SIGTERM, SIGKILL 5 s later), reap every
    one, and close their pipes."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()
    for conn in conns:
        conn.close()


def _collect(
    procs: Sequence[multiprocessing.process.BaseProcess],
    conns: dict[Connection, int],
    deadline: float,
) -> Report:
    open_conns = dict(conns)
    replies: dict[int, object] = {}
    while True:
        for rank, proc in enumerate(procs):
            if proc.exitcode not in (None, 0):
                raise BenchFailed(f"rank {rank} exited with code {proc.exitcode}")
        alive = [proc for proc in procs if proc.exitcode is None]
        if not alive and not open_conns:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchFailed("the ranks did not finish in time (see --timeout)")
        ready = multiprocessing.connection.wait(
            [*open_conns, *(proc.sentinel for proc in alive)], remaining
        )
        for obj in ready:
            if not isinstance(obj, Connection):
                continue  # a sentinel: the exit code is read at the top
            rank = open_conns.pop(obj)
            with contextlib.suppress(EOFError):  # no reply: reported below
                replies[rank] = obj.recv()
    for rank in range(len(procs)):
        if rank not in replies:
            raise BenchFailed(f"rank {rank} exited without a reply")
    reports = [replies[rank] for rank in range(len(procs))]
    for rank, reply in enumerate(reports):
        if not isinstance(reply, Report):
            raise BenchFailed(f"rank {rank} sent {type(reply).__name__}, not a Report")
    report = reports[0]
    assert isinstance(report, Report)
    for other in reports[1:]:
        assert isinstance(other, Report)
        report.failures.extend(other.failures)
    return report
