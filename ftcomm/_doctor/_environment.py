"""What ftcomm needs around torch: ``/dev/shm`` for ``subprocess=True``,
uvloop, anyio and torchft, and whether ftcomm's owner loop can start; and
what of that is a problem (no room in ``/dev/shm``, a loop that cannot
start) or a note (an optional package missing).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil

from ._record import JSON, Findings, Problem, size

SHM_DIR = "/dev/shm"
"""Where ``subprocess=True`` puts tensors (``backends/subprocess/_shm.py``)."""
SHM_MIN_FREE = 256 << 20
"""Below this much free room in ``/dev/shm``, ``subprocess=True`` is reported too small."""


def shm_info() -> JSON:
    """``/dev/shm``: there? writable? its total and free bytes; ``subprocess=True`` usable?"""
    info: JSON = {"path": SHM_DIR, "exists": os.path.isdir(SHM_DIR)}
    info["writable"] = info["exists"] and os.access(SHM_DIR, os.W_OK | os.X_OK)
    try:
        usage = shutil.disk_usage(SHM_DIR)
    except OSError:
        info["total_bytes"] = info["free_bytes"] = None
    else:
        info["total_bytes"], info["free_bytes"] = usage.total, usage.free
    free = info["free_bytes"]
    info["usable"] = bool(info["writable"]) and free is not None and free >= SHM_MIN_FREE
    return info


def _version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or ``None``."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def packages_info() -> JSON:
    """uvloop (importable? version), anyio, torchft (optional), and the owner loop's kind."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        importable = False
    else:
        importable = True
    loop: JSON
    try:
        from .._runtime.loop import loop_kind

        loop = {"kind": loop_kind(), "error": None}
    except (ValueError, RuntimeError) as exc:
        loop = {"kind": None, "error": str(exc)}
    return {
        "uvloop": {"importable": importable, "version": _version("uvloop")},
        "anyio": {"version": _version("anyio")},
        "torchft": {"version": _version("torchft")},
        "owner_loop": loop,
    }


def advise_shm(shm: JSON, found: Findings) -> None:
    """Add to ``found`` what :func:`shm_info` found: a ``/dev/shm`` that is
    missing, not writable or under :data:`SHM_MIN_FREE` free is a problem."""
    free = shm["free_bytes"]
    if not shm["exists"]:
        found.problems.append(
            Problem(
                f"{SHM_DIR} does not exist: Group(..., subprocess=True) cannot run here",
                f"mount a tmpfs on {SHM_DIR} (Linux: mount -t tmpfs -o size=1G tmpfs {SHM_DIR}), "
                "or use in-process groups only",
            )
        )
    elif not shm["writable"]:
        found.problems.append(
            Problem(
                f"{SHM_DIR} is not writable by this user: subprocess=True cannot run here",
                f"make {SHM_DIR} writable (normally mode 1777), or use in-process groups only",
            )
        )
    elif free is None or free < SHM_MIN_FREE:
        room = "unknown" if free is None else size(free)
        found.problems.append(
            Problem(
                f"{SHM_DIR} has {room} free, less than {size(SHM_MIN_FREE)}: too small for "
                "subprocess=True (its tensors travel through it)",
                f"give {SHM_DIR} more room (docker run --shm-size=1g ..., or "
                f"mount -o remount,size=1G {SHM_DIR}); in-process groups do not use it",
            )
        )


def advise_packages(packages: JSON, found: Findings) -> None:
    """Add to ``found`` what :func:`packages_info` found: a missing uvloop,
    anyio or torchft is a note; an owner loop that cannot start is a problem."""
    if not packages["uvloop"]["importable"]:
        found.notes.append(
            "uvloop: not installed (optional): ftcomm's owner loop runs on asyncio's"
        )
    if packages["anyio"]["version"] is None:
        found.notes.append("anyio: not installed (a dependency of ftcomm: pip install 'anyio>=4')")
    if packages["torchft"]["version"] is None:
        found.notes.append("torchft: not installed (optional: pip install 'ftcomm[torchft]')")
    loop_error = packages["owner_loop"]["error"]
    if loop_error:
        found.problems.append(
            Problem(
                f"ftcomm cannot start its owner loop: {loop_error}",
                "unset FTCOMM_LOOP, set it to auto, asyncio or uvloop, or pip install uvloop",
            )
        )
