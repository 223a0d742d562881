"""What a contender is: one way of running an epoch of a workload (child side)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional

from workloads import Workload, build_datapipe


class Contender:
    """One way of running an epoch of a workload.

    ``servers`` (RPCRS-tcp, RPCDataloader) holds the addresses of worker servers that
    the parent started ahead of time, untimed.  ``epoch`` builds the loader (timed: it is
    part of the time to the first item), yields an iterable of items, and shuts it down.
    """

    name = "?"
    stops_early_cleanly = True  # may an epoch be abandoned when the time budget runs out?
    one_stream = False  # a limit with no worker count: compared at any W
    one_round = False  # full run: measured in one round only (no target depends on it)
    skipped_when_quick = False  # --quick leaves it out unless selected by name
    servers_needed: Optional[int] = None  # running worker servers it uses (None: one per worker)
    production_limit = "production-limit"  # the contender that makes the same items and moves none

    def __init__(self, servers: Optional[dict] = None):
        self.servers = servers or {}

    def load(self) -> None:
        """Import the contender's own package, as a script's imports do before any loader (the
        parent imported torch and torchdata.dataloader2 before forking every child)."""

    @contextlib.contextmanager
    def epoch(self, workload: Workload, num_workers: int) -> Iterator[Iterable]:
        """Build the loader for one epoch of ``workload`` on ``num_workers`` workers, yield
        an iterable of its items, shut it down on exit."""
        raise NotImplementedError

    @contextlib.contextmanager
    def epochs(self, workload: Workload, num_workers: int) -> Iterator[Callable[[], Iterable]]:
        """Build the loader once, as :meth:`epoch`, and yield a function that gives the
        iterable of its next epoch (the same workers serve every epoch); shut it down on exit."""
        with self.epoch(workload, num_workers) as loader:
            yield lambda: loader  # a DataLoader2 (and so its reading service) runs a new epoch per iter()

    def credit_window_bytes(self, workload: Workload, num_workers: int) -> Optional[int]:
        """Bytes the trainer may hold in flight by design (its credit window), if known."""
        return None


class DataLoader2Contender(Contender):
    """``DataLoader2(graph, reading_service=...)``; subclasses make the reading service."""

    def reading_service(self, num_workers: int):
        """The reading service to run ``num_workers`` workers with."""
        raise NotImplementedError

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        from torchdata.dataloader2 import DataLoader2

        loader = DataLoader2(build_datapipe(workload), reading_service=self.reading_service(num_workers))
        try:
            yield loader
        finally:
            loader.shutdown()
