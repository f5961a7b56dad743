"""How the report is printed: :func:`render`, the human text, and
:func:`write`, which prints it or one JSON object on stdout. No check runs
here: this module only reads a report ``collect`` made.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from ._environment import SHM_DIR
from ._record import JSON, size
from ._table import ROWS


def render(report: JSON) -> str:
    """The human report: what is here, the truth table's rows, problems and notes."""
    t = report["torch"]
    lines = [
        "ftcomm doctor",
        f"  ftcomm      {report['ftcomm']}",
        f"  python      {report['python']}",
        f"  platform    {report['platform']} ({report['cpus']} CPUs)",
        f"  torch       {t['version']} (build: {t['build']})",
        "",
        "backends",
    ]
    for name, b in report["backends"].items():
        if name == "gloo":
            what = "CPU tensors"
        else:
            kind = "CUDA GPUs" if name == "nccl" else "XPUs"
            what = f"{b['devices']} {kind}" if b["device_present"] else f"no {kind} seen"
            if b.get("library_version"):
                what += f", NCCL {b['library_version']}"
        status = "yes" if b["usable"] else "no "
        lines.append(f"  {name:<11} {status}  in torch: {_yn(b['in_torch'])}; {what}")
    shm = report["shm"]
    if shm["exists"] and shm["total_bytes"] is not None:
        room = f"{size(shm['free_bytes'])} free of {size(shm['total_bytes'])}"
        room += ", writable" if shm["writable"] else ", NOT writable"
    else:
        room = "missing"
    lines.append(f"  {'subprocess':<11} {'yes' if shm['usable'] else 'no '}  {SHM_DIR}: {room}")
    p = report["packages"]
    uv = p["uvloop"]
    lines += [
        "",
        "packages",
        f"  uvloop      {uv['version'] if uv['importable'] else 'not installed'}",
        f"  anyio       {p['anyio']['version'] or 'not installed'}",
        f"  torchft     {p['torchft']['version'] or 'not installed'} (optional)",
        f"  owner loop  {p['owner_loop']['kind'] or 'cannot start'}",
        "",
        f"abort truth table ({report['truth_table_source']}), for the backends here",
    ]
    for row in report["abort_truth_table"]:
        lines.append(f"  {row['backend']}, {row['mode']}: real abort: {row['real_abort']}")
        lines.append(f"      abort:       {row['abort_does']}")
        if row["local_op"] != "-":
            lines.append(f"      local op:    {row['local_op']}")
            lines.append(f"      its tensors: {row['tensors']}")
            lines.append(f"      peers' op:   {row['peers']}")
            lines.append(f"      verified by: {row['verified']}")
        if "here" in row:
            lines.append(f"      here:        {row['here']}")
    absent = [n for n in ROWS if not report["backends"][n]["usable"]]
    if absent:
        lines.append(f"  (not here: {', '.join(absent)}; their rows are in docs/errors.md)")
    if report["store"] is not None:
        s = report["store"]
        verdict = "reachable" if s["reachable"] else "NOT reachable"
        lines += ["", "store", f"  {s['addr']}  {verdict}: {s['detail']} ({s['seconds']:g} s)"]
    if report.get("etcd") is not None:
        e = report["etcd"]
        lines += ["", "etcd", f"  {e['addr']}  {e['detail']} ({e['seconds']:g} s)"]
        lines += [f"    {x['endpoint']}: {x['detail']}" for x in e["endpoints"]]
    if report["notes"]:
        lines += ["", "notes"] + [f"  - {n}" for n in report["notes"]]
    lines.append("")
    if report["ok"]:
        lines.append("OK: everything ftcomm needs is here")
    else:
        lines.append(f"{len(report['problems'])} problem(s):")
        for prob in report["problems"]:
            lines.append(f"  - {prob['what']}")
            lines.append(f"    do: {prob['advice']}")
    return "\n".join(lines) + "\n"


def _yn(flag: bool) -> str:
    """``"yes"`` or ``"no"``."""
    return "yes" if flag else "no"


def write(report: JSON, as_json: bool) -> None:
    """Print ``report`` on stdout: one JSON object, or :func:`render`'s text.

    A reader that left (``| head``) is no error: stdout is pointed at
    ``/dev/null`` so that the exit's flush does not fail again.
    """
    try:
        sys.stdout.write(json.dumps(report, indent=2) + "\n" if as_json else render(report))
        sys.stdout.flush()
    except BrokenPipeError:  # | head: the reader left; the status still counts
        with contextlib.suppress(OSError, ValueError):
            out = sys.stdout.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, out)  # so that the exit's flush does not fail again
            os.close(devnull)
