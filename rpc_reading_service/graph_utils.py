"""torchdata's DataPipe graph utilities on torch's own DataPipes, without needing torchdata.

torchdata 0.10 removed ``torchdata.dataloader2`` (and ``torchdata.datapipes``), while torch
still ships its DataPipes, ``torch.utils.data.graph`` and ``graph_settings.apply_sharding``.
The functions torchdata built on them (finding, listing and replacing DataPipes, seeding a
graph, finding the dispatching part) are kept here: torchdata 0.9's code (BSD-3-Clause,
Meta Platforms, Inc.), so that a graph is split, sharded and seeded the same under any torchdata.
``sharding_round_robin_dispatch`` exists only with torchdata's DataPipes (< 0.10).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections import deque
from dataclasses import dataclass
from types import ModuleType
from typing import Deque, Dict, List, Optional, Set, Type, Union

from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe
from torch.utils.data.graph import DataPipe, DataPipeGraph, traverse_dps

from .quiet_imports import torchdata_banner_muted
from .seed_generator import SeedGenerator

__all__ = [
    "DataPipe",
    "DataPipeGraph",
    "traverse_dps",
    "WorkerInfo",
    "HAS_NUMPY",
    "find_dps",
    "list_dps",
    "replace_dp",
    "find_replicable_branches",
    "set_datapipes_seed",
    "set_graph_random_seed",
    "DispatchPlaceholder",
    "ROUND_ROBIN_DISPATCHER",
    "find_lca_round_robin_sharding_dp",
    "find_non_dispatching_branches",
    "iter_datapipe_classes",
]

#: numpy's global generator is seeded too where numpy is installed (as torchdata does).
HAS_NUMPY = importlib.util.find_spec("numpy") is not None


def _torchdata_iter() -> Optional[ModuleType]:
    """``torchdata.datapipes.iter`` where this torchdata has it (< 0.10), else None."""
    try:
        with torchdata_banner_muted():
            import torchdata.datapipes.iter as module
    except ImportError:
        return None
    return module


_TORCHDATA_ITER = _torchdata_iter()
#: torchdata's ``sharding_round_robin_dispatch`` DataPipe (None where torchdata has no DataPipes).
ROUND_ROBIN_DISPATCHER: Optional[type] = getattr(_TORCHDATA_ITER, "ShardingRoundRobinDispatcher", None)


def iter_datapipe_classes(names) -> tuple:
    """The iterable DataPipe classes of these names that exist (torchdata's, else torch's)."""
    import torch.utils.data.datapipes.iter as torch_iter

    module = _TORCHDATA_ITER or torch_iter
    return tuple(cls for cls in (getattr(module, name, None) for name in names) if cls is not None)


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's place: ``worker_id`` of ``num_workers`` (what ``worker_init_fn`` is given)."""

    num_workers: int
    worker_id: int


def find_dps(graph: DataPipeGraph, dp_type: Type[DataPipe]) -> List[DataPipe]:
    """The DataPipes of ``graph`` (a ``traverse_dps`` result) whose type is exactly ``dp_type``."""
    dps: List[DataPipe] = []
    cache: Set[int] = set()

    def helper(g) -> None:
        for dp_id, (dp, src_graph) in g.items():
            if dp_id in cache:
                continue
            cache.add(dp_id)
            if type(dp) is dp_type:
                dps.append(dp)
            helper(src_graph)

    helper(graph)
    return dps


def list_dps(graph: DataPipeGraph, exclude_dps: Optional[Union[DataPipe, List[DataPipe]]] = None) -> List[DataPipe]:
    """Every DataPipe of ``graph`` once, breadth first, leaving out ``exclude_dps`` and what precedes them."""
    dps: List[DataPipe] = []
    cache: Set[int] = set()
    if exclude_dps is not None:
        if isinstance(exclude_dps, (IterDataPipe, MapDataPipe)):
            exclude_dps = [exclude_dps]
        for exclude_dp in exclude_dps:  # type: ignore[union-attr]
            assert isinstance(exclude_dp, (IterDataPipe, MapDataPipe))
            if id(exclude_dp) in cache:
                continue
            for dp in list_dps(traverse_dps(exclude_dp)):
                cache.add(id(dp))
    q: Deque = deque()
    for dp_id, (dp, subgraph) in graph.items():
        if dp_id not in cache:
            q.append((dp_id, dp, subgraph))
            cache.add(dp_id)
    while len(q) > 0:
        dp_id, dp, subgraph = q.popleft()
        dps.append(dp)
        for parent_dp_id, (parent_dp, parent_subgraph) in subgraph.items():
            if parent_dp_id not in cache:
                q.append((parent_dp_id, parent_dp, parent_subgraph))
                cache.add(parent_dp_id)
    return dps


def replace_dp(graph: DataPipeGraph, old_datapipe: DataPipe, new_datapipe: DataPipe) -> DataPipeGraph:
    """Put ``new_datapipe`` where ``old_datapipe`` is in ``graph`` (in place) and return the new graph."""
    assert len(graph) == 1
    if id(old_datapipe) in graph:
        graph = traverse_dps(new_datapipe)
    final_datapipe = list(graph.values())[0][0]
    for recv_dp, send_graph in graph.values():
        _replace_dp(recv_dp, send_graph, old_datapipe, new_datapipe)
    return traverse_dps(final_datapipe)


def find_replicable_branches(graph: DataPipeGraph) -> List[DataPipe]:
    """The frontmost DataPipes of ``graph`` all of whose predecessors are replicable."""
    assert len(graph) == 1, "DataPipeGraph should only contain a single output DataPipe"
    dps: List[DataPipe] = []
    dp_ids: Set[int] = set()
    branch_is_replicable: Dict[int, bool] = {}
    root_dp_id = list(graph.keys())[0]
    root_dp, root_graph = graph[root_dp_id]

    def _is_replicable(root_dp_id, root_dp, root_graph) -> bool:
        if root_dp_id in branch_is_replicable:
            return branch_is_replicable[root_dp_id]
        branch_is_replicable[root_dp_id] = True
        if hasattr(root_dp, "is_replicable") and not root_dp.is_replicable():
            branch_is_replicable[root_dp_id] = False
        for dp_id, (dp, src_graph) in root_graph.items():
            if not _is_replicable(dp_id, dp, src_graph):
                branch_is_replicable[root_dp_id] = False
        if not branch_is_replicable[root_dp_id]:
            for dp_id, (dp, _) in root_graph.items():
                if dp_id in dp_ids:
                    continue
                if branch_is_replicable[dp_id]:
                    prior_dps = list_dps(traverse_dps(dp))
                    if all(id(p_dp) not in dp_ids for p_dp in prior_dps):
                        dps.append(dp)
                        dp_ids.add(dp_id)
        return branch_is_replicable[root_dp_id]

    if _is_replicable(root_dp_id, root_dp, root_graph) and root_dp_id not in dp_ids:
        prior_dps = list_dps(traverse_dps(root_dp))
        if all(id(p_dp) not in dp_ids for p_dp in prior_dps):
            dps.append(root_dp)
            dp_ids.add(root_dp_id)
    return dps


def _replace_dp(recv_dp, send_graph: DataPipeGraph, old_dp: DataPipe, new_dp: DataPipe) -> None:
    old_dp_id = id(old_dp)
    for send_id in send_graph:
        if send_id == old_dp_id:
            _assign_attr(recv_dp, old_dp, new_dp, inner_dp=True)
        else:
            send_dp, sub_send_graph = send_graph[send_id]
            _replace_dp(send_dp, sub_send_graph, old_dp, new_dp)


def _assign_attr(obj, old_dp, new_dp, inner_dp: bool = False):
    """Replace ``old_dp`` by ``new_dp`` in ``obj``'s attributes and containers (one level of DataPipe)."""
    if obj is old_dp:
        return new_dp
    if isinstance(obj, (IterDataPipe, MapDataPipe)):
        if not inner_dp:
            return None
        for k in list(obj.__dict__.keys()):
            new_obj = _assign_attr(obj.__dict__[k], old_dp, new_dp)
            if new_obj is not None:
                obj.__dict__[k] = new_obj
                break
        return None
    if isinstance(obj, dict):
        for k in list(obj.keys()):
            new_obj = _assign_attr(obj[k], old_dp, new_dp)
            if new_obj is not None:
                obj[k] = new_obj
                break
        return None
    if isinstance(obj, tuple):
        replaced = [_assign_attr(o, old_dp, new_dp, inner_dp) is not None for o in obj]
        return tuple(new_dp if hit else o for hit, o in zip(replaced, obj)) if any(replaced) else None
    if isinstance(obj, list):
        for i in range(len(obj)):
            new_obj = _assign_attr(obj[i], old_dp, new_dp, inner_dp)
            if new_obj is not None:
                obj[i] = new_obj
                break
        return None
    if isinstance(obj, set):
        if any(_assign_attr(o, old_dp, new_dp, inner_dp) is not None for o in obj):
            obj.remove(old_dp)
            obj.add(new_dp)
    return None


def set_datapipes_seed(datapipes: List[DataPipe], seed_generator: SeedGenerator, distributed_shared: bool) -> None:
    """Seed every random DataPipe (one with a ``set_seed`` method) of ``datapipes``, in order,
    from the shared stream (``distributed_shared``) or the worker's own."""
    for dp in datapipes:
        if hasattr(dp, "set_seed") and inspect.ismethod(dp.set_seed):
            dp.set_seed(seed_generator.generate_shared_seed() if distributed_shared else seed_generator.generate_seed())


def set_graph_random_seed(datapipe: DataPipe, seed_generator: SeedGenerator) -> DataPipe:
    """Seed the DataPipes before ``sharding_filter`` from the shared stream, the others from the worker's."""
    graph = traverse_dps(datapipe)
    sharding_filter_dps = find_dps(graph, ShardingFilterIterDataPipe)
    cache: Set[int] = set()
    dps_before_sharding = []
    for sf_dp in sharding_filter_dps:
        for dp in list_dps(traverse_dps(sf_dp)):
            if id(dp) not in cache:
                cache.add(id(dp))
                dps_before_sharding.append(dp)
    set_datapipes_seed(dps_before_sharding, seed_generator, distributed_shared=True)
    set_datapipes_seed(list_dps(graph, exclude_dps=sharding_filter_dps), seed_generator, distributed_shared=False)
    return datapipe


class DispatchPlaceholder(IterDataPipe):
    """Stands where the dispatching part was cut off; each worker puts its dealt items there."""

    def __iter__(self):
        raise RuntimeError("the dispatch placeholder of a graph was iterated: the worker did not replace it")


def find_lca_round_robin_sharding_dp(graph: DataPipeGraph) -> Optional[DataPipe]:
    """The lowest common ancestor of the graph's ``sharding_round_robin_dispatch`` DataPipes (None without)."""
    assert len(graph) == 1, "DataPipeGraph should only contain a single output DataPipe"
    if ROUND_ROBIN_DISPATCHER is None:
        return None
    non_replicable_dps: Set[int] = set()
    for dp in list_dps(graph):
        if id(dp) not in non_replicable_dps and type(dp) is ROUND_ROBIN_DISPATCHER:
            non_replicable_dps.update(id(par_dp) for par_dp in list_dps(traverse_dps(dp)))
    root_dp_id = list(graph.keys())[0]
    root_dp, root_graph = graph[root_dp_id]
    lca_for_subgraph: Dict[int, Optional[DataPipe]] = {}

    def _get_lca_from_graph(root_dp_id, root_dp, root_graph) -> Optional[DataPipe]:
        if root_dp_id in lca_for_subgraph:
            return lca_for_subgraph[root_dp_id]
        if root_dp_id in non_replicable_dps:
            lca_for_subgraph[root_dp_id] = root_dp
            return root_dp
        lca_for_subgraph[root_dp_id] = None
        parents = [
            found for found in (_get_lca_from_graph(i, dp, src) for i, (dp, src) in root_graph.items())
            if found is not None
        ]  # fmt: skip
        if parents:
            lca_for_subgraph[root_dp_id] = parents[0] if all(dp == parents[0] for dp in parents) else root_dp
        return lca_for_subgraph[root_dp_id]

    return _get_lca_from_graph(root_dp_id, root_dp, root_graph)


def find_non_dispatching_branches(graph: DataPipeGraph) -> List[DataPipe]:
    """The frontmost DataPipes of ``graph`` with no :class:`DispatchPlaceholder` before them."""
    assert len(graph) == 1, "DataPipeGraph should only contain a single output DataPipe"
    dps: List[DataPipe] = []
    non_dispatching: Dict[int, bool] = {}
    root_dp_id = list(graph.keys())[0]
    root_dp, root_graph = graph[root_dp_id]

    def _is_non_dispatching(root_dp_id, root_dp, root_graph) -> bool:
        if root_dp_id in non_dispatching:
            return non_dispatching[root_dp_id]
        if type(root_dp) is DispatchPlaceholder:
            non_dispatching[root_dp_id] = False
            return False
        non_dispatching[root_dp_id] = True
        for dp_id, (dp, src_graph) in root_graph.items():
            if not _is_non_dispatching(dp_id, dp, src_graph):
                non_dispatching[root_dp_id] = False
        if not non_dispatching[root_dp_id]:
            dps.extend(dp for dp_id, (dp, _) in root_graph.items() if non_dispatching[dp_id])
        return non_dispatching[root_dp_id]

    if _is_non_dispatching(root_dp_id, root_dp, root_graph):
        dps.append(root_dp)
    return dps
