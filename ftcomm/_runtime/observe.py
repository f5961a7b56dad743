"""What a group did: its statistics, its events and its log lines.

Owns :class:`Observer` (one per :class:`~ftcomm.Group`, told of every op's
end, every configure and every break), :class:`Histogram`, the public
:class:`GroupStats`, :class:`OpStats`, :class:`Event` and
:class:`Subscription`, and the log lines on the ``ftcomm`` logger. Statistics
are recorded where an op's end is published, under the group's lock; events
and log lines are queued there and delivered on ``ftcomm-events``, in order.
See docs/observability.md.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ..errors import CommAborted, CommError, CommTimeout, WorkerDied

log = logging.getLogger("ftcomm")

_SUB = 8  # buckets per doubling
_LOW = -20  # 2**-20 s: about 1 µs
_HIGH = 7  # 2**7 s: 128 s
_BUCKETS = (_HIGH - _LOW) * _SUB + 2  # + one below _LOW, one from _HIGH up


FOLD_EVERY = 256
"""How many noted successes are folded into the statistics at once
(:meth:`Observer.succeeded_locked`): a bound on the notes' memory, not a
visible delay (a read folds)."""

SEEN_WITHIN = 0.001
"""An op's end seen this soon after it was last seen running (or issued)
counts as seen as it happened: its latency goes into the statistics."""


def timed(latency: float, window: float) -> bool:
    """Whether an op's end, seen ``latency`` after its issue to within
    ``window``, was seen as it happened: within 1 ms or 1/16 of its latency."""
    return window <= max(latency / 16, SEEN_WITHIN)


def _bucket(seconds: float) -> int:
    if not seconds > 2.0**_LOW:  # also NaN
        return 0
    mantissa, exp = math.frexp(seconds)  # seconds = mantissa * 2**exp, mantissa in [0.5, 1)
    return min((exp - 1 - _LOW) * _SUB + int((mantissa * 2 - 1) * _SUB) + 1, _BUCKETS - 1)


def _middle(index: int) -> float:
    """A value inside bucket ``index``: its geometric middle."""
    if index == 0:
        return 2.0**_LOW
    if index == _BUCKETS - 1:
        return math.inf  # past the top: the caller answers with the max
    octave, step = divmod(index - 1, _SUB)
    low = 2.0 ** (_LOW + octave) * (1 + step / _SUB)
    high = 2.0 ** (_LOW + octave) * (1 + (step + 1) / _SUB)
    return math.sqrt(low * high)


class Histogram:
    """Durations in a fixed number of log-spaced buckets: 8 per doubling from
    1 µs to 128 s, so a percentile below 128 s is off by at most 1/16 of its
    value, in constant memory (docs/observability.md)."""

    __slots__ = ("count", "counts", "max", "total")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        self.counts[_bucket(seconds)] += 1
        self.count += 1
        self.total += seconds
        if seconds > self.max:
            self.max = seconds

    def add_sorted(self, values: list[float]) -> None:
        """:meth:`add` each of ``values``, given in ascending order: one bucket
        lookup per run of values in one bucket (a binary search), not one per
        value (1000 ops of a fused batch)."""
        if not values:
            return
        counts = self.counts
        i, n = 0, len(values)
        while i < n:  # buckets rise with the values: each run found by bisection
            index = _bucket(values[i])
            end = bisect.bisect_right(values, index, lo=i, key=_bucket)
            counts[index] += end - i
            i = end
        self.count += n
        self.total += math.fsum(values)
        if values[-1] > self.max:
            self.max = values[-1]

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (0..1), within 1/16 of its value below 128 s
        (above, the largest value); ``None`` if empty."""
        if self.count == 0:
            return None
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for index, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return min(_middle(index), self.max)
        return self.max


@dataclass(frozen=True)
class OpStats:
    """One op kind's statistics (see :meth:`ftcomm.Group.stats`).

    Latencies are of the ops that succeeded and whose end was seen as it
    happened, from issue to end, in seconds (``None`` before any did):
    within 1/16 of the value, plus up to 1 ms or 1/16 of the latency where
    the end was seen late.
    """

    count: int
    """Ops of this kind that ended (succeeded or failed)."""
    failed: Mapping[str, int]
    """Failed ones, by error type name (``CommTimeout``, ``CommAborted``, ...)."""
    p50: float | None
    p99: float | None
    mean: float | None
    max: float | None
    untimed: int = 0
    """Succeeded ones whose end was not seen as it happened (found ended
    after other work): in ``count``, not in the latencies."""


@dataclass(frozen=True)
class GroupStats:
    """What :meth:`ftcomm.Group.stats` returns: a snapshot, since the group was made."""

    ops: Mapping[str, OpStats]
    """Per op kind (``"allreduce"``, ``"barrier"``, ...), those with any op."""
    configures: int
    """``configure()`` calls that built a group."""
    configure_failures: Mapping[str, int]
    """Those that did not, by error type name."""
    configure_seconds: OpStats | None
    """Durations of the configures that built a group (``None`` before one did)."""
    aborts: Mapping[str, int]
    """Configurations that broke, by the type name of what broke them
    (``CommTimeout``, ``CommFailed``, ``WorkerDied``, ``CommAborted`` for
    ``abort()`` and cancels). A reconfigure or shutdown is not an abort."""
    last_abort: str | None
    """What broke the last one, in words."""
    in_flight: int
    """Ops of the current configuration that have not ended."""

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts and numbers (for JSON, a metrics exporter)."""

        def one(s: OpStats) -> dict[str, Any]:
            return {
                "count": s.count,
                "untimed": s.untimed,
                "failed": dict(s.failed),
                "p50": s.p50,
                "p99": s.p99,
                "mean": s.mean,
                "max": s.max,
            }

        return {
            "ops": {name: one(s) for name, s in self.ops.items()},
            "configures": self.configures,
            "configure_failures": dict(self.configure_failures),
            "configure_seconds": one(self.configure_seconds) if self.configure_seconds else None,
            "aborts": dict(self.aborts),
            "last_abort": self.last_abort,
            "in_flight": self.in_flight,
        }

    def __str__(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1e3:.3g}"

        lines = [
            f"{'op':<34}{'count':>8}{'failed':>8}{'untimed':>9}"
            f"{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}"
        ]
        for name, s in sorted(self.ops.items()):
            failed = sum(s.failed.values())
            lines.append(
                f"{name:<34}{s.count:>8}{failed:>8}{s.untimed:>9}"
                f"{ms(s.p50):>10}{ms(s.p99):>10}{ms(s.max):>10}"
            )
        c = self.configure_seconds
        failures = sum(self.configure_failures.values())
        lines.append(
            f"{'configure':<34}{self.configures:>8}{failures:>8}{'':>9}"
            f"{ms(c.p50 if c else None):>10}{ms(c.p99 if c else None):>10}"
            f"{ms(c.max if c else None):>10}"
        )
        aborts = ", ".join(f"{k} {v}" for k, v in sorted(self.aborts.items())) or "none"
        lines.append(f"aborts: {aborts}; in flight: {self.in_flight}")
        if self.last_abort:
            lines.append(f"last abort: {self.last_abort}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Event:
    """Something a group did, as a subscriber gets it (:meth:`ftcomm.Group.subscribe`).

    ``kind`` is one of:

    - ``"issued"``: an op went on the wire (``op``, ``seq``);
    - ``"ended"``: it succeeded (``duration``: from issue to end);
    - ``"failed"``: it ended with ``error`` (``duration`` as above);
    - ``"configured"``: ``configure()`` built a group (``duration``);
    - ``"configure_failed"``: it did not (``error``, ``duration``);
    - ``"aborted"``: the configuration broke (``error``: what broke it, the
      op's error for a timeout or a failure; ``op``/``seq``: that op's). The
      ``"failed"`` of the ops it ended may come before or after it: an op
      is published once its native op can no longer write (a stopped Gloo
      op, a millisecond or two later);
    - ``"worker_died"``: the subprocess worker exited (``error`` is the
      ``WorkerDied``), just before its ``"aborted"``;
    - ``"shutdown"``: ``shutdown()`` ended the configuration.
    """

    kind: str
    rank: int | None
    store: str | None
    """The configuration's ``host:port/prefix``."""
    op: str | None = None
    seq: int | None = None
    duration: float | None = None
    """Seconds: an op's from its issue to its end: as the backend saw it
    (a subprocess worker's reply, an accelerator event's poll), else as
    seen here (an await, a wait, its completion callback: for an op awaited
    after other work, that later moment); a configure's."""
    error: BaseException | None = None
    time: float = field(default_factory=time.time)
    """When, as ``time.time()``."""


Subscriber = Callable[[Event], object]


class Subscription:
    """A subscriber's registration: :meth:`close` (or leave the ``with``) to stop."""

    __slots__ = ("_callback", "_observer")

    def __init__(self, observer: Observer, callback: Subscriber) -> None:
        self._observer: Observer | None = observer
        self._callback = callback

    def close(self) -> None:
        """Stop delivering events to the callback (idempotent). Events
        queued before (not yet delivered) still arrive."""
        observer, self._observer = self._observer, None
        if observer is not None:
            observer._unsubscribe(self._callback)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _deliver(subscribers: tuple[Subscriber, ...], event: Event) -> None:
    for callback in subscribers:
        try:
            callback(event)
        except Exception:
            with contextlib.suppress(Exception):  # a broken log handler: still the next one
                log.exception("ftcomm: an event subscriber raised on %s", event.kind)


def _safely(fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except Exception:  # a log handler's bug: not the group's
        with contextlib.suppress(Exception):
            log.exception("ftcomm: writing a log line failed")


def _name(error: BaseException) -> str:
    return type(error).__name__


class _OpCounters:
    __slots__ = ("count", "failed", "hist", "untimed")

    def __init__(self) -> None:
        self.count = 0
        self.untimed = 0
        self.failed: Counter[str] = Counter()
        self.hist = Histogram()

    def snapshot(self) -> OpStats:
        h = self.hist
        mean = h.total / h.count if h.count else None
        return OpStats(
            self.count,
            dict(self.failed),
            h.quantile(0.5),
            h.quantile(0.99),
            mean,
            h.max if h.count else None,
            self.untimed,
        )


class Observer:
    """One group's statistics, subscribers and log lines (docs/observability.md).

    Op ends are recorded under the group's lock (passed in as ``lock``: the
    one the op is published under); the rest under this observer's own.
    Events and log lines go through ``post`` (the runtime's events thread).
    """

    def __init__(
        self,
        lock: threading.Lock,
        post: Callable[[Callable[[], object]], object],
        *,
        stats: bool = True,
    ) -> None:
        self.stats_on = stats
        self._post = post
        self._ops_lock = lock
        self._lock = threading.Lock()
        self._ops: dict[str, _OpCounters] = {}
        # Successes not yet in _ops (op, latency, window): succeeded_locked.
        self._noted: list[tuple[str, float, float]] = []
        self.subscribers: tuple[Subscriber, ...] = ()
        """Read without a lock on the hot path (replaced whole, never mutated)."""
        self._configures = _OpCounters()
        self._aborts: Counter[str] = Counter()
        self._last_abort: str | None = None

    # -- subscribers -------------------------------------------------------
    def subscribe(self, callback: Subscriber) -> Subscription:
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        with self._lock:
            self.subscribers = (*self.subscribers, callback)
        return Subscription(self, callback)

    def _unsubscribe(self, callback: Subscriber) -> None:
        with self._lock:
            subs = list(self.subscribers)
            for i, sub in enumerate(subs):
                if sub is callback:
                    del subs[i]
                    break
            self.subscribers = tuple(subs)

    def emit(self, event: Event) -> None:
        """Queue ``event`` for the subscribers (if any)."""
        subs = self.subscribers
        if subs:
            self._post(lambda: _deliver(subs, event))

    def _log(self, level: int, message: str, *args: object, extra: dict[str, Any]) -> None:
        """Queue a log line (formatted where it is written: lazily)."""
        if log.isEnabledFor(level):
            self._post(lambda: _safely(log.log, level, message, *args, extra=extra))

    # -- ops ---------------------------------------------------------------
    def issued_locked(self, rank: int, store: str, op: str, seq: int) -> None:
        """Under the group's lock: queue an op's ``"issued"`` event (its record
        sees that it goes once, and before its end's)."""
        self.emit(Event("issued", rank, store, op, seq))

    def op_ended_locked(
        self,
        rank: int,
        store: str,
        op: str,
        seq: int,
        seconds: float,
        timed: bool,
        error: BaseException | None,
        notify: bool,
    ) -> None:
        """Under the group's lock: record an op's end (``seconds`` from its
        issue to its end as seen; ``timed``: seen as it happened, see
        :data:`SEEN_WITHIN`); queue its event where ``notify`` (the caller's one read of
        ``subscribers``, by which it also queued the op's ``"issued"`` first:
        a subscriber arriving meanwhile never gets an end without it)."""
        if self.stats_on:
            counters = self._counters(op)
            counters.count += 1
            if error is None:
                if timed:
                    counters.hist.add(seconds)
                else:
                    counters.untimed += 1
            else:
                counters.failed[_name(error)] += 1
        if notify:
            kind = "ended" if error is None else "failed"
            self.emit(Event(kind, rank, store, op, seq, seconds, error))

    def succeeded_locked(self, op: str, seconds: float, window: float) -> None:
        """Under the group's lock, statistics on and no subscriber: note an
        op of kind ``op`` that succeeded, seen end ``seconds`` after its issue
        to within ``window``; what :meth:`op_ended_locked` records for it,
        folded in, still under that lock, every :data:`FOLD_EVERY` notes
        and whenever the statistics are read, so the histogram's work is off
        the small-op path."""
        if op not in self._ops:  # the kinds in the order of their first ends
            self._ops[op] = _OpCounters()
        noted = self._noted
        noted.append((op, seconds, window))
        if len(noted) >= FOLD_EVERY:
            self._fold_locked()

    def _fold_locked(self) -> None:
        """Under the group's lock: put the noted successes into the statistics,
        per op kind in one pass (sorted, as :meth:`batch_ended_locked` does).
        Measured, warm: 90 µs for 256 notes of one kind, where adding each
        to the histogram took 170 µs in all; the op whose end folds pays it."""
        noted, self._noted = self._noted, []
        kinds = dict.fromkeys(op for op, _, _ in noted)
        for kind in kinds:
            mine = noted if len(kinds) == 1 else [note for note in noted if note[0] == kind]
            latencies = sorted([seconds for _, seconds, window in mine if timed(seconds, window)])
            self._add_successes(kind, len(mine), latencies)

    def _add_successes(self, op: str, count: int, timed_latencies: list[float]) -> None:
        """Under the group's lock: ``count`` successes of kind ``op``, of which
        those timed have ``timed_latencies`` (ascending); the rest are untimed."""
        counters = self._counters(op)
        counters.count += count
        counters.untimed += count - len(timed_latencies)
        counters.hist.add_sorted(timed_latencies)

    def _counters(self, op: str) -> _OpCounters:
        """Under the group's lock: ``op``'s counters, made on its first end."""
        counters = self._ops.get(op)
        if counters is None:
            counters = self._ops[op] = _OpCounters()
        return counters

    def batch_ended_locked(self, op: str, latencies: list[float], window: float) -> None:
        """Under the group's lock, with statistics on and no subscriber: what
        :meth:`op_ended_locked` records for each of a batch of ops of kind
        ``op`` that succeeded together (a fused batch, seen end to within
        ``window``), each ``latencies[i]`` after its issue, in one pass."""
        latencies = sorted(latencies)
        # timed() holds from some latency up: the untimed ones come first
        untimed = bisect.bisect_left(latencies, True, key=lambda v: timed(v, window))
        self._add_successes(op, len(latencies), latencies[untimed:])

    # -- configurations ----------------------------------------------------
    def configured(self, rank: int, world_size: int, store: str, seconds: float) -> None:
        with self._lock:
            self._configures.count += 1
            self._configures.hist.add(seconds)
        self._log(
            logging.INFO,
            "ftcomm: configured rank %d of %d at %s in %.1f ms",
            rank,
            world_size,
            store,
            seconds * 1e3,
            extra=_extra("configured", rank, store, duration=seconds),
        )
        self.emit(Event("configured", rank, store, "configure", None, seconds))

    def configure_failed(self, rank: int, store: str, seconds: float, error: BaseException) -> None:
        with self._lock:
            self._configures.failed[_name(error)] += 1
        by_caller = isinstance(
            error, (CommAborted, asyncio.CancelledError)
        )  # superseded, cancelled
        self._log(
            logging.INFO if by_caller else logging.WARNING,
            "ftcomm: configure of rank %d at %s failed after %.1f ms: %s: %s",
            rank,
            store,
            seconds * 1e3,
            _name(error),
            str(error),
            extra=_extra("configure_failed", rank, store, duration=seconds, error=error),
        )
        self.emit(Event("configure_failed", rank, store, "configure", None, seconds, error))

    def broke(self, cause: CommError, why: str, store: str, rank: int, in_flight: int) -> None:
        """A configuration ended: ``why`` is the state event that ended it
        (``"break"``/``"abort"``: an abort; ``"begin"``: a reconfigure;
        ``"shutdown"``). No lock held."""
        if why == "begin":
            return  # the configure that follows logs and emits
        if why == "shutdown":
            self._log(
                logging.DEBUG,
                "ftcomm: rank %d at %s shut down (%d ops ended with it)",
                rank,
                store,
                in_flight,
                extra=_extra("shutdown", rank, store),
            )
            self.emit(Event("shutdown", rank, store))
            return
        what = _name(cause)
        with self._lock:
            self._aborts[what] += 1
            self._last_abort = f"{what}: {cause}"
        died = isinstance(cause, WorkerDied)
        by_call = isinstance(cause, CommAborted)  # abort(), a cancel: the caller's own doing
        kind = "timeout" if isinstance(cause, CommTimeout) else "worker died" if died else what
        self._log(
            logging.INFO if by_call else logging.WARNING,
            "ftcomm: group aborted (rank %d at %s, %s; %d other ops ended with it): %s",
            rank,
            store,
            kind,
            in_flight,
            _plain(str(cause)),  # not the error: its traceback may hold the native group
            extra=_extra("aborted", rank, store, op=cause.op, seq=cause.seq, error=cause),
        )
        if died:
            self.emit(Event("worker_died", rank, store, cause.op, cause.seq, None, cause))
        self.emit(Event("aborted", rank, store, cause.op, cause.seq, None, cause))

    # -- reading -----------------------------------------------------------
    def snapshot(self, in_flight: int) -> GroupStats:
        with self._ops_lock:
            self._fold_locked()
            ops = {name: c.snapshot() for name, c in self._ops.items()}
        with self._lock:
            configures = self._configures.snapshot()
            aborts = dict(self._aborts)
            last = self._last_abort
        return GroupStats(
            ops=ops,
            configures=configures.count,
            configure_failures=configures.failed,
            configure_seconds=configures if configures.p50 is not None else None,
            aborts=aborts,
            last_abort=last,
            in_flight=in_flight,
        )


# Gloo's advice, appended to each of its connection errors: once per log line
# it is noise ("... Check the logs of the remote worker ... GLHF! 🏖️").
_GLOO_ADVICE = re.compile(
    r" This is typically caused by [^.]*\. Check the logs of the remote worker before "
    r"reporting an error\. GLHF!(?: [^\x00-\x7f]+)?"  # and its emoji
)


def _plain(text: str) -> str:
    """An error's text for a log line, without Gloo's boilerplate advice."""
    return _GLOO_ADVICE.sub("", text)


def _extra(
    event: str,
    rank: int | None,
    store: str | None,
    *,
    op: str | None = None,
    seq: int | None = None,
    duration: float | None = None,
    error: BaseException | None = None,
) -> dict[str, Any]:
    """The structured fields of a log record (``record.ftcomm_event`` ...)."""
    return {
        "ftcomm_event": event,
        "ftcomm_time": time.time(),  # when it happened; the record's is when it was written
        "ftcomm_rank": rank,
        "ftcomm_store": store,
        "ftcomm_op": op,
        "ftcomm_seq": seq,
        "ftcomm_duration": duration,
        "ftcomm_error": None if error is None else _name(error),
    }
