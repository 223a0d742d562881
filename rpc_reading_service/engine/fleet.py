"""Where the workers of a run come from, and connecting to them.

A :class:`Fleet` resolves the configured :class:`~rpc_reading_service.config.WorkerSource`
(a local server it starts, known addresses, a TCPStore or a hostfile), creates the transport
and opens one set-up :class:`~rpc_reading_service.client.WorkerChannel` per worker rank. It
also opens the replacement session of a lost worker and closes everything, in bounded time.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
import queue
from typing import Any, Callable, List, Optional, Sequence

from ..client import Event, WorkerChannel
from ..config import Hostfile, LocalWorkers, ReadingServiceConfig, StoreDiscovery, WorkerAddresses
from ..discovery import discover_workers
from ..errors import WorkerLostError
from ..keys import new_auth_key
from ..local_fleet import LocalWorkerServer
from ..receive_loop import ReceiveLoop
from ..serialization import buffer_allocator
from ..transports import create_transport
from ..transports.base import PeerLostError, Transport
from ..protocol import SessionOptions, Setup

__all__ = ["Fleet", "close_channels"]

log = logging.getLogger(__name__)

#: Sessions set up at once. Setting up is mostly waiting (a handshake's round trips, a server
#: forking the session, the worker unpickling the graph): 64 sessions in one wave rather
#: than two; the bound keeps hundreds of sessions from starting hundreds of threads.
MAX_PARALLEL_SETUPS = 64

#: Makes the queue a new channel delivers its events to.
Sink = Callable[[], "queue.SimpleQueue[Event]"]


def close_channels(channels: Sequence[WorkerChannel]) -> None:
    """Close every channel, in parallel; one by one at interpreter exit, when
    ``concurrent.futures`` no longer schedules work ("cannot schedule new futures")."""
    try:
        with ThreadPoolExecutor(max_workers=min(32, len(channels))) as pool:
            list(pool.map(lambda channel: channel.close(), channels))
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

    def discover(self) -> int:
        """Find the workers of a :class:`StoreDiscovery` or :class:`Hostfile` (once) and return
        the number of worker sessions."""
        workers = self.config.workers
        if self._discovered is not None or not isinstance(workers, (StoreDiscovery, Hostfile)):
            return self.num_workers
        if isinstance(workers, StoreDiscovery):
            self._discovered, self._hosted_store = discover_workers(
                store=workers.store, job=workers.job, min_workers=workers.min_workers,
                host_store=workers.host_store, timeout=workers.timeout,
            )  # fmt: skip
        else:
            self._discovered, _ = discover_workers(
                hostfile=workers.path, min_workers=workers.min_workers, timeout=workers.timeout
            )
        if self.num_workers == 0:
            self.num_workers = len(self._discovered)
        return self.num_workers

    def rank_addresses(self) -> List[str]:
        """The server address of every worker rank (sessions of one server share it), resolved
        once: a local fleet's server starts here. The sticky distribution hashes keys over them."""
        if self._rank_addresses is None:
            self._rank_addresses = self._addresses()
        return self._rank_addresses

    def _addresses(self) -> List[str]:
        workers = self.config.workers
        if isinstance(workers, LocalWorkers):
            self.auth_key = self.auth_key or new_auth_key()
            self.local_server = LocalWorkerServer(
                self.auth_key, self.config.transport.name, start_method=workers.start_method,
                cache_dir=workers.cache_dir, cache_size=int(workers.cache_size),
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
        )

    def connect(self, graph: bytes, sink: Optional[Sink] = None) -> List[WorkerChannel]:
        """Start local workers if configured, then open and set up one channel per worker rank
        (in parallel); on any failure close those that opened and raise the first error.

        ``sink``: where each channel delivers its events; a channel starts receiving (and
        sending heartbeats) as soon as it is set up, so that the first sessions of hundreds
        do not time out waiting for the last ones.

        Returns only once every session is set up, and the engine starts the first epoch on
        all of them together: streaming from the first sessions while later ones still set
        up would bring the first item forward by the setup spread (~0.5 s for 64 sessions of
        one server, which forks them one by one), but those sessions would then finish their
        shards first and the epoch would end on the late ones alone: every rank's share is
        fixed by the distribution, so a head start is idle time at the end, and the epoch's
        efficiency drops by the spread. Cutting the setup cost is what brings the first item
        forward (a server warms up and freezes its heap before forking sessions)."""
        self._transport = create_transport(
            self.config.transport.name, **self.config.transport.factory_options()
        )
        self._graph = graph
        addresses = self.rank_addresses()
        self._loop = self._loop or ReceiveLoop()  # after a local server forked: not its descriptors
        channels: List[WorkerChannel] = []
        errors: List[BaseException] = []
        parallel = min(MAX_PARALLEL_SETUPS, self.num_workers)
        with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="rrs-setup") as pool:
            futures = [
                pool.submit(self.open_channel, rank, addresses[rank], sink)
                for rank in range(self.num_workers)
            ]
            for future in futures:
                try:
                    channels.append(future.result())
                except BaseException as exc:  # noqa: BLE001 - close every channel, raise the first error
                    errors.append(exc)
        if errors:
            if channels:
                close_channels(channels)
            raise errors[0]
        return channels

    def open_channel(self, rank: int, address: str, sink: Optional[Sink] = None) -> WorkerChannel:
        """Connect to ``address`` and set up the session of worker ``rank``; with ``sink``,
        start receiving into the queue it returns."""
        assert self._transport is not None, "connect() must run first"
        options, timeout = self.session_options(), self.config.liveness.connect_timeout
        try:
            conn = self._transport.connect(
                address, self.auth_key or b"", timeout, allocate=buffer_allocator(self.config.pin_memory)
            )
        except PeerLostError as exc:
            raise WorkerLostError(f"worker {rank}: {exc}", rank, address) from exc
        channel = WorkerChannel(conn, rank, options.heartbeat_interval, options.peer_timeout, self._loop)
        try:
            channel.setup(Setup(self._graph, rank, self.num_workers, options), timeout)
        except BaseException:
            channel.close()
            raise
        if sink is not None:
            channel.start_receiver(sink())
        return channel

    def reopen(
        self, rank: int, lost: WorkerChannel, others: Sequence[WorkerChannel], error: WorkerLostError
    ) -> WorkerChannel:
        """A new session for worker ``rank``, whose channel ``lost`` was lost with ``error``.

        Tries the lost worker's server first (only its session may have died), then the
        other servers; local workers get a new local server if theirs is gone.
        """
        lost.close(timeout=0.5)
        candidates = list(dict.fromkeys([lost.address, *(ch.address for ch in others if ch is not lost)]))
        if self.local_server is not None:
            if not self.local_server.alive():
                self.local_server.stop()
                self.local_server.start()
            assert self.local_server.address is not None
            candidates = [self.local_server.address]
        failures = []
        for address in candidates:
            try:
                return self.open_channel(rank, address)
            except (WorkerLostError, OSError) as exc:
                failures.append(f"{address}: {exc}")
        raise WorkerLostError(
            f"{error}; no server could take over its shard: {'; '.join(failures)}", rank, lost.address
        ) from error

    def close(self) -> None:
        """Stop the receive loop (after the channels closed), local workers and a TCPStore this
        process hosted (idempotent)."""
        if self._loop is not None:
            self._loop.close()
        if self.local_server is not None:
            self.local_server.stop()
            self.local_server = None
        self._hosted_store = None  # stops a TCPStore this trainer hosted (StoreDiscovery(host_store=True))
