"""The disk tier: an LRU store of byte payloads under one directory, bounded in size, safe to
share between processes (the sessions of a worker server) and kept across runs.

Its layout: docs/caching.md. Directories are created mode 0700 and files 0600 (entries are
pickles); an entry not the worker's user's, or that other users may write, is deleted unread."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import List, Optional, Tuple, Union

from .config import writable_by_others
from .entry import decode_entry, encode_entry, is_older_format

__all__ = ["DiskStore"]

log = logging.getLogger("rpc_reading_service.cache")

LOW_WATER = 0.9
STALE_TEMP_SECONDS = 3600.0  # a temp file this old was left by a writer that died


def _touch(file: Union[str, int]) -> None:
    """Make an entry (a path, or an open file: no second path lookup) the most recently used.

    An explicit nanosecond time, not the kernel's coarse clock: two hits milliseconds apart
    must still be ordered for LRU."""
    now = time.time_ns()
    os.utime(file, ns=(now, now))


#: How a writer creates its temporary entry file, and the lock and usage files are opened
#: (created mode 0600, never through a symbolic link).
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
_LOCK_FILE = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW


def _private_directories(*paths: str) -> None:
    """Create each of ``paths`` that is missing, in order, mode 0700."""
    for path in paths:
        os.makedirs(path, mode=0o700, exist_ok=True)


def _read_into(fd: int, data: bytearray) -> int:
    """Fill ``data`` from ``fd``: one syscall for an entry (a read stops short only past 2 GiB,
    or at the end of a file that is shorter than it was); the bytes read."""
    view, done = memoryview(data), 0
    while done < len(data):
        read = os.readv(fd, [view[done:]])
        if read == 0:
            break
        done += read
    return done


class DiskStore:
    """Payloads by key in ``directory``, at most ``max_bytes`` of entries in all.

    Never raises for I/O: a read that fails is a miss, a corrupt entry is deleted and is a
    miss, and the first write that fails (full disk, quota, permissions) logs one warning and
    turns writing off for this process.
    """

    def __init__(self, directory: str, max_bytes: int, lock_timeout: float = 60.0):
        self.directory = directory
        self.max_bytes = max_bytes
        self.lock_timeout = lock_timeout
        self.writable = True
        self._told_older_format = False
        self._entries = os.path.join(directory, "entries")
        self._locks = os.path.join(directory, "locks")
        self._usage = os.path.join(directory, "usage")

    def entry_path(self, key: str) -> str:
        """The file that holds ``key``'s entry."""
        return os.path.join(self._entries, key[:2], key + ".entry")

    def get(self, key: str) -> Optional[memoryview]:
        """``key``'s payload (and mark it recently used), or ``None`` on a miss; an entry that is
        corrupt, another key's, larger than the bound or writable by other users is deleted.

        The payload is a view of memory read for this call alone, so a value may be rebuilt on it.
        """
        path = self.entry_path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                status = os.fstat(fd)
                payload, problem = self._read(fd, status, key)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read cache entry %s (%s); computing the item instead", path, exc)
            return None
        if payload is not None:
            return payload
        if problem:
            log.warning("cache entry %s %s: deleted, computing it again", path, problem)
        elif not self._told_older_format:
            self._told_older_format = True
            log.info("cache %s holds entries of an earlier version: each is computed again once", self.directory)
        with contextlib.suppress(OSError):
            os.unlink(path)
            if status.st_size <= self.max_bytes:  # a larger one was never counted: put refuses it
                self._account(-status.st_size)
        return None

    def _read(self, fd: int, status: os.stat_result, key: str) -> Tuple[Optional[memoryview], str]:
        """``key``'s payload from the open entry ``fd``, or ``None`` and what is wrong with the
        entry ("" for one of an earlier version).

        Args:
            fd: The entry, open for reading.
            status: Its ``fstat``.
            key: The key it was looked up under.
        """
        others = writable_by_others(status)
        if others is not None:
            return None, f"can be written by {others}, not only by this worker's user, so it is not read"
        if status.st_size > self.max_bytes:
            return None, f"is {status.st_size} bytes, more than the whole cache may hold ({self.max_bytes})"
        try:
            data = bytearray(status.st_size)
        except MemoryError:
            return None, f"is {status.st_size} bytes, more than this process can read into memory"
        if _read_into(fd, data) == len(data):
            payload = decode_entry(data, key)
            if payload is not None:
                with contextlib.suppress(OSError):
                    _touch(fd)
                return payload, ""
        if is_older_format(data):
            return None, ""
        return None, f"is corrupt, partial or another key's ({len(data)} bytes)"

    def put(self, key: str, payload: Union[bytes, bytearray, memoryview]) -> bool:
        """Store ``payload`` under ``key``; False when it was not stored (too big, or writing is off)."""
        if not self.writable:
            return False
        data = encode_entry(key, payload)
        if len(data) > self.max_bytes:
            return False
        path = self.entry_path(key)
        temp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            try:
                fd = os.open(temp, _NEW_FILE, 0o600)
            except FileNotFoundError:  # the first entry of its shard directory
                _private_directories(self.directory, self._entries, os.path.dirname(path))
                fd = os.open(temp, _NEW_FILE, 0o600)
            with open(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                _touch(handle.fileno())
            try:
                replaced = os.stat(path).st_size
            except FileNotFoundError:
                replaced = 0
            os.replace(temp, path)
            self._account(len(data) - replaced)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            self._stop_writing(exc)
            return False
        return True

    @contextlib.contextmanager
    def computing(self, key: str) -> Iterator[bool]:
        """Hold the lock on ``key`` while computing it, so that other processes wait for this
        one's result instead of computing it too.

        Yields True once locked; False after ``lock_timeout`` seconds (the holder is stuck)
        or when no lock file can be made: the caller then computes without it. A holder
        that dies releases the lock with its process.
        """
        fd = self._open_lock(key)
        locked = fd is not None and self._wait_for_lock(fd)
        try:
            yield locked
        finally:
            if fd is not None:
                os.close(fd)  # releases the flock

    def total_bytes(self) -> int:
        """The bytes of all entries now on disk (scans the directory)."""
        return sum(size for _, size, _ in self._scan())

    # -- internals ---------------------------------------------------------------------------
    def _open_lock(self, key: str) -> Optional[int]:
        path = os.path.join(self._locks, key[:3] + ".lock")
        try:
            try:
                return os.open(path, _LOCK_FILE, 0o600)
            except FileNotFoundError:  # the first lock of this directory
                _private_directories(self.directory, self._locks)
                return os.open(path, _LOCK_FILE, 0o600)
        except OSError:
            return None

    def _wait_for_lock(self, fd: int) -> bool:
        deadline = time.monotonic() + self.lock_timeout
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning(
                        "waited %.0f s for another session to compute a cache entry; computing it here",
                        self.lock_timeout,
                    )
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 0.02)

    def _account(self, delta: int) -> None:
        """Add ``delta`` to the running total; evict when it passes the bound.

        The total is rewritten in place (one short ``pwrite`` under the file's flock), not
        through a temporary file and a rename: those were half of the metadata work of a put.
        A damaged total is counted again.
        """
        fd = os.open(self._usage, _LOCK_FILE, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                total = int(os.pread(fd, 64, 0)) + delta
            except ValueError:
                total = self.total_bytes()  # first use, or a damaged usage file: count
            if total > self.max_bytes:
                total = self._evict()
            os.pwrite(fd, b"%020d" % max(total, 0), 0)  # fixed width: covers what was there
        finally:
            os.close(fd)

    def _scan(self) -> List[Tuple[int, int, str]]:
        """``(mtime_ns, size, path)`` of every entry; deletes temp files of writers that died."""
        found: List[Tuple[int, int, str]] = []
        stale = time.time() - STALE_TEMP_SECONDS
        try:
            shards = [entry.path for entry in os.scandir(self._entries) if entry.is_dir()]
        except FileNotFoundError:
            return found
        for shard in shards:
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(shard):
                    with contextlib.suppress(FileNotFoundError):
                        stat = entry.stat()
                        if entry.name.endswith(".entry"):
                            found.append((stat.st_mtime_ns, stat.st_size, entry.path))
                        elif entry.name.endswith(".tmp") and stat.st_mtime < stale:
                            os.unlink(entry.path)
        return found

    def _evict(self) -> int:
        """Delete least recently used entries until at most LOW_WATER of the bound; the new total."""
        entries = sorted(self._scan())
        total = sum(size for _, size, _ in entries)
        target = int(self.max_bytes * LOW_WATER)
        for _, size, path in entries:
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                total -= size
        return total

    def _stop_writing(self, exc: OSError) -> None:
        self.writable = False
        log.warning(
            "worker cache %s on %s (process %d): writing an entry failed (%s); this session stores no more "
            "entries and computes what it cannot find. Free space, or lower --cache-size below the "
            "disk's free space",
            self.directory, socket.gethostname(), os.getpid(), exc,
        )  # fmt: skip
