"""The worker's side of shared memory: the segments and caller storages it
has mapped, kept for its lifetime.

Owns :class:`Mappings`: turning a descriptor into a tensor over the memory
it names, and taking the names the worker mapped out of ``/dev/shm`` when
its parent is gone. See docs/subprocess.md.
"""

from __future__ import annotations

import mmap
import os

import torch

from ..._protocol import TensorDesc
from ._layout import BY_NAME, check_reach
from ._shm import EMPTY, FD_PREFIX, attach, unlink


class Mappings:
    """The worker's side: segments mapped by name, kept for its lifetime."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def adopt(self, ino: int, fd: int) -> None:
        """Map a caller's shared storage received as ``fd`` (closed here)."""
        try:
            size = os.fstat(fd).st_size
            if os.fstat(fd).st_ino != ino:
                raise ValueError(f"fd {fd} is not inode {ino}")
            buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._maps[f"{FD_PREFIX}{ino}"] = buf

    def release(self, ino: int) -> None:
        """The caller's storage died: unmap it once its views are gone."""
        self._maps.pop(f"{FD_PREFIX}{ino}", None)

    def tensor(self, desc: TensorDesc) -> torch.Tensor:
        """The tensor ``desc`` describes, over the parent's segment.

        Raises:
            ValueError: the descriptor names no segment of ours, or reaches past it.
        """
        dtype = BY_NAME[desc.dtype]
        if desc.handle == EMPTY or min(desc.shape, default=1) == 0:
            return torch.empty(desc.shape, dtype=dtype)
        buf = self._maps.get(desc.handle)
        if buf is None:
            if desc.handle.startswith(FD_PREFIX):
                raise ValueError(f"no storage was sent for {desc.handle!r}")
            buf = self._maps[desc.handle] = attach(desc.handle)
        itemsize = dtype.itemsize
        check_reach(desc, itemsize, len(buf), "segment")
        flat = torch.frombuffer(buf, dtype=dtype, count=len(buf) // itemsize)
        return flat.as_strided(desc.shape, desc.stride, desc.offset)

    def unlink_all(self) -> None:
        """The parent is gone: take the names we know out of ``/dev/shm``."""
        for name in self._maps:
            if not name.startswith(FD_PREFIX):  # a caller's storage: not ours to unlink
                unlink(name)
