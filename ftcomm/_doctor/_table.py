"""The abort truth table of docs/errors.md, as data: :class:`AbortRow`, one
row per backend and mode, and :data:`ROWS`, the rows by backend. What is
true here (the rows' ``here`` column) is added by ``ftcomm._doctor.collect``.
"""

from __future__ import annotations

from dataclasses import dataclass

TRUTH_TABLE = "docs/errors.md, 'Abort truth table'"


@dataclass(frozen=True)
class AbortRow:
    """One row of docs/errors.md's abort truth table, as stated there."""

    backend: str
    mode: str
    real_abort: str
    """``"yes"``, ``"no"``, or ``"yes (...)"`` with a condition."""
    abort_does: str
    local_op: str
    tensors: str
    peers: str
    verified: str


# The facts of docs/errors.md ("Abort truth table") and README.md, per backend
# and mode. Keep in step with those tables.
GLOO_IN_PROCESS = AbortRow(
    "gloo",
    "in process",
    "yes, when its sockets are found (else a RuntimeWarning at configure() says so)",
    "shuts the group's TCP connections down (shutdown(SHUT_RDWR))",
    "fails within 1-4 ms (rarely a blocked send's error is published 1 s after the abort)",
    "never written after the error",
    "fail with CommFailed ('Connection closed by peer'), whenever they come",
    "CPU tests and drills (tests/test_abort_drill.py; make soak: 2000 trials)",
)
GLOO_SUBPROCESS = AbortRow(
    "gloo",
    "subprocess=True",
    "yes",
    "kills the worker",
    "the worker is killed",
    "never written after the error (results are copied back only on success)",
    "fail with CommFailed (the worker's connections close with it)",
    "CPU tests and drills (6 trials by default, 200 in make soak)",
)
NCCL_IN_PROCESS = AbortRow(
    "nccl",
    "in process",
    "yes (not yet verified on a GPU)",
    "ncclCommAbort on a worker thread (await group.abort() waits for it, up to 2 s)",
    "over at the deadline, never a success; the communicator is aborted",
    "hold whatever the aborted kernels left (do not read them)",
    "end by their own deadlines, or fail when NCCL reports the peer's failure",
    "CPU tests over a fake device layer; GPU: not yet run (make gpu-check)",
)
NCCL_SUBPROCESS = AbortRow(
    "nccl",
    "subprocess=True",
    "yes (not yet verified on a GPU)",
    "kills the worker (its CUDA context goes with it)",
    "the worker is killed",
    "never written after the error (as Gloo's subprocess row)",
    "as Gloo's subprocess row",
    "CPU tests of the worker over the fake; GPU: not yet run",
)
XCCL_IN_PROCESS = AbortRow(
    "xccl",
    "in process",
    "no",
    "nothing native: torch's XCCL has no abort (a RuntimeWarning at configure() says so); "
    "the op is given up here, the group errored",
    "given up locally, never a success",
    "may still be written by its kernels",
    "may complete against it",
    "CPU tests over the fake; no XPU here",
)
XCCL_SUBPROCESS = AbortRow(
    "xccl",
    "subprocess=True",
    "n/a",
    "XPU tensors cannot reach a worker (torch has no XPU IPC): they are refused",
    "-",
    "-",
    "-",
    "-",
)
ROWS: dict[str, tuple[AbortRow, AbortRow]] = {
    "gloo": (GLOO_IN_PROCESS, GLOO_SUBPROCESS),
    "nccl": (NCCL_IN_PROCESS, NCCL_SUBPROCESS),
    "xccl": (XCCL_IN_PROCESS, XCCL_SUBPROCESS),
}
