"""A fake NCCL/XCCL device layer: :class:`FakeDevice` replaces
:class:`~ftcomm.backends._accel_device.DeviceCalls`, and nothing else.

"Device" tensors are CPU tensors. The native group does what a group of
``world_size`` ranks whose peers mirror this rank would do to this rank's
tensors (an allreduce SUM leaves world_size x the input, ...), at once, on
the issuing thread; what is fake is *when the op ends*: each op's event
completes at once, unless the test holds events (:meth:`FakeDevice.hold`),
then when the test says so (:meth:`FakeEvent.complete`,
:meth:`FakeDevice.release`), or when the group is aborted (an abort stops
the kernels, so their events complete). Every call is counted, so tests
can assert that an abort happened exactly once, on which thread, and what
the group was built with.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed import ReduceOp

from ftcomm.backends import _accel_device, accelerator
from ftcomm.backends._accel_device import FLAVORS, Flavor


class FakeEvent:
    def __init__(self, device: FakeDevice, group: FakeGroup, op: str) -> None:
        self.op = op
        self.group = group
        self._done = threading.Event()
        self.queries = 0
        if not device.holding:
            self._done.set()

    def query(self) -> bool:
        self.queries += 1
        return self._done.is_set()

    def complete(self) -> None:
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()


class FakeWork:
    def __init__(self, group: FakeGroup, op: str, opts: Any) -> None:
        self.group = group
        self.op = op
        self.opts = opts


class FakeGroup:
    """The native group: records its construction and the ops issued on it."""

    def __init__(self, device: FakeDevice, rank: int, world_size: int, options: Any) -> None:
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.options = options
        self.ops: list[FakeWork] = []
        self.events: list[FakeEvent] = []
        self.aborts = 0
        self.abort_threads: list[str] = []
        self.sequence_set = False
        self.connected_on: torch.device | None = None
        self.error: str | None = None
        self.comm: str | None = None
        """``None`` until the communicator exists, then "live" or "aborted"."""
        self._aborted = threading.Event()
        self._coalescing: list[FakeWork] | None = None
        self.p2p: list[tuple[str, int, int]] = []
        """Each send and recv: the op, and where the bytes it was given lie
        (their address and size; not the tensor, which a test must not keep)."""

    # -- construction
    def _set_sequence_number_for_group(self) -> None:
        self.sequence_set = True

    def eager_connect_single_device(self, device: torch.device) -> None:
        self.device.connecting.set()
        gate = self.device.init_gate
        interruptible = self.device.interruptible_init
        while not gate.wait(0.01):
            if interruptible and self._aborted.is_set():
                raise RuntimeError("NCCL communicator was aborted during init")
        if interruptible and self._aborted.is_set():
            raise RuntimeError("NCCL communicator was aborted during init")
        # Not interruptible (waiting in the store for its id, as NCCL's does):
        # the communicator comes to exist even after an abort was called.
        self.comm = "live"
        self.connected_on = device

    def abort(self) -> None:
        """Aborts the communicators that exist now (as c10d's abort does)."""
        self.aborts += 1
        self.abort_threads.append(threading.current_thread().name)
        self.device.abort_gate.wait()  # a test may make the native abort slow
        self._aborted.set()
        if self.comm == "live":
            self.comm = "aborted"
        for event in self.events:
            event.complete()  # the kernels exit

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def get_error(self) -> Any:
        return SimpleNamespace(name=self.error or "SUCCESS")

    # -- ops (this rank's view: every peer holds what this rank holds)
    def _op(self, op: str, opts: Any) -> FakeWork:
        if self._aborted.is_set():
            raise RuntimeError("NCCL communicator was aborted")
        work = FakeWork(self, op, opts)
        if self._coalescing is not None:
            self._coalescing.append(work)
        else:
            self.ops.append(work)
        return work

    def _start_coalescing(self) -> None:
        assert self._coalescing is None, "coalescing blocks do not nest"
        self._coalescing = []

    def _end_coalescing(self) -> FakeWork:
        inner, self._coalescing = self._coalescing, None
        assert inner is not None, "_end_coalescing without _start_coalescing"
        return self._op("coalesced:" + ",".join(w.op for w in inner), None)

    def _reduce(self, t: torch.Tensor, op: Any) -> None:
        n = self.world_size
        if getattr(op, "op", None) == ReduceOp.PREMUL_SUM:  # NCCL's, the factor in it
            t.mul_(n * op.factor)
        elif op == ReduceOp.SUM:
            t.mul_(n)
        elif op == ReduceOp.PRODUCT:
            t.pow_(n)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> FakeWork:
        for t in tensors:
            self._reduce(t, opts.reduceOp)
        return self._op("allreduce", opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> FakeWork:
        for t in tensors:
            self._reduce(t, opts.reduceOp)
        return self._op("allreduce_coalesced", opts)

    def allgather(
        self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor], opts: Any
    ) -> FakeWork:
        for o in outs[0]:
            o.copy_(ins[0])
        return self._op("allgather", opts)

    def _allgather_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any) -> FakeWork:
        out.copy_(inp.reshape(-1).repeat(self.world_size).reshape(out.shape))
        return self._op("_allgather_base", opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> FakeWork:
        return self._op(f"broadcast:{opts.rootRank}", opts)

    def reduce_scatter(
        self, outs: list[torch.Tensor], ins: list[list[torch.Tensor]], opts: Any
    ) -> FakeWork:
        outs[0].copy_(ins[0][self.rank])
        self._reduce(outs[0], opts.reduceOp)
        return self._op("reduce_scatter", opts)

    def _reduce_scatter_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any) -> FakeWork:
        out.copy_(inp.chunk(self.world_size)[self.rank].reshape(out.shape))
        self._reduce(out, opts.reduceOp)
        return self._op("_reduce_scatter_base", opts)

    def alltoall_base(
        self, out: torch.Tensor, inp: torch.Tensor, osplit: list[int], isplit: list[int], opts: Any
    ) -> FakeWork:
        out.copy_(inp)
        return self._op("alltoall_base", opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> FakeWork:
        self._p2p(f"send:{dst}", tensors[0])
        return self._op(f"send:{dst}", None)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> FakeWork:
        self._p2p(f"recv:{src}", tensors[0])
        return self._op(f"recv:{src}", None)

    def _p2p(self, op: str, t: torch.Tensor) -> None:
        self.p2p.append((op, t.data_ptr(), t.numel() * t.element_size()))


class FakeDevice:
    """The device layer: see the module's docstring."""

    device_type = "cpu"

    def __init__(self, flavor: Flavor) -> None:
        self.flavor = flavor
        self.groups: list[FakeGroup] = []
        self.holding = False
        self.init_gate = threading.Event()
        self.init_gate.set()  # connects finish at once unless a test clears it
        self.connecting = threading.Event()
        self.abort_gate = threading.Event()
        self.abort_gate.set()
        self.interruptible_init = True
        self.joins: list[tuple[FakeEvent, torch.device]] = []
        self.dumps: list[int] = []
        self.dump_dir: str | None = None
        self._local = threading.local()

    @property
    def group(self) -> FakeGroup:
        return self.groups[-1]

    def hold(self) -> None:
        """Events recorded from now on stay pending until completed."""
        self.holding = True

    def release(self) -> None:
        """Complete every pending event, and stop holding."""
        self.holding = False
        for group in self.groups:
            for event in group.events:
                event.complete()

    # -- DeviceCalls
    def available(self) -> bool:
        return True

    def set_device(self, index: int) -> None:
        """``torch.cuda.set_device`` for the calling thread."""
        self._local.index = index

    def current_index(self) -> int:
        return int(getattr(self._local, "index", 0))

    def device(self, index: int | None) -> torch.device:
        return torch.device("cpu", self.current_index() if index is None else index)

    @contextlib.contextmanager
    def _using(self, device: torch.device) -> Iterator[None]:
        before = self.current_index()
        self.set_device(device.index or 0)
        try:
            yield
        finally:
            self.set_device(before)

    def using(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return self._using(device)

    def options(self) -> Any:
        return SimpleNamespace(
            config=SimpleNamespace(blocking=-(2**31)),
            _timeout=None,
            global_ranks_in_group=[],
            group_name="",
        )

    def new_group(self, store: Any, rank: int, world_size: int, options: Any) -> FakeGroup:
        group = FakeGroup(self, rank, world_size, options)
        self.groups.append(group)
        return group

    def connect(self, pg: FakeGroup, device: torch.device) -> None:
        pg._set_sequence_number_for_group()
        pg.eager_connect_single_device(device)

    def abort(self, pg: FakeGroup) -> None:
        pg.abort()

    def failed(self, pg: FakeGroup) -> str | None:
        name = pg.get_error().name
        return None if name == "SUCCESS" else str(name)

    def record(self, work: FakeWork, device: torch.device) -> FakeEvent:
        group = work.group
        event = FakeEvent(self, group, work.op)
        if group.aborted:
            event.complete()
        group.events.append(event)
        return event

    def query(self, event: FakeEvent) -> bool:
        return event.query()

    def join(self, event: FakeEvent, device: torch.device) -> None:
        self.joins.append((event, device))

    def scratch(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int32)

    def dump_flight_recorder(self, rank: int) -> str | None:
        self.dumps.append(rank)
        return None if self.dump_dir is None else f"{self.dump_dir}/trace{rank}"


def install(monkeypatch: Any, flavor: Flavor) -> FakeDevice:
    """Make the accelerator backend use a new :class:`FakeDevice` for
    ``flavor`` (and clear the variables ftcomm may set, which ``monkeypatch``
    restores after the test)."""
    device = FakeDevice(flavor)

    def calls(asked: Flavor) -> FakeDevice:
        assert asked is flavor, f"asked for {asked.name}, the test fakes {flavor.name}"
        return device

    monkeypatch.setattr(accelerator, "device_calls", calls)
    for f in FLAVORS.values():
        for name in [f.nonblocking_env, *dict(f.watchdog_env)]:
            if name is not None:
                monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(_accel_device.FR_ENV, raising=False)
    return device
