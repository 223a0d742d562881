"""``"sticky"``: every item to the worker server chosen by a stable hash of its key.

The fixed-shard policy of :mod:`.builtin` (round-robin merge, positions per rank: resuming
and reassigning replay a shard from the items consumed) with another worker-side selection:
:class:`~rpc_reading_service.policies.sticky.worker.KeySelection` over the servers of the run,
whose table (the server address of every rank) travels with the shipped graph.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe

from ...errors import ConfigurationError
from ...graph_utils import find_dps, find_lca_round_robin_sharding_dp, traverse_dps
from .hashing import StickyAssignment
from .worker import KeySelection
from ..base import FleetView
from ..round_robin.trainer import RoundRobin

__all__ = ["Sticky"]


class Sticky(RoundRobin):
    """Send every item to the worker server chosen by a stable hash of its key (``distribution="sticky"``).

    Each worker walks the stream at the graph's ``sharding_filter()`` and keeps the items
    whose key maps to its own session: the same items every epoch (so a server's
    ``cached_map`` cache stays warm), in a new order every epoch (shuffles before the
    sharding point still use the epoch's shared seed). The trainer merges the workers'
    streams round-robin; shards are uneven, and a worker whose shard ended drops out of the
    rotation. Keys go to servers by rendezvous hashing of their addresses, so adding or
    removing one of N servers moves only about 1/N of the keys. Under torch.distributed the
    keys are split among the trainer ranks by a stable hash too.

    Args:
        key_fn: The key of an item at the sharding point (default: the item itself). Keys are
            bytes, str, int (also numpy integers and one-element integer tensors), float,
            None, or tuples/lists of them; anything else raises
            :class:`~rpc_reading_service.errors.StickyKeyError` on the worker.
    """

    name = "sticky"

    def __init__(self, key_fn: Optional[Callable[[Any], Any]] = None):
        if key_fn is not None and not callable(key_fn):
            raise ConfigurationError(
                f"Sticky(key_fn=...) must be a function of an item or None, got {key_fn!r}"
            )
        super().__init__()
        self.key_fn = key_fn

    def check_graph(self, graph: Any) -> None:
        """Refuse a graph without ``sharding_filter`` (where items are keyed), with one that applies
        to a ``sharding_group_filter`` only, or with a dispatch point (items dealt by position)."""
        dps = traverse_dps(graph)  # pickles every DataPipe of the graph: once
        if find_lca_round_robin_sharding_dp(dps) is not None:
            raise ConfigurationError(
                "distribution='sticky' keys the items at a sharding_filter, and "
                "sharding_round_robin_dispatch deals them to the workers by position: "
                "use distribution='round_robin' with it"
            )
        filters = find_dps(dps, ShardingFilterIterDataPipe)
        if not filters:
            raise ConfigurationError(
                "distribution='sticky' needs a sharding_filter() in the graph: the point whose items "
                "(or key_fn of them) decide which worker gets them; put it right after the (shuffled) "
                "file list"
            )
        for sharding_filter in filters:
            if sharding_filter.sharding_group_filter is not None:
                raise ConfigurationError(
                    "distribution='sticky' replaces sharding_filter(); a sharding_filter with a "
                    f"sharding_group_filter ({sharding_filter.sharding_group_filter!r}) cannot select by key"
                )

    def worker_selection(self, fleet: FleetView) -> KeySelection:
        """The selection by key over the servers of the fleet (the server address of every rank)."""
        return KeySelection(StickyAssignment(fleet.rank_addresses()), self.key_fn)

    def placement(self, fleet: FleetView) -> Optional[str]:
        """The digest of the table of servers: resuming over other servers would replay other shards."""
        return StickyAssignment(fleet.rank_addresses()).digest()

    def __repr__(self) -> str:
        return f"Sticky(key_fn={self.key_fn!r})"
