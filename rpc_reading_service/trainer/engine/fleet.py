"""Where the workers of a run come from, and connecting to them.

A :class:`Fleet` resolves the configured :class:`~rpc_reading_service.trainer.config.WorkerSource`
(a local server it starts, known addresses, a TCPStore or a hostfile), creates the transport
and opens one :class:`~rpc_reading_service.trainer.channel.WorkerChannel` per worker rank, each setting
up in the background. It also opens the replacement session of a lost worker and closes
everything, in bounded time.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from ...addresses import distinct_servers, server_key
from ..channel import Event, WorkerChannel
from ..config import Hostfile, LocalWorkers, ReadingServiceConfig, StoreDiscovery, WorkerAddresses
from ...discovery import discover_workers
from ...errors import WorkerDrainedError, WorkerLostError
from ...keys import new_auth_key
from ..local_fleet import LocalWorkerServer
from ..receive_loop import ReceiveLoop
from .watch import DiscoveryWatch
from ...serialization import buffer_allocator
from ...tasks import TaskGroup
from ...transports import create_transport
from ...transports.base import PeerLostError, Transport
from ...protocol import DEFAULT_MAX_FRAME_BYTES, SessionOptions, Setup

__all__ = ["Fleet", "close_channels"]

log = logging.getLogger(__name__)

#: Sessions set up at once. Setting up is mostly waiting (a handshake's round trips, a server
#: forking the session, the worker unpickling the graph): 64 sessions in one wave rather
#: than two; the bound keeps hundreds of sessions from starting hundreds of threads.
MAX_PARALLEL_SETUPS = 64

#: Seconds closing waits for the setups still in progress to end (a connect in its handshake
#: ends only when the handshake does).
SETUP_CLOSE_WAIT = 2.0

#: Makes the queue a new channel delivers its events to.
Sink = Callable[[], "queue.SimpleQueue[Event]"]


def close_channels(channels: Sequence[WorkerChannel]) -> None:
    """Close every channel, in parallel (threads joined before this returns); one by one where no
    thread can start (at interpreter exit)."""
    try:
        TaskGroup("closing the run's sessions").map("close", lambda channel: channel.close(), channels, width=32)
    except RuntimeError:
        for channel in channels:
            channel.close()  # idempotent: the ones closed above return at once


class Fleet:
    """The worker servers of one run and the transport to reach them."""

    def __init__(self, config: ReadingServiceConfig):
        self.config = config
        #: Worker sessions of the run; known after :meth:`discover` (0 until then with discovery).
        self.num_workers = config.sessions()
        self.auth_key = config.auth_key
        self.local_server: Optional[LocalWorkerServer] = None
        self._discovered: Optional[List[str]] = None
        self._hosted_store: Any = None
        self._transport: Optional[Transport] = None
        #: The one thread receiving for every session of the run (made by :meth:`connect`).
        self._loop: Optional[ReceiveLoop] = None
        self._rank_addresses: Optional[List[str]] = None
        #: Sessions a server that joins the run gets (:meth:`sessions_per_server`), and server
        #: addresses resolved to what identifies them (``localhost:P`` is ``127.0.0.1:P``).
        self._per_server: Optional[int] = None
        self._server_keys: Dict[str, Tuple[str, int]] = {}
        #: The thread watching a store or hostfile for servers that join (:meth:`watch`).
        self._watch: Optional[DiscoveryWatch] = None
        #: The threads of the setups of :meth:`connect` (and the one starting them); :meth:`close` stops them.
        self._setups = TaskGroup("the setups of the run's sessions")
        #: The servers that drained during the run or left its store or hostfile, by :func:`server_key`.
        self._drained: Set[Tuple[str, int]] = set()

    def discover(self) -> int:
        """Find the workers of a :class:`StoreDiscovery` or :class:`Hostfile` (once) and return
        the number of worker sessions."""
        workers = self.config.workers
        if self._discovered is not None or not isinstance(workers, (StoreDiscovery, Hostfile)):
            return self.num_workers
        if isinstance(workers, StoreDiscovery):
            self._discovered, self._hosted_store = discover_workers(
                store=workers.store, job=workers.job, min_workers=workers.min_workers,
                host_store=workers.host_store, timeout=workers.timeout, probe=self.transport().probe,
            )  # fmt: skip
        else:
            self._discovered, _ = discover_workers(
                hostfile=workers.path, min_workers=workers.min_workers, timeout=workers.timeout
            )
        if self.num_workers == 0:
            self.num_workers = len(self._discovered)
        return self.num_workers

    def transport(self) -> Transport:
        """The run's transport, made on first use."""
        if self._transport is None:
            self._transport = create_transport(self.config.transport.name, **self.config.transport.factory_options())
        return self._transport

    def rank_addresses(self) -> List[str]:
        """The server address of every worker rank (sessions of one server share it), resolved
        once: a local fleet's server starts here. The sticky distribution hashes keys over them."""
        if self._rank_addresses is None:
            self._rank_addresses = self._addresses()
        return self._rank_addresses

    def sessions_per_server(self) -> int:
        """Sessions a server that joins gets: as many as the first server got when the run began
        (``num_workers`` spread over the servers found, rank by rank: the larger share)."""
        if self._per_server is None:
            addresses = self.rank_addresses()
            self._per_server = -(-len(addresses) // max(1, len(distinct_servers(addresses, self._server_keys))))
        return self._per_server

    def unknown_servers(self, addresses: Sequence[str], known: Sequence[str]) -> List[str]:
        """The servers of ``addresses`` (one spelling each) that are not among ``known``."""
        taken = {self._key(address) for address in known}
        return [address for address in distinct_servers(addresses, self._server_keys) if self._key(address) not in taken]

    def _key(self, address: str) -> Tuple[str, int]:
        if address not in self._server_keys:
            self._server_keys[address] = server_key(address)
        return self._server_keys[address]

    def mark_drained(self, addresses: Iterable[str]) -> None:
        """The servers at ``addresses`` drained or left: no new session goes to them (any spelling)."""
        keys = [self._key(address) for address in addresses]  # resolved before the set changes
        self._drained.update(keys)

    def serves_again(self, addresses: Iterable[str]) -> None:
        """The servers at ``addresses`` came back (listed again, or joined): they take sessions again."""
        keys = [self._key(address) for address in addresses]
        self._drained.difference_update(keys)

    def is_drained(self, address: str) -> bool:
        """Whether the server at ``address`` (any spelling of it) drained or left the run."""
        return self._key(address) in self._drained

    def add_rank(self, address: str) -> int:
        """One more worker rank, on the server at ``address``; returns the number of sessions."""
        self.rank_addresses().append(address)
        self.serves_again([address])  # a server that drained and came back serves again
        self.num_workers += 1
        return self.num_workers

    def servers(self) -> List[str]:
        """Every server the run knows and that did not drain: those it was given or found, and
        those serving a rank now (one spelling each)."""
        workers = self.config.workers
        given = list(workers.addresses) if isinstance(workers, WorkerAddresses) else list(self._discovered or ())
        known = distinct_servers([*given, *self.rank_addresses()], self._server_keys)
        return [address for address in known if not self.is_drained(address)]

    def resize(self, ranks: Sequence[str]) -> None:
        """The run's worker ranks from now on: ``ranks``, the server of each (autoscaling)."""
        self._rank_addresses = list(ranks)
        self.num_workers = len(ranks)

    def regroup(self, current: Sequence[str], joined: Sequence[Tuple[str, int]]) -> None:
        """The ranks before an epoch over a grown fleet: ``current`` (the server of each rank now:
        reassignment moves ranks), then ``(address, sessions)`` of each server that joined. A rank
        whose server no longer answers (it drained, or died, after its shard ended) moves to one
        that does."""
        answers = {address: self.transport().probe(address) for address in set(current)}
        addresses = [address for address, sessions in joined for _session in range(sessions)]
        spare = [address for address in current if answers[address] is None] + addresses
        ranks = list(current)
        for rank, address in enumerate(current):
            if answers[address] is not None and spare:
                ranks[rank] = spare[rank % len(spare)]
                log.warning("worker %d (%s) does not answer (%s): it moves to %s", rank, address, answers[address], ranks[rank])
        self._rank_addresses = ranks
        self.num_workers = len(ranks)
        for address in addresses:
            self.add_rank(address)

    def retirees(self, current: Sequence[str], leaving: Iterable[int]) -> List[int]:
        """Of the ranks ``leaving`` (their server drained or went away) and those whose session is on
        a drained server, the ones to retire before an epoch; ``current``: the server of each rank's
        session now. A session that took over such a rank stays as a rank of its server if that
        server keeps no other rank (a server of the run that had none); none is retired if that
        would leave no rank (the epoch then replaces or raises)."""
        gone = set(self._drained)  # a copy: the watch's thread adds to it
        leaving = {*leaving, *(rank for rank, address in enumerate(current) if self._key(address) in gone)}
        keeping = {self._key(address) for rank, address in enumerate(current) if rank not in leaving}
        retired = []
        for rank in sorted(leaving):
            address = current[rank]
            if self._key(address) in gone or self._key(address) in keeping:
                retired.append(rank)
            else:
                keeping.add(self._key(address))
        return retired if len(retired) < len(current) else []

    def watch(self, found: Callable[[List[str]], List[str]]) -> None:
        """Watch the run's store or hostfile for servers that register later, calling ``found``
        with new addresses (it returns those it could not add: they are tried again), and for
        servers that leave it (:meth:`unlisted`); a run of known addresses or local workers has nothing to watch."""
        workers = self.config.workers
        if self._watch is None and isinstance(workers, (StoreDiscovery, Hostfile)) and workers.poll_interval is not None:
            self._watch = DiscoveryWatch(workers, found, self._hosted_store, self._discovered or (), self.unlisted)
            self._watch.start()

    def unlisted(self, addresses: Sequence[str]) -> None:
        """The servers at ``addresses`` left the store or hostfile: taken as drained (no new session
        goes to them; their ranks are retired before the next epoch, :meth:`retirees`)."""
        where = self._watch.where() if self._watch is not None else "the discovery"
        log.info("worker server %s left %s: taken as drained, its sessions end before the next epoch",
                 ", ".join(addresses), where)  # fmt: skip
        self.mark_drained(addresses)

    def _addresses(self) -> List[str]:
        workers = self.config.workers
        if isinstance(workers, LocalWorkers):
            self.auth_key = self.auth_key or new_auth_key()
            self.local_server = LocalWorkerServer(
                self.auth_key, self.config.transport.name, start_method=workers.start_method,
                cache_dir=workers.cache_dir, cache_size=int(workers.cache_size),
                watch_locks=self.config.item_timeout is not None,
            )  # fmt: skip
            addresses = [self.local_server.start()]
        elif isinstance(workers, WorkerAddresses):
            addresses = list(workers.addresses)
        else:
            assert self._discovered is not None, "discover() must run first"
            addresses = self._discovered
        return [addresses[rank % len(addresses)] for rank in range(self.num_workers)]

    def session_options(self) -> SessionOptions:
        """The tunables every worker session gets in SETUP."""
        return SessionOptions(
            heartbeat_interval=self.config.liveness.heartbeat_interval,
            peer_timeout=self.config.timeout,
            item_timeout=self.config.item_timeout,
        ).within(self.config.transport.max_frame_bytes or DEFAULT_MAX_FRAME_BYTES)

    def connect(self, graph: bytes, sink: Sink) -> List[WorkerChannel]:
        """Start local workers if configured and return one channel per worker rank at once,
        each connecting and setting up in the background (:data:`MAX_PARALLEL_SETUPS` at a time).

        ``sink``: makes the queue each channel delivers its events to. A channel starts
        receiving (and sending heartbeats) as soon as it is set up, and what is sent to it
        before (the epoch's START_EPOCH) goes out then: each session starts its epoch once
        its own setup is done, instead of all of them after the slowest of all setups (the
        first item of round-robin needs rank 0's setup only; the epoch ends no later than
        before). A failed setup is reported in the channel's queue as the session lost with
        its error: the consumer raises it, or reassigns the rank, when it comes to that worker."""
        self.transport()
        self._graph = graph
        addresses = self.rank_addresses()
        self._loop = self._loop or ReceiveLoop()  # after a local server forked: not its descriptors
        channels = [self._new_channel(rank, address) for rank, address in enumerate(addresses)]
        for channel in channels:
            channel.queue = sink()
        # Starting the setup threads takes a few ms each while the first ones already run (each
        # start waits for the GIL): a thread of its own starts them, and the caller goes on to
        # start the epoch meanwhile.
        self._setups.start("setup-start", self._setups.start_each, "setup", self._set_up_in_background, channels, MAX_PARALLEL_SETUPS)
        return channels

    def wait_set_up(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the setups :meth:`connect` started to end (each
        succeeded, or reported its failure in its channel's queue)."""
        deadline = time.monotonic() + timeout
        self._setups.join(timeout, report=False)  # the thread starting them: then every setup thread is there
        self._setups.join(max(0.0, deadline - time.monotonic()), report=False)

    def open_channel(
        self, rank: int, address: str, num_workers: Optional[int] = None, graph: Optional[bytes] = None
    ) -> WorkerChannel:
        """Connect to ``address`` and set up the session of worker ``rank`` of ``num_workers``
        with ``graph`` (default: the run's), waiting for it; on a failure close it and raise the error."""
        channel = self._new_channel(rank, address)
        try:
            self._set_up(channel, num_workers, graph)
        except BaseException:
            channel.close()
            raise
        return channel

    def _new_channel(self, rank: int, address: str) -> WorkerChannel:
        """The channel of worker ``rank`` at ``address``, before it connects."""
        options = self.session_options()
        channel = WorkerChannel(None, rank, options.heartbeat_interval, options.peer_timeout, self._loop, address=address)
        if options.item_timeout is not None:
            channel.closed_hint = (
                " (with item_timeout, a session whose graph holds the interpreter lock in C code for longer ends its "
                "process: the worker server's log shows where)"
            )
        return channel

    def _set_up(self, channel: WorkerChannel, num_workers: Optional[int] = None, graph: Optional[bytes] = None) -> None:
        """Connect ``channel`` to its worker and set up its session there (as one of ``num_workers``,
        with the pickled ``graph``; default: the run's)."""
        assert self._transport is not None, "connect() must run first"
        rank, address, timeout = channel.rank, channel.address, self.config.liveness.connect_timeout
        try:
            conn = self._transport.connect(
                address, self.auth_key or b"", timeout, allocate=buffer_allocator(self.config.pin_memory)
            )
        except PeerLostError as exc:
            raise WorkerLostError(f"worker {rank}: {exc}", rank, address) from exc
        channel.attach(conn)
        workers = self.num_workers if num_workers is None else num_workers
        shipped = self._graph if graph is None else graph
        channel.setup(Setup(shipped, rank, workers, self.session_options()), timeout)

    def _set_up_in_background(self, channel: WorkerChannel) -> None:
        """:meth:`_set_up` in a setup thread, then receive; a failure goes to the channel's queue."""
        try:
            self._set_up(channel)
            channel.start_receiver(channel.queue)
        except BaseException as exc:  # noqa: BLE001 - the consumer raises it, from the channel's queue
            channel.fail_setup(exc)

    def reopen(
        self, rank: int, lost: WorkerChannel, others: Sequence[WorkerChannel], error: WorkerLostError
    ) -> WorkerChannel:
        """A new session for worker ``rank``, whose channel ``lost`` was lost with ``error``.

        Tries the lost worker's server first (only its session may have died), then the
        other servers, each only if it answers a probe within seconds (a hung or stopped
        server costs no ``connect_timeout``); local workers get a new local server if theirs
        is gone.
        """
        lost.close(timeout=0.5)
        candidates = distinct_servers([lost.address, *(ch.address for ch in others if ch is not lost)])
        probe: Optional[Callable[[str], Optional[str]]] = self.transport().probe
        if self.local_server is not None:
            if not self.local_server.alive():
                self.local_server.stop()
                self.local_server.start()
            assert self.local_server.address is not None
            candidates, probe = [self.local_server.address], None  # it was just checked, or started
        failures = []
        for address in candidates:
            if self.is_drained(address) and probe is not None:
                failures.append(f"{address}: it drained (or left the run's store or hostfile)")
                continue
            reason = None if probe is None else probe(address)
            if reason is not None:
                failures.append(f"{address}: {reason}")
                continue
            try:
                return self.open_channel(rank, address)
            except (WorkerLostError, OSError) as exc:
                failures.append(f"{address}: {exc}")
        if isinstance(error, WorkerDrainedError):
            gone = [address for address in candidates if not self.is_drained(address)]
            every = "every worker server of this run has drained" if not gone else "no other server could take it"
            raise WorkerDrainedError(
                f"{error}; {every}, so its work cannot go on: {'; '.join(failures)}. Start more worker servers "
                "(or pass their addresses) for a run to outlive its servers", rank, lost.address,
            ) from error
        raise WorkerLostError(
            f"{error}; no server could take over its shard: {'; '.join(failures)}", rank, lost.address
        ) from error

    def stop_watching(self) -> None:
        """Stop watching the store or hostfile (idempotent; waits boundedly for the thread)."""
        if self._watch is not None:
            self._watch.stop(SETUP_CLOSE_WAIT)

    def close(self) -> None:
        """Stop the receive loop (after the channels closed), local workers and a TCPStore this
        process hosted, and wait (boundedly) for setups still in progress to end (idempotent)."""
        self._setups.stopping.set()  # the setups not started never run
        self.stop_watching()
        if self._loop is not None:
            self._loop.close()
        if self.local_server is not None:
            self.local_server.stop()
            self.local_server = None
        # A closed channel ends its setup: at once while it waits for READY (its connection is
        # shut), after the handshake while it connects (attach() refuses it).
        self._setups.join(SETUP_CLOSE_WAIT)
        self._hosted_store = None  # stops a TCPStore this trainer hosted (StoreDiscovery(host_store=True))
