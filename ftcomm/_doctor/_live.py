"""The live abort check: two ranks of one in-process Gloo group in this
process abort an op for real, or the check fails; its outcome in words, and
the problem a failure is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import warnings

from ._record import JSON, Findings, Problem

LIVE_ABORT_BOUND = 2.0
"""How soon an aborted in-process Gloo op must end for the live check to pass."""
LIVE_TIMEOUT = 5.0
"""The live check's groups' timeout: bounds its configure and its ops."""


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

    from ..backends.gloo import GlooBackend
    from ..errors import CommAborted, CommError
    from ..group import Group, config_of

    result: JSON = {"ran": True, "passed": False, "error": None}
    from .._server import serve_store

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
        cfg = config_of(g0)
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
        except TimeoutError:
            result["rank0"] = f"still running {LIVE_ABORT_BOUND:g} s after the abort"
        else:
            result["rank0"] = "completed (a success after the abort)"
        result["abort_s"] = round(time.monotonic() - started, 4)

        # The matching op: a real abort fails it (in ms); a local-only one lets
        # it complete against rank 0's native op, still running. Its deadline
        # only bounds the wait: 1 s once proved short on a loaded machine.
        try:
            await g1.allreduce(torch.ones(1), timeout=LIVE_TIMEOUT)
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


def live_text(lc: JSON) -> str:
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


def advise_live(lc: JSON, found: Findings) -> None:
    """Add to ``found`` what :func:`live_check` found: a check that ran and
    did not pass is a problem."""
    if lc["ran"] and not lc["passed"]:
        found.problems.append(
            Problem(
                "the live in-process Gloo abort check failed: "
                + live_text(lc).removeprefix("FAILED: "),
                _live_advice(lc),
            )
        )
