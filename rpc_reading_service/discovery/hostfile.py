"""Hostfiles: one ``host:port`` per line, ``#`` starts a comment, blank lines are ignored."""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

from ..addresses import distinct_servers, parse_address
from ..errors import ConfigurationError, DiscoveryTimeoutError

__all__ = ["read_hostfile", "wait_for_hostfile"]

_POLL_SECONDS = 0.2


def read_hostfile(path: str) -> List[str]:
    """The ``host:port`` lines of a hostfile (``#`` comments and blank lines skipped).

    A malformed line raises :class:`ConfigurationError` naming the file and line.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise ConfigurationError(f"cannot read hostfile {path!r}: {exc.strerror}") from exc
    addresses = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            parse_address(text)
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"hostfile {path}, line {number}: {exc} (each line holds one HOST:PORT; '#' starts a comment)"
            ) from None
        addresses.append(text)
    return addresses


def wait_for_hostfile(path: str, min_workers: Optional[int], timeout: float) -> List[str]:
    """Read a hostfile; with ``min_workers``, wait until it exists and lists that many addresses."""
    if min_workers is None:
        addresses = read_hostfile(path)
        if not addresses:
            raise ConfigurationError(f"hostfile {path!r} lists no worker: put one HOST:PORT per line")
        return addresses
    deadline = time.monotonic() + timeout
    addresses: List[str] = []
    keys: Dict[str, Tuple[str, int]] = {}  # each listed name resolved once
    while True:
        if os.path.exists(path):
            addresses = distinct_servers(read_hostfile(path), keys)
            if len(addresses) >= min_workers:
                return addresses
        if time.monotonic() >= deadline:
            raise DiscoveryTimeoutError(
                f"waited {timeout:.0f} s for hostfile {path!r} to list {min_workers} workers: it lists "
                f"{len(addresses)}{'' if os.path.exists(path) else ' (the file does not exist)'}. Add "
                "HOST:PORT lines, lower min_workers, or raise the timeout of StoreDiscovery/Hostfile"
            )
        time.sleep(_POLL_SECONDS)
