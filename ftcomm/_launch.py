"""``python -m ftcomm run``: start a job's members; restart only the dead.

Owns the command line, one supervisor task per member (a member that dies is
restarted alone, under its old id, with a backoff, up to ``--max-restarts``
times; a survivor is never signalled), the engine it hosts on loopback unless
``--engine`` names a shared one, and the stop on SIGINT, SIGTERM or SIGHUP.
Why not torchrun, what each member gets, the exit codes: docs/running.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._etcd import SCHEME as ETCD_SCHEME
from ._etcd import parse_etcd_addr
from ._membership._lighthouse import host_port as lighthouse_host_port
from ._membership._lighthouse import is_lighthouse
from ._membership._names import check_name
from ._server import serve_store
from ._store import parse_store_addr

# a shell's 128 + signal; SIGHUP: the terminal went away (the members, in
# sessions of their own, would not hear of it otherwise)
EXIT_STOPPED = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
EXIT_INTERNAL = 3  # the launcher itself failed (after stopping every member)
MAX_BACKOFF = 30.0  # seconds: the most a restart waits, however many came before


@dataclass
class Member:
    """One member's life under the launcher: its id, its restarts so far,
    its process while one runs, and how it ended (``state``)."""

    index: int
    id: str
    restarts: int = 0
    proc: asyncio.subprocess.Process | None = None
    state: str = "running"  # running -> done | gave up | stopped
    codes: list[int | None] = field(default_factory=list)  # every exit (None: no start)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ftcomm run",
        description=(
            "Start N members of a job; restart one that dies (under its id, with a "
            "backoff); never signal the others. Each member reads the engine, job and "
            "its id from the environment: ftcomm.Membership.from_env()."
        ),
        epilog=(
            "Exit status: 0 when every member exited 0; 1 when one gave up (its "
            "restarts used up: the launcher waits for the others first); 2 for bad "
            "arguments; 3 when the launcher itself failed; 130 (SIGINT, Ctrl-C), 143 "
            "(SIGTERM) or 129 (SIGHUP) when stopped: the signal goes to every member, "
            "SIGKILL after --grace, or at once on a second one. "
            "Members get FTCOMM_ENGINE, FTCOMM_JOB, FTCOMM_MEMBER_ID, FTCOMM_MIN_SIZE, "
            "FTCOMM_MAX_SIZE, FTCOMM_STORE_HOST (a lighthouse engine), FTCOMM_LOCAL_INDEX, "
            "FTCOMM_NPROC, FTCOMM_RESTART_COUNT (docs/running.md)."
        ),
    )
    p.add_argument("--nproc", type=int, default=1, help="members on this host (default 1)")
    p.add_argument(
        "--engine",
        help=(
            "the engine every host's launcher shares: a store's host:port[/prefix], a "
            "torchft lighthouse's http://host:port, or an etcd cluster's "
            "etcd://host:port[,host:port...][/prefix] (default: a store this launcher "
            "hosts on loopback, for a job on this host only)"
        ),
    )
    p.add_argument("--job", default="job", help="the job's name (default 'job')")
    p.add_argument(
        "--id-prefix",
        help=(
            "member ids are PREFIX0, PREFIX1, ... (default 'm' with the embedded store, "
            "'<hostname>-m' with --engine: ids must be unique across hosts)"
        ),
    )
    p.add_argument("--min-size", type=int, help="FTCOMM_MIN_SIZE: the fewest members (1)")
    p.add_argument(
        "--max-size",
        type=int,
        help="FTCOMM_MAX_SIZE: the most members (default: --nproc with the embedded store)",
    )
    p.add_argument(
        "--store-host",
        help=(
            "with a lighthouse engine: the address this host's members host their "
            "groups' store on, which the other hosts reach (default: the one that routes "
            "to the lighthouse)"
        ),
    )
    p.add_argument("--max-restarts", type=int, default=3, help="restarts per member (default 3)")
    p.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help=f"seconds before a first restart, doubled for each next (default 1, at most "
        f"{MAX_BACKOFF:g})",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="on Ctrl-C or SIGTERM: seconds members get to exit before SIGKILL (default 10)",
    )
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    p.add_argument("script", help="the member's script (a module name with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ftcomm run``; see :func:`parser` for the exit statuses."""
    p = parser()
    opts = p.parse_args(argv)
    problem = _check(opts)
    if problem:
        p.print_usage(sys.stderr)
        print(f"python -m ftcomm run: {problem}", file=sys.stderr)
        return 2
    try:
        with _engine(opts.engine) as engine:
            return asyncio.run(_run(opts, engine))
    except Exception as exc:  # members were stopped on the way out (_run's finally)
        _say(f"the launcher failed: {type(exc).__name__}: {exc}")
        return EXIT_INTERNAL


def _check(opts: argparse.Namespace) -> str:
    """What is wrong with the arguments, in words ('' if nothing): whatever
    would make every member fail at its start is refused here instead."""
    for name in ("nproc", "min_size", "max_size"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
    most = max_size_of(opts)
    if opts.min_size and most and opts.min_size > most:
        where = "--max-size" if opts.max_size else "--nproc, the most with the embedded store"
        return f"--min-size ({opts.min_size}) must not exceed {where} ({most})"
    if opts.max_size and opts.nproc > opts.max_size:
        return (
            f"--nproc ({opts.nproc}) exceeds --max-size ({opts.max_size}): the members "
            "beyond it would never be let in"
        )
    if opts.max_restarts < 0:
        return f"--max-restarts must be >= 0, got {opts.max_restarts}"
    for name in ("backoff", "grace"):
        if not 0 <= getattr(opts, name) < float("inf"):
            return f"--{name} must be a number of seconds >= 0, got {getattr(opts, name)}"
    lighthouse = opts.engine is not None and is_lighthouse(opts.engine)
    try:
        if lighthouse:
            lighthouse_host_port(opts.engine)
        elif opts.engine is not None and opts.engine.startswith(ETCD_SCHEME):
            parse_etcd_addr(opts.engine, "--engine")
        elif opts.engine is not None:
            parse_store_addr(opts.engine, "--engine")
    except ValueError as exc:
        return f"--engine {opts.engine!r}: {exc}" if "--engine" not in str(exc) else str(exc)
    if opts.store_host is not None:
        if not lighthouse:
            return "--store-host is for a lighthouse engine (a store engine hosts the groups)"
        if not opts.store_host.strip() or any(c.isspace() for c in opts.store_host):
            return f"--store-host must be a host name or address, got {opts.store_host!r}"
    try:
        check_name(opts.job, "--job")
        if opts.id_prefix is not None:
            check_name(opts.id_prefix, "--id-prefix")
    except ValueError as exc:
        return str(exc)
    if opts.module:
        top = opts.script.partition(".")[0]  # its package only: nothing of it runs here
        try:
            found = bool(top) and importlib.util.find_spec(top) is not None
        except Exception:
            found = False
        if not found:
            return f"no module named {top or opts.script!r}"
    elif not os.path.isfile(opts.script):
        return f"no such script: {opts.script!r} (a module: -m {opts.script})"
    return ""


def max_size_of(opts: argparse.Namespace) -> int | None:
    """The most members a generation may have: ``--max-size``; with the
    embedded store (a job on this host only), ``--nproc``."""
    return opts.max_size or (opts.nproc if opts.engine is None else None)


def _route_to(url: str) -> str:
    """This host's address on the route to ``url``'s host (no packet is sent)."""
    host, port = lighthouse_host_port(url)
    family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)
        return str(probe.getsockname()[0])


@contextlib.contextmanager
def _engine(given: str | None) -> Iterator[str]:
    """The engine's address: ``given``, or a store hosted here while the job runs."""
    if given is not None:
        yield given
        return
    with serve_store() as server:
        yield server.address


def _signal(members: list[Member], sig: signal.Signals) -> None:
    """``sig`` to each running member's process group (it and what it started)."""
    for m in members:
        proc = m.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)


def _say(text: str) -> None:
    """A line on stderr; a reader that went away does not stop the launcher."""
    with contextlib.suppress(OSError, ValueError):
        print(f"ftcomm run: {text}", file=sys.stderr, flush=True)


def _ended(code: int | None) -> str:
    if code is None:
        return "could not be started"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited {code}"


async def _run(opts: argparse.Namespace, engine: str) -> int:
    embedded = opts.engine is None
    prefix = opts.id_prefix or ("m" if embedded else f"{socket.gethostname()}-m")
    members = [Member(i, f"{prefix}{i}") for i in range(opts.nproc)]
    max_size = max_size_of(opts)
    base = dict(os.environ)
    base.update(FTCOMM_ENGINE=engine, FTCOMM_JOB=opts.job, FTCOMM_NPROC=str(opts.nproc))
    for name in ("FTCOMM_MIN_SIZE", "FTCOMM_MAX_SIZE", "FTCOMM_STORE_HOST"):
        base.pop(name, None)
    if opts.min_size:
        base["FTCOMM_MIN_SIZE"] = str(opts.min_size)
    if max_size:
        base["FTCOMM_MAX_SIZE"] = str(max_size)
    if is_lighthouse(engine):
        base["FTCOMM_STORE_HOST"] = opts.store_host or _route_to(engine)
    if opts.nproc > 1 and "OMP_NUM_THREADS" not in base:
        base["OMP_NUM_THREADS"] = "1"  # as torchrun: N members' thread pools share the CPUs
        _say("OMP_NUM_THREADS=1 for each member (set it to change that)")
    command = [sys.executable, *(["-m"] if opts.module else []), opts.script, *opts.args]
    where = "a store on loopback" if embedded else engine
    _say(
        f"{opts.nproc} member(s) of job {opts.job!r} ({', '.join(m.id for m in members)}); "
        f"engine: {where}"
    )

    stopping = asyncio.Event()
    signals: list[signal.Signals] = []
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        """Each member is in a process group of its own (a terminal's Ctrl-C
        reaches the launcher alone): the signal is passed on to each, once;
        a second one SIGKILLs them."""
        signals.append(sig)
        if stopping.is_set():
            _signal(members, signal.SIGKILL)
            return
        stopping.set()
        _signal(members, sig)
        _say(f"{sig.name}: passed on to every member (SIGKILL after {opts.grace:g} s)")

    # SIGHUP ignored as the launcher started stays ignored (nohup). (Not
    # SIGINT: a shell starts background jobs with it ignored, and Ctrl-C
    # must still reach the members through the launcher.)
    handled = [
        sig
        for sig in EXIT_STOPPED
        if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN
    ]
    for sig in handled:
        loop.add_signal_handler(sig, stop, sig)
    tasks = [
        asyncio.create_task(_supervise(m, opts, base, command, stopping, signals)) for m in members
    ]
    # Ends when every supervisor has (one that failed does not end it early).
    done = asyncio.gather(*tasks, return_exceptions=True)
    asked = asyncio.ensure_future(stopping.wait())
    either: list[asyncio.Future[Any]] = [done, asked]
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if stopping.is_set():
            await _ended_within(done, members, opts.grace)
        results = await done
    finally:  # the launcher itself failed: the members get SIGTERM, the grace, SIGKILL
        asked.cancel()
        if any(m.proc is not None and m.proc.returncode is None for m in members):
            stopping.set()
            _signal(members, signal.SIGTERM)
            await _ended_within(done, members, opts.grace)
        for sig in handled:
            loop.remove_signal_handler(sig)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for m in members:
        restarts = f"{m.restarts} restart{'s' if m.restarts != 1 else ''}"
        _say(f"{m.id} {m.state}: {_ended(m.codes[-1]) if m.codes else 'never ran'} ({restarts})")
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:  # a supervisor's own failure (its member had ended): main() says so
        raise failed[0]
    if signals:
        return EXIT_STOPPED[signals[0]]
    return 0 if all(m.state == "done" for m in members) else 1


async def _ended_within(done: asyncio.Future[Any], members: list[Member], grace: float) -> None:
    """Wait ``grace`` seconds for every member to end; then SIGKILL the rest."""
    with contextlib.suppress(Exception):  # the grace passed (TimeoutError), or worse
        await asyncio.wait_for(asyncio.shield(done), grace)
    if not done.done():
        _signal(members, signal.SIGKILL)


async def _supervise(
    m: Member,
    opts: argparse.Namespace,
    base: dict[str, str],
    command: list[str],
    stopping: asyncio.Event,
    stop_signal: list[signal.Signals],
) -> None:
    """Run member ``m`` until it exits 0, its restarts are used up, or the
    launcher stops (``stop_signal``: what stopped it, once it has)."""
    while not stopping.is_set():
        env = dict(base)
        env.update(
            FTCOMM_MEMBER_ID=m.id,
            FTCOMM_LOCAL_INDEX=str(m.index),
            FTCOMM_RESTART_COUNT=str(m.restarts),
        )
        code: int | None = None
        try:  # in a session of its own: a terminal's Ctrl-C is the launcher's to pass on
            m.proc = await asyncio.create_subprocess_exec(*command, env=env, start_new_session=True)
        except OSError as exc:  # no fork (memory, a process limit): a failed start
            _say(f"{m.id} could not be started: {exc}")
            pid = None
        else:
            if stopping.is_set():  # the stop came as it started: what the others got
                _signal([m], stop_signal[0] if stop_signal else signal.SIGTERM)
            code = await m.proc.wait()
            pid, m.proc = m.proc.pid, None
        m.codes.append(code)
        if code == 0:
            m.state = "done"
            return
        if stopping.is_set():
            break
        who = f"{m.id} (pid {pid})" if pid is not None else m.id
        if m.restarts >= opts.max_restarts:
            m.state = "gave up"
            _say(f"{who} {_ended(code)}: no restarts left of {opts.max_restarts}; the others go on")
            return
        m.restarts += 1
        delay = min(opts.backoff * 2.0 ** min(m.restarts - 1, 30), MAX_BACKOFF)
        _say(f"{who} {_ended(code)}: restart {m.restarts} of {opts.max_restarts} in {delay:g} s")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), delay)
    m.state = "stopped"
