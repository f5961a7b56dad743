"""The third engine: membership agreed in etcd, and no host whose death ends a job.

Owns: :class:`EtcdEngine`, the store engine's rule on an etcd cluster
(``etcd://host:port[,host:port...][/prefix]``), its calls made of etcd by
``_etcd_store.EtcdStore``, and the c10d store each member hosts for the
groups of the generations it is rank 0 of (``srv/<id>``). Its leases, its
watch, its stores and etcd's own faults: docs/membership.md, "The etcd
engine".
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

from .._etcd import Etcd, EtcdAddr
from .._server import StoreServer, serve_store
from .._store import StoreAddr, connect_store
from ..errors import MembershipError
from . import _sweep
from ._engine import Stopped
from ._etcd_store import COMPACT_TIMEOUT, Changes, EtcdStore, Lease, lease_ttl
from ._reach import listen_host
from ._rule import Member, WorldRecord
from ._store_engine import OP_TIMEOUT, SWEEP_CONNECT, StoreEngine, failed
from ._watch import Watcher, beat_key, read

WATCH_CAP = 0.25
"""Seconds an agreeing member waits at most between two looks at etcd, and
no longer than a heartbeat interval: a change of a key wakes it sooner, and
what it learns on its own (a member found dead by its heartbeat, or its
listener refusing) is learnt at that pace anyway."""


def srv_key(member_id: str) -> str:
    """Where member ``member_id`` says where its store is (held by its lease)."""
    return f"srv/{member_id}"


class _Sweepers:
    """A rank 0's sweeps (``_sweep``): the job's keys in etcd, and the old
    generations' groups in the store it hosts (those it was rank 0 of: a
    member stays rank 0 from one generation to the next while it lives)."""

    def __init__(self, *sweepers: _sweep.Sweeper) -> None:
        self._all = list(sweepers)

    def add(self, sweeper: _sweep.Sweeper) -> None:
        self._all.append(sweeper)

    def request(self, floor_to: int) -> None:
        for sweeper in self._all:
            sweeper.request(floor_to)

    def close(self) -> None:
        for sweeper in self._all:
            sweeper.close()


class EtcdEngine(StoreEngine):
    """One member's view of a job in etcd (docs/membership.md, "The etcd engine")."""

    def __init__(
        self,
        addr: EtcdAddr,
        job: str,
        me: Member,
        *,
        heartbeat_interval: float,
        heartbeat_timeout: float,
    ) -> None:
        host, port = addr.endpoints[0]
        super().__init__(
            StoreAddr(host, port, addr.prefix),
            job,
            me,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
        )
        self.etcd = addr
        self._server: StoreServer | None = None
        self._changes: Changes | None = None
        self._hosts: dict[int, str] = {}  # generation -> its store's host:port
        self._clients: list[Etcd] = []  # closed at close()

    def __repr__(self) -> str:
        return str(self.etcd)

    def _base(self) -> str:
        return f"{self.etcd.prefix}/" if self.etcd.prefix else ""

    # -- opening and closing ----------------------------------------------

    def open(self, timeout: float, stop: threading.Event) -> None:
        """Grant this member's lease, claim its id, host its store, beat.

        Raises:
            MembershipError: no endpoint answers, or the cluster has no quorum.
            ValueError: a live member already uses this id.
        """
        timeout = max(timeout, 0.01)
        local = self._local(timeout)
        endpoints = self.etcd.endpoints
        base = self._base()
        root = f"{base}ftcomm/members/{self.job}/"
        etcd = Etcd(endpoints, timeout, keep=True)  # its clients go where one went
        self._clients = [etcd]  # (closed by close(), after a failed open too)
        try:
            lease = Lease(etcd, lease_ttl(self._timeout))
            lease.id()  # (a grant needs a leader: a cluster without quorum fails here)
            calls, beats = etcd.sharing(timeout), etcd.sharing(timeout)
            self._clients += [calls, beats]
            self._store = EtcdStore(calls, root, lease=lease)
            self.watcher = Watcher(
                EtcdStore(beats, root, lease=lease),
                self.me,
                interval=self._interval,
                timeout=self._timeout,
            )
            scope = f"ftcomm/members/{self.job}/"
            swept = _sweep.Sweeper(
                lambda: EtcdStore(etcd.sharing(SWEEP_CONNECT, keep=False), base, scope=scope),
                "",
                self.job,
                name=f"sweep-{self.me.id}",
            )
            self.watcher.sweeper = _Sweepers(swept)
            self._claim(stop)
            for client in (self._store, self.watcher.store):
                client.set_timeout(timedelta(seconds=OP_TIMEOUT))
            etcd.timeout = OP_TIMEOUT  # (the lease's)
        except (RuntimeError, OSError) as exc:
            exc.with_traceback(None)  # its frames hold the clients
            raise MembershipError(f"{self.etcd} does not answer: {exc}") from exc
        host = listen_host(endpoints[0][0], local)
        try:
            self._server = serve_store(host)
        except (RuntimeError, OSError) as exc:
            raise MembershipError(
                f"member {self.me.id!r} cannot host a store on {host!r}: {exc}"
            ) from None
        served = StoreAddr(self._server.host, self._server.port, "")
        assert self.watcher is not None
        self.watcher.sweeper.add(  # its old groups' keys, in its own store (as rank 0)
            _sweep.Sweeper(
                lambda: connect_store(served, SWEEP_CONNECT),
                base,
                self.job,
                name=f"sweep-groups-{self.me.id}",
            )
        )
        self._start(host)
        self._changes = Changes(
            endpoints,
            root.encode(),
            quiet=(beat_key("").encode(),),
            silence=max(5.0, 10 * self._interval),
            name=f"ftcomm-membership-watch-{self.me.id}",
            compact=self._clients[0].sharing(COMPACT_TIMEOUT, keep=False),
        )
        self._changes.start()

    def _local(self, timeout: float) -> str:
        """This end's address of a connection to the first endpoint that
        answers: the interface that reaches the cluster.

        Raises:
            MembershipError: no endpoint takes a connection.
        """
        why = []
        for host, port in self.etcd.endpoints:
            try:
                with socket.create_connection((host, port), timeout=min(timeout, 2.0)) as probe:
                    return str(probe.getsockname()[0])
            except OSError as exc:
                why.append(f"{host}:{port}: {exc}")
        raise MembershipError(f"{self.etcd} does not answer: {'; '.join(why)}")

    def _announce(self, me: Member) -> None:
        """Say where incarnation ``me``'s listener and store are: both noted
        first, so that a renewal puts back the one whose write failed."""
        if self._server is None:
            super()._announce(me)
            return
        where = f"{me.token} {self._server.address}"
        self._store.note(srv_key(me.id), where)
        super()._announce(me)
        self._store.set(srv_key(me.id), where)

    def close(self) -> None:
        """Stop beating, say this member left, stop watching and hosting.
        Its lease is left to run out: its ``left`` beat stays that long."""
        super().close()
        clients, self._clients = self._clients, []
        for client in clients:  # (their last calls are done: the watcher's thread ended)
            client.close()
        changes, self._changes = self._changes, None
        if changes is not None:
            changes.close()
        server, self._server = self._server, None
        if server is not None:
            server.close()

    # -- agreeing ---------------------------------------------------------

    def _pause(self, stop: threading.Event, seconds: float) -> bool:
        if self._changes is None:
            return stop.wait(seconds)
        return self._changes.wait(stop, seconds)

    def _poll_cap(self, members: int) -> float:
        return min(WATCH_CAP, self._interval)

    def agree(
        self,
        prev: WorldRecord,
        stop: threading.Event,
        *,
        member_of: int | None,
        min_size: int,
        max_size: int,
        window: float,
        deadline: float,
    ) -> WorldRecord:
        """The store engine's ``agree``, and where the generation's group
        meets: its rank 0's store. One whose rank 0 has no store (its lease
        ran out: it is dead) is given up, and the next one agreed.

        Raises: as ``StoreEngine.agree``.
        """
        while True:
            record = super().agree(
                prev,
                stop,
                member_of=member_of,
                min_size=min_size,
                max_size=max_size,
                window=window,
                deadline=deadline,
            )
            host = record.members[0]
            try:
                where = self._host_of(host, stop, deadline)
            except Exception as exc:
                self.abandon(record)  # (the others need not wait for this member)
                if isinstance(exc, (RuntimeError, OSError)) and not isinstance(
                    exc, MembershipError
                ):
                    raise failed(exc) from None
                raise
            if where:
                self._hosts[record.generation] = where
                for old in [g for g in self._hosts if g < record.generation - 1]:
                    del self._hosts[old]
                return record
            if not self.lost(record, host):
                raise MembershipError(
                    f"generation {record.generation} of job {self.job!r} was kept, but its "
                    f"rank 0 ({host.id!r}) says of no store where its group meets"
                )
            prev, member_of = record, record.generation

    def _host_of(self, host: Member, stop: threading.Event, deadline: float) -> str:
        """Where ``host``'s store is (``""``: it has none: it is dead). A
        live one whose ``srv`` key is gone or stale puts it back within a
        lease renewal (``_etcd_store.Lease``): it is waited for, a heartbeat
        timeout or a renewal's time at most.

        Raises:
            Stopped: ``stop`` was set.
        """
        if host == self.me:
            server = self._server
            return server.address if server is not None else ""
        # (a renewal puts it back: every third of the lease's TTL, at a beat)
        wait = max(self._timeout, lease_ttl(self._timeout) / 3 + 2 * self._interval)
        until = min(deadline, time.monotonic() + wait)
        while True:
            held = read(self._store, srv_key(host.id))
            token, _, where = (held or b"").decode(errors="replace").partition(" ")
            if token == host.token and where:
                return where
            watcher = self.watcher
            if watcher is None or not watcher.alive(host) or time.monotonic() >= until:
                return ""
            if stop.wait(0.05):
                raise Stopped

    def group_addr(self, record: WorldRecord) -> str:
        """Where ``record``'s group meets: a prefix of its own in its rank
        0's store (read as it was agreed)."""
        host = self._hosts.get(record.generation)
        if host is None:
            raise MembershipError(f"generation {record.generation} was not agreed here")
        return f"{host}/{self._base()}ftcomm/groups/{self.job}/g{record.generation}"
