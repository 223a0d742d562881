"""The typed configuration of a run: :class:`ReadingServiceConfig` and its option objects.

Every value is checked once, when its object is built (with :mod:`.settings`' table of
checks), so nothing below the front end ever reads a setting by string key or checks one
again. The option objects group settings that belong together and replace runtime
"only one of" checks by types: the workers come from exactly one of :class:`LocalWorkers`,
:class:`WorkerAddresses`, :class:`StoreDiscovery` or :class:`Hostfile`.

All of them are frozen and picklable (DataLoader2 clones its reading service by pickling);
functions in :class:`ReadingServiceConfig` travel with cloudpickle there.
"""

from __future__ import annotations

import dataclasses
import os
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from ..addresses import parse_address
from ..cache.config import parse_size
from ..discovery import check_discovery_options
from ..policies import available_distributions, create_distribution
from ..protocol import SessionOptions, window_bytes
from ..serialization import OUT_OF_BAND_MIN_BYTES
from ..errors import ConfigurationError
from ..keys import weak_key_advice
from ..settings import check_settings
from ..transports import available_transports, create_transport

__all__ = [
    "DEFAULT_LOCAL_CACHE_BYTES",
    "LocalWorkers",
    "WorkerAddresses",
    "StoreDiscovery",
    "Hostfile",
    "WorkerSource",
    "TLS",
    "TransportConfig",
    "Liveness",
    "Reassign",
    "Autoscale",
    "ReadingServiceConfig",
]

#: The default bound of the local workers' ``cached_map`` cache (1 GiB).
DEFAULT_LOCAL_CACHE_BYTES = 1 << 30

_START_METHODS = (None, "fork", "spawn")

#: Seconds between looks at a store or hostfile for servers that join a running run.
DEFAULT_POLL_INTERVAL = 5.0


def _check(owner: str, values: Dict[str, Any]) -> None:
    """Apply the settings table to ``values``, naming each one ``Owner.field`` in errors."""
    try:
        check_settings(values)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{owner}.{exc}") from None


def _check_cache_dir(directory: str) -> None:
    """Refuse a ``cache_dir`` the local server could not use: not a directory, not writable, or
    missing with no writable parent to create it in (nothing is created here)."""
    what = f"LocalWorkers.cache_dir {directory!r}"
    if os.path.exists(directory):
        if not os.path.isdir(directory):
            raise ConfigurationError(f"{what} is not a directory: give a directory (it is created if missing)")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigurationError(f"{what} is not writable by this user: pick a directory you can write to")
        return
    parent = os.path.dirname(directory)
    if not os.path.isdir(parent):
        raise ConfigurationError(
            f"{what} cannot be created: its parent {parent!r} does not exist. Create the parent, or pick another path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"{what} cannot be created: its parent {parent!r} is not writable by this user. Pick another path"
        )


@dataclass(frozen=True)
class LocalWorkers:
    """Workers started on this host by the reading service (the default).

    Args:
        start_method: ``"fork"`` (default on POSIX with the socket transport; milliseconds, as
            torch's DataLoader workers; the workers must not use CUDA) or ``"spawn"`` (a fresh
            interpreter importing torch; a second or two).
        cache_dir: Where the local server caches ``cached_map`` results, kept for later runs
            (default: a temporary directory removed when the run ends). Created mode 0700; one
            that exists must be this user's and writable by nobody else, else it is refused.
        cache_size: The bound of that cache in bytes (an int, or a size such as ``"2G"``).
    """

    start_method: Optional[str] = None
    cache_dir: Optional[str] = None
    cache_size: Union[int, str] = DEFAULT_LOCAL_CACHE_BYTES

    def __post_init__(self) -> None:
        if self.start_method not in _START_METHODS:
            raise ConfigurationError(
                f"LocalWorkers.start_method must be 'fork', 'spawn' or None, got {self.start_method!r}"
            )
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ConfigurationError(f"LocalWorkers.cache_dir must be a path or None, got {self.cache_dir!r}")
        if self.cache_dir is not None:
            _check_cache_dir(os.path.abspath(os.fspath(self.cache_dir)))
        size = parse_size(self.cache_size, "cache_size")
        if size <= 0:
            raise ConfigurationError(f"cache_size must be positive, got {self.cache_size!r}")
        object.__setattr__(self, "cache_size", size)


@dataclass(frozen=True)
class WorkerAddresses:
    """``rpc-reading-worker`` servers at known addresses (``"host:port"`` each).

    A plain list of addresses given as ``workers=`` means the same.
    """

    addresses: Tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.addresses, (str, bytes)) or not isinstance(self.addresses, Sequence):
            raise ConfigurationError(
                f"WorkerAddresses takes a list of 'host:port' strings, got {self.addresses!r}"
            )
        addresses = tuple(self.addresses)
        if not addresses:
            raise ConfigurationError("WorkerAddresses is empty: give at least one 'host:port'")
        for address in addresses:
            parse_address(address)
        object.__setattr__(self, "addresses", addresses)


@dataclass(frozen=True)
class StoreDiscovery:
    """Workers that registered in a ``torch.distributed.TCPStore``
    (``rpc-reading-worker --store HOST:PORT --job NAME``). Resolved when the run starts, then
    watched: a worker that registers later joins the run (docs/deployment.md).

    Args:
        store: The store's ``"HOST:PORT"``.
        job: The name the workers registered under with ``--job``.
        min_workers: Wait until this many registered workers answer (default 1), then use every
            live one. ``num_workers`` then defaults to ``min_workers`` sessions.
        host_store: Serve the TCPStore from this process (``store="0.0.0.0:PORT"``) until the
            run ends; with several trainer ranks, on one rank only.
        timeout: Seconds to wait for the store and for ``min_workers``; then a
            :class:`~rpc_reading_service.errors.DiscoveryTimeoutError` says how many came.
        poll_interval: Seconds between looks at the store for workers that registered after the
            run began (they join it); None: the workers found at the start are the run's.
    """

    store: str
    job: str = "default"
    min_workers: Optional[int] = None
    host_store: bool = False
    timeout: float = 300.0
    poll_interval: Optional[float] = DEFAULT_POLL_INTERVAL

    def __post_init__(self) -> None:
        _check("StoreDiscovery", {"min_workers": self.min_workers, "host_store": self.host_store})
        _check("StoreDiscovery", {"timeout": self.timeout, "poll_interval": self.poll_interval})
        check_discovery_options(store=self.store, job=self.job)


@dataclass(frozen=True)
class Hostfile:
    """Workers listed in a file, one ``host:port`` per line (``#`` comments). Read when the run
    starts, then again whenever it changes: a server added to it joins the run.

    Args:
        path: The file.
        min_workers: Wait until the file lists this many addresses.
        timeout: Seconds to wait for that.
        poll_interval: Seconds between checks of the file for changes; None: read once.
    """

    path: str
    min_workers: Optional[int] = None
    timeout: float = 300.0
    poll_interval: Optional[float] = DEFAULT_POLL_INTERVAL

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise ConfigurationError(f"Hostfile.path must be a path, got {self.path!r}")
        _check("Hostfile", {"min_workers": self.min_workers})
        _check("Hostfile", {"timeout": self.timeout, "poll_interval": self.poll_interval})


#: Where the workers of a run come from.
WorkerSource = Union[LocalWorkers, WorkerAddresses, StoreDiscovery, Hostfile]
_WORKER_SOURCES = (LocalWorkers, WorkerAddresses, StoreDiscovery, Hostfile)


@dataclass(frozen=True)
class TLS:
    """Connect to the workers over TLS (servers started with ``--tls-cert/--tls-key``).

    Args:
        ca_file: The CA bundle (PEM) the workers' certificates are verified against. The
            HMAC auth-key handshake runs inside TLS as well.
        server_hostname: The name the certificates must carry (default: the host of each
            worker address).
    """

    ca_file: str
    server_hostname: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.ca_file, (str, os.PathLike)):
            raise ConfigurationError(f"TLS.ca_file must be a path, got {self.ca_file!r}")


@dataclass(frozen=True)
class TransportConfig:
    """A registered transport by name, with its options.

    Args:
        name: ``"socket"`` (default) or ``"torch_rpc"``, or a name from
            :func:`~rpc_reading_service.register_transport`.
        tls: :class:`TLS` for remote workers (socket transport).
        max_frame_bytes: The largest frame accepted (default: the transport's own limit).
        options: Further keyword arguments for the transport's factory.
    """

    name: str = "socket"
    tls: Optional[TLS] = None
    max_frame_bytes: Optional[int] = None
    options: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in available_transports():
            raise ConfigurationError(
                f"unknown transport {self.name!r}; available transports: {', '.join(available_transports())}"
            )
        if self.tls is not None and not isinstance(self.tls, TLS):
            raise ConfigurationError(
                f"TransportConfig.tls must be a TLS(ca_file=...) or None, got {self.tls!r}"
            )
        _check("TransportConfig", {"max_frame_bytes": self.max_frame_bytes, "options": self.options})
        object.__setattr__(self, "options", dict(self.options))  # a copy: the caller may change theirs
        # The transport owns its options (TLS files, shared_memory, its own keywords): building
        # it once now refuses what it refuses here, instead of when the first epoch connects.
        create_transport(self.name, **self.factory_options())

    def factory_options(self) -> Dict[str, Any]:
        """The keyword arguments for the transport's factory."""
        options = dict(self.options)
        if self.max_frame_bytes is not None:
            options["max_frame_bytes"] = self.max_frame_bytes
        if self.tls is not None:
            options["tls_ca_file"] = self.tls.ca_file
            if self.tls.server_hostname:
                options["tls_server_hostname"] = self.tls.server_hostname
        return options


@dataclass(frozen=True)
class Liveness:
    """How a lost or silent worker is noticed.

    Args:
        heartbeat_interval: Seconds between heartbeats in both directions (below ``timeout``).
        connect_timeout: Seconds to connect to and set up every worker.
    """

    heartbeat_interval: float = 1.0
    connect_timeout: float = 60.0

    def __post_init__(self) -> None:
        _check(
            "Liveness",
            {"heartbeat_interval": self.heartbeat_interval, "connect_timeout": self.connect_timeout},
        )


@dataclass(frozen=True)
class Reassign:
    """On a lost worker, replay its shard on a new session (exactly once, in the same order).

    Args:
        max_reassignments: How often one worker's shard may be replayed from the same position
            within an epoch before giving up (a graph that kills its process at the same item
            every time). Counted afresh every epoch; a replay that gets further starts a new count.
    """

    max_reassignments: int = 3

    def __post_init__(self) -> None:
        _check("Reassign", {"max_reassignments": self.max_reassignments})


@dataclass(frozen=True)
class Autoscale:
    """Size the fleet by the data stall: at each epoch boundary open a session while the trainer
    waits for data and more sessions still raise throughput, close one while it never waits.

    Args:
        min_sessions: The fewest worker sessions (at least 1).
        max_sessions: The most worker sessions (at least ``min_sessions``).
        target_stall: The data stall (share of the epoch's time the trainer waited for items) above
            which a session is added; below half of it, one is closed.
        min_gain: Stop adding sessions once the last one raised items/s by less than this share.
        sessions_per_server: The most sessions one server hosts (default: as many as each server
            got when the run began; a local fleet's one server hosts ``max_sessions``).
        on_scale: ``fn(wanted_servers, stats)``, called when the sessions wanted need another
            number of servers than the run knows (scale a Deployment, submit a job); it runs
            before the epoch, in the trainer's thread.
    """

    min_sessions: int
    max_sessions: int
    target_stall: float = 0.05
    min_gain: float = 0.05
    sessions_per_server: Optional[int] = None
    on_scale: Optional[Callable[[int, Any], Any]] = None

    def __post_init__(self) -> None:
        for name in ("min_sessions", "max_sessions", "sessions_per_server"):
            value = getattr(self, name)
            if (value is not None or name != "sessions_per_server") and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ConfigurationError(f"Autoscale.{name} must be an integer of at least 1, got {value!r}")
        if self.max_sessions < self.min_sessions:
            raise ConfigurationError(
                f"Autoscale.max_sessions ({self.max_sessions}) is below min_sessions ({self.min_sessions}): "
                "give max_sessions >= min_sessions"
            )
        for name, low, high in (("target_stall", 0.0, 1.0), ("min_gain", 0.0, 1.0)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low < value < high:
                raise ConfigurationError(f"Autoscale.{name} must be a number between {low} and {high} (both excluded), got {value!r}")
        if self.on_scale is not None and not callable(self.on_scale):
            raise ConfigurationError(f"Autoscale.on_scale must be a function fn(wanted_servers, stats) or None, got {self.on_scale!r}")


InitFn = Callable[..., Any]


def _workers(value: Any) -> WorkerSource:
    if value is None:
        return LocalWorkers()
    if isinstance(value, _WORKER_SOURCES):
        return value
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return WorkerAddresses(tuple(value))
    raise ConfigurationError(
        "workers must be LocalWorkers(...), WorkerAddresses([...]) or a list of 'host:port' strings, "
        f"StoreDiscovery(store=...) or Hostfile(path), got {value!r}"
    )


def _local_with_start_method(workers: Any, start_method: str) -> LocalWorkers:
    """``workers`` with MPRS's ``multiprocessing_context`` as the local workers' start method."""
    if start_method not in ("fork", "spawn"):
        raise ConfigurationError(f"multiprocessing_context must be 'fork' or 'spawn', got {start_method!r}")
    if workers is None:
        return LocalWorkers(start_method=start_method)
    if not isinstance(workers, LocalWorkers) or workers.start_method not in (None, start_method):
        raise ConfigurationError(
            f"multiprocessing_context={start_method!r} is for local workers: give it, or "
            f"LocalWorkers(start_method=...), not both with {workers!r}"
        )
    return dataclasses.replace(workers, start_method=start_method)


def _transport(value: Any) -> TransportConfig:
    if isinstance(value, TransportConfig):
        return value
    if isinstance(value, str):
        return TransportConfig(name=value)
    raise ConfigurationError(f"transport must be a transport name or a TransportConfig(...), got {value!r}")


def _distribution(value: Any, in_order: bool) -> Any:
    """The policy object of ``distribution=`` (a registered name or a policy), with ``in_order=False``
    as the shorthand for ``"first_ready"`` (or first-ready delivery of ``"dynamic"``)."""
    from ..policies.base import DistributionPolicy

    if value is None:
        return create_distribution("round_robin" if in_order else "first_ready")
    if isinstance(value, str):
        if not in_order and value == "dynamic":
            return create_distribution("dynamic", in_order=False)
        policy = create_distribution(value)
    elif isinstance(value, DistributionPolicy):
        policy = value
    else:
        raise ConfigurationError(
            "distribution must be 'round_robin', 'first_ready', 'dynamic', another registered name "
            f"(available: {', '.join(available_distributions())}) or a DistributionPolicy, got {value!r}"
        )
    if not in_order and policy.in_order:
        raise ConfigurationError(
            f"in_order=False asks for first-ready delivery, but distribution={value!r} delivers in a fixed order: "
            "give distribution='first_ready' (or Dynamic(in_order=False)), or drop in_order=False"
        )
    return policy


def _failure_policy(value: Any) -> Optional[Reassign]:
    if value == "raise":
        return None
    if value == "reassign":
        return Reassign()
    if isinstance(value, Reassign):
        return value
    raise ConfigurationError(f"on_worker_failure must be 'raise', 'reassign' or Reassign(...), got {value!r}")


#: ``prefetch=None``: each worker's window is this many frames ...
AUTO_PREFETCH_FRAMES = 4
#: ... growing to this many for items large enough that a few fill a frame ...
AUTO_PREFETCH_GROW_TO = 16
#: ... and past 4 workers to fewer, about this many shared (the trainer's memory for what is in flight).
AUTO_PREFETCH_TRAINER_FRAMES = 64


@dataclass(frozen=True)
class ReadingServiceConfig:
    """Everything a run needs to know, checked once: build it with :meth:`create`.

    ``prefetch`` is None for a window sized by the items and the fleet (:meth:`frames_in_flight`).
    ``reassign`` is ``None`` for ``on_worker_failure="raise"``. ``main_prefetch_cnt`` is the
    number of items a trainer-side thread takes ahead (MPRS's ``main_prefetch_cnt``; 0: none).
    ``distribution`` is the :class:`~rpc_reading_service.policies.base.DistributionPolicy`
    (default round-robin); ``in_order`` is False when it delivers in arrival order.
    """

    num_workers: int = 0
    workers: WorkerSource = LocalWorkers()
    auth_key: Optional[bytes] = None
    transport: TransportConfig = TransportConfig()
    in_order: bool = True
    prefetch: Optional[int] = None
    main_prefetch_cnt: int = 0
    worker_init_fn: Optional[InitFn] = None
    worker_reset_fn: Optional[InitFn] = None
    timeout: float = 10.0
    item_timeout: Optional[float] = None
    pickle_by_value: Tuple[types.ModuleType, ...] = ()
    liveness: Liveness = Liveness()
    reassign: Optional[Reassign] = None
    pin_memory: bool = False
    distribution: Any = None
    autoscale: Optional[Autoscale] = None

    def frames_in_flight(self, workers: int) -> Tuple[int, int]:
        """Each worker's credit window: ``(frames, grow_to)``, ``(prefetch, 0)``, or for
        ``prefetch=None`` 4 frames growing to 16 for large items (256 of them in flight), to fewer
        past 4 workers (64 frames shared).

        Args:
            workers: The sessions the trainer reads from now.
        """
        if self.prefetch is not None:
            return self.prefetch, 0
        shared = AUTO_PREFETCH_TRAINER_FRAMES // max(1, workers)
        return AUTO_PREFETCH_FRAMES, max(AUTO_PREFETCH_FRAMES, min(AUTO_PREFETCH_GROW_TO, shared))

    def in_flight_bytes(self, workers: int, item_bytes: int, in_band: Optional[bool] = None) -> int:
        """The bytes ``workers`` sessions may have in flight to the trainer once items of
        ``item_bytes`` each were handed on (their credit windows): what bounds its memory.

        Args:
            workers: The sessions the trainer reads from.
            item_bytes: The size of every item (a frame holds at least one).
            in_band: Whether the items are pickled in band (None: as a tensor of that size is).
        """
        frames, grow_to = self.frames_in_flight(workers)
        options = SessionOptions()
        if in_band is None:
            in_band = item_bytes < OUT_OF_BAND_MIN_BYTES
        bound = options.batch_max_bytes if in_band else options.frame_max_bytes
        items = min(options.batch_max_items, -(-bound // max(1, item_bytes)))  # a frame is sealed at its bound
        return workers * window_bytes(frames, options.batch_max_bytes, items * item_bytes, grow_to, item_bytes)

    @classmethod
    def create(
        cls,
        *,
        workers: Any = None,
        transport: Any = "socket",
        on_worker_failure: Any = "raise",
        liveness: Optional[Liveness] = None,
        auth_key: Optional[Union[str, bytes]] = None,
        pickle_by_value: Sequence[types.ModuleType] = (),
        worker_prefetch_cnt: Optional[int] = None,
        multiprocessing_context: Optional[str] = None,
        distribution: Any = None,
        autoscale: Optional[Autoscale] = None,
        **settings: Any,
    ) -> "ReadingServiceConfig":
        """Check every setting and build the configuration; shorthands are turned into option objects
        (a list of addresses into :class:`WorkerAddresses`, a transport name into
        :class:`TransportConfig`, ``"raise"``/``"reassign"`` into the failure policy), and
        MultiProcessingReadingService's names into ours (``worker_prefetch_cnt`` is ``prefetch``,
        ``multiprocessing_context`` the local workers' start method)."""
        if worker_prefetch_cnt is not None:
            if settings.get("prefetch", worker_prefetch_cnt) not in (cls.prefetch, worker_prefetch_cnt):
                raise ConfigurationError("give prefetch or worker_prefetch_cnt (its MPRS name), not both")
            settings["prefetch"] = worker_prefetch_cnt
        if multiprocessing_context is not None:
            workers = _local_with_start_method(workers, multiprocessing_context)
        if not isinstance(pickle_by_value, (str, bytes)) and isinstance(pickle_by_value, Sequence):
            pickle_by_value = list(pickle_by_value)
        check_settings({"auth_key": auth_key, "pickle_by_value": pickle_by_value, **settings})
        liveness = Liveness() if liveness is None else liveness
        if not isinstance(liveness, Liveness):
            raise ConfigurationError(f"liveness must be a Liveness(...), got {liveness!r}")
        if autoscale is not None and not isinstance(autoscale, Autoscale):
            raise ConfigurationError(f"autoscale must be an Autoscale(min_sessions=..., max_sessions=...) or None, got {autoscale!r:.80}")
        policy = _distribution(distribution, settings.get("in_order", True))
        settings["in_order"] = policy.in_order
        key = auth_key.encode("utf-8") if isinstance(auth_key, str) else auth_key
        if weak_key_advice(key):
            warnings.warn(weak_key_advice(key), UserWarning, stacklevel=3)  # the caller of RPCReadingService(...)
        config = cls(
            distribution=policy,
            workers=_workers(workers),
            transport=_transport(transport),
            reassign=_failure_policy(on_worker_failure),
            liveness=liveness,
            autoscale=autoscale,
            auth_key=key,
            pickle_by_value=tuple(pickle_by_value),
            **settings,
        )
        config._check_combinations()
        return config

    def _check_combinations(self) -> None:
        if self.timeout <= self.liveness.heartbeat_interval:
            raise ConfigurationError(
                f"timeout ({self.timeout} s) must exceed Liveness.heartbeat_interval "
                f"({self.liveness.heartbeat_interval} s)"
            )
        if self.transport.tls is not None and self.local:
            raise ConfigurationError(
                "TLS is for remote workers (workers=WorkerAddresses([...]) or discovery); "
                "local workers use no TLS"
            )
        if self.autoscale is not None:
            self._check_autoscale(self.autoscale)
        self.distribution.check(self)

    def _check_autoscale(self, autoscale: Autoscale) -> None:
        if self.local and not self.num_workers:
            raise ConfigurationError(
                "autoscale sizes the worker sessions, and num_workers=0 runs the graph in the trainer: "
                "give num_workers (between min_sessions and max_sessions) or workers="
            )
        sessions = self.sessions()
        if sessions and not autoscale.min_sessions <= sessions <= autoscale.max_sessions:
            raise ConfigurationError(
                f"the run starts with {sessions} worker sessions, outside Autoscale's bounds "
                f"[{autoscale.min_sessions}, {autoscale.max_sessions}]: give num_workers within them"
            )

    @property
    def local(self) -> bool:
        """True when the workers are local ones started by the run."""
        return isinstance(self.workers, LocalWorkers)

    @property
    def discovered(self) -> bool:
        """True when the workers are found when the run starts (a store or a hostfile)."""
        return isinstance(self.workers, (StoreDiscovery, Hostfile))

    def sessions(self) -> int:
        """The number of worker sessions known before discovery (0: as many as are found)."""
        if self.num_workers or self.local:
            return self.num_workers
        if isinstance(self.workers, WorkerAddresses):
            return len(self.workers.addresses)
        return self.workers.min_workers or 0

    def replace(self, **changes: Any) -> "ReadingServiceConfig":
        """A copy with ``changes`` (already checked values only)."""
        return dataclasses.replace(self, **changes)
