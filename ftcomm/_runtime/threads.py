"""Worker threads: where everything that may block runs, off the owner loop.

Two kinds, both daemon threads so a blocked native call never holds up
interpreter exit:

* :class:`WorkerPool` runs blocking calls (store connects, group construction,
  Gloo point-to-point waits) and hands results back as
  ``concurrent.futures.Future`` objects.
* :class:`Reaper` drops references to native objects. Dropping the last
  reference to a Gloo group with an op in flight blocks the dropping thread
  until that op's own timeout; the reaper is that thread.

Each blocking item may say by when (``time.monotonic()``) it will end, at the
latest. At interpreter exit the runtime waits a few seconds for the items that
end soon (a native call that returns into Python *during* finalization aborts
the process: "terminate called without an active exception"), and abandons the
ones that end long after the process is gone.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = object()


class _Pending:
    """Items in progress, each with the time by which it ends (None: soon)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._items: dict[int, float | None] = {}
        self._ids = itertools.count()

    def add(self, until: float | None) -> int:
        with self.cond:
            token = next(self._ids)
            self._items[token] = until
            return token

    def remove(self, token: int) -> None:
        with self.cond:
            del self._items[token]
            self.cond.notify_all()

    def __len__(self) -> int:
        return len(self._items)

    def wait_idle(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: not self._items, timeout)

    def wait_short(self, cap: float) -> bool:
        """Wait (at most ``cap`` s) for the items that end within ``cap`` s."""
        limit = time.monotonic() + cap
        with self.cond:
            return self.cond.wait_for(
                lambda: all(u is not None and u > limit for u in self._items.values()), cap
            )


class WorkerPool:
    """A small pool of daemon threads, started on demand, bounded in number."""

    def __init__(self, name: str, max_workers: int) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._name = name
        self._max = max_workers
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # started workers that are free and not reserved
        self._waiting = 0  # queued calls that no worker was reserved for
        self._pending = _Pending()
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: object, until: float | None = None) -> Future[T]:
        """Run ``fn(*args)`` on a worker thread; its outcome lands in the future.

        ``until``: the ``time.monotonic()`` by which the call ends at the latest.
        """
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            token = self._pending.add(until)
            if self._idle > 0:
                self._idle -= 1  # reserve a free worker for this call
            elif len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            else:  # every worker is busy: the first to finish takes this call
                self._waiting += 1
            self._queue.put((token, fut, fn, args))
        return fut

    @property
    def busy(self) -> int:
        """How many submitted calls have not finished yet."""
        return len(self._pending)

    @property
    def thread_count(self) -> int:
        return len(self._threads)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no submitted call is running or queued; False on timeout."""
        return self._pending.wait_idle(timeout)

    def wait_short(self, cap: float) -> bool:
        """Block (at most ``cap`` s) until the calls that end within ``cap`` s have."""
        return self._pending.wait_short(cap)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            token = item[0]
            try:
                _run_one(*item[1:])
            finally:
                del item  # drop the call's references before waiting again
                with self._lock:
                    if self._waiting:
                        self._waiting -= 1
                    else:
                        self._idle += 1
                self._pending.remove(token)

    def close(self, timeout: float = 1.0) -> None:
        """Stop idle workers; workers blocked in a native call are left to finish."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(_STOP)
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


class Reaper:
    """One daemon thread that drops references handed to it, in order."""

    def __init__(self, name: str = "ftcomm-reaper") -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = _Pending()
        self._lock = threading.Lock()
        self._last_until: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def dispose(self, *objs: object, until: float | None = None) -> None:
        """Take ownership of ``objs`` and drop them on the reaper thread.

        ``until``: by when dropping them ends at the latest (the deadline of the
        last native op they hold); ``None`` when nothing is in flight.
        """
        if not objs:
            return
        with self._lock:
            # One thread, in order: a batch ends no sooner than the one before it.
            if until is not None and self._last_until is not None:
                until = max(until, self._last_until)
            elif until is None:
                until = self._last_until
            self._last_until = until
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

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            token, batch = item
            del item
            batch.clear()  # may block until a native op's own timeout
            del batch
            self._pending.remove(token)

    def close(self, timeout: float = 1.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)
