"""``"sticky"``: an item always goes to the same worker server, chosen by a stable hash of its
key, so the server's cache stays warm across epochs and runs.

:mod:`.hashing` places keys (rendezvous hashing over server addresses, then a stable split
among a server's sessions); :mod:`.worker` is the worker's half, the selection that keeps the
items of its own session; :mod:`.trainer` the trainer's half, the policy ``Sticky`` (both import
torchdata, so they are not imported here).
"""

from .hashing import Rendezvous, StickyAssignment, trainer_rank_of

__all__ = ["Rendezvous", "StickyAssignment", "trainer_rank_of"]
