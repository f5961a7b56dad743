"""The owner loop: one asyncio event loop per process that owns every group.

Owns :class:`Runtime`: the loop, in the daemon thread ``ftcomm-owner``
(uvloop when installed, unless ``FTCOMM_LOOP=asyncio``), which holds the
control plane (deadline timers, aborts, hand-offs to the reaper) but not the
data plane; the bridge from other threads (:meth:`Runtime.call_soon`, fire
and forget; :meth:`Runtime.call`, blocking, refused on the loop's thread);
its threads and reaper. Also :class:`LoopPoller` and debug mode's
:class:`Watchdog`. See docs/ops.md and docs/observability.md.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import gc
import logging
import os
import sys
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from .threads import EventQueue, Reaper, WorkerPool

T = TypeVar("T")

log = logging.getLogger("ftcomm")

_LOOP_ENV = "FTCOMM_LOOP"
_DEBUG_ENV = "FTCOMM_DEBUG"
_STALL_ENV = "FTCOMM_STALL_MS"


def loop_kind() -> str:
    """The owner loop implementation this process uses: ``"uvloop"`` or ``"asyncio"``."""
    wanted = os.environ.get(_LOOP_ENV, "auto").strip().lower()
    if wanted not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"{_LOOP_ENV} must be auto, uvloop or asyncio, got {wanted!r}")
    if wanted == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if wanted == "uvloop":
            raise RuntimeError(f"{_LOOP_ENV}=uvloop but uvloop is not installed") from None
        return "asyncio"
    return "uvloop"


def new_event_loop(kind: str | None = None) -> asyncio.AbstractEventLoop:
    """A fresh event loop of ``kind`` (default: :func:`loop_kind`)."""
    kind = kind or loop_kind()
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


sched_yield: Callable[[], object] = getattr(os, "sched_yield", lambda: None)
"""Give this core to another runnable thread (a no-op where the OS has no
``sched_yield``)."""


HOLD_SECONDS = 50e-6
"""How long an await that is alone in spinning on its loop polls before it
lets the loop run once (``Work._spin``). The hold is checked after each
poll's ``sched_yield``, so a turn may run a yield past it (on a loaded
machine a yield can give the core away for a scheduler slice)."""


class _Spinners(threading.local):
    def __init__(self) -> None:
        self.count = [0]


SPINNERS = _Spinners()


def spinners() -> list[int]:
    """This thread's count of awaits spinning on an op, in a box: a spin whose
    generator is closed on another thread (by a garbage collection) counts
    down the box of the thread it counted up."""
    return SPINNERS.count


class LoopPoller:
    """Call ``poll()`` once per iteration of ``loop``, yielding the core in
    between, until it returns true or ``spin`` seconds have passed; then, if
    it never did (or the loop is closed, or ``poll()`` raised), call
    ``give_up()`` once. A loop closed with the poll queued drops it: then
    ``give_up()`` is called as the poller is let go (a loop stopped but
    not closed holds it).

    An object, not a closure that schedules itself: such a closure is a
    reference cycle, which would keep what it polls (a native op, and
    through it a native group and its sockets) until the next garbage
    collection."""

    __slots__ = ("_give_up", "_loop", "_over", "_poll", "_until")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        spin: float,
        poll: Callable[[], bool],
        give_up: Callable[[], object],
    ) -> None:
        self._loop = loop
        self._until = time.perf_counter() + spin
        self._poll = poll
        self._give_up = give_up
        self._over = False

    def start(self) -> None:
        try:
            self._loop.call_soon(self)
        except RuntimeError:  # the loop is closed
            self._stop(give_up=True)

    def _stop(self, give_up: bool) -> None:
        if not self._over:
            self._over = True
            if give_up:
                self._give_up()

    def __call__(self) -> None:
        try:
            done = self._poll()
        except Exception:  # a bug below: leave it to the native callback
            log.exception("ftcomm: a loop's poll of an op failed")
            done = False
            self._until = 0.0
        if done:
            self._stop(give_up=False)
            return
        if time.perf_counter() >= self._until:
            self._stop(give_up=True)
            return
        sched_yield()  # the backend's thread first (see Work._spin)
        self.start()

    def __del__(self) -> None:
        # Dropped with its handle by a loop closed before it ran (whatever
        # thread closed it): the op must not wait for its deadline.
        if not self._over:
            try:
                self._stop(give_up=True)
            except Exception:
                log.exception("ftcomm: arming an op whose loop closed failed")


def _set_none(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(None)


def require_asyncio(what: str, name: str = "") -> None:
    """Raise a clear error where ``what`` (and ``name``: only formatted then)
    is awaited without a running asyncio loop (under trio, say, which cannot
    drive ftcomm's awaitables).

    Raises:
        RuntimeError: no asyncio event loop is running in this thread.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            f"{what}{' ' + name if name else ''} needs a running asyncio event loop "
            "(under anyio: its asyncio backend; trio is not supported)"
        ) from None


def wake_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any]) -> None:
    """Complete ``fut`` (with ``None``) on ``loop``, from any thread; nothing
    if the loop is closed (nobody is waiting there any more)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_set_none, fut)


@dataclass(frozen=True)
class Stall:
    """The owner loop was held by one callback for longer than the threshold.

    ``seconds`` is how late the loop's heartbeat was, less ``queued``: the
    machine's delay, not the callback's (Linux only, else 0). That is the
    time the owner thread was runnable but waiting for a CPU, plus the time
    the process's main thread waited for one while the owner thread was
    off the CPU: a Python thread preempted mid-bytecode keeps the GIL, and
    the trainer's main thread is the one that holds it most.
    """

    seconds: float
    stack: str
    queued: float = 0.0

    def __str__(self) -> str:
        return (
            f"held for {self.seconds:.3f} s (and {self.queued:.3f} s the machine's) by:\n"
            f"{self.stack}"
        )


class CpuClock:
    """One thread's scheduler counters, from ``/proc/self/task/<tid>/schedstat``.

    :meth:`read` gives ``(on_cpu, queued)``: seconds the thread has run, and
    seconds it has been runnable but waiting for a CPU. Both are 0 where the
    kernel does not say (not Linux, or no schedstat). The file stays open
    until :meth:`close` (one fd, not one per read: leak checks snapshot fds
    while the watchdog runs).
    """

    def __init__(self, native_id: int | None) -> None:
        self._fd = -1
        if native_id is not None:
            with contextlib.suppress(OSError):
                self._fd = os.open(f"/proc/self/task/{native_id}/schedstat", os.O_RDONLY)

    def read(self) -> tuple[float, float]:
        if self._fd < 0:
            return 0.0, 0.0
        try:
            on_cpu, queued = os.pread(self._fd, 128, 0).split()[:2]
            return int(on_cpu) / 1e9, int(queued) / 1e9
        except (OSError, ValueError):
            return 0.0, 0.0

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


# Innermost frames of an owner loop that is waiting for events, not running a
# callback: a late heartbeat there means the process was busy elsewhere.
_IDLE_FRAMES = frozenset({"run_forever", "_run_once", "select", "poll"})


def _idle(frame: types.FrameType) -> bool:
    # uvloop waits in C: its innermost Python frame is Runtime._run itself, or,
    # on a caller's thread, whatever called run_until_complete (asyncio.run's
    # Runner, anyio's, pytest-asyncio's).
    code = frame.f_code
    return (
        code.co_name in _IDLE_FRAMES
        or code is Runtime._run.__code__
        or (code.co_name in ("run", "run_until_complete") and "asyncio" in code.co_filename)
    )


def _excused(
    base: tuple[float, float, float, float], now: tuple[float, float, float, float], held: float
) -> float:
    """The machine's part of a late beat between two samples of a loop's
    counters (:meth:`_Watched.sample`): the loop thread's own run-queue wait,
    plus ``held``, the likely GIL holder's run-queue wait while the beat was
    overdue, as far as the loop thread was neither on a CPU nor queued for
    one then. From outside, waiting for the GIL and a callback blocked with
    it released (``time.sleep``, a lock, ``recv``) look the same: such a
    callback is excused that holder's queueing too, so on a loaded machine
    it is reported only once it held the loop for the threshold beyond it.
    Beside a running holder (one not queued) nothing is excused."""
    elapsed = now[0] - base[0]
    on_cpu, queued = (max(0.0, n - b) for n, b in zip(now[1:3], base[1:3], strict=True))
    off = max(0.0, elapsed - on_cpu - queued)
    return queued + min(held, off)


class _Watched:
    """One event loop the watchdog watches: its thread and its heartbeat."""

    __slots__ = (
        "base",
        "beat",
        "clock",
        "held",
        "holder",
        "loop",
        "owner",
        "previous",
        "reported",
        "thread_id",
        "window",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        thread_id: int,
        native_id: int | None,
        owner: bool,
        holder: int | None = None,
    ) -> None:
        self.loop = weakref.ref(loop)  # a caller's loop dropped unclosed is not kept
        self.thread_id = thread_id
        self.owner = owner
        # Read by the watchdog thread only: this loop's thread's counters, and
        # those of the thread most likely to hold the GIL it waits for.
        self.clock = CpuClock(native_id)
        self.holder = CpuClock(holder)
        self.beat = self.window = time.monotonic()
        self.reported = 0.0
        # (time, on_cpu, queued, holder's queued) at the watchdog's last wake,
        # and at the last wake before the current beat was seen.
        self.base = self.previous = self.sample()
        self.held = 0.0  # the holder's run-queue wait while this beat was overdue

    def sample(self) -> tuple[float, float, float, float]:
        on_cpu, queued = self.clock.read()
        return time.monotonic(), on_cpu, queued, self.holder.read()[1]

    def close(self) -> None:
        self.clock.close()
        self.holder.close()


class Watchdog:
    """Debug mode: notices when a callback holds an event loop too long.

    It watches the owner loop, and every loop that configures a group or
    sleeps awaiting an op (:meth:`watch`): a trainer's own loop held by a
    blocking call delays every op it awaits. Each loop beats every
    ``threshold / 4``; a daemon thread checks the beats and, when one is
    older than ``threshold`` while its thread is inside a callback (not
    waiting for events), records a :class:`Stall` with that thread's stack:
    for the owner loop in ``stalls``, logged at ERROR (tests fail on any);
    for a caller's loop in ``caller_stalls``, logged at WARNING.

    Time the owner thread spent runnable but off the CPU (the kernel's run
    queue wait, from :class:`CpuClock`) is not counted: on an oversubscribed
    machine (2 cores running process worlds) that is the scheduler's delay,
    not a callback's. Nor is the time the process's main thread (the
    trainer's, which holds the GIL most) queued for a CPU while the beat was
    overdue and the owner thread off the CPU: a thread preempted
    mid-bytecode keeps the GIL. Other GIL waits are counted: from outside,
    they cannot be told apart from a callback blocked in ``time.sleep``, a
    lock or a native wait, which is what the watchdog exists to catch (and
    on a loaded machine such a callback is reported only once it held the
    loop for the threshold beyond the main thread's queueing).
    """

    def __init__(self, runtime: Runtime, threshold: float) -> None:
        self.threshold = threshold
        self.stalls: list[Stall] = []
        """The owner loop's."""
        self.caller_stalls: list[Stall] = []
        """Those of loops that await ftcomm (:meth:`watch`)."""
        self._runtime = runtime
        self._stop = threading.Event()
        self._period = threshold / 4
        self._lock = threading.Lock()
        # thread id -> its watched loop; the owner's first. Replaced whole.
        main = threading.main_thread().native_id
        owner = _Watched(
            runtime.loop,
            runtime.thread_id or -1,
            runtime.native_id,
            owner=True,
            holder=main if main != runtime.native_id else None,
        )
        self._watched: dict[int, _Watched] = {owner.thread_id: owner}
        self._thread = threading.Thread(target=self._watch, name="ftcomm-watchdog", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            owner.close()
            raise
        try:
            runtime.call_soon(self._tick, owner)
        except BaseException:  # the loop is closed: stop the thread (it closes the clock)
            self.stop()
            raise

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch ``loop``, the running loop of the calling thread, from now
        on, until it closes (a dict lookup when it is watched already)."""
        thread_id = threading.get_ident()
        watched = self._watched.get(thread_id)
        if (watched is not None and watched.loop() is loop) or self._stop.is_set():
            return  # watched already (the owner loop, too), or stopping
        # No run-queue clock (its fd would outlive the loop until the next
        # check, and leak checks count fds): a caller's stall is not excused
        # for time queued for a CPU, and is only logged.
        new = _Watched(loop, thread_id, None, owner=False)
        with self._lock:
            old = self._watched.get(thread_id)
            self._watched = {**self._watched, thread_id: new}
        if old is not None:
            old.close()  # that thread's earlier loop: not run any more
        loop.call_soon(self._tick, new)

    def _tick(self, watched: _Watched) -> None:
        watched.beat = time.monotonic()
        loop = watched.loop()
        current = self._watched.get(watched.thread_id) is watched
        if loop is not None and current and not self._stop.is_set():
            loop.call_later(self._period, self._tick, watched)

    def _watch(self) -> None:
        try:
            while not self._stop.wait(self._period):
                frames = current_frames()
                for watched in list(self._watched.values()):
                    if watched.owner:
                        self._check(watched, frames)
                        continue
                    loop = watched.loop()
                    if loop is None or loop.is_closed() or watched.thread_id not in frames:
                        self._forget(watched)  # closed, dropped, or its thread is gone
                    elif not loop.is_running():
                        watched.beat = time.monotonic()  # between runs: nothing to hold
                    else:
                        self._check(watched, frames)
                    del loop
                # Frames keep their locals alive (a caller's groups, say):
                # never past this round.
                del frames
        finally:
            for watched in self._watched.values():
                watched.close()

    def _forget(self, watched: _Watched) -> None:
        with self._lock:
            if self._watched.get(watched.thread_id) is watched:
                self._watched = {k: w for k, w in self._watched.items() if w is not watched}
        watched.close()

    def _check(self, w: _Watched, frames: dict[int, types.FrameType]) -> None:
        now = w.sample()
        beat = w.beat
        if beat != w.window:
            # The counters at the last wake before this beat was seen: a
            # period at most before the beat, so the excuse may come out a
            # little long (by what the threads queued in that period).
            w.window, w.base, w.held = beat, w.previous, 0.0
        if w.previous[0] >= beat + self._period:
            # Since the last wake the beat was overdue (its next tick was due
            # by then): the holder's queueing over it may have held the loop.
            w.held += max(0.0, now[3] - w.previous[3])
        w.previous = now
        late = now[0] - beat
        if late <= self.threshold or beat == w.reported:
            return
        thread_id = w.thread_id
        frame = frames.get(thread_id)
        if frame is None or _idle(frame):
            return  # a late beat, not a callback holding the loop
        queued = _excused(w.base, now, w.held)
        if late - queued <= self.threshold:
            return
        w.reported = beat
        stack = "".join(traceback.format_stack(frame))
        if w.owner:
            self.stalls.append(Stall(late - queued, stack, queued))
            log.error(
                "ftcomm owner loop held for %.3f s (and %.3f s the machine's) by:\n%s",
                late - queued,
                queued,
                stack,
            )
        else:
            self.caller_stalls.append(Stall(late - queued, stack, queued))
            log.warning(
                "ftcomm: an event loop awaiting ftcomm (thread %d) was held for %.3f s "
                "(and %.3f s queued for a CPU); its ops' awaits and deadlines wait for it. By:\n%s",
                thread_id,
                late - queued,
                queued,
                stack,
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


def current_frames() -> dict[int, types.FrameType]:
    """``sys._current_frames()`` with the collector paused. Before CPython
    3.12 it builds its dict holding the runtime's thread-list lock, and a
    collection that an allocation starts there runs finalizers that take
    that lock again: the whole process deadlocks (python/cpython#106883,
    not fixed in 3.11; seen here, a test suite's worker hung in a watchdog
    round). A collector the program turned off stays off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


class Runtime:
    """The process's owner loop, its worker threads and its reaper."""

    def __init__(self, kind: str | None = None) -> None:
        self.kind = kind or loop_kind()
        self.loop = new_event_loop(self.kind)
        self.thread_id: int | None = None
        self.native_id: int | None = None
        self.workers = WorkerPool("ftcomm-worker", max_workers=16)
        # Connects and group construction get their own threads: hung p2p
        # waits filling `workers` must never stop the reconfigure that
        # recovers from them.
        self.control = WorkerPool("ftcomm-control", max_workers=4)
        # Completions handed off the owner loop (c10d futures settled by a
        # deadline or an abort): never behind blocked native waits.
        self.callbacks = WorkerPool("ftcomm-callback", max_workers=4)
        # Groups' events and log lines (observe.py): one thread, in order,
        # never a native library's thread.
        self.events = EventQueue("ftcomm-events")
        self.reaper = Reaper()
        self.watchdog: Watchdog | None = None
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="ftcomm-owner", daemon=True
        )
        self._thread.start()
        started.wait()
        if os.environ.get(_DEBUG_ENV, "") not in ("", "0"):
            self.set_debug(float(os.environ.get(_STALL_ENV, "100")) / 1000)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.thread_id = threading.get_ident()
        self.native_id = threading.get_native_id()
        self.loop.call_soon(started.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    # -- reaching the loop -------------------------------------------------
    def in_loop_thread(self) -> bool:
        """Whether the calling thread is the owner loop's thread."""
        return threading.get_ident() == self.thread_id

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Schedule ``fn(*args)`` on the owner loop; never waits for it."""
        if self.in_loop_thread():
            self.loop.call_soon(fn, *args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the owner loop; its outcome lands in the future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the owner loop and block this thread for its result.

        Raises:
            RuntimeError: called on the owner loop's own thread (it would deadlock).
            TimeoutError: ``timeout`` passed first; the coroutine is cancelled.
        """
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("Runtime.call() would deadlock on the owner loop thread")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            # The same class as TimeoutError (and CommTimeout) since 3.11:
            # a coroutine that raised one has finished, so pass it on.
            if fut.done():
                raise
            fut.cancel()
            raise TimeoutError(f"owner loop call did not finish in {timeout} s") from None

    # -- blocking work -----------------------------------------------------
    def run_blocking(
        self, fn: Callable[..., T], *args: object, until: float | None = None
    ) -> concurrent.futures.Future[T]:
        """Run a call that may block on a worker thread, never on the loop.

        ``until``: the ``time.monotonic()`` by which the call ends at the latest.
        """
        return self.workers.submit(fn, *args, until=until)

    def run_control(
        self, fn: Callable[..., T], *args: object, until: float | None = None
    ) -> concurrent.futures.Future[T]:
        """Like :meth:`run_blocking`, on the threads kept for configure."""
        return self.control.submit(fn, *args, until=until)

    def run_callback(self, fn: Callable[..., object], *args: object) -> None:
        """Run a completion callback off the owner loop, on threads that never
        block in a native wait (user code chained on a future may run there)."""
        self.callbacks.submit(fn, *args)

    def dispose(self, *objs: object, until: float | None = None) -> None:
        """Hand native objects to the reaper, which drops them off the loop.

        ``until``: the deadline of the last native op they hold, if any.
        """
        self.reaper.dispose(*objs, until=until)

    # -- debug -------------------------------------------------------------
    def watch_caller(self) -> None:
        """Debug mode: have the watchdog watch the calling thread's running
        loop too (nothing otherwise, or on the owner loop)."""
        watchdog = self.watchdog
        if watchdog is not None and not self.in_loop_thread():
            watchdog.watch(asyncio.get_running_loop())

    def set_debug(self, threshold: float | None) -> None:
        """Turn the stall watchdog on (``threshold`` seconds) or off (``None``)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if threshold is not None:
            if not threshold > 0:
                raise ValueError(f"threshold must be > 0 seconds, got {threshold}")
            self.watchdog = Watchdog(self, threshold)

    def close(self, timeout: float = 2.0, exit_grace: float | None = None) -> None:
        """Stop the loop and the idle threads (at interpreter exit).

        First waits up to ``exit_grace`` seconds (``FTCOMM_EXIT_GRACE``, default
        5) for blocking calls and drops that end within that time: a native
        call returning into Python while the interpreter finalizes aborts the
        process. Calls that end later are abandoned with the process.
        """
        if exit_grace is None:
            exit_grace = float(os.environ.get("FTCOMM_EXIT_GRACE", "5"))
        end = time.monotonic() + exit_grace
        for pending in (self.control, self.workers, self.callbacks, self.reaper):
            pending.wait_short(max(0.0, end - time.monotonic()))
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        self.workers.close(timeout / 4)
        self.control.close(timeout / 4)
        self.callbacks.close(timeout / 4)
        self.events.close(min(1.0, exit_grace))
        self.reaper.close(0.1)


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> Runtime:
    """The process's :class:`Runtime`, started on first use."""
    global _runtime
    rt = _runtime
    if rt is not None:
        return rt
    with _runtime_lock:
        if _runtime is None:
            _runtime = Runtime()
            atexit.register(_runtime.close)
        return _runtime


def _forget_after_fork() -> None:
    # The owner thread does not exist in a forked child: start afresh there.
    global _runtime, _runtime_lock
    _runtime = None
    _runtime_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
