"""A small blocking client of etcd's v3 API, over its JSON gateway.

Owns :class:`Etcd` (one client of a cluster: its endpoints, the one in use,
a deadline on every call), its errors and etcd addresses. It runs on
ftcomm's control threads, as the store engine's calls do; nothing here
touches a loop. Why the gateway and not gRPC: :class:`Etcd`. The engine
that uses it: docs/membership.md ("The etcd engine").
"""

from __future__ import annotations

import base64
import http.client
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RETRY_PAUSE = 0.05
"""Seconds before a call tries the next endpoint (doubling, up to 0.5 s)."""


FIRST_WAIT = 1.0
"""Seconds a try waits for its endpoint, twice that once a call tried them
all, and so on. A node that lost its leader holds a request until its
own timeout (5 s) rather than refusing it; the next node may have a new
leader already (an election takes about one election timeout)."""


class Route:
    """Which endpoint a cluster's clients try first (shared by those of
    :meth:`Etcd.sharing`). A race of two updates costs a try, no more."""

    def __init__(self) -> None:
        self.current = 0


class EtcdError(RuntimeError):
    """etcd answered with an error that a retry does not mend (a bad
    request, a lease that expired)."""


class EtcdUnavailable(ConnectionError):
    """No endpoint of the cluster answered, or none had a leader, by the
    call's deadline."""


@dataclass(frozen=True)
class EtcdAddr:
    """An etcd cluster's address: its client endpoints and a key prefix."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str = ""

    def __str__(self) -> str:
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        return f"etcd://{hosts}" + (f"/{self.prefix}" if self.prefix else "")


SCHEME = "etcd://"


def parse_etcd_addr(text: str, name: str = "address") -> EtcdAddr:
    """``etcd://host:port[,host:port...][/prefix]`` (``[v6]:port`` for IPv6).

    Raises:
        ValueError: not such an address, naming ``name`` and what is wrong.
    """
    if not isinstance(text, str) or not text.startswith(SCHEME):
        raise ValueError(f"{name} must be etcd://host:port[,host:port...][/prefix], got {text!r}")
    hosts, _, prefix = text[len(SCHEME) :].partition("/")
    endpoints: list[tuple[str, int]] = []
    for part in hosts.split(","):
        host, sep, port = part.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not port.isdecimal() or not 0 < int(port) < 65536:
            raise ValueError(
                f"{name}: each endpoint must be host:port with a port from 1 to 65535, "
                f"got {part!r} in {text!r}"
            )
        endpoints.append((host, int(port)))
    return EtcdAddr(tuple(endpoints), prefix.strip("/"))


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    """A key or value as etcd's JSON gives it (base64), as bytes."""
    return base64.b64decode(text)


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=unb64(raw["key"]),
        value=unb64(raw.get("value", "")),
        mod_revision=int(raw.get("mod_revision", 0)),
        lease=int(raw.get("lease", 0)),
    )


def ranged(answer: dict[str, Any]) -> list[KeyValue]:
    """The keys a transaction's ``request_range`` answer holds."""
    return [_kv(raw) for raw in answer.get("response_range", {}).get("kvs", [])]


def put_op(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    """A transaction's put of ``value`` at ``key`` (held by ``lease``)."""
    put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {"request_put": put}


def range_op(key: bytes) -> dict[str, Any]:
    """A transaction's read of ``key``."""
    return {"request_range": {"key": _b64(key)}}


def absent(key: bytes) -> dict[str, Any]:
    """A transaction's compare: ``key`` does not exist."""
    return {"key": _b64(key), "target": "CREATE", "create_revision": "0"}


def holds(key: bytes, value: bytes) -> dict[str, Any]:
    """A transaction's compare: ``key`` holds ``value``."""
    return {"key": _b64(key), "target": "VALUE", "value": _b64(value)}


def unchanged(key: bytes, mod_revision: int) -> dict[str, Any]:
    """A transaction's compare: ``key`` was last written at ``mod_revision``."""
    return {"key": _b64(key), "target": "MOD", "mod_revision": str(mod_revision)}


def prefix_range(prefix: bytes) -> dict[str, Any]:
    """A request's ``key`` and ``range_end`` for every key under ``prefix``."""
    return {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


_RETRIED = ("leader changed", "no leader", "timed out", "too many requests", "not capable")
"""etcd's errors a call retries on another endpoint (an election, an endpoint behind)."""


class Etcd:
    """A client of the cluster at ``endpoints`` (``(host, port)`` pairs).

    Every call takes ``timeout`` seconds at most: it goes to the endpoint
    that last answered (over a connection kept from the last call, with
    ``keep``: :meth:`close` closes them), and on a refused or silent connection, or an
    endpoint without a leader, to the next, until then.

    Why the gateway and the standard library, not a gRPC client: etcd serves
    the same API as JSON over HTTP on its client port (``/v3/kv/range``,
    ``/v3/kv/txn``, ``/v3/lease/grant``...), so no dependency is needed;
    every call is one request with a socket timeout, so a deadline is a
    deadline; and a cluster's failover is ours to write. The asyncio gRPC
    clients on PyPI (``aetcd``, ``etcd3aio``) pull in grpcio, run on a loop of
    their own, and leave failover and deadlines to gRPC's channel settings.

    Keys and values are bytes (base64 on the wire). A call retried after a
    lost answer may have taken effect: :meth:`create` reads back what it lost
    to, and counts its own value as its win.

    Raises (every call):
        EtcdUnavailable: no endpoint answered in time.
        EtcdError: etcd refused the request.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        timeout: float,
        *,
        route: Route | None = None,
        keep: bool = False,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._route = route if route is not None else Route()
        # with keep, connections kept per endpoint (until close()): a call is
        # a request, not a handshake too. A call takes one out while it uses
        # it (a client's calls on two threads at once each use their own)
        self.keep = keep
        self._closed = False
        self._conns: dict[tuple[str, int], http.client.HTTPConnection] = {}

    def close(self) -> None:
        """Close the connections it keeps; from now on it keeps none (a
        call still works, on a connection of its own)."""
        self._closed = True
        conns, self._conns = self._conns, {}
        for conn in conns.values():
            conn.close()

    def sharing(self, timeout: float, *, keep: bool | None = None) -> Etcd:
        """Another client of the same cluster (a deadline of its own) that
        goes where this one goes: one that found an endpoint gone spares
        the others the wait. ``keep``: as this one's, unless given."""
        return Etcd(
            self.endpoints, timeout, route=self._route, keep=self.keep if keep is None else keep
        )

    def __repr__(self) -> str:
        return f"etcd {','.join(f'{h}:{p}' for h, p in self.endpoints)}"

    # -- requests -----------------------------------------------------------

    def call(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``path`` (``/v3/...``) on the cluster: its answer."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        pause, last, wait, tries = RETRY_PAUSE, "no endpoint tried", FIRST_WAIT, 0
        while True:
            at = self._route.current % len(self.endpoints)
            host, port = self.endpoints[at]
            left = deadline - time.monotonic()
            try:
                return self._post(host, port, path, body, max(min(left, wait), 0.01))
            except (OSError, http.client.HTTPException, _Retry) as exc:
                last = f"{host}:{port}: {exc}"
                self._route.current = (at + 1) % len(self.endpoints)
                tries += 1
                if tries % len(self.endpoints) == 0:
                    wait *= 2  # every one tried: slow rather than stuck, it seems
            left = deadline - time.monotonic()
            if left <= 0:
                raise EtcdUnavailable(
                    f"etcd at {','.join(f'{h}:{p}' for h, p in self.endpoints)} did not "
                    f"answer {path} in time (last: {last})"
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)

    def _post(
        self, host: str, port: int, path: str, body: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        payload = json.dumps(body)
        for _ in range(2):  # again, on a fresh connection, where a kept one was stale
            kept = self._conns.pop((host, port), None)
            conn = kept or http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                else:
                    conn.timeout = timeout
                conn.request("POST", path, payload, {"Content-Type": "application/json"})
                response = conn.getresponse()
                data = response.read()
            except TimeoutError as exc:
                conn.close()
                raise TimeoutError(f"no answer within {timeout:.2f} s") from exc
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                conn.close()
                if kept is None:
                    raise
                continue  # the endpoint closed a kept connection: not its fault
            except BaseException:
                conn.close()
                raise
            if response.will_close or not self.keep or self._closed:
                conn.close()
            elif self._conns.setdefault((host, port), conn) is not conn:
                conn.close()  # a call on another thread kept one first: one is enough
            elif self._closed:  # (close() came meanwhile: it may have missed it)
                self.close()
            break
        else:  # (two kept connections gone stale in a row: another call's)
            raise http.client.RemoteDisconnected(f"{host}:{port} closed the connection")
        try:
            answer: dict[str, Any] = json.loads(data) if data else {}
        except ValueError:
            raise EtcdError(f"etcd answered {response.status} with {data[:200]!r}") from None
        if response.status == 200 and "error" not in answer:
            return answer
        message = str(answer.get("message") or answer.get("error") or data[:200])
        if response.status >= 500 or any(word in message for word in _RETRIED):
            raise _Retry(message)
        raise EtcdError(f"etcd refused {path}: {message}")

    # -- keys -----------------------------------------------------------------

    def get(self, key: bytes) -> KeyValue | None:
        kvs = self.call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: bytes, *, keys_only: bool = False) -> list[KeyValue]:
        body = prefix_range(prefix)
        if keys_only:
            body["keys_only"] = True
        return [_kv(raw) for raw in self.call("/v3/kv/range", body).get("kvs", [])]

    def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
    ) -> tuple[bool, list[dict[str, Any]]]:
        """One transaction (``compare`` as etcd's JSON, ``key``/``value``
        already base64): whether it succeeded, and the answers of the
        branch it took, in order."""
        answer = self.call(
            "/v3/kv/txn", {"compare": compare, "success": success, "failure": failure}
        )
        return bool(answer.get("succeeded")), list(answer.get("responses", []))

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Set ``key``; the store's revision after."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("/v3/kv/put", body)["header"]["revision"])

    def create(self, key: bytes, value: bytes, lease: int = 0) -> tuple[bool, bytes]:
        """Set ``key`` only where it does not exist: whether this call set
        it, and the value it holds (ours, or the one that was first)."""
        won, answers = self.txn([absent(key)], [put_op(key, value, lease)], [range_op(key)])
        if won:
            return True, value
        found = ranged(answers[0]) if answers else []
        held = found[0].value if found else b""
        # a retry after a lost answer finds its own value: that was its win
        return held == value, held

    def delete(self, key: bytes) -> int:
        """Delete ``key``: how many keys went (0 or 1)."""
        return int(self.call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def delete_prefix(self, prefix: bytes) -> int:
        return int(self.call("/v3/kv/deleterange", prefix_range(prefix)).get("deleted", 0))

    # -- leases ---------------------------------------------------------------

    def grant(self, ttl: float) -> int:
        """A lease of ``ttl`` seconds (rounded up: etcd counts whole seconds)."""
        answer = self.call("/v3/lease/grant", {"TTL": str(max(1, int(-(-ttl // 1))))})
        return int(answer["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``: the seconds it has left (0: it expired)."""
        answer = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", answer).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` and delete its keys (one already gone: nothing)."""
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    # -- the cluster ----------------------------------------------------------

    def status(self, host: str, port: int, timeout: float = 1.0) -> dict[str, Any]:
        """One endpoint's own status (its leader's id, its member id), no failover."""
        return self._post(host, port, "/v3/maintenance/status", {}, timeout)


class _Retry(Exception):
    """An answer that another endpoint (or the same, later) may mend."""
