"""The worker cache's configuration (``--cache-dir``, ``--cache-size``, ``--cache-memory``), checked once."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import Optional, Union

from ..errors import ConfigurationError

__all__ = ["CacheConfig", "check_private_directory", "parse_size", "writable_by_others"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: Union[str, int], what: str = "size") -> int:
    """Bytes from ``"1048576"``, ``"64K"``, ``"512M"``, ``"10G"`` or ``"10GiB"`` (powers of 1024).

    Raises :class:`~rpc_reading_service.errors.ConfigurationError` naming ``what`` (the
    option) for anything else.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE.match(str(text))
    if match is None:
        raise ConfigurationError(
            f"{what} {text!r} is not a size in bytes; write e.g. 1048576, 64K, 512M or 10G"
        )
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


@dataclass(frozen=True)
class CacheConfig:
    """Where a worker server caches ``cached_map`` results and how much it may keep.

    ``directory``: the disk tier, shared by every session of the server and kept across
    runs (``None``: no disk tier). ``max_bytes``: the disk tier's bound (entries, headers
    included). ``memory_bytes``: an in-process tier of each session on top (0: none).
    ``temporary``: the server removes ``directory`` when it stops. Build it with :meth:`create`, which checks everything once.
    """

    directory: Optional[str]
    max_bytes: int
    memory_bytes: int = 0
    #: The directory belongs to this one server (a local fleet's): removed when it stops,
    #: by the server itself, so that it goes even when the trainer that made it was killed.
    temporary: bool = False

    @classmethod
    def create(
        cls,
        directory: Optional[str],
        max_bytes: Union[str, int, None] = None,
        memory_bytes: Union[str, int, None] = None,
        option: str = "--cache-dir",
    ) -> Optional[CacheConfig]:
        """A checked configuration, or ``None`` when neither tier is asked for.

        Creates ``directory`` (mode 0700) if needed; raises
        :class:`~rpc_reading_service.errors.ConfigurationError` when it cannot be written,
        another user owns it or may write it (see :func:`check_private_directory`), or a
        size is missing, malformed or not positive. ``option``: how the user named the
        directory, for the messages.
        """
        size = parse_size(max_bytes, "--cache-size") if max_bytes is not None else None
        memory = parse_size(memory_bytes, "--cache-memory") if memory_bytes is not None else 0
        if directory is None:
            if size is not None:
                raise ConfigurationError("--cache-size bounds the disk cache: give --cache-dir DIR with it")
            if memory < 0:
                raise ConfigurationError(f"--cache-memory must be positive, got {memory}")
            return cls(None, 0, memory) if memory else None
        if size is None:
            raise ConfigurationError(
                f"--cache-dir {directory} needs --cache-size BYTES (e.g. 10G): the cache is bounded"
            )
        if size <= 0 or memory < 0:
            raise ConfigurationError(
                f"--cache-size must be positive (got {size}) and --cache-memory not negative"
            )
        directory = os.path.abspath(directory)
        try:
            # Private: entries are pickles, so whoever can write them can run code in the worker.
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot create the cache directory {directory}: {exc}; pick a writable one"
            ) from exc
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigurationError(
                f"the cache directory {directory} is not writable by this user; pick another one"
            )
        check_private_directory(directory, option)
        return cls(directory, size, memory)


def writable_by_others(status: os.stat_result) -> Optional[str]:
    """Who besides this process's user may write the file or directory of ``status`` ("uid N
    (its owner)", "every user", "its group"), or ``None``.

    Args:
        status: Its ``stat``.
    """
    if status.st_uid != os.geteuid():
        return f"uid {status.st_uid} (its owner)"
    if status.st_mode & stat.S_IWOTH:
        return "every user"
    if status.st_mode & stat.S_IWGRP:
        return "its group"
    return None


def check_private_directory(directory: str, option: str = "--cache-dir") -> None:
    """Refuse a cache directory that another user owns or that its group or others may write:
    its entries are pickles, so whoever writes there runs code as the worker's user.

    Args:
        directory: The cache directory (it exists).
        option: How the user gave it, for the message.

    Raises:
        ConfigurationError: Saying who else may write it and how to fix it.
    """
    status = os.stat(directory)
    others = writable_by_others(status)
    if others is None:
        return
    raise ConfigurationError(
        f"{option} {directory} can be written by {others}, not only by this worker's user (uid {os.geteuid()}; "
        f"mode {stat.filemode(status.st_mode)}): cache entries are pickles, so whoever can write there could "
        f"run code as this worker's user. Give a directory of your own that only you can write (`chmod 700 "
        f"{directory}`), or a new path (it is created private)"
    )
