"""Write the bench's section of docs/performance.md from a bench JSON file.

    python -m ftcomm bench --pin --json docs/bench.json   # measure (make bench-page)
    python scripts/performance_page.py docs/bench.json    # rewrite the section
    python scripts/performance_page.py --check docs/bench.json

The section lies between the two markers below; the rest of the page is
written by hand. ``--check`` exits 1 when the page's section is not what the
JSON gives (tests/test_docs.py runs it), so the figures on the page are always
those of the JSON file beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
BEGIN = "<!-- bench: written by scripts/performance_page.py from docs/bench.json -->"
END = "<!-- bench: end -->"


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _para(text: str) -> list[str]:
    return textwrap.wrap(text, width=76, break_on_hyphens=False)


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _us(value: float | None) -> str:
    return _num(value, 0 if value is None or value >= 100 else 1)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _header(doc: dict[str, Any]) -> list[str]:
    plan = doc["plan"]
    when = doc.get("measured") or "an unrecorded date"
    commit = doc.get("commit")
    at = f" at commit `{commit}`" if commit else ""
    pinned = "each rank pinned to a core" if plan["pin"] else "unpinned"
    return _para(
        f"Measured {when}{at} by `python -m ftcomm bench"
        + (" --pin" if plan["pin"] else "")
        + "`: "
        + f"{doc['machine']}; Python {doc['python']}, torch {doc['torch']}, "
        + f"ftcomm {doc['ftcomm']}; {doc['world_size']} ranks of {doc['backend']} over "
        + f"{doc['transport']}, the {plan['loop']} loop, {pinned}, "
        + f"{plan['rounds']} interleaved rounds. Ratios are to raw `torch.distributed` "
        + f"({plan['baseline']}) measured in the same run."
    )


def _latency(doc: dict[str, Any]) -> list[str]:
    lines = ["### Collectives", ""]
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for row in doc["rows"]:
        by_workload.setdefault(row["workload"], []).append(row)
    for w in doc["plan"]["workloads"]:
        rows = by_workload.get(w["label"], [])
        if not rows:
            continue
        lines += [f"**{w['label']}** ({w['bytes']:,} B, {w['iters']:,} ops per case)", ""]
        head = ["case", "p50 µs", "p90 µs", "p99 µs", "p50 / raw"]
        if w["bandwidth"]:
            head += ["GB/s", "bandwidth / raw"]
        cells = []
        for row in rows:
            cell = [
                row["case"],
                _us(row["p50_us"]),
                _us(row["p90_us"]),
                _us(row["p99_us"]),
                _ratio(row["ratio_p50_vs_raw"]),
            ]
            if w["bandwidth"]:
                cell += [_num(row["gb_per_s"], 2), _ratio(row["bw_ratio_vs_raw"])]
            cells.append(cell)
        lines += [*_table(head, cells), ""]
    return lines


def _recovery(rows: list[dict[str, Any]]) -> list[str]:
    cells = [
        [r["what"], str(r["samples"]), _num(r["p50_ms"], 1), _num(r["max_ms"], 1)] for r in rows
    ]
    return ["### Recovery", "", *_table(["what", "samples", "p50 ms", "max ms"], cells), ""]


def _membership(m: dict[str, Any]) -> list[str]:
    lines = [
        "### Membership: a member killed or stopped",
        "",
        *_para(
            f"{m['members']} members, heartbeat timeout {m['heartbeat_timeout_s']} s, "
            f"join window {m['join_window_s']} s, op deadline {m['op_deadline_s']} s. "
            "From the signal to the survivors' first good allreduce in the next "
            "generation (torchft: its first committed step); detection is the "
            "heartbeat timeout for a SIGKILL and the op deadline for a SIGSTOP, "
            "and beyond is the total less it (negative: found sooner, a killed "
            "member by its listener refusing at once, a stopped one by its "
            "heartbeat lapsing before the op deadline)."
        ),
        "",
    ]
    cells = [
        [
            r["what"],
            str(r["trials"]),
            _num(r["detection_ms"]),
            _num(r.get("p50_ms")),
            _num(r.get("p90_ms")),
            _num(r.get("beyond_p50_ms")),
            r["failed"] or (f"{r['voided']} trial(s) voided" if r.get("voided") else ""),
        ]
        for r in m["rows"]
    ]
    head = ["row", "trials", "detection ms", "p50 ms", "p90 ms", "beyond p50 ms", "failed"]
    notes = m.get("notes", [])
    return [*lines, *_table(head, cells), *([""] if notes else []), *_notes(notes), ""]


def _fsdp(f: dict[str, Any]) -> list[str]:
    cells = [[r["impl"], _num(r["p50_ms"], 1), _num(r["p90_ms"], 1)] for r in f["rows"]]
    return [
        "### FSDP2",
        "",
        *_para(
            f"{f['world_size']} ranks, {f['model']}, batch {f['batch']}, "
            f"{f['steps_per_round']} steps a round, {f['rounds']} rounds; "
            f"ftcomm's step p50 is {_ratio(f['ratio_p50'])} torch's own group's."
        ),
        "",
        *_table(["group", "step p50 ms", "step p90 ms"], cells),
        "",
    ]


def _state_copy(s: dict[str, Any]) -> list[str]:
    def rows(items: list[dict[str, Any]], mib: float) -> list[list[str]]:
        return [
            [r["case"], _num(r["p50_s"], 3), _num(mib * 2**20 / 1e9 / r["p50_s"], 2)]
            for r in items
            if r["p50_s"]
        ]

    extra = s.get("extra_bytes") or {}
    memory = ", ".join(f"{who} {n / 2**20:.1f} MiB" for who, n in extra.items())
    torchft = s.get("torchft_ratio_to_raw")
    lines = [
        "### State copied to a rejoining member",
        "",
        *_para(
            f"{s['mib']:,} MiB in {s['tensors']} tensors, {s['rounds']} rounds, the "
            "cases taking turns; a case marked x2 copies to two members behind (a "
            f"chain). ftcomm took {_ratio(s['ratio_to_raw'])} raw Gloo send/recv's "
            "time"
            + (f", torchft's PGTransport {_ratio(torchft)}" if torchft is not None else "")
            + f"; two behind took {_ratio(s['two_behind_over_one'])} one's time"
            + (f"; ftcomm's peak extra memory: {memory}." if memory else ".")
        ),
        "",
        *_table(["case", "p50 s", "GB/s"], rows(s["rows"], s["mib"])),
        "",
    ]
    links = s.get("links")
    if links:
        lines += [
            *_para(
                f"Over links of their own, three members in network namespaces, "
                f"{links['gbit']} Gbit/s each way ({links['mib']} MiB): two behind "
                f"took {_ratio(links['two_behind_over_one'])} one's time."
            ),
            "",
            *_table(["case", "p50 s", "GB/s"], rows(links["rows"], links["mib"])),
            "",
        ]
    return lines


def _notes(notes: Sequence[str], title: str | None = None) -> list[str]:
    if not notes:
        return []
    return [*([f"{title}:", ""] if title else []), *(f"- {n}" for n in notes), ""]


def render(doc: dict[str, Any]) -> str:
    """The section for one bench JSON document, markers included."""
    if doc.get("bench") != "ftcomm":
        raise ValueError("not the JSON of python -m ftcomm bench")
    lines = [BEGIN, "", *_header(doc), "", *_latency(doc)]
    if doc.get("recovery"):
        lines += _recovery(doc["recovery"])
    if doc.get("membership"):
        lines += _membership(doc["membership"])
    if doc.get("fsdp"):
        lines += _fsdp(doc["fsdp"])
    if doc.get("state_copy"):
        lines += _state_copy(doc["state_copy"])
    lines += _notes(doc.get("notes", []), "Notes") + _notes(doc.get("failures", []), "Failures")
    while lines[-1] == "":
        lines.pop()
    return "\n".join([*lines, "", END])


def splice(page: str, section: str) -> str:
    """``page`` with its bench section replaced by ``section``."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no section between {BEGIN!r} and {END!r}")
    return page[:start] + section + page[end + len(END) :]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", type=Path, help="a python -m ftcomm bench --json file")
    p.add_argument("--page", type=Path, default=PAGE, help="the page (docs/performance.md)")
    p.add_argument("--check", action="store_true", help="exit 1 if the page differs")
    args = p.parse_args(argv)
    doc = json.loads(args.json.read_text(encoding="utf-8"))
    page = args.page.read_text(encoding="utf-8")
    new = splice(page, render(doc))
    if args.check:
        if new != page:
            print(f"{args.page}: its bench section is not {args.json} rendered", file=sys.stderr)
            return 1
        return 0
    if new != page:
        args.page.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
