"""ftcomm's facade groups as torch backends: ``init_process_group("ftcomm-gloo")``.

Owns :func:`register_backends` (torch's ``Backend.register_backend`` for each
facade class) and the creator torch calls for a group of one of them, which
torch keeps as the process group itself. A creator gets the group's store
from torch (a ``PrefixStore`` over the job's ``TCPStore``) and meets at that
``TCPStore``'s address under a prefix of its own, which rank 0 draws and
hands the others through torch's store. See docs/migrating.md.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from .._store import StoreAddr
from ..errors import CommFailed, CommTimeout
from ._baby import ProcessGroupBabyGloo, ProcessGroupBabyNCCL, ProcessGroupBabyXCCL
from ._groups import (
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupWrapper,
    ProcessGroupXCCL,
)

BACKENDS: dict[str, tuple[type[ProcessGroupWrapper], str]] = {
    "ftcomm-gloo": (ProcessGroupGloo, "cpu"),
    "ftcomm-nccl": (ProcessGroupNCCL, "cuda"),
    "ftcomm-xccl": (ProcessGroupXCCL, "xpu"),
    "ftcomm-baby-gloo": (ProcessGroupBabyGloo, "cpu"),
    "ftcomm-baby-nccl": (ProcessGroupBabyNCCL, "cuda"),
    "ftcomm-baby-xccl": (ProcessGroupBabyXCCL, "xpu"),
}
"""torch's name for each facade class (its ``getBackendName()``), and its device."""

_PREFIX_KEY = "ftcomm/backend-prefix"
_READ_KEY = "ftcomm/backend-prefix-read"
_lock = threading.Lock()


def register_backends() -> list[str]:
    """Make ftcomm's facade groups torch backends; returns their names.

    After it, ``dist.init_process_group("ftcomm-gloo", init_method=...,
    rank=r, world_size=n)`` makes the default group a
    :class:`ProcessGroupGloo` (``"ftcomm-nccl"``: a :class:`ProcessGroupNCCL`;
    ``"ftcomm-baby-gloo"``: a :class:`ProcessGroupBabyGloo`; ...), and
    ``dist.new_group(ranks, backend="ftcomm-gloo")`` a group of its own, so
    that DeviceMesh, FSDP2, DTensor and DCP run with no group of torch's.
    Each op has the group's timeout (``init_process_group``'s ``timeout``) as
    its deadline. The job's store must be a ``TCPStore`` (``env://``,
    ``tcp://``, torchrun's, or ``store=TCPStore(...)``): the group meets at
    its address. Calling it again changes nothing.

    Such a group keeps the members it was made with: torch's tables fix its
    ranks. To go on after a failure with other members, use a group you
    ``configure()`` and ``register()`` (docs/migrating.md).
    """
    with _lock:
        for name, (_, device) in BACKENDS.items():
            if name not in dist.Backend.backend_list:
                creator = functools.partial(_create, name)
                dist.Backend.register_backend(name, creator, extended_api=True, devices=[device])
    return list(BACKENDS)


def _create(name: str, opts: Any, backend_options: object = None) -> ProcessGroupWrapper:
    """torch's call for a group of backend ``name`` (``opts``: c10d's
    ``_DistributedBackendOptions``).

    Raises:
        ValueError: the job's store is not a ``TCPStore``.
        CommTimeout: a member did not come by ``opts.timeout``.
        CommFailed: the store failed, or the group could not be built.
    """
    store = opts.store
    base = store
    while isinstance(base, PrefixStore):
        base = base.underlying_store
    if not isinstance(base, TCPStore):
        raise ValueError(
            f"ftcomm's backends meet at a TCPStore's address; this job's store is a "
            f"{type(base).__name__} (use init_method='env://' or 'tcp://...', or "
            "store=TCPStore(...))"
        )
    rank, size = opts.group_rank, opts.group_size
    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else timedelta(seconds=60)
    prefix = _agree_prefix(store, rank, size, time.monotonic() + timeout.total_seconds())
    pg = BACKENDS[name][0](timeout=timeout)
    given = list(opts.global_ranks_in_group or [])
    try:
        pg.configure(
            str(StoreAddr(base.host, base.port, prefix)),
            "0",
            rank,
            size,
            global_ranks=given if len(given) == size else None,
        )
    except BaseException:
        pg.shutdown()  # torch never gets it: nothing else would
        raise
    return pg


def _agree_prefix(store: Any, rank: int, size: int, deadline: float) -> str:
    """A store prefix of this making's own, drawn by rank 0 and handed to the
    others through the group's store.

    torch gives a group made again after ``destroy_process_group`` the
    namespace of the one before, so the key must not outlive its making:
    rank 0 takes it back once every other member said it read it, and before
    it configures (no member gets past the making, and into the next one,
    before that).

    Raises:
        CommTimeout: a member did not come by ``deadline``.
        CommFailed: the store failed.
    """
    if size == 1:
        return f"ftcomm/backend/{uuid.uuid4().hex}"

    def left() -> timedelta:
        return timedelta(seconds=max(deadline - time.monotonic(), 0.001))

    try:
        if rank == 0:
            prefix = f"ftcomm/backend/{uuid.uuid4().hex}"
            read = [f"{_READ_KEY}/{prefix}/{r}" for r in range(1, size)]
            store.set(_PREFIX_KEY, prefix)
            try:
                store.wait(read, left())
            finally:
                for key in [_PREFIX_KEY, *read]:
                    with contextlib.suppress(Exception):  # the store may be gone
                        store.delete_key(key)
            return prefix
        store.wait([_PREFIX_KEY], left())
        prefix = store.get(_PREFIX_KEY).decode()
        store.set(f"{_READ_KEY}/{prefix}/{rank}", "1")
        return str(prefix)
    except (TimeoutError, RuntimeError) as exc:  # c10d's store errors are RuntimeErrors
        timed_out = isinstance(exc, TimeoutError) or "timeout" in str(exc).lower()
        kind = CommTimeout if timed_out else CommFailed
        what = "timed out" if timed_out else "failed"
        raise kind(
            f"making the group's ranks meet in the store {what}: {exc}", rank=rank, op="configure"
        ) from exc
