"""NCCL/XCCL on the CPU: the accelerator backend over a fake device layer.

Only :class:`~ftcomm.backends._accel_device.DeviceCalls` is replaced
(``fake_accel.FakeDevice``: events that complete when the test says so, an
abort that completes them); the backend, ``Work``, the op table, deadlines,
the group and the c10d facade are the real code under test. The same tests
on a GPU are ``tests/test_accelerator_gpu.py`` (``make gpu-check``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import fake_accel
import pytest
import torch
from fake_accel import FakeDevice
from helpers import StoreServer, peers_came

import ftcomm
from ftcomm import CommAborted, CommFailed, CommTimeout
from ftcomm._runtime.loop import get_runtime
from ftcomm.backends import _accel_device, accelerator, backend_class
from ftcomm.backends._accel_device import NCCL, XCCL, Flavor
from ftcomm.backends.accelerator import AcceleratorBackend, EventOp
from ftcomm.c10d import ProcessGroupNCCL, ProcessGroupXCCL
from ftcomm.testing import inspect

_prefixes = itertools.count()


def _addr(store: StoreServer, world: int = 1) -> str:
    """A fresh address on ``store``; ranks 1.. of a ``world`` of several
    have come to it already (the fake's own peers are modelled by its gates)."""
    prefix = f"accel{next(_prefixes)}"
    peers_came(store.port, prefix, world, range(1, world))
    return f"127.0.0.1:{store.port}/{prefix}"


def _fake(monkeypatch: pytest.MonkeyPatch, flavor: Flavor) -> FakeDevice:
    return fake_accel.install(monkeypatch, flavor)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDevice]:
    return _fake(monkeypatch, NCCL)


def _backend(fake: FakeDevice, world_size: int = 2) -> AcceleratorBackend:
    """A backend over a fresh fake group, built without connecting (for
    tests that drive one op's polls by hand)."""
    group = fake.new_group(None, 0, world_size, fake.options())
    cls = accelerator.accelerator_class("nccl")
    return cls(fake, group, None, 0, world_size, torch.device("cpu"), 0)  # type: ignore[arg-type]


async def _until(predicate: object, timeout: float = 5.0) -> None:
    """Await a condition another thread makes true (bounded)."""
    end = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.001)


# -- building ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_group_is_built_as_torchft_builds_it(
    fake: FakeDevice, store: StoreServer
) -> None:
    async with ftcomm.Group("nccl", timeout=5.0) as g:
        # Generous: configure connects to the store, which can wait a second
        # on a reverse DNS lookup (tests/conftest.py); it also sets the
        # non-blocking timeout below.
        await g.configure(_addr(store), 0, 1, global_ranks=[7], timeout=10.0)
        pg = fake.group
        assert pg.options.config.blocking is False  # non-blocking: ncclCommAbort stops it
        assert pg.options.global_ranks_in_group == [7]
        assert pg.options.group_name.startswith("ftcomm:0:None:accel")
        # c10d's own op timeout (NCCL has only the group's) is a week: its
        # watchdog never acts before ftcomm's deadline.
        assert pg.options._timeout == timedelta(days=7)
        assert pg.sequence_set
        assert pg.connected_on == torch.device("cpu", 0)  # the caller's current device
        assert g.rank == 0
        assert g.size() == 1
    # What ftcomm set where the user had not, and why: docs/accelerators.md.
    import os

    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "10"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert pg.aborts == 1  # shutdown aborts the communicator (bounded)


def test_the_users_environment_is_kept(
    fake: FakeDevice, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", "77")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.setenv("TORCH_NCCL_ENABLE_MONITORING", "0")
    monkeypatch.setattr(_accel_device, "_warned", set())
    with caplog.at_level("WARNING", logger="ftcomm"):
        assert _accel_device.prepare_environment(NCCL, 5.0) == {}
        # torch reads the non-blocking timeout once: a longer configure is capped, and told so.
        assert _accel_device.prepare_environment(NCCL, 100.0) == {}
    import os

    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "77"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in caplog.text  # a teardown mode is named
    assert "TORCH_NCCL_NONBLOCKING_TIMEOUT=77" in caplog.text
    assert "allows 100 s" in caplog.text


def test_the_environment_is_set_in_whole_seconds_and_legacy_names_count(
    fake: FakeDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "2")  # the old name torch still reads
    monkeypatch.setenv("NCCL_ENABLE_MONITORING", "0")  # not a name torch reads
    set_now = _accel_device.prepare_environment(NCCL, 2.5)
    # torch parses it with stoi: 2.5 s must not become 2 s
    assert set_now == {"TORCH_NCCL_NONBLOCKING_TIMEOUT": "3", "TORCH_NCCL_ENABLE_MONITORING": "0"}


def test_without_the_library_the_backend_says_so_before_anything_is_built() -> None:
    # This torch has no NCCL (a CPU build): the real device layer says so.
    if accelerator.device_calls(NCCL).available():
        pytest.skip("this torch has NCCL and a GPU")
    with pytest.raises(RuntimeError, match="needs a torch build with NCCL"):
        ftcomm.Group("nccl")
    with pytest.raises(ValueError, match="verify=True"):  # arguments are checked first
        ftcomm.Group("nccl", verify=True)
    with pytest.raises(RuntimeError, match="needs a torch build with XCCL"):
        ftcomm.Group("xccl", subprocess=True)
    pg = ProcessGroupNCCL()  # constructing the facade works; configure says why not
    with pytest.raises(RuntimeError, match="NCCL"):
        pg.configure("127.0.0.1:1/x", "0", 0, 1)


def test_the_backend_classes_share_one_implementation() -> None:
    nccl, xccl = backend_class("nccl"), backend_class("xccl")
    assert issubclass(nccl, AcceleratorBackend)
    assert issubclass(xccl, AcceleratorBackend)
    assert (nccl.device_type, xccl.device_type) == ("cuda", "xpu")
    assert nccl.allreduce is xccl.allreduce is AcceleratorBackend.allreduce
    # XCCL's construction cannot be aborted: its connects run on the bounded pool.
    assert nccl.stoppable_connect
    assert not xccl.stoppable_connect
    assert backend_class("nccl") is nccl  # built once


@pytest.mark.asyncio
async def test_premul_sum_is_nccls_own_with_its_factor(
    fake: FakeDevice, store: StoreServer
) -> None:
    """NCCL has PREMUL_SUM: the native op gets it, the factor with it (no
    SUM and scaling afterwards, as on Gloo)."""
    async with ftcomm.Group("nccl", timeout=5.0) as g:
        await g.configure(_addr(store), 0, 1)
        t = torch.tensor([2.0, 4.0])
        await g.allreduce(t, torch.distributed.ReduceOp.PREMUL_SUM(0.5))
        assert t.tolist() == [1.0, 2.0]  # world size 1: the factor alone
        out = await g.reduce_scatter(
            torch.zeros(2), [torch.tensor([8.0, 6.0])], torch.distributed.ReduceOp.PREMUL_SUM(0.25)
        )
        assert out.tolist() == [2.0, 1.5]
        native = [w.opts.reduceOp for w in fake.group.ops[1:]]
        assert [(op.op, op.factor) for op in native] == [
            (torch.distributed.ReduceOp.PREMUL_SUM, 0.5),
            (torch.distributed.ReduceOp.PREMUL_SUM, 0.25),
        ]


# -- ops end when their device work has ----------------------------------------------


@pytest.mark.asyncio
async def test_every_collective_returns_what_its_native_op_wrote(
    fake: FakeDevice, store: StoreServer
) -> None:
    async with ftcomm.Group("nccl", timeout=5.0) as g:
        await g.configure(_addr(store), 0, 1)
        t = torch.tensor([1.0, 2.0])
        assert (await g.allreduce(t)) is t
        assert torch.equal(t, torch.tensor([1.0, 2.0]))  # world size 1: SUM leaves it
        (a, b) = await g.allreduce_coalesced([torch.ones(2), torch.ones(3)])
        assert a.sum() == 2
        assert b.sum() == 3
        outs = await g.allgather(torch.tensor([3.0, 4.0]), out=[torch.zeros(2)])
        assert torch.equal(outs[0], torch.tensor([3.0, 4.0]))
        (o,) = await g.allgather_into_tensor_coalesced([torch.zeros(2)], [torch.tensor([5.0, 6.0])])
        assert torch.equal(o, torch.tensor([5.0, 6.0]))
        assert torch.equal(await g.broadcast(torch.ones(2), root=0), torch.ones(2))
        out = await g.reduce_scatter(torch.zeros(2), [torch.tensor([7.0, 8.0])])
        assert torch.equal(out, torch.tensor([7.0, 8.0]))
        (r,) = await g.reduce_scatter_tensor_coalesced([torch.zeros(2)], [torch.tensor([1.0, 9.0])])
        assert torch.equal(r, torch.tensor([1.0, 9.0]))
        out = await g.alltoall_base(torch.zeros(2), torch.tensor([2.0, 3.0]), [2], [2])
        assert torch.equal(out, torch.tensor([2.0, 3.0]))
        assert (await g.barrier()) is None
        ops = [w.op for w in fake.group.ops]
        assert ops == [
            "allreduce",  # configure's: every peer has joined
            "allreduce",
            "allreduce_coalesced",
            "allgather",
            "_allgather_base",  # one pair: the single-tensor op every torch has
            "broadcast:0",
            "reduce_scatter",
            "_reduce_scatter_base",
            "alltoall_base",
            "allreduce",  # barrier: one element, never c10d's blocking barrier
        ]
        assert all(e.done for e in fake.group.events)
        with pytest.raises(ValueError, match="BAND"):  # NCCL has no bitwise reductions
            g.allreduce(torch.ones(1, dtype=torch.int32), op="band")


@pytest.mark.asyncio
async def test_await_returns_once_the_event_completes_not_at_enqueue(
    fake: FakeDevice, store: StoreServer
) -> None:
    async with ftcomm.Group("nccl", timeout=10.0) as g:
        await g.configure(_addr(store), 0, 1)
        fake.hold()
        work = g.allreduce(torch.ones(2))
        task = asyncio.create_task(work)
        event = fake.group.events[-1]
        await _until(lambda: event.queries >= 3)  # polled (the spin, then the watcher)
        assert not task.done()
        assert not work.done()
        event.complete()
        assert torch.equal(await asyncio.wait_for(task, 5.0), torch.ones(2))
        assert fake.group.aborts == 0
        assert g.errored() is None


@pytest.mark.asyncio
async def test_a_c10d_wait_on_a_lone_fused_op_is_a_cut_however_far_it_got(
    fake: FakeDevice, store: StoreServer
) -> None:
    """c10d's wait() orders the caller's stream and returns while the op
    still runs (the CPU fake's ops fuse, as host tensors): it is a look all
    the same, so the next fusible op goes on its own on every rank, not
    only on one whose op had ended by then."""
    from ftcomm.c10d._work import OpWork

    async with ftcomm.Group("nccl", timeout=10.0, fuse=True) as g:
        await g.configure(_addr(store), 0, 1)
        fake.hold()
        lone = g.allreduce(torch.ones(2))  # the first fusible op goes at once
        cfg = inspect(g).config
        assert cfg is not None
        assert cfg.fuse_alone is False  # the next one would join a batch
        assert OpWork(lone, None).wait() is True  # ordered on the stream
        assert cfg.fuse_alone is True  # a cut point: the next op goes at once
        assert not lone.done()  # it was still running
        fake.release()
        await lone


@pytest.mark.asyncio
async def test_an_awaited_event_is_timed_by_the_poll_that_saw_it_complete(
    fake: FakeDevice, store: StoreServer
) -> None:
    """stats(): an accelerator op's end is the watcher's poll that saw its
    event complete, a poll (of at most POLL_MAX) after one that saw it
    running: timed, though the callback comes from that poll."""
    async with ftcomm.Group("nccl", timeout=10.0) as g:
        await g.configure(_addr(store), 0, 1)
        fake.hold()
        task = asyncio.create_task(g.allreduce(torch.ones(2)))
        event = fake.group.events[-1]
        await _until(lambda: event.queries >= 3)  # the watcher polls it
        # Held 1 s: timed if the poll that saw the end came within 62 ms
        # (1/16) of one that saw it running; polls are POLL_MAX apart, and
        # the margin absorbs a loaded box's late thread wake-ups (a 50 ms
        # hold's 3 ms margin did not, once, in CI).
        await asyncio.sleep(1.0)
        event.complete()
        await asyncio.wait_for(task, 5.0)
        stats = g.stats().ops["allreduce"]
        assert (stats.count, stats.untimed) == (1, 0)
        assert stats.p50 is not None
        assert stats.max is not None
        assert stats.max >= 1.0
        assert stats.p50 >= 1.0 * 15 / 16  # a bucket's lower edge


# -- deadlines ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_deadline_on_a_pending_event_aborts_once_and_fails_every_op(
    fake: FakeDevice, store: StoreServer
) -> None:
    async with ftcomm.Group("nccl", timeout=10.0) as g:
        await g.configure(_addr(store), 0, 1)
        fake.hold()
        slow = g.allreduce(torch.ones(2), timeout=0.3)
        other = g.broadcast(torch.ones(2), root=0)
        start = time.monotonic()
        with pytest.raises(CommTimeout):
            await slow
        assert time.monotonic() - start < 0.3 + 1.0  # at the deadline, not at c10d's timeout
        with pytest.raises(CommAborted):
            await other
        assert isinstance(g.errored(), CommTimeout)
        pg = fake.group
        await _until(lambda: pg.aborted)
        # Exactly once, on a worker thread: never the owner loop, never the caller.
        assert pg.aborts == 1
        assert pg.abort_threads[0].startswith("ftcomm-worker")
        with pytest.raises(CommAborted):
            g.allreduce(torch.ones(1))
        await g.abort()
        assert pg.aborts == 1


@pytest.mark.asyncio
async def test_an_event_that_completed_before_the_deadline_is_a_success(
    fake: FakeDevice, store: StoreServer
) -> None:
    """Completion racing the deadline, one way: nobody polled the op, its
    event completed, then its deadline came: the owner loop's query at the
    deadline finds it complete and the op succeeds, with no abort."""
    async with ftcomm.Group("nccl", timeout=10.0) as g:
        await g.configure(_addr(store), 0, 1)
        fake.hold()
        work = g.allreduce(torch.ones(2), timeout=0.2)
        event = fake.group.events[-1]
        event.complete()
        await asyncio.sleep(0.4)  # the deadline passes with nobody awaiting the op
        assert work._end is not None  # ended by the owner loop's query at the deadline
        assert work.done()
        assert work.exception() is None
        assert torch.equal(await work, torch.ones(2))
        assert fake.group.aborts == 0
        assert g.errored() is None


def test_a_completion_seen_after_an_abort_began_is_not_a_success(fake: FakeDevice) -> None:
    """Completion racing the deadline, the other way, forced: the event's
    query returns True (the abort stopped the kernel) but the abort began
    while it was queried. The op must fail: the kernel did not finish."""
    backend = _backend(fake)
    group = fake.group
    fake.hold()
    op = backend.allreduce([torch.ones(1)], torch.distributed.ReduceOp.SUM, 5.0)
    assert isinstance(op, EventOp)
    (event,) = group.events

    def query_during_abort() -> bool:
        backend.abort()  # begins, then the kernel's event completes
        fake.abort_gate.wait()
        event.complete()
        return True

    event.query = query_during_abort  # type: ignore[method-assign]
    assert op.poll()
    assert isinstance(op.outcome(), CommAborted)
    backend.closed().result(5.0)


def test_a_completion_after_the_library_reported_an_error_is_not_a_success(
    fake: FakeDevice,
) -> None:
    """c10d's watchdog sets the group's error, then (clean-up mode) aborts the
    communicator, whose stopped kernels complete their events: a poll that
    sees such a completion must report the failure."""
    backend = _backend(fake)
    group = fake.group
    fake.hold()
    op = backend.allreduce([torch.ones(1)], torch.distributed.ReduceOp.SUM, 5.0)
    group.error = "COMM_ERROR"
    group.events[-1].complete()
    assert op.poll()
    error = op.outcome()
    assert isinstance(error, CommFailed)
    assert "COMM_ERROR" in str(error)
    backend.closed().result(5.0)
    assert group.aborts == 1


@pytest.mark.asyncio
async def test_a_library_error_fails_the_ops_without_waiting_for_the_deadline(
    fake: FakeDevice, store: StoreServer
) -> None:
    async with ftcomm.Group("nccl", timeout=30.0) as g:
        await g.configure(_addr(store), 0, 1)
        fake.hold()
        work = g.allreduce(torch.ones(2))
        task = asyncio.create_task(work)
        await _until(lambda: fake.group.events[-1].queries >= 2)
        fake.group.error = "REMOTE_ERROR"  # a peer died: NCCL says so, the kernel hangs
        with pytest.raises(CommFailed, match="REMOTE_ERROR"):
            await asyncio.wait_for(task, 5.0)
        await _until(lambda: fake.group.aborted)
        assert fake.group.aborts == 1


# -- init -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_init_that_never_completes_is_aborted_at_the_configure_deadline(
    fake: FakeDevice, store: StoreServer
) -> None:
    fake.init_gate.clear()  # the peer never shows up
    async with ftcomm.Group("nccl") as g:
        # The address before the clock starts: _addr() connects to the store
        # on this thread, and a TCPStore connect can wait a second or more on
        # a reverse DNS lookup (tests/conftest.py), which is not configure's.
        addr = _addr(store, 2)
        start = time.monotonic()
        # Long enough for the connect to reach the communicator (else it rightly
        # builds nothing) on a loaded machine whose DNS drops the connect's
        # lookup, 1 s (CI: the connect timed out at a 1.5 s deadline).
        with pytest.raises(CommTimeout, match="configure"):
            await g.configure(addr, 0, 2, timeout=4.0)
        assert 4.0 - 0.1 < time.monotonic() - start < 4.0 + 1.0  # at the deadline
        assert fake.groups, "the configure's connect never reached the communicator"
        pg = fake.group
        await _until(lambda: pg.aborted)
        # The connect thread returns, and aborts once more as it gives up (for
        # a communicator created after the first abort: none here).
        assert await asyncio.to_thread(get_runtime().control.wait_idle, 5.0)
        assert pg.aborts == 2
        assert g.state is ftcomm.State.UNCONFIGURED
        # The next configure builds a new communicator, which works.
        fake.init_gate.set()
        await g.configure(_addr(store), 0, 1, timeout=5.0)
        assert fake.group is not pg
        await g.allreduce(torch.ones(1))


@pytest.mark.asyncio
async def test_abort_during_init_stops_the_communicator(
    fake: FakeDevice, store: StoreServer
) -> None:
    fake.init_gate.clear()
    async with ftcomm.Group("nccl") as g:
        task = asyncio.ensure_future(g.configure(_addr(store, 2), 0, 2, timeout=30.0))
        await asyncio.wait_for(asyncio.to_thread(fake.connecting.wait), 5.0)
        await g.abort()
        with pytest.raises(CommAborted, match="superseded by abort"):
            await asyncio.wait_for(task, 5.0)
        await _until(lambda: fake.group.aborted)
        assert await asyncio.to_thread(get_runtime().control.wait_idle, 5.0)
        assert fake.group.aborts == 2  # abort()'s, then the connect thread's as it gave up


@pytest.mark.asyncio
async def test_configure_after_a_deadline_builds_a_working_group(
    fake: FakeDevice, store: StoreServer
) -> None:
    async with ftcomm.Group("nccl", timeout=10.0) as g:
        await g.configure(_addr(store), 0, 1)
        first = fake.group
        fake.hold()
        with pytest.raises(CommTimeout):
            await g.allreduce(torch.ones(1), timeout=0.1)
        fake.release()
        await g.configure(_addr(store), 0, 1)
        assert fake.group is not first
        assert torch.equal(await g.allreduce(torch.ones(2)), torch.ones(2))
        await _until(lambda: first.aborted)
        assert first.aborts == 1
        assert fake.group.aborts == 0


@pytest.mark.asyncio
async def test_closing_waits_for_the_native_abort(fake: FakeDevice, store: StoreServer) -> None:
    async with ftcomm.Group("nccl", timeout=10.0) as g:
        await g.configure(_addr(store), 0, 1)
        fake.abort_gate.clear()  # ncclCommAbort takes its time
        closing = asyncio.ensure_future(g.abort())
        await asyncio.sleep(0.2)
        assert not closing.done()
        assert isinstance(g.errored(), CommAborted)  # the abort itself is immediate
        fake.abort_gate.set()
        await asyncio.wait_for(closing, 5.0)
        assert fake.group.aborted


@pytest.mark.asyncio
async def test_several_pairs_are_one_coalesced_op(fake: FakeDevice, store: StoreServer) -> None:
    async with ftcomm.Group("nccl", timeout=10.0) as g:
        await g.configure(_addr(store, 2), 0, 2)
        outs = [torch.zeros(4), torch.zeros(2)]
        await g.allgather_into_tensor_coalesced(outs, [torch.ones(2), torch.full((1,), 3.0)])
        assert outs[0].tolist() == [1.0] * 4
        assert outs[1].tolist() == [3.0, 3.0]
        r = [torch.zeros(1), torch.zeros(2)]
        await g.reduce_scatter_tensor_coalesced(r, [torch.ones(2), torch.ones(4)])
        assert r[0].tolist() == [2.0]
        assert r[1].tolist() == [2.0, 2.0]
        assert [w.op for w in fake.group.ops[-2:]] == [
            "coalesced:_allgather_base,_allgather_base",
            "coalesced:_reduce_scatter_base,_reduce_scatter_base",
        ]


@pytest.mark.asyncio
async def test_the_communicator_uses_the_device_given_or_the_callers(
    fake: FakeDevice, store: StoreServer
) -> None:
    async with ftcomm.Group("nccl", timeout=10.0) as g:
        await g.configure(_addr(store), 0, 1, device_id=2)
        assert fake.group.connected_on == torch.device("cpu", 2)
        fake.set_device(1)  # this thread's current device; the connect runs on another
        await g.configure(_addr(store), 0, 1)
        assert fake.group.connected_on == torch.device("cpu", 1)
    with pytest.raises(ValueError, match="device_id is for the nccl and xccl"):
        await ftcomm.Group("gloo").configure(_addr(store), 0, 1, device_id=0)


def test_the_facade_builds_on_its_callers_device(fake: FakeDevice, store: StoreServer) -> None:
    fake.set_device(3)  # configure itself runs on the owner loop's thread
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=10))
    pg.configure(_addr(store), "0", 0, 1)
    try:
        assert fake.group.connected_on == torch.device("cpu", 3)
    finally:
        pg.shutdown()


@pytest.mark.asyncio
async def test_a_communicator_created_after_the_abort_began_is_aborted_too(
    fake: FakeDevice, store: StoreServer
) -> None:
    """The native abort covers the communicators that exist when it runs; one
    still waiting in the store for its id comes to exist afterwards."""
    fake.interruptible_init = False
    fake.init_gate.clear()
    async with ftcomm.Group("nccl") as g:
        task = asyncio.ensure_future(g.configure(_addr(store, 2), 0, 2, timeout=30.0))
        await asyncio.wait_for(asyncio.to_thread(fake.connecting.wait), 10.0)
        await g.abort()  # gives the connect up, as its deadline would
        with pytest.raises(CommAborted):
            await task
        pg = fake.group
        await _until(lambda: pg.aborts == 1)
        assert pg.comm is None  # the first abort found nothing to abort
        fake.init_gate.set()  # the id arrives: the communicator is created
        await _until(lambda: pg.comm == "aborted")
        assert await asyncio.to_thread(get_runtime().control.wait_idle, 5.0)


@pytest.mark.asyncio
async def test_a_failing_event_query_fails_the_op_and_the_group(
    fake: FakeDevice, store: StoreServer
) -> None:
    async with ftcomm.Group("nccl", timeout=30.0) as g:
        await g.configure(_addr(store), 0, 1)
        fake.hold()
        work = g.allreduce(torch.ones(1))
        event = fake.group.events[-1]

        def sticky() -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        event.query = sticky  # type: ignore[method-assign]
        with pytest.raises(CommFailed, match="illegal memory access"):
            await asyncio.wait_for(work, 5.0)
        assert isinstance(g.errored(), CommFailed)
        await _until(lambda: fake.group.aborted)


@pytest.mark.asyncio
async def test_errored_names_the_deadline_when_another_op_sees_the_abort_first(
    fake: FakeDevice, store: StoreServer
) -> None:
    """Forced: between the deadline's abandon() (the abort begins) and its
    break of the table, another op is polled (the watcher's round) and sees
    the stop. That op ends with CommAborted; errored() still names the deadline."""
    async with ftcomm.Group("nccl", timeout=30.0) as g:
        await g.configure(_addr(store), 0, 1)
        backend = inspect(g).backend  # type: ignore[union-attr]
        fake.hold()
        other = g.broadcast(torch.ones(1), root=0)
        slow = g.allreduce(torch.ones(1), timeout=0.2)
        real_abort = backend.abort

        polled: list[bool] = []

        def abort_then_poll(*args: object, **kwargs: object) -> bool:
            began = real_abort(*args, **kwargs)  # type: ignore[arg-type]
            if began:  # the deadline's abandon(): poll the other op in the window
                polled.append(other.done())
            return began

        backend.abort = abort_then_poll  # type: ignore[method-assign]
        with pytest.raises(CommTimeout):
            await slow
        assert polled == [True]  # it saw the stop, before the table broke
        with pytest.raises(CommAborted):
            await other
        assert isinstance(g.errored(), CommTimeout)


@pytest.mark.asyncio
async def test_errored_names_the_deadline_when_an_op_is_issued_in_the_abort_window(
    fake: FakeDevice, store: StoreServer
) -> None:
    """Forced: an op is issued between the deadline's abandon() and its break
    of the table (here on the settling thread itself, inside the abort): the
    op is refused, and errored() still names the deadline."""
    async with ftcomm.Group("nccl", timeout=30.0) as g:
        await g.configure(_addr(store), 0, 1)
        backend = inspect(g).backend  # type: ignore[union-attr]
        fake.hold()
        slow = g.allreduce(torch.ones(1), timeout=0.2)
        real_abort = backend.abort
        refused: list[BaseException] = []

        def abort_then_issue(*args: object, **kwargs: object) -> bool:
            began = real_abort(*args, **kwargs)  # type: ignore[arg-type]
            if began:
                try:
                    g.allreduce(torch.ones(1))
                except CommAborted as exc:
                    refused.append(exc)
            return began

        backend.abort = abort_then_issue  # type: ignore[method-assign]
        with pytest.raises(CommTimeout):
            await slow
        assert len(refused) == 1
        assert isinstance(g.errored(), CommTimeout)


@pytest.mark.asyncio
async def test_a_watcher_that_fails_is_replaced(fake: FakeDevice, store: StoreServer) -> None:
    async with ftcomm.Group("nccl", timeout=30.0) as g:
        await g.configure(_addr(store), 0, 1)
        backend = inspect(g).backend  # type: ignore[union-attr]
        real_check = backend.check_library
        failures = [RuntimeError("a bug in the watcher")]

        def check_once() -> None:
            if failures:
                raise failures.pop()
            real_check()

        backend.check_library = check_once  # type: ignore[method-assign]
        fake.hold()
        work = g.allreduce(torch.ones(1))
        task = asyncio.create_task(work)
        await _until(lambda: not failures)  # the first watcher died
        fake.release()
        assert torch.equal(await asyncio.wait_for(task, 5.0), torch.ones(1))


def test_a_connect_cancelled_before_it_starts_builds_nothing(
    fake: FakeDevice, store: StoreServer
) -> None:
    from ftcomm._store import parse_store_addr
    from ftcomm.backends import ConnectSpec

    cancel: concurrent.futures.Future[None] = concurrent.futures.Future()
    cancel.set_result(None)
    spec = ConnectSpec(parse_store_addr(_addr(store)), 0, 1, 5.0)
    with pytest.raises(RuntimeError, match="cancelled"):
        accelerator.accelerator_class("nccl").connect(spec, cancel)
    assert fake.groups == []


@pytest.mark.asyncio
async def test_every_tensor_of_an_op_is_checked_against_the_groups_device(
    fake: FakeDevice, store: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ftcomm.Group("nccl", timeout=10.0) as g:
        await g.configure(_addr(store), 0, 1)
        backend = inspect(g).backend  # type: ignore[union-attr]
        checked: list[torch.device] = []
        monkeypatch.setattr(backend, "_check_device", checked.append)
        outs, ins = [torch.zeros(2), torch.zeros(2)], [torch.ones(2), torch.ones(2)]
        await g.allgather_into_tensor_coalesced(outs, ins)
        assert len(checked) == 4  # outputs and inputs, every one
        checked.clear()
        await g.reduce_scatter(torch.zeros(1), [torch.ones(1)])
        assert len(checked) == 2


def test_tensors_on_another_device_than_the_groups_are_refused(fake: FakeDevice) -> None:
    group = fake.new_group(None, 0, 1, fake.options())
    cls = accelerator.accelerator_class("nccl")
    backend = cls(fake, group, None, 0, 1, torch.device("cuda", 0), 0)  # type: ignore[arg-type]
    backend._check_device(torch.device("cuda", 0))
    backend._check_device(torch.device("cuda"))  # "the current one": c10d decides
    with pytest.raises(ValueError, match=r"on cuda:1, and this NCCL group on cuda:0"):
        backend._check_device(torch.device("cuda", 1))
    assert group.ops == []


@pytest.mark.asyncio
async def test_ops_end_when_the_watcher_comes_and_goes_between_them(
    fake: FakeDevice, store: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher ends after LINGER idle: an op added as it leaves must still
    get a watcher (it used to find a thread that was exiting). No spin, a
    LINGER of 10 us, completions 0-2 ms after each issue."""
    import random

    from ftcomm._runtime import work as work_module

    monkeypatch.setattr(accelerator, "LINGER", 1e-5)
    monkeypatch.setattr(work_module, "SPIN_SECONDS", 0.0)
    rng = random.Random(12)
    async with ftcomm.Group("nccl", timeout=30.0) as g:
        await g.configure(_addr(store), 0, 1)
        fake.hold()
        for _ in range(300):
            work = g.allreduce(torch.ones(1))
            timer = threading.Timer(rng.random() * 0.002, fake.group.events[-1].complete)
            timer.start()
            await asyncio.wait_for(work, 5.0)
            timer.join()


def test_a_poll_that_raises_ends_its_op_with_the_failure(fake: FakeDevice) -> None:
    backend = _backend(fake)
    fake.hold()
    op = backend.allreduce([torch.ones(1)], torch.distributed.ReduceOp.SUM, 5.0)
    assert isinstance(op, EventOp)

    def broken() -> None:
        raise RuntimeError("a bug")

    backend.stopped = broken  # type: ignore[assignment,method-assign]
    assert accelerator._polled(op)
    error = op.outcome()
    assert isinstance(error, CommFailed)
    assert "a bug" in str(error)


def test_a_connect_cancelled_while_it_reached_the_store_builds_nothing(
    fake: FakeDevice, store: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ftcomm._store import parse_store_addr
    from ftcomm.backends import ConnectSpec

    cancel: concurrent.futures.Future[None] = concurrent.futures.Future()
    real = accelerator.connect_store

    def connect_then_cancel(*args: object) -> object:
        client = real(*args)  # type: ignore[arg-type]
        cancel.set_result(None)  # configure gave up meanwhile
        return client

    monkeypatch.setattr(accelerator, "connect_store", connect_then_cancel)
    spec = ConnectSpec(parse_store_addr(_addr(store)), 0, 1, 5.0)
    with pytest.raises(RuntimeError, match="cancelled"):
        accelerator.accelerator_class("nccl").connect(spec, cancel)
    assert fake.groups == []


def test_verify_is_refused_on_the_accelerators(fake: FakeDevice) -> None:
    with pytest.raises(ValueError, match="verify=True is not available with 'nccl'"):
        ftcomm.Group("nccl", verify=True)


# -- the flight recorder -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_flight_recorder_is_dumped_before_an_abort_when_asked(
    fake: FakeDevice, store: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ftcomm.Group("nccl", timeout=10.0) as g:
        await g.configure(_addr(store), 0, 1, global_ranks=[3])
        await g.abort()
        assert fake.dumps == []  # off unless asked
        monkeypatch.setenv("TORCHFT_TRIGGER_FR_ON_ABORT", "true")
        await g.configure(_addr(store), 0, 1, global_ranks=[3])
        pg = fake.group
        order: list[str] = []
        dump = fake.dump_flight_recorder
        monkeypatch.setattr(fake, "dump_flight_recorder", lambda r: order.append("dump") or dump(r))
        monkeypatch.setattr(pg, "abort", lambda: order.append("abort"))
        await g.abort()
        assert fake.dumps == [3]  # the global rank names the trace
        assert order == ["dump", "abort"]


# -- the c10d facade ---------------------------------------------------------------------------


def test_the_facade_wait_orders_the_stream_and_the_loop_keeps_the_deadline(
    fake: FakeDevice, store: StoreServer
) -> None:
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=10))
    pg.configure(_addr(store), "0", 0, 1)
    try:
        assert pg.getBackendName() == "ftcomm-nccl"
        fake.hold()
        t = torch.ones(2)
        work = pg.allreduce([t])
        fut = work.get_future()
        start = time.monotonic()
        assert work.wait() is True  # c10d's meaning: the stream waits, the CPU does not
        assert time.monotonic() - start < 1.0
        event = fake.group.events[-1]
        assert fake.joins == [(event, t.device)]  # the op's device's current stream
        assert not event.done
        assert not fut.done()
        event.complete()
        assert fut.wait() == [t]  # the future completes once the device work has
        # A deadline the loop holds: the next op times out with nobody waiting on the CPU.
        pg.set_timeout(timedelta(seconds=0.2))
        late = pg.allreduce([torch.ones(1)])
        late.wait()
        deadline = time.monotonic() + 5.0
        while pg.errored() is None and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert isinstance(pg.errored(), CommTimeout)
        with pytest.raises(RuntimeError, match="CommTimeout"):  # a torch future's error
            late.get_future().wait()
        # A barrier's wait() blocks the CPU, as c10d's does; synchronize() orders the stream.
        fake.release()
        pg.set_timeout(timedelta(seconds=10))
        pg.configure(_addr(store), "0", 0, 1)
        fake.hold()
        barrier = pg.barrier()
        releaser = threading.Timer(0.2, fake.release)
        start = time.monotonic()  # before the timer starts: its 0.2 s count from here on
        releaser.start()
        assert barrier.wait() is True
        assert time.monotonic() - start >= 0.15  # it waited for the device
        releaser.join()
        fake.hold()
        joins = len(fake.joins)
        pending = pg.allreduce([torch.ones(1)])
        pending.synchronize()
        assert len(fake.joins) == joins + 1
        # wait(timeout) blocks the CPU with that deadline, as ftcomm's facade does everywhere.
        fake.release()
        pg.set_timeout(timedelta(seconds=10))
        pg.configure(_addr(store), "0", 0, 1)
        fake.hold()
        with pytest.raises(CommTimeout):
            pg.allreduce([torch.ones(1)]).wait(timedelta(seconds=0.1))
    finally:
        pg.shutdown()


@pytest.mark.parametrize("flavor", [NCCL, XCCL], ids=["nccl", "xccl"])
def test_xccl_takes_the_same_path_as_nccl(
    flavor: Flavor, monkeypatch: pytest.MonkeyPatch, store: StoreServer
) -> None:
    fake = _fake(monkeypatch, flavor)
    monkeypatch.setattr(accelerator, "_warned_local", set())
    cls = ProcessGroupNCCL if flavor is NCCL else ProcessGroupXCCL
    pg = cls(timeout=timedelta(seconds=10))
    if flavor.real_abort:
        pg.configure(_addr(store), "0", 0, 1)
    else:  # torch's XCCL abort() does nothing: said once, at configure
        with pytest.warns(RuntimeWarning, match="XCCL backend has no abort"):
            pg.configure(_addr(store), "0", 0, 1)
    try:
        assert pg.getBackendName() == f"ftcomm-{flavor.name}"
        import os

        if flavor.nonblocking_env is not None:
            assert os.environ[flavor.nonblocking_env] == "10"
        pg.allreduce([torch.ones(1)]).wait()
        fake.hold()
        with pytest.raises(CommTimeout):
            pg.allreduce([torch.ones(1)]).wait(timedelta(seconds=0.1))
        native = fake.group
        deadline = time.monotonic() + 5.0
        while not native.aborted and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert native.aborts == 1
    finally:
        pg.shutdown()


def test_the_subprocess_variants_are_built_for_the_accelerator() -> None:
    from ftcomm.backends.subprocess import subprocess_class

    for name, device in (("nccl", "cuda"), ("xccl", "xpu")):
        cls = subprocess_class(name)
        assert cls.inner is backend_class(name)
        assert cls.device_type == device
        assert cls.reduce_ops == backend_class(name).reduce_ops


# -- the state copy -------------------------------------------------------------------


def _within(where: tuple[int, int], owner: torch.Tensor) -> bool:
    """Whether bytes at ``where`` (address, size) lie in ``owner``'s storage."""
    start = owner.untyped_storage().data_ptr()
    end = start + owner.untyped_storage().nbytes()
    return start <= where[0] and where[0] + where[1] <= end


@pytest.mark.asyncio
async def test_a_state_copy_on_an_accelerator_group_moves_device_tensors_in_place(
    fake: FakeDevice, store: StoreServer
) -> None:
    """sync_state's stream on NCCL: each tensor on the group's device goes
    straight from the sender's storage and lands straight in the receiver's
    own tensor, or in the new one made where it holds none, in chunks (no
    staging, no host copy); the fake device layer records where the bytes
    each send and recv was given lie."""
    from ftcomm._membership import _state_copy, _state_land, _state_wire

    monkey = pytest.MonkeyPatch()
    monkey.setattr(_state_copy, "CHUNK", 1 << 12)  # 16 KiB tensors in 4 KiB chunks
    try:
        async with ftcomm.Group("nccl", timeout=30.0) as g:
            await g.configure(_addr(store, 2), 0, 2)
            device = _state_copy.device_of(g)
            mine = {"w": torch.zeros(64, 64), "b": torch.zeros(3)}
            described = _state_wire.describe(mine, device)
            assert all(spec.on_group for spec in described.specs)
            tree, specs = _state_wire.parse(described.encode())
            deadline = time.monotonic() + 30
            receivers = []
            for template in (mine, {}):  # its own tensors; new ones
                landing = _state_land.match(template, tree, specs)
                receiver = _state_copy._Receiver(landing, device, deadline)
                await _state_copy._stream(g, specs, receiver, 1, None, 16, deadline)
                receivers.append((receiver, landing))
            sender = _state_copy._Sender(described, device, deadline)
            await _state_copy._stream(g, specs, sender, None, 1, 16, deadline)
        (native,) = fake.groups[-1:]
        recvs = [(p, n) for op, p, n in native.p2p if op == "recv:1"]
        sends = [(p, n) for op, p, n in native.p2p if op == "send:1"]
        new = receivers[1][1].targets
        assert new[0] is not None
        assert new[1] is not None
        assert new[0] is not mine["w"]
        for chunks, (w, b) in (
            (recvs[:5], (mine["w"], mine["b"])),
            (recvs[5:], (new[0], new[1])),
            (sends, (mine["w"], mine["b"])),
        ):
            assert [n for _, n in chunks] == [4096] * 4 + [12]  # w in four chunks, b in one
            assert all(_within(c, w) for c in chunks[:4])
            assert _within(chunks[4], b)
        assert sender.pool.made == 0  # nothing staged
        assert all(r.pool.made == 0 for r, _ in receivers)
    finally:
        monkey.undo()
