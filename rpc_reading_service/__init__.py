"""rpc_reading_service: run data pipelines on remote CPU workers.

``DataLoader2(datapipe, reading_service=RPCReadingService(num_workers=4))`` (torchdata < 0.10)
or ``DataLoader(RemoteIterable(source, num_workers=4), batch_size=None)`` is all a user
changes; see :class:`RPCReadingService` and :class:`RemoteIterable`.
"""

from typing import TYPE_CHECKING, Any

from .quiet_imports import torchdata_banner_muted

with torchdata_banner_muted():
    from . import cache as _cache  # noqa: F401 - registers dp.cached_map
from .trainer.frontends import remote_map as _remote_map  # noqa: F401 - registers dp.remote_map
from .trainer.config import (
    TLS,
    Autoscale,
    Hostfile,
    Liveness,
    LocalWorkers,
    Reassign,
    StoreDiscovery,
    TransportConfig,
    WorkerAddresses,
)
from .errors import (
    AuthenticationError,
    CacheKeyError,
    ConfigurationError,
    DiscoveryTimeoutError,
    FrameTooLargeError,
    ItemPicklingError,
    ItemTimeoutError,
    ItemTooLargeError,
    ItemUnpicklingError,
    LocalProtocolError,
    MissingDependencyError,
    ProtocolError,
    RemoteProtocolError,
    RemoteWorkerError,
    RPCReadingServiceError,
    StickyKeyError,
    WorkerDrainedError,
    WorkerLostError,
    WorkerRefusedError,
    WorkerStartupError,
)
from .policies import available_distributions, register_distribution
from .metrics import MetricsEndpoint, ReadingServiceCollector, serve_metrics
from .transports import available_transports, register_transport
from .version import __version__

if TYPE_CHECKING:
    from .trainer.frontends.nodes import RemoteMapper, RemoteNode
    from .trainer.frontends.torch_dataloader import RemoteIterable
    from .trainer.reading_service import RPCReadingService


_POLICIES = ("Dynamic", "Sticky", "RoundRobin", "FirstReady", "DistributionPolicy")


def __getattr__(name: str) -> Any:
    # The front ends (and torchdata with them) load on first use, so that the worker server
    # (``rpc_reading_service.worker``) decides how torchdata is first imported in its process.
    # RPCReadingService raises an ImportError saying what to install where torchdata has no DataLoader2.
    if name == "RPCReadingService":
        from .trainer.reading_service import RPCReadingService

        return RPCReadingService
    if name == "RemoteIterable":
        from .trainer.frontends.torch_dataloader import RemoteIterable

        return RemoteIterable
    if name in ("RemoteNode", "RemoteMapper"):  # torchdata.nodes (>= 0.10): an ImportError says so otherwise
        from .trainer.frontends import nodes

        return getattr(nodes, name)
    if name in _POLICIES:  # the distribution policies, as lazily
        from .policies.base import DistributionPolicy
        from .policies.dynamic.trainer import Dynamic
        from .policies.first_ready.trainer import FirstReady
        from .policies.round_robin.trainer import RoundRobin
        from .policies.sticky.trainer import Sticky

        policies = {"Dynamic": Dynamic, "Sticky": Sticky, "RoundRobin": RoundRobin, "FirstReady": FirstReady}
        return policies.get(name, DistributionPolicy)
    if name in ("shared_empty", "shared_collate"):  # torch loads on first use too
        from .transports.socket_transport import shared_items

        return getattr(shared_items, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "__version__",
    "RPCReadingService",
    "RemoteIterable",
    "RemoteNode",
    "RemoteMapper",
    "shared_empty",
    "shared_collate",
    "LocalWorkers",
    "WorkerAddresses",
    "StoreDiscovery",
    "Hostfile",
    "TransportConfig",
    "TLS",
    "Liveness",
    "Reassign",
    "Autoscale",
    "Sticky",
    "register_transport",
    "available_transports",
    "register_distribution",
    "available_distributions",
    "serve_metrics",
    "ReadingServiceCollector",
    "MetricsEndpoint",
    "Dynamic",
    "RoundRobin",
    "FirstReady",
    "DistributionPolicy",
    "RPCReadingServiceError",
    "ConfigurationError",
    "MissingDependencyError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "FrameTooLargeError",
    "AuthenticationError",
    "WorkerLostError",
    "ItemTimeoutError",
    "ItemUnpicklingError",
    "WorkerDrainedError",
    "WorkerRefusedError",
    "WorkerStartupError",
    "RemoteWorkerError",
    "DiscoveryTimeoutError",
    "CacheKeyError",
    "StickyKeyError",
    "ItemPicklingError",
    "ItemTooLargeError",
]
