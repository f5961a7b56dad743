"""The exception hierarchy of ftcomm.

Owns :class:`CommError` (a ``RuntimeError``: what broke a group, with the rank,
op and sequence number where known) and its subclasses, and
:class:`MembershipError`, ``Membership``'s, which is not a ``CommError``.
Argument errors are the builtin ``TypeError``/``ValueError``. The families
and when each is raised: docs/errors.md.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = [
    "CommAborted",
    "CommError",
    "CommFailed",
    "CommTimeout",
    "Evicted",
    "MembershipError",
    "MembershipTimeout",
    "NotConfigured",
    "ProtocolError",
    "WorkerDied",
]


_CONTEXT = frozenset({"message", "rank", "op", "seq"})


_E = TypeVar("_E", bound="CommError")


class CommError(RuntimeError):
    """Base class of every communication failure raised by ftcomm.

    Attributes:
        message: what happened, without the context suffix.
        rank: the rank of the group that raised, or ``None``.
        op: the collective's name (``"allreduce"``, ``"configure"`` …), or ``None``.
        seq: the op's sequence number within its group configuration, or ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        op: str | None = None,
        seq: int | None = None,
    ) -> None:
        self.message = message
        self.rank = rank
        self.op = op
        self.seq = seq
        super().__init__(self._format())

    def _format(self) -> str:
        where = [
            f"{name}={value}"
            for name, value in (("rank", self.rank), ("op", self.op), ("seq", self.seq))
            if value is not None
        ]
        return f"{self.message} [{' '.join(where)}]" if where else self.message

    def at(
        self: _E, rank: int | None, op: str | None, seq: int | None, *, message: str | None = None
    ) -> _E:
        """A copy of this error (same class, extra attributes and cause) said
        of ``rank``, ``op`` and ``seq``, and of ``message`` where given: an
        error raised below an op (a worker's death) named after the op it
        ended, or a fresh copy to raise again on another thread.

        Raises:
            Nothing.
        """
        state = {k: v for k, v in self.__dict__.items() if k not in _CONTEXT}
        said = self.message if message is None else message
        error = _rebuild(type(self), said, rank, op, seq, state)
        error.__cause__ = self.__cause__
        return error

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only constructor arguments: rebuild through a helper so the
        # error survives pickling (it crosses process boundaries in tests).
        return (_rebuild, (type(self), self.message, self.rank, self.op, self.seq, self.__dict__))


def _rebuild(
    cls: type[_E],
    message: str,
    rank: int | None,
    op: str | None,
    seq: int | None,
    state: dict[str, object],
) -> _E:
    err = cls(message, rank=rank, op=op, seq=seq)
    err.__dict__.update(state)
    return err


class CommTimeout(CommError, TimeoutError):
    """An op (or ``configure``) did not finish by its deadline.

    The group it ran on is marked errored; every later op on it raises
    :class:`CommAborted` until ``configure()`` is called.
    """


class CommAborted(CommError):
    """The group was aborted, shut down, reconfigured or broken earlier.

    Raised at once by every op issued on an errored group, and by ops that were
    in flight when their group was torn down. ``__cause__`` holds the original
    error when the abort followed a failure.
    """


class CommFailed(CommError):
    """The native op failed before its deadline (a peer died, a connection closed).

    The group is marked errored. ``__cause__`` holds the backend's own error.
    """


class PrefixReused(CommError):
    """``configure()`` was given a store prefix where a group was built before.

    A rank that built a native group at the prefix is refused before it
    builds another, and every other rank of its configuration that waits
    there for it is told so (within 0.5 s): the prefix still holds the
    earlier group's keys, and a group built over them connects to peers
    that are gone. Trying the same prefix again fails again: configure each
    group at a fresh prefix (a generation or quorum number in it, as
    ``Membership`` and torchft's Manager do). As after any failed
    ``configure()``, the group is unconfigured.
    """


class NotConfigured(CommError):
    """An op or query needs a configured group and there is none.

    Call ``await group.configure(...)`` first (again, after ``shutdown()``).
    """


class WorkerDied(CommError):
    """The subprocess worker that ran the group exited.

    Attributes:
        exitcode: the worker's exit code, or ``None``.
        signal: the signal that killed it, or ``None``.
        pid: the worker's process id, or ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        exitcode: int | None = None,
        signal: int | None = None,
        pid: int | None = None,
        rank: int | None = None,
        op: str | None = None,
        seq: int | None = None,
    ) -> None:
        self.exitcode = exitcode
        self.signal = signal
        self.pid = pid
        super().__init__(message, rank=rank, op=op, seq=seq)


class ProtocolError(CommError):
    """A frame between parent and subprocess worker was malformed."""


class MembershipError(RuntimeError):
    """:class:`ftcomm.Membership` could not agree on a world.

    Raised by ``Membership``'s calls when its engine (the store, the
    lighthouse) does not answer or went away, and as the base of
    :class:`Evicted` and :class:`MembershipTimeout`. Groups already
    configured keep working; another world cannot be formed until the
    engine answers again.
    """


class Evicted(MembershipError):
    """This member was dropped: a later generation was formed without it.

    Its heartbeat stopped (a stopped or overloaded process) or it did not
    come within the join window, and the others went on without it. Its
    group belongs to a generation that no longer exists. Call
    ``members.join(group)`` again to come back as a newcomer (and take the
    training state with ``members.sync_state``).

    Attributes:
        member_id: this member's id.
        generation: the generation it was last part of.
        current: the generation formed without it.
        cut_off: it was alive, but could not exchange data with the others
            (a network fault): ``join()`` then waits until it reaches
            them, longer each time this happens again.
    """

    def __init__(
        self,
        message: str,
        *,
        member_id: str,
        generation: int,
        current: int,
        cut_off: bool = False,
    ) -> None:
        self.member_id = member_id
        self.generation = generation
        self.current = current
        self.cut_off = cut_off
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        args = (str(self), self.member_id, self.generation, self.current, self.cut_off)
        return (_evicted, args)


def _evicted(
    message: str, member_id: str, generation: int, current: int, cut_off: bool = False
) -> Evicted:
    return Evicted(
        message, member_id=member_id, generation=generation, current=current, cut_off=cut_off
    )


class MembershipTimeout(MembershipError, TimeoutError):
    """``join()``, ``recover()`` or ``pending()`` did not end by its deadline.

    The message says what it waited for (how many members came, who is
    missing). Nothing it wrote blocks the next attempt.
    """
