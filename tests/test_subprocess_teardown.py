"""A worker's teardown releases its ops' shared memory before it says so.

``WorkerProcess.exited`` completes "once the worker has exited and been
reaped, and its socket and shared memory are closed": ``shutdown()`` and
``abort()`` return on it, and the leak checks (``tests/conftest.py``,
``ftcomm.testing``) look for open descriptors right after. A segment's file
stays open in this process as long as its mapping does (``mmap`` holds its own
descriptor), and the mapping as long as anything references the op's
:class:`~ftcomm.backends.subprocess._client.Call`. So the teardown must hold
no call once ``exited`` completes.

It did: ``WorkerProcess._die`` ended its calls, completed ``exited``, and only
then dropped them, as its frame returned -- and ``mmap``'s deallocation
releases the GIL before it closes its descriptor, so a leak check woken by
``exited`` saw the segment's descriptor open about 1 run in 10.

The tests look from inside ``exited``'s own done-callback, which runs on the
owner loop as the future completes: whatever the teardown still holds then,
it holds for certain, not by chance of scheduling.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch
from helpers import StoreServer, subprocess_backend

import ftcomm
from ftcomm import CommAborted, WorkerDied
from ftcomm.backends.subprocess._client import WorkerProcess

# What these check runs on ftcomm's owner loop and in the worker: asyncio only.
pytestmark = pytest.mark.one_loop


@pytest_asyncio.fixture
async def group(store: StoreServer) -> AsyncIterator[ftcomm.Group]:
    async with ftcomm.Group(
        "gloo", subprocess=True, spare_worker=False, timeout=10, configure_timeout=60
    ) as g:
        await g.configure(f"127.0.0.1:{store.port}/t0", 0, 1)
        yield g


def _held(name: str) -> list[str]:
    """How this process still holds segment ``name``: mappings and descriptors."""
    path = f"/dev/shm/{name}"
    with open("/proc/self/maps") as f:
        held = [f"mapped {line.split()[0]}" for line in f if path in line]
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(path):
                held.append(f"fd {fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return held


def _stop_with_an_op_in_flight(group: ftcomm.Group) -> tuple[ftcomm.Work[torch.Tensor], str]:
    """A stopped worker with one allreduce in flight, and the name of its segment."""
    worker = subprocess_backend(group).worker
    os.kill(worker.pid, signal.SIGSTOP)  # the op stays in flight
    work = group.allreduce(torch.ones(4))
    (call,) = worker._calls.values()
    segment = call.staged.segment
    assert segment is not None
    name = segment.name
    del call, segment  # the test must not be what keeps the mapping
    assert _held(name), "the op's segment should be mapped while it is in flight"
    return work, name


class _Watch:
    """What still held a segment when ``exited`` completed, as seen from its
    done-callback (on the owner loop)."""

    def __init__(self, worker: WorkerProcess, name: str) -> None:
        self.name = name
        self.seen: list[str] | None = None
        self._looked = threading.Event()
        worker.exited.add_done_callback(self._look)

    def _look(self, _: object) -> None:
        self.seen = _held(self.name)
        self._looked.set()

    async def held(self) -> list[str] | None:
        """Once the callback has looked (the future is done before its
        callbacks run: an awaiter may wake first)."""
        assert await asyncio.to_thread(self._looked.wait, 5.0)
        return self.seen


# Neither test awaits the op before ``exited`` completes: an awaiting task
# holds the op's call in its own frames until it runs again, on its own loop
# (not the teardown's doing, and gone before the task's test ends).
@pytest.mark.asyncio
async def test_a_dead_worker_has_released_its_segments_once_exited_completes(
    group: ftcomm.Group,
) -> None:
    worker = subprocess_backend(group).worker
    work, name = _stop_with_an_op_in_flight(group)
    watch = _Watch(worker, name)
    os.kill(worker.pid, signal.SIGKILL)  # not on purpose: the group hears of it
    await asyncio.wait_for(asyncio.wrap_future(worker.exited), 5.0)
    assert await watch.held() == [], f"segment {name} was still held when exited completed"
    assert isinstance(work.exception(), WorkerDied)


@pytest.mark.asyncio
async def test_a_worker_killed_on_purpose_has_released_its_segments_once_exited_completes(
    group: ftcomm.Group,
) -> None:
    worker = subprocess_backend(group).worker
    work, name = _stop_with_an_op_in_flight(group)
    ended = threading.Event()
    work.add_done_callback(lambda _: ended.set())  # the op ends with the call
    watch = _Watch(worker, name)
    worker.kill()  # on purpose (what the backend's close() does): its ops end with it
    await asyncio.wait_for(asyncio.wrap_future(worker.exited), 5.0)
    assert await watch.held() == [], f"segment {name} was still held when exited completed"
    assert ended.is_set()
    assert isinstance(work.exception(), CommAborted)
