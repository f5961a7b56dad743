"""``torch.distributed.Work`` objects for the c10d facade.

Three shapes, all real ``dist.Work`` subclasses (torch's C++ callers, DDP's
reducer among them, reach them through its trampoline): :class:`OpWork` (one
ftcomm op), :class:`ChainedWork` (a work whose outcome a wrapper rewrites,
once) and :class:`DoneWork` (an op that ended when it was issued: skipped,
dummy). ``wait()`` and ``get_future()`` always agree on the outcome, and the
future is never completed on the owner loop's thread (docs/facade.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .._runtime.deadline import to_seconds
from .._runtime.loop import get_runtime
from .._runtime.work import Work as FtWork
from .._runtime.work import order_stream, wait_blocking, when_done
from .._runtime.work import outcome as outcome_of

Outcome = Callable[[BaseException | None], BaseException | None]
"""Maps an op's error (or ``None``) to the error its work reports (or ``None``)."""

_future_lock = threading.Lock()


def wait_seconds(timeout: object) -> float | None:
    """A c10d ``wait`` timeout in seconds, or ``None`` for "the op's own deadline".

    ``timedelta(0)`` is c10d's "no timeout" (what torch passes by default), so
    it means no extra deadline, as it does for every c10d work.
    """
    if timeout is None:
        return None
    if isinstance(timeout, timedelta) and timeout == timedelta(0):
        return None
    return to_seconds(timeout, "timeout")


class _Failed:
    """An op's error travelling through a source future (see :func:`new_future`)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(source: torch.futures.Future[Any]) -> Any:
    value = source.value()
    if type(value) is _Failed:
        raise value.error
    return value


def new_future() -> tuple[torch.futures.Future[Any], torch.futures.Future[Any]]:
    """``(source, future)``: settle ``source`` with :func:`_settle_future`; hand out ``future``.

    torch's ``Future.set_exception`` stores the exception as a *successful*
    Python value: C++ consumers (DDP's reducer) then read it as their result
    and crash. A callback that raises is the one way Python can put a real
    (C++) error on a torch future, so ``future`` is ``source.then(...)``,
    which raises the op's error. Python callers see a ``RuntimeError`` that
    carries the ftcomm error's type name and message.
    """
    source: torch.futures.Future[Any] = torch.futures.Future()
    return source, source.then(_unwrap)


def _settle_future(
    source: torch.futures.Future[Any], error: BaseException | None, value: Any
) -> None:
    source.set_result(value if error is None else _Failed(error))


class OpWork(dist.Work):
    """The c10d work of one ftcomm op.

    ``wait(timeout=None)`` blocks the calling thread (never the owner loop)
    until the op ends and returns True, or raises the op's ftcomm error; for
    an NCCL/XCCL op still running (but a barrier), it makes the calling
    thread's current stream wait for the op instead, and returns True at
    once (c10d's meaning; the op's deadline still aborts it, and
    ``errored()`` says so).
    ``timeout`` (a timedelta or seconds) is a deadline: if the op has not
    ended by then it ends with ``CommTimeout`` and its group is aborted.
    ``get_future()`` gives a ``torch.futures.Future`` with the op's output
    tensors (or its error).
    """

    def __init__(self, op: FtWork[Any], value: Any, finish: Finish | None = None) -> None:
        super().__init__()
        self._op = op
        self._value = value
        self._future: torch.futures.Future[Any] | None = None
        self._finish = finish

    def _finished(self, blocking: bool = True) -> None:
        """The op succeeded: its outputs made (see :class:`Finish`)."""
        if self._finish is not None:
            self._finish.run(blocking)

    def __repr__(self) -> str:
        return f"<ftcomm.c10d work of {self._op!r}>"

    def wait(self, timeout: object = None) -> bool:
        op = self._op
        seconds = None if timeout is None else wait_seconds(timeout)
        # NCCL/XCCL: the caller's stream waits, the CPU does not -- except for
        # a barrier, whose wait() blocks the CPU in c10d too.
        if seconds is None and op.op != "barrier" and order_stream(op):
            self._finished(blocking=False)  # on the caller's stream, after the op
            return True
        if not op.done() and get_runtime().in_loop_thread():
            raise RuntimeError(
                "wait() would block ftcomm's owner loop: call it from another thread"
            )
        wait_blocking(op, seconds, abort_on_timeout=True)  # raises the op's ftcomm error
        self._finished()
        return True

    def is_completed(self) -> bool:
        if not self._op.done():
            return False
        if self._finish is not None and outcome_of(self._op).error is None:
            try:
                return self._finish.done()
            except Exception:  # wait() and is_success() say it
                return True
        return True

    def is_success(self) -> bool:
        if not self.is_completed() or outcome_of(self._op).error is not None:
            return False
        return self._finish is None or self._finish.error is None

    def result(self) -> Any:
        return self._value

    def synchronize(self) -> None:
        """NCCL/XCCL: the calling thread's current stream waits for the op
        (c10d's meaning); nothing to do for an op on CPU tensors or one that
        has ended."""
        order_stream(self._op)

    def get_future(self) -> torch.futures.Future[Any]:
        source, fut = _claim_future(self)
        if source is not None:
            value = self._value
            op = self._op  # on the thread that ends it, whatever loop runs here
            finish = self._finished if self._finish is not None else None
            when_done(op, lambda: _complete_off_loop(source, outcome_of(op).error, value, finish))
        return fut


class Finish:
    """What makes an op's outputs once it succeeded (a copy out of the op's
    own buffer): ``step()`` runs once, by whichever caller comes first
    (``wait()``, the future, ``is_completed()``); the others wait for that
    run, and each of them gets its error. ``step`` returns ``None`` (done:
    host tensors), or the event recorded after copies it queued on a device
    stream, which each caller then waits for its own way (:meth:`run`,
    :meth:`done`), outside the lock."""

    def __init__(self, step: Callable[[], Any]) -> None:
        self._step: Callable[[], Any] | None = step
        self._lock = threading.Lock()
        self._event: Any = None
        self.error: Exception | None = None

    def _once(self) -> Any:
        """The copies' event (``None``: done).

        Raises: the step's error (the same one for every caller)."""
        with self._lock:
            step, self._step = self._step, None  # the step (its buffers) goes once run
            if step is not None:
                try:
                    self._event = step()
                except Exception as exc:
                    self.error = exc.with_traceback(None)  # its frames hold the buffers
            if self.error is not None:
                raise self.error
            return self._event

    def run(self, blocking: bool) -> None:
        """Make the outputs; then, for copies on a device, ``blocking``: wait
        for them here; else the calling thread's current stream waits for
        them (c10d's ``wait()``: the CPU does not).

        Raises: the step's error."""
        event = self._once()
        if event is None:
            return
        if blocking:
            event.synchronize()
        else:
            torch.accelerator.current_stream(event.device).wait_event(event)

    def done(self) -> bool:
        """Whether the outputs are made (a poll: it never waits for a device).

        Raises: the step's error."""
        event = self._once()
        return event is None or bool(event.query())


class _HasFuture(Protocol):
    _future: torch.futures.Future[Any] | None


def _claim_future(
    work: _HasFuture,
) -> tuple[torch.futures.Future[Any] | None, torch.futures.Future[Any]]:
    """``(source, future)`` for the first caller, ``(None, future)`` for later ones:
    a work has one future, completed once."""
    with _future_lock:
        if work._future is not None:
            return None, work._future
        source, work._future = new_future()
        return source, work._future


def _complete_off_loop(
    fut: torch.futures.Future[Any],
    error: BaseException | None,
    value: Any,
    finish: Callable[[], None] | None = None,
) -> None:
    """Settle ``fut`` off the owner loop, ``finish()`` first where the op succeeded."""

    def settle() -> None:
        failure = error
        if failure is None and finish is not None:
            try:
                finish()
            except Exception as exc:
                failure = exc
        _settle_future(fut, failure, value)

    runtime = get_runtime()
    if runtime.in_loop_thread() or finish is not None:
        # a finish step may wait for copies on a device: never on the thread
        # that publishes the group's op ends (an accelerator group's watcher)
        runtime.run_callback(settle)
    else:
        settle()


class ChainedWork(dist.Work):
    """Another c10d work whose outcome ``outcome`` rewrites, once.

    ``value`` is what the future holds when the rewritten outcome is a
    success that the inner work did not have (a swallowed error).
    ``wait_raises=False``: a failed outcome fails the future only, and
    ``wait()`` returns ``True`` once the inner work ended.
    """

    def __init__(
        self, inner: dist.Work, value: Any, outcome: Outcome, *, wait_raises: bool = True
    ) -> None:
        super().__init__()
        self._inner = inner
        self._wait_raises = wait_raises
        self._value = value
        self._outcome_fn: Outcome | None = outcome
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._future: torch.futures.Future[Any] | None = None

    def __repr__(self) -> str:
        return f"<ftcomm.c10d work over {self._inner!r}>"

    def _outcome(self, error: BaseException | None) -> BaseException | None:
        with self._lock:
            fn, self._outcome_fn = self._outcome_fn, None
            if fn is not None:
                self._error = fn(error)
            return self._error

    def _finish(self, timeout: object = None) -> BaseException | None:
        """Wait for the inner work; the rewritten outcome. Returns at once once it ended."""
        try:
            self._inner.wait() if timeout is None else self._inner.wait(timeout)  # type: ignore[arg-type]
        except Exception as exc:  # the inner work's own error, typed
            # Kept (and maybe stored by a wrapper): without its traceback,
            # whose frames reach back into the thread that settled the op and
            # would hold its native work (and the group's sockets) alive.
            return self._outcome(exc.with_traceback(None))
        return self._outcome(None)

    def wait(self, timeout: object = None) -> bool:
        error = self._finish(timeout)
        if error is not None and self._wait_raises:
            raise error.with_traceback(None)  # kept: each raise starts afresh
        return True

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return self.is_completed() and self._finish() is None

    def result(self) -> Any:
        return self._value

    def synchronize(self) -> None:
        self._inner.synchronize()

    def get_future(self) -> torch.futures.Future[Any]:
        source, fut = _claim_future(self)
        if source is None:
            return fut

        def done(inner: torch.futures.Future[Any]) -> None:
            # The inner future's error is torch's RuntimeError around the op's
            # own; the ended inner work raises the op's own error at once.
            error = self._finish()
            value = self._value
            if error is None:
                try:
                    value = inner.value()
                except Exception:  # the op failed and the outcome swallowed it
                    value = self._value
            _settle_future(source, error, value)

        self._inner.get_future().add_done_callback(done)
        return fut


class DoneWork(dist.Work):
    """A work that ended when it was issued, with ``value`` or ``error``."""

    def __init__(self, value: Any, error: BaseException | None = None) -> None:
        super().__init__()
        self._value = value
        self._error = error
        self._future: torch.futures.Future[Any] | None = None

    def __repr__(self) -> str:
        state = "ok" if self._error is None else f"failed: {self._error!r}"
        return f"<ftcomm.c10d done work {state}>"

    def wait(self, timeout: object = None) -> bool:
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._error is None

    def result(self) -> Any:
        return self._value

    def synchronize(self) -> None:
        """Nothing to do: the op ended when it was issued."""

    def get_future(self) -> torch.futures.Future[Any]:
        source, fut = _claim_future(self)
        if source is not None:
            _settle_future(source, self._error, self._value)
        return fut
