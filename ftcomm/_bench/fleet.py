"""The processes of a soak or a scale run, one incarnation of a member at a time.

Owns: :class:`Fleet` (each member id's processes, the current one and those
before it, each with a pipe to this process; started from the caller's
multiprocessing context, ftcomm.testing's fork server; signalled, replaced,
reaped; cut off the network and healed, where they live on :class:`Hosts`),
:class:`Incarnation` (one of them, and what the bench knows of it), and the
stacks a member writes when a run stalls (:func:`install_dumps`, in the
member; :func:`dump`, in the bench).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

from ..testing import _faults
from ..testing._net import Network, NetworkFailed

Target = tuple[Callable[..., None], tuple[object, ...]]
"""A process's function and its first arguments (the environment and the
pipe's end are added after them)."""


class FleetFailed(Exception):
    """A process failed, exited unasked, or said nothing in time: one that
    the bench did not signal and that exits before it said it was done, or
    that sends ``("error", traceback)``, fails the run (with its exit code
    or its traceback)."""


@dataclass(eq=False)
class Incarnation:
    """One process of member ``member`` (its ``n``-th, from 0)."""

    member: str
    n: int
    proc: Any
    conn: Connection
    started: float
    generation: int | None = None
    """The latest generation it said it is in (``None``: none yet)."""
    size: int = 0
    """That generation's size (torchft: its participants)."""
    stopped: bool = False
    """SIGSTOPped by the bench."""
    signalled: bool = False
    """SIGKILLed (or to be) by the bench: its exit is expected."""
    done: bool = False
    """It said ``done``: its exit is expected."""
    eof: bool = False
    heard: float = 0.0
    """When it last said something."""

    @property
    def name(self) -> str:
        return self.member if self.n == 0 else f"{self.member}#{self.n}"

    @property
    def pid(self) -> int:
        pid: int = self.proc.pid
        return pid

    def send(self, message: object) -> None:
        """Send ``message``; a process that is gone is not an error here
        (its EOF says so, if it was not expected)."""
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(message)


class Hosts:
    """A host of its own for each member: ``m<k>``, and every process that
    takes its id, lives in ``net``'s namespace ``k``. Holds the network
    faults in force, one per member at most."""

    def __init__(self, net: Network) -> None:
        self.net = net
        self._ops = itertools.count()  # (each fault's nftables table is its own)
        self.cut: dict[str, _faults.Fault] = {}

    def of(self, member: str) -> tuple[str, str]:
        """``member``'s namespace and its address there."""
        slot = int(member[1:])
        return self.net.namespaces[slot], self.net.hosts[slot]

    def fault(self, kind: str, member: str) -> _faults.Fault:
        """A network fault ``kind`` on ``member``'s host (a partition keeps the store)."""
        return _faults.Fault(_faults.Kind(kind), int(member[1:]), next(self._ops))


@dataclass
class Fleet:
    """Every process of one run; :meth:`close` kills (a stopped one too) and reaps them all."""

    ctx: Any
    target: Callable[[str], Target]
    """The function and arguments of member ``member``'s next process."""
    hosts: Hosts | None = None
    """Where the members live on hosts of their own (``None``: the network of this process)."""
    all: list[Incarnation] = field(default_factory=list)
    current: dict[str, Incarnation] = field(default_factory=dict)

    def start(self, member: str) -> Incarnation:
        """Start a process for ``member`` (a replacement if it had one)."""
        before = self.current.get(member)
        fn, args = self.target(member)
        recv_end, send_end = self.ctx.Pipe()
        n = 0 if before is None else before.n + 1
        proc = self.ctx.Process(
            target=fn,
            args=(*args, dict(os.environ), send_end),
            name=f"ftcomm-bench-{member}-{n}",
            daemon=True,
        )
        try:
            proc.start()
        except BaseException:
            recv_end.close()
            raise
        finally:
            send_end.close()  # the child's is the only other end: its exit gives EOF
        inc = Incarnation(member, n, proc, recv_end, time.monotonic())
        self.all.append(inc)
        self.current[member] = inc
        return inc

    def live(self) -> list[Incarnation]:
        """The current incarnation of every member, in member order."""
        return [self.current[m] for m in sorted(self.current, key=_member_order)]

    def kill(self, inc: Incarnation) -> None:
        """SIGKILL ``inc`` (stopped or not) and reap it."""
        inc.signalled = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(inc.pid, signal.SIGKILL)
        inc.proc.join(10.0)

    def stop(self, inc: Incarnation) -> None:
        """SIGSTOP ``inc``: it hangs until :meth:`kill`."""
        inc.stopped = True
        inc.signalled = True
        os.kill(inc.pid, signal.SIGSTOP)

    def cut(self, inc: Incarnation, kind: str) -> None:
        """Cut ``inc``'s host off the network, until :meth:`heal`: ``kind``
        ``"partition"`` drops every packet to and from the other members'
        hosts (not the store's), ``"isolate"`` every packet.

        Raises:
            FleetFailed: the members have no hosts, or the rules failed.
        """
        if self.hosts is None:
            raise FleetFailed(f"{kind}: the members have no hosts of their own")
        fault = self.hosts.fault(kind, inc.member)
        said = self.hosts.net.fire(fault.rank, fault)
        if said != "done":
            raise FleetFailed(f"{kind} of {inc.name} could not strike: {said}")
        self.hosts.cut[inc.member] = fault

    def heal(self, inc: Incarnation) -> None:
        """Lift the network fault on ``inc``'s host (:meth:`cut`'s).

        Raises:
            FleetFailed: its rules could not be removed.
        """
        fault = self.hosts.cut.pop(inc.member) if self.hosts is not None else None
        if fault is not None and self.hosts is not None:
            try:
                self.hosts.net.heal(fault.rank, fault)
            except NetworkFailed as exc:
                raise FleetFailed(f"{fault.kind.value} of {inc.name} not healed: {exc}") from None

    def receive(self, timeout: float) -> list[tuple[Incarnation, tuple[Any, ...]]]:
        """The messages that arrive within ``timeout`` seconds (those already
        there at once), in the order each process sent them.

        Raises:
            FleetFailed: a process sent an error, or exited unasked.
        """
        by_conn = {inc.conn: inc for inc in self.all if not inc.eof}
        if not by_conn:
            return []
        ready = multiprocessing.connection.wait(list(by_conn), max(timeout, 0.0))
        out: list[tuple[Incarnation, tuple[Any, ...]]] = []
        for conn in ready:
            inc = by_conn[cast(Connection, conn)]
            try:
                while inc.conn.poll():
                    message: tuple[Any, ...] = inc.conn.recv()
                    if message[0] == "error":
                        raise FleetFailed(f"{inc.name} failed:\n{message[1]}")
                    inc.heard = time.monotonic()
                    if message[0] == "done":
                        inc.done = True
                    out.append((inc, message))
            except (EOFError, OSError):  # (a socket's end: reset, where data was unread)
                inc.eof = True
                if not (inc.signalled or inc.done):
                    inc.proc.join(1.0)
                    raise FleetFailed(
                        f"{inc.name} (pid {inc.pid}) exited unasked (code {inc.proc.exitcode})"
                    ) from None
        return out

    def expect(
        self,
        incs: Sequence[Incarnation],
        kind: str,
        deadline: float,
        on: Callable[[Incarnation, tuple[Any, ...]], None] = lambda inc, message: None,
    ) -> dict[Incarnation, tuple[Any, ...]]:
        """The first message ``(kind, ...)`` from each of ``incs``; every
        message received meanwhile (theirs or others') goes to ``on`` first.

        Raises:
            FleetFailed: as :meth:`receive`, or the deadline passed.
        """
        got: dict[Incarnation, tuple[Any, ...]] = {}
        while len(got) < len(incs):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(inc.name for inc in incs if inc not in got)
                raise FleetFailed(f"no {kind!r} from {missing} in time")
            for inc, message in self.receive(left):
                on(inc, message)
                if message[0] == kind and inc in incs and inc not in got:
                    got[inc] = message
        return got

    def close(self) -> None:
        for inc in self.all:
            inc.proc.join(0.0)
            if inc.proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(inc.pid, signal.SIGKILL)  # ends a stopped process too
        for inc in self.all:
            inc.proc.join(10.0)
            with contextlib.suppress(ValueError):  # still running: left to the daemon flag
                inc.proc.close()
            inc.conn.close()


def _member_order(member: str) -> tuple[int, str]:
    digits = "".join(c for c in member if c.isdigit())
    return (int(digits) if digits else -1, member)


# -- stacks, for a stall --------------------------------------------------------------
_THREADS_SIGNAL = signal.SIGUSR1
"""Makes a process write every thread's stack to its stacks file (faulthandler:
at once, whatever its threads are doing)."""
_TASKS_SIGNAL = signal.SIGUSR2
"""Makes it write its event loop's tasks' stacks there, then :data:`_END`."""
_END = "(end of the stacks)"


def stacks_file(folder: str, member: str) -> str:
    return os.path.join(folder, f"{member}-{os.getpid()}.txt")


def install_dumps(path: str) -> None:
    """In a member's process, on its event loop: write the stacks to ``path``
    when the bench asks (:func:`dump`): every thread's at once (faulthandler,
    even where the loop is blocked), then, from the loop, every thread's as
    Python sees it and every task's down the chain of what it awaits."""
    import asyncio
    import faulthandler
    import sys
    import traceback

    out = open(path, "a", encoding="utf-8")  # noqa: SIM115  (kept open: faulthandler's)
    faulthandler.register(_THREADS_SIGNAL, file=out, all_threads=True)

    def tasks() -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, top in sys._current_frames().items():
            print(f"\nthread {names.get(ident, ident)}:", file=out)
            print("".join(traceback.format_stack(top, limit=30)), end="", file=out)
        for task in asyncio.all_tasks():
            print(f"\n{task!r:.300}", file=out)
            awaited: Any = task.get_coro()
            for _ in range(64):  # what each coroutine awaits, down to the bottom
                frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
                if frame is not None:
                    code = frame.f_code
                    print(
                        f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}',
                        file=out,
                    )
                awaited = getattr(awaited, "cr_await", None) or getattr(
                    awaited, "gi_yieldfrom", None
                )
                if awaited is None:
                    break
        print(_END, file=out, flush=True)

    asyncio.get_running_loop().add_signal_handler(_TASKS_SIGNAL, tasks)


def dump(incs: Sequence[Incarnation], folder: str, wait: float = 3.0) -> str:
    """Every thread's and task's stack of each of ``incs`` that still runs
    (and was not stopped by the bench), as their processes wrote them."""
    asked = []
    for inc in incs:
        if inc.proc.exitcode is not None or inc.stopped:
            continue
        path = os.path.join(folder, f"{inc.member}-{inc.pid}.txt")
        with contextlib.suppress(ProcessLookupError):
            os.kill(inc.pid, _THREADS_SIGNAL)
            os.kill(inc.pid, _TASKS_SIGNAL)
            asked.append((inc, path))
    until = time.monotonic() + wait
    out = []
    for inc, path in asked:
        text = ""
        while time.monotonic() < until:  # the loop writes its tasks when it next runs
            with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
                text = f.read()
            if _END in text:
                break
            time.sleep(0.05)
        out.append(f"--- {inc.name} (pid {inc.pid}):\n{text or '(nothing written)'}")
    return "\n".join(out)
