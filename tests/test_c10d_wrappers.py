"""The c10d wrappers: error swallowing, error injection and the managed group.

Every collective of each wrapper on the dummy group (one rank, no network),
then every collective again on one in-process one-rank Gloo group per test;
send, recv and errors from a real deadline (a peer that never joins the op)
in one two-rank Gloo world of threads. Errors come from a refused op
(``inner.abort()``), from an injected one (``FakeProcessGroupWrapper``) or
from a deadline.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, TCPStore

import ftcomm
from ftcomm._runtime.loop import get_runtime
from ftcomm.c10d import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    Manager,
    ProcessGroup,
    ProcessGroupDummy,
    ProcessGroupGloo,
)
from ftcomm.c10d._work import DoneWork
from ftcomm.testing import RankContext, run_world

SENTINEL = -7.0  # what an output holds until an op writes it
IN = (1.0, 2.0)  # every input's value


def _in() -> torch.Tensor:
    return torch.tensor(IN)


def _out() -> torch.Tensor:
    return torch.full((2,), SENTINEL)


# -- one call of each collective ---------------------------------------------


@dataclass
class Call:
    """One collective's arguments on a one-rank group, ready to issue on ``pg``."""

    issue: Callable[[], dist.Work]
    default: Any  # what the wrappers' skipped or swallowed op hands back
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]  # what a real one-rank op sets to the input

    def untouched(self) -> bool:
        """No tensor was written: inputs as they were, outputs still the sentinel."""
        return all(t.tolist() == list(IN) for t in self.inputs) and all(
            o.tolist() == [SENTINEL] * 2 for o in self.outputs
        )

    def ran(self) -> bool:
        """The op ran on a one-rank group: every output holds the input."""
        return all(t.tolist() == list(IN) for t in self.inputs + self.outputs)


def _allreduce(pg: ProcessGroup, timeout: timedelta | None = None) -> Call:
    ts = [_in()]
    opts = dist.AllreduceOptions()
    if timeout is not None:
        opts.timeout = timeout
    return Call(lambda: pg.allreduce(ts, opts), ts, ts, [])


def _allreduce_coalesced(pg: ProcessGroup) -> Call:
    ts = [_in(), _in()]
    opts = dist.AllreduceCoalescedOptions()
    return Call(lambda: pg.allreduce_coalesced(ts, opts), ts, ts, [])


def _allgather(pg: ProcessGroup, timeout: timedelta | None = None, world_size: int = 1) -> Call:
    outs, ins = [[_out() for _ in range(world_size)]], [_in()]
    opts = AllgatherOptions()
    if timeout is not None:
        opts.timeout = timeout
    return Call(lambda: pg.allgather(outs, ins, opts), outs, ins, outs[0])


def _allgather_into_tensor_coalesced(pg: ProcessGroup) -> Call:
    outs, ins = [_out()], [_in()]
    opts = AllgatherOptions()
    return Call(lambda: pg.allgather_into_tensor_coalesced(outs, ins, opts), outs, ins, outs)


def _allgather_base(pg: ProcessGroup) -> Call:
    out, inp = _out(), _in()
    return Call(lambda: pg._allgather_base(out, inp, AllgatherOptions()), [out], [inp], [out])


def _broadcast(pg: ProcessGroup) -> Call:
    ts = [_in()]
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return Call(lambda: pg.broadcast(ts, opts), ts, ts, [])


def _reduce_scatter(pg: ProcessGroup) -> Call:
    outs, ins = [_out()], [[_in()]]
    opts = dist.ReduceScatterOptions()
    return Call(lambda: pg.reduce_scatter(outs, ins, opts), outs, ins[0], outs)


def _reduce_scatter_tensor_coalesced(pg: ProcessGroup) -> Call:
    outs, ins = [_out()], [_in()]
    opts = dist.ReduceScatterOptions()
    return Call(lambda: pg.reduce_scatter_tensor_coalesced(outs, ins, opts), outs, ins, outs)


def _reduce_scatter_base(pg: ProcessGroup) -> Call:
    out, inp = _out(), _in()
    opts = dist.ReduceScatterOptions()
    return Call(lambda: pg._reduce_scatter_base(out, inp, opts), [out], [inp], [out])


def _alltoall_base(pg: ProcessGroup) -> Call:
    out, inp = _out(), _in()
    opts = dist.AllToAllOptions()
    return Call(lambda: pg.alltoall_base(out, inp, [], [], opts), [out], [inp], [out])


def _barrier(pg: ProcessGroup) -> Call:
    return Call(lambda: pg.barrier(dist.BarrierOptions()), None, [], [])


OPS: dict[str, Callable[[ProcessGroup], Call]] = {
    "allreduce": _allreduce,
    "allreduce_coalesced": _allreduce_coalesced,
    "allgather": _allgather,
    "allgather_into_tensor_coalesced": _allgather_into_tensor_coalesced,
    "_allgather_base": _allgather_base,
    "broadcast": _broadcast,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor_coalesced": _reduce_scatter_tensor_coalesced,
    "_reduce_scatter_base": _reduce_scatter_base,
    "alltoall_base": _alltoall_base,
    "barrier": _barrier,
}
"""Every collective a one-rank group can run (send and recv: the world below)."""


def assert_default(value: Any, default: Any) -> None:
    """``value`` is ``default``: the same structure holding the same tensors."""
    if default is None:
        assert value is None
        return
    assert isinstance(value, list), value
    assert len(value) == len(default)
    for v, d in zip(value, default, strict=True):
        if isinstance(d, list):
            assert_default(v, d)
        else:
            assert v is d


# -- inner groups ------------------------------------------------------------
# Each store connection may cost a reverse-DNS lookup in c10d (seconds where
# DNS is slow), so the per-op tests run on the dummy group, and each Gloo test
# shares one group across every op, reconfiguring it only where it must.

UNUSED = "127.0.0.1:1/unused"  # what the dummy's configure is given (and ignores)


@pytest.fixture
def dummy() -> Iterator[ProcessGroupDummy]:
    pg = ProcessGroupDummy()
    try:
        yield pg
    finally:
        pg.shutdown()


@dataclass
class Gloo:
    """A configured one-rank Gloo group, and fresh addresses on its store."""

    pg: ProcessGroupGloo
    port: int

    def addr(self) -> str:
        return f"127.0.0.1:{self.port}/{uuid.uuid4().hex}"


@pytest.fixture
def gloo() -> Iterator[Gloo]:
    holder = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)]
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    try:
        g = Gloo(pg, holder[0].port)
        pg.configure(g.addr(), "0", 0, 1)
        yield g
    finally:
        pg.shutdown()
        holder.clear()


def names(error: BaseException | None, expected: BaseException) -> bool:
    """``error`` is ``expected``, or the ``RuntimeError`` that a torch future
    makes of it, which carries its type name and message (futures hold C++
    errors: see ``ftcomm.c10d._work.new_future``)."""
    if error is expected:
        return True
    return isinstance(error, RuntimeError) and f"{type(expected).__name__}: {expected}" in str(
        error
    )


def names_a(error: BaseException | None, kind: type[BaseException]) -> bool:
    """``error`` is a ``kind``, or a torch future's ``RuntimeError`` that names one."""
    return isinstance(error, kind) or (
        isinstance(error, RuntimeError) and f"{kind.__name__}: " in str(error)
    )


op_names = pytest.mark.parametrize("op", list(OPS))


# -- ErrorSwallowingProcessGroupWrapper --------------------------------------


@op_names
def test_swallowing_passes_successes_through(op: str, dummy: ProcessGroupDummy) -> None:
    sw = ErrorSwallowingProcessGroupWrapper(dummy)
    call = OPS[op](sw)
    work = call.issue()
    assert work.wait() is True
    assert call.ran()
    work.get_future().wait()
    assert sw.error() is None


@op_names
def test_swallowing_swallows_an_op_refused_at_issue(op: str, dummy: ProcessGroupDummy) -> None:
    sw = ErrorSwallowingProcessGroupWrapper(dummy)
    dummy.abort(errored=False)
    call = OPS[op](sw)
    work = call.issue()  # refused with CommAborted: not raised
    assert work.is_completed()
    assert work.wait() is True
    assert_default(work.get_future().wait(), call.default)
    assert call.untouched()
    error = sw.error()
    assert isinstance(error, ftcomm.CommAborted)

    later = OPS[op](sw)
    assert later.issue().wait() is True
    assert later.untouched()
    assert sw.error() is error

    sw.configure(UNUSED, "0", 0, 1)  # clears the error and the abort
    assert sw.error() is None
    again = OPS[op](sw)
    assert again.issue().wait() is True
    assert again.ran()
    assert sw.error() is None


@op_names
@pytest.mark.parametrize("via", ["wait", "future"])
def test_swallowing_swallows_an_error_at_wait(op: str, via: str, dummy: ProcessGroupDummy) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    sw = ErrorSwallowingProcessGroupWrapper(fake)
    injected = RuntimeError(f"{op} failed")
    fake.report_future_error(injected)
    call = OPS[op](sw)
    work = call.issue()
    if via == "wait":
        assert work.wait() is True
        assert sw.error() is injected
        assert_default(work.get_future().wait(), call.default)
    else:
        assert_default(work.get_future().wait(), call.default)
        assert sw.error() is injected
        assert work.wait() is True
    first = sw.error()
    assert first is injected

    skipped = OPS[op](sw)  # the inner group is healthy, yet nothing runs
    work = skipped.issue()
    assert work.is_completed()
    assert work.wait() is True
    assert_default(work.get_future().wait(), skipped.default)
    assert skipped.untouched()
    assert sw.error() is first

    sw.configure(UNUSED, "0", 0, 1)
    assert sw.error() is None
    again = OPS[op](sw)
    assert again.issue().wait() is True
    assert again.ran()


def test_swallowing_keeps_the_first_error(dummy: ProcessGroupDummy) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    sw = ErrorSwallowingProcessGroupWrapper(fake)
    first, second = RuntimeError("first"), RuntimeError("second")
    fake.report_future_error(first)
    w1 = _allreduce(sw).issue()
    fake.report_future_error(second)
    w2 = _allgather(sw).issue()  # issued before the first error is seen
    assert w1.wait() is True
    assert w2.wait() is True
    assert sw.error() is first
    sw.report_error(RuntimeError("third"))
    assert sw.error() is first

    for make in OPS.values():  # every op is skipped until configure
        call = make(sw)
        work = call.issue()
        assert work.is_completed()
        assert work.wait() is True
        assert call.untouched()
    assert sw.error() is first

    sw.configure(UNUSED, "0", 0, 1)
    assert sw.error() is None
    sw.report_error(second)
    assert sw.error() is second


def test_swallowing_swallows_a_refusal_of_an_unconfigured_group() -> None:
    gloo = ProcessGroupGloo(timeout=timedelta(seconds=30))  # never configured
    sw = ErrorSwallowingProcessGroupWrapper(gloo)
    try:
        call = _allgather(sw)
        assert call.issue().wait() is True
        assert call.untouched()
        assert isinstance(sw.error(), ftcomm.NotConfigured)
    finally:
        sw.shutdown()


def test_swallowing_logs_what_it_swallows(
    dummy: ProcessGroupDummy, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    sw = ErrorSwallowingProcessGroupWrapper(fake)
    fake.report_future_error(RuntimeError("the peer went away"))
    with caplog.at_level(logging.WARNING, logger="ftcomm.c10d"):
        assert _allreduce(sw).issue().wait() is True
        # Logged from the owner loop (the swallowing thread may be Gloo's
        # own): once the loop has run what was queued before, it is there.
        get_runtime().call(asyncio.sleep(0))
    assert [r.getMessage() for r in caplog.records] == [
        "swallowed a collective's error: the peer went away"
    ]


def _swallowed_op(via: str) -> weakref.ref[dist.Work]:
    """A swallowed op's work, once the caller has dropped it and the wrapper
    has forgotten its error."""
    dummy = ProcessGroupDummy()
    try:
        fake = FakeProcessGroupWrapper(dummy)
        sw = ErrorSwallowingProcessGroupWrapper(fake)
        fake.report_future_error(RuntimeError("injected"))
        work = _allreduce(sw).issue()
        if via == "wait":
            assert work.wait() is True
        else:
            assert work.get_future().wait() is not None
        assert sw.error() is not None
        sw.configure(UNUSED, "0", 0, 1)  # forgets the error
        return weakref.ref(work)
    finally:
        dummy.shutdown()


@pytest.fixture
def no_captured_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """The swallowed error's log record (and so the error) is not kept by pytest."""
    caplog.set_level(logging.ERROR, logger="ftcomm.c10d")


@pytest.mark.usefixtures("no_captured_warnings")
def test_a_swallowed_error_at_wait_lets_its_op_go() -> None:
    ref = _swallowed_op("wait")
    gc.collect()
    assert ref() is None


@pytest.mark.usefixtures("no_captured_warnings")
def test_a_swallowed_error_through_the_future_lets_its_op_go() -> None:
    # An error that a torch future holds as a Python object, raised in the
    # callback that swallows it, made an uncollectable cycle through the
    # future and kept the op (and a Gloo group's fds) alive for good.
    ref = _swallowed_op("future")
    gc.collect()
    assert ref() is None


class PeerLost(Exception):
    """An error of a type that whoever reads ``error()`` may act on."""


@pytest.mark.parametrize("wrapper", ["swallowing", "managed"])
def test_the_error_reported_through_the_future_is_the_ops_own(
    wrapper: str, dummy: ProcessGroupDummy, manager: FakeManager
) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    sw = ErrorSwallowingProcessGroupWrapper(fake)
    managed = ManagedProcessGroup(manager, pg=fake)
    injected = PeerLost("rank 3 is gone")
    fake.report_future_error(injected)
    call = _allgather(sw if wrapper == "swallowing" else managed)
    assert_default(call.issue().get_future().wait(), call.default)
    reported = sw.error() if wrapper == "swallowing" else manager.errors[0]
    assert reported is injected, reported


BAD_ARGS: dict[str, tuple[type[Exception], str, Callable[[ProcessGroup], object]]] = {
    "two_tensors": (
        ValueError,
        "exactly one entry",
        lambda pg: pg.allreduce([_in(), _in()]),
    ),
    "not_a_list": (
        TypeError,
        "must be a list",
        lambda pg: pg.allreduce_coalesced(_in()),
    ),
    "bad_opts": (
        TypeError,
        "opts must be c10d reduce options",
        lambda pg: pg.allreduce([_in()], "sum"),
    ),
    "bad_shape": (
        ValueError,
        "must have the shape",
        lambda pg: pg.allgather([[torch.zeros(3)]], [_in()]),
    ),
    "send_to_self": (
        ValueError,
        "dst must be another rank",
        lambda pg: pg.send([_in()], 0, 0),
    ),
    "recv_from_self": (
        ValueError,
        "src must be another rank",
        lambda pg: pg.recv([_in()], 0, 0),
    ),
    "send_out_of_range": (
        ValueError,
        "dst must be < world_size",
        lambda pg: pg.send([_in()], 1, 0),
    ),
}
"""Arguments every group rejects (a one-rank group cannot send to itself)."""


@pytest.mark.parametrize("bad", list(BAD_ARGS))
@pytest.mark.parametrize("aborted", [False, True], ids=["healthy", "aborted"])
def test_swallowing_raises_bad_arguments(bad: str, aborted: bool, dummy: ProcessGroupDummy) -> None:
    sw = ErrorSwallowingProcessGroupWrapper(dummy)
    if aborted:
        dummy.abort(errored=False)
    kind, match, issue = BAD_ARGS[bad]
    with pytest.raises(kind, match=match):
        issue(sw)
    assert sw.error() is None  # raised, not recorded


def test_swallowing_over_gloo(gloo: Gloo) -> None:
    """Every path of every op on one real (one-rank) Gloo group."""
    fake = FakeProcessGroupWrapper(gloo.pg)
    errors: list[BaseException | None] = []
    for op, make in OPS.items():
        call = make(ErrorSwallowingProcessGroupWrapper(fake))
        assert call.issue().wait() is True, op
        assert call.ran(), op
        for via in ("wait", "future"):
            sw = ErrorSwallowingProcessGroupWrapper(fake)  # no error recorded yet
            injected = RuntimeError(f"{op} failed at {via}")
            errors.append(injected)
            fake.report_future_error(injected)
            call = make(sw)
            work = call.issue()
            if via == "wait":
                assert work.wait() is True, op
                assert sw.error() is injected, op
            else:
                assert_default(work.get_future().wait(), call.default)
                assert sw.error() is injected, op
                errors.append(sw.error())
            skipped = make(sw)
            work = skipped.issue()
            assert work.is_completed(), op
            assert work.wait() is True, op
            assert skipped.untouched(), op

    for aborted in (False, True):
        if aborted:
            gloo.pg.abort(errored=False)
        for bad, (kind, match, issue) in BAD_ARGS.items():
            sw = ErrorSwallowingProcessGroupWrapper(fake)
            with pytest.raises(kind, match=match):
                issue(sw)
            assert sw.error() is None, bad

    for op, make in OPS.items():  # the group is aborted: every op is refused
        sw = ErrorSwallowingProcessGroupWrapper(fake)
        call = make(sw)
        work = call.issue()
        assert work.is_completed(), op
        assert work.wait() is True, op
        assert_default(work.get_future().wait(), call.default)
        assert call.untouched(), op
        assert isinstance(sw.error(), ftcomm.CommAborted), op
        errors.append(sw.error())

    sw.configure(gloo.addr(), "0", 0, 1)  # through fake, to the Gloo group
    assert sw.error() is None
    assert gloo.pg.errored() is None
    for op, make in OPS.items():
        call = make(sw)
        assert call.issue().wait() is True, op
        assert call.ran(), op
    assert sw.error() is None


@pytest.mark.parametrize("wrapper", [ErrorSwallowingProcessGroupWrapper, FakeProcessGroupWrapper])
@pytest.mark.parametrize("pg", [None, object(), "gloo"], ids=["none", "object", "str"])
def test_wrappers_reject_a_group_that_is_not_ftcomm(wrapper: type, pg: object) -> None:
    with pytest.raises(TypeError, match=r"ftcomm\.c10d ProcessGroup"):
        wrapper(pg)


@pytest.mark.parametrize("wrapper", [ErrorSwallowingProcessGroupWrapper, FakeProcessGroupWrapper])
def test_wrappers_reject_a_raw_torch_group(wrapper: type) -> None:
    with pytest.raises(TypeError, match=r"ftcomm\.c10d ProcessGroup"):
        wrapper(dist.ProcessGroup(0, 1))


# -- FakeProcessGroupWrapper -------------------------------------------------


def _assert_fails_with(work: dist.Work, injected: Exception, first: str) -> None:
    """``work`` fails with ``injected``: wait() raises it, the future an error
    that is or names it (see :func:`names`)."""
    hows = ["wait", "future", "wait"] if first == "wait" else ["future", "wait", "future"]
    for how in hows:  # the same error, however and however often it is asked
        with pytest.raises((type(injected), RuntimeError)) as raised:
            work.wait() if how == "wait" else work.get_future().wait()
        if how == "wait":
            assert raised.value is injected
        else:
            assert names(raised.value, injected), raised.value
        # raised -> its traceback -> this frame -> raised: a cycle that would
        # keep ``work`` (and a Gloo group's fds) alive until the GC runs.
        del raised


@op_names
@pytest.mark.parametrize("first", ["wait", "future"])
def test_fake_fails_the_next_op_with_the_injected_error(
    op: str, first: str, dummy: ProcessGroupDummy
) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    injected = ValueError(f"injected into {op}")
    fake.report_future_error(injected)
    call = OPS[op](fake)
    _assert_fails_with(call.issue(), injected, first)
    assert call.ran()  # the op itself ran as usual on the inner group

    after = OPS[op](fake)
    work = after.issue()
    assert work.wait() is True
    work.get_future().wait()
    assert after.ran()


def test_fake_over_gloo(gloo: Gloo) -> None:
    fake = FakeProcessGroupWrapper(gloo.pg)
    errors: list[BaseException] = []
    for op, make in OPS.items():
        injected = RuntimeError(f"injected into {op}")
        errors.append(injected)
        fake.report_future_error(injected)
        call = make(fake)
        _assert_fails_with(call.issue(), injected, "future")
        assert call.ran(), op
        after = make(fake)
        assert after.issue().wait() is True, op
        assert after.ran(), op

    fake.report_future_error(RuntimeError("dropped by configure"))
    fake.configure(gloo.addr(), "0", 0, 1)
    call = _allgather(fake)
    assert call.issue().wait() is True
    assert call.ran()


def test_fake_error_waits_for_an_op_that_is_issued(dummy: ProcessGroupDummy) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    injected = RuntimeError("injected")
    fake.report_future_error(injected)
    with pytest.raises(ValueError, match="exactly one entry"):
        fake.allreduce([_in(), _in()])  # rejected: it never ran
    dummy.abort(errored=False)
    with pytest.raises(ftcomm.CommAborted):
        _allgather(fake).issue()  # refused: it never ran
    dummy.configure(UNUSED, "0", 0, 1)
    _assert_fails_with(_barrier(fake).issue(), injected, "wait")


def test_fake_configure_drops_a_pending_error(dummy: ProcessGroupDummy) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    fake.report_future_error(RuntimeError("never raised"))
    fake.configure(UNUSED, "0", 0, 1)
    assert dummy.configure_count == 1  # passed on to the wrapped group
    call = _allgather(fake)
    work = call.issue()
    assert work.wait() is True
    work.get_future().wait()
    assert call.ran()


@pytest.mark.parametrize(
    "not_an_error",
    ["x", RuntimeError, KeyboardInterrupt(), None],
    ids=["str", "class", "base_exception", "none"],
)
def test_fake_rejects_what_is_not_an_exception(
    not_an_error: object, dummy: ProcessGroupDummy
) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    with pytest.raises(TypeError, match="Exception instance"):
        fake.report_future_error(not_an_error)  # type: ignore[arg-type]
    assert _allreduce(fake).issue().wait() is True  # nothing pending


def test_fake_failed_work_is_not_a_success(dummy: ProcessGroupDummy) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    fake.report_future_error(RuntimeError("injected"))
    work = _allreduce(fake).issue()
    with pytest.raises(RuntimeError):
        work.wait()
    assert work.is_completed()
    assert not work.is_success()


@pytest.mark.parametrize("op", list(OPS))
def test_fake_error_from_the_future_only(op: str, dummy: ProcessGroupDummy) -> None:
    """``wait_raises=False`` (what torchft's DDP can carry): ``wait()`` returns
    True once the op ran, the future fails with the very error, and the work
    is not a success."""
    fake = FakeProcessGroupWrapper(dummy)
    injected = RuntimeError(f"{op}: injected, future only")
    fake.report_future_error(injected, wait_raises=False)
    call = OPS[op](fake)
    work = call.issue()
    assert work.wait() is True
    assert call.ran(), op
    assert not work.is_success()
    fut = work.get_future()
    with pytest.raises(RuntimeError, match="injected, future only"):
        fut.wait()
    assert call.issue().wait() is True  # once: the next op is not touched


def test_fake_wait_raises_must_be_a_bool(dummy: ProcessGroupDummy) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    with pytest.raises(TypeError, match="wait_raises must be a bool"):
        fake.report_future_error(RuntimeError("x"), wait_raises=0)  # type: ignore[arg-type]
    assert _allreduce(fake).issue().wait() is True  # nothing was armed


# -- ManagedProcessGroup -----------------------------------------------------


class FakeManager:
    """What ManagedProcessGroup needs from a manager, recording every call."""

    def __init__(self, pg: object = None, participants: int = 3) -> None:
        self._reducer = ProcessGroupDummy()
        if pg is not None:
            self._pg = pg
        self.participants = participants
        self.allreduces: list[tuple[torch.Tensor, object]] = []
        self.works: list[dist.Work] = []
        self.errors: list[Exception] = []

    def allreduce(self, tensor: torch.Tensor, *, reduce_op: dist.ReduceOp.RedOpType) -> dist.Work:
        self.allreduces.append((tensor, reduce_op))
        work = self._reducer.allreduce([tensor], reduce_op)
        self.works.append(work)
        return work

    def num_participants(self) -> int:
        return self.participants

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def shutdown(self) -> None:
        self._reducer.shutdown()


@pytest.fixture
def manager() -> Iterator[FakeManager]:
    m = FakeManager()
    try:
        yield m
    finally:
        m.shutdown()


def _reduce_opts(op: dist.ReduceOp.RedOpType) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


REDUCE_ARGS: dict[str, tuple[Callable[[], object], dist.ReduceOp.RedOpType]] = {
    "none": (lambda: None, dist.ReduceOp.SUM),
    "default_options": (dist.AllreduceOptions, dist.ReduceOp.SUM),
    "options_max": (lambda: _reduce_opts(dist.ReduceOp.MAX), dist.ReduceOp.MAX),
    "options_avg": (lambda: _reduce_opts(dist.ReduceOp.AVG), dist.ReduceOp.AVG),
    "reduce_op_min": (lambda: dist.ReduceOp.MIN, dist.ReduceOp.MIN),
    "reduce_op_product": (lambda: dist.ReduceOp.PRODUCT, dist.ReduceOp.PRODUCT),
}


def test_fake_manager_is_a_manager(manager: FakeManager) -> None:
    assert isinstance(manager, Manager)
    assert not isinstance(object(), Manager)


@pytest.mark.parametrize("args", list(REDUCE_ARGS))
def test_managed_allreduce_goes_to_the_manager(
    args: str, manager: FakeManager, dummy: ProcessGroupDummy
) -> None:
    dummy.abort()  # an allreduce that reached pg would be refused (and reported)
    managed = ManagedProcessGroup(manager, pg=dummy)
    make_opts, expected = REDUCE_ARGS[args]
    t = _in()
    work = managed.allreduce([t], make_opts())
    assert work is manager.works[-1]  # the manager's own work, as it is
    assert work.wait() is True
    assert len(manager.allreduces) == 1
    tensor, reduce_op = manager.allreduces[0]
    assert tensor is t
    assert reduce_op == expected
    assert manager.errors == []


def test_managed_allreduce_needs_no_group(manager: FakeManager) -> None:
    managed = ManagedProcessGroup(manager)
    t = _in()
    assert managed.allreduce([t], dist.ReduceOp.MAX).wait() is True
    assert manager.allreduces == [(t, dist.ReduceOp.MAX)]
    with pytest.raises(ValueError, match="exactly one entry"):
        managed.allreduce([t, t])  # still one tensor per rank


def test_managed_size_is_the_number_of_participants(
    manager: FakeManager, dummy: ProcessGroupDummy
) -> None:
    managed = ManagedProcessGroup(manager, pg=dummy)
    assert managed.size() == 3
    assert managed.getSize() == 3
    manager.participants = 5
    assert managed.size() == 5
    assert managed.getSize() == 5
    assert dummy.size() == 1  # the group's own size is not what the model sees
    assert ManagedProcessGroup(manager).size() == 5


@pytest.mark.parametrize("op", [name for name in OPS if name != "allreduce"])
def test_managed_runs_other_ops_on_its_group(
    op: str, manager: FakeManager, dummy: ProcessGroupDummy
) -> None:
    managed = ManagedProcessGroup(manager, pg=dummy)
    call = OPS[op](managed)
    assert call.issue().wait() is True
    assert call.ran()
    assert manager.allreduces == []
    assert manager.errors == []


@pytest.mark.parametrize("op", [name for name in OPS if name != "allreduce"])
@pytest.mark.parametrize("when", ["issue", "wait", "future"])
def test_managed_reports_and_swallows_errors(
    op: str, when: str, manager: FakeManager, dummy: ProcessGroupDummy
) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    managed = ManagedProcessGroup(manager, pg=fake)
    injected = RuntimeError(f"{op} failed")
    if when == "issue":
        dummy.abort()
    else:
        fake.report_future_error(injected)
    call = OPS[op](managed)
    work = call.issue()
    if when == "future":
        assert_default(work.get_future().wait(), call.default)
        assert work.wait() is True
    else:
        assert work.wait() is True
        assert_default(work.get_future().wait(), call.default)
    assert len(manager.errors) == 1  # reported once, however often it is asked
    if when == "issue":
        assert isinstance(manager.errors[0], ftcomm.CommAborted)
        assert call.untouched()
        dummy.configure("unused", "0", 0, 1)
    elif when == "wait":
        assert manager.errors[0] is injected
    else:
        assert manager.errors[0] is injected

    after = OPS[op](managed)  # no skipping: the manager decides what an error means
    assert after.issue().wait() is True
    assert after.ran()
    assert len(manager.errors) == 1


@pytest.mark.parametrize("op", [name for name in OPS if name != "allreduce"])
def test_managed_without_a_group_runs_only_allreduce(op: str, manager: FakeManager) -> None:
    managed = ManagedProcessGroup(manager)
    with pytest.raises(NotImplementedError, match="pass pg="):
        OPS[op](managed).issue()
    assert managed.getBackendName() == "ftcomm-managed"


def test_managed_picks_up_the_managers_group(dummy: ProcessGroupDummy) -> None:
    manager = FakeManager(pg=dummy)
    try:
        managed = ManagedProcessGroup(manager)
        call = _allgather(managed)
        assert call.issue().wait() is True
        assert call.ran()
        assert managed.getBackendName() == dummy.getBackendName()
        assert repr(dummy) in repr(managed)
    finally:
        manager.shutdown()


def test_managed_prefers_the_group_it_is_given(dummy: ProcessGroupDummy) -> None:
    other = ProcessGroupDummy()
    manager = FakeManager(pg=other)
    try:
        other.abort()  # an op on the manager's group would fail
        managed = ManagedProcessGroup(manager, pg=dummy)
        call = _allgather(managed)
        assert call.issue().wait() is True
        assert call.ran()
        assert manager.errors == []
    finally:
        manager.shutdown()
        other.shutdown()


@pytest.mark.parametrize(
    "pg", [object(), dist.ProcessGroup(0, 1)], ids=["object", "raw_torch_group"]
)
def test_managed_ignores_a_managers_group_that_is_not_ftcomm(pg: object) -> None:
    manager = FakeManager(pg=pg)
    try:
        managed = ManagedProcessGroup(manager)
        with pytest.raises(NotImplementedError):
            _barrier(managed).issue()
    finally:
        manager.shutdown()


def test_managed_rejects_a_group_that_is_not_ftcomm(manager: FakeManager) -> None:
    with pytest.raises(TypeError, match=r"ftcomm\.c10d ProcessGroup"):
        ManagedProcessGroup(manager, pg=dist.ProcessGroup(0, 1))  # type: ignore[arg-type]


class _NoReportError:
    def allreduce(self, tensor: torch.Tensor, *, reduce_op: object) -> None: ...

    def num_participants(self) -> int:
        return 1


class _NoAllreduce:
    def num_participants(self) -> int:
        return 1

    def report_error(self, e: Exception) -> None: ...


class _ParticipantsNotCallable:
    num_participants = 1

    def allreduce(self, tensor: torch.Tensor, *, reduce_op: object) -> None: ...

    def report_error(self, e: Exception) -> None: ...


@pytest.mark.parametrize(
    ("incomplete", "missing"),
    [
        (_NoReportError(), "report_error"),
        (_NoAllreduce(), "allreduce"),
        (_ParticipantsNotCallable(), "num_participants"),
        (object(), "allreduce, num_participants, report_error"),
    ],
    ids=["no_report_error", "no_allreduce", "attribute_not_method", "nothing"],
)
def test_managed_rejects_an_incomplete_manager(incomplete: object, missing: str) -> None:
    with pytest.raises(TypeError, match=missing):
        ManagedProcessGroup(incomplete)  # type: ignore[arg-type]


# -- repr --------------------------------------------------------------------


def test_reprs_show_the_wrapped_group(dummy: ProcessGroupDummy, manager: FakeManager) -> None:
    fake = FakeProcessGroupWrapper(dummy)
    sw = ErrorSwallowingProcessGroupWrapper(fake)
    managed = ManagedProcessGroup(manager, pg=sw)
    assert repr(dummy) in repr(fake)
    assert repr(fake) in repr(sw)
    assert repr(sw) in repr(managed)
    assert repr(fake).startswith("FakeProcessGroupWrapper(")
    assert repr(sw).startswith("ErrorSwallowingProcessGroupWrapper(")
    assert repr(managed).startswith("ManagedProcessGroup(")


# -- send, recv and real deadlines: a two-rank Gloo world --------------------

DEADLINE = timedelta(seconds=0.3)
GENEROUS = 10.0  # seconds: a swallowed timeout must end well within this


def _send_recv(ctx: RankContext) -> list[str]:
    """Rank 0 sends, rank 1 receives; each step asserts as it goes."""
    rank = ctx.rank
    gloo = ProcessGroupGloo(timeout=timedelta(seconds=30))
    fake = FakeProcessGroupWrapper(gloo)
    sw = ErrorSwallowingProcessGroupWrapper(fake)
    steps: list[str] = []
    errors: list[BaseException | None] = []  # their tracebacks are dropped at the end

    def send_or_recv(pg: ProcessGroup, value: float) -> tuple[dist.Work, Any, torch.Tensor]:
        """Rank 0 sends ``value`` to rank 1; returns (work, default, tensor)."""
        if rank == 0:
            t = torch.full((2,), value)
            ts = [t]
            return pg.send(ts, 1, 0), ts, t  # a send's future holds what it sent
        ts = [_out()]
        return pg.recv(ts, 0, 0), ts, ts[0]

    try:
        sw.configure(ctx.addr("a"), "0", rank, 2)
        work, _, t = send_or_recv(sw, 1.0)
        assert work.wait() is True
        assert t.tolist() == [1.0, 1.0]
        assert sw.error() is None
        steps.append("swallowing passes a success")

        injected = RuntimeError(f"injected on rank {rank}")
        errors.append(injected)
        fake.report_future_error(injected)
        work, _, t = send_or_recv(fake, 2.0)
        _assert_fails_with(work, injected, "wait" if rank == 0 else "future")
        assert t.tolist() == [2.0, 2.0]  # the op ran as usual
        work, _, t = send_or_recv(fake, 3.0)
        assert work.wait() is True
        assert t.tolist() == [3.0, 3.0]
        steps.append("fake injects into one op")

        fake.report_future_error(injected)
        work, default, t = send_or_recv(sw, 4.0)
        if rank == 0:
            assert work.wait() is True
            assert_default(work.get_future().wait(), default)
        else:
            assert_default(work.get_future().wait(), default)
            assert work.wait() is True
        assert sw.error() is injected
        errors.append(sw.error())
        assert t.tolist() == [4.0, 4.0]
        steps.append("swallowing swallows an error at wait")

        # Skipped: without its partner, the op would block until the deadline.
        work, default, t = send_or_recv(sw, 5.0)
        assert work.is_completed()
        assert work.wait() is True
        assert_default(work.get_future().wait(), default)
        assert t.tolist() == ([5.0, 5.0] if rank == 0 else [SENTINEL] * 2)
        steps.append("swallowing skips after an error")

        sw.configure(ctx.addr("b"), "0", rank, 2)
        assert sw.error() is None
        # Both ranks hold the group before either aborts it: an abort shuts
        # the group's connections, and would fail a peer still building it.
        ctx.store.set(f"b-built-{rank}", b"1")
        ctx.store.wait([f"b-built-{1 - rank}"])
        gloo.abort(errored=False)
        work, default, t = send_or_recv(sw, 6.0)
        assert work.is_completed()
        assert work.wait() is True
        assert_default(work.get_future().wait(), default)
        assert isinstance(sw.error(), ftcomm.CommAborted)
        errors.append(sw.error())
        assert t.tolist() == ([6.0, 6.0] if rank == 0 else [SENTINEL] * 2)
        steps.append("swallowing swallows a refusal")

        # Real deadlines: a peer that never joins. Rank 0's allreduce ends
        # through its future, then rank 1's allgather through wait(). Not send
        # or recv: when a Gloo send/recv hits its deadline, the native wait's
        # error can hold ftcomm/_runtime/threads.py:_run_one's frame in a cycle
        # (error -> traceback -> frame -> future -> error) that keeps the native
        # work, and so the group's fds, open until the GC runs.
        for prefix, waiter in (("c", 0), ("d", 1)):
            sw.configure(ctx.addr(prefix), "0", rank, 2)
            if rank != waiter:
                ctx.store.wait([f"{prefix}-done"])
                assert sw.error() is None
                continue
            if waiter == 0:
                call = _allreduce(sw, timeout=DEADLINE)
            else:
                call = _allgather(sw, timeout=DEADLINE, world_size=2)
            start = time.monotonic()
            work = call.issue()
            if waiter == 0:
                assert_default(work.get_future().wait(), call.default)
            else:
                assert work.wait() is True
            assert time.monotonic() - start < GENEROUS
            assert names_a(sw.error(), ftcomm.CommTimeout), sw.error()
            errors.append(sw.error())
            assert call.untouched()
            assert work.wait() is True  # asked again: still swallowed
            ctx.store.set(f"{prefix}-done", b"1")
        steps.append("swallowing swallows a deadline")

        sw.configure(ctx.addr("e"), "0", rank, 2)
        assert sw.error() is None
        work, _, t = send_or_recv(sw, 8.0)
        assert work.wait() is True
        assert t.tolist() == [8.0, 8.0]
        steps.append("configure makes it work again")
    finally:
        sw.shutdown()
    return steps


def test_send_recv_and_real_deadlines_in_a_two_rank_world() -> None:
    start = time.monotonic()
    results = run_world(_send_recv, 2, mode="thread", timeout=60.0)
    expected = [
        "swallowing passes a success",
        "fake injects into one op",
        "swallowing swallows an error at wait",
        "swallowing skips after an error",
        "swallowing swallows a refusal",
        "swallowing swallows a deadline",
        "configure makes it work again",
    ]
    assert results == [expected, expected]
    assert time.monotonic() - start < 45.0


@pytest.mark.parametrize("via", ["wait", "future"])
def test_an_error_from_an_earlier_configuration_does_not_skip_the_next(
    dummy: ProcessGroupDummy, via: str
) -> None:
    """DDP reads its bucket's future lazily: an op of the old configuration
    whose error is seen after configure() must not stop the new one."""
    fake = FakeProcessGroupWrapper(dummy)
    sw = ErrorSwallowingProcessGroupWrapper(fake)
    old_error = PeerLost("rank 3 is gone")
    fake.report_future_error(old_error)
    old = sw.allreduce([torch.ones(2)])  # its outcome is read lazily, below
    sw.configure(UNUSED, "0", 0, 1)
    if via == "wait":
        assert old.wait() is True
    else:
        assert old.get_future().wait() is not None
    assert sw.error() is None  # swallowed, but not recorded into the new configuration
    new = sw.allreduce([torch.ones(2)])
    assert not isinstance(new, DoneWork)  # issued, not skipped
    assert new.wait() is True
