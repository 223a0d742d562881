"""The distribution policy interface: who produces which items of an epoch, and in which order they arrive.

What a policy decides (selection, merging, checkpoints, reassignment): docs/architecture.md.
Policies register by name (:func:`rpc_reading_service.register_distribution`) or by the
entry-point group ``rpc_reading_service.distributions``."""

from __future__ import annotations

import abc
import queue
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, Iterator, List, Mapping, Optional, Protocol

from ..errors import ConfigurationError
from ..selection import WorkerSelection

if TYPE_CHECKING:
    from ..trainer.channel import Event, WorkerChannel
    from .merge import EpochProgress, ReplaceFn

__all__ = ["DistributionPolicy", "EpochRun", "FleetView", "Merger"]


class FleetView(Protocol):
    """What a policy may ask about the run's workers when the graph is shipped (the engine's
    :class:`~rpc_reading_service.trainer.engine.fleet.Fleet` is one)."""

    #: Worker sessions of the run.
    num_workers: int

    def rank_addresses(self) -> List[str]:
        """The server address of every worker rank (sessions of one server share it); the
        first call resolves them (a local server starts)."""
        ...


@dataclass
class EpochRun:
    """What one epoch's merger works with.

    Attributes:
        channels: The worker channels by rank (a replaced channel is swapped in place).
        events: The queue every channel delivers to when the policy wants one shared queue.
        progress: The epoch's progress (count every item handed on with ``progress.count``).
        replace: Opens the replacement session of a lost worker; it raises the loss itself when it
            is a failure and ``reassign`` is False (a drained worker is always replaced).
        resume: The policy's state from the checkpoint this epoch resumes (None: a fresh epoch).
        wire: The epoch's wire number (what its frames carry).
    """

    channels: List["WorkerChannel"]
    events: "queue.SimpleQueue[Event]"
    progress: "EpochProgress"
    replace: Optional["ReplaceFn"]
    resume: Optional[Mapping[str, Any]]
    wire: int
    #: A dispatching graph's units under a policy with :attr:`DistributionPolicy.dispatch_units`
    #: (an :class:`~rpc_reading_service.trainer.engine.dispatch.UnitDispatch`), set by the engine before
    #: the epoch is iterated; None otherwise.
    dispatched: Optional[Any] = None
    #: What the run's previous epoch's merger passed on (:meth:`Merger.hint`; None: nothing, or no such epoch).
    hint: Optional[Any] = None
    #: ``on_worker_failure="reassign"``: a failed worker is replaced too, not only a drained one.
    reassign: bool = True
    #: Under an :attr:`DistributionPolicy.elastic` policy: the sessions of servers that joined
    #: since the last call, appended to ``channels`` and started on this epoch (a ``ServersJoined``
    #: event says when to call it); None: the epoch takes no new sessions.
    join: Optional[Callable[[], List["WorkerChannel"]]] = None


class Merger(abc.ABC):
    """One epoch of a policy: an iterator of the delivered items, and its checkpoint state."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Any]:
        """The epoch's items in the delivered order; ends when every worker's stream ended."""

    def runs(self) -> Optional[Iterator[Iterator[Any]]]:
        """The same items in runs handed on in a row, each the iterator ``progress.count_run``
        returned when it counted the run at once (``progress.ahead``: its items not handed on yet);
        None: only :meth:`__iter__`. Once one of the two is iterated, the other is not."""
        return None

    def state(self, undelivered: int = 0) -> Optional[Dict[str, Any]]:
        """The policy's checkpoint state (JSON-able), as if the last ``undelivered`` items handed on
        had not been taken (a trainer-side stage holds them: they are replayed). None: the per-rank
        positions say everything."""
        return None

    def units(self) -> Optional[Dict[int, int]]:
        """Units of work (e.g. chunks) each rank got this epoch, for ``stats()``; None: fixed shards."""
        return None

    def hint(self) -> Optional[Any]:
        """What the next epoch's merger of the run may start from (:attr:`EpochRun.hint`, e.g. how long
        the stream was); only ever a hint: the next epoch must be right without it. None: nothing."""
        return None


class DistributionPolicy(abc.ABC):
    """How the items of an epoch are spread over the workers and merged back.

    Instances are configuration: frozen in spirit, picklable (DataLoader2 clones its reading
    service), and shared by the epochs of a run; per-epoch state lives in the :class:`Merger`.
    """

    #: The name it is registered under (for messages and ``stats()``).
    name: ClassVar[str] = ""
    #: True: every channel delivers to one shared queue (arrival order); False: each to its own.
    shared_queue: ClassVar[bool] = False
    #: True: workers walk the stream by leases (epochs start with START_EPOCH ``leased``).
    leased: ClassVar[bool] = False
    #: True: with a dispatch point (``sharding_round_robin_dispatch``) the policy's merger leases
    #: the dispatched items as units itself (:attr:`EpochRun.dispatched`) instead of the round-robin deal.
    dispatch_units: ClassVar[bool] = False
    #: True: a session of a server that joins takes work within the running epoch (its merger
    #: adopts it through :attr:`EpochRun.join`), and a checkpoint resumes on any number of
    #: sessions; False: a joined server gets sessions from the next epoch on, and a checkpoint
    #: taken in an epoch resumes on as many sessions as it was taken with.
    elastic: ClassVar[bool] = False

    @property
    def in_order(self) -> bool:
        """Whether items are delivered in an order fixed by the seed (not by the workers' speeds)."""
        return not self.shared_queue

    def check(self, config: Any) -> None:
        """Refuse settings this policy cannot serve (raise ConfigurationError); called once, by the
        run's :class:`~rpc_reading_service.trainer.config.ReadingServiceConfig` with itself (a
        policy knows the settings it reads; the policies' layer is below the configuration)."""

    def check_graph(self, graph: Any) -> None:
        """Refuse a graph this policy cannot serve (raise ConfigurationError), before it is shipped."""

    def worker_selection(self, fleet: FleetView) -> Optional[WorkerSelection]:
        """The selection that replaces ``sharding_filter`` in the shipped graph; None keeps it (by rank)."""
        return None

    def placement(self, fleet: FleetView) -> Optional[str]:
        """A digest of what, besides the number of workers, decides which worker owns which item
        (None: nothing does). A checkpoint records it; resuming where it differs is refused."""
        return None

    def credits(self, prefetch: int) -> int:
        """DATA frames a worker may send ahead of the consumer (its credit window): ``prefetch``,
        the bound on what waits in the trainer per worker."""
        return prefetch

    def skip(self, progress: "EpochProgress", rank: int) -> int:
        """Items of its stream worker ``rank`` skips when its session starts this epoch."""
        return progress.consumed[rank]

    @abc.abstractmethod
    def merger(self, run: EpochRun) -> Merger:
        """The merger of one epoch."""

    def check_state(self, state: Any) -> None:
        """Refuse a malformed checkpoint state of this policy (raise ConfigurationError).
        Policies without state accept only None."""
        if state is not None:
            raise ConfigurationError(
                f"the checkpoint holds state of a distribution policy, but {self.name!r} keeps none: "
                "resume with the distribution the checkpoint was taken with"
            )

    def hint_from_state(self, state: Any) -> Optional[Any]:
        """What the epoch after a checkpoint taken between epochs may start from: the
        :meth:`Merger.hint` the checkpointed epoch's state (``state``) records (default: None)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
