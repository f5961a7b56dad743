"""Store addresses: ``host:port/prefix`` parsing and the store client."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import timedelta

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore


@dataclass(frozen=True, slots=True)
class StoreAddr:
    """A parsed ``host:port/prefix`` (``[v6addr]:port/prefix`` for IPv6)."""

    host: str
    port: int
    prefix: str

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}/{self.prefix}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_store_addr(value: object, name: str = "store_addr") -> StoreAddr:
    """Parse ``host:port/prefix``; the prefix may contain ``/`` and may be empty.

    Raises:
        TypeError: ``value`` is not a str.
        ValueError: it is empty, or its host, port or brackets are malformed.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str 'host:port/prefix', got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{name} must be 'host:port/prefix', got an empty string")
    hostport, _, prefix = value.partition("/")
    if hostport.startswith("["):
        host, sep, rest = hostport[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{name} {value!r}: an IPv6 host is written '[addr]:port/prefix'")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{name} {value!r}: {host!r} is not an IPv6 address") from None
        port_text = rest[1:]
    else:
        host, sep, port_text = hostport.rpartition(":")
        if not sep:
            raise ValueError(f"{name} {value!r} has no port: expected 'host:port/prefix'")
        if ":" in host:
            raise ValueError(f"{name} {value!r}: put an IPv6 host in brackets, '[{host}]:port'")
    if not host:
        raise ValueError(f"{name} {value!r} has no host: expected 'host:port/prefix'")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{name} {value!r}: port must be an integer in 1..65535")
    return StoreAddr(host, int(port_text), prefix)


def connect_store(addr: StoreAddr, timeout: float) -> Store:
    """A client of the TCPStore at ``addr``, scoped to its prefix. Blocks."""
    store = TCPStore(
        host_name=addr.host,
        port=addr.port,
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )
    return PrefixStore(addr.prefix, store) if addr.prefix else store
