"""``python -m ftcomm bench``: ftcomm against raw c10d Gloo, measured in one run.

Two ranks run on loopback as two spawned processes. The parent owns the
``TCPStore``; the children connect to it as clients. Every child builds one
runner per *case* (an implementation: raw Gloo, ftcomm, torchft when it is
installed), then measures every *workload* (an op at one size) in rounds,
alternating the order of the cases from round to round, with a store barrier
before every phase, so that drift on these noisy 2-core machines hits all the
cases alike. Rank 0 sends its per-op latencies to the parent, which prints one
table of medians, tails and ratios against raw Gloo; ``--json`` writes the same
figures as one JSON object, ``--plot`` draws the latency distributions
(matplotlib, ``pip install 'ftcomm[plot]'``).

Adding a row: add a :class:`Case` to :data:`CASES` (its ``open`` builds a
:class:`Runner` on every rank). Adding an op: add a :class:`Workload` in
:func:`workloads` and the op's name to every runner's ``ops``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from ._server import serve_store

WORLD_SIZE = 2
HOST = "127.0.0.1"
_STORE_TIMEOUT = timedelta(seconds=60)
_OP_TIMEOUT = 60.0
_SMALL_CHUNK = 50
"""Ops per turn of a case in the 1-float row (see :func:`workloads`)."""
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


# -- the cases --------------------------------------------------------------------------
class _Views:
    """The burst row's one-element tensors: views of the case's tensor, made
    once (a user's 1000 small tensors exist before they are reduced; making
    1000 views costs 0.5 ms, which raw and ftcomm alike are not timed for)."""

    def __init__(self) -> None:
        self._of: tuple[torch.Tensor, Sequence[torch.Tensor]] | None = None

    def of(self, t: torch.Tensor) -> Sequence[torch.Tensor]:
        if self._of is None or self._of[0] is not t:
            self._of = (t, t.split(1))  # type: ignore[no-untyped-call]
        return self._of[1]


async def _open_raw(env: ChildEnv) -> Runner:
    pg_gloo: Any = dist.ProcessGroupGloo
    opts = pg_gloo._Options()
    opts._timeout = timedelta(seconds=_OP_TIMEOUT)
    opts._devices = [pg_gloo.create_device(hostname=HOST)]
    pg: Any = pg_gloo(PrefixStore("raw", env.store), env.rank, WORLD_SIZE, opts)
    # The burst row on a group of its own, for every case: 1000 ops at once
    # warm a Gloo group up (measured: an ftcomm group's single-op p50 went
    # from ~200 µs to 130-180 µs after unfused bursts), and the single-op row
    # must not depend on which case's bursts ran on its group.
    burst_pg: Any = pg_gloo(PrefixStore("raw-burst", env.store), env.rank, WORLD_SIZE, opts)

    def allreduce(t: torch.Tensor) -> None:
        pg.allreduce([t]).wait()

    views = _Views()

    def allreduce_burst(t: torch.Tensor) -> None:
        for view in views.of(t):  # one after another: what raw c10d can do
            burst_pg.allreduce([view]).wait()

    return BlockingRunner("raw", {"allreduce": allreduce, "allreduce_burst": allreduce_burst})


async def _group_runner(
    env: ChildEnv,
    impl: str,
    prefix: str,
    burst: bool = False,
    single: bool = True,
    gather: Callable[..., Awaitable[object]] = asyncio.gather,
    **kwargs: Any,
) -> Runner:
    """An ftcomm.Group on Gloo (``kwargs``: its options), awaited op by op
    (``single``); ``burst``: it also runs the burst row, awaiting the ops
    with ``gather``."""
    import ftcomm

    groups: list[ftcomm.Group] = []

    async def new_group(name: str) -> ftcomm.Group:
        group = ftcomm.Group("gloo", timeout=_OP_TIMEOUT, **kwargs)
        groups.append(group)
        await group.configure(env.store_addr(name), env.rank, WORLD_SIZE)
        return group

    async def close() -> None:
        errors: list[BaseException] = []
        for group in groups:
            try:
                await group.shutdown()
            except Exception as exc:  # the others are shut down all the same
                errors.append(exc)
        if errors:
            raise errors[0]

    ops: dict[str, Callable[[torch.Tensor], Awaitable[object]]] = {}
    try:
        if single:
            ops["allreduce"] = (await new_group(prefix)).allreduce
        if burst:
            burst_group = await new_group(f"{prefix}-burst")  # its own: see _open_raw
            views = _Views()

            async def allreduce_burst(t: torch.Tensor) -> None:
                # every op issued before any is awaited (fused with fuse=True)
                await gather(*[burst_group.allreduce(view) for view in views.of(t)])

            ops["allreduce_burst"] = allreduce_burst
    except BaseException:
        await close()  # a group made before the one that failed
        raise
    return AwaitingRunner(impl, ops, close)


def _c10d_runner(
    env: ChildEnv,
    impl: str,
    prefix: str,
    pg: Any,
    close: Callable[[], object] | None = None,
) -> Runner:
    """A c10d-style group (ftcomm's facade, or torchft's), blocking op by op;
    ``close`` ends it (default: its ``shutdown``)."""
    from torch.distributed import AllreduceOptions

    pg.configure(env.store_addr(prefix), "0", env.rank, WORLD_SIZE)

    def allreduce(t: torch.Tensor) -> None:
        pg.allreduce([t], AllreduceOptions()).wait()  # what torch.distributed.all_reduce does

    return BlockingRunner(impl, {"allreduce": allreduce}, close or getattr(pg, "shutdown", None))


async def _open_ftcomm(env: ChildEnv) -> Runner:
    return await _group_runner(env, "ftcomm", "ftcomm-bench", burst=True)


async def _open_fused(env: ChildEnv) -> Runner:
    """``fuse=True``: concurrent small allreduces sent as one op."""
    return await _group_runner(env, "fused", "fused-bench", burst=True, fuse=True)


async def _open_fused_gather(env: ChildEnv) -> Runner:
    """``fuse=True``, the burst awaited with ``ftcomm.gather`` (no task per
    op); its single ops are the fused row's."""
    import ftcomm

    return await _group_runner(
        env, "fused+fg", "fused-fg-bench", burst=True, single=False, gather=ftcomm.gather, fuse=True
    )


async def _open_stats_off(env: ChildEnv) -> Runner:
    return await _group_runner(env, "stats-off", "stats-off-bench", stats=False)


async def _open_verified(env: ChildEnv) -> Runner:
    """``verify=True``: a descriptor allgather before every op."""
    return await _group_runner(env, "verify", "verify-bench", verify=True)


async def _open_subprocess(env: ChildEnv) -> Runner:
    return await _group_runner(
        env, "subproc", "subprocess-bench", subprocess=True, spare_worker=False
    )


async def _open_subprocess_moved(env: ChildEnv) -> Runner:
    """The subprocess backend opted in to moving large storages into shared
    memory (after a tensor's first op, it is reduced in place)."""
    return await _group_runner(
        env,
        "sub+move",
        "subprocess-move-bench",
        subprocess=True,
        spare_worker=False,
        share_min_bytes=1 << 20,
    )


async def _open_facade(env: ChildEnv) -> Runner:
    from .c10d import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=timedelta(seconds=_OP_TIMEOUT))
    return _c10d_runner(env, "facade", "facade-bench", pg)


async def _open_baby(env: ChildEnv) -> Runner:
    from .c10d import ProcessGroupBabyGloo

    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=_OP_TIMEOUT))
    return _c10d_runner(env, "baby", "baby-bench", pg)


def _torchft_missing() -> str | None:
    try:
        importlib.import_module("torchft.process_group")
    except Exception as exc:  # not installed, or broken: either way, no rows
        return f"import torchft failed ({type(exc).__name__}: {exc})"
    return None


async def _open_torchft(env: ChildEnv) -> Runner:
    pgs: Any = importlib.import_module("torchft.process_group")
    pg = pgs.ProcessGroupGloo(timeout=timedelta(seconds=_OP_TIMEOUT))
    return _c10d_runner(env, "torchft", "torchft-bench", pg)


def close_torchft_baby(pg: Any) -> None:
    """Shut a torchft ``ProcessGroupBaby`` down without its worker's tracebacks.

    torchft 0.2's ``shutdown()`` closes its pipes first and kills the worker
    after. The worker, blocked reading its request pipe, wakes to that EOF
    first: it logs "worker errored: EOFError", fails to send the error back
    (``BrokenPipeError``) and raises, and multiprocessing prints that as
    "Process SpawnProcess-N" with two tracebacks, for every group shut down.

    Here the pipe that torchft's future thread reads is closed first (that
    thread stops without a word on a closed pipe), then the worker is killed
    and reaped while its request pipe is still open, so it never sees an EOF,
    and only then does torchft's own ``shutdown()`` close the rest. A worker
    that had already exited before its shutdown died on its own: that is
    raised (after the shutdown), not hidden. Without those internals (another
    torchft), this is plain ``shutdown()``.
    """
    proc = getattr(pg, "_p", None)
    future_pipe = getattr(pg, "_future_pipe", None)
    code: int | None = None
    pid: int | None = None
    if proc is not None and future_pipe is not None:
        code, pid = proc.exitcode, proc.pid
        future_pipe.close()
        if code is None:
            proc.kill()
            proc.join(10)
    pg.shutdown()
    if code is not None:
        raise RuntimeError(
            f"torchft's worker (pid {pid}) had exited on its own, code {code}, before its shutdown"
        )


async def _open_torchft_baby(env: ChildEnv) -> Runner:
    pgs: Any = importlib.import_module("torchft.process_group")
    pg = pgs.ProcessGroupBabyGloo(timeout=timedelta(seconds=_OP_TIMEOUT))
    return _c10d_runner(
        env, "tft-baby", "torchft-baby-bench", pg, close=lambda: close_torchft_baby(pg)
    )


@dataclass(frozen=True)
class Case:
    """One implementation (one row per workload).

    ``missing`` returns why it cannot run in this environment (its rows are
    then skipped with that note), or ``None``. ``open`` runs on every rank, in
    the order of :data:`CASES`, inside the children's event loop.
    """

    impl: str
    open: Callable[[ChildEnv], Awaitable[Runner]]
    missing: Callable[[], str | None] = lambda: None
    opt_in: bool = False
    """Only run with ``--with IMPL``."""


BASELINE = "raw"
CASES: list[Case] = [
    Case(BASELINE, _open_raw),
    Case("ftcomm", _open_ftcomm),
    Case("fused", _open_fused),
    Case("fused+fg", _open_fused_gather),  # burst only: ftcomm.gather, no task per op
    Case("stats-off", _open_stats_off, opt_in=True),  # what Group.stats() costs
    Case("verify", _open_verified),
    Case("facade", _open_facade),
    Case("subproc", _open_subprocess),
    Case("sub+move", _open_subprocess_moved),
    Case("baby", _open_baby),
    Case("torchft", _open_torchft, _torchft_missing),
    Case("tft-baby", _open_torchft_baby, _torchft_missing),
]


def workloads(args: argparse.Namespace) -> tuple[Workload, ...]:
    """The ops to time, with per-round counts derived from the totals asked for."""

    rounds: int = args.rounds

    def per_round(total: int) -> int:
        return max(1, math.ceil(total / rounds))

    big_mib: int = args.big_mib
    big = big_mib * (1 << 20) // 4
    burst: int = args.burst
    return (
        # The cases take turns every 50 ops: on a 2-core box where each rank
        # is placed changes every few tens of ms, and a turn of 500 ops (8
        # rounds) caught different placements for different cases (measured:
        # the same code 1.12x, 1.19x and 1.29x raw in three runs; two raw
        # groups taking turns every 50 ops stay within 1.02-1.05x).
        Workload(
            "allreduce 1xfp32",
            "allreduce",
            1,
            per_round(args.iters),
            args.warmup,
            chunk=_SMALL_CHUNK,
        ),
        Workload(
            f"{burst} x allreduce 1xfp32",
            "allreduce_burst",
            burst,
            per_round(args.burst_iters),
            1,
            burst=burst,
        ),
        Workload(
            f"allreduce {big_mib}MiB fp32",
            "allreduce",
            big,
            per_round(args.big_iters),
            args.big_warmup,
            bandwidth=True,
        ),
    )


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
    env = ChildEnv(rank, port, store)
    barrier = _Barrier(store)
    by_name = {case.impl: case for case in CASES}
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
            runners[impl] = await by_name[impl].open(env)
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
        coro = _measure(rank, port, plan, store)
        if plan.loop == "uvloop":
            import uvloop

            report = uvloop.run(coro)
        else:
            report = asyncio.run(coro)
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
        store.close()


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


# -- the table --------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolated linearly between ranks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _measured(plan: Plan, report: Report) -> Iterator[tuple[Workload, str, Seconds, float | None]]:
    """Every (workload, case) with latencies, in the table's order, and raw's p50."""
    for w in plan.workloads:
        base = report.latencies.get((w.label, BASELINE))
        base_p50 = percentile(base, 50) if base else None
        for impl in plan.cases:
            lat = report.latencies.get((w.label, impl))
            if lat:
                yield w, impl, lat, base_p50


def format_table(plan: Plan, report: Report, notes: Sequence[str]) -> str:
    width = max([8, *(len(impl) for impl in plan.cases)])
    head = (
        f"{'op':<24} {'impl':<{width}} {'p50_us':>9} {'p99_us':>9} {'GB/s':>7}   ratio_p50(vs raw)"
    )
    lines = [
        f"ftcomm bench: {WORLD_SIZE} ranks, gloo, loopback, loop={plan.loop}, "
        f"torch {torch.__version__}" + (", each rank pinned to a CPU" if plan.pin else ""),
        head,
    ]
    for w, impl, lat, base_p50 in _measured(plan, report):
        p50, p99 = percentile(lat, 50), percentile(lat, 99)
        gbs = f"{w.nbytes / p50 / 1e9:7.2f}" if w.bandwidth else ""
        ratio = ""
        if impl != BASELINE and base_p50 is not None:
            if w.bandwidth:
                ratio = f"(bw ratio {base_p50 / p50:.2f}x)"
            elif w.burst:
                ratio = f"{p50 / base_p50:.3f}x ({base_p50 / p50:.1f}x faster than raw, one by one)"
            else:
                ratio = f"{p50 / base_p50:.2f}x"
        row = f"{w.label:<24} {impl:<{width}} {p50 * 1e6:9.1f} {p99 * 1e6:9.1f} {gbs:>7}   {ratio}"
        lines.append(row.rstrip())
    lines.append(
        f"({plan.rounds} rounds, cases alternating; per case: "
        + ", ".join(
            f"{w.label}: {w.iters * plan.rounds} ops"
            + (f" in turns of {w.chunk}" if len(_turns(w)) > 1 else "")
            for w in plan.workloads
        )
        + "; rank 0's times)"
    )
    lines.extend(f"note: {note}" for note in notes)
    lines.extend(f"FAILED: {failure}" for failure in report.failures)
    return "\n".join(lines)


# -- recovery: configure-to-first-op and dead-worker detection, at world size 1 --------
async def _first_op(group: Any, addr: str) -> float:
    """Seconds from ``configure`` to the end of the first allreduce."""
    started = time.perf_counter()
    await group.configure(addr, 0, 1)
    await group.allreduce(torch.ones(1))
    return time.perf_counter() - started


async def _spare_ready(group: Any, timeout: float = 30.0) -> None:
    """Wait until the group's spare worker has said READY (it imports torch first)."""
    import select

    rt = group._runtime
    await asyncio.to_thread(rt.control.wait_idle, timeout)
    spare = group._launcher._spare
    if spare is not None:
        await asyncio.to_thread(select.select, [spare.channel.fd], [], [], timeout)


class _KilledOnPurpose(logging.Filter):
    """Drops ftcomm's log records of the aborts the bench causes itself (a
    worker it kills, by the store address of that group); every other record
    passes, so an abort nobody caused is still printed."""

    def __init__(self) -> None:
        super().__init__()
        self.stores: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "ftcomm_store", None) not in self.stores


_KILLED_ON_PURPOSE = _KilledOnPurpose()


async def _recovery(port: int, samples: int, torchft: bool) -> dict[str, Seconds]:
    import ftcomm

    out: dict[str, Seconds] = {}
    n = iter(range(1 << 30))
    # Kept for the rest of the process: a record may be logged after the kill is seen.
    logging.getLogger("ftcomm").addFilter(_KILLED_ON_PURPOSE)

    def addr() -> str:
        return f"{HOST}:{port}/recovery-{next(n)}"

    for _ in range(samples):
        async with ftcomm.Group("gloo", timeout=_OP_TIMEOUT) as g:
            out.setdefault("in-process gloo", []).append(await _first_op(g, addr()))
        async with ftcomm.Group(
            "gloo", subprocess=True, spare_worker=False, timeout=_OP_TIMEOUT
        ) as g:
            out.setdefault("subproc, new worker", []).append(await _first_op(g, addr()))
    async with ftcomm.Group("gloo", subprocess=True, timeout=_OP_TIMEOUT) as g:
        await g.configure(addr(), 0, 1)
        for _ in range(samples):
            await _spare_ready(g)
            out.setdefault("subproc, spare worker", []).append(await _first_op(g, addr()))
        for _ in range(samples):
            await _spare_ready(g)
            victim = addr()
            _KILLED_ON_PURPOSE.stores.add(victim)
            await _first_op(g, victim)
            cfg: Any = g._config
            worker = cfg.backend.worker
            killed = time.perf_counter()
            os.kill(worker.pid, 9)
            await asyncio.wrap_future(worker.exited)
            out.setdefault("dead worker noticed", []).append(time.perf_counter() - killed)
            if not isinstance(g.errored(), ftcomm.WorkerDied):
                raise RuntimeError(f"a killed worker gave {g.errored()!r}, not WorkerDied")
    if torchft:
        pgs: Any = importlib.import_module("torchft.process_group")
        for _ in range(samples):
            pg = pgs.ProcessGroupBabyGloo(timeout=timedelta(seconds=_OP_TIMEOUT))
            started = time.perf_counter()
            pg.configure(addr(), "0", 0, 1)
            pg.allreduce([torch.ones(1)], dist.AllreduceOptions()).wait()
            out.setdefault("torchft baby", []).append(time.perf_counter() - started)
            close_torchft_baby(pg)
    return out


def format_recovery(times: Mapping[str, Seconds]) -> str:
    lines = [
        "recovery (world size 1, this process):",
        f"{'what':<28} {'p50_ms':>9} {'max_ms':>9}",
    ]
    for what, values in times.items():
        lines.append(f"{what:<28} {percentile(values, 50) * 1e3:9.1f} {max(values) * 1e3:9.1f}")
    lines.append(
        "(configure: to the end of the first allreduce; 'dead worker noticed': from "
        "SIGKILL to the worker reaped and the group errored with WorkerDied)"
    )
    return "\n".join(lines)


# -- JSON and plot ---------------------------------------------------------------------
def machine() -> str:
    """This machine in a few words: CPU model, CPUs this process may use, OS."""
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else os.cpu_count()
    return (
        f"{model or platform.processor() or platform.machine()}, {cpus} CPUs, {platform.system()}"
    )


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def results(
    plan: Plan,
    report: Report,
    notes: Sequence[str],
    recovery: Mapping[str, Seconds] | None,
) -> dict[str, Any]:
    """Every figure of the table and of the recovery part, as one JSON-able object.

    ``rows``: one per (workload, case), the table's order; latencies in
    microseconds; ``ratio_p50_vs_raw`` is p50 / raw's p50 (lower is better),
    ``bw_ratio_vs_raw`` (bandwidth workloads) raw's p50 / p50 (higher is better).
    """
    from . import __version__

    rows: list[dict[str, Any]] = []
    for w, impl, lat, base_p50 in _measured(plan, report):
        p50 = percentile(lat, 50)
        rows.append(
            {
                "workload": w.label,
                "op": w.op,
                "bytes": w.nbytes,
                "case": impl,
                "baseline": impl == BASELINE,
                "ops": len(lat),
                "p50_us": _us(p50),
                "p90_us": _us(percentile(lat, 90)),
                "p99_us": _us(percentile(lat, 99)),
                "gb_per_s": round(w.nbytes / p50 / 1e9, 4) if w.bandwidth else None,
                "ratio_p50_vs_raw": round(p50 / base_p50, 4) if base_p50 else None,
                "bw_ratio_vs_raw": (round(base_p50 / p50, 4) if base_p50 and w.bandwidth else None),
            }
        )
    return {
        "bench": "ftcomm",
        "ftcomm": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": machine(),
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "transport": "loopback",
        "plan": {
            "loop": plan.loop,
            "pin": plan.pin,
            "rounds": plan.rounds,
            "cases": list(plan.cases),
            "baseline": BASELINE,
            "workloads": [
                {
                    "label": w.label,
                    "op": w.op,
                    "numel": w.numel,
                    "bytes": w.nbytes,
                    "iters_per_round": w.iters,
                    "warmup_per_round": w.warmup,
                    "turn": _turns(w)[0],
                    "iters": w.iters * plan.rounds,
                    "bandwidth": w.bandwidth,
                }
                for w in plan.workloads
            ],
        },
        "rows": rows,
        "recovery": (
            None
            if recovery is None
            else [
                {
                    "what": what,
                    "samples": len(values),
                    "p50_ms": round(percentile(values, 50) * 1e3, 3),
                    "max_ms": round(max(values) * 1e3, 3),
                }
                for what, values in recovery.items()
            ]
        ),
        "notes": list(notes),
        "failures": list(report.failures),
    }


PLOT_HINT = "pip install 'ftcomm[plot]'"

# One colour per family of cases; raw Gloo, the reference, in black.
_COLORS = {
    BASELINE: "#222222",
    "ftcomm": "#1f77b4",
    "fused": "#17becf",
    "fused+fg": "#9edae5",
    "stats-off": "#aec7e8",
    "verify": "#6baed6",
    "facade": "#2ca02c",
    "subproc": "#ff7f0e",
    "sub+move": "#fdae6b",
    "baby": "#d62728",
    "torchft": "#9467bd",
    "tft-baby": "#c5b0d5",
}


def matplotlib_missing() -> str | None:
    """Why ``--plot`` cannot work here, or ``None``."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        return f"--plot needs matplotlib, which is not importable ({exc}): {PLOT_HINT}"
    return None


def write_plot(path: str, plan: Plan, report: Report) -> None:
    """Draw each case's per-op latencies side by side, one panel per workload
    (violins of log latency for the small op, every op as a point for the big
    one), raw Gloo first and in black, its median as a dashed line across."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullLocator

    panels = [
        w for w in plan.workloads if any(report.latencies.get((w.label, c)) for c in plan.cases)
    ]
    fig = Figure(figsize=(12, 4.2 * len(panels) + 1.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, w in zip(axes, panels, strict=True):
        cases = [c for c in plan.cases if report.latencies.get((w.label, c))]
        lat = {c: np.asarray(report.latencies[(w.label, c)]) for c in cases}
        p50 = {c: percentile(lat[c].tolist(), 50) for c in cases}
        p99 = {c: percentile(lat[c].tolist(), 99) for c in cases}
        base = p50.get(BASELINE)
        pos = list(range(1, len(cases) + 1))
        colors = [_COLORS.get(c, f"C{i}") for i, c in enumerate(cases)]
        labels = []
        for c in cases:
            if w.bandwidth:
                figure = f"{w.nbytes / p50[c] / 1e9:.2f} GB/s"
                ratio = "" if base is None else f"{base / p50[c]:.2f}x bw"
            else:
                figure = f"p50 {p50[c] * 1e6:.0f} µs"
                ratio = "" if base is None else f"{p50[c] / base:.2f}x"
            name = f"{c} (reference)" if c == BASELINE else c
            labels.append(f"{name}\n{figure}\n{'' if c == BASELINE else ratio}".rstrip())
        if w.bandwidth:
            # Few ops: every one as a point (jittered sideways), the median as a bar.
            rng = np.random.default_rng(0)
            for x, c, color in zip(pos, cases, colors, strict=True):
                ms = lat[c] * 1e3
                jitter = rng.uniform(-0.18, 0.18, ms.size)
                ax.scatter(x + jitter, ms, s=14, color=color, alpha=0.75, linewidths=0)
                ax.hlines(p50[c] * 1e3, x - 0.3, x + 0.3, color="black", linewidth=2)
            ax.set_ylabel("ms per op")
            ax.set_ylim(bottom=0)
            if base is not None:
                ax.axhline(base * 1e3, color=_COLORS[BASELINE], linestyle="--", linewidth=1)
            ax.legend(
                handles=[
                    Line2D(
                        [], [], marker="o", linestyle="", color="gray", markersize=4, label="one op"
                    ),
                    Line2D([], [], color="black", linewidth=2, label="p50"),
                    Line2D([], [], color=_COLORS[BASELINE], linestyle="--", label="raw Gloo p50"),
                ],
                loc="lower right",
                bbox_to_anchor=(1.0, 1.0),
                ncol=3,
                fontsize=8,
                framealpha=0.9,
            )
        else:
            # Many ops over decades: violins of log10(µs), ticks labelled in µs.
            logs = [np.log10(lat[c] * 1e6) for c in cases]
            parts = ax.violinplot(logs, pos, widths=0.85, showextrema=False, points=300)
            for body, color, c in zip(parts["bodies"], colors, cases, strict=True):
                body.set_facecolor(color)
                body.set_edgecolor("black" if c == BASELINE else color)
                body.set_linewidth(1.5 if c == BASELINE else 0.5)
                body.set_alpha(0.85 if c == BASELINE else 0.6)
            ax.scatter(
                pos,
                [math.log10(p50[c] * 1e6) for c in cases],
                marker="o",
                s=28,
                color="white",
                edgecolors="black",
                zorder=3,
            )
            ax.scatter(
                pos,
                [math.log10(p99[c] * 1e6) for c in cases],
                marker="_",
                s=260,
                color="black",
                linewidths=1.5,
                zorder=3,
            )
            if base is not None:
                ax.axhline(
                    math.log10(base * 1e6), color=_COLORS[BASELINE], linestyle="--", linewidth=1
                )
            lo = min(float(v.min()) for v in logs)
            hi = max(float(v.max()) for v in logs)
            nice = [m * 10**e for e in range(-1, 8) for m in (1, 2, 5)]
            ticks = [math.log10(v) for v in nice if lo - 0.05 <= math.log10(v) <= hi + 0.05]
            ax.yaxis.set_major_locator(FixedLocator(ticks))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.set_yticklabels([f"{10**t:g}" for t in ticks])
            ax.set_ylabel("µs per op (log scale)")
            ax.legend(
                handles=[
                    Line2D(
                        [],
                        [],
                        marker="o",
                        linestyle="",
                        markerfacecolor="white",
                        markeredgecolor="black",
                        label="p50",
                    ),
                    Line2D(
                        [],
                        [],
                        marker="_",
                        linestyle="",
                        color="black",
                        markersize=14,
                        markeredgewidth=1.5,
                        label="p99",
                    ),
                    Line2D([], [], color=_COLORS[BASELINE], linestyle="--", label="raw Gloo p50"),
                ],
                loc="lower right",
                bbox_to_anchor=(1.0, 1.0),
                ncol=3,
                fontsize=8,
                framealpha=0.9,
            )
        ax.set_xticks(pos)
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_xlim(0.4, len(cases) + 0.6)
        ax.grid(axis="y", alpha=0.3)
        ax.set_title(
            f"{w.label}: {len(lat[cases[0]])} ops per case"
            + ("  (ratio: raw's bandwidth = 1)" if w.bandwidth else "  (ratio: p50 / raw's p50)"),
            fontsize=10,
        )
        baseline_tick = ax.get_xticklabels()[cases.index(BASELINE)] if base is not None else None
        if baseline_tick is not None:
            baseline_tick.set_fontweight("bold")
    fig.suptitle(
        f"ftcomm bench: allreduce latency per op, {WORLD_SIZE} ranks, Gloo over loopback "
        f"(raw torch.distributed Gloo = reference)\n{machine()}; loop={plan.loop}; "
        f"torch {torch.__version__}; {plan.rounds} rounds, cases alternating; rank 0's times",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)


# -- CLI --------------------------------------------------------------------------------
def _default_loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ftcomm bench",
        description="Time ftcomm's collectives against raw torch.distributed Gloo "
        "(and torchft when installed): 2 ranks on loopback, one run, ratios.",
    )
    p.add_argument("--iters", type=_positive, default=4000, help="1-float ops per case (4000)")
    p.add_argument("--big-iters", type=_positive, default=32, help="big ops per case (32)")
    p.add_argument("--big-mib", type=_positive, default=16, help="big tensor size in MiB (16)")
    p.add_argument(
        "--burst",
        type=_positive,
        default=1000,
        help="1-float allreduces issued at once in the burst row: raw issues them one by one, "
        "ftcomm awaits them with asyncio.gather(), fused with fuse=True, fused+fg with "
        "fuse=True and ftcomm.gather() (1000)",
    )
    p.add_argument("--burst-iters", type=_positive, default=16, help="bursts per case (16)")
    p.add_argument("--rounds", type=_positive, default=8, help="interleaved rounds (8)")
    p.add_argument(
        "--warmup", type=_non_negative, default=100, help="1-float warm-up ops per round (100)"
    )
    p.add_argument(
        "--big-warmup", type=_non_negative, default=1, help="big warm-up ops per round (1)"
    )
    p.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default=None,
        help="event loop of the ranks and of ftcomm's owner loop (default: uvloop if installed)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="give up after this many seconds (300)"
    )
    p.add_argument(
        "--no-torchft", action="store_true", help="skip torchft's rows even where it is installed"
    )
    p.add_argument(
        "--with",
        dest="with_",
        action="append",
        default=[],
        choices=[case.impl for case in CASES if case.opt_in],
        help="add an optional row: stats-off (ftcomm with Group(stats=False))",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin each rank (with its threads) to a CPU of its own: steadier small-op "
        "figures on a small machine, where unpinned runs swing with thread placement",
    )
    p.add_argument(
        "--recovery-samples",
        type=_non_negative,
        default=5,
        help="samples of configure-to-first-op and dead-worker detection (5; 0: skip)",
    )
    p.add_argument(
        "--json",
        metavar="FILE|-",
        default=None,
        help="also write every figure (each row's p50/p90/p99 or GB/s and ratio to raw, the "
        "recovery times, the plan, torch's and ftcomm's versions) as one JSON object to FILE; "
        "'-': print only that JSON on stdout, no tables",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        default=None,
        help="also draw each case's per-op latency distribution, side by side, raw Gloo as "
        f"the reference, into FILE (.png; matplotlib: {PLOT_HINT})",
    )
    return p


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written (checked before the run, not after it)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{path}: no such directory {folder}"
    if os.path.isdir(path):
        return f"{path} is a directory"
    return None


def _unplottable(path: str) -> str | None:
    """Why matplotlib cannot write ``path``'s format (checked before the run)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        formats = FigureCanvasAgg(Figure()).get_supported_filetypes()
    except Exception as exc:  # installed, but broken
        return f"--plot: matplotlib does not work here ({type(exc).__name__}: {exc})"
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in formats:
        known = ", ".join(sorted(formats))
        return f"--plot {path}: write .png (or {known}), not {ext or 'no extension'!r}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; print the table (or the JSON). Returns the exit code."""
    args = parser().parse_args(argv)
    loop: str = args.loop or _default_loop()
    if loop == "uvloop" and _default_loop() != "uvloop":
        print("ftcomm bench: --loop uvloop but uvloop is not installed", file=sys.stderr)
        return 2
    json_path: str | None = args.json
    plot_path: str | None = args.plot
    missing = None if plot_path is None else matplotlib_missing()
    problems = [
        why
        for why in (
            missing,
            None if plot_path is None or missing else _unplottable(plot_path),
            None if plot_path is None else _unwritable(plot_path),
            None if json_path in (None, "-") else _unwritable(json_path),
            _unpinnable() if args.pin else None,
        )
        if why is not None
    ]
    if problems:
        for problem in problems:
            print(f"ftcomm bench: {problem}", file=sys.stderr)
        return 2
    tables = json_path != "-"  # '-': stdout carries the JSON alone
    out = sys.stdout if tables else sys.stderr  # where "wrote FILE" goes
    notes: list[str] = []
    cases: list[str] = []
    for case in CASES:
        if case.opt_in and case.impl not in args.with_:
            continue
        torchft_row = case.missing is _torchft_missing
        why = "--no-torchft" if torchft_row and args.no_torchft else case.missing()
        if why is None:
            cases.append(case.impl)
        else:
            notes.append(f"{case.impl} rows skipped: {why}")
    plan = Plan(loop, args.rounds, tuple(cases), workloads(args), pin=args.pin)
    started = time.monotonic()
    try:
        report = _run_children(plan, args.timeout)
    except BenchFailed as exc:
        print(f"ftcomm bench failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    notes.append(f"took {time.monotonic() - started:.1f} s")
    if tables:
        print(format_table(plan, report, notes), flush=True)
    else:
        for failure in report.failures:
            print(f"ftcomm bench: FAILED: {failure}", file=sys.stderr)
    failed = bool(report.failures)
    if plot_path is not None:
        try:
            write_plot(plot_path, plan, report)
        except Exception as exc:  # the measurements still go to the table and the JSON
            print(f"ftcomm bench: cannot write the plot: {exc}", file=sys.stderr)
            failed = True
        else:
            print(f"plot: {plot_path}", file=out, flush=True)
    times: dict[str, Seconds] | None = None
    if args.recovery_samples:
        store = serve_store(HOST)  # loopback only
        try:
            torchft = not args.no_torchft and _torchft_missing() is None
            times = asyncio.run(_recovery(store.port, args.recovery_samples, torchft))
        except Exception as exc:
            traceback.print_exc()
            print(f"ftcomm bench: recovery failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            report.failures.append(f"recovery: {type(exc).__name__}: {exc}")
            failed = True
        finally:
            store.close()
        if times is not None and tables:
            print(format_recovery(times), flush=True)
    if json_path is not None:
        text = json.dumps(results(plan, report, notes, times), indent=2)
        if json_path == "-":
            print(text, flush=True)
        else:
            try:
                with open(json_path, "w", encoding="utf-8") as f:
                    f.write(text + "\n")
            except OSError as exc:
                print(f"ftcomm bench: cannot write the JSON: {exc}", file=sys.stderr)
                failed = True
            else:
                print(f"json: {json_path}", file=out, flush=True)
    return 1 if failed else 0
