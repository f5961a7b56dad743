"""ftcomm.Membership over the store engine: worlds of members that join,
die, hang, come back and grow, and what each call raises."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from typing import Any

import pytest
import torch
from helpers import engine_for, engine_key

import ftcomm
from ftcomm._membership._rule import parse_ready
from ftcomm.testing import Fault, FaultPlan, RankContext, run_world

HB = 1.0  # heartbeat_timeout of the worlds below (generous: the suite runs 3 at once)
WINDOW = 2.0  # how long survivors wait for a live straggler
# _train's join window: well above its tests' bounds on recover(), which
# include a configure (its store connect can wait 1 s on a reverse DNS
# lookup, tests/conftest.py), so that a member found dead is told from one
# waited for.
TRAIN_WINDOW = 5.0


def membership(
    ctx: RankContext, member_id: str | None = None, address: str | None = None, **kw: Any
) -> ftcomm.Membership:
    kw.setdefault("min_size", 2)
    kw.setdefault("max_size", 3)
    kw.setdefault("join_window", WINDOW)
    kw.setdefault("heartbeat_timeout", HB)
    kw.setdefault("timeout", 30)
    if address is None:
        address = engine_for(ctx)
    return ftcomm.Membership(address, "job", member_id or f"m{ctx.rank}", **kw)


def _membership_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ftcomm-membership")]


# -- forming the first generation ---------------------------------------------


async def _join_and_sum(ctx: RankContext) -> tuple[ftcomm.World, float]:
    async with membership(ctx) as members, ftcomm.Group("gloo", timeout=10) as group:
        world = await members.join(group)
        total = await group.allreduce(torch.tensor([float(world.rank + 1)]))
        return world, total.item()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_max_size_members_form_one_world_at_once(loop: str, engine: str) -> None:
    results = run_world(_join_and_sum, 3, mode="thread", loop=loop, timeout=30)
    worlds = [w for w, _ in results]
    assert {(w.generation, w.members, w.size, w.store_addr) for w in worlds} == {
        (1, worlds[0].members, 3, worlds[0].store_addr)
    }
    assert sorted(w.rank for w in worlds) == [0, 1, 2]
    assert all(w.members[w.rank] == f"m{ctx}" for ctx, w in enumerate(worlds))
    assert all(set(w.newcomers) == {"m0", "m1", "m2"} for w in worlds)
    assert [total for _, total in results] == [6.0, 6.0, 6.0]


async def _join_timed(ctx: RankContext) -> tuple[int, float]:
    async with membership(ctx, join_window=1.0) as members, ftcomm.Group("gloo") as group:
        started = time.monotonic()
        world = await members.join(group)
        took = time.monotonic() - started
        # No member leaves before all have configured: one that closes its
        # membership early is seen gone by a peer still configuring, which
        # then (rightly) gives the generation up and waits for another.
        await group.allreduce(torch.ones(1))
        return world.size, took


def test_min_size_members_form_a_world_once_the_window_passed(engine: str) -> None:
    results = run_world(_join_timed, 2, mode="thread", timeout=30)
    assert [size for size, _ in results] == [2, 2]
    assert all(1.0 <= took < 6.0 for _, took in results), results


async def _alone(ctx: RankContext) -> str:
    async with membership(ctx, min_size=2) as members, ftcomm.Group("gloo") as group:
        started = time.monotonic()
        with pytest.raises(ftcomm.MembershipTimeout, match=r"1 ready \(m0\), need at least 2"):
            await members.join(group, timeout=0.5)
        took = time.monotonic() - started
        assert 0.5 <= took < 1.5
        assert members.world is None
        return "timed out"


def test_join_without_enough_members_times_out_naming_who_came(engine: str) -> None:
    assert run_world(_alone, 1, mode="thread", timeout=30) == ["timed out"]


# -- a member dies, hangs, comes back ---------------------------------------


async def _train(ctx: RankContext, steps: int, op_timeout: float) -> list[Any]:
    """Allreduce ones; on a CommError, recover and go on. The log holds
    (generation, sum) per step and (error, generation, size, seconds) per recovery."""
    log: list[Any] = []
    async with (
        membership(ctx, join_window=TRAIN_WINDOW) as members,
        ftcomm.Group("gloo", timeout=10) as group,
    ):
        world = await members.join(group)
        done = 0
        while done < steps:
            issued = time.monotonic()
            try:
                total = await group.allreduce(torch.ones(1), timeout=op_timeout)
                log.append((world.generation, total.item()))
                done += 1
            except ftcomm.CommError as exc:
                failed = time.monotonic()
                world = await members.recover(group)
                took = time.monotonic() - failed
                log.append(
                    (type(exc).__name__, world.generation, world.size, took, failed - issued)
                )
    assert not _membership_threads()
    return log


def test_survivors_of_a_killed_member_form_the_next_generation(engine: str) -> None:
    plan = FaultPlan.of(Fault.kill(2, 3))
    results = run_world(_train, 3, plan=plan, args=(6, 5.0), timeout=60)
    assert results[2] is None  # killed
    for log in results[:2]:
        assert log[:3] == [(1, 3.0)] * 3
        error, generation, size, took, _ = log[3]
        assert (error, generation, size) == ("CommFailed", 2, 2)
        assert took < HB + 2.0  # its heartbeat's silence, and configure's store connect
        assert log[4:] == [(2, 2.0)] * 3


def test_survivors_of_a_hung_member_recover_once_its_heartbeat_stops(engine: str) -> None:
    op_timeout = 8.0
    plan = FaultPlan.of(Fault.stop(2, 3))
    results = run_world(_train, 3, plan=plan, args=(5, op_timeout), timeout=60)
    assert results[2] is None  # stopped, then killed by the harness
    # Its silent heartbeat aborts the group's configuration on each survivor
    # (the first to abort may reach the other as its peer closing): the op
    # ends a heartbeat timeout after the stop, not at its own deadline.
    assert "CommAborted" in {log[3][0] for log in results[:2]}
    for log in results[:2]:
        error, generation, size, took, op_took = log[3]
        assert error in ("CommAborted", "CommFailed")
        assert op_took < HB + 3.0 < op_timeout
        assert (generation, size) == (2, 2)
        assert took < 2.0  # seen dead already: configure's time only
        assert log[4:] == [(2, 2.0)] * 2


async def _stopped_and_resumed(ctx: RankContext) -> list[Any]:
    """Rank 2 is SIGSTOPped by rank 0 and resumed once the others moved on:
    it is told it was dropped, joins again, and gets the state."""
    log: list[Any] = []
    async with membership(ctx) as members, ftcomm.Group("gloo", timeout=10) as group:
        world = await members.join(group)
        step, weight = 0, torch.zeros(2)
        if ctx.rank == 2:
            ctx.store.set(f"{ctx.world_id}/pid", str(os.getpid()))
        end = 3000  # until 3 steps after it came back (a bound, should it never)
        while step < end:
            if ctx.rank == 0 and step == 2 and world.generation == 1:
                os.kill(int(ctx.store.get(f"{ctx.world_id}/pid")), signal.SIGSTOP)
            if ctx.rank == 0 and step == 4 and world.generation == 2:
                os.kill(int(ctx.store.get(f"{ctx.world_id}/pid")), signal.SIGCONT)
            try:
                if await members.pending():
                    world = await members.recover(group)
                    weight_step = await members.sync_state({"w": weight}, step)
                    state, step = weight_step
                    weight = state["w"]
                    log.append(("grown", world.generation, world.size, step))
                    if world.size == 3:
                        end = step + 3
                grad = await group.allreduce(torch.ones(2), timeout=1.5)
                weight += grad / world.size
                step += 1
            except ftcomm.CommError as exc:
                try:
                    world = await members.recover(group)
                    log.append(("recovered", type(exc).__name__, world.generation, world.size))
                except ftcomm.Evicted as evicted:
                    log.append(("evicted", evicted.generation, evicted.current))
                    world = await members.join(group)
                    (state, step) = await members.sync_state({"w": weight}, step)
                    weight = state["w"]
                    log.append(("rejoined", world.generation, world.size, step))
                    if world.size == 3:
                        end = step + 3
        return [*log, ("done", world.generation, step, weight.tolist())]


def test_a_dropped_member_that_resumes_is_evicted_and_joins_again(engine: str) -> None:
    results = run_world(_stopped_and_resumed, 3, timeout=60)
    evicted, rejoined = results[2][0], results[2][-2]
    assert evicted == ("evicted", 1, 2)
    assert rejoined[0] == "rejoined"
    for rank in (0, 1):
        log = results[rank]
        # the first to reach its deadline aborts; its peer may see that first
        assert log[0][0] == "recovered"
        assert log[0][1] in ("CommAborted", "CommTimeout", "CommFailed")
        assert log[0][2:] == (2, 2)
        # let in at a step boundary (once, or twice where it came after the window)
        grown = [entry for entry in log if entry[0] == "grown"]
        assert grown[-1] == ("grown", rejoined[1], 3, rejoined[3])
    finals = [log[-1] for log in results]
    assert finals[0] == finals[1] == finals[2]  # one world, one state
    assert finals[0][2] >= 7  # 4 steps before the stop, then 2 and 3 at least


# -- growth and the state copy -------------------------------------------------


async def _grow(ctx: RankContext) -> list[Any]:
    """Ranks 0 and 1 train; rank 2 joins at step 3 of theirs; they let it in
    at a step boundary and copy it their state."""
    async with membership(ctx) as members, ftcomm.Group("gloo", timeout=10) as group:
        if ctx.rank == 2:
            await ctx.wait_for("step3")
        world = await members.join(group)
        fresh = ctx.rank == 2
        state: dict[str, Any] = {
            "w": torch.full((3,), -100.0 if fresh else 0.0),
            "note": "fresh" if fresh else "trained",
        }
        step, end = 0, 3000  # until 5 steps after it came in (a bound, should it never)
        seen: list[Any] = []
        if ctx.rank == 2:
            state, step = await members.sync_state(state, step)
            seen.append(("joined", world.generation, world.rank, step, state["note"]))
            end = step + 5
        while step < end:
            if step == 3 and world.generation == 1 and ctx.rank == 0:
                ctx.signal("step3")
            # the same calls in the same order on every member: a newcomer
            # comes in where the others' recover() was, before their allreduce
            if not fresh and await members.pending():
                world = await members.recover(group)
                state, step = await members.sync_state(state, step)
                seen.append(("grew", world.generation, world.size, step))
                if world.size == 3:
                    end = step + 5
            total = await group.allreduce(torch.ones(1))
            state["w"] += total
            step, fresh = step + 1, False
        return [*seen, ("done", world.generation, world.size, state["w"].tolist())]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_newcomer_is_let_in_at_one_step_boundary_and_gets_the_state(
    loop: str, engine: str
) -> None:
    results = run_world(_grow, 3, mode="thread", loop=loop, timeout=60)
    grew = {tuple(entry for entry in log if entry[0] == "grew") for log in results[:2]}
    assert len(grew) == 1  # both survivors alike, at the same steps
    (*_, (_, generation, size, at)) = grew.pop()
    assert size == 3
    assert at >= 3
    joined = results[2][0]
    assert joined[:4] == ("joined", generation, 2, at)
    assert joined[4] == "trained"  # a survivor's state, not its own
    finals = [log[-1] for log in results]
    assert finals[0] == finals[1] == finals[2]
    assert finals[0][:3] == ("done", generation, 3)


async def _newcomer_dies_in_copy(ctx: RankContext) -> list[Any]:
    async with membership(ctx) as members, ftcomm.Group("gloo", timeout=10) as group:
        if ctx.rank == 2:
            await ctx.wait_for("trained")
        world = await members.join(group)
        big = {"w": torch.zeros(1 << 20)}
        log: list[Any] = []
        if ctx.rank == 2:
            await members.sync_state(big, 0)  # killed at its recv of the bytes
            return log
        step, grown = 0, False
        while step < 6 or not grown or world.size == 3:
            try:
                if step == 1 and ctx.rank == 0:
                    ctx.signal("trained")
                if await members.pending():
                    world = await members.recover(group)
                    grown = True
                    big, step = await members.sync_state(big, step)
                await group.allreduce(torch.ones(1), timeout=3)
                step += 1
            except ftcomm.CommError as exc:
                world = await members.recover(group)
                log.append((type(exc).__name__, world.generation, world.size))
        return [*log, ("done", world.generation, world.size)]


def test_a_newcomer_killed_during_the_state_copy_is_left_out(engine: str) -> None:
    # rank 2's ops: allgather of the steps (0), recv of the description (1),
    # allgather of the verdicts (2), recv of the tensor's bytes (3)
    plan = FaultPlan.of(Fault.kill(2, 3))
    results = run_world(_newcomer_dies_in_copy, 3, plan=plan, timeout=60)
    assert results[2] is None
    for log in results[:2]:
        assert log[-1] == ("done", 3, 2)
        assert log[0][1:] == (3, 2)


async def _sync_on_a_group(ctx: RankContext) -> tuple[Any, int]:
    async with ftcomm.Group("gloo", timeout=10) as group:
        await group.configure(ctx.addr(), ctx.rank, ctx.world_size)
        with pytest.raises(TypeError, match=r"group must be an ftcomm\.Group"):
            await ftcomm.sync_state(object(), {}, 0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="step must be >= 0"):
            await ftcomm.sync_state(group, {}, -1)
        with pytest.raises(ValueError, match="fit in an int64, got 9223372036854775808"):
            await ftcomm.sync_state(group, {}, 2**63)
        # ranks 1 and 2 are at step 7 (rank 1, the lowest, sends); rank 0 is behind
        step = 7 if ctx.rank else 3
        mine = {"w": torch.full((3,), float(ctx.rank)), "note": f"rank{ctx.rank}"}
        state, got = await ftcomm.sync_state(group, mine, step, timeout=10)
        return {"w": state["w"].tolist(), "note": state["note"]}, got


def test_sync_state_on_any_group_copies_from_the_lowest_rank_furthest_ahead() -> None:
    """ftcomm.sync_state: Membership.sync_state's copy on a group the
    membership does not configure (another shard's group of the same world)."""
    results = run_world(_sync_on_a_group, 3, mode="thread", timeout=30)
    assert results == [
        ({"w": [1.0, 1.0, 1.0], "note": "rank1"}, 7),
        ({"w": [1.0, 1.0, 1.0], "note": "rank1"}, 7),
        ({"w": [2.0, 2.0, 2.0], "note": "rank2"}, 7),
    ]


# -- the engine going away, bad input, cancelling ------------------------------


async def _store_breaks(ctx: RankContext) -> list[Any]:
    members = membership(ctx, min_size=2, max_size=2)
    async with members, ftcomm.Group("gloo", timeout=10) as group:
        await members.join(group)
        await group.allreduce(torch.ones(1))  # op 0; the store breaks before op 1
        await group.allreduce(torch.ones(1))
        # the group works on; the membership says its store is gone
        total = (await group.allreduce(torch.ones(1))).item()
        deadline = time.monotonic() + 10
        said = ""
        while not said:
            try:
                await members.pending()
            except ftcomm.MembershipError as exc:
                said = str(exc)
            assert time.monotonic() < deadline, "the broken store was never noticed"
            await asyncio.sleep(0.05)
        assert "store" in said
        with pytest.raises(ftcomm.MembershipError, match="store"):
            await members.recover(group)
        return [total]


def test_a_store_that_goes_away_is_a_membership_error_and_the_group_works_on() -> None:
    plan = FaultPlan.of(Fault.break_store(0, 1))
    assert run_world(_store_breaks, 2, plan=plan, timeout=60) == [[2.0], [2.0]]


@pytest.fixture
def store() -> Any:
    with ftcomm.serve_store() as server:
        yield server


_ADDR = "127.0.0.1:29400"  # never reached: arguments are checked before anything connects


def _refused(error: type[Exception], match: str, id: str, **changes: Any) -> Any:
    """A refused construction: the good arguments with ``changes``."""
    kwargs = {"address": _ADDR, "job": "job", "member_id": "m", **changes}
    return pytest.param(kwargs, error, match, id=id)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        _refused(ValueError, r"min_size \(3\) must not exceed max_size \(2\)",
                 "min_size over max_size", min_size=3, max_size=2),
        _refused(ValueError, "member_id must not be empty", "empty member_id", member_id=""),
        _refused(ValueError, "must not contain whitespace", "member_id with a space",
                 member_id="a b"),
        _refused(ValueError, "job must not be empty", "blank job", job=" "),
        _refused(TypeError, "member_id must be a str", "member_id not a str", member_id=3),
        _refused(TypeError, "min_size must be an int", "min_size not an int", min_size=1.5),
        _refused(ValueError, "min_size must be >= 1", "min_size 0", min_size=0),
        _refused(ValueError, "heartbeat_interval must be > 0 and at most a third",
                 "heartbeat_interval too long", heartbeat_timeout=1, heartbeat_interval=0.4),
        _refused(ValueError, "join_window must be >= 0", "negative join_window", join_window=-1),
        _refused(ValueError, r"address .* has no port", "address without a port",
                 address="localhost"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_at_once(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ftcomm.Membership(**kwargs)


def test_a_heartbeat_interval_of_a_third_of_the_timeout_is_accepted() -> None:
    members = ftcomm.Membership(_ADDR, "job", "m", heartbeat_timeout=0.9, heartbeat_interval=0.3)
    assert members.world is None


@pytest.mark.asyncio
async def test_an_address_that_does_not_answer_is_refused_at_once() -> None:
    with socket.socket() as bound:  # bound, never listening: refused
        bound.bind(("127.0.0.1", 0))
        members = ftcomm.Membership(f"127.0.0.1:{bound.getsockname()[1]}", "job", "m")
        started = time.monotonic()
        with pytest.raises(ftcomm.MembershipError, match="does not answer: connection refused"):
            await members.open()
        assert time.monotonic() - started < 1.0
    assert not _membership_threads()
    with pytest.raises(RuntimeError, match="already closed"):
        await members.open()


@pytest.mark.asyncio
async def test_an_id_in_use_by_a_live_member_is_refused(engine_addr: str) -> None:
    async with ftcomm.Membership(engine_addr, "job", "m", heartbeat_timeout=0.5):
        twin = ftcomm.Membership(engine_addr, "job", "m", heartbeat_timeout=0.5)
        with pytest.raises(ValueError, match="member_id 'm' is in use in job 'job'"):
            await twin.open()
    # once it left, the id is free at once; once it died, after its silence
    async with ftcomm.Membership(engine_addr, "job", "m", heartbeat_timeout=0.5) as again:
        assert again.world is None
    assert not _membership_threads()


@pytest.mark.asyncio
async def test_calls_out_of_order_are_refused(engine_addr: str) -> None:
    members = ftcomm.Membership(engine_addr, "job", "m", min_size=1, join_window=0)
    async with ftcomm.Group("gloo") as group:
        with pytest.raises(RuntimeError, match="needs an open membership"):
            await members.join(group)
        async with members:
            with pytest.raises(RuntimeError, match="in no world: join\\(\\) first"):
                await members.recover(group)
            with pytest.raises(RuntimeError, match="in no world"):
                await members.pending()
            with pytest.raises(TypeError, match=r"group must be an ftcomm\.Group"):
                await members.join(object())  # type: ignore[arg-type]
            world = await members.join(group)
            assert (world.generation, world.size, world.rank) == (1, 1, 0)
            with pytest.raises(RuntimeError, match="already: after a failure, call recover"):
                await members.join(group)
            with pytest.raises(ValueError, match="step must be >= 0"):
                await members.sync_state({}, -1)
            with pytest.raises(TypeError, match="step must be an int"):
                await members.sync_state({}, 1.0)  # type: ignore[arg-type]
            first = asyncio.ensure_future(members.recover(group))
            await asyncio.sleep(0)
            with pytest.raises(RuntimeError, match="pending\\(\\) called while recover\\(\\)"):
                await members.pending()
            assert (await first).generation == 2
            assert await members.pending() is False
            assert await members.sync_state({"a": 1}, 3) == ({"a": 1}, 3)
        with pytest.raises(RuntimeError, match="needs an open membership"):
            await members.pending()


@pytest.mark.asyncio
async def test_a_cancelled_join_leaves_nothing_that_blocks_the_next(engine_addr: str) -> None:
    first = ftcomm.Membership(engine_addr, "job", "a", min_size=2, join_window=0)
    async with first, ftcomm.Group("gloo") as group:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await first.join(group)
        assert first.world is None
        # its ready entry was taken back: a second member alone cannot form
        # a world with it, and the engine says so
        ready = parse_ready(engine_key(engine_addr, "job", "ready/1") or b"")
        assert ready == set()
        # and a join after it works
        second = ftcomm.Membership(engine_addr, "job", "b", min_size=2, join_window=0)
        async with second, ftcomm.Group("gloo") as other:
            worlds = await asyncio.gather(first.join(group), second.join(other))
            assert [(w.generation, w.size) for w in worlds] == [(1, 2), (1, 2)]
    assert not _membership_threads()


# -- the same worlds on torchft's lighthouse ----------------------------------


@pytest.fixture(scope="session")
def lighthouse() -> Any:
    """A torchft lighthouse in this process (min 2, join timeout as WINDOW,
    heartbeat timeout as HB); skipped without torchft. One per test process:
    a lighthouse keeps some fds after its shutdown. The worlds that use it
    take turns; one world's members are the next one's previous quorum,
    which the lighthouse forgets once their heartbeats stop."""
    os.environ.setdefault("RUST_LOG", "error")  # torchft's own log lines
    coordination = pytest.importorskip("torchft.coordination")
    server = coordination.LighthouseServer(
        bind="[::]:0",
        min_replicas=2,
        join_timeout_ms=int(WINDOW * 1000),
        quorum_tick_ms=10,
        heartbeat_timeout_ms=int(HB * 1000),
    )
    yield server
    server.shutdown()


async def _on_lighthouse(ctx: RankContext, address: str, body: str, *args: Any) -> Any:
    """Run ``body`` with a Membership on the lighthouse at ``address``, every
    rank beating before any asks for a quorum (else the first quorum forms
    without those the lighthouse has not heard of yet)."""
    os.environ.setdefault("RUST_LOG", "error")  # torchft's own log, before it loads
    coordination = __import__("torchft.coordination", fromlist=["LighthouseClient"])
    from datetime import timedelta

    # torch's store server and torchft's runtime keep a few fds once used: not leaks
    client = coordination.LighthouseClient(address, connect_timeout=timedelta(seconds=10))
    client.heartbeat(f"warm-{ctx.world_id}-{ctx.rank}")
    del client
    ftcomm.serve_store().close()
    ctx.baseline()
    return await globals()[body](ctx, address, *args)


async def _lh_train(ctx: RankContext, address: str) -> list[Any]:
    log: list[Any] = []
    async with membership(ctx, address=address) as members:
        ctx.signal(f"open{ctx.rank}")
        for rank in range(ctx.world_size):
            await ctx.wait_for(f"open{rank}")
        async with ftcomm.Group("gloo", timeout=10) as group:
            world = await members.join(group)
            done = 0
            while done < 6:
                try:
                    total = await group.allreduce(torch.ones(1), timeout=5.0)
                    log.append((world.generation, total.item()))
                    done += 1
                except ftcomm.CommError as exc:
                    failed = time.monotonic()
                    world = await members.recover(group)
                    took = time.monotonic() - failed
                    log.append((type(exc).__name__, world.generation, world.size, took))
    return log


def test_lighthouse_survivors_of_a_killed_member_form_the_next_generation(lighthouse: Any) -> None:
    plan = FaultPlan.of(Fault.kill(2, 3))
    args = (lighthouse.address(), "_lh_train")
    results = run_world(_on_lighthouse, 3, plan=plan, args=args, timeout=60)
    assert results[2] is None
    for log in results[:2]:
        assert log[:3] == [(1, 3.0)] * 3  # the three formed one world first
        error, generation, size, took = log[3]
        assert (error, generation, size) == ("CommFailed", 2, 2)
        # the lighthouse's heartbeat timeout, or its join timeout; and
        # configure's store connect (a reverse DNS lookup may wait 1 s)
        assert took < HB + WINDOW + 2.0
        assert log[4:] == [(2, 2.0)] * 3


async def _lh_grow(ctx: RankContext, address: str) -> list[Any]:
    """Ranks 0 and 1 train, asking pending() every step; rank 2 joins at their step 3."""
    async with membership(ctx, address=address) as members:
        if ctx.rank < 2:
            ctx.signal(f"open{ctx.rank}")
            await ctx.wait_for("open0")
            await ctx.wait_for("open1")
        else:
            await ctx.wait_for("step3")
        async with ftcomm.Group("gloo", timeout=10) as group:
            world = await members.join(group)
            fresh = ctx.rank == 2
            state = {"w": torch.full((2,), -100.0 if fresh else 0.0)}
            step, end, seen = 0, 3000, list[Any]()
            if fresh:
                state, step = await members.sync_state(state, step)
                seen.append(("joined", world.generation, world.rank, step))
                end = step + 3
            while step < end:
                if step == 3 and ctx.rank == 0 and world.size == 2:
                    ctx.signal("step3")
                # the same calls in the same order on every member: a newcomer
                # comes in where the others' recover() was, before their allreduce
                if not fresh and await members.pending():
                    world = await members.recover(group)
                    state, step = await members.sync_state(state, step)
                    seen.append(("grew", world.generation, world.size, step))
                    if world.size == 3:
                        end = step + 3
                state["w"] += await group.allreduce(torch.ones(2))
                step, fresh = step + 1, False
            return [*seen, ("done", world.generation, world.size, state["w"].tolist())]


def test_lighthouse_lets_a_newcomer_in_at_a_step_boundary(lighthouse: Any) -> None:
    args = (lighthouse.address(), "_lh_grow")
    results = run_world(_on_lighthouse, 3, args=args, timeout=60)
    grew = {tuple(e for e in log if e[0] == "grew") for log in results[:2]}
    assert len(grew) == 1
    (*_, (_, generation, size, at)) = grew.pop()
    assert size == 3
    assert results[2][0] == ("joined", generation, 2, at)
    finals = [log[-1] for log in results]
    assert finals[0] == finals[1] == finals[2]
    assert finals[0][:3] == ("done", generation, 3)


async def _lighthouse_goes_away(ctx: RankContext) -> Any:
    """Rank 0 runs a lighthouse, and shuts it down once ranks 1 and 2 (its
    members) have formed a world; they find it gone, and their group works on."""
    os.environ.setdefault("RUST_LOG", "error")
    from torchft.coordination import LighthouseServer

    if ctx.rank == 0:
        server = LighthouseServer(bind="[::]:0", min_replicas=2, heartbeat_timeout_ms=1000)
        ctx.baseline()  # torchft's runtime keeps a few fds once started: not leaks
        ctx.store.set(f"{ctx.world_id}/lighthouse", server.address())
        await ctx.wait_for("joined1")
        await ctx.wait_for("joined2")
        server.shutdown()
        ctx.signal("gone")
        return "shut down"
    address = ctx.store.get(f"{ctx.world_id}/lighthouse").decode()
    return await _on_lighthouse(ctx, address, "_members_lose_it")


async def _members_lose_it(ctx: RankContext, address: str) -> Any:
    members = membership(ctx, address=address)
    async with members, ftcomm.Group("gloo", timeout=10) as group:
        world = await members.join(group)
        ctx.signal(f"joined{ctx.rank}")
        await ctx.wait_for("gone")
        with pytest.raises(ftcomm.MembershipError, match="lighthouse"):
            await members.pending(timeout=5)
        return world.size, (await group.allreduce(torch.ones(1))).item()


def test_a_lighthouse_that_goes_away_is_a_membership_error_and_the_group_works_on() -> None:
    pytest.importorskip("torchft.coordination")
    results = run_world(_lighthouse_goes_away, 3, timeout=60)
    assert results == ["shut down", (2, 2.0), (2, 2.0)]


@pytest.mark.asyncio
async def test_a_lighthouse_address_that_does_not_answer_is_refused_at_once() -> None:
    pytest.importorskip("torchft.coordination")
    with socket.socket() as bound:  # bound, never listening: refused
        bound.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{bound.getsockname()[1]}"
        members = ftcomm.Membership(address, "job", "m")
        started = time.monotonic()
        with pytest.raises(ftcomm.MembershipError, match=r"lighthouse at .* does not answer"):
            await members.open()
        assert time.monotonic() - started < 1.0
    with pytest.raises(ValueError, match="a lighthouse is 'http://host:port'"):
        ftcomm.Membership("http://localhost", "job", "m")
    assert not _membership_threads()
