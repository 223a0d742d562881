"""Pure functions over DataPipe graphs: splitting, sharding and seeding.

Everything here reuses torchdata's own graph, sharding and seed utilities so that a
graph behaves on remote workers exactly as under torchdata's reading services, with one
deliberate difference: a fresh shared seed is drawn from DataLoader2's seed generator for
every epoch (advancing it), so the epochs of a ``dl.seed(s)`` run differ.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2.graph import DataPipe, replace_dp, traverse_dps
from torchdata.dataloader2.graph.utils import _find_replicable_branches
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils import WorkerInfo, process_init_fn, process_reset_fn
from torchdata.dataloader2.utils.worker import _set_global_random_state
from torchdata.dataloader2.utils.dispatch import find_lca_round_robin_sharding_dp

from .errors import ConfigurationError
from .selection import selections_in, share_seeds_before_selections

__all__ = [
    "DistributedInfo",
    "distributed_info",
    "split_replicable",
    "apply_distributed_sharding",
    "draw_epoch_seed",
    "advance_trainer_rng",
    "worker_seed_generator",
    "init_worker_graph",
    "reset_worker_graph",
    "seed_chunk",
]

InitFn = Callable[[DataPipe, WorkerInfo], DataPipe]
ResetFn = Callable[[DataPipe, WorkerInfo, SeedGenerator], DataPipe]

# torch traverses a graph by pickling it under a process-wide reduce_ex hook, and refuses
# ("Attempt to override existing reduce_ex_hook") when another thread traverses at the same
# time: sessions of a thread-mode server set up and reset their graphs one at a time.
_traversal_lock = threading.Lock()


@dataclass(frozen=True)
class DistributedInfo:
    """This trainer's place in a torch.distributed job (rank 0 of 1 without one)."""

    rank: int = 0
    world_size: int = 1

    def global_worker_id(self, worker_rank: int, num_workers: int) -> int:
        """The global shard index of a worker: ``rank * num_workers + worker_rank``."""
        return self.rank * num_workers + worker_rank


def distributed_info() -> DistributedInfo:
    """Read rank and world size from an initialised default process group, if any."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return DistributedInfo(dist.get_rank(), dist.get_world_size())
    return DistributedInfo()


def split_replicable(datapipe: DataPipe) -> Tuple[DataPipe, Callable[[DataPipe], DataPipe]]:
    """Split a graph into the branch the workers run and a function that re-attaches the rest.

    Returns ``(replicable_branch, attach)``: ``attach(stream)`` puts the stream of items
    coming back from the workers where the branch was and returns the trainer's graph.
    Non-replicable DataPipes at the end of the graph (``fullsync`` added by
    ``DistributedReadingService``, for example) stay in the trainer.
    """
    graph = traverse_dps(datapipe)
    if find_lca_round_robin_sharding_dp(graph) is not None:
        raise ConfigurationError(
            "sharding_round_robin_dispatch is not supported by RPCReadingService: use "
            "sharding_filter() so that each worker reads its own shard"
        )
    branches = _find_replicable_branches(graph)
    if len(branches) != 1:
        raise ConfigurationError(
            f"RPCReadingService needs exactly one replicable branch in the graph, found {len(branches)}: "
            "keep non-replicable DataPipes (fullsync, prefetch in the trainer) at the end of the graph"
        )
    branch = branches[0]

    def attach(stream: DataPipe) -> DataPipe:
        if branch is datapipe:
            return stream
        replace_dp(graph, branch, stream)
        return datapipe

    return branch, attach


def apply_distributed_sharding(datapipe: DataPipe, info: DistributedInfo) -> None:
    """Apply the distributed level of sharding (idempotent with DistributedReadingService's)."""
    if info.world_size > 1:
        torch.utils.data.graph_settings.apply_sharding(
            datapipe, info.world_size, info.rank, SHARDING_PRIORITIES.DISTRIBUTED
        )


def draw_epoch_seed(seed_generator: SeedGenerator) -> int:
    """Draw this epoch's shared seed from DataLoader2's generator alone, advancing it.

    Nothing else goes in, so the generator's state decides the epoch (torchdata's contract):
    ``torch.manual_seed(s)`` before an epoch, from which DataLoader2 reseeds an unseeded
    generator, repeats it; after ``dl.seed(s)`` the advanced generator makes the next epoch differ.
    """
    return seed_generator.generate_shared_seed()


def advance_trainer_rng() -> None:
    """Take one draw from torch's global RNG in the trainer, once per epoch.

    torch's own DataLoader does the same (its base seed); without it an unseeded DataLoader2,
    which reseeds its generator from torch's RNG *under fork_rng*, would repeat its epochs
    whenever nothing else in the training loop draws from torch. Draw after the epoch's seeds:
    ``torch.manual_seed(s)`` before an epoch still reproduces it.
    """
    torch.empty((), dtype=torch.int64).random_()


def worker_seed_generator(epoch_seed: int, global_worker_id: int) -> SeedGenerator:
    """The seed generator of one worker for one epoch.

    Its shared stream is the same on every worker (shuffles before the sharding point
    agree); its worker stream is spawned from the global worker id (per-worker randomness).
    """
    return SeedGenerator(epoch_seed).spawn(global_worker_id)


def init_worker_graph(datapipe: DataPipe, worker_info: WorkerInfo, worker_init_fn: Optional[InitFn]) -> DataPipe:
    """Shard the graph for one worker and run the user's ``worker_init_fn`` (torchdata's code)."""
    with _traversal_lock:
        return process_init_fn(datapipe, worker_info, worker_init_fn)


def reset_worker_graph(
    datapipe: DataPipe,
    worker_info: WorkerInfo,
    epoch_seed: int,
    global_worker_id: int,
    worker_reset_fn: Optional[ResetFn],
) -> DataPipe:
    """Seed the graph and the global RNGs of one worker for an epoch, then run ``worker_reset_fn``."""
    generator = worker_seed_generator(epoch_seed, global_worker_id)
    with _traversal_lock:
        shared: Optional[Callable[[DataPipe], DataPipe]] = None
        if selections_in(datapipe):  # a distribution policy's replacement of sharding_filter
            shared = functools.partial(share_seeds_before_selections, seed_generator=generator)
        return process_reset_fn(datapipe, worker_info, generator, iter_reset_fn=shared, custom_reset_fn=worker_reset_fn)


def seed_chunk(epoch_seed: int, chunk: int) -> None:
    """Seed the global RNGs (``random``, torch, numpy) of a worker for one leased chunk of a "dynamic"
    epoch, from the epoch's seed and the chunk's index alone: the randomness after the sharding
    point then depends on the chunk, not on which worker got it (nor on what it did before)."""
    _set_global_random_state(SeedGenerator(epoch_seed).spawn(chunk))
