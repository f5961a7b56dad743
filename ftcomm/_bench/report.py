"""What the bench writes of a run: the table of medians, tails and ratios
against :data:`BASELINE` (raw Gloo), the same figures as one JSON object
(:func:`results`), and the plot of each case's latencies (:func:`write_plot`;
matplotlib, imported when drawing).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import math
import os
import platform
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .runner import WORLD_SIZE, Plan, Report, Seconds, Workload, _turns

BASELINE = "raw"
"""The case every ratio is against."""


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
                if p50 <= base_p50:
                    than = f"{base_p50 / p50:.1f}x faster"
                else:
                    than = f"{p50 / base_p50:.1f}x slower"
                ratio = f"{p50 / base_p50:.3f}x ({than} than raw, one by one)"
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


# -- JSON and plot ---------------------------------------------------------------------
def commit() -> str | None:
    """The git commit of the ftcomm measured, 12 or more hex digits
    (``+dirty`` with uncommitted changes to tracked files); None unless this
    package is tracked in a git checkout of its own (an installed copy inside
    another project's repository is not that project's commit)."""
    package = os.path.dirname(os.path.abspath(__file__))
    source = os.path.dirname(os.path.dirname(package))  # .../ftcomm/_bench -> the checkout

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "--no-optional-locks", *args],  # no index.lock beside the user's own git
            cwd=package,
            env={k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()

    try:
        if os.path.realpath(git("rev-parse", "--show-toplevel")) != os.path.realpath(source):
            return None
        git("ls-files", "--error-unmatch", os.path.basename(__file__))  # tracked, not a copy
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


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
    membership: Mapping[str, Any] | None = None,
    fsdp: Mapping[str, Any] | None = None,
    state_copy: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every figure of the table and of the recovery part, as one JSON-able object.

    ``membership``: the membership recovery rows, as
    :func:`~ftcomm._bench.membership.membership_json` gives them (``None``: not run);
    ``fsdp``: the FSDP2 rows, as :func:`~ftcomm._bench.fsdp.fsdp_json` gives them;
    ``state_copy``: the state-copy rows, as
    :func:`~ftcomm._bench.state_copy.state_copy_json` gives them.

    ``rows``: one per (workload, case), the table's order; latencies in
    microseconds; ``ratio_p50_vs_raw`` is p50 / raw's p50 (lower is better),
    ``bw_ratio_vs_raw`` (bandwidth workloads) raw's p50 / p50 (higher is better).
    """
    from .. import __version__

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
        "measured": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "commit": commit(),
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
        "membership": None if membership is None else dict(membership),
        "fsdp": None if fsdp is None else dict(fsdp),
        "state_copy": None if state_copy is None else dict(state_copy),
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


def _legend(ax: Any, *handles: Any) -> None:
    """A panel's key: ``handles``, then raw Gloo's median line, in one row
    above the panel's right corner."""
    from matplotlib.lines import Line2D

    ax.legend(
        handles=[
            *handles,
            Line2D([], [], color=_COLORS[BASELINE], linestyle="--", label="raw Gloo p50"),
        ],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=3,
        fontsize=8,
        framealpha=0.9,
    )


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
            _legend(
                ax,
                Line2D(
                    [], [], marker="o", linestyle="", color="gray", markersize=4, label="one op"
                ),
                Line2D([], [], color="black", linewidth=2, label="p50"),
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
            for at, style in (
                (p50, {"marker": "o", "s": 28, "color": "white", "edgecolors": "black"}),
                (p99, {"marker": "_", "s": 260, "color": "black", "linewidths": 1.5}),
            ):
                ax.scatter(pos, [math.log10(at[c] * 1e6) for c in cases], zorder=3, **style)
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
            _legend(
                ax,
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
