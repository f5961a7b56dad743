"""A store that takes connections but never answers (hung or stopped).

c10d's store client blocks in its handshake (``TCPStore::ping``, a ``recv``
with no timeout) for as long as such a server stays silent, whatever the
``timeout`` it was given. ``configure`` still raises ``CommTimeout`` on time,
but the connect goes on blocking its ftcomm-control thread. Two things must
not follow from that: the control threads running out (so that a later
``configure`` against a healthy store cannot even start), and the process
dying at exit with SIGABRT when the blocked call finally returns into a
finalizing interpreter ("terminate called without an active exception").
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import asyncio, socket, time
import ftcomm
from torch._C._distributed_c10d import TCPStore

silent = socket.socket()  # accepts (into the backlog), never answers
silent.bind(("127.0.0.1", 0))
silent.listen(16)
port = silent.getsockname()[1]

async def main():
    g = ftcomm.Group("gloo")
    for i in range(4):
        started = time.monotonic()
        try:
            await g.configure(f"127.0.0.1:{port}/p{i}", 0, 1, timeout=0.3)
        except ftcomm.CommTimeout:
            print(f"timeout {time.monotonic() - started:.3f}", flush=True)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        await g.configure(f"127.0.0.1:{server.port}/ok", 0, 1, timeout=5)
        print("configured", flush=True)
    except ftcomm.CommError as exc:
        print(f"not configured: {exc!r}", flush=True)
    await g.shutdown()

asyncio.run(main())
"""


def test_configure_timeouts_against_a_silent_store_leave_configure_and_exit_working() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    lines = proc.stdout.splitlines()
    timeouts = [float(line.split()[1]) for line in lines if line.startswith("timeout ")]
    assert len(timeouts) == 4, proc.stdout
    assert max(timeouts) < 0.3 + 1.0, timeouts  # configure keeps its deadline
    # Four connects stuck in c10d must not take every control thread.
    assert "configured" in lines, proc.stdout
    # -6 (SIGABRT): a stuck connect returned while the interpreter finalized.
    assert proc.returncode == 0, proc.stderr[-2000:]
