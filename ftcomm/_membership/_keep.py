"""The step from an agreed generation to a group its members keep.

Owns: :func:`configure`, a :class:`~ftcomm.Membership`'s configure of its
group for one generation, with what runs beside it (the check of the
world's paths, the watch for a member dead or a verdict that gave the
world up), and the verdict that keeps it (then the engine watches the
world). It gets what it needs of its ``Membership`` as a :class:`Keeper`
(its settings, its engine, its control-thread calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._runtime.loop import get_runtime
from ..errors import CommAborted, CommError, MembershipError
from ..group import Group
from ._reach import CHECK_TIMEOUT
from ._rule import Member, WorldRecord

if TYPE_CHECKING:
    from ._engine import Engine

log = logging.getLogger("ftcomm")


@dataclass(frozen=True)
class Keeper:
    """What :func:`configure` needs of its :class:`~ftcomm.Membership`.

    Args:
        job: the job's name, for messages.
        member_id: this member's id, for messages.
        engine: the coordination engine.
        hb_interval: the heartbeat interval, in seconds.
        hb_timeout: the heartbeat timeout, in seconds.
        call: runs an engine call ``fn(stop)`` on a control thread, within a deadline.
        blocking: runs a blocking call on a control thread, shielded.
        on_broken: what the engine calls when a kept world breaks.
    """

    job: str
    member_id: str
    engine: Engine
    hb_interval: float
    hb_timeout: float
    call: Callable[..., Awaitable[Any]]
    blocking: Callable[[Callable[[], object]], Awaitable[None]]
    on_broken: Callable[[Group, WorldRecord], Callable[[str], None]]


async def configure(
    members: Keeper, group: Group, record: WorldRecord, addr: str, rank: int, deadline: float
) -> None:
    """``group.configure()`` for ``record``, beside the check of its
    world's paths (``engine.reach_check``), kept only where its members
    agree it stands (the engine's verdicts). Given up (the group
    aborted) when a member is seen dead as it runs, when another member
    gave it up (its verdicts are read meanwhile: one member's giving up
    must not leave the others waiting out their deadline), or when the
    check leaves members out, once the configure succeeded too (Gloo
    may build rank 0's connections while a path between two others is
    cut); unless the world was kept first (this configure then
    completes too). Once it succeeded, given up where the world was
    given up first (a member whose call was cancelled mid-configure may
    have left a native construction behind that completed this one's).
    Kept: the engine watches the world from then on (``on_broken``).

    Raises:
        CommError: the configure failed, timed out, or was given up.
        MembershipError: the engine failed as it was asked (the group
            is aborted, and this member quits the generation).
    """
    engine = members.engine
    size = len(record.members)
    left = max(deadline - time.monotonic(), 0.001)
    engine.read_fate(record)
    task = asyncio.ensure_future(group.configure(addr, rank, size, timeout=left))
    stop, timeout = threading.Event(), max(members.hb_timeout, CHECK_TIMEOUT)
    check = asyncio.wrap_future(
        get_runtime().control.spawn(
            lambda stop: engine.reach_check(record, stop, timeout), stop, until=deadline + 5.0
        )
    )
    gone = ""
    try:
        try:
            dead: Member | None = None
            cut: list[Member] = []
            given_up = False
            while True:  # (a configure that succeeded waits for its check's verdict)
                dead = next((m for m in record.members if not engine.alive(m)), None)
                given_up = engine.given_up(record)
                if check.done() and check.exception() is None:
                    cut = [m for m in record.members if m in check.result()[0]]
                if dead or cut or given_up or _failed(task) or (task.done() and check.done()):
                    break
                if time.monotonic() >= deadline:
                    break
                waits = [f for f in (task, check) if not f.done()]
                await asyncio.wait(
                    waits, timeout=members.hb_interval, return_when=asyncio.FIRST_COMPLETED
                )
            kept_first = False
            if dead is not None or cut:
                lost = dead if dead is not None else cut[0]
                if await members.call(lambda _: engine.lost(record, lost), deadline=deadline):
                    gone = (
                        f"{lost.id} died as it was configured"
                        if dead is not None
                        else f"{', '.join(m.id for m in cut)} could not exchange data "
                        "with the others (paths cut)"
                    )
                else:
                    kept_first = True  # the others configured it: this one may complete too
            elif given_up:
                gone = (
                    "it was given up as it was configured (by another member, or a later "
                    "generation was kept)"
                )
            if gone:
                await group.abort()  # (its error is the verdict's, below)
            else:
                if kept_first:
                    # ... or may not (it needed the dead member, or the cut
                    # path): bounded, not the whole deadline
                    bound = max(members.hb_timeout, CHECK_TIMEOUT)
                    await asyncio.wait([task], timeout=bound)
                    if not task.done():
                        gone = "it was kept by the others, and this member's configure of it "
                        gone += f"did not complete within {bound:g} s of that"
                        await group.abort()
                if not gone:
                    try:
                        await task
                    except CommError:
                        # failed by itself (its store connect, its deadline,
                        # the native connect): this member will not use the
                        # world, and the others' configure would wait for it,
                        # so it gives the world up; kept first, it tells
                        # those watching it instead
                        me = engine.me
                        if not await members.call(
                            lambda _: engine.lost(record, me), deadline=deadline
                        ):
                            await members.call(
                                lambda _: engine.recovering(record), deadline=deadline
                            )
                        raise
                elif kept_first:  # the others are in it: tell them it broke
                    await members.call(lambda _: engine.recovering(record), deadline=deadline)
        finally:
            stop.set()
            engine.read_fate(None)
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await _settle(check)
        if not gone:
            broken = members.on_broken(group, record)
            reached = check.result()[1] if not _failed(check) else set()
            if check.done() and not check.cancelled() and check.exception() is not None:
                log.warning(
                    "ftcomm: membership %s: the check of generation %d's paths failed: %s",
                    members.member_id,
                    record.generation,
                    check.exception(),
                )

            def keep(_: threading.Event) -> bool:
                if not engine.keep(record):
                    return False
                try:
                    engine.watch(record, broken, reached)
                except MembershipError as exc:  # the next call reports the engine's loss
                    log.warning("ftcomm: membership %s cannot watch: %s", members.member_id, exc)
                return True

            if not await members.call(keep, deadline=deadline):
                gone = "a member gave it up as it was configured"
    except MembershipError:
        await group.abort()
        await members.blocking(functools.partial(engine.abandon, record))
        raise
    except asyncio.CancelledError:
        await group.abort()  # (_form quits the generation)
        raise
    if gone:
        await group.abort()
        raise CommAborted(
            f"generation {record.generation} of job {members.job!r} was given up: {gone}",
            rank=rank,
            op="configure",
        )


def _failed(future: asyncio.Future[Any]) -> bool:
    """Whether ``future`` ended, and not with a result."""
    return future.done() and (future.cancelled() or future.exception() is not None)


async def _settle(check: asyncio.Future[Any]) -> None:
    """Wait for ``check`` (told to stop) to end, whatever it ends with, so
    that its thread never outlives the call; a cancel that comes meanwhile
    is raised once it has ended, not lost."""
    cancelled = False
    while not check.done():
        try:
            await asyncio.shield(check)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:
            break
    if cancelled:
        raise asyncio.CancelledError
