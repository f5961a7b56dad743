"""``--store HOST:PORT``: whether a TCPStore answers there, within
:data:`STORE_TIMEOUT`, and the problem it is when none does.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator

from ._record import JSON, Findings, Problem

STORE_TIMEOUT = 2.0
"""How long ``--store`` waits for the store to answer (seconds)."""


def store_check(text: str) -> JSON:
    """Whether a TCPStore answers at ``text`` (``host:port[/prefix]``), within
    :data:`STORE_TIMEOUT`: one TCP connect (a refusal is an answer at once),
    then a store client's handshake and one read."""
    from .._store import connect_store, resolve_store_addr, why_unreachable

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


def advise_store(sc: JSON, found: Findings) -> None:
    """Add to ``found`` what :func:`store_check` found: a store that does
    not answer is a problem."""
    if not sc["reachable"]:
        found.problems.append(
            Problem(
                f"the store at {sc['addr']} is not reachable: {sc['detail']}",
                f"start a store on {sc['host_port']} (python -m ftcomm store --host "
                "HOST --port PORT, in a process that stays up), or fix the address; "
                "check that a firewall lets the port through",
            )
        )
