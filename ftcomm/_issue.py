"""The issuer: how a :class:`~ftcomm.Group` puts an op on the wire, one at a
time, in call order.

Owns the issue lock, fusion (``fuse=True``, ``batch()``, ``flush()``: the open
batch and when it is sent; the batch itself is ``_runtime/fuse.py``'s), the
default deadline, and the one issue path: the open and configured checks, the
fault seam, ``verify=True``'s agreement, the op table's record of each op, and
the short path of the plain small allreduce. See docs/ops.md and docs/fusion.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

import torch
from torch.distributed import ReduceOp

from ._runtime import faults
from ._runtime.deadline import Timeout, to_seconds
from ._runtime.fuse import MAX_OP_FRACTION, Batch, MemberOp, copy_back_cpu
from ._runtime.native import NativeOp, without_tracebacks
from ._runtime.table import AbandonAbort, Broken, CutPoint, OpTable, aborted_by, as_seen
from ._runtime.work import Work
from ._state import Config, GroupCore
from ._validate import ReduceOpArg
from ._verify import Chain, VerifiedOp, describe, reduce_code
from .backends import Backend
from .errors import CommAborted, CommError, CommFailed, NotConfigured

R = TypeVar("R")
_SUM = ReduceOp.SUM
_STRIDED = torch.strided

_BATCH_SCOPES: contextvars.ContextVar[tuple[BatchScope, ...]] = contextvars.ContextVar(
    "ftcomm_batch_scopes", default=()
)
"""The :meth:`~ftcomm.Group.batch` blocks the current context is in (a task started
inside one copies it, and is in the block while the block lasts)."""


class BatchScope:
    """What :meth:`~ftcomm.Group.batch` returns: a block (``async with`` or ``with``)
    in which the group's small allreduces are fused; leaving it flushes.

    Raises:
        RuntimeError: entered again while entered.
    """

    __slots__ = ("_token", "active", "group", "issuer")

    def __init__(self, issuer: Issuer, group: object) -> None:
        self.issuer = issuer
        self.group = group  # the Group whose batch() made it
        self.active = False  # cleared at the block's end: tasks started in it see it
        self._token: contextvars.Token[tuple[BatchScope, ...]] | None = None

    def __enter__(self) -> BatchScope:
        if self._token is not None or self.active:
            raise RuntimeError("this group.batch() block is already entered: make another")
        self._token = _BATCH_SCOPES.set((*_BATCH_SCOPES.get(), self))
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        token, self._token = self._token, None
        self.active = False
        try:
            self.issuer.flush()
        finally:
            if token is not None:
                # An exit in another context (an async generator finalised
                # by the loop) cannot reset it: the block is over all the same.
                with contextlib.suppress(ValueError):
                    _BATCH_SCOPES.reset(token)

    async def __aenter__(self) -> BatchScope:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)


class Issuer:
    """A group's issue path: ops go from checked to on the wire one at a time,
    in call order, under the issue lock (not the state lock: issuing may
    wait on a native call, and transitions never wait)."""

    def __init__(self, core: GroupCore, timeout: float, fuse: bool, fuse_bytes: int) -> None:
        self.core = core
        self.timeout = timeout
        """The default deadline of ops issued from now on, in seconds."""
        self.fuse = fuse
        self.fuse_bytes = fuse_bytes
        self.fuse_op_bytes = fuse_bytes // MAX_OP_FRACTION
        self._lock = threading.Lock()

    def flush(self) -> None:
        """:meth:`ftcomm.Group.flush`: send the open batch, or mark a cut point."""
        cfg = self.core.config
        if cfg is None:
            return
        batch = cfg.batch
        if batch is not None:
            self._flush_batch(cfg, batch)
        else:
            with self._lock:
                cfg.fuse_alone = True  # a cut point, with nothing to send

    def short_allreduce(self, tensor: torch.Tensor) -> Work[torch.Tensor] | None:
        """The short path: issue a plain small allreduce (the default op and
        deadline) in one frame, or return ``None`` for the long path.

        It takes a dense contiguous CPU tensor of a dtype the backend sends,
        with no verify and no ``batch()`` block; with ``fuse=True``, one that
        goes on its own. It does what the long path does for such an op, in
        one frame and one call into the backend (through the fault seam where
        a test set one): the layers it skips cost ~10 µs on a ~120 µs op
        (tests/test_short_path.py holds the two paths to one outcome).

        The batch and ``fuse_alone`` are read here without the issue lock, as
        hints that send an op that will join a batch to the long path early
        (once a batch is open, its members skip the checks below); both are
        read again under the lock before the short path issues.
        """
        cfg = self.core.config
        if (
            cfg is None
            or (dtypes := cfg.short_dtypes) is None
            or cfg.batch is not None
            or _BATCH_SCOPES.get()
            or type(tensor) is not torch.Tensor
            or not tensor.is_cpu
            or tensor.is_nested
            or tensor.layout is not _STRIDED
            or tensor.dtype not in dtypes
            or not tensor.is_contiguous()
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            return None
        fusible = self.fuse and tensor.nelement() * tensor.element_size() <= self.fuse_op_bytes
        if fusible and not cfg.fuse_alone:
            return None  # it joins a batch
        table = cfg.table
        not_issued: tuple[CommError, Broken] | None = None
        with self._lock:
            # On the long path: an open batch (it goes first), a fusible op
            # that joins a batch (not the first since a cut point), and an
            # errored table (it refuses).
            if cfg.batch is not None or table.error is not None or (fusible and not cfg.fuse_alone):
                return None
            # A fusible op goes on its own, and the next one joins a batch
            # until its first look; any other op is a cut point.
            cfg.fuse_alone = not fusible
            seconds = self.timeout
            issued = time.perf_counter()  # for its latency
            deadline = time.monotonic() + seconds
            backend = cfg.backend
            inject = faults.injector  # tests: the fault seam, as on the long path
            try:
                if inject is None:
                    native = backend.allreduce_sum(tensor, seconds)
                else:
                    native = inject(
                        "allreduce", lambda: backend.allreduce_sum(tensor, seconds), backend
                    )
            except (CommError, RuntimeError) as exc:
                not_issued = self._not_issued_locked(table, "allreduce", exc)
            else:
                # A fusible op's first look is a cut point (set before anyone sees it).
                mark = cfg.alone_mark if fusible else None
                seq = table.next_seq()
                work = Work(table, "allreduce", seq, deadline, native, tensor, issued, mark)
                table.track(work, seconds)
                return work
        # Refused: raised with the lock released (every other way out returned).
        assert not_issued is not None
        self._raise_not_issued(table, "allreduce", *not_issued)

    def allreduce(
        self, cfg: Config, tensor: torch.Tensor, rop: ReduceOpArg, timeout: Timeout | None
    ) -> Work[torch.Tensor]:
        """A checked allreduce: fused into the open batch, or issued alone."""
        if self._fusing(tensor):
            return self._enqueue(cfg, tensor, rop, timeout)
        return self.issue_allreduce(cfg, tensor, rop, timeout)

    def issue_allreduce(
        self,
        cfg: Config,
        tensor: torch.Tensor,
        rop: ReduceOpArg,
        timeout: Timeout | None,
        mark: CutPoint | None = None,
    ) -> Work[torch.Tensor]:
        """One allreduce of ``tensor``, on its own (see :meth:`issue`)."""
        return self.issue(
            cfg,
            "allreduce",
            timeout,
            tensor,
            lambda b, s: b.allreduce([tensor], rop, s),
            (tensor,),
            0 if cfg.chain is None else reduce_code(rop),  # only a verified op sends it
            mark,
        )

    def check_open(self, op: str) -> None:
        """Raise what issuing ``op`` now would raise at once: ``NotConfigured``,
        or ``CommAborted`` on an errored group (for ops that never reach a
        native group: the c10d dummy's)."""
        table = self.configured(op).table
        error = table.error
        if error is not None:
            raise _refused(op, error, table.rank) from error

    def configured(self, op: str) -> Config:
        """The configuration ``op`` issues on; raises ``NotConfigured``, or
        the error that left the group without one."""
        cfg = self.core.config
        if cfg is None:
            error = self.core.errored()
            if error is not None:
                raise _refused(op, error, None) from error
            state = self.core.state
            raise NotConfigured(
                f"{op} needs a configured group ({state.value}): await group.configure(...) first",
                op=op,
            )
        return cfg

    def issue(
        self,
        cfg: Config,
        op: str,
        timeout: Timeout | None,
        result: R,
        start: Callable[[Backend, float], NativeOp],
        check: Sequence[torch.Tensor] | None = (),
        extra: int = 0,
        mark: CutPoint | None = None,
    ) -> Work[R]:
        """Issue ``start``; with ``verify=True``, after the ranks agreed on
        ``check``'s dtypes and shapes and on ``extra`` (``None``: unchecked).
        ``mark``: a fusible op going on its own holds the cut point its first
        look reaches (and is not one itself); any other op is a cut point.
        :meth:`short_allreduce` does what this does for a plain op, in one
        frame: a change here is a change there (tests/test_short_path.py)."""
        seconds = self.timeout if timeout is None else to_seconds(timeout)
        table = cfg.table
        not_issued: tuple[CommError, Broken] | None = None
        sent: Callable[[], object] | None = None
        try:
            with self._lock:
                if cfg.batch is not None:  # an op that cannot join it: the batch goes first
                    sent = self._send_locked(cfg)
                if mark is None:  # an op that cannot join a batch: the next fusible op goes at once
                    cfg.fuse_alone = True
                error = table.error
                if error is not None:
                    raise _refused(op, error, table.rank) from error
                issued = time.perf_counter()  # for its latency
                deadline = time.monotonic() + seconds
                try:
                    native = self._start_locked(cfg, op, start, check, extra, deadline, seconds)
                except (CommError, RuntimeError) as exc:
                    not_issued = self._not_issued_locked(table, op, exc)
                else:
                    seq = table.next_seq()
                    work = Work(table, op, seq, deadline, native, result, issued, mark)
                    table.track(work, seconds)
        finally:
            if sent is not None:
                sent()
        if not_issued is None:
            return work
        self._raise_not_issued(table, op, *not_issued)

    def _not_issued_locked(
        self, table: OpTable, op: str, exc: CommError | RuntimeError
    ) -> tuple[CommError, Broken]:
        """Under the issue lock: the native group refused to issue ``op``
        (``exc``): break the table (marked under the locks; the ops it ends,
        and their callbacks, which may issue ops, end with the issue lock
        released, in :meth:`_raise_not_issued`). Returns the op's error and
        the break."""
        refused = self._refused(table, op, exc)
        if isinstance(exc, AbandonAbort):
            # Another op's abandon() stopped the native group; its
            # settler is breaking the table with the real cause.
            raise refused from exc.__cause__
        with table.lock:
            return refused, table.break_locked(refused)

    @staticmethod
    def _raise_not_issued(table: OpTable, op: str, refused: CommError, broken: Broken) -> NoReturn:
        """After :meth:`_not_issued_locked`, with the issue lock released: end
        the ops the break ended, and raise the op's error (or, if another
        error broke the table first, ``CommAborted`` naming it)."""
        table.after_break(broken, time.monotonic())
        if broken.cause is refused:
            raise refused from refused.__cause__
        aborted = CommAborted(
            f"{op} refused: the group broke while it was issued ({broken.cause.message})",
            rank=table.rank,
            op=op,
        )
        raise aborted from broken.cause

    def _start_locked(
        self,
        cfg: Config,
        op: str,
        start: Callable[[Backend, float], NativeOp],
        check: Sequence[torch.Tensor] | None,
        extra: int,
        deadline: float,
        seconds: float,
    ) -> NativeOp:
        """Issue one native op (under the issue lock): behind the descriptor
        check with ``verify=True``, through the fault seam in tests."""
        if cfg.chain is not None and check is not None:
            start = self._verified(cfg.chain, op, check, extra, deadline, start)
        inject = faults.injector
        if inject is None:
            return start(cfg.backend, seconds)
        return inject(op, lambda: start(cfg.backend, seconds), cfg.backend)

    # -- fusing (fuse.py; docs/fusion.md) ---------
    def _fusing(self, tensor: torch.Tensor) -> bool:
        """Whether an allreduce of ``tensor`` joins the open batch: a small
        one in host memory (the copy back of device tensors would need its
        stream ordered: not done yet)."""
        # _BATCH_SCOPES is () where no block is open, the usual case: no call
        if not self.fuse and not (_BATCH_SCOPES.get() and self._in_block()):
            return False
        return tensor.is_cpu and tensor.nelement() * tensor.element_size() <= self.fuse_op_bytes

    def _in_block(self) -> bool:
        """Whether the calling context is in a :meth:`batch` block of this group."""
        scopes = _BATCH_SCOPES.get()
        return bool(scopes) and any(s.issuer is self and s.active for s in scopes)

    def _enqueue(
        self, cfg: Config, tensor: torch.Tensor, rop: ReduceOpArg, timeout: Timeout | None
    ) -> Work[torch.Tensor]:
        """A small allreduce, fused: it joins the open batch (one of its key:
        dtype and reduce op; else the open one is sent first, a cut point);
        a batch that reaches ``fuse_bytes`` is sent. With ``fuse=True``, the
        first one after a cut point goes at once, on its own (docs/fusion.md);
        a plain lone op goes so by :meth:`short_allreduce`, which must keep
        to these rules."""
        seconds = self.timeout if timeout is None else to_seconds(timeout)
        table = cfg.table
        dtype = tensor.dtype
        nbytes = tensor.nelement() * tensor.element_size()
        after: Callable[[], object] | None = None
        work: Work[torch.Tensor] | None = None
        try:
            with self._lock:
                batch = cfg.batch
                if batch is not None and (
                    batch.dtype is not dtype
                    or batch.op != rop
                    or batch.nbytes + nbytes > self.fuse_bytes
                ):
                    after = self._send_locked(cfg)  # a cut point: the open one goes first
                    batch = None
                error = table.error
                if error is not None:
                    raise _refused("allreduce", error, table.rank) from error
                if batch is None and cfg.fuse_alone and self.fuse and not self._in_block():
                    # The first fusible op since a cut point goes on its own,
                    # below (a lone op awaited before the next is issued waits
                    # for nothing); its first look is a cut point.
                    cfg.fuse_alone = False
                else:
                    if batch is None:
                        batch = cfg.batch = Batch(
                            table, dtype, rop, lambda b: self._flush_batch(cfg, b), copy_back_cpu
                        )
                    member = MemberOp(batch)
                    work = Work(
                        table,
                        "allreduce",
                        table.next_seq(),
                        time.monotonic() + seconds,
                        member,
                        tensor,
                        time.perf_counter(),
                        batch,
                    )
                    member.work = work
                    batch.add(work, tensor, nbytes)
                    table.track(work, seconds)
                    if batch.nbytes >= self.fuse_bytes and after is None:
                        after = self._send_locked(cfg)  # full (a new batch never is)
        finally:
            if after is not None:
                after()
        if work is not None:
            return work
        return self.issue_allreduce(cfg, tensor, rop, timeout, cfg.alone_mark)

    def _flush_batch(self, cfg: Config, batch: Batch) -> None:
        """Send ``batch`` if it is still ``cfg``'s open one."""
        after = None
        with self._lock:
            if cfg.batch is batch:
                after = self._send_locked(cfg)
        if after is not None:
            after()

    def _send_locked(self, cfg: Config) -> Callable[[], object] | None:
        """Send the open batch as one native allreduce (under the issue lock,
        in program order); what to run once the lock is released (a refused
        batch breaks the group: its ops end, and their callbacks run)."""
        batch, cfg.batch = cfg.batch, None
        table = cfg.table
        cfg.fuse_alone = True  # a cut point
        if batch is None:
            return None
        if table.error is not None:  # broken: its ops are ending (or end at track)
            batch.abandon()
            return None
        if not batch.begin_send():  # a settler dropped it: the group is breaking
            return None
        rop = batch.op
        deadline = batch.deadline  # its members' earliest
        seconds = max(deadline - time.monotonic(), 0.001)
        try:
            flat = batch.pack()
            native = self._start_locked(
                cfg,
                "allreduce",
                lambda b, s: b.allreduce([flat], rop, s),
                # verify=True checks the members, not the flat buffer: ranks
                # whose batches differ but add up to as many elements would
                # otherwise mix their data unseen (and a lone op of 5 elements
                # would pass for a batch of 2 and 3).
                batch.tensors,
                reduce_code(rop),
                deadline,
                seconds,
            )
        except BaseException as exc:  # the peers sent it: the group is broken
            # Whatever it was (a refusal, no room in /dev/shm, no memory for
            # the flat buffer, an interrupt), the peers issued this op and we
            # did not: the group is broken, and the ops fail. The call that
            # made the cut (an await, an issue, a flush) does not raise it,
            # but for an interrupt, raised again once the lock is released.
            interrupt = None if isinstance(exc, Exception) else exc
            if interrupt is None:
                refused = self._refused(table, "allreduce", exc)  # type: ignore[arg-type]
            else:
                refused = CommFailed(
                    f"allreduce was interrupted while its batch was sent ({type(exc).__name__})",
                    rank=table.rank,
                    op="allreduce",
                )
            if isinstance(exc, AbandonAbort):
                # The settler that stopped the group breaks it: the members end
                # with the stop's error, still marked so that they do not (each
                # sees a plain CommAborted: table.as_seen).
                return batch.refuse(without_tracebacks(exc).at(table.rank, "allreduce", None))
            with table.lock:
                broken = table.break_locked(refused)
            if broken.cause is not refused:
                # Refused because the group is being stopped (another op's
                # deadline or cancel shut its sockets): its ops are aborted
                # by that, as the ops its break ends.
                refused = aborted_by(broken.cause, rank=table.rank, op="allreduce")
            announce = batch.refuse(refused)

            def after() -> None:
                try:
                    table.after_break(broken, time.monotonic())
                finally:
                    announce()
                if interrupt is not None:
                    raise interrupt

            return after
        return batch.sent(native)

    @staticmethod
    def _verified(
        chain: Chain,
        op: str,
        check: Sequence[torch.Tensor],
        extra: int,
        deadline: float,
        start: Callable[[Backend, float], NativeOp],
    ) -> Callable[[Backend, float], NativeOp]:
        """``start`` behind a descriptor check (``verify=True``; under the issue lock)."""
        desc = describe(op, chain.next_seq(), check, extra)

        def verified(backend: Backend, seconds: float) -> NativeOp:
            vop = VerifiedOp(desc, lambda s: start(backend, s), deadline)
            return chain.submit(vop)

        return verified

    @staticmethod
    def _refused(table: OpTable, op: str, exc: Exception) -> CommError:
        """The error of an op the native group refused to issue. Arguments
        were checked before, so this is a broken group (Gloo: "Application
        timeout caused pair closure"); a CommError from below (a dead worker)
        says what broke.

        The error is kept (``errored()``, until ``configure()``): ``exc``
        and the errors chained to it lose their tracebacks, whose frames
        hold the refused op's tensors (a batch's members and flat buffer, a
        staging segment) and the native group."""
        exc = without_tracebacks(exc)
        if isinstance(exc, CommError):
            return as_seen(exc.at(table.rank, op, None))
        failed = CommFailed(f"{op} could not be issued: {exc}", rank=table.rank, op=op)
        failed.__cause__ = exc
        return failed


def _refused(op: str, error: CommError, rank: int | None) -> CommAborted:
    """The error an op issued on a group that ``error`` broke raises."""
    return CommAborted(
        f"{op} refused: the group is errored ({error.message}); call configure()",
        rank=rank,
        op=op,
    )
