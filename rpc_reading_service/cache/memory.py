"""The memory tier: an LRU of byte payloads inside one session process, bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

__all__ = ["MemoryTier"]


class MemoryTier:
    """Payloads by key, at most ``max_bytes`` of them; the least recently used go first.

    Thread-safe (sessions in ``--session-mode thread`` share one process).
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._payloads: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Optional[bytes]:
        """``key``'s payload (now the most recently used), or ``None``."""
        with self._lock:
            payload = self._payloads.get(key)
            if payload is not None:
                self._payloads.move_to_end(key)
            return payload

    def put(self, key: str, payload: bytes) -> None:
        """Keep ``payload`` (unless it alone exceeds the bound), evicting the least recently used."""
        if len(payload) > self.max_bytes:
            return
        with self._lock:
            old = self._payloads.pop(key, None)
            self._bytes += len(payload) - (len(old) if old is not None else 0)
            self._payloads[key] = payload
            while self._bytes > self.max_bytes:
                _, evicted = self._payloads.popitem(last=False)
                self._bytes -= len(evicted)
