"""Where native failures become ftcomm errors: configure() (by type, keeping
the native message, holding nothing native) and issuing an op."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from helpers import StoreServer, peers_came

import ftcomm
from ftcomm._runtime.loop import get_runtime
from ftcomm._store import ConnectProgress
from ftcomm.backends import Backend, ConnectSpec
from ftcomm.backends import gloo as gloo_mod
from ftcomm.backends.subprocess._client import connecting, starting
from ftcomm.testing import inspect
from ftcomm.testing._base import fds_opened_since, open_fds


class _Refused(dist.ProcessGroupGloo):  # type: ignore[misc]
    """Gloo's group construction failing the way a vanished peer makes it."""

    error: type[Exception] = RuntimeError

    def __init__(self, *args: object) -> None:
        raise self.error("Connection refused (from the test's stand-in for Gloo)")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("native", "expected"),
    [
        (RuntimeError, ftcomm.CommFailed),
        (dist.DistStoreError, ftcomm.CommTimeout),
        (dist.DistNetworkError, ftcomm.CommFailed),  # a broken connection
        (TimeoutError, ftcomm.CommTimeout),
    ],
)
async def test_a_failed_configure_is_classified_by_type_and_keeps_the_cause(
    store: StoreServer,
    monkeypatch: pytest.MonkeyPatch,
    native: type[Exception],
    expected: type[ftcomm.CommError],
) -> None:
    monkeypatch.setattr(_Refused, "error", native)
    monkeypatch.setattr(gloo_mod.dist, "ProcessGroupGloo", _Refused)
    g = ftcomm.Group("gloo", timeout=30)
    peers_came(store.port, "refused", 2, [1])
    with pytest.raises(expected, match="Connection refused") as info:
        await g.configure(f"127.0.0.1:{store.port}/refused", 0, 2)
    assert type(info.value) is expected
    assert isinstance(info.value.__cause__, native)
    assert info.value.op == "configure"
    assert g.state is ftcomm.State.UNCONFIGURED
    await g.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("step", "waited"),
    [
        (starting, "the worker process was still starting"),
        (connecting, "the worker process was still connecting"),
    ],
    ids=["starting", "connecting"],
)
async def test_a_workers_timeout_that_comes_first_says_configures_timeout(
    store: StoreServer, step: Callable[[ConnectProgress], None], waited: str
) -> None:
    """A worker's start and its connect are given configure()'s deadline;
    their own TimeoutError may land before configure()'s timer fires (seen
    on a loaded box). Forced here: it comes at once, 30 s before ours.
    Either way the error is configure()'s timeout, saying what it waited for."""
    g = ftcomm.Group("gloo", timeout=30)

    def worker_never_answers(spec: ConnectSpec, cancel: object) -> Backend:
        step(spec.progress)
        raise TimeoutError("the worker did not answer in time")

    g._configurer._connect = worker_never_answers  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(ftcomm.CommTimeout) as info:
        await g.configure(f"127.0.0.1:{store.port}/slow-worker", 0, 2)
    assert time.monotonic() - started < 10  # the worker's error, not our timer
    assert str(info.value).startswith("configure timed out after 30 seconds: ")
    assert waited in str(info.value)
    assert info.value.op == "configure"
    assert g.state is ftcomm.State.UNCONFIGURED
    await g.shutdown()


@pytest.mark.asyncio
async def test_a_held_configure_error_holds_no_native_fds(
    store: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error's traceback must not keep the half-built group (its Gloo
    device: listening socket, epoll, pipe) open: a trainer keeps the error
    (torchft's Manager does). The worker pool strips the tracebacks of what
    it runs; this keeps it so."""
    monkeypatch.setattr(gloo_mod.dist, "ProcessGroupGloo", _Refused)
    g = ftcomm.Group("gloo", timeout=30)
    peers_came(store.port, "held", 2, [1])
    before = open_fds()
    try:
        await g.configure(f"127.0.0.1:{store.port}/held", 0, 2)
    except ftcomm.CommFailed as exc:
        held: BaseException | None = exc
    else:
        pytest.fail("configure succeeded against a refusing peer")
    rt = get_runtime()
    assert rt.control.wait_idle(10)
    assert rt.reaper.wait_idle(10)
    # The store server runs in this process: its end of the configure's
    # connection closes on its own thread once it reads the client's close
    # (late, on a busy machine: an fd for a moment, nothing to await). A
    # group the error held would hold its fds for good.
    for _ in range(200):  # 10 s at most
        left = fds_opened_since(before)
        if not left:
            break
        await asyncio.sleep(0.05)
    assert not left, [os.readlink(f"/proc/self/fd/{fd}") for fd in left]
    assert held is not None
    del held
    await g.shutdown()


@pytest.mark.asyncio
async def test_a_native_group_that_refuses_to_issue_errors_the_group() -> None:
    """Gloo raises at issue once its pairs are closed ("Application timeout
    caused pair closure"): that is a broken group, not a bad argument."""
    g = ftcomm.Group("dummy")
    await g.configure("127.0.0.1:1/refuse", 0, 1)
    cfg = inspect(g).config
    assert cfg is not None

    def refuse(*args: object) -> object:
        raise RuntimeError("Application timeout caused pair closure")

    cfg.backend.allreduce = refuse  # type: ignore[method-assign]
    with pytest.raises(ftcomm.CommFailed, match="could not be issued: Application timeout"):
        g.allreduce(torch.ones(2))
    assert g.state is ftcomm.State.ERRORED
    assert isinstance(g.errored(), ftcomm.CommFailed)
    with pytest.raises(ftcomm.CommAborted, match="refused"):
        g.barrier()
    await g.shutdown()


_STORE_PROCESS = """
import sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_a_store_that_dies_mid_configure_is_a_failure_not_a_timeout() -> None:
    """c10d raises DistNetworkError at once for a broken store connection, as
    it does after a connect timeout: only the timeout is CommTimeout."""
    server = subprocess.Popen(
        [sys.executable, "-c", _STORE_PROCESS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdin is not None
    assert server.stdout is not None
    try:
        port = int(server.stdout.readline())
        raised = asyncio.run(_configure_while_the_store_dies(port, server))
    finally:
        server.kill()
        server.wait()
        server.stdin.close()
        server.stdout.close()
    assert isinstance(raised, ftcomm.CommFailed), raised
    assert isinstance(raised.__cause__, dist.DistNetworkError)


async def _configure_while_the_store_dies(
    port: int, server: subprocess.Popen[str]
) -> BaseException | None:
    g = ftcomm.Group("gloo", timeout=30)
    task = asyncio.ensure_future(g.configure(f"127.0.0.1:{port}/dies", 0, 2))
    probe = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    try:
        deadline = time.monotonic() + 10
        while probe.num_keys() == 0:  # rank 0 is in the store, waiting for rank 1
            assert not task.done(), task
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    finally:
        del probe
    server.kill()  # the store's process dies
    started = time.monotonic()
    try:
        await task
    except ftcomm.CommError as exc:
        raised: BaseException | None = exc
    else:
        raised = None
    assert time.monotonic() - started < 10  # at once, not at the 30 s timeout
    await g.shutdown()
    return raised


def test_a_store_nobody_listens_on_is_a_timeout() -> None:
    """c10d retries a refused connect until its timeout and then raises
    DistNetworkError, as it does at once for a broken connection, logging a
    C++ stack per try: ftcomm tries the port itself first, and raises
    TimeoutError that says why, with the refusal as its cause."""
    from helpers import free_port

    from ftcomm._store import StoreAddr, connect_store

    with pytest.raises(TimeoutError, match=r"did not answer within 0\.5 s") as info:
        connect_store(StoreAddr("127.0.0.1", free_port(), "x"), 0.5)
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
    assert "connection refused" in str(info.value)
