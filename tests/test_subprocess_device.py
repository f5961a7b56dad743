"""CUDA tensors in the subprocess backend: IPC handles and events.

No GPU here, so :class:`DeviceCalls` -- every CUDA call the backend makes,
and nothing else -- is replaced by :class:`FakeCalls`: "device" tensors are
CPU tensors it registered, "IPC" hands the worker side the very same
storage, and streams and events are entries in a log. The parent's staging,
the real codec, the worker's op handling and the parent's reply handling
all run as they do with a GPU; the log says which stream waited on which
event, and when. ``test_cuda_end_to_end`` runs the real thing where CUDA is
available.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import itertools
import os
import threading
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
import torch
from helpers import StoreServer
from torch.distributed import ReduceOp

import ftcomm
from ftcomm import ProtocolError
from ftcomm._protocol import Decoder, Done, Failed, Frame, Op, encode
from ftcomm._runtime.native import DoneOp, NativeOp
from ftcomm.backends.dummy import DummyBackend
from ftcomm.backends.subprocess._client import Call, WorkerProcess
from ftcomm.backends.subprocess._device import (
    DeviceCalls,
    DeviceMappings,
    DeviceStorages,
    IpcRecord,
    PoolClosed,
)
from ftcomm.backends.subprocess._pool import Pool
from ftcomm.backends.subprocess._worker import Worker
from ftcomm.testing import inspect

# What these check runs on ftcomm's owner loop and in the worker: asyncio only.
pytestmark = pytest.mark.one_loop


class FakeStream:
    def __init__(self, name: str, sid: int) -> None:
        self.name, self.sid = name, sid

    def __repr__(self) -> str:
        return self.name


class FakeCalls(DeviceCalls):
    """CUDA on the CPU, in one process: what each call did goes in ``log``."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.on_device: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
        self.exported: weakref.WeakValueDictionary[int, torch.UntypedStorage] = (
            weakref.WeakValueDictionary()
        )
        self.caller = FakeStream("caller", 7)
        self._ids = itertools.count(1)

    def cuda(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a tensor on "cuda:0"."""
        self.on_device.add(t.untyped_storage())
        return t

    def device_of(self, t: torch.Tensor) -> int | None:
        return 0 if t.untyped_storage() in self.on_device else None

    def share(self, storage: torch.UntypedStorage) -> IpcRecord:
        key = next(self._ids)
        self.exported[key] = storage
        self.log.append(("share", key))
        return IpcRecord(0, key.to_bytes(8, "big"), storage.nbytes(), 0, b"rc", 3, b"", False)

    def current_stream(self, device: int) -> Any:
        return self.caller

    def stream_id(self, stream: Any) -> int:
        return int(stream.sid)

    def record(self, stream: Any) -> tuple[Any, str]:
        handle = f"{next(self._ids):04x}"
        self.log.append(("record", stream.name, handle))
        return object(), handle

    def wait(self, device: int, event: str, stream: Any) -> None:
        self.log.append(("wait", stream.name, event))

    def open(self, record: IpcRecord) -> torch.UntypedStorage:
        key = int.from_bytes(record.handle, "big")
        self.log.append(("open", key))
        # Another storage object over the same memory, as an IPC mapping is:
        # it does not keep the caller's storage alive.
        storage = self.exported[key]
        memory = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
        return torch.frombuffer(memory, dtype=torch.uint8).untyped_storage()

    def release(self, record: IpcRecord) -> None:
        self.log.append(("release", int.from_bytes(record.handle, "big")))

    def empty(self, device: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def new_stream(self, device: int) -> Any:
        n = next(self._ids)
        self.log.append(("new_stream", n))
        return FakeStream(f"worker{n}", n)

    @contextlib.contextmanager
    def _using(self, stream: Any) -> Iterator[Any]:
        self.log.append(("enter", stream.name))
        yield stream
        self.log.append(("exit", stream.name))

    def using(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._using(stream)


class FakeChannel:
    """The worker's socket: replies land in ``sent``."""

    def __init__(self) -> None:
        self.sent: list[Frame] = []

    def send(self, frame: Frame) -> None:
        self.sent.append(frame)

    def take_fds(self, n: int) -> list[int]:
        raise AssertionError("no fds travel with CUDA tensors")


class JoiningOp(DoneOp):
    """An op whose device work its ``join_stream`` orders (as NCCL's is)."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.log = log

    def join_stream(self) -> None:
        self.log.append(("join",))


class JoiningDummy(DummyBackend):
    """The dummy backend, its ops joined to the worker's stream like NCCL's."""

    log: list[tuple[Any, ...]]

    def allgather(
        self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, timeout: float
    ) -> NativeOp:
        super().allgather(outputs, tensor, timeout)
        return JoiningOp(self.log)

    def allreduce(
        self, tensors: Sequence[torch.Tensor], op: ReduceOp.RedOpType, timeout: float
    ) -> NativeOp:
        return JoiningOp(self.log)


def _through_codec(frame: Frame) -> Frame:
    (decoded,) = Decoder().feed(encode(frame))
    return decoded


class Rig:
    """The parent's pool and an in-process worker running the dummy backend,
    joined by the real codec, sharing one :class:`FakeCalls`."""

    def __init__(self) -> None:
        self.calls = FakeCalls()
        self.pool = Pool()
        self.pool.device = DeviceStorages(self.calls)
        self.channel = FakeChannel()
        self.worker = Worker(self.channel, DummyBackend, os.getpid())  # type: ignore[arg-type]
        self.worker.device = DeviceMappings(self.calls)
        backend = JoiningDummy(0, 1)
        backend.log = self.calls.log
        self.worker.backend = backend
        self.ids = itertools.count(1)

    async def op(self, name: str, tensors: list[tuple[torch.Tensor, str]]) -> tuple[int, Frame]:
        """Stage, send, run and answer one op, as the parent and worker do."""
        staged = self.pool.stage(tensors)
        options: dict[str, Any] = {"timeout": 10.0, "reduce_op": "SUM", **staged.options}
        op_id = next(self.ids)
        frame = _through_codec(Op(op_id, name, staged.descs, options))
        assert isinstance(frame, Op)
        self.worker.run_op(frame)
        # The dummy backend's ops end as they are issued: the worker replies at once.
        assert len(self.channel.sent) == 1
        reply = _through_codec(self.channel.sent.pop())
        if isinstance(reply, Done) and reply.event:
            assert staged.device is not None
            self.pool.device.replied(op_id, staged.device, reply.event)
        return op_id, reply

    def close(self) -> None:
        self.pool.close()


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig()
    yield r
    r.close()


@pytest.mark.asyncio
async def test_an_op_waits_for_the_callers_stream_and_the_caller_waits_for_it(rig: Rig) -> None:
    calls = rig.calls
    src = calls.cuda(torch.arange(8, dtype=torch.float32))
    out = calls.cuda(torch.zeros(8))
    _, reply = await rig.op("allgather", [(src, "in"), (out, "out")])
    assert isinstance(reply, Done)
    assert reply.event == "0005"
    assert torch.equal(out, src)  # the worker wrote the caller's memory itself
    assert calls.log == [
        ("share", 1),  # each storage once, when first used
        ("share", 2),
        ("record", "caller", "0003"),  # on the caller's stream, as the op is issued
        ("open", 1),
        ("open", 2),
        ("new_stream", 4),  # the worker's stream for that caller stream
        ("wait", "worker4", "0003"),  # waits for the caller's work
        ("enter", "worker4"),  # and the op is issued on it
        ("exit", "worker4"),
        ("enter", "worker4"),  # once it has ended: the stream waits for its device work
        ("join",),
        ("exit", "worker4"),
        ("record", "worker4", "0005"),  # and then records the event
        ("wait", "caller", "0005"),  # the caller's stream waits for that
    ]
    assert rig.worker.device.pending_events == 1  # kept until the parent has waited


@pytest.mark.asyncio
async def test_storages_are_shared_once_and_released_when_they_die(rig: Rig) -> None:
    calls = rig.calls
    t = calls.cuda(torch.ones(16))
    for _ in range(3):
        _, reply = await rig.op("allreduce", [(t, "inout")])
        assert isinstance(reply, Done)
    assert [e for e in calls.log if e[0] in ("share", "open")] == [("share", 1), ("open", 1)]
    assert [e for e in calls.log if e[0] == "new_stream"] == [("new_stream", 3)]  # reused
    # The parent said it waited on each reply's event: the worker let them go.
    assert rig.worker.device.pending_events == 1
    # A view at an offset into the same storage goes by the same handle.
    view = t[4:12]
    view.fill_(5.0)
    rig.calls.log.clear()
    _, reply = await rig.op("allgather", [(view, "in"), (calls.cuda(torch.zeros(8)), "out")])
    assert isinstance(reply, Done)
    shared = [e for e in calls.log if e[0] in ("share", "open")]
    assert [kind for kind, _ in shared] == ["share", "open"]  # only the new output
    assert shared[0][1] == shared[1][1]
    assert rig.worker.device.mapped == 2
    del t, view
    gc.collect()  # both storages are gone now (the output was a temporary)
    _, reply = await rig.op("allreduce", [(calls.cuda(torch.ones(2)), "inout")])
    assert isinstance(reply, Done)
    assert rig.worker.device.mapped == 1  # the two released, this op's one mapped


@pytest.mark.asyncio
async def test_an_empty_cuda_tensor_needs_no_storage(rig: Rig) -> None:
    empty = rig.calls.cuda(torch.empty(0))
    _, reply = await rig.op("allreduce", [(empty, "inout")])
    assert isinstance(reply, Done)
    assert [e for e in rig.calls.log if e[0] in ("share", "open")] == []


@pytest.mark.asyncio
async def test_cpu_and_cuda_tensors_cannot_share_an_op(rig: Rig) -> None:
    with pytest.raises(ValueError, match="must all be on the CPU or all on one CUDA device"):
        rig.pool.stage([(rig.calls.cuda(torch.ones(2)), "in"), (torch.zeros(2), "out")])
    assert rig.calls.log == []  # nothing was shared or recorded


@pytest.mark.asyncio
async def test_the_worker_refuses_malformed_ipc_descriptors(rig: Rig) -> None:
    t = rig.calls.cuda(torch.ones(4))
    staged = rig.pool.stage([(t, "inout")])
    (desc,) = staged.descs
    bad = [
        desc.__class__("ipc:99", desc.dtype, desc.shape, desc.stride, 0, "cuda:0"),  # never shared
        desc.__class__("ipc:x", desc.dtype, desc.shape, desc.stride, 0, "cuda:0"),
        desc.__class__(desc.handle, desc.dtype, desc.shape, desc.stride, 0, "cpu"),
        desc.__class__("ipc:5:1.zz.3.0.00.0..0", desc.dtype, desc.shape, desc.stride, 0, "cuda:0"),
        desc.__class__(desc.handle, desc.dtype, (64,), (1,), 0, "cuda:0"),  # past its storage
    ]
    for i, d in enumerate(bad, start=100):
        rig.worker.run_op(Op(i, "allreduce", (d,), {**staged.options, "timeout": 1.0}))
        reply = rig.channel.sent.pop()
        assert isinstance(reply, Failed), d
        assert reply.type == "ValueError", (d, reply)
    # Without the caller's event the worker cannot order the op: refused too.
    rig.worker.run_op(Op(200, "allreduce", staged.descs, {"timeout": 1.0}))
    reply = rig.channel.sent.pop()
    assert isinstance(reply, Failed)
    assert "event and stream" in reply.message


@pytest.mark.asyncio
async def test_a_resized_storage_is_shared_again(rig: Rig) -> None:
    # FSDP frees and regrows storages with resize_: same object, new memory.
    calls = rig.calls
    t = calls.cuda(torch.ones(8))
    await rig.op("allreduce", [(t, "inout")])
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(8 * 4)
    t.fill_(3.0)
    staged = rig.pool.stage([(t, "inout")])
    (desc,) = staged.descs
    assert desc.handle.startswith("ipc:2:")  # a new id, with its record
    assert staged.options["release_ipc"] == (1,)  # the old mapping goes
    assert [e for e in calls.log if e[0] == "share"] == [("share", 1), ("share", 5)]


@pytest.mark.asyncio
async def test_a_storage_counts_as_shared_only_once_its_op_is_staged(rig: Rig) -> None:
    calls = rig.calls
    first, second = calls.cuda(torch.ones(4)), calls.cuda(torch.ones(4))
    real_share = calls.share
    calls.share = lambda s: (  # type: ignore[method-assign]
        real_share(s) if s is first.untyped_storage() else _raise(OSError("out of IPC handles"))
    )
    with pytest.raises(OSError, match="out of IPC handles"):
        rig.pool.stage([(first, "in"), (second, "out")])
    # The share that worked holds a reference the worker will never take:
    # given back at once.
    assert [e for e in calls.log if e[0] in ("share", "release")] == [
        ("share", 1),
        ("release", 1),
    ]
    calls.share = real_share  # type: ignore[method-assign]
    staged = rig.pool.stage([(first, "inout")])
    (desc,) = staged.descs
    assert desc.handle.count(":") == 2  # ipc:<id>:<record>: shared afresh, not assumed


def _raise(exc: BaseException) -> Any:
    raise exc


@pytest.mark.asyncio
async def test_closing_gives_back_the_ipc_references_a_dead_worker_held(rig: Rig) -> None:
    calls = rig.calls
    kept, dropped = calls.cuda(torch.ones(4)), calls.cuda(torch.ones(4))
    await rig.op("allreduce", [(kept, "inout")])
    await rig.op("allreduce", [(dropped, "inout")])
    del dropped
    gc.collect()  # its release is pending: the worker never heard of it
    rig.pool.close()  # the worker was killed: it could not drop its references
    assert sorted(e for e in calls.log if e[0] == "release") == [("release", 1), ("release", 5)]
    rig.pool.close()  # once only
    assert len([e for e in calls.log if e[0] == "release"]) == 2
    assert kept.sum().item() == 4.0


@pytest.mark.asyncio
async def test_staging_after_close_shares_nothing(rig: Rig) -> None:
    rig.pool.close()
    t = rig.calls.cuda(torch.ones(4))
    with pytest.raises(PoolClosed):
        rig.pool.stage([(t, "inout")])
    shares = [e[1] for e in rig.calls.log if e[0] == "share"]
    assert [e for e in rig.calls.log if e[0] == "release"] == [("release", k) for k in shares]


def test_a_storage_dying_inside_the_lock_does_not_deadlock() -> None:
    # A garbage collection can run a storage's finalizer on a thread that
    # holds the lock (any allocation in stage() can start one).
    storages = DeviceStorages(FakeCalls())
    result: list[bool] = []

    def collect_inside() -> None:
        with storages._lock:
            storages._died(12345)
        result.append(True)

    thread = threading.Thread(target=collect_inside)
    thread.start()
    thread.join(5)
    assert result == [True], "a finalizer under the lock deadlocked"


def test_ipc_records_round_trip_and_reject_garbage() -> None:
    record = IpcRecord(1, b"\x00\xff" * 32, 4096, 512, b"/torch_1_2", 7, b"\x01" * 64, True)
    assert IpcRecord.decode(record.encode()) == record
    assert IpcRecord.decode(IpcRecord(0, b"h", 0, 0, b"", 0, b"", False).encode()).size == 0
    for garbage in ("", "1.2.3", "a.00.1.0.00.0.00.0", "0.00.1.0.00.0.00.2", "0.0g.1.0.00.0.00.1"):
        with pytest.raises(ValueError, match="IPC record"):
            IpcRecord.decode(garbage)


def test_done_carries_an_event_only_as_hex() -> None:
    assert _through_codec(Done(3, "00ff")) == Done(3, "00ff")
    assert encode(Done(3)) == encode(Done(3, ""))  # the usual reply keeps its empty payload
    for bad in ("0", "xyz0", "ABCD", "00" * 513, None, 0, False, []):
        with pytest.raises(ProtocolError):
            Done(3, bad)  # type: ignore[arg-type]
    header = encode(Done(3))[: -len(b"{}")]
    for payload in (b'{"event":null}', b'{"event":0}', b'{"event":""}', b'{"event":[]}'):
        data = bytearray(header[:-4]) + len(payload).to_bytes(4, "big") + payload
        with pytest.raises(ProtocolError):
            Decoder().feed(bytes(data))


# -- the parent's reply handling, on a real worker process ------------------------------------
@dataclass
class InFlight:
    """A dummy group in a worker, with one call in flight on it as if it were
    an op on CUDA tensors (its storage shared through ``calls``)."""

    group: ftcomm.Group
    worker: WorkerProcess
    calls: FakeCalls
    call: Call
    ended: list[BaseException | None]


@pytest_asyncio.fixture
async def in_flight(store: StoreServer) -> AsyncIterator[InFlight]:
    async with ftcomm.Group(
        "dummy", subprocess=True, spare_worker=False, timeout=10, configure_timeout=60
    ) as g:
        await g.configure(f"127.0.0.1:{store.port}/d", 0, 1)
        worker = inspect(g).backend.worker  # type: ignore[union-attr]
        calls = FakeCalls()
        worker.pool.device = DeviceStorages(calls)
        staged = worker.pool.stage([(calls.cuda(torch.ones(4)), "inout")])
        assert staged.device is not None
        call = Call(worker, 10**9, staged)
        with worker.lock:
            worker._calls[call.op_id] = call
        ended: list[BaseException | None] = []
        call.on_done(ended.append)
        yield InFlight(g, worker, calls, call, ended)


@pytest.mark.asyncio
async def test_the_parent_orders_the_callers_stream_after_a_done(in_flight: InFlight) -> None:
    f = in_flight
    f.worker._on_frames([Done(f.call.op_id, "abcd")])
    assert f.ended == [None]
    assert f.calls.log[-1] == ("wait", "caller", "abcd")
    # The next op tells the worker it may drop that event.
    staged = f.worker.pool.stage([(f.calls.cuda(torch.ones(2)), "inout")])
    assert staged.options["events_done"] == (f.call.op_id,)
    await f.group.allreduce(torch.ones(2))  # the group still works (on CPU tensors)


@pytest.mark.asyncio
async def test_a_done_without_its_event_is_a_protocol_error(
    in_flight: InFlight, store: StoreServer
) -> None:
    f = in_flight
    f.worker._on_frames([Done(f.call.op_id)])  # the caller's stream would not be ordered
    assert len(f.ended) == 1
    assert isinstance(f.ended[0], ProtocolError)
    with pytest.raises(ProtocolError):
        await f.group.allreduce(torch.ones(2))  # the worker is being killed for it
    await f.group.configure(f"127.0.0.1:{store.port}/d2", 0, 1)  # and a new one works
    await f.group.allreduce(torch.ones(2))


@pytest.mark.asyncio
async def test_a_failed_device_op_orders_no_stream(in_flight: InFlight) -> None:
    f = in_flight
    f.worker._on_frames([Failed(f.call.op_id, "RuntimeError", "NCCL error")])
    assert len(f.ended) == 1
    assert "NCCL error" in str(f.ended[0])
    assert not [e for e in f.calls.log if e[0] == "wait"]  # nothing to order after
    await f.group.allreduce(torch.ones(2))  # a failed op is not a broken worker


@pytest.mark.asyncio
async def test_a_killed_workers_ipc_references_are_given_back(in_flight: InFlight) -> None:
    import signal

    f = in_flight  # its storage is shared with the worker
    os.kill(f.worker.pid, signal.SIGKILL)
    await asyncio.wait_for(asyncio.wrap_future(f.worker.exited), 10)
    assert isinstance(f.ended[0], ftcomm.WorkerDied)
    # Reaped: the reference the worker held on that block is given back.
    assert [e for e in f.calls.log if e[0] == "release"] == [("release", 1)]


# -- the real thing --------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.asyncio
async def test_cuda_end_to_end(store: StoreServer) -> None:  # pragma: no cover - needs a GPU
    async with ftcomm.Group(
        "dummy", subprocess=True, spare_worker=False, timeout=30, configure_timeout=60
    ) as g:
        await g.configure(f"127.0.0.1:{store.port}/cuda", 0, 1)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            src = torch.arange(4096, device="cuda", dtype=torch.float32)
            src.mul_(2)  # queued on the caller's stream: the worker must wait for it
            out = torch.empty_like(src)
            for _ in range(3):
                await g.allgather(src, out=[out])
            got = out.sum()  # queued after the op on the caller's stream
            # A view at an offset, into another view at an offset.
            await g.allgather(src[10:20], out=[out[100:110]])
            window = out[95:115].clone()
        torch.cuda.synchronize()
        assert got.item() == float(4096 * 4095)
        expected = src[95:115].clone()
        expected[5:15] = src[10:20]
        assert torch.equal(window, expected)


@pytest.mark.asyncio
async def test_a_worker_running_nccl_replies_once_the_ops_device_work_is_done(rig: Rig) -> None:
    """``Group("nccl", subprocess=True)``: the worker runs the accelerator
    backend (its device layer faked, tests/fake_accel.py). The op's reply
    waits for the op's event, not for its enqueue; then the worker's stream
    joins the op's and the reply carries the event the caller's stream waits on."""
    from fake_accel import FakeDevice

    from ftcomm.backends._accel_device import NCCL
    from ftcomm.backends.accelerator import accelerator_class

    accel = FakeDevice(NCCL)
    native = accel.new_group(None, 0, 1, accel.options())
    backend = accelerator_class("nccl")(accel, native, None, 0, 1, torch.device("cpu"), 0)
    rig.worker.backend = backend
    accel.hold()
    t = rig.calls.cuda(torch.ones(4))
    staged = rig.pool.stage([(t, "inout")])
    options: dict[str, Any] = {"timeout": 10.0, "reduce_op": "SUM", **staged.options}
    frame = _through_codec(Op(1, "allreduce", staged.descs, options))
    assert isinstance(frame, Op)
    rig.worker.run_op(frame)
    (event,) = native.events
    await asyncio.sleep(0.05)  # the worker polls, then its watcher does: no reply yet
    assert rig.channel.sent == []
    assert event.queries > 0
    event.complete()
    for _ in range(500):
        if rig.channel.sent:
            break
        await asyncio.sleep(0.01)
    (reply,) = rig.channel.sent
    assert isinstance(reply, Done)
    assert reply.event
    assert accel.joins == [(event, t.device)]  # the worker's stream waited for the op first
    kind, stream, handle = rig.calls.log[-1]  # then an event on that stream, sent back
    assert (kind, handle) == ("record", reply.event)
    assert stream.startswith("worker")
    backend.close()
    backend.closed().result(5.0)
