"""What ``RPCReadingService.stats()`` reports: throughput per worker and the data stall.

The data stall is the share of the trainer's wall time spent waiting for the next item
from the workers. Near 0, the workers keep up and more of them would not help; near 1,
the trainer starves and more workers (or cheaper preprocessing) would help.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["WorkerStats", "ReadingServiceStats"]


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


@dataclass
class ReadingServiceStats:
    """Trainer-side statistics of the current (or last) epoch."""

    epoch: int
    elapsed_seconds: float
    items: int
    items_per_second: float
    wait_seconds: float
    data_stall: float
    workers: List[WorkerStats] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        """Plain dict, e.g. for logging as JSON."""
        return asdict(self)

    def summary(self) -> str:
        """One line for a log: items/s and data stall."""
        return (
            f"epoch {self.epoch}: {self.items} items in {self.elapsed_seconds:.1f} s "
            f"({self.items_per_second:,.0f} items/s), data stall {self.data_stall:.0%}"
        )
