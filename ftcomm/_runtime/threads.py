"""Worker threads: where everything that may block runs, off the owner loop.

Two kinds, both daemon threads so a blocked native call never holds up
interpreter exit:

* :class:`WorkerPool` runs blocking calls (store connects, group construction,
  Gloo point-to-point waits) and hands results back as
  ``concurrent.futures.Future`` objects.
* :class:`Reaper` drops references to native objects. Dropping the last
  reference to a Gloo group with an op in flight blocks the dropping thread
  until that op's own timeout; the reaper is that thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = object()


class WorkerPool:
    """A small pool of daemon threads, started on demand, bounded in number."""

    def __init__(self, name: str, max_workers: int) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._name = name
        self._max = max_workers
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._idle = 0  # started workers that are free and not reserved
        self._waiting = 0  # queued calls that no worker was reserved for
        self._busy = 0
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn(*args)`` on a worker thread; its outcome lands in the future."""
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            self._busy += 1
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
            self._queue.put((fut, fn, args))
        return fut

    @property
    def busy(self) -> int:
        """How many submitted calls have not finished yet."""
        return self._busy

    @property
    def thread_count(self) -> int:
        return len(self._threads)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no submitted call is running or queued; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self._busy == 0, timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                _run_one(*item)
            finally:
                del item  # drop the call's references before waiting again
                with self._done:
                    self._busy -= 1
                    if self._waiting:
                        self._waiting -= 1
                    else:
                        self._idle += 1
                    self._done.notify_all()

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
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class Reaper:
    """One daemon thread that drops references handed to it, in order."""

    def __init__(self, name: str = "ftcomm-reaper") -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def dispose(self, *objs: object) -> None:
        """Take ownership of ``objs`` and drop them on the reaper thread."""
        if not objs:
            return
        with self._lock:
            self._pending += 1
        self._queue.put(list(objs))

    @property
    def pending(self) -> int:
        """Batches handed over and not yet dropped."""
        return self._pending

    def wait_idle(self, timeout: float) -> bool:
        """Block until every handed-over batch is dropped; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is _STOP:
                return
            batch.clear()  # may block until a native op's own timeout
            del batch
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def close(self, timeout: float = 1.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)
