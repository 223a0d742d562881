"""The sticky distribution's placement: an item always goes to the same worker server, chosen by
a stable hash of its key, so the server's cache stays warm across epochs and runs.

:mod:`.hashing` places keys (rendezvous hashing over server addresses, then a stable split
among a server's sessions); :mod:`.selection` is the worker-side selection that keeps the
items of its own session (it imports torchdata, so it is not imported here). The policy,
``Sticky``, is :mod:`rpc_reading_service.policies.sticky.trainer`.
"""

from .hashing import Rendezvous, StickyAssignment, trainer_rank_of
from ...stable_keys import encode_key

__all__ = ["Rendezvous", "StickyAssignment", "encode_key", "trainer_rank_of"]
