"""``RPCReadingService``: the DataLoader2 face of rpc_reading_service."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import queue
import threading
import types
import weakref
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Sequence, Tuple, Union

import cloudpickle
from torchdata.dataloader2.graph import DataPipe, list_dps, set_graph_random_seed, traverse_dps
from torchdata.dataloader2.random import SeedGenerator, dist_share_seed
from torchdata.dataloader2.reading_service import CheckpointableReadingServiceInterface
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterDataPipe

from .addresses import parse_address
from .discovery import check_discovery_options, discover_workers
from .checkpoint import ReadingServiceState, graph_fingerprint, load_seed_generator_state, seed_generator_state
from .client import EpochProgress, Event, WorkerChannel, iterate_as_completed, iterate_in_order
from .errors import ConfigurationError, WorkerLostError
from .graph import (
    DistributedInfo,
    advance_trainer_rng,
    apply_distributed_sharding,
    distributed_info,
    draw_epoch_seed,
    init_worker_graph,
    reset_worker_graph,
    split_replicable,
)
from .keys import new_auth_key
from .cache.config import parse_size
from .local_fleet import DEFAULT_LOCAL_CACHE_BYTES, LocalWorkerServer
from .serialization import buffer_allocator, dumps_graph
from .settings import check_settings
from .stats import ReadingServiceStats, WorkerStats
from .transports import available_transports, create_transport
from .transports.base import PeerLostError
from .protocol import SessionOptions

__all__ = ["RPCReadingService"]

log = logging.getLogger(__name__)

InitFn = Callable[[DataPipe, WorkerInfo], DataPipe]
ResetFn = Callable[[DataPipe, WorkerInfo, SeedGenerator], DataPipe]


class _RemoteStream(IterDataPipe):
    """The trainer-side stand-in for the graph that runs on the workers."""

    def __init__(self, service: "RPCReadingService"):
        self._service = service

    def __iter__(self) -> Iterator[Any]:
        return self._service._iterate_epoch()

    def __getstate__(self) -> Dict[str, Any]:
        # torchdata traverses graphs by pickling them; the service (sockets, threads) stays out.
        return {}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self._service = None  # a detached copy: iterating it is an error


class _DeliveryCounter(IterDataPipe):
    """The end of a trainer's graph that keeps DataPipes after the stream (fullsync, pin_memory).

    Those may hold items taken from the workers but not yet given to the training loop
    (fullsync prefetches one), and may end the epoch early (fullsync stops at the shortest
    rank): counting here lets a checkpoint record what the training loop really received.
    """

    def __init__(self, datapipe: DataPipe, service: "RPCReadingService"):
        self.datapipe = datapipe
        self._service = service

    def __iter__(self) -> Iterator[Any]:
        progress = self._service._progress
        assert progress is not None, "initialize_iteration() must run first"
        progress.delivered = 0
        for item in self.datapipe:
            progress.delivered += 1
            yield item
        progress.delivered_all = True

    def __getstate__(self) -> Dict[str, Any]:
        return {"datapipe": self.datapipe}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.datapipe, self._service = state["datapipe"], None


def _shutdown_trainer_side(dp: DataPipe, timeout: float = 10.0) -> None:
    """Stop the threads of a DataPipe kept in the trainer (fullsync's prefetcher) from ``finalize``.

    Left to the garbage collector, ``FullSync.__del__`` joins its thread at an arbitrary
    moment (FullSync and its executor form a reference cycle), which can deadlock a thread
    start. FullSync's pending prefetch ends in an ``all_reduce`` that the other ranks' pending
    prefetches pair with: let it finish instead of cancelling it on this rank only.
    """
    pending = list(getattr(getattr(dp, "_executor", None), "_futures", None) or ())
    if pending and wait_futures(pending, timeout=timeout).not_done:
        log.warning(
            "trainer-side %s still waits for other ranks after %.0f s; not stopping it", type(dp).__name__, timeout
        )
        return
    try:
        dp.shutdown()
    except Exception:  # noqa: BLE001 - finalize must go on
        log.warning("shutting down trainer-side %s failed", type(dp).__name__, exc_info=True)


class _OneIterationAtATime:
    """Refuses a second thread that starts or steps an iteration while one thread is in one.

    DataLoader2 serves one iterator at a time but does not lock: two threads iterating one
    DataLoader2 would share the workers' streams (one thread receiving both threads' items,
    the other waiting forever). Holding this guard while setting up an epoch and while taking
    each item makes the second thread fail at once instead. Sequential use from any number
    of threads (a new epoch after an abandoned one, an iterator handed to another thread) is
    not affected: the guard is only held inside those calls.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()  # reentrant: restore() calls initialize()
        self.depth = 0  # only the holding thread touches it
        self.holder: Optional[int] = None  # its threading.get_ident()
        self.doing = ""

    def acquire(self, doing: str) -> None:
        """Take the guard for ``doing`` (e.g. ``"starting an epoch"``) or :meth:`refuse`."""
        if not self.lock.acquire(blocking=False):
            self.refuse(doing)
        self.depth += 1
        if self.depth == 1:
            self.holder, self.doing = threading.get_ident(), doing

    def release(self) -> None:
        """Give the guard back (the outermost release of a thread frees it)."""
        self.depth -= 1
        if self.depth == 0:
            self.holder = None
        self.lock.release()

    def refuse(self, doing: str) -> NoReturn:
        """Raise the ``RuntimeError`` that names both threads and what they are doing."""
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        raise RuntimeError(
            f"two threads use one DataLoader2 at once: thread {threading.current_thread().name!r} is {doing} "
            f"while thread {names.get(self.holder, '?')!r} is {self.doing}. A DataLoader2 serves one "
            "iteration at a time: give each thread its own DataLoader2, or share one iterator behind a lock"
        )

    @contextlib.contextmanager
    def held(self, doing: str) -> Iterator[None]:
        """Hold the guard for the ``with`` block."""
        self.acquire(doing)
        try:
            yield
        finally:
            self.release()


def _exclusive(doing: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a method of RPCReadingService holding its :class:`_OneIterationAtATime` guard."""

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def exclusive(self: "RPCReadingService", *args: Any, **kwargs: Any) -> Any:
            with self._guard.held(doing):
                return method(self, *args, **kwargs)

        return exclusive

    return decorate


def _close_channels(channels: Sequence[WorkerChannel]) -> None:
    """Close every channel, in parallel; one by one at interpreter exit, when
    ``concurrent.futures`` no longer schedules work ("cannot schedule new futures")."""
    try:
        with ThreadPoolExecutor(max_workers=min(32, len(channels))) as pool:
            list(pool.map(lambda channel: channel.close(), channels))
    except RuntimeError:
        for channel in channels:
            channel.close()  # idempotent: the ones closed above return at once


#: Reading services with workers that have not been finalized, and the process that owns them.
_unfinalized: "weakref.WeakKeyDictionary[RPCReadingService, int]" = weakref.WeakKeyDictionary()


@atexit.register
def _finalize_at_exit() -> None:
    """Stop the workers of every reading service still running when the interpreter exits.

    DataLoader2 finalizes its reading service in ``shutdown()`` or ``__del__``; a script that
    never calls ``shutdown()`` leaves that to ``__del__``, which runs late in interpreter
    shutdown or never (reference cycles), so local workers would outlive the trainer.
    """
    for service, owner in list(_unfinalized.items()):
        if owner == os.getpid():  # not in a forked child that inherited the trainer's memory
            service.finalize()


def _rebuild_service(config: bytes) -> "RPCReadingService":
    service = RPCReadingService.__new__(RPCReadingService)
    service._configure(**cloudpickle.loads(config))
    return service


class RPCReadingService(CheckpointableReadingServiceInterface):
    """Run a DataPipe graph on worker servers and stream the items back to the trainer.

    Args:
        num_workers: Number of worker sessions. Without ``worker_addresses``, that many
            local workers on this host (``0`` runs the graph in the trainer's process).
            With addresses, the sessions are spread round-robin over them (default: one
            per address); each server runs every session in its own process.
        worker_addresses: ``"host:port"`` of ``rpc-reading-worker`` servers.
        auth_key: The servers' shared key (``str`` or ``bytes``). Local workers get a
            fresh random key.
        transport: Name of a registered transport (``"socket"`` by default).
        in_order: Round-robin over workers, deterministic (default); ``False`` yields
            whatever arrives first.
        prefetch: Packed frames each worker may have in flight (the credit window);
            bounds the trainer's memory.
        worker_init_fn: ``fn(datapipe, worker_info) -> datapipe``, run once per worker.
        worker_reset_fn: ``fn(datapipe, worker_info, seed_generator) -> datapipe``, run
            at the start of every epoch on every worker.
        timeout: Seconds without any word (data or heartbeat) from a worker before it is
            declared lost with :class:`~rpc_reading_service.errors.WorkerLostError`.
        connect_timeout: Seconds to connect to and set up every worker.
        pickle_by_value: Modules not installed on the workers whose functions and classes
            should travel by value.
        heartbeat_interval: Seconds between heartbeats in both directions.
        on_worker_failure: ``"raise"`` (default): a lost worker raises
            :class:`~rpc_reading_service.errors.WorkerLostError` within ``timeout``.
            ``"reassign"``: its shard is replayed on a new session (same server, another
            server, or a new local server) from the same seed, skipping the items already
            delivered, so the epoch yields exactly the items of a fault-free run. This
            needs a graph that is deterministic given the seed.
        max_reassignments: How often one worker's shard may be replayed from the same
            position within an epoch before giving up (a graph that kills its process at
            the same item every time). Counted afresh every epoch; a replay that gets
            further starts a new count, so unrelated faults never add up.
        item_timeout: Seconds one worker may spend producing one item (default ``None``: no
            limit). Past it the worker ends its session and the trainer raises
            :class:`~rpc_reading_service.errors.ItemTimeoutError` with the item's position and
            the worker's Python stack at that moment; a lost worker for ``on_worker_failure``.
            Time spent waiting for the trainer to take items does not count. Not applied
            with ``num_workers=0`` (the graph runs in the trainer).
        pin_memory: Receive tensors straight into pinned (page-locked) memory when CUDA
            is available, for fast ``.to("cuda", non_blocking=True)``.
        start_method: How local workers start: ``"fork"`` (default on POSIX with the
            socket transport; milliseconds, as torch's DataLoader workers; the workers must
            not use CUDA) or ``"spawn"`` (a fresh interpreter importing torch; a second or two).
        tls_ca_file: Connect to the workers over TLS, verifying their certificates (servers
            started with ``--tls-cert/--tls-key``) against this CA bundle (PEM). The HMAC
            auth-key handshake runs inside TLS as well. Remote workers only.
        tls_server_hostname: The name the workers' certificates must carry (default: the
            host of each worker address).
        transport_options: Extra keyword arguments for the transport's factory, e.g.
            ``{"max_frame_bytes": 1 << 30}`` for ``"socket"``; ``tls_ca_file`` and
            ``tls_server_hostname`` are added to them.
        store: Find the workers in the ``torch.distributed.TCPStore`` at ``"HOST:PORT"``
            (workers started with ``rpc-reading-worker --store HOST:PORT --job NAME``),
            instead of ``worker_addresses``. Resolved in ``initialize``, not here.
        job: The name workers registered under with ``--job`` (default ``"default"``).
        min_workers: Wait until this many registered workers answer (default 1), then use
            every live one. ``num_workers`` then defaults to ``min_workers`` sessions.
            With ``hostfile``: wait until the file lists this many addresses.
        hostfile: A file with one ``host:port`` per line (``#`` comments), instead of
            ``worker_addresses``.
        host_store: Serve the TCPStore from this process (``store="0.0.0.0:PORT"``) until
            ``finalize``; with several trainer ranks, on one rank only.
        discovery_timeout: Seconds to wait for the store and for ``min_workers``; then a
            :class:`~rpc_reading_service.discovery.DiscoveryTimeoutError` says how many came.
        cache_dir: Local workers only: where their server caches ``cached_map`` results, kept
            for later runs (default: a temporary directory removed when the run ends). Remote
            servers have their own (``rpc-reading-worker --cache-dir``).
        cache_size: Local workers only: the bound of that cache in bytes (an int, or ``"2G"``).
    """

    def __init__(
        self,
        num_workers: int = 0,
        worker_addresses: Optional[Sequence[str]] = None,
        auth_key: Optional[Union[str, bytes]] = None,
        transport: str = "socket",
        in_order: bool = True,
        prefetch: int = 4,
        worker_init_fn: Optional[InitFn] = None,
        worker_reset_fn: Optional[ResetFn] = None,
        timeout: float = 10.0,
        connect_timeout: float = 60.0,
        pickle_by_value: Sequence[types.ModuleType] = (),
        heartbeat_interval: float = 1.0,
        on_worker_failure: str = "raise",
        max_reassignments: int = 3,
        item_timeout: Optional[float] = None,
        tls_ca_file: Optional[str] = None,
        tls_server_hostname: Optional[str] = None,
        transport_options: Optional[Dict[str, Any]] = None,
        pin_memory: bool = False,
        start_method: Optional[str] = None,
        store: Optional[str] = None,
        job: str = "default",
        min_workers: Optional[int] = None,
        hostfile: Optional[str] = None,
        host_store: bool = False,
        discovery_timeout: float = 300.0,
        cache_dir: Optional[str] = None,
        cache_size: Union[int, str] = DEFAULT_LOCAL_CACHE_BYTES,
    ) -> None:
        config = dict(locals())  # exactly the parameters above, so the two cannot drift apart
        del config["self"]
        config["worker_addresses"] = list(worker_addresses) if worker_addresses is not None else None
        # Copies (the caller may change theirs); anything else is left for _configure to refuse.
        if not isinstance(pickle_by_value, (str, bytes)):
            config["pickle_by_value"] = list(pickle_by_value)
        options = transport_options or {}
        config["transport_options"] = dict(options) if isinstance(options, dict) else options
        self._configure(**config)

    def _configure(self, **config: Any) -> None:
        """Check and store the configuration; opens nothing (DataLoader2 clones us by pickling)."""
        self._config = config
        num_workers = config["num_workers"]
        addresses = config["worker_addresses"]
        check_settings(config)
        if addresses is not None:
            if not addresses:
                raise ConfigurationError("worker_addresses is empty: give at least one 'host:port'")
            for address in addresses:
                parse_address(address)
        if config["timeout"] <= config["heartbeat_interval"]:
            raise ConfigurationError(
                f"timeout ({config['timeout']} s) must exceed heartbeat_interval ({config['heartbeat_interval']} s)"
            )
        if config.get("start_method") not in (None, "fork", "spawn"):
            raise ConfigurationError(f"start_method must be 'fork' or 'spawn', got {config['start_method']!r}")
        if config["on_worker_failure"] not in ("raise", "reassign"):
            raise ConfigurationError(
                f"on_worker_failure must be 'raise' or 'reassign', got {config['on_worker_failure']!r}"
            )
        if config["transport"] not in available_transports():
            raise ConfigurationError(
                f"unknown transport {config['transport']!r}; available transports: {', '.join(available_transports())}"
            )
        discovering = check_discovery_options(config)
        if config.get("cache_dir") is not None and (addresses is not None or discovering):
            raise ConfigurationError(
                "cache_dir is for local workers; remote worker servers cache in their own "
                "rpc-reading-worker --cache-dir"
            )
        self._cache_size = parse_size(config.get("cache_size", DEFAULT_LOCAL_CACHE_BYTES), "cache_size")
        if self._cache_size <= 0:
            raise ConfigurationError(f"cache_size must be positive, got {config['cache_size']!r}")
        if config.get("tls_ca_file") and addresses is None and not discovering:
            raise ConfigurationError("tls_ca_file is for remote workers (worker_addresses=...); local workers use no TLS")
        key = config["auth_key"]
        self._auth_key = key.encode("utf-8") if isinstance(key, str) else key
        self.num_workers = len(addresses) if addresses and num_workers == 0 else num_workers
        if discovering and num_workers == 0:
            # One session per worker: min_workers, or (without it) as many as are found.
            self.num_workers = config.get("min_workers") or 0
        self._discovered: Optional[List[str]] = None  # set by _discover(), in initialize
        self._hosted_store: Any = None
        self.in_order = config["in_order"]
        self._channels: List[WorkerChannel] = []
        self._events: "queue.SimpleQueue[Event]" = queue.SimpleQueue()
        self._local_server: Optional[LocalWorkerServer] = None
        self._in_process_graph: Optional[DataPipe] = None
        self._end_datapipe: Optional[DataPipe] = None
        self._dist = DistributedInfo()
        self._seed_group: Any = None
        self._epoch = 0
        self._epoch_seed = 0
        self._progress: Optional[EpochProgress] = None
        # Not "_resume": that name is DataLoader2's pause/resume hook (a method below).
        self._resume_state: Optional[ReadingServiceState] = None
        self._seed_generator: Optional[SeedGenerator] = None
        self._epoch_start_generator: Optional[Dict[str, Dict[str, Any]]] = None  # its state as the epoch began
        self._fingerprint: List[str] = []
        #: Worker losses this epoch by (rank, items of its shard the trainer had): see _replace_worker.
        self._reassignments: Dict[Tuple[int, int], int] = {}
        self._finalized = False
        self._lock = threading.Lock()
        self._guard = _OneIterationAtATime()

    def __reduce__(self) -> Any:
        if self._channels or self._local_server is not None:
            raise TypeError("an initialised RPCReadingService cannot be pickled; pickle it before DataLoader2 uses it")
        # cloudpickle, so lambdas given as worker_init_fn survive DataLoader2's cloning.
        return _rebuild_service, (cloudpickle.dumps(self._config),)

    # -- ReadingServiceInterface ----------------------------------------------------------------
    @_exclusive("setting up the workers")
    def initialize(self, datapipe: DataPipe) -> DataPipe:
        """Ship the graph to the workers and return the trainer's graph that streams from them."""
        self._fingerprint = graph_fingerprint(datapipe)
        self._discover()
        if self.num_workers == 0:
            self._in_process_graph = init_worker_graph(datapipe, WorkerInfo(1, 0), self._config["worker_init_fn"])
            self._end_datapipe = _RemoteStream(self)
            return self._end_datapipe
        self._dist = distributed_info()
        branch, attach = split_replicable(datapipe)
        apply_distributed_sharding(branch, self._dist)
        graph = dumps_graph(
            (branch, self._config["worker_init_fn"], self._config["worker_reset_fn"]), self._config["pickle_by_value"]
        )
        try:
            if self._dist.world_size > 1:
                import torch.distributed as dist

                self._seed_group = dist.new_group(backend="gloo")
            _unfinalized[self] = os.getpid()
            self._connect(graph)
        except BaseException:
            self.finalize()
            raise
        end = attach(_RemoteStream(self))
        # DataPipes kept in the trainer after the stream may buffer items: count at the very end.
        self._end_datapipe = end if isinstance(end, _RemoteStream) else _DeliveryCounter(end, self)
        return self._end_datapipe

    def _discover(self) -> None:
        """Find the workers through ``store=`` or ``hostfile=`` (once; never in ``__init__``)."""
        config = self._config
        if self._discovered is not None or (config.get("store") is None and config.get("hostfile") is None):
            return
        self._discovered, self._hosted_store = discover_workers(
            store=config["store"],
            job=config["job"],
            min_workers=config["min_workers"],
            hostfile=config["hostfile"],
            host_store=config["host_store"],
            timeout=config["discovery_timeout"],
        )
        if self.num_workers == 0:
            self.num_workers = len(self._discovered)

    def _worker_addresses(self) -> List[str]:
        addresses = self._discovered or self._config["worker_addresses"]
        if addresses is None:
            self._auth_key = self._auth_key or new_auth_key()
            self._local_server = LocalWorkerServer(
                self._auth_key, self._config["transport"], start_method=self._config["start_method"],
                cache_dir=self._config.get("cache_dir"), cache_size=self._cache_size,
            )  # fmt: skip
            addresses = [self._local_server.start()]
        return [addresses[rank % len(addresses)] for rank in range(self.num_workers)]

    def _connect(self, graph: bytes) -> None:
        options = dict(self._config.get("transport_options") or {})
        options.update({k: self._config[k] for k in ("tls_ca_file", "tls_server_hostname") if self._config.get(k)})
        self._transport = create_transport(self._config["transport"], **options)
        self._graph_bytes = graph
        addresses = self._worker_addresses()
        with ThreadPoolExecutor(max_workers=min(32, self.num_workers)) as pool:
            futures = [pool.submit(self._open_channel, rank, addresses[rank]) for rank in range(self.num_workers)]
            errors = []
            for future in futures:
                try:
                    self._channels.append(future.result())
                except BaseException as exc:  # noqa: BLE001 - close every channel, raise the first error
                    errors.append(exc)
        if errors:
            raise errors[0]
        for channel in self._channels:
            channel.start_receiver(self._receiver_queue())

    def _session_options(self) -> SessionOptions:
        return SessionOptions(
            heartbeat_interval=self._config["heartbeat_interval"],
            peer_timeout=self._config["timeout"],
            item_timeout=self._config.get("item_timeout"),
        )

    def _receiver_queue(self) -> "queue.SimpleQueue[Event]":
        return self._events if not self.in_order else queue.SimpleQueue()

    def _open_channel(self, rank: int, address: str) -> WorkerChannel:
        """Connect to ``address`` and set up the session of worker ``rank``."""
        options, timeout = self._session_options(), self._config["connect_timeout"]
        try:
            conn = self._transport.connect(
                address, self._auth_key or b"", timeout, allocate=buffer_allocator(self._config["pin_memory"])
            )
        except PeerLostError as exc:
            raise WorkerLostError(f"worker {rank}: {exc}", rank, address) from exc
        channel = WorkerChannel(conn, rank, options.heartbeat_interval, options.peer_timeout)
        try:
            channel.setup(
                {"graph": self._graph_bytes, "worker_rank": rank, "num_workers": self.num_workers, "options": options.__dict__},
                timeout,
            )
        except BaseException:
            channel.close()
            raise
        return channel

    def _replace_worker(self, lost: WorkerChannel, error: WorkerLostError) -> WorkerChannel:
        """Replay a lost worker's shard on a new session, skipping what the trainer consumed.

        Tries the lost worker's server first (only its session may have died), then the
        other servers; local workers get a new local server if theirs is gone.
        """
        rank, progress = lost.rank, self._progress
        assert progress is not None
        # Losses at one position of one shard, this epoch: a replay that gets further is progress
        # (unrelated faults), one that dies at the same place again points at the graph.
        position, limit = progress.consumed[rank], self._config["max_reassignments"]
        losses = self._reassignments[(rank, position)] = self._reassignments.get((rank, position), 0) + 1
        if losses > limit:
            raise WorkerLostError(
                f"{error} -- gave up: worker {rank}'s shard was lost {losses} times in this epoch with the trainer "
                f"at the same position (after {position} of its items), and max_reassignments={limit} allows "
                f"{limit} replays from one position. Does the graph crash its process at that item every time? "
                "on_worker_failure='raise' shows the first loss",
                rank,
                lost.address,
            ) from error
        log.warning(
            "%s; replaying its shard from item %d on a new session (replay %d of %d from there this epoch)",
            error, position, losses, limit,
        )  # fmt: skip
        lost.close(timeout=0.5)
        if self._local_server is not None and not self._local_server.alive():
            self._local_server.stop()
            self._local_server.start()
        candidates = list(dict.fromkeys([lost.address, *(ch.address for ch in self._channels if ch is not lost)]))
        if self._local_server is not None:
            candidates = [self._local_server.address]
        failures = []
        for address in candidates:
            try:
                channel = self._open_channel(rank, address)
            except (WorkerLostError, OSError) as exc:
                failures.append(f"{address}: {exc}")
                continue
            channel.start_receiver(self._receiver_queue())
            channel.start_epoch(
                self._epoch,
                self._epoch_seed,
                self._dist.global_worker_id(rank, self.num_workers),
                self._config["prefetch"],
                skip=progress.consumed[rank],
            )
            self._channels[rank] = channel
            return channel
        raise WorkerLostError(f"{error}; no server could take over its shard: {'; '.join(failures)}", rank, lost.address) from error

    @_exclusive("starting an epoch")
    def initialize_iteration(
        self, seed_generator: SeedGenerator, iter_reset_fn: Optional[Callable[[DataPipe], DataPipe]] = None
    ) -> Optional[Callable[[DataPipe], DataPipe]]:
        """Start an epoch on every worker with a fresh shared seed."""
        assert self._end_datapipe is not None, "initialize() must run first"
        self._seed_generator = seed_generator  # DataLoader2's own: checkpoint() records its state
        self._reassignments.clear()  # max_reassignments counts within one epoch
        resume, self._resume_state = self._resume_state, None
        if resume is not None and resume.replays_epoch(seed_generator):
            self._epoch, resume = resume.epoch - 1, None  # _restore_checkpoint_beginning_of_epoch()
        if resume is not None:
            # Continue the checkpointed epoch: its seed, and skip what was consumed.
            self._epoch, self._epoch_seed = resume.epoch, resume.epoch_seed
            self._epoch_start_generator = resume.epoch_start_seed_generator
            self._progress = EpochProgress(self._epoch, list(resume.consumed), resume.next_rank)
            if resume.seed_generator is not None:
                # Undo draws made while resuming (DistributedReadingService draws every epoch),
                # so that the epochs after this one match the uninterrupted run.
                load_seed_generator_state(seed_generator, resume.seed_generator)
        else:
            self._epoch += 1
            self._epoch_start_generator = seed_generator_state(seed_generator)
            self._epoch_seed = draw_epoch_seed(seed_generator)
            if self._seed_group is not None:
                self._epoch_seed = dist_share_seed(self._epoch_seed, self._seed_group)
            self._progress = EpochProgress(self._epoch, [0] * max(1, self.num_workers))
        advance_trainer_rng()
        if self._in_process_graph is not None:
            self._in_process_graph = reset_worker_graph(
                self._in_process_graph, WorkerInfo(1, 0), self._epoch_seed, self._dist.rank, self._config["worker_reset_fn"]
            )
            return None
        if resume is None:
            # DataPipes kept in the trainer (after the remote branch) are seeded as MPRS does.
            set_graph_random_seed(self._end_datapipe, seed_generator)
        for channel in self._channels:
            channel.start_epoch(
                self._epoch,
                self._epoch_seed,
                self._dist.global_worker_id(channel.rank, self.num_workers),
                self._config["prefetch"],
                skip=self._progress.consumed[channel.rank],
            )
        return None

    def _iterate_epoch(self) -> Iterator[Any]:
        progress = self._progress
        assert progress is not None, "initialize_iteration() must run first"
        if self._in_process_graph is not None:
            return self._one_step_at_a_time(self._iterate_in_process(progress), progress)
        replace = self._replace_worker if self._config["on_worker_failure"] == "reassign" else None
        if self.in_order:
            items = iterate_in_order(self._channels, progress, replace)
        else:
            items = iterate_as_completed(self._channels, self._events, progress, replace)
        return self._one_step_at_a_time(items, progress)

    def _one_step_at_a_time(self, items: Iterator[Any], progress: EpochProgress) -> Iterator[Any]:
        """``items``, each taken holding the guard, and only while their epoch is the current one.

        An iterator of an epoch that a newer one superseded must not take the newer epoch's
        frames from the shared queues: that would lose them for its own iterator.
        """
        guard, get_ident = self._guard, threading.get_ident
        lock, doing = guard.lock, "taking an item"
        while True:
            # guard.acquire()/release() inlined: this runs once per item.
            if not lock.acquire(False):
                guard.refuse(doing)
            guard.depth, guard.holder, guard.doing = 1, get_ident(), doing
            try:
                if progress is not self._progress:
                    raise RuntimeError(
                        "this iterator of a DataLoader2 was invalidated because a newer iteration of the same "
                        "DataLoader2 started a new epoch; iterate the newest iterator only"
                    )
                item = next(items)
            except StopIteration:
                return
            finally:
                guard.depth, guard.holder = 0, None
                lock.release()
            yield item

    def _iterate_in_process(self, progress: EpochProgress) -> Iterator[Any]:
        skip = progress.consumed[0]
        for index, item in enumerate(self._in_process_graph):  # type: ignore[arg-type]
            if index >= skip:
                progress.count(0)
                yield item
        progress.finish()

    # -- CheckpointableReadingServiceInterface ----------------------------------------------------
    def checkpoint(self) -> bytes:
        """Seeds and per-worker positions of the current epoch (small; no data)."""
        progress = self._progress
        consumed, next_rank = progress.positions() if progress else ([], 0)
        if progress is not None and progress.delivered is not None:
            finished = progress.delivered_all  # the trainer's graph ended the epoch (fullsync)
        else:
            finished = progress is None or progress.finished
        state = ReadingServiceState(
            num_workers=self.num_workers,
            graph=self._fingerprint,
            epoch=self._epoch,
            epoch_seed=self._epoch_seed,
            consumed=consumed,
            next_rank=next_rank,
            in_epoch=not finished,
            seed_generator=seed_generator_state(self._seed_generator) if self._seed_generator is not None else None,
            dist_rank=distributed_info().rank,
            dist_world_size=distributed_info().world_size,
            epoch_start_seed_generator=self._epoch_start_generator,
        )
        return state.to_bytes()

    @_exclusive("restoring a checkpoint")
    def restore(self, datapipe: DataPipe, serialized_state: bytes) -> DataPipe:
        """Initialise from a checkpoint; the next epoch continues the checkpointed one."""
        state = ReadingServiceState.from_bytes(serialized_state)
        self._discover()  # num_workers may come from discovery
        dist_info = distributed_info()
        state.check_compatible(self.num_workers, graph_fingerprint(datapipe), dist_info.rank, dist_info.world_size)
        end = self.initialize(datapipe)
        self._epoch = state.epoch
        if state.in_epoch:
            self._resume_state = state
        return end

    def finalize_iteration(self) -> None:
        """Nothing to release: workers end their epoch by themselves."""

    def finalize(self) -> None:
        """Close every session and stop local workers; idempotent, bounded in time."""
        with self._lock:
            if self._finalized:
                return
            self._finalized = True
        _unfinalized.pop(self, None)
        if isinstance(self._end_datapipe, _DeliveryCounter):
            # Stop trainer-side threads (fullsync's prefetcher) while the workers still answer.
            for dp in self._trainer_side_dps():
                if callable(getattr(dp, "shutdown", None)):
                    _shutdown_trainer_side(dp)
        channels, self._channels = self._channels, []
        if channels:
            _close_channels(channels)
        if self._local_server is not None:
            self._local_server.stop()
            self._local_server = None
        self._hosted_store = None  # stops a TCPStore this trainer hosted (host_store=True)
        if self._seed_group is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group(self._seed_group)
            except Exception:  # noqa: BLE001 - the default group may already be gone
                pass
            self._seed_group = None

    # -- DataLoader2 pause / resume / limit -----------------------------------------------------
    def _trainer_side_dps(self) -> List[DataPipe]:
        assert self._end_datapipe is not None
        return list_dps(traverse_dps(self._end_datapipe))

    def _pause(self, pause_fn: Optional[Callable[[DataPipe], DataPipe]] = None) -> None:
        """Pause trainer-side DataPipes; workers stop by themselves once their credits run out."""
        for dp in self._trainer_side_dps():
            if hasattr(dp, "pause") and callable(dp.pause):
                dp.pause()
        return None

    def _resume(self, resume_fn: Optional[Callable[[DataPipe], DataPipe]] = None) -> None:
        """Resume trainer-side DataPipes (in reverse order, as torchdata does)."""
        for dp in reversed(self._trainer_side_dps()):
            if hasattr(dp, "resume") and callable(dp.resume):
                dp.resume()
        return None

    def _limit(self, num_batches: Optional[int], limit_fn: Optional[Callable[[DataPipe, Optional[int]], DataPipe]] = None) -> None:
        """Apply ``limit_fn`` to the trainer's graph; DataLoader2 counts and pauses itself."""
        if limit_fn is not None:
            limit_fn(self._end_datapipe, num_batches)  # type: ignore[arg-type]
        return None

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> ReadingServiceStats:
        """Throughput per worker and the trainer's data stall for the current (or last) epoch.

        Call it on the reading service DataLoader2 uses: ``dl.reading_service.stats()``.
        """
        progress = self._progress
        if progress is None:
            return ReadingServiceStats(0, 0.0, 0, 0.0, 0.0, 0.0)
        elapsed = max(progress.elapsed, 1e-9)
        workers = [
            WorkerStats(
                rank=channel.rank,
                address=channel.address,
                items_consumed=progress.consumed[channel.rank],
                items_received=channel.stats.items,
                bytes_received=channel.stats.bytes,
                frames_received=channel.stats.frames,
                items_per_second=progress.consumed[channel.rank] / elapsed,
                queue_depth=channel.queue.qsize() if self.in_order else 0,
                wait_seconds=channel.stats.wait_seconds,
                pid=channel.info.get("pid"),
            )
            for channel in self._channels
        ]
        items = sum(progress.consumed)
        return ReadingServiceStats(
            epoch=progress.epoch - 1,  # counted from 1 on the wire; users count from 0 (range(epochs))
            elapsed_seconds=elapsed,
            items=items,
            items_per_second=items / elapsed,
            wait_seconds=progress.wait_seconds,
            data_stall=min(1.0, progress.wait_seconds / elapsed),
            workers=workers,
        )

    @property
    def worker_addresses(self) -> List[str]:
        """Addresses of the connected worker sessions, by rank."""
        return [channel.address for channel in self._channels]
