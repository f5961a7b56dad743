"""``python -m ftcomm doctor``: what this machine has, and what ftcomm can do on it.

It reports torch's version and build, the backends torch has here (Gloo,
NCCL, XCCL) and the devices they would use, whether ``subprocess=True`` can
run (a writable ``/dev/shm`` with room), uvloop, anyio and torchft, and the
abort truth table of docs/errors.md for the backends that are here. The
in-process Gloo row is also checked live: two ranks in this process, rank 0
aborts an allreduce that rank 1 never joined, and the check passes when that
op ends with ``CommAborted`` within 2 s, the group's sockets were found (its
abort is real), rank 1's matching op then fails instead of completing, and
rank 0's tensor is untouched. ``--store HOST:PORT`` also checks that a store
answers there.

Exit status: 0 when everything ftcomm needs is here; 1 when something is
missing or failed (one line of advice for each); 2 for a bad argument.
Missing optional things (a GPU, uvloop, torchft) are notes, not problems.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

JSON = dict[str, Any]

MIN_TORCH = "2.7"
"""The oldest torch ftcomm supports (pyproject's ``torch>=2.7``)."""
SHM_DIR = "/dev/shm"
"""Where ``subprocess=True`` puts tensors (``backends/subprocess/_shm.py``)."""
SHM_MIN_FREE = 256 << 20
"""Below this much free room in ``/dev/shm``, ``subprocess=True`` is reported too small."""
STORE_TIMEOUT = 2.0
"""How long ``--store`` waits for the store to answer (seconds)."""
LIVE_ABORT_BOUND = 2.0
"""How soon an aborted in-process Gloo op must end for the live check to pass."""
LIVE_TIMEOUT = 5.0
"""The live check's groups' timeout: bounds its configure and its ops."""
TRUTH_TABLE = "docs/errors.md, 'Abort truth table'"


@dataclass(frozen=True)
class Problem:
    """Something ftcomm needs that is missing or failed here, and what to do."""

    what: str
    advice: str


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


# -- what is here ----------------------------------------------------------------------
def _version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or ``None``."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_info() -> JSON:
    """torch's version and build: CUDA or ROCm version, or ``"cpu"``; XPU or not."""
    import torch

    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    xpu = getattr(torch.version, "xpu", None)
    build = f"cuda {cuda}" if cuda else f"rocm {hip}" if hip else f"xpu {xpu}" if xpu else "cpu"
    return {
        "version": torch.__version__,
        "build": build,
        "cuda": cuda,
        "hip": hip,
        "xpu": xpu,
        "git": torch.version.git_version,
    }


def _devices(module_name: str) -> tuple[bool, int]:
    """Whether torch sees a device of this kind (``cuda``, ``xpu``), and how many.

    Warnings are silenced: a CUDA build on a machine without a driver warns.
    """
    import torch

    module: Any = getattr(torch, module_name, None)
    if module is None:
        return False, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            present = bool(module.is_available())
            count = int(module.device_count()) if present else 0
        except Exception:
            return False, 0
    return present, count


def backends_info() -> JSON:
    """Each backend: in this torch build? its device present? how many? usable?"""
    import torch.distributed as dist

    from .backends._accel_device import FLAVORS

    distributed = bool(dist.is_available())
    gloo = distributed and bool(dist.is_gloo_available())
    found: JSON = {
        "gloo": {"in_torch": gloo, "device": "cpu", "device_present": True, "devices": 1},
    }
    found["gloo"]["usable"] = gloo
    for name, flavor in FLAVORS.items():
        in_torch = distributed and getattr(dist, flavor.native, None) is not None
        present, count = _devices(flavor.device_type)
        entry: JSON = {
            "in_torch": in_torch,
            "device": flavor.device_type,
            "device_present": present,
            "devices": count,
            "usable": in_torch and present,
        }
        if name == "nccl" and in_torch:
            with contextlib.suppress(Exception):
                import torch.cuda.nccl

                nccl: Any = torch.cuda.nccl  # untyped in torch's stubs
                entry["library_version"] = ".".join(map(str, nccl.version()))
        found[name] = entry
    return found


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
        from ._runtime.loop import loop_kind

        loop = {"kind": loop_kind(), "error": None}
    except (ValueError, RuntimeError) as exc:
        loop = {"kind": None, "error": str(exc)}
    return {
        "uvloop": {"importable": importable, "version": _version("uvloop")},
        "anyio": {"version": _version("anyio")},
        "torchft": {"version": _version("torchft")},
        "owner_loop": loop,
    }


# -- the live check ----------------------------------------------------------------------
async def _live_gloo_abort() -> JSON:
    """Two ranks of one in-process Gloo group here; rank 0 aborts an allreduce
    rank 1 never joined; then rank 1 issues the matching op.

    Passes when rank 0's op ends with ``CommAborted`` within
    :data:`LIVE_ABORT_BOUND`, no ``RuntimeWarning`` came at ``configure()``
    and the group's sockets were found, rank 1's op fails (a local-only abort
    would let it complete against rank 0's still-running native op), and rank
    0's tensor is untouched. Everything is shut down and dropped before it returns.
    """
    import torch

    from .backends.gloo import GlooBackend
    from .errors import CommAborted, CommError
    from .group import Group

    result: JSON = {"ran": True, "passed": False, "error": None}
    from ._server import serve_store

    store = serve_store()  # loopback only (c10d's own server listens everywhere)
    addr = store.addr("ftcomm-doctor")
    # ftcomm logs the peer's failure (a WARNING), maybe after this returns:
    # expected here, and the report says it. Records naming another store pass.
    _QUIET.marks.add(addr)
    logging.getLogger("ftcomm").addFilter(_QUIET)  # once: addFilter skips a repeat
    g0, g1 = Group("gloo", timeout=LIVE_TIMEOUT), Group("gloo", timeout=LIVE_TIMEOUT)
    try:
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await asyncio.gather(g0.configure(addr, 0, 2), g1.configure(addr, 1, 2))
        result["configure_s"] = round(time.monotonic() - started, 4)
        result["warnings"] = [
            str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
        ]
        cfg = g0._config
        backend = cfg.backend if cfg is not None else None
        result["sockets_found"] = isinstance(backend, GlooBackend) and backend.aborts_for_real

        mine = torch.ones(1)
        work = g0.allreduce(mine)  # rank 1 never joins this one
        await asyncio.sleep(0.02)  # in flight, waiting for rank 1
        started = time.monotonic()
        g0.abort()
        try:
            await asyncio.wait_for(work, LIVE_ABORT_BOUND)
        except CommAborted:
            result["rank0"] = "CommAborted"
        except CommError as exc:  # before TimeoutError: CommTimeout is one too
            result["rank0"] = f"{type(exc).__name__}: {exc}"
        except asyncio.TimeoutError:
            result["rank0"] = f"still running {LIVE_ABORT_BOUND:g} s after the abort"
        else:
            result["rank0"] = "completed (a success after the abort)"
        result["abort_s"] = round(time.monotonic() - started, 4)

        # The matching op: a real abort fails it; a local-only one lets it
        # complete against rank 0's native op, still running.
        try:
            await g1.allreduce(torch.ones(1), timeout=1.0)
        except CommError as exc:
            result["peer"] = type(exc).__name__
        else:
            result["peer"] = "completed against the aborted op"
        result["tensor_untouched"] = mine.tolist() == [1.0]
        result["passed"] = (
            result["rank0"] == "CommAborted"
            and result["abort_s"] <= LIVE_ABORT_BOUND
            and not result["warnings"]
            and result["sockets_found"]
            and result["peer"] == "CommFailed"
            and result["tensor_untouched"]
        )
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(g0.shutdown(), g1.shutdown()), LIVE_TIMEOUT)
        store.close()
    return result


class _Unless(logging.Filter):
    """Drops the log records that name one of :attr:`marks` (the live checks'
    stores, each on a port of its own). It stays on ftcomm's logger: the
    owner loop may log a group's failure after the check has returned."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` passes: it names none of :attr:`marks`."""
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: let it be seen
            return True
        return not any(mark in message for mark in self.marks)


_QUIET = _Unless()


def live_check() -> JSON:
    """Run :func:`_live_gloo_abort` on an event loop of its own (on a thread
    of its own when the caller's thread already runs one)."""
    out: list[JSON] = []

    def run() -> None:
        try:
            out.append(asyncio.run(_live_gloo_abort()))
        except Exception as exc:  # it could not even start (a store, a group)
            out.append({"ran": True, "passed": False, "error": f"{type(exc).__name__}: {exc}"})

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        run()
    else:
        thread = threading.Thread(target=run, name="doctor-live")
        thread.start()
        thread.join()
    return out[0] if out else {"ran": True, "passed": False, "error": "the check died"}


# -- a store -----------------------------------------------------------------------------
def store_check(text: str) -> JSON:
    """Whether a TCPStore answers at ``text`` (``host:port[/prefix]``), within
    :data:`STORE_TIMEOUT`: one TCP connect (a refusal is an answer at once),
    then a store client's handshake and one read."""
    from ._store import connect_store, resolve_store_addr, why_unreachable

    addr = resolve_store_addr(text, "--store")  # env:// too: torchrun's store
    result: JSON = {
        "addr": text,
        "host_port": addr.host_port,
        "prefix": addr.prefix,
        "reachable": False,
        "detail": "",
    }
    started = time.monotonic()
    try:
        socket.create_connection((addr.host, addr.port), timeout=STORE_TIMEOUT).close()
    except OSError as exc:
        result["detail"] = why_unreachable(exc)
    else:
        try:
            with _quiet_stderr():
                store = connect_store(addr, STORE_TIMEOUT)
                store.check(["ftcomm/doctor"])
                del store
        except Exception as exc:
            result["detail"] = (
                f"something listens there, but no TCPStore answered: {type(exc).__name__}: {exc}"
            )
        else:
            result["reachable"] = True
            result["detail"] = "a TCPStore answered"
    result["seconds"] = round(time.monotonic() - started, 4)
    return result


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to a scratch file for the block, and drop it.

    c10d's store client logs a failed handshake with a C++ stack to the
    process's stderr; the report says what failed in words instead. Only the
    store client's connect runs inside (at most :data:`STORE_TIMEOUT`).
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as scratch:
            os.dup2(scratch.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)


# -- the report --------------------------------------------------------------------------
def collect(store: str | None, live: bool) -> JSON:
    """Everything doctor reports, as one JSON-able object; ``problems`` and
    ``notes`` say what is missing (``ok`` is whether nothing needed is)."""
    from torch.torch_version import TorchVersion

    from . import __version__

    report: JSON = {
        "ftcomm": __version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch_info(),
        "backends": backends_info(),
        "shm": shm_info(),
        "packages": packages_info(),
    }
    problems: list[Problem] = []
    notes: list[str] = []
    tv = report["torch"]["version"]
    if TorchVersion(tv) < MIN_TORCH:
        problems.append(
            Problem(
                f"torch {tv} is older than {MIN_TORCH}, the oldest ftcomm supports",
                f"upgrade torch: pip install -U 'torch>={MIN_TORCH}'",
            )
        )
    backends = report["backends"]
    if not backends["gloo"]["usable"]:
        problems.append(
            Problem(
                f"this torch build ({tv}) has no Gloo (torch.distributed.is_gloo_available() "
                "is False)",
                "install a torch wheel from pytorch.org (their builds have Gloo), "
                "not a build with USE_DISTRIBUTED=0 or USE_GLOO=0",
            )
        )
    for name in ("nccl", "xccl"):
        b = backends[name]
        kind = "a CUDA GPU" if name == "nccl" else "an Intel XPU"
        if not b["in_torch"]:
            notes.append(
                f"{name}: not in this torch build (optional: for {kind}, a torch built for it)"
            )
        elif not b["device_present"]:
            notes.append(f"{name}: in torch, but torch sees no device here (optional: for {kind})")
    shm = report["shm"]
    free = shm["free_bytes"]
    if not shm["exists"]:
        problems.append(
            Problem(
                f"{SHM_DIR} does not exist: Group(..., subprocess=True) cannot run here",
                f"mount a tmpfs on {SHM_DIR} (Linux: mount -t tmpfs -o size=1G tmpfs {SHM_DIR}), "
                "or use in-process groups only",
            )
        )
    elif not shm["writable"]:
        problems.append(
            Problem(
                f"{SHM_DIR} is not writable by this user: subprocess=True cannot run here",
                f"make {SHM_DIR} writable (normally mode 1777), or use in-process groups only",
            )
        )
    elif free is None or free < SHM_MIN_FREE:
        room = "unknown" if free is None else _size(free)
        problems.append(
            Problem(
                f"{SHM_DIR} has {room} free, less than {_size(SHM_MIN_FREE)}: too small for "
                "subprocess=True (its tensors travel through it)",
                f"give {SHM_DIR} more room (docker run --shm-size=1g ..., or "
                f"mount -o remount,size=1G {SHM_DIR}); in-process groups do not use it",
            )
        )
    packages = report["packages"]
    if not packages["uvloop"]["importable"]:
        notes.append("uvloop: not installed (optional): ftcomm's owner loop runs on asyncio's")
    if packages["anyio"]["version"] is None:
        notes.append("anyio: not installed (a dependency of ftcomm: pip install 'anyio>=4')")
    if packages["torchft"]["version"] is None:
        notes.append("torchft: not installed (optional: pip install 'ftcomm[torchft]')")
    loop_error = packages["owner_loop"]["error"]
    if loop_error:
        problems.append(
            Problem(
                f"ftcomm cannot start its owner loop: {loop_error}",
                "unset FTCOMM_LOOP, set it to auto, asyncio or uvloop, or pip install uvloop",
            )
        )

    if not live:
        report["live_check"] = {"ran": False, "reason": "--no-live"}
    elif not backends["gloo"]["usable"]:
        report["live_check"] = {"ran": False, "reason": "no Gloo in this torch"}
    elif loop_error:
        report["live_check"] = {"ran": False, "reason": "ftcomm's owner loop cannot start"}
    else:
        report["live_check"] = live_check()
        lc = report["live_check"]
        if not lc["passed"]:
            problems.append(
                Problem(
                    "the live in-process Gloo abort check failed: "
                    + _live_text(lc).removeprefix("FAILED: "),
                    _live_advice(lc),
                )
            )

    rows: list[JSON] = []
    for name, (in_process, sub) in ROWS.items():
        if not backends[name]["usable"]:
            continue
        for row in (in_process, sub):
            entry = asdict(row)
            if row is GLOO_SUBPROCESS:  # CPU tensors travel through /dev/shm
                entry["here"] = "usable" if shm["usable"] else f"needs {SHM_DIR} (see problems)"
            if row is GLOO_IN_PROCESS:
                entry["here"] = "live check: " + _live_text(report["live_check"])
            rows.append(entry)
    report["abort_truth_table"] = rows
    report["truth_table_source"] = TRUTH_TABLE

    report["store"] = None
    if store is not None:
        report["store"] = sc = store_check(store)
        if not sc["reachable"]:
            problems.append(
                Problem(
                    f"the store at {sc['addr']} is not reachable: {sc['detail']}",
                    f"start a store on {sc['host_port']} (python -m ftcomm store --host "
                    "HOST --port PORT, in a process that stays up), or fix the address; "
                    "check that a firewall lets the port through",
                )
            )

    report["problems"] = [asdict(p) for p in problems]
    report["notes"] = notes
    report["ok"] = not problems
    return report


def _live_text(lc: JSON) -> str:
    """The live check's outcome in one line."""
    if not lc.get("ran"):
        return f"not run ({lc.get('reason')})"
    if lc.get("error"):
        return f"error: {lc['error']}"
    facts = (
        f"rank 0's op: {lc.get('rank0')} {lc.get('abort_s', 0) * 1000:.1f} ms after abort(); "
        f"the peer's matching op: {lc.get('peer')}; "
        f"rank 0's tensor {'untouched' if lc.get('tensor_untouched') else 'WRITTEN'}; "
        f"sockets {'found' if lc.get('sockets_found') else 'NOT found'}"
    )
    if lc.get("warnings"):
        facts += "; a RuntimeWarning at configure() (--json has its text)"
    return ("passed: " if lc.get("passed") else "FAILED: ") + facts


def _live_advice(lc: JSON) -> str:
    """What to do when the live check failed."""
    if not lc.get("sockets_found") and not lc.get("error"):
        return (
            "in-process Gloo aborts stay local here (finding a group's sockets needs "
            "Linux's /proc/self/fd and /proc/self/net/tcp): use Group('gloo', "
            "subprocess=True), whose aborts kill the worker, and report this output"
        )
    return (
        "use Group('gloo', subprocess=True), whose aborts kill the worker, and report "
        "this output (python -m ftcomm doctor --json) as an issue"
    )


def _size(nbytes: int) -> str:
    """``nbytes`` in MiB or GiB, one decimal."""
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


def render(report: JSON) -> str:
    """The human report: what is here, the truth table's rows, problems and notes."""
    t = report["torch"]
    lines = [
        "ftcomm doctor",
        f"  ftcomm      {report['ftcomm']}",
        f"  python      {report['python']}",
        f"  platform    {report['platform']} ({report['cpus']} CPUs)",
        f"  torch       {t['version']} (build: {t['build']})",
        "",
        "backends",
    ]
    for name, b in report["backends"].items():
        if name == "gloo":
            what = "CPU tensors"
        else:
            kind = "CUDA GPUs" if name == "nccl" else "XPUs"
            what = f"{b['devices']} {kind}" if b["device_present"] else f"no {kind} seen"
            if b.get("library_version"):
                what += f", NCCL {b['library_version']}"
        status = "yes" if b["usable"] else "no "
        lines.append(f"  {name:<11} {status}  in torch: {_yn(b['in_torch'])}; {what}")
    shm = report["shm"]
    if shm["exists"] and shm["total_bytes"] is not None:
        room = f"{_size(shm['free_bytes'])} free of {_size(shm['total_bytes'])}"
        room += ", writable" if shm["writable"] else ", NOT writable"
    else:
        room = "missing"
    lines.append(f"  {'subprocess':<11} {'yes' if shm['usable'] else 'no '}  {SHM_DIR}: {room}")
    p = report["packages"]
    uv = p["uvloop"]
    lines += [
        "",
        "packages",
        f"  uvloop      {uv['version'] if uv['importable'] else 'not installed'}",
        f"  anyio       {p['anyio']['version'] or 'not installed'}",
        f"  torchft     {p['torchft']['version'] or 'not installed'} (optional)",
        f"  owner loop  {p['owner_loop']['kind'] or 'cannot start'}",
        "",
        f"abort truth table ({report['truth_table_source']}), for the backends here",
    ]
    for row in report["abort_truth_table"]:
        lines.append(f"  {row['backend']}, {row['mode']}: real abort: {row['real_abort']}")
        lines.append(f"      abort:       {row['abort_does']}")
        if row["local_op"] != "-":
            lines.append(f"      local op:    {row['local_op']}")
            lines.append(f"      its tensors: {row['tensors']}")
            lines.append(f"      peers' op:   {row['peers']}")
            lines.append(f"      verified by: {row['verified']}")
        if "here" in row:
            lines.append(f"      here:        {row['here']}")
    absent = [n for n in ROWS if not report["backends"][n]["usable"]]
    if absent:
        lines.append(f"  (not here: {', '.join(absent)}; their rows are in docs/errors.md)")
    if report["store"] is not None:
        s = report["store"]
        verdict = "reachable" if s["reachable"] else "NOT reachable"
        lines += ["", "store", f"  {s['addr']}  {verdict}: {s['detail']} ({s['seconds']:g} s)"]
    if report["notes"]:
        lines += ["", "notes"] + [f"  - {n}" for n in report["notes"]]
    lines.append("")
    if report["ok"]:
        lines.append("OK: everything ftcomm needs is here")
    else:
        lines.append(f"{len(report['problems'])} problem(s):")
        for prob in report["problems"]:
            lines.append(f"  - {prob['what']}")
            lines.append(f"    do: {prob['advice']}")
    return "\n".join(lines) + "\n"


def _yn(flag: bool) -> str:
    """``"yes"`` or ``"no"``."""
    return "yes" if flag else "no"


def main(argv: Sequence[str]) -> int:
    """``python -m ftcomm doctor [--store HOST:PORT] [--json] [--no-live]``.

    Prints the report (or one JSON object with ``--json``); returns 0 when
    everything needed is here, 1 when something is missing or failed (the
    report's ``problems``, each with advice), 2 for a bad argument.
    """
    parser = argparse.ArgumentParser(
        prog="python -m ftcomm doctor",
        description=(
            "Check this machine for ftcomm: torch, its backends, which of them abort "
            "for real, /dev/shm for subprocess=True, uvloop, and optionally a store."
        ),
    )
    parser.add_argument(
        "--store",
        metavar="HOST:PORT",
        help="check that a TCPStore answers there (host:port, host:port/prefix, [v6]:port)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="skip the live in-process Gloo abort check (two ranks in this process)",
    )
    args = parser.parse_args(list(argv))
    if args.store is not None:
        from ._store import resolve_store_addr

        try:
            resolve_store_addr(args.store, "--store")  # env:// too: torchrun's store
        except ValueError as exc:
            parser.error(str(exc))
    report = collect(args.store, live=not args.no_live)
    try:
        sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else render(report))
        sys.stdout.flush()
    except BrokenPipeError:  # | head: the reader left; the status still counts
        with contextlib.suppress(OSError, ValueError):
            out = sys.stdout.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, out)  # so that the exit's flush does not fail again
            os.close(devnull)
    return 0 if report["ok"] else 1
