"""The state copy: the members furthest ahead stream their state to the members behind.

Owns :func:`sync_state` (public as ``ftcomm.sync_state``, and the work of
``Membership.sync_state``): its plan (:func:`plan`) and its stream
(:func:`_stream`), the steps of one copy being :func:`copy_state`'s. What a
state is and its description are ``_state_wire``'s; where each tensor lands,
``_state_land``'s. What a copy costs and refuses: docs/membership.md, "State".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .._runtime.deadline import Timeout, resolve
from .._runtime.loop import get_runtime
from ..errors import CommError
from ..group import Group, config_of
from . import _state_land as land
from . import _state_wire as wire

S = TypeVar("S")

TAG = 0x5EED
"""The p2p tag of the state copy, apart from a user's own tags."""
CHUNK = 32 << 20
"""The most bytes one send or recv of the stream moves (measured here, 1 GiB
in 32 tensors: 8 MiB chunks cost 8% more time than whole tensors, 32 MiB
none). Both ends cut a tensor the same way, from its description alone
(:func:`chunks`): Gloo ends the process if a message is larger than the
receive posted for it."""
WINDOW = 16
"""The most ops of the stream in flight on a member."""
BUFFERS = 2
"""The most staging buffers (``CHUNK`` bytes each: 64 MiB) on a member."""
THREAD_COPY = 4 << 20
"""A copy or fill of more bytes runs on a worker thread, off the event loop."""

_OK, _BAD_STATE, _UNREADABLE = 0, 1, -1


def device_of(group: Group) -> torch.device:
    """Where ``group``'s tensors live: its accelerator's device, else the CPU."""
    config = config_of(group)
    device = getattr(config.backend, "device", None) if config is not None else None
    return device if isinstance(device, torch.device) else torch.device("cpu")


def plan(steps: list[int]) -> list[list[int]]:
    """The chains of a copy, ``[source, behind, behind...]``: the ranks at the
    highest step are the sources, in rank order; the ranks behind are dealt
    out among them in rank order. Empty when nobody is behind."""
    top = max(steps)
    sources = [r for r, s in enumerate(steps) if s == top]
    behind = [r for r, s in enumerate(steps) if s < top]
    chains = [[source] for source in sources[: len(behind)]]
    for i, rank in enumerate(behind):
        chains[i % len(chains)].append(rank)
    return chains


STEP_MAX = 2**63 - 1
"""The largest step: steps go over the group as int64."""


def check_step(step: object) -> int:
    """Raises: TypeError, ValueError: ``step`` is not an int in 0..STEP_MAX."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if not 0 <= step <= STEP_MAX:
        raise ValueError(f"step must be >= 0 and fit in an int64, got {step}")
    return step


async def sync_state(
    group: Group, state: S, step: int, *, timeout: Timeout | None = None
) -> tuple[S, int]:
    """Give the ranks of ``group`` that are behind the state of the ranks furthest ahead.

    Every rank of the configured ``group`` calls it, like a collective, with
    its own ``state`` (a ``state_dict``, or any nesting of dict, list and
    tuple whose leaves are tensors and plain values) and ``step``. The ranks
    at the highest step send, tensor by tensor, to the ranks at a lower step;
    each returns ``(state, step)``: its own where it was not behind, else the
    state sent and its step.

    What a rank behind gets back:

    * **In place** where its own ``state`` has the structure of the one sent
      (the same keys and lengths, each tensor's dtype and shape): the returned
      state holds its own tensor objects (a ``Parameter`` stays one, a
      ``DTensor`` gets its local shard written), with the values sent. A
      ``model.state_dict()`` passed in updates the model itself.
    * **New tensors** where it holds ``None`` or an empty container (``{}``
      for a whole state): on the group's device where the sender's tensor
      was on its own, else on the CPU, with the sender's strides.
    * **Plain values** (and the containers) as sent.

    No code runs on a receiver: the state is described as data, never
    pickled. A copy costs at most two 32 MiB staging buffers of extra memory
    on any rank (none where layouts match), and never blocks the event loop
    for long. Cancelled, it aborts the group, as a cancelled op does.

    :meth:`ftcomm.Membership.sync_state` is this call on the membership's
    group; call this one on a group the membership does not configure
    itself (another shard's group of the same world, say).

    Args:
        timeout: a deadline for the whole copy (default: ``group``'s).

    Raises:
        CommError: the group failed during the copy (``NotConfigured``: it
            is not configured). A rank behind may then hold a state partly
            written: after ``recover()``, call it again to complete it.
        ValueError: ``step`` is negative or over ``2**63 - 1``; a rank's
            state holds what cannot be copied (raised on every rank, naming
            the place on the rank that holds it); or a rank behind holds a
            state whose structure differs from the one sent (raised on every
            rank before any tensor moves: the states are as they were).
        TypeError: ``group`` is not an :class:`ftcomm.Group`; ``step`` is
            not an int.
    """
    if not isinstance(group, Group):
        raise TypeError(f"group must be an ftcomm.Group, got {type(group).__name__}")
    check_step(step)
    deadline = time.monotonic() + resolve(timeout, group.timeout)
    return await copy_state(group, state, step, deadline)


async def copy_state(group: Group, state: S, step: int, deadline: float) -> tuple[S, int]:
    """:func:`sync_state`'s work, bound by ``deadline`` (a ``time.monotonic()`` value).

    Every member of the group calls it, like a collective:

    1. **Each member describes its own state** (:func:`~._state_wire.describe`).
       A state that cannot be copied fails there, on every member, at every
       call: the first time, not when a replacement joins.
    2. **One allgather of** ``[step, state ok, description length]``. The
       members at the highest step are the sources; the members behind are
       dealt out among them in chains (:func:`plan`): source -> b1 -> b2 ...
       Each member of a chain forwards each chunk as it lands, so two members
       behind one source take about the time of one.
    3. **Each source sends its description** to every member of its chain,
       which matches it against its own state (:func:`~._state_land.match`):
       in place where the structure is the same, new tensors where it holds
       ``None`` or an empty container.
    4. **One allgather of the verdicts**: a mismatch is a ``ValueError`` on
       every member before a tensor byte moves, and the receivers' states are
       as they were.
    5. **The stream** (:func:`_stream`): each tensor's bytes in chunks of at
       most :data:`CHUNK`, at most :data:`WINDOW` ops in flight, straight from
       the sender's tensor into the receiver's where their layouts allow
       (dense, on the group's device). Any other goes chunk by chunk through
       at most :data:`BUFFERS` staging buffers on the group's device. A copy
       or a fill of over :data:`THREAD_COPY` bytes runs on a worker thread:
       the event loop keeps running.

    A sender that dies mid-stream leaves its receivers with a ``CommError``
    and a state partly written; a ``sync_state`` after ``recover()`` completes
    it from another member.
    """

    def left() -> float:
        return max(deadline - time.monotonic(), 0.0)

    me, device = group.rank, device_of(group)
    mine: wire.Described | None = None
    desc, problem = b"", None
    try:
        mine = wire.describe(state, device)
        desc = mine.encode()
        if len(desc) > wire.MAX_BYTES:
            raise ValueError(f"its description takes {len(desc)} bytes, over {wire.MAX_BYTES}")
    except Exception as exc:  # ValueError, or torch's own on an odd tensor: told to every rank
        problem = exc
    row = [step, _OK if problem is None else _BAD_STATE, len(desc)]
    rows = await _gather_ints(group, row, left())
    bad = [r for r, got in enumerate(rows) if got[1] != _OK]
    if bad:
        if problem is not None:
            raise ValueError(f"the state cannot be copied: {problem}") from problem
        raise ValueError(
            f"the state of rank {bad[0]} cannot be copied (its error says where): "
            "nothing was copied"
        )
    assert mine is not None  # for mypy: no problem, so described
    chains = plan([got[0] for got in rows])
    chain = next((c for c in chains if me in c), None)
    top = max(got[0] for got in rows)

    # The description, and the verdicts: every rank learns of a mismatch.
    landing: land.Landing | None = None
    tree, specs = mine.tree, mine.specs  # a receiver's: the ones its chain's source sent
    verdict: list[int] = [_OK, -1]
    failure: Exception | None = None
    try:
        if chain is not None and chain[0] == me:
            data = _bytes_tensor(desc, device)
            for rank in chain[1:]:
                await group.send(data, rank, TAG, timeout=left())
        elif chain is not None:
            data = torch.empty(rows[chain[0]][2], dtype=torch.uint8, device=device)
            await group.recv(data, chain[0], TAG, timeout=left())
            try:
                tree, specs = wire.parse(data.cpu().numpy().tobytes())
                landing = land.match(state, tree, specs)
            except land.Mismatch as exc:
                verdict, failure = [exc.code, exc.index], exc
            except Exception as exc:  # unreadable (or a bug here): never a rank left alone
                verdict, failure = [_UNREADABLE, -1], exc
    except CommError:
        raise
    except BaseException:  # out of memory, say: this rank leaves, its peers must not wait
        group.abort()
        raise
    verdicts = await _gather_ints(group, verdict, left())
    wrong = [(r, v) for r, v in enumerate(verdicts) if v[0] != _OK]
    if wrong:
        raise _refused(wrong, failure, chain, tree)
    if chain is None:
        return state, step
    at = chain.index(me)
    prev = chain[at - 1] if at else None
    nxt = chain[at + 1] if at + 1 < len(chain) else None
    config = config_of(group)
    window = 2 if config is not None and config.backend.copies_in_flight else WINDOW
    if prev is None:
        await _stream(group, specs, _Sender(mine, device, deadline), prev, nxt, window, deadline)
        return state, step
    assert landing is not None  # matched, or a verdict raised above
    receiver = _Receiver(landing, device, deadline)
    await _stream(group, specs, receiver, prev, nxt, window, deadline)
    await receiver.finish(specs)
    return land.build(tree, landing.leaves), top


def _refused(
    wrong: list[tuple[int, list[int]]],
    failure: Exception | None,
    chain: list[int] | None,
    tree: wire.Node,
) -> ValueError:
    """The error of a copy a receiver refused (``wrong``: each such rank's
    verdict), on this rank: its own reason, or the first refuser's, with the
    place named where this rank knows the tree the index is of (its chain's)."""
    if failure is not None:
        source = "?" if chain is None else chain[0]
        if isinstance(failure, land.Mismatch):
            error = ValueError(
                f"this rank's state does not match the one rank {source} sent, at {failure}: "
                "nothing was copied"
            )
        else:
            error = ValueError(
                f"this rank could not take the state rank {source} sent: {failure}: "
                "nothing was copied"
            )
        error.__cause__ = failure
        return error
    rank, (code, index) = wrong[0]
    where = land.path_of(tree, index) if chain is not None and rank in chain else None
    what = land.WHAT.get(code, "an error of its own")
    return ValueError(
        f"rank {rank} cannot take the state sent ({what}"
        f"{' at ' + where if where else ''}; its error says more): nothing was copied"
    )


async def _gather_ints(group: Group, values: list[int], timeout: float) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64, device=device_of(group))
    return [t.cpu().tolist() for t in await group.allgather(mine, timeout=timeout)]


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


# -- the stream -----------------------------------------------------------------
def chunks(spec: wire.TensorSpec, limit: int) -> Iterator[tuple[int, int, tuple[Any, ...]]]:
    """A tensor's wire bytes in ranges of at most ``limit`` bytes (a single
    value excepted): ``(lo, hi, index)``, where ``index`` picks the same
    values out of the tensor permuted into wire order (:func:`wire_order`).
    Whole rows of the outermost dimension where they fit, else each row in
    pieces, and so on inwards."""
    order = wire_order(spec)
    shape = [spec.shape[d] for d in order]
    item = spec.dtype.itemsize
    if not shape:
        yield 0, item, ()
        return

    def within(
        dim: int, prefix: tuple[Any, ...], base: int
    ) -> Iterator[tuple[int, int, tuple[Any, ...]]]:
        inner = math.prod(shape[dim + 1 :])
        if inner * item <= limit or dim == len(shape) - 1:
            per = max(1, limit // (inner * item))
            for a in range(0, shape[dim], per):
                b = min(a + per, shape[dim])
                yield (base + a * inner) * item, (base + b * inner) * item, (*prefix, slice(a, b))
        else:
            for i in range(shape[dim]):
                yield from within(dim + 1, (*prefix, i), base + i * inner)

    yield from within(0, (), 0)


def wire_order(spec: wire.TensorSpec) -> list[int]:
    """The dimensions from the outermost of the wire layout to the innermost:
    ``t.permute(order)`` reads ``t``'s values in wire order."""
    return sorted(range(len(spec.shape)), key=lambda d: (-spec.stride[d], d))


class _Pool:
    """Staging buffers of :data:`CHUNK` bytes on the group's device, at most
    :data:`BUFFERS` of them, made as needed and used again."""

    def __init__(self, device: torch.device, deadline: float) -> None:
        self._device, self._deadline = device, deadline
        self._free: list[torch.Tensor] = []
        self.made = 0

    async def take(self) -> torch.Tensor | None:
        """A buffer, or ``None`` if all are in use (end an op first)."""
        if self._free:
            return self._free.pop()
        if self.made == BUFFERS:
            return None
        self.made += 1
        buffer = torch.empty(CHUNK, dtype=torch.uint8, device=self._device)
        await fill(buffer, self._deadline)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)


@dataclass
class _Chunk:
    """One range of a tensor's wire bytes in the stream."""

    data: torch.Tensor
    """The bytes an op moves: a range of the tensor's own, or of ``buffer``."""
    buffer: torch.Tensor | None = None
    land: Callable[[], Awaitable[None]] | None = None
    """A staged receive: copy the buffer into the tensor's values."""
    ops: int = 0


def _values(data: torch.Tensor, spec: wire.TensorSpec, view: torch.Tensor) -> torch.Tensor:
    """``data`` (wire bytes) as values shaped like ``view``."""
    return data.view(spec.dtype).view(view.shape)


class _Side:
    """A sender's or a receiver's end of the stream: each tensor's chunks."""

    def __init__(self, device: torch.device, deadline: float) -> None:
        self.device, self.deadline = device, deadline
        self.pool = _Pool(device, deadline)

    async def tensor(self, index: int, spec: wire.TensorSpec) -> tuple[torch.Tensor, bool]:
        """The tensor ``index`` (its bytes are read or written), and whether
        they go straight between it and the wire (else through buffers)."""
        raise NotImplementedError

    async def staged(self, t: torch.Tensor, spec: wire.TensorSpec, view: Any, data: Any) -> Any:
        """A chunk through a buffer: ``data``, its bytes in the buffer, for
        the values ``view`` picks of ``t`` permuted into wire order. A sender
        fills ``data`` now; a receiver returns what lands it once it came."""
        raise NotImplementedError


class _Sender(_Side):
    def __init__(self, mine: wire.Described, device: torch.device, deadline: float) -> None:
        super().__init__(device, deadline)
        self._mine = mine

    async def tensor(self, index: int, spec: wire.TensorSpec) -> tuple[torch.Tensor, bool]:
        t = self._mine.tensors[index]
        return t, wire.on_device(t, self.device) and wire.plain_bytes(t)

    async def staged(self, t: torch.Tensor, spec: wire.TensorSpec, view: Any, data: Any) -> Any:
        source = t.permute(wire_order(spec))[view]
        await copy(_values(data, spec, source), source, self.deadline)
        return None


class _Receiver(_Side):
    def __init__(self, landing: land.Landing, device: torch.device, deadline: float) -> None:
        super().__init__(device, deadline)
        self._landing = landing

    async def tensor(self, index: int, spec: wire.TensorSpec) -> tuple[torch.Tensor, bool]:
        target = self._landing.targets[index]
        if target is None:  # the receiver holds none: a new one, in the sender's layout
            target = self._new(index, spec)
            await fill(target, self.deadline)
            return target, wire.on_device(target, self.device)
        self._changed(index)
        return target, wire.on_device(target, self.device) and _lands_as_is(target, spec)

    def _changed(self, index: int) -> None:
        """The receiver's own tensor ``index`` is about to be written: as an
        in-place op would, bump its version (and its DTensor's), so that a
        graph that saved it raises rather than use what it no longer holds,
        even if the copy then fails midway. Bytes written from the wire
        bump nothing by themselves."""
        target, leaf = self._landing.targets[index], self._landing.leaves[index]
        for t in (target, leaf):
            if isinstance(t, torch.Tensor):
                torch.autograd.graph.increment_version(t)

    def _new(self, index: int, spec: wire.TensorSpec) -> torch.Tensor:
        where = self.device if spec.on_group else torch.device("cpu")
        new = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=where)
        self._landing.targets[index] = self._landing.leaves[index] = new
        return new

    async def staged(self, t: torch.Tensor, spec: wire.TensorSpec, view: Any, data: Any) -> Any:
        target = t.permute(wire_order(spec))[view]
        return lambda: copy(target, _values(data, spec, target), self.deadline)

    async def finish(self, specs: list[wire.TensorSpec]) -> None:
        """After the stream: tensors with no bytes, and tensors sent once for
        several places (tied weights), each place its own."""
        targets, leaves = self._landing.targets, self._landing.leaves
        for i, spec in enumerate(specs):
            if spec.same_as is None:
                if targets[i] is None:  # no bytes came for it
                    self._new(i, spec)
                continue
            source = targets[spec.same_as]
            assert source is not None
            target = targets[i]
            if target is None:
                targets[i], leaves[i] = source, leaves[spec.same_as]
            elif not _same_view(target, source):
                self._changed(i)
                await copy(target, source, self.deadline)


def _lands_as_is(t: torch.Tensor, spec: wire.TensorSpec) -> bool:
    """Whether the wire's bytes can be received straight into ``t``'s storage."""
    if not wire.plain_bytes(t):
        return False
    return all(
        size == 1 or mine == theirs
        for size, mine, theirs in zip(spec.shape, t.stride(), spec.stride, strict=True)
    )


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.stride() == b.stride()
    )


async def _oldest_or_a_failure(oldest: Any, works: list[Any]) -> None:
    """Wait until ``oldest`` ends, or any of ``works`` fails.

    Gloo never fails a receive whose message its sender's death (or a
    peer's abort, which shuts its sockets down) cut short: it waits for its
    deadline, the copy's. The ops after it, on the same connection, fail at
    once; but one awaited only after the oldest is seen only then. Its
    failure breaks the group (ftcomm ends every op in flight with it, the
    torn one included, within a second), so it is looked at as it comes."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def look(work: Any) -> None:
        if ended.done():
            return
        if work is oldest or work.cancelled() or work.exception() is not None:
            ended.set_result(None)

    for work in works:
        work.add_done_callback(look)
    try:
        await ended
    finally:
        for work in works:
            work.remove_done_callback(look)


async def fill(t: torch.Tensor, deadline: float) -> None:
    """Touch every page of a new tensor before bytes land in it (off the
    loop if it is large): a page first touched by the backend's reader costs
    a fault while that reader holds its connection's lock, and an op issued
    meanwhile waits for that lock on the event loop."""
    if t.numel() * t.element_size() <= THREAD_COPY:
        t.zero_()
        return
    await asyncio.wrap_future(get_runtime().run_blocking(t.zero_, until=deadline))


async def copy(dst: torch.Tensor, src: torch.Tensor, deadline: float) -> None:
    """``dst.copy_(src)``, off the event loop if it is large (and, on an
    accelerator, complete when this returns)."""

    def run() -> None:
        with torch.no_grad():
            dst.copy_(src)
        for device in {dst.device, src.device}:
            if device.type not in ("cpu", "meta"):
                getattr(torch, device.type).synchronize(device)

    if dst.numel() * dst.element_size() <= THREAD_COPY:
        run()
        return
    await asyncio.wrap_future(get_runtime().run_blocking(run, until=deadline))


async def _stream(
    group: Group,
    specs: list[wire.TensorSpec],
    side: _Side,
    prev: int | None,
    nxt: int | None,
    window: int,
    deadline: float,
) -> None:
    """Move every tensor's bytes: received from ``prev`` (``None``: this rank
    sends its own), and sent on to ``nxt`` (``None``: the end of the chain),
    at most ``window`` ops in flight. Returns once every op has ended; on an
    error, once every op in flight has ended too (nothing is written after
    this raises). Cancelled, it aborts the group (the peers' ops end at once)
    and returns at once: an op aborted may still write for a moment."""

    def left() -> float:
        return max(deadline - time.monotonic(), 0.0)

    in_flight: collections.deque[tuple[Any, _Chunk, bool]] = collections.deque()

    def issue(chunk: _Chunk, receive: bool) -> None:
        work: Any
        if receive:
            assert prev is not None
            work = group.recv(chunk.data, prev, TAG, timeout=left())
        else:
            assert nxt is not None
            work = group.send(chunk.data, nxt, TAG, timeout=left())
        in_flight.append((work, chunk, receive))
        chunk.ops += 1

    async def retire() -> None:
        work = in_flight[0][0]
        if len(in_flight) > 1 and not work.done():
            await _oldest_or_a_failure(work, [w for w, _, _ in in_flight])
        work, chunk, received = in_flight.popleft()
        await work
        chunk.ops -= 1
        if received:
            if nxt is not None:
                issue(chunk, receive=False)  # forwarded as it lands
            if chunk.land is not None:
                await chunk.land()
        if chunk.ops == 0 and chunk.buffer is not None:
            side.pool.give(chunk.buffer)

    async def buffer() -> torch.Tensor:
        while (taken := await side.pool.take()) is None:
            await retire()
        return taken

    try:
        for index, spec in enumerate(specs):
            if spec.same_as is not None or spec.nbytes == 0:
                continue
            t, direct = await side.tensor(index, spec)
            flat = wire.flat_bytes(t) if direct else None
            for lo, hi, view in chunks(spec, CHUNK):  # the same cuts on every rank
                if flat is not None:
                    chunk = _Chunk(flat[lo:hi])
                else:
                    held = await buffer()
                    data = held[: hi - lo]
                    chunk = _Chunk(data, held, await side.staged(t, spec, view, data))
                issue(chunk, receive=prev is not None)
                while len(in_flight) >= window:
                    await retire()
        while in_flight:
            await retire()
    except asyncio.CancelledError:
        group.abort()  # off an op too (a staging copy, a fill): the peers must not wait
        raise
    except BaseException as exc:
        if not isinstance(exc, CommError):
            group.abort()  # a failure of ours: the peers' ops must not wait for the deadline
        for work, *_ in in_flight:  # their ends are published once nothing more is written
            with contextlib.suppress(Exception):
                await work
        raise
