"""A group's state: one lock, five states, every transition in :meth:`GroupCore._go`.

Owns :class:`State`, the transition table (:data:`TRANSITIONS`, which ``_go``
checks every transition against), :class:`GroupCore` (the state under its
lock, shared with the current configuration's op table), :class:`Config`,
:class:`Attempt` and :class:`Teardown`. The table with who causes each event,
who may call what from which thread, and why ``abort()`` wins: docs/ops.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._runtime.native import countdown
from ._runtime.table import on_end
from .errors import CommAborted, CommError

if TYPE_CHECKING:
    import torch

    from ._runtime.fuse import AloneMark, Batch
    from ._runtime.table import Broken, OpTable
    from ._verify import Chain
    from .backends import Backend


class State(enum.Enum):
    """Where a :class:`~ftcomm.Group` is in its life (``Group.state``)."""

    UNCONFIGURED = "unconfigured"
    """Never configured, or the last ``configure()`` failed."""
    CONFIGURING = "configuring"
    """A ``configure()`` is building the native group."""
    READY = "ready"
    """Configured; ops run."""
    ERRORED = "errored"
    """Broken by a failed op, ``abort()`` or a dead worker; ops raise
    ``CommAborted`` until ``configure()``."""
    CLOSED = "closed"
    """``shutdown()`` was called; ``configure()`` may start again."""


# (event, from) -> to. Anything not here is refused by _go (a bug in ftcomm).
# docs/ops.md ("State: one lock, named states, one table") gives who causes each.
_ANY = tuple(State)
TRANSITIONS: dict[tuple[str, State], State] = {
    **{("begin", s): State.CONFIGURING for s in _ANY},
    ("ready", State.CONFIGURING): State.READY,
    ("fail", State.CONFIGURING): State.UNCONFIGURED,
    ("break", State.READY): State.ERRORED,
    ("abort", State.READY): State.ERRORED,
    ("abort", State.ERRORED): State.ERRORED,
    ("abort", State.CONFIGURING): State.ERRORED,
    ("abort", State.UNCONFIGURED): State.UNCONFIGURED,
    ("abort", State.CLOSED): State.CLOSED,
    **{("shutdown", s): State.CLOSED for s in _ANY},
}


@dataclass(eq=False)
class Config:
    """One configuration: the native group and the table of its ops."""

    backend: Backend
    table: OpTable
    store_addr: str
    sum_ok: bool = True
    """Whether the backend takes ``ReduceOp.SUM`` (every one does so far)."""
    chain: Chain | None = None
    """With ``verify=True``: issues each collective after a descriptor check."""
    batch: Batch | None = None
    """The open batch of fused allreduces (``Group(fuse=True)``): under the
    group's issue lock."""
    fuse_alone: bool = True
    """Whether the next fusible op goes at once, on its own: no cut point
    came since the last one did (fuse.py; issues read and write it under
    the issue lock; a look sets it without: see ``AloneMark.flush``)."""
    alone_mark: AloneMark | None = None
    """What an op that went on its own holds: its first look is a cut point."""
    short_dtypes: frozenset[torch.dtype] | None = None
    """The dtypes ``Group.allreduce``'s short path takes (``None``: it has
    none): set where the backend has one (:attr:`Backend.short_allreduce`,
    CPU tensors) and ``verify=True`` is off."""


class Attempt:
    """One ``configure()`` call: current until a later event supersedes it.

    ``superseded`` completes when the attempt is over without having become
    the group's configuration (superseded, failed, timed out, cancelled): a
    ``configure()`` waiting for its native group stops waiting, and a worker
    process being configured for it is killed.
    """

    __slots__ = ("superseded", "superseded_by")

    def __init__(self) -> None:
        self.superseded_by: str | None = None
        self.superseded: concurrent.futures.Future[str] = concurrent.futures.Future()


class Teardown:
    """What a transition left to do once the lock is released: end the ops
    of a configuration that is over (its table is already marked, under the
    lock) and, the first time its table breaks, dispose of its native group."""

    __slots__ = ("broken", "config")

    def __init__(self, config: Config | None, broken: Broken | None) -> None:
        self.config = config
        self.broken = broken

    def run(self) -> Backend | None:
        """End the ops and dispose; the backend being closed, if any."""
        cfg = self.config
        if cfg is None:
            return None
        if self.broken is not None:
            cfg.table.after_break(self.broken, time.monotonic())
        return cfg.backend

    def ended(self) -> concurrent.futures.Future[None] | None:
        """A future done once every op this teardown ended has published its
        end (a stopped Gloo op publishes once its native op has ended, a
        millisecond or two later); ``None`` if none is left to wait for."""
        broken = self.broken
        futures = []
        for work in [] if broken is None else broken.pending:
            ended: concurrent.futures.Future[None] = concurrent.futures.Future()
            on_end(work, functools.partial(ended.set_result, None))
            futures.append(ended)
        return all_of(futures)


def all_of(
    futures: Sequence[concurrent.futures.Future[None]],
) -> concurrent.futures.Future[None] | None:
    """One future done once all of ``futures`` are (``None`` for none)."""
    if len(futures) <= 1:
        return futures[0] if futures else None
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    one = countdown(len(futures), lambda: done.set_result(None))
    for fut in futures:
        fut.add_done_callback(one)
    return done


class GroupCore:
    """The state of one :class:`~ftcomm.Group`, under one lock.

    The op table of the current configuration shares the lock, so an op that
    breaks its table and ``abort()`` on another thread see one order.

    Transitions never block: they run under the lock and only change fields;
    what must happen because of them (ending the ops of a configuration,
    disposing of its native group) runs after the lock is released, on the
    calling thread, and never waits for a native call. ``abort()`` and
    ``shutdown()`` may come from any thread while ``configure()`` runs on
    another: they win, because a configuration becomes READY only through
    ``ready``, under the lock, for the attempt that is still current.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._state = State.UNCONFIGURED
        self._config: Config | None = None
        self._attempt: Attempt | None = None
        self._error: CommError | None = None  # ERRORED without a configuration
        self.on_transition: Callable[[str, State, State], None] | None = None
        """Test hook: called under the lock with (event, from, to)."""

    # -- reads (any thread, no lock: each is one attribute read) -------------
    @property
    def state(self) -> State:
        return self._state

    @property
    def config(self) -> Config | None:
        """The configuration ops run on (READY, or ERRORED after one), else None."""
        return self._config

    def errored(self) -> CommError | None:
        cfg = self._config
        if cfg is not None:
            return cfg.table.reported
        return self._error

    # -- transitions (each takes the lock, or is called under it) -------------
    def _go(self, event: str, to_close: CommError | None = None) -> Teardown:
        """Under the lock: apply ``event`` to the state; end the current
        configuration's ops with ``to_close`` if given."""
        before = self._state
        after = TRANSITIONS.get((event, before))
        if after is None:
            raise RuntimeError(f"ftcomm bug: {event!r} is not allowed in state {before.value}")
        if self.on_transition is not None:
            self.on_transition(event, before, after)
        self._state = after  # first: the table's break below must not count as "break"
        cfg = self._config
        if to_close is None or cfg is None:
            return Teardown(None, None)
        if event in ("begin", "shutdown"):
            self._config = None
        return Teardown(cfg, cfg.table.break_locked(to_close, event))

    def table_broke(self, table: OpTable) -> None:
        """Under the lock: the op table ``table`` has just set its ``error``."""
        cfg = self._config
        if cfg is not None and cfg.table is table and self._state is State.READY:
            self._go("break")

    def begin(self, closing: CommError) -> tuple[Attempt, Teardown]:
        """A ``configure()`` starts: supersede any attempt, end the configuration."""
        with self.lock:
            old = self._supersede("configure()")
            attempt = self._attempt = Attempt()
            self._error = None
            teardown = self._go("begin", closing)
        _announce(old)
        return attempt, teardown

    def ready(
        self, attempt: Attempt, config: Config, on_ready: Callable[[], None] | None = None
    ) -> bool:
        """The attempt built ``config``; False if it was superseded (the caller
        must then dispose of it: it never became the group's). ``on_ready``
        runs under the lock once it is READY (it must not block): before any
        op of the configuration can be issued."""
        with self.lock:
            if self._attempt is not attempt:
                return False
            self._attempt = None
            self._config = config
            self._go("ready")
            if on_ready is not None:
                with contextlib.suppress(Exception):  # a record, never the configure's outcome
                    on_ready()
            return True

    def fail(self, attempt: Attempt) -> None:
        """The attempt failed, timed out or was cancelled: it is over, and
        what it was still building is stopped (its future completes)."""
        with self.lock:
            if self._attempt is attempt:
                self._attempt = None
                self._go("fail")
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            attempt.superseded.set_result("failed")

    def abort(self, error: CommError) -> Teardown:
        with self.lock:
            old = None
            if self._state is State.CONFIGURING:
                old = self._supersede("abort()")
                self._error = error
            teardown = self._go("abort", error)
        _announce(old)
        return teardown

    def abort_if(self, config: Config, error: CommError) -> Teardown | None:
        """``abort(error)`` where ``config`` is still the configuration ops
        run on (READY, or ERRORED after it); else nothing (``None``): a
        ``configure()`` begun since, or a shutdown, is left alone."""
        with self.lock:
            if self._config is not config or self._state not in (State.READY, State.ERRORED):
                return None
            return self._go("abort", error)

    def shutdown(self, error: CommError) -> Teardown:
        with self.lock:
            old = self._supersede("shutdown()")
            self._error = None
            teardown = self._go("shutdown", error)
        _announce(old)
        return teardown

    def _supersede(self, by: str) -> Attempt | None:
        """Under the lock: the current attempt is over; it, to announce."""
        attempt, self._attempt = self._attempt, None
        if attempt is not None:
            attempt.superseded_by = by
        return attempt

    def superseded(self, attempt: Attempt, rank: int) -> CommAborted:
        """The error a superseded ``configure()`` raises."""
        by = attempt.superseded_by or "another call"
        return CommAborted(f"configure was superseded by {by}", rank=rank, op="configure")


def _announce(attempt: Attempt | None) -> None:
    """Complete a superseded attempt's future, with the lock released: its
    callbacks wake the configuring loop and kill a worker being configured."""
    if attempt is not None and attempt.superseded_by is not None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            attempt.superseded.set_result(attempt.superseded_by)
