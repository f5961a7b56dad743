"""Wrappers that change what ops report: error swallowing, error injection, managed.

Each overrides the one hook every op passes through (``_run``), so each
covers every collective, not just allreduce as torchft's did
(docs/migrating.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .._runtime.loop import get_runtime
from ..errors import CommError
from ._base import ProcessGroup, logger
from ._groups import Issue, ProcessGroupWrapper
from ._ops import one, reduce_args
from ._work import ChainedWork, DoneWork


def _swallowing(
    target: Callable[[], object],
    issue: Issue,
    default: object,
    report: Callable[[Exception], None],
) -> dist.Work:
    """Issue an op whose errors go to ``report`` and end as successes with ``default``."""

    def outcome(error: BaseException | None) -> BaseException | None:
        if isinstance(error, Exception):
            # Logged from the owner loop: this may run on one of Gloo's native
            # threads, where logging would leave a threading._DummyThread behind.
            get_runtime().call_soon(logger.warning, "swallowed a collective's error: %s", error)
            report(error)
            return None
        return error  # KeyboardInterrupt and the like are not swallowed

    try:
        work = issue(target())  # type: ignore[arg-type]
    except CommError as exc:  # refused: errored or unconfigured group
        report(exc.with_traceback(None))  # stored: no frames kept alive with it
        return DoneWork(default)
    return ChainedWork(work, default, outcome)


def _check_pg(pg: object) -> ProcessGroup:
    if not isinstance(pg, ProcessGroup):
        raise TypeError(f"pg must be an ftcomm.c10d ProcessGroup, got {type(pg).__name__}")
    return pg


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """Wraps ``pg`` so that no collective raises: an op that fails (at issue,
    at ``wait()`` or through its future) reports its error here and ends as a
    success with its inputs left as they were. After the first error every op
    is skipped (it succeeds at once without communicating) until ``configure``.

    For training loops that handle failures outside the model code: check
    :meth:`error` after the step; ``configure`` clears it. An op that is issued has its arguments
    checked: ``TypeError``/``ValueError`` are raised, never swallowed (a
    skipped op is not checked: it goes nowhere).

    Args:
        pg: the ftcomm.c10d group whose ops it runs.

    Raises:
        TypeError: ``pg`` is not an ftcomm.c10d ``ProcessGroup``.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=_check_pg(pg))
        self._error: Exception | None = None
        self._lock = threading.Lock()
        self._generation = 0  # configure() count: an op reports into its own

    def _on_configure(self) -> None:
        with self._lock:  # a new configuration: ops run again
            self._generation += 1
            self._error = None

    def report_error(self, e: Exception) -> None:
        """Record ``e`` (the first error is kept); later ops are skipped until
        ``configure``."""
        self._report(e, self._generation)

    def _report(self, e: Exception, generation: int) -> None:
        # An op of an earlier configuration (aborted by configure itself, or
        # waited on only afterwards) must not stop the new one.
        with self._lock:
            if generation == self._generation and self._error is None:
                self._error = e

    def error(self) -> Exception | None:
        """The first error recorded since the last ``configure``, or ``None``."""
        return self._error

    def _run(self, op: str, default: object, issue: Issue) -> dist.Work:
        if self._error is not None:
            return DoneWork(default)
        generation = self._generation
        return _swallowing(
            lambda: self._target(op), issue, default, lambda e: self._report(e, generation)
        )


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """Wraps ``pg`` to inject errors, for tests: after
    ``report_future_error(e)`` the next op runs as usual on ``pg`` and then
    fails with ``e``, from ``wait()`` and from ``get_future()`` alike (or
    from the future only: see :meth:`report_future_error`).

    Args:
        pg: the ftcomm.c10d group whose ops it runs.

    Raises:
        TypeError: ``pg`` is not an ftcomm.c10d ``ProcessGroup``.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=_check_pg(pg))
        self._future_error: tuple[Exception, bool] | None = None
        self._lock = threading.Lock()

    def _on_configure(self) -> None:
        self._future_error = None  # a pending injected error is dropped

    def report_future_error(self, e: Exception, *, wait_raises: bool = True) -> None:
        """Make the next op fail with ``e``.

        Args:
            e: the error the next op ends with.
            wait_raises: whether its ``wait()`` raises ``e`` too; with ``False``
                it returns ``True`` and only the future fails, as with torchft's
                wrapper (what torchft's ``DistributedDataParallel`` needs:
                docs/migrating.md#torchfts-manager-and-ddp).

        Raises:
            TypeError: ``e`` is not an exception instance, or ``wait_raises``
                not a bool.
        """
        if not isinstance(e, Exception):
            raise TypeError(f"e must be an Exception instance, got {type(e).__name__}")
        if not isinstance(wait_raises, bool):
            raise TypeError(f"wait_raises must be a bool, got {type(wait_raises).__name__}")
        self._future_error = (e, wait_raises)

    def _run(self, op: str, default: object, issue: Issue) -> dist.Work:
        work = issue(self._target(op))
        with self._lock:
            pending, self._future_error = self._future_error, None
        if pending is None:
            return work
        error, wait_raises = pending
        return ChainedWork(work, default, lambda _: error, wait_raises=wait_raises)


@runtime_checkable
class Manager(Protocol):
    """What :class:`ManagedProcessGroup` needs from a fault-tolerance manager
    (torchft's ``Manager`` has it)."""

    def allreduce(self, tensor: torch.Tensor, *, reduce_op: ReduceOp.RedOpType) -> dist.Work:
        """Reduce ``tensor`` across the healthy participants; errors go to the
        manager, never to the caller."""
        ...

    def num_participants(self) -> int:
        """How many replicas take part in the current step."""
        ...

    def report_error(self, e: Exception) -> None:
        """Record an error: the manager will not commit this step."""
        ...


class ManagedProcessGroup(ProcessGroupWrapper):
    """A group whose allreduce goes through a :class:`Manager`, sized by the
    manager's participants. Other collectives run on ``pg`` (default: the
    manager's ``_pg``, as torchft's Manager keeps it, if that is an
    ftcomm.c10d group); their errors are reported to the manager and the op
    ends as a success with its inputs unchanged.

    Args:
        manager: the fault-tolerance manager that runs the allreduces.
        pg: the ftcomm.c10d group for the other collectives (default: the
            manager's ``_pg``, if that is one).

    Raises:
        TypeError: ``manager`` lacks a method of :class:`Manager`, or ``pg``
            is not an ftcomm.c10d ``ProcessGroup``.
    """

    _sized_as_inner = False  # sized by its manager, not by the wrapped group

    def __init__(self, manager: Manager, pg: ProcessGroup | None = None) -> None:
        missing = [
            m
            for m in ("allreduce", "num_participants", "report_error")
            if not callable(getattr(manager, m, None))
        ]
        if missing:
            raise TypeError(f"manager must have {', '.join(missing)}(): see ftcomm.c10d.Manager")
        if pg is None:
            own = getattr(manager, "_pg", None)
            pg = own if isinstance(own, ProcessGroup) else None
        super().__init__(pg=pg)
        self._manager = manager

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        if isinstance(tensors, torch.Tensor):  # c10d's allreduce(tensor, op) overload
            tensors = [tensors]
        tensor = one(tensors, "tensors")
        op, _ = reduce_args(opts)  # the manager's own deadline applies
        return self._manager.allreduce(tensor, reduce_op=op)

    def _run(self, op: str, default: object, issue: Issue) -> dist.Work:
        if self._inner is None:
            raise NotImplementedError(
                f"ManagedProcessGroup runs {op} on a group: pass pg= (only allreduce "
                "goes through the manager)"
            )
        return _swallowing(lambda: self._target(op), issue, default, self._manager.report_error)

    def size(self) -> int:
        """The number of participants in the manager's current quorum."""
        return self._manager.num_participants()

    def getBackendName(self) -> str:
        return self._inner.getBackendName() if self._inner is not None else "ftcomm-managed"
