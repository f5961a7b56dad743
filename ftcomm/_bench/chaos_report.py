"""The chaos soak's table and JSON (``python -m ftcomm bench --chaos``).

Owns: :func:`format_chaos` (one line a row: goodput next to its target,
the recovery gaps, the time stalled, faults, generations, evictions, and
whether every member ended with the same parameters; then each stall's
message, and how a row with network faults ran) and :func:`chaos_json`
(the same figures, every fault's with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .chaos import HEARTBEAT_TIMEOUT, JOIN_WINDOW, OP_DEADLINE, STATE_MIB, Phase, Row
from .report import percentile


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def _gaps(phase: Phase) -> tuple[float, float, float] | None:
    gaps = phase.gaps
    if not gaps:
        return None
    return percentile(gaps, 50), percentile(gaps, 90), max(gaps)


def _verdict(row: Row) -> str:
    if row.spec.target is None or row.goodput is None:
        return ""
    return f">= {row.spec.target:.2f} {'ok' if row.goodput >= row.spec.target else 'MISSED'}"


def format_chaos(
    rows: Sequence[Row],
    seconds: float,
    seed: int,
    notes: Sequence[str],
    state_mib: int = STATE_MIB,
) -> str:
    where = "on hosts of their own" if all(row.spec.network for row in rows) else "on loopback"
    lines = [
        f"chaos soak: {state_mib} MiB of fp32 parameters (and momentum), members {where} "
        f"(each a process); {seconds:g} s without faults, then {seconds:g} s with them; seed "
        f"{seed}; heartbeat timeout {HEARTBEAT_TIMEOUT:g} s, op deadline {OP_DEADLINE:g} s, "
        f"join window {JOIN_WINDOW:g} s",
        f"{'system':<8} {'n':>2} {'faults':<9} {'every':>5} {'steps':>6} {'w/faults':>8}"
        f" {'goodput':>7} {'target':<11} {'gap_p50':>7} {'gap_p90':>7} {'gap_max':>7}"
        f" {'stalled':>7} {'faults':>6} {'gens':>4} {'evict':>5} {'clean':>5} {'same':>4}",
    ]
    for row in rows:
        spec = row.spec
        head = f"{spec.system:<8} {spec.members:>2} {'/'.join(spec.kinds):<9} {spec.interval:>4g}s"
        clean, chaos = row.clean, row.chaos
        if row.failed is not None or clean is None or chaos is None:
            lines.append(f"{head} FAILED: {(row.failed or 'not run').splitlines()[0]}")
            continue
        gaps = _gaps(chaos)
        gap_cols = (
            " ".join(f"{_ms(g):7.0f}" for g in gaps) if gaps else f"{'-':>7} {'-':>7} {'-':>7}"
        )
        goodput = row.goodput
        lines.append(
            f"{head} {clean.committed:>6} {chaos.committed:>8}"
            f" {goodput if goodput is not None else float('nan'):7.3f} {_verdict(row):<11}"
            f" {gap_cols} {chaos.stalled:6.2f}s {len(chaos.faults):>6} {chaos.generations:>4}"
            f" {chaos.evictions:>5} {f'{clean.generations}/{clean.evictions}':>5} {'yes':>4}"
        )
    lines.append(
        "(steps: the job's committed steps in the window, without faults and with them; "
        "goodput: their ratio; gap: from a fault to the next good step of the survivors, ms; "
        "stalled: the time the job made no step, from its last step in a generation to its "
        "first in the next, added up (a smaller world steps faster on a small machine: steps "
        "alone can hide a stall); gens: generations (torchft: quorums) the members entered in "
        "the window; evict: members taken for dead while alive (Evicted, then join() again); "
        "clean: gens/evict without faults, 0/0 where no live member was taken for dead; same: "
        "every member ended with bit-identical parameters and momentum, at one step)"
    )
    for row in rows:
        if row.spec.network:
            heal = row.spec.interval / 2 if row.spec.heal is None else row.spec.heal
            cut = f"{row.chaos.cut_off} of its evictions cut off" if row.chaos else "not run"
            lines.append(
                f"network: {row.spec.label}: each member on a host of its own (a network "
                f"namespace; the store on a hub), in both phases; partition drops the packets "
                f"between the victim's host and the others' (not the store's), isolate all of "
                f"its host's; lifted after {heal:g} s, nothing killed ({cut})"
            )
    for row in rows:
        for name, phase in (("without faults", row.clean), ("with faults", row.chaos)):
            for text in phase.timeouts if phase is not None else ():
                first = text.splitlines()[0] if text else ""
                lines.append(f"stall: {row.spec.label}, {name}: a call ran out of time: {first}")
    lines.extend(f"note: {note}" for note in notes)
    return "\n".join(lines)


def _phase_json(phase: Phase | None) -> dict[str, Any] | None:
    if phase is None:
        return None
    gaps = _gaps(phase)
    return {
        "seconds": phase.seconds,
        "committed_steps": phase.committed,
        "steps_per_s": round(phase.committed / phase.seconds, 3),
        "generations": phase.generations,
        "stalled_s": round(phase.stalled, 3),
        "evictions": phase.evictions,
        "evictions_cut_off": phase.cut_off,
        "membership_timeouts": list(phase.timeouts),
        "final_step": phase.final_step,
        "members_at_end": phase.members_at_end,
        "faults": [
            {
                "at_s": round(f.at, 3),
                "kind": f.kind,
                "member": f.member,
                "generation": f.generation,
                "gap_ms": None if f.gap is None else _ms(f.gap),
            }
            for f in phase.faults
        ],
        "gap_p50_ms": None if gaps is None else _ms(gaps[0]),
        "gap_p90_ms": None if gaps is None else _ms(gaps[1]),
        "gap_max_ms": None if gaps is None else _ms(gaps[2]),
    }


def chaos_json(
    rows: Sequence[Row],
    seconds: float,
    seed: int,
    notes: Sequence[str],
    state_mib: int = STATE_MIB,
) -> dict[str, Any]:
    """The rows as one JSON-able object."""
    out = []
    for row in rows:
        spec, goodput = row.spec, row.goodput
        out.append(
            {
                "what": spec.label,
                "system": spec.system,
                "members": spec.members,
                "kinds": list(spec.kinds),
                "interval_s": spec.interval,
                "heal_s": (spec.interval / 2 if spec.heal is None else spec.heal)
                if spec.network
                else None,
                "clean": _phase_json(row.clean),
                "faults": _phase_json(row.chaos),
                "goodput": None if goodput is None else round(goodput, 4),
                "target": spec.target,
                "target_met": None
                if spec.target is None or goodput is None
                else goodput >= spec.target,
                "identical": None if row.failed is not None else True,
                "failed": row.failed,
            }
        )
    return {
        "seconds": seconds,
        "seed": seed,
        "state_mib": state_mib,
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
        "op_deadline_s": OP_DEADLINE,
        "join_window_s": JOIN_WINDOW,
        "rows": out,
        "notes": list(notes),
    }
