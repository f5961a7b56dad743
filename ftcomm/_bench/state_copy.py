"""The state-copy rows: ``ftcomm.sync_state`` of a big state (32 fp32
tensors) against raw Gloo send/recv of the same tensors into the receiver's
own (every op in flight at once), and against torchft's ``PGTransport``
where torchft is installed; to one member behind and to two; with the peak
extra memory (RSS) of the sender and of the receiver.

Owns: the three ranks' processes (spawned; rank 2 takes part in the
two-behind rows only), the cases, taking turns round by round, and the
rows' table (:func:`format_state_copy`) and JSON (:func:`state_copy_json`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from .report import percentile
from .runner import HOST, spawn_ranks

RANKS = 3
TENSORS = 32
MIB = 1024
"""The state's size (``--state-mib``)."""
ROUNDS = 5
"""Rounds of every case (``--state-rounds``)."""
CASES = ("raw", "ftcomm", "torchft", "raw x2", "ftcomm x2")
"""Raw Gloo to one member behind (the baseline), ftcomm's ``sync_state``,
torchft's ``PGTransport`` (when installed); then the same to two behind."""
_TIMEOUT = timedelta(seconds=120)


class StateCopyFailed(Exception):
    """A rank failed, or did not answer in time."""


@dataclass
class Rows:
    """Each case's times (seconds, the slowest rank's per round) and the
    peak extra RSS (bytes) of ftcomm's sender and receiver."""

    mib: int
    rounds: int
    times: dict[str, list[float]]
    extra: dict[str, int | None]
    """``None``: not measured (the high-water mark could not be reset)."""
    torchft: str | None
    """Why torchft's row is missing (``None``: it ran)."""

    def p50(self, case: str) -> float:
        return percentile(self.times[case], 50)

    def ratio(self, case: str, base: str) -> float:
        return self.p50(case) / self.p50(base)


def _status(field: str) -> int:
    """A size from /proc/self/status, in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


@contextlib.contextmanager
def _peak() -> Iterator[list[int | None]]:
    """The peak RSS over the block, less the RSS at its start: the kernel's
    own high-water mark, reset first (``/proc/self/clear_refs``), so nothing
    samples it while the copy runs. ``None`` where it cannot be reset."""
    box: list[int | None] = [None]
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM to the RSS now
    except OSError:  # not allowed here: no figure, the times still count
        yield box
        return
    base = _status("VmRSS")
    try:
        yield box
    finally:
        box[0] = max(_status("VmHWM") - base, 0)


def _state(rank: int, mib: int) -> dict[str, Any]:
    import torch

    per = mib * (1 << 20) // 4 // TENSORS
    gen = torch.Generator().manual_seed(0)
    if rank == 0:
        return {f"t{i}": torch.randn(per, generator=gen) for i in range(TENSORS)}
    return {f"t{i}": torch.zeros(per) for i in range(TENSORS)}


async def _rank(rank: int, port: int, mib: int, rounds: int, use_torchft: bool) -> dict[str, Any]:
    import torch
    from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

    import ftcomm

    torch.set_num_threads(1)
    store = TCPStore(HOST, port, is_master=False, timeout=_TIMEOUT)
    raw: Any = ProcessGroupGloo(PrefixStore("raw", store), rank, RANKS, _TIMEOUT)
    state = _state(rank, mib)
    tensors = list(state.values())
    times: dict[str, list[float]] = {case: [] for case in CASES}
    extra: dict[str, int | None] = {"sender": 0, "receiver": 0}
    sent = _digest(_state(0, mib)) if rank else 0.0
    wrong: list[str] = []
    two = ftcomm.Group("gloo", timeout=_TIMEOUT.total_seconds())
    one = ftcomm.Group("gloo", timeout=_TIMEOUT.total_seconds())
    await two.configure(f"{HOST}:{port}/two", rank, RANKS)
    if rank < 2:
        await one.configure(f"{HOST}:{port}/one", rank, 2)
    transport: Any = None
    if use_torchft and rank < 2:
        pgs: Any = importlib.import_module("torchft.process_group")
        pg_transport: Any = importlib.import_module("torchft.checkpointing.pg_transport")
        tpg = pgs.ProcessGroupGloo(timeout=_TIMEOUT)
        tpg.configure(f"{HOST}:{port}/torchft", "0", rank, 2)
        transport = pg_transport.PGTransport(
            tpg, _TIMEOUT, torch.device("cpu"), state_dict=lambda: state
        )

    def raw_copy(behind: list[int]) -> None:
        if rank == 0:
            works = [raw.send([t], dst, 0) for dst in behind for t in tensors]
        elif rank in behind:
            works = [raw.recv([t], 0, 0) for t in tensors]
        else:
            works = []
        for work in works:
            work.wait()

    async def ftcomm_copy(group: Any, behind: list[int]) -> None:
        if rank == 0 or rank in behind:
            with _peak() as peak:
                await ftcomm.sync_state(group, state, 1 if rank == 0 else 0)
            role = "sender" if rank == 0 else "receiver"
            held, now = extra[role], peak[0]
            extra[role] = None if held is None or now is None else max(held, now)

    def torchft_copy() -> None:
        if rank == 0:
            transport.send_checkpoint([1], 1, state, _TIMEOUT)
        elif rank == 1:
            transport.recv_checkpoint(0, transport.metadata(), 1, _TIMEOUT)

    async def timed(case: str, run: Callable[[], Any]) -> None:
        raw.barrier().wait()
        started = time.perf_counter()
        result = run()
        if asyncio.iscoroutine(result):
            await result
        times[case].append(time.perf_counter() - started)

    def check(case: str, behind: list[int]) -> None:
        """A member behind holds what was sent (zeroed before each case)."""
        if rank in behind and _digest(state) != sent:
            wrong.append(case)

    for _ in range(rounds + 1):  # the first round warms up, and is dropped
        for case, run, behind in (
            ("raw", lambda: raw_copy([1]), [1]),
            ("ftcomm", lambda: ftcomm_copy(one, [1]), [1]),
            ("torchft", torchft_copy, [1]),
            ("raw x2", lambda: raw_copy([1, 2]), [1, 2]),
            ("ftcomm x2", lambda: ftcomm_copy(two, [1, 2]), [1, 2]),
        ):
            if case == "torchft" and not use_torchft:
                continue
            if rank:
                for t in tensors:
                    t.zero_()
            await timed(case, run if case != "torchft" or transport is not None else _nothing)
            check(case, behind)
    raw.barrier().wait()
    await one.shutdown()
    await two.shutdown()
    if transport is not None:
        tpg.shutdown()
    return {"times": {c: v[1:] for c, v in times.items()}, "extra": extra, "wrong": wrong}


def _nothing() -> None:
    return None


def _digest(state: dict[str, Any]) -> float:
    return float(sum(t.double().sum().item() for t in state.values()))


def _child(
    rank: int, port: int, mib: int, rounds: int, use_torchft: bool, conn: Connection
) -> None:
    try:
        conn.send(("ok", asyncio.run(_rank(rank, port, mib, rounds, use_torchft))))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise


def measure(mib: int, rounds: int, torchft_skip: str | None, timeout: float = 600.0) -> Rows:
    """Run the three ranks; each case's times and ftcomm's extra memory.

    Raises:
        StateCopyFailed: a rank raised (its traceback in the message), exited
            without an answer, or none came within ``timeout`` seconds; or the
            members behind did not end with the sender's state.
    """
    from .._server import serve_store

    server = serve_store(HOST)  # loopback only
    try:
        args = [(r, server.port, mib, rounds, torchft_skip is None) for r in range(RANKS)]
        answers = spawn_ranks(_child, args, timeout, StateCopyFailed)
    finally:
        server.close()
    for rank, answer in enumerate(answers):
        if answer["wrong"]:
            raise StateCopyFailed(f"rank {rank} did not get the state sent in {answer['wrong']}")
    times = {
        case: [max(a["times"][case][i] for a in answers) for i in range(rounds)]
        for case in CASES
        if answers[0]["times"][case]
    }
    extra = {"sender": answers[0]["extra"]["sender"], "receiver": answers[1]["extra"]["receiver"]}
    return Rows(mib, rounds, times, extra, torchft_skip)


def format_state_copy(rows: Rows) -> str:
    mb = rows.mib * (1 << 20)
    lines = [
        f"state copy ({rows.mib} MiB in {TENSORS} fp32 tensors, CPU Gloo, loopback; the cases "
        "take turns, each round's slowest rank):",
        f"{'what':<40}{'p50_s':>8}{'GB/s':>8}{'vs raw':>9}",
    ]
    labels = {
        "raw": "raw gloo send/recv in place, 1 behind",
        "ftcomm": "ftcomm sync_state, 1 behind",
        "torchft": "torchft PGTransport, 1 behind",
        "raw x2": "raw gloo send/recv in place, 2 behind",
        "ftcomm x2": "ftcomm sync_state, 2 behind",
    }
    for case, label in labels.items():
        if case not in rows.times:
            continue
        p50 = rows.p50(case)
        base = "raw x2" if case.endswith("x2") else "raw"
        ratio = "" if case.startswith("raw") else f"{rows.ratio(case, base):8.2f}x"
        lines.append(f"{label:<40}{p50:8.3f}{mb / p50 / 1e9:8.2f}{ratio:>9}")
    if rows.torchft is not None:
        lines.append(f"(torchft's row skipped: {rows.torchft})")
    lines.append(
        f"two behind take {rows.ratio('ftcomm x2', 'ftcomm'):.2f}x the time of one "
        "(a chain: on one machine's loopback every byte forwarded costs its cores "
        "again; across hosts each link carries it once)"
    )
    sender, receiver = rows.extra["sender"], rows.extra["receiver"]
    if sender is None or receiver is None:
        lines.append("ftcomm's peak extra memory: not measured (/proc/self/clear_refs refused)")
    else:
        lines.append(
            f"ftcomm's peak extra memory: sender {sender / 2**20:.0f} MiB, "
            f"receiver {receiver / 2**20:.0f} MiB ({rows.rounds} rounds)"
        )
    return "\n".join(lines)


def state_copy_json(rows: Rows) -> dict[str, Any]:
    return {
        "mib": rows.mib,
        "tensors": TENSORS,
        "rounds": rows.rounds,
        "rows": [
            {"case": case, "p50_s": rows.p50(case), "times_s": rows.times[case]}
            for case in rows.times
        ],
        "ratio_to_raw": rows.ratio("ftcomm", "raw"),
        "torchft_ratio_to_raw": rows.ratio("torchft", "raw") if "torchft" in rows.times else None,
        "two_behind_over_one": rows.ratio("ftcomm x2", "ftcomm"),
        "extra_bytes": rows.extra,
        "torchft_skipped": rows.torchft,
    }
