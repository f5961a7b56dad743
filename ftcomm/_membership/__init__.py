"""Membership: generations of a job's world agreed on an existing engine.

Owns nothing itself; re-exports :class:`Membership`, :class:`World` and
:func:`sync_state`. The rule is ``_rule``; the engines ``_store_engine``,
``_lighthouse`` and ``_etcd_engine``; heartbeats ``_watch``; the state copy
``_state_copy``; the public calls ``membership``. See docs/membership.md.
"""

from ._names import World as World
from ._state_copy import sync_state as sync_state
from .membership import Membership as Membership

__all__ = ["Membership", "World", "sync_state"]
