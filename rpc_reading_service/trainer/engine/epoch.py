"""One epoch of a run: its distribution policy's merger, reassigning lost workers, positions.

An :class:`Epoch` is what :meth:`Engine.start_epoch <rpc_reading_service.trainer.engine.Engine.start_epoch>`
returns: iterate it for the items (in the order the distribution policy delivers), ask it for its
:class:`Positions` (a checkpoint), and it replays a lost worker's shard on a new session
when the failure policy is :class:`~rpc_reading_service.trainer.config.Reassign`, and always for a
worker whose server drained (its work goes on elsewhere: leaving is not a failure).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Protocol, Set, Tuple

from ...addresses import server_key
from ..channel import Event, WorkerChannel
from ..config import ReadingServiceConfig
from ...policies.merge import EpochProgress
from ...policies.base import EpochRun, Merger
from ...errors import ItemTimeoutError, WorkerDrainedError, WorkerLostError, past_the_end

from .dispatch import Dispatch
from .fleet import Fleet
from .guard import IterationGuard

__all__ = ["Epoch", "EpochHost", "Positions"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Positions:
    """How far the consumer got in an epoch: items taken from each worker's shard, whose
    turn is next in the round-robin, and the distribution policy's own state (None for
    policies whose workers own a fixed shard). Starting an epoch at positions replays the rest exactly."""

    consumed: Tuple[int, ...]
    next_rank: int = 0
    policy: Optional[Mapping[str, Any]] = None

    def resized(self, workers: int) -> "Positions":
        """These positions over ``workers`` ranks, for a policy whose positions are not per rank
        ("dynamic": its own state says what was delivered): the dropped ranks' counts go to rank 0."""
        consumed = list(self.consumed[:workers]) + [0] * (workers - len(self.consumed))
        consumed[0] += sum(self.consumed[workers:])
        return Positions(tuple(consumed), self.next_rank % workers, self.policy)


class EpochHost(Protocol):
    """What an epoch uses of its :class:`~rpc_reading_service.trainer.engine.Engine`."""

    config: ReadingServiceConfig
    #: The graph, when it runs in this process (``num_workers=0``).
    in_process_graph: Optional[Any]
    #: The current epoch, and the first epoch's hint (:meth:`Epoch.hint`).
    epoch: Optional["Epoch"]
    first_hint: Optional[Any]
    channels: List[WorkerChannel]
    events: "queue.SimpleQueue[Event]"
    guard: IterationGuard
    #: The dispatching part of the graph and the current epoch's dispatching (None without a dispatch point).
    dispatching: Optional[Any]
    dispatch: Optional[Dispatch]
    #: The run's workers (a drained server's address is remembered there).
    fleet: Fleet

    def dispatch_failure(self, wire: int) -> Optional[BaseException]:
        """The exception that ended the dispatching part of epoch ``wire``, if one did."""

    def reopen_channel(self, lost: WorkerChannel, error: WorkerLostError, epoch: "Epoch") -> WorkerChannel:
        """A new session in place of ``lost``, started on ``epoch``."""

    def adopt_joined(self, epoch: Optional["Epoch"]) -> List[WorkerChannel]:
        """The sessions of servers that joined, made ranks of the run and started on ``epoch``."""


class Epoch:
    """One epoch of an :class:`~rpc_reading_service.trainer.engine.Engine`: an iterable of its items.

    ``dispatched``: the epoch's dispatched units, for a policy that leases them itself
    (:attr:`EpochRun.dispatched <rpc_reading_service.policies.base.EpochRun>`)."""

    def __init__(
        self, engine: EpochHost, number: int, wire: int, seed: int, positions: Positions, dispatched: Any = None
    ):
        self.engine = engine
        #: The epoch's number (counted from 1; a resumed epoch keeps its own) and its shared seed.
        self.number = number
        self.seed = seed
        #: The number its frames carry: new for every epoch a session sees, so that frames of an
        #: epoch this one supersedes (also one it resumes) are told apart.
        self.wire = wire
        self.progress = EpochProgress(wire, list(positions.consumed), positions.next_rank)
        self._merger: Optional[Merger] = None
        if engine.in_process_graph is None:
            hint = engine.epoch.hint() if engine.epoch is not None else engine.first_hint
            run = EpochRun(
                engine.channels, engine.events, self.progress, self._replace, positions.policy, wire, dispatched, hint,
                reassign=engine.config.reassign is not None,
                join=self._join if engine.config.distribution.elastic else None,
            )  # fmt: skip
            self._merger = engine.config.distribution.merger(run)
        #: Worker losses this epoch by (rank, items of its shard consumed): see :meth:`_replace`.
        self._losses: Dict[Tuple[int, int], int] = {}
        #: Lost workers replaced by a new session this epoch (on_worker_failure="reassign"), and
        #: workers whose server drained (their work went on elsewhere), for ``stats()``.
        self.reassignments = 0
        self.drains = 0
        #: Servers that joined the run for this epoch (at its start, or during it under "dynamic").
        self.joins = 0
        #: Ranks the next epoch retires (:meth:`Engine.retire <rpc_reading_service.trainer.engine.Engine.retire>`):
        #: their server drained, or (under an elastic policy) their replacement had to move to another server.
        self.retiring: Set[int] = set()
        self._started = False

    def __iter__(self) -> Iterator[Any]:
        """The epoch's items; an epoch is iterated once."""
        if self._started:
            raise RuntimeError("an Epoch is iterated once: start a new epoch with Engine.start_epoch()")
        self._started = True
        if self.engine.in_process_graph is not None:
            return self._one_step_at_a_time(self._iterate_in_process())
        assert self._merger is not None
        runs = self._merger.runs()
        if runs is None:
            return self._one_step_at_a_time(iter(self._merger))
        # A run's items are handed on by its own iterator (no Python frame per item); this
        # epoch's steps (its guard, superseded or not) run once per run.
        return itertools.chain.from_iterable(self._one_step_at_a_time(runs))

    @property
    def user_number(self) -> int:
        """The epoch as users count it (from 0: ``range(epochs)``), in ``stats()`` and messages."""
        return self.number - 1

    @property
    def finished(self) -> bool:
        """True once every item of the epoch was taken."""
        return self.progress.finished

    def positions(self, delivered: Optional[int] = None) -> Positions:
        """The epoch's positions; ``delivered``: how many of the items taken so far the consumer
        really received (a trainer-side stage after the stream may hold some back: they are
        given back, to be replayed)."""
        self.progress.delivered = delivered
        consumed, next_rank = self.progress.positions()
        policy = None if self._merger is None else self._merger.state(self.progress.undelivered)
        return Positions(tuple(consumed), next_rank, policy)

    def units(self) -> Optional[Dict[int, int]]:
        """Units of work each rank got this epoch (the policy's, e.g. chunks); None for fixed shards."""
        return None if self._merger is None else self._merger.units()

    def hint(self) -> Optional[Any]:
        """What the next epoch's distribution policy may start from (:meth:`Merger.hint`)."""
        return None if self._merger is None else self._merger.hint()

    def supersede(self) -> None:
        """A newer epoch of the engine replaces this one: its iterator hands on nothing more."""
        self.progress.drop_run()

    def _one_step_at_a_time(self, source: Iterator[Any]) -> Iterator[Any]:
        """The items (or runs) of ``source``, each taken holding the engine's guard, and only while
        this epoch is the current one; then the exception that ended the dispatching part, if one did.

        An iterator of an epoch that a newer one superseded must not take the newer epoch's
        frames from the shared queues: that would lose them for its own iterator. The items of
        a run are this iterator's already: handing them on takes no guard (a newer epoch drops
        those not handed on yet: :meth:`supersede`).
        """
        engine = self.engine
        guard, get_ident = engine.guard, threading.get_ident
        lock, doing = guard.lock, "taking an item"
        while True:
            # guard.acquire()/release() inlined: this runs once per item or run.
            if not lock.acquire(False):
                guard.refuse(doing)
            guard.depth, guard.holder, guard.doing = 1, get_ident(), doing
            try:
                if self is not engine.epoch:
                    self._superseded()
                taken = next(source)
            except StopIteration:
                break
            finally:
                guard.depth, guard.holder = 0, None
                lock.release()
            yield taken
        failure = engine.dispatch_failure(self.wire)
        if failure is not None:
            raise failure

    @staticmethod
    def _superseded() -> None:
        raise RuntimeError(
            "this iterator of a DataLoader2 was invalidated because a newer iteration of the "
            "same DataLoader2 started a new epoch; iterate the newest iterator only"
        )

    def _iterate_in_process(self) -> Iterator[Any]:
        progress = self.progress
        skip, index = progress.consumed[0], -1
        for index, item in enumerate(self.engine.in_process_graph):  # type: ignore[arg-type]
            if index >= skip:
                progress.count(0)
                yield item
        if index + 1 < skip:  # a resumed epoch's position lies past the end of the graph's stream
            raise past_the_end("'consumed'", "the trainer's own graph (num_workers=0)", skip, index + 1)
        progress.finish()

    def _replace(self, lost: WorkerChannel, error: WorkerLostError) -> WorkerChannel:
        """Replay a lost worker's shard on a new session, skipping what the consumer took; a loss
        other than a drain is raised unless on_worker_failure is "reassign"."""
        if isinstance(error, WorkerDrainedError):
            return self._take_over(lost, error)
        engine, rank, progress = self.engine, lost.rank, self.progress
        if engine.config.reassign is None:
            raise error
        if engine.dispatch is not None and error is engine.dispatch.timed_out:
            raise error  # the trainer's dispatcher timed out, not a worker: no replacement helps
        # Losses at one position of one shard, this epoch: a replay that gets further is progress
        # (unrelated faults), one that dies at the same place again points at the graph.
        position, limit = progress.consumed[rank], engine.config.reassign.max_reassignments
        losses = self._losses[(rank, position)] = self._losses.get((rank, position), 0) + 1
        if losses > limit:
            message = (
                f"{error} -- gave up: worker {rank}'s shard was lost {losses} times in this epoch with the "
                f"trainer at the same position (after {position} of its items), and "
                f"max_reassignments={limit} allows {limit} replays from one position. Does the graph crash "
                "its process at that item every time? on_worker_failure='raise' shows the first loss"
            )
            if isinstance(error, ItemTimeoutError):  # the same kind of failure, every time: keep its type
                raise ItemTimeoutError(message, rank, lost.address, error.position, error.stack) from error
            raise WorkerLostError(message, rank, lost.address) from error
        log.warning(
            "%s; replaying its shard from item %d on a new session (replay %d of %d from there this epoch)",
            error, position, losses, limit,
        )  # fmt: skip
        channel = self._reopen(lost, error)
        self.reassignments += 1
        if engine.config.distribution.elastic and server_key(channel.address) != server_key(lost.address):
            self.retiring.add(rank)  # its server did not take the new session: taken as gone from the next epoch on
        return channel

    def _take_over(self, lost: WorkerChannel, error: WorkerDrainedError) -> WorkerChannel:
        """A drained worker's work goes on in a new session on another server, whatever
        on_worker_failure says (not counted against max_reassignments)."""
        engine = self.engine
        if engine.config.reassign is None and engine.dispatching is not None:
            raise WorkerDrainedError(
                f"{error}; the items the trainer dealt it (sharding_round_robin_dispatch) are kept for a replay "
                "elsewhere only with on_worker_failure='reassign': pass it to go on when a worker server drains",
                lost.rank, lost.address,
            )  # fmt: skip
        log.info("%s; its work goes on in a new session on another server", error)
        engine.fleet.mark_drained([lost.address])
        channel = self._reopen(lost, error)
        self.drains += 1
        self.retiring.add(lost.rank)
        return channel

    def _join(self) -> List[WorkerChannel]:
        """The sessions of servers that joined since the last call, started on this epoch."""
        return self.engine.adopt_joined(self)

    def _reopen(self, lost: WorkerChannel, error: WorkerLostError) -> WorkerChannel:
        """A new session for ``lost``'s rank, started where the epoch's progress says."""
        return self.engine.reopen_channel(lost, error, self)
