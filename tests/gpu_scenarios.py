"""What ``make gpu-check`` runs on one GPU (scripts/gpu_check.py), and
tests/test_accelerator_gpu.py where pytest finds a GPU.

Each scenario is a coroutine ``(rig, store_port) -> figures``: it raises
``AssertionError`` when ftcomm breaks a promise, and returns what it
measured. A :class:`Rig` hides the only things that differ between a real
GPU and the fake device layer (tests/fake_accel.py), so that the scenarios
themselves run on a CPU too (``scripts/gpu_check.py --fake``): where the
tensors live, how a stream is held busy, how to wait for the device.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from helpers import peers_came

import ftcomm
from ftcomm import CommAborted, CommTimeout
from ftcomm._runtime.loop import get_runtime
from ftcomm.testing import inspect

Figures = dict[str, Any]

LATE_OK = 0.05
"""The promise: ``CommTimeout`` no later than the deadline plus this."""


class Rig:
    """A real CUDA device."""

    fake = False
    init_deadline = 3.0
    """configure()'s deadline when a peer never joins."""
    late_ok = LATE_OK
    """How late after its deadline ``CommTimeout`` may come."""

    def __init__(self) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._cycles_per_s: float | None = None

    def tensor(self, data: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.as_tensor(data, dtype=dtype, device=self.device)

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def cycles_per_second(self) -> float:
        if self._cycles_per_s is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)  # warm up
            start.record()
            torch.cuda._sleep(100_000_000)
            end.record()
            end.synchronize()
            self._cycles_per_s = 100_000_000 / (start.elapsed_time(end) / 1000)
        return self._cycles_per_s

    def busy(self, seconds: float) -> None:
        """Hold the current stream busy for ``seconds`` (the op queued behind it)."""
        torch.cuda._sleep(int(self.cycles_per_second() * seconds))

    def peer_absent(self) -> None:
        """The next configure's peers never show up (real: nobody else runs)."""


class FakeRig(Rig):
    """The fake device layer: tensors on the CPU, "busy" holds the events."""

    fake = True
    init_deadline = 1.0  # nothing real waits: a shorter one tests the same
    # The logic, not the latency: the suite runs this on 2 busy cores, where
    # a thread can wait a few tenths of a second for the GIL.
    late_ok = 1.0

    def __init__(self, device: Any) -> None:
        self.device = torch.device("cpu")
        self.fake_device = device
        self._cycles_per_s = None

    def sync(self) -> None:
        return None

    def busy(self, seconds: float) -> None:
        fake = self.fake_device
        fake.hold()
        # Half of it: what counts is that it outlasts the op's deadline.
        timer = threading.Timer(seconds / 2, fake.release)
        timer.daemon = True
        timer.start()

    def peer_absent(self) -> None:
        self.fake_device.init_gate.clear()


async def _configure(g: ftcomm.Group, port: int, prefix: str, **kw: Any) -> None:
    await g.configure(f"127.0.0.1:{port}/{prefix}", kw.pop("rank", 0), kw.pop("world", 1), **kw)


async def every_collective(rig: Rig, port: int) -> Figures:
    """World size 1, every collective, on the device: the values are right."""
    async with ftcomm.Group("nccl", timeout=30.0) as g:
        await _configure(g, port, "every")
        t = rig.tensor([1.0, 2.0])
        assert torch.equal((await g.allreduce(t)).cpu(), torch.tensor([1.0, 2.0]))
        a, b = await g.allreduce_coalesced([rig.tensor([1.0]), rig.tensor([2.0, 3.0])])
        assert a.item() == 1.0
        assert b.sum().item() == 5.0
        (out,) = await g.allgather(rig.tensor([4.0, 5.0]))
        assert out.cpu().tolist() == [4.0, 5.0]
        (o,) = await g.allgather_into_tensor_coalesced([rig.empty(2)], [rig.tensor([6.0, 7.0])])
        assert o.cpu().tolist() == [6.0, 7.0]
        assert (await g.broadcast(rig.tensor([8.0]), root=0)).item() == 8.0
        r = await g.reduce_scatter(rig.empty(2), [rig.tensor([1.0, 2.0])])
        assert r.cpu().tolist() == [1.0, 2.0]
        (r2,) = await g.reduce_scatter_tensor_coalesced([rig.empty(2)], [rig.tensor([3.0, 4.0])])
        assert r2.cpu().tolist() == [3.0, 4.0]
        x = await g.alltoall_base(rig.empty(2), rig.tensor([5.0, 6.0]), [2], [2])
        assert x.cpu().tolist() == [5.0, 6.0]
        m = await g.allreduce(rig.tensor([3.0]), op="max")
        assert m.item() == 3.0
        avg = await g.allreduce(rig.tensor([4.0]), op="avg")
        assert avg.item() == 4.0
        assert await g.barrier() is None
    return {"collectives": 12}


async def busy_stream_deadline(rig: Rig, port: int) -> Figures:
    """A collective queued behind a stream held busy: its deadline fires with
    its event pending, ``CommTimeout`` comes by deadline + 50 ms, the
    communicator is aborted, and a new configuration works afterwards."""
    deadline = 0.5
    async with ftcomm.Group("nccl", timeout=30.0) as g:
        await _configure(g, port, "busy1")
        backend: Any = inspect(g).backend  # type: ignore[union-attr]
        await g.allreduce(rig.tensor([1.0]))  # warm
        # Made before the stream is held: a host-to-device copy waits for it.
        t = rig.tensor([1.0])
        rig.busy(3.0)
        start = time.monotonic()
        work = g.allreduce(t, timeout=deadline)
        try:
            await work
        except CommTimeout:
            late = time.monotonic() - start - deadline
        else:
            raise AssertionError("an op behind a busy stream succeeded before its deadline")
        assert isinstance(g.errored(), CommTimeout)
        abort_start = time.monotonic()
        backend.closed().result(60.0)  # the native abort has returned
        abort_s = time.monotonic() - abort_start
        rig.sync()  # the held stream drains; the aborted kernel must not hang it
        drained_s = time.monotonic() - abort_start
        await _configure(g, port, "busy2")
        again = await g.allreduce(rig.tensor([2.0]))
        assert again.item() == 2.0
    assert late <= rig.late_ok, f"CommTimeout came {late * 1e3:.1f} ms after the deadline"
    return {
        "timeout_after_deadline_ms": round(late * 1e3, 2),
        "abort_returned_ms": round(abort_s * 1e3, 1),
        "stream_drained_ms": round(drained_s * 1e3, 1),
        "recovered": True,
    }


async def init_absent_peer(rig: Rig, port: int) -> Figures:
    """World size 2 with rank 1 absent: configure raises ``CommTimeout`` at
    its deadline, and the communicator that was connecting is aborted (its
    connect thread returns)."""
    deadline = rig.init_deadline
    rig.peer_absent()
    # Rank 1 came to the store (else configure waits there, and no
    # communicator is built), then never joined the communicator.
    peers_came(port, "absent", 2, [1])
    async with ftcomm.Group("nccl") as g:
        start = time.monotonic()
        try:
            await _configure(g, port, "absent", world=2, timeout=deadline)
        except CommTimeout:
            raised = time.monotonic() - start
        else:
            raise AssertionError("configure succeeded with a peer absent")
        # The connect thread returns once the abort has gone through.
        assert get_runtime().control.wait_idle(120.0), "the connect thread never returned"
        returned = time.monotonic() - start
    assert raised <= deadline + 1.0, f"configure raised after {raised:.2f} s"
    return {
        "configure_raised_s": round(raised, 3),
        "connect_thread_returned_s": round(returned, 3),
    }


async def subprocess_ws1(rig: Rig, port: int) -> Figures:
    """``Group("nccl", subprocess=True)``, world size 1: CUDA tensors by IPC."""
    if rig.fake:
        return {"skipped": "the worker process runs the real device layer"}
    async with ftcomm.Group("nccl", subprocess=True, timeout=60.0) as g:
        await _configure(g, port, "sub", timeout=120.0)
        t = rig.tensor([1.0, 2.0, 3.0])
        assert (await g.allreduce(t)).cpu().tolist() == [1.0, 2.0, 3.0]
        (o,) = await g.allgather(rig.tensor([4.0]))
        assert o.item() == 4.0
        assert (await g.broadcast(rig.tensor([5.0]))).item() == 5.0
    return {"collectives": 3}


def facade_ws1(rig: Rig, port: int) -> Figures:
    """``ProcessGroupNCCL``: ``wait()`` orders the stream, the result is right."""
    from ftcomm.c10d import ProcessGroupNCCL

    pg = ProcessGroupNCCL(timeout=timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{port}/facade", "0", 0, 1)
    try:
        t = rig.tensor([1.0, 2.0])
        work = pg.allreduce([t])
        assert work.wait() is True
        fut = work.get_future()
        rig.sync()
        assert fut.wait()[0].cpu().tolist() == [1.0, 2.0]
        t = rig.tensor([1.0])  # before the stream is held (a copy would wait for it)
        rig.busy(2.0)
        late = pg.allreduce([t])
        try:
            late.wait(timedelta(seconds=0.3))
        except CommTimeout:
            pass
        else:
            raise AssertionError("wait(timeout) behind a busy stream succeeded")
        assert isinstance(pg.errored(), CommTimeout)
        rig.sync()
    finally:
        pg.shutdown()
    return {"ok": True}


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


async def bench(rig: Rig, port: int) -> Figures:
    """Latency of a 4-byte and a 256 MiB allreduce, world size 1: raw c10d
    NCCL (issue, then wait for the device) against ``await g.allreduce``
    (which returns once the op's event has completed), in the same run."""
    if rig.fake:
        return {"skipped": "raw NCCL needs a GPU"}
    import torch.distributed as dist

    figures: Figures = {}
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    opts: Any = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
    raw: Any = dist.ProcessGroupNCCL(dist.PrefixStore("raw", store), 0, 1, opts)  # type: ignore[attr-defined]
    sizes = {"4B": (1, 300), "256MiB": (64 << 20, 20)}
    async with ftcomm.Group("nccl", timeout=60.0) as g:
        await _configure(g, port, "bench")
        for name, (numel, n) in sizes.items():
            t = rig.empty(numel)
            t.fill_(1.0)

            def raw_once(t: torch.Tensor = t) -> None:
                raw.allreduce([t]).wait()
                rig.sync()

            async def ours_once(t: torch.Tensor = t) -> None:
                await g.allreduce(t)

            raw_s = await _timed(lambda: _as_coro(raw_once), n)
            ours_s = await _timed(ours_once, n)
            raw_p50, raw_p90 = _percentiles(raw_s)
            ours_p50, ours_p90 = _percentiles(ours_s)
            figures[name] = {
                "raw_p50_us": round(raw_p50 * 1e6, 1),
                "raw_p90_us": round(raw_p90 * 1e6, 1),
                "ftcomm_p50_us": round(ours_p50 * 1e6, 1),
                "ftcomm_p90_us": round(ours_p90 * 1e6, 1),
                "ratio_p50": round(ours_p50 / raw_p50, 2),
            }
    raw.shutdown()
    return figures


async def _as_coro(fn: Callable[[], None]) -> None:
    fn()


async def _timed(once: Callable[[], Awaitable[None]], n: int) -> list[float]:
    for _ in range(max(3, n // 10)):
        await once()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await once()
        samples.append(time.perf_counter() - start)
    return samples


class Skipped(Exception):
    """A scenario this machine cannot run (the check records it as skipped)."""


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fsdp2_fault_tolerant.py"
EXAMPLE_GPUS = 4
"""examples/fsdp2_fault_tolerant.py on NCCL: 2 replicas x 2 shards, one GPU each."""
EXAMPLE_TIMEOUT = 90
"""The example's own bound; the scenario's and the check's limit are above it."""


def fsdp2_example(rig: Rig, port: int) -> Figures:
    """The FSDP2 fault-tolerance example on NCCL, where the machine has a GPU
    per process (the CPU run is tests/test_clients.py's).

    Raises:
        Skipped: fewer GPUs than processes (or the fake device layer).
    """
    gpus = 0 if rig.fake else torch.cuda.device_count()
    if gpus < EXAMPLE_GPUS:
        raise Skipped(f"needs {EXAMPLE_GPUS} GPUs (one per process), this machine has {gpus}")
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(EXAMPLE), "--device", "cuda", "--timeout", str(EXAMPLE_TIMEOUT)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=EXAMPLE_TIMEOUT + 10,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        print(exc.stdout or "")
        raise
    print(done.stdout)
    assert done.returncode == 0, f"exit {done.returncode}"
    assert "RECOVERED" in done.stdout
    return {"seconds": round(time.monotonic() - start, 1)}


STATE_TENSORS = 8
STATE_FLOATS = 16 << 20
"""The state copy's state: 8 tensors of 64 MiB on the GPU, and a CPU one."""


async def _copy_rank(ctx: Any, backend: str) -> Figures:
    """One rank of :func:`state_copy`: rank 0 sends, rank 1 receives in place."""
    device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    fill = (lambda i: float(i + 1)) if ctx.rank == 0 else (lambda i: 0.0)
    state = {
        f"t{i}": torch.full((STATE_FLOATS,), fill(i), device=device) for i in range(STATE_TENSORS)
    }
    state["step"] = torch.tensor(3.0 if ctx.rank == 0 else 0.0)  # Adam's step: on the CPU
    before = {k: v.data_ptr() for k, v in state.items()}
    async with ftcomm.Group(backend, timeout=60) as g:
        await g.configure(ctx.addr(backend), ctx.rank, 2)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        out, step = await ftcomm.sync_state(g, state, 5 if ctx.rank == 0 else 0)
        took = time.perf_counter() - start
    in_place = all(out[k].data_ptr() == ptr for k, ptr in before.items())
    values = all(bool(out[f"t{i}"].eq(i + 1).all()) for i in range(STATE_TENSORS))
    return {
        "step": step,
        "in_place": in_place,
        "values": values and out["step"].item() == 3.0 and out["step"].device.type == "cpu",
        "seconds": took,
    }


def state_copy(rig: Rig, port: int) -> Figures:
    """``sync_state`` of a 512 MiB GPU state (and a CPU tensor) between two
    processes: over Gloo (one GPU: each chunk staged through the host) and,
    with two GPUs, over NCCL (device to device, straight into the receiver's
    tensors). Each time the receiver's tensors are its own, with the values
    sent, and its CPU tensor stays on the CPU.

    Raises:
        Skipped: the fake device layer (it models one rank).
    """
    from ftcomm.testing import run_world

    if rig.fake:
        raise Skipped("two processes on the device: the fake layer models one rank")
    figures: Figures = {}
    nbytes = STATE_TENSORS * STATE_FLOATS * 4
    for backend, gpus in (("gloo", 1), ("nccl", 2)):
        if torch.cuda.device_count() < gpus:
            figures[backend] = f"skipped: needs {gpus} GPUs"
            continue
        ranks = run_world(_copy_rank, 2, args=(backend,), timeout=180)
        assert all(r["step"] == 5 for r in ranks), ranks
        assert ranks[1]["in_place"], ranks
        assert ranks[1]["values"], ranks
        seconds = max(r["seconds"] for r in ranks)
        figures[backend] = {"seconds": round(seconds, 3), "GB/s": round(nbytes / seconds / 1e9, 2)}
    return figures


SCENARIOS: dict[str, Callable[[Rig, int], Any]] = {
    "every_collective": every_collective,
    "busy_stream_deadline": busy_stream_deadline,
    "init_absent_peer": init_absent_peer,
    "subprocess_ws1": subprocess_ws1,
    "facade_ws1": facade_ws1,
    "bench": bench,
    "fsdp2_example": fsdp2_example,
    "state_copy": state_copy,
}

UNVERIFIED = (
    "One GPU cannot host two NCCL ranks, so a peer that is aborted while the "
    "other waits in the same collective, the peer's op failing (not "
    "completing) after the abort, and NCCL's async errors from a dead peer "
    "(get_error, TORCH_NCCL_ASYNC_ERROR_HANDLING=2 keeping the process alive) "
    "are not checked here; nor is examples/fsdp2_fault_tolerant.py on NCCL, "
    f"which needs {EXAMPLE_GPUS} GPUs (the fsdp2_example scenario runs it where they are)."
)

__all__ = ["SCENARIOS", "UNVERIFIED", "CommAborted", "FakeRig", "Rig", "Skipped"]
