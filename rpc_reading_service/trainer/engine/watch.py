"""Watching a run's TCPStore or hostfile for worker servers that come up after the run began.

A :class:`DiscoveryWatch` is a thread of the run's :class:`~rpc_reading_service.trainer.engine.fleet.Fleet`:
every ``poll_interval`` seconds it lists the registered workers (or re-reads the hostfile once its
size or modification time changed) and hands the addresses it has not seen to the engine, which
adds them (docs/deployment.md: a server joins). Addresses the engine could not add (a server not
up yet) are tried again at the next look; addresses that leave the list are handed to the engine,
which takes them as drained from the next epoch on.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, List, Optional, Set, Tuple, Union

from ..config import Hostfile, StoreDiscovery
from ...discovery import connect_store, read_hostfile, registered_workers
from ...discovery.store import PROBE_TIMEOUT, probe_address
from ...tasks import TaskGroup

__all__ = ["DiscoveryWatch"]

log = logging.getLogger(__name__)


class DiscoveryWatch:
    """A thread listing the workers of a store or hostfile and handing new ones to ``found``.

    Args:
        source: The run's :class:`StoreDiscovery` or :class:`Hostfile` (its ``poll_interval`` is set).
        found: Called with addresses not seen before; returns those it could not add (tried again).
        store: The TCPStore this trainer hosts (None: connect to ``source.store`` as a client).
        seen: Addresses the run has already (listed at the start).
        removed: Called with the addresses listed before and no longer (none: nothing is called).
    """

    def __init__(
        self,
        source: Union[StoreDiscovery, Hostfile],
        found: Callable[[List[str]], List[str]],
        store: Any = None,
        seen: Iterable[str] = (),
        removed: Optional[Callable[[List[str]], None]] = None,
    ):
        self.source, self.found, self.removed = source, found, removed
        self._store, self._hosted = store, store is not None
        self._seen: Set[str] = set(seen)
        #: What the last look listed (what a removal is found against).
        self._previous: List[str] = list(dict.fromkeys(seen))
        #: The hostfile's (size, mtime, inode) when it was last read, and the addresses it listed.
        self._stamp: Optional[Tuple[int, int, int]] = None
        self._listed: List[str] = []
        self._failing = False
        self._tasks = TaskGroup(f"the run's watch of {self.where()}")
        self._stopped = self._tasks.stopping

    def start(self) -> None:
        """Start watching."""
        self._tasks.start("discovery-watch", self._run)

    def stop(self, timeout: float) -> None:
        """Stop watching; wait up to ``timeout`` seconds for the thread (it may be adding a server)."""
        self._tasks.stop(timeout)  # not the watch itself, if it stops itself
        self._store = None

    def _run(self) -> None:
        interval = self.source.poll_interval
        assert interval is not None
        while not self._stopped.wait(interval):
            try:
                addresses = self._addresses()
            except Exception as exc:  # noqa: BLE001 - the store or file may come back: look again later
                if not self._failing:
                    log.warning("cannot look for worker servers that join (%s): %s; looking again every %g s",
                                self.where(), exc, interval)  # fmt: skip
                self._failing = True
                continue
            if self._failing:
                log.info("%s answers again: looking for worker servers that join", self.where())
                self._failing = False
            listed = list(dict.fromkeys(addresses))
            now = set(listed)
            gone = [address for address in self._previous if address not in now]
            self._previous = listed
            if gone and not self._stopped.is_set():
                self._seen.difference_update(gone)  # listed again later: it joins again
                if self.removed is not None:
                    self.removed(gone)
            new = [address for address in listed if address not in self._seen]
            if new and not self._stopped.is_set():
                again = set(self.found(new))
                self._seen.update(address for address in new if address not in again)

    def where(self) -> str:
        """What is watched, for messages."""
        if isinstance(self.source, Hostfile):
            return f"hostfile {self.source.path}"
        return f"the TCPStore at {self.source.store}"

    def _addresses(self) -> List[str]:
        """The addresses listed now (a hostfile is read again only when it changed)."""
        source = self.source
        if isinstance(source, Hostfile):
            status = os.stat(source.path)
            stamp = (status.st_size, status.st_mtime_ns, status.st_ino)
            if stamp != self._stamp:
                self._listed, self._stamp = read_hostfile(source.path), stamp
            return self._listed
        if self._store is None:
            reason = probe_address(source.store)  # a client call on a dead store prints a C++ stack trace
            if reason is not None:
                raise ConnectionError(reason)
            self._store = connect_store(source.store, timeout=PROBE_TIMEOUT)
        try:
            return [address for _slot, address in registered_workers(self._store, source.job)]
        except Exception:
            if not self._hosted:
                self._store = None  # a new connection next time
            raise
