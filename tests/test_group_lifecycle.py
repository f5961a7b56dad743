"""Group configuration lifecycles in one process (world size 1 on a real store)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import TCPStore

import ftcomm
from ftcomm.backends.gloo import GlooBackend


@pytest.fixture
def store_port() -> Iterator[int]:
    holder = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)]
    yield holder[0].port
    holder.clear()


@pytest.mark.asyncio
async def test_configure_cancelled_as_the_group_lands_disposes_it(
    store_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[GlooBackend] = []
    closed: list[GlooBackend] = []
    landed = threading.Event()
    connect, close = GlooBackend.connect.__func__, GlooBackend.close  # type: ignore[attr-defined]

    def spy_connect(cls: Any, spec: Any, cancel: Any = None) -> GlooBackend:
        backend: GlooBackend = connect(cls, spec, cancel)
        built.append(backend)
        landed.set()
        return backend

    def spy_close(self: GlooBackend) -> list[object]:
        closed.append(self)
        return close(self)  # type: ignore[no-any-return]

    monkeypatch.setattr(GlooBackend, "connect", classmethod(spy_connect))
    monkeypatch.setattr(GlooBackend, "close", spy_close)
    g = ftcomm.Group("gloo", timeout=10)
    task = asyncio.ensure_future(g.configure(f"127.0.0.1:{store_port}/a", 0, 1))
    await asyncio.sleep(0)  # configure has handed the connect to a thread
    assert landed.wait(10)  # the loop is held: the group lands before it resumes
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert g.errored() is None
    with pytest.raises(ftcomm.NotConfigured):
        g.allreduce(torch.ones(1))
    assert built
    assert closed == built, "the group built for a cancelled configure() was not disposed"


def test_one_group_from_two_threads_with_two_event_loops(store_port: int) -> None:
    """Callers on other threads and other loops share one group (world size 1)."""
    from ftcomm._runtime.loop import new_event_loop

    g = ftcomm.Group("gloo", timeout=10)
    setup = new_event_loop("asyncio")
    try:
        setup.run_until_complete(g.configure(f"127.0.0.1:{store_port}/threads", 0, 1))
    finally:
        setup.close()
    results: dict[str, float] = {}
    errors: list[BaseException] = []

    def caller(kind: str) -> None:
        async def many() -> float:
            total = 0.0
            for i in range(200):
                t = torch.full((4,), float(i))
                total += float((await g.allreduce(t)).sum())
            return total

        loop = new_event_loop(kind)
        try:
            results[kind] = loop.run_until_complete(many())
        except BaseException as exc:
            errors.append(exc)
        finally:
            loop.close()

    threads = [threading.Thread(target=caller, args=(k,)) for k in ("asyncio", "uvloop")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == {"asyncio": 4.0 * sum(range(200)), "uvloop": 4.0 * sum(range(200))}
    assert g.errored() is None
    assert g.num_active_work() == 0
    teardown = new_event_loop("asyncio")
    try:
        teardown.run_until_complete(g.shutdown())
    finally:
        teardown.close()


def test_a_thread_without_a_loop_waits_on_real_gloo_ops(store_port: int) -> None:
    from ftcomm._runtime.loop import new_event_loop

    g = ftcomm.Group("gloo", timeout=10)
    setup = new_event_loop("asyncio")
    try:
        setup.run_until_complete(g.configure(f"127.0.0.1:{store_port}/sync", 0, 1))
        got: list[float] = []
        worker = threading.Thread(
            target=lambda: got.extend(
                g.allreduce(torch.full((2,), float(i))).wait(timeout=10).sum().item()
                for i in range(50)
            )
        )
        worker.start()
        worker.join(30)
        assert got == [2.0 * i for i in range(50)]
        setup.run_until_complete(g.shutdown())
    finally:
        setup.close()


async def _pair(port: int, prefix: str) -> tuple[ftcomm.Group, ftcomm.Group]:
    g0, g1 = ftcomm.Group("gloo", timeout=10), ftcomm.Group("gloo", timeout=10)
    addr = f"127.0.0.1:{port}/{prefix}"
    await asyncio.gather(g0.configure(addr, 0, 2), g1.configure(addr, 1, 2))
    return g0, g1


@pytest.mark.asyncio
async def test_an_op_is_a_coroutine_for_tasks_and_anyio_task_groups(store_port: int) -> None:
    """``tg.start_soon(group.allreduce, t)`` (anyio wants a coroutine) and
    ``asyncio.create_task(group.allreduce(t))`` run the op's await."""
    import anyio

    g0, g1 = await _pair(store_port, "coro")
    try:
        assert asyncio.iscoroutine(g0.barrier())
        await g1.barrier()
        ts = [[torch.full((2,), float(i + 10 * r)) for i in range(3)] for r in range(2)]
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(g0.allreduce, ts[0][i])
                tg.start_soon(g1.allreduce, ts[1][i])
        assert [t.tolist() for t in ts[0]] == [[10.0, 10.0], [12.0, 12.0], [14.0, 14.0]]
        assert [t.tolist() for t in ts[1]] == [t.tolist() for t in ts[0]]
        work = g0.allgather(torch.tensor([7.0]))
        other = asyncio.create_task(g1.allgather(torch.tensor([8.0])))
        # one work driven by several tasks: each gets the result
        got = await asyncio.gather(asyncio.create_task(work), asyncio.wait_for(work, 5))
        assert [[x.item() for x in out] for out in got] == [[7.0, 8.0], [7.0, 8.0]]
        assert [x.item() for x in await asyncio.create_task(work)] == [7.0, 8.0]
        await other
    finally:
        await asyncio.gather(g0.shutdown(), g1.shutdown())


@pytest.mark.asyncio
async def test_a_task_cancelled_before_its_first_step_aborts_the_op(store_port: int) -> None:
    """asyncio throws the cancel into a task that never ran: the op is aborted
    as a cancelled ``await`` aborts it, and every later task over the same
    work sees that failure, never a success."""
    g0, g1 = await _pair(store_port, "cancel")
    try:
        work = g0.allreduce(torch.ones(1))  # rank 1 never joins it
        task = asyncio.create_task(work)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert work.done()
        assert isinstance(g0.errored(), ftcomm.CommAborted)
        assert "cancelled while in flight" in str(g0.errored())
        assert "aborted" in str(g0.errored())  # what torchft's users match
        for _ in range(2):
            with pytest.raises(ftcomm.CommAborted, match="cancelled while in flight"):
                await asyncio.create_task(work)
        # an abort's Closing, too, may be driven by several tasks
        closing = g0.abort()
        assert await asyncio.gather(asyncio.ensure_future(closing), closing) == [None, None]
    finally:
        await asyncio.gather(g0.shutdown(), g1.shutdown())
    # the class form of throw() (drivers other than asyncio use it) aborts too
    g0, g1 = await _pair(store_port, "cancel-class")
    try:
        pending = g1.barrier()  # rank 0 never joins it
        with pytest.raises(asyncio.CancelledError):
            pending.throw(asyncio.CancelledError)
        assert pending.done()
        assert isinstance(g1.errored(), ftcomm.CommAborted)
    finally:
        await asyncio.gather(g0.shutdown(), g1.shutdown())


@pytest.mark.asyncio
async def test_a_deadline_before_the_connect_began_says_so(
    store_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a busy machine a short configure timeout can pass before the
    connect's thread has run at all: the error says that (issue 35), not
    just the store's address."""
    began = threading.Event()
    go_on = threading.Event()
    connect = GlooBackend.connect.__func__  # type: ignore[attr-defined]

    def held_connect(cls: Any, spec: Any, cancel: Any = None) -> GlooBackend:
        began.set()
        go_on.wait(10)  # as if its thread had not been scheduled yet
        return connect(cls, spec, cancel)  # type: ignore[no-any-return]

    monkeypatch.setattr(GlooBackend, "connect", classmethod(held_connect))
    async with ftcomm.Group("gloo") as g:
        with pytest.raises(ftcomm.CommTimeout, match="connect had not begun") as info:
            await g.configure(f"127.0.0.1:{store_port}/p", 0, 1, timeout=0.2)
        assert f"store 127.0.0.1:{store_port}/p" in str(info.value)
        assert began.is_set()
        go_on.set()  # the connect that nobody waits for builds, and is disposed of
        await g.configure(f"127.0.0.1:{store_port}/q", 0, 1, timeout=10)
        assert (await g.allreduce(torch.ones(1))).item() == 1.0
