"""Network faults: each rank a host of its own, and its wire cut as planned.

Every kind is checked from the ranks: what still reaches them and what no
longer does (a TCP connect that times out, where an open path answers at
once with a refusal; UDP datagrams counted), and that a Gloo op meets its
deadline. After each world, nothing of it is left: no namespace, no
nftables table in the root namespace, no thread or process (conftest).
The worlds skip where :func:`network_missing` says they cannot run.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ftcomm
from ftcomm.testing import (
    Fault,
    FaultPlan,
    Kind,
    RankContext,
    WorldError,
    network_missing,
    run_world,
)
from ftcomm.testing._net import HUB_HOST, NetworkFailed, rules
from ftcomm.testing.pytest_plugin import World

MISSING = network_missing()
needs_network = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
DEADLINE = 1.0
"""Each Gloo op's deadline in these worlds, in seconds."""
LATE = 3.0
"""How long past its deadline an op may end on a loaded 2-core machine."""
SLOW = 30.0
"""Each configure's deadline: ranks start late on a loaded machine."""
CONNECT = 0.3
"""A TCP connect's deadline: an open path answers (accepts or refuses) at once."""
UDP_PORT = 47000
DATAGRAMS = 100
QUIET = 1.0
"""How long a rank waits for one more datagram, once every rank has sent."""


# -- as data: no network needed ------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Fault.partition(0, 0, seconds=-1), ValueError, "seconds must be finite"),
        (lambda: Fault.partition(0, 0, seconds=math.nan), ValueError, "seconds must be finite"),
        (lambda: Fault.isolate(0, 0, seconds=math.inf), ValueError, "seconds must be finite"),
        (lambda: Fault.isolate(0, 0, seconds="1"), TypeError, "seconds must be a number"),  # type: ignore[arg-type]
        (lambda: Fault.partition(0, 0, seconds=True), TypeError, "seconds must be a number"),
        (lambda: Fault.partition(0, 0, store=1), TypeError, "store must be a bool"),  # type: ignore[arg-type]
        (lambda: Fault.drop(0, 0, direction="both"), ValueError, "'out' or 'in'"),
        (lambda: Fault.drop(0, 0, direction=1), TypeError, "direction must be a str"),  # type: ignore[arg-type]
        (lambda: Fault.loss(0, 0, rate=0), ValueError, "rate must be > 0 and < 1"),
        (lambda: Fault.loss(0, 0, rate=1.0), ValueError, "rate must be > 0 and < 1"),
        (lambda: Fault.loss(0, 0, rate=math.nan), ValueError, "rate must be > 0 and < 1"),
        (lambda: Fault.loss(0, 0, rate="0.5"), TypeError, "rate must be a number"),  # type: ignore[arg-type]
        (lambda: Fault.isolate(-1, 0), ValueError, "rank must be"),
        (lambda: Fault(Kind.KILL, 0, 0, rate=0.5), ValueError, "rate= is for loss"),
        (lambda: Fault(Kind.LOSS, 0, 0, store=False, rate=0.5), ValueError, "store= is for"),
        (lambda: Fault(Kind.PARTITION, 0, 0, direction="in"), ValueError, "direction= is for"),
    ],
)
def test_bad_network_faults_are_rejected(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_each_kind_is_one_nftables_table_on_the_wire() -> None:
    peers = ["10.86.0.1", "10.86.0.3"]
    kept = rules(Fault.partition(1, 4), peers)
    assert kept.startswith("table netdev ftcomm_op4 {")
    assert 'hook egress device "eth0"' in kept
    assert 'hook ingress device "eth0"' in kept
    assert "ip daddr { 10.86.0.1, 10.86.0.3 } drop" in kept
    assert "ip saddr { 10.86.0.1, 10.86.0.3 } drop" in kept
    assert HUB_HOST not in kept  # the store stays reachable
    cut = rules(Fault.partition(1, 4, store=False), peers)
    assert f"ip daddr {{ 10.86.0.1, 10.86.0.3, {HUB_HOST} }} drop" in cut
    isolated = rules(Fault.isolate(1, 0), peers)
    assert isolated.count("    drop\n") == 2  # every packet, both ways
    out, into = rules(Fault.drop(1, 0), peers), rules(Fault.drop(1, 0, direction="in"), peers)
    assert "ip daddr" in out
    assert "ip saddr" not in out
    assert "ip saddr" in into
    assert "ip daddr" not in into
    lossy = rules(Fault.loss(1, 0, 0.25), peers)
    assert lossy.count("numgen random mod 10000 < 2500 drop") == 2
    assert "reject" not in kept + cut + isolated + out + into + lossy  # never an answer
    assert str(Fault.partition(1, 4, 2.5, store=False)) == (
        "partition(rank 1, op 4 store cut too for 2.5s)"
    )
    assert str(Fault.loss(0, 1, 0.5)) == "loss(rank 0, op 1 rate 0.5 until the end)"


async def _nothing(ctx: RankContext) -> None:
    return None


_PARTITION = FaultPlan.of(Fault.partition(0, 0))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param({"plan": _PARTITION, "mode": "thread"}, ValueError, "mode='process'",
                     id="a partition in a thread world"),
        pytest.param({"network": True, "mode": "thread"}, ValueError, "mode='process'",
                     id="a network thread world"),
        pytest.param({"plan": _PARTITION, "network": False}, ValueError, "need network=True",
                     id="a partition without a network"),
        pytest.param({"network": "yes"}, TypeError, "network must be a bool",
                     id="network not a bool"),
    ],
)  # fmt: skip
def test_network_worlds_are_refused_where_they_cannot_run(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        run_world(_nothing, 2, **kwargs)


def test_a_network_world_is_refused_where_nft_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ftcomm.testing._world.network_missing", lambda: "no nft here")
    with pytest.raises(RuntimeError, match="cannot run here: no nft here"):
        run_world(_nothing, 2, plan=_PARTITION)


# -- worlds ------------------------------------------------------------------------------
def _ours() -> list[str]:
    """This process's network-world namespaces."""
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        return []
    return [name for name in names if name.startswith(f"ftcw{os.getpid()}x")]


@pytest.fixture
def clean_network() -> Iterator[None]:
    """After the test: none of its namespaces, and no table in the root
    namespace (every rule lives in a rank's namespace)."""
    yield
    assert _ours() == []
    assert _tables() == ""


def _connect(host: str, port: int, wait: float = CONNECT) -> str:
    """``"connected"``, ``"refused"`` (an open path: the host answered with a
    reset), or ``"timeout"`` (nothing came back: dropped)."""
    try:
        with socket.create_connection((host, port), timeout=wait):
            return "connected"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"


async def _timed_op(group: ftcomm.Group) -> tuple[str, float]:
    started = time.monotonic()
    try:
        await group.allreduce(torch.ones(1))
        outcome = "ok"
    except ftcomm.CommError as exc:
        outcome = type(exc).__name__
    return outcome, time.monotonic() - started


async def partitioned(ctx: RankContext) -> dict[str, Any]:
    out: dict[str, Any] = {"ns": os.readlink("/proc/self/ns/net")}
    async with ftcomm.Group("gloo", timeout=DEADLINE, configure_timeout=SLOW) as every:
        await every.configure(ctx.addr("every"), ctx.rank, 3)
        out["first"] = (await every.allreduce(torch.ones(1))).item()  # op 0, across hosts
        out["second"], out["took"] = await _timed_op(every)  # op 1: rank 1 is cut off first
    if ctx.rank == 1:
        ctx.store.set("gray", b"still here")  # the store is kept: heartbeats go on
        out["store"] = ctx.store.get("gray")
        out["peer"] = _connect(ctx.host_of(0), 9)
        return out
    # the other two go on together
    async with ftcomm.Group("gloo", timeout=5, configure_timeout=SLOW) as pair:
        await pair.configure(ctx.addr("pair"), ctx.rank // 2, 2)
        out["pair"] = (await pair.allreduce(torch.ones(1))).item()
    out["peer"] = _connect(ctx.host_of(2 - ctx.rank), 9)
    return out


@needs_network
def test_partition_cuts_the_peers_and_keeps_the_store(clean_network: None) -> None:
    zero, one, two = run_world(partitioned, 3, plan=FaultPlan.of(Fault.partition(1, 1)))
    # three hosts of their own, none of them this process's
    assert len({zero["ns"], one["ns"], two["ns"], os.readlink("/proc/self/ns/net")}) == 4
    assert zero["first"] == one["first"] == two["first"] == 3.0
    assert one["second"] == "CommTimeout"
    assert DEADLINE <= one["took"] < DEADLINE + LATE
    assert zero["second"] != "ok"
    assert two["second"] != "ok"
    assert one["store"] == b"still here"
    assert one["peer"] == "timeout"  # dropped: no reset came back
    assert zero["peer"] == two["peer"] == "refused"  # their path answers
    assert zero["pair"] == two["pair"] == 2.0


HEAL = 2.0


async def healed(ctx: RankContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with ftcomm.Group("gloo", timeout=DEADLINE, configure_timeout=SLOW) as before:
        await before.configure(ctx.addr("before"), ctx.rank, 2)
        await before.allreduce(torch.ones(1))  # op 0
        cut_at = time.monotonic()
        out["op"], out["took"] = await _timed_op(before)  # op 1: rank 1 loses the store too
    out["checked"] = time.monotonic() - cut_at
    out["store"] = _connect(ctx.host, ctx.port, CONNECT)
    async with ftcomm.Group("gloo", timeout=5, configure_timeout=SLOW) as after:
        await after.configure(ctx.addr("after"), ctx.rank, 2)  # a fresh one, once healed
        out["configured"] = time.monotonic() - cut_at
        out["sum"] = (await after.allreduce(torch.ones(1))).item()
    return out


@needs_network
def test_partition_with_the_store_heals_after_its_seconds(clean_network: None) -> None:
    plan = FaultPlan.of(Fault.partition(1, 1, seconds=HEAL, store=False))
    zero, one = run_world(healed, 2, plan=plan)
    assert one["op"] == "CommTimeout"
    assert zero["op"] != "ok"
    assert DEADLINE <= one["took"] < DEADLINE + LATE
    if one["checked"] + CONNECT < HEAL:  # (a rank starved past the heal finds it healed)
        assert one["store"] == "timeout"  # cut, silently
    assert zero["store"] == "connected"
    assert one["configured"] >= HEAL  # nothing got through before the heal
    assert zero["sum"] == one["sum"] == 2.0


async def isolated(ctx: RankContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with ftcomm.Group("gloo", timeout=DEADLINE, configure_timeout=SLOW) as group:
        await group.configure(ctx.addr(), ctx.rank, 2)
        out["op"], out["took"] = await _timed_op(group)  # op 0: rank 1 is isolated first
    out["store"] = _connect(ctx.host, ctx.port)
    out["peer"] = _connect(ctx.host_of(1 - ctx.rank), 9)
    with socket.create_server((ctx.host_of(ctx.rank), 0)) as own:  # its own host still works
        out["own"] = _connect(ctx.host_of(ctx.rank), own.getsockname()[1])
    with socket.create_server(("127.0.0.1", 0)) as local:
        out["loopback"] = _connect("127.0.0.1", local.getsockname()[1])
    return out


@needs_network
def test_isolate_leaves_the_host_its_loopback_only(clean_network: None) -> None:
    zero, one = run_world(isolated, 2, plan=FaultPlan.of(Fault.isolate(1, 0)))
    assert one["op"] == "CommTimeout"
    assert DEADLINE <= one["took"] < DEADLINE + LATE
    assert zero["op"] != "ok"
    assert one["store"] == one["peer"] == "timeout"
    assert one["own"] == one["loopback"] == "connected"
    assert zero["store"] == "connected"
    assert zero["peer"] == "timeout"


async def _solo_op(ctx: RankContext) -> None:
    """Op 0 of this rank, on a group of its own: fires its fault, touches no peer."""
    async with ftcomm.Group("gloo", timeout=5, configure_timeout=SLOW) as solo:
        await solo.configure(ctx.addr(f"solo{ctx.rank}"), 0, 1)
        await solo.allreduce(torch.ones(1))


async def _datagrams(ctx: RankContext, count: int) -> dict[int, int]:
    """Each rank sends ``count`` datagrams to every other, once all listen;
    returns how many it got from each: all it can get, or what came until
    none more did for ``QUIET`` seconds after every rank had sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((ctx.host_of(ctx.rank), UDP_PORT))
        ctx.signal(f"bound{ctx.rank}")
        for rank in range(ctx.world_size):
            await ctx.wait_for(f"bound{rank}")
        for rank in range(ctx.world_size):
            if rank != ctx.rank:
                for _ in range(count):
                    sock.sendto(bytes([ctx.rank]), (ctx.host_of(rank), UDP_PORT))
        ctx.signal(f"sent{ctx.rank}")
        for rank in range(ctx.world_size):
            await ctx.wait_for(f"sent{rank}")
        heard: dict[int, int] = {}
        sock.settimeout(QUIET)
        with contextlib.suppress(TimeoutError):
            while sum(heard.values()) < count * (ctx.world_size - 1):
                sender = sock.recv(16)[0]
                heard[sender] = heard.get(sender, 0) + 1
        return heard


async def one_way(ctx: RankContext) -> dict[int, int]:
    await _solo_op(ctx)
    return await _datagrams(ctx, 20)


@needs_network
def test_drop_cuts_one_direction(clean_network: None) -> None:
    plan = FaultPlan.of(Fault.drop(1, 0, direction="out"), Fault.drop(2, 0, direction="in"))
    zero, one, two = run_world(one_way, 3, plan=plan)
    assert zero == {2: 20}  # nothing from 1, which drops what it sends
    assert one == {0: 20, 2: 20}  # 1 still hears everyone
    assert two == {}  # 2 drops what it gets


def _tables() -> str:
    """``nft list tables`` in this thread's namespace."""
    return subprocess.run(
        ["nft", "list", "tables"], capture_output=True, text=True, check=True
    ).stdout


async def lossy(ctx: RankContext) -> tuple[dict[int, int], str]:
    await _solo_op(ctx)
    heard = await _datagrams(ctx, DATAGRAMS)
    return heard, _tables()  # this rank's own namespace: its fault's table, if any


@needs_network
def test_loss_loses_about_its_share(clean_network: None) -> None:
    (zero, zero_tables), (one, one_tables) = run_world(
        lossy, 2, plan=FaultPlan.of(Fault.loss(1, 0, rate=0.8))
    )
    # 20 of 100 expected each way; 0 or 50 and more: about 1e-10 each
    assert 0 < zero.get(1, 0) < DATAGRAMS // 2
    assert 0 < one.get(0, 0) < DATAGRAMS // 2
    assert one_tables == "table netdev ftcomm_op0\n"
    assert zero_tables == ""


async def interrupts(ctx: RankContext, harness: int) -> None:
    await _solo_op(ctx)  # rank 0's partition fires, with a heal timer 60 s out
    if ctx.rank == 0:
        os.kill(harness, signal.SIGINT)
    await ctx.wait_for("never", timeout=30)  # the harness's teardown kills it


@needs_network
def test_an_interrupted_world_leaves_nothing_behind(clean_network: None) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT reaches the main thread only")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    plan = FaultPlan.of(Fault.partition(0, 0, seconds=60))
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_world(interrupts, 2, plan=plan, args=(os.getpid(),), timeout=30)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 20  # the interrupt ended it, not a bound
    assert not [t for t in threading.enumerate() if t.name.startswith("world-heal")]


async def refused_rule(ctx: RankContext) -> str:
    async with ftcomm.Group("gloo", timeout=5, configure_timeout=SLOW) as solo:
        await solo.configure(ctx.addr(f"solo{ctx.rank}"), 0, 1)
        try:
            await solo.allreduce(torch.ones(1))  # op 0: its rule cannot be applied
            return "ok"
        except ftcomm.CommError as exc:
            return f"{type(exc).__name__}: {exc}"


@needs_network
def test_a_rule_that_cannot_be_applied_fails_its_op(
    monkeypatch: pytest.MonkeyPatch, clean_network: None
) -> None:
    def refuse(namespace: str, text: str) -> None:  # the harness's side, in this process
        raise NetworkFailed("nft: no such hook here")

    monkeypatch.setattr("ftcomm.testing._net._nft", refuse)
    (said,) = run_world(refused_rule, 1, plan=FaultPlan.of(Fault.drop(0, 0)))
    assert said.startswith("Comm")
    assert "could not apply drop(rank 0, op 0 out until the end)" in said
    assert "nft: no such hook here" in said


async def fails(ctx: RankContext) -> None:
    await _solo_op(ctx)  # rank 1's loss fires, with a heal timer 60 s out
    if ctx.rank == 1:
        raise RuntimeError("a rank fails in a network world")


@needs_network
def test_a_failed_world_leaves_nothing_behind(clean_network: None) -> None:
    plan = FaultPlan.of(Fault.loss(1, 0, rate=0.5, seconds=60))
    with pytest.raises(WorldError, match="a rank fails in a network world"):
        run_world(fails, 2, plan=plan)
    assert not [t for t in threading.enumerate() if t.name.startswith("world-heal")]


async def across_hosts(ctx: RankContext) -> tuple[str, str, str, float]:
    async with ftcomm.Group(ctx.backend, timeout=5, configure_timeout=SLOW) as group:
        await group.configure(ctx.addr(), ctx.rank, ctx.world_size)
        total = (await group.allreduce(torch.ones(1))).item()
    return ctx.host, ctx.host_of(ctx.rank), os.environ["FTCOMM_GLOO_HOST"], total


@needs_network
@pytest.mark.ftcomm_loops("uvloop")
def test_a_network_world_without_faults_runs_across_hosts(
    ftcomm_world: World, clean_network: None
) -> None:
    assert ftcomm_world.run(across_hosts, 2, network=True) == [
        (HUB_HOST, "10.86.0.1", "10.86.0.1", 2.0),
        (HUB_HOST, "10.86.0.2", "10.86.0.2", 2.0),
    ]
