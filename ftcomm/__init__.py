"""ftcomm: fault-tolerant, awaitable collectives for PyTorch.

Every collective returns an awaitable :class:`Work` with a deadline; when the
deadline passes or the awaiting task is cancelled, the group is aborted and a
typed error (:mod:`ftcomm.errors`) is raised, so a trainer can reconfigure with
the survivors and carry on. How it works: docs/design.md.
"""

from . import errors as errors
from ._gather import gather as gather
from ._membership import Membership as Membership
from ._membership import World as World
from ._membership import sync_state as sync_state
from ._runtime.deadline import Timeout as Timeout
from ._runtime.observe import Event as Event
from ._runtime.observe import GroupStats as GroupStats
from ._runtime.observe import OpStats as OpStats
from ._runtime.observe import Subscription as Subscription
from ._runtime.work import Work as Work
from ._server import StoreServer as StoreServer
from ._server import serve_store as serve_store
from ._state import State as State
from .errors import CommAborted as CommAborted
from .errors import CommError as CommError
from .errors import CommFailed as CommFailed
from .errors import CommTimeout as CommTimeout
from .errors import Evicted as Evicted
from .errors import MembershipError as MembershipError
from .errors import MembershipTimeout as MembershipTimeout
from .errors import NotConfigured as NotConfigured
from .errors import PrefixReused as PrefixReused
from .errors import ProtocolError as ProtocolError
from .errors import WorkerDied as WorkerDied
from .group import BatchScope as BatchScope
from .group import Closing as Closing
from .group import Group as Group

__version__ = "0.1.0"

__all__ = [
    "BatchScope",
    "Closing",
    "CommAborted",
    "CommError",
    "CommFailed",
    "CommTimeout",
    "Event",
    "Evicted",
    "Group",
    "GroupStats",
    "Membership",
    "MembershipError",
    "MembershipTimeout",
    "NotConfigured",
    "OpStats",
    "PrefixReused",
    "ProtocolError",
    "State",
    "StoreServer",
    "Subscription",
    "Timeout",
    "Work",
    "World",
    "WorkerDied",
    "errors",
    "gather",
    "serve_store",
    "sync_state",
]
