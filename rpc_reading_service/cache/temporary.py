"""Local workers' temporary cache directories: held while in use, removed by the next run when abandoned."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time
from typing import List, Optional

__all__ = [
    "TEMPORARY_CACHE_PREFIX", "ABANDONED_AFTER_S",
    "HeldDirectory", "make_temporary_cache", "remove_abandoned_caches",
]

TEMPORARY_CACHE_PREFIX = "rrs-cache-"
#: A directory changed more recently than this is never taken for abandoned (its maker may not hold it yet).
ABANDONED_AFTER_S = 10.0


class HeldDirectory:
    """A directory marked in use (a shared lock on it) until :meth:`close` or :meth:`remove`.

    Args:
        path: The directory to hold.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: Optional[int] = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
        except OSError:  # a file system without locks: nobody's lock succeeds there, so none removes it
            pass

    def close(self) -> None:
        """Let go of the directory, leaving it where it is (once)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        """Delete the directory, then let go of it (once)."""
        if self._fd is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.close()


def make_temporary_cache() -> HeldDirectory:
    """A new private cache directory in the temporary directory, held.

    Removes this user's abandoned ones first (their run was killed with its workers at once).
    """
    remove_abandoned_caches()
    return HeldDirectory(tempfile.mkdtemp(prefix=TEMPORARY_CACHE_PREFIX))


def remove_abandoned_caches(parent: Optional[str] = None, min_age_s: float = ABANDONED_AFTER_S) -> List[str]:
    """Remove this user's temporary cache directories that nobody holds; the paths removed.

    Args:
        parent: Where to look (default: the temporary directory).
        min_age_s: Leave a directory changed fewer seconds ago than this.
    """
    parent = tempfile.gettempdir() if parent is None else parent
    removed = []
    try:
        entries = [entry for entry in os.scandir(parent) if entry.name.startswith(TEMPORARY_CACHE_PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # gone, not a directory, or a symbolic link
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            if time.time() - info.st_mtime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a running trainer's or server's
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        finally:
            os.close(fd)
    return removed
