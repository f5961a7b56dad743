"""The subprocess backend when something gives way under an op.

* ``/dev/shm`` is full: staging reserves an op's bytes before copying, so the
  caller gets an ``OSError`` naming the directory and its free space instead
  of dying of SIGBUS on its first write, and nothing is left behind.
* An op cannot be sent: more tensors than a frame carries is a ``ValueError``
  up front; a frame that fails to encode leaves no call, pin, segment or
  "already sent" descriptor behind.
* A frame waits in the socket's backlog: it keeps the storages whose
  descriptors it carries alive, and a frame whose descriptors the kernel
  refuses fails its op only; the frames behind it, and the worker, go on.

The backlog is forced by holding the channel's writes (``_send`` reports a
full socket, ``_arm`` waits) until the test lets it flush.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from helpers import StoreServer, subprocess_backend
from test_subprocess_device import FakeCalls
from torch.distributed import ReduceOp

import ftcomm
from ftcomm import CommFailed, ProtocolError
from ftcomm._protocol import Op, TensorDesc
from ftcomm._runtime.loop import get_runtime
from ftcomm.backends.subprocess import _pool, _shm
from ftcomm.backends.subprocess._channel import Channel
from ftcomm.backends.subprocess._client import Call, WorkerProcess
from ftcomm.backends.subprocess._device import DeviceStorages

# What these check runs on ftcomm's owner loop and in the worker: asyncio only.
pytestmark = pytest.mark.one_loop


@pytest_asyncio.fixture
async def group(store: StoreServer) -> AsyncIterator[ftcomm.Group]:
    async with ftcomm.Group(
        "gloo", subprocess=True, spare_worker=False, timeout=10, configure_timeout=60
    ) as g:
        await g.configure(f"127.0.0.1:{store.port}/f", 0, 1)
        yield g


def _mine() -> set[str]:
    """This process's segment names in /dev/shm."""
    return {n for n in os.listdir(_shm.SHM_DIR) if n.startswith(f"ftcomm-{os.getpid()}-")}


class SmallShm:
    """``posix_fallocate`` as on a nearly full tmpfs: a reservation of more
    than ``limit`` bytes fails with ``ENOSPC``; ``calls`` lists them all."""

    def __init__(self) -> None:
        self.limit = 1 << 20
        self.calls: list[tuple[int, int]] = []
        self._real = os.posix_fallocate

    def __call__(self, fd: int, offset: int, length: int) -> None:
        self.calls.append((offset, length))
        if length > self.limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._real(fd, offset, length)


@pytest.fixture
def small_shm(monkeypatch: pytest.MonkeyPatch) -> SmallShm:
    fake = SmallShm()
    monkeypatch.setattr(os, "posix_fallocate", fake)
    return fake


# -- /dev/shm full ----------------------------------------------------------------------------
def test_a_full_dev_shm_is_an_oserror_that_leaves_nothing_behind(small_shm: SmallShm) -> None:
    pool = _pool.Pool()
    before, pins = _mine(), dict(_pool._pins)
    try:
        t = torch.ones(1 << 20)  # 4 MiB
        with pytest.raises(OSError, match="no room") as info:
            pool.stage([(t, "inout")])
        assert info.value.errno == errno.ENOSPC
        assert _shm.SHM_DIR in str(info.value)
        assert "MiB free of" in str(info.value)
        del info  # its traceback holds this frame, and this frame the mappings made below
        assert small_shm.calls == [(0, 4 << 20)]  # reserved up front, before any copy
        assert _mine() == before  # the segment's name is gone
        assert pool.segments == 0
        assert _pool._pins == pins  # nothing pinned
        staged = pool.stage([(torch.full((4,), 2.0), "inout")])  # a smaller op fits
        assert torch.equal(staged.copy_back[0][1], torch.full((4,), 2.0))
        staged.unpin()
    finally:
        pool.close()


def test_a_reused_segment_reserves_what_a_larger_op_needs(small_shm: SmallShm) -> None:
    pool = _pool.Pool()
    try:
        first = pool.stage([(torch.ones(160 * 1024), "in")])  # 640 KiB: a 1 MiB segment
        assert first.segment is not None
        assert small_shm.calls == [(0, 640 * 1024)]  # its bytes, not its size class
        first.unpin()
        pool.give_back(first.segment)
        small_shm.calls.clear()
        small_shm.limit = 0  # full now
        with pytest.raises(OSError, match="no room"):
            pool.stage([(torch.ones(250 * 1024), "in")])  # 1000 KiB: the same segment
        assert small_shm.calls == [(640 * 1024, 360 * 1024)]  # only the bytes it lacked
        # The segment went back with what it had: the first layout reuses it, no call.
        small_shm.calls.clear()
        again = pool.stage([(torch.ones(160 * 1024), "in")])
        assert again.segment is first.segment
        assert small_shm.calls == []
        again.unpin()
    finally:
        pool.close()


_STAGE_ON_A_SMALL_TMPFS = """
import errno, json, os, sys
import torch
from ftcomm.backends.subprocess import _pool, _shm
_shm.SHM_DIR = sys.argv[1]
pool = _pool.Pool()
out = {}
try:
    pool.stage([(torch.ones(1 << 20), "inout")])  # 4 MiB into 1 MiB
    out["big"] = "staged"
except OSError as exc:
    out["big"] = [exc.errno, str(exc)]
out["files"] = os.listdir(sys.argv[1])
out["pins"] = len(_pool._pins)
staged = pool.stage([(torch.full((1024,), 2.0), "inout")])
out["small"] = staged.copy_back[0][1][:2].tolist()
staged.unpin()
pool.close()
out["left"] = os.listdir(sys.argv[1])
print(json.dumps(out))
"""


def _in_a_small_tmpfs(where: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` where ``where`` is a fresh 1 MiB tmpfs, in a mount
    namespace of its own (the mount goes with the process); skips where
    that cannot be done (no unshare, neither user namespaces nor root)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs")
    where.mkdir()
    mount = f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(where))} || exit 77"
    for ns in (["--user", "--map-root-user", "--mount"], ["--mount"]):
        command = [unshare, *ns, "sh", "-c"]
        probe = subprocess.run([*command, mount], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            break
    else:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()[:200]}")
    return subprocess.run(
        [*command, f'{mount}; exec "$@"', "sh", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(ftcomm.__file__).parents[1],  # the ftcomm under test
    )


def test_a_real_full_tmpfs_is_an_oserror_not_a_sigbus(tmp_path: Path) -> None:
    where = tmp_path / "shm"
    proc = _in_a_small_tmpfs(where, sys.executable, "-c", _STAGE_ON_A_SMALL_TMPFS, str(where))
    assert proc.returncode == 0, f"exit {proc.returncode} (135: SIGBUS): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout)
    code, message = out["big"]
    assert code == errno.ENOSPC
    assert str(where) in message
    assert "MiB free of 1.0 MiB" in message
    assert out["files"] == []  # the failed op's segment is gone
    assert out["pins"] == 0
    assert out["small"] == [2.0, 2.0]  # a smaller op fits afterwards
    assert out["left"] == []


@pytest.mark.asyncio
async def test_a_full_dev_shm_reaches_the_caller_and_a_smaller_op_works(
    group: ftcomm.Group, small_shm: SmallShm
) -> None:
    worker = subprocess_backend(group).worker
    assert torch.equal(await group.allreduce(torch.ones(2)), torch.ones(2))
    segments, pins = worker.pool.segments, dict(_pool._pins)
    with pytest.raises(OSError, match="no room") as info:
        group.allreduce(torch.ones(1 << 20))  # 4 MiB
    assert info.value.errno == errno.ENOSPC
    text = str(info.value)
    del info  # its traceback holds this frame, and this frame the tensors below
    assert text.startswith("[Errno 28] allreduce: ")
    assert _shm.SHM_DIR in text
    assert "free" in text
    assert group.errored() is None  # nothing was sent: the group is usable
    assert worker.in_flight == 0
    assert worker.pool.segments == segments
    assert _pool._pins == pins
    assert torch.equal(await group.allreduce(torch.full((1024,), 3.0)), torch.full((1024,), 3.0))


# -- an op that cannot be sent ------------------------------------------------------------------
def test_the_tensor_cap_is_the_protocols() -> None:
    from ftcomm.backends.subprocess import MAX_TENSORS

    desc = TensorDesc("empty", "float32", (0,), (1,))
    Op(1, "allreduce", (desc,) * MAX_TENSORS)
    with pytest.raises(ProtocolError):
        Op(1, "allreduce", (desc,) * (MAX_TENSORS + 1))


@pytest.mark.asyncio
async def test_more_tensors_than_an_op_carries_is_a_clear_value_error(
    group: ftcomm.Group,
) -> None:
    worker = subprocess_backend(group).worker
    pins = dict(_pool._pins)
    grads = [torch.ones(1) for _ in range(5000)]
    with pytest.raises(ValueError, match=r"allreduce: tensors: 5000 tensors, more than the 4096"):
        group.allreduce_coalesced(grads)
    assert worker.in_flight == 0
    assert worker.pool.segments == 0  # refused before anything was staged
    assert _pool._pins == pins
    assert group.errored() is None
    out = await group.allreduce_coalesced(grads[:3])
    assert all(torch.equal(t, torch.ones(1)) for t in out)


@pytest.mark.asyncio
async def test_an_op_that_fails_to_encode_leaves_nothing_behind(
    group: ftcomm.Group, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ftcomm.backends.subprocess import _client

    worker = subprocess_backend(group).worker
    assert torch.equal(await group.allreduce(torch.ones(2)), torch.ones(2))
    shared = torch.full((256,), 2.0)
    shared.share_memory_()  # goes by fd: the failed op must not count it as sent
    real = _client.encode_op

    def broken(*args: Any) -> bytes:
        raise ProtocolError("a payload of 2000000 bytes is over the cap")

    monkeypatch.setattr(_client, "encode_op", broken)
    segments, pins = worker.pool.segments, dict(_pool._pins)
    with pytest.raises(ValueError, match="does not fit in a frame to the worker"):
        group.allreduce_coalesced([torch.ones(8), shared])
    assert worker._calls == {}
    assert _pool._pins == pins
    assert worker.pool.segments == segments  # the first op's, reused
    assert sum(map(len, worker.pool._free.values())) == segments  # and back in the pool
    assert worker.pool.shared._sent == {}  # the fd never went out
    monkeypatch.setattr(_client, "encode_op", real)
    # The storage's fd goes with the next op that uses it.
    out = await group.allreduce_coalesced([torch.ones(8), shared])
    assert torch.equal(out[1], torch.full((256,), 2.0))
    assert group.errored() is None


def test_an_unsent_device_op_gives_back_its_shares_releases_and_acks() -> None:
    calls = FakeCalls()
    pool = _pool.Pool()
    pool.device = DeviceStorages(calls)
    try:
        old = calls.cuda(torch.ones(4))
        first = pool.stage([(old, "inout")])
        assert first.device is not None
        del old, first
        gc.collect()  # its storage dies: the next op releases it
        pool.device.acknowledge(7)  # and says op 7's reply event was waited on
        t = calls.cuda(torch.ones(8))
        staged = pool.stage([(t, "inout")])
        assert staged.options["release_ipc"] == (1,)
        assert staged.options["events_done"] == (7,)
        assert ":" in staged.descs[0].handle[len("ipc:") :]  # shared with its record
        pool.unstage(staged)  # it never reached the worker
        share = [e for e in calls.log if e[0] == "share"][-1]
        assert calls.log[-1] == ("release", share[1])  # its new share is given back
        again = pool.stage([(t, "inout")])
        assert again.options["release_ipc"] == (1,)  # said again, by this op
        assert again.options["events_done"] == (7,)
        assert ":" in again.descs[0].handle[len("ipc:") :]  # shared again, with its record
        assert [e[0] for e in calls.log].count("share") == 3
        assert ("release", 1) not in calls.log  # the worker releases that one
    finally:
        pool.close(reaped=False)


# -- a frame that waits, or is refused ------------------------------------------------------------
class _Held:
    """Holds ``channel``'s writes: the socket reads as full until :meth:`release`."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        channel._send = lambda data, fds: 0  # type: ignore[method-assign]
        channel._arm = lambda: None  # type: ignore[method-assign]

    def release(self) -> None:
        del self.channel._send, self.channel._arm
        get_runtime().call_soon(self.channel._arm)


async def _ended(call: Call, timeout: float = 5.0) -> BaseException | None:
    """``call``'s outcome once it ends (on this loop)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[BaseException | None] = loop.create_future()

    def done(error: BaseException | None) -> None:
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(error))

    call.on_done(done)
    return await asyncio.wait_for(fut, timeout)


def _op(worker: WorkerProcess, tensors: list[torch.Tensor]) -> tuple[Any, dict[str, Any]]:
    staged = worker.pool.stage([(t, "inout") for t in tensors])
    return staged, {"timeout": 10.0, "reduce_op": "SUM", **staged.options}


@pytest.mark.asyncio
async def test_a_queued_op_keeps_the_storage_whose_fd_it_carries(group: ftcomm.Group) -> None:
    backend = subprocess_backend(group)
    worker = backend.worker
    assert torch.equal(await group.allreduce(torch.ones(2)), torch.ones(2))
    held = _Held(worker.channel)
    t = torch.full((1024,), 5.0)
    t.share_memory_()
    first = backend.allreduce([t], ReduceOp.SUM, 10.0)  # a send's Work holds no tensor either
    second = backend.allreduce([torch.ones(4)], ReduceOp.SUM, 10.0)
    assert isinstance(first, Call)
    assert isinstance(second, Call)
    assert worker.channel._backlog  # both wait for room
    del t
    gc.collect()  # the caller is done with its tensor: its storage would go, and its fd
    held.release()
    assert await _ended(first) is None
    assert await _ended(second) is None
    assert worker.death is None


@pytest.mark.asyncio
async def test_a_refused_op_fails_alone_and_the_ops_behind_it_go_on(group: ftcomm.Group) -> None:
    worker = subprocess_backend(group).worker
    assert torch.equal(await group.allreduce(torch.ones(2)), torch.ones(2))
    t = torch.full((64,), 2.0)
    t.share_memory_()
    held = _Held(worker.channel)
    staged, options = _op(worker, [t])
    staged.fds = (-1,)  # the kernel refuses it: EBADF
    refused = worker.submit("allreduce", staged, options)
    behind = worker.submit("allreduce", *_op(worker, [torch.ones(4)]))
    held.release()
    error = await _ended(refused)
    assert isinstance(error, CommFailed)
    assert "refused its file descriptors" in str(error)
    assert await _ended(behind) is None
    assert worker.death is None
    assert worker.in_flight == 0
    # The refused op's fd never went out: the next op that uses the storage sends it.
    again = worker.submit("allreduce", *_op(worker, [t]))
    assert await _ended(again) is None
    # Refused at once (nothing queued): that op fails, the worker is fine.
    u = torch.ones(64)
    u.share_memory_()
    staged, options = _op(worker, [u])
    staged.fds = (-1,)
    error = await _ended(worker.submit("allreduce", staged, options))
    assert isinstance(error, CommFailed)
    assert worker.death is None
    assert worker.in_flight == 0
    assert torch.equal(await group.allreduce(u), torch.ones(64))


async def _on_loop(fn: Any, *args: Any) -> None:
    fn(*args)


@pytest.mark.asyncio
async def test_a_channel_drops_only_the_frame_whose_fds_are_refused() -> None:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    b.setblocking(False)
    channel = Channel(a)
    channel.bind(get_runtime().loop)
    r, w = os.pipe()
    try:
        held = _Held(channel)
        refused: asyncio.Future[OSError] = loop.create_future()

        def on_refused(error: OSError) -> None:
            loop.call_soon_threadsafe(refused.set_result, error)

        channel.send_bytes(b"first", (-1,), refused=on_refused)
        channel.send_bytes(b"second", (r,), owner=object(), refused=on_refused)
        channel.send_bytes(b"third")
        held.release()
        assert (await asyncio.wait_for(refused, 5.0)).errno == errno.EBADF
        got = b""
        while len(got) < len(b"secondthird"):
            got += await asyncio.wait_for(loop.sock_recv(b, 64), 5.0)
        assert got == b"secondthird"  # the frames behind it went out, in order
        channel.send_bytes(b"fourth")  # and the channel is still open
        assert await asyncio.wait_for(loop.sock_recv(b, 64), 5.0) == b"fourth"
    finally:
        await asyncio.wrap_future(get_runtime().submit(_on_loop(channel.close)))
        b.close()
        os.close(r)
        os.close(w)
