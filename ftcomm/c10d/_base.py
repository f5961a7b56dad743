"""The facade's base class and store helper (torchft's ``ProcessGroup`` contract).

See docs/facade.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from .._runtime.deadline import to_seconds
from .._store import connect_store, resolve_store_addr
from . import _registry

logger = logging.getLogger("ftcomm.c10d")


def create_store_client(store_addr: str, timeout: timedelta) -> Store:
    """A client of the TCPStore at ``store_addr``, scoped to its prefix. Blocks
    until connected.

    Args:
        store_addr: ``host:port/prefix`` (IPv6: ``[::1]:port/prefix``).
        timeout: how long to wait for the store.

    Raises:
        TypeError, ValueError: a malformed address or timeout.
        RuntimeError: (torch's ``DistStoreError``) the store did not answer in time.
    """
    return connect_store(resolve_store_addr(store_addr), to_seconds(timeout, "timeout"))


class ProcessGroup(dist.ProcessGroup):
    """A reconfigurable c10d process group: the contract of every ftcomm.c10d group.

    Usable wherever torch takes a ``ProcessGroup`` (DDP's ``process_group=``,
    ``torch.distributed.*(group=pg)``; functional collectives and DeviceMesh
    after :meth:`register`). Subclasses implement the collectives and
    :meth:`configure`; the base raises ``NotImplementedError`` for them.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group_name: str | None = None

    # -- the collectives (c10d signatures) ----------------------------------
    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensor: list[torch.Tensor],
        opts: object = None,
    ) -> dist.Work:
        """Gather ``input_tensor[0]`` from every rank into ``output_tensors[0]``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement allgather")

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: object = None,
    ) -> dist.Work:
        """Gather each ``input_tensors[i]`` into ``output_tensors[i]`` (rank-major)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement allgather_into_tensor_coalesced"
        )

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        """Reduce ``tensors[0]`` in place across ranks (``opts``: options or a ReduceOp)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement allreduce")

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        """Reduce several tensors in place as one op."""
        raise NotImplementedError(f"{type(self).__name__} does not implement allreduce_coalesced")

    def alltoall_base(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: object = None,
    ) -> dist.Work:
        """Exchange slices of ``input_buffer`` along dim 0 (``all_to_all_single``)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement alltoall_base")

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: object = None,
    ) -> dist.Work:
        """Send ``input_tensors[r]`` to rank ``r``, receive rank ``r``'s into
        ``output_tensors[r]`` (``all_to_all``)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement alltoall")

    def barrier(self, opts: object = None) -> dist.Work:
        """Wait until every rank has reached the barrier."""
        raise NotImplementedError(f"{type(self).__name__} does not implement barrier")

    def broadcast(self, tensor_list: list[torch.Tensor], opts: object = None) -> dist.Work:
        """Copy the root's ``tensor_list[0]`` to every rank (``opts.rootRank``)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement broadcast")

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """``broadcast([tensor])`` from group rank ``root``."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self.broadcast([tensor], opts)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work:
        """Receive into ``tensors[0]`` from ``src_rank``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement recv")

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: object = None,
    ) -> dist.Work:
        """Reduce ``input_tensors[0][r]`` across ranks into rank ``r``'s output."""
        raise NotImplementedError(f"{type(self).__name__} does not implement reduce_scatter")

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: object = None,
    ) -> dist.Work:
        """Reduce each ``input_tensors[i]`` and keep this rank's chunk."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement reduce_scatter_tensor_coalesced"
        )

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work:
        """Send ``tensors[0]`` to ``dst_rank``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement send")

    # -- lifecycle ----------------------------------------------------------
    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: Sequence[int] | None = None,
    ) -> None:
        """(Re)build the group on a fresh store prefix; blocks until it is built.

        Args:
            store_addr: ``host:port/prefix`` (or ``env://prefix``), the same
                on every rank, at a prefix no earlier configuration used.
            replica_id: a label for this rank's replica (torchft passes its
                replica group's id), in the native group's name; any string will do.
            rank: this process's rank.
            world_size: the number of ranks.
            quorum_id: torchft's quorum number, a label in that name too.
            group_rank: this rank's place in its replica group (torchft's;
                kept for its callers).
            group_world_size: the size of that replica group (likewise).
            global_ranks: every member's default-group rank, by group rank,
                where the caller knows them (checked against the ranks'
                exchange, which always runs).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement configure")

    def size(self) -> int:
        """The world size of the current configuration."""
        raise NotImplementedError(f"{type(self).__name__} does not implement size")

    # C++ callers (DDP's reducer and parameter check, the registry) read the
    # rank and size through these virtuals: they must follow reconfiguration.
    def getRank(self) -> int:
        """:meth:`rank`, for torch's C++ callers."""
        return self.rank()

    def getSize(self) -> int:
        """:meth:`size`, for torch's C++ callers."""
        return self.size()

    def getBackendName(self) -> str:
        """The backend's name, as registered with torch."""
        raise NotImplementedError(f"{type(self).__name__} does not implement getBackendName")

    def _c10d_backend(self) -> tuple[str, str] | None:
        """``(c10d backend, device type)`` of the native group underneath
        (``("gloo", "cpu")``), what torch's ``get_backend(group)`` and
        ``get_backend_config(group)`` answer for a registered group, so that
        torch's own code picks the branch it would for that backend
        (``monitored_barrier`` is Gloo's only); ``None``: no such backend."""
        return None

    def _get_backend(self, device: object) -> Any:
        """torch's look for the native backend of ``device`` in this group.

        An ftcomm group has none torch could drive; a stand-in that says so
        (no splitting, coalescing, allocation, time estimate or shrinking),
        so that torch's code takes the branch for a backend without them:
        ``init_process_group(device_id=...)`` skips its eager connect (each
        configure makes a communicator of its own), FSDP2 allocates its
        buffers itself."""
        try:
            name = self.getBackendName()
        except NotImplementedError:
            name = type(self).__name__
        return _NoNativeBackend(name)

    def _members_global_ranks(self) -> list[int] | None:
        """Every member's rank in the default process group, by group rank,
        for torch's tables when the group is registered; ``None``: unknown
        (the group is entered as this process's rank alone)."""
        return None

    def _settle_ranks(self, initialized: bool) -> None:
        """At :meth:`register`: find the members' default-group ranks where
        :meth:`configure` came before the default group and there is one now
        (``initialized``); nothing to find in the base class."""

    def _ranks_pending(self) -> bool:
        """Whether the default-group ranks of several members are still to be
        found (after a configure that came before the default group)."""
        return False

    def abort(self, errored: bool = True) -> None:
        """Abort the group (nothing to abort in the base class)."""

    def shutdown(self) -> None:
        """Shut the group down (nothing to shut down in the base class)."""

    def errored(self) -> Exception | None:
        """The error that requires a reconfigure, or ``None``."""
        return None

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the default deadline of the ops issued from now on."""
        raise NotImplementedError(f"{type(self).__name__} does not implement set_timeout")

    # -- the registry -------------------------------------------------------
    def register(self, name: str) -> ProcessGroup:
        """Register this group as ``"<backend name>:<name>"`` so functional
        collectives, ``torch.distributed`` calls and DeviceMesh can find it.
        Returns ``self``.

        Where the default process group came after :meth:`configure`, this
        finds the members' default-group ranks, in the configuration's
        store: every member must call it then (docs/migrating.md).

        Raises:
            TypeError: ``name`` is not a str.
            ValueError: ``name`` is empty, or this group or that name is
                registered already.
            CommTimeout: a member did not register within the group's timeout
                (only where the ranks must be found here); nothing is registered.
            CommAborted: the group was reconfigured, aborted or shut down meanwhile.
            CommFailed: the store failed while the ranks were found.
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if not name:
            raise ValueError("name must not be empty")
        group_name = f"{self.getBackendName()}:{name}"
        _registry.register(self, group_name)
        self._group_name = group_name
        return self

    def unregister(self) -> None:
        """Remove this group from torch's registry. The group itself stays as it
        is (torchft's shut it down as well; call :meth:`shutdown` for that).

        Raises:
            ValueError: the group is not registered.
        """
        _registry.unregister(self)
        self._group_name = None

    @property
    def group_name(self) -> str:
        """The registered name.

        Raises:
            ValueError: the group has not been registered.
        """
        if self._group_name is None:
            raise ValueError(f"{type(self).__name__} has no name: call register(name) first")
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _NoNativeBackend:
    """What :meth:`ProcessGroup._get_backend` gives: none of c10d's optional
    capabilities, and the group's backend name."""

    supports_splitting = False
    supports_coalescing = False
    supports_tensor_alloc = False
    supports_time_estimate = False
    supports_shrinking = False

    def __init__(self, name: str) -> None:
        self._name = name

    def name(self) -> str:
        return self._name
