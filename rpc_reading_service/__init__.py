"""rpc_reading_service: run torchdata DataPipe graphs on remote CPU workers.

``DataLoader2(datapipe, reading_service=RPCReadingService(num_workers=4))`` is all a
user changes; see :class:`RPCReadingService`.
"""

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    AuthenticationError,
    ConfigurationError,
    DiscoveryTimeoutError,
    FrameTooLargeError,
    ItemTimeoutError,
    ProtocolError,
    RemoteWorkerError,
    RPCReadingServiceError,
    WorkerLostError,
    WorkerRefusedError,
    WorkerStartupError,
)
from .reading_service import RPCReadingService  # noqa: E402
from .transports import available_transports, register_transport  # noqa: E402

__all__ = [
    "__version__",
    "RPCReadingService",
    "register_transport",
    "available_transports",
    "RPCReadingServiceError",
    "ConfigurationError",
    "ProtocolError",
    "FrameTooLargeError",
    "AuthenticationError",
    "WorkerLostError",
    "ItemTimeoutError",
    "WorkerRefusedError",
    "WorkerStartupError",
    "RemoteWorkerError",
    "DiscoveryTimeoutError",
]
