"""torchft's rows, where it is installed: its ProcessGroupGloo (torchft)
and its ProcessGroupBabyGloo (tft-baby), and how the bench shuts the latter
down without its worker's tracebacks (:func:`close_torchft_baby`, which the
recovery part uses too); and a replica of torchft's Manager as the
membership and chaos rows run it (:func:`manager_replica`).
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

import torch

from .groups import _c10d_runner
from .runner import _OP_TIMEOUT, HOST, ChildEnv, Runner


def _torchft_missing() -> str | None:
    try:
        importlib.import_module("torchft.process_group")
    except Exception as exc:  # not installed, or broken: either way, no rows
        return f"import torchft failed ({type(exc).__name__}: {exc})"
    return None


async def _open_torchft(env: ChildEnv) -> Runner:
    pgs: Any = importlib.import_module("torchft.process_group")
    pg = pgs.ProcessGroupGloo(timeout=timedelta(seconds=_OP_TIMEOUT))
    return _c10d_runner(env, "torchft", "torchft-bench", pg)


def close_torchft_baby(pg: Any) -> None:
    """Shut a torchft ``ProcessGroupBaby`` down without its worker's tracebacks.

    torchft 0.2's ``shutdown()`` closes its pipes first and kills the worker
    after. The worker, blocked reading its request pipe, wakes to that EOF
    first: it logs "worker errored: EOFError", fails to send the error back
    (``BrokenPipeError``) and raises, and multiprocessing prints that as
    "Process SpawnProcess-N" with two tracebacks, for every group shut down.

    Here the pipe that torchft's future thread reads is closed first (that
    thread stops without a word on a closed pipe), then the worker is killed
    and reaped while its request pipe is still open, so it never sees an EOF,
    and only then does torchft's own ``shutdown()`` close the rest. A worker
    that had already exited before its shutdown died on its own: that is
    raised (after the shutdown), not hidden. Without those internals (another
    torchft), this is plain ``shutdown()``.
    """
    proc = getattr(pg, "_p", None)
    future_pipe = getattr(pg, "_future_pipe", None)
    code: int | None = None
    pid: int | None = None
    if proc is not None and future_pipe is not None:
        code, pid = proc.exitcode, proc.pid
        future_pipe.close()
        if code is None:
            proc.kill()
            proc.join(10)
    pg.shutdown()
    if code is not None:
        raise RuntimeError(
            f"torchft's worker (pid {pid}) had exited on its own, code {code}, before its shutdown"
        )


async def _open_torchft_baby(env: ChildEnv) -> Runner:
    pgs: Any = importlib.import_module("torchft.process_group")
    pg = pgs.ProcessGroupBabyGloo(timeout=timedelta(seconds=_OP_TIMEOUT))
    return _c10d_runner(
        env, "tft-baby", "torchft-baby-bench", pg, close=lambda: close_torchft_baby(pg)
    )


def manager_replica(
    lighthouse: str,
    replica_id: str,
    *,
    min_size: int,
    load_state_dict: Any,
    state_dict: Any,
    op_deadline: float,
    quorum_timeout: float,
    heartbeat_timeout: float,
    **more: Any,
) -> tuple[Any, Any]:
    """A replica of torchft's Manager (one rank, its own replica group's
    store): its ProcessGroupGloo with ``op_deadline``, its heartbeat every
    fifth of ``heartbeat_timeout`` (ftcomm's default ratio), and the state
    over the group (``PGTransport``, as examples/torchft_manager.py: the
    default HTTP transport writes a line per request to stderr). ``more``:
    the Manager's other arguments. Returns the Manager (the caller shuts
    it down) and the replica group's store, which must live as long."""
    from torch._C._distributed_c10d import TCPStore

    manager_mod: Any = importlib.import_module("torchft.manager")
    pgs: Any = importlib.import_module("torchft.process_group")
    pg_transport: Any = importlib.import_module("torchft.checkpointing.pg_transport")
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False)  # the replica group's
    deadline = timedelta(seconds=op_deadline)
    pg = pgs.ProcessGroupGloo(timeout=deadline)
    manager = manager_mod.Manager(
        pg=pg,
        min_replica_size=min_size,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=replica_id,
        store_addr=HOST,
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname=HOST,
        timeout=deadline,
        quorum_timeout=timedelta(seconds=quorum_timeout),
        connect_timeout=timedelta(seconds=10),
        heartbeat_interval=timedelta(seconds=heartbeat_timeout / 5),
        checkpoint_transport=pg_transport.PGTransport(
            pg, timeout=deadline, device=torch.device("cpu")
        ),
        **more,
    )
    return manager, store
