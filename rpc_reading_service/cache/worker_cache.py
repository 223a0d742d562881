"""The cache a worker session uses: the memory tier over the disk tier, values pickled (tensors
out of band, see ``values.py``), and each key computed once however many sessions ask for it
at the same time."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from .config import CacheConfig
from .memory import MemoryTier
from .store import DiskStore
from .values import pack_value, unpack_value

__all__ = ["WorkerCache"]

log = logging.getLogger("rpc_reading_service.cache")

_MISSING = object()


class WorkerCache:
    """Values by key in the tiers of a :class:`~rpc_reading_service.cache.config.CacheConfig`.

    Values travel through the tiers as pickles (protocol 5), so every hit is a fresh copy: a
    step after ``cached_map`` that changes its input in place cannot change the cache. A disk
    hit's tensors live on the memory the entry was read into (no copy after the read); a
    memory hit copies the payload once.
    """

    def __init__(self, config: CacheConfig):
        self.config = config
        self.disk = DiskStore(config.directory, config.max_bytes) if config.directory else None
        self.memory = MemoryTier(config.memory_bytes) if config.memory_bytes else None
        self._warned_unpicklable = False
        #: Lookups answered by each tier, and values computed (misses), for the server's metrics.
        self._counts = {"memory_hits": 0, "disk_hits": 0, "misses": 0}
        self._counts_lock = threading.Lock()  # sessions in thread mode share this cache

    def counts(self) -> Dict[str, int]:
        """Hits per tier (``memory_hits``, ``disk_hits``) and ``misses`` (values computed) so far."""
        with self._counts_lock:
            return dict(self._counts)

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self._counts[name] += 1

    def get_or_compute(self, key: str, compute: Callable[[], Any]) -> Any:
        """The cached value of ``key``, or ``compute()`` stored under it.

        While one process computes a key, others asking for it wait for its result (up to the
        store's lock timeout) instead of computing it too.
        """
        found = self._load(key)
        if found is not _MISSING:
            return found
        if self.disk is None:
            self._count("misses")
            return self._store(key, compute())
        with self.disk.computing(key):
            found = self._load(key)  # the holder we waited for may have stored it
            if found is not _MISSING:
                return found
            self._count("misses")
            return self._store(key, compute())

    def _load(self, key: str) -> Any:
        found = self._lookup(key)
        if found is None:
            return _MISSING
        payload, tier = found
        try:
            value = unpack_value(payload)
        except Exception as exc:  # noqa: BLE001 - e.g. the class of a cached value is gone
            log.warning("cached_map: a cached value cannot be unpickled (%s); computing it again", exc)
            return _MISSING
        self._count(tier)
        return value

    def _lookup(self, key: str) -> Optional[Tuple[memoryview, str]]:
        """``key``'s payload in memory nobody else holds (values are rebuilt on it) and the counter
        of the tier that held it (``"memory_hits"`` or ``"disk_hits"``), or ``None``."""
        # A memory hit leaves the disk entry's recency alone: the disk tier ranks what the
        # sessions' memory tiers do not hold, which is what it is there for.
        kept = self.memory.get(key) if self.memory is not None else None
        if kept is not None:
            return memoryview(bytearray(kept)), "memory_hits"
        payload = self.disk.get(key) if self.disk is not None else None
        if payload is None:
            return None
        if self.memory is not None:
            self.memory.put(key, bytes(payload))
        return payload, "disk_hits"

    def _store(self, key: str, value: Any) -> Any:
        try:
            payload = pack_value(value)
        except Exception as exc:  # noqa: BLE001 - pickling raises many types
            if not self._warned_unpicklable:
                self._warned_unpicklable = True
                log.warning(
                    "cached_map: a result of type %s cannot be pickled (%s); such results are not cached",
                    type(value).__name__,
                    exc,
                )
            return value
        if self.disk is not None:
            self.disk.put(key, payload)
        if self.memory is not None:
            self.memory.put(key, payload)
        return value
