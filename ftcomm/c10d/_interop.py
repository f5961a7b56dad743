"""Where sync torch code and async ftcomm code share a group: views, typed errors.

Owns :func:`check_view`, what a facade class's view of an :class:`ftcomm.Group`
(``ProcessGroupGloo.of``: DDP on a group that ``Membership`` reconfigures)
accepts, and :func:`raising`. When the future of torch's reducer's
communication hook fails, the reducer raises a plain ``RuntimeError`` whose
text holds the ftcomm error's, its type and ``__cause__`` gone; the facade
group still knows the typed error (``errored()``), and :func:`raising` puts
the two back together. See docs/migrating.md.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

from ..errors import CommError
from ..group import Group


def check_view(name: str, backend: str | None, subprocess: bool, group: object) -> None:
    """That facade class ``name`` (its ``backend``, in a worker process or
    not) can be a view of ``group``.

    Raises:
        TypeError: ``group`` is not an ``ftcomm.Group``.
        ValueError: it runs another backend, or runs it elsewhere.
    """
    if not isinstance(group, Group):
        raise TypeError(f"group must be an ftcomm.Group, got {type(group).__name__}")
    if backend is None or (group.backend, group.subprocess) != (backend, subprocess):
        where = "in a worker process" if group.subprocess else "in process"
        wants = f"{backend!r}{' in a worker process' if subprocess else ''}" if backend else "none"
        raise ValueError(
            f"{name} cannot run on a {group.backend!r} group {where}: its backend is {wants}"
        )


def _error_names() -> frozenset[str]:
    """The names of ftcomm's communication errors (CommError and every subclass)."""
    names, todo = set(), [CommError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return frozenset(names)


def _names_an_error(text: str) -> bool:
    """Whether torch's message carries an ftcomm error (``"CommFailed: ..."``)."""
    return any(re.search(rf"\b{name}: ", text) for name in _error_names())


@contextlib.contextmanager
def raising(errored: Callable[[], Exception | None]) -> Iterator[None]:
    """Re-raise, as the group's typed error, a ``RuntimeError`` into which
    torch turned one of ftcomm's (see ``_Facade.raising``)."""
    try:
        yield
    except CommError:
        raise
    except RuntimeError as exc:
        error = errored()
        if not isinstance(error, CommError) or not _names_an_error(str(exc)):
            raise
        # A copy: errored() hands out one object, which a raise would change.
        # The chain goes on through torch's error to the op's (its native cause).
        if exc.__cause__ is None and error.__cause__ is not None:
            exc.__cause__ = error.__cause__
        raise error.at(error.rank, error.op, error.seq) from exc
