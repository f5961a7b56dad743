"""Timeout validation: one rule for every ``timeout=`` argument in ftcomm.

A timeout is a finite, non-negative number of seconds (``int`` or ``float``) or
a ``datetime.timedelta``. ``None`` means "use the default" where a default
exists. Zero is a real value (the op must already be done), never "not given".
"""

from __future__ import annotations

import math
from datetime import timedelta

Timeout = float | int | timedelta
"""What every ``timeout=`` argument accepts."""

MAX_TIMEOUT = 1e9
"""About 31 years: the largest timeout every backend can represent."""


def to_seconds(value: object, name: str = "timeout") -> float:
    """Return ``value`` as seconds, or raise naming ``name``.

    Raises:
        TypeError: ``value`` is not an int, float or timedelta (``bool`` included).
        ValueError: ``value`` is NaN, infinite, negative or above :data:`MAX_TIMEOUT`.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"{name} must be seconds (int or float) or a datetime.timedelta, "
            f"got {type(value).__name__}"
        )
    if math.isnan(seconds):
        raise ValueError(f"{name} must be a number of seconds, got NaN")
    if math.isinf(seconds):
        raise ValueError(f"{name} must be finite, got {seconds}")
    if seconds < 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {seconds}")
    if seconds > MAX_TIMEOUT:
        raise ValueError(f"{name} must be <= {MAX_TIMEOUT:g} seconds, got {seconds:g}")
    return seconds


def resolve(value: object, default: float, name: str = "timeout") -> float:
    """``to_seconds(value)``, or ``default`` when ``value`` is ``None``."""
    return default if value is None else to_seconds(value, name)
