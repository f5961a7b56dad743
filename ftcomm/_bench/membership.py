"""The membership recovery rows: a member of a world of three is SIGKILLed (or
SIGSTOPped) by the bench; the figure is the time from that signal to the
survivors' first good allreduce in the next generation, per engine, and
torchft's Manager doing the same beside it.

Owns: the engines the rows run on (:data:`ENGINES`, one line each: adding
one is a line there), a trial (:func:`_trial`), torchft's Manager trial, and
the rows' table (:func:`format_membership`) and JSON (:func:`membership_json`).
torchft is imported only in the processes that use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import multiprocessing.connection
import os
import re
import signal
import time
import traceback
import urllib.parse
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

import torch

from .report import percentile
from .runner import _LOOP_ENV, HOST, run_on

MEMBERS = 3
"""Members of a trial's first generation; one of them is signalled."""
MIN_SIZE = 2
TRIALS = 5
"""Trials per row (``--membership-trials``)."""
HEARTBEAT_TIMEOUT = 0.3
"""Seconds of silence after which a member is dead (short: loopback)."""
JOIN_WINDOW = 1.0
"""Longer than the heartbeat timeout: a SIGKILLed member is found dead by
its heartbeat, not left out for not coming (``recover()`` leaves a member
out at whichever comes first)."""
OP_DEADLINE = 1.0
"""The survivors' allreduce deadline: what finds a SIGSTOPped member."""
FAULTS: Mapping[str, signal.Signals] = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}
_SETTLE = 0.1
"""Seconds of steps in the full world before the signal."""
_STEP_PAUSE = 0.001
"""Seconds between two steps: members that do not take both cores of a
small machine from the heartbeats (a step of training takes time too)."""
_TRIAL_TIMEOUT = 30.0


class TrialFailed(Exception):
    """A trial's process failed, exited, or said nothing in time."""


class SetupFailed(TrialFailed):
    """A trial failed before its signal: its engine or its first generation
    of three was not there in time (on a loaded machine, a member that
    starts late misses the join window). Nothing was measured yet."""


# -- the engines --------------------------------------------------------------------------
@contextlib.contextmanager
def _serve_store() -> Iterator[str]:
    """The embedded engine: a c10d store, served on loopback."""
    from .._server import serve_store

    server = serve_store(HOST)
    try:
        yield server.address
    finally:
        server.close()


def _on_loopback(address: str) -> str:
    """``http://NAME:PORT`` (torchft names the host) as ``http://127.0.0.1:PORT``."""
    return f"http://{HOST}:{urllib.parse.urlsplit(address).port}"


@contextlib.contextmanager
def _serve_lighthouse() -> Iterator[str]:
    """torchft's lighthouse, with the rows' heartbeat timeout and join window
    (its quorum for the Manager's rows, the lighthouse engine's server)."""
    # torchft's Rust side reads RUST_LOG once, when it is imported (in this
    # process: the fork server has not): else an INFO line per quorum tick.
    os.environ.setdefault("RUST_LOG", "error")
    coordination: Any = importlib.import_module("torchft.coordination")
    server = coordination.LighthouseServer(
        bind=f"{HOST}:0",
        min_replicas=MIN_SIZE,
        join_timeout_ms=round(JOIN_WINDOW * 1000),
        quorum_tick_ms=10,
        heartbeat_timeout_ms=round(HEARTBEAT_TIMEOUT * 1000),
    )
    try:
        yield _on_loopback(server.address())
    finally:
        server.shutdown()


@contextlib.contextmanager
def _serve_etcd() -> Iterator[str]:
    """The etcd engine: a 3-node etcd cluster on loopback (the members host
    their groups' stores)."""
    from ..testing import EtcdCluster

    with EtcdCluster(3) as cluster:
        yield cluster.address("bench")


def _etcd_missing() -> str | None:
    from ..testing import etcd_missing

    return etcd_missing()


@dataclass(frozen=True)
class Engine:
    """Where a trial's members agree: ``serve`` (a module-level function: it
    runs in the engine's host process) serves one and yields its address
    for ``ftcomm.Membership``. ``needs``: modules that must be importable,
    and ``unavailable`` says what else is missing (else the engine's rows
    are skipped, with a note); ``torchft``: skipped with ``--no-torchft`` too."""

    name: str
    serve: Callable[[], AbstractContextManager[str]]
    needs: tuple[str, ...] = ()
    torchft: bool = False
    unavailable: Callable[[], str | None] | None = None
    """Why it cannot run here (a program that is not installed), or ``None``."""

    def missing(self) -> str | None:
        if self.unavailable is not None:
            why = self.unavailable()
            if why is not None:
                return why
        for module in self.needs:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):  # a package above it is missing
                found = False
            if not found:
                return f"{module} is not there (yet)"
        return None


ENGINES: tuple[Engine, ...] = (
    Engine("store", _serve_store),
    Engine(
        "lighthouse",
        _serve_lighthouse,
        needs=("torchft.coordination", "ftcomm._membership._lighthouse"),
        torchft=True,
    ),
    Engine("etcd", _serve_etcd, unavailable=_etcd_missing),
)


# -- the processes ------------------------------------------------------------------------
def _take_env(env: Mapping[str, str]) -> None:
    """A process forked from the fork server has the server's environment: take the bench's."""
    os.environ.clear()
    os.environ.update(env)


def _fail(conn: Connection) -> None:
    """Say what failed (the parent raises it as :class:`TrialFailed`): the
    heartbeat rounds of its own it said overran (:func:`_starved` reads
    them), then the error; and leave now."""
    with contextlib.suppress(Exception):
        conn.send(("error", "".join(f"{line}\n" for line in _LATE) + traceback.format_exc()))
    os._exit(1)


def _host(
    serve: Callable[[], AbstractContextManager[str]], env: dict[str, str], conn: Connection
) -> None:
    """An engine's host process: serve it, say where, serve until told (or the parent is gone)."""
    _take_env(env)
    try:
        with serve() as address:
            conn.send(("address", address))
            with contextlib.suppress(EOFError):
                conn.recv()
    except BaseException:
        _fail(conn)


_LATE: list[str] = []  # this member's "heartbeat round took" warnings


class _OnPurpose(logging.Filter):
    """Drops ftcomm's "group aborted" records: in a trial every abort is one
    the bench caused (a trial that goes wrong fails, and says why). Keeps the
    member's warnings that a heartbeat round of its own overran, for
    :func:`_fail`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "its heartbeat round took" in message:
            _LATE.append(message)
        return getattr(record, "ftcomm_event", None) != "aborted"


def _member(
    address: str, job: str, member_id: str, loop: str, env: dict[str, str], conn: Connection
) -> None:
    """A member's process: join, step, recover; say when it is in, when the
    world it is in shrank (the time of its first good allreduce there), done."""
    _take_env(env)
    os.environ[_LOOP_ENV] = loop  # ftcomm's owner loop matches the caller's
    os.environ.setdefault("RUST_LOG", "error")  # a lighthouse engine's torchft, quiet
    logging.getLogger("ftcomm").addFilter(_OnPurpose())
    try:
        run_on(loop, _member_steps(address, job, member_id, conn))
        conn.send(("done",))
    except BaseException:
        _fail(conn)


async def _member_steps(address: str, job: str, member_id: str, conn: Connection) -> None:
    import ftcomm

    async with (
        ftcomm.Membership(
            address,
            job,
            member_id,
            min_size=MIN_SIZE,
            max_size=MEMBERS,
            join_window=JOIN_WINDOW,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            timeout=_TRIAL_TIMEOUT,
        ) as members,
        ftcomm.Group("gloo", timeout=_TRIAL_TIMEOUT) as group,
    ):
        world = await members.join(group)
        conn.send(("in", world.size))
        size, stop = world.size, 0.0
        t = torch.zeros(2)
        while True:
            t[0], t[1] = 1.0, stop  # the members' count; whether one was told to stop
            try:
                await group.allreduce(t, timeout=OP_DEADLINE)
            except ftcomm.CommError:
                world = await members.recover(group)
                continue
            if t[0].item() != world.size:
                raise RuntimeError(f"an allreduce of ones gave {t[0].item()}, not {world.size}")
            if world.size < size:
                conn.send(("back", time.monotonic(), world.size))
            size = world.size
            if t[1].item() > 0:  # every member stops at the same step
                return
            if not stop and conn.poll():
                conn.recv()
                stop = 1.0
            await asyncio.sleep(_STEP_PAUSE)


def _replica(lighthouse: str, replica_id: str, env: dict[str, str], conn: Connection) -> None:
    """A torchft replica's process: the same steps through torchft's Manager
    (its ProcessGroupGloo, the op deadline as its timeout)."""
    _take_env(env)
    os.environ.setdefault("RUST_LOG", "error")  # before torchft's import (see _serve_lighthouse)
    # the failures the bench causes, logged with their tracebacks; and the
    # warnings of torchft's own PGTransport (a read-only buffer, a deprecation)
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", module=r"torchft\.")
    try:
        _replica_steps(lighthouse, replica_id, conn)
        conn.send(("done",))
    except BaseException:
        _fail(conn)


def _replica_steps(lighthouse: str, replica_id: str, conn: Connection) -> None:
    from .torchft_rows import manager_replica

    state = {"w": torch.zeros(1)}
    manager, _replica_store = manager_replica(  # (the store: held while it runs)
        lighthouse,
        replica_id,
        min_size=MIN_SIZE,
        load_state_dict=lambda s: None,
        state_dict=lambda: state,
        op_deadline=OP_DEADLINE,
        quorum_timeout=_TRIAL_TIMEOUT,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        init_sync=False,
    )
    size, stop = 0, 0.0
    t = torch.zeros(2)
    try:
        while True:
            manager.start_quorum()
            t[0], t[1] = 1.0, stop
            manager.allreduce(t).wait()  # the average: a failure is the Manager's, not raised
            if not manager.should_commit():
                continue
            n = manager.num_participants()
            if abs(t[0].item() - 1.0) > 1e-6:
                raise RuntimeError(f"a committed average of ones gave {t[0].item()}")
            if n > size:
                conn.send(("in", n))
            elif n < size:
                conn.send(("back", time.monotonic(), n))
            size = n
            if t[1].item() > 0:
                return
            if not stop and conn.poll():
                conn.recv()
                stop = 1.0
            time.sleep(_STEP_PAUSE)
    finally:
        manager.shutdown(wait=False)


class _Procs:
    """The processes of one trial, each with a pipe to this one; all of
    them killed (a stopped one too) and reaped by :meth:`close`."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._procs: dict[str, Any] = {}
        self._conns: dict[str, Connection] = {}

    def start(self, name: str, target: Callable[..., None], *args: object) -> None:
        recv_end, send_end = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=target,
            args=(*args, dict(os.environ), send_end),
            name=f"ftcomm-bench-{name}",
            daemon=True,
        )
        self._procs[name], self._conns[name] = proc, recv_end
        proc.start()
        send_end.close()  # the child's is the only other end: its exit gives EOF

    def pid(self, name: str) -> int:
        pid: int = self._procs[name].pid
        return pid

    def send(self, name: str, message: object) -> None:
        self._conns[name].send(message)

    def expect(
        self,
        names: Sequence[str],
        kind: str,
        deadline: float,
        where: Callable[[tuple[Any, ...]], bool] = lambda _: True,
    ) -> dict[str, tuple[Any, ...]]:
        """A message ``(kind, ...)`` that ``where`` accepts from each of
        ``names`` (others of theirs are passed over).

        Raises:
            TrialFailed: one failed or exited first, or the deadline passed.
        """
        got: dict[str, tuple[Any, ...]] = {}
        while len(got) < len(names):
            waiting = {self._conns[n]: n for n in names if n not in got}
            left = deadline - time.monotonic()
            if left <= 0:
                raise TrialFailed(f"no {kind!r} from {', '.join(waiting.values())} in time")
            for ready in multiprocessing.connection.wait(list(waiting), left):
                conn = cast(Connection, ready)
                name = waiting[conn]
                try:
                    message: tuple[Any, ...] = conn.recv()
                except EOFError:
                    self._procs[name].join(1.0)
                    code = self._procs[name].exitcode
                    raise TrialFailed(f"{name} exited (code {code}) before {kind!r}") from None
                if message[0] == "error":
                    raise TrialFailed(f"{name} failed:\n{message[1]}")
                if message[0] == kind and where(message):
                    got[name] = message
        return got

    def close(self) -> None:
        """The members killed; then the engine's host told to stop (its
        pipe closed), so that it stops what it started (etcd's nodes), and
        killed only if it does not within 15 s."""
        for name, proc in self._procs.items():
            proc.join(0.0)
            if proc.exitcode is None and name != "engine":
                proc.kill()
        for conn in self._conns.values():
            conn.close()
        host = self._procs.get("engine")
        if host is not None:
            host.join(15.0)
            if host.exitcode is None:
                host.kill()
        for proc in self._procs.values():
            proc.join(10.0)
            with contextlib.suppress(ValueError):  # still running: left to the daemon flag
                proc.close()


StartMember = Callable[[_Procs, str, str, int], None]
"""Starts member ``name`` of trial ``n`` against the engine at ``address``."""


def _trial(
    ctx: Any,
    serve: Callable[[], AbstractContextManager[str]],
    start_member: StartMember,
    fault: str,
    n: int,
) -> float:
    """One trial: an engine host and three members, each a process of its
    own started from ftcomm.testing's fork server; one signalled by this
    process (a different one each trial), the two others back. Seconds from
    the signal to the later survivor's first good allreduce in the smaller
    world.

    The two ends of the figure are taken in two processes on one machine:
    ``time.monotonic()`` is ``CLOCK_MONOTONIC`` on Linux, one clock for every
    process of the host, so the survivors send their time of the first good
    allreduce and this process subtracts the time it sent the signal."""
    procs = _Procs(ctx)
    try:
        deadline = time.monotonic() + _TRIAL_TIMEOUT
        names = [f"m{i}" for i in range(MEMBERS)]
        try:
            procs.start("engine", _host, serve)
            address: str = procs.expect(["engine"], "address", deadline)["engine"][1]
            for name in names:
                start_member(procs, name, address, n)
            procs.expect(names, "in", deadline, where=lambda m: m[1] == MEMBERS)
        except TrialFailed as exc:
            raise SetupFailed(f"before the signal: {exc}") from exc
        time.sleep(_SETTLE)
        victim = names[n % MEMBERS]
        survivors = [name for name in names if name != victim]
        signalled = time.monotonic()
        os.kill(procs.pid(victim), FAULTS[fault])
        back = procs.expect(survivors, "back", deadline, where=lambda m: m[2] == MEMBERS - 1)
        total = max(float(m[1]) for m in back.values()) - signalled
        for name in survivors:
            procs.send(name, "stop")
        procs.expect(survivors, "done", deadline)
        return total
    finally:
        procs.close()


def _ftcomm_member(loop: str, fault: str) -> StartMember:
    def start(procs: _Procs, name: str, address: str, n: int) -> None:
        procs.start(name, _member, address, f"bench-{fault}-{n}", name, loop)

    return start


def _torchft_replica(procs: _Procs, name: str, address: str, n: int) -> None:
    procs.start(name, _replica, address, f"{name}-{n}")


# -- the rows -----------------------------------------------------------------------------
@dataclass
class Row:
    """One system and fault: every trial's seconds, or why it failed."""

    system: str
    fault: str
    totals: list[float] = field(default_factory=list)
    failed: str | None = None
    voided: int = 0
    """Trials run again because a survivor was evicted, starved (``VOIDS``)."""

    @property
    def detection(self) -> float:
        """What "beyond" is counted from: what used to find the failure, the
        heartbeat timeout for a kill (the join window is longer, so that it
        is not the window) and the op deadline for a hang. ftcomm finds both
        sooner (a killed member's listener refuses at once, and a hung
        member's silent heartbeat aborts the ops waiting on it:
        docs/membership.md): a negative beyond."""
        return HEARTBEAT_TIMEOUT if self.fault == "kill" else OP_DEADLINE

    @property
    def label(self) -> str:
        how = (
            f"SIGKILL, hb {HEARTBEAT_TIMEOUT:g} s"
            if self.fault == "kill"
            else f"SIGSTOP, deadline {OP_DEADLINE:g} s"
        )
        return f"{self.system}: {how}"


VOIDS = 2
"""Trials of a row that may be voided and run again: those that failed before
their signal (:class:`SetupFailed`: nothing measured), and those in which a
survivor was evicted because its own heartbeat came late (a machine starving
it, with a 0.3 s timeout; the engine did as it should). Counted in the row."""

_EVICTED = re.compile(
    r"^ftcomm\.errors\.Evicted: member '(?P<member>[^']+)' was dropped from job .*"
    r"its heartbeat stopped or it did not come in time"
)


def _starved(failure: str) -> bool:
    """Whether a trial's failure is a survivor evicted for its own late
    heartbeat: its error, the last line, is that eviction (not one for being
    cut off, nor one in the chain of another error), and the member had said
    that a heartbeat round of its own overran the timeout."""
    lines = [line.strip() for line in failure.strip().splitlines() if line.strip()]
    found = _EVICTED.match(lines[-1]) if lines else None
    if found is None:
        return False
    return f"membership {found['member']}: its heartbeat round took" in failure


def _row(system: str, fault: str, trials: int, run: Callable[[int], float]) -> Row:
    row = Row(system, fault)
    try:
        while len(row.totals) < trials:
            try:  # each try's number (its job's name): the tries before it
                row.totals.append(run(len(row.totals) + row.voided))
            except TrialFailed as exc:
                voidable = isinstance(exc, SetupFailed) or _starved(str(exc))
                if not voidable or row.voided >= VOIDS:
                    raise
                row.voided += 1
    except Exception as exc:  # the other rows still run
        row.failed = f"trial {len(row.totals) + 1}: {type(exc).__name__}: {exc}"
    return row


def measure(trials: int, loop: str, torchft_skip: str | None) -> tuple[list[Row], list[str]]:
    """Every engine's rows (kill, hang), then torchft's Manager's; and a note
    for each engine or system skipped. ``torchft_skip``: why torchft's rows
    are skipped (``--no-torchft``, not installed), or ``None``."""
    from ..testing._world import _mp_context

    ctx = _mp_context()
    rows: list[Row] = []
    notes: list[str] = []
    for engine in ENGINES:
        why = torchft_skip if engine.torchft and torchft_skip else engine.missing()
        if why is not None:
            notes.append(f"{engine.name} engine skipped: {why}")
            continue
        for fault in FAULTS:
            start = _ftcomm_member(loop, fault)
            run = _bound(ctx, engine.serve, start, fault)
            rows.append(_row(f"ftcomm {engine.name}", fault, trials, run))
    if torchft_skip is not None:
        notes.append(f"torchft Manager rows skipped: {torchft_skip}")
    else:
        for fault in FAULTS:
            run = _bound(ctx, _serve_lighthouse, _torchft_replica, fault)
            rows.append(_row("torchft Manager", fault, trials, run))
    return rows, notes


def _bound(
    ctx: Any,
    serve: Callable[[], AbstractContextManager[str]],
    start: StartMember,
    fault: str,
) -> Callable[[int], float]:
    return lambda n: _trial(ctx, serve, start, fault, n)


def format_membership(rows: Sequence[Row], notes: Sequence[str]) -> str:
    width = max([24, *(len(row.label) for row in rows)])
    lines = [
        f"membership recovery ({MEMBERS} members on loopback, one SIGKILLed or SIGSTOPped; "
        f"join window {JOIN_WINDOW:g} s):",
        f"{'what':<{width}} {'p50_ms':>8} {'p90_ms':>8} {'beyond_p50':>10} {'beyond_p90':>10}"
        f" {'trials':>6}",
    ]
    for row in rows:
        if row.failed is not None:
            lines.append(f"{row.label:<{width}} FAILED: {row.failed.splitlines()[0]}")
            continue
        p50, p90 = percentile(row.totals, 50), percentile(row.totals, 90)
        beyond = [(p - row.detection) * 1e3 for p in (p50, p90)]
        lines.append(
            f"{row.label:<{width}} {p50 * 1e3:8.1f} {p90 * 1e3:8.1f} {beyond[0]:10.1f}"
            f" {beyond[1]:10.1f} {len(row.totals):6d}"
        )
    lines.append(
        "(from the signal, sent by the bench, to the survivors' first good allreduce in the "
        "next generation, the later survivor's (torchft: its first committed step); beyond: "
        "less the heartbeat timeout for a SIGKILL and the op deadline for a SIGSTOP. A "
        "negative beyond: found sooner. ftcomm: a killed member's listener refuses at once, "
        "and a hung one's silent heartbeat aborts the ops waiting on it; torchft asks its "
        "lighthouse for a quorum every step: a member stopped outside an allreduce is found "
        "by its heartbeat)"
    )
    lines.extend(
        f"note: {row.label}: {row.voided} trial(s) voided and run again: not set up "
        "in time, or a survivor evicted for its own late heartbeat (a loaded machine)"
        for row in rows
        if row.voided
    )
    lines.extend(f"note: {note}" for note in notes)
    return "\n".join(lines)


def membership_json(rows: Sequence[Row], notes: Sequence[str]) -> dict[str, Any]:
    """The rows as one JSON-able object (milliseconds)."""

    def ms(seconds: float) -> float:
        return round(seconds * 1e3, 3)

    out: list[dict[str, Any]] = []
    for row in rows:
        item: dict[str, Any] = {
            "what": row.label,
            "system": row.system,
            "fault": row.fault,
            "detection_ms": ms(row.detection),
            "trials": len(row.totals),
            "totals_ms": [ms(t) for t in row.totals],
            "failed": row.failed,
            "voided": row.voided,
        }
        if row.totals and row.failed is None:
            p50, p90 = percentile(row.totals, 50), percentile(row.totals, 90)
            item.update(
                p50_ms=ms(p50),
                p90_ms=ms(p90),
                beyond_p50_ms=ms(p50 - row.detection),
                beyond_p90_ms=ms(p90 - row.detection),
            )
        out.append(item)
    return {
        "members": MEMBERS,
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
        "join_window_s": JOIN_WINDOW,
        "op_deadline_s": OP_DEADLINE,
        "rows": out,
        "notes": list(notes),
    }
