"""The reading service's checkpoint: small, versioned, and checked before it is used.

A checkpoint holds seeds and positions, never data: the epoch number, the epoch's shared
seed, how many items of each worker's shard the trainer has consumed, and whose turn
is next in the round-robin. Resuming replays each worker's shard from the same seed and
skips the consumed items, so the rest of the epoch comes out exactly as it would have.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, List

from torchdata.dataloader2.graph import DataPipe, list_dps, traverse_dps

from .errors import ConfigurationError

__all__ = ["CHECKPOINT_VERSION", "ReadingServiceState", "graph_fingerprint"]

CHECKPOINT_VERSION = 1


def graph_fingerprint(datapipe: DataPipe) -> List[str]:
    """The DataPipe classes of a graph, in traversal order: a cheap, process-independent identity."""
    return [f"{type(dp).__module__}.{type(dp).__qualname__}" for dp in list_dps(traverse_dps(datapipe))]


@dataclass
class ReadingServiceState:
    """Everything needed to continue an epoch where a checkpoint left it."""

    num_workers: int
    graph: List[str]
    epoch: int = 0
    epoch_seed: int = 0
    consumed: List[int] = field(default_factory=list)
    next_rank: int = 0
    in_epoch: bool = False
    version: int = CHECKPOINT_VERSION

    def to_bytes(self) -> bytes:
        """Serialise as JSON (readable, and nothing to unpickle)."""
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> "ReadingServiceState":
        """Parse a checkpoint, refusing other versions and malformed data."""
        try:
            values: Any = json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ConfigurationError(f"not an RPCReadingService checkpoint: {exc}") from exc
        if not isinstance(values, dict) or values.get("version") != CHECKPOINT_VERSION:
            version = values.get("version") if isinstance(values, dict) else None
            raise ConfigurationError(
                f"checkpoint has version {version!r}, this rpc_reading_service reads version {CHECKPOINT_VERSION}"
            )
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigurationError(f"malformed RPCReadingService checkpoint: {exc}") from exc

    def check_compatible(self, num_workers: int, graph: List[str]) -> None:
        """Refuse to resume with another number of workers or another graph."""
        if num_workers != self.num_workers:
            raise ConfigurationError(
                f"checkpoint was taken with num_workers={self.num_workers}, this reading service has "
                f"num_workers={num_workers}: resume with the same number of workers"
            )
        # An empty graph: checkpointed before DataLoader2 ever iterated (no position to check).
        if self.graph and graph != self.graph:
            raise ConfigurationError(
                "checkpoint was taken with a different DataPipe graph "
                f"({' -> '.join(c.rsplit('.', 1)[-1] for c in self.graph)}); resume with the same graph"
            )
