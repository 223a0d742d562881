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

__all__ = ["KeySelection", "StickyShardingFilterIterDataPipe", "make_sticky"]

KeyFn = Callable[[Any], Any]


class KeySelection:
    """Which items of the stream at the sharding point one worker keeps: those whose key
    the :class:`~.hashing.StickyAssignment` gives to its rank.

    It has the shape of the distribution-policy interface's ``WorkerSelection`` (``bind``,
    ``start_epoch``, ``keep``, ``passed``, ``end``; never ``leased``). Pickled with the graph,
    one copy per worker session; until bound (the graph run in the trainer) it keeps every item.

    Args:
        assignment: Which rank owns a key (the same table on every worker of the run).
        key_fn: The key of an item (default: the item itself); see :func:`~.hashing.encode_key`.
    """

    leased = False

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

    def bind_trainer(self, trainer_rank: int, world_size: int) -> None:
        """This trainer's torch.distributed rank: its keys are split among the trainer ranks
        by another stable hash of the key (not by position, so that a trainer rank with a
        fleet of its own, e.g. local workers, also keeps its items across epochs)."""
        self.trainer_rank, self.world_size = trainer_rank, world_size

    def start_epoch(self, context: Any) -> None:
        """Nothing changes between epochs: the keys decide."""

    def keep(self, position: int, item: Any) -> bool:
        """Whether ``item`` is this worker's (``position`` does not matter: its key does)."""
        if self.num_workers == 1 and self.world_size == 1:
            return True
        key_bytes = encode_key(item if self.key_fn is None else self.key_fn(item))
        if self.world_size > 1 and trainer_rank_of(key_bytes, self.world_size) != self.trainer_rank:
            return False
        return self.num_workers == 1 or self.assignment.rank_of_encoded(key_bytes) == self.worker_rank

    def passed(self, position: int) -> None:
        """Nothing to report per item."""

    def end(self, length: Optional[int]) -> None:
        """Nothing to report at the end of the walk."""


class StickyShardingFilterIterDataPipe(ShardingFilterIterDataPipe):
    """The sharding point of the sticky distribution: keeps what its :class:`KeySelection` keeps.

    Sharded like the ``sharding_filter`` it replaces: torchdata's ``apply_sharding`` binds
    the selection to the worker's rank (the multiprocessing level) and to the trainer's
    torch.distributed rank (the distributed level). Without any sharding applied (the graph
    run in the trainer) it passes every item.
    """

    def __init__(self, source_datapipe: DataPipe, selection: KeySelection) -> None:
        super().__init__(source_datapipe)
        self.selection = selection

    def apply_sharding(
        self, num_of_instances: int, instance_id: int, sharding_group: Any = SHARDING_PRIORITIES.DEFAULT
    ) -> None:
        """Record the level as ``sharding_filter`` does, and bind the selection to it."""
        if sharding_group not in (SHARDING_PRIORITIES.MULTIPROCESSING, SHARDING_PRIORITIES.DISTRIBUTED):
            raise ConfigurationError(
                "the sticky distribution shards by worker rank and torch.distributed rank: "
                f"apply_sharding with the {sharding_group!r} group cannot be combined with it"
            )
        super().apply_sharding(num_of_instances, instance_id, sharding_group)
        if sharding_group == SHARDING_PRIORITIES.MULTIPROCESSING:
            self.selection.bind(instance_id, num_of_instances)
        else:
            self.selection.bind_trainer(instance_id, num_of_instances)

    def __iter__(self) -> Iterator[Any]:
        keep = self.selection.keep
        for position, item in enumerate(self.source_datapipe):
            if keep(position, item):
                yield item

    def __len__(self) -> int:
        raise TypeError(
            f"{type(self).__name__} has no length before it is iterated: how many items a worker "
            "keeps depends on their keys"
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
    # A graph made sticky before is made sticky again (over the new table).
    kinds = (ShardingFilterIterDataPipe, StickyShardingFilterIterDataPipe)
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
        new = StickyShardingFilterIterDataPipe(old.source_datapipe, KeySelection(assignment, key_fn))
        for group, (instances, instance_id) in old.groups.items():  # torch.distributed's, by the trainer
            new.apply_sharding(instances, instance_id, group)
        if old is datapipe:
            datapipe = new
        else:
            replace_dp(graph, old, new)
    return datapipe
