"""Test helpers: a scripted native op (the only fake in ftcomm's unit tests:
everything above it, the op table, ``Work``, deadlines, the c10d works, is the
real code under test) and an in-process TCPStore server."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from torch.distributed import PrefixStore, TCPStore

import ftcomm
from ftcomm._etcd import Etcd, parse_etcd_addr
from ftcomm._meet import MEET_COUNT, MEET_KEY
from ftcomm._membership._etcd_store import EtcdStore
from ftcomm._membership._watch import read
from ftcomm._runtime.native import Done
from ftcomm._runtime.table import OpTable
from ftcomm._runtime.work import Work
from ftcomm._store import parse_store_addr
from ftcomm.backends.subprocess import SubprocessBackend
from ftcomm.testing import inspect


class ScriptedOp:
    """A native op that ends when the test says so (from any thread)."""

    def __init__(self, done: bool = False) -> None:
        self._done = done
        self._error: BaseException | None = None
        self._callbacks: list[Done] = []
        self._lock = threading.Lock()

    def poll(self) -> bool:
        return self._done

    def outcome(self) -> BaseException | None:
        return self._error

    def on_done(self, callback: Done) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self._error)

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._error, self._done = error, True
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(error)


def issue(
    table: OpTable, op: ScriptedOp, timeout: float, result: object = "result"
) -> Work[object]:
    work: Work[object] = Work(
        table, "allreduce", table.next_seq(), time.monotonic() + timeout, op, result
    )
    table.track(work, timeout)
    return work


class StoreServer:
    """Owns a real TCPStore server; ``close()`` destroys it.

    pytest keeps fixture values alive until the whole test item is torn down
    (after the leak check in conftest.py), so the fixture hands out this holder
    and drops the server itself at its own teardown.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._server: TCPStore | None = TCPStore(
            host_name=host, port=0, is_master=True, wait_for_workers=False
        )
        self.port = int(self._server.port)

    def close(self) -> None:
        self._server = None


def peers_came(port: int, prefix: str, world: int, ranks: Iterable[int]) -> None:
    """Mark ``ranks`` of a ``world`` as having come to the store at ``port``
    under ``prefix`` (what each rank's configure writes before it builds the
    native group): for a test whose one rank stands for a group whose peers
    are there."""
    store = PrefixStore(
        prefix, TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    )
    for rank in ranks:
        store.set(MEET_KEY.format(world=world, rank=rank), "1")
        store.add(MEET_COUNT.format(world=world), 1)


# Bound for the life of the process, never listening (and without
# SO_REUSEADDR): a connect to it is refused, and no other process -- another
# test worker's store or Gloo group -- can take the port meanwhile. Made at
# import, before any test's leak check counts this process's fds.
_REFUSING = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
_REFUSING.bind(("127.0.0.1", 0))


def free_port() -> int:
    """A loopback port nobody listens on, nor will while this process lives."""
    return int(_REFUSING.getsockname()[1])


def subprocess_backend(group: ftcomm.Group) -> SubprocessBackend:
    """The worker-process backend of ``group``'s current configuration."""
    cfg = inspect(group).config
    assert cfg is not None
    assert isinstance(cfg.backend, SubprocessBackend), cfg.backend
    return cfg.backend


def add_callback_off_loop(work: Work[Any], fn: Callable[[Work[Any]], object]) -> None:
    """``work.add_done_callback(fn)`` from a thread without an event loop: ``fn``
    then runs on the thread that ends the op (on a loop's thread it would be
    scheduled on that loop, as asyncio's futures do)."""
    thread = threading.Thread(target=work.add_done_callback, args=(fn,))
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "add_done_callback() blocked"


def spy_allreduces(g: ftcomm.Group) -> list[tuple[str, int]]:
    """Record the group's calls into its backend's allreduces (the device
    call; the logic above it runs as it is), with the elements sent:
    ("sum", n) for the short path's ``allreduce_sum``, ("allreduce", n) for
    the long path's (a batch is one flat tensor)."""
    backend = inspect(g).backend  # type: ignore[union-attr]
    calls: list[tuple[str, int]] = []
    real, real_sum = backend.allreduce, backend.allreduce_sum

    def allreduce(tensors: Any, *args: Any) -> Any:
        calls.append(("allreduce", sum(t.numel() for t in tensors)))
        return real(tensors, *args)

    def allreduce_sum(tensor: Any, timeout: float) -> Any:
        calls.append(("sum", tensor.numel()))
        return real_sum(tensor, timeout)

    backend.allreduce = allreduce  # type: ignore[method-assign]
    backend.allreduce_sum = allreduce_sum  # type: ignore[method-assign]
    return calls


ENGINE_ENV = "FTCOMM_TEST_ETCD"
"""Set (by the ``engine`` fixture) to an etcd address: the membership tests
that run on both engines run on etcd (a prefix per world) instead of the
worlds' own store."""


def engine_address(host: str, port: int, world_id: str) -> str:
    """Where a world's memberships agree: its store (``host:port``) under
    ``world_id``, or etcd's where :data:`ENGINE_ENV` says so."""
    etcd = os.environ.get(ENGINE_ENV)
    return f"{etcd}/{world_id}" if etcd else f"{host}:{port}/{world_id}"


def engine_for(ctx: Any) -> str:
    """A rank's engine address (:func:`engine_address` of its world). On
    etcd each member hosts a store, and torch keeps a pipe once one ran:
    one is run first, outside the rank's leak check (``ctx.baseline()``)."""
    address = engine_address(ctx.host, ctx.port, ctx.world_id)
    if address.startswith("etcd://"):
        ftcomm.serve_store().close()
        ctx.baseline()
    return address


def _job_store(address: str, job: str) -> Any:
    """A client of job ``job``'s keys in the engine at ``address`` (a
    store's ``host:port[/prefix]`` or ``etcd://...``): a c10d store scoped
    to them, or the etcd engine's own adapter."""
    if address.startswith("etcd://"):
        etcd = parse_etcd_addr(address)
        base = f"{etcd.prefix}/" if etcd.prefix else ""
        return EtcdStore(Etcd(etcd.endpoints, 5.0), f"{base}ftcomm/members/{job}/")
    addr = parse_store_addr(address)
    base = f"{addr.prefix}/" if addr.prefix else ""
    client = TCPStore(addr.host, addr.port, is_master=False, wait_for_workers=False)
    return PrefixStore(f"{base}ftcomm/members/{job}", client)


def engine_key(address: str, job: str, key: str) -> bytes | None:
    """Job ``job``'s key ``key`` (``ready/1``...) in the engine at ``address``,
    as it holds it now."""
    return read(_job_store(address, job), key)


def engine_set(address: str, job: str, key: str, value: str | bytes) -> None:
    """Set job ``job``'s key ``key`` in the engine at ``address`` (a test's
    own writes: a key as another member would write it)."""
    _job_store(address, job).set(key, value)


def open_sockets() -> int:
    """Sockets this process has open now."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def memberships(store: Any, *ids: str, **kw: Any) -> list[ftcomm.Membership]:
    """A ``Membership`` of job ``job`` for each of ``ids`` on ``store`` (a
    ``serve_store()``, or an engine's address), with the tests' defaults: 2 to ``len(ids)``
    members, a heartbeat timeout of 1 s, a join window of 5 s, 20 s a call."""
    kw.setdefault("min_size", 2)
    kw.setdefault("max_size", len(ids))
    kw.setdefault("heartbeat_timeout", 1.0)
    kw.setdefault("join_window", 5.0)
    kw.setdefault("timeout", 20.0)
    address = store if isinstance(store, str) else store.address
    return [ftcomm.Membership(address, "job", i, **kw) for i in ids]
