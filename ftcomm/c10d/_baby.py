"""torchft's ``ProcessGroupBaby*``: the reconfigurable groups whose native
group runs in a worker process (``Group(subprocess=True)``).

Owns: the Baby classes (their own option, ``share_min_bytes``). See
docs/subprocess.md.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .._validate import check_int
from ._groups import ProcessGroupGloo, ProcessGroupNCCL, ProcessGroupWrapper, ProcessGroupXCCL


class _Baby(ProcessGroupWrapper):
    """The group runs in a worker process: torchft's ``ProcessGroupBaby*``.

    Each ``configure`` gets a fresh worker (one started ahead, so recovery
    does not wait for Python and torch to start); a deadline, ``abort()`` or
    ``configure()`` kills the worker, so an aborted op writes nothing
    anywhere afterwards, and the worker's death fails every op in flight at
    once with ``WorkerDied``. Tensors are copied through shared memory, and
    written only when their op succeeds; tensors already in shared memory
    (``t.share_memory_()``) are used in place. ``share_min_bytes`` opts in to
    moving large reused storages there (as torchft's does with every tensor):
    docs/subprocess.md says when that is unsafe, and what it saves.
    """

    _subprocess = True

    def __init__(
        self,
        timeout: timedelta | float = timedelta(seconds=60),
        *,
        share_min_bytes: int | None = None,
        fuse: bool = False,
    ) -> None:
        super().__init__(timeout, fuse=fuse)
        if share_min_bytes is not None:
            check_int(share_min_bytes, "share_min_bytes", minimum=0, maximum=None)
        self._share_min_bytes = share_min_bytes

    def _group_options(self) -> dict[str, Any]:
        return {"share_min_bytes": self._share_min_bytes}


class ProcessGroupBabyGloo(_Baby, ProcessGroupGloo):
    """Gloo in a worker process (CPU tensors); every collective, send and recv.

    Args:
        timeout: the default deadline of every op and of ``configure``.
        share_min_bytes: move a CPU storage that a tensor of at least this many
            bytes brings back for another op into shared memory, in place
            (``None``, the default: always copy; docs/subprocess.md).
        fuse: as :class:`ProcessGroupWrapper`'s.

    Raises:
        TypeError, ValueError: a bad ``timeout``, ``share_min_bytes`` or ``fuse``.
    """


class ProcessGroupBabyNCCL(_Baby, ProcessGroupNCCL):
    """NCCL in a worker process (CUDA tensors, shared by IPC handle). ``wait()``
    blocks until the worker has replied (once the op's device work is done),
    and the caller's stream then waits for the worker's through an event. A
    deadline or ``abort()`` kills the worker. ``configure`` raises
    ``RuntimeError`` where torch has no NCCL or sees no GPU. Its arguments
    are :class:`ProcessGroupBabyGloo`'s."""


class ProcessGroupBabyXCCL(_Baby, ProcessGroupXCCL):
    """XCCL in a worker process (Intel XPU tensors); as :class:`ProcessGroupBabyNCCL`."""
