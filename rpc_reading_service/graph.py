"""Pure functions over DataPipe graphs: splitting, sharding and seeding.

Everything here reuses torchdata's own graph, sharding and seed utilities so that a
graph behaves on remote workers exactly as under torchdata's reading services, with one
deliberate difference: a fresh shared seed is drawn from DataLoader2's seed generator for
every epoch (advancing it), so the epochs of a ``dl.seed(s)`` run differ.
"""

from __future__ import annotations

import functools
import random
import threading
from dataclasses import dataclass
from typing import Callable, ContextManager, List, Optional, Tuple

import torch
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES, ShardingFilterIterDataPipe

from .chunk_seeds import spawned_seeds
from .errors import ConfigurationError
from .graph_utils import (
    HAS_NUMPY,
    ROUND_ROBIN_DISPATCHER,
    DataPipe,
    DataPipeGraph,
    DispatchPlaceholder,
    WorkerInfo,
    find_dps,
    find_lca_round_robin_sharding_dp,
    find_non_dispatching_branches,
    find_replicable_branches,
    iter_datapipe_classes,
    list_dps,
    replace_dp,
    set_datapipes_seed,
    set_graph_random_seed,
    traverse_dps,
)
from .seed_generator import SeedGenerator
from .selection import SelectionFilter, datapipes_before, selections_in, share_seeds_before_selections

__all__ = [
    "graph_traversal",
    "DistributedInfo",
    "distributed_info",
    "new_seed_group",
    "destroy_seed_group",
    "split_dispatching",
    "check_per_item_after_dispatch",
    "split_replicable",
    "apply_distributed_sharding",
    "draw_epoch_seed",
    "advance_trainer_rng",
    "worker_seed_generator",
    "init_worker_graph",
    "WorkerGraph",
    "prepare_worker_graph",
    "reset_worker_graph",
    "WorkerGraphSeeds",
    "reset_dispatching_graph",
    "warm_up_worker_graph_utilities",
    "seed_chunk",
    "settle_iterator_checks",
]

InitFn = Callable[[DataPipe, WorkerInfo], DataPipe]
ResetFn = Callable[[DataPipe, WorkerInfo, SeedGenerator], DataPipe]

# torch traverses a graph by pickling it under process-wide getstate/reduce_ex hooks, and refuses
# ("Attempt to override existing getstate_hook") when another thread traverses at the same
# time: sessions of a thread-mode server set up and reset their graphs one at a time. Reentrant,
# so that a session's setup holds it across init_worker_graph and its own look at the graph.
_traversal_lock = threading.RLock()


def graph_traversal() -> ContextManager[bool]:
    """Hold this while traversing a DataPipe graph (``traverse_dps``, directly or through
    torchdata) in a process whose other threads may traverse too: the functions of this module
    hold it already; nesting is fine."""
    return _traversal_lock


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


def new_seed_group(dist: DistributedInfo) -> Optional[object]:
    """A gloo process group over which the trainers share each epoch's seed (None without torch.distributed)."""
    if dist.world_size <= 1:
        return None
    return torch.distributed.new_group(backend="gloo")


def destroy_seed_group(group: Optional[object]) -> None:
    """Destroy a group of :func:`new_seed_group` (None: nothing to do; a group already gone is fine)."""
    if group is not None:
        try:
            torch.distributed.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - the default group may already be gone
            pass


def split_dispatching(datapipe: DataPipe) -> Tuple[Optional[DataPipe], DataPipe]:
    """Cut off the non-replicable part before ``sharding_round_robin_dispatch``, as MPRS does.

    Returns ``(dispatching_part, graph)``: the dispatching part is the lowest common ancestor
    of the graph's ``sharding_round_robin_dispatch`` DataPipes (torchdata's own search), run
    once per epoch by the trainer's dispatcher; in ``graph`` (the same graph, changed in place
    as MPRS changes it) torchdata's placeholder stands where it was, and each worker puts the
    source of its dealt items there (:func:`init_worker_graph`). ``(None, datapipe)`` for a
    graph without dispatching.
    """
    graph = traverse_dps(datapipe)
    dispatching = find_lca_round_robin_sharding_dp(graph)
    if dispatching is None:
        return None, datapipe
    graph = replace_dp(graph, dispatching, DispatchPlaceholder())
    return dispatching, list(graph.values())[0][0]


def check_per_item_after_dispatch(graph: DataPipe, policy: str) -> None:
    """Refuse a workers' graph (``graph``, with torchdata's dispatch placeholder) whose DataPipes
    after the dispatch point do not map each dispatched item to its outputs on their own, for a
    ``policy`` that resequences outputs by dispatched item ("dynamic"): a map, filter or flatmap
    is fine (0..k outputs per input); a DataPipe that holds items across inputs (batch, shuffle,
    bucketing, grouping, prefetch) would mix the items of units other workers may have, and a
    ``sharding_filter`` or ``header`` there would drop units by worker."""
    holding = iter_datapipe_classes(_HOLDS_ACROSS_INPUTS)
    dispatch_points = tuple(cls for cls in (ROUND_ROBIN_DISPATCHER, DispatchPlaceholder) if cls is not None)
    found, levels = set(), [traverse_dps(graph)]
    while levels:  # the DataPipes down to the dispatch point (the part before it may hold anything)
        for datapipe, inputs in levels.pop().values():
            if not isinstance(datapipe, dispatch_points):
                if isinstance(datapipe, holding):
                    found.add(type(datapipe).__name__)
                levels.append(inputs)
    if found:
        raise ConfigurationError(
            f"distribution={policy!r} with sharding_round_robin_dispatch resequences the outputs of each dispatched "
            f"item, and the graph after the dispatch point has {', '.join(sorted(found))}, which hold items across inputs "
            "(or pick them by worker rank): move them before sharding_round_robin_dispatch, or to the trainer's end "
            "of the graph after a non-replicable DataPipe, or use distribution='round_robin'"
        )


#: DataPipes (``torchdata.datapipes.iter`` names) that hold items across their inputs.
_HOLDS_ACROSS_INPUTS = (
    "Batcher", "BucketBatcher", "MaxTokenBucketizer", "Shuffler", "Grouper", "Prefetcher", "ShardingFilter",
    "Header",  # a per-worker limit: which items it keeps would depend on the workers' speeds
)  # fmt: skip


def split_replicable(datapipe: DataPipe) -> Tuple[DataPipe, Callable[[DataPipe], DataPipe]]:
    """Split a graph into the branch the workers run and a function that re-attaches the rest.

    Returns ``(replicable_branch, attach)``: ``attach(stream)`` puts the stream of items
    coming back from the workers where the branch was and returns the trainer's graph.
    Non-replicable DataPipes at the end of the graph (``fullsync`` added by
    ``DistributedReadingService``, for example) stay in the trainer. A dispatching part is
    cut off first (:func:`split_dispatching`).
    """
    graph = traverse_dps(datapipe)
    branches = find_replicable_branches(graph)
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


def init_worker_graph(
    datapipe: DataPipe,
    worker_info: WorkerInfo,
    worker_init_fn: Optional[InitFn],
    dispatched_input: Optional[DataPipe] = None,
) -> DataPipe:
    """Shard the graph for one worker and run the user's ``worker_init_fn`` (torchdata's
    ``process_init_fn``, step by step).

    A graph cut by :func:`split_dispatching` gets ``dispatched_input`` (the source of the
    items dealt to this worker) in place of the placeholder, and only its branches that do
    not come from the dispatcher are sharded, as torchdata's ``process_init_fn`` does with
    MPRS's dispatching queues.
    """
    return _initialised_worker_graph(datapipe, worker_info, worker_init_fn, dispatched_input)[0]


def _initialised_worker_graph(
    datapipe: DataPipe,
    worker_info: WorkerInfo,
    worker_init_fn: Optional[InitFn],
    dispatched_input: Optional[DataPipe],
) -> Tuple[DataPipe, DataPipeGraph]:
    """:func:`init_worker_graph`'s graph, and its traversal (``traverse_dps``) as it is returned."""
    with _traversal_lock:
        graph = traverse_dps(datapipe)
        placeholders = find_dps(graph, DispatchPlaceholder)
        if not placeholders:  # process_init_fn's own case, without traversing the graph again to find out
            torch.utils.data.graph_settings.apply_sharding(
                datapipe, worker_info.num_workers, worker_info.worker_id, SHARDING_PRIORITIES.MULTIPROCESSING
            )
        else:
            if dispatched_input is None:
                raise ConfigurationError(
                    "this graph was cut for dispatching (sharding_round_robin_dispatch) but the worker has no "
                    "dispatched input for it; update rpc_reading_service on the worker to the trainer's version"
                )
            for branch in find_non_dispatching_branches(graph):
                torch.utils.data.graph_settings.apply_sharding(
                    branch, worker_info.num_workers, worker_info.worker_id, SHARDING_PRIORITIES.MULTIPROCESSING
                )
            datapipe = list(replace_dp(graph, placeholders[0], dispatched_input).values())[0][0]
        datapipe = _run_worker_init_fn(worker_init_fn, datapipe, worker_info)
        # Traversed again: a DataPipe's apply_sharding or the worker_init_fn may add DataPipes.
        finished = traverse_dps(datapipe)
        settle_iterator_checks(datapipe, finished)
        return datapipe, finished


@dataclass(frozen=True)
class WorkerGraph:
    """A worker session's graph, sharded and initialised (:func:`init_worker_graph`), with what
    its epochs need of it: its :class:`~rpc_reading_service.selection.SelectionFilter` DataPipes
    and its :class:`WorkerGraphSeeds` (None: each reset traverses the graph)."""

    datapipe: DataPipe
    selections: List[SelectionFilter]
    seeds: Optional[WorkerGraphSeeds]


def prepare_worker_graph(
    datapipe: DataPipe,
    worker_info: WorkerInfo,
    worker_init_fn: Optional[InitFn],
    dispatched_input: Optional[DataPipe] = None,
    find_seeds: bool = True,
) -> WorkerGraph:
    """:func:`init_worker_graph`, then the graph's selections (:func:`selections_in`) and, with
    ``find_seeds``, its :class:`WorkerGraphSeeds`, all from one traversal of the initialised graph:
    each traversal pickles the whole graph (about 0.1 ms of CPU per DataPipe), and a session's
    setup used to make seven. Nothing changes the graph between them (setting torch's iterator
    flag adds no DataPipe), so each finds what its own traversal would."""
    with _traversal_lock:
        datapipe, traversal = _initialised_worker_graph(datapipe, worker_info, worker_init_fn, dispatched_input)
        seeds = WorkerGraphSeeds(datapipe, traversal) if find_seeds else None
        return WorkerGraph(datapipe, selections_in(datapipe, traversal), seeds)


def settle_iterator_checks(datapipe: DataPipe, traversal: Optional[DataPipeGraph] = None) -> DataPipe:
    """``datapipe``, every DataPipe of its graph given torch's ``_is_child_datapipe`` flag (False)
    where it has none; returned for chaining. ``traversal``: the graph's ``traverse_dps``, if the
    caller has it (else it is traversed).

    torch's iterator hook checks, for every item each DataPipe yields, whether the DataPipe is a
    fork's child with ``hasattr(datapipe, "_is_child_datapipe")``: on a DataPipe without the flag
    that raises, inside ``IterDataPipe.__getattr__``, an AttributeError with a formatted message,
    about 3 us per item per DataPipe. With the flag set the check takes the same branch (not a
    child) without raising. Children (``fork``, ``demux``) keep theirs.
    """
    with _traversal_lock:
        for dp in list_dps(traverse_dps(datapipe) if traversal is None else traversal):
            if not hasattr(dp, "_is_child_datapipe"):
                try:
                    dp._is_child_datapipe = False
                except AttributeError:  # __slots__ or a read-only __setattr__: the check stays as it was
                    pass
    return datapipe


def _run_worker_init_fn(
    worker_init_fn: Optional[InitFn], datapipe: DataPipe, worker_info: WorkerInfo
) -> DataPipe:
    """``worker_init_fn(datapipe, worker_info)`` (or ``datapipe`` without one), checked to be a
    DataPipe as torchdata's ``process_init_fn`` asserts, but with a message that says what to do."""
    if worker_init_fn is None:
        return datapipe
    result = worker_init_fn(datapipe, worker_info)
    if not isinstance(result, (IterDataPipe, MapDataPipe)):
        name = getattr(worker_init_fn, "__qualname__", type(worker_init_fn).__name__)
        raise ConfigurationError(
            f"worker_init_fn {name} returned {type(result).__name__} on worker {worker_info.worker_id} "
            f"of {worker_info.num_workers}, not a DataPipe: return the DataPipe it was given (or one "
            "built on it), e.g. end it with `return datapipe`"
        )
    return result


class WorkerGraphSeeds:
    """The DataPipes that each epoch of one worker graph seeds, found once.

    Finding them is torchdata's graph traversal, which pickles the whole graph: about three
    quarters of a reset's CPU, paid per session and per epoch, all at an epoch's start. These
    are the lists ``set_graph_random_seed`` and :func:`share_seeds_before_selections` build
    (with torchdata's own ``traverse_dps``, ``find_dps`` and ``list_dps``, in their order), and
    :meth:`seed` seeds them with torchdata's ``set_datapipes_seed``: the same draws in the same
    order. Valid while the graph keeps its structure: a session builds one only when there is no
    ``worker_reset_fn`` (which may rebuild the graph), and :func:`reset_worker_graph` uses it only
    for the graph it was made of.
    """

    def __init__(self, datapipe: DataPipe, traversal: Optional[DataPipeGraph] = None):
        """``traversal``: ``traverse_dps(datapipe)``, if the caller has it (else it is traversed)."""
        with _traversal_lock:
            self.graph = datapipe
            graph = traverse_dps(datapipe) if traversal is None else traversal
            sharding = find_dps(graph, ShardingFilterIterDataPipe)
            self._shared = datapipes_before(sharding)  # set_graph_random_seed's "dps_before_sharding"
            self._local = list_dps(graph, exclude_dps=sharding)
            self._before_selections = datapipes_before(selections_in(datapipe, graph))

    def seed(self, seed_generator: SeedGenerator) -> None:
        """Seed as ``set_graph_random_seed``, then :func:`share_seeds_before_selections`, do."""
        set_datapipes_seed(self._shared, seed_generator, distributed_shared=True)
        set_datapipes_seed(self._local, seed_generator, distributed_shared=False)
        set_datapipes_seed(self._before_selections, seed_generator, distributed_shared=True)


def reset_worker_graph(
    datapipe: DataPipe,
    worker_info: WorkerInfo,
    epoch_seed: int,
    global_worker_id: int,
    worker_reset_fn: Optional[ResetFn],
    seeds: Optional[WorkerGraphSeeds] = None,
) -> DataPipe:
    """Seed the graph and the global RNGs of one worker for an epoch, then run ``worker_reset_fn``:
    torchdata's ``process_reset_fn``, step by step, with the global RNGs seeded by
    :func:`_seed_global_rngs` (the same seeds, drawn in the same order). ``seeds``: the graph's
    :class:`WorkerGraphSeeds`, if it was made of ``datapipe`` (else the graph is traversed)."""
    generator = worker_seed_generator(epoch_seed, global_worker_id)
    with _traversal_lock:
        _seed_global_rngs(generator)
        if seeds is not None and seeds.graph is datapipe:
            seeds.seed(generator)
        else:
            set_graph_random_seed(datapipe, generator)
            # a distribution policy's replacements of sharding_filter (none: no seed is drawn)
            datapipe = share_seeds_before_selections(datapipe, seed_generator=generator)
        if worker_reset_fn is not None:
            datapipe = worker_reset_fn(datapipe, worker_info, generator)
            assert isinstance(datapipe, (IterDataPipe, MapDataPipe)), "worker_reset_fn must return a DataPipe"
            settle_iterator_checks(datapipe)  # it may have built new DataPipes
        return datapipe


def _seed_global_rngs(seed_generator: SeedGenerator) -> None:
    """Seed ``random``, torch and numpy from ``seed_generator`` as torchdata does (same draws, same order)."""
    python_seed, torch_seed = seed_generator.generate_seed(), seed_generator.generate_seed()
    _apply_global_seeds(python_seed, torch_seed, seed_generator.generate_seed() if HAS_NUMPY else None)


def _apply_global_seeds(python_seed: int, torch_seed: int, numpy_seed: Optional[int]) -> None:
    """Seed ``random``, torch and numpy (unless None) with torchdata's three draws, as its
    ``_set_global_random_state`` does. On a host with no accelerator only torch's CPU generator
    is seeded: ``torch.manual_seed`` would also queue a seed for a CUDA that can never start
    here, recording the caller's stack (``traceback.format_stack``, about 1 ms of CPU per epoch
    and per leased chunk)."""
    random.seed(python_seed)
    if _accelerator_available():
        torch.manual_seed(torch_seed)
    else:
        torch.default_generator.manual_seed(torch_seed)
    if numpy_seed is not None:
        import numpy

        numpy.random.seed(numpy_seed >> 32)  # torchdata's uint64 to uint32


def _accelerator_available() -> bool:
    """Whether this host has a device whose generator ``torch.manual_seed`` would seed."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def reset_dispatching_graph(datapipe: DataPipe, epoch_seed: int) -> DataPipe:
    """Seed the dispatching part for an epoch from its shared seed, as MPRS seeds its
    dispatching process: every random DataPipe there draws from the shared stream.

    Unlike that process, the dispatcher is a thread of the trainer: the global RNGs
    (``random``, ``torch``, ``numpy``) are the trainer's and are left alone.
    """
    generator = SeedGenerator(epoch_seed)
    with _traversal_lock:
        set_datapipes_seed(list_dps(traverse_dps(datapipe)), seed_generator=generator, distributed_shared=True)
    return datapipe


def warm_up_worker_graph_utilities() -> None:
    """Shard, seed and iterate a tiny graph once, as a session does.

    A server that forks its sessions calls this first: torchdata's first traversal and
    seeding of a graph (lazy imports, caches) cost about 15 ms of CPU, which every forked
    session would otherwise pay again, all at once when a trainer opens many sessions.
    The graph maps with a function, a builtin and a ``functools.partial``, as graphs do:
    torch's traversal checks each attribute against the DataPipe classes, and the first
    check of a type walks all their subclasses (~3 ms of CPU per session for a graph's
    usual types, unless the server's caches already hold the answer).
    """
    from torch.utils.data.datapipes.iter import IterableWrapper

    info = WorkerInfo(1, 0)
    tiny = IterableWrapper(range(1)).sharding_filter().map(abs).map(functools.partial(_same)).map(_same)
    graph = init_worker_graph(tiny, info, None)
    list(reset_worker_graph(graph, info, 0, 0, None))


def _same(value: object) -> object:
    return value


def seed_chunk(epoch_seed: int, chunk: int) -> None:
    """Seed the global RNGs (``random``, torch, numpy) of a worker for one leased chunk of a "dynamic"
    epoch, from the epoch's seed and the chunk's index alone: the randomness after the sharding
    point then depends on the chunk, not on which worker got it (nor on what it did before).
    The seeds are ``SeedGenerator(epoch_seed).spawn(chunk)``'s, computed without building it
    (:func:`~rpc_reading_service.chunk_seeds.spawned_seeds`: a sixth of its CPU, per chunk)."""
    python_seed, torch_seed, numpy_seed = spawned_seeds(epoch_seed, chunk)
    _apply_global_seeds(python_seed, torch_seed, numpy_seed if HAS_NUMPY else None)
