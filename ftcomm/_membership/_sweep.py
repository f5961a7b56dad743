"""Old generations' keys, deleted: the store engine's garbage collector.

Owns: the key ``floor`` of a job (every generation below it is swept) and
:func:`sweep`. Once generation ``g`` is kept, its rank 0's watcher raises
``floor`` to ``g - 1`` and then deletes every key of the generations below
it: the job's (``ready``, ``world``, ``quit``, ``reach``, ``cut``,
``sus``, ``fate``, ``chk``) and their groups' (``ftcomm/groups/<job>/g<n>/``,
Gloo's and the meet's). Generation ``g - 1`` stays: its
members left out of ``g`` read ``cut``, ``fate`` and ``world`` of it and
of ``g`` to learn why.

A member that reads a generation below ``floor`` (it was stopped for two
generations or more) takes it as swept: it was dropped
(:meth:`StoreEngine.agree`). ``floor`` is raised before any key goes, and
every read of a decided world looks at ``floor`` after it, so a world
proposed again into a swept generation's deleted key is never taken; the
next sweep deletes it. The sweep needs ``Store.list_keys`` (torch 2.10
and later); without it nothing is swept.
"""

from __future__ import annotations

import logging
from typing import Any

from ._watch import read

log = logging.getLogger("ftcomm")

FLOOR = "floor"
"""The lowest generation whose keys are kept (``0``, or no key: none swept)."""

PER_GENERATION = ("ready", "world", "quit", "reach", "cut", "sus", "fate", "chk")
"""The first part of each per-generation key of a job: ``<name>/<g>[/...]``."""

MAX_DELETES = 512
"""Keys one sweep deletes at most (the rest: the next sweep): it runs on the
watcher's thread, between two heartbeat rounds."""


def generation_of(key: str) -> int | None:
    """The generation of a job's per-generation key (``None``: not one)."""
    name, _, rest = key.partition("/")
    if name not in PER_GENERATION:
        return None
    number = rest.partition("/")[0]
    return int(number) if number.isdigit() else None


def group_generation_of(key: str) -> int | None:
    """The generation of a key under the job's groups' prefix (``g<n>/...``)."""
    head, slash, _ = key.partition("/")
    if not slash or not head.startswith("g") or not head[1:].isdigit():
        return None
    return int(head[1:])


def _below(generation: int | None, floor: int) -> bool:
    return generation is not None and generation < floor


def floor(store: Any) -> int:
    """The job's ``floor`` (0: nothing swept yet)."""
    held = read(store, FLOOR)
    return int(held) if held is not None and held.isdigit() else 0


FLOOR_EVERY = 1.0
"""Seconds between two looks at ``floor`` while a generation is awaited."""


class FloorCheck:
    """An agreeing member's looks at ``floor``: whether the generation it
    reads was swept. It looks when it comes to a generation, after it read
    that generation decided, and every :data:`FLOOR_EVERY` s while it waits
    (a member stopped while it waited may find the world it waited for
    decided, kept past and swept: its key gone)."""

    def __init__(self) -> None:
        self._generation = -1
        self._looked = 0.0

    def swept(self, store: Any, generation: int, decided: bool, now: float) -> bool:
        if decided or generation != self._generation or now - self._looked >= FLOOR_EVERY:
            self._generation, self._looked = generation, now
            return generation < floor(store)
        return False


def raise_floor(store: Any, to: int) -> int:
    """Move ``floor`` up to ``to`` (never down); the floor it holds after."""
    for _ in range(64):
        held = read(store, FLOOR)
        now = int(held) if held is not None and held.isdigit() else 0
        if now >= to:
            return now
        expected = held.decode() if held is not None else ""
        if store.compare_set(FLOOR, expected, str(to)) == str(to).encode():
            return to
    return floor(store)


def can_sweep(store: Any) -> bool:
    """Whether the store can list its keys (torch 2.10 and later)."""
    return callable(getattr(store, "list_keys", None))


def sweep(store: Any, groups: Any, below: int) -> int:
    """Raise ``floor`` to ``below``, then delete the job's keys (``store``:
    scoped to the job) and its groups' keys (``groups``: scoped to
    ``ftcomm/groups/<job>/``) of every generation below the floor.
    Returns the keys deleted.

    Raises:
        RuntimeError, OSError: the store failed (the watcher keeps it as
            the store's loss, as for its other ops).
    """
    if not can_sweep(store):
        return 0
    below = raise_floor(store, below)
    doomed = [key for key in store.list_keys() if _below(generation_of(key), below)]
    deleted = 0
    for key in doomed[:MAX_DELETES]:
        deleted += bool(store.delete_key(key))
    if groups is not None and len(doomed) < MAX_DELETES:
        left = MAX_DELETES - len(doomed)
        old = [k for k in groups.list_keys() if _below(group_generation_of(k), below)]
        for key in old[:left]:
            deleted += bool(groups.delete_key(key))
    return deleted
