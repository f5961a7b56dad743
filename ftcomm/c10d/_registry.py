"""Naming a facade group in torch's process-group registry.

Functional collectives resolve a group by name through c10d's C++ registry;
``torch.distributed`` calls (``broadcast(src=...)``, ``get_process_group_ranks``,
``DeviceMesh.from_group``) look groups up in ``distributed_c10d._world``. Both
are torch internals, so every touch of them lives here, with the rank mapping
(``pg_group_ranks``: global rank -> group rank) that :func:`refresh` rewrites at
every ``configure`` (:func:`global_ranks`, :class:`MemberRanks`). See
docs/migrating.md ("Registered rank mapping").
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
from torch.distributed import distributed_c10d as c10d

from .._store import connect_store, resolve_store_addr
from ..errors import CommAborted, CommFailed, CommTimeout
from ..group import config_of

if TYPE_CHECKING:
    from ..group import Group
    from ._base import ProcessGroup

_lock = threading.Lock()
# The groups entered in torch's tables without their members' default-group
# ranks yet (see check_entry), under _lock.
_provisional: weakref.WeakSet[ProcessGroup] = weakref.WeakSet()
any_provisional = False
"""Whether any entry was ever provisional: the facade's ops look no further
while none was (a plain read on their hot path)."""


def _rank_mapping(pg: ProcessGroup, initialized: bool) -> tuple[dict[int, int], bool]:
    """``pg``'s entry in ``pg_group_ranks`` (global rank -> group rank), and
    whether it is provisional: made without the members' default-group
    ranks, which a default group made later may contradict (see
    :func:`check_entry`). ``initialized``: whether a default group exists
    (read once by the caller, for the whole entry)."""
    # reach-in (here and in register): ProcessGroup's registry hooks, private so
    # that torchft's class names show users torch's API only (c10d/_base.py).
    if initialized:
        known = pg._members_global_ranks()  # reach-in: a registry hook
        if known:  # a facade group's members, found by an exchange
            return {g: i for i, g in enumerate(known)}, False
        # reach-in: a registry hook. Several members, not found yet: group ranks for now.
        if pg._ranks_pending():
            return {r: r for r in range(pg.size())}, True
        # one member, members apart (torchft's replica groups), or a group
        # that cannot say (a manager's): this rank alone
        return {dist.get_rank(): 0}, False
    try:
        size = pg.size()
    except RuntimeError:  # not configured yet: refreshed by configure()
        size = 0
    return {r: r for r in range(size)}, True  # no default group (yet): global = group ranks


def register(pg: ProcessGroup, group_name: str) -> None:
    """Enter ``pg`` under ``group_name``. Where ``pg`` was configured before
    the default group existed, its members' default-group ranks are
    exchanged first (every member must register, as torch's ``new_group``
    asks of every rank).

    Raises:
        ValueError: ``pg`` or ``group_name`` is registered already.
        CommTimeout: a member did not register within the group's timeout
            (where the exchange is needed).
        CommAborted: the group's configuration was over (errored, aborted,
            shut down or reconfigured) before or during the exchange.
        CommFailed: the store failed during the exchange.
    """
    world: Any = c10d._world  # torch's private registry tables
    with _lock:  # checked before the exchange, which may take a while
        _check_free(world, pg, group_name)
    initialized = dist.is_initialized()  # read once: the exchange and the entry agree
    # reach-in: a registry hook, outside the lock: it waits for the other members
    pg._settle_ranks(initialized)
    with _lock:
        _check_free(world, pg, group_name)  # another thread's register meanwhile
        # before any write: it may raise (a manager's size)
        ranks, provisional = _rank_mapping(pg, initialized)
        native = pg._c10d_backend()  # reach-in: a registry hook
        _register_process_group(group_name, pg)  # type: ignore[arg-type]  # a GroupName
        # torch's get_backend(pg) reads pg_map, get_backend_config(pg) the
        # config: the native backend's, as for c10d's own groups of it
        world.pg_map[pg] = (native[0] if native else group_name, None)
        world.pg_names[pg] = group_name
        world.pg_backend_config[pg] = f"{native[1]}:{native[0]}" if native else group_name
        world.pg_group_ranks[pg] = ranks
        _mark(pg, provisional)
        tag = f"ptd:{group_name}"
        world.pg_to_tag[pg] = tag
        world.tags_to_pg.setdefault(tag, []).append(pg)


def provisional(pg: ProcessGroup) -> bool:
    """Whether ``pg`` is in torch's tables without its members' default-group
    ranks yet: its ops check the entry first (:func:`check_entry`)."""
    return pg in _provisional


def _mark(pg: ProcessGroup, flag: bool) -> None:
    """Under ``_lock``: note whether ``pg``'s entry is provisional."""
    global any_provisional
    if flag:
        any_provisional = True
        _provisional.add(pg)
    else:
        _provisional.discard(pg)


def _check_free(world: Any, pg: ProcessGroup, group_name: str) -> None:
    if pg in world.pg_map:
        raise ValueError(f"{pg!r} is registered already (as {world.pg_names[pg]!r})")
    if group_name in world.pg_names.values():
        raise ValueError(f"a process group named {group_name!r} is registered already")


def check_entry(pg: ProcessGroup, op: str) -> None:
    """Before an op of ``pg`` whose entry is provisional (made without the
    members' default-group ranks), once a default group exists: where the
    right entry is known here (one member, members apart, ranks found
    since), write it. Otherwise the entry holds group ranks as global
    ranks: go on where that is true of this member (its default rank is
    its group rank), else abort the group (its peers' ops end at once, not
    at their deadline) and raise. Where it is true of every member taking
    part in an op, the entry is right for every rank they address; members
    of whom it is true read the others' global ranks wrong from torch's
    tables (``get_process_group_ranks``) until ``configure()``, which finds
    them. Local: no member waits for another.

    Raises:
        CommAborted: this member's default rank is not its group rank.
    """
    world: Any = c10d._world  # torch's private registry tables
    with _lock:
        if pg not in _provisional:
            return
        if pg not in world.pg_group_ranks:  # unregistered, or torch destroyed its tables
            _provisional.discard(pg)
            return
        if not dist.is_initialized():
            return
        try:
            ranks, provisional = _rank_mapping(pg, True)
            group_rank = pg.rank()
        except RuntimeError:  # not configured: the op says so itself
            return
        if not provisional:
            world.pg_group_ranks[pg] = ranks
            _provisional.discard(pg)
            return
        mine = dist.get_rank()
        if mine == group_rank:
            return
    error = CommAborted(
        f"{pg!r} was registered before the default process group existed, so torch's "
        f"tables hold its group ranks as global ranks, but this member's default-group "
        f"rank is {mine}, not its group rank {group_rank}. The group is aborted (its "
        "peers' ops end too): configure() it again on every member, which finds the "
        "members' default-group ranks",
        rank=group_rank,
        op=op,
    )
    pg.abort()
    raise error


def refresh(pg: ProcessGroup) -> None:
    """Update the rank mapping of a registered group after ``configure``
    (or ``register()``'s exchange), and of every registered wrapper around
    it (a wrapper's ranks are its group's, however that group was
    configured)."""
    world: Any = c10d._world  # torch's private registry tables
    initialized = dist.is_initialized()
    with _lock:
        stale = [pg]
        while stale:
            group = stale.pop()
            if group in world.pg_group_ranks:
                world.pg_group_ranks[group], provisional = _rank_mapping(group, initialized)
                _mark(group, provisional)
            else:
                _provisional.discard(group)
            # reach-in: the facade wrappers over this group (c10d/_groups.py's _inner)
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
        _provisional.discard(pg)
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
_RANK_KEY = "ftcomm/c10d/default-rank/{stage}/{rank}"
"""Where a member of a configuration writes its default-group rank (under
the configuration's own store prefix, beside the group's own keys), at
configure and again at register (the stage)."""


def _row(value: bytes) -> tuple[int, int, int]:
    rank, size, tag = (int(v) for v in value.decode().split(","))
    return rank, size, tag


class Superseded(Exception):
    """The configuration whose ranks were being exchanged is no longer the
    group's (an abort, a shutdown or another configure came)."""


class Unsettled:
    """:func:`global_ranks`' answer where a member had no default group:
    the default group may come after configure, and register() asks again."""


UNSETTLED = Unsettled()


@dataclass(frozen=True)
class Exchange:
    """Who asks, and where, in one configuration's exchange of ranks."""

    store_addr: str
    rank: int
    world_size: int
    given: tuple[int, ...] | None
    superseded: Callable[[], bool]
    """True once the configuration is no longer the group's (an abort, a
    shutdown or another configure came)."""


def _missing(store: Any, keys: list[str]) -> list[int]:
    return [r for r, key in enumerate(keys) if not store.check([key])]


def global_ranks(
    exchange: Exchange, deadline: float, stage: str = "configure"
) -> list[int] | Unsettled | None:
    """Every member's rank in the default group, by group rank; ``None``
    where they do not share one default world (torchft's replica groups:
    each its own job, their ranks repeat) or ``given`` does not name this
    rank's (torchft's Manager passes replica-major numbers, not ranks);
    :data:`UNSETTLED` where a member has no default group (yet).

    Exchanged in the configuration's store, not over the group (no op a
    user sees in stats, events or a fault plan's op count), by every member
    alike, with a default group or not (then ``(-1, 0, mark)``): a member
    that skipped it would leave the others waiting. Each member writes
    (default rank, default world size, job mark) and reads everyone's:
    trusted when the ranks are distinct and within one world size, and the
    marks agree. Every member reads the same rows, so every member decides
    alike. Blocks the calling thread until ``deadline`` (``time.monotonic()``)
    at most, and looks at ``exchange.superseded()`` every few milliseconds.

    Raises:
        TimeoutError: the store or a member did not answer by the deadline
            (the message names the members that did not).
        Superseded: ``exchange.superseded()`` said so first.
        RuntimeError: the store failed (c10d's ``DistError``).
    """
    me = (-1, 0, _job_tag())
    if dist.is_initialized():
        me = (dist.get_rank(), dist.get_world_size(), _job_tag())
    if exchange.world_size == 1:  # nobody to ask (a dummy group has no store at all)
        rows = [me]
    else:
        store = connect_store(
            resolve_store_addr(exchange.store_addr), max(deadline - time.monotonic(), 0.01)
        )
        try:
            keys = [_RANK_KEY.format(stage=stage, rank=r) for r in range(exchange.world_size)]
            store.set(keys[exchange.rank], ",".join(map(str, me)))
            while not store.check(keys):
                if exchange.superseded():
                    raise Superseded
                if time.monotonic() >= deadline:
                    try:
                        who = f"group rank(s) {_missing(store, keys)}"
                    except RuntimeError:  # the store failed as well: say what is known
                        who = "some group ranks"
                    raise TimeoutError(
                        f"the member(s) of {who} did not say their default-group rank in time"
                    )
                time.sleep(_POLL)
            rows = [_row(bytes(r)) for r in store.multi_get(keys)]
        finally:
            del store  # the connection closes with it, whatever is raised
    ranks = [r for r, _, _ in rows]
    if any(r < 0 for r in ranks):
        return UNSETTLED
    one_world = len({(w, tag) for _, w, tag in rows}) == 1
    if not one_world or len(set(ranks)) != len(ranks) or not all(0 <= r < me[1] for r in ranks):
        return None
    if exchange.given is not None and list(exchange.given) != ranks:
        return None
    return ranks


class MemberRanks:
    """A facade's members' default-group ranks, by group rank, for torch's
    tables (:func:`register`, :func:`refresh`); one lock. At each configure,
    :meth:`configure` exchanges them. Where a member had no default group
    then, the exchange is kept, pending: :meth:`settle` (at ``register()``)
    asks again once this process has a default group. Then every member
    must register, as every rank must call torch's ``new_group``.

    The default group may come later than either step; what finds the mapping:

    | order                                  | what finds the mapping                          |
    |----------------------------------------|-------------------------------------------------|
    | default group, configure, register     | configure's exchange                            |
    | default group, register, configure     | configure's exchange, then :func:`refresh`      |
    | register, default group, configure     | configure's exchange, then :func:`refresh`      |
    | configure, default group, register     | register's exchange (every member registers)    |
    | configure and register (either first), | entered provisionally as ``{r: r}``; at each op |
    | then the default group                 | :func:`check_entry` writes an entry known here  |
    |                                        | (one member, apart), or lets a member of which  |
    |                                        | ``{r: r}`` is true go on, or aborts the group;  |
    |                                        | the next configure's exchange finds the ranks   |

    Its own states:

    | state   | ``ranks``  | ``pending``   | after                                  |
    |---------|------------|---------------|----------------------------------------|
    | none    | ``None``   | ``None``      | no configure yet; members apart; or a  |
    |         |            |               | member with no default group at settle |
    | found   | the ranks  | ``None``      | an exchange that every member answered |
    |         |            |               | with a default rank of one world       |
    | pending | ``None``   | the exchange  | a configure where a member had none    |

    Every transition is a whole assignment of both under the lock, and only
    for the configuration current then (an exchange of a superseded one
    changes nothing).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: list[int] | None = None
        self._pending: Exchange | None = None

    def found(self) -> list[int] | None:
        """The members' default-group ranks, or ``None`` (none, apart, pending)."""
        with self._lock:
            return self._ranks

    def pending(self) -> bool:
        """Whether the ranks of several members are still to be found."""
        with self._lock:
            return self._pending is not None and self._pending.world_size > 1

    def configure(
        self,
        group: Group,
        store_addr: str,
        rank: int,
        world_size: int,
        given: Sequence[int] | None,
        deadline: float,
        timeout: float,
    ) -> None:
        """The exchange of ``group``'s new configuration, by every member
        alike (see :func:`global_ranks`), by ``deadline`` (``timeout``
        seconds after configure() began).

        Raises:
            CommAborted: the configuration was superseded (abort, shutdown or
                another configure).
            CommTimeout, CommFailed: a member or the store did not answer,
                or failed: the configuration is aborted.
        """
        # Weakly: a pending exchange must not keep an old configuration
        # alive after shutdown() or another configure().
        current = config_of(group)
        config = weakref.ref(current) if current is not None else None

        def superseded() -> bool:  # by abort(), shutdown() or another configure()
            now = config_of(group)
            return (
                now is None or config is None or config() is not now or group.errored() is not None
            )

        ranks = tuple(given) if given is not None else None
        exchange = Exchange(store_addr, rank, world_size, ranks, superseded)
        with self._lock:
            self._ranks, self._pending = None, None
        try:
            found = global_ranks(exchange, deadline)
        except Superseded:
            why = "configure was superseded (abort, shutdown or another configure)"
            raise CommAborted(why, rank=rank, op="configure") from None
        except (TimeoutError, RuntimeError) as exc:  # a member or the store went away
            if not superseded():  # this configuration's own failure: it is broken
                group.abort()
            timed_out = isinstance(exc, TimeoutError)
            kind = CommTimeout if timed_out else CommFailed
            what = f"timed out after {timeout:g} seconds" if timed_out else "failed"
            raise kind(f"configure {what}: {exc}", rank=rank, op="configure") from exc
        with self._lock:
            if not exchange.superseded():  # else a later configure owns the state
                if isinstance(found, Unsettled):
                    self._ranks, self._pending = None, exchange
                else:
                    self._ranks, self._pending = found, None

    def settle(self, initialized: bool, timeout: float) -> bool:
        """At register(): where the last configure's exchange is pending and
        a default group exists now (``initialized``), exchange again (every
        member). Returns whether the ranks were settled here.

        Raises:
            CommTimeout: a member did not register within ``timeout`` seconds.
            CommAborted: the configuration was over (errored, aborted, shut
                down or reconfigured) before or during the exchange.
            CommFailed: the store failed.
        """
        with self._lock:
            exchange = self._pending
        if exchange is None or not initialized:
            return False
        rank = exchange.rank
        over = (
            "the group's configuration is over (errored, aborted, shut down or "
            "reconfigured): configure() it again, which finds the members' default-group ranks"
        )
        if exchange.superseded():
            why = f"register() needs the members' default-group ranks, and {over}"
            raise CommAborted(why, rank=rank, op="register")
        try:
            found = global_ranks(exchange, time.monotonic() + timeout, stage="register")
        except Superseded:
            raise CommAborted(f"register(): meanwhile, {over}", rank=rank, op="register") from None
        except TimeoutError as exc:
            raise CommTimeout(
                f"register() timed out after {timeout:g} seconds: the default group came "
                f"after configure(), so every member says its default-group rank at "
                f"register(), and {exc} (one that registers with no default group of its "
                "own says none). Call register() on every member once each has its default "
                "group, or configure() after init_process_group()",
                rank=rank,
                op="register",
            ) from exc
        except RuntimeError as exc:
            raise CommFailed(f"register() failed: {exc}", rank=rank, op="register") from exc
        with self._lock:
            if self._pending is not exchange or exchange.superseded():
                raise CommAborted(f"register(): meanwhile, {over}", rank=rank, op="register")
            # a member with no default group (Unsettled): the members are apart
            self._ranks = None if isinstance(found, Unsettled) else found
            self._pending = None
        return True
