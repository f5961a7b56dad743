"""CUDA tensors across the process boundary: IPC handles and events.

A CUDA tensor is never copied: the worker maps the caller's device memory, and
events keep stream order both ways, as in torchft's subprocess group. Owns the
parent's side (:class:`DeviceStorages`), the worker's (:class:`DeviceMappings`)
and :class:`DeviceCalls`, every device call, which the CPU tests replace
(tests/test_subprocess_device.py). XPU tensors are refused: torch 2.13 has no
XPU IPC. See docs/subprocess.md; the frames' fields: docs/protocol.md.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..._protocol import Scalar, TensorDesc
from ._layout import BY_NAME, check_reach, dtype_name

log = logging.getLogger("ftcomm")
_cuda: Any = torch.cuda  # its Event and Stream constructors are untyped

IPC_PREFIX = "ipc:"


def _hex(name: str, text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"IPC record field {name} is not hex: {text[:40]!r}") from None


def _nat(name: str, text: str) -> int:
    if not text.isdigit() or len(text) > 20:
        raise ValueError(f"IPC record field {name} is not a count: {text[:40]!r}")
    return int(text)


@dataclass(frozen=True)
class IpcRecord:
    """What ``UntypedStorage._share_cuda_()`` gives, and ``_new_shared_cuda`` takes."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    @classmethod
    def of(cls, shared: tuple[Any, ...]) -> IpcRecord:
        device, handle, size, offset, rc_handle, rc_offset, ev_handle, sync = shared
        return cls(
            int(device),
            bytes(handle),
            int(size),
            int(offset),
            bytes(rc_handle),
            int(rc_offset),
            bytes(ev_handle or b""),
            bool(sync),
        )

    def encode(self) -> str:
        return ".".join(
            (
                str(self.device),
                self.handle.hex(),
                str(self.size),
                str(self.offset),
                self.ref_counter_handle.hex(),
                str(self.ref_counter_offset),
                self.event_handle.hex(),
                "1" if self.event_sync_required else "0",
            )
        )

    @classmethod
    def decode(cls, text: str) -> IpcRecord:
        """Raises: ValueError: not a record this module encoded."""
        parts = text.split(".")
        if len(parts) != 8 or parts[7] not in ("0", "1"):
            raise ValueError(f"malformed IPC record {text[:80]!r}")
        return cls(
            _nat("device", parts[0]),
            _hex("handle", parts[1]),
            _nat("size", parts[2]),
            _nat("offset", parts[3]),
            _hex("ref_counter_handle", parts[4]),
            _nat("ref_counter_offset", parts[5]),
            _hex("event_handle", parts[6]),
            parts[7] == "1",
        )


class PoolClosed(Exception):
    """The pool's worker is gone: nothing is staged for it any more."""


class DeviceCalls:
    """Every CUDA call the subprocess backend makes, and nothing else.

    Tests replace these methods (and only these) where no GPU exists.
    """

    def device_of(self, t: torch.Tensor) -> int | None:
        """The CUDA device index of ``t``; ``None`` if it does not travel by IPC."""
        if t.device.type != "cuda":
            return None
        index = t.device.index
        return torch.cuda.current_device() if index is None else index

    # -- the parent
    def share(self, storage: torch.UntypedStorage) -> IpcRecord:
        return IpcRecord.of(storage._share_cuda_())  # type: ignore[no-untyped-call]

    def current_stream(self, device: int) -> Any:
        return torch.cuda.current_stream(device)

    def stream_id(self, stream: Any) -> int:
        return int(stream.stream_id)

    def record(self, stream: Any) -> tuple[Any, str]:
        """An interprocess event recorded on ``stream``, and its IPC handle (hex)."""
        event = _cuda.Event(interprocess=True)
        event.record(stream)
        return event, bytes(event.ipc_handle()).hex()

    def wait(self, device: int, event: str, stream: Any) -> None:
        """Make ``stream`` wait for the other process's event (the CPU does not)."""
        _cuda.Event.from_ipc_handle(device, bytes.fromhex(event)).wait(stream)

    def release(self, record: IpcRecord) -> None:
        """Drop one consumer reference to a shared block (a worker that died
        holding it cannot)."""
        storage_cls: Any = torch.UntypedStorage
        storage_cls._release_ipc_counter_cuda(record.ref_counter_handle, record.ref_counter_offset)

    # -- the worker
    def open(self, record: IpcRecord) -> torch.UntypedStorage:
        return torch.UntypedStorage._new_shared_cuda(
            record.device,
            record.handle,
            record.size,
            record.offset,
            record.ref_counter_handle,
            record.ref_counter_offset,
            record.event_handle or None,
            record.event_sync_required,
        )

    def empty(self, device: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=f"cuda:{device}")

    def new_stream(self, device: int) -> Any:
        return _cuda.Stream(device)

    def using(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)


def cuda_index(desc: TensorDesc) -> int | None:
    """The CUDA device ``desc`` names (``cuda`` alone: 0), or ``None``."""
    kind, _, index = desc.device.partition(":")
    return (int(index) if index else 0) if kind == "cuda" else None


@dataclass(eq=False)
class DeviceStaged:
    """The device side of one op in the parent."""

    device: int
    stream: Any
    """The caller's stream when the op was issued: it waits for the op."""
    event: Any
    """The caller's event the worker waits on: kept alive until the reply."""
    shared: tuple[tuple[int, _Shared], ...] = ()
    """The storages this op shares with the worker for the first time."""
    released: tuple[_Shared, ...] = ()
    """The shares this op tells the worker to drop (``release_ipc``)."""
    done: tuple[int, ...] = ()
    """The reply events this op says were waited on (``events_done``)."""


@dataclass(frozen=True)
class _Shared:
    """A storage as shared with one worker: its id there, and what it was."""

    known: int
    ptr: int
    nbytes: int
    record: IpcRecord


class DeviceStorages:
    """The parent's side, per worker: storages shared with it, replies waited on."""

    def __init__(self, calls: DeviceCalls | None = None) -> None:
        self.calls = calls or DeviceCalls()
        self._lock = threading.Lock()
        self._shared: dict[int, _Shared] = {}  # id(storage) -> its share
        self._finalizers: dict[int, Any] = {}  # id(storage) -> weakref.finalize
        self._next = 1
        self._dead: list[_Shared] = []  # released in the next OP
        self._dying: collections.deque[int] = collections.deque()  # from finalizers
        self._done: list[int] = []  # ops whose reply event the caller's stream waits on
        self._closed = False

    def stage(
        self, tensors: list[torch.Tensor], devices: list[int | None], options: dict[str, Scalar]
    ) -> tuple[list[TensorDesc], DeviceStaged]:
        """Descriptors of ``tensors`` (on CUDA ``devices``, per
        :meth:`DeviceCalls.device_of`), and the caller's stream and event;
        adds the op's options. A storage counts as shared with the worker
        only once all of this has worked.

        Raises:
            ValueError: the tensors are not all on one CUDA device.
        """
        if len(set(devices)) != 1 or devices[0] is None:
            raise ValueError(
                "an op's tensors must all be on the CPU or all on one CUDA device, "
                f"got {sorted({str(t.device) for t in tensors})}"
            )
        device = devices[0]
        new: dict[int, tuple[torch.UntypedStorage, _Shared]] = {}
        try:
            descs = [self._place(t, device, new) for t in tensors]
            stream = self.calls.current_stream(device)
            event, handle = self.calls.record(stream)
            options["event"] = handle
            options["stream"] = self.calls.stream_id(stream)
            with self._lock:
                if self._closed:
                    raise PoolClosed("the worker's shared memory is closed")
                self._drain()
                for key, (storage, share) in new.items():
                    stale = self._shared.get(key)
                    if stale is not None:  # the same storage object, resized since
                        self._dead.append(stale)
                    self._shared[key] = share
                    if key not in self._finalizers:
                        self._finalizers[key] = weakref.finalize(storage, self._died, key)
                dead, self._dead = self._dead, []
                done, self._done = self._done, []
        except BaseException:
            # Each share holds a reference in torch's IPC counter; none of
            # these reached the worker, so none would ever be given back.
            self._release([share for _, share in new.values()])
            raise
        if dead:
            options["release_ipc"] = tuple(share.known for share in dead)
        if done:
            options["events_done"] = tuple(done)
        shares = tuple((key, share) for key, (_, share) in new.items())
        return descs, DeviceStaged(device, stream, event, shares, tuple(dead), tuple(done))

    def unstage(self, staged: DeviceStaged) -> None:
        """``staged``'s OP never reached the worker: its new shares were never
        mapped there (given back now; the storages are shared again by the
        next op that uses them), and its releases and acknowledgements go
        with the next OP instead. Nothing to do once closed: :meth:`close`
        gave back what it held."""
        with self._lock:
            if self._closed:
                return
            ours = {id(share) for _, share in staged.shared}
            for key, share in staged.shared:
                if self._shared.get(key) is share:
                    del self._shared[key]
            # One that a later op found stale is given back here, not there.
            self._dead = [*staged.released, *(d for d in self._dead if id(d) not in ours)]
            self._done[:0] = staged.done
        self._release([share for _, share in staged.shared])

    def _place(
        self, t: torch.Tensor, device: int, new: dict[int, tuple[torch.UntypedStorage, _Shared]]
    ) -> TensorDesc:
        storage = t.untyped_storage()
        layout = (
            dtype_name(t.dtype),
            tuple(t.shape),
            tuple(t.stride()),
            int(t.storage_offset()),
            f"cuda:{device}",
        )
        if storage.nbytes() == 0:  # nothing to map (and nothing to share)
            return TensorDesc(f"{IPC_PREFIX}0", *layout)
        key, ptr, nbytes = id(storage), storage.data_ptr(), storage.nbytes()
        if key in new:  # named twice by this op
            return TensorDesc(f"{IPC_PREFIX}{new[key][1].known}", *layout)
        with self._lock:
            self._drain()  # a dead storage's id() may be this one's now
            share = self._shared.get(key)
            if share is not None and (share.ptr, share.nbytes) == (ptr, nbytes):
                return TensorDesc(f"{IPC_PREFIX}{share.known}", *layout)
            known, self._next = self._next, self._next + 1
        # New, or resized since it was shared (FSDP frees and regrows its
        # storages with resize_: same object, new memory): share it (again).
        share = _Shared(known, ptr, nbytes, self.calls.share(storage))
        new[key] = (storage, share)
        return TensorDesc(f"{IPC_PREFIX}{known}:{share.record.encode()}", *layout)

    def _died(self, key: int) -> None:
        # A finalizer: it may run inside a garbage collection on a thread that
        # holds `_lock` (any allocation can start one), so it takes no lock.
        self._dying.append(key)

    def _drain(self) -> None:
        """Move the storages that died to ``_dead``. Under ``_lock``."""
        while self._dying:
            key = self._dying.popleft()
            self._finalizers.pop(key, None)
            share = self._shared.pop(key, None)
            if share is not None:
                self._dead.append(share)

    def replied(self, op_id: int, staged: DeviceStaged, event: str) -> None:
        """The worker's DONE for ``op_id`` carried ``event``: order the
        caller's stream after it (any thread; the CPU does not wait)."""
        try:
            self.calls.wait(staged.device, event, staged.stream)
        finally:
            self.acknowledge(op_id)

    def acknowledge(self, op_id: int) -> None:
        """The worker may let ``op_id``'s reply event go (said in the next OP)."""
        with self._lock:
            self._done.append(op_id)

    def close(self, release: bool = True) -> None:
        """The worker has exited: give back the IPC references it held.

        A worker leaves by SIGKILL or ``os._exit``, so its mappings never ran
        the destructors that tell torch's IPC reference counters it is done;
        without this, every block it had mapped would stay out of the
        caller's allocator for good once freed. ``release=False`` where the
        worker may not be gone yet (a dying worker's kernels could still
        touch those blocks): they are kept, a leak rather than a reuse.
        Shares sent for release in an OP the worker never read are not known
        here, and stay held.
        """
        with self._lock:
            self._closed = True
            self._drain()
            held = [*self._shared.values(), *self._dead]
            finalizers = list(self._finalizers.values())
            self._shared.clear()
            self._finalizers.clear()
            self._dead.clear()
            self._done.clear()
        for finalizer in finalizers:
            finalizer.detach()
        if release:
            self._release(held)

    def _release(self, shares: list[_Shared]) -> None:
        for share in shares:
            try:
                self.calls.release(share.record)
            except Exception:  # the counter file is gone: nothing is held
                log.debug("ftcomm: releasing an IPC reference failed", exc_info=True)


class DeviceMappings:
    """The worker's side: caller storages it mapped, its streams, its events."""

    def __init__(self, calls: DeviceCalls | None = None) -> None:
        self.calls = calls or DeviceCalls()
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._streams: dict[tuple[int, int], Any] = {}
        self._events: dict[int, Any] = {}  # op id -> its reply event, until the parent waited
        self._lock = threading.Lock()

    def update(self, options: Mapping[str, Scalar]) -> bool:
        """Drop the storages the parent released and the events it has waited
        on; say whether a storage went (views of it must go too)."""
        for name, table in (("release_ipc", self._storages), ("events_done", self._events)):
            ids = options.get(name)
            if isinstance(ids, tuple):
                with self._lock:
                    for key in ids:
                        table.pop(key, None)
        return bool(options.get("release_ipc"))

    def tensor(self, desc: TensorDesc) -> torch.Tensor:
        """The caller's tensor ``desc`` describes, mapped from its IPC handle.

        Raises:
            ValueError: a malformed handle, or an id never shared with us.
        """
        head, _, record = desc.handle[len(IPC_PREFIX) :].partition(":")
        if not head.isdigit():
            raise ValueError(f"malformed IPC handle {desc.handle[:80]!r}")
        key = int(head)
        device = cuda_index(desc)
        if device is None:
            raise ValueError(f"an IPC handle names a CUDA tensor, not a {desc.device} one")
        dtype = BY_NAME[desc.dtype]
        if key == 0:  # a storage of no bytes
            if min(desc.shape, default=1) != 0:
                raise ValueError(f"{desc.handle!r} names no storage, but shape {desc.shape}")
            return self.calls.empty(device, desc.shape, dtype)
        storage = self._storages.get(key)
        if record:
            if storage is None:
                storage = self._storages[key] = self.calls.open(IpcRecord.decode(record))
        elif storage is None:
            raise ValueError(f"no storage was shared as {desc.handle!r}")
        check_reach(desc, dtype.itemsize, storage.nbytes(), "storage")
        t = torch.empty(0, dtype=dtype, device=storage.device)
        return t.set_(storage, desc.offset, desc.shape, desc.stride)

    def stream(self, device: int, caller_stream: int) -> Any:
        """This worker's stream for one caller stream."""
        key = (device, caller_stream)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = self.calls.new_stream(device)
        return stream

    @contextlib.contextmanager
    def issuing(self, device: int, options: Mapping[str, Scalar]) -> Iterator[Any]:
        """Run the block (issuing the op) on the worker's stream for the
        caller's, after that stream has waited for the caller's event.

        Raises:
            ValueError: the OP lacks its ``event`` or ``stream``.
        """
        event, caller = options.get("event"), options.get("stream")
        if not isinstance(event, str) or type(caller) is not int:
            raise ValueError("an op on CUDA tensors needs its event and stream options")
        stream = self.stream(device, caller)
        self.calls.wait(device, event, stream)
        with self.calls.using(stream):
            yield stream

    def ended(self, op_id: int, stream: Any, native: object) -> str:
        """Order ``stream`` after the op's device work (its ``join_stream``,
        if it has one), then record an event there; its handle goes in the
        op's DONE."""
        join = getattr(native, "join_stream", None)
        if join is not None:
            with self.calls.using(stream):
                join()
        event, handle = self.calls.record(stream)
        with self._lock:
            self._events[op_id] = event
        return handle

    @property
    def mapped(self) -> int:
        return len(self._storages)

    @property
    def pending_events(self) -> int:
        return len(self._events)
