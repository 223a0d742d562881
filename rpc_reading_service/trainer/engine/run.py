"""The engine: the workers of one run behind a plain Python API, independent of any loader (docs/architecture.md)."""

from __future__ import annotations

import atexit
import copy
import logging
import os
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ...addresses import distinct_servers, parse_address
from ..channel import EpochFailed, Event, ServersJoined, UnitsDispatched, WorkerChannel, drop_items
from ..config import ReadingServiceConfig
from ...errors import (
    ConfigurationError, DispatchStalledError, RPCReadingServiceError, WorkerDrainedError, WorkerLostError,
)
from ...graph import DistributedInfo, graph_traversal, init_worker_graph, reset_dispatching_graph, reset_worker_graph
from ...graph_utils import DataPipe, WorkerInfo
from ...policies.base import FleetView
from ...selection import selection_in_place
from ...serialization import dumps_graph, pack_exception, rebuild_exception
from ..stats import ReadingServiceStats, WorkerStats
from .autoscale import Autoscaler, EpochSample
from .dispatch import Dispatch, RankInput, UnitDispatch
from .epoch import Epoch, Positions
from .fleet import Fleet, close_channels
from .guard import IterationGuard

__all__ = ["Engine"]

log = logging.getLogger(__name__)

#: Seconds a stopped dispatcher thread gets to end before a new epoch or shutdown leaves it behind
#: (stuck in the dispatching part's own code: the new epoch dispatches from a copy of that part).
ABANDON_AFTER = 1.0

#: Engines with workers that have not been closed, and the process that owns them.
_open_engines: "weakref.WeakKeyDictionary[Engine, int]" = weakref.WeakKeyDictionary()


@atexit.register
def _close_at_exit() -> None:
    """Stop the workers of every engine still open when the interpreter exits.

    A front end's own cleanup (DataLoader2's ``__del__``) runs late in interpreter shutdown
    or never (reference cycles), so local workers would outlive the trainer.
    """
    for engine, owner in list(_open_engines.items()):
        if owner == os.getpid():  # not in a forked child that inherited the trainer's memory
            engine.close()


def _in_mprs_words(exc: BaseException) -> BaseException:
    """An exception of the dispatching part as MPRS raises it (ours stay as they are)."""
    if isinstance(exc, RPCReadingServiceError):
        return exc
    return rebuild_exception(pack_exception(exc), None, None, where="dispatching process")


@dataclass
class GrownFleet:
    """The fleet a run will have once the servers that joined take part (a :class:`FleetView`)."""

    num_workers: int
    addresses: List[str]

    def rank_addresses(self) -> List[str]:
        """The server address of every worker rank."""
        return self.addresses


class Engine:
    """The workers of one run: where they come from, their sessions, epochs, reassignment and stats.

    Args:
        config: The run's checked configuration. Nothing opens before :meth:`start`.
    """

    def __init__(self, config: ReadingServiceConfig):
        self.config = config
        #: This trainer's place in a torch.distributed job (set by :meth:`start`).
        self.dist = DistributedInfo()
        self.fleet = Fleet(config)
        self.channels: List[WorkerChannel] = []
        #: The queue every channel delivers to when items are taken as completed.
        self.events: "queue.SimpleQueue[Event]" = queue.SimpleQueue()
        #: With ``num_workers=0`` the graph runs in this process.
        self.in_process_graph: Optional[DataPipe] = None
        #: The non-replicable part before ``sharding_round_robin_dispatch`` (None without one),
        #: and the current epoch's dispatching of it.
        self.dispatching: Optional[DataPipe] = None
        self.dispatch: Optional[Dispatch] = None
        #: The current (or last) epoch, and the number of the latest one (0 before the first).
        self.epoch: Optional[Epoch] = None
        #: The first epoch's hint (:meth:`Merger.hint <rpc_reading_service.policies.base.Merger.hint>`): a checkpoint's,
        #: taken between epochs, so that the next epoch is the one the checkpointed run had.
        self.first_hint: Optional[Any] = None
        self.epoch_number = 0
        self._wire_epochs = 0
        #: Held while setting up and while taking each item: one thread at a time.
        self.guard = IterationGuard()
        self._closed = False
        self._lock = threading.Lock()
        #: The graph :meth:`start` got (shipped again when servers join under a static policy).
        self._graph: Optional[DataPipe] = None
        #: Servers that joined and are in no epoch yet: an elastic policy's sessions, set up and
        #: receiving; a static policy's ``(address, sessions)``, for the next epoch. One join at a time.
        self._joined_channels: List[WorkerChannel] = []
        self._joined_servers: List[Tuple[str, int]] = []
        self._join_lock = threading.Lock()
        self._ship_lock = threading.Lock()
        self._join_failures: set = set()
        #: Sizes the fleet by the data stall between epochs (``autoscale=``; made by :meth:`start`).
        self.autoscaler: Optional[Autoscaler] = None

    @property
    def num_workers(self) -> int:
        """Worker sessions of the run (known after :meth:`discover` with discovery)."""
        return self.fleet.num_workers

    def discover(self) -> int:
        """Find the workers of a store or hostfile (once) and return the number of sessions."""
        return self.fleet.discover()

    def start(
        self, graph: DataPipe, dist: Optional[DistributedInfo] = None, dispatching: Optional[DataPipe] = None
    ) -> None:
        """Find and start the workers and set up every session with ``graph``, the DataPipes the
        workers run (already sharded for ``dist``, this trainer's place in a torch.distributed
        job: worker ``i`` runs global shard ``dist.rank * num_workers + i``); with
        ``num_workers=0`` the graph runs in this process. ``dispatching``: the part a graph
        with ``sharding_round_robin_dispatch`` runs here, once per epoch, dealing its items
        to the workers (``graph`` has torchdata's placeholder where it was).

        Returns while the sessions still set up (in the background): each one starts an epoch
        as soon as it is set up; a failed setup is raised when the epoch's items come to its
        worker (:meth:`Fleet.connect <rpc_reading_service.trainer.engine.fleet.Fleet.connect>`)."""
        self.dist = dist or DistributedInfo()
        self.dispatching = dispatching
        if self.config.autoscale is not None and self.dist.world_size > 1 and not self.config.distribution.elastic:
            raise ConfigurationError(
                f"autoscale under torch.distributed ({self.dist.world_size} trainer ranks) would give each rank its own "
                f"number of sessions, and distribution={self.config.distribution.name!r} shards by that number over "
                "every rank: use distribution='dynamic' (its shards do not depend on it), or a fixed num_workers"
            )
        self.discover()
        config = self.config
        if self.num_workers == 0:
            self.in_process_graph = init_worker_graph(graph, WorkerInfo(1, 0), config.worker_init_fn)
            return
        _open_engines[self] = os.getpid()
        try:
            shipped = self._ship(graph)  # a policy may ask for the workers' addresses: a local server starts
            self.channels = self.fleet.connect(shipped, self.receiver_queue)
            self._graph = graph
            self.fleet.watch(self._found)
            if config.autoscale is not None:
                per_server = config.autoscale.sessions_per_server or (
                    config.autoscale.max_sessions if config.local else self.fleet.sessions_per_server()
                )
                self.autoscaler = Autoscaler(config.autoscale, per_server)
        except BaseException:
            self.close()
            raise

    def add_workers(self, addresses: Sequence[str]) -> List[str]:
        """Add the worker servers at ``addresses`` to the running run; returns those added.

        Each new server gets :meth:`Fleet.sessions_per_server <rpc_reading_service.trainer.engine.fleet.Fleet.sessions_per_server>`
        sessions, set up here: under an elastic policy ("dynamic") they take work in the current
        epoch, else from the next epoch on. A server of the run (under any spelling) is not added
        again; one that does not answer or fails its setup is logged and skipped.

        Args:
            addresses: ``"host:port"`` of each server.
        """
        if isinstance(addresses, (str, bytes)) or not isinstance(addresses, Sequence):
            raise ConfigurationError(f"add_workers takes a list of 'host:port' strings, got {addresses!r:.80}")
        for address in addresses:
            parse_address(address)
        if self.in_process_graph is not None:
            raise ConfigurationError(
                "add_workers: num_workers=0 runs the graph in the trainer, with no worker server to add to; "
                "pass num_workers or workers= for a run on worker servers"
            )
        if self._graph is None or self._closed:
            when = "was closed (shut down)" if self._closed else "has not started"
            raise ConfigurationError(f"add_workers adds servers to a running run, and this one {when}: call it "
                                     "once the first epoch began, before the run is shut down")  # fmt: skip
        return self._join(addresses)[0]

    def _found(self, addresses: List[str]) -> List[str]:
        """The discovery watch found ``addresses``: add them; returns those to try again."""
        self.fleet.serves_again(addresses)  # listed again after they left the list: they serve again
        return self._join(addresses)[1]

    def _join(self, addresses: Sequence[str]) -> Tuple[List[str], List[str]]:
        """Add the servers of ``addresses`` the run does not have: ``(added, failed)``."""
        added, failed = [], []
        with self._join_lock:
            known = [address for address, _count in self._joined_servers]
            known += [channel.address for channel in [*self.channels, *self._joined_channels]]  # where the ranks are now
            for address in self.fleet.unknown_servers(addresses, known):
                if self._closed:
                    break
                (added if self._join_server(address) else failed).append(address)
        return added, failed

    def _join_server(self, address: str) -> bool:
        """Set up the sessions of the server at ``address`` (holding the join lock); False if it
        does not answer or fails its setup (logged), or the run closed meanwhile."""
        fleet, elastic = self.fleet, self.config.distribution.elastic
        count = fleet.sessions_per_server()
        with self._lock:
            first = self.num_workers + len(self._joined_channels) + sum(n for _a, n in self._joined_servers)
        channels: List[WorkerChannel] = []
        try:
            reason = fleet.transport().probe(address)
            if reason is not None:
                raise ConnectionError(reason)
            graph = None
            pending = [a for a, n in self._joined_servers for _session in range(n)]
            grown = GrownFleet(first + count, [*fleet.rank_addresses(), *pending, *[address] * count])
            if not elastic and self.config.distribution.placement(grown) is not None:
                assert self._graph is not None  # shipped as to the next epoch's fleet (sticky: a table of its servers)
                graph = self._ship(self._graph, grown)
            for rank in range(first, first + count):
                channels.append(fleet.open_channel(rank, address, first + count, graph))
        except Exception as exc:  # noqa: BLE001 - any reason a server cannot serve: never the run's error
            for channel in channels:
                channel.close()
            again = address in self._join_failures
            self._join_failures.add(address)
            log.log(logging.DEBUG if again else logging.WARNING, "worker server %s cannot join the run: %s", address, exc)
            return False
        self._join_failures.discard(address)
        with self._lock:
            closed, epoch = self._closed, self.epoch
            if not closed and elastic:
                for channel in channels:
                    channel.start_receiver(self.receiver_queue())
                self._joined_channels.extend(channels)
            elif not closed:
                self._joined_servers.append((address, count))
        if closed or not elastic:
            close_channels(channels)  # a static policy's were a check that the server serves this run
        if closed:
            return False
        now = elastic and epoch is not None and not epoch.finished
        log.info(
            "worker server %s joined the run with %d session%s (ranks %d-%d), taking work %s", address, count,
            "s" if count != 1 else "", first, first + count - 1, "in this epoch" if now else "from the next epoch",
        )  # fmt: skip
        if now:
            assert epoch is not None
            self.events.put(ServersJoined(channels[0], epoch.wire))  # wakes the merger: Epoch.join
        return True

    def adopt_joined(self, epoch: Optional[Epoch]) -> List[WorkerChannel]:
        """Make the sessions of servers that joined (an elastic policy's) ranks of the run, started
        on ``epoch`` if given (it counts the joins); returns them."""
        with self._lock:
            channels, self._joined_channels = self._joined_channels, []
            for channel in channels:
                channel.rank = len(self.channels)  # ranks retired since its setup numbered it
                self.channels.append(channel)
                self.fleet.add_rank(channel.address)
                if epoch is not None:
                    epoch.progress.consumed.append(0)
                    self.replace_dispatched(channel)
                    self.start_channel(channel, epoch)
        if epoch is not None:
            epoch.joins += len(distinct_servers(channel.address for channel in channels))
        return channels

    def _grow(self, retired: bool = False) -> int:
        """Give the servers that joined under a static policy their ranks, before an epoch: every
        session is set up again over the new fleet (shards follow the ranks and their number;
        sticky's keys, the servers), also when ranks were ``retired``. Returns the number of servers that joined."""
        with self._lock:
            servers, self._joined_servers = self._joined_servers, []
        servers = [(address, count) for address, count in servers if not self.fleet.is_drained(address)]  # left since
        if not servers:
            joined = len(distinct_servers(channel.address for channel in self.adopt_joined(None)))
            if retired and not self.config.distribution.elastic:
                self._set_up_again()
            return joined
        self.fleet.regroup([channel.address for channel in self.channels], servers)
        self._set_up_again()
        return len(servers)

    def retire(self) -> bool:
        """Before an epoch: retire the ranks whose server drained (or, under an elastic policy, went
        away) so that the run's sessions are those of the servers it has (:meth:`Fleet.retirees
        <rpc_reading_service.trainer.engine.fleet.Fleet.retirees>`). An elastic policy's sessions
        left are numbered anew; a static policy's are set up again by :meth:`_grow`. True if any was."""
        leaving = set(self.epoch.retiring) if self.epoch is not None else set()
        for channel in self.channels:
            if isinstance(channel.ended_by, WorkerDrainedError):  # it left once its epoch's work was done
                self.fleet.mark_drained([channel.address])
                leaving.add(channel.rank)
        ranks = self.fleet.retirees(self.worker_addresses, leaving)
        left = self.epoch.progress.left if self.epoch is not None else set()
        if left and len(left | set(ranks)) < len(self.channels):  # sessions ended in their epoch are never kept
            ranks = sorted(left | set(ranks))
        if not ranks:
            return False
        with self._lock:
            gone = [self.channels[rank] for rank in ranks]
            kept = [channel for channel in self.channels if channel.rank not in ranks]
            log.info("retiring worker%s %s (%s): %d session%s left", "s" if len(ranks) > 1 else "",
                     ", ".join(map(str, ranks)), ", ".join(distinct_servers(c.address for c in gone)),
                     len(kept), "s" if len(kept) != 1 else "")  # fmt: skip
            for rank, channel in enumerate(kept):
                channel.rank = rank
            self.channels = kept
            self.fleet.resize(self.worker_addresses)
        close_channels(gone)
        return True

    def _set_up_again(self) -> None:
        """Close every session and set up the fleet's ranks anew (a static policy's new fleet)."""
        old, self.channels = self.channels, []
        close_channels(old)
        drop_items(self.events)
        assert self._graph is not None
        self.channels = self.fleet.connect(self._ship(self._graph), self.receiver_queue)

    def _measure(self, last: Epoch) -> Optional[Tuple[ReadingServiceStats, EpochSample]]:
        """The ``last`` epoch's stats and what the autoscaler reads of it (None if it had no items)."""
        stats, progress = self._stats_of(last), last.progress
        if stats.items == 0:
            return None
        steady = max(progress.elapsed - progress.startup_wait, 1e-9)  # past the first item: what sessions change
        return stats, EpochSample(len(stats.workers), stats.items / steady, (progress.wait_seconds - progress.startup_wait) / steady)

    def _autoscale(self, stats: ReadingServiceStats, sample: EpochSample, joined: int) -> None:
        """Before an epoch: act on the autoscaler's decision over the last epoch (``joined``:
        servers that joined since, now ranks of the run)."""
        assert self.autoscaler is not None
        decision, ranks = self.autoscaler.plan(stats, sample, self.worker_addresses, self.fleet.servers(), joined)
        if len(ranks) != len(self.channels):
            self.resize(ranks)
        self.autoscaler.done(decision, len(self.channels))

    def resize(self, ranks: Sequence[str]) -> None:
        """Make the run's worker ranks ``ranks`` (the server of each), between epochs: under an
        elastic policy the sessions past the end are closed or new ones opened at the end (one
        that fails is logged, and the run goes on without it); under a static policy every
        session is set up again over the new fleet (waited for)."""
        if not self.config.distribution.elastic:
            self.fleet.resize(ranks)
            self._set_up_again()
            self.fleet.wait_set_up(self.config.liveness.connect_timeout)  # the epoch's stats time the workers, not setups
            return
        dropped, self.channels = self.channels[len(ranks) :], self.channels[: len(ranks)]
        if dropped:
            close_channels(dropped)
        for rank in range(len(self.channels), len(ranks)):
            try:
                channel = self.fleet.open_channel(rank, ranks[rank], len(ranks))
            except (WorkerLostError, OSError) as exc:
                log.warning("autoscale: a new session on %s failed (%s); the run goes on with %d", ranks[rank], exc, rank)
                break
            channel.start_receiver(self.receiver_queue())
            self.channels.append(channel)
        self.fleet.resize(self.worker_addresses)

    def _ship(self, graph: DataPipe, fleet: Optional[FleetView] = None) -> bytes:
        """The pickled graph for the workers, with the policy's worker-side selection in place of
        ``sharding_filter`` (the caller's graph is put back as it was); ``fleet``: the workers it
        is for (default: the run's)."""
        config, policy = self.config, self.config.distribution

        def dump(shipped: DataPipe) -> bytes:
            return dumps_graph((shipped, config.worker_init_fn, config.worker_reset_fn), config.pickle_by_value)

        with self._ship_lock:  # a join may ship from the discovery watch's thread
            policy.check_graph(graph)
            if self.dispatching is not None and policy.dispatch_units:  # the policy leases the dispatched items
                return dump(graph)
            selection = policy.worker_selection(self.fleet if fleet is None else fleet)
            if self.dispatching is not None and (selection is not None or policy.leased):
                # The graph's dispatch point is already cut off here: the policy's own check cannot see it.
                raise ConfigurationError(
                    f"distribution={policy.name!r} decides itself which worker gets which item, and "
                    "sharding_round_robin_dispatch deals the items to the workers by position: use "
                    "distribution='round_robin' (or 'first_ready') with a dispatching graph"
                )
            if selection is None:
                return dump(graph)
            with selection_in_place(graph, selection) as shipped:
                return dump(shipped)

    def placement(self) -> Optional[str]:
        """The policy's digest of what, besides the number of workers, decides which worker owns
        which item (None: nothing does, or the graph runs here). It may resolve the workers'
        addresses (a local server starts): call it before :meth:`start` only to check a checkpoint."""
        if self.num_workers == 0:
            return None
        return self.config.distribution.placement(self.fleet)

    def receiver_queue(self) -> "queue.SimpleQueue[Event]":
        """Where a new channel delivers: the shared queue, or a queue of its own (the policy says)."""
        return self.events if self.config.distribution.shared_queue else queue.SimpleQueue()

    def start_epoch(
        self, seed: int, positions: Optional[Positions] = None, number: Optional[int] = None
    ) -> Epoch:
        """Start an epoch with the shared ``seed`` on every worker and return it.

        ``positions`` (from :meth:`Epoch.positions`) and ``number`` resume a checkpointed
        epoch: each worker replays its shard from the same seed, skipping what was consumed.
        """
        self.epoch_number = self.epoch_number + 1 if number is None else number
        self._wire_epochs += 1
        last = self.epoch if self.autoscaler is not None and positions is None else None
        measured = self._measure(last) if last is not None else None
        now = positions is None or self.config.distribution.elastic  # a static resume keeps the checkpoint's ranks
        retired = self._graph is not None and now and self.retire()
        later = self.epoch.retiring if self.epoch is not None and not now else set()
        if measured is None:
            joins = self._grow(retired) if self._graph is not None else 0
        else:
            with self._join_lock:  # no server joins while the ranks change (a join numbers its ranks)
                joins = self._grow(retired)
                self._autoscale(*measured, joins)
        positions = positions or Positions((0,) * max(1, self.num_workers))
        if len(positions.consumed) != max(1, self.num_workers):  # an elastic policy's checkpoint of another fleet
            positions = positions.resized(max(1, self.num_workers))
        units = None
        if self.dispatching is not None and self.in_process_graph is None and self.config.distribution.dispatch_units:
            units = self._new_unit_dispatch(self._wire_epochs, seed)
        epoch = Epoch(self, self.epoch_number, self._wire_epochs, seed, positions, dispatched=units)
        epoch.joins = joins
        epoch.retiring.update(later)
        if self.epoch is not None:
            self.epoch.supersede()
        self.epoch = epoch
        if self.in_process_graph is not None:
            self.in_process_graph = reset_worker_graph(
                self.in_process_graph, WorkerInfo(1, 0), seed, self.dist.rank, self.config.worker_reset_fn
            )
            return epoch
        dispatch = units or (self._new_dispatch(epoch) if self.dispatching is not None else None)
        for channel in self.channels:
            self.start_channel(channel, epoch)
        if dispatch is not None:
            dispatch.start()
        return epoch

    def start_channel(self, channel: WorkerChannel, epoch: Epoch) -> None:
        """Start ``epoch`` on one worker, skipping what the policy says was consumed of its stream."""
        global_rank = self.dist.global_worker_id(channel.rank, self.num_workers)
        policy = self.config.distribution
        skip = policy.skip(epoch.progress, channel.rank)
        frames, grow_to = self.config.frames_in_flight(len(self.channels))
        channel.start_epoch(
            epoch.wire, epoch.seed, global_rank, policy.credits(frames), skip=skip,
            dispatched=self.dispatching is not None, leased=policy.leased, number=epoch.user_number, grow_to=grow_to,
        )  # fmt: skip

    def _frames_in_flight(self) -> int:
        """Each worker's credit window in frames (before it grows for large items), for the fleet as it is now."""
        return self.config.frames_in_flight(len(self.channels))[0]

    def _new_dispatch(self, epoch: Epoch) -> Dispatch:
        """Stop the last epoch's dispatching and set up this one's (its thread starts after
        every worker was told to start the epoch). A resumed epoch deals from its first item
        again: the same items to the same ranks, and each worker skips what was consumed."""
        self._supersede_dispatch(epoch.seed)
        options, cond = self.fleet.session_options(), threading.Condition()
        keep_history = self.config.reassign is not None
        # A worker's pipeline, in frames: one pending here, the credit window, one in its graph,
        # two in its outbox, the DATA window, one the consumer took. Past that, dispatching stalls.
        depth = 2 * self._frames_in_flight() + 5
        inputs = [
            RankInput(channel.rank, epoch.wire, channel.send_input, options.batch_max_items,
                      options.batch_max_bytes, keep_history, cond, depth * options.batch_max_items,
                      depth * options.batch_max_bytes, channel.heard_since)
            for channel in self.channels
        ]  # fmt: skip
        self.dispatch = Dispatch(
            self.dispatching, inputs, self._dispatch_failed(epoch.wire), self.config.item_timeout, epoch.user_number
        )
        for channel in self.channels:
            channel.input_sink = self.dispatch.input_sink(channel.rank)
        return self.dispatch

    def _new_unit_dispatch(self, wire: int, seed: int) -> UnitDispatch:
        """Stop the last epoch's dispatching and set up this one's for a policy that leases the
        dispatched items itself (its merger does; the thread starts with the epoch). A resumed
        epoch pulls from the first item again: the same item for each unit."""
        self._supersede_dispatch(seed)
        options = self.fleet.session_options()

        def notify() -> None:
            channels = self.channels
            if channels:
                self.events.put(UnitsDispatched(channels[0], wire))

        self.dispatch = UnitDispatch(
            self.dispatching, wire, self._dispatch_failed(wire), notify, self._frames_in_flight(),
            options.batch_max_items, options.batch_max_bytes, self.config.item_timeout,
            self.epoch_number - 1,  # the Epoch's user_number (made after this)
        )  # fmt: skip
        for channel in self.channels:
            channel.input_sink = self.dispatch.credit_sink(channel)
        return self.dispatch

    def _supersede_dispatch(self, seed: int) -> None:
        """Stop the last epoch's dispatching and seed the dispatching part for the next one: a copy
        of it if the last thread is stuck in it (a graph supports one iterator at a time)."""
        if self._stop_dispatch("a new epoch dispatches from a copy of the dispatching part"):
            try:
                with graph_traversal():
                    self.dispatching = copy.deepcopy(self.dispatching)
            except Exception as exc:  # noqa: BLE001 - any reason a user's DataPipe gives
                raise DispatchStalledError(
                    f"the dispatching part is stuck in the thread of an earlier epoch (stack in the log) and cannot "
                    f"be copied to dispatch a new epoch ({exc!r}); fix what blocks it there, or pass item_timeout "
                    "to hear of it when it happens"
                ) from exc
        reset_dispatching_graph(self.dispatching, seed)

    def _stop_dispatch(self, then: str) -> bool:
        """Stop the current dispatching; True if its thread did not end within ``ABANDON_AFTER`` (or
        timed out already): it is left behind, its stack logged, and ``then`` says what follows."""
        dispatch = self.dispatch
        if dispatch is None:
            return False
        dispatch.stop()
        if dispatch.join(0 if dispatch.timed_out is not None else ABANDON_AFTER) or not dispatch.dispatcher_alive:
            return False
        log.warning(
            "the dispatcher thread of epoch %d is stuck in the dispatching part and is left behind; %s. "
            "It is here:\n%s", dispatch.number, then, dispatch.stack(),
        )  # fmt: skip
        return True

    def _dispatch_failed(self, wire: int) -> Callable[[BaseException], None]:
        """Report an exception of dispatching to the consumer at once, with MPRS's words."""

        def report(exc: BaseException) -> None:
            error = _in_mprs_words(exc)
            for channel in list(self.channels):  # whichever worker the consumer waits for
                channel.queue.put(EpochFailed(channel, wire, error))

        return report

    def dispatch_failure(self, wire: int) -> Optional[BaseException]:
        """The exception that ended the dispatching part of epoch ``wire`` (in MPRS's words), if one did:
        the epoch raises it after the items dealt before it."""
        dispatch = self.dispatch
        if dispatch is None or dispatch.epoch != wire or dispatch.failure is None:
            return None
        return _in_mprs_words(dispatch.failure)

    def reopen_channel(self, lost: WorkerChannel, error: WorkerLostError, epoch: Epoch) -> WorkerChannel:
        """A new session in place of ``lost``, started on ``epoch`` (its rank's input dealt again)."""
        rank = lost.rank
        channel = self.fleet.reopen(rank, lost, self.channels, error)
        self.replace_dispatched(channel)
        channel.start_receiver(self.receiver_queue())
        self.start_channel(channel, epoch)
        self.channels[rank] = channel
        return channel

    def replace_dispatched(self, channel: WorkerChannel) -> None:
        """A replacement session took over ``channel.rank``: it gets the rank's input of this
        epoch again (before its epoch starts: its events go to the dispatcher)."""
        dispatch = self.dispatch
        if isinstance(dispatch, UnitDispatch):  # its merger leases the lost units again
            channel.input_sink = dispatch.credit_sink(channel)
        elif dispatch is not None:
            dispatch.inputs[channel.rank].restart(channel.send_input, channel.heard_since)
            channel.input_sink = dispatch.input_sink(channel.rank)

    def stats(self) -> ReadingServiceStats:
        """Throughput per worker and the consumer's data stall for the current (or last) epoch."""
        if self.epoch is None:
            return ReadingServiceStats(0, 0.0, 0, 0.0, 0.0, 0.0)
        return self._stats_of(self.epoch)

    def _stats_of(self, epoch: Epoch) -> ReadingServiceStats:
        """:meth:`stats` of ``epoch``, run by the run's sessions (taken before any changes them)."""
        progress = epoch.progress
        elapsed = max(progress.elapsed, 1e-9)
        units = epoch.units() or {}
        consumed = progress.handed_on()
        workers = [
            WorkerStats(
                rank=channel.rank,
                address=channel.address,
                items_consumed=consumed[channel.rank],
                items_received=channel.stats.items,
                bytes_received=channel.stats.bytes,
                frames_received=channel.frames_received,
                items_per_second=consumed[channel.rank] / elapsed,
                queue_depth=channel.queue.qsize() if not self.config.distribution.shared_queue else 0,
                wait_seconds=channel.stats.wait_seconds,
                pid=channel.info.get("pid"),
                units=units.get(channel.rank),
            )
            for channel in self.channels
            if channel.rank not in progress.left
        ]
        items = sum(consumed)
        return ReadingServiceStats(
            epoch=epoch.user_number,
            elapsed_seconds=elapsed,
            items=items,
            items_per_second=items / elapsed,
            wait_seconds=progress.wait_seconds,
            data_stall=min(1.0, progress.wait_seconds / elapsed),
            workers=workers,
            reassignments=epoch.reassignments,
            drains=epoch.drains,
            joins=epoch.joins,
            **self._scale_stats(),
        )

    def _scale_stats(self) -> Dict[str, Any]:
        """The autoscaler's part of :meth:`stats` (nothing without one)."""
        scaler = self.autoscaler
        if scaler is None:
            return {}
        return dict(scale_ups=scaler.ups, scale_downs=scaler.downs, scale_decisions=list(scaler.decisions),
                    wanted_servers=scaler.wanted_servers)  # fmt: skip

    @property
    def worker_addresses(self) -> List[str]:
        """Addresses of the connected worker sessions, by rank."""
        return [channel.address for channel in self.channels]

    def close(self) -> None:
        """Close every session and stop local workers; idempotent, bounded in time."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _open_engines.pop(self, None)
        self.fleet.stop_watching()
        if self.dispatch is not None:
            self.dispatch.stop()  # nothing more is sent; joined once the channels closed (a stuck send ends)
        with self._lock:  # a join still setting up closes its sessions itself (it sees the run closed)
            joined, self._joined_channels = self._joined_channels, []
        if joined:
            close_channels(joined)
        channels, self.channels = self.channels, []
        if channels:
            close_channels(channels)
        self._stop_dispatch("shutdown goes on (a daemon thread, it ends with the process)")
        self.fleet.close()
        for events in {id(q): q for q in [self.events, *(channel.queue for channel in channels)]}.values():
            drop_items(events)
