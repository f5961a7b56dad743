"""CUDA tensors across the process boundary: IPC handles and events.

A CUDA tensor is never copied to the worker: the worker maps the caller's
device memory through a CUDA IPC handle, and events keep stream order on
both sides, as torchft's subprocess group does:

* **Storages are shared once per worker.** The first OP that uses a storage
  carries its IPC record (``storage._share_cuda_()``) in the descriptor's
  handle, ``ipc:<id>:<record>``; later OPs name it ``ipc:<id>``. When the
  caller's storage dies, the next OP lists its id in ``release_ipc`` and the
  worker drops its mapping; torch's IPC reference counter keeps the block
  out of the caller's allocator until then.
* **The caller's stream comes first.** The parent records an interprocess
  event on the caller's current stream and sends its handle (``event``)
  with the stream's id (``stream``). The worker runs the op on a stream of
  its own for that caller stream (one each, so unrelated caller streams are
  not serialised) after making it wait on the event. The parent keeps the
  event alive until the op's reply.
* **The caller's stream waits for the op.** The worker records an event on
  its stream after the op and sends its handle in DONE; the parent makes the
  caller's stream (the one current when the op was issued) wait on it, so
  the op's result is ordered before anything the caller queues later, and
  the CPU does not wait for the device. The worker keeps that event alive
  until the parent says it has waited on it (``events_done`` in a later OP).

Every device call goes through :class:`DeviceCalls`, so machines without a
GPU test this logic with those calls replaced (tests/test_subprocess_device.py).
torch 2.13 has no IPC for XPU tensors (no ``_share_xpu_``, no XPU
``Event.ipc_handle``): a worker gets those through host memory, copied.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..._protocol import Scalar, TensorDesc

_cuda: Any = torch.cuda  # its Event and Stream constructors are untyped

IPC_PREFIX = "ipc:"
IPC_DEVICES = frozenset({"cuda"})
"""Device types whose tensors travel by IPC handle (the others are copied)."""


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


@dataclass(eq=False)
class DeviceStaged:
    """The device side of one op in the parent."""

    device: int
    stream: Any
    """The caller's stream when the op was issued: it waits for the op."""
    event: Any
    """The caller's event the worker waits on: kept alive until the reply."""


class DeviceStorages:
    """The parent's side, per worker: storages shared with it, replies waited on."""

    def __init__(self, calls: DeviceCalls | None = None) -> None:
        self.calls = calls or DeviceCalls()
        self._lock = threading.Lock()
        self._ids: dict[int, int] = {}  # id(storage) -> its id for this worker
        self._next = 1
        self._dead: list[int] = []
        self._done: list[int] = []  # ops whose reply event the caller's stream waits on

    def stage(
        self, tensors: list[torch.Tensor], devices: list[int | None], options: dict[str, Scalar]
    ) -> tuple[list[TensorDesc], DeviceStaged]:
        """Descriptors of ``tensors`` (on CUDA ``devices``, per
        :meth:`DeviceCalls.device_of`), and the caller's stream and event;
        adds the op's options.

        Raises:
            ValueError: the tensors are not all on one CUDA device.
        """
        if len(set(devices)) != 1 or devices[0] is None:
            raise ValueError(
                "an op's tensors must all be on the CPU or all on one CUDA device, "
                f"got {sorted({str(t.device) for t in tensors})}"
            )
        device = devices[0]
        descs = [self._place(t, device) for t in tensors]
        stream = self.calls.current_stream(device)
        event, handle = self.calls.record(stream)
        options["event"] = handle
        options["stream"] = self.calls.stream_id(stream)
        with self._lock:
            dead, self._dead = self._dead, []
            done, self._done = self._done, []
        if dead:
            options["release_ipc"] = tuple(dead)
        if done:
            options["events_done"] = tuple(done)
        return descs, DeviceStaged(device, stream, event)

    def _place(self, t: torch.Tensor, device: int) -> TensorDesc:
        from ._shm import dtype_name

        storage = t.untyped_storage()
        if storage.nbytes() == 0:  # nothing to map (and nothing to share)
            return TensorDesc(
                f"{IPC_PREFIX}0",
                dtype_name(t.dtype),
                tuple(t.shape),
                tuple(t.stride()),
                0,
                f"cuda:{device}",
            )
        key = id(storage)
        with self._lock:
            known = self._ids.get(key)
            if known is None:
                known = self._ids[key] = self._next
                self._next += 1
                weakref.finalize(storage, self._died, key, known)
                record: str | None = self.calls.share(storage).encode()
            else:
                record = None
        handle = f"{IPC_PREFIX}{known}" + (f":{record}" if record else "")
        return TensorDesc(
            handle,
            dtype_name(t.dtype),
            tuple(t.shape),
            tuple(t.stride()),
            int(t.storage_offset()),
            f"cuda:{device}",
        )

    def _died(self, key: int, known: int) -> None:
        with self._lock:
            if self._ids.get(key) == known:
                del self._ids[key]
                self._dead.append(known)

    def replied(self, op_id: int, staged: DeviceStaged, event: str) -> None:
        """The worker's DONE for ``op_id`` carried ``event``: order the
        caller's stream after it (any thread; the CPU does not wait)."""
        self.calls.wait(staged.device, event, staged.stream)
        with self._lock:
            self._done.append(op_id)

    def close(self) -> None:
        with self._lock:
            self._ids.clear()
            self._dead.clear()
            self._done.clear()


class DeviceMappings:
    """The worker's side: caller storages it mapped, its streams, its events."""

    def __init__(self, calls: DeviceCalls | None = None) -> None:
        self.calls = calls or DeviceCalls()
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._streams: dict[tuple[int, int], Any] = {}
        self._events: dict[int, Any] = {}  # op id -> its reply event, until the parent waited
        self._lock = threading.Lock()

    def update(self, options: Mapping[str, Scalar]) -> None:
        """Drop the storages the parent released and the events it has waited on."""
        for name, table in (("release_ipc", self._storages), ("events_done", self._events)):
            ids = options.get(name)
            if isinstance(ids, tuple):
                with self._lock:
                    for key in ids:
                        table.pop(key, None)

    def tensor(self, desc: TensorDesc) -> torch.Tensor:
        """The caller's tensor ``desc`` describes, mapped from its IPC handle.

        Raises:
            ValueError: a malformed handle, or an id never shared with us.
        """
        from ._shm import _BY_NAME

        head, _, record = desc.handle[len(IPC_PREFIX) :].partition(":")
        if not head.isdigit():
            raise ValueError(f"malformed IPC handle {desc.handle[:80]!r}")
        key = int(head)
        if not desc.device.startswith("cuda:"):
            raise ValueError(f"an IPC handle names a CUDA tensor, not a {desc.device} one")
        dtype = _BY_NAME[desc.dtype]
        device = int(desc.device[len("cuda:") :])
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
        span = 1 + sum((n - 1) * s for n, s in zip(desc.shape, desc.stride, strict=True))
        if min(desc.shape, default=1) and (desc.offset + span) * dtype.itemsize > storage.nbytes():
            raise ValueError(f"descriptor reaches past storage {desc.handle[:80]!r}")
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

    def ended(self, op_id: int, stream: Any) -> str:
        """Record the op's end on ``stream``; the handle goes in its DONE."""
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
