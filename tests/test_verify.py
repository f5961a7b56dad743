"""Ranks that disagree on an op (issue 11, ``../shared/repros/n2_mismatched_shapes.py``).

Without a check, Gloo kills the process that receives more bytes than it
posted (``std::terminate``, SIGABRT) and, for an allgather, hands the other
rank garbage as a success -- in process and, with ``subprocess=True``, in the
worker (measured: the peer of a ``WorkerDied`` got ``[1.0, 0.0, 2.3e-41,
2.3e-41]``). With ``verify=True`` every rank raises ``CommFailed`` naming
both sides, nothing of the op is sent, and the trainer lives on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import ScriptedOp

import ftcomm
from ftcomm._verify import Chain, VerifiedOp, describe, explain, mismatch
from ftcomm.errors import CommAborted
from ftcomm.testing import RankContext, run_world

Case = Callable[[ftcomm.Group, int], Any]
CASES: dict[str, Case] = {
    "allreduce len 4 vs 5": lambda g, r: g.allreduce(torch.ones(4 + r)),
    "allreduce len 4 vs 4000": lambda g, r: g.allreduce(torch.ones(4 if r == 0 else 4000)),
    "allreduce float32 vs float64": lambda g, r: g.allreduce(
        torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64)
    ),
    "allreduce vs broadcast": lambda g, r: (
        g.allreduce(torch.ones(4)) if r == 0 else g.broadcast(torch.ones(4), root=0)
    ),
    "allgather len 3 vs 4": lambda g, r: g.allgather(torch.ones(3 + r)),
    "allreduce float32 vs int32 (same bytes)": lambda g, r: g.allreduce(
        torch.ones(4, dtype=torch.float32 if r == 0 else torch.int32)
    ),
    "broadcast root 0 vs 1": lambda g, r: g.broadcast(torch.ones(4), root=r),
}


async def mismatched(ctx: RankContext, names: list[str], subprocess: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, name in enumerate(names):
        # configure's own deadline is generous: a subprocess worker starting
        # on a loaded machine is not what this test looks at
        g = ftcomm.Group(
            "gloo", timeout=5, configure_timeout=60, verify=True, subprocess=subprocess
        )
        try:
            await g.configure(ctx.addr(f"m{i}"), ctx.rank, 2)
            try:
                await CASES[name](g, ctx.rank)
                out[name] = ("success", "", None)
            except ftcomm.CommError as exc:
                errored = g.errored()
                out[name] = (type(exc).__name__, str(exc), type(errored).__name__)
        finally:
            await g.shutdown()
    # The trainer carries on: a fresh configuration works.
    async with ftcomm.Group(
        "gloo", timeout=5, configure_timeout=60, verify=True, subprocess=subprocess
    ) as g:
        await g.configure(ctx.addr("again"), ctx.rank, 2)
        assert (await g.allreduce(torch.ones(2))).tolist() == [2.0, 2.0]
    return out


def _assert_named(results: list[dict[str, Any]], names: list[str]) -> None:
    for name in names:
        for rank in (0, 1):
            kind, message, errored = results[rank][name]
            assert kind == "CommFailed", (name, rank, kind, message)
            assert "rank 0 issued" in message or "rank 1 issued" in message, message
            assert f"rank {1 - rank} issued" in message, message  # names the other side
            assert errored == "CommFailed"


@pytest.mark.slow
def test_mismatched_ops_fail_on_every_rank_and_the_process_lives() -> None:
    names = list(CASES)
    results = run_world(mismatched, 2, args=(names, False), timeout=120)
    _assert_named(results, names)


@pytest.mark.slow
def test_mismatched_allgather_with_subprocess_is_no_garbage_success() -> None:
    names = ["allgather len 3 vs 4"]
    results = run_world(mismatched, 2, args=(names, True), timeout=120)
    _assert_named(results, names)


async def _fused_batches(ctx: RankContext) -> dict[str, Any]:
    """Batches that add up to as many elements on both ranks, but differ."""
    r = ctx.rank
    out: dict[str, Any] = {}
    cases = {
        "members in another order": ([(2,), (3,)], [(3,), (2,)]),
        "a lone op against a batch": ([(5,)], [(2,), (3,)]),
        "the same batch": ([(2,), (3,)], [(2,), (3,)]),
    }
    for name, shapes in cases.items():
        async with ftcomm.Group("gloo", timeout=10, verify=True, fuse=True) as g:
            await g.configure(ctx.addr(f"fb{len(out)}"), r, 2)
            ts = [torch.full(shape, float(r + 1)) for shape in shapes[r]]
            async with g.batch():
                works = [g.allreduce(t) for t in ts]
            got = await asyncio.gather(*works, return_exceptions=True)
            errored = g.errored()
            out[name] = (
                [type(x).__name__ if isinstance(x, BaseException) else x.tolist() for x in got],
                None if errored is None else (type(errored).__name__, str(errored)),
            )
    return out


def test_fused_batches_are_checked_member_by_member() -> None:
    for result in run_world(_fused_batches, 2, mode="thread", timeout=60):
        for name in ("members in another order", "a lone op against a batch"):
            ops, errored = result[name]
            # every member fails: by the check, or aborted by the break it made
            assert set(ops) <= {"CommFailed", "CommAborted"}, (name, ops)
            assert errored is not None, name
            kind, message = errored
            assert kind == "CommFailed", (name, message)
            assert "issued" in message, message  # the check's own words: who issued what
        assert result["the same batch"] == ([[3.0, 3.0], [3.0, 3.0, 3.0]], None)


async def matching(ctx: RankContext) -> dict[str, Any]:
    r = ctx.rank
    async with ftcomm.Group("gloo", timeout=10, verify=True) as g:
        await g.configure(ctx.addr("v"), r, 2)
        # Many at once: the chain issues check, op, check, op ... in order.
        works = [g.allreduce(torch.full((3,), float(i + r))) for i in range(40)]
        sums = [(await w).tolist() for w in works]
        out = {
            "sums": sums,
            "gather": [t.tolist() for t in await g.allgather(torch.tensor([float(r)]))],
            "bcast": (await g.broadcast(torch.tensor([float(r + 5)]), root=1)).tolist(),
            "rs": (
                await g.reduce_scatter(torch.zeros(1), [torch.tensor([1.0]), torch.tensor([2.0])])
            ).tolist(),
            "a2a": (await g.alltoall_base(torch.zeros(2), torch.tensor([r, r + 0.5]))).tolist(),
            "barrier": await g.barrier(),
        }
        if r == 0:
            await g.send(torch.tensor([7.0]), 1)
        else:
            out["recv"] = (await g.recv(torch.zeros(1), 0)).tolist()
        return out


def test_verified_ops_give_the_same_results_in_order() -> None:
    results = run_world(matching, 2, mode="thread", timeout=60)
    for r, out in enumerate(results):
        assert out["sums"] == [[float(2 * i + 1)] * 3 for i in range(40)]
        assert out["gather"] == [[0.0], [1.0]]
        assert out["bcast"] == [6.0]
        assert out["rs"] == [2.0 if r == 0 else 4.0]
        assert out["a2a"] == ([0.0, 1.0] if r == 0 else [0.5, 1.5])
        assert out["barrier"] is None
    assert results[1]["recv"] == [7.0]


async def cancelled_while_checking(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 gives its op up while the check waits for rank 1; rank 1 comes later."""
    async with ftcomm.Group("gloo", timeout=10, verify=True) as g:
        await g.configure(ctx.addr("c"), ctx.rank, 2)
        t = torch.ones(2)
        if ctx.rank == 0:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await g.allreduce(t)
            ctx.signal("given-up")
            await ctx.wait_for("done")
            return {"tensor": t.tolist(), "errored": type(g.errored()).__name__}
        await ctx.wait_for("given-up")
        try:
            await g.allreduce(t)
            outcome = "success"
        except ftcomm.CommError as exc:
            outcome = type(exc).__name__
        ctx.signal("done")
        return {"outcome": outcome}


def test_an_op_given_up_during_its_check_is_over_for_both_ranks() -> None:
    r0, r1 = run_world(cancelled_while_checking, 2, timeout=60)
    assert r0 == {"tensor": [1.0, 1.0], "errored": "CommAborted"}
    assert r1["outcome"] == "CommFailed"


def test_descriptors_name_what_differs() -> None:
    a = describe("allreduce", 3, [torch.ones(4, 2)], 0)
    b = describe("allreduce", 3, [torch.ones(5, 2, dtype=torch.float64)], 0)
    assert explain(a.tolist()) == "allreduce #3 float32 [4, 2] (8 elements)"
    assert explain(b.tolist()) == "allreduce #3 float64 [5, 2] (10 elements)"
    why = mismatch(torch.stack([a, b]), 1)
    assert why is not None
    assert "rank 1 issued allreduce #3 float64" in why
    assert "rank 0 issued allreduce #3 float32" in why
    assert mismatch(torch.stack([a, a.clone()]), 0) is None
    barrier = describe("barrier", 1, [], 0)
    assert explain(barrier.tolist()) == "barrier #1"
    root = describe("broadcast", 2, [torch.ones(2, 3, 4, 5)], 1)
    assert explain(root.tolist()) == "broadcast #2 float32 [2, 3, 4, ...] (120 elements, root/op 1)"
    assert explain([9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).startswith("an unknown descriptor")


def test_verify_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="verify"):
        ftcomm.Group("gloo", verify="yes")  # type: ignore[arg-type]


# -- the chain, driven with scripted native ops (tests/helpers.py) ----------


class _Recorder:
    """Issues scripted exchanges and ops, and records what was issued."""

    def __init__(self) -> None:
        self.issued: list[str] = []
        self.exchanges: list[tuple[ScriptedOp, list[torch.Tensor], torch.Tensor]] = []

    def exchange(self, outs: list[torch.Tensor], desc: torch.Tensor, _: float) -> ScriptedOp:
        op = ScriptedOp()
        self.issued.append(f"check {int(desc[1])}")
        self.exchanges.append((op, outs, desc))
        return op

    def start(self, name: str) -> Callable[[float], ScriptedOp]:
        def issue(_: float) -> ScriptedOp:
            self.issued.append(name)
            return ScriptedOp(done=True)

        return issue

    def agree(self, i: int) -> None:
        """Every rank sent the same descriptor: complete exchange ``i``."""
        op, outs, desc = self.exchanges[i]
        for out in outs:
            out.copy_(desc)
        op.finish()


def _chain(rec: _Recorder, broke: list[BaseException]) -> Chain:
    return Chain(rec.exchange, 0, 2, broke.append)


def test_an_op_given_up_after_its_check_breaks_the_chain() -> None:
    """Review finding: the peers issue the op in the slot its check opened;
    this rank skipping it and going on to the next check would put its ops
    out of step with theirs (Gloo matches by order)."""
    rec, broke = _Recorder(), []
    chain = _chain(rec, broke)
    deadline = time.monotonic() + 10
    first = chain.submit(VerifiedOp(describe("barrier", 1, []), rec.start("op 1"), deadline))
    second = chain.submit(VerifiedOp(describe("barrier", 2, []), rec.start("op 2"), deadline))
    first.abandon()
    rec.agree(0)
    assert rec.issued == ["check 1"]  # neither op 1 nor check 2
    assert first.poll()
    assert isinstance(first.outcome(), CommAborted)
    assert second.poll()
    assert isinstance(second.outcome(), CommAborted)
    assert len(broke) == 1
    assert isinstance(broke[0], CommAborted)


def test_an_op_given_up_while_queued_breaks_the_chain() -> None:
    rec, broke = _Recorder(), []
    chain = _chain(rec, broke)
    deadline = time.monotonic() + 10
    first = chain.submit(VerifiedOp(describe("barrier", 1, []), rec.start("op 1"), deadline))
    second = chain.submit(VerifiedOp(describe("barrier", 2, []), rec.start("op 2"), deadline))
    second.abandon()
    rec.agree(0)
    assert rec.issued == ["check 1", "op 1"]  # op 1 went; check 2 never
    assert first.poll()
    assert first.outcome() is None
    assert second.poll()
    assert isinstance(second.outcome(), CommAborted)
    assert broke


def test_checks_and_ops_alternate_and_a_mismatch_fails_the_rest() -> None:
    rec, broke = _Recorder(), []
    chain = _chain(rec, broke)
    deadline = time.monotonic() + 10
    vops = [
        chain.submit(VerifiedOp(describe("barrier", i, []), rec.start(f"op {i}"), deadline))
        for i in (1, 2, 3)
    ]
    rec.agree(0)
    assert rec.issued == ["check 1", "op 1", "check 2"]
    op, outs, desc = rec.exchanges[1]
    outs[0].copy_(desc)
    outs[1].copy_(describe("allreduce", 2, [torch.ones(2)]))  # the peer differs
    op.finish()
    assert rec.issued == ["check 1", "op 1", "check 2"]
    assert vops[0].outcome() is None
    assert isinstance(vops[1].outcome(), ftcomm.CommFailed)
    assert "rank 1 issued allreduce #2" in str(vops[1].outcome())
    assert vops[2].poll()
    assert vops[2].outcome() is vops[1].outcome()
    assert len(broke) == 1  # the group's table breaks at once


def test_a_verified_op_peeks_and_spins_as_its_op_does() -> None:
    """Review finding: a break must only peek (a subprocess call's poll
    reads its socket), and a subprocess op's awaiter must not spin."""

    class Quiet(ScriptedOp):
        spin = 0.0

        def poll(self) -> bool:
            raise AssertionError("a break polled the op")

        def peek(self) -> bool:
            return False

    rec, broke = _Recorder(), []
    chain = _chain(rec, broke)
    vop = chain.submit(
        VerifiedOp(describe("barrier", 1, []), lambda _: Quiet(), time.monotonic() + 10)
    )
    assert vop.peek() is False  # in its check
    rec.agree(0)
    assert vop.peek() is False
    assert vop.spin == 0.0


def test_every_tensor_of_a_coalesced_op_is_checked() -> None:
    """Review finding: only the first tensor's dtype and shape were kept, so
    [2, 4, 6] against [2, 6, 4] (or f32+f32 against f32+f64) passed the check
    and the ranks' native ops diverged."""

    def rows(*sizes: tuple[int, torch.dtype]) -> torch.Tensor:
        return describe("allreduce_coalesced", 1, [torch.ones(n, dtype=d) for n, d in sizes])

    f32, f64 = torch.float32, torch.float64
    a = rows((2, f32), (4, f32), (6, f32))
    b = rows((2, f32), (6, f32), (4, f32))
    c = rows((2, f32), (4, f32), (6, f64))
    assert mismatch(torch.stack([a, b]), 0) is not None
    assert mismatch(torch.stack([a, c]), 0) is not None
    assert mismatch(torch.stack([a, rows((2, f32), (4, f32), (6, f32))]), 1) is None
