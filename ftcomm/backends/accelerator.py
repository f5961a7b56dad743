"""NCCL (CUDA) and XCCL (XPU): one backend, parametrised by a :class:`Flavor`.

Owns :class:`AcceleratorBackend`: the communicator built as torchft builds it;
an op's end taken from an event recorded after it on a stream of ftcomm's
own; the deadline held by the owner loop, which aborts the communicator once
per configuration, on a worker thread; success only for an event seen
completed before any abort began; and the environment that keeps c10d from
ending the process (:func:`prepare_environment`). How, and what is verified
without a GPU: docs/accelerators.md; the abort truth table: docs/errors.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    ReduceScatterOptions,
    _make_nccl_premul_sum,
)
from torch.distributed import ReduceOp

from .._meet import meet
from .._runtime.loop import get_runtime
from .._runtime.native import Done, NativeOp
from .._runtime.table import AbandonAbort
from .._store import Stopped, connect_store
from .._validate import PremulSum, ReduceOpArg
from ..errors import CommAborted, CommError, CommFailed
from ._accel_device import (
    FLAVORS,
    WATCHDOG_TIMEOUT,
    DeviceCalls,
    Flavor,
    coalesced,
    device_calls,
    dump_before_abort,
    prepare_environment,
)
from ._base import NUMERIC_DTYPES, Backend, ConnectSpec

log = logging.getLogger("ftcomm")

ABORT_BOUND = 60.0
"""By when a native abort should have returned (for the exit grace)."""
POLL_MIN = 50e-6
"""The watcher's first pause between two rounds of event queries (seconds)."""
POLL_MAX = 2e-3
"""Its longest pause: an op that ends is seen within this (plus a round)."""
LINGER = 1.0
"""How long the watcher thread waits for new ops before it ends."""


class EventOp:
    """One accelerator op: ended once its event has completed, or its group
    was aborted (or its library reported an error) first.

    ``abandon()`` aborts the group (on a worker thread) and returns False:
    the op's error is published at once, at the deadline; the communicator's
    kernels stop as the abort takes effect (docs/errors.md).
    """

    __slots__ = (
        "_backend",
        "_device",
        "_end",
        "_event",
        "_polled_at",
        "_work",
        "end_window",
        "ended_at",
    )

    stream_ordered: ClassVar[bool] = True
    """c10d's ``Work.wait()`` on it orders the caller's stream, not the CPU."""
    polled_end: ClassVar[bool] = True
    """Its ``on_done`` callback comes when the watcher's poll sees the event
    complete (up to ``POLL_MAX`` late), not at the end itself: the end is
    ``ended_at``, known to within ``end_window`` (``Work``, observe.py)."""

    def __init__(
        self, backend: AcceleratorBackend, work: Any, event: Any, device: torch.device
    ) -> None:
        self._backend = backend
        self._work = work  # keeps the native work (and its tensors) until the end
        self._event = event
        self._device = device
        self._end: list[BaseException | None] | None = None  # set once, by _seen
        # time.perf_counter() of the poll that saw its event complete, and how
        # long before that a poll (any thread's) still saw it running
        self.ended_at: float | None = None
        self.end_window: float | None = None
        self._polled_at = time.perf_counter()

    def poll(self) -> bool:
        if self._end is not None:
            return True
        backend = self._backend
        error = backend.stopped()
        if error is not None:  # no device call once an abort began: it may hold locks
            self._seen(error)
            return True
        # The query first, the library's error and the abort flag second: a
        # completion seen before an abort began (c10d's watchdog sets the
        # error before it aborts) is the op's own; one seen after may be the
        # abort's, whose stopped kernels complete their events too.
        try:
            completed = backend.calls.query(self._event)
        except Exception as exc:  # a sticky device error: the group is done for
            failed = CommFailed(f"querying a {backend.flavor.library} op's event failed: {exc}")
            failed.__cause__ = exc.with_traceback(None)
            backend.abort(failed)
            completed = False
        if completed:
            backend.check_library()
        error = backend.stopped()
        if error is not None:
            self._seen(error)
            return True
        if completed:
            now = time.perf_counter()
            if self.ended_at is None:
                self.ended_at, self.end_window = now, now - self._polled_at
            self._seen(None)
        else:
            self._polled_at = time.perf_counter()
        return completed

    def peek(self) -> bool:
        """Whether the op ended by itself: its event completed before any
        abort (an op a break ends after an abort began gets the break's
        error, which says why)."""
        return self.poll() and self.outcome() is None

    def outcome(self) -> BaseException | None:
        end = self._end
        return None if end is None else end[0]

    def _seen(self, error: BaseException | None) -> None:
        """The op's end, first seen (several threads may poll at once: the
        first to see it decides, under the group's lock)."""
        with self._backend._lock:
            if self._end is None:
                self._end = [error]
                self._work = None

    def on_done(self, callback: Done) -> None:
        if self._end is not None:
            callback(self.outcome())
            return
        self._backend.watcher.add(self, callback)

    def abandon(self) -> bool:
        self._backend.abort(abandoned=True)
        return False

    def join_stream(self) -> None:
        """The calling thread's current stream on the op's device waits for
        the op (the CPU does not)."""
        self._backend.calls.join(self._event, self._device)


class Watcher:
    """Queries the events of a group's ops that someone waits for, on one
    thread that runs while there are any (and :data:`LINGER` after), and
    calls their callbacks when they end. Also notices an error the library
    reports while ops are pending, and aborts the group then."""

    def __init__(self, backend: AcceleratorBackend) -> None:
        self._backend = backend
        self._cond = threading.Condition(threading.Lock())
        self._pending: list[tuple[EventOp, Done]] = []
        self._thread: threading.Thread | None = None

    def add(self, op: EventOp, callback: Done) -> None:
        with self._cond:
            self._pending.append((op, callback))
            if self._thread is None:
                self._start_locked()
            else:
                self._cond.notify()

    def _start_locked(self) -> None:
        thread = threading.Thread(
            target=self._run, name=f"ftcomm-{self._backend.name}-watch", daemon=True
        )
        thread.start()  # may raise (no thread to be had): then there is none
        self._thread = thread

    def _run(self) -> None:
        try:
            self._watch()
        except BaseException:  # a bug below: the ops still pending get a new watcher
            log.exception("ftcomm: the %s watcher failed", self._backend.name)
            with self._cond:
                self._thread = None
                if self._pending:
                    with contextlib.suppress(RuntimeError):  # no thread: the next add() tries
                        self._start_locked()

    def _watch(self) -> None:
        pause = POLL_MIN
        while True:
            with self._cond:
                if not self._pending:
                    self._cond.wait(LINGER)
                    if not self._pending:
                        # Under the same lock as the check: an add() after
                        # this sees no thread and starts one.
                        self._thread = None
                        return
                pending = list(self._pending)
            try:
                self._backend.check_library()
            except Exception:  # a bug: the ops' own polls still end them
                log.exception("ftcomm: checking the %s group's error failed", self._backend.name)
            ended = [(op, cb) for op, cb in pending if _polled(op)]
            if not ended:
                time.sleep(pause)
                pause = min(pause * 2, POLL_MAX)
                continue
            pause = POLL_MIN
            with self._cond:
                done = {id(op) for op, _ in ended}
                self._pending = [(op, cb) for op, cb in self._pending if id(op) not in done]
            for op, cb in ended:
                try:
                    cb(op.outcome())
                except BaseException:  # a callback's bug must not stop the others
                    log.exception("ftcomm: a completion callback failed")
            del ended, pending


def _go_on(cancel: concurrent.futures.Future[Any] | None) -> None:
    """Raise if the connect was cancelled (between its blocking steps)."""
    if cancel is not None and cancel.done():
        raise RuntimeError("the connect was cancelled (configure gave up on it)")


def _polled(op: EventOp) -> bool:
    """``op.poll()``, or, if that raises, the op ended with that failure."""
    try:
        return op.poll()
    except Exception as exc:
        op._seen(CommFailed(f"polling a {op._backend.flavor.library} op failed: {exc}"))
        return True


class AcceleratorBackend(Backend):
    """One NCCL or XCCL group (a subclass per :class:`Flavor`: :func:`accelerator_class`)."""

    flavor: ClassVar[Flavor]
    dtypes: ClassVar[frozenset[torch.dtype] | None] = NUMERIC_DTYPES
    reduce_ops: ClassVar[frozenset[ReduceOp.RedOpType]] = frozenset(
        {
            ReduceOp.SUM,
            ReduceOp.AVG,
            ReduceOp.PREMUL_SUM,
            ReduceOp.PRODUCT,
            ReduceOp.MIN,
            ReduceOp.MAX,
        }
    )

    def __init__(
        self,
        calls: DeviceCalls,
        pg: Any,
        store: object,
        rank: int,
        world_size: int,
        device: torch.device,
        global_rank: int,
    ) -> None:
        super().__init__(rank, world_size)
        self.calls = calls
        # The device layer says where its tensors live (a fake's are on the CPU).
        self.device_type = calls.device_type
        self.device = device
        self._pg: Any = pg
        self._store: object | None = store
        self._global_rank = global_rank
        self._lock = threading.Lock()
        self._stop: CommError | None = None  # set once, when an abort begins
        self._aborted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._options: dict[tuple[object, ...], Any] = {}
        self._scratch: torch.Tensor | None = None
        self.watcher = Watcher(self)

    def __repr__(self) -> str:
        state = "aborted" if self._stop is not None else "live"
        return f"<ftcomm {self.name} backend rank={self.rank}/{self.world_size} {state}>"

    # -- building -------------------------------------------------------------
    @classmethod
    def caller_device(cls) -> int | None:
        """The calling thread's current device index (``torch.cuda.set_device``)."""
        return device_calls(cls.flavor).current_index()

    @classmethod
    def check_usable(cls) -> None:
        """Raises: RuntimeError: torch has no such library, or sees no device."""
        check_available(cls.flavor)

    @classmethod
    def connect(
        cls, spec: ConnectSpec, cancel: concurrent.futures.Future[Any] | None = None
    ) -> AcceleratorBackend:
        """Build the group and connect its communicator on ``spec.device``
        (the caller's current device at ``configure()``).

        ``cancel``: once it completes (the configure deadline passed, or it
        was superseded), the communicator being connected is aborted, and
        this raises.

        Raises:
            RuntimeError: torch has no such backend, or the connect was aborted.
            TimeoutError, RuntimeError: the store or the library failed.
        """
        flavor = cls.flavor
        calls = device_calls(flavor)
        check_available(flavor, calls)
        if not flavor.real_abort:  # before anything is built: -W error raises here
            warn_local_aborts(flavor)
        _go_on(cancel)  # given up before it began: not even the environment
        spec.progress.detail = "this rank was still setting up its device"
        prepare_environment(flavor, spec.timeout)
        device = calls.device(spec.device)
        deadline = time.monotonic() + spec.timeout
        progress = spec.progress
        store = connect_store(spec.store, spec.timeout, progress, cancel)
        with contextlib.suppress(Stopped):  # stopped: cancel is done, and the check below raises
            where = str(spec.store)  # for the error of a used prefix
            meet(store, spec.rank, spec.world_size, deadline, progress, cancel, where=where)
        if cancel is not None and cancel.done():  # nobody waits any more: build nothing
            del store  # not held by the error's traceback
            _go_on(cancel)
        progress.step = "native"
        opts = calls.options()
        config = getattr(opts, "config", None)
        if config is not None:
            config.blocking = False  # a communicator that ncclCommAbort can stop
        opts._timeout = WATCHDOG_TIMEOUT  # c10d's watchdog never acts before ftcomm
        if spec.global_ranks is not None:
            opts.global_ranks_in_group = list(spec.global_ranks)
        opts.group_name = f"ftcomm:{spec.replica_id}:{spec.quorum_id}:{spec.store.prefix}"
        pg = calls.new_group(store, spec.rank, spec.world_size, opts)
        global_rank = spec.global_ranks[spec.rank] if spec.global_ranks else spec.rank
        backend = cls(calls, pg, store, spec.rank, spec.world_size, device, global_rank)
        if cancel is not None:
            cancel.add_done_callback(backend._cancel)  # at once if it is done
        try:
            with calls.using(device):
                calls.connect(pg, device)
                backend._joined(time.monotonic() + spec.timeout)
        except BaseException:
            backend.close()  # begins the abort (once), lets go of the store
            # A communicator the library created after that abort began (it
            # waited in the store for its id) is aborted here too: the
            # native abort covers the communicators that exist when called.
            with contextlib.suppress(Exception):
                calls.abort(pg)
            # The error's traceback holds this frame: it must not hold the
            # store's connection or the native group while someone keeps it.
            del store, pg
            raise
        return backend

    def _cancel(self, _: object) -> None:
        """The connect's ``cancel`` completed: abort (never blocks)."""
        self.abort()

    def _joined(self, deadline: float) -> None:
        """Wait until every peer has joined: a barrier, whose issue waits (in
        torch) for the non-blocking communicator to be ready, and whose event
        says every rank took part. Afterwards no op waits for a peer to join
        on the issuing thread. Ends early, raising, once the group is aborted
        (the connect was cancelled).

        Raises:
            TimeoutError: not every peer joined by ``deadline``.
            RuntimeError: the group was aborted, or the barrier failed.
        """
        op = self.barrier(max(0.0, deadline - time.monotonic()))
        ended = threading.Event()
        op.on_done(lambda _: ended.set())  # the group's watcher, as for any op
        if not ended.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"not every {self.flavor.library} peer joined in time")
        error = op.outcome()
        if error is not None:
            raise RuntimeError(
                f"the {self.flavor.library} communicator did not connect: {error.message}"
                if isinstance(error, CommError)
                else f"the {self.flavor.library} communicator did not connect: {error}"
            )

    # -- aborting ---------------------------------------------------------------
    def stopped(self) -> CommError | None:
        """The error ops not seen completed get once an abort has begun
        (``None`` before)."""
        return self._stop

    def abort(self, error: CommError | None = None, *, abandoned: bool = False) -> bool:
        """Abort the communicator, once: the native abort runs on a worker
        thread (it may block; never on the owner loop), after a flight
        recorder dump if ``TORCHFT_TRIGGER_FR_ON_ABORT=true``. ``error``: what
        the ops not seen completed end with (default ``CommAborted``).
        ``abandoned``: an op's ``abandon()`` began it, and that op's settler
        breaks the table with the real cause: the other ops end with this
        error without breaking it (so ``errored()`` names the deadline, not
        this abort). Whether this call was the one that began it."""
        with self._lock:
            if self._stop is not None:
                return False
            said = f"the {self.flavor.library} group was aborted"
            stop = error or (AbandonAbort(said) if abandoned else CommAborted(said))
            self._stop = stop
            pg = self._pg
        until = time.monotonic() + ABORT_BOUND
        get_runtime().workers.spawn(self._abort_native, pg, until=until)
        return True

    def _abort_native(self, pg: Any) -> None:
        try:
            dump_before_abort(self.calls, self._global_rank)
            self.calls.abort(pg)
        except Exception:
            log.exception("ftcomm: aborting the %s group failed", self.flavor.library)
        finally:
            self._pg = None  # aborted: dropping it now is quick, here, off the loop
            del pg
            self._aborted.set_result(None)

    def check_library(self) -> None:
        """Abort if the library reports an error (the watcher, while ops are pending)."""
        if self._stop is not None:
            return
        pg = self._pg
        if pg is None:
            return
        try:
            failure = self.calls.failed(pg)
        except Exception:  # a query that fails says nothing about the ops
            log.debug("ftcomm: querying the %s group's error failed", self.name, exc_info=True)
            return
        if failure is not None:
            self.abort(CommFailed(f"{self.flavor.library} reported {failure}"))

    def close(self) -> list[object]:
        """Abort the communicator (a reconfigure or shutdown; ncclCommAbort is
        bounded where a graceful destroy could wait on a dead peer)."""
        self.abort()
        store, self._store = self._store, None
        return [store] if store is not None else []

    def closed(self) -> concurrent.futures.Future[None]:
        """Completes once the native abort has returned."""
        return self._aborted

    # -- ops ------------------------------------------------------------------------
    def _opts(self, kind: type, reduce_op: object = None, root: int = 0) -> Any:
        """An options object, built once per (kind, op, root) and reused (c10d
        copies what it needs when it issues the op). No timeout: NCCL ignores
        a per-op one (its watchdog uses the group's, :data:`WATCHDOG_TIMEOUT`);
        the owner loop holds each op's deadline."""
        key = (kind, reduce_op, root)
        opts = self._options.get(key)
        if opts is None:
            if len(self._options) >= 64:  # many PREMUL_SUM factors: start over
                self._options.clear()
            opts = kind()
            if isinstance(reduce_op, PremulSum):  # NCCL's own, the factor with it
                opts.reduceOp = _make_nccl_premul_sum(reduce_op.factor)
            elif reduce_op is not None:
                opts.reduceOp = reduce_op
            if kind is BroadcastOptions:
                opts.rootRank = root
                opts.rootTensor = 0
            self._options[key] = opts
        return opts

    def _issue(self, tensors: Sequence[torch.Tensor], call: Callable[[Any], Any]) -> NativeOp:
        """Issue ``call(native group)`` over ``tensors`` (all of the op's, the
        first one's device being the op's) and record its event."""
        for t in tensors:
            self._check_device(t.device)
        device = tensors[0].device
        pg = self._pg  # before the flag: an abort that ends drops it
        stop = self._stop
        if stop is not None or pg is None:  # aborted (the group breaks on the error)
            raise self._refusal()
        try:
            work = call(pg)
            event = self.calls.record(work, device)
        except Exception as exc:
            # The error becomes the group's: its traceback must not hold the
            # native group (this frame's ``pg``) for as long as it is kept.
            del pg
            if self._stop is not None:  # an abort raced the issue: say why
                raise self._refusal() from None
            raise exc.with_traceback(None) from exc.__cause__
        return EventOp(self, work, event, device)

    def _check_device(self, device: torch.device) -> None:
        """A tensor on another device than the communicator's would make c10d
        build a second communicator on the issuing thread, which waits there
        for every peer (an event loop's, maybe): refused.

        Raises:
            ValueError: ``device`` is not the group's.
        """
        mine = self.device.index
        if device.index is not None and mine is not None and device.index != mine:
            raise ValueError(
                f"the tensors are on {device}, and this {self.flavor.library} group on "
                f"{self.device} (configure(device_id=...) chooses it)"
            )

    def _refusal(self) -> CommError:
        stop = self._stop
        if stop is None:
            return CommAborted(f"the {self.flavor.library} group was aborted")
        return stop.at(None, None, None)  # a copy: raising adds a traceback

    def allreduce(
        self, tensors: Sequence[torch.Tensor], op: ReduceOpArg, timeout: float
    ) -> NativeOp:
        ts = list(tensors)
        if len(ts) == 1:
            opts = self._opts(AllreduceOptions, op)
            return self._issue(ts, lambda pg: pg.allreduce(ts, opts))
        copts = self._opts(AllreduceCoalescedOptions, op)
        return self._issue(ts, lambda pg: pg.allreduce_coalesced(ts, copts))

    def allgather(
        self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, timeout: float
    ) -> NativeOp:
        opts = self._opts(AllgatherOptions)
        outs = [list(outputs)]
        return self._issue([tensor, *outputs], lambda pg: pg.allgather(outs, [tensor], opts))

    def allgather_into_tensor(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], timeout: float
    ) -> NativeOp:
        opts = self._opts(AllgatherOptions)
        pairs = list(zip(outputs, inputs, strict=True))
        return self._issue(
            [*inputs, *outputs], lambda pg: coalesced(pg, "_allgather_base", pairs, opts)
        )

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float) -> NativeOp:
        opts = self._opts(BroadcastOptions, root=root)
        return self._issue([tensor], lambda pg: pg.broadcast([tensor], opts))

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOpArg,
        timeout: float,
    ) -> NativeOp:
        opts = self._opts(ReduceScatterOptions, op)
        ins = [list(inputs)]
        return self._issue([output, *inputs], lambda pg: pg.reduce_scatter([output], ins, opts))

    def reduce_scatter_tensor(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        op: ReduceOpArg,
        timeout: float,
    ) -> NativeOp:
        opts = self._opts(ReduceScatterOptions, op)
        pairs = list(zip(outputs, inputs, strict=True))
        return self._issue(
            [*outputs, *inputs], lambda pg: coalesced(pg, "_reduce_scatter_base", pairs, opts)
        )

    def alltoall_base(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        timeout: float,
    ) -> NativeOp:
        opts = self._opts(AllToAllOptions)
        return self._issue(
            [tensor, output],
            lambda pg: pg.alltoall_base(
                output, tensor, output_split_sizes, input_split_sizes, opts
            ),
        )

    def barrier(self, timeout: float) -> NativeOp:
        """An allreduce of one element: c10d's own barrier blocks the thread
        that waits on it until the device is done, and the owner loop must
        never block."""
        scratch = self._scratch
        if scratch is None:
            scratch = self._scratch = self.calls.scratch(self.device)
        opts = self._opts(AllreduceOptions, ReduceOp.SUM)
        return self._issue([scratch], lambda pg: pg.allreduce([scratch], opts))

    def send(self, tensor: torch.Tensor, dst: int, tag: int, timeout: float) -> NativeOp:
        return self._issue([tensor], lambda pg: pg.send([tensor], dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int, timeout: float) -> NativeOp:
        return self._issue([tensor], lambda pg: pg.recv([tensor], src, tag))


_warned_local: set[str] = set()


def warn_local_aborts(flavor: Flavor) -> None:
    """Warn, once per process and library, that its aborts stay local."""
    if flavor.name in _warned_local:
        return
    _warned_local.add(flavor.name)
    warnings.warn(
        f"ftcomm: torch's {flavor.library} backend has no abort: a deadline, cancel "
        "or abort() ends the op here and errors the group, but the communicator's "
        "kernels run on until they end by themselves and a peer may still complete "
        "the op (docs/errors.md, 'Abort truth table')",
        RuntimeWarning,
        stacklevel=2,
    )


def check_available(flavor: Flavor, calls: DeviceCalls | None = None) -> None:
    """Raise ``RuntimeError`` where torch has no ``flavor`` (or sees no device)."""
    calls = calls if calls is not None else device_calls(flavor)
    if not calls.available():
        raise RuntimeError(
            f"the {flavor.name!r} backend needs a torch build with {flavor.library} and a "
            f"{flavor.device_type} device; this one (torch {torch.__version__}) has none"
        )


_classes: dict[str, type[AcceleratorBackend]] = {}


def accelerator_class(name: str) -> type[AcceleratorBackend]:
    """The backend class for ``"nccl"`` or ``"xccl"`` (the same code, its own flavor)."""
    cls = _classes.get(name)
    if cls is None:
        flavor = FLAVORS[name]
        cls = type(
            f"{flavor.library}Backend",
            (AcceleratorBackend,),
            {
                "flavor": flavor,
                "name": flavor.name,
                "device_type": flavor.device_type,
                # XCCL's construction cannot be aborted: its connects are bounded.
                "stoppable_connect": flavor.real_abort,
            },
        )
        _classes[name] = cls
    return cls
