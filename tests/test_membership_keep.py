"""The step from an agreed generation to a kept group (``_membership._keep``),
against an engine of the test's own whose answers come when the test says:
a verdict that gave the world up ends a configure still waiting, a check
that leaves members out wins over a configure that succeeded, a cancel is
never lost while the check ends, and the world is watched once kept."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ftcomm
from ftcomm._membership import _keep
from ftcomm._membership._rule import Member, WorldRecord

pytestmark = pytest.mark.asyncio

ME, OTHER = Member("m0", "t0"), Member("m1", "t1")


class Engine:
    """The calls ``_keep.configure`` makes, answered as the test set them."""

    def __init__(self) -> None:
        self.me = ME
        self.cut: set[Member] = set()
        self.check_takes = 0.0  # seconds before the check answers
        self.check_ignores_stop = False
        self.check_ended = threading.Event()
        self.gave_up_at: float | None = None  # given_up() is True from then on
        self.dead_at: float | None = None  # OTHER is dead from then on
        self.kept_first = False  # lost() finds the world kept already
        self.calls: list[str] = []

    def alive(self, member: Member) -> bool:
        return member != OTHER or self.dead_at is None or time.monotonic() < self.dead_at

    def given_up(self, record: WorldRecord) -> bool:
        return self.gave_up_at is not None and time.monotonic() >= self.gave_up_at

    def read_fate(self, record: WorldRecord | None) -> None:
        self.calls.append(f"read_fate {record.generation if record else None}")

    def reach_check(
        self, record: WorldRecord, stop: threading.Event, timeout: float
    ) -> tuple[set[Member], set[Member]]:
        try:
            if self.check_ignores_stop:
                time.sleep(self.check_takes)
            elif stop.wait(self.check_takes):
                return set(), set()
            return set(self.cut), {m for m in record.members if m != ME}
        finally:
            self.check_ended.set()

    def lost(self, record: WorldRecord, member: Member) -> bool:
        self.calls.append(f"lost {member.id}")
        return not self.kept_first

    def recovering(self, record: WorldRecord) -> None:
        self.calls.append("recovering")

    def keep(self, record: WorldRecord) -> bool:
        self.calls.append("keep")
        return True

    def watch(
        self, record: WorldRecord, on_broken: Callable[[str], None], reached: set[Member]
    ) -> None:
        self.calls.append(f"watch {sorted(m.id for m in reached)}")

    def abandon(self, record: WorldRecord) -> None:
        self.calls.append("abandon")


@pytest.fixture
def store() -> Iterator[Any]:
    with ftcomm.serve_store() as server:
        yield server


def _members(engine: Engine) -> _keep.Keeper:
    members = ftcomm.Membership("127.0.0.1:1", "job", "m0", heartbeat_timeout=1.0)
    members._engine = engine  # type: ignore[assignment]
    return members._keeper()


async def test_a_kept_world_is_watched_with_whom_the_check_reached(store: Any) -> None:
    engine = Engine()
    record = WorldRecord(1, (ME,))
    async with ftcomm.Group("gloo", timeout=10) as group:
        await _keep.configure(
            _members(engine), group, record, f"{store.address}/g", 0, time.monotonic() + 20
        )
        assert (await group.allreduce(torch.ones(1))).item() == 1.0
    assert engine.calls == ["read_fate 1", "read_fate None", "keep", "watch []"]


async def test_a_cut_found_after_the_configure_succeeded_gives_the_world_up(store: Any) -> None:
    """Gloo may build one member's connections while a path between two
    others is cut: its configure succeeds, and its check's verdict, which
    comes later, must still give the world up rather than keep it."""
    engine = Engine()
    engine.cut, engine.check_takes = {ME}, 0.5
    record = WorldRecord(1, (ME,))
    async with ftcomm.Group("gloo", timeout=10) as group:
        with pytest.raises(ftcomm.CommAborted, match="m0 could not exchange data"):
            await _keep.configure(
                _members(engine), group, record, f"{store.address}/g", 0, time.monotonic() + 20
            )
    assert "keep" not in engine.calls
    assert "lost m0" in engine.calls


async def test_a_world_another_member_gave_up_ends_a_configure_still_waiting(
    store: Any,
) -> None:
    """The other member will never come (it gave the world up): the
    configure ends at that verdict, not at its 20 s deadline."""
    engine = Engine()
    engine.check_takes = 60.0  # the check answers nothing meanwhile
    engine.gave_up_at = time.monotonic() + 0.5
    record = WorldRecord(1, (ME, OTHER))
    started = time.monotonic()
    async with ftcomm.Group("gloo", timeout=30) as group:
        with pytest.raises(ftcomm.CommAborted, match="given up as it was configured"):
            await _keep.configure(
                _members(engine), group, record, f"{store.address}/g", 0, started + 20
            )
    assert time.monotonic() - started < 10.0
    assert engine.check_ended.is_set()  # its thread did not outlive the call


async def test_a_cancel_while_the_check_ends_is_raised_not_lost(store: Any) -> None:
    engine = Engine()
    engine.check_takes, engine.check_ignores_stop = 1.5, True  # deaf to stop for 1.5 s
    record = WorldRecord(1, (ME,))
    async with ftcomm.Group("gloo", timeout=10) as group:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await _keep.configure(
                    _members(engine), group, record, f"{store.address}/g", 0, started + 20
                )
        assert engine.check_ended.is_set()  # waited for, then the cancel went on
    assert "keep" not in engine.calls


async def test_a_member_whose_configure_cannot_complete_in_a_world_kept_first_gives_up(
    store: Any,
) -> None:
    """The others kept the world; then its peer died before this member's
    connection to it was built: its configure gives up within a bound (and
    tells those watching the world), not at its 20 s deadline."""
    engine = Engine()
    engine.check_takes, engine.kept_first = 60.0, True
    engine.dead_at = time.monotonic() + 0.3
    record = WorldRecord(1, (ME, OTHER))
    started = time.monotonic()
    async with ftcomm.Group("gloo", timeout=30) as group:
        with pytest.raises(ftcomm.CommAborted, match="kept by the others"):
            await _keep.configure(
                _members(engine), group, record, f"{store.address}/g", 0, started + 20
            )
    assert time.monotonic() - started < 10.0
    assert engine.calls[-3:] == ["lost m1", "recovering", "read_fate None"]


async def test_a_configure_that_failed_in_a_world_kept_first_tells_its_watchers() -> None:
    engine = Engine()
    engine.kept_first = True
    record = WorldRecord(1, (ME,))
    with socket.socket() as closed:  # a store address that refuses
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    async with ftcomm.Group("gloo", timeout=1) as group:
        with pytest.raises(ftcomm.CommError):
            await _keep.configure(
                _members(engine), group, record, f"127.0.0.1:{port}/g", 0, time.monotonic() + 1.5
            )
    assert engine.calls[-3:] == ["lost m0", "recovering", "read_fate None"]
