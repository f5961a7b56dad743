"""The seam where :mod:`ftcomm.testing` injects faults into issued ops.

Nothing in production sets an injector: the cost on the issue path is one
module-global read. With one set, every op a :class:`~ftcomm.Group` issues in
this process goes through ``injector(op, issue, backend)``, which decides
whether and how to call ``issue()`` (the real native call) and what
:class:`~ftcomm._runtime.native.NativeOp` the op gets. ``backend`` is the
group's configured backend (a subprocess backend's worker can be hurt
through it).
"""

from __future__ import annotations

from collections.abc import Callable

from .native import NativeOp

Issue = Callable[[], NativeOp]
Injector = Callable[[str, Issue, object], NativeOp]
"""``(op name, issue, backend) -> native op``; the injector counts the ops itself."""

injector: Injector | None = None


def set_injector(new: Injector | None) -> Injector | None:
    """Install ``new`` (``None`` removes it); returns the previous one."""
    global injector
    old, injector = injector, new
    return old
