"""Naming a facade group in torch's process-group registry.

Functional collectives resolve a group by name through c10d's C++ registry;
``torch.distributed`` calls (``broadcast(src=...)``, ``get_process_group_ranks``,
``DeviceMesh.from_group``) look groups up in ``distributed_c10d._world``. Both
are torch internals, so every touch of them lives here.

Rank mapping (``pg_group_ranks``: global rank -> group rank), refreshed at
every ``configure``: with a default process group (``init_process_group``),
the members' global ranks, found by :func:`global_ranks` (one allgather
over the new configuration), so that ``src``/``dst`` (global) and
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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
from torch.distributed import distributed_c10d as c10d

if TYPE_CHECKING:
    from ..group import Group

_lock = threading.Lock()


def _rank_mapping(pg: dist.ProcessGroup) -> dict[int, int]:
    if dist.is_initialized():
        known: list[int] | None = getattr(pg, "_global_ranks", None)
        if known:  # a facade group's members, found at configure
            return {g: i for i, g in enumerate(known)}
        return {dist.get_rank(): 0}  # a group that cannot say (a manager's): this rank alone
    try:
        size = pg.size()
    except RuntimeError:  # not configured yet: refreshed by configure()
        size = 0
    return {r: r for r in range(size)}


def register(pg: dist.ProcessGroup, group_name: str) -> None:
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
        answer = getattr(pg, "_c10d_backend", None)  # ftcomm's groups have it
        native: tuple[str, str] | None = answer() if answer is not None else None
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


def refresh(pg: dist.ProcessGroup) -> None:
    """Update the rank mapping of a registered group after ``configure``."""
    world: Any = c10d._world  # torch's private registry tables
    with _lock:
        if pg in world.pg_group_ranks:
            world.pg_group_ranks[pg] = _rank_mapping(pg)


def unregister(pg: dist.ProcessGroup) -> str:
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


async def global_ranks(
    group: Group, device: int | None, given: Sequence[int] | None
) -> list[int] | None:
    """Every member's rank in the default group, by group rank, or ``None``
    where they do not share one default world (torchft's replica groups:
    each its own job, their ranks repeat) or ``given`` does not name this
    rank's (torchft's Manager passes replica-major numbers, not ranks).

    One allgather over the new configuration (on the group's device) of
    (default rank, default world size, job mark): trusted when the ranks
    are distinct and within one world size, and the marks agree."""
    where = torch.device("cpu")
    if device is not None:
        where = torch.device(group._backend_cls.device_type, device)
    me = (dist.get_rank(), dist.get_world_size(), _job_tag())
    mine = torch.tensor(me, dtype=torch.int64, device=where)
    rows = [tuple(int(v) for v in t.tolist()) for t in await group.allgather(mine)]
    ranks = [r for r, _, _ in rows]
    one_world = len({(w, tag) for _, w, tag in rows}) == 1
    if not one_world or len(set(ranks)) != len(ranks) or not all(0 <= r < me[1] for r in ranks):
        return None
    if given is not None and [int(r) for r in given] != ranks:
        return None
    return ranks
