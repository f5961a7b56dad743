"""What a :class:`~ftcomm.Membership` is made of and gives: its arguments
checked, and the :class:`World` a generation is to one member.

Owns: :class:`World`, :func:`check_name` (a job's or member's name, also
the launcher's), the size checks, and the environment ``from_env`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass

ENV_NAMES = ("engine", "job", "member_id", "min_size", "max_size", "store_host")
"""What :meth:`Membership.from_env` reads: ``FTCOMM_<NAME>``, set by ``ftcomm run``."""


@dataclass(frozen=True, slots=True)
class World:
    """One generation of a job, as this member sees it.

    Attributes:
        generation: the generation's number (1 for the first); every member
            of it has the same one, and the same ``members``.
        rank: this member's rank in it (``0..size-1``).
        size: how many members it has.
        members: their ids, in rank order.
        newcomers: the ids of those that were not in the previous
            generation this member knew (all of them in its first; a
            restarted member's new incarnation is one).
        store_addr: where the generation's group met (``host:port/prefix``).
    """

    generation: int
    rank: int
    size: int
    members: tuple[str, ...]
    newcomers: tuple[str, ...]
    store_addr: str


def check_name(value: object, name: str) -> str:
    """``value`` as a job's or member's name: a non-empty str without whitespace or '/'.

    Raises:
        TypeError: not a str.
        ValueError: empty, or with whitespace or '/'.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not value or not value.strip():
        raise ValueError(f"{name} must not be empty")
    bad = [c for c in value if c.isspace() or c == "/" or not c.isprintable()]
    if bad:
        raise ValueError(f"{name} {value!r} must not contain whitespace or '/', got {bad[0]!r}")
    return value


def check_size(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value
