"""Finding worker servers: through torch's ``TCPStore`` (the store torchrun uses) or a hostfile.

A worker started with ``rpc-reading-worker --store HOST:PORT --job NAME`` registers its address;
``RPCReadingService(workers=StoreDiscovery("HOST:PORT", job="NAME", min_workers=N))`` waits for N
live ones. See docs/deployment.md."""

from ..errors import DiscoveryTimeoutError
from .hostfile import read_hostfile, wait_for_hostfile
from .lookup import check_discovery_options, discover_workers, wait_for_workers
from .registration import WorkerRegistration, advertised_address
from .store import KEY_PREFIX, connect_store, registered_workers

__all__ = [
    "DiscoveryTimeoutError",
    "check_discovery_options",
    "KEY_PREFIX",
    "advertised_address",
    "connect_store",
    "discover_workers",
    "read_hostfile",
    "registered_workers",
    "wait_for_hostfile",
    "wait_for_workers",
    "WorkerRegistration",
]
