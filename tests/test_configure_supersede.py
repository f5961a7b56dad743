"""A ``configure()`` attempt that is over -- superseded by ``abort()`` or by
another ``configure()``, or cancelled -- stops its connect: one that its
control thread has not begun never begins, and one that is building the
native Gloo group ends within moments, not at the native construction's own
timeout (a Membership's configure: up to its 20 s, longer than the 15 s the
leak check waits for the control threads).
Each interleaving is forced (the connect's thread held at a chosen point,
or a peer that came to the store and never builds its side), not left to
chance."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from helpers import StoreServer, peers_came
from torch.distributed import DistStoreError, HashStore, PrefixStore, TCPStore

import ftcomm
from ftcomm._meet import StoppableStore
from ftcomm._runtime import threads
from ftcomm._runtime.loop import get_runtime
from ftcomm._store import Stopped
from ftcomm.backends import ConnectSpec, gloo
from ftcomm.backends.gloo import GlooBackend

TIMEOUT = 20.0
"""The configure's, and so the native construction's own: what a connect
nobody stops would still wait for its peer."""
PROMPT = 3.0
"""What "at once" may take on a busy 2-core machine: well under TIMEOUT."""
PREFIX = "g"

HOWS = ["abort", "cancel", "configure"]


async def _until(condition: Callable[[], bool], what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.01)


async def _give_up(group: ftcomm.Group, task: asyncio.Future[None], how: str, port: int) -> None:
    """End ``task``'s configure attempt the way ``how`` says, and see it end."""
    if how == "abort":
        group.abort()
    elif how == "cancel":
        task.cancel()
    else:  # a newer configure: a world of one at a fresh prefix, which completes
        await group.configure(f"127.0.0.1:{port}/newer", 0, 1, timeout=TIMEOUT)
    with pytest.raises((ftcomm.CommAborted, asyncio.CancelledError)):
        await task


async def _give_up_once(port: int, how: str, reached: threading.Event, go: threading.Event) -> None:
    """Configure rank 0 of 2; once the connect has ``reached`` its point (and
    waits there for ``go``), give it up the way ``how`` says; then its
    control thread must be free at once."""
    async with ftcomm.Group("gloo") as group:
        task = asyncio.ensure_future(
            group.configure(f"127.0.0.1:{port}/{PREFIX}", 0, 2, timeout=TIMEOUT)
        )
        await asyncio.to_thread(reached.wait, 10)
        assert reached.is_set()
        try:
            await _give_up(group, task, how, port)
        finally:
            go.set()
        await _assert_control_idle_at_once()


async def _assert_control_idle_at_once() -> None:
    started = time.monotonic()
    idle = await asyncio.to_thread(get_runtime().control.wait_idle, PROMPT)
    waited = time.monotonic() - started
    assert idle, (
        f"the given-up connect still holds its control thread {waited:.1f} s later "
        f"(its own timeout is {TIMEOUT:g} s)"
    )


class Watcher:
    """A plain client of the test's store, under the configure's prefix.
    ``close()`` drops it: pytest keeps a fixture's value until after the
    leak check, and the client's socket must be gone by then."""

    def __init__(self, port: int) -> None:
        client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        self._store: Any = PrefixStore(PREFIX, client)

    def has(self, key: str) -> bool:
        return bool(self._store.check([key]))

    def close(self) -> None:
        self._store = None


@pytest.fixture
def watcher(store: StoreServer) -> Iterator[Watcher]:
    held = Watcher(store.port)
    yield held
    held.close()


@pytest.mark.asyncio
@pytest.mark.one_loop
@pytest.mark.parametrize("how", HOWS)
async def test_a_connect_given_up_inside_the_native_construction_ends_at_once(
    store: StoreServer, watcher: Watcher, how: str
) -> None:
    """Rank 1 came to the store (counted in the meeting) and never builds its
    side: rank 0's native construction waits in the store for rank 1's
    address. Given up there, it ends at once."""
    peers_came(store.port, PREFIX, 2, [1])
    async with ftcomm.Group("gloo") as group:
        task = asyncio.ensure_future(
            group.configure(f"127.0.0.1:{store.port}/{PREFIX}", 0, 2, timeout=TIMEOUT)
        )
        # Inside the native construction: rank 0 published its own Gloo
        # address (c10d's rendezvous key "<device>/<rank>", torch 2.13) and
        # waits for rank 1's.
        await _until(lambda: watcher.has("0/0"), "rank 0 began its native group")
        await _give_up(group, task, how, store.port)
        await _assert_control_idle_at_once()


@pytest.mark.asyncio
@pytest.mark.one_loop
@pytest.mark.parametrize("how", HOWS)
async def test_a_connect_given_up_as_its_ranks_met_never_builds_the_native_group(
    store: StoreServer, watcher: Watcher, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Given up just after the meeting in the store (every rank came),
    before the native construction began: that construction never begins."""
    peers_came(store.port, PREFIX, 2, [1])
    met, go = threading.Event(), threading.Event()
    real_meet = gloo.meet

    def meet_then_pause(store: Any, rank: int, world_size: int, *args: Any, **kw: Any) -> None:
        real_meet(store, rank, world_size, *args, **kw)
        if world_size == 2:  # not a newer configure's (a world of one)
            met.set()
            go.wait(30)

    monkeypatch.setattr(gloo, "meet", meet_then_pause)
    await _give_up_once(store.port, how, met, go)
    assert not watcher.has("0/0"), "the native construction began"
    # it built nothing at the prefix: its mark is taken back, it may come again
    assert not watcher.has("ftcomm/met/native/0")


@pytest.mark.asyncio
@pytest.mark.one_loop
@pytest.mark.parametrize("how", HOWS)
async def test_a_connect_given_up_before_its_thread_began_it_never_begins(
    store: StoreServer, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The connect's control thread took the call (too late for the call to
    be cancelled) but has not begun it when the attempt is given up: the
    backend's connect is never called."""
    picked, go = threading.Event(), threading.Event()
    real_run_one = threads._run_one

    def run_one(fut: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if picked.is_set() or not any(isinstance(a, ConnectSpec) for a in args):
            return real_run_one(fut, fn, args)

        def held(*call_args: Any) -> Any:  # running: a cancel comes too late
            picked.set()
            go.wait(30)
            return fn(*call_args)

        return real_run_one(fut, held, args)

    monkeypatch.setattr(threads, "_run_one", run_one)
    began: list[str] = []
    real_connect = GlooBackend.connect.__func__  # type: ignore[attr-defined]

    def connect(cls: type[GlooBackend], spec: ConnectSpec, cancel: Any = None) -> GlooBackend:
        began.append(spec.store.prefix)
        return real_connect(cls, spec, cancel)  # type: ignore[no-any-return]

    monkeypatch.setattr(GlooBackend, "connect", classmethod(connect))
    await _give_up_once(store.port, how, picked, go)
    assert PREFIX not in began, "the given-up connect began after all"


def test_the_view_a_group_is_built_through_stops_with_its_connect() -> None:
    """StoppableStore: a wait ends at the first poll after the stop (not at
    its timeout), a wait past its timeout is c10d's error, every call fails
    once stopped, and once the group is built the view is plain."""
    real, stop = HashStore(), concurrent.futures.Future[None]()
    view = StoppableStore(real, stop)
    real.set("there", "1")
    assert view.get("there") == b"1"
    with pytest.raises(DistStoreError, match="wait timeout after 50ms"):
        view.wait(["missing"], timedelta(seconds=0.05))
    stopper = threading.Timer(0.2, stop.set_result, (None,))
    started = time.monotonic()
    stopper.start()
    with pytest.raises(Stopped):
        view.wait(["missing"], timedelta(seconds=TIMEOUT))
    assert time.monotonic() - started < PROMPT
    stopper.join()
    with pytest.raises(Stopped):
        view.set("key", "value")
    view.built()
    view.set("key", "value")
    assert view.get("key") == b"value"
