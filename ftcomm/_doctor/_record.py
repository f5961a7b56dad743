"""The doctor's record: the JSON type of its report, :class:`Problem`,
:class:`Findings`, and how sizes are written in it. The bottom of the
package: every other module of ``ftcomm._doctor`` may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]


@dataclass(frozen=True)
class Problem:
    """Something ftcomm needs that is missing or failed here, and what to do."""

    what: str
    advice: str


@dataclass
class Findings:
    """What the checks found, in the order they found it: problems (each with
    advice; any one fails the doctor) and notes (optional things missing)."""

    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def size(nbytes: int) -> str:
    """``nbytes`` in MiB or GiB, one decimal."""
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"
