"""The contract every membership engine fills (the store, torchft's lighthouse, etcd).

Owns: :class:`Engine`, the calls :class:`~ftcomm.Membership` makes of an
engine; all of them block (they run on ftcomm's control threads) and each
long one looks at a ``stop`` event at every poll.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from ._rule import Member, WorldRecord


class Stopped(Exception):
    """An engine's call ended because its ``stop`` event was set (a cancel)."""


class Engine(Protocol):
    """Where a job's generations are agreed.

    ``me`` is this member's current incarnation (a new one after it gave
    up a generation it was formed into: see :meth:`abandon`).

    Promises: ``agree`` gives every member of a generation the same record
    (members in rank order), one record per generation number, ever; and a
    member that was left out of a later generation than the one it knew
    gets :class:`~ftcomm.errors.Evicted` (or is let in again as a newcomer,
    where the engine cannot tell), never a world the others are not in.
    """

    me: Member

    def open(self, timeout: float, stop: threading.Event) -> None:
        """Connect, check that no live member has this id, start the heartbeat.

        Raises: MembershipError (no answer), ValueError (the id is in use)."""

    def register(self) -> None:
        """Say this member wants in (a newcomer for the next generation)."""

    def latest(self) -> WorldRecord:
        """The latest generation's record (``_rule.EMPTY`` before the first)."""

    def agree(
        self,
        prev: WorldRecord,
        stop: threading.Event,
        *,
        member_of: int | None,
        min_size: int,
        max_size: int,
        window: float,
        deadline: float,
    ) -> WorldRecord:
        """The first generation after ``prev`` with this member in it.

        Raises: Evicted, MembershipTimeout, MembershipError, and the
        ``Stopped`` when ``stop`` was set."""

    def check(self, record: WorldRecord, k: int, *, max_size: int, deadline: float) -> bool:
        """What ``pending()`` call ``k`` of generation ``record`` says, the
        same for every member. Raises: MembershipError."""

    def abandon(self, record: WorldRecord) -> None:
        """Say this member will not configure ``record`` (its call was
        cancelled), so that the others need not wait for it; from then on
        this member is a new incarnation (``me``), which comes back as a
        newcomer. Best effort. Idempotent: the engine may close at once after."""

    def keep(self, record: WorldRecord) -> bool:
        """This member configured ``record``'s group: whether the generation
        stands, the same answer for every member that configured it (False
        where it was given up first: a member quit it, its call cancelled,
        or was seen dead by one configuring it, see :meth:`lost`; then no
        member uses it). Raises: MembershipError."""

    def lost(self, record: WorldRecord, member: Member) -> bool:
        """This member saw ``member`` dead as it configured ``record``:
        whether to give the generation up (False where it was kept first:
        this member's configure then completes, and it keeps it too).
        Raises: MembershipError."""

    def reach_check(
        self, record: WorldRecord, stop: threading.Event, timeout: float
    ) -> tuple[set[Member], set[Member]]:
        """As ``record``'s group is configured: probe the paths between its
        members (``timeout`` each) and, once every member reported, those
        to leave out of the next generation for paths cut, the same for
        every member (empty: none, not known, or ``stop`` was set first);
        and the members this one reached. Raises: MembershipError."""

    def admit(self, stop: threading.Event, deadline: float, timeout: float) -> None:
        """Before a newcomer registers: wait until it reaches the members of
        the latest generation. Raises: MembershipTimeout (by ``deadline``),
        MembershipError, and ``Stopped`` when ``stop`` was set."""

    def watch(
        self, record: WorldRecord, on_broken: Callable[[str], None], reached: set[Member]
    ) -> None:
        """``record``'s group is configured: from now on call ``on_broken(why)``
        once (from another thread) when a member of it is found dead or a
        path between two of them cut (one that had worked: ``reached``, as
        it was configured, or since). Raises: MembershipError."""

    def unwatch(self) -> None:
        """Watch no world (the next one is being formed)."""

    def recovering(self, record: WorldRecord) -> None:
        """This member leaves ``record``'s world to recover it: tell the
        others watching it (best effort)."""

    def given_up(self, record: WorldRecord) -> bool:
        """Whether a member gave ``record`` up as it was configured (quit it,
        saw a member dead, found paths cut), as last read: never blocks."""

    def read_fate(self, record: WorldRecord | None) -> None:
        """Read ``record``'s verdicts in the background from now on (for
        :meth:`given_up`; ``None``: stop)."""

    def group_addr(self, record: WorldRecord) -> str:
        """The store address (``host:port/prefix``) where ``record``'s group meets."""

    def alive(self, member: Member) -> bool:
        """Whether ``member`` is alive as this member last saw it."""

    def broken(self) -> BaseException | None:
        """What broke the engine's connection, if something did."""

    def close(self) -> None:
        """Stop the heartbeat and say this member left. Idempotent."""
