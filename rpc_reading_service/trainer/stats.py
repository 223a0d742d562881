"""What ``RPCReadingService.stats()`` reports: throughput per worker and the data stall.

The data stall is the share of the trainer's wall time spent waiting for the next item
from the workers. Near 0, the workers keep up and more of them would not help; near 1,
the trainer starves and more workers (or cheaper preprocessing) would help.

``print(rs.stats())`` shows the summary line and a table with one line per worker.
Epochs are numbered from 0, as in ``for epoch in range(n): for batch in dl: ...``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["WorkerStats", "ReadingServiceStats", "ScaleDecision"]

#: Autoscale decisions ``stats()`` keeps.
KEPT_DECISIONS = 20


@dataclass
class WorkerStats:
    """One worker session as the trainer sees it, for the current epoch."""

    rank: int
    address: str
    items_consumed: int
    items_received: int
    bytes_received: int
    frames_received: int
    items_per_second: float
    queue_depth: int
    wait_seconds: float
    pid: Optional[int] = None  # the session's process id on its host
    #: Units of work the distribution policy gave this worker this epoch ("dynamic": chunks
    #: leased); None for policies where each worker owns a fixed shard.
    units: Optional[int] = None


@dataclass(frozen=True)
class ScaleDecision:
    """One decision of :class:`~rpc_reading_service.Autoscale`, at the start of an epoch."""

    #: The epoch it was taken before (counted from 0), the action (``"grow"``, ``"shrink"`` or
    #: ``"hold"``), the sessions before and wanted, and why.
    epoch: int
    action: str
    sessions_before: int
    sessions: int
    reason: str


@dataclass
class ReadingServiceStats:
    """Trainer-side statistics of the current (or last) epoch."""

    #: 0 for the first epoch of this DataLoader2, 1 for the second, ...
    epoch: int
    elapsed_seconds: float
    items: int
    items_per_second: float
    wait_seconds: float
    data_stall: float
    #: The run's sessions now (under "dynamic" a drained session's take-over is gone once its chunks came).
    workers: List[WorkerStats] = field(default_factory=list)
    #: Lost workers' shards replayed on new sessions this epoch (``on_worker_failure="reassign"``).
    reassignments: int = 0
    #: Workers whose server drained (SIGTERM) this epoch, their work handed to other servers
    #: (not failures: not among ``reassignments``).
    drains: int = 0
    #: Worker servers that joined the run for this epoch (``add_workers``, or found by watching
    #: a store or hostfile): at its start, or during it under ``distribution="dynamic"``.
    joins: int = 0
    #: With ``autoscale``: sessions added and closed by it in the run so far, its latest
    #: decisions (the last :data:`KEPT_DECISIONS`), and the servers the sessions wanted need.
    scale_ups: int = 0
    scale_downs: int = 0
    scale_decisions: List[ScaleDecision] = field(default_factory=list)
    wanted_servers: Optional[int] = None

    def as_dict(self) -> Dict[str, Any]:
        """Plain dict, e.g. for logging as JSON."""
        return asdict(self)

    def summary(self) -> str:
        """One line for a log: items/s and data stall."""
        changes = "".join(
            f", {count} {noun}{'s' if count != 1 else ''} {what}"
            for count, noun, what in (
                (self.joins, "server", "joined"), (self.drains, "worker", "drained"),
                (self.reassignments, "worker", "lost and replaced"),
            )
            if count
        )  # fmt: skip
        return (
            f"epoch {self.epoch}: {self.items} items in {self.elapsed_seconds:.1f} s "
            f"({self.items_per_second:,.0f} items/s), data stall {self.data_stall:.0%}{changes}"
        )

    def table(self) -> str:
        """One line per worker: rank, address, items, units, items/s, wait, queue depth and pid."""
        rows = [_WORKER_COLUMNS] + [
            (
                str(w.rank),
                w.address,
                f"{w.items_consumed:,}",
                "-" if w.units is None else f"{w.units:,}",
                f"{w.items_per_second:,.0f}",
                f"{w.wait_seconds:.2f}",
                str(w.queue_depth),
                "-" if w.pid is None else str(w.pid),
            )
            for w in self.workers
        ]
        widths = [max(len(row[column]) for row in rows) for column in range(len(_WORKER_COLUMNS))]
        return "\n".join(_format_row(row, widths) for row in rows)

    def __str__(self) -> str:
        if not self.workers:
            return self.summary()
        return f"{self.summary()}\n{self.table()}"


_WORKER_COLUMNS = ("rank", "address", "items", "units", "items/s", "wait s", "queue", "pid")
_TEXT_COLUMNS = {"address"}  # left-aligned; numbers are right-aligned


def _format_row(row: Sequence[str], widths: Sequence[int]) -> str:
    cells = (
        cell.ljust(width) if name in _TEXT_COLUMNS else cell.rjust(width)
        for name, cell, width in zip(_WORKER_COLUMNS, row, widths)
    )
    return "  ".join(cells).rstrip()
