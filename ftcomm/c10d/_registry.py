"""Naming a facade group in torch's process-group registry.

Functional collectives resolve a group by name through c10d's C++ registry;
``torch.distributed`` calls (``broadcast(src=...)``, ``get_process_group_ranks``,
``DeviceMesh.from_group``) look groups up in ``distributed_c10d._world``. Both
are torch internals, so every touch of them lives here.

Rank mapping (``pg_group_ranks``: global rank -> group rank), refreshed at
every ``configure``: with a default process group (``init_process_group``),
the members' global ranks, found by :func:`global_ranks` (an exchange in
the new configuration's store, by every member), so that ``src``/``dst`` (global) and
``group_src``/``group_dst`` mean what they mean for torch's own groups and
DeviceMesh sees the group's real ranks. A group whose members do not share
one default world (torchft's replica groups), or that cannot say (a
wrapper over a manager), is entered as torchft enters it: this process's
global rank alone. Without a default group, global and group ranks are the
same: ``{r: r}``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
from torch.distributed import distributed_c10d as c10d

from .._store import connect_store, resolve_store_addr

if TYPE_CHECKING:
    from ._base import ProcessGroup

_lock = threading.Lock()


def _rank_mapping(pg: ProcessGroup) -> dict[int, int]:
    if dist.is_initialized():
        known = pg._members_global_ranks()
        if known:  # a facade group's members, found at configure
            return {g: i for i, g in enumerate(known)}
        return {dist.get_rank(): 0}  # a group that cannot say (a manager's): this rank alone
    try:
        size = pg.size()
    except RuntimeError:  # not configured yet: refreshed by configure()
        size = 0
    return {r: r for r in range(size)}


def register(pg: ProcessGroup, group_name: str) -> None:
    """Enter ``pg`` under ``group_name``.

    Raises:
        ValueError: ``pg`` or ``group_name`` is registered already.
    """
    world: Any = c10d._world  # torch's private registry tables
    with _lock:
        if pg in world.pg_map:
            raise ValueError(f"{pg!r} is registered already (as {world.pg_names[pg]!r})")
        if group_name in world.pg_names.values():
            raise ValueError(f"a process group named {group_name!r} is registered already")
        ranks = _rank_mapping(pg)  # before any write: it may raise (a manager's size)
        native = pg._c10d_backend()
        _register_process_group(group_name, pg)  # type: ignore[arg-type]  # a GroupName
        # torch's get_backend(pg) reads pg_map, get_backend_config(pg) the
        # config: the native backend's, as for c10d's own groups of it
        world.pg_map[pg] = (native[0] if native else group_name, None)
        world.pg_names[pg] = group_name
        world.pg_backend_config[pg] = f"{native[1]}:{native[0]}" if native else group_name
        world.pg_group_ranks[pg] = ranks
        tag = f"ptd:{group_name}"
        world.pg_to_tag[pg] = tag
        world.tags_to_pg.setdefault(tag, []).append(pg)


def refresh(pg: ProcessGroup) -> None:
    """Update the rank mapping of a registered group after ``configure``,
    and of every registered wrapper around it (a wrapper's ranks are its
    group's, however that group was configured)."""
    world: Any = c10d._world  # torch's private registry tables
    with _lock:
        stale = [pg]
        while stale:
            group = stale.pop()
            if group in world.pg_group_ranks:
                world.pg_group_ranks[group] = _rank_mapping(group)
            stale += [w for w in world.pg_group_ranks if getattr(w, "_inner", None) is group]


def unregister(pg: ProcessGroup) -> str:
    """Forget ``pg``'s entry; returns the name it had.

    Raises:
        ValueError: ``pg`` is not registered.
    """
    world: Any = c10d._world  # torch's private registry tables
    with _lock:
        name: str | None = world.pg_names.get(pg)
        if name is None:
            raise ValueError(f"{pg!r} is not registered: call register(name) first")
        _unregister_process_group(name)  # type: ignore[arg-type]  # a GroupName
        for table in (world.pg_map, world.pg_names, world.pg_backend_config, world.pg_group_ranks):
            table.pop(pg, None)
        tag = world.pg_to_tag.pop(pg, None)
        members = world.tags_to_pg.get(tag, []) if tag is not None else []
        if pg in members:
            members.remove(pg)
        if tag is not None and not members:
            world.tags_to_pg.pop(tag, None)
        return name


def _job_tag() -> int:
    """This job's mark: members of one default world share it (torchrun's
    run id where there is one; 0 elsewhere)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return int.from_bytes(hashlib.sha256(run.encode()).digest()[:7], "big") if run else 0


_POLL = 0.002
"""Seconds between two looks for the other members' rows."""
_RANK_KEY = "ftcomm/c10d/default-rank/{rank}"
"""Where a member of a configuration writes its default-group rank (under
the configuration's own store prefix, beside the group's own keys)."""


def _row(value: bytes) -> tuple[int, int, int]:
    rank, size, tag = (int(v) for v in value.decode().split(","))
    return rank, size, tag


class Superseded(Exception):
    """The configuration whose ranks were being exchanged is no longer the
    group's (an abort, a shutdown or another configure came)."""


def global_ranks(
    store_addr: str,
    rank: int,
    world_size: int,
    given: Sequence[int] | None,
    deadline: float,
    superseded: Callable[[], bool],
) -> list[int] | None:
    """Every member's rank in the default group, by group rank, or ``None``
    where they do not share one default world (torchft's replica groups:
    each its own job, their ranks repeat) or ``given`` does not name this
    rank's (torchft's Manager passes replica-major numbers, not ranks).

    Exchanged in the configuration's store, not over the group (no op a
    user sees in stats, events or a fault plan's op count), by every member
    alike, with a default group or not (then ``(-1, 0, mark)``): a member
    that skipped it would leave the others waiting. Each member writes
    (default rank, default world size, job mark) and reads everyone's:
    trusted when the ranks are distinct and within one world size, and the
    marks agree. Every member reads the same rows, so every member decides
    alike. Blocks the calling thread until ``deadline`` (``time.monotonic()``)
    at most, and looks at ``superseded()`` every few milliseconds.

    Raises:
        TimeoutError: the store or a member did not answer by the deadline.
        Superseded: ``superseded()`` said so first.
        RuntimeError: the store failed (c10d's ``DistError``).
    """
    me = (-1, 0, _job_tag())
    if dist.is_initialized():
        me = (dist.get_rank(), dist.get_world_size(), _job_tag())
    if world_size == 1:  # nobody to ask (a dummy group has no store at all)
        rows = [me]
    else:
        store = connect_store(
            resolve_store_addr(store_addr), max(deadline - time.monotonic(), 0.01)
        )
        try:
            keys = [_RANK_KEY.format(rank=r) for r in range(world_size)]
            store.set(keys[rank], ",".join(map(str, me)))
            while not store.check(keys):
                if superseded():
                    raise Superseded
                if time.monotonic() >= deadline:
                    raise TimeoutError("a member did not say its default-group rank in time")
                time.sleep(_POLL)
            rows = [_row(bytes(r)) for r in store.multi_get(keys)]
        finally:
            del store  # the connection closes with it, whatever is raised
    ranks = [r for r, _, _ in rows]
    one_world = len({(w, tag) for _, w, tag in rows}) == 1
    if not one_world or len(set(ranks)) != len(ranks) or not all(0 <= r < me[1] for r in ranks):
        return None
    if given is not None and [int(r) for r in given] != ranks:
        return None
    return ranks
