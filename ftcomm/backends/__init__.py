"""Backends behind one contract (:class:`Backend`); the front end picks by name."""

from __future__ import annotations

from ._base import Backend, ConnectSpec

__all__ = ["BACKENDS", "Backend", "ConnectSpec", "backend_class"]

BACKENDS: tuple[str, ...] = ("gloo", "nccl", "xccl", "dummy")


def backend_class(name: str) -> type[Backend]:
    """The backend class for ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`BACKENDS`.
    """
    if name == "gloo":
        from .gloo import GlooBackend

        return GlooBackend
    if name == "dummy":
        from .dummy import DummyBackend

        return DummyBackend
    if name in ("nccl", "xccl"):
        from .accelerator import accelerator_class

        return accelerator_class(name)
    raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
