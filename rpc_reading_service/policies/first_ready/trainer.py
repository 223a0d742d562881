"""``"first_ready"`` (``in_order=False``): round-robin's shards, delivered as the workers' frames arrive."""

from __future__ import annotations

from ..base import EpochRun, Merger
from ..merge import runs_as_completed
from ..round_robin.trainer import RoundRobin, IteratorMerger

__all__ = ["FirstReady"]


class FirstReady(RoundRobin):
    """Each worker's shard by rank, delivered in arrival order (``in_order=False``): the fastest
    worker's items first; not deterministic."""

    name = "first_ready"
    shared_queue = True

    def merger(self, run: EpochRun) -> Merger:
        """Items as their frames arrive, from the queue all channels share."""
        runs = runs_as_completed(run.channels, run.events, run.progress, run.replace, run.reassign)
        return IteratorMerger(runs)
