"""The worker-side half of the sticky distribution: the selection by key at the sharding point.

The policy (:class:`~rpc_reading_service.policies.sticky.trainer.Sticky`) puts a
:class:`KeySelection` in every ``sharding_filter()``'s place (a
:class:`~rpc_reading_service.selection.SelectionFilter`). Instead of keeping every n-th item,
each worker walks the whole stream at the sharding point and keeps the items whose key the
:class:`~.hashing.StickyAssignment` gives to its rank. The stream there is the same on every
worker (shuffles before it share the epoch's seed), so every item is kept by exactly one
worker, each worker keeps the same items every epoch, in that epoch's order, and a worker's
shard is a deterministic function of the seed: a resumed epoch skips into it as into a
round-robin shard.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ...errors import ConfigurationError
from ...selection import WorkerSelection
from .hashing import StickyAssignment, trainer_rank_of
from ...stable_keys import encode_key

__all__ = ["KeySelection"]

KeyFn = Callable[[Any], Any]


class KeySelection(WorkerSelection):
    """Which items of the stream at the sharding point one worker keeps: those whose key
    the :class:`~.hashing.StickyAssignment` gives to its rank.

    Under torch.distributed, the keys are first split among the trainer ranks by another
    stable hash of the key (not by position, so that a trainer rank with a fleet of its own,
    e.g. local workers, also keeps its items across epochs). Pickled with the graph, one
    copy per worker session; until bound (the graph run in the trainer) it keeps every item.

    Args:
        assignment: Which rank owns a key (the same table on every worker of the run).
        key_fn: The key of an item (default: the item itself); see :func:`~.hashing.encode_key`.
    """

    def __init__(self, assignment: StickyAssignment, key_fn: Optional[KeyFn] = None) -> None:
        self.assignment = assignment
        self.key_fn = key_fn
        self.worker_rank, self.num_workers = 0, 1
        self.trainer_rank, self.world_size = 0, 1

    def bind(self, worker_rank: int, num_workers: int) -> None:
        """This worker's rank among the run's ``num_workers`` sessions (which must be the table's)."""
        if num_workers != self.assignment.num_ranks:
            raise ConfigurationError(
                f"the sticky distribution's table has {self.assignment.num_ranks} worker ranks but worker "
                f"{worker_rank} was sharded as one of {num_workers}: build the table from the run's "
                "worker addresses"
            )
        self.worker_rank, self.num_workers = worker_rank, num_workers

    def bind_outer(self, instance_id: int, num_instances: int) -> bool:
        """This trainer's torch.distributed rank: the keys are split among the trainer ranks too."""
        self.trainer_rank, self.world_size = instance_id, num_instances
        return True

    def keep(self, position: int, item: Any) -> bool:
        """Whether ``item`` is this worker's (``position`` does not matter: its key does)."""
        if self.num_workers == 1 and self.world_size == 1:
            return True
        key_bytes = encode_key(item if self.key_fn is None else self.key_fn(item))
        if self.world_size > 1 and trainer_rank_of(key_bytes, self.world_size) != self.trainer_rank:
            return False
        return self.num_workers == 1 or self.assignment.rank_of_encoded(key_bytes) == self.worker_rank
