"""The state copy (``ftcomm.sync_state``): its description as data, the
plan of chains, and worlds that copy in place, into new tensors, through
chains and spread over several sources; mismatches refused before a byte
moves; a sender killed mid-stream; an event loop that keeps running."""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

import ftcomm
from ftcomm._membership import _state_copy, _state_land, _state_wire
from ftcomm._membership._state_land import Mismatch
from ftcomm._membership._state_wire import TensorSpec
from ftcomm.testing import Fault, FaultPlan, RankContext, run_world

CPU = torch.device("cpu")


def _rich(seed: int = 0) -> dict[str, Any]:
    """A state with every kind of leaf and layout the copy handles."""
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(6, 4)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(4, 6, generator=g))
        lin.bias.copy_(torch.randn(4, generator=g))
    model = lin.state_dict()  # an OrderedDict with _metadata
    model["tied"] = model["weight"]  # the same view twice: sent once
    base = torch.randn(8, 10, generator=g)
    return {
        "model": model,
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 6, generator=g)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "foreach": None, "params": [0]}],
        },
        "layouts": {
            "transposed": base.t(),  # dense, not contiguous: sent as its storage lies
            "strided": base[:, ::2],  # not dense: sent row by row
            "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(
                memory_format=torch.channels_last
            ),
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(7, dtype=torch.int64),
            "half": torch.randn(5, generator=g).to(torch.bfloat16),
            "mask": torch.rand(9, generator=g) > 0.5,
            "complex": torch.randn(3, dtype=torch.complex64, generator=g),
            "conj": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
        },
        "plain": [None, True, 3, 2.5, float("nan"), float("-inf"), "text", b"\x00\xff"],
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


def _same(a: Any, b: Any) -> bool:
    """Bit for bit (NaN equal to NaN), and the same kinds of containers."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(_bits(a), _bits(b))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return bool(a == b)


# -- the description ----------------------------------------------------------------
def test_a_description_round_trips_as_json_and_builds_the_same_state() -> None:
    state = _rich()
    described = _state_wire.describe(state, CPU)
    data = described.encode()
    json.loads(data)  # JSON, nothing else
    tree, specs = _state_wire.parse(data)
    assert tree == json.loads(json.dumps(described.tree))
    assert specs == described.specs
    tied = [s for s in specs if s.same_as is not None]
    assert len(tied) == 1  # model["tied"] is model["weight"]
    by_place = dict(zip(_places(state), specs, strict=True))
    assert by_place["layouts/transposed"].stride == (1, 10)  # its own strides: no copy
    assert by_place["layouts/strided"].stride == (5, 1)  # row-major: it has gaps
    assert by_place["layouts/channels_last"].stride == state["layouts"]["channels_last"].stride()
    # What the receiver builds with the sender's tensors is the state itself.
    built = _state_land.build(tree, list(described.leaves))
    assert _same(built, state)
    assert built["model"]._metadata == state["model"]._metadata


def _places(state: Any, prefix: str = "") -> list[str]:
    """Each tensor's place, in the order the description numbers them."""
    if isinstance(state, torch.Tensor):
        return [prefix.strip("/")]
    if isinstance(state, dict):
        return [p for k, v in state.items() for p in _places(v, f"{prefix}/{k}")]
    if isinstance(state, list | tuple):
        return [p for i, v in enumerate(state) for p in _places(v, f"{prefix}/{i}")]
    return []


@pytest.mark.parametrize(
    ("state", "named"),
    [
        ({"w": np.zeros(3)}, r"state\['w'\]: a numpy.ndarray cannot be copied"),
        ({"a": [1, {2, 3}]}, r"state\['a'\]\[1\]: a set cannot be copied"),
        ({"s": torch.zeros(3).to_sparse()}, r"state\['s'\]: a torch.sparse_coo tensor"),
        ({"m": torch.empty(3, device="meta")}, r"state\['m'\]: a tensor on the meta device"),
        ({(1, 2): torch.ones(1)}, r"a key of type tuple"),
        ({"np": np.float64(1.0)}, "a numpy.float64 cannot be copied"),
        ({float("nan"): 1}, "a key that is NaN"),
    ],
)
def test_a_state_that_cannot_be_copied_is_named_where_it_is(state: Any, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _state_wire.describe(state, CPU)


def test_a_state_nested_too_deep_is_refused() -> None:
    state: Any = torch.ones(1)
    for _ in range(_state_wire.MAX_DEPTH + 2):
        state = [state]
    with pytest.raises(ValueError, match="nests deeper than"):
        _state_wire.describe(state, CPU)


def _good() -> dict[str, Any]:
    return json.loads(_state_wire.describe({"w": torch.ones(2, 3), "n": 1}, CPU).encode())


def _spec(**change: Any) -> dict[str, Any]:
    body = _good()
    body["tensors"][0].update(change)
    return body


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"\xff", "not JSON"),
        (b'{"version": 1, "tree": ["F", NaN], "tensors": []}', "holds NaN"),
        ({**_good(), "extra": 1}, "exactly the fields"),
        ({**_good(), "version": 2}, "version 2"),
        ({**_good(), "version": True}, "version True"),
        (_spec(dtype="float33"), "unknown dtype"),
        (_spec(dtype=None), "unknown dtype"),
        (_spec(shape=[2, True]), "not an int"),
        (_spec(stride=[1, 1]), "not a dense layout"),
        (_spec(stride=[3]), "not a dense layout"),
        (_spec(nbytes=23), "23 bytes for 6 values"),
        (_spec(same_as=0), "same_as is not an int in 0..-1"),
        (_spec(on_group=1), "on_group is not a bool"),
        (_spec(offset=-1), "offset is not an int"),
        (
            {**_good(), "tree": ["D", [[["S", "w"], ["T", 0]], [["S", "x"], ["T", 0]]]]},
            "named twice",
        ),
        ({**_good(), "tree": ["D", []]}, "do not agree"),
        ({**_good(), "tree": ["Z"]}, "unknown tag"),
        ({**_good(), "tree": ["D", [[["T", 0], ["T", 0]]]]}, "not a plain value"),
        (
            {**_good(), "tree": ["D", [[["S", "w"], ["T", 0]], [["S", "n"], ["I", 1.5]]]]},
            "not a plain",
        ),
        (
            {**_good(), "tree": ["D", [[["S", "w"], ["T", 0]], [["S", "n"], ["B", 1]]]]},
            "not a plain",
        ),
        (
            {**_good(), "tree": ["D", [[["S", "w"], ["T", 0]], [["S", "n"], ["Y", "zz"]]]]},
            "not a plain",
        ),
        ({**_good(), "tree": ["O", [[["S", "w"], ["T", 0]]], ["T", 0]]}, "named twice"),
        (
            {**_good(), "tree": ["D", [[["S", "w"], ["T", 0]], [["S", "w"], ["I", 1]]]]},
            "repeats a key",
        ),
        ({**_good(), "tree": ["D", [[["S", "w"], ["T", 0]], [["F", "nan"], ["I", 1]]]]}, "NaN"),
        (b'{"version": 1, "version": 1, "tree": ["N"], "tensors": []}', "repeats a field"),
        (b'{"version": 1, "tree": ["F", 1e400], "tensors": []}', "not a plain"),
    ],
)
def test_a_description_is_parsed_strictly(body: Any, says: str) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ValueError, match=says):
        _state_wire.parse(data)


def test_a_tensor_sent_once_for_two_places_must_be_the_same_tensor() -> None:
    w = torch.ones(2, 3)
    body = json.loads(_state_wire.describe({"a": w, "b": w}, CPU).encode())
    assert body["tensors"][1]["same_as"] == 0
    body["tensors"][1].update(shape=[3, 2], stride=[2, 1])
    with pytest.raises(ValueError, match="not the same as its same_as"):
        _state_wire.parse(json.dumps(body).encode())


def test_a_description_over_the_cap_is_refused_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_state_wire, "MAX_BYTES", 10)
    with pytest.raises(ValueError, match="over 10"):
        _state_wire.parse(b" " * 11)


# -- where the tensors land -----------------------------------------------------------
def _desc(state: Any) -> tuple[Any, list[TensorSpec]]:
    return _state_wire.parse(_state_wire.describe(state, CPU).encode())


def test_a_receiver_of_the_same_structure_gets_its_own_tensors_back() -> None:
    sent = {"w": torch.ones(2, 3), "opt": {"m": [torch.ones(2)], "lr": 0.1}}
    mine = {"w": torch.zeros(2, 3), "opt": {"m": [torch.zeros(2)], "lr": 0.5}}
    landing = _state_land.match(mine, *_desc(sent))
    assert landing.targets[0] is mine["w"]
    assert landing.targets[1] is mine["opt"]["m"][0]


def test_none_or_an_empty_container_gets_new_tensors_there() -> None:
    sent = {"model": {"w": torch.ones(2)}, "optim": {"state": {0: {"m": torch.ones(2)}}}}
    mine = {"model": {"w": torch.zeros(2)}, "optim": {"state": {}}}
    landing = _state_land.match(mine, *_desc(sent))
    assert landing.targets == [mine["model"]["w"], None]
    assert _state_land.match({}, *_desc(sent)).targets == [None, None]
    assert _state_land.match(None, *_desc(sent)).targets == [None, None]


@pytest.mark.parametrize(
    ("mine", "code", "where"),
    [
        ({"a": {"w": torch.zeros(2)}}, _state_land.KEYS, "state['a']"),  # "b" missing
        ({"a": {"w": torch.zeros(2), "b": 1, "c": 2}}, _state_land.KEYS, "state['a']"),
        ({"a": {"w": torch.zeros(3), "b": 1}}, _state_land.SHAPE, "state['a']['w']"),
        (
            {"a": {"w": torch.zeros(2, dtype=torch.int32), "b": 1}},
            _state_land.DTYPE,
            "state['a']['w']",
        ),
        ({"a": {"w": 0.0, "b": 1}}, _state_land.KIND, "state['a']['w']"),
        ({"a": {"w": torch.zeros(2), "b": torch.ones(1)}}, _state_land.KIND, "state['a']['b']"),
        ({"a": [torch.zeros(2)]}, _state_land.KEYS, "state['a']"),
    ],
)
def test_a_mismatch_is_located_by_a_node_every_rank_can_name(
    mine: Any, code: int, where: str
) -> None:
    sent = {"a": {"w": torch.ones(2), "b": 5}}
    tree, specs = _desc(sent)
    with pytest.raises(Mismatch) as caught:
        _state_land.match(mine, tree, specs)
    assert caught.value.code == code
    assert str(caught.value).startswith(where + ":")
    # the sender names the place from its own tree
    assert _state_land.path_of(_state_wire.describe(sent, CPU).tree, caught.value.index) == where


def test_a_tensor_that_cannot_be_written_in_place_is_a_mismatch() -> None:
    tree, specs = _desc({"w": torch.ones(3, 4)})
    with pytest.raises(Mismatch, match=r"state\['w'\]: its elements share memory") as caught:
        _state_land.match({"w": torch.zeros(4).expand(3, 4)}, tree, specs)
    assert caught.value.code == _state_land.WRITE
    with torch.inference_mode():
        frozen = torch.zeros(3, 4)
    with pytest.raises(Mismatch, match="an inference tensor cannot be written in place"):
        _state_land.match({"w": frozen}, tree, specs)


def test_the_plan_deals_the_members_behind_out_over_the_sources() -> None:
    assert _state_copy.plan([3, 3]) == []
    assert _state_copy.plan([5, 0]) == [[0, 1]]
    assert _state_copy.plan([0, 5]) == [[1, 0]]
    assert _state_copy.plan([5, 0, 0]) == [[0, 1, 2]]  # a chain: two behind, one source
    assert _state_copy.plan([5, 5, 0, 0]) == [[0, 2], [1, 3]]  # spread
    assert _state_copy.plan([5, 0, 5, 0, 0]) == [[0, 1, 4], [2, 3]]
    assert _state_copy.plan([5, 5, 5, 1]) == [[0, 3]]


# -- worlds ----------------------------------------------------------------------------
async def _copy(ctx: RankContext, steps: list[int], states: list[Any]) -> Any:
    async with ftcomm.Group("gloo", timeout=30) as group:
        await group.configure(ctx.addr(), ctx.rank, ctx.world_size)
        mine = states[ctx.rank]
        before = {id(t): t for t in _tensors(mine)}
        state, step = await ftcomm.sync_state(group, mine, steps[ctx.rank], timeout=30)
        kept = [id(t) in before for t in _tensors(state)]
        # nothing is left on the wire: the group goes on
        total = await group.allreduce(torch.ones(1))
        return state, step, kept, total.item()


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    return []


def _zeroed(state: Any) -> Any:
    """The same structure and layouts, every tensor zero (a replica built
    before it joins), plain values changed."""
    if isinstance(state, torch.Tensor):
        z = torch.empty_strided(state.shape, state.stride(), dtype=state.dtype)
        z.zero_()
        return z
    if isinstance(state, OrderedDict):
        return OrderedDict((k, _zeroed(v)) for k, v in state.items())
    if isinstance(state, dict):
        return {k: _zeroed(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_zeroed(v) for v in state)
    return "changed" if isinstance(state, str) else state


def test_a_copy_lands_in_place_into_the_receivers_own_tensors() -> None:
    sent = _rich()
    mine = _zeroed(_rich())
    results = run_world(_copy, 2, args=([9, 4], [sent, mine]), mode="thread", timeout=60)
    (s0, step0, kept0, t0), (s1, step1, kept1, t1) = results
    assert (step0, step1, t0, t1) == (9, 9, 2.0, 2.0)
    assert s0 is sent
    assert all(kept0)
    assert _same(s1, sent)
    assert all(kept1)  # every tensor returned is the receiver's own object
    assert s1["model"]["weight"] is mine["model"]["weight"]
    assert s1["layouts"]["transposed"].stride() == (1, 10)


def test_a_receiver_holding_nothing_gets_new_tensors_with_the_senders_layout() -> None:
    sent = _rich()
    results = run_world(_copy, 2, args=([9, 4], [sent, {}]), mode="thread", timeout=60)
    state, step, kept, _ = results[1]
    assert step == 9
    assert not any(kept)
    assert _same(state, sent)
    assert state["layouts"]["channels_last"].is_contiguous(memory_format=torch.channels_last)
    assert state["model"]["tied"] is state["model"]["weight"]  # tied stays tied


def test_a_model_state_dict_passed_in_updates_the_model() -> None:
    async def rank(ctx: RankContext) -> list[float]:
        torch.manual_seed(ctx.rank)
        model = torch.nn.Linear(3, 2)
        async with ftcomm.Group("gloo", timeout=30) as group:
            await group.configure(ctx.addr(), ctx.rank, 2)
            await ftcomm.sync_state(group, model.state_dict(), 1 - ctx.rank)
        assert isinstance(model.weight, torch.nn.Parameter)
        assert model.weight.requires_grad
        return model.weight.detach().reshape(-1).tolist()

    w0, w1 = run_world(rank, 2, mode="thread", timeout=30)
    assert w0 == w1


def test_two_behind_one_source_and_spread_over_two_sources_get_the_same_state() -> None:
    sent = _rich()
    states = [sent, _zeroed(_rich()), {}]
    results = run_world(_copy, 3, args=([9, 4, 0], states), mode="thread", timeout=60)
    assert all(_same(r[0], sent) and r[1] == 9 for r in results)
    states = [_rich(), _zeroed(_rich()), _rich(), {}]
    results = run_world(_copy, 4, args=([9, 2, 9, 0], states), mode="thread", timeout=60)
    assert all(_same(r[0], sent) and r[1] == 9 for r in results)


async def _refused(ctx: RankContext, steps: list[int], states: list[Any]) -> Any:
    async with ftcomm.Group("gloo", timeout=30) as group:
        await group.configure(ctx.addr(), ctx.rank, ctx.world_size)
        mine = states[ctx.rank]
        with pytest.raises(ValueError, match="copied") as caught:
            await ftcomm.sync_state(group, mine, steps[ctx.rank], timeout=30)
        untouched = [t.tolist() for t in _tensors(mine)]
        total = await group.allreduce(torch.ones(1))  # nothing left on the wire
        return str(caught.value), untouched, total.item()


def test_a_mismatch_is_a_value_error_on_every_rank_before_a_byte_moves() -> None:
    sent = {"w": torch.ones(4), "b": torch.ones(2)}
    states = [
        sent,
        {"w": torch.zeros(4), "b": torch.zeros(2)},
        {"w": torch.zeros(5), "b": torch.zeros(2)},
    ]
    results = run_world(_refused, 3, args=([7, 0, 0], states), mode="thread", timeout=60)
    assert (
        "this rank's state does not match the one rank 0 sent, at state['w']: shape (5,)"
        in results[2][0]
    )
    for message, _, _ in results[:2]:
        assert "rank 2 cannot take the state sent (a shape differs at state['w']" in message
    assert results[1][1] == [[0.0] * 4, [0.0] * 2]  # the chain's first member: untouched too
    assert results[2][1] == [[0.0] * 5, [0.0] * 2]
    assert [r[2] for r in results] == [3.0] * 3


def test_a_mismatch_is_named_by_the_members_of_its_chain_from_the_tree_sent() -> None:
    """Rank 1 holds nothing (it names the place from the tree it was sent);
    rank 2 holds a tensor that cannot be written."""
    sent = {"w": torch.ones(4)}
    states = [sent, {}, {"w": torch.zeros(1).expand(4)}]
    results = run_world(_refused, 3, args=([7, 0, 0], states), mode="thread", timeout=60)
    assert "this rank's state does not match the one rank 0 sent, at state['w']" in results[2][0]
    for message, _, _ in results[:2]:
        assert "rank 2 cannot take the state sent (a tensor of its own cannot be written" in message
        assert "at state['w']" in message
    assert [r[2] for r in results] == [3.0] * 3


def test_only_the_members_of_its_chain_name_the_place_of_a_mismatch() -> None:
    """Two chains, 0 -> 1 and 2 -> 3: rank 3's mismatch is an index into
    the tree rank 2 sent; rank 1 was sent rank 0's, so it names no place."""
    sent = {"w": torch.ones(4)}
    states = [sent, {}, {"w": torch.ones(4)}, {"w": torch.zeros(5)}]
    results = run_world(_refused, 4, args=([7, 0, 7, 0], states), mode="thread", timeout=60)
    for rank in (0, 2):
        assert "rank 3 cannot take the state sent (a shape differs" in results[rank][0]
    assert "differs at state['w']" in results[2][0]
    assert "differs at" not in results[0][0]
    assert "differs at" not in results[1][0]
    assert [r[1] for r in results[:2]] == [[[1.0] * 4], []]  # nothing was written


def test_a_tensor_whose_storage_was_freed_is_refused_where_it_is_held() -> None:
    freed = torch.zeros(4)
    freed.untyped_storage().resize_(0)  # as FSDP2 frees an unsharded parameter
    with pytest.raises(ValueError, match=r"state\['p'\]: a tensor whose storage does not hold"):
        _state_wire.describe({"p": freed}, CPU)


class _HeldGroup:
    """What the stream needs of a group: ops that end when the test says."""

    def __init__(self) -> None:
        self.ops: list[asyncio.Future[None]] = []

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> Any:
        self.ops.append(asyncio.get_running_loop().create_future())
        return self.ops[-1]

    recv = send

    def abort(self) -> None:
        for op in self.ops:
            if not op.done():
                op.set_exception(ftcomm.CommAborted("aborted"))


@pytest.mark.asyncio
@pytest.mark.parametrize("window", [2, 16])
async def test_the_stream_keeps_at_most_its_window_of_ops_in_flight(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_state_copy, "CHUNK", 1 << 10)
    described = _state_wire.describe({"w": torch.ones(64, 64)}, CPU)  # 16 chunks
    group = _HeldGroup()
    deadline = time.monotonic() + 30
    sender = _state_copy._Sender(described, CPU, deadline)
    stream = asyncio.ensure_future(
        _state_copy._stream(group, described.specs, sender, None, 1, window, deadline)  # type: ignore[arg-type]
    )
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(group.ops) == window  # issued up to the window, then waits for the oldest
    while not stream.done():
        for op in group.ops:
            if not op.done():
                op.set_result(None)
        await asyncio.sleep(0)
        assert sum(not op.done() for op in group.ops) <= window
    await stream
    assert len(group.ops) == 16


def test_an_unexpected_error_describing_or_matching_is_told_to_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never one rank raising while the others wait for the deadline: an
    error of torch's (or ftcomm's) own on one rank fails the copy on all."""
    describe, match = _state_wire.describe, _state_land.match

    def odd_describe(state: Any, device: torch.device) -> Any:
        if isinstance(state, dict) and "odd" in state:
            raise RuntimeError("torch says no")
        return describe(state, device)

    def odd_match(template: Any, tree: Any, specs: Any) -> Any:
        if isinstance(template, dict) and "odd" in template:
            raise RuntimeError("a bug here")
        return match(template, tree, specs)

    monkeypatch.setattr(_state_wire, "describe", odd_describe)
    monkeypatch.setattr(_state_land, "match", odd_match)
    states = [{"w": torch.ones(2)}, {"w": torch.zeros(2), "odd": 1}]
    started = time.monotonic()
    results = run_world(_refused, 2, args=([3, 0], states), mode="thread", timeout=60)
    assert "the state cannot be copied: torch says no" in results[1][0]
    assert "the state of rank 1 cannot be copied" in results[0][0]
    monkeypatch.setattr(_state_wire, "describe", describe)
    results = run_world(_refused, 2, args=([3, 0], states), mode="thread", timeout=60)
    assert "this rank could not take the state rank 0 sent: a bug here" in results[1][0]
    assert "rank 1 cannot take the state sent (an error of its own" in results[0][0]
    assert time.monotonic() - started < 25  # never a deadline of 30 s


def test_a_state_that_cannot_be_copied_fails_on_its_holder_even_with_nobody_behind() -> None:
    states = [{"w": torch.ones(2)}, {"w": torch.ones(2), "np": np.ones(2)}]
    results = run_world(_refused, 2, args=([3, 3], states), mode="thread", timeout=30)
    assert "state['np']: a numpy.ndarray cannot be copied" in results[1][0]
    assert "the state of rank 1 cannot be copied" in results[0][0]


async def _cancelled_while_staging(ctx: RankContext, entered: threading.Event) -> Any:
    async with ftcomm.Group("gloo", timeout=30) as group:
        await group.configure(ctx.addr(), ctx.rank, 2)
        if ctx.rank == 0:
            state = {"w": torch.ones(4, 6)[:, ::2]}  # not dense: staged before it is sent
            task = asyncio.ensure_future(ftcomm.sync_state(group, state, 5))
            assert await asyncio.to_thread(entered.wait, 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            errored = type(group.errored()).__name__
            await ctx.wait_for("ended")  # the group stays: only an abort ends the peer's recv
            return errored
        started = time.monotonic()
        with pytest.raises(ftcomm.CommError):
            await ftcomm.sync_state(group, {}, 0)
        ctx.signal("ended")
        return time.monotonic() - started


def test_a_sender_cancelled_before_its_first_op_aborts_so_no_peer_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered = threading.Event()

    async def stuck(dst: torch.Tensor, src: torch.Tensor, deadline: float) -> None:
        entered.set()  # the sender is staging its first chunk: no op in flight yet
        await asyncio.Event().wait()

    monkeypatch.setattr(_state_copy, "copy", stuck)
    sender, took = run_world(
        _cancelled_while_staging, 2, args=(entered,), mode="thread", timeout=60
    )
    assert sender == "CommAborted"
    assert took < 10  # the group's abort, not its 30 s deadline


async def _graph_saw(ctx: RankContext) -> Any:
    async with ftcomm.Group("gloo", timeout=30) as group:
        await group.configure(ctx.addr(), ctx.rank, 2)
        if ctx.rank == 0:
            await ftcomm.sync_state(group, {"w": torch.ones(3)}, 5)
            return None
        w = torch.zeros(3, requires_grad=True)
        y = (w * w).sum()  # saves w for its backward
        await ftcomm.sync_state(group, {"w": w}, 0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
        return w.detach().tolist()


def test_a_graph_that_saved_a_tensor_written_in_place_knows_it_changed() -> None:
    assert run_world(_graph_saw, 2, mode="thread", timeout=30)[1] == [1.0, 1.0, 1.0]


async def _over_a_worker(ctx: RankContext) -> Any:
    async with ftcomm.Group("gloo", timeout=30, subprocess=True) as group:
        await group.configure(ctx.addr(), ctx.rank, 2)
        state = _trained(0) if ctx.rank == 0 else {}
        state, step = await ftcomm.sync_state(group, state, 5 - 5 * ctx.rank)
        return step, [t.tolist() for t in state.values()]


def test_a_group_whose_ops_copy_their_bytes_keeps_two_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """subprocess=True: each op's bytes sit in shared memory while it is in
    flight, so the stream keeps two at a time (64 MiB), not 16."""
    windows: list[int] = []
    stream = _state_copy._stream

    async def spy(*args: Any) -> None:
        windows.append(args[5])
        await stream(*args)

    monkeypatch.setattr(_state_copy, "_stream", spy)
    results = run_world(_over_a_worker, 2, mode="thread", timeout=60)
    assert windows == [2, 2]
    assert results[0] == results[1] == (5, [t.tolist() for t in _trained(0).values()])


# -- a sender killed mid-stream -------------------------------------------------------
TENSORS = 12


def _trained(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(1 << 16, generator=g) for i in range(TENSORS)}


async def _sender_dies(ctx: RankContext) -> Any:
    """Ranks 0 and 1 trained to step 5, rank 2 is new; rank 0 sends and is
    killed mid-stream. The survivors form a world of two (as ``recover()``
    would) and copy again: rank 1 completes rank 2's state."""
    fresh = ctx.rank == 2
    state = {k: torch.zeros(1 << 16) for k in _trained(0)} if fresh else _trained(0)
    step = 0 if fresh else 5
    async with ftcomm.Group("gloo", timeout=10) as group:
        await group.configure(ctx.addr("first"), ctx.rank, 3)
        try:
            state, step = await ftcomm.sync_state(group, state, step)
            await group.allreduce(torch.ones(1))  # rank 1 finds rank 0 dead here
        except ftcomm.CommError:
            pass
        else:
            raise AssertionError("the copy went on without its sender")
        await group.configure(ctx.addr("second"), ctx.rank - 1, 2)
        state, step = await ftcomm.sync_state(group, state, step)
        return step, [t.tolist() for t in state.values()]


@pytest.mark.parametrize("seed", [1, 2])
def test_a_sender_killed_at_a_random_tensor_is_completed_from_another_member(seed: int) -> None:
    # rank 0's ops: allgather (0), the description (1), the verdicts (2), then
    # one send per tensor: it dies just before one of them.
    at = 3 + random.Random(seed).randrange(TENSORS)
    results = run_world(_sender_dies, 3, plan=FaultPlan.of(Fault.kill(0, at)), timeout=90)
    assert results[0] is None
    (step1, kept), (step2, got) = results[1], results[2]
    assert step1 == step2 == 5
    assert got == kept == [t.tolist() for t in _trained(0).values()]


# -- the event loop keeps running -------------------------------------------------------
BIG = 1 << 27  # floats: 512 MiB


async def _lagged(ctx: RankContext) -> dict[str, float]:
    torch.set_num_threads(1)  # a copy on the loop's thread shows as that thread's CPU time
    # The receiver's tensor is laid out otherwise: it lands through a staging
    # tensor and a copy, which must not run on the event loop.
    if ctx.rank == 0:
        state = {"big": torch.ones(2, BIG // 2)}
    else:
        state = {"big": torch.zeros(BIG // 2, 2).t()}
    async with ftcomm.Group("gloo", timeout=60) as group:
        await group.configure(ctx.addr(), ctx.rank, 2)
        gaps: list[tuple[float, float]] = []
        done = asyncio.Event()

        async def tick() -> None:
            wall, cpu = time.monotonic(), time.thread_time()
            while not done.is_set():
                await asyncio.sleep(0.002)
                now, now_cpu = time.monotonic(), time.thread_time()
                gaps.append((now - wall, now_cpu - cpu))
                wall, cpu = now, now_cpu

        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        state, _ = await ftcomm.sync_state(group, state, 1 - ctx.rank)
        took = time.monotonic() - started
        done.set()
        await ticker
        ok = await asyncio.to_thread(lambda: bool(state["big"].eq(1).all()))
    return {
        "took": took,
        "max_gap": max(g for g, _ in gaps),
        "max_cpu": max(c for _, c in gaps),
        "ok": ok,
        "threads": threading.active_count(),
    }


@pytest.mark.slow
def test_the_event_loop_keeps_running_through_a_big_copy() -> None:
    for rank, r in enumerate(run_world(_lagged, 2, timeout=120)):
        assert r["ok"]
        # The loop's own thread never runs a long stretch between two ticks
        # (CPU time: what a busy machine's scheduling does not inflate); a
        # staging copy of the 512 MiB on the loop would take ~0.2 s of it.
        assert r["max_cpu"] < 0.05, (rank, r)
        print(f"rank {rank}: copy {r['took']:.2f} s, loop lag max {r['max_gap'] * 1e3:.0f} ms")
