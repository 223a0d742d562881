"""The graph utilities and seed generator kept from torchdata 0.9 give what torchdata's own give
(where torchdata still has them), so graphs split, shard and seed alike under any torchdata."""

from __future__ import annotations

import random

import pytest
from torch.utils.data.datapipes.iter import IterableWrapper

from rpc_reading_service import graph_utils
from rpc_reading_service.seed_generator import SeedGenerator

torchdata_graph = pytest.importorskip("torchdata.dataloader2.graph", reason="needs torchdata < 0.10 to compare with")
from torchdata.dataloader2.graph.utils import _find_replicable_branches  # noqa: E402
from torchdata.dataloader2.random import SeedGenerator as TorchdataSeedGenerator  # noqa: E402
from torchdata.dataloader2.utils import dispatch as torchdata_dispatch  # noqa: E402
from torchdata.datapipes.iter import ShardingRoundRobinDispatcher  # noqa: E402
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1, 2**32 + 7, 2**64 - 1, 123456789])
def test_seed_generator_draws_as_torchdata(seed):
    ours, theirs = SeedGenerator(seed), TorchdataSeedGenerator(seed)
    for index in (0, 1, 5, 2**33):
        a, b = ours.spawn(index), theirs.spawn(index)
        assert [a.generate_seed() for _ in range(5)] == [b.generate_seed() for _ in range(5)]
        assert [a.generate_shared_seed() for _ in range(3)] == [b.generate_shared_seed() for _ in range(3)]
    assert [ours.generate_shared_seed() for _ in range(7)] == [theirs.generate_shared_seed() for _ in range(7)]


def test_unseeded_generators_take_torchs_global_seed_alike():
    import torch

    torch.manual_seed(5)
    ours = SeedGenerator().generate_seed()
    torch.manual_seed(5)
    assert ours == TorchdataSeedGenerator().generate_seed()


def _graph():
    source = IterableWrapper(range(20)).shuffle()
    left, right = source.sharding_filter().map(abs).fork(2)
    return left.shuffle().zip(right.map(str)).shuffle()


def test_graph_functions_find_and_seed_as_torchdata():
    graph = _graph()
    traversal = graph_utils.traverse_dps(graph)
    assert graph_utils.list_dps(traversal) == torchdata_graph.list_dps(traversal)
    for kind in {type(dp) for dp in graph_utils.list_dps(traversal)}:
        assert graph_utils.find_dps(traversal, kind) == torchdata_graph.find_dps(traversal, kind)
    assert graph_utils.find_replicable_branches(traversal) == _find_replicable_branches(traversal)
    ours, theirs = _graph(), _graph()
    graph_utils.set_graph_random_seed(ours, SeedGenerator(3).spawn(1))
    torchdata_graph.set_graph_random_seed(theirs, TorchdataSeedGenerator(3).spawn(1))
    random.seed(0)
    assert list(ours) == list(theirs)


def test_dispatch_point_found_as_torchdata():
    dispatch = IterableWrapper(range(6)).shuffle().sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    graph = graph_utils.traverse_dps(dispatch.map(abs).zip(IterableWrapper(range(6)).sharding_filter()))
    assert graph_utils.ROUND_ROBIN_DISPATCHER is ShardingRoundRobinDispatcher
    found = graph_utils.find_lca_round_robin_sharding_dp(graph)
    assert found is dispatch and found is torchdata_dispatch.find_lca_round_robin_sharding_dp(graph)
    replaced = graph_utils.replace_dp(graph, dispatch, graph_utils.DispatchPlaceholder())
    theirs = graph_utils.replace_dp(graph_utils.traverse_dps(dispatch.map(abs)), dispatch, torchdata_dispatch._DummyIterDataPipe())
    assert [type(dp).__name__ for dp in graph_utils.find_non_dispatching_branches(replaced)] == ["ShardingFilterIterDataPipe"]
    assert torchdata_dispatch.find_non_dispatching_branches(theirs) == []
