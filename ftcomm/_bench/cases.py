"""The cases and the workloads of a run, in the table's order.

Adding a row: add a :class:`Case` to :data:`CASES` (its ``open``, in the
module of its family, builds a :class:`~ftcomm._bench.runner.Runner` on every
rank). Adding an op: add a :class:`~ftcomm._bench.runner.Workload` in
:func:`workloads` and the op's name to every runner's ``ops``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .fusion import _open_fused, _open_fused_gather
from .latency import _open_facade, _open_ftcomm, _open_raw, _open_stats_off, _open_verified
from .report import BASELINE
from .runner import ChildEnv, Runner, Workload
from .subproc import _open_baby, _open_subprocess, _open_subprocess_moved
from .torchft_rows import _open_torchft, _open_torchft_baby, _torchft_missing

_SMALL_CHUNK = 50
"""Ops per turn of a case in the 1-float row (see :func:`workloads`)."""


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
