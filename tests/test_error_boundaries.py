"""configure()'s failures: one boundary that classifies them by type, keeps the
native message, and holds nothing native once the error is raised."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from helpers import StoreServer

import ftcomm
from ftcomm._runtime.loop import get_runtime
from ftcomm.backends import gloo as gloo_mod
from ftcomm.testing._world import _fds


@pytest.fixture
def store() -> Iterator[StoreServer]:
    server = StoreServer()
    yield server
    server.close()


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
        (dist.DistNetworkError, ftcomm.CommTimeout),
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
    with pytest.raises(expected, match="Connection refused") as info:
        await g.configure(f"127.0.0.1:{store.port}/refused", 0, 2)
    assert type(info.value) is expected
    assert isinstance(info.value.__cause__, native)
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
    before = _fds()
    try:
        await g.configure(f"127.0.0.1:{store.port}/held", 0, 2)
    except ftcomm.CommFailed as exc:
        held: BaseException | None = exc
    else:
        pytest.fail("configure succeeded against a refusing peer")
    rt = get_runtime()
    assert rt.control.wait_idle(10)
    assert rt.reaper.wait_idle(10)
    left = _fds() - before
    assert not left, [os.readlink(f"/proc/self/fd/{fd}") for fd in left]
    assert held is not None
    del held
    await g.shutdown()
