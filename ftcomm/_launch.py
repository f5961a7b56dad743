"""``python -m ftcomm run``: start a job's members; restart only the dead.

torchrun's agent runs its ranks as one unit: when one fails, it stops
every other and restarts them all, or gives up. With ``ftcomm.Membership``
the survivors go on without the dead member, so this launcher does the
opposite: it restarts the member that died, under its old id (with a
backoff, up to ``--max-restarts`` times), and never signals a survivor.
Each member finds the engine, its job and its id in its environment
(:meth:`ftcomm.Membership.from_env`); the engine is a store this launcher
hosts on loopback, unless ``--engine`` names one (a store or a torchft
lighthouse) that the launchers of several hosts share.

Owns: the command line, one supervisor task per member, the embedded
store, the stop on SIGINT/SIGTERM. Imports: ``ftcomm._server``,
``ftcomm._store`` and the membership's lighthouse check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._membership._lighthouse import is_lighthouse
from ._server import serve_store
from ._store import parse_store_addr

EXIT_STOPPED = {signal.SIGINT: 130, signal.SIGTERM: 143}  # a shell's 128 + signal
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
    codes: list[int] = field(default_factory=list)  # every exit, in order


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
            "arguments; 130 (SIGINT, Ctrl-C) or 143 (SIGTERM) when stopped. "
            "Members get FTCOMM_ENGINE, FTCOMM_JOB, FTCOMM_MEMBER_ID, FTCOMM_MIN_SIZE, "
            "FTCOMM_MAX_SIZE, FTCOMM_LOCAL_INDEX, FTCOMM_NPROC, FTCOMM_RESTART_COUNT "
            "(docs/running.md)."
        ),
    )
    p.add_argument("--nproc", type=int, default=1, help="members on this host (default 1)")
    p.add_argument(
        "--engine",
        help=(
            "the engine every host's launcher shares: a store's host:port[/prefix] or a "
            "torchft lighthouse's http://host:port (default: a store this launcher hosts "
            "on loopback, for a job on this host only)"
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
    with _engine(opts.engine) as engine:
        return asyncio.run(_run(opts, engine))


def _check(opts: argparse.Namespace) -> str:
    """What is wrong with the arguments, in words ('' if nothing)."""
    for name in ("nproc", "min_size", "max_size"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
    if opts.min_size and opts.max_size and opts.min_size > opts.max_size:
        return f"--min-size ({opts.min_size}) must not exceed --max-size ({opts.max_size})"
    if opts.max_restarts < 0:
        return f"--max-restarts must be >= 0, got {opts.max_restarts}"
    for name in ("backoff", "grace"):
        if not 0 <= getattr(opts, name) < float("inf"):
            return f"--{name} must be a number of seconds >= 0, got {getattr(opts, name)}"
    if opts.engine is not None and not is_lighthouse(opts.engine):
        try:
            parse_store_addr(opts.engine, "--engine")
        except ValueError as exc:
            return str(exc)
    prefix = opts.id_prefix
    if prefix is not None and (not prefix or any(c.isspace() or c == "/" for c in prefix)):
        return f"--id-prefix must be non-empty, without whitespace or '/', got {prefix!r}"
    if not opts.module and not os.path.isfile(opts.script):
        return f"no such script: {opts.script!r} (a module: -m {opts.script})"
    return ""


@contextlib.contextmanager
def _engine(given: str | None) -> Iterator[str]:
    """The engine's address: ``given``, or a store hosted here while the job runs."""
    if given is not None:
        yield given
        return
    with serve_store() as server:
        yield server.address


def _kill(members: list[Member]) -> None:
    for m in members:
        if m.proc is not None and m.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                m.proc.kill()


def _say(text: str) -> None:
    print(f"ftcomm run: {text}", file=sys.stderr, flush=True)


def _ended(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited {code}"


async def _run(opts: argparse.Namespace, engine: str) -> int:
    embedded = opts.engine is None
    prefix = opts.id_prefix or ("m" if embedded else f"{socket.gethostname()}-m")
    members = [Member(i, f"{prefix}{i}") for i in range(opts.nproc)]
    max_size = opts.max_size or (opts.nproc if embedded else None)
    base = dict(os.environ)
    base.update(FTCOMM_ENGINE=engine, FTCOMM_JOB=opts.job, FTCOMM_NPROC=str(opts.nproc))
    base.pop("FTCOMM_MAX_SIZE", None)
    base.pop("FTCOMM_MIN_SIZE", None)
    if opts.min_size:
        base["FTCOMM_MIN_SIZE"] = str(opts.min_size)
    if max_size:
        base["FTCOMM_MAX_SIZE"] = str(max_size)
    command = [sys.executable, *(["-m"] if opts.module else []), opts.script, *opts.args]
    where = "a store on loopback" if embedded else engine
    _say(
        f"{opts.nproc} member(s) of job {opts.job!r} ({', '.join(m.id for m in members)}); "
        f"engine: {where}"
    )

    stopping = asyncio.Event()
    stopped_by: list[signal.Signals] = []
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        if stopping.is_set():
            return
        stopped_by.append(sig)
        stopping.set()
        _say(f"{sig.name}: stopping every member (SIGKILL after {opts.grace:g} s)")
        for m in members:
            if m.proc is not None and m.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    m.proc.send_signal(signal.SIGTERM)

    for sig in EXIT_STOPPED:
        loop.add_signal_handler(sig, stop, sig)
    tasks = [asyncio.create_task(_supervise(m, opts, base, command, stopping)) for m in members]
    done = asyncio.gather(*tasks)
    asked = asyncio.ensure_future(stopping.wait())
    either: list[asyncio.Future[Any]] = [done, asked]
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if stopping.is_set():
            try:
                await asyncio.wait_for(asyncio.shield(done), opts.grace)
            except TimeoutError:
                _kill(members)
        await done
    finally:  # (a failure of the launcher's own, too): no member outlives it
        asked.cancel()
        for sig in EXIT_STOPPED:
            loop.remove_signal_handler(sig)
        _kill(members)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for m in members:
        restarts = f"{m.restarts} restart{'s' if m.restarts != 1 else ''}"
        _say(f"{m.id} {m.state}: {_ended(m.codes[-1]) if m.codes else 'never ran'} ({restarts})")
    if stopped_by:
        return EXIT_STOPPED[stopped_by[0]]
    return 0 if all(m.state == "done" for m in members) else 1


async def _supervise(
    m: Member,
    opts: argparse.Namespace,
    base: dict[str, str],
    command: list[str],
    stopping: asyncio.Event,
) -> None:
    """Run member ``m`` until it exits 0, its restarts are used up, or the launcher stops."""
    while not stopping.is_set():
        env = dict(base)
        env.update(
            FTCOMM_MEMBER_ID=m.id,
            FTCOMM_LOCAL_INDEX=str(m.index),
            FTCOMM_RESTART_COUNT=str(m.restarts),
        )
        m.proc = await asyncio.create_subprocess_exec(*command, env=env)
        if stopping.is_set():  # the stop came as it started: it gets the others' SIGTERM
            with contextlib.suppress(ProcessLookupError):
                m.proc.send_signal(signal.SIGTERM)
        code = await m.proc.wait()
        pid, m.proc = m.proc.pid, None
        m.codes.append(code)
        if code == 0:
            m.state = "done"
            return
        if stopping.is_set():
            break
        if m.restarts >= opts.max_restarts:
            m.state = "gave up"
            _say(
                f"{m.id} (pid {pid}) {_ended(code)}: no restarts left of "
                f"{opts.max_restarts}; the others go on"
            )
            return
        m.restarts += 1
        delay = min(opts.backoff * 2 ** (m.restarts - 1), MAX_BACKOFF)
        _say(
            f"{m.id} (pid {pid}) {_ended(code)}: restart {m.restarts} of "
            f"{opts.max_restarts} in {delay:g} s, as {m.id}"
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), delay)
    m.state = "stopped"
