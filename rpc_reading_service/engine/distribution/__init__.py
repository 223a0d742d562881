"""Work distribution: which worker produces which items of the sharded stream, and in which order
they are delivered (``RPCReadingService(distribution=...)``).

:mod:`.base` is the policy interface, :mod:`.merge` the merging of the workers' streams and the
epoch's progress, :mod:`.builtin` the fixed-shard policies (``"round_robin"``, ``"first_ready"``),
:mod:`.dynamic` ``"dynamic"`` (leased chunks, resequenced), :mod:`.sticky` ``"sticky"`` (by a stable
hash of each item's key). The registry by name is
:mod:`rpc_reading_service.distributions`; the worker side is :mod:`rpc_reading_service.selection`.
"""

from .base import DistributionPolicy, EpochRun, FleetView, Merger
from .builtin import FirstReady, RoundRobin
from .merge import EpochProgress, ReplaceFn, iterate_as_completed, iterate_in_order

__all__ = [
    "DistributionPolicy",
    "EpochRun",
    "FleetView",
    "Merger",
    "RoundRobin",
    "FirstReady",
    "EpochProgress",
    "ReplaceFn",
    "iterate_in_order",
    "iterate_as_completed",
]
