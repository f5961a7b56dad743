"""``Group(verify=True)``: the ranks agree on an op before it runs.

Owns an op's descriptor (:func:`describe`: ``DESC_LEN`` int64 naming the op, its
sequence number, dtypes, shapes, root or reduce op), the check of the
descriptors every rank sent (:func:`mismatch`), and :class:`Chain`, which
issues "descriptor 1, op 1, descriptor 2, op 2, ..." in one order on every
rank: an op goes only once every rank described the same one, and otherwise
fails with ``CommFailed`` on every rank, unsent. See docs/verify.md.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence

import torch

from ._runtime.native import Done, NativeOp
from ._runtime.work import SPIN_SECONDS
from .errors import CommAborted, CommError, CommFailed

DESC_LEN = 12
_VERSION = 1
_OPS = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_into_tensor_coalesced",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor_coalesced",
    "alltoall_base",
    "barrier",
)
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def describe(op: str, seq: int, tensors: Sequence[torch.Tensor], extra: int = 0) -> torch.Tensor:
    """This rank's descriptor of an op: what every rank must agree on.

    ``tensors``: those whose dtype and shape must be the same on every rank
    (the first one's dtype and first 3 dims are kept, and all their elements
    counted); ``extra``: a root, a reduce op or a dtype code that must agree.
    """
    first = tensors[0] if tensors else None
    dtype = -1 if first is None else dtype_code(first.dtype)
    shape = [] if first is None else list(first.shape)
    dims = [*shape[:3], -1, -1, -1][:3]
    numel = sum(t.numel() for t in tensors)
    # Every tensor's dtype and shape, not only the first's: a coalesced op
    # whose later tensors differ moves other byte counts on each rank.
    every = zlib.crc32(repr([(dtype_code(t.dtype), tuple(t.shape)) for t in tensors]).encode())
    row = [_VERSION, seq, _OPS.index(op), len(tensors), dtype, numel, len(shape), *dims, extra]
    return torch.tensor([*row, every], dtype=torch.int64)


def reduce_code(op: object) -> int:
    """A reduce op as a small integer, the same on every rank."""
    return int(getattr(op, "value", -1))


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype as a small integer, the same on every rank."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def explain(row: Sequence[int]) -> str:
    """A descriptor in words: ``allreduce #3 float32 [4, 2] (8 elements)``."""
    version, seq, op, count, dtype, numel, ndim = (int(x) for x in row[:7])
    if version != _VERSION or not 0 <= op < len(_OPS):
        return f"an unknown descriptor {list(map(int, row))}"
    name = _OPS[op]
    if dtype < 0:
        return f"{name} #{seq}"
    kind = str(_DTYPES[dtype]).removeprefix("torch.") if dtype < len(_DTYPES) else "other"
    dims = [int(d) for d in row[7 : 7 + min(ndim, 3)]]
    shape = ", ".join(map(str, dims)) + (", ..." if ndim > 3 else "")
    many = f" x{count}" if count > 1 else ""
    extra = f", root/op {int(row[10])}" if int(row[10]) else ""
    every = f", shapes {int(row[11]):08x}" if count > 1 else ""
    return f"{name} #{seq} {kind} [{shape}]{many} ({numel} elements{extra}{every})"


def mismatch(rows: torch.Tensor, rank: int) -> str | None:
    """Why the ranks' descriptors (one row each) disagree, or ``None``."""
    mine = rows[rank]
    for peer in range(rows.shape[0]):
        if peer != rank and not torch.equal(rows[peer], mine):
            return (
                f"the ranks issued different ops: rank {rank} issued {explain(mine.tolist())}, "
                f"rank {peer} issued {explain(rows[peer].tolist())}"
            )
    return None


Start = Callable[[float], NativeOp]
"""Issue the data op with the given seconds left."""
Exchange = Callable[[list[torch.Tensor], torch.Tensor, float], NativeOp]
"""Issue the descriptor allgather: (outputs, input, seconds)."""


class VerifiedOp:
    """A NativeOp in two stages: the descriptor exchange, then the op.

    Ends (``poll``/``on_done``) with the op's own end, or with the error that
    kept it from being issued.
    """

    def __init__(self, desc: torch.Tensor, start: Start, deadline: float) -> None:
        self.desc = desc
        self.start = start
        self.deadline = deadline
        self._lock = threading.Lock()
        self._data: NativeOp | None = None
        self._error: BaseException | None = None  # set once: it failed before its op
        self._callbacks: list[Done] = []
        self._stage: NativeOp | None = None  # what is running now (for abandon)
        self.abandoned = False

    # -- NativeOp ------------------------------------------------------------
    def poll(self) -> bool:
        data = self._data
        return data.poll() if data is not None else self._error is not None

    def outcome(self) -> BaseException | None:
        data = self._data
        return data.outcome() if data is not None else self._error

    def on_done(self, callback: Done) -> None:
        with self._lock:
            data = self._data
            if data is None and self._error is None:
                self._callbacks.append(callback)
                return
        if data is not None:
            data.on_done(callback)
        else:
            callback(self._error)

    def peek(self) -> bool:
        """``poll`` without side effects (see NativeOp)."""
        data = self._data
        if data is None:
            return self._error is not None
        peek = getattr(data, "peek", None)
        return bool(peek()) if peek is not None else data.poll()

    @property
    def spin(self) -> float:
        """How long an awaiter polls: the op's own (a subprocess call: 0)."""
        return float(getattr(self._data, "spin", SPIN_SECONDS))

    def abandon(self) -> bool:
        """Never issue the op; stop the stage running now (see NativeOp)."""
        self.abandoned = True
        stage = self._stage
        abandon = getattr(stage, "abandon", None)
        return bool(abandon()) if abandon is not None else False

    # -- the chain's side ----------------------------------------------------
    def _attach(self, data: NativeOp) -> None:
        with self._lock:
            self._data = data
            self._stage = data
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            data.on_done(cb)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is not None or self._data is not None:
                return
            self._error = error
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(error)


class Chain:
    """Issues one configuration's verified ops, descriptor then op, in order."""

    def __init__(
        self,
        exchange: Exchange,
        rank: int,
        world_size: int,
        on_error: Callable[[CommError], None] | None = None,
    ) -> None:
        self._exchange = exchange
        self._on_error = on_error  # breaks the group's table at once
        self._rank = rank
        self._world = world_size
        self._lock = threading.Lock()
        self._queue: deque[VerifiedOp] = deque()
        self._busy = False
        self._seq = 0
        self._broken: BaseException | None = None

    def next_seq(self) -> int:
        """The sequence number of the next verified op (issue order)."""
        with self._lock:
            self._seq += 1
            return self._seq

    def submit(self, vop: VerifiedOp) -> VerifiedOp:
        with self._lock:
            if self._busy:
                self._queue.append(vop)
                return vop
            self._busy = True
        self._run(vop)
        return vop

    def _run(self, vop: VerifiedOp | None) -> None:
        """Issue descriptor exchanges until one is still running (its end
        goes on from its callback) or none is left."""
        while vop is not None:
            if self._begin(vop):
                return
            vop = self._pop()

    def _pop(self) -> VerifiedOp | None:
        with self._lock:
            if not self._queue:
                self._busy = False
                return None
            return self._queue.popleft()

    def _begin(self, vop: VerifiedOp) -> bool:
        """Start ``vop``'s exchange; True if it is running (False: it ended
        here, and the next one may start)."""
        broken = self._broken
        if broken is not None:
            vop._fail(broken)
            return False
        if vop.abandoned:  # given up while queued: this rank would skip a slot
            self._break(vop, CommAborted("a verified op was given up before its check"))
            return False
        outs = [torch.empty(DESC_LEN, dtype=torch.int64) for _ in range(self._world)]
        try:
            exchange = self._exchange(outs, vop.desc, vop.deadline - time.monotonic())
        except Exception as exc:  # the native group refused: it is broken
            self._break(vop, exc)
            return False
        vop._stage = exchange
        me = threading.get_ident()
        registering = [True]
        finished: list[bool] = []

        def exchanged(error: BaseException | None) -> None:
            try:
                self._check(vop, outs, error)
            except BaseException as exc:  # a bug: the op must still end
                self._break(vop, exc)
                raise
            finally:
                if registering[0] and threading.get_ident() == me:
                    finished.append(True)  # ran inside on_done: _run's loop goes on
                else:
                    self._run(self._pop())

        exchange.on_done(exchanged)
        registering[0] = False
        return not finished

    def _check(
        self, vop: VerifiedOp, outs: list[torch.Tensor], error: BaseException | None
    ) -> None:
        if error is not None:
            self._break(vop, error)
            return
        why = mismatch(torch.stack(outs), self._rank)
        if why is not None:
            self._break(vop, CommFailed(why))
            return
        if vop.abandoned:
            # Given up after a check that every rank passed: the peers issue
            # the op in this slot, this rank would not. Nothing may follow.
            self._break(vop, CommAborted("a verified op was given up after its check"))
            return
        try:
            vop._attach(vop.start(vop.deadline - time.monotonic()))
        except Exception as exc:
            self._break(vop, exc)

    def _break(self, vop: VerifiedOp, error: BaseException) -> None:
        """End ``vop`` with ``error``; every later op of the chain fails with
        it, and the group's table breaks now, not when someone looks."""
        self._broken = error
        vop._fail(error)
        if self._on_error is not None:
            if isinstance(error, CommError):
                cause = error
            else:
                cause = CommFailed(f"the check before an op failed: {error}")
                cause.__cause__ = error
            self._on_error(cause)
