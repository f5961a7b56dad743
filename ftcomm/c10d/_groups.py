"""The reconfigurable c10d groups: wrapper, Gloo, NCCL/XCCL, dummy.

Each is a thin shell over an ftcomm :class:`~ftcomm.Group` (or over the facade
group it wraps): collectives are issued on the calling thread through
:class:`~ftcomm.c10d._ops.GroupOps`, configure runs on the owner loop
(``Runtime.call``), and every op passes through one hook, :meth:`_Facade._run`,
which wrappers override. See docs/facade.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, ClassVar, Self

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from .._runtime.deadline import to_seconds
from .._runtime.loop import get_runtime
from .._runtime.observe import Event, GroupStats, Subscription
from ..errors import CommError, NotConfigured
from ..group import Group, configurer_of
from . import _interop, _registry
from ._base import ProcessGroup, logger
from ._ops import DummyOps, GroupOps

Target = GroupOps | ProcessGroup
"""What a facade issues its ops on: its own group's ops, or the group it wraps."""

Issue = Callable[[Target], dist.Work]


class _Facade(ProcessGroup):
    """The collectives and lifecycle shared by every ftcomm.c10d group."""

    _sized_as_inner: ClassVar[bool] = True
    """Whether a wrapper has the wrapped group's ranks (a manager's does not)."""

    def __init__(self, rank: int, world: int, timeout: float) -> None:
        super().__init__(rank, world)
        self._timeout = timeout
        self._group: Group | None = None
        self._ops: GroupOps | None = None
        self._inner: ProcessGroup | None = None
        self._ranks = _registry.MemberRanks()  # by group rank, with a default group
        # First use makes the Group: configure(), or stats()/subscribe() from
        # a metrics thread meanwhile, must make one, not two.
        self._group_lock = threading.Lock()

    # -- what it did --------------------------------------------------------
    def stats(self) -> GroupStats:
        """What its ops did: :meth:`ftcomm.Group.stats` of the group it runs
        on (a wrapper's: of the group it wraps), across configures.

        Raises:
            NotImplementedError: it has no backend of its own and wraps nothing.
        """
        return self._ftcomm_group().stats()

    def subscribe(self, callback: Callable[[Event], object]) -> Subscription:
        """:meth:`ftcomm.Group.subscribe` on the group it runs on (a
        wrapper's: on the group it wraps), from now on, across configures.

        Raises:
            TypeError: ``callback`` is not callable.
            NotImplementedError: it has no backend of its own and wraps nothing.
        """
        return self._ftcomm_group().subscribe(callback)

    def _ftcomm_group(self) -> Group:
        """The :class:`~ftcomm.Group` it runs on."""
        if self._group is None:
            raise NotImplementedError(f"{type(self).__name__} runs on no ftcomm Group")
        return self._group

    # -- dispatch -----------------------------------------------------------
    def _target(self, op: str) -> Target:
        if _registry.any_provisional and _registry.provisional(self):  # no default-group ranks yet
            _registry.check_entry(self, op)
        target: Target | None = self._inner if self._inner is not None else self._ops
        if target is None:
            raise NotConfigured(f"{op} needs a configured group: call configure(...) first", op=op)
        return target

    def _run(self, op: str, default: object, issue: Issue) -> dist.Work:
        """Issue one op. ``default``: the result an op that is skipped returns."""
        return issue(self._target(op))

    # -- collectives --------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        ops = self._ops
        if (
            ops is not None
            and self._inner is None
            and type(self)._run is _Facade._run
            and not (_registry.any_provisional and _registry.provisional(self))
        ):
            return ops.allreduce(tensors, opts)  # the hot path: nothing to intercept
        return self._run("allreduce", tensors, lambda t: t.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        return self._run(
            "allreduce_coalesced", tensors, lambda t: t.allreduce_coalesced(tensors, opts)
        )

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensor: list[torch.Tensor],
        opts: object = None,
    ) -> dist.Work:
        return self._run(
            "allgather", output_tensors, lambda t: t.allgather(output_tensors, input_tensor, opts)
        )

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: object = None,
    ) -> dist.Work:
        return self._run(
            "allgather_into_tensor_coalesced",
            output_tensors,
            lambda t: t.allgather_into_tensor_coalesced(output_tensors, input_tensors, opts),
        )

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: object = None
    ) -> dist.Work:
        """``torch.distributed.all_gather_into_tensor`` and functional all_gather."""
        return self._run(
            "allgather_into_tensor",
            [output],
            lambda t: t.allgather_into_tensor_coalesced([output], [input], opts),
        )

    def broadcast(self, tensor_list: list[torch.Tensor], opts: object = None) -> dist.Work:
        return self._run("broadcast", tensor_list, lambda t: t.broadcast(tensor_list, opts))

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: object = None,
    ) -> dist.Work:
        return self._run(
            "reduce_scatter",
            output_tensors,
            lambda t: t.reduce_scatter(output_tensors, input_tensors, opts),
        )

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: object = None,
    ) -> dist.Work:
        return self._run(
            "reduce_scatter_tensor_coalesced",
            output_tensors,
            lambda t: t.reduce_scatter_tensor_coalesced(output_tensors, input_tensors, opts),
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: object = None
    ) -> dist.Work:
        """``torch.distributed.reduce_scatter_tensor`` and functional reduce_scatter."""
        return self._run(
            "reduce_scatter_tensor",
            [output],
            lambda t: t.reduce_scatter_tensor_coalesced([output], [input], opts),
        )

    def alltoall_base(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: object = None,
    ) -> dist.Work:
        return self._run(
            "alltoall_base",
            [output_buffer],
            lambda t: t.alltoall_base(
                output_buffer, input_buffer, output_split_sizes, input_split_sizes, opts
            ),
        )

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: object = None,
    ) -> dist.Work:
        """``torch.distributed.all_to_all`` (the list form)."""
        return self._run(
            "alltoall",
            output_tensors,
            lambda t: t.alltoall(output_tensors, input_tensors, opts),
        )

    def barrier(self, opts: object = None) -> dist.Work:
        return self._run("barrier", None, lambda t: t.barrier(opts))

    def reduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        """``torch.distributed.reduce``: the root's tensor gets the result."""
        return self._run("reduce", tensors, lambda t: t.reduce(tensors, opts))

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: object = None,
    ) -> dist.Work:
        """``torch.distributed.gather``: the root's list gets every rank's tensor."""
        return self._run(
            "gather", output_tensors, lambda t: t.gather(output_tensors, input_tensors, opts)
        )

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: object = None,
    ) -> dist.Work:
        """``torch.distributed.scatter``: rank ``r`` gets the root's tensor ``r``."""
        return self._run(
            "scatter", output_tensors, lambda t: t.scatter(output_tensors, input_tensors, opts)
        )

    def monitored_barrier(self, timeout: object = None, wait_all_ranks: bool = False) -> None:
        """``torch.distributed.monitored_barrier``: a barrier with a deadline
        (``timeout``, else the group's). ftcomm's barrier already ends at
        its deadline on every rank.

        Args:
            timeout: the barrier's deadline (default: the group's).
            wait_all_ranks: accepted and ignored: every rank's barrier ends at
                the deadline.

        Raises:
            CommTimeout: a rank did not come by the deadline (the group is
                aborted until ``configure``).
            CommError: the group failed.
        """
        opts = dist.BarrierOptions()
        # torch passes its own default (30 minutes) where the caller gave none
        if timeout is not None and timeout != default_pg_timeout:
            opts.timeout = timedelta(seconds=to_seconds(timeout, "timeout"))
        self.barrier(opts).wait()

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        return self._run("send", tensors, lambda t: t.send(tensors, dst_rank, tag))

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        return self._run("recv", tensors, lambda t: t.recv(tensors, src_rank, tag))

    # torch >= 2.10 calls the single-tensor ops by these names (Python and C++).
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]
    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]
    all_to_all_single = alltoall_base  # type: ignore[assignment]

    # -- lifecycle ----------------------------------------------------------
    def _configure_group(
        self,
        group: Group,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None,
        group_rank: int | None,
        group_world_size: int | None,
        global_ranks: Sequence[int] | None,
    ) -> None:
        deadline = time.monotonic() + self._timeout  # configure's, the exchange's part too
        get_runtime().call(
            group.configure(
                store_addr,
                rank,
                world_size,
                replica_id=replica_id,
                quorum_id=quorum_id,
                group_rank=group_rank,
                group_world_size=group_world_size,
                global_ranks=global_ranks,
                timeout=self._timeout,  # set_timeout() reaches configure too
                # NCCL/XCCL: this thread's current device (configure runs on the owner loop's)
                device_id=configurer_of(group).backend_cls.caller_device(),
            )
        )
        # Which default-group rank each member is: torch's tables map a
        # group's ranks to the default group's (see _registry.global_ranks).
        self._ranks.configure(
            group, store_addr, rank, world_size, global_ranks, deadline, self._timeout
        )
        _registry.refresh(self)

    # A wrapper's ranks are the wrapped group's as they are now, however that
    # group was configured (through this wrapper or not); a manager's are not.
    def _members_global_ranks(self) -> list[int] | None:
        """Every member's default-group rank, by group rank, or ``None``
        where they do not share one default world (found at configure, or
        at register where the default group came after configure)."""
        if self._inner is not None:
            return self._inner._members_global_ranks() if self._sized_as_inner else None
        return self._ranks.found()

    def _settle_ranks(self, initialized: bool) -> None:
        if self._inner is not None:
            if self._sized_as_inner:
                self._inner._settle_ranks(initialized)
        elif self._ranks.settle(initialized, self._timeout):
            _registry.refresh(self)  # its own entry, and its wrappers'

    def _ranks_pending(self) -> bool:
        if self._inner is not None:
            return self._sized_as_inner and self._inner._ranks_pending()
        return self._ranks.pending()

    def abort(self, errored: bool = True) -> None:
        """Abort the group: ops in flight end with ``CommAborted``, later ops
        raise it, ``errored()`` reports it, until ``configure``. Bounded (never
        waits for the native group) and safe to call twice.

        Args:
            errored: log the abort at WARNING (torchft's error log); False for
                planned teardowns.
        """
        if errored:
            logger.warning("aborting %r", self)
        if self._inner is not None:
            self._inner.abort(errored)
        elif self._group is not None:
            self._group.abort().wait()

    def shutdown(self) -> None:
        """Tear the group down; ops in flight end with ``CommAborted``, later
        ones raise ``NotConfigured`` until ``configure``. Bounded, safe twice."""
        if self._inner is not None:
            self._inner.shutdown()
        elif self._group is not None:
            self._group.shutdown().wait()

    def errored(self) -> CommError | Exception | None:
        """The error that broke the current configuration (a deadline, a dead
        peer, ``abort()``), or ``None``."""
        if self._inner is not None:
            return self._inner.errored()
        return self._group.errored() if self._group is not None else None

    def raising(self) -> contextlib.AbstractContextManager[None]:
        """``with pg.raising(): loss.backward()``: the group's typed error out
        of code that runs its ops for you (docs/migrating.md).

        Inside the block, a ``RuntimeError`` that names an ftcomm error while
        the group is errored (DDP's reducer makes a failed allreduce one, with
        no ``__cause__``) is raised again as a copy of :meth:`errored`'s error,
        from torch's; anything else passes through unchanged.

        Raises:
            CommError: the group's error (``CommTimeout``, ``CommFailed``,
                ``CommAborted``, ...), with torch's ``RuntimeError`` as its
                ``__cause__``.
        """
        return _interop.raising(self.errored)

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Set the default deadline of every op issued from now on (torchft's
        applied it at the next configure only).

        Raises:
            TypeError, ValueError: a bad timeout.
        """
        seconds = to_seconds(timeout, "timeout")
        self._timeout = seconds
        if self._inner is not None:
            self._inner.set_timeout(timedelta(seconds=seconds))
        elif self._group is not None:
            self._group.set_timeout(seconds)

    def size(self) -> int:
        """The world size of the current configuration.

        Raises:
            NotConfigured: the group is not configured.
        """
        if self._inner is not None:
            return self._inner.size()
        return self._configured("size").size()

    def rank(self) -> int:
        """This process's rank in the current configuration.

        Raises:
            NotConfigured: the group is not configured.
        """
        if self._inner is not None:
            return self._inner.rank()
        return self._configured("rank").rank

    def num_active_work(self) -> int:
        """Ops of the current configuration that have not ended yet."""
        if isinstance(self._inner, _Facade):
            return self._inner.num_active_work()
        return self._group.num_active_work() if self._group is not None else 0

    @property
    def parent(self) -> Group | ProcessGroup:
        """The wrapped facade group, or the async :class:`ftcomm.Group` underneath
        (share it with async code: ``await pg.parent.allreduce(t)``).

        Raises:
            NotConfigured: there is none yet (configure first).
        """
        if self._inner is not None:
            return self._inner
        return self._configured("parent")

    def _configured(self, op: str) -> Group:
        if self._group is None:
            raise NotConfigured(f"{op} needs a configured group: call configure(...) first", op=op)
        return self._group

    def __repr__(self) -> str:
        if self._inner is not None:
            return f"{type(self).__name__}(pg={self._inner!r})"
        inner = repr(self._group) if self._group is not None else "unconfigured"
        return f"{type(self).__name__}({inner})"


class ProcessGroupWrapper(_Facade):
    """A reconfigurable group: over a group of its own (subclasses name the
    backend) or over ``pg``, another ftcomm.c10d group it passes every call to.

    Args:
        timeout: the default deadline of every op and of ``configure``.
        pg: the group to wrap, if any.
        fuse: send the small host-tensor allreduces issued before a work is
            looked at as one native op (off by default; docs/fusion.md).

    Raises:
        TypeError: ``pg`` is not an ftcomm.c10d ``ProcessGroup``; ``fuse`` is
            not a bool.
        TypeError, ValueError: a bad timeout.
        ValueError: ``fuse=True`` with ``pg`` (set it on the wrapped group).
    """

    _backend: ClassVar[str | None] = None
    """The ftcomm backend a group of its own uses (None: a pure wrapper)."""
    _subprocess: ClassVar[bool] = False
    """Whether that group runs in a worker process (the ``Baby`` classes)."""

    def __init__(
        self,
        timeout: timedelta | float = timedelta(seconds=60),
        pg: ProcessGroup | None = None,
        *,
        fuse: bool = False,
    ) -> None:
        if pg is not None and not isinstance(pg, ProcessGroup):
            raise TypeError(
                f"pg must be an ftcomm.c10d ProcessGroup, got {type(pg).__name__}"
                " (wrap a raw torch group by building its ftcomm counterpart)"
            )
        if not isinstance(fuse, bool):
            raise TypeError(f"fuse must be a bool, got {type(fuse).__name__}")
        if fuse and pg is not None:
            raise ValueError("fuse=True applies to a group of its own: set it on the wrapped pg")
        super().__init__(0, 1, to_seconds(timeout, "timeout"))
        self._inner = pg
        self._fuse = fuse

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
        """(Re)build the group: every rank calls it with the same fresh store
        address (the arguments: :meth:`ProcessGroup.configure`; ``replica_id``
        is a label). The previous configuration's ops in
        flight end with ``CommAborted``. Blocks until the group is built or the
        timeout passes; never call it on ftcomm's owner loop thread.

        Raises:
            TypeError, ValueError: a bad argument (the previous configuration
                stays as it was).
            CommTimeout: the store or a peer did not answer in time.
            CommFailed: the store or the group construction failed; PrefixReused: a used prefix.
            NotImplementedError: this class has no backend of its own and wraps nothing.
        """
        self._on_configure()
        if self._inner is not None:
            self._inner.configure(
                store_addr,
                replica_id,
                rank,
                world_size,
                quorum_id,
                group_rank,
                group_world_size,
                global_ranks,
            )  # its refresh of torch's tables covers this wrapper too
            return
        self._configure_group(
            self._own_group(),
            store_addr,
            replica_id,
            rank,
            world_size,
            quorum_id,
            group_rank,
            group_world_size,
            global_ranks,
        )

    @classmethod
    def of(cls, group: Group) -> Self:
        """This class's view of an :class:`ftcomm.Group`: its ops are
        ``group``'s, its rank and size follow each ``group.configure()``
        (``ftcomm.Membership``'s too), so DDP and ``torch.distributed``
        run on a group that async code reconfigures. Its ``abort()``,
        ``shutdown()`` and ``set_timeout()`` act on ``group`` (the owner's to
        call); ``register()`` it only after a ``configure()`` through it.

        Args:
            group: the group to view, of this class's backend.

        Raises:
            TypeError: ``group`` is not an ``ftcomm.Group``.
            ValueError: its backend is not this class's (a Baby class:
                ``Group(subprocess=True)``, and the others ``False``).
        """
        _interop.check_view(cls.__name__, cls._backend, cls._subprocess, group)
        pg = cls(timeout=group.timeout)
        pg._group, pg._ops = group, GroupOps(group)
        return pg

    def _on_configure(self) -> None:
        """Called first by :meth:`configure`: wrappers drop per-configuration state."""

    def _own_group(self) -> Group:
        """The :class:`~ftcomm.Group` this process group runs on, made on first use."""
        with self._group_lock:
            group = self._group
            if group is None:
                group = self._new_group()
                self._group, self._ops = group, GroupOps(group)
            return group

    def _ftcomm_group(self) -> Group:
        inner = self._inner
        if inner is None:
            return self._own_group()
        if isinstance(inner, _Facade):
            return inner._ftcomm_group()
        raise NotImplementedError(f"{type(inner).__name__} runs on no ftcomm Group")

    def _new_group(self) -> Group:
        if self._backend is None:
            raise NotImplementedError(
                f"{type(self).__name__} has no backend of its own: pass pg= or use "
                "ProcessGroupGloo/ProcessGroupNCCL/ProcessGroupXCCL"
            )
        return Group(
            self._backend,
            subprocess=self._subprocess,
            timeout=self._timeout,
            fuse=self._fuse,
            **self._group_options(),
        )

    def _group_options(self) -> dict[str, Any]:
        """More keyword arguments for the :class:`~ftcomm.Group` it builds."""
        return {}

    def _c10d_backend(self) -> tuple[str, str] | None:
        if self._inner is not None:
            return self._inner._c10d_backend()
        device = _DEVICES.get(self._backend or "")
        return (self._backend, device) if self._backend and device else None

    def getBackendName(self) -> str:
        if self._inner is not None:
            return self._inner.getBackendName()
        if self._backend is None:
            raise NotImplementedError(f"{type(self).__name__} wraps nothing: it has no backend")
        return f"ftcomm-baby-{self._backend}" if self._subprocess else f"ftcomm-{self._backend}"


_DEVICES = {"gloo": "cpu", "nccl": "cuda", "xccl": "xpu"}
"""The device type of each native backend a wrapper may run."""


class ProcessGroupGloo(ProcessGroupWrapper):
    """A reconfigurable Gloo group (CPU tensors) with deadlines on every op.

    Every collective, including ``reduce_scatter`` and
    ``reduce_scatter_tensor_coalesced`` (which torchft's refused), send and recv.
    Its arguments are :class:`ProcessGroupWrapper`'s.
    """

    _backend = "gloo"


class _AcceleratorGroup(ProcessGroupWrapper):
    """NCCL and XCCL: one class, parametrised by the backend. ``wait()`` keeps
    c10d's stream meaning, and ``errored()`` never blocks (docs/accelerators.md)."""

    def _new_group(self) -> Group:
        # RuntimeError where torch has no such library, before anything is built.
        return super()._new_group()


class ProcessGroupNCCL(_AcceleratorGroup):
    """A reconfigurable NCCL group (CUDA tensors): each op's deadline aborts
    the communicator (``ncclCommAbort``) and raises ``CommTimeout``.
    Constructing it always works; ``configure`` raises ``RuntimeError`` where
    torch has no NCCL or sees no GPU. Its arguments are :class:`ProcessGroupWrapper`'s."""

    _backend = "nccl"


class ProcessGroupXCCL(_AcceleratorGroup):
    """A reconfigurable XCCL group (Intel XPU tensors); as :class:`ProcessGroupNCCL`."""

    _backend = "xccl"


_DUMMY_STORE = "127.0.0.1:1/ftcomm-dummy"  # never contacted: the dummy backend has no store


class ProcessGroupDummy(_Facade):
    """A group of one rank that talks to nobody: every op ends at once with what
    a real one-rank group would give (allreduce leaves the tensor as it is,
    allgather copies the input to the output, ...).

    As torchft's, it also takes lists sized for another world (what
    ``ManagedProcessGroup`` over a dummy passes, sized for the manager's
    world): each output gets a copy of the input in the same position, the
    rest are left as they are.

    ``configure`` only counts its calls (``configure_count``) and clears an
    ``abort()``; its arguments are ignored.

    Args:
        rank: this process's rank, 0.
        world: the world size, 1.

    Raises:
        ValueError: ``rank`` is not 0 or ``world`` is not 1.
    """

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        if rank != 0 or world != 1:
            raise ValueError(
                f"ProcessGroupDummy has rank 0 and world size 1, got rank={rank}, world={world}"
            )
        super().__init__(rank, world, 60.0)
        self._dummy = self._group = Group("dummy", timeout=self._timeout)
        self._ops = DummyOps(self._dummy)
        self.configure_count = 0
        self._configure_group(self._dummy, _DUMMY_STORE, "0", 0, 1, None, None, None, None)

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
        self.configure_count += 1
        self._configure_group(self._dummy, _DUMMY_STORE, "0", 0, 1, None, None, None, None)

    def getBackendName(self) -> str:
        return "ftcomm-dummy"

    def __repr__(self) -> str:
        return "ProcessGroupDummy()"  # torchft's: it has no state worth showing
