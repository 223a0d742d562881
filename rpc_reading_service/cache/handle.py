"""The process-level handle through which a session's ``cached_map`` finds its server's cache.

The worker server calls :func:`set_worker_cache` before it forks sessions; each session
process (or, with thread sessions, the server process) opens its :class:`WorkerCache` on first
use, so each session has its own memory tier and its own warnings while sharing the disk tier.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional, Tuple

from .config import CacheConfig
from .worker_cache import WorkerCache

__all__ = ["set_worker_cache", "worker_cache", "opened_worker_cache"]

_config: Optional[CacheConfig] = None
_opened: Optional[Tuple[int, WorkerCache]] = None  # (pid, cache): a forked child opens its own
_lock = threading.Lock()

log = logging.getLogger("rpc_reading_service.cache")


def set_worker_cache(config: Optional[CacheConfig]) -> None:
    """Make ``config`` this process's (and its future children's) worker cache; ``None``: no cache."""
    global _config, _opened
    with _lock:
        _config, _opened = config, None
    if config is not None:
        disk = f" in {config.directory} (up to {config.max_bytes} bytes)" if config.directory else ""
        memory = (
            f", up to {config.memory_bytes} bytes in each session's memory" if config.memory_bytes else ""
        )
        log.info("cached_map results are cached%s%s", disk, memory)


def worker_cache() -> Optional[WorkerCache]:
    """This process's worker cache, or ``None`` when no server configured one."""
    global _opened
    if _config is None:
        return None
    with _lock:
        if _opened is None or _opened[0] != os.getpid():
            _opened = (os.getpid(), WorkerCache(_config))
        return _opened[1]


def opened_worker_cache() -> Optional[WorkerCache]:
    """This process's worker cache if a session of this process has opened it, else ``None``
    (never opens one: a forking server's own process leaves that to its sessions)."""
    opened = _opened
    return opened[1] if opened is not None and opened[0] == os.getpid() else None
