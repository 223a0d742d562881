"""The reading service's checkpoint: small, versioned, and checked before it is used.

A checkpoint holds seeds and positions, never data: the epoch number, the epoch's shared
seed, how many items of each worker's shard the trainer has consumed, and whose turn
is next in the round-robin. Resuming replays each worker's shard from the same seed and
skips the consumed items, so the rest of the epoch comes out exactly as it would have.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from torchdata.dataloader2.graph import DataPipe, list_dps, traverse_dps

from .errors import ConfigurationError

__all__ = [
    "CHECKPOINT_VERSION",
    "ReadingServiceState",
    "graph_fingerprint",
    "seed_generator_state",
    "load_seed_generator_state",
]

CHECKPOINT_VERSION = 1


def graph_fingerprint(datapipe: DataPipe) -> List[str]:
    """The DataPipe classes of a graph, in traversal order: a cheap, process-independent identity."""
    return [f"{type(dp).__module__}.{type(dp).__qualname__}" for dp in list_dps(traverse_dps(datapipe))]


_RNGS = ("_shared_rng", "_worker_rng")
_ENGINE_FIELDS = ("_seed", "_ctr", "_generated_seeds", "_spawn_seed")


def seed_generator_state(generator: Any) -> Optional[Dict[str, Dict[str, Any]]]:
    """The exact state of a torchdata ``SeedGenerator``, as JSON-able ints (None if unknown)."""
    try:
        return {rng: {f: getattr(getattr(generator, rng), f) for f in _ENGINE_FIELDS} for rng in _RNGS}
    except AttributeError:
        return None


def load_seed_generator_state(generator: Any, state: Dict[str, Dict[str, Any]]) -> None:
    """Put a state from :func:`seed_generator_state` back into ``generator``, in place."""
    for rng in _RNGS:
        engine, values = getattr(generator, rng), state[rng]
        engine._seed = tuple(int(v) for v in values["_seed"])
        engine._ctr = [int(v) for v in values["_ctr"]]
        generated = values["_generated_seeds"]
        engine._generated_seeds = None if generated is None else [int(v) for v in generated]
        engine._spawn_seed = tuple(int(v) for v in values["_spawn_seed"])


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
    #: DataLoader2's seed generator at the checkpoint: resuming puts it back, because reading
    #: services before ours (DistributedReadingService) draw from it again when the epoch resumes.
    seed_generator: Optional[Dict[str, Dict[str, Any]]] = None
    #: This trainer's place in a torch.distributed job: each rank resumes its own shards.
    dist_rank: int = 0
    dist_world_size: int = 1

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

    def check_compatible(
        self, num_workers: int, graph: List[str], dist_rank: int = 0, dist_world_size: int = 1
    ) -> None:
        """Refuse to resume with another number of workers, another graph, or another trainer rank."""
        if (dist_rank, dist_world_size) != (self.dist_rank, self.dist_world_size):
            raise ConfigurationError(
                f"checkpoint was taken by trainer rank {self.dist_rank} of {self.dist_world_size}, this is "
                f"rank {dist_rank} of {dist_world_size}: each rank must resume from its own state, with the "
                "same world size"
            )
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
