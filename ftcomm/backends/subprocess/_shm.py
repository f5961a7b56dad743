"""Shared-memory segments: the files under ``/dev/shm`` that both sides use.

Owns :class:`Segment` (a segment's name and file: made with its bytes
reserved, attached by name, unlinked, closed without leaving its name behind;
its rules are in its docstring) and the handles a descriptor gives what is
not a segment (:data:`EMPTY`, :data:`FD_PREFIX`). See docs/subprocess.md.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import secrets
import threading

import torch

from ..._protocol import TensorDesc
from ._device import PoolClosed

SHM_DIR = "/dev/shm"
PREFIX = "ftcomm-"

_names = itertools.count()


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(name))


def _map(fd: int, size: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)  # the mapping keeps its own reference


def attach(name: str) -> mmap.mmap:
    """Map the segment ``name`` (the worker's side).

    Raises:
        ValueError: ``name`` is not an ftcomm segment's.
        OSError: there is no such segment (any more), or it cannot be mapped.
    """
    if not name.startswith(PREFIX) or "/" in name or name in (".", ".."):
        raise ValueError(f"not an ftcomm segment name: {name!r}")
    fd = os.open(_path(name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        raise
    return _map(fd, size)


EMPTY = "empty"
"""The handle of a tensor with no elements (nothing to map)."""
FD_PREFIX = "fd:"
"""The handle of a caller's storage already in shared memory: ``fd:<inode>``."""


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _no_room(needed: int, cause: OSError) -> OSError:
    """The error for an op whose ``needed`` bytes do not fit in :data:`SHM_DIR`."""
    try:
        st = os.statvfs(SHM_DIR)
        room = f"{_mib(st.f_bavail * st.f_frsize)} free of {_mib(st.f_blocks * st.f_frsize)}"
    except OSError:
        room = "free space unknown"
    error = OSError(
        errno.ENOSPC,
        f"{SHM_DIR} has no room for {_mib(needed)} more of an op's shared memory ({room}): "
        f"issue smaller ops, or give {SHM_DIR} more room (docker run --shm-size=...)",
    )
    error.__cause__ = cause
    return error


def _reserve(fd: int, start: int, end: int) -> None:
    """Allocate bytes ``[start, end)`` of the file ``fd`` now, so that no
    write into its mapping can fault for want of memory.

    Raises:
        OSError: ``ENOSPC``, naming :data:`SHM_DIR` and its free space; or
            another error of ``posix_fallocate``.
    """
    while True:
        try:
            os.posix_fallocate(fd, start, end - start)
            return
        except InterruptedError:  # a signal whose handler did not raise: again
            continue
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):  # pragma: no cover - not tmpfs
                return  # a file system that cannot reserve: its writes find out
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise _no_room(end - start, exc) from exc
            raise


class Segment:
    """One shared-memory segment of the parent's pool.

    Rules:

    1. Segments are files under ``/dev/shm`` opened with ``O_EXCL`` and mode
       0600, not :class:`multiprocessing.shared_memory.SharedMemory`, whose
       resource tracker is a process of its own and would own (and report)
       them.
    2. A segment's name leaves ``/dev/shm`` as soon as the worker has mapped
       it (the first reply of an op that used it): both sides keep their
       mappings, and nothing is left behind if both processes then die. The
       worker unlinks the names it mapped when its parent goes away; the
       parent unlinks the rest when the pool closes.
    3. The bytes an op uses are reserved (``posix_fallocate``) before anything
       is copied: tmpfs allocates a page on its first write, and a write that
       finds ``/dev/shm`` full is a SIGBUS that kills the caller. A full
       ``/dev/shm`` is an :class:`OSError` (``ENOSPC``) from
       :meth:`~._pool.Pool.stage` instead, that names the directory and its
       free space, and leaves no segment behind. A segment keeps its
       descriptor (closed with the pool) to reserve more when a larger op of
       its size class reuses it: only the bytes ops use are reserved, not the
       power-of-two rounding.

    Raises (constructor):
        OSError: the file could not be made, or ``reserve`` bytes of it not
            reserved (rule 3); nothing is left behind then.
    """

    __slots__ = ("_fd", "_lock", "buf", "linked", "name", "reserved", "size", "views")

    def __init__(self, size: int, reserve: int = 0) -> None:
        self.name = f"{PREFIX}{os.getpid()}-{next(_names)}-{secrets.token_hex(4)}"
        self.size = size
        self.reserved = 0
        """How many bytes from the start are allocated (rule 3)."""
        self._lock = threading.Lock()
        fd = os.open(_path(self.name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)  # the mapping's length; allocates nothing
            if reserve:
                self.reserved = _reserved(reserve, size)
                _reserve(fd, 0, self.reserved)
            self.buf = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            unlink(self.name)
            raise
        self._fd = fd
        """Kept to reserve more (:meth:`reserve`); -1 once closed."""
        self.linked = True
        self.views: dict[tuple[object, ...], tuple[torch.Tensor, TensorDesc]] = {}
        """(dtype, shape, offset) -> a view and its descriptor: a pooled
        segment is reused for the same layout op after op."""

    def reserve(self, nbytes: int) -> None:
        """Make sure the first ``nbytes`` are allocated (rule 3).

        Raises:
            OSError: as :func:`_reserve`; what was reserved before stays.
            PoolClosed: the pool closed meanwhile.
        """
        if nbytes <= self.reserved:  # a segment reused for its layout: no call
            return
        with self._lock:
            if self._fd < 0:
                raise PoolClosed("the worker's shared memory is closed")
            want = _reserved(nbytes, self.size)
            if want > self.reserved:
                _reserve(self._fd, self.reserved, want)
                self.reserved = want

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            unlink(self.name)

    def close(self) -> None:
        """Unlink the name and close the descriptor; the mapping goes with its views."""
        self.unlink()
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _reserved(nbytes: int, size: int) -> int:
    """``nbytes`` rounded up to whole pages, within a segment of ``size``."""
    return min(size, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
