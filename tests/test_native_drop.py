"""A native group's last reference goes on the reaper, never on one of its
own threads.

``ProcessGroupGloo``'s destructor joins its worker threads, and ops'
completion callbacks run on those threads: a group whose last reference
is dropped there kills the process ("terminate called after throwing an
instance of 'std::system_error' / Resource deadlock avoided", seen once in
the in-process abort drill). Each scenario below forces one interleaving
that did that, in a child process (the failure is an abort), and checks
that the process lives and that the group was dropped on the reaper:

* ``callback-break``: an op fails on its Gloo thread (a peer went away);
  its completion callback breaks the group and hands it to the reaper.
  The reaper runs before that hand-over's frames return: their arguments
  were the last references.
* ``issue-on-gloo-thread``: with ``verify=True``, an op is issued from its
  check's completion callback, on a Gloo thread; an abort on another
  thread hands the group to the reaper while that issue holds it.

The child runs this file: ``python tests/test_native_drop.py SCENARIO``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ftcomm
from ftcomm._runtime import threads
from ftcomm._runtime.loop import get_runtime
from ftcomm.testing import inspect

DEADLOCK = "Resource deadlock avoided"


def _is_native_thread() -> bool:
    """Whether the calling thread was started outside Python (Gloo's)."""
    return isinstance(threading.current_thread(), threading._DummyThread)


def _watch_drop(obj: object, into: list[str]) -> weakref.ref[Any]:
    """A weak reference to ``obj`` that records the thread it dies on."""
    return weakref.ref(obj, lambda _: into.append(threading.current_thread().name))


async def _two_ranks(server: Any, key: str, **kw: Any) -> tuple[ftcomm.Group, ftcomm.Group]:
    """Ranks 0 and 1 of one Gloo group, both in this process."""
    g0, g1 = ftcomm.Group("gloo", timeout=30, **kw), ftcomm.Group("gloo", timeout=30, **kw)
    addr = server.addr(key)
    await asyncio.gather(g0.configure(addr, 0, 2), g1.configure(addr, 1, 2))
    assert inspect(g0).config is not None
    assert inspect(g0).backend.aborts_for_real
    return g0, g1


class _HeldPuts:
    """The reaper's queue, with a put made on a native thread held until
    the reaper has dropped what it was handed (or ``done()``): the reaper
    runs before the handing thread's frames return."""

    def __init__(self, inner: Any, done: Callable[[], bool]) -> None:
        self.inner = inner
        self.done = done
        self.held_on: list[str] = []

    def get(self, timeout: float | None = None) -> Any:
        return self.inner.get(timeout=timeout)

    def put(self, item: Any) -> None:
        self.inner.put(item)
        if not _is_native_thread():
            return
        self.held_on.append(threading.current_thread().name)
        rt = get_runtime()
        end = time.monotonic() + 5.0
        while time.monotonic() < end and rt.reaper.pending and not self.done():
            time.sleep(0.001)


async def _callback_break() -> dict[str, Any]:
    rt = get_runtime()
    dropped_on: list[str] = []
    refs: list[weakref.ref[Any]] = []
    # Held until the reaper is done, or until the group is being dropped
    # (on the reaper: its destructor then waits for this very thread).
    queue = _HeldPuts(rt.reaper._queue, lambda: bool(refs) and refs[0]() is None)
    rt.reaper._queue = queue
    server = ftcomm.serve_store()
    g0, g1 = await _two_ranks(server, "callback-break")
    assert inspect(g0).config is not None
    refs.append(_watch_drop(inspect(g0).backend._pg, dropped_on))  # type: ignore[attr-defined]
    work = g0.allreduce(torch.ones(4))
    ended = threading.Event()
    # From a thread without an event loop: the native completion callback
    # is armed now, and nobody polls the op: it ends on its Gloo thread.
    arm = threading.Thread(target=work.add_done_callback, args=(lambda _: ended.set(),))
    arm.start()
    arm.join()
    await g1.abort()  # rank 1 goes away: rank 0's op fails on its Gloo thread
    assert await asyncio.to_thread(ended.wait, 10.0)
    error = type(work.exception()).__name__
    await g0.shutdown()
    await g1.shutdown()
    assert await asyncio.to_thread(rt.reaper.wait_idle, 10.0)
    server.close()
    return {"error": error, "held_on": queue.held_on, "dropped_on": dropped_on}


async def _issue_on_gloo_thread() -> dict[str, Any]:
    from ftcomm.backends import gloo

    rt = get_runtime()
    dropped_on: list[str] = []
    inside = threading.Event()
    disposed = threading.Event()
    mine: list[torch.Tensor] = []
    buckets = gloo._buckets

    def held_buckets(bufs: Any) -> Any:
        # Rank 0's reduce-scatter, issued on its Gloo thread: its group is
        # in _reduce_scatter's hands until it returns.
        if _is_native_thread() and any(b is mine[0] for b in bufs) and not inside.is_set():
            inside.set()
            disposed.wait(10.0)
            end = time.monotonic() + 0.5  # the reaper's chance to drop it
            while time.monotonic() < end and rt.reaper.pending:
                time.sleep(0.001)
        return buckets(bufs)

    gloo._buckets = held_buckets  # type: ignore[assignment]
    server = ftcomm.serve_store()
    g0, g1 = await _two_ranks(server, "issue-on-gloo-thread", verify=True)
    assert inspect(g0).config is not None
    ref = _watch_drop(inspect(g0).backend._pg, dropped_on)  # type: ignore[attr-defined]
    outs = [torch.zeros(4), torch.zeros(4)]
    mine.append(outs[0])
    w0 = g0.reduce_scatter(outs[0], [torch.ones(4), torch.ones(4)])
    # Rank 0's descriptor check is armed by now: rank 1's completes it, and
    # rank 0's op goes out from its completion callback, on its Gloo thread.
    await asyncio.sleep(0.1)
    w1 = g1.reduce_scatter(outs[1], [torch.ones(4), torch.ones(4)])
    assert await asyncio.to_thread(inside.wait, 10.0), "no op was issued on a Gloo thread"
    g0.abort()  # hands the group to the reaper, now
    disposed.set()
    errors = []
    for w in (w0, w1):
        try:
            await w
            errors.append("success")
        except ftcomm.CommError as exc:
            errors.append(type(exc).__name__)
    await g0.shutdown()
    await g1.shutdown()
    assert await asyncio.to_thread(rt.reaper.wait_idle, 10.0)
    server.close()
    assert ref() is None
    return {"errors": errors, "dropped_on": dropped_on}


SCENARIOS: dict[str, Callable[[], Any]] = {
    "callback-break": _callback_break,
    "issue-on-gloo-thread": _issue_on_gloo_thread,
}


def _run_child(scenario: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, scenario],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert DEADLOCK not in proc.stderr, proc.stderr
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_a_group_broken_on_its_gloo_thread_is_dropped_on_the_reaper() -> None:
    out = _run_child("callback-break")
    assert out["error"] == "CommFailed"
    assert out["held_on"], "the group was not handed over on a Gloo thread"
    assert out["dropped_on"] == ["ftcomm-reaper"]


@pytest.mark.slow
def test_a_group_aborted_while_its_gloo_thread_issues_is_dropped_on_the_reaper() -> None:
    out = _run_child("issue-on-gloo-thread")
    assert out["errors"][0] == "CommAborted"
    assert "success" not in out["errors"]
    assert out["dropped_on"] == ["ftcomm-reaper"]


# -- the reaper's rule, in this process ------------------------------------------------


class _Tracked:
    """Records the thread it is dropped on."""

    def __init__(self, into: list[str]) -> None:
        self.into = into

    def __del__(self) -> None:
        self.into.append(threading.current_thread().name)


def test_a_handoff_is_dropped_on_the_reaper_once_nobody_else_holds_it() -> None:
    rt = get_runtime()
    dropped_on: list[str] = []
    obj = _Tracked(dropped_on)
    held = [obj]  # another thread, in the middle of a call on it
    rt.dispose(threads.Handoff(obj))
    del obj
    time.sleep(0.2)
    assert dropped_on == []  # the reaper waits for it
    assert rt.reaper.pending >= 1
    held.clear()
    assert rt.reaper.wait_idle(5.0)
    assert dropped_on == ["ftcomm-reaper"]


def test_a_handoff_held_by_a_garbage_cycle_is_dropped_on_the_reaper() -> None:
    rt = get_runtime()
    dropped_on: list[str] = []
    enabled = gc.isenabled()
    gc.disable()  # no collection on this thread first
    try:
        obj = _Tracked(dropped_on)
        cycle: list[Any] = [obj]
        cycle.append(cycle)
        rt.dispose(threads.Handoff(obj))
        del obj, cycle
        assert rt.reaper.wait_idle(5.0)
    finally:
        if enabled:
            gc.enable()
    assert dropped_on == ["ftcomm-reaper"]


def test_a_handoff_held_long_is_parked_and_still_dropped_on_the_reaper(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Held elsewhere past the reaper's short wait, the objects are parked:
    later batches are not held up, a warning says so, and once the holder
    lets go the reaper drops them (never the holder)."""
    rt = get_runtime()
    monkeypatch.setattr(threads, "SOLE_WAIT", 0.05)
    monkeypatch.setattr(threads, "_WARN_AFTER", 0.2)
    dropped_on: list[str] = []
    later: list[str] = []
    kept = _Tracked(dropped_on)
    with caplog.at_level(logging.WARNING, logger="ftcomm"):
        rt.dispose(threads.Handoff(kept))
        rt.dispose(threads.Handoff(_Tracked(later)))  # not held up behind it
        deadline = time.monotonic() + 5
        while not later or "still referenced elsewhere" not in caplog.text:
            assert time.monotonic() < deadline, (later, caplog.text)
            time.sleep(0.01)
    assert later == ["ftcomm-reaper"]
    assert dropped_on == []
    assert rt.reaper.pending >= 1  # the parked batch
    del kept  # its holder lets go: the reaper holds the last reference
    assert rt.reaper.wait_idle(5.0)
    assert dropped_on == ["ftcomm-reaper"]


def test_a_reaper_closed_with_objects_parked_goes_on_until_it_holds_the_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Closed (at exit) with objects parked, the reaper does not let go of
    them (the last reference would be someone else's): it goes on, drops
    them once only it holds them, then ends; closed with nothing parked,
    it ends at once."""
    monkeypatch.setattr(threads, "SOLE_WAIT", 0.05)
    reaper = threads.Reaper(name="ftcomm-test-reaper")
    dropped_on: list[str] = []
    kept = _Tracked(dropped_on)
    reaper.dispose(threads.Handoff(kept))
    deadline = time.monotonic() + 5
    while reaper.wait_unparked(0.0):  # until it parked them
        assert time.monotonic() < deadline
        time.sleep(0.01)
    reaper.close(0.2)
    assert reaper._thread.is_alive()
    assert dropped_on == []
    del kept
    reaper._thread.join(5.0)
    assert not reaper._thread.is_alive()
    assert dropped_on == ["ftcomm-test-reaper"]
    idle = threads.Reaper(name="ftcomm-test-reaper-2")
    idle.close(5.0)
    assert not idle._thread.is_alive()


def test_a_handoff_takes_its_objects_out() -> None:
    a, b = object(), object()
    cell = threads.Handoff(a, b)
    assert cell.take() == [a, b]
    assert cell.take() == []


if __name__ == "__main__":
    print(json.dumps(asyncio.run(SCENARIOS[sys.argv[1]]())), flush=True)
