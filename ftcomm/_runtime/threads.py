"""Worker threads: where everything that may block runs, off the owner loop.

Owns, all daemon threads so a blocked native call never holds up exit:
:class:`WorkerPool` (blocking calls: ``submit`` bounded, ``spawn`` never
queued, for native waits bounded by a deadline), :class:`Reaper` (drops
native objects, a :class:`Handoff`'s once its reference is the last) and
:class:`EventQueue` (events and log lines, in order). Each blocking item says
by when it ends at the latest, so that interpreter exit waits only for those
that end soon (``Runtime.close``). See docs/ops.md ("Teardown").
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = object()

_Item = tuple[int, Future[Any], Callable[..., Any], tuple[object, ...], bool]
"""A call: (pending token, its future, fn, args, counted against max_workers)."""
_Inbox = queue.SimpleQueue["_Item | None"]
"""Where a worker thread gets its next call; ``None`` tells it to end."""


class _Pending:
    """Items in progress, each with the time by which it ends (None: soon).

    ``in_order``: one thread runs the items in the order they came (the
    reaper's), so an item ends no sooner than the items still ahead of it;
    its end is worked out when waited for, from what is still pending (an
    item that has ended holds up nothing). A parked item (:meth:`park`) is
    not waited for, and holds up no later one: it waits for its holder to
    let go, beside the queue, not in it.
    """

    def __init__(self, *, in_order: bool = False) -> None:
        self.cond = threading.Condition()
        self._items: dict[int, float | None] = {}  # in the order added
        self._parked: set[int] = set()
        self._ids = itertools.count()
        self._in_order = in_order

    def add(self, until: float | None) -> int:
        with self.cond:
            token = next(self._ids)
            self._items[token] = until
            return token

    def remove(self, token: int) -> None:
        with self.cond:
            del self._items[token]
            self._parked.discard(token)
            self.cond.notify_all()

    def park(self, token: int) -> None:
        """Item ``token`` ends at no time anyone can wait for."""
        with self.cond:
            self._parked.add(token)
            self.cond.notify_all()

    def wait_unparked(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until no item is parked."""
        with self.cond:
            return self.cond.wait_for(lambda: not self._parked, timeout)

    def __len__(self) -> int:
        return len(self._items)

    def wait_idle(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: not self._items, timeout)

    def wait_short(self, cap: float) -> bool:
        """Wait (at most ``cap`` s) for the items that end within ``cap`` s."""
        limit = time.monotonic() + cap
        with self.cond:
            return self.cond.wait_for(lambda: self._all_end_after(limit), cap)

    def _all_end_after(self, limit: float) -> bool:
        """Whether no item still pending ends by ``limit`` (under ``cond``)."""
        ahead: float | None = None  # the latest end of the items before, in order
        for token, until in self._items.items():
            if token in self._parked:
                continue
            if self._in_order and ahead is not None:
                until = ahead if until is None else max(until, ahead)
            if until is None or until <= limit:
                return False
            ahead = until
        return True


class WorkerPool:
    """Daemon threads, started on demand, that run blocking calls.

    Two ways in:

    * :meth:`submit`: at most ``max_workers`` of these calls run at once; the
      others wait their turn, first in first out.
    * :meth:`spawn`: the call starts at once, on an idle thread or a new one,
      however many calls are running. For calls that only block in a native
      wait (GIL released) that ends by ``until`` at the latest, such as a Gloo
      send or recv waited on for its completion: bounding them would let
      waits for ops that complete late hold every thread that the waits of
      ops completing sooner need, and stall a pipeline with many ops in flight.

    Idle threads beyond ``max_workers`` end after ``linger`` seconds, so a
    burst of spawned calls does not leave its threads behind.
    """

    def __init__(self, name: str, max_workers: int, *, linger: float = 5.0) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if not linger > 0:
            raise ValueError(f"linger must be > 0 seconds, got {linger}")
        self._name = name
        self._max = max_workers
        self._linger = linger
        self._lock = threading.Condition(threading.Lock())  # notified when a thread ends
        self._threads: list[threading.Thread] = []
        self._idle: list[_Inbox] = []  # last in, first out: the warmest thread first
        self._queue: collections.deque[_Item] = collections.deque()  # submit()s waiting
        self._bounded = 0  # submit() calls running (or handed to a thread)
        self._serial = itertools.count()
        self._pending = _Pending()
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: object, until: float | None = None) -> Future[T]:
        """Run ``fn(*args)`` on a worker thread; its outcome lands in the future.

        At most ``max_workers`` submitted calls run at once; later ones queue.
        ``until``: the ``time.monotonic()`` by which the call ends at the latest.
        """
        fut: Future[T] = Future()
        with self._lock:
            item = self._item(fut, fn, args, until, bounded=True)
            if self._bounded < self._max:
                self._bounded += 1
                self._hand_over(item)
            else:  # every slot is taken: the first to finish takes this call
                self._queue.append(item)
        return fut

    def spawn(self, fn: Callable[..., T], *args: object, until: float | None) -> Future[T]:
        """Run ``fn(*args)`` on a thread now: an idle one, else a new one.

        Never queued, not counted against ``max_workers``: only for calls that
        block in a native wait (GIL released) ending by ``until`` (a
        ``time.monotonic()`` value; ``None``: they end soon by themselves).
        """
        fut: Future[T] = Future()
        with self._lock:
            self._hand_over(self._item(fut, fn, args, until, bounded=False))
        return fut

    def _item(
        self,
        fut: Future[Any],
        fn: Callable[..., Any],
        args: tuple[object, ...],
        until: float | None,
        *,
        bounded: bool,
    ) -> _Item:
        if self._closed:
            raise RuntimeError(f"{self._name} is closed")
        return (self._pending.add(until), fut, fn, args, bounded)

    def _hand_over(self, item: _Item) -> None:
        """Give ``item`` to an idle thread, or start one for it (lock held)."""
        if self._idle:
            self._idle.pop().put(item)
            return
        # The call goes through the inbox, not the thread's arguments: a
        # Thread keeps those until it ends, and with them the call's native
        # objects (a Gloo group's sockets).
        inbox: _Inbox = queue.SimpleQueue()
        thread = threading.Thread(
            target=self._run, args=(inbox,), name=f"{self._name}-{next(self._serial)}", daemon=True
        )
        self._threads.append(thread)
        try:
            thread.start()
        except BaseException:
            self._threads.remove(thread)
            self._pending.remove(item[0])
            if item[4]:
                self._bounded -= 1
            raise
        inbox.put(item)

    @property
    def busy(self) -> int:
        """How many calls (submitted or spawned) have not finished yet."""
        return len(self._pending)

    @property
    def thread_count(self) -> int:
        """Threads started and not ended (idle ones included)."""
        return len(self._threads)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no call is running or queued; False on timeout."""
        return self._pending.wait_idle(timeout)

    def wait_short(self, cap: float) -> bool:
        """Block (at most ``cap`` s) until the calls that end within ``cap`` s have."""
        return self._pending.wait_short(cap)

    def wait_threads(self, count: int, timeout: float) -> bool:
        """Block until at most ``count`` threads are left; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self._threads) <= count, timeout)

    def _run(self, inbox: _Inbox) -> None:
        item = inbox.get()
        try:
            while item is not None:
                token, bounded = item[0], item[4]
                try:
                    _run_one(item[1], item[2], item[3])
                finally:
                    # Drop the call's references before waiting again.
                    item = None
                    item = self._next(bounded)
                    self._pending.remove(token)
                if item is None:
                    item = self._wait_for_work(inbox)
        finally:
            with self._lock:
                with contextlib.suppress(ValueError):
                    self._threads.remove(threading.current_thread())
                self._lock.notify_all()

    def _next(self, bounded: bool) -> _Item | None:
        """After a call: the next queued call this thread may run, if any."""
        with self._lock:
            if bounded:
                self._bounded -= 1
            if self._queue and self._bounded < self._max:
                self._bounded += 1
                return self._queue.popleft()
            return None

    def _wait_for_work(self, inbox: _Inbox) -> _Item | None:
        """Wait idle for a call; None: the thread ends (a surplus thread that
        lingered long enough, or the pool closed).

        The thread lists itself idle only here, once its last call's
        bookkeeping is done: a call handed to a thread still finishing the one
        before waits for that thread to win the GIL back from the caller's
        polling loop. Measured on 2 cores, 2 ranks, rounds of 300 awaited
        send/recv pairs: listed idle before its bookkeeping, 8 rounds in ~100
        took ~3.5 ms per pair instead of ~0.4 ms; listed here, 1 in 180 (as
        the 16-thread queue before it: 1 in 150).
        """
        with self._lock:
            if self._closed:
                return None
            self._idle.append(inbox)
        while True:
            try:
                return inbox.get(timeout=self._linger)
            except queue.Empty:
                pass
            with self._lock:
                if inbox not in self._idle:
                    # Handed a call (or None) as we timed out: put under the lock.
                    return inbox.get()
                if len(self._threads) > self._max:
                    self._idle.remove(inbox)
                    return None

    def close(self, timeout: float = 1.0) -> None:
        """Stop idle workers; workers blocked in a native call are left to finish."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
            for inbox in self._idle:
                inbox.put(None)
            self._idle.clear()
        for thread in threads:
            thread.join(timeout / max(1, len(threads)))


def _run_one(fut: Future[Any], fn: Callable[..., Any], args: tuple[object, ...]) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as exc:  # handed to whoever holds the future
        # Without its traceback: the frames hold the call's arguments (native
        # works, and through them a Gloo group's sockets) in a cycle with the
        # future that only the garbage collector would break.
        fut.set_exception(exc.with_traceback(None))
    else:
        fut.set_result(result)


SOLE_WAIT = 0.2
"""How long the reaper waits for other holders of a :class:`Handoff`'s
objects to let go (a thread in the middle of a call on the group: a moment)
before it parks them and goes on with the next batch."""

_COLLECT_AFTER = 0.05
"""Still held after this long: a garbage cycle may hold them, and is
collected on the reaper (not on whatever thread, a Gloo one included,
collects next)."""

_RECHECK = 0.05
"""While objects are parked, how often the reaper looks at them again."""

_WARN_AFTER = 5.0
"""Parked this long: a warning (something keeps a native group alive)."""

_COLLECT_AT = (1.0, 5.0)
"""Seconds after parking at which the reaper collects garbage again."""


class Handoff:
    """Native objects handed to the reaper in a cell: ``dispose(Handoff(pg,
    store))``, for objects whose last reference must be dropped on the
    reaper and nowhere else (a Gloo group: its destructor joins its worker
    threads, and on one of them, where its ops' completion callbacks run,
    aborts the process with "Resource deadlock avoided").

    A hand-over leaves references on the handing thread for a moment: its
    arguments, ``dispose(*objs)``'s tuples, until those frames return; the
    reaper may drop its own before that, and the handing thread's would be
    the last. Through a cell they are references to the cell, never to the
    objects: the reaper takes the objects out of it (:meth:`take`). And it
    drops them only once its references are the only ones (a thread in the
    middle of an issue on the group holds it too): it waits a moment
    (:data:`SOLE_WAIT`), then parks them and looks again every
    :data:`_RECHECK` seconds, never letting go elsewhere.
    """

    __slots__ = ("_objs",)

    def __init__(self, *objs: object) -> None:
        self._objs: list[object] = list(objs)

    def take(self) -> list[object]:
        """The objects, now the caller's alone (the cell is left empty)."""
        objs, self._objs = self._objs, []
        return objs


def _refs(objs: list[object], i: int) -> int:
    return sys.getrefcount(objs[i])


_ONLY_HERE = _refs([object()], 0)
"""What :func:`_refs` reads of an object that only the list holds."""


def _held_elsewhere(objs: list[object]) -> bool:
    return any(_refs(objs, i) > _ONLY_HERE for i in range(len(objs)))


def _until_only_here(objs: list[object], limit: float) -> bool:
    """Wait (at most ``limit`` s) until ``objs`` holds the only reference to
    each of its objects; whether it does. Nothing new can take one: the
    objects were taken from the only place that handed them out (a closed
    backend), so once the count is down to ``objs`` it stays there."""
    started = time.monotonic()
    collected = False
    pause = 0.0002
    while _held_elsewhere(objs):
        waited = time.monotonic() - started
        if waited >= limit:
            return False
        if not collected and waited >= _COLLECT_AFTER:
            collected = True
            gc.collect()
            continue
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    return True


class Reaper:
    """One daemon thread that drops references handed to it, in order; a
    :class:`Handoff`'s objects once nothing else holds them."""

    def __init__(self, name: str = "ftcomm-reaper") -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = _Pending(in_order=True)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def dispose(self, *objs: object, until: float | None = None) -> None:
        """Take ownership of ``objs`` and drop them on the reaper thread.

        ``until``: by when dropping them ends at the latest (the deadline of the
        last native op they hold); ``None`` when nothing is in flight.
        """
        if not objs:
            return
        with self._lock:  # counted in the order it is queued in
            self._queue.put((self._pending.add(until), list(objs)))

    @property
    def pending(self) -> int:
        """Batches handed over and not yet dropped."""
        return len(self._pending)

    def wait_idle(self, timeout: float) -> bool:
        """Block until every handed-over batch is dropped; False on timeout."""
        return self._pending.wait_idle(timeout)

    def wait_short(self, cap: float) -> bool:
        """Block (at most ``cap`` s) until the batches that drop within ``cap`` s have."""
        return self._pending.wait_short(cap)

    def wait_unparked(self, timeout: float) -> bool:
        """Block (at most ``timeout`` s) until nothing is parked (held
        elsewhere when handed over); False if something still is."""
        return self._pending.wait_unparked(timeout)

    def _run(self) -> None:
        parked: list[_Parked] = []  # Handoffs whose objects others still held
        stopping = False
        while True:
            try:
                item = self._queue.get(timeout=_RECHECK if parked or stopping else None)
            except queue.Empty:
                item = None
            if item is _STOP:
                # It ends once nothing is parked or queued: with objects parked,
                # going on is the only safe way out (this thread's references
                # gone, the last would be someone else's). A daemon, it does
                # not hold up the interpreter's exit.
                stopping, item = True, None
            if item is not None:
                token, batch = item
                del item
                held = _drop(batch)  # may block until a native op's own timeout
                del batch
                if held:
                    parked.append(_Parked(token, held, time.monotonic()))
                    self._pending.park(token)  # no exit waits for it
                else:
                    self._pending.remove(token)
            for p in [p for p in parked if p.settle()]:
                parked.remove(p)
                self._pending.remove(p.token)
            if stopping and not parked and self._queue.empty():
                return

    def close(self, timeout: float = 1.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)


def _drop(batch: list[Any]) -> list[list[object]]:
    """Drop ``batch``'s references in order (the reaper's own: the list is
    its); a :class:`Handoff`'s objects once they are held nowhere else.
    Those still held elsewhere after a moment (:data:`SOLE_WAIT`, a garbage
    collection) are returned, to be parked: kept until they are."""
    held: list[list[object]] = []
    batch.reverse()
    while batch:
        obj = batch.pop()
        if type(obj) is not Handoff:
            del obj
            continue
        owned = obj.take()
        del obj
        if _until_only_here(owned, SOLE_WAIT):
            owned.clear()
        else:
            held.append(owned)
    return held


class _Parked:
    """A batch's Handoff objects that others still held when it was dropped."""

    __slots__ = ("collections", "held", "since", "token", "warned")

    def __init__(self, token: int, held: list[list[object]], since: float) -> None:
        self.token, self.held, self.since, self.warned = token, held, since, False
        self.collections = 0

    def settle(self) -> bool:
        """Drop what only the reaper holds now; True once nothing is left."""
        parked_for = time.monotonic() - self.since
        due = sum(1 for at in _COLLECT_AT if parked_for >= at)
        if due > self.collections:
            self.collections = due  # once, however many were due
            gc.collect()  # a cycle formed since may hold it: collected here, not elsewhere
        for owned in [o for o in self.held if not _held_elsewhere(o)]:
            self.held.remove(owned)
            owned.clear()
        if self.held and not self.warned and time.monotonic() - self.since >= _WARN_AFTER:
            self.warned = True
            logging.getLogger("ftcomm").warning(
                "ftcomm: native objects handed to the reaper are still referenced elsewhere "
                "after %g s (%s); the reaper keeps them until it holds the last reference",
                _WARN_AFTER,
                ", ".join(type(o).__name__ for owned in self.held for o in owned),
            )
        return not self.held


class EventQueue:
    """One daemon thread that runs posted calls one at a time, in order.

    For groups' events and log lines (``observe.py``): :meth:`post` takes a
    short lock of its own, then ``SimpleQueue.put`` (safe under any lock of
    ftcomm, from any thread, native ones included) and never raises. The
    thread starts on the first post; if it cannot (at interpreter exit, at
    the thread limit), posts are dropped. At most ``bound`` calls wait;
    past that, posts are dropped and counted (a subscriber that never
    returns must not grow memory without end), and the drop is logged once
    the queue has room again.
    """

    def __init__(self, name: str, bound: int = 100_000) -> None:
        self._name = name
        self._bound = bound
        self._queue: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._cond = threading.Condition(threading.Lock())  # guards the counts below
        self._posted = 0
        self._done = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped = 0
        """Calls dropped because ``bound`` were waiting."""

    def post(self, call: Callable[[], object]) -> None:
        """Run ``call()`` on the thread, after every call posted before it."""
        with self._cond:
            if self._closed or self._posted - self._done >= self._bound:
                self.dropped += not self._closed
                return
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # interpreter exit, the thread limit: nobody runs it
                    self.dropped += 1
                    return
                self._thread = thread
            self._posted += 1
        self._queue.put(call)

    def _run(self) -> None:
        reported = 0
        while True:
            call = self._queue.get()
            if call is None:
                return
            try:
                call()
            except BaseException:  # a call's own error (a log filter's): the next still runs
                with contextlib.suppress(BaseException):
                    logging.getLogger("ftcomm").exception(
                        "ftcomm: %s: a posted call raised", self._name
                    )
            # Not kept while waiting for the next: it may hold an error whose
            # traceback holds a native group that must go now.
            del call
            with self._cond:
                self._done += 1
                self._cond.notify_all()
                dropped = self.dropped
            if dropped != reported and self._posted - self._done < self._bound // 2:
                reported = dropped
                with contextlib.suppress(BaseException):  # this thread must live on
                    logging.getLogger("ftcomm").warning(
                        "ftcomm: %d events and log lines dropped: %d were waiting",
                        dropped,
                        self._bound,
                    )

    def wait_idle(self, timeout: float) -> bool:
        """Block until every call posted so far has run; False on timeout."""
        with self._cond:
            target = self._posted
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Run what is queued (at most ``timeout`` s), then stop; later posts are dropped."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)
