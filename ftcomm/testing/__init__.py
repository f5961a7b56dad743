"""Test worlds and faults as data, for ftcomm's tests and yours.

``run_world(fn, n)`` runs ``await fn(ctx)`` on ``n`` spawned ranks on loopback
and returns their values; a :class:`FaultPlan` kills, stops, hangs, delays or
fails chosen ops of chosen ranks without touching the code under test, and
with ``network=True`` (each rank a host of its own) cuts, drops or loses
their packets. See docs/testing.md.
"""

from ._base import RankContext as RankContext
from ._base import RankFailure as RankFailure
from ._base import WorldError as WorldError
from ._etcd import EtcdCluster as EtcdCluster
from ._etcd import etcd_missing as etcd_missing
from ._etcd import partition_missing as partition_missing
from ._faults import Fault as Fault
from ._faults import FaultPlan as FaultPlan
from ._faults import Kind as Kind
from ._inspect import Inspection as Inspection
from ._inspect import inspect as inspect
from ._net import network_missing as network_missing
from ._world import LOOPS as LOOPS
from ._world import run_world as run_world

__all__ = [
    "LOOPS",
    "EtcdCluster",
    "Fault",
    "FaultPlan",
    "Inspection",
    "Kind",
    "RankContext",
    "RankFailure",
    "WorldError",
    "etcd_missing",
    "inspect",
    "partition_missing",
    "network_missing",
    "run_world",
]
