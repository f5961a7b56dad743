"""``python -m ftcomm bench --scale``: what a world of members costs as it grows.

Owns: a scale trial (:func:`trial`: a store, ``size`` members, each a process
of its own started from ftcomm.testing's fork server; they join together,
one is SIGKILLed, the others recover), its member process, the count of the
store's operations and bytes in one heartbeat round (a counting wrapper
around the member's heartbeat client: :class:`Counting`), and the rows'
table (:func:`format_scale`) and JSON (:func:`scale_json`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from .chaos import _store
from .fleet import Fleet, FleetFailed, Incarnation, Target, dump, install_dumps, stacks_file
from .membership import _fail, _OnPurpose, _take_env
from .report import percentile
from .runner import _LOOP_ENV, run_on

SIZES = (3, 8, 16, 32)
"""World sizes (``--scale-sizes``)."""
MAX_SIZE = 64
TRIALS = 3
"""Trials per size."""
ROUNDS = 10
"""Heartbeat rounds counted per member."""
HEARTBEAT_TIMEOUT = 1.0
"""Membership's default: 32 processes share two cores here."""
JOIN_WINDOW = 10.0
"""Longer than any start: the first generation forms at the full size (a
killed member is dead, not waited for: the window does not slow a recovery)."""
OP_DEADLINE = 5.0
CALL_TIMEOUT = 60.0
STEP_PAUSE = 0.005
"""Seconds between two steps: a step's compute, which leaves the two cores
to the heartbeats of 32 processes."""
_TRIAL_TIMEOUT = 180.0
TARGET_RATIO = 2.0
"""At 32 members, at most this many times the 3-member figure."""


class ScaleFailed(Exception):
    """A trial failed: a member failed, exited, or said nothing in time."""


@dataclass(frozen=True)
class Settings:
    """What every member of a trial runs with (pickled to each)."""

    size: int
    loop: str
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    join_window: float = JOIN_WINDOW
    op_deadline: float = OP_DEADLINE
    timeout: float = CALL_TIMEOUT
    rounds: int = ROUNDS
    stacks: str = ""
    """A folder for each member's stacks, written when a trial fails."""


# -- counting the store's load ----------------------------------------------------------
_REPLY_VALUES = {"compare_set": 1, "get": 1, "multi_get": -1, "add": 0, "check": 0}
"""Values in each call's reply (-1: one per key); ``add`` replies an int64 and
``check`` a byte (counted as 8 and 1); ``set``, ``append`` and the others
reply nothing."""


class Counting:
    """A store client that counts what goes through it, one heartbeat round
    at a time: rounds begin at each write of the member's own heartbeat key
    (``beat``), the first of every round. Counting starts at the first beat
    it sees and stops after ``rounds`` rounds (:attr:`done`).

    The bytes are those of c10d's ``TCPStore`` protocol as its client frames
    a call (``torch/csrc/distributed/c10d/TCPStore.cpp``): a 1-byte command,
    then each key and value as an 8-byte length and its bytes (a key with
    the store's ``/`` and the engine's prefix before it; a ``multi_get`` adds
    an 8-byte count); a reply, each value as an 8-byte length and its bytes.
    TCP's own headers are not counted."""

    def __init__(self, inner: Any, beat_key: str, prefix_bytes: int, rounds: int) -> None:
        self._inner = inner
        self._beat_key = beat_key
        self._prefix = prefix_bytes  # "/" and the engine's prefix, before every key
        self._rounds = rounds
        self.beats = 0
        self.ops: dict[str, int] = {}
        self.sent = 0
        self.received = 0
        self.done = threading.Event()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            self._count(name, args, result)
            return result

        return call

    def _count(self, name: str, args: tuple[Any, ...], result: Any) -> None:
        if name == "compare_set" and args and args[0] == self._beat_key:
            self.beats += 1
            if self.beats == self._rounds + 1:
                self.done.set()
        if not 1 <= self.beats <= self._rounds:
            return
        self.ops[name] = self.ops.get(name, 0) + 1
        sent = 1
        if name in ("multi_get", "multi_set") and args:
            keys = list(args[0])
            sent += 8 + sum(8 + self._prefix + len(k) for k in keys)
            if name == "multi_set" and len(args) > 1:
                sent += 8 + sum(8 + len(_raw(v)) for v in args[1])
        elif args:
            sent += 8 + self._prefix + len(str(args[0]))
            sent += sum(8 + len(_raw(v)) for v in args[1:] if isinstance(v, (str, bytes)))
            sent += sum(8 for v in args[1:] if isinstance(v, int))
        self.sent += sent
        values = _REPLY_VALUES.get(name)
        if name == "add":
            self.received += 8
        elif name == "check":
            self.received += 1
        elif values == 1:
            self.received += 8 + len(_raw(result))
        elif values == -1:
            self.received += sum(8 + len(_raw(v)) for v in result)


def _raw(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _count_rounds(members: Any, rounds: int) -> Counting | None:
    """Put a :class:`Counting` between the member's heartbeat thread and its
    store client (the store engine's watcher: ``None`` on another engine)."""
    membership: Any = importlib.import_module("ftcomm._membership.membership")
    engine = membership.engine_of(members)
    watcher = getattr(engine, "watcher", None)
    if watcher is None:
        return None
    beat_key: Any = importlib.import_module("ftcomm._membership._watch").beat_key
    prefix = 1 + len(engine.prefix)
    counting = Counting(watcher.store, beat_key(members.member_id), prefix, rounds)
    watcher.swap_store(counting)
    return counting


def _uncount(members: Any, counting: Counting) -> None:
    """Give the heartbeat thread its own client back."""
    membership: Any = importlib.import_module("ftcomm._membership.membership")
    membership.engine_of(members).watcher.swap_store(counting._inner)


# -- a member -------------------------------------------------------------------------
def scale_member(
    address: str, job: str, member: str, settings: Settings, env: dict[str, str], conn: Connection
) -> None:
    """A member's process: ready, then (at ``go``) join, count, step, recover."""
    _take_env(env)
    os.environ[_LOOP_ENV] = settings.loop
    torch.set_num_threads(1)
    logging.getLogger("ftcomm").addFilter(_OnPurpose())
    try:
        import ftcomm  # noqa: F401  (before "ready": not part of the join)

        conn.send(("ready",))
        if conn.recv()[0] != "go":
            return
        run_on(settings.loop, _member(address, job, member, settings, conn))
    except BaseException:
        _fail(conn)


async def _member(
    address: str, job: str, member: str, settings: Settings, conn: Connection
) -> None:
    import ftcomm

    if settings.stacks:
        install_dumps(stacks_file(settings.stacks, member))
    async with (
        ftcomm.Membership(
            address,
            job,
            member,
            min_size=max(1, settings.size - 1),
            max_size=settings.size,
            join_window=settings.join_window,
            heartbeat_timeout=settings.heartbeat_timeout,
            timeout=settings.timeout,
        ) as members,
        ftcomm.Group("gloo", timeout=settings.op_deadline) as group,
    ):
        conn.send(("opened", time.monotonic()))
        while True:
            try:
                world = await members.join(group)
                break
            except ftcomm.MembershipTimeout as exc:  # a stall: again (as its docs say)
                conn.send(("timeout", time.monotonic(), str(exc)))
        t = torch.ones(2)
        await group.allreduce(t, timeout=settings.op_deadline)
        conn.send(("joined", time.monotonic(), world.generation, world.size))
        counting = _count_rounds(members, settings.rounds)
        if counting is None:
            conn.send(("load", 0, {}, 0, 0))
        size, stop = world.size, 0.0
        while True:
            if counting is not None and counting.done.is_set():
                _uncount(members, counting)
                conn.send(("load", settings.rounds, counting.ops, counting.sent, counting.received))
                counting = None
            t[0], t[1] = 1.0, stop
            try:
                await group.allreduce(t, timeout=settings.op_deadline)
            except ftcomm.CommError:
                while True:
                    try:
                        world = await members.recover(group)
                        break
                    except ftcomm.MembershipTimeout as exc:
                        conn.send(("timeout", time.monotonic(), str(exc)))
                continue
            if world.size < size:
                conn.send(("back", time.monotonic(), world.size))
            size = world.size
            if t[1].item() > 0:
                break
            if not stop and conn.poll():
                conn.recv()
                stop = 1.0
            await asyncio.sleep(STEP_PAUSE)
        conn.send(("done",))
        await asyncio.get_running_loop().run_in_executor(None, _until_exit, conn)


def _until_exit(conn: Connection) -> None:
    try:
        while conn.recv()[0] != "exit":
            pass
    except EOFError:
        pass


# -- a trial and the rows -------------------------------------------------------------
@dataclass
class Trial:
    join: float
    kill_to_good: float
    start: float
    """From the first process started to the last one ready (imports)."""
    ops_per_round: float
    """Store operations of one member's heartbeat round (mean over members)."""
    bytes_per_round: float
    ops: dict[str, float] = field(default_factory=dict)
    stalls: list[str] = field(default_factory=list)
    """What each join()/recover() that ran out of time said (it was called again)."""
    connect: float = 0.0
    """From ``go`` to the last member's ``Membership`` open (its store clients
    connected, its listener up): part of :attr:`join`."""


def _target(address: str, job: str, settings: Settings) -> Callable[[str], Target]:
    def target(member: str) -> Target:
        return scale_member, (address, job, member, settings)

    return target


def trial(ctx: Any, size: int, loop: str, n: int, rounds: int = ROUNDS) -> Trial:
    """One trial at ``size`` members (``rounds`` heartbeat rounds counted).

    Every process starts and says it is ready (torch imported by the fork
    server, ftcomm by itself); then the bench says ``go`` to all at once.
    **Join** is from ``go`` to the last member's first allreduce done in the
    first generation (which has every member: ``max_size`` is the size;
    where a call runs out of time, the member calls it again, and the stall
    is in the figure and in a note). Each member then counts its heartbeat
    rounds' store operations and bytes for ``rounds`` rounds while it steps
    (an allreduce of two floats, then :data:`STEP_PAUSE` s, a step's
    compute). Then one member is SIGKILLed; **kill to good step** is from
    the signal to the last survivor's first good allreduce in the world
    without it.

    Raises:
        ScaleFailed: a member failed or exited, or said nothing in time.
    """
    folder = tempfile.mkdtemp(prefix="ftcomm-scale-")
    settings = Settings(size, loop, rounds=rounds, stacks=folder)
    deadline = time.monotonic() + _TRIAL_TIMEOUT
    with _store() as address:
        fleet = Fleet(ctx, _target(address, f"scale-{size}-{n}", settings))
        stalls: list[str] = []
        opened: dict[Incarnation, float] = {}

        def on(inc: Incarnation, message: tuple[Any, ...]) -> None:
            if message[0] == "timeout":
                stalls.append(f"{inc.name}: {message[2]}")
            elif message[0] == "opened":
                opened.setdefault(inc, float(message[1]))

        try:
            first = time.monotonic()
            for i in range(size):
                fleet.start(f"m{i}")
            live = fleet.live()
            fleet.expect(live, "ready", deadline, on)
            go = time.monotonic()
            for inc in live:
                inc.send(("go",))
            joined = fleet.expect(live, "joined", deadline, on)
            worlds = {m[2:] for m in joined.values()}
            if len(worlds) != 1 or next(iter(worlds))[1] != size:
                raise ScaleFailed(f"the members joined different or smaller worlds: {worlds}")
            loads = fleet.expect(live, "load", deadline, on)
            victim = live[1 % size]
            survivors = [inc for inc in live if inc is not victim]
            killed = time.monotonic()
            fleet.kill(victim)
            back = fleet.expect(survivors, "back", deadline, on)
            for inc in survivors:
                inc.send(("stop",))
            fleet.expect(survivors, "done", deadline, on)
            for inc in survivors:
                inc.send(("exit",))
        except FleetFailed as exc:
            stacks = dump(fleet.live(), folder)
            raise ScaleFailed(
                f"{size} members, trial {n + 1}: {exc}\nthe others' stacks:\n{stacks}"
            ) from None
        finally:
            fleet.close()
            shutil.rmtree(folder, ignore_errors=True)
    trial = _trial_of(first, go, joined, killed, back, loads, stalls)
    trial.connect = max(opened.values(), default=go) - go
    return trial


def _trial_of(
    first: float,
    go: float,
    joined: dict[Incarnation, tuple[Any, ...]],
    killed: float,
    back: dict[Incarnation, tuple[Any, ...]],
    loads: dict[Incarnation, tuple[Any, ...]],
    stalls: list[str],
) -> Trial:
    counted = [m for m in loads.values() if m[1]]
    rounds = sum(m[1] for m in counted) or 1
    ops: dict[str, float] = {}
    for m in counted:
        for name, count in m[2].items():
            ops[name] = ops.get(name, 0.0) + count / rounds
    return Trial(
        join=max(float(m[1]) for m in joined.values()) - go,
        kill_to_good=max(float(m[1]) for m in back.values()) - killed,
        start=go - first,
        ops_per_round=sum(ops.values()),
        bytes_per_round=sum(m[3] + m[4] for m in counted) / rounds,
        ops=ops,
        stalls=stalls,
    )


@dataclass
class Row:
    size: int
    trials: list[Trial] = field(default_factory=list)
    failed: str | None = None

    def p50(self, what: Callable[[Trial], float]) -> float:
        return percentile([what(t) for t in self.trials], 50)


def measure(
    sizes: Sequence[int], loop: str, progress: Callable[[str], None] = lambda line: None
) -> list[Row]:
    """:data:`TRIALS` trials per size, smallest first; a size whose trial
    fails says why (the others still run)."""
    from ..testing._world import _mp_context

    ctx = _mp_context()
    rows: list[Row] = []
    for size in sorted(sizes):
        progress(f"scale: {size} members, {TRIALS} trials")
        row = Row(size)
        try:
            for n in range(TRIALS):
                row.trials.append(trial(ctx, size, loop, n))
        except ScaleFailed as exc:
            row.failed = str(exc)
        rows.append(row)
    return rows


def _ratio(rows: Sequence[Row], row: Row, what: Callable[[Trial], float]) -> float | None:
    base = next((r for r in rows if r.size == 3), None)
    if base is None or base.failed or row.failed or not base.trials or not row.trials:
        return None
    return row.p50(what) / base.p50(what)


def _verdict(rows: Sequence[Row], row: Row, what: Callable[[Trial], float]) -> str:
    ratio = _ratio(rows, row, what)
    if ratio is None:
        return ""
    mark = f"{ratio:.2f}x"
    if row.size == 32:
        mark += f" (<= {TARGET_RATIO:g}x: {'ok' if ratio <= TARGET_RATIO else 'MISSED'})"
    return mark


def _join(t: Trial) -> float:
    return t.join


def _kill(t: Trial) -> float:
    return t.kill_to_good


def _after(t: Trial) -> float:
    return t.join - t.connect


def format_scale(rows: Sequence[Row], notes: Sequence[str]) -> str:
    interval = HEARTBEAT_TIMEOUT / 5
    lines = [
        f"scale: members on loopback, each a process (from the fork server); {TRIALS} trials "
        f"per size, p50; heartbeat timeout {HEARTBEAT_TIMEOUT:g} s (a round every "
        f"{interval:g} s); a step: an allreduce of 2 floats, then {STEP_PAUSE * 1e3:g} ms",
        f"{'members':>7} {'join_ms':>8} {'vs 3':<21} {'conn_ms':>8} {'after_ms':>8} {'vs 3':>6}"
        f" {'kill_ms':>8} {'vs 3':<21}"
        f" {'ops/round':>9} {'B/round':>8} {'store ops/s':>11} {'store B/s':>10}",
    ]
    for row in rows:
        if row.failed is not None or not row.trials:
            lines.append(f"{row.size:>7} FAILED: {(row.failed or 'no trial').splitlines()[0]}")
            continue
        ops, nbytes = row.p50(lambda t: t.ops_per_round), row.p50(lambda t: t.bytes_per_round)
        after = _ratio(rows, row, _after)
        lines.append(
            f"{row.size:>7} {row.p50(_join) * 1e3:8.0f} {_verdict(rows, row, _join):<21}"
            f" {row.p50(lambda t: t.connect) * 1e3:8.0f} {row.p50(_after) * 1e3:8.0f}"
            f" {'' if after is None else f'{after:.2f}x':>6}"
            f" {row.p50(_kill) * 1e3:8.0f} {_verdict(rows, row, _kill):<21}"
            f" {ops:9.1f} {nbytes:8.0f} {ops * row.size / interval:11.0f}"
            f" {nbytes * row.size / interval:10.0f}"
        )
    lines.append(
        "(join: from every process ready, told to go at once, to the last member's first "
        "allreduce in the first generation; conn: from go to the last member's Membership "
        "open (its store clients: each c10d client looks its socket's address up in DNS, "
        "and a resolver that drops a query waits its timeout, 5 s by default); after: join "
        "less conn; kill: from a member's SIGKILL to the last "
        "survivor's first good allreduce without it; ops/round and B/round: one member's "
        "heartbeat round, store operations and bytes both ways as c10d frames them; store "
        "ops/s and B/s: every member's rounds together, at the store)"
    )
    for row in rows:
        if row.trials and row.failed is None:
            calls = ", ".join(
                f"{name} {count:g}" for name, count in sorted(row.trials[-1].ops.items())
            )
            lines.append(f"{row.size} members, one round: {calls}")
    for row in rows:
        for n, t in enumerate(row.trials):
            for stall in t.stalls:
                first = stall.splitlines()[0] if stall else ""
                lines.append(f"stall: {row.size} members, trial {n + 1}: {first}")
    lines.extend(f"note: {note}" for note in notes)
    return "\n".join(lines)


def scale_json(rows: Sequence[Row], notes: Sequence[str]) -> dict[str, Any]:
    interval = HEARTBEAT_TIMEOUT / 5
    out: list[dict[str, Any]] = []
    for row in rows:
        if row.failed is not None or not row.trials:
            out.append({"members": row.size, "trials": 0, "failed": row.failed})
            continue
        ops, nbytes = row.p50(lambda t: t.ops_per_round), row.p50(lambda t: t.bytes_per_round)
        out.append(
            {
                "members": row.size,
                "trials": len(row.trials),
                "join_ms": [round(t.join * 1e3, 1) for t in row.trials],
                "kill_to_good_step_ms": [round(t.kill_to_good * 1e3, 1) for t in row.trials],
                "start_ms": [round(t.start * 1e3, 1) for t in row.trials],
                "stalls": [stall for t in row.trials for stall in t.stalls],
                "join_p50_ms": round(row.p50(_join) * 1e3, 1),
                "connect_ms": [round(t.connect * 1e3, 1) for t in row.trials],
                "after_connect_p50_ms": round(row.p50(_after) * 1e3, 1),
                "after_connect_vs_3": _ratio(rows, row, _after),
                "kill_to_good_step_p50_ms": round(row.p50(_kill) * 1e3, 1),
                "join_vs_3": _ratio(rows, row, _join),
                "kill_vs_3": _ratio(rows, row, _kill),
                "heartbeat_round": {
                    "ops_per_member": round(ops, 2),
                    "bytes_per_member": round(nbytes, 1),
                    "ops_at_store_per_s": round(ops * row.size / interval, 1),
                    "bytes_at_store_per_s": round(nbytes * row.size / interval, 1),
                    "ops_by_call": row.trials[-1].ops,
                },
                "failed": None,
            }
        )
    return {
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
        "heartbeat_interval_s": interval,
        "target_ratio_at_32": TARGET_RATIO,
        "rows": out,
        "notes": list(notes),
    }
