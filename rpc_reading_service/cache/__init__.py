"""The worker-side cache behind ``dp.cached_map``: a disk tier shared by the sessions of a worker
server and kept across runs (``store.py``), an optional memory tier per session (``memory.py``),
the entry format (``entry.py``), keys (``keys.py``), configuration (``config.py``), the handle
through which sessions find their server's cache (``handle.py``) and the DataPipe (``datapipe.py``).

Importing this package registers ``cached_map`` on ``IterDataPipe``.
"""

from .config import CacheConfig, parse_size
from .datapipe import CachedMapperIterDataPipe
from .handle import set_worker_cache, worker_cache
from .store import DiskStore
from .worker_cache import WorkerCache

__all__ = [
    "CacheConfig",
    "parse_size",
    "CachedMapperIterDataPipe",
    "set_worker_cache",
    "worker_cache",
    "DiskStore",
    "WorkerCache",
]
