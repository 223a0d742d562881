"""The engine layer: the workers of one run, independent of DataLoader2.

:class:`Engine` owns a run's workers (:mod:`.fleet`: where they come from, connecting) and
its epochs (:mod:`.epoch`: reassignment, positions); :mod:`rpc_reading_service.policies` is the policy that
spreads the work and merges the workers' streams; :mod:`.guard` keeps iteration to one
thread at a time; :mod:`.autoscale` sizes the fleet by the data stall between epochs. Front ends (the DataLoader2 adapter) sit on top.
"""

from .epoch import Epoch, Positions
from .fleet import Fleet
from .guard import IterationGuard
from .run import Engine

__all__ = ["Engine", "Epoch", "Positions", "Fleet", "IterationGuard"]
