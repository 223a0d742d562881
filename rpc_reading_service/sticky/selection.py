"""The worker-side half of the sticky distribution: a sharding filter that selects by key.

:func:`make_sticky` swaps every ``sharding_filter()`` of a graph for a
:class:`StickyShardingFilterIterDataPipe`. It is sharded like the filter it replaces
(torchdata's ``apply_sharding`` gives it the worker's rank), but instead of keeping every
n-th item it walks the whole stream at the sharding point and keeps the items whose key
the :class:`~.hashing.StickyAssignment` gives to its rank. The stream there is the same on
every worker (shuffles before it share the epoch's seed), so every item is kept by exactly
one worker, each worker keeps the same items every epoch, in that epoch's order, and a
worker's shard is a deterministic function of the seed: a resumed epoch skips into it as
into a round-robin shard.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES, ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe, replace_dp, traverse_dps
from torchdata.dataloader2.graph.utils import list_dps

from ..errors import ConfigurationError
from .hashing import StickyAssignment, encode_key, trainer_rank_of

__all__ = ["StickyShardingFilterIterDataPipe", "make_sticky"]

KeyFn = Callable[[Any], Any]


class StickyShardingFilterIterDataPipe(ShardingFilterIterDataPipe):
    """Keeps the items whose key belongs to this worker (the sticky distribution's sharding point).

    Args:
        source_datapipe: The stream at the sharding point.
        assignment: Which rank owns a key (the same table on every worker of the run).
        key_fn: The key of an item (default: the item itself); see
            :func:`~.hashing.encode_key` for the keys accepted.

    The multiprocessing level of sharding (the worker's rank among the run's sessions) must
    match ``assignment``; under torch.distributed the keys are first split among the trainer
    ranks by another stable hash of the key (not by position, so that a trainer's workers
    also keep their items across epochs). Without any sharding applied (the graph run in
    the trainer) it passes every item.
    """

    def __init__(
        self, source_datapipe: DataPipe, assignment: StickyAssignment, key_fn: Optional[KeyFn] = None
    ) -> None:
        super().__init__(source_datapipe)
        self.assignment = assignment
        self.key_fn = key_fn

    def _levels(self) -> tuple:
        """``(trainer world size, trainer rank, sessions, this session's rank)`` from the applied sharding."""
        world, trainer = self.groups.get(SHARDING_PRIORITIES.DISTRIBUTED, (1, 0))
        sessions, rank = self.groups.get(SHARDING_PRIORITIES.MULTIPROCESSING, (1, 0))
        if SHARDING_PRIORITIES.DEFAULT in self.groups:
            raise ConfigurationError(
                "the sticky distribution shards by worker rank (the multiprocessing level): "
                "apply_sharding with the DEFAULT group cannot be combined with it"
            )
        if SHARDING_PRIORITIES.MULTIPROCESSING in self.groups and sessions != self.assignment.num_ranks:
            raise ConfigurationError(
                f"the sticky distribution's table has {self.assignment.num_ranks} worker ranks but worker {rank} "
                f"was sharded as one of {sessions}: build the table from the run's worker addresses"
            )
        return world, trainer, sessions, rank

    def __iter__(self) -> Iterator[Any]:
        world, trainer, sessions, rank = self._levels()
        key_fn, owner = self.key_fn, self.assignment.rank_of_encoded
        for item in self.source_datapipe:
            if world == 1 and sessions == 1:
                yield item
                continue
            key_bytes = encode_key(item if key_fn is None else key_fn(item))
            if world > 1 and trainer_rank_of(key_bytes, world) != trainer:
                continue
            if sessions == 1 or owner(key_bytes) == rank:
                yield item

    def __len__(self) -> int:
        raise TypeError(
            f"{type(self).__name__} has no length before it is iterated: how many items a worker keeps depends on their keys"
        )


def make_sticky(datapipe: DataPipe, assignment: StickyAssignment, key_fn: Optional[KeyFn] = None) -> DataPipe:
    """``datapipe`` with every ``sharding_filter()`` replaced by a sticky one (in place, as
    torchdata's graph functions do; the new root is returned when the root was the filter).

    The sharding levels already applied to a filter (torch.distributed's, by the trainer)
    carry over. Raises :class:`~rpc_reading_service.errors.ConfigurationError` when the
    graph has no ``sharding_filter()`` (the point where items are keyed) or one that only
    applies to a ``sharding_group_filter``.
    """
    graph = traverse_dps(datapipe)
    kinds = (ShardingFilterIterDataPipe, StickyShardingFilterIterDataPipe)  # a graph made sticky before: again
    filters = [dp for dp in list_dps(graph) if type(dp) in kinds]
    if not filters:
        raise ConfigurationError(
            "the sticky distribution needs a sharding_filter() in the graph: the point whose items "
            "(or key_fn of them) decide which worker gets them; put it right after the (shuffled) file list"
        )
    for old in filters:
        if old.sharding_group_filter is not None:
            raise ConfigurationError(
                "the sticky distribution replaces sharding_filter(); a sharding_filter with a "
                f"sharding_group_filter ({old.sharding_group_filter!r}) cannot be made sticky"
            )
        new = StickyShardingFilterIterDataPipe(old.source_datapipe, assignment, key_fn)
        new.groups = dict(old.groups)
        new._update_num_of_instances()
        if old is datapipe:
            datapipe = new
        else:
            replace_dp(graph, old, new)
    return datapipe
