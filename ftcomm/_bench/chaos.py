"""``python -m ftcomm bench --chaos``: members train while a fault strikes every
few seconds; the figure is the work done, next to the same run without faults.

Owns: the rows (:data:`ROWS`, :class:`RowSpec`), the fault kinds
(:data:`KINDS`, :func:`network_missing`), one phase of a row
(:func:`run_phase`), and what is made of it (:class:`Phase`: goodput,
recovery gaps, generations, the check that every member ends with the same
parameters; the table and JSON are ``chaos_report``'s). torchft is imported
only in the processes that use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from ..testing._net import Network, NetworkFailed
from .chaos_members import Settings, ftcomm_member, torchft_replica
from .fleet import Fleet, FleetFailed, Hosts, Incarnation, Target, dump
from .membership import _host
from .runner import HOST

MAX_MEMBERS = 32
"""The most members a row may have (``--chaos-members``)."""
SECONDS = 60.0
"""Each phase's window (``--chaos-seconds``)."""
STATE_MIB = 4
"""The model's fp32 parameters, in MiB (as many of momentum)."""
HEARTBEAT_TIMEOUT = 1.0
"""Membership's default. Shorter (0.3 s) takes live members for dead here:
with 4 or more members busy on two cores, a heartbeat round takes 0.2-0.4 s,
and longer while a group is built."""
JOIN_WINDOW = 2.0
"""Membership's default."""
OP_DEADLINE = 1.0
"""Each allreduce's deadline: what finds a stopped member."""
CALL_TIMEOUT = 30.0
"""The deadline of every membership call (torchft: of its quorum)."""
STALL = 10.0
"""Seconds a member in a world may say nothing (it ticks every second it
steps) before the bench has every member write its stacks (once a phase)."""
_START_TIMEOUT = 90.0
"""Seconds for the members to start and form a full world (before ``go``,
and again after the window)."""


class ChaosFailed(Exception):
    """A phase could not run to its end, or ended wrong."""


class FaultUnavailable(ChaosFailed):
    """A fault kind that cannot strike here (a network fault outside a
    phase whose members live on hosts of their own)."""


# -- the fault kinds ------------------------------------------------------------------
NETWORK_KINDS = ("partition", "isolate")


def network_missing(kind: str) -> str | None:
    """Why network fault ``kind`` (``partition``: cut a member's host off
    the others', not the store; ``isolate``: off everything) cannot strike
    here, or ``None``: ftcomm.testing's reason (Linux, root, ``ip``,
    ``nft``, namespaces that work)."""
    from ..testing._net import network_missing as missing

    why = missing()
    return None if why is None else f"--chaos-kinds {kind}: {why}"


def _network(kind: str, fleet: Fleet, victim: Incarnation) -> None:
    raise FaultUnavailable(
        f"{kind} strikes only in a phase whose members live on hosts of their own (run_phase's)"
    )


def _cut(kind: str) -> Callable[[Fleet, Incarnation], None]:
    return lambda fleet, victim: fleet.cut(victim, kind)


def _restart(fleet: Fleet, victim: Incarnation) -> None:
    """Start a replacement under ``victim``'s id."""
    fleet.start(victim.member)


def _replace(fleet: Fleet, victim: Incarnation) -> None:
    """Kill ``victim`` if it still runs, start a replacement under its id."""
    fleet.kill(victim)
    fleet.start(victim.member)


@dataclass(frozen=True)
class Kind:
    """A fault: ``strike`` hits the victim; ``finish`` ends the fault
    ``hold(settings)`` seconds later (``None``: at once)."""

    name: str
    strike: Callable[[Fleet, Incarnation], None]
    finish: Callable[[Fleet, Incarnation], None]
    hold: Callable[[Settings], float | None] = lambda settings: None


KINDS: Mapping[str, Kind] = {
    "kill": Kind("kill", Fleet.kill, _restart),
    "stop": Kind("stop", Fleet.stop, _replace, hold=lambda settings: settings.op_deadline),
    **{name: Kind(name, functools.partial(_network, name), _replace) for name in NETWORK_KINDS},
}
"""What each kind does to its victim (a member in a world, drawn by the
phase's seeded RNG). ``kill`` SIGKILLs it and starts a replacement under the
same member id at once; ``stop`` SIGSTOPs it, and one op deadline later (when
the survivors' allreduce has given up on it, and its heartbeat has long been
silent: what a supervisor watching its heartbeat would do) SIGKILLs it and
starts a replacement. The network kinds strike only where the members live on
hosts of their own (:func:`run_phase` puts its own in place): ``partition``
drops every packet between the victim's host and the other members' (the
store still answers it: a gray failure), ``isolate`` every packet of its host
(the store's too); either is lifted ``heal`` seconds later (the row's; by
default half the interval). Nothing is killed: the victim, left out, comes
back by itself (``Evicted``, ``join()`` again)."""


def kinds_missing(kinds: Sequence[str]) -> str | None:
    """Why ``kinds`` cannot all strike here (checked before a run), or ``None``."""
    for kind in kinds:
        if kind not in KINDS:
            return f"--chaos-kinds: unknown kind {kind!r} (known: {', '.join(KINDS)})"
        if kind in NETWORK_KINDS and (why := network_missing(kind)) is not None:
            return why
    return None


# -- the rows -------------------------------------------------------------------------
@dataclass(frozen=True)
class RowSpec:
    """A system, a world's size, the faults and how often; and the goodput
    the row should reach (``None``: no target)."""

    system: str  # "ftcomm" or "torchft"
    members: int
    kinds: tuple[str, ...]
    interval: float
    target: float | None = None
    heal: float | None = None
    """Seconds a network fault lasts (``None``: half the interval)."""

    @property
    def network(self) -> bool:
        """Its members live on hosts of their own (it has a network kind)."""
        return any(kind in NETWORK_KINDS for kind in self.kinds)

    @property
    def label(self) -> str:
        kinds = "/".join(self.kinds)
        return f"{self.system} {self.members} members, {kinds} every {self.interval:g} s"


ROWS: tuple[RowSpec, ...] = (
    RowSpec("ftcomm", 3, ("kill",), 10.0, target=0.9),
    RowSpec("torchft", 3, ("kill",), 10.0),
    RowSpec("ftcomm", 4, ("kill", "stop"), 5.0, target=0.85),
    RowSpec("torchft", 4, ("kill", "stop"), 5.0),
    RowSpec("ftcomm", 8, ("kill",), 10.0),
)


def rows_for(
    members: int | None, interval: float | None, kinds: tuple[str, ...] | None, torchft: bool
) -> tuple[RowSpec, ...]:
    """The default rows, or, where any of ``members``, ``interval`` and
    ``kinds`` is given, one row of ftcomm with them (the others' defaults:
    3 members, SIGKILL, every 10 s) and torchft's on the same workload
    (not with a network kind: its replicas are not put on hosts)."""
    if members is None and interval is None and kinds is None:
        rows = ROWS
    else:
        spec = RowSpec("ftcomm", members or 3, kinds or ("kill",), interval or 10.0)
        rows = (spec, RowSpec("torchft", spec.members, spec.kinds, spec.interval))
    return tuple(row for row in rows if row.system == "ftcomm" or (torchft and not row.network))


@dataclass(frozen=True)
class Fault:
    """A fault struck: when (seconds into the window), what, on whom, and
    the generation its victim was last in."""

    at: float
    kind: str
    member: str
    generation: int
    gap: float | None = None
    """Seconds to the next good step of the survivors (``None``: none came)."""


@dataclass
class Phase:
    """One phase of a row: what the job did in its window."""

    seconds: float
    committed: int
    """The job's steps from ``go`` to the window's end (a step done by a
    member that then died, and by no survivor, is not counted: the
    survivors' step is what the job kept)."""
    generations: int
    evictions: int = 0
    """Times a member was taken for dead while alive: the others went on
    without it, and it joined again (``Evicted``)."""
    cut_off: int = 0
    """Of those, the times it was alive but cut off from the others
    (``Evicted.cut_off``: a network fault)."""
    timeouts: list[str] = field(default_factory=list)
    """What each ``join()``/``recover()`` that ran out of time said (it was called again)."""
    stalled: float = 0.0
    """Seconds the job made no step, between generations (see :meth:`_Log.stalled`)."""
    faults: list[Fault] = field(default_factory=list)
    final_step: int = 0
    trace: str = ""
    """Where a call ran out of time, a member was evicted or a member was
    silent: the phase's events (seconds from its start), the store's record
    of the job, and every member's stacks at the first stall."""
    members_at_end: int = 0

    @property
    def gaps(self) -> list[float]:
        return [f.gap for f in self.faults if f.gap is not None]


@dataclass
class Row:
    """A row's two phases (or why it failed)."""

    spec: RowSpec
    clean: Phase | None = None
    chaos: Phase | None = None
    failed: str | None = None

    @property
    def goodput(self) -> float | None:
        if self.clean is None or self.chaos is None or not self.clean.committed:
            return None
        return self.chaos.committed / self.clean.committed


# -- a phase --------------------------------------------------------------------------
@contextlib.contextmanager
def _store(net: Network | None = None) -> Iterator[str]:
    """The store, on loopback, or on ``net``'s hub (made by a thread there)."""
    from .._server import serve_store

    hub = HOST if net is None else net.hub_host
    with serve_store(HOST) if net is None else net.in_hub(lambda: serve_store(hub)) as server:
        yield server.address


def _store_record(address: str, job: str) -> str:
    """What the store engine holds of ``job``'s generations (their members,
    the verdicts on each, who quit it): for a stall or a failure's report.
    It reads the engine's keys (``ftcomm/_membership/_store_engine.py``),
    never blocking on one that is not there."""
    from torch._C._distributed_c10d import TCPStore

    from .._membership._watch import read as watch_read

    host, port = address.rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    prefix = f"ftcomm/members/{job}/"

    def read(key: str) -> str | None:  # (a get would wait for a key swept meanwhile)
        value = watch_read(store, prefix + key)
        return value.decode(errors="replace") if value is not None else None

    kept = max(int(read("floor") or 2) - 1, 1)  # (the keys below floor - 1 are swept)
    lines = [f"the store's record of job {job!r} (generations {kept} to {read('gen')}):"]
    for g in range(kept, int(read("gen") or 0) + 2):
        for key in (f"world/{g}", f"fate/{g}", f"quit/{g}", f"sus/{g}", f"ready/{g}"):
            value = read(key)
            if value is not None:
                lines.append(f"  {key}: {value.strip()!r:.400}")
    return "\n".join(lines)


@contextlib.contextmanager
def _serve_lighthouse(heartbeat_timeout: float, join_window: float) -> Iterator[str]:
    """torchft's lighthouse with the soak's timeouts (in the host process)."""
    os.environ.setdefault("RUST_LOG", "error")
    coordination: Any = importlib.import_module("torchft.coordination")
    server = coordination.LighthouseServer(
        bind=f"{HOST}:0",
        min_replicas=1,
        join_timeout_ms=round(join_window * 1000),
        quorum_tick_ms=10,
        heartbeat_timeout_ms=round(heartbeat_timeout * 1000),
    )
    try:
        port = server.address().rsplit(":", 1)[1]
        yield f"http://{HOST}:{port}"
    finally:
        server.shutdown()


@contextlib.contextmanager
def _hosted(ctx: Any, serve: Callable[[], AbstractContextManager[str]]) -> Iterator[str]:
    """``serve`` in a host process of its own (membership's ``_host``); its address."""
    recv_end, send_end = ctx.Pipe()
    proc = ctx.Process(target=_host, args=(serve, dict(os.environ), send_end), daemon=True)
    proc.start()
    send_end.close()
    try:
        if not recv_end.poll(_START_TIMEOUT):
            raise ChaosFailed("the lighthouse's host said nothing in time")
        message = recv_end.recv()
        if message[0] != "address":
            raise ChaosFailed(f"the lighthouse's host failed:\n{message[1]}")
        yield str(message[1])
    finally:
        recv_end.close()  # the host's recv() sees EOF and stops serving
        proc.join(10.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join()


class _Log:
    """What the members said during a phase."""

    def __init__(self) -> None:
        # generation -> each member's first good step in it, and its good step before
        self.firsts: dict[int, list[tuple[float, float | None]]] = {}
        self.generations: set[int] = set()
        self.went: list[int] = []
        self.evictions = self.cut_off = 0
        self.timeouts: list[str] = []
        self.events: list[tuple[float, str, str]] = []  # (time, who, what): the timeline
        self.stacks = ""  # every member's, written once, at the first stall
        self.done: dict[Incarnation, tuple[Any, ...]] = {}

    def event(self, who: str, what: str) -> None:
        self.events.append((time.monotonic(), who, what))

    def timeline(self, since: float, last: int = 120) -> str:
        """The last ``last`` events, seconds from ``since``."""
        return "\n".join(
            f"  {t - since:9.3f} {who:<6} {what}" for t, who, what in self.events[-last:]
        )

    def on(self, inc: Incarnation, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind != "error":
            self.event(
                inc.name,
                " ".join(
                    f"{part:.3f}" if isinstance(part, float) else str(part) for part in message
                )[:300],
            )
        if kind == "gen":
            inc.generation, inc.size = int(message[1]), int(message[2])
            self.generations.add(inc.generation)
        elif kind == "first":
            before = None if message[3] is None else float(message[3])
            self.firsts.setdefault(int(message[1]), []).append((float(message[2]), before))
        elif kind == "went":
            self.went.append(int(message[1]))
        elif kind == "evicted":
            self.evictions += 1
            self.cut_off += bool(message[2])
        elif kind == "timeout":
            self.timeouts.append(str(message[2]))

    def gap(self, generation: int, t: float) -> float | None:
        """From ``t`` to the first good step after it, of every member that
        reported one, in the first generation after ``generation`` that had one."""
        for g in sorted(self.firsts):
            later = [s for s, _ in self.firsts[g] if s > t]
            if g > generation and later:
                return max(later) - t
        return None

    def stalled(self, start: float, end: float) -> float:
        """Seconds without a step of the job between generations, for the
        generations entered from a step in ``[start, end)``: from the job's
        last good step before each to its first good step in it."""
        total = 0.0
        for firsts in self.firsts.values():
            befores = [b for _, b in firsts if b is not None]
            if befores and start <= max(befores) < end:
                total += max(t for t, _ in firsts) - max(befores)
        return total


def _watch(fleet: Fleet, log: _Log, folder: str) -> None:
    """At the phase's first stall (a member in a world silent for
    :data:`STALL` s, or a call that ran out of time), every member's stacks."""
    if log.stacks or not folder:
        return
    now = time.monotonic()
    silent = [
        inc.name
        for inc in fleet.live()
        if inc.generation is not None and not inc.signalled and now - inc.heard > STALL
    ]
    if silent or log.timeouts:
        why = f"{', '.join(silent)} silent for {STALL:g} s" if silent else "a call ran out of time"
        log.event("bench", f"a stall ({why}): every member's stacks")
        log.stacks = f"the stacks at the first stall ({why}):\n{dump(fleet.live(), folder)}"


def _full(fleet: Fleet, members: int) -> bool:
    """Every member's process is in one generation of the full size."""
    live = fleet.live()
    return (
        len(live) == members
        and all(inc.size == members and not inc.stopped for inc in live)
        and len({inc.generation for inc in live}) == 1
        and live[0].generation is not None
    )


def _until_full(fleet: Fleet, members: int, log: _Log, deadline: float, folder: str) -> None:
    while not _full(fleet, members):
        left = deadline - time.monotonic()
        if left <= 0:
            where = ", ".join(f"{i.name}: g{i.generation} of {i.size}" for i in fleet.live())
            raise ChaosFailed(f"no full world of {members} in time ({where})")
        for inc, message in fleet.receive(min(left, 1.0)):
            log.on(inc, message)
        _watch(fleet, log, folder)


def _target(
    system: str, address: str, job: str, settings: Settings, hosts: Hosts | None
) -> Callable[[str], Target]:
    def target(member: str) -> Target:
        if system != "ftcomm":
            return torchft_replica, (address, job, member, settings)
        host = None if hosts is None else hosts.of(member)
        return ftcomm_member, (address, job, member, settings, host)

    return target


def run_phase(
    ctx: Any,
    spec: RowSpec,
    settings: Settings,
    seconds: float,
    seed: int,
    *,
    faults: bool,
) -> Phase:
    """Run one phase of ``spec``: ``seconds`` of training, with its faults or without.

    The members start (each a process from the fork server) and join; once
    every member is in one generation of the full size, the bench says
    ``go`` and the window of ``seconds`` starts. With faults, every
    ``spec.interval`` seconds the next kind (the kinds are taken in turn)
    strikes (:data:`KINDS`). When the window ends, faults stop, the bench
    waits for a full world again and tells every member to stop: they stop
    at one step, and each sends the SHA-256 of its parameters and momentum.

    With a network kind, each member lives on a host of its own (ftcomm.testing's
    ``Network``, the store on its hub; with faults or not: the same network
    for both phases' figures); every namespace (and the rules in it) is gone
    when it returns or raises.

    Raises:
        ChaosFailed: a member failed or exited unasked, a world did not form
            in time, a fault kind cannot strike, or the members ended with
            different parameters or steps.
    """
    if spec.network and spec.system != "ftcomm":
        raise ChaosFailed(f"{spec.system}: network kinds are for ftcomm rows only")
    if not spec.network:
        return _run_phase(ctx, spec, settings, seconds, seed, faults, None, KINDS)
    try:
        net = Network(spec.members)
    except NetworkFailed as exc:
        raise ChaosFailed(f"the members' hosts could not be made: {exc}") from None
    try:  # the namespaces go last: once the processes and the store are gone
        heal = spec.interval / 2 if spec.heal is None else spec.heal
        cuts = {n: Kind(n, _cut(n), Fleet.heal, lambda _: heal) for n in NETWORK_KINDS}
        kinds = {**KINDS, **cuts}
        return _run_phase(ctx, spec, settings, seconds, seed, faults, Hosts(net), kinds)
    finally:
        net.close()


def _run_phase(
    ctx: Any,
    spec: RowSpec,
    settings: Settings,
    seconds: float,
    seed: int,
    faults: bool,
    hosts: Hosts | None,
    kinds: Mapping[str, Kind],
) -> Phase:
    net = None if hosts is None else hosts.net
    if spec.system == "ftcomm":
        serve: AbstractContextManager[str] = _store(net)
    else:
        serve = _hosted(
            ctx,
            functools.partial(_serve_lighthouse, settings.heartbeat_timeout, settings.join_window),
        )
    job = f"chaos-{spec.members}-{'faults' if faults else 'clean'}"
    log = _Log()
    started = time.monotonic()
    folder = tempfile.mkdtemp(prefix="ftcomm-chaos-") if spec.system == "ftcomm" else ""
    settings = dataclasses.replace(settings, stacks=folder)
    with serve as address, contextlib.ExitStack() as cleanup:
        if folder:
            cleanup.callback(shutil.rmtree, folder, ignore_errors=True)

        def record() -> str:  # (read from the hub, where the store is)
            if spec.system != "ftcomm":
                return ""
            read = functools.partial(_store_record, address, job)
            return read() if net is None else net.in_hub(read)

        fleet = Fleet(ctx, _target(spec.system, address, job, settings, hosts), hosts)
        try:
            rng = random.Random(seed)
            phase = _drive(fleet, spec, settings, seconds, rng, faults, log, kinds)
            if phase.timeouts or phase.evictions or log.stacks:  # a stall, or a live member
                phase.trace = f"{log.timeline(started, last=400)}\n{record()}\n{log.stacks}"
            return phase
        except (FleetFailed, ChaosFailed) as exc:
            stacks = log.stacks or (dump(fleet.live(), folder) if folder else "")
            raise ChaosFailed(
                f"{exc}\n(the phase's last events, seconds from its start:)\n"
                + log.timeline(started)
                + f"\n{record()}\n{stacks}"
            ) from None
        finally:
            fleet.close()


def _drive(
    fleet: Fleet,
    spec: RowSpec,
    settings: Settings,
    seconds: float,
    rng: random.Random,
    faults: bool,
    log: _Log,
    kinds: Mapping[str, Kind],
) -> Phase:
    for i in range(spec.members):
        fleet.start(f"m{i}")
    _until_full(fleet, spec.members, log, time.monotonic() + _START_TIMEOUT, settings.stacks)
    first_generation = fleet.live()[0].generation or 0
    t0 = time.monotonic()
    log.event("bench", "go")
    for inc in fleet.live():
        inc.send(("go",))
    t_end = t0 + seconds
    next_fault = t0 + spec.interval if faults else math.inf
    struck: list[tuple[Fault, float]] = []  # (fault, its absolute time)
    holds: list[tuple[float, Kind, Incarnation]] = []  # faults to finish, and when
    while (now := time.monotonic()) < t_end:
        wake = min(t_end, next_fault, now + 1.0, *(when for when, _, _ in holds))
        for inc, message in fleet.receive(wake - now):
            log.on(inc, message)
        _watch(fleet, log, settings.stacks)
        now = time.monotonic()
        for hold in [h for h in holds if h[0] <= now]:
            holds.remove(hold)
            log.event("bench", f"end {hold[1].name} of {hold[2].name}")
            hold[1].finish(fleet, hold[2])
        if now >= next_fault and next_fault < t_end:
            for inc, message in fleet.receive(0):  # what was said before it
                log.on(inc, message)
            kind = kinds[spec.kinds[len(struck) % len(spec.kinds)]]
            held = {victim for _, _, victim in holds}  # (a fault at a time on a member)
            eligible = [
                i
                for i in fleet.live()
                if i.generation is not None and not i.signalled and i not in held
            ]
            if eligible:
                victim = eligible[rng.randrange(len(eligible))]
                at = time.monotonic()
                log.event("bench", f"{kind.name} {victim.name} (pid {victim.pid})")
                kind.strike(fleet, victim)
                fault = Fault(at - t0, kind.name, victim.member, victim.generation or 0)
                struck.append((fault, at))
                wait = kind.hold(settings)
                if wait is None:
                    kind.finish(fleet, victim)
                else:
                    holds.append((at + wait, kind, victim))
            next_fault += spec.interval
    for _, kind, victim in holds:  # the window is over: no fault outlives it
        log.event("bench", f"end {kind.name} of {victim.name}")
        kind.finish(fleet, victim)
    log.event("bench", "the window ends")
    _until_full(fleet, spec.members, log, time.monotonic() + _START_TIMEOUT, settings.stacks)
    live = fleet.live()
    log.event("bench", "stop")
    for inc in live:
        inc.send(("stop", t_end))
    done = fleet.expect(live, "done", time.monotonic() + _START_TIMEOUT, on=log.on)
    for inc in live:
        inc.send(("exit",))
    ends = {inc.name: (message[2], message[3]) for inc, message in done.items()}
    if len(set(ends.values())) != 1:
        said = "; ".join(f"{name}: step {s}, {d[:16]}" for name, (s, d) in sorted(ends.items()))
        raise ChaosFailed(f"the members ended with different parameters or steps: {said}")
    at_end = [message[1] for message in done.values() if message[1] is not None]
    if not at_end or not log.went:
        raise ChaosFailed("no member held a step at the window's end (or at its start)")
    return Phase(
        seconds=seconds,
        committed=max(at_end) - max(log.went),
        generations=len({g for g in log.generations if g > first_generation}),
        stalled=log.stalled(t0, t_end),
        evictions=log.evictions,
        cut_off=log.cut_off,
        timeouts=log.timeouts,
        faults=[
            Fault(f.at, f.kind, f.member, f.generation, log.gap(f.generation, at))
            for f, at in struck
        ],
        final_step=next(iter(ends.values()))[0],
        members_at_end=len(live),
    )


def settings_for(spec: RowSpec, loop: str, state_mib: int = STATE_MIB) -> Settings:
    return Settings(
        numel=state_mib * 2**20 // 4,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        join_window=JOIN_WINDOW,
        op_deadline=OP_DEADLINE,
        timeout=CALL_TIMEOUT,
        loop=loop,
        max_size=spec.members,
    )


def measure(
    rows: Sequence[RowSpec],
    seconds: float,
    seed: int,
    loop: str,
    progress: Callable[[str], None] = lambda line: None,
    state_mib: int = STATE_MIB,
) -> list[Row]:
    """Every row: the phase without faults, then the one with them, each
    member holding ``state_mib`` MiB of parameters (and as many of
    momentum). A row that fails says why; the others still run."""
    from ..testing._world import _mp_context

    ctx = _mp_context()
    out: list[Row] = []
    for spec in rows:
        row = Row(spec)
        settings = settings_for(spec, loop, state_mib)
        try:
            progress(f"{spec.label}: {seconds:g} s without faults")
            row.clean = run_phase(ctx, spec, settings, seconds, seed, faults=False)
            progress(f"{spec.label}: {seconds:g} s with faults")
            row.chaos = run_phase(ctx, spec, settings, seconds, seed, faults=True)
        except ChaosFailed as exc:
            row.failed = str(exc)
        out.append(row)
    return out
