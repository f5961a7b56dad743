"""``python -m ftcomm doctor``: what this machine has, and what ftcomm can do on it.

Owns the command line (:func:`main`) and :func:`collect`, which runs the
checks in the order the report gives them. Each check lives in a module of
its own (docs/design.md's map), with the facts it gathers and what they mean
(its ``advise_*``). Imports point one way: ``_record`` and ``_table`` import
nothing of the doctor; each check imports ``_record`` only; ``_output``
imports ``_record``, ``_table`` and ``_environment``; this module, any of
them. What it checks: docs/testing.md, "Checking a machine".
"""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict

from ._environment import SHM_DIR, SHM_MIN_FREE, advise_packages, advise_shm
from ._environment import packages_info as packages_info
from ._environment import shm_info as shm_info
from ._etcd_check import advise_etcd
from ._etcd_check import etcd_check as etcd_check
from ._live import LIVE_ABORT_BOUND, LIVE_TIMEOUT, advise_live, live_text
from ._live import live_check as live_check
from ._output import render, write
from ._record import JSON, Findings, Problem
from ._store_check import STORE_TIMEOUT, advise_store
from ._store_check import store_check as store_check
from ._table import (
    GLOO_IN_PROCESS,
    GLOO_SUBPROCESS,
    NCCL_IN_PROCESS,
    NCCL_SUBPROCESS,
    ROWS,
    TRUTH_TABLE,
    XCCL_IN_PROCESS,
    XCCL_SUBPROCESS,
    AbortRow,
)
from ._torch_build import MIN_TORCH, advise_torch
from ._torch_build import backends_info as backends_info
from ._torch_build import torch_info as torch_info

__all__ = [
    "GLOO_IN_PROCESS",
    "GLOO_SUBPROCESS",
    "JSON",
    "LIVE_ABORT_BOUND",
    "LIVE_TIMEOUT",
    "MIN_TORCH",
    "NCCL_IN_PROCESS",
    "NCCL_SUBPROCESS",
    "ROWS",
    "SHM_DIR",
    "SHM_MIN_FREE",
    "STORE_TIMEOUT",
    "TRUTH_TABLE",
    "XCCL_IN_PROCESS",
    "XCCL_SUBPROCESS",
    "AbortRow",
    "Problem",
    "backends_info",
    "collect",
    "live_check",
    "main",
    "packages_info",
    "render",
    "shm_info",
    "etcd_check",
    "store_check",
    "torch_info",
]


def collect(store: str | None, live: bool, etcd: str | None = None) -> JSON:
    """Everything doctor reports, as one JSON-able object; ``problems`` and
    ``notes`` say what is missing (``ok`` is whether nothing needed is).

    The checks are looked up here, by name, when it runs (a test may
    replace one on this module)."""
    from .. import __version__

    report: JSON = {
        "ftcomm": __version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch_info(),
        "backends": backends_info(),
        "shm": shm_info(),
        "packages": packages_info(),
    }
    found = Findings()
    backends = report["backends"]
    advise_torch(report["torch"], backends, found)
    advise_shm(report["shm"], found)
    advise_packages(report["packages"], found)

    loop_error = report["packages"]["owner_loop"]["error"]
    if not live:
        report["live_check"] = {"ran": False, "reason": "--no-live"}
    elif not backends["gloo"]["usable"]:
        report["live_check"] = {"ran": False, "reason": "no Gloo in this torch"}
    elif loop_error:
        report["live_check"] = {"ran": False, "reason": "ftcomm's owner loop cannot start"}
    else:
        report["live_check"] = live_check()
        advise_live(report["live_check"], found)

    report["abort_truth_table"] = _truth_table(report)
    report["truth_table_source"] = TRUTH_TABLE

    report["store"] = None
    if store is not None:
        report["store"] = store_check(store)
        advise_store(report["store"], found)
    report["etcd"] = None
    if etcd is not None:
        report["etcd"] = etcd_check(etcd)
        advise_etcd(report["etcd"], found)

    report["problems"] = [asdict(p) for p in found.problems]
    report["notes"] = found.notes
    report["ok"] = not found.problems
    return report


def _truth_table(report: JSON) -> list[JSON]:
    """The truth table's rows for the backends usable here, each Gloo row
    with what is true here: ``/dev/shm`` for ``subprocess=True``, the live
    check's outcome for in process."""
    rows: list[JSON] = []
    for name, (in_process, sub) in ROWS.items():
        if not report["backends"][name]["usable"]:
            continue
        for row in (in_process, sub):
            entry = asdict(row)
            if row is GLOO_SUBPROCESS:  # CPU tensors travel through /dev/shm
                usable = report["shm"]["usable"]
                entry["here"] = "usable" if usable else f"needs {SHM_DIR} (see problems)"
            if row is GLOO_IN_PROCESS:
                entry["here"] = "live check: " + live_text(report["live_check"])
            rows.append(entry)
    return rows


def main(argv: Sequence[str]) -> int:
    """``python -m ftcomm doctor [--store HOST:PORT] [--etcd etcd://...] [--json] [--no-live]``.

    Prints the report (or one JSON object with ``--json``); returns 0 when
    everything needed is here, 1 when something is missing or failed (the
    report's ``problems``, each with advice), 2 for a bad argument.
    """
    parser = argparse.ArgumentParser(
        prog="python -m ftcomm doctor",
        description=(
            "Check this machine for ftcomm: torch, its backends, which of them abort "
            "for real, /dev/shm for subprocess=True, uvloop, and optionally a store."
        ),
    )
    parser.add_argument(
        "--store",
        metavar="HOST:PORT",
        help="check that a TCPStore answers there (host:port, host:port/prefix, [v6]:port)",
    )
    parser.add_argument(
        "--etcd",
        metavar="etcd://HOST:PORT[,...]",
        help="check that an etcd cluster answers there: each endpoint's version and "
        "leader, and whether they agree on one",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="skip the live in-process Gloo abort check (two ranks in this process)",
    )
    args = parser.parse_args(list(argv))
    if args.store is not None:
        from .._store import resolve_store_addr

        try:
            resolve_store_addr(args.store, "--store")  # env:// too: torchrun's store
        except ValueError as exc:
            parser.error(str(exc))
    if args.etcd is not None:
        from .._etcd import parse_etcd_addr

        try:
            parse_etcd_addr(args.etcd, "--etcd")
        except ValueError as exc:
            parser.error(str(exc))
    report = collect(args.store, live=not args.no_live, etcd=args.etcd)
    write(report, as_json=args.json)
    return 0 if report["ok"] else 1
