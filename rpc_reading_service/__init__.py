"""rpc_reading_service: run torchdata DataPipe graphs on remote CPU workers.

``DataLoader2(datapipe, reading_service=RPCReadingService(num_workers=4))`` is all a
user changes; see :class:`RPCReadingService`.
"""

from . import cache as _cache  # noqa: F401 - registers dp.cached_map
from .errors import (
    AuthenticationError,
    CacheKeyError,
    ConfigurationError,
    DiscoveryTimeoutError,
    FrameTooLargeError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    RemoteWorkerError,
    RPCReadingServiceError,
    WorkerLostError,
    WorkerRefusedError,
    WorkerStartupError,
)
from .reading_service import RPCReadingService
from .transports import available_transports, register_transport
from .version import __version__

__all__ = [
    "__version__",
    "RPCReadingService",
    "register_transport",
    "available_transports",
    "RPCReadingServiceError",
    "ConfigurationError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "FrameTooLargeError",
    "AuthenticationError",
    "WorkerLostError",
    "WorkerRefusedError",
    "WorkerStartupError",
    "RemoteWorkerError",
    "DiscoveryTimeoutError",
    "CacheKeyError",
]
