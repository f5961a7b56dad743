"""``python -m ftcomm bench``: ftcomm against raw c10d Gloo, measured in one run.

Owns the command line: :func:`main`, its options and what is checked before
a run. The main table's run is ``runner``'s (:func:`~.runner._run_children`),
its cases and workloads ``cases``', its table, JSON and plot ``report``'s;
every other part (the recovery, membership, state-copy, FSDP2, chaos and
scale rows) is a module of its own, each named on docs/design.md's map.
What the bench measures, and how to read it: docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from .._server import serve_store
from . import chaos, chaos_report, fsdp, links, scale, state_copy
from .cases import CASES, workloads
from .membership import TRIALS, format_membership, measure, membership_json
from .recovery import _recovery, format_recovery
from .report import PLOT_HINT, format_table, matplotlib_missing, results, write_plot
from .runner import HOST, BenchFailed, Plan, Seconds, _run_children, _unpinnable
from .torchft_rows import _torchft_missing

FSDP_STEPS = 10
"""Timed FSDP2 steps per round and group (``--fsdp-steps``)."""
FSDP_ROUNDS = 4
"""Rounds in which the two groups take turns."""


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


def _rate(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a rate >= 0, got {text}")
    return value


def _duration(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in chaos.KINDS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(
            f"must be kinds from {', '.join(chaos.KINDS)}, comma-separated, got {text!r}"
        )
    return kinds


def _members(text: str) -> int:
    value = int(text)
    if not 2 <= value <= chaos.MAX_MEMBERS:
        raise argparse.ArgumentTypeError(
            f"must be 2 to {chaos.MAX_MEMBERS} (a fault needs a survivor), got {value}"
        )
    return value


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be world sizes, comma-separated, got {text!r}"
        ) from None
    if not sizes or any(not 2 <= n <= scale.MAX_SIZE for n in sizes):
        raise argparse.ArgumentTypeError(
            f"each size must be 2 to {scale.MAX_SIZE} (a kill needs a survivor), got {text!r}"
        )
    return sizes


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
        "--membership-trials",
        type=_non_negative,
        default=TRIALS,
        help="trials of each membership recovery row: a member of three SIGKILLed or "
        f"SIGSTOPped, to the survivors' first good allreduce ({TRIALS}; 0: skip)",
    )
    p.add_argument(
        "--fsdp-steps",
        type=_non_negative,
        default=FSDP_STEPS,
        help="timed FSDP2 training steps per round and group in the FSDP2 rows: a step over "
        f"torch's own Gloo group against one over ftcomm's ({FSDP_STEPS}; 0: skip)",
    )
    p.add_argument(
        "--state-mib",
        type=_non_negative,
        default=state_copy.MIB,
        help="size of the state in the state-copy rows: sync_state against raw Gloo send/recv "
        f"and torchft's PGTransport, to one member behind and to two ({state_copy.MIB}; 0: skip)",
    )
    p.add_argument(
        "--state-rounds",
        type=_positive,
        default=state_copy.ROUNDS,
        help=f"rounds of each state-copy case ({state_copy.ROUNDS})",
    )
    p.add_argument(
        "--state-link-gbit",
        type=_rate,
        default=links.GBIT,
        help="each link's rate in the state copy over links of their own: 3 members in network "
        f"namespaces, one and two behind (needs root and iproute2; {links.GBIT:g}; 0: skip)",
    )
    soak = p.add_argument_group(
        "chaos and scale (each runs instead of the tables above; both: one after the other)"
    )
    soak.add_argument(
        "--chaos",
        action="store_true",
        help="the chaos soak: members train (ftcomm.Membership on the store, Gloo, a "
        f"{chaos.STATE_MIB} MiB model) while a fault strikes every few seconds, and the same "
        "without faults: goodput, recovery gaps, generations, the same parameters on all at "
        "the end; beside torchft's Manager where it is installed",
    )
    soak.add_argument(
        "--chaos-seconds",
        type=_duration,
        default=None,
        help=f"each phase's window, with faults and without ({chaos.SECONDS:g})",
    )
    soak.add_argument(
        "--chaos-interval",
        type=_duration,
        default=None,
        help="seconds between two faults (given, or --chaos-members or --chaos-kinds: one "
        "row with them instead of the default rows; else 10)",
    )
    soak.add_argument(
        "--chaos-members",
        type=_members,
        default=None,
        help="members of the one row (3)",
    )
    soak.add_argument(
        "--chaos-kinds",
        type=_kinds,
        default=None,
        help=f"faults of the one row, taken in turn, comma-separated: {', '.join(chaos.KINDS)} "
        "(kill)",
    )
    soak.add_argument(
        "--chaos-seed",
        type=int,
        default=None,
        help="the seed of the RNG that picks each fault's victim (0)",
    )
    soak.add_argument(
        "--chaos-state-mib",
        type=_positive,
        default=None,
        help=f"each member's fp32 parameters in MiB, and as many of momentum ({chaos.STATE_MIB})",
    )
    soak.add_argument(
        "--scale",
        action="store_true",
        help="join time, kill-to-next-good-step time and the store's load per heartbeat "
        f"round at {', '.join(map(str, scale.SIZES))} members (processes)",
    )
    soak.add_argument(
        "--scale-sizes",
        type=_sizes,
        default=None,
        help=f"the world sizes of --scale, comma-separated ({','.join(map(str, scale.SIZES))})",
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


_CHAOS_OPTIONS = (
    "chaos_seconds",
    "chaos_interval",
    "chaos_members",
    "chaos_kinds",
    "chaos_seed",
    "chaos_state_mib",
)


def _soak_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the --chaos and --scale options (before a run)."""
    problems = [
        f"--{name.replace('_', '-')} needs --chaos"
        for name in _CHAOS_OPTIONS
        if getattr(args, name) is not None and not args.chaos
    ]
    if args.scale_sizes is not None and not args.scale:
        problems.append("--scale-sizes needs --scale")
    if args.plot is not None and (args.chaos or args.scale):
        problems.append("--plot draws the latency tables, which --chaos and --scale replace")
    if args.chaos:
        why = chaos.kinds_missing(args.chaos_kinds or ())
        if why is not None:
            problems.append(why)
        seconds = args.chaos_seconds or chaos.SECONDS
        rows = chaos.rows_for(args.chaos_members, args.chaos_interval, args.chaos_kinds, True)
        if any(row.interval >= seconds for row in rows):
            interval = max(row.interval for row in rows)
            problems.append(
                f"--chaos-interval ({interval:g} s) must be shorter than --chaos-seconds "
                f"({seconds:g} s): no fault would strike"
            )
    return problems


def _say(line: str) -> None:
    print(f"ftcomm bench: {line}", file=sys.stderr, flush=True)


def _soak(args: argparse.Namespace, loop: str, json_path: str | None) -> int:
    """``--chaos`` and ``--scale``: their tables (or the JSON). Returns the exit code."""
    from .. import __version__
    from .report import machine

    tables = json_path != "-"
    failures: list[str] = []
    torchft_skip = "--no-torchft" if args.no_torchft else _torchft_missing()
    doc: dict[str, Any] = {
        "bench": "ftcomm",
        "ftcomm": __version__,
        "torch": _torch_version(),
        "python": sys.version.split()[0],
        "machine": machine(),
        "loop": loop,
        "chaos": None,
        "scale": None,
    }
    started = time.monotonic()
    if args.chaos:
        seconds, seed = args.chaos_seconds or chaos.SECONDS, args.chaos_seed or 0
        state_mib = args.chaos_state_mib or chaos.STATE_MIB
        rows = chaos.rows_for(
            args.chaos_members, args.chaos_interval, args.chaos_kinds, torchft_skip is None
        )
        notes = [] if torchft_skip is None else [f"torchft's rows skipped: {torchft_skip}"]
        measured = chaos.measure(rows, seconds, seed, loop, progress=_say, state_mib=state_mib)
        for row in measured:
            if row.failed is not None:
                failures.append(f"chaos: {row.spec.label}: {row.failed.splitlines()[0]}")
                _say(f"chaos: {row.spec.label} FAILED: {row.failed}")
            for name, phase in (("without faults", row.clean), ("with faults", row.chaos)):
                if phase is not None and phase.trace:
                    _say(f"chaos: {row.spec.label}, {name}: a stall or an eviction:\n{phase.trace}")
        notes.append(f"took {time.monotonic() - started:.0f} s")
        doc["chaos"] = chaos_report.chaos_json(measured, seconds, seed, notes, state_mib)
        if tables:
            print(chaos_report.format_chaos(measured, seconds, seed, notes, state_mib), flush=True)
    if args.scale:
        begun = time.monotonic()
        sized = scale.measure(args.scale_sizes or scale.SIZES, loop, progress=_say)
        for srow in sized:
            if srow.failed is not None:
                failures.append(f"scale: {srow.failed.splitlines()[0]}")
                _say(f"scale: {srow.size} members FAILED: {srow.failed}")
        scale_notes = [f"took {time.monotonic() - begun:.0f} s"]
        doc["scale"] = scale.scale_json(sized, scale_notes)
        if tables:
            print(scale.format_scale(sized, scale_notes), flush=True)
    doc["failures"] = failures
    if json_path is None:
        return 1 if failures else 0
    text = json.dumps(doc, indent=2)
    if json_path == "-":
        print(text, flush=True)
        return 1 if failures else 0
    try:
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError as exc:
        _say(f"cannot write the JSON: {exc}")
        return 1
    print(f"json: {json_path}", flush=True)
    return 1 if failures else 0


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; print the table (or the JSON). Returns the exit code."""
    args = parser().parse_args(argv)
    loop: str = args.loop or _default_loop()
    if loop == "uvloop" and _default_loop() != "uvloop":
        print("ftcomm bench: --loop uvloop but uvloop is not installed", file=sys.stderr)
        return 2
    json_path: str | None = args.json
    plot_path: str | None = args.plot
    soak_problems = _soak_problems(args)
    if soak_problems or args.chaos or args.scale:
        unwritable = None if json_path in (None, "-") else _unwritable(json_path)
        if unwritable is not None:
            soak_problems.append(unwritable)
        for problem in soak_problems:
            print(f"ftcomm bench: {problem}", file=sys.stderr)
        if soak_problems:
            return 2
        try:
            return _soak(args, loop, json_path)
        except KeyboardInterrupt:
            return 130
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
    opens = {case.impl: case.open for case in CASES if case.impl in cases}
    plan = Plan(loop, args.rounds, tuple(cases), workloads(args), pin=args.pin, opens=opens)
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
    members: dict[str, Any] | None = None
    if args.membership_trials:
        torchft_skip = "--no-torchft" if args.no_torchft else _torchft_missing()
        try:
            rows, member_notes = measure(args.membership_trials, loop, torchft_skip)
        except Exception as exc:
            traceback.print_exc()
            print(f"ftcomm bench: membership failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            report.failures.append(f"membership: {type(exc).__name__}: {exc}")
            failed = True
        else:
            for row in rows:
                if row.failed is not None:
                    report.failures.append(f"membership: {row.label}: {row.failed}")
                    print(f"ftcomm bench: membership: {row.label}: {row.failed}", file=sys.stderr)
                    failed = True
            members = membership_json(rows, member_notes)
            if tables:
                print(format_membership(rows, member_notes), flush=True)
    fsdp_rows: dict[str, Any] | None = None
    if args.fsdp_steps:
        try:
            measured = fsdp.measure(args.fsdp_steps, FSDP_ROUNDS)
        except fsdp.FsdpFailed as exc:
            print(f"ftcomm bench: fsdp2 failed: {exc}", file=sys.stderr)
            report.failures.append(f"fsdp2: {exc}")
            failed = True
        else:
            fsdp_rows = fsdp.fsdp_json(measured)
            if tables:
                print(fsdp.format_fsdp(measured), flush=True)
    copies: dict[str, Any] | None = None
    if args.state_mib:
        torchft_skip = "--no-torchft" if args.no_torchft else _torchft_missing()
        try:
            copied = state_copy.measure(args.state_mib, args.state_rounds, torchft_skip)
        except state_copy.StateCopyFailed as exc:
            print(f"ftcomm bench: state copy failed: {exc}", file=sys.stderr)
            report.failures.append(f"state copy: {exc}")
            failed = True
        else:
            copies = state_copy.state_copy_json(copied)
            if tables:
                print(state_copy.format_state_copy(copied), flush=True)
        why = links.missing() if args.state_link_gbit > 0 else "--state-link-gbit 0"
        if why is not None:
            if copies is not None:
                copies["links"] = None
            if tables:
                print(f"(the state copy over links of their own skipped: {why})", flush=True)
        else:
            try:
                linked = links.measure(
                    min(args.state_mib, links.MIB), args.state_rounds, args.state_link_gbit
                )
            except links.LinksFailed as exc:
                print(f"ftcomm bench: state copy over links failed: {exc}", file=sys.stderr)
                report.failures.append(f"state copy over links: {exc}")
                failed = True
            else:
                if copies is not None:
                    copies["links"] = links.links_json(linked)
                if tables:
                    print(links.format_links(linked), flush=True)
    if json_path is not None:
        doc = results(plan, report, notes, times, members, fsdp_rows, copies)
        text = json.dumps(doc, indent=2)
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
