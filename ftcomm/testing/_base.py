"""What every world shares, whichever way its ranks run (processes or threads).

Owns: the rank's context (:class:`RankContext`) and failure record, the
world's store (which a fault plan may break; in a network world it listens
in the hub namespace, and hands network faults to ``_net.Network``), the
leak checks a rank's end is held to, and :class:`WorldError`. The process
world (``_world.py``) and the thread world (``_thread_world.py``) both build
on it; it imports neither.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing.connection as mp_connection
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torch._C._distributed_c10d import TCPStore

if TYPE_CHECKING:
    from ._faults import FaultPlan
    from ._net import Network

LOOPBACK = "127.0.0.1"


@dataclass
class RankContext:
    """What a rank's function gets: who it is, and where the world's store is."""

    rank: int
    world_size: int
    port: int
    world_id: str
    loop: str
    backend: str = "gloo"
    """The backend the test asked for: ``ftcomm.Group(ctx.backend)``."""
    host: str = LOOPBACK
    """Where the world's store listens: loopback, or in a world with
    ``network=True`` the hub's address, which each rank reaches over its
    own link (``f"{ctx.host}:{ctx.port}"``)."""
    hosts: tuple[str, ...] = ()
    """Each rank's own address in a world with ``network=True`` (its Gloo
    listens there); empty otherwise. See :meth:`host_of`."""
    _store: Any = field(default=None, repr=False)
    _rebase: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def addr(self, name: str = "g0") -> str:
        """A store address unique to this world: ``host:port/<world>/<name>``."""
        return f"{self.host}:{self.port}/{self.world_id}/{name}"

    def host_of(self, rank: int) -> str:
        """The address of ``rank``'s host (loopback unless ``network=True``)."""
        return self.hosts[rank] if self.hosts else LOOPBACK

    @property
    def store(self) -> Any:
        """A plain store client, for signalling between ranks in a test
        (made on first use; a network fault that cuts the store blocks it
        for its 30 s timeout)."""
        if self._store is None:
            self._store = TCPStore(
                self.host,
                self.port,
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(seconds=30),
            )
        return self._store

    def baseline(self) -> None:
        """Count what this rank has open now (fds, threads) as its own
        from the start: the leak check at its end then leaves it out.

        For a library that keeps some state for the life of the process
        once first used (torch's store server, torchft's runtime): use it
        once, call this, then run the code under test. In thread mode
        (one process for every rank) it does nothing.
        """
        if self._rebase is not None:
            self._rebase()

    def signal(self, key: str) -> None:
        """Tell every rank that ``key`` happened (see :meth:`wait_for`)."""
        self.store.set(f"{self.world_id}/sig/{key}", b"1")

    async def wait_for(self, key: str, timeout: float = 30.0) -> None:
        """Wait until some rank has called ``signal(key)``.

        Raises:
            TimeoutError: nobody did within ``timeout`` seconds.
        """
        full = f"{self.world_id}/sig/{key}"
        deadline = time.monotonic() + timeout
        while not self.store.check([full]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rank signalled {key!r} within {timeout} s")
            await asyncio.sleep(0.005)

    def wait_for_blocking(self, key: str, timeout: float = 30.0) -> None:
        """:meth:`wait_for` for a sync rank function: blocks this thread.

        Raises:
            TimeoutError: nobody signalled ``key`` within ``timeout`` seconds.
        """
        try:
            self.store.wait([f"{self.world_id}/sig/{key}"], timedelta(seconds=timeout))
        except RuntimeError as exc:  # torch's DistStoreError
            raise TimeoutError(f"no rank signalled {key!r} within {timeout} s") from exc


@dataclass
class RankFailure:
    """A rank's exception (``None`` if it did not pickle), its traceback
    text, when it was raised (``time.monotonic()``, one clock for every
    process of the machine: the rank that failed first is told), and the
    exception in one line."""

    rank: int
    error: BaseException | None
    text: str
    at: float | None = None
    line: str = ""


RankFn = Callable[..., Any]
"""``async def fn(ctx: RankContext, *args) -> value`` (a module-level function), or
a plain ``def`` for sync code such as the c10d facade: it then runs on the rank's
main thread, inside its event loop's first step."""


async def rank_coroutine(fn: RankFn, ctx: RankContext, args: tuple[Any, ...]) -> Any:
    """Run ``fn``, awaiting it if it is a coroutine function."""
    if inspect.iscoroutinefunction(fn):
        return await fn(ctx, *args)
    return fn(ctx, *args)


FdMap = dict[str, tuple[str, int, int]]
"""Open fds: each number with what it is open on (see :func:`open_fds`)."""


def open_fds() -> FdMap:
    """This process's open fds, each with what it is open on (device and
    inode), so that a number that was closed and opened again on something
    else is told apart. Anonymous inodes (epoll, eventfd, timerfd) share one
    inode: of those only the kind tells them apart, not one from another."""
    found: FdMap = {}
    for fd in os.listdir("/proc/self/fd"):
        link = _link(fd)
        if not link:  # closed since it was listed (the listing's own fd, say)
            continue
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # closed since
            continue
        except OSError:  # open, on something that cannot be looked at (a dead mount)
            found[fd] = (link, -1, -1)
            continue
        # a file's path is not part of what it is: renamed or deleted, it is the same file
        found[fd] = (link if link.startswith("anon_inode:") else "", st.st_dev, st.st_ino)
    return found


def fds_opened_since(before: FdMap) -> set[str]:
    """The fds open now that were not open on the same thing in ``before``:
    a leak is seen even where it reuses the number of an fd that something
    else (a late close, a garbage collection) freed meanwhile."""
    return {fd for fd, what in open_fds().items() if before.get(fd) != what}


def thread_ids() -> set[int]:
    """Python threads other than ftcomm's own. A native thread (Gloo's, a
    c10d future's) that once ran a Python callback is listed too, as a
    ``_DummyThread``, and Python 3.11 keeps it listed after it has ended: it
    is no thread the rank started, and not counted."""
    return {
        t.ident or 0
        for t in threading.enumerate()
        if not t.name.startswith("ftcomm-") and not isinstance(t, threading._DummyThread)
    }


def proc_stat(pid: object) -> list[str]:
    """``/proc/<pid>/stat`` past the command name (state, ppid, ...); [] if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def child_pids(zombies: bool = False, *, descendants: bool = False) -> set[int]:
    """Child processes of this process, from /proc: live ones, or also
    zombies (exited, never reaped); with ``descendants``, their children
    too, and so on (ranks are the forkserver's children, not ours)."""
    parents, found = {str(os.getpid())}, set[str]()
    stats = [(entry, proc_stat(entry)) for entry in os.listdir("/proc") if entry.isdigit()]
    while parents:
        parents = {
            entry
            for entry, fields in stats
            if fields[1:2] and fields[1] in parents and (zombies or fields[0] != "Z")
        } - found
        found |= parents
        if not descendants:
            break
    return {int(entry) for entry in found}


def shm_segments() -> set[str]:
    """ftcomm's shared-memory segments in ``/dev/shm`` (every process's)."""
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith("ftcomm-")}
    except FileNotFoundError:  # pragma: no cover - Linux always has it
        return set()


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed since it was listed
        return ""


def settle_fds(left: Callable[[], set[str]], cap: float = 2.0) -> set[str]:
    """What ``left()`` still finds after at most ``cap`` s. A Gloo device
    (its listening socket, epoll and pipe) may be let go on a thread of its
    own (a Gloo worker returning from a completion callback) just after the
    rank's code saw its op end; what is still open after ``cap`` is a leak.
    Only waited for when an epoll is among the new fds: other leaks are
    reported at once."""
    limit = time.monotonic() + cap
    found = left()
    while found and time.monotonic() < limit:
        time.sleep(0.01)
        found = left()
    return found


def _passing(link: str) -> bool:
    """An fd that may still be on its way out when the rank's code is done:
    a native group's epoll (see :func:`settle_fds`), or a Python source file
    that another thread has open to format a traceback (a logged error's,
    seen as ``threading.py``), which linecache closes once it is read."""
    return link == "anon_inode:[eventpoll]" or link.endswith(".py")


def on_baseline(ctx: RankContext, hook: Callable[[], None]) -> None:
    """Have ``ctx.baseline()`` call ``hook`` (the harness: count what is
    open now as the rank's own)."""
    ctx._rebase = hook


def release_store(ctx: RankContext) -> None:
    """Let go of ``ctx``'s signalling store client, at its rank's end (the
    harness; the leak check then finds its socket closed)."""
    ctx._store = None


def find_leaks(rt: Any, fds: FdMap, threads: set[int], children: set[int]) -> str | None:
    """What the rank left behind, once ftcomm's blocking work has ended."""
    # A finished call leaves the pool's books just after its future completes.
    # Bounded by the calls' own deadlines: a configure against a broken store may
    # block its control thread up to 2 * timeout + 2 s (see Group.configure).
    rt.workers.wait_idle(15.0)
    rt.control.wait_idle(15.0)
    rt.callbacks.wait_idle(15.0)
    rt.reaper.wait_short(10.0)
    if not rt.reaper.wait_unparked(5.0):
        return "native objects handed to the reaper are still referenced elsewhere"
    if rt.workers.busy or rt.control.busy:
        return f"{rt.workers.busy + rt.control.busy} ftcomm worker call(s) still blocked"
    if child_pids() - children:
        return f"child processes left running: {sorted(child_pids() - children)}"
    if child_pids(zombies=True) - children:
        return f"child processes left unreaped: {sorted(child_pids(zombies=True) - children)}"
    mine = {name for name in shm_segments() if name.startswith(f"ftcomm-{os.getpid()}-")}
    if mine:
        return f"shared-memory segments left in /dev/shm: {sorted(mine)}"
    if rt.reaper.pending:
        # A native group with an op in flight until its own (long) timeout:
        # in-process Gloo cannot be stopped earlier, by design. Its sockets
        # are the reaper's until then, so there is nothing to compare.
        return None
    new_fds = fds_opened_since(fds)
    if any(_passing(_link(fd)) for fd in new_fds):
        new_fds = settle_fds(lambda: fds_opened_since(fds))  # see _passing
    if new_fds:
        paths = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in new_fds]
        return f"fds left open: {paths}"
    new_threads = thread_ids() - threads
    left = [t for t in threading.enumerate() if t.ident in new_threads and t.is_alive()]
    if left:  # (one that ended since thread_ids() is no leak)
        return f"threads left running: {left}"
    return None


def world_error(failures: list[str], plan: FaultPlan | None) -> WorldError:
    """Every failure in full, then the plan, then one line per failure: a
    rank's traceback is long, and an output cut to its ends (a CI log)
    still shows which rank failed first and how."""
    summary = [_headline(text) for text in failures]
    if plan is not None:
        failures.append(f"plan: {plan}")
    if len(failures) > 1 or "\n" in failures[0]:
        failures.append("in short:\n" + "\n".join(f"  {line}" for line in summary))
    return WorldError("\n\n".join(failures))


def _headline(text: str, width: int = 300) -> str:
    """A failure's first line (a rank that raised: its exception's, see
    :func:`exception_line`), cut to ``width`` characters."""
    head = next((line for line in text.splitlines() if line.strip()), "(no message)")
    return head if len(head) <= width else head[: width - 3] + "..."


def exception_line(exc: BaseException) -> str:
    """``exc`` in one line: its type and its message's first line; for an
    exception group, that of its first leaf too (a TaskGroup's failure)."""
    text = "".join(traceback.format_exception_only(exc)).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    leaves = getattr(exc, "exceptions", None)  # an ExceptionGroup's (Python 3.11)
    if isinstance(leaves, tuple) and leaves and isinstance(leaves[0], BaseException):
        line += f" (first: {exception_line(leaves[0])})"
    return line


def _serve(host: str) -> Any:
    return TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


class HarnessStore:
    """The world's TCPStore, which a rank's fault plan may break.

    A thread answers the ranks' control pipes: on ``"break_store"`` it drops
    the server, so that no new store connection succeeds from then on (every
    later ``configure()`` fails; connections already made keep working); on
    ``("network", fault)`` it has ``network`` apply the fault. With a
    ``network``, the server listens in its hub namespace.
    """

    def __init__(self, network: Network | None = None) -> None:
        self._network = network
        if network is None:
            self.host = LOOPBACK
            self._server: Any = _serve(LOOPBACK)
        else:
            self.host = network.hub_host
            self._server = network.in_hub(lambda: _serve(network.hub_host))
        self.port: int = self._server.port
        self.fired: set[int] = set()  # ranks whose kill or stop fault has fired
        self._thread: threading.Thread | None = None

    def serve(self, controls: list[Any]) -> None:
        """Answer the ranks' control pipes (``controls[rank]``) on a thread."""
        self._thread = threading.Thread(
            target=self._answer, args=(dict(enumerate(controls)),), name="world-store-control"
        )
        self._thread.daemon = True
        self._thread.start()

    def _answer(self, controls: dict[int, Any]) -> None:
        by_conn = {conn: rank for rank, conn in controls.items()}
        while by_conn:
            ready: list[Any] = mp_connection.wait(list(by_conn))
            for conn in ready:
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    del by_conn[conn]  # the rank is gone
                    continue
                answer = "done"
                if request == "break_store":
                    self.break_()
                elif isinstance(request, tuple) and request[0] == "fired":
                    self.fired.add(by_conn[conn])
                elif isinstance(request, tuple) and request[0] == "network":
                    answer = self._fire(by_conn[conn], request[1])
                try:
                    conn.send(answer)
                except OSError:  # it died right after asking
                    del by_conn[conn]

    def _fire(self, rank: int, fault: Any) -> str:
        """Have the network apply ``fault``: ``"done"``, or why not (the
        rank's op then fails with it; this thread goes on either way)."""
        if self._network is None:
            return "this world has no network (run_world(network=True))"
        try:
            return self._network.fire(rank, fault)
        except Exception as exc:
            return f"the harness failed to apply it: {exc!r}"

    def break_(self) -> None:
        """Stop taking connections (those already made keep working)."""
        self._server = None

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(10)
        self._server = None


class WorldError(AssertionError):
    """A world failed: a rank raised, died unexpectedly, hung, or leaked.

    The message holds every failing rank's traceback and the fault plan.
    """
