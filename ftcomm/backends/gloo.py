"""In-process c10d Gloo on CPU tensors.

Owns :class:`GlooBackend`: every collective issued with the time left to its
deadline as its own Gloo timeout (``abort()`` and ``shutdown()`` do nothing);
send and recv waited on by spawned threads; ``reduce_scatter`` and coalesced
allgathers made of ops with futures (:class:`WorksOp`); the group built
through a store view a given-up connect stops (``StoppableStore``); the real
abort, by severing its pairs (``_gloo_pairs.py``). The facts of torch's Gloo
it is built around: docs/gloo.md.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
)
from torch.distributed import ReduceOp

from .._meet import StoppableStore, mark_native, meet, peer_refused
from .._runtime.loop import get_runtime
from .._runtime.native import (
    NativeOp,
    Sever,
    ThenOp,
    ThreadOp,
    WorkOp,
    WorksOp,
    divide,
    write_outputs,
)
from .._runtime.threads import Handoff
from .._store import StoreAddr, connect_store
from .._validate import PremulSum, ReduceOpArg
from ._base import NUMERIC_DTYPES, Backend, ConnectSpec
from ._gloo_pairs import (
    LISTENER_KEY,
    PairSockets,
    decode_addr,
    encode_addr,
    find_pairs,
    make_device,
    socket_inodes,
)

log = logging.getLogger("ftcomm")
_SUM = ReduceOp.SUM

_MIN_NATIVE_TIMEOUT = 0.001

_warned_local = threading.Event()


def warn_local_aborts() -> None:
    """Warn, once per process, that a Gloo group's aborts stay local."""
    if _warned_local.is_set():
        return
    _warned_local.set()
    warnings.warn(
        "ftcomm: the Gloo group's sockets could not be identified exactly, so an "
        "abort, deadline or cancellation gives up its op on this rank only: the "
        "native op may still write into its tensors until its own timeout, and "
        "a late peer may complete it (see docs/errors.md, 'Abort truth table'). "
        "subprocess=True aborts for real.",
        RuntimeWarning,
        stacklevel=2,
    )


def _td(seconds: float) -> timedelta:
    # Gloo reads a zero timeout as "use the default": never hand it zero.
    return timedelta(seconds=max(seconds, _MIN_NATIVE_TIMEOUT))


HOST_ENV = "FTCOMM_GLOO_HOST"
"""Where this rank's Gloo listens, if set: an address or host name of this
machine (ranks on 127.0.0.2 and 127.0.0.3 stand in for two hosts)."""


def _device(addr: StoreAddr) -> tuple[object, tuple[str, int] | None]:
    """Where Gloo listens (``$FTCOMM_GLOO_HOST``; else the store's loopback
    address; else Gloo's default: the address this machine's host name
    resolves to, or ``$GLOO_SOCKET_IFNAME``'s), and the address of its
    listening socket if found exactly."""
    pg_gloo: Any = dist.ProcessGroupGloo
    own = os.environ.get(HOST_ENV, "").strip()
    if own:
        try:
            return make_device(lambda: pg_gloo.create_device(hostname=own))
        except RuntimeError as exc:  # Gloo's own words name neither the variable nor why
            raise RuntimeError(
                f"{HOST_ENV}={own!r} is not an address of this machine to listen on: {exc}"
            ) from exc
    if addr.is_loopback:
        host = "127.0.0.1" if addr.host == "localhost" else addr.host
        return make_device(lambda: pg_gloo.create_device(hostname=host))
    return make_device(pg_gloo.create_default_device)


def _listeners(store: Any, world_size: int) -> list[tuple[str, int] | None]:
    """Every member's listener address as published (``None`` where missing:
    a member that is not ftcomm's publishes none, and is not waited for)."""
    keys = [LISTENER_KEY.format(rank=r) for r in range(world_size)]
    if not store.check(keys):
        log.debug("ftcomm: a member published no Gloo listener address")
        return [None] * world_size
    return [decode_addr(bytes(value)) for value in store.multi_get(keys)]


_FUSE_MAX_BYTES = 4 << 20
"""A reduce-scatter's buffers (every rank's chunk of every pair) are packed, by
dtype and in order, into fused ``allreduce_coalesced`` calls of up to this
many bytes each; a buffer this big or bigger goes alone, as one in-place
allreduce (no extra copy), as in Gloo's own reduce-scatter. Measured, 2
ranks, ``await``, p50, 2 busy cores: fused beats Gloo's own (waited on a
thread) on small chunks (4 B: 0.35-0.4 against 0.5-0.55 ms; 64 KiB: 0.6
against 0.8 ms) and is never worse up to 1 MiB chunks, where two allreduces
in flight at once sometimes take 15-40 ms; with 16 MiB chunks its copies
lose (69-90 against 26-46 ms); 4 MiB chunks are about even. Packing by
bucket, not by the op's total, keeps an op just past the cap from falling
back to one allreduce per small chunk (16x slower: 21 ms against 310-450 ms
for 513 pairs of 4 KiB outputs)."""


def _wait(work: dist.Work, deadline: float) -> None:
    work.wait(_td(deadline - time.monotonic()))


def _waited(work: dist.Work, timeout: float, sever: Sever | None) -> NativeOp:
    """An op over a work that learns it completed only inside ``wait()``.

    Waited on a thread that starts now, not queued behind other waits: it
    only sleeps in C++ (GIL released) and ends by the op's deadline (a
    ``wait()`` past it fails the op and closes the group's pairs). If no
    thread can be started, the posted work goes to the reaper (dropping it
    may block until its deadline) and the error is raised: the group is then
    errored, as for any op its native group refused.
    """
    deadline = time.monotonic() + timeout
    rt = get_runtime()
    try:
        return ThreadOp(rt.workers.spawn(_wait, work, deadline, until=deadline), sever)
    except BaseException:
        rt.dispose(work, until=deadline)
        raise


def _scatter_buffers(
    pairs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]], rank: int
) -> list[torch.Tensor]:
    """The tensors to allreduce so that each pair's ``output`` ends up
    holding this rank's reduced chunk: the output itself, filled with this
    rank's chunk, and a copy of every other chunk (reduced too, then
    dropped), pair after pair. Gloo's own reduce-scatter does the same, less
    the wait it needs to end.

    Every chunk is read before any output is written: an output may overlap
    a chunk of its own pair or of another pair, and the caller's inputs are
    never written.
    """
    outputs = {o.untyped_storage().data_ptr() for o, _ in pairs}
    bufs: list[list[torch.Tensor]] = []
    own: list[torch.Tensor] = []
    for output, chunks in pairs:
        bufs.append([output if d == rank else c.clone() for d, c in enumerate(chunks)])
        mine = chunks[rank]
        shared = mine.untyped_storage().data_ptr() in outputs and mine is not output
        own.append(mine.clone() if shared else mine)
    write_outputs((output, mine) for (output, _), mine in zip(pairs, own, strict=True))
    return [b for pair in bufs for b in pair]


def _premultiply(tensors: Sequence[torch.Tensor], factor: float) -> None:
    """PREMUL_SUM's first half, in place (unrecorded by autograd, as a
    native op writes): each rank's own input times its own factor, so that
    ranks with different factors get NCCL's answer, and a float16 sum stays
    in range where the scaled sum does."""
    with torch.inference_mode():
        for t in tensors:
            t.mul_(factor)


def _buckets(bufs: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``bufs`` packed by dtype, in order, into buckets of at most
    :data:`_FUSE_MAX_BYTES` (one buffer that big or bigger: a bucket alone).
    The same on every rank: it depends on shapes and dtypes only."""
    buckets: list[list[torch.Tensor]] = []
    open_: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = {}
    for b in bufs:
        size = b.numel() * b.element_size()
        if size >= _FUSE_MAX_BYTES:
            buckets.append([b])
            continue
        bucket, used = open_.get(b.dtype, (None, [0]))
        if bucket is None or used[0] + size > _FUSE_MAX_BYTES:
            bucket, used = [], [0]
            buckets.append(bucket)
            open_[b.dtype] = (bucket, used)
        bucket.append(b)
        used[0] += size
    return buckets


class GlooBackend(Backend):
    name: ClassVar[str] = "gloo"
    device_type = "cpu"
    dtypes: ClassVar[frozenset[torch.dtype] | None] = NUMERIC_DTYPES | {
        torch.complex64,
        torch.complex128,
    }
    # AVG and PREMUL_SUM are not Gloo's: a SUM, then a division (ThenOp)
    # before the op ends; each rank's input multiplied, then a SUM
    reduce_ops: ClassVar[frozenset[ReduceOp.RedOpType]] = frozenset(
        {
            ReduceOp.SUM,
            ReduceOp.AVG,
            ReduceOp.PREMUL_SUM,
            ReduceOp.PRODUCT,
            ReduceOp.MIN,
            ReduceOp.MAX,
            ReduceOp.BAND,
            ReduceOp.BOR,
            ReduceOp.BXOR,
        }
    )

    int_avg: ClassVar[bool] = False  # its AVG is a SUM and a division (PREMUL_SUM alike)
    short_allreduce: ClassVar[bool] = True

    def __init__(
        self,
        pg: Any,
        store: object,
        rank: int,
        world_size: int,
        pairs: PairSockets | None = None,
    ) -> None:
        super().__init__(rank, world_size)
        # Any: torch's stubs for ProcessGroupGloo lack most backend methods.
        self._pg: Any = pg
        self._store: object | None = store
        self._options: dict[tuple[object, ...], Any] = {}
        # allreduce_sum's (timeout, options); like _options, under the group's issue lock
        self._sum_options: tuple[float, Any] | None = None
        self._pairs = pairs
        self._sever = None if pairs is None else pairs.abort  # not self.sever: no cycle

    @property
    def aborts_for_real(self) -> bool:
        """Whether an abort stops the native group for every member (its pair
        sockets were found), rather than only giving up locally."""
        return self._pairs is not None

    def sever(self) -> bool:
        """Shut down the group's pair sockets (once; then a no-op): every op in
        flight fails within milliseconds, here and at every peer, and so do
        later ones. False when they are not known (an abort stays local)."""
        pairs = self._pairs
        if pairs is None:
            return False
        pairs.sever()
        return True

    def _opts(self, kind: type, timeout: float, reduce_op: object = None, root: int = 0) -> Any:
        """An options object, built once per (kind, timeout, op, root) and reused.

        c10d copies what it needs out of the options when it issues the op and
        ftcomm never changes one after building it, so reusing them is safe; it
        saves building a pybind object and a timedelta on every small op.
        """
        key = (kind, timeout, reduce_op, root)
        opts = self._options.get(key)
        if opts is None:
            if len(self._options) >= 64:  # many distinct per-op timeouts: start over
                self._options.clear()
            opts = kind()
            opts.timeout = _td(timeout)
            if reduce_op is not None:
                opts.reduceOp = reduce_op
            if kind is BroadcastOptions:
                opts.rootRank = root
                opts.rootTensor = 0
            self._options[key] = opts
        return opts

    @classmethod
    def connect(
        cls, spec: ConnectSpec, cancel: concurrent.futures.Future[Any] | None = None
    ) -> GlooBackend:
        deadline = time.monotonic() + spec.timeout
        progress = spec.progress
        store = connect_store(spec.store, spec.timeout, progress, cancel)
        progress.step, progress.detail = "meet", "this rank was still setting up"
        pg_gloo: Any = dist.ProcessGroupGloo
        opts = pg_gloo._Options()
        opts._timeout = timedelta(seconds=spec.timeout)
        device, listener = _device(spec.store)
        opts._devices = [device]
        if spec.global_ranks is not None:
            opts.global_ranks_in_group = list(spec.global_ranks)
        opts.group_name = f"ftcomm:{spec.replica_id}:{spec.quorum_id}:{spec.store.prefix}"
        where, rank = str(spec.store), spec.rank
        meet(store, rank, spec.world_size, deadline, progress, cancel, where=where, mark=False)
        if listener is not None:  # after the meet: a refused rank writes nothing here
            store.set(LISTENER_KEY.format(rank=rank), encode_addr(listener))
        progress.step = "native"
        before = socket_inodes()
        # The construction waits in the store for each peer's address until
        # its own timeout: through a view that ends those waits once nobody
        # waits for this connect (or a peer was refused at this prefix), it
        # gives its thread back at once. The view marks the rank just before
        # the group's first write (one native group per rank and prefix: a
        # group given up before it wrote leaves none). The group keeps the
        # view (plain from now on) as long as it lives.
        native_store = StoppableStore(
            store,
            cancel if cancel is not None else concurrent.futures.Future(),
            functools.partial(peer_refused, where, rank),
            lambda: mark_native(store, rank),
        )
        pg = pg_gloo(native_store, rank, spec.world_size, opts)
        native_store.built()
        pairs = None
        if listener is not None:
            pairs = find_pairs(before, _listeners(store, spec.world_size), spec.rank)
        if pairs is None:
            warn_local_aborts()
        return cls(pg, native_store, spec.rank, spec.world_size, pairs)

    def close(self) -> list[object]:
        """Let go of the native objects. Not a sever: an op in flight was
        severed when it was abandoned, and an idle group's connections close
        when it is dropped. (Severing here would also cut, in a process that
        holds several ranks of the group, pairs between the other ranks that
        are still finishing their last op.)"""
        pg, store = self._pg, self._store
        self._pg = self._store = None
        # The reaper drops a cell's objects last first: the group before the store
        # it was built through (a Python view it may still call as it ends).
        objs = [obj for obj in (store, pg) if obj is not None]
        # In a cell: the group's last reference must go on the reaper, never
        # on the thread that hands it over (a completion callback's, on one
        # of the threads the group's destructor joins): see Handoff.
        return [Handoff(*objs)] if objs else []

    @property
    def pg(self) -> Any:
        pg = self._pg
        if pg is None:
            raise RuntimeError("the Gloo group was closed")
        return pg

    def allreduce(
        self, tensors: Sequence[torch.Tensor], op: ReduceOpArg, timeout: float
    ) -> NativeOp:
        if op == ReduceOp.AVG:
            summed = self.allreduce(tensors, _SUM, timeout)
            return ThenOp(summed, divide(tensors, self.world_size))
        if isinstance(op, PremulSum):  # this rank's input scaled, then summed: NCCL's
            self.pg  # noqa: B018 - a closed group raises before the tensors are written
            _premultiply(tensors, op.factor)
            return self.allreduce(tensors, _SUM, timeout)
        if len(tensors) == 1:
            opts = self._opts(AllreduceOptions, timeout, op)
            return WorkOp(self.pg.allreduce(list(tensors), opts), self._sever)
        copts = self._opts(AllreduceCoalescedOptions, timeout, op)
        return WorkOp(self.pg.allreduce_coalesced(list(tensors), copts), self._sever)

    def allreduce_sum(self, tensor: torch.Tensor, timeout: float) -> NativeOp:
        # The small-op path: one Python frame between Group.allreduce and c10d
        # (Group.allreduce says what the layers it skips cost).
        cached = self._sum_options
        if cached is None or cached[0] != timeout:
            cached = self._sum_options = (timeout, self._opts(AllreduceOptions, timeout, _SUM))
        pg = self._pg
        if pg is None:
            raise RuntimeError("the Gloo group was closed")
        return WorkOp(pg.allreduce([tensor], cached[1]), self._sever)

    def allgather(
        self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, timeout: float
    ) -> NativeOp:
        opts = self._opts(AllgatherOptions, timeout)
        return WorkOp(self.pg.allgather([list(outputs)], [tensor], opts), self._sever)

    def allgather_into_tensor(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], timeout: float
    ) -> NativeOp:
        opts = self._opts(AllgatherOptions, timeout)
        pg = self.pg
        return WorksOp(
            [pg._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)],
            self._sever,
        )

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float) -> NativeOp:
        opts = self._opts(BroadcastOptions, timeout, root=root)
        return WorkOp(self.pg.broadcast([tensor], opts), self._sever)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOpArg,
        timeout: float,
    ) -> NativeOp:
        return self._reduce_scatter([(output, inputs)], op, timeout)

    def reduce_scatter_tensor(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        op: ReduceOpArg,
        timeout: float,
    ) -> NativeOp:
        n = self.world_size
        return self._reduce_scatter(
            [(o, i.chunk(n)) for o, i in zip(outputs, inputs, strict=True)], op, timeout
        )

    def _reduce_scatter(
        self,
        pairs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]],
        op: ReduceOpArg,
        timeout: float,
    ) -> NativeOp:
        """Reduce-scatter ``chunks`` (one per rank) into ``output``, for each pair:
        allreduces of the buffers of :func:`_scatter_buffers`, packed by
        :func:`_buckets` (see :data:`_FUSE_MAX_BYTES`)."""
        if op == ReduceOp.AVG:
            summed = self._reduce_scatter(pairs, _SUM, timeout)
            return ThenOp(summed, divide((o for o, _ in pairs), self.world_size))
        premul = op.factor if isinstance(op, PremulSum) else None
        op = _SUM if premul is not None else op
        pg = self.pg  # before any output is written
        bufs = _scatter_buffers(pairs, self.rank)  # the outputs, and copies of the inputs
        if premul is not None:  # this rank's shares scaled, then summed: NCCL's
            _premultiply(bufs, premul)
        works = []
        for bucket in _buckets(bufs):
            if len(bucket) == 1:
                works.append(pg.allreduce(bucket, self._opts(AllreduceOptions, timeout, op)))
            else:
                copts = self._opts(AllreduceCoalescedOptions, timeout, op)
                works.append(pg.allreduce_coalesced(bucket, copts))
        return WorkOp(works[0], self._sever) if len(works) == 1 else WorksOp(works, self._sever)

    def alltoall_base(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        timeout: float,
    ) -> NativeOp:
        opts = self._opts(AllToAllOptions, timeout)
        work = self.pg.alltoall_base(output, tensor, output_split_sizes, input_split_sizes, opts)
        return WorkOp(work, self._sever)

    def barrier(self, timeout: float) -> NativeOp:
        opts = self._opts(BarrierOptions, timeout)
        return WorkOp(self.pg.barrier(opts), self._sever)

    def send(self, tensor: torch.Tensor, dst: int, tag: int, timeout: float) -> NativeOp:
        return _waited(self.pg.send([tensor], dst, tag), timeout, self._sever)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, timeout: float) -> NativeOp:
        return _waited(self.pg.recv([tensor], src, tag), timeout, self._sever)
