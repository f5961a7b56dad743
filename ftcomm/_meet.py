"""The ranks' meeting in the store before a native group is built, and the
view of the store it is built through.

Owns: :func:`meet` (each rank counted once, named when missing, stopped
when given up), the rule of one native group per rank and prefix
(``NATIVE_KEY``, ``REFUSED_KEY``: :class:`~ftcomm.errors.PrefixReused`),
and :class:`StoppableStore`. See docs/configure.md ("The meet").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import Store
from torch.distributed import DistStoreError

from ._store import ConnectProgress, Stopped, stop_requested
from .errors import PrefixReused

MEET_KEY = "ftcomm/met/{world}/{rank}"
MEET_COUNT = "ftcomm/met/{world}/n"
NATIVE_KEY = "ftcomm/met/native/{rank}"  # this rank went on to build its native group here
REFUSED_KEY = "ftcomm/met/refused"  # a rank was refused here: the others stop waiting
_OUT_PREFIX = b"out-"  # a rank's key once an attempt took it out: out-<its token>


def reused_error(where: str, rank: int, why: str) -> PrefixReused:
    """The error of a configure refused at a used prefix (``where``), and ``why``."""
    return PrefixReused(
        f"configure() at {where}: {why}; its keys are still there: configure each "
        "group at a fresh prefix (a generation or quorum number in it)",
        rank=rank,
        op="configure",
    )


def peer_refused(where: str, rank: int) -> PrefixReused:
    """The error of a rank whose peer was refused at the prefix (``REFUSED_KEY``)."""
    return reused_error(where, rank, "another rank was refused at this prefix")


def meet(
    store: Store,
    rank: int,
    world_size: int,
    deadline: float,
    progress: ConnectProgress,
    stop: concurrent.futures.Future[Any] | None = None,
    *,
    where: str = "this store prefix",
    mark: bool = True,
) -> None:
    """Wait in ``store`` until every rank of the group has come.

    The native group's own rendezvous waits for the peers too, but with a
    timeout that logs a C++ stack and names no one. Here, a missing rank is
    named, a superseded connect stops at its next poll, and the native group
    is built once everyone is there. Each poll is one counter read, so the
    store's load grows with the ranks, not their square.

    A rank is counted once, whatever its attempts: its key holds the token
    of the attempt that counts it, and a later attempt takes the key over
    (an earlier one killed with its worker process still counts it) instead
    of counting again; an attempt that gives up takes the rank out only if
    the key is still its own.

    A prefix serves one native group per rank: a rank marks itself
    (``NATIVE_KEY``, :func:`mark_native`) before its native group first
    writes at the prefix: here once it met the others (``mark``), or, for a
    group built through a :class:`StoppableStore`, by that view just before
    the group's first write. An attempt of a marked rank is refused before
    it counts itself in; it takes out what still counts it (a stale count
    must let no peer through) and says so in the store (``REFUSED_KEY``). A
    rank of the same configuration looks for that as it comes, every 0.5 s
    while it waits, at its deadline and before it marks itself, and is
    refused too; the view ends its waits with it. So every rank of a
    configuration after a complete one is refused, while a rank whose
    earlier attempts wrote nothing (given up, timed out, its worker killed)
    may come again (``where``: the address, for the message).

    Raises:
        PrefixReused: this rank built a native group at this prefix before,
            or another rank was refused here.
        TimeoutError: not every rank came by ``deadline`` (it names who did not).
        Stopped: ``stop`` completed.
    """
    mine = MEET_KEY.format(world=world_size, rank=rank)
    count = MEET_COUNT.format(world=world_size)
    who = f"{os.getpid()}-{threading.get_ident()}"
    if store.check([NATIVE_KEY.format(rank=rank)]):
        store.set(REFUSED_KEY, str(rank))
        _take_out(store, mine, count, who)
        raise reused_error(where, rank, f"rank {rank} built a group at this prefix before")

    def look() -> None:  # for a peer's refusal
        if store.check([REFUSED_KEY]):
            raise peer_refused(where, rank)

    token = f"{who}-{time.monotonic_ns()}"
    came = _come(store, mine, count, token)
    progress.step = "meet"
    # Polls back off from 0.2 ms to 50 ms (longer for large worlds: every
    # rank polls): ranks that come within milliseconds meet within a poll.
    cap = min(0.5, 0.05 * max(1.0, world_size / 64))
    delay = 0.0002
    looked_at = time.monotonic()
    try:
        look()  # a peer may have been refused before this rank came
        while came < world_size:
            now = time.monotonic()
            if now >= deadline:
                came = int(store.add(count, 0))  # one last look
                if came >= world_size:
                    break
                look()
                progress.detail = _missing(store, world_size)
                raise TimeoutError(f"{progress.detail} (this is rank {rank})")
            # names: for small worlds all along, for up to 64 near the end
            names = world_size <= 16 or (world_size <= 64 and deadline - now <= 0.6)
            if now - looked_at >= 0.5:
                looked_at = now
                look()
                if names:
                    progress.detail = _missing(store, world_size)
            if not names:
                progress.detail = f"{world_size - came} of {world_size} ranks never came"
            if stop_requested(stop, min(delay, deadline - now)):
                raise Stopped
            delay = min(delay * 1.5, cap)
            came = int(store.add(count, 0))
        if stop_requested(stop):  # all came (maybe at once), but nobody waits for this connect
            raise Stopped
        look()  # all came, maybe counted by a stale attempt among them
        if mark:
            mark_native(store, rank, token)
    except (Stopped, TimeoutError, PrefixReused):
        with contextlib.suppress(Exception):  # best effort: the store may be gone
            out = _OUT_PREFIX.decode() + token
            if store.compare_set(mine, token, out) == out.encode():  # still ours
                store.add(count, -1)
        raise


def _take_out(store: Store, key: str, count: str, by: str) -> None:
    """Take out whatever attempt of this rank counts it at ``key`` (a stale
    one, of a configuration before): swapped to ``out-...-by-<by>`` (a
    value of this take-out's own: two cannot both think they did it),
    then uncounted."""
    if not store.check([key]):
        return
    held: Any = store.get(key)  # bytes, passed back as they are
    if not held.startswith(_OUT_PREFIX):
        out = f"{_OUT_PREFIX.decode()}{held.decode(errors='replace')}-by-{by}"
        if store.compare_set(key, held, out) == out.encode():
            store.add(count, -1)


def mark_native(store: Store, rank: int, token: str = "") -> None:
    """Mark ``rank`` as having built (begun to write) a native group here."""
    store.set(NATIVE_KEY.format(rank=rank), token or "1")


def _come(store: Store, key: str, count: str, token: str) -> int:
    """Count this rank in, once; the count after.

    Counted first, then the key claimed: an attempt killed in between
    leaves the rank counted once too often (the others then wait in the
    native rendezvous), never uncounted for good. Where another attempt of
    this rank holds the key (and so counts it), this one takes it over and
    takes its own count back.
    """
    came = int(store.add(count, 1))
    mine = token.encode()
    held: Any = store.compare_set(key, "", token)  # bytes, passed back as they are
    for _ in range(64):  # each failed swap is another attempt's success
        if held == mine:
            return came
        if held.startswith(_OUT_PREFIX):  # taken out: this attempt's count stands
            swapped = store.compare_set(key, held, token)
            if swapped == mine:
                return came
        else:  # another attempt counts it: take the key over, uncount ours
            swapped = store.compare_set(key, held, token)
            if swapped == mine:
                return int(store.add(count, -1))
        # compare_set answers the expected value when the key is gone
        held = store.compare_set(key, "", token) if swapped == held else swapped
    raise RuntimeError(f"could not claim {key!r} in the store: it keeps changing")


def _missing(store: Store, world_size: int) -> str:
    """Who has not come, in words (ranks checked one by one up to 64)."""
    if world_size > 64:
        came = store.add(MEET_COUNT.format(world=world_size), 0)
        return f"{world_size - came} of {world_size} ranks never came to the store"
    missing = []
    for r in range(world_size):
        key = MEET_KEY.format(world=world_size, rank=r)
        if not store.check([key]) or store.get(key).startswith(_OUT_PREFIX):
            missing.append(r)
    if not missing:
        return f"all {world_size} ranks came to the store"
    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    return (
        f"{len(missing)} of {world_size} ranks never came to the store (rank {shown}): "
        "did each call configure() with this address and world size?"
    )


class StoppableStore(Store):
    """The store a native group is built through: ``store``, ending with its connect.

    torch 2.13's ``ProcessGroupGloo`` waits in the store for each peer's
    address (``wait``, then ``get``) until its own timeout, and nothing ends
    that wait early: a connect given up there (superseded, cancelled, timed
    out) held its control thread for the rest of its timeout. Here a wait
    polls the store (``check``, backing off from 0.2 ms to 50 ms, as
    :func:`meet` does) and raises :class:`Stopped` at the first poll after
    ``stop`` completed; any other call raises it too once ``stop`` has. A
    wait past its timeout raises c10d's own error.

    Two states: *stopping*, from construction, and *plain* once the group
    is built (:meth:`built`): every call then goes straight to ``store``
    (the group keeps this store for as long as it lives). ``stop`` is the
    configure attempt's: only the attempt completes it (``_configure``).

    ``refused``: while stopping, a wait also looks at the prefix's
    ``REFUSED_KEY`` every 0.5 s and raises ``refused()`` once a rank was
    refused there (its peers must not wait for it until their timeout); so
    does the group's first write. ``before_write``: called once, just
    before that first write (the rank marks itself: :func:`meet`), so a
    group given up before it wrote anything leaves no mark.
    :attr:`wrote`: whether the group wrote anything through it yet.
    """

    def __init__(
        self,
        store: Store,
        stop: concurrent.futures.Future[Any],
        refused: Callable[[], Exception] | None = None,
        before_write: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._store: Any = store  # Any: torch's stubs lack timeout, append and multi_set
        self._stop: concurrent.futures.Future[Any] | None = stop
        self._refused = refused
        self._before_write = before_write
        self.wrote = False

    def _write(self) -> None:
        """Before a write: stopped? refused? the first one marks the rank."""
        self._go_on()
        if self.wrote or self._stop is None:
            self.wrote = True
            return
        if self._refused is not None and self._store.check([REFUSED_KEY]):
            raise self._refused()
        if self._before_write is not None:
            self._before_write()
        self.wrote = True

    def built(self) -> None:
        """The native group is built: from now on, calls go straight to the store."""
        self._stop = None

    def _go_on(self) -> None:
        stop = self._stop
        if stop is not None and stop.done():
            raise Stopped

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        stop = self._stop
        if stop is None:
            self._store.wait(keys, *(() if timeout is None else (timeout,)))
            return
        seconds = (self._store.timeout if timeout is None else timeout).total_seconds()
        deadline = time.monotonic() + seconds if seconds > 0 else float("inf")  # 0: none
        delay = 0.0002
        looked_at = time.monotonic()
        while not self._store.check(keys):
            now = time.monotonic()
            if self._refused is not None and now - looked_at >= 0.5:
                looked_at = now
                if self._store.check([REFUSED_KEY]):
                    raise self._refused()
            remaining = deadline - now
            if remaining <= 0 and not stop.done():
                raise DistStoreError(f"wait timeout after {seconds * 1000:.0f}ms, keys: {keys}")
            if stop_requested(stop, min(delay, max(remaining, 0.0))):
                raise Stopped
            delay = min(delay * 1.5, 0.05)

    def get(self, key: str) -> bytes:
        self.wait([key])  # c10d's get waits for the key
        return self._store.get(key)  # type: ignore[no-any-return]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self._store.multi_get(keys)  # type: ignore[no-any-return]

    def set(self, key: str, value: Any) -> None:
        self._write()
        self._store.set(key, value)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._write()
        self._store.multi_set(keys, values)

    def add(self, key: str, value: int) -> int:
        self._write()
        return self._store.add(key, value)  # type: ignore[no-any-return]

    def append(self, key: str, value: Any) -> None:
        self._write()
        self._store.append(key, value)

    def check(self, keys: list[str]) -> bool:
        self._go_on()
        return self._store.check(keys)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        self._write()
        return self._store.compare_set(key, expected_value, desired_value)  # type: ignore[no-any-return]

    def delete_key(self, key: str) -> bool:
        self._write()
        return self._store.delete_key(key)  # type: ignore[no-any-return]

    def num_keys(self) -> int:
        self._go_on()
        return self._store.num_keys()  # type: ignore[no-any-return]
