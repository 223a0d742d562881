"""A factory source: ``fn(worker_info) -> iterable`` as a DataPipe the engine ships and shards."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe

from ...errors import ConfigurationError
from ...graph_utils import WorkerInfo

__all__ = ["FactorySource", "as_graph"]


class FactorySource(ShardingFilterIterDataPipe):
    """The items of ``factory(WorkerInfo(num_workers, worker_id))``: each worker builds its own
    shard, told its place as a ``sharding_filter`` is (global under torch.distributed).

    Args:
        factory: A picklable ``fn(worker_info) -> iterable``.
    """

    def __init__(self, factory: Callable[[WorkerInfo], Iterable[Any]]):
        super().__init__(None)
        self.factory = factory

    def __iter__(self) -> Iterator[Any]:
        info = WorkerInfo(self.num_of_instances, self.instance_id)
        items = self.factory(info)
        try:
            return iter(items)
        except TypeError:
            name = getattr(self.factory, "__qualname__", type(self.factory).__name__)
            raise ConfigurationError(
                f"the source factory {name} returned {type(items).__name__} for worker {info.worker_id} of "
                f"{info.num_workers}, not an iterable: return the worker's items (a list, a generator, a Dataset)"
            ) from None


def as_graph(source: Any) -> IterDataPipe:
    """``source`` as the DataPipe graph the workers run: a DataPipe as it is, a callable as a
    :class:`FactorySource`; anything else is refused."""
    if isinstance(source, (IterDataPipe, MapDataPipe)):
        return source
    if callable(source) and not isinstance(source, type):
        return FactorySource(source)
    raise ConfigurationError(
        f"source must be a DataPipe graph or a picklable factory fn(worker_info) -> iterable, got "
        f"{type(source).__name__}: wrap a list as IterableWrapper(items).sharding_filter(), or a Dataset "
        "as lambda info: shard_of(dataset, info.worker_id, info.num_workers)"
    )
