"""Sharding and seeding of DataPipe graphs (pure functions over graphs, no processes)."""

from __future__ import annotations

import random

import pytest
import torch
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service.graph import (
    DistributedInfo,
    WorkerGraphSeeds,
    advance_trainer_rng,
    apply_distributed_sharding,
    distributed_info,
    draw_epoch_seed,
    init_worker_graph,
    prepare_worker_graph,
    reset_worker_graph,
    seed_chunk,
    split_dispatching,
    split_replicable,
    worker_seed_generator,
)


def draw(x):
    return (x, random.random())


def shard(dp, num_workers, rank, epoch_seed, dist=DistributedInfo()):
    """Run one worker's copy of ``dp`` for an epoch, as a worker session does."""
    import copy

    graph = copy.deepcopy(dp)
    apply_distributed_sharding(graph, dist)
    info = WorkerInfo(num_workers, rank)
    graph = init_worker_graph(graph, info, None)
    graph = reset_worker_graph(graph, info, epoch_seed, dist.global_worker_id(rank, num_workers), None)
    return list(graph)


def test_epoch_seeds_advance_and_are_reproducible():
    gen = SeedGenerator(0)
    seeds = [draw_epoch_seed(gen) for _ in range(3)]
    assert len(set(seeds)) == 3
    again = SeedGenerator(0)
    assert [draw_epoch_seed(again) for _ in range(3)] == seeds
    assert draw_epoch_seed(SeedGenerator(1)) != seeds[0]


def test_epoch_seed_is_a_function_of_the_generator_alone():
    # DataLoader2 reseeds an unseeded generator from torch's RNG before every epoch:
    # torch.manual_seed(s) before an epoch must repeat it, whatever the epoch number.
    seeds = {draw_epoch_seed(SeedGenerator(42)) for _ in range(3)}
    assert len(seeds) == 1
    assert all(0 <= s < 2**64 for s in seeds)


def test_advancing_the_trainer_rng_moves_torch_and_keeps_manual_seed_reproducible():
    torch.manual_seed(7)
    untouched = torch.randint(0, 2**62, (4,))
    torch.manual_seed(7)
    advance_trainer_rng()
    advanced = torch.randint(0, 2**62, (4,))
    torch.manual_seed(7)
    advance_trainer_rng()
    assert not torch.equal(untouched, advanced)
    assert torch.equal(torch.randint(0, 2**62, (4,)), advanced)


def test_worker_generators_share_the_shared_seed_only():
    a, b = worker_seed_generator(123, 0), worker_seed_generator(123, 1)
    assert a.generate_shared_seed() == b.generate_shared_seed()
    assert a.generate_seed() != b.generate_seed()


def test_global_worker_id():
    assert DistributedInfo().global_worker_id(2, 4) == 2
    assert DistributedInfo(rank=1, world_size=2).global_worker_id(1, 4) == 5
    assert distributed_info() == DistributedInfo(0, 1)  # no process group in this process


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_shuffle_before_sharding_is_shared_so_shards_partition_the_data(num_workers):
    dp = IterableWrapper(range(23)).shuffle().sharding_filter()
    shards = [shard(dp, num_workers, r, epoch_seed=99) for r in range(num_workers)]
    assert sorted(x for s in shards for x in s) == list(range(23))
    # A different epoch seed gives a different order.
    other = [shard(dp, num_workers, r, epoch_seed=100) for r in range(num_workers)]
    assert other != shards
    assert sorted(x for s in other for x in s) == list(range(23))


def test_randomness_after_sharding_differs_per_worker_and_repeats_per_seed():
    dp = IterableWrapper(range(8)).sharding_filter().map(draw)
    w0, w1 = shard(dp, 2, 0, 5), shard(dp, 2, 1, 5)
    assert [r for _, r in w0] != [r for _, r in w1]
    assert shard(dp, 2, 0, 5) == w0
    assert shard(dp, 2, 0, 6) != w0


def test_worker_reset_seeds_the_graph_and_global_rngs_exactly_as_torchdata_process_reset_fn():
    """reset_worker_graph seeds torch's CPU generator itself on a host with no accelerator (no
    ``torch.manual_seed``, which records a stack for CUDA): the seeds and their order stay torchdata's."""
    import numpy
    from torchdata.dataloader2.utils import process_reset_fn

    dp = IterableWrapper(range(40)).shuffle().sharding_filter().shuffle().map(draw)
    info = WorkerInfo(4, 1)

    def epoch(reset):
        graph = reset(init_worker_graph(dp, info, None))
        return list(graph), random.random(), torch.rand(2).tolist(), numpy.random.rand()

    ours = epoch(lambda graph: reset_worker_graph(graph, info, 77, 1, None))
    theirs = epoch(lambda graph: process_reset_fn(graph, info, worker_seed_generator(77, 1)))
    assert ours == theirs
    assert epoch(lambda graph: reset_worker_graph(graph, info, 78, 1, None)) != ours


def test_seeds_found_once_seed_every_epoch_as_traversing_the_graph_does():
    """A session finds its graph's random DataPipes once (WorkerGraphSeeds): each epoch then gets
    the same seeds as a reset that traverses the graph; seeds made of another graph are not used."""
    dp = IterableWrapper(range(40)).shuffle().sharding_filter().shuffle().map(draw)
    info = WorkerInfo(4, 1)
    traversed, found = init_worker_graph(dp, info, None), init_worker_graph(dp, info, None)
    seeds = WorkerGraphSeeds(found)
    for epoch_seed in (77, 78, 79):
        expected = list(reset_worker_graph(traversed, info, epoch_seed, 1, None))
        assert list(reset_worker_graph(found, info, epoch_seed, 1, None, seeds)) == expected
    other = init_worker_graph(dp, info, None)
    expected = list(reset_worker_graph(traversed, info, 80, 1, None))
    assert list(reset_worker_graph(other, info, 80, 1, None, seeds)) == expected


def _add_a_shuffle(datapipe, worker_info):
    return datapipe.shuffle()


def test_a_prepared_graph_traverses_once_and_finds_what_each_step_finds():
    """prepare_worker_graph finds the selections and seeds from one traversal of the initialised
    graph: the same SelectionFilters as selections_in, the same epochs as a reset that traverses the
    graph (also with a worker_init_fn that adds a DataPipe), in fewer pickling passes than the steps."""
    import copy

    import torch.utils.data.graph as torch_graph

    from rpc_reading_service.policies.dynamic.worker import LeasedChunks
    from rpc_reading_service.selection import selection_in_place, selections_in

    source = IterableWrapper(range(40)).shuffle().sharding_filter().shuffle().map(draw)
    with selection_in_place(source, LeasedChunks()) as shipped:
        dp = copy.deepcopy(shipped)
    info = WorkerInfo(4, 1)
    passes = []
    listing = torch_graph._list_connected_datapipes

    def counted(graph_builder):
        passes.clear()
        torch_graph._list_connected_datapipes = lambda *args: passes.append(1) or listing(*args)
        try:
            return graph_builder(), len(passes)
        finally:
            torch_graph._list_connected_datapipes = listing

    for init_fn in (None, _add_a_shuffle):
        prepared, prepared_passes = counted(lambda: prepare_worker_graph(copy.deepcopy(dp), info, init_fn))

        def by_steps():
            graph = init_worker_graph(copy.deepcopy(dp), info, init_fn)
            return graph, selections_in(graph), WorkerGraphSeeds(graph)

        (traversed, selections, _), step_passes = counted(by_steps)
        assert prepared_passes < step_passes
        assert [type(s) for s in prepared.selections] == [type(s) for s in selections] == [type(selections[0])]
        assert prepared.selections == selections_in(prepared.datapipe)  # its own graph's, the same objects
        for epoch_seed in (77, 78):
            expected = list(reset_worker_graph(traversed, info, epoch_seed, 1, None))
            got = list(reset_worker_graph(prepared.datapipe, info, epoch_seed, 1, None, prepared.seeds))
            assert got == expected and len(got) > 0
    assert prepare_worker_graph(copy.deepcopy(dp), info, None, find_seeds=False).seeds is None


def test_distributed_and_worker_sharding_combine_to_global_shards():
    dp = IterableWrapper(range(40)).sharding_filter()
    seen = []
    for dist_rank in range(2):
        for worker in range(3):
            items = shard(dp, 3, worker, 0, DistributedInfo(dist_rank, 2))
            global_id = dist_rank * 3 + worker
            assert items == [x for x in range(40) if x % 6 == global_id]
            seen += items
    assert sorted(seen) == list(range(40))


def test_split_replicable_keeps_fullsync_in_the_trainer():
    dp = IterableWrapper(range(5)).sharding_filter().map(lambda x: x + 1)
    branch, attach = split_replicable(dp)
    assert branch is dp
    assert attach(IterableWrapper([9])) is not None

    synced = IterableWrapper(range(5)).sharding_filter().fullsync()
    branch, attach = split_replicable(synced)
    assert type(branch).__name__ != "FullSyncIterDataPipe"
    trainer_graph = attach(IterableWrapper(["from workers"]))
    assert trainer_graph is synced


def test_split_dispatching_cuts_off_the_part_before_the_dispatch_point():
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
    from rpc_reading_service.graph_utils import DispatchPlaceholder

    source = IterableWrapper(range(6)).shuffle()
    dispatch = source.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    dp = dispatch.map(lambda x: x * 10).sharding_filter()
    part, rest = split_dispatching(dp)
    assert part is dispatch and rest is dp
    assert type(dp.source_datapipe.datapipe) is DispatchPlaceholder  # where MPRS puts its placeholder
    assert sorted(part) == list(range(6))  # the part runs on its own
    # A worker puts its dealt items where the placeholder is; sharding after the dispatch point
    # is not applied there (MPRS shards only the branches that do not come from the dispatcher).
    worker_graph = init_worker_graph(rest, WorkerInfo(2, 1), None, dispatched_input=IterableWrapper([1, 2, 3]))
    assert list(worker_graph) == [10, 20, 30]
    assert split_dispatching(IterableWrapper(range(3)).sharding_filter())[0] is None


def test_seed_chunk_seeds_like_torchdata_whatever_was_seeded_before():
    """The chunk's randomness is torchdata's for SeedGenerator(epoch_seed).spawn(chunk), also
    when chunks come out of order (the epoch's generator is made once and reused)."""
    from torchdata.dataloader2.utils.worker import _set_global_random_state

    numpy = pytest.importorskip("numpy")

    def draws() -> tuple:
        return random.random(), torch.rand(2).tolist(), numpy.random.rand()

    for chunk in (3, 0, 3, 1000):
        _set_global_random_state(SeedGenerator(11).spawn(chunk))
        expected = draws()
        random.seed(1), torch.manual_seed(1), numpy.random.seed(1)
        seed_chunk(11, chunk)
        assert draws() == expected, chunk


def test_worker_graphs_iterate_without_torchs_per_item_attribute_error():
    # torch's iterator hook asks every DataPipe, for every item, hasattr(dp, "_is_child_datapipe"):
    # without the flag that raised (and formatted) an AttributeError in IterDataPipe.__getattr__.
    from torch.utils.data import IterDataPipe

    lookups = []
    getattr_ = IterDataPipe.__getattr__

    def counting(self, name):
        if name == "_is_child_datapipe":
            lookups.append(type(self).__name__)
        return getattr_(self, name)

    left, right = IterableWrapper(range(40)).sharding_filter().map(_double).fork(2)
    graph = init_worker_graph(left.zip(right), WorkerInfo(2, 1), None)
    IterDataPipe.__getattr__ = counting
    try:
        items = list(graph)
    finally:
        IterDataPipe.__getattr__ = getattr_
    assert items == [(2 * x, 2 * x) for x in range(1, 40, 2)]
    assert lookups == []
    # torch's check itself still holds: a second iterator invalidates the first
    first = iter(graph)
    next(first)
    second = iter(graph)
    next(second)
    with pytest.raises(RuntimeError, match="invalidated|single iterator"):
        next(first)


def _double(x):
    return 2 * x
