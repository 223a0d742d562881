"""A worker server's counters, and how its session processes report theirs: a page of shared
memory per session (see docs/deployment.md "Metrics"). No Prometheus here."""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable

from ..cache.handle import opened_worker_cache

__all__ = ["SessionCounters", "SessionLedger", "ServerCounts", "COUNTER_FIELDS"]

#: The counters of a session, in their slots of its page.
COUNTER_FIELDS = ("items_sent", "bytes_sent", "credit_wait_ns", "memory_hits", "disk_hits", "misses")
_SLOT = {name: index for index, name in enumerate(COUNTER_FIELDS)}
#: Seconds between a session's publications while it sends (a publication costs ~10 us).
PUBLISH_INTERVAL = 0.1


class SessionCounters:
    """One session's counters in a page of shared memory the server maps before it forks the
    session: the session publishes (one writer at a time), its server reads. Each value is one
    aligned 8-byte word, written whole."""

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, mmap.PAGESIZE)  # MAP_SHARED | MAP_ANONYMOUS: shared with forked children
        self._words = memoryview(self._map).cast("q")
        self._creator = os.getpid()
        self._lock = threading.Lock()
        self._published = float("-inf")

    def publish(self, outbox: Any, final: bool = False) -> None:
        """Write the session's counters: what ``outbox`` sent and, in a session process of its
        own, the hits and misses of its process's worker cache (a server counts its own).

        Unless ``final``, only if :data:`PUBLISH_INTERVAL` has passed since the last time."""
        now = time.monotonic()
        if not final and now - self._published < PUBLISH_INTERVAL:
            return
        self._published = now
        values = {
            "items_sent": outbox.items_sent,
            "bytes_sent": outbox.bytes_sent,
            "credit_wait_ns": int(outbox.credit_wait_total() * 1e9),
        }
        cache = opened_worker_cache() if os.getpid() != self._creator else None
        if cache is not None:
            values.update(cache.counts())
        with self._lock:
            words = self._words
            for name, value in values.items():
                slot = _SLOT[name]
                if value > words[slot]:  # counters only grow, also if two threads publish
                    words[slot] = value

    def read(self) -> Dict[str, int]:
        """The values last published."""
        words = self._words
        return {name: words[slot] for name, slot in _SLOT.items()}

    def close(self) -> None:
        """Unmap the page (the server, once the session ended)."""
        self._words.release()
        self._map.close()


@dataclass
class ServerCounts:
    """A worker server's counters at one moment, ended sessions and running ones together."""

    sessions_open: int
    sessions_total: int
    items_sent: int
    bytes_sent: int
    credit_wait_seconds: float
    cache_memory_hits: int
    cache_disk_hits: int
    cache_misses: int


class SessionLedger:
    """The server's account of its sessions: which run, and the counters of all of them.

    The server's accept loop calls :meth:`begin`, :meth:`forked` and :meth:`end`; a metrics
    endpoint's thread calls :meth:`snapshot`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: Dict[int, SessionCounters] = {}  # by id()
        self._by_pid: Dict[int, SessionCounters] = {}
        self._ended = dict.fromkeys(COUNTER_FIELDS, 0)
        self._total = 0

    def begin(self) -> SessionCounters:
        """A session is starting (before its fork or thread): its counters."""
        counters = SessionCounters()
        with self._lock:
            self._open[id(counters)] = counters
            self._total += 1
        return counters

    def forked(self, pid: int, counters: SessionCounters) -> None:
        """The session of ``counters`` runs in process ``pid`` (see :meth:`process_ended`)."""
        with self._lock:
            self._by_pid[pid] = counters

    def process_ended(self, pid: int) -> None:
        """Session process ``pid`` was reaped."""
        with self._lock:
            counters = self._by_pid.pop(pid, None)
        if counters is not None:
            self.end(counters)

    def end(self, counters: SessionCounters) -> None:
        """The session of ``counters`` is over (or never started): keep its last values."""
        with self._lock:
            if self._open.pop(id(counters), None) is None:
                return
            for name, value in counters.read().items():
                self._ended[name] += value
            counters.close()

    def snapshot(self) -> ServerCounts:
        """Every counter now: ended sessions, running ones, and this process's own worker cache."""
        with self._lock:
            sums = dict(self._ended)
            _add(sums, (counters.read() for counters in self._open.values()))
            sessions_open, total = len(self._open), self._total
        cache = opened_worker_cache()  # sessions in thread mode share this process's cache
        if cache is not None:
            _add(sums, [cache.counts()])
        return ServerCounts(
            sessions_open=sessions_open,
            sessions_total=total,
            items_sent=sums["items_sent"],
            bytes_sent=sums["bytes_sent"],
            credit_wait_seconds=sums["credit_wait_ns"] / 1e9,
            cache_memory_hits=sums["memory_hits"],
            cache_disk_hits=sums["disk_hits"],
            cache_misses=sums["misses"],
        )


def _add(sums: Dict[str, int], parts: Iterable[Dict[str, int]]) -> None:
    for part in parts:
        for name, value in part.items():
            sums[name] += value
