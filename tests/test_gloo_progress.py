"""Gloo ops that make progress however many are outstanding, and composed ops
whose outcome waits for every member.

* Gloo's send/recv works learn that they completed only inside ``wait()``
  (their data moves on Gloo's own device thread). ftcomm waits on them on a
  worker thread each; those waits must never queue behind one another, or a
  pipeline with many outstanding receives stalls (a wait for a recv whose send
  comes later holds the thread the next send's wait needs).
* ``reduce_scatter`` and ``reduce_scatter_tensor_coalesced`` must not need a
  waiting thread at all.
* An op ftcomm composes from several c10d works (``WorksOp``) ends when every
  member has ended, with the first member's error: never at the first
  failure while a sibling can still write, and never with torch's
  "completed() INTERNAL ASSERT FAILED" from reading a pending sibling.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

import ftcomm
from ftcomm._runtime.native import WorksOp
from ftcomm._runtime.threads import WorkerPool
from ftcomm.testing import RankContext, run_world

OUTSTANDING = 64


# -- many outstanding point-to-point ops ---------------------------------------
async def recvs_then_awaited_sends(ctx: RankContext) -> list[float]:
    """Post every recv first, then send one message at a time, each awaited
    before the next is issued (a pipeline): the peer's recv ``i`` completes
    only after this rank's send ``i`` was issued, long after recv ``i + 16``
    was posted."""
    r, peer = ctx.rank, 1 - ctx.rank
    async with ftcomm.Group("gloo", timeout=20) as g:
        await g.configure(ctx.addr(), r, 2)
        bufs = [torch.full((2,), -1.0) for _ in range(OUTSTANDING)]
        recvs = [g.recv(b, peer, tag=i) for i, b in enumerate(bufs)]
        for i in range(OUTSTANDING):
            await g.send(torch.tensor([float(i), 100.0 * r]), peer, tag=i)
        got = [await w for w in reversed(recvs)][::-1]
        assert all(a is b for a, b in zip(got, bufs, strict=True))
        assert g.errored() is None
        return [float(b[0]) + float(b[1]) for b in bufs]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_pipeline_with_many_outstanding_recvs_completes(mode: str) -> None:
    results = run_world(recvs_then_awaited_sends, 2, mode=mode, timeout=60)
    for r, got in enumerate(results):
        peer = 1 - r
        assert got == [float(i) + 100.0 * peer for i in range(OUTSTANDING)]


async def reduce_scatters_under_outstanding_recvs(ctx: RankContext) -> dict[str, Any]:
    """Receives for the next step are posted, the peer sends them only after
    this step's reduce-scatters: those must complete while every recv waits."""
    r, n, peer = ctx.rank, ctx.world_size, 1 - ctx.rank
    async with ftcomm.Group("gloo", timeout=20) as g:
        await g.configure(ctx.addr(), r, n)
        bufs = [torch.zeros(1) for _ in range(OUTSTANDING)]
        recvs = [g.recv(b, peer, tag=i) for i, b in enumerate(bufs)]
        outs = [torch.full((2,), -1.0) for _ in range(OUTSTANDING)]
        scatters = [
            g.reduce_scatter(o, [torch.full((2,), float(i * 10 + d + r)) for d in range(n)])
            for i, o in enumerate(outs)
        ]
        pairs = [(torch.empty(1), torch.empty(2, dtype=torch.int64)) for _ in range(OUTSTANDING)]
        coalesced = [
            g.reduce_scatter_tensor_coalesced(
                list(p),
                [
                    torch.arange(n, dtype=torch.float32) * (r + 1) + i,
                    torch.tensor([i, r] * n, dtype=torch.int64),
                ],
                "max",
            )
            for i, p in enumerate(pairs)
        ]
        # Awaited last-issued first: no op may depend on an earlier one's waiter.
        for pair in reversed(coalesced):
            await pair
        for scatter in reversed(scatters):
            await scatter
        for i in range(OUTSTANDING):
            await g.send(torch.tensor([float(i)]), peer, tag=i)
        for w in recvs:
            await w
        assert g.errored() is None
        return {
            "scatter": [o.tolist() for o in outs],
            "coalesced": [[p[0].tolist(), p[1].tolist()] for p in pairs],
            "recv": [float(b) for b in bufs],
        }


def test_reduce_scatters_complete_while_many_recvs_are_outstanding() -> None:
    results = run_world(reduce_scatters_under_outstanding_recvs, 2, mode="thread", timeout=60)
    n = 2
    for r, got in enumerate(results):
        assert got["scatter"] == [
            [float(sum(i * 10 + r + k for k in range(n)))] * 2 for i in range(OUTSTANDING)
        ]
        assert got["coalesced"] == [[[float(r * n + i)], [i, n - 1]] for i in range(OUTSTANDING)]
        assert got["recv"] == [float(i) for i in range(OUTSTANDING)]


async def reduce_scatter_ops(ctx: RankContext) -> dict[str, Any]:
    """Every reduce op, a big input and an output inside its input, in three ranks."""
    r, n = ctx.rank, ctx.world_size
    async with ftcomm.Group("gloo", timeout=20) as g:
        await g.configure(ctx.addr(), r, n)
        out: dict[str, Any] = {}
        for name in ("sum", "product", "min", "max"):
            out[name] = (
                await g.reduce_scatter(
                    torch.empty(2),
                    [torch.tensor([d + r + 1.0, -(d + r + 1.0)]) for d in range(n)],
                    name,
                )
            ).tolist()
        big = 1 << 18  # 2 MiB of float64 per chunk: one allreduce per chunk
        ins = torch.arange(n * big, dtype=torch.float64) + r
        got = await g.reduce_scatter_tensor_coalesced(
            [torch.empty(big, dtype=torch.float64)], [ins], "sum"
        )
        want = (torch.arange(n * big, dtype=torch.float64) * n + sum(range(n)))[
            r * big : (r + 1) * big
        ]
        out["big"] = bool(torch.equal(got[0], want))
        # The output may be this rank's own chunk of the input (in place).
        inplace = torch.arange(n * 3, dtype=torch.float32) + 10 * r
        mine = inplace[r * 3 : (r + 1) * 3]
        await g.reduce_scatter_tensor_coalesced([mine], [inplace], "sum")
        out["inplace"] = mine.tolist()
        return out


def test_reduce_scatter_gives_every_reduce_op_and_big_inputs() -> None:
    n = 3
    results = run_world(reduce_scatter_ops, n, mode="thread", timeout=60)
    for r, got in enumerate(results):
        vals = [float(r + k + 1) for k in range(n)]
        prod = 1.0
        for x in vals:
            prod *= x
        assert got["sum"] == [sum(vals), -sum(vals)]
        assert got["product"] == [prod, prod * (-1) ** n]
        assert got["min"] == [min(vals), -max(vals)]
        assert got["max"] == [max(vals), -min(vals)]
        assert got["big"] is True
        assert got["inplace"] == [
            float(sum(r * 3 + j + 10 * k for k in range(n))) for j in range(3)
        ]


# -- the worker pool's unqueued calls -------------------------------------------
def test_spawned_calls_run_side_by_side_past_max_workers() -> None:
    """Each call waits for all the others: queued behind one another they
    would deadlock, as p2p waits did behind 16 threads."""
    pool = WorkerPool("test-pool", max_workers=2, linger=0.05)
    count = 2 * 2 + 5
    everyone = threading.Barrier(count)
    try:
        futures = [pool.spawn(everyone.wait, 10.0, until=None) for _ in range(count)]
        assert sorted(f.result(15) for f in futures) == list(range(count))
        assert pool.wait_idle(5)
        # Submitted calls stay bounded; spawned ones pass them.
        gate, third = threading.Event(), threading.Event()
        blocked = [pool.submit(gate.wait, 10.0) for _ in range(2)]
        queued = pool.submit(third.set)
        assert pool.spawn(lambda: "past the queue", until=None).result(5) == "past the queue"
        assert not third.is_set()  # both bounded slots are taken
        gate.set()
        queued.result(5)
        assert all(f.result(5) for f in blocked)
    finally:
        pool.close()


def test_surplus_idle_threads_end_after_lingering() -> None:
    pool = WorkerPool("test-pool-linger", max_workers=1, linger=0.05)
    count = 6
    everyone = threading.Barrier(count)

    def meet() -> threading.Thread:
        everyone.wait(10.0)
        return threading.current_thread()

    threads: set[threading.Thread] = set()
    try:
        futures = [pool.spawn(meet, until=None) for _ in range(count)]
        threads = {f.result(15) for f in futures}
        assert len(threads) == count
        # Down to max_workers once the surplus has been idle for `linger`.
        assert pool.wait_threads(1, timeout=10), f"{pool.thread_count} threads still alive"
        assert pool.spawn(lambda: "again", until=None).result(5) == "again"
    finally:
        pool.close()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def test_spawn_and_submit_refused_after_close() -> None:
    pool = WorkerPool("test-pool-closed", max_workers=1)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.spawn(lambda: None, until=None)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(lambda: None)


# -- composed ops end when every member has ended ---------------------------
async def coalesced_gather_while_the_peer_leaves(ctx: RankContext, trials: int) -> list[str]:
    """Rank 0 gathers three tensors (three Gloo works); rank 1 never joins,
    it shuts its group down: every member fails, in an order Gloo picks."""
    errors = []
    for trial in range(trials):
        async with ftcomm.Group("gloo", timeout=20) as g:
            await g.configure(ctx.addr(f"t{trial}"), ctx.rank, 2)
            if ctx.rank == 1:
                await ctx.wait_for(f"issued{trial}")
                await g.shutdown()
                continue
            work = g.allgather_into_tensor_coalesced(
                [torch.empty(2) for _ in range(3)], [torch.ones(1) for _ in range(3)]
            )
            ctx.signal(f"issued{trial}")
            with pytest.raises(ftcomm.CommError) as caught:
                await work
            errors.append(f"{type(caught.value).__name__}: {caught.value}")
    return errors


def test_a_composed_op_fails_with_gloos_error_when_the_peer_leaves() -> None:
    errors, _ = run_world(coalesced_gather_while_the_peer_leaves, 2, mode="thread", args=(8,))
    assert len(errors) == 8
    for error in errors:
        assert "INTERNAL ASSERT" not in error
        assert error.startswith("CommFailed: "), error


class _Member:
    """A real c10d work whose outcome the test sets: success, or a real c10d
    error (raised in a ``then`` callback, so it is set in C++, as Gloo does)."""

    def __init__(self) -> None:
        self._source: torch.futures.Future[None] = torch.futures.Future()
        self._fail: str | None = None

        def settle(_: object) -> None:
            if self._fail is not None:
                raise RuntimeError(self._fail)

        self.work = _create_work_from_future(self._source.then(settle))

    def succeed(self) -> None:
        self._source.set_result(None)

    def fail(self, message: str) -> None:
        self._fail = message
        self._source.set_result(None)


def _watch(op: WorksOp) -> list[BaseException | None]:
    seen: list[BaseException | None] = []
    op.on_done(seen.append)
    return seen


@pytest.mark.parametrize(
    "script",
    [
        # (member index, error message or None), in completion order
        [(1, "second member broke"), (0, None), (2, None)],
        [(2, "third broke"), (1, "second broke"), (0, None)],
        [(0, "first broke"), (2, None), (1, None)],
        [(2, None), (1, "second broke"), (0, "first broke")],
        [(1, None), (2, None), (0, None)],
    ],
)
def test_a_composed_op_ends_when_its_last_member_does(script: list[tuple[int, str | None]]) -> None:
    members = [_Member() for _ in range(3)]
    op = WorksOp([m.work for m in members])
    seen = _watch(op)
    for step, (index, message) in enumerate(script):
        assert seen == [], f"ended after {step} of 3 members"
        assert op.poll() is False
        if message is None:
            members[index].succeed()
        else:
            members[index].fail(message)
    assert op.poll() is True
    failures = sorted((i, m) for i, m in script if m is not None)
    expected = None if not failures else failures[0][1]  # the first member's, in member order
    assert len(seen) == 1
    outcome = op.outcome()
    for got in (seen[0], outcome):
        if expected is None:
            assert got is None
        else:
            assert isinstance(got, RuntimeError)
            assert expected in str(got)
            assert "INTERNAL ASSERT" not in str(got)
    late = _watch(op)  # registered after the end: called at once, same outcome
    assert len(late) == 1
    assert type(late[0]) is type(seen[0])


def test_members_ending_on_many_threads_end_the_op_once() -> None:
    count = 32
    members = [_Member() for _ in range(count)]
    op = WorksOp([m.work for m in members])
    calls: list[BaseException | None] = []
    lock = threading.Lock()
    ended = threading.Event()

    def record(error: BaseException | None) -> None:
        with lock:
            calls.append(error)
        ended.set()

    op.on_done(record)
    start = threading.Barrier(count)

    def finish(i: int) -> None:
        start.wait(10)
        if i == 7:
            members[i].fail("member 7 broke")
        else:
            members[i].succeed()

    threads = [threading.Thread(target=finish, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert ended.wait(10)
    assert len(calls) == 1
    assert isinstance(calls[0], RuntimeError)
    assert "member 7 broke" in str(calls[0])


def _inputs(rank: int, pairs: int, size: int, n: int) -> list[torch.Tensor]:
    """Rank ``rank``'s inputs: ``pairs`` tensors of ``n`` chunks of ``size``."""
    return [
        torch.arange(n * size, dtype=torch.float32) * (p + 1) + 1000 * rank for p in range(pairs)
    ]


async def reduce_scatter_aliasing_and_buckets(ctx: RankContext) -> dict[str, Any]:
    r, n = ctx.rank, ctx.world_size
    async with ftcomm.Group("gloo", timeout=30) as g:
        await g.configure(ctx.addr(), r, n)
        out: dict[str, Any] = {}
        # Pair 0's output is the other rank's chunk of pair 1's input: pair 1
        # must reduce the input as it was, not what pair 0 wrote there.
        ins = _inputs(r, 2, 4, n)
        outs = [ins[1][(1 - r) * 4 : (2 - r) * 4], torch.empty(4)]
        await g.reduce_scatter_tensor_coalesced(outs, ins, "sum")
        out["cross"] = [o.tolist() for o in outs]
        # Separate outputs: the inputs are never written.
        ins = _inputs(r, 3, 8, n)
        before = [t.clone() for t in ins]
        await g.reduce_scatter_tensor_coalesced([torch.empty(8) for _ in ins], ins, "max")
        out["inputs kept"] = all(torch.equal(a, b) for a, b in zip(ins, before, strict=True))
        # Past one bucket (600 pairs x 2 chunks x 4 KiB = 4.7 MiB), and bitwise on ints.
        ins = _inputs(r, 600, 1024, n)
        got = await g.reduce_scatter_tensor_coalesced([torch.empty(1024) for _ in ins], ins)
        out["many"] = [t[:3].tolist() + t[-1:].tolist() for t in got]
        bits = [torch.tensor([0b1111 ^ (1 << r), 0b0110 | r], dtype=torch.int64) for _ in range(n)]
        out["band"] = (
            await g.reduce_scatter(torch.empty(2, dtype=torch.int64), bits, "band")
        ).tolist()
        return out


def test_reduce_scatter_reads_every_input_before_writing_and_packs_buckets() -> None:
    n = 2
    results = run_world(reduce_scatter_aliasing_and_buckets, n, mode="thread", timeout=90)

    def totals(pairs: int, size: int) -> list[torch.Tensor]:
        every = [_inputs(k, pairs, size, n) for k in range(n)]
        return [sum(rank[p] for rank in every) for p in range(pairs)]  # type: ignore[misc]

    cross, many = totals(2, 4), totals(600, 1024)
    for r, got in enumerate(results):
        assert got["cross"] == [t[r * 4 : (r + 1) * 4].tolist() for t in cross]
        assert got["inputs kept"] is True
        mine = [t[r * 1024 : (r + 1) * 1024] for t in many]
        assert got["many"] == [t[:3].tolist() + t[-1:].tolist() for t in mine]
        assert got["band"] == [0b1111 & ~0b11, 0b0110]


def test_buckets_pack_by_dtype_in_order_up_to_the_cap() -> None:
    from ftcomm.backends.gloo import _FUSE_MAX_BYTES, _buckets

    quarter = torch.empty(_FUSE_MAX_BYTES // 4 // 4)  # float32: a quarter of the cap
    small_int = torch.empty(4, dtype=torch.int64)
    big = torch.empty(_FUSE_MAX_BYTES // 4)  # the cap: alone
    bufs = [quarter, small_int, quarter, big, quarter, quarter, quarter]
    got = [[id(t) for t in bucket] for bucket in _buckets(bufs)]
    assert got == [
        [id(quarter)] * 4,  # 4 quarters fill the first float bucket ...
        [id(small_int)],
        [id(big)],
        [id(quarter)],  # ... the fifth opens a second
    ]
