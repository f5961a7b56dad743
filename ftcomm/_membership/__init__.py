"""Membership: generations of a job's world agreed on an existing engine.

Owns nothing itself; re-exports :class:`Membership` and :class:`World`.
The rule is ``_rule``; the store engine ``_store_engine``; heartbeats
``_watch``; the state copy ``_state_copy``; the public calls ``membership``.
"""

from .membership import Membership as Membership
from .membership import World as World

__all__ = ["Membership", "World"]
