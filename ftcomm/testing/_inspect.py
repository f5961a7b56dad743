"""``inspect(group)``: a look at a :class:`~ftcomm.Group`'s parts,
for tests that check what a group holds (its native backend, its op table,
its worker launcher) without reaching into its private attributes. See
docs/testing.md, "Looking inside a group".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..group import Group, config_of, configurer_of

if TYPE_CHECKING:
    from .._runtime.table import OpTable
    from .._state import Config, State
    from ..backends import Backend
    from ..backends.subprocess import Launcher


@dataclass(frozen=True)
class Inspection:
    """What :func:`inspect` saw, at the moment it looked.

    Attributes:
        state: where the group was in its life.
        config: the configuration its ops ran on, or ``None``.
        backend: that configuration's native backend (its Gloo process
            group, its worker process, ...), or ``None``.
        table: that configuration's op table, or ``None``.
        launcher: the worker launcher of a ``subprocess=True`` group, or ``None``.
    """

    state: State
    config: Config | None
    backend: Backend | None
    table: OpTable | None
    launcher: Launcher | None


def inspect(group: Group) -> Inspection:
    """Look at ``group``'s parts now (any thread). The objects are the
    group's own, not copies: a test may call them (or, to force a path,
    change them), and the look does not follow later configures.

    Args:
        group: the group to look at.

    Raises:
        TypeError: ``group`` is not an :class:`ftcomm.Group`.
    """
    if not isinstance(group, Group):
        raise TypeError(f"inspect() takes an ftcomm.Group, got {type(group).__name__}")
    state = group.state
    config = config_of(group)
    return Inspection(
        state,
        config,
        config.backend if config is not None else None,
        config.table if config is not None else None,
        configurer_of(group).launcher,
    )
