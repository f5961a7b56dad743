"""configure()'s own steps before the native group: reaching the store's
port, and meeting the other ranks in the store (ftcomm/_store.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from helpers import StoreServer
from torch.distributed import PrefixStore, TCPStore

import ftcomm
from ftcomm._meet import (
    MEET_COUNT,
    MEET_KEY,
    NATIVE_KEY,
    REFUSED_KEY,
    StoppableStore,
    meet,
)
from ftcomm._runtime.loop import get_runtime
from ftcomm._store import ConnectProgress, Stopped


class MemoryStore:
    """The store calls meet() makes, in memory, counted."""

    def __init__(self) -> None:
        self.data: dict[str, int | str] = {}
        self.calls: list[tuple[str, int]] = []  # (method, keys it touched)

    def set(self, key: str, value: str) -> None:
        self.calls.append(("set", 1))
        self.data[key] = value

    def add(self, key: str, n: int) -> int:
        self.calls.append(("add", 1))
        value = int(self.data.get(key, 0)) + n
        self.data[key] = value
        return value

    def check(self, keys: list[str]) -> bool:
        self.calls.append(("check", len(keys)))
        return all(k in self.data for k in keys)

    def delete_key(self, key: str) -> bool:
        self.calls.append(("delete_key", 1))
        return self.data.pop(key, None) is not None

    def get(self, key: str) -> bytes:
        self.calls.append(("get", 1))
        return str(self.data[key]).encode()

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """c10d's: set ``desired`` if the value is ``expected`` (or the key
        is missing and ``expected`` is empty); the value after."""
        self.calls.append(("compare_set", 1))
        if isinstance(expected, bytes):  # c10d takes bytes as they are
            expected = expected.decode()
        if key not in self.data:
            if expected == "":
                self.data[key] = desired
                return desired.encode()
            return expected.encode()
        if str(self.data[key]) == expected:
            self.data[key] = desired
        return str(self.data[key]).encode()


def test_meet_names_the_ranks_that_never_came_and_takes_itself_out() -> None:
    store = MemoryStore()
    store.set(MEET_KEY.format(world=3, rank=2), "1")
    store.add(MEET_COUNT.format(world=3), 1)  # rank 2 came; rank 1 never does
    progress = ConnectProgress()
    with pytest.raises(TimeoutError, match=r"1 of 3 ranks never came .*\(rank 1\)"):
        meet(store, 0, 3, time.monotonic() + 0.2, progress)  # type: ignore[arg-type]
    assert progress.step == "meet"
    assert "rank 1" in progress.detail
    # it gave up: a later rank does not count it as there
    assert store.data[MEET_COUNT.format(world=3)] == 1
    assert str(store.data[MEET_KEY.format(world=3, rank=0)]).startswith("out-")
    # and when it comes again, it counts once more
    store.set(MEET_KEY.format(world=3, rank=1), "1")
    store.add(MEET_COUNT.format(world=3), 1)
    meet(store, 0, 3, time.monotonic() + 5, ConnectProgress())  # type: ignore[arg-type]
    assert store.data[MEET_COUNT.format(world=3)] == 3


def test_a_rank_is_counted_once_whatever_its_attempts() -> None:
    """An attempt killed with its worker process never takes itself out: the
    rank's next attempt takes its key over instead of counting again, so the
    rank that is still missing keeps the others waiting (and is named)."""
    store = MemoryStore()
    store.set(MEET_KEY.format(world=2, rank=0), "token-of-a-killed-worker")
    store.add(MEET_COUNT.format(world=2), 1)
    with pytest.raises(TimeoutError, match=r"1 of 2 ranks never came .*\(rank 1\)"):
        meet(store, 0, 2, time.monotonic() + 0.2, ConnectProgress())  # type: ignore[arg-type]
    assert store.data[MEET_COUNT.format(world=2)] == 0  # and it took itself out
    # the killed worker's attempt, were it to give up late, takes nothing out
    key = MEET_KEY.format(world=2, rank=0)
    assert store.compare_set(key, "token-of-a-killed-worker", "out-x") != b"out-x"
    assert store.data[MEET_COUNT.format(world=2)] == 0


def test_two_attempts_giving_up_take_the_rank_out_once() -> None:
    store = MemoryStore()
    count = MEET_COUNT.format(world=2)
    with pytest.raises(TimeoutError):
        meet(store, 0, 2, time.monotonic() + 0.1, ConnectProgress())  # type: ignore[arg-type]
    with pytest.raises(TimeoutError):
        meet(store, 0, 2, time.monotonic() + 0.1, ConnectProgress())  # type: ignore[arg-type]
    assert store.data[count] == 0
    # rank 1 comes with rank 0: they meet, counted once each
    store.set(MEET_KEY.format(world=2, rank=1), "1")
    store.add(count, 1)
    meet(store, 0, 2, time.monotonic() + 5, ConnectProgress())  # type: ignore[arg-type]
    assert store.data[count] == 2


class VanishingStore(MemoryStore):
    """A key that someone else deletes as this rank claims it."""

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if expected not in ("", b"") and key in self.data:
            del self.data[key]  # gone between the read and the swap
        return super().compare_set(key, expected, desired)


def test_a_key_that_vanishes_mid_claim_is_claimed_again_not_spun_on() -> None:
    store = VanishingStore()
    key = MEET_KEY.format(world=1, rank=0)
    store.data[key] = "another-attempt"
    meet(store, 0, 1, time.monotonic() + 5, ConnectProgress())  # type: ignore[arg-type]
    assert str(store.data[key]).startswith(str(os.getpid()))
    assert len(store.calls) < 20


def test_meet_polls_one_counter_however_large_the_world() -> None:
    """Every rank polls: a poll is one small request, never a check of every
    rank's key (that load grew with the square of the world)."""
    store = MemoryStore()
    with pytest.raises(TimeoutError, match="999 of 1000 ranks never came"):
        meet(store, 0, 1000, time.monotonic() + 0.3, ConnectProgress())  # type: ignore[arg-type]
    polls = [c for c in store.calls if c[0] == "add"]
    assert len(polls) >= 3
    assert all(n == 1 for _, n in store.calls), store.calls  # no many-key request


def test_meet_returns_once_everyone_came_and_stops_when_asked() -> None:
    store = MemoryStore()
    for r in (1, 2):
        store.set(MEET_KEY.format(world=3, rank=r), "1")
        store.add(MEET_COUNT.format(world=3), 1)
    meet(store, 0, 3, time.monotonic() + 5, ConnectProgress())  # type: ignore[arg-type]
    assert store.data[MEET_COUNT.format(world=3)] == 3
    lonely = MemoryStore()
    stop: concurrent.futures.Future[None] = concurrent.futures.Future()
    stop.set_result(None)
    started = time.monotonic()
    with pytest.raises(Stopped):
        meet(lonely, 0, 2, time.monotonic() + 30, ConnectProgress(), stop)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0
    assert lonely.data[MEET_COUNT.format(world=2)] == 0


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port whose listener's queue is full: connections to it get no answer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = int(listener.getsockname()[1])
    filled = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.settimeout(0.3)
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                s.close()
                break
            filled.append(s)
        else:
            pytest.skip("the kernel kept accepting connections to a full queue")
        yield port
    finally:
        for s in filled:
            s.close()
        listener.close()


def test_a_store_that_never_answers_says_so_and_an_abort_stops_the_connect(
    black_hole: int,
) -> None:
    asyncio.run(_never_answers(black_hole))  # one loop is enough: it is the store's side


async def _never_answers(black_hole: int) -> None:
    async with ftcomm.Group("gloo") as g:
        with pytest.raises(ftcomm.CommTimeout, match="no answer to the connection") as info:
            await g.configure(f"127.0.0.1:{black_hole}/bh", 0, 2, timeout=1.5)
        assert isinstance(info.value.__cause__, TimeoutError)
        task = asyncio.ensure_future(g.configure(f"127.0.0.1:{black_hole}/bh2", 0, 2, timeout=30))
        await asyncio.sleep(0.2)
        g.abort()
        with pytest.raises(ftcomm.CommAborted):
            await task
        started = time.monotonic()
        # each try at the port is bounded (0.5 s): the connect sees the stop
        assert await asyncio.to_thread(get_runtime().control.wait_idle, 5.0)
        assert time.monotonic() - started < 1.5


def test_a_rank_that_built_a_group_at_a_prefix_is_refused_there() -> None:
    store = MemoryStore()
    meet(store, 0, 1, time.monotonic() + 5, ConnectProgress())  # type: ignore[arg-type]
    # marked with the attempt that met (its meet token)
    assert store.data[NATIVE_KEY.format(rank=0)] == store.data[MEET_KEY.format(world=1, rank=0)]
    before = dict(store.data)
    with pytest.raises(ftcomm.PrefixReused, match="at h:1/p: rank 0 built a group") as info:
        meet(store, 0, 1, time.monotonic() + 5, ConnectProgress(), where="h:1/p")  # type: ignore[arg-type]
    assert isinstance(info.value, ftcomm.CommError)
    assert (info.value.rank, info.value.op) == (0, "configure")
    assert "configure each group at a fresh prefix" in str(info.value)
    # refused before it counted itself in; it says so to the others, and
    # takes out what counted it before (a stale count lets no peer through)
    key, count = MEET_KEY.format(world=1, rank=0), MEET_COUNT.format(world=1)
    taken = str(store.data[key])
    assert taken.startswith(f"out-{before[key]}-by-")  # a value of the take-out's own
    assert store.data[count] == 0
    assert store.data == {**before, REFUSED_KEY: "0", key: taken, count: 0}


def test_a_rank_waiting_at_a_prefix_where_another_was_refused_is_refused_too() -> None:
    """A larger world at a used prefix: its new rank never built anything
    there, but the ranks that did are refused, and it hears of it."""
    store = MemoryStore()
    store.set(REFUSED_KEY, "0")
    started = time.monotonic()
    with pytest.raises(ftcomm.PrefixReused, match="another rank was refused at this prefix"):
        meet(store, 2, 3, time.monotonic() + 10, ConnectProgress())  # type: ignore[arg-type]
    assert time.monotonic() - started < 5.0  # at its next look (0.5 s), not its deadline
    assert store.data[MEET_COUNT.format(world=3)] == 0  # it took itself out
    assert NATIVE_KEY.format(rank=2) not in store.data


def test_a_stale_count_lets_no_peer_of_a_refused_rank_through() -> None:
    """Run 1 (a world of 2) left rank 0 marked and both counted, rank 1
    unmarked (its worker was killed before it marked itself). In run 2,
    rank 0 is refused and takes its stale count out, so rank 1 does not
    pass the meet on it: it hears of the refusal instead of building a
    group against rank 0's dead keys."""
    store = MemoryStore()
    for rank in (0, 1):
        store.set(MEET_KEY.format(world=2, rank=rank), f"run-1-token-{rank}")
        store.add(MEET_COUNT.format(world=2), 1)
    store.set(NATIVE_KEY.format(rank=0), "2")
    with pytest.raises(ftcomm.PrefixReused, match="rank 0 built a group"):
        meet(store, 0, 2, time.monotonic() + 5, ConnectProgress())  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(ftcomm.PrefixReused, match="another rank was refused"):
        meet(store, 1, 2, time.monotonic() + 10, ConnectProgress())  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0  # at once: it looks as it comes
    assert NATIVE_KEY.format(rank=1) not in store.data


def test_a_rank_whose_earlier_attempt_built_nothing_may_come_again() -> None:
    """A first run's rank 1 counted itself in and was killed before rank 0
    came (its count stands): rank 0 meets at once and goes on to build;
    rank 1, coming again, takes its key over, is not refused, and meets."""
    store = MemoryStore()
    store.set(MEET_KEY.format(world=2, rank=1), "token-of-a-killed-worker")
    store.add(MEET_COUNT.format(world=2), 1)
    meet(store, 0, 2, time.monotonic() + 5, ConnectProgress())  # type: ignore[arg-type]
    assert NATIVE_KEY.format(rank=0) in store.data
    meet(store, 1, 2, time.monotonic() + 5, ConnectProgress())  # type: ignore[arg-type]
    assert NATIVE_KEY.format(rank=1) in store.data
    assert REFUSED_KEY not in store.data
    assert store.data[MEET_COUNT.format(world=2)] == 2


def test_a_rank_that_gave_up_is_not_marked() -> None:
    store = MemoryStore()
    with pytest.raises(TimeoutError):
        meet(store, 0, 2, time.monotonic() + 0.1, ConnectProgress())  # type: ignore[arg-type]
    assert NATIVE_KEY.format(rank=0) not in store.data
    store.set(MEET_KEY.format(world=2, rank=1), "1")
    store.add(MEET_COUNT.format(world=2), 1)
    meet(store, 0, 2, time.monotonic() + 5, ConnectProgress())  # type: ignore[arg-type]
    assert NATIVE_KEY.format(rank=0) in store.data


def test_a_reused_prefix_fails_at_once_on_every_rank_every_time(store: StoreServer) -> None:
    """The same script run twice at one prefix of a long-lived store: the
    second run's ranks all get PrefixReused, before any native group, in
    20 tries of 20; a larger world at the prefix too (its extra rank never
    met there before)."""
    asyncio.run(_reuse(store.port, tries=20))


@pytest.mark.slow
def test_a_reused_prefix_is_the_same_error_from_a_worker_process(store: StoreServer) -> None:
    asyncio.run(_reuse(store.port, tries=1, subprocess=True))


async def _reuse(port: int, tries: int, subprocess: bool = False) -> None:
    async def world(prefix: str, size: int) -> list[BaseException | None]:
        groups = [ftcomm.Group("gloo", timeout=10, subprocess=subprocess) for _ in range(size)]
        try:
            results = await asyncio.gather(
                *(g.configure(f"127.0.0.1:{port}/{prefix}", r, size) for r, g in enumerate(groups)),
                return_exceptions=True,
            )
            if not any(results):
                sums = [g.allreduce(torch.ones(1)) for g in groups]
                assert [t.item() for t in await asyncio.gather(*sums)] == [size] * size
            return list(results)
        finally:
            await asyncio.gather(*(g.shutdown() for g in groups))

    for i in range(tries):
        assert await world(f"run{i}", 2) == [None, None]
        started = time.monotonic()
        again = await world(f"run{i}", 3 if i == 0 else 2)
        if not subprocess:  # (worker processes take their own time to start)
            assert time.monotonic() - started < 5.0  # at once: not at the 10 s timeout
        # refused, every rank: not a CommTimeout at the configure timeout
        for rank, error in enumerate(again):
            assert isinstance(error, ftcomm.PrefixReused), (i, rank, error)
            assert f"configure() at 127.0.0.1:{port}/run{i}: " in str(error)
            assert "configure each group at a fresh prefix" in str(error)
            assert error.rank == rank


@pytest.mark.slow
def test_a_rank_whose_worker_was_killed_in_the_meet_configures_again_there(
    store: StoreServer,
) -> None:
    """The same configuration, retried: rank 1's first attempt is given up
    while its worker waits in the meet (the worker is killed, its count
    stands); rank 0 comes and goes on to build; rank 1 configures again at
    the same prefix, and the two make one group."""
    asyncio.run(_retry_after_a_killed_worker(store.port))


def _counted(port: int, prefix: str, key: str) -> None:
    """Wait (at most 30 s) until a rank counted itself in at ``key``."""
    client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    store = PrefixStore(prefix, client)
    deadline = time.monotonic() + 30
    while not (store.check([key]) and store.add(key, 0) >= 1):
        assert time.monotonic() < deadline, f"nobody counted itself in at {key!r}"
        time.sleep(0.01)


async def _retry_after_a_killed_worker(port: int) -> None:
    addr = f"127.0.0.1:{port}/retry"
    first = ftcomm.Group("gloo", timeout=30, subprocess=True)
    attempt = asyncio.ensure_future(first.configure(addr, 1, 2))
    await asyncio.to_thread(_counted, port, "retry", MEET_COUNT.format(world=2))
    await first.abort()
    with pytest.raises(ftcomm.CommAborted):
        await attempt
    r0, r1 = ftcomm.Group("gloo", timeout=30), ftcomm.Group("gloo", timeout=30, subprocess=True)
    try:
        await asyncio.gather(r0.configure(addr, 0, 2), r1.configure(addr, 1, 2))
        sums = await asyncio.gather(r0.allreduce(torch.ones(1)), r1.allreduce(torch.ones(1)))
        assert [t.item() for t in sums] == [2.0, 2.0]
    finally:
        await asyncio.gather(first.shutdown(), r0.shutdown(), r1.shutdown())


def _view(store: MemoryStore) -> tuple[StoppableStore, ftcomm.PrefixReused, list[str]]:
    """A view over ``store`` that is never stopped: its refusal, and its marks."""
    refused = ftcomm.PrefixReused("refused", rank=1, op="configure")
    marks: list[str] = []
    view = StoppableStore(
        store,  # type: ignore[arg-type]
        concurrent.futures.Future(),
        lambda: refused,
        lambda: marks.append("marked"),
    )
    return view, refused, marks


def test_the_view_a_group_is_built_through_hears_of_a_refused_rank() -> None:
    """A rank in its native construction waits in the store for its peers:
    once one of them was refused at the prefix, the wait ends (within a
    look, 0.5 s) with the refusal, not at the construction's timeout."""
    store = MemoryStore()
    view, refused, marks = _view(store)
    assert view.wrote is False
    view.set("1/addr", "x")
    view.set("1/more", "y")
    assert view.wrote is True
    assert marks == ["marked"]  # once, before the first write
    store.set(REFUSED_KEY, "0")
    started = time.monotonic()
    with pytest.raises(ftcomm.PrefixReused) as info:
        view.wait(["0/addr"], timedelta(seconds=30))
    assert info.value is refused
    assert time.monotonic() - started < 5.0


def test_a_group_refused_before_its_first_write_marks_nothing() -> None:
    store = MemoryStore()
    store.set(REFUSED_KEY, "0")
    view, _, marks = _view(store)
    with pytest.raises(ftcomm.PrefixReused):
        view.set("1/addr", "x")
    assert marks == []
    assert "1/addr" not in store.data
