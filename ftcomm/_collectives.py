"""The collectives of :class:`~ftcomm.Group`: argument checks, then one issue.

:class:`Collectives`, ``Group``'s base class, is what a group offers to
issue. Each method checks its arguments (``TypeError``/``ValueError`` naming
the argument, before anything is sent: the group stays usable) and hands the
native call to the group's :class:`~ftcomm._issue.Issuer`, which issues it on
the calling thread at once, so issue order is call order on every rank. See
docs/ops.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ReduceOp

from . import _validate as v
from ._issue import BatchScope, Issuer
from ._runtime.deadline import Timeout
from ._runtime.work import Work
from ._verify import dtype_code, reduce_code

_SUM = ReduceOp.SUM


class Collectives:
    """What a :class:`~ftcomm.Group` offers to issue, through its issuer.

    Args:
        issuer: the group's issue path (lock, fusion, default deadline).
        backend: the backend's name, for error messages.
    """

    def __init__(self, issuer: Issuer, backend: str) -> None:
        self._issuer = issuer
        self.backend = backend

    def flush(self) -> None:
        """Send the open batch of fused allreduces now (``fuse=True``, or in a
        :meth:`batch` block), as one native op; a no-op without one. A point
        of the program's order: call it at the same place on every rank.
        Any thread.

        Raises:
            Nothing: a batch the group refuses fails its ops (their awaits
            raise), as an op refused at issue would.
        """
        self._issuer.flush()

    def batch(self) -> BatchScope:
        """A block whose small allreduces are fused, on a group made without
        ``fuse=True`` (with it, a block that ends with a flush)::

            async with group.batch():
                works = [group.allreduce(t) for t in stats]
            await asyncio.gather(*works)   # sent at the block's end, as one op

        The block ends with :meth:`flush`; inside it, looking at an op sends
        its batch as ``fuse=True`` does. It applies to the task (context)
        that entered it, and to tasks started inside it while it lasts:
        ops other tasks issue meanwhile cut the batch (an op that cannot
        join it). ``with`` works too, from a thread.

        Raises:
            RuntimeError: the same block object entered twice.
        """
        return BatchScope(self._issuer, self)

    def allreduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp.RedOpType | ReduceOp | str = _SUM,
        *,
        timeout: Timeout | None = None,
    ) -> Work[torch.Tensor]:
        """Reduce ``tensor`` in place across all ranks; ``await`` gives ``tensor``.

        Args:
            tensor: the tensor to reduce, in place.
            op: a ``ReduceOp`` member, its lower-case name (``"sum"``, ``"avg"``,
                ``"max"`` ...) or ``ReduceOp.PREMUL_SUM(factor)``; where the backend
                lacks AVG or PREMUL_SUM, ftcomm makes it around a SUM (docs/migrating.md).
            timeout: this op's deadline, in seconds or a timedelta (default:
                the group's).

        Raises:
            TypeError, ValueError: bad arguments (the group stays usable).
            NotConfigured: no configuration.
            CommAborted: the group is errored.
            CommFailed: the native group refused to issue the op (it is
                broken: the group is errored from now on).
            OSError: ``subprocess=True`` and ``/dev/shm`` has no room for the
                op's tensors (nothing was sent; the group stays usable).
        """
        if op is _SUM and timeout is None:  # the common small op: one frame
            work = self._issuer.short_allreduce(tensor)
            if work is not None:
                return work
        cfg = self._issuer.configured("allreduce")
        v.check_tensor(tensor, "tensor", cfg.backend)
        if op is _SUM and cfg.sum_ok:
            # The default, valid for every dtype: each check is a few calls
            # into torch, and on the small-op path they cost more than the op's
            # Python elsewhere (cold caches after every wait).
            rop: v.ReduceOpArg = _SUM
        else:
            rop = v.check_reduce_op(op, cfg.backend.reduce_ops, self.backend)
            v.check_reduce_dtype(rop, tensor, "tensor", int_avg=cfg.backend.int_avg)
        return self._issuer.allreduce(cfg, tensor, rop, timeout)

    def allreduce_coalesced(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp.RedOpType | ReduceOp | str = _SUM,
        *,
        timeout: Timeout | None = None,
    ) -> Work[list[torch.Tensor]]:
        """Reduce several tensors of one dtype in place as one op; ``await`` gives the list.

        Args:
            tensors: the tensors to reduce in place, all of one dtype.
            op: as :meth:`allreduce`.
            timeout: this op's deadline, in seconds or a timedelta (default:
                the group's).

        Raises: as :meth:`allreduce`.
        """
        cfg = self._issuer.configured("allreduce_coalesced")
        ts = v.check_tensor_list(tensors, "tensors", cfg.backend)
        for i, t in enumerate(ts[1:], 1):
            v.check_dtype(t, f"tensors[{i}]", ts[0], "tensors[0]")
        rop = v.check_reduce_op(op, cfg.backend.reduce_ops, self.backend)
        v.check_reduce_dtype(rop, ts[0], "tensors[0]", int_avg=cfg.backend.int_avg)
        if v.scaled_in_place(rop, cfg.backend.int_avg):
            v.check_apart(ts, "tensors")
        return self._issuer.issue(
            cfg,
            "allreduce_coalesced",
            timeout,
            ts,
            lambda b, s: b.allreduce(ts, rop, s),
            ts,
            reduce_code(rop),
        )

    def allgather(
        self,
        tensor: torch.Tensor,
        *,
        out: Sequence[torch.Tensor] | None = None,
        timeout: Timeout | None = None,
    ) -> Work[list[torch.Tensor]]:
        """Gather ``tensor`` from every rank into ``out`` (allocated if ``None``):
        one tensor per rank, in rank order. ``await`` gives that list.

        Args:
            tensor: this rank's input.
            out: one tensor per rank, each like ``tensor``, to gather into.
            timeout: this op's deadline, in seconds or a timedelta (default:
                the group's).

        Raises: as :meth:`allreduce`.
        """
        cfg = self._issuer.configured("allgather")
        rules, ws = cfg.backend, cfg.backend.world_size
        v.check_tensor(tensor, "tensor", rules)
        if out is None:
            outs = [torch.empty_like(tensor) for _ in range(ws)]
        else:
            outs = v.check_tensor_list(out, "out", rules, length=ws)
            for i, o in enumerate(outs):
                v.check_like(o, f"out[{i}]", tensor, "tensor")
        return self._issuer.issue(
            cfg, "allgather", timeout, outs, lambda b, s: b.allgather(outs, tensor, s), (tensor,)
        )

    def allgather_into_tensor_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        *,
        timeout: Timeout | None = None,
    ) -> Work[list[torch.Tensor]]:
        """For each pair, gather every rank's ``inputs[i]`` into ``outputs[i]``
        (``world_size`` times as many elements, rank-major). ``await`` gives ``outputs``.

        Args:
            outputs: one tensor per input, ``world_size`` times its size.
            inputs: this rank's tensors, one per output.
            timeout: this op's deadline, in seconds or a timedelta (default:
                the group's).

        Raises: as :meth:`allreduce`.
        """
        cfg = self._issuer.configured("allgather_into_tensor_coalesced")
        rules, ws = cfg.backend, cfg.backend.world_size
        outs = v.check_tensor_list(outputs, "outputs", rules)
        ins = v.check_tensor_list(inputs, "inputs", rules, length=len(outs))
        for i, (o, t) in enumerate(zip(outs, ins, strict=True)):
            v.check_stacked(o, f"outputs[{i}]", t, f"inputs[{i}]", ws)
        return self._issuer.issue(
            cfg,
            "allgather_into_tensor_coalesced",
            timeout,
            outs,
            lambda b, s: b.allgather_into_tensor(outs, ins, s),
            ins,
        )

    def broadcast(
        self, tensor: torch.Tensor, root: int = 0, *, timeout: Timeout | None = None
    ) -> Work[torch.Tensor]:
        """Copy ``root``'s ``tensor`` into every rank's ``tensor``; ``await`` gives it.

        Args:
            tensor: the root's source, every other rank's destination.
            root: the rank whose tensor is sent.
            timeout: this op's deadline, in seconds or a timedelta (default:
                the group's).

        Raises: as :meth:`allreduce`.
        """
        cfg = self._issuer.configured("broadcast")
        v.check_tensor(tensor, "tensor", cfg.backend)
        root = v.check_rank(root, "root", cfg.backend.world_size)
        return self._issuer.issue(
            cfg,
            "broadcast",
            timeout,
            tensor,
            lambda b, s: b.broadcast(tensor, root, s),
            (tensor,),
            root,
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOp.RedOpType | ReduceOp | str = _SUM,
        *,
        timeout: Timeout | None = None,
    ) -> Work[torch.Tensor]:
        """Reduce ``inputs[r]`` across ranks into rank ``r``'s ``output``
        (``inputs`` holds one tensor per rank, each shaped like ``output``).

        Args:
            output: this rank's result.
            inputs: one tensor per rank, each shaped like ``output``.
            op: as :meth:`allreduce`.
            timeout: this op's deadline, in seconds or a timedelta (default:
                the group's).

        Raises: as :meth:`allreduce`.
        """
        cfg = self._issuer.configured("reduce_scatter")
        rules, ws = cfg.backend, cfg.backend.world_size
        v.check_tensor(output, "output", rules)
        ins = v.check_tensor_list(inputs, "inputs", rules, length=ws)
        for i, t in enumerate(ins):
            v.check_like(t, f"inputs[{i}]", output, "output")
        rop = v.check_reduce_op(op, cfg.backend.reduce_ops, self.backend)
        v.check_reduce_dtype(rop, output, "output", int_avg=cfg.backend.int_avg)
        return self._issuer.issue(
            cfg,
            "reduce_scatter",
            timeout,
            output,
            lambda b, s: b.reduce_scatter(output, ins, rop, s),
            ins,
            reduce_code(rop),
        )

    def reduce_scatter_tensor_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        op: ReduceOp.RedOpType | ReduceOp | str = _SUM,
        *,
        timeout: Timeout | None = None,
    ) -> Work[list[torch.Tensor]]:
        """For each pair, reduce ``inputs[i]`` (``world_size`` chunks, rank-major)
        across ranks and keep this rank's chunk in ``outputs[i]``.

        Args:
            outputs: this rank's chunk of each reduction.
            inputs: one tensor per output, ``world_size`` times its size.
            op: as :meth:`allreduce`.
            timeout: this op's deadline, in seconds or a timedelta (default:
                the group's).

        Raises: as :meth:`allreduce`.
        """
        cfg = self._issuer.configured("reduce_scatter_tensor_coalesced")
        rules, ws = cfg.backend, cfg.backend.world_size
        outs = v.check_tensor_list(outputs, "outputs", rules)
        ins = v.check_tensor_list(inputs, "inputs", rules, length=len(outs))
        for i, (o, t) in enumerate(zip(outs, ins, strict=True)):
            v.check_stacked(t, f"inputs[{i}]", o, f"outputs[{i}]", ws)
        rop = v.check_reduce_op(op, cfg.backend.reduce_ops, self.backend)
        for i, o in enumerate(outs):  # the dtypes may differ from one pair to the next
            v.check_reduce_dtype(rop, o, f"outputs[{i}]", int_avg=cfg.backend.int_avg)
        if v.scaled_in_place(rop, cfg.backend.int_avg):
            v.check_apart(outs, "outputs")
        return self._issuer.issue(
            cfg,
            "reduce_scatter_tensor_coalesced",
            timeout,
            outs,
            lambda b, s: b.reduce_scatter_tensor(outs, ins, rop, s),
            ins,
            reduce_code(rop),
        )

    def alltoall_base(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        timeout: Timeout | None = None,
    ) -> Work[torch.Tensor]:
        """Send slice ``r`` of ``tensor`` (along dim 0) to rank ``r`` and receive
        rank ``r``'s slice into slice ``r`` of ``output``. Split sizes default to
        equal slices. ``await`` gives ``output``.

        Args:
            output: where each rank's slice is received.
            tensor: the slices to send, one per rank.
            output_split_sizes: how many rows of ``output`` each rank sends here.
            input_split_sizes: how many rows of ``tensor`` go to each rank.
            timeout: this op's deadline, in seconds or a timedelta (default:
                the group's).

        Raises: as :meth:`allreduce`.
        """
        cfg = self._issuer.configured("alltoall_base")
        rules, ws = cfg.backend, cfg.backend.world_size
        v.check_tensor(output, "output", rules)
        v.check_tensor(tensor, "tensor", rules)
        v.check_dtype(output, "output", tensor, "tensor")
        for name, t in (("output", output), ("tensor", tensor)):
            if t.dim() == 0:
                raise ValueError(f"{name} must have at least one dimension")
        if output.shape[1:] != tensor.shape[1:]:
            raise ValueError("output and tensor must have the same shape past dim 0")
        outs = v.check_splits(
            output_split_sizes, "output_split_sizes", ws, output.shape[0], "output"
        )
        ins = v.check_splits(input_split_sizes, "input_split_sizes", ws, tensor.shape[0], "tensor")
        if not outs and not ins and output.shape[0] != tensor.shape[0]:
            raise ValueError("output and tensor must have the same shape[0] with equal splits")
        return self._issuer.issue(
            cfg,
            "alltoall_base",
            timeout,
            output,
            lambda b, s: b.alltoall_base(output, tensor, outs, ins, s),
            (),  # sizes may differ by rank; the dtype may not
            dtype_code(tensor.dtype),
        )

    def barrier(self, *, timeout: Timeout | None = None) -> Work[None]:
        """Wait until every rank has reached the barrier.

        Args:
            timeout: this op's deadline, in seconds or a timedelta (default:
                the group's).

        Raises: as :meth:`allreduce`.
        """
        cfg = self._issuer.configured("barrier")
        return self._issuer.issue(cfg, "barrier", timeout, None, lambda b, s: b.barrier(s))

    def send(
        self, tensor: torch.Tensor, dst: int, tag: int = 0, *, timeout: Timeout | None = None
    ) -> Work[None]:
        """Send ``tensor`` to rank ``dst``; the matching ``recv`` uses the same ``tag``.

        Args:
            tensor: the tensor to send.
            dst: the receiving rank (not this one).
            tag: a number >= 0 that matches this send to its ``recv``.
            timeout: this op's deadline, in seconds or a timedelta (default:
                the group's).

        Raises: as :meth:`allreduce`.
        """
        cfg = self._issuer.configured("send")
        v.check_tensor(tensor, "tensor", cfg.backend)
        dst = v.check_rank(dst, "dst", cfg.backend.world_size, not_self=cfg.backend.rank)
        tag = v.check_int(tag, "tag", minimum=0)
        return self._issuer.issue(
            cfg, "send", timeout, None, lambda b, s: b.send(tensor, dst, tag, s), None
        )

    def recv(
        self, tensor: torch.Tensor, src: int, tag: int = 0, *, timeout: Timeout | None = None
    ) -> Work[torch.Tensor]:
        """Receive into ``tensor`` from rank ``src``; ``await`` gives ``tensor``.

        Args:
            tensor: where the data is received.
            src: the sending rank (not this one).
            tag: the ``tag`` of the matching ``send``.
            timeout: this op's deadline, in seconds or a timedelta (default:
                the group's).

        Raises: as :meth:`allreduce`.
        """
        cfg = self._issuer.configured("recv")
        v.check_tensor(tensor, "tensor", cfg.backend)
        src = v.check_rank(src, "src", cfg.backend.world_size, not_self=cfg.backend.rank)
        tag = v.check_int(tag, "tag", minimum=0)
        return self._issuer.issue(
            cfg, "recv", timeout, tensor, lambda b, s: b.recv(tensor, src, tag, s), None
        )


def check_open(group: Collectives, op: str) -> None:
    """Raise what issuing ``op`` on ``group`` now would raise at once:
    ``NotConfigured``, or ``CommAborted`` on an errored group (for ftcomm's
    layers above the group: the c10d facade's ops that never reach a native
    group). Not API."""
    group._issuer.check_open(op)
