"""``ftcomm.Membership``: who is in the world, agreed, and the group configured for it.

Owns: the public :class:`Membership` (its :class:`World` and argument
checks are ``_names``'), one call at a time per membership, and the step
from an agreed generation to a configured group (``_keep`` configures it
and keeps it). The agreement itself is the engine's (``_store_engine``,
``_lighthouse``, ``_etcd_engine``); each of its blocking calls runs on a
control thread of its own (spawned, so that waits never queue). See
docs/membership.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from .._etcd import SCHEME as ETCD_SCHEME
from .._etcd import parse_etcd_addr
from .._runtime.deadline import Timeout, resolve, to_seconds
from .._runtime.loop import get_runtime
from .._store import parse_store_addr
from ..errors import CommError, Evicted, MembershipError, MembershipTimeout
from ..group import Group, abort_config, config_of
from . import _keep, _state_copy
from ._engine import Engine, Stopped
from ._etcd_engine import EtcdEngine
from ._lighthouse import LighthouseEngine, is_lighthouse
from ._names import ENV_NAMES, World, check_name, check_size
from ._reach import PROBE_TIMEOUT
from ._rule import NO_CAP, Member, WorldRecord
from ._store_engine import StoreEngine

T = TypeVar("T")
S = TypeVar("S")

log = logging.getLogger("ftcomm")

CUT_BACKOFF = 1.0
"""Seconds a member left out for paths cut waits before it tries to come
in again; twice as long each further time in a row, up to
:data:`CUT_BACKOFF_MAX`, so that a flapping link does not stall the others
at every generation."""
CUT_BACKOFF_MAX = 30.0
CUT_FORGET = 300.0
"""A member not left out for this many seconds starts from one backoff again."""


class Membership:
    """Members of a job agree on who is in the world, generation by generation.

    ``async with Membership(address, job, member_id, min_size, max_size)``
    starts this member's heartbeat and ends it (saying it left) on exit.
    Then ``world = await members.join(group)`` waits for a generation with
    this member and configures ``group`` for it; after a ``CommError``,
    ``world = await members.recover(group)`` forms the next one with those
    still alive; ``await members.pending()`` at a step boundary says (the
    same on every member) whether newcomers wait or a member died, so that
    every member calls ``recover()`` at the same point;
    ``await members.sync_state(state, step)`` gives the members behind the
    state of the ones furthest ahead, in place into their own tensors.

    Args:
        address: the engine: a c10d store's ``host:port[/prefix]``, a torchft
            lighthouse's ``http://host:port``, or an etcd cluster's
            ``etcd://host:port[,host:port...][/prefix]`` (docs/membership.md,
            "Engines").
        job: the job's name, the same on every member of the job.
        member_id: this member's id, unique among the job's live members (a
            restarted member may take its old id again).
        min_size: the fewest members a generation may have.
        max_size: the most (``None``: no limit); newcomers beyond it wait.
        join_window: seconds a first generation waits for more members once
            ``min_size`` are there, and a recovery for a member alive but not
            there.
        heartbeat_timeout: seconds of silence after which a member is dead.
        heartbeat_interval: seconds between heartbeats, a fifth of
            ``heartbeat_timeout`` by default and at most a third of it
            (docs/membership.md, "Its settings, and their defaults").
        timeout: the default deadline of each call, in seconds.
        store_host: lighthouse engine only: the address the store this member
            hosts for its groups listens on.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an empty or malformed id, job or address, ``min_size`` >
            ``max_size``, a heartbeat timeout that is not positive, a
            heartbeat interval over a third of its timeout, or a negative or
            non-finite duration.
    """

    def __init__(
        self,
        address: str,
        job: str,
        member_id: str,
        min_size: int = 1,
        max_size: int | None = None,
        *,
        join_window: Timeout = 2.0,
        heartbeat_timeout: Timeout = 1.0,
        heartbeat_interval: Timeout | None = None,
        timeout: Timeout = 60.0,
        store_host: str = "127.0.0.1",
    ) -> None:
        self.job = check_name(job, "job")
        self.member_id = check_name(member_id, "member_id")
        self.min_size = check_size(min_size, "min_size")
        self.max_size = None if max_size is None else check_size(max_size, "max_size")
        if self.max_size is not None and self.min_size > self.max_size:
            raise ValueError(f"min_size ({min_size}) must not exceed max_size ({max_size})")
        self._window = to_seconds(join_window, "join_window")
        self._hb_timeout = to_seconds(heartbeat_timeout, "heartbeat_timeout")
        if self._hb_timeout <= 0:
            raise ValueError("heartbeat_timeout must be > 0 seconds")
        self._hb_interval = resolve(heartbeat_interval, self._hb_timeout / 5, "heartbeat_interval")
        if not 0 < self._hb_interval <= self._hb_timeout / 3:
            raise ValueError(
                f"heartbeat_interval must be > 0 and at most a third of heartbeat_timeout "
                f"({self._hb_timeout:g} s), got {self._hb_interval:g}"
            )
        self._timeout = to_seconds(timeout, "timeout")
        self._me = Member.fresh(self.member_id)  # the engine's is the current one
        self._engine: Engine
        if isinstance(address, str) and is_lighthouse(address):
            if not isinstance(store_host, str):
                raise TypeError(f"store_host must be a str, got {type(store_host).__name__}")
            self._engine = LighthouseEngine(
                address,
                self.job,
                self._me,
                heartbeat_interval=self._hb_interval,
                store_host=store_host,
            )
        elif isinstance(address, str) and address.startswith(ETCD_SCHEME):
            self._engine = EtcdEngine(
                parse_etcd_addr(address, "address"),
                self.job,
                self._me,
                heartbeat_interval=self._hb_interval,
                heartbeat_timeout=self._hb_timeout,
            )
        else:
            self._engine = StoreEngine(
                parse_store_addr(address, "address"),
                self.job,
                self._me,
                heartbeat_interval=self._hb_interval,
                heartbeat_timeout=self._hb_timeout,
            )
        self._lock = threading.Lock()  # guards _busy, _running and _state
        self._busy: str | None = None  # the call in progress
        self._running: tuple[threading.Event, concurrent.futures.Future[Any]] | None = None
        self._state = "new"  # new -> opening -> open -> closed
        self._record: WorldRecord | None = None
        self._world: World | None = None
        self._group: Group | None = None
        self._checks = 0
        self._cuts = 0  # times in a row it was left out for paths cut (_form)
        self._last_cut = 0.0

    def __repr__(self) -> str:
        where = f"generation {self._world.generation}" if self._world else "no world"
        return f"<ftcomm.Membership {self.job}/{self.member_id} {self._state}, {where}>"

    @property
    def world(self) -> World | None:
        """The generation this member is in (``None`` before ``join()``, after eviction)."""
        return self._world

    @classmethod
    def from_env(
        cls,
        *,
        min_size: int | None = None,
        max_size: int | None = None,
        join_window: Timeout = 2.0,
        heartbeat_timeout: Timeout = 1.0,
        heartbeat_interval: Timeout | None = None,
        timeout: Timeout = 60.0,
        store_host: str | None = None,
    ) -> Membership:
        """This member of a job that ``python -m ftcomm run`` started: the
        engine, job, member id and sizes from the environment it sets
        (``FTCOMM_ENGINE``, ``FTCOMM_JOB``, ``FTCOMM_MEMBER_ID``,
        ``FTCOMM_MIN_SIZE``, ``FTCOMM_MAX_SIZE``, and for a lighthouse
        engine ``FTCOMM_STORE_HOST``; docs/running.md), so a script names no
        address. ``min_size``, ``max_size`` and ``store_host`` given here win
        over the environment's; the other arguments are ``Membership()``'s.

        Raises:
            ValueError: a variable it needs is not set (the script was not
                started by ``python -m ftcomm run``), or one is malformed;
                and as ``Membership()``.
            TypeError: as ``Membership()``.
        """
        env = {name: os.environ.get(f"FTCOMM_{name.upper()}", "") for name in ENV_NAMES}
        missing = [f"FTCOMM_{n.upper()}" for n in ("engine", "job", "member_id") if not env[n]]
        if missing:
            raise ValueError(
                f"{', '.join(missing)} not set: start this script with `python -m ftcomm run "
                "--nproc N script.py` (docs/running.md), or build ftcomm.Membership(address, "
                "job, member_id) yourself"
            )

        def size(name: str, given: int | None) -> int | None:
            if given is not None or not env[name]:
                return given
            try:
                return int(env[name])
            except ValueError:
                raise ValueError(
                    f"FTCOMM_{name.upper()} must be an int, got {env[name]!r}"
                ) from None

        least = size("min_size", min_size)
        return cls(
            env["engine"],
            env["job"],
            env["member_id"],
            1 if least is None else least,
            size("max_size", max_size),
            join_window=join_window,
            heartbeat_timeout=heartbeat_timeout,
            heartbeat_interval=heartbeat_interval,
            timeout=timeout,
            store_host=store_host or env["store_host"] or "127.0.0.1",
        )

    # -- lifecycle --------------------------------------------------------

    async def __aenter__(self) -> Membership:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self, *, timeout: Timeout | None = None) -> None:
        """Connect to the engine, check the id is free, start the heartbeat.

        Raises:
            MembershipError: the engine does not answer (refused: at once).
            ValueError: a live member of the job already has this id.
            RuntimeError: already open, or closed.
        """
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"this membership is already {self._state}")
            self._state = "opening"
        seconds = resolve(timeout, min(self._timeout, 10.0))
        try:
            engine, until = self._engine, time.monotonic() + seconds
            await self._call(lambda stop: engine.open(seconds, stop), deadline=until)
            with self._lock:
                closed = self._state == "closed"  # close() ran meanwhile
                if not closed:
                    self._state = "open"
            if closed:
                raise MembershipError(
                    f"membership {self.job}/{self.member_id} was closed while it opened"
                )
        except BaseException:
            await self._blocking(self._engine.close)
            with self._lock:
                self._state = "closed"
            raise

    async def close(self) -> None:
        """Stop the heartbeat and tell the others this member left. Idempotent.

        A call still running (in another task) ends first, with a
        :class:`~ftcomm.errors.MembershipError`. The group is not touched:
        shut it down yourself.
        """
        with self._lock:
            if self._state == "closed":
                return
            self._state = "closed"
            running = self._running
        if running is not None:
            stop, future = running
            stop.set()
            with contextlib.suppress(BaseException):
                await asyncio.shield(asyncio.wrap_future(future))
        await self._blocking(self._engine.close)
        self._world = self._record = None

    # -- the calls --------------------------------------------------------

    async def join(self, group: Group, *, timeout: Timeout | None = None) -> World:
        """Wait for a generation that has this member, and configure ``group`` for it.

        Returns once ``max_size`` members are there, or ``min_size`` are and
        the join window has passed (while a world runs, at the step where
        its members call ``recover()`` after ``pending()`` said so).
        Call it again after :class:`~ftcomm.errors.Evicted` to come back.
        A join that is cancelled after its generation was formed tells
        that generation's other members, which then form the next one.

        Raises:
            MembershipTimeout: no such generation by the deadline, or this
                member cannot reach the running world's members by then
                (it waits until it can before it asks in).
            MembershipError: the engine went away, the membership was
                closed meanwhile, or this member was given up for dead and
                another process took its id.
            TypeError: ``group`` is not an :class:`ftcomm.Group`.
            RuntimeError: not open, already in a world (use ``recover()``),
                or another call of this membership is running.
        """
        with self._call_slot("join"):
            if self._world is not None:
                raise RuntimeError(
                    f"member {self.member_id!r} is in generation {self._world.generation} "
                    "already: after a failure, call recover()"
                )
            deadline = time.monotonic() + resolve(timeout, self._timeout)
            group = self._check_group(group)
            return await self._form(group, None, None, deadline)

    async def recover(self, group: Group, *, timeout: Timeout | None = None) -> World:
        """Form the next generation with the members still alive, and configure ``group``.

        Call it on every member after a ``CommError`` (or when ``pending()``
        says so). A member that died (its heartbeat stopped) or that does
        not come within the join window is left out; newcomers waiting are
        let in. A recover cancelled once it said it was ready (not one that
        times out) gives up this member's place (store engine): the next
        ``recover()`` raises :class:`~ftcomm.errors.Evicted`, and
        ``join()`` comes back.

        Raises:
            Evicted: the others went on without this member (``cut_off``:
                it could not exchange data with them): ``join()`` again.
            MembershipTimeout: fewer than ``min_size`` members by the deadline
                (or the group could not be configured in time: call it again).
            MembershipError: the engine went away, or the membership was
                closed meanwhile.
            TypeError: ``group`` is not an :class:`ftcomm.Group`.
            RuntimeError: not in a world (``join()`` first), or another call running.
        """
        with self._call_slot("recover"):
            if self._record is None:
                raise RuntimeError(f"member {self.member_id!r} is in no world: join() first")
            deadline = time.monotonic() + resolve(timeout, self._timeout)
            group = self._check_group(group)
            record, engine = self._record, self._engine
            engine.unwatch()  # (its own line must not abort its own group)
            await self._call(lambda _: engine.recovering(record), deadline=deadline)
            return await self._form(group, record, record.generation, deadline)

    async def pending(self, *, timeout: Timeout | None = None) -> bool:
        """Whether the next generation is due: a member died, or a newcomer
        waits (ready, with room for it under ``max_size``).

        Every member of the world calls it at the same points (like a
        collective, at a step boundary) and gets the same answer there: the
        first member to ask decides for all. Where it says ``True``, call
        ``recover()``. A call that is cancelled does not count: the next
        one asks the same question again.

        Raises:
            MembershipError: the engine went away.
            RuntimeError: not in a world, or another call running.
        """
        with self._call_slot("pending"):
            record = self._record
            if record is None:
                raise RuntimeError(f"member {self.member_id!r} is in no world: join() first")
            deadline = time.monotonic() + resolve(timeout, self._timeout)
            k, cap, engine = self._checks, self.max_size or NO_CAP, self._engine
            due = await self._call(
                lambda _: engine.check(record, k, max_size=cap, deadline=deadline),
                deadline=deadline,
            )
            self._checks = k + 1
            return due

    async def sync_state(
        self, state: S, step: int, *, timeout: Timeout | None = None
    ) -> tuple[S, int]:
        """Give the members behind the state of the members furthest ahead.

        Every member of the world calls it (after ``join()``/``recover()``)
        with its own ``state`` (a ``state_dict``, or any nesting of dict,
        list and tuple whose leaves are tensors and plain values) and
        ``step``. The members at the highest step stream their tensors to
        the members at a lower step, over the group; each returns ``(state,
        step)``: its own where it was not behind, else the state sent,
        written into its own tensors where its structure is the same (a
        ``model.state_dict()`` passed in updates the model), new tensors
        where it holds ``None`` or an empty container. It is
        :func:`ftcomm.sync_state` on the membership's group (which says what
        a caller may rely on).

        Raises:
            CommError: the group failed during the copy (a member behind may
                hold a state partly written: ``recover()``, then call it
                again).
            ValueError: ``step`` is negative (or over ``2**63 - 1``); on
                every member, before a tensor moves: a member's state holds
                what cannot be copied, or a member behind holds a state whose
                structure differs from the one sent.
            TypeError: ``step`` is not an int.
            RuntimeError: not in a world, or another call running.
        """
        _state_copy.check_step(step)
        with self._call_slot("sync_state"):
            if self._world is None or self._group is None:
                raise RuntimeError(f"member {self.member_id!r} is in no world: join() first")
            deadline = time.monotonic() + resolve(timeout, self._timeout)
            return await _state_copy.copy_state(self._group, state, step, deadline)

    # -- inside -----------------------------------------------------------

    async def _form(
        self, group: Group, prev: WorldRecord | None, member_of: int | None, deadline: float
    ) -> World:
        """Agree on a generation with this member, configure ``group`` for it;
        a configure that fails moves on to the next generation. ``prev``
        ``None``: a newcomer (``join()``), from the latest generation on."""
        known = set(self._record.members) if self._record is not None else set()
        engine, newcomer = self._engine, prev is None
        engine.unwatch()
        try:
            while True:
                if prev is None:  # (again, if the others went on without it)
                    await self._come_in(deadline)
                    await self._call(lambda _: engine.register(), deadline=deadline)
                    prev = await self._call(lambda _: engine.latest(), deadline=deadline)
                try:
                    record = await self._agree(prev, member_of, deadline)
                except Evicted as exc:
                    if not newcomer:
                        raise
                    self._count_cut(exc)
                    prev = None  # its first world went on without it: come in again
                    continue
                rank = record.rank_of(engine.me)
                assert rank is not None
                addr = engine.group_addr(record)
                try:
                    await self._configure(group, record, addr, rank, deadline)
                except CommError as exc:
                    if time.monotonic() >= deadline:
                        # the next call starts past it
                        self._record, self._world, self._group = record, None, None
                        raise MembershipTimeout(
                            f"generation {record.generation} of job {self.job!r} could not "
                            f"configure its group in time: {exc}"
                        ) from exc
                    prev, member_of = record, record.generation
                    continue
                except asyncio.CancelledError:
                    await self._blocking(functools.partial(engine.abandon, record))
                    raise
                break
        except Evicted as exc:
            self._record = self._world = self._group = None
            self._count_cut(exc)
            raise
        self._record, self._group, self._checks = record, group, 0
        self._world = World(
            generation=record.generation,
            rank=rank,
            size=len(record.members),
            members=record.ids,
            newcomers=tuple(m.id for m in record.members if m not in known),
            store_addr=addr,
        )
        return self._world

    def _count_cut(self, exc: Evicted) -> None:
        """After an eviction: how many times in a row it was for paths cut."""
        if not exc.cut_off:
            self._cuts = 0
            return
        now = time.monotonic()
        recent = now - self._last_cut < CUT_FORGET
        self._cuts, self._last_cut = (self._cuts + 1 if recent else 1), now

    async def _come_in(self, deadline: float) -> None:
        """Before a newcomer registers: where it was left out for paths cut
        lately, wait (twice as long each time in a row, from
        :data:`CUT_BACKOFF`, and never more than half the time left); then
        until it reaches the world's members.

        Raises:
            MembershipTimeout: it cannot reach them by ``deadline``.
        """
        if self._cuts and time.monotonic() - self._last_cut < CUT_FORGET:
            pause = min(CUT_BACKOFF * 2 ** (self._cuts - 1), CUT_BACKOFF_MAX)
            await asyncio.sleep(max(min(pause, (deadline - time.monotonic()) / 2), 0.0))
        engine, timeout = self._engine, max(self._hb_timeout, PROBE_TIMEOUT)
        await self._call(lambda stop: engine.admit(stop, deadline, timeout), deadline=deadline)

    def _on_broken(self, group: Group, record: WorldRecord) -> Callable[[str], None]:
        """What the engine calls (on its thread) when the world just
        configured breaks: a member found dead, or a path found cut. It
        aborts ``group``'s configuration for that world (only while it is
        the current one), so that an op in flight ends now rather than at
        its deadline, and the members recover."""
        config, job, me = config_of(group), self.job, self.member_id

        def broken(why: str) -> None:
            if abort_config(group, config, f"generation {record.generation} of job {job!r}: {why}"):
                log.warning(
                    "ftcomm: membership %s/%s aborted its group: generation %d: %s",
                    job,
                    me,
                    record.generation,
                    why,
                )

        return broken

    async def _agree(
        self, prev: WorldRecord, member_of: int | None, deadline: float
    ) -> WorldRecord:
        """The engine's ``agree``; a generation it formed as the call was
        cancelled is given up (its other members form the next one)."""
        return await self._call(
            functools.partial(
                self._engine.agree,
                prev,
                member_of=member_of,
                min_size=self.min_size,
                max_size=self.max_size or NO_CAP,
                window=self._window,
                deadline=deadline,
            ),
            deadline=deadline,
            unwanted=self._engine.abandon,
        )

    async def _configure(
        self, group: Group, record: WorldRecord, addr: str, rank: int, deadline: float
    ) -> None:
        """``group.configure()`` for ``record``, kept only where its members
        agree it stands (``_keep.configure``).

        Raises:
            CommError: the configure failed, timed out, or was given up.
            MembershipError: the engine failed as it was asked.
        """
        await _keep.configure(self._keeper(), group, record, addr, rank, deadline)

    def _keeper(self) -> _keep.Keeper:
        """What the keep step needs of this member (``_keep.configure``)."""
        return _keep.Keeper(
            self.job,
            self.member_id,
            self._engine,
            self._hb_interval,
            self._hb_timeout,
            self._call,
            self._blocking,
            self._on_broken,
        )

    def _check_group(self, group: object) -> Group:
        if not isinstance(group, Group):
            raise TypeError(f"group must be an ftcomm.Group, got {type(group).__name__}")
        return group

    @contextlib.contextmanager
    def _call_slot(self, name: str) -> Any:
        with self._lock:
            if self._state != "open":
                raise RuntimeError(
                    f"{name}() needs an open membership (async with ftcomm.Membership(...)); "
                    f"this one is {self._state}"
                )
            if self._busy is not None:
                raise RuntimeError(f"{name}() called while {self._busy}() is running")
            self._busy = name
        try:
            error = self._engine.broken()
            if error is not None:
                raise MembershipError(f"lost the membership {self._engine!r}: {error}") from error
            yield
        finally:
            with self._lock:
                self._busy = None

    async def _call(
        self,
        fn: Callable[[threading.Event], T],
        *,
        deadline: float,
        unwanted: Callable[[T], object] | None = None,
    ) -> T:
        """Run the engine's blocking ``fn(stop)`` on a control thread of its
        own (spawned: a long wait never holds a thread other calls need); a
        cancel sets ``stop`` (the engine looks at it every poll) and waits
        for the call to end, so that no thread outlives it. ``close()``
        sets it too. ``unwanted(result)`` (blocking) undoes a result the
        call came to after all, when it is cancelled.

        Raises:
            MembershipError: the membership was closed (before or during).
        """
        stop = threading.Event()
        with self._lock:
            if self._state == "closed":
                raise MembershipError(f"membership {self.job}/{self.member_id} was closed")
            future = get_runtime().control.spawn(fn, stop, until=deadline + 5.0)
            self._running = (stop, future)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            stop.set()
            with contextlib.suppress(BaseException):
                await asyncio.shield(asyncio.wrap_future(future))
            if unwanted is not None and future.done() and future.exception() is None:
                await self._blocking(functools.partial(unwanted, future.result()))
            raise
        except Stopped:
            raise MembershipError(
                f"membership {self.job}/{self.member_id} was closed during the call"
            ) from None
        finally:
            with self._lock:
                self._running = None
            # this frame -> future -> its error -> traceback -> this frame:
            # cut, so that the engine's frames (and what they hold) go now
            del future

    async def _blocking(self, fn: Callable[[], object]) -> None:
        future = get_runtime().run_control(fn, until=time.monotonic() + 5.0)
        await asyncio.shield(asyncio.wrap_future(future))


def engine_of(members: Membership) -> Engine:
    """``members``' coordination engine: for ftcomm's own tools (the scale
    bench). Not API."""
    return members._engine
