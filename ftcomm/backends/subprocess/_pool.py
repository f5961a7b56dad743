"""The parent's side of shared memory: each worker's pool of segments, and
how an op's CPU tensors are staged in it.

Owns the pool of reusable segments (:class:`Pool`, whose docstring has the
rules), an op's staged tensors (:class:`Staged`), the caller storages the
worker maps in place (:class:`SharedStorages`) and the moves of storages into
shared memory. See docs/subprocess.md.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._protocol import Scalar, TensorDesc
from ._device import DeviceStaged, DeviceStorages, PoolClosed
from ._layout import dtype_name
from ._shm import EMPTY, FD_PREFIX, Segment

ALIGN = 64
MIN_SEGMENT = mmap.PAGESIZE

log = logging.getLogger("ftcomm")


def _size_class(nbytes: int) -> int:
    return max(MIN_SEGMENT, 1 << max(0, nbytes - 1).bit_length())


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _view(buf: mmap.mmap, dtype: torch.dtype, shape: Sequence[int], offset: int) -> torch.Tensor:
    """A contiguous tensor over ``buf`` at byte ``offset``."""
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    flat = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset)
    return flat.view(tuple(shape))


def _place(
    segment: Segment | None, t: torch.Tensor, offset: int
) -> tuple[torch.Tensor, TensorDesc]:
    """A contiguous view for ``t`` at byte ``offset`` of ``segment``, and its descriptor."""
    shape = tuple(t.shape)
    if segment is None or t.numel() == 0:
        view = torch.empty(shape, dtype=t.dtype)
        return view, TensorDesc(EMPTY, dtype_name(t.dtype), shape, tuple(view.stride()))
    key = (t.dtype, shape, offset)
    placed = segment.views.get(key)
    if placed is None:
        if len(segment.views) >= 64:
            segment.views.clear()
        view = _view(segment.buf, t.dtype, shape, offset)
        desc = TensorDesc(
            segment.name,
            dtype_name(t.dtype),
            shape,
            tuple(view.stride()),
            offset // t.element_size(),
        )
        placed = segment.views[key] = (view, desc)
    return placed


# Process-wide (any pool), by data_ptr, under `_moves`: caller storages being
# copied in or out by some op (pins: how many ops), and storages being moved
# into shared memory. A storage is moved only while nothing pins it, and
# nothing pins (or maps) it while it moves: no copy ever touches memory a
# move frees.
_pins: dict[int, int] = {}
_moving: set[int] = set()
_moves = threading.Condition()
# Large storages that went through an op before (rule 3 moves them the next
# time), and storages whose move failed (copied from then on).
_seen: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
_unmovable: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()


def _forget_after_fork() -> None:
    # A forked child has none of its parent's ops, and `_moves` may have been
    # held by another thread at the fork.
    global _moves
    _pins.clear()
    _moving.clear()
    _moves = threading.Condition()


os.register_at_fork(after_in_child=_forget_after_fork)


def _unpin(pins: Sequence[int]) -> None:
    """Drop one pin of each storage. Under ``_moves``."""
    for ptr in pins:
        left = _pins[ptr] - 1
        if left:
            _pins[ptr] = left
        else:
            del _pins[ptr]


def _move(storage: torch.UntypedStorage) -> None:
    """Move ``storage`` into shared memory, in place; marked as moving (no
    lock held: a large move takes a while). A failure (``/dev/shm`` full, no
    fds left) leaves it where it was, and it is copied from then on."""
    ptr = storage.data_ptr()
    try:
        storage.share_memory_()
    except (RuntimeError, OSError) as exc:
        _unmovable.add(storage)
        log.info(
            "ftcomm: a %d-byte storage stays copied: moving it failed: %s", storage.nbytes(), exc
        )
    finally:
        with _moves:
            _moving.discard(ptr)
            _moves.notify_all()


@dataclass(eq=False)
class Staged:
    """An op's tensors, copied into one segment: what to send and what to copy back."""

    segment: Segment | None
    descs: tuple[TensorDesc, ...]
    copy_back: list[tuple[torch.Tensor, torch.Tensor]]
    """(caller's tensor, its view in the segment), for the op's outputs."""
    fds: tuple[int, ...] = ()
    """Descriptors of shared storages the worker has not seen yet, sent with
    the OP (``SCM_RIGHTS``), in the order of ``options["fds"]``."""
    options: dict[str, Scalar] = field(default_factory=dict)
    """``fds`` (their inodes) and ``release`` (inodes of storages that died);
    for CUDA tensors, those of :class:`~._device.DeviceStorages`."""
    pins: tuple[int, ...] = ()
    """The caller storages this op copies (:data:`_pins`), until :meth:`unpin`."""
    device: DeviceStaged | None = None
    """For an op on CUDA tensors (passed by IPC handle): the caller's stream
    and event."""
    owners: tuple[torch.UntypedStorage, ...] = ()
    """The storages that own ``fds``: held until the OP carrying them is out
    (a tensor alone does not keep its storage's fd open once the caller
    drops it, and a queued OP may wait for room in the socket)."""

    def unpin(self) -> None:
        """Nothing is copied into or out of the caller's storages any more
        (idempotent)."""
        if not self.pins:  # most ops: nothing to take the lock for
            return
        with _moves:
            pins, self.pins = self.pins, ()
            _unpin(pins)


def _shared_fd(t: torch.Tensor) -> tuple[int, int] | None:
    """(fd, inode) of ``t``'s storage if it is in fd-backed shared memory."""
    storage = t.untyped_storage()
    if t.device.type != "cpu" or t.numel() == 0 or not storage.is_shared():
        return None
    try:
        fd = storage._get_shared_fd()  # type: ignore[attr-defined]  # its own fd (never moves it, unlike _share_fd_cpu_)
    except RuntimeError:  # shared by file name (the file_system strategy): copied
        return None
    return fd, os.fstat(fd).st_ino


class SharedStorages:
    """The storages in shared memory that one worker has mapped, by inode.

    Each is sent once (its fd rides with the first OP that uses it); when
    the caller's storage dies, the next OP tells the worker to unmap it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: dict[int, Any] = {}  # inode -> weakref.finalize of its storage
        self._dead: list[int] = []
        self._dying: collections.deque[int] = collections.deque()  # from finalizers

    def place(self, t: torch.Tensor, fd: int, ino: int, new: list[tuple[int, int]]) -> TensorDesc:
        with self._lock:
            self._drain()  # a dead storage's inode may be a new storage's now
            if ino not in self._sent and all(ino != i for _, i in new):
                new.append((fd, ino))
        return TensorDesc(
            f"{FD_PREFIX}{ino}",
            dtype_name(t.dtype),
            tuple(t.shape),
            tuple(t.stride()),
            int(t.storage_offset()),
        )

    def sent(self, t: torch.Tensor, ino: int) -> None:
        """``ino``'s fd went out: watch its storage (weakly) for its end."""
        with self._lock:
            if ino not in self._sent:
                self._sent[ino] = weakref.finalize(t.untyped_storage(), self._died, ino)

    def _died(self, ino: int) -> None:
        # A finalizer: it may run inside a garbage collection on a thread that
        # holds `_lock` (any allocation can start one), so it takes no lock.
        self._dying.append(ino)

    def unsend(self, sent: Scalar, released: Scalar) -> None:
        """An OP with options ``fds=sent`` and ``release=released`` never
        reached the worker: send those descriptors again with the next OP
        that uses them, and those releases with the next OP."""
        with self._lock:
            for ino in sent if isinstance(sent, tuple) else ():
                finalizer = self._sent.pop(ino, None)
                if finalizer is not None:
                    finalizer.detach()
            if isinstance(released, tuple):
                self._dead[:0] = released

    def _drain(self) -> None:
        """Move the storages that died to ``_dead``. Under ``_lock``."""
        while self._dying:
            ino = self._dying.popleft()
            if self._sent.pop(ino, None) is not None:
                self._dead.append(ino)

    def take_dead(self) -> tuple[int, ...]:
        with self._lock:
            self._drain()
            dead, self._dead = self._dead, []
        return tuple(dead)

    def close(self) -> None:
        with self._lock:
            finalizers, self._sent = list(self._sent.values()), {}
            self._dead.clear()
            self._dying.clear()
        for finalizer in finalizers:
            finalizer.detach()


class Pool:
    """The parent's segments for one worker (thread-safe).

    Tensors are *copied* through a reusable pool of segments: the caller's
    tensors stay where they are, and an op whose worker is killed cannot write
    into them afterwards (its segment simply stops being read). A copy is
    cheap next to moving a storage (docs/performance.md), and so is a
    segment (creating and unlinking one of 16 MiB took 0.03 ms on the 2-core
    CI machine).

    Rules (and those of the segments themselves, :class:`~._shm.Segment`'s):

    1. One segment per op, holding all its tensors contiguously, each at a
       64-byte aligned offset. Segments come in power-of-two sizes (at least
       one page) and go back to the pool when their op has ended and the
       worker is done with them; the pool lives as long as its worker, and
       peaks at the bytes that were in flight at once.
    2. A tensor whose storage is already in shared memory is not copied: its
       file descriptor goes to the worker once (:class:`SharedStorages`), and
       the worker maps the caller's storage itself.
    3. Opt-in (:attr:`share_min_bytes`, off by default): a CPU storage that a
       tensor of at least that many bytes brings back for another op is moved
       into shared memory in place (``share_memory_()``) and goes by rule 2
       from then on, the way training loops reuse their gradient buckets: two
       copies per op become none, for one move. A storage used by one op only
       is copied. Never moved: storages torch does not own (``from_numpy``,
       ``frombuffer``: not resizable), pinned memory, a storage some op is
       copying (:data:`_pins`), and one whose move failed once (it stays
       copied). Why it is off by default: docs/subprocess.md.
    """

    def __init__(self, share_min_bytes: int | None = None) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[Segment]] = {}
        self._all: list[Segment] = []
        self._closed = False
        self.shared = SharedStorages()
        self.share_min_bytes = share_min_bytes
        """Move a CPU tensor's storage into shared memory when a tensor of at
        least this many bytes on it comes back for another op (rule 3);
        ``None``: never."""
        self.device = DeviceStorages()
        """CUDA storages shared with the worker (IPC handles, not copies)."""

    def _movable(self, t: torch.Tensor) -> torch.UntypedStorage | None:
        """``t``'s storage if rule 3 may move it (size, owner, not pinned)."""
        limit = self.share_min_bytes
        if limit is None or not t.is_cpu or t.numel() * t.element_size() < max(limit, 1):
            return None
        storage = t.untyped_storage()
        if storage.is_shared() or not storage.resizable() or t.is_pinned():
            return None
        return None if storage in _unmovable else storage

    def stage(self, tensors: Sequence[tuple[torch.Tensor, str]]) -> Staged:
        """Lay an op's tensors out in one segment.

        ``tensors``: (tensor, role) pairs, role ``"in"`` (copied in),
        ``"out"`` (copied back when the op succeeds) or ``"inout"`` (both).

        Raises:
            ValueError: a dtype the protocol cannot carry, or a device it
                cannot reach (not CPU or CUDA), or CPU and CUDA tensors mixed.
            OSError: shared memory is exhausted (``ENOSPC``, naming
                :data:`~._shm.SHM_DIR` and its free space: nothing is staged).
            PoolClosed: the pool's worker is gone.
        """
        device_of = self.device.calls.device_of
        devices = [device_of(t) for t, _ in tensors]
        if any(d is not None for d in devices):
            return self._stage_device([t for t, _ in tensors], devices)
        for t, _ in tensors:
            if not t.is_cpu:
                raise ValueError(
                    f"the subprocess backend carries CPU and CUDA tensors, not {t.device.type}"
                )
        candidates = {id(s): s for s in map(self._movable, (t for t, _ in tensors)) if s}
        if candidates:  # opted in (rule 3), and some storage is large enough
            self._move_seen(tensors, candidates)
        with _moves:
            ptrs = {t.untyped_storage().data_ptr() for t, _ in tensors if t.numel()}
            while not ptrs.isdisjoint(_moving):
                _moves.wait()
            shared = [_shared_fd(t) for t, _ in tensors]
            pins = tuple(
                t.untyped_storage().data_ptr()
                for (t, _), fd in zip(tensors, shared, strict=True)
                if fd is None and t.numel()
            )
            for ptr in pins:
                _pins[ptr] = _pins.get(ptr, 0) + 1
        try:
            return self._stage(tensors, shared, pins)
        except BaseException:
            with _moves:
                _unpin(pins)
            raise

    def _move_seen(
        self,
        tensors: Sequence[tuple[torch.Tensor, str]],
        candidates: dict[int, torch.UntypedStorage],
    ) -> None:
        """Move the candidates that an earlier op used too and nothing pins."""
        ptrs = {t.untyped_storage().data_ptr() for t, _ in tensors if t.numel()}
        with _moves:
            while not ptrs.isdisjoint(_moving):  # another op is moving one of ours
                _moves.wait()
            moves = [
                s
                for s in candidates.values()
                if s in _seen and s.data_ptr() not in _pins and not s.is_shared()
            ]
            _moving.update(s.data_ptr() for s in moves)
        try:
            for storage in moves:
                _move(storage)
        finally:  # an interrupt mid-loop: the ones not moved are not moving either
            with _moves:
                _moving.difference_update(s.data_ptr() for s in moves if not s.is_shared())
                _moves.notify_all()
        for storage in candidates.values():
            _seen.add(storage)  # after this op's own choices: never moved on first use

    def _stage_device(self, tensors: list[torch.Tensor], devices: list[int | None]) -> Staged:
        options: dict[str, Scalar] = {}
        descs, device = self.device.stage(tensors, devices, options)
        dead = self.shared.take_dead()
        if dead:
            options["release"] = dead
        return Staged(None, tuple(descs), [], (), options, (), device)

    def _stage(
        self,
        tensors: Sequence[tuple[torch.Tensor, str]],
        shared: Sequence[tuple[int, int] | None],
        pins: tuple[int, ...],
    ) -> Staged:
        offsets, total = [], 0
        for (t, _), fd in zip(tensors, shared, strict=True):
            offsets.append(total)
            if fd is None:
                total = _aligned(total + t.numel() * t.element_size())
        segment = self._take(total) if total else None
        descs: list[TensorDesc] = []
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        new: list[tuple[int, int]] = []
        try:
            for (t, role), offset, fd in zip(tensors, offsets, shared, strict=True):
                if fd is not None:  # in place: the worker maps the caller's storage
                    descs.append(self.shared.place(t, fd[0], fd[1], new))
                    continue
                view, desc = _place(segment, t, offset)
                if role != "out":
                    view.copy_(t)
                if role != "in":
                    copy_back.append((t, view))
                descs.append(desc)
        except BaseException:  # a dtype the protocol cannot name, an interrupt
            self.give_back(segment)
            raise
        options: dict[str, Scalar] = {}
        owners: dict[int, torch.UntypedStorage] = {}
        if new:
            options["fds"] = tuple(ino for _, ino in new)
            sending = {ino for _, ino in new}
            for (t, _), fd in zip(tensors, shared, strict=True):
                if fd is not None:
                    self.shared.sent(t, fd[1])
                    if fd[1] in sending:
                        owners.setdefault(fd[1], t.untyped_storage())
        dead = self.shared.take_dead()
        if dead:
            options["release"] = dead
        return Staged(
            segment,
            tuple(descs),
            copy_back,
            tuple(fd for fd, _ in new),
            options,
            pins,
            owners=tuple(owners.values()),
        )

    def unstage(self, staged: Staged) -> None:
        """``staged``'s OP never reached the worker: undo :meth:`stage` --
        its pins, its segment (back to the pool), and what the pool counted
        on the worker learning from it (descriptors, releases, IPC shares)."""
        staged.unpin()
        self.give_back(staged.segment)
        self.shared.unsend(staged.options.get("fds"), staged.options.get("release"))
        if staged.device is not None:
            self.device.unstage(staged.device)

    def _take(self, nbytes: int) -> Segment:
        """A segment with at least ``nbytes`` reserved (:class:`~._shm.Segment`, rule 3).

        Raises:
            OSError: no room in :data:`~._shm.SHM_DIR`; a new segment is not kept then.
            PoolClosed: the pool is closed.
        """
        size = _size_class(nbytes)
        with self._lock:
            if self._closed:
                raise PoolClosed("the worker's shared memory is closed")
            free = self._free.get(size)
            segment = free.pop() if free else None
        if segment is not None:
            try:
                segment.reserve(nbytes)
            except BaseException:
                self.give_back(segment)  # with what it had reserved before
                raise
            return segment
        segment = Segment(size, nbytes)
        with self._lock:
            self._all.append(segment)
            if self._closed:  # closed meanwhile: do not leave the name behind
                segment.close()
        return segment

    def give_back(self, segment: Segment | None) -> None:
        """``segment``'s op has ended and the worker no longer touches it."""
        if segment is None:
            return
        with self._lock:
            if not self._closed:
                self._free.setdefault(segment.size, []).append(segment)

    def close(self, reaped: bool = True) -> None:
        """Unlink every name still linked; mappings go when their views do.

        ``reaped``: the worker is known to be gone, so the CUDA IPC
        references it held can be given back (else they are kept: a leak,
        rather than blocks reused under a dying worker's kernels).
        """
        with self._lock:
            self._closed = True
            segments, self._all = self._all, []
            self._free.clear()
        self.shared.close()
        self.device.close(release=reaped)
        for segment in segments:
            segment.close()

    @property
    def segments(self) -> int:
        with self._lock:
            return len(self._all)
