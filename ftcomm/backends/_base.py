"""The contract every backend fills.

A backend is one configured native group. The front end (:mod:`ftcomm.group`)
validates every argument before it calls a backend, so backends may assume
well-formed tensors and ranks; they issue the op and return a
:class:`~ftcomm._runtime.native.NativeOp` without waiting for it. ``connect``
is the only call that blocks, and it runs on a worker thread.
"""

from __future__ import annotations

import abc
import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.distributed import ReduceOp

from .._runtime.native import NativeOp
from .._store import ConnectProgress, StoreAddr
from .._validate import ReduceOpArg
from ..errors import CommError

NUMERIC_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
"""The dtypes every native backend sends (Gloo adds the complex ones)."""


@dataclass(frozen=True)
class ConnectSpec:
    """Everything a backend needs to build its native group."""

    store: StoreAddr
    rank: int
    world_size: int
    timeout: float
    """Seconds the store connection and the group construction may take."""
    replica_id: str = "0"
    quorum_id: int | None = None
    group_rank: int | None = None
    group_world_size: int | None = None
    global_ranks: tuple[int, ...] | None = None
    device: int | None = None
    """The accelerator device index (NCCL/XCCL): the one current on the
    thread that called ``configure()``, since the connect runs on another;
    ``None``: the connecting thread's current one."""
    progress: ConnectProgress = field(default_factory=ConnectProgress, compare=False, repr=False)
    """How far the connect got (the connecting thread writes it): what a
    ``configure()`` that times out names."""


class Backend(abc.ABC):
    """One configured native group. Ops take the remaining deadline in seconds."""

    name: ClassVar[str]
    device_type: str
    """The device type of the tensors this backend accepts (``"*"``: any); a
    class attribute, which an instance may set (the accelerator backend
    takes it from its device layer)."""
    dtypes: ClassVar[frozenset[torch.dtype] | None] = None
    """The dtypes it can send (``None``: any)."""
    reduce_ops: ClassVar[frozenset[ReduceOp.RedOpType]]
    int_avg: ClassVar[bool] = True
    """Whether AVG of integer tensors is the backend's own (NCCL's); where
    it is not (Gloo's AVG is ftcomm's SUM and division), it is refused."""
    short_allreduce: ClassVar[bool] = False
    """Whether :meth:`allreduce_sum` is this backend's own short path, which
    ``Group.allreduce`` takes for a plain op (see there); else every op goes
    through :meth:`allreduce`."""
    stoppable_connect: ClassVar[bool] = True
    """Whether a connect ends soon once its ``cancel`` completes or its
    timeout passes (else connects run on a bounded pool of threads)."""
    copies_in_flight: ClassVar[bool] = False
    """Whether an op's bytes are copied for as long as it is in flight (a
    worker process's shared memory): what many big ops at once cost in memory."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    @classmethod
    @abc.abstractmethod
    def connect(
        cls, spec: ConnectSpec, cancel: concurrent.futures.Future[Any] | None = None
    ) -> Backend:
        """Build the native group. Blocks; called on a worker thread.

        ``cancel`` completes when nobody waits for this connect any more (the
        configure deadline passed, or it was superseded): a backend that can
        stop its construction then does, and raises. Others finish, and the
        group disposes of what they built."""

    @classmethod
    def caller_device(cls) -> int | None:
        """The device index of the calling thread that the group should use
        (:attr:`ConnectSpec.device`); ``None`` for backends without one."""
        return None

    @classmethod
    def check_usable(cls) -> None:
        """Raise ``RuntimeError`` if this torch (or machine) cannot run the
        backend at all; called when a group is created."""
        return None  # every backend but NCCL/XCCL runs wherever torch does

    def close(self) -> list[object]:
        """Let go of the native objects; the caller hands them to the reaper."""
        return []

    def closed(self) -> concurrent.futures.Future[None] | None:
        """A future that completes once :meth:`close` has fully taken effect
        (a worker process killed and reaped), or ``None`` when closing is
        immediate (in-process groups: their native objects go to the reaper)."""
        return None

    def watch(self, on_break: Callable[[CommError], None]) -> None:  # noqa: B027 (a hook)
        """Have ``on_break(error)`` called (any thread) if the group breaks on
        its own, with no op in flight to report it (a worker process that
        dies). In-process groups only break through their ops: a no-op."""

    @abc.abstractmethod
    def allreduce(
        self, tensors: Sequence[torch.Tensor], op: ReduceOpArg, timeout: float
    ) -> NativeOp: ...

    def allreduce_sum(self, tensor: torch.Tensor, timeout: float) -> NativeOp:
        """``allreduce([tensor], ReduceOp.SUM, timeout)`` of a tensor the caller
        has checked (dense, contiguous, on this backend's device, of a dtype
        it sends); a backend with :attr:`short_allreduce` issues it in fewer
        steps."""
        return self.allreduce([tensor], ReduceOp.SUM, timeout)

    @abc.abstractmethod
    def allgather(
        self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, timeout: float
    ) -> NativeOp: ...

    @abc.abstractmethod
    def allgather_into_tensor(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], timeout: float
    ) -> NativeOp: ...

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float) -> NativeOp: ...

    @abc.abstractmethod
    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOpArg,
        timeout: float,
    ) -> NativeOp: ...

    @abc.abstractmethod
    def reduce_scatter_tensor(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        op: ReduceOpArg,
        timeout: float,
    ) -> NativeOp: ...

    @abc.abstractmethod
    def alltoall_base(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        timeout: float,
    ) -> NativeOp: ...

    @abc.abstractmethod
    def barrier(self, timeout: float) -> NativeOp: ...

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, dst: int, tag: int, timeout: float) -> NativeOp: ...

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, src: int, tag: int, timeout: float) -> NativeOp: ...
