"""rpc_reading_service: run torchdata DataPipe graphs on remote CPU workers.

``DataLoader2(datapipe, reading_service=RPCReadingService(num_workers=4))`` is all a
user changes; see :class:`RPCReadingService`.
"""

from typing import TYPE_CHECKING, Any

from .quiet_imports import torchdata_banner_muted

with torchdata_banner_muted():
    from . import cache as _cache  # noqa: F401 - registers dp.cached_map
from .config import (
    TLS,
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
    LocalProtocolError,
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
from .distributions import available_distributions, register_distribution
from .transports import available_transports, register_transport
from .version import __version__

if TYPE_CHECKING:
    from .reading_service import RPCReadingService


_POLICIES = ("Dynamic", "Sticky", "RoundRobin", "FirstReady", "DistributionPolicy")


def __getattr__(name: str) -> Any:
    # RPCReadingService (and torchdata with it) loads on first use, so that the worker server
    # (``rpc_reading_service.worker``) decides how torchdata is first imported in its process.
    if name == "RPCReadingService":
        from .reading_service import RPCReadingService

        return RPCReadingService
    if name in _POLICIES:  # the distribution policies, as lazily (they need torchdata)
        from .engine import distribution
        from .engine.distribution.dynamic import Dynamic
        from .engine.distribution.sticky import Sticky

        return {"Dynamic": Dynamic, "Sticky": Sticky}.get(name) or getattr(distribution, name)
    if name in ("shared_empty", "shared_collate"):  # torch loads on first use too
        from . import shared_items

        return getattr(shared_items, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "__version__",
    "RPCReadingService",
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
    "Sticky",
    "register_transport",
    "available_transports",
    "register_distribution",
    "available_distributions",
    "Dynamic",
    "RoundRobin",
    "FirstReady",
    "DistributionPolicy",
    "RPCReadingServiceError",
    "ConfigurationError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "FrameTooLargeError",
    "AuthenticationError",
    "WorkerLostError",
    "ItemTimeoutError",
    "WorkerDrainedError",
    "WorkerRefusedError",
    "WorkerStartupError",
    "RemoteWorkerError",
    "DiscoveryTimeoutError",
    "CacheKeyError",
    "StickyKeyError",
    "ItemPicklingError",
]
