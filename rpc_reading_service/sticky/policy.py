"""``Sticky``: the option object of the sticky distribution, and what it does to a run's graph."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ..errors import ConfigurationError
from .hashing import StickyAssignment

if TYPE_CHECKING:
    from torchdata.dataloader2.graph import DataPipe

    from .selection import KeySelection

__all__ = ["Sticky"]


@dataclass(frozen=True)
class Sticky:
    """Send every item to the worker server chosen by a stable hash of its key (``distribution="sticky"``).

    Each worker walks the stream at the graph's ``sharding_filter()`` and keeps the items
    whose key maps to its own session: the same items every epoch (so a server's
    ``cached_map`` cache stays warm), in a new order every epoch (shuffles before the
    sharding point still use the epoch's shared seed). The trainer merges the workers'
    streams round-robin; shards are uneven, and a worker whose shard ended drops out of the
    rotation. Keys go to servers by rendezvous hashing of their addresses, so adding or
    removing one of N servers moves only about 1/N of the keys.

    Args:
        key_fn: The key of an item at the sharding point (default: the item itself). Keys are
            bytes, str, int (also numpy integers and one-element integer tensors), float,
            None, or tuples/lists of them; anything else raises
            :class:`~rpc_reading_service.errors.StickyKeyError` on the worker.
    """

    key_fn: Optional[Callable[[Any], Any]] = None

    def __post_init__(self) -> None:
        if self.key_fn is not None and not callable(self.key_fn):
            raise ConfigurationError(
                f"Sticky(key_fn=...) must be a function of an item or None, got {self.key_fn!r}"
            )

    def worker_selection(self, rank_addresses: Sequence[str]) -> "KeySelection":
        """The worker-side selection over the servers of ``rank_addresses`` (the server
        address of every worker rank), for the distribution-policy interface."""
        from .selection import KeySelection  # torchdata: imported where a graph is at hand

        return KeySelection(StickyAssignment(rank_addresses), self.key_fn)

    def worker_graph(self, graph: "DataPipe", rank_addresses: Sequence[str]) -> "DataPipe":
        """``graph`` with its sharding point selecting by key over the servers of
        ``rank_addresses`` (the server address of every worker rank)."""
        from .selection import make_sticky  # torchdata: imported where a graph is at hand

        return make_sticky(graph, StickyAssignment(rank_addresses), self.key_fn)
