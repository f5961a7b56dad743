"""The second engine: membership agreed by torchft's Lighthouse.

Owns: :class:`LighthouseEngine`, one member's client of a lighthouse
(``torchft.coordination``, the optional ``torchft`` extra), its heartbeat
thread, the store this member hosts for its groups, and how a lighthouse
quorum becomes a generation (:func:`_generation`). How a quorum becomes a
generation, and what this engine cannot tell: docs/membership.md, "Engines".
"""

from __future__ import annotations

import importlib
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._server import StoreServer, serve_store
from ..errors import MembershipError, MembershipTimeout
from ._engine import Stopped
from ._rule import EMPTY, NO_CAP, Member, WorldRecord

log = logging.getLogger("ftcomm")

SCHEMES = ("http://", "https://")
"""Addresses with these schemes are a lighthouse's (``LighthouseServer.address()``)."""

_ROUND = 5.0
"""Seconds one quorum request waits before it is asked again (and ``stop``
looked at): a request cannot be interrupted, so a cancel ends within this;
and a lighthouse counts its join timeout from its participants' latest
requests, so a ``join_timeout_ms`` longer than this never runs out."""


def is_lighthouse(address: str) -> bool:
    return address.startswith(SCHEMES)


def host_port(address: str) -> tuple[str, int]:
    """Raises: ValueError: not ``http(s)://host:port``."""
    parsed = urllib.parse.urlsplit(address)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None or parsed.path not in ("", "/"):
        raise ValueError(f"address {address!r}: a lighthouse is 'http://host:port'")
    return parsed.hostname, port


class LighthouseEngine:
    """One member's view of a job on a torchft lighthouse.

    The lighthouse decides quorums itself: who is in one is whoever asked
    for it and beats its heartbeat, once the previous quorum's members are
    all there, or ``min_replicas`` are and its ``join_timeout_ms`` has
    passed. Every member of a quorum gets the same answer, and each turns it
    into the same generation on its own (:func:`_generation`) from what
    every member sent with its request (``{"gen", "rank", "token", "store",
    "since"}``: its last generation, its rank there, its incarnation, the
    address of the store it hosts, when it first asked). Members past
    ``max_size`` ask again; a quorum with fewer than ``min_size`` members is
    asked for again by all of them.
    """

    def __init__(
        self,
        address: str,
        job: str,
        me: Member,
        *,
        heartbeat_interval: float,
        store_host: str,
    ) -> None:
        self.address = address
        self.host, self.port = host_port(address)
        self.job = job
        self.me = me
        self._interval = heartbeat_interval
        self._store_host = store_host
        self._client: Any = None
        self._server: StoreServer | None = None
        self._beat_client: Any = None
        self._error: ConnectionError | None = None
        self._stop = threading.Event()
        self._closing = threading.Lock()  # close() may come from two threads at once
        self._thread: threading.Thread | None = None
        self._stores: dict[int, str] = {}  # generation -> its rank 0's store
        self._ahead: WorldRecord | None = None  # what pending() found, for recover()

    def __repr__(self) -> str:
        return f"lighthouse {self.address}"

    # -- opening and closing ----------------------------------------------

    def open(self, timeout: float, stop: threading.Event) -> None:
        """Raises: MembershipError: no torchft, or the lighthouse does not answer."""
        try:
            coordination: Any = importlib.import_module("torchft.coordination")
        except ImportError as exc:
            raise MembershipError(
                f"address {self.address!r} is a lighthouse's, and torchft is not installed "
                "(pip install 'ftcomm[torchft]')"
            ) from exc
        try:
            with socket.create_connection((self.host, self.port), timeout=min(timeout, 2.0)):
                pass
        except OSError as exc:
            raise MembershipError(
                f"the lighthouse at {self.address} does not answer: {exc}"
            ) from exc
        try:
            connect = timedelta(seconds=timeout)
            self._client = coordination.LighthouseClient(self.address, connect_timeout=connect)
            self._beat_client = coordination.LighthouseClient(self.address, connect_timeout=connect)
            self._beat_client.heartbeat(self.me.id)
        except Exception as exc:
            raise MembershipError(
                f"the lighthouse at {self.address} does not answer: {exc}"
            ) from exc
        self._server = serve_store(self._store_host)
        self._thread = threading.Thread(
            target=self._beat, name=f"ftcomm-membership-{self.me.id}", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat_client.heartbeat(self.me.id)
            except Exception as exc:  # kept for the next call, without a traceback
                self._error = ConnectionError(f"{type(exc).__name__}: {exc}")
                log.warning("ftcomm: membership %s lost its lighthouse: %s", self.me.id, exc)
                return

    def register(self) -> None:
        """Nothing to do: a lighthouse learns of a member from its requests."""

    def close(self) -> None:
        with self._closing:
            self._close()

    def _close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._server is not None:
            self._server.close()
            self._server = None
        self._client = self._beat_client = None

    def broken(self) -> BaseException | None:
        return self._error

    def alive(self, member: Member) -> bool:
        return True  # the lighthouse keeps who beats to itself

    # -- paths: the lighthouse knows nothing of them -----------------------

    def reach_check(
        self, record: WorldRecord, stop: threading.Event, timeout: float
    ) -> tuple[set[Member], set[Member]]:
        return set(), set()

    def admit(self, stop: threading.Event, deadline: float, timeout: float) -> None:
        return None

    def watch(
        self, record: WorldRecord, on_broken: Callable[[str], None], reached: set[Member]
    ) -> None:
        return None

    def unwatch(self) -> None:
        return None

    def recovering(self, record: WorldRecord) -> None:
        return None

    def given_up(self, record: WorldRecord) -> bool:
        return False  # no verdicts here

    def read_fate(self, record: WorldRecord | None) -> None:
        return None

    # -- agreeing ---------------------------------------------------------

    def latest(self) -> WorldRecord:
        return EMPTY  # a lighthouse says only when asked for a quorum

    def group_addr(self, record: WorldRecord) -> str:
        return f"{self._stores[record.generation]}/ftcomm/groups/{self.job}/g{record.generation}"

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
        """Raises: MembershipTimeout, MembershipError, Stopped."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.generation > prev.generation and self.me in ahead.members:
            return ahead  # pending() already took the quorum that forms it
        since = time.time()  # wall clock: sent, and compared, within one quorum only
        while True:
            record, formed = self._round(prev, min_size, max_size, deadline, stop, since, window)
            if record is not None and self.me in record.members:
                return record
            if record is not None:  # over max_size: the next quorum
                prev = WorldRecord(record.generation, prev.members)
            if time.monotonic() >= deadline:
                raise MembershipTimeout(
                    f"the lighthouse at {self.address} formed no world of at least "
                    f"{min_size} with member {self.me.id!r} in time"
                    + (f" (its last quorum had {formed})" if formed else "")
                )

    def abandon(self, record: WorldRecord) -> None:
        """Nothing to say it with: the others' configure runs to its deadline
        (or to the abandoning member's next quorum request)."""

    def keep(self, record: WorldRecord) -> bool:
        """Always: no member can give one up (see :meth:`abandon`)."""
        return True

    def lost(self, record: WorldRecord, member: Member) -> bool:
        """Always: a member seen dead ends the configure (no verdicts here)."""
        return True

    def check(self, record: WorldRecord, k: int, *, max_size: int, deadline: float) -> bool:
        """Raises: MembershipError (the lighthouse failed or did not answer in time)."""
        found, _ = self._round(record, 1, NO_CAP, deadline, threading.Event())
        if found is None:
            raise MembershipError(
                f"the lighthouse at {self.address} formed no quorum for pending() call {k}"
            )
        if found.members == record.members:
            return False
        self._ahead = found
        return True

    def _round(
        self,
        prev: WorldRecord,
        min_size: int,
        max_size: int,
        deadline: float,
        stop: threading.Event,
        since: float = 0.0,
        window: float = 0.0,
    ) -> tuple[WorldRecord | None, str]:
        """One quorum (asked again until one forms, or the deadline): the
        generation it makes, if it has ``min_size`` members -- and, for a
        first generation, ``max_size`` or the join window since the first
        of them asked (every member of the quorum reads the same figures
        in it, so all take it or all ask again)."""
        rank = prev.rank_of(self.me)
        data: dict[str, object] = {
            "gen": prev.generation if rank is not None else 0,
            "rank": rank if rank is not None else -1,
            "token": self.me.token,
            "store": self._server.address if self._server is not None else "",
            "since": since,
        }
        while True:
            if stop.is_set():
                raise Stopped
            if self._error is not None:
                raise MembershipError(f"lost the lighthouse: {self._error}")
            left = deadline - time.monotonic()
            if left <= 0:
                return None, ""
            try:
                quorum = self._client.quorum(
                    replica_id=self.me.id,
                    timeout=timedelta(seconds=min(left, _ROUND)),
                    store_address=data["store"],
                    data=data,
                )
            except TimeoutError:
                continue  # no quorum yet: ask again
            except Exception as exc:
                raise MembershipError(f"the lighthouse at {self.address} failed: {exc}") from None
            record, store = _generation(quorum.participants, max_size)
            if len(quorum.participants) < min_size or _early(quorum, max_size, window):
                if stop.wait(0.05):  # everyone in it asks again, alike
                    raise Stopped
                continue
            self._stores[record.generation] = store
            return record, f"{len(quorum.participants)} members"


def _data(participant: Any) -> dict[str, Any]:
    data = participant.data
    return data if isinstance(data, dict) else json.loads(data or "{}")


def _early(quorum: Any, max_size: int, window: float) -> bool:
    """A first generation's quorum below ``max_size`` formed before the join
    window passed since its first member asked: not taken (the lighthouse
    forms one as soon as every member it has heard of asks, and a member
    that has only just started is not heard of yet)."""
    entries = [_data(p) for p in quorum.participants]
    if len(entries) >= max_size or any(int(d.get("gen", 0)) > 0 for d in entries):
        return False
    first = min(float(d.get("since", 0.0)) for d in entries)
    created = quorum.created.seconds + quorum.created.nanos / 1e9
    return bool(created - first < window)


def _generation(participants: Any, max_size: int) -> tuple[WorldRecord, str]:
    """A quorum as a generation: what every member of it computes alike."""
    entries = [(p.replica_id, _data(p)) for p in participants]
    top = max((int(d.get("gen", 0)) for _, d in entries), default=0)
    old = sorted((int(d.get("rank", -1)), i) for i, d in entries if int(d.get("gen", 0)) == top)
    ordered = [i for r, i in old if r >= 0] + sorted(
        i for i, d in entries if int(d.get("gen", 0)) != top or int(d.get("rank", -1)) < 0
    )
    by_id = dict(entries)
    members = tuple(Member(i, str(by_id[i].get("token", ""))) for i in ordered[:max_size])
    store = str(by_id[ordered[0]].get("store", "")) if ordered else ""
    return WorldRecord(top + 1, members, seen=len(entries)), store


def _unanswered(address: str, exc: BaseException) -> MembershipError:
    return MembershipError(f"the lighthouse at {address} does not answer: {exc}")
