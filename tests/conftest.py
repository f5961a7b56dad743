from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker

import pytest
from helpers import ENGINE_ENV, StoreServer
from torch._C._distributed_c10d import TCPStore

from ftcomm import serve_store
from ftcomm._runtime.loop import get_runtime, new_event_loop
from ftcomm.testing import EtcdCluster, etcd_missing
from ftcomm.testing._base import (
    child_pids,
    fds_opened_since,
    open_fds,
    settle_fds,
    shm_segments,
    thread_ids,
)
from ftcomm.testing._world import _mp_context

os.environ.setdefault("FTCOMM_DEBUG", "1")
# c10d's TCPStore resolves every peer address to a name for its logs (a DNS
# PTR query, which /etc/hosts does not answer for the IPv4-mapped addresses it
# sees). Where the DNS server drops a query (this CI's drops one in ~25), the
# resolver waits its timeout, 5 s by default, in the middle of a configure:
# 1 s here. docs/errors.md says so for users.
os.environ.setdefault("RES_OPTIONS", "timeout:1")
# The watchdog is here to catch blocking calls on the owner loop, which block
# for an op's deadline (a second or more). On the 2-core CI box a callback can
# also wait 0.1-0.25 s for the GIL while a test thread runs gc.collect(); the
# watchdog cannot tell that from a blocked callback, so tests allow 0.5 s.
os.environ.setdefault("FTCOMM_STALL_MS", "500")


def pytest_configure(config: pytest.Config) -> None:
    """What every process that runs tests starts before the first one, so
    that it belongs to the baseline of every leak check. Not pytest-xdist's
    controller (``make test``), which runs none."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return
    # multiprocessing's long-lived helper process
    resource_tracker.ensure_running()
    # the fork server the worlds' ranks start from (torch imported once)
    _mp_context()
    # torch keeps a process-wide pipe pair once the first TCPStore server has run
    TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` run first (otherwise in file order): with
    ``make test``'s workers (pytest-xdist) the longest start early, and the
    short ones fill the gaps instead of a worker ending the run alone.

    A test run on both engines and both loops runs on etcd with asyncio
    only: an engine's calls run on ftcomm's control threads, never on the
    caller's loop, which the store's runs cover on both."""
    twice = [item for item in items if _engine_and_loop(item) == ("etcd", "uvloop")]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [item for item in items if _engine_and_loop(item) != ("etcd", "uvloop")]
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _engine_and_loop(item: pytest.Item) -> tuple[str, str] | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None or "engine" not in callspec.params:
        return None
    name = item.name
    loop = "uvloop" if "uvloop" in name else "asyncio"
    return str(callspec.params["engine"]), loop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every async test runs on both event loops, but those marked
    ``one_loop`` (asyncio only): what they check runs on ftcomm's owner loop
    and in worker processes, and the caller's loop only awaits, which the
    other tests check on both."""
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": lambda: new_event_loop("asyncio"),
        "uvloop": lambda: new_event_loop("uvloop"),
    }
    if item.get_closest_marker("one_loop") is not None:
        del factories["uvloop"]
    return factories


@pytest.fixture
def store() -> Iterator[StoreServer]:
    """A real TCPStore server on 127.0.0.1, for this test only.

    Closed once no configure thread is still at work (bounded): a connect
    given up by the test (a cancelled join's) that reaches the store only
    after it closed would retry c10d's connect for its whole timeout, and
    hold its thread past the leak check's wait."""
    server = StoreServer()
    yield server
    get_runtime().control.wait_idle(30.0)
    server.close()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Every test leaves no thread, child process (running or unreaped), fd,
    shared-memory segment or owner-loop stall behind."""
    rt = get_runtime()
    threads, fds, children = thread_ids(), open_fds(), child_pids(zombies=True, descendants=True)
    segments = {s for s in shm_segments() if s.startswith(f"ftcomm-{os.getpid()}-")}
    stalls = len(rt.watchdog.stalls) if rt.watchdog else 0
    yield
    assert rt.workers.wait_idle(15.0), "an ftcomm worker thread is still blocked"
    assert rt.control.wait_idle(15.0), "an ftcomm configure thread is still blocked"
    assert rt.callbacks.wait_idle(15.0), "an ftcomm callback thread is still busy"
    assert rt.reaper.wait_idle(15.0), "the reaper is still holding native groups"
    for thread in threading.enumerate():
        if thread.ident not in threads and not thread.name.startswith("ftcomm-"):
            thread.join(5.0)  # a thread that is finishing gets a bounded moment
    assert not (thread_ids() - threads), f"threads left behind: {threading.enumerate()}"
    left = child_pids(zombies=True, descendants=True) - children
    assert not left, f"child processes left behind (running or unreaped): {left}"
    mine = {s for s in shm_segments() if s.startswith(f"ftcomm-{os.getpid()}-")}
    assert not (mine - segments), f"/dev/shm segments left: {mine - segments}"
    leaked = fds_opened_since(fds)
    if leaked:
        # A native client may close its socket on a thread of its own just
        # after the test let go of it (torchft's lighthouse client, on its
        # runtime's thread): what is still open after a bounded wait is a leak.
        leaked = settle_fds(lambda: fds_opened_since(fds), cap=5.0)
    assert not leaked, (
        f"fds left behind: {[os.path.realpath(f'/proc/self/fd/{fd}') for fd in leaked]}"
    )
    if rt.watchdog is not None:
        assert len(rt.watchdog.stalls) == stalls, str(rt.watchdog.stalls[-1])


@pytest.fixture(scope="session")
def engine_etcd() -> Iterator[EtcdCluster | None]:
    """One etcd node for this worker's engine tests (each a prefix of its
    own); ``None`` where etcd cannot run here. Started before any test's
    leak check counts what is running (a session fixture comes first)."""
    if etcd_missing() is not None:
        yield None
        return
    with EtcdCluster(1) as cluster:
        yield cluster


@pytest.fixture(params=["store", "etcd"])
def engine(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    engine_etcd: EtcdCluster | None,
) -> str:
    """The membership engine a test runs on, once on each: the worlds'
    c10d store, or an etcd node (``helpers.ENGINE_ENV`` says which, to the
    ranks' processes too). Skips on etcd where it cannot run, saying why."""
    if request.param == "etcd":
        if engine_etcd is None:
            pytest.skip(str(etcd_missing()))
        monkeypatch.setenv(ENGINE_ENV, engine_etcd.address())
    else:
        monkeypatch.delenv(ENGINE_ENV, raising=False)
    return str(request.param)


@pytest.fixture
def engine_addr(engine: str) -> Iterator[str]:
    """An address of ``engine`` for one test's memberships: a store of its
    own, or a prefix of its own in etcd."""
    if engine == "etcd":
        yield f"{os.environ[ENGINE_ENV]}/{uuid.uuid4().hex[:12]}"
        return
    server = serve_store()
    yield server.address
    get_runtime().control.wait_idle(30.0)  # (as the store fixture's close)
    server.close()
