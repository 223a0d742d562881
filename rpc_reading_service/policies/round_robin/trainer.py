"""``"round_robin"`` (the default), the fixed-shard policy that ``"first_ready"`` also is.

Each worker keeps torchdata's ``sharding_filter`` by rank (every ``num_workers``-th item
of the sharded stream); the policies differ only in the order of delivery. Positions are
per rank, so resuming and reassigning replay a shard from the items consumed.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from ...selection import WorkerSelection
from ..base import DistributionPolicy, EpochRun, FleetView, Merger
from ..merge import flatten_runs, runs_in_order

__all__ = ["RoundRobin", "IteratorMerger"]


class IteratorMerger(Merger):
    """A merger that is one of the merge functions' runs over the epoch's channels."""

    def __init__(self, runs: Iterator[Iterator[Any]]):
        self._runs = runs

    def __iter__(self) -> Iterator[Any]:
        return flatten_runs(self._runs)

    def runs(self) -> Iterator[Iterator[Any]]:
        """The merge function's runs."""
        return self._runs


class RoundRobin(DistributionPolicy):
    """One item of each worker in turn, by rank: deterministic for a seed (the default).

    Args:
        selection: A worker-side selection replacing ``sharding_filter`` (a subclass's
            business, e.g. "sticky" keeps the items whose key hashes to the worker);
            None keeps torchdata's ``sharding_filter`` by rank.
    """

    name = "round_robin"

    def __init__(self, selection: Optional[WorkerSelection] = None):
        self.selection = selection

    def worker_selection(self, fleet: FleetView) -> Optional[WorkerSelection]:
        """The selection given, else None (torchdata's ``sharding_filter``)."""
        return self.selection

    def merger(self, run: EpochRun) -> Merger:
        """Round-robin over the workers' queues, starting at ``progress.next_rank``."""
        return IteratorMerger(runs_in_order(run.channels, run.progress, run.replace))
