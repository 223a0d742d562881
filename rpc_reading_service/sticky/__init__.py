"""The sticky distribution: an item always goes to the same worker server, chosen by a stable
hash of its key, so the server's cache stays warm across epochs and runs.

:mod:`.hashing` places keys (rendezvous hashing over server addresses, then a stable split
among a server's sessions); :mod:`.selection` is the worker-side sharding point that keeps
the items of its own session.
"""

from .hashing import Rendezvous, StickyAssignment, encode_key, trainer_rank_of
from .selection import StickyShardingFilterIterDataPipe, make_sticky

__all__ = [
    "Rendezvous",
    "StickyAssignment",
    "encode_key",
    "trainer_rank_of",
    "StickyShardingFilterIterDataPipe",
    "make_sticky",
]
