"""The front ends without DataLoader2 (torchdata >= 0.10) and what users run in their place:
``RemoteMapper`` vs torchdata's ``ParallelMapper(method="process")``, ``RemoteIterable`` under
torch's DataLoader vs ``DataLoader(num_workers=W)`` (``alternatives.TorchDataLoader``).

Not in ``CONTENDERS``: ``bench_frontends.py`` adds them, in the environment with torchdata.nodes.
"""

from __future__ import annotations

import contextlib
import gc

from workloads import build_datapipe, item_function

from benchsuite.contenders.base import Contender


def mapped_function(workload):
    """What a mapper applies to each index: the workload's item function (``int`` for plain ints)."""
    return item_function(workload) or int


class LoaderContender(Contender):
    """A contender whose loader serves every epoch: :meth:`epochs` builds it, :meth:`epoch` is its first."""

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        with self.epochs(workload, num_workers) as next_epoch:
            yield next_epoch()


class MapperContender(LoaderContender):
    """A torchdata.nodes mapper over ``IterableWrapper(range(N))`` that makes each item from its
    index in its workers (``workloads.item_function``), read through ``Loader``."""

    def mapper(self, source, fn, num_workers: int):
        """The mapper node over ``source``."""
        raise NotImplementedError

    @contextlib.contextmanager
    def epochs(self, workload, num_workers):
        from torchdata.nodes import IterableWrapper, Loader

        mapper = self.mapper(IterableWrapper(range(workload.n_items)), mapped_function(workload), num_workers)
        loader = Loader(mapper)
        try:
            yield lambda: iter(loader)
        finally:
            close = getattr(mapper, "close", None)
            if close is not None:
                close()
            del loader, mapper
            gc.collect()  # ParallelMapper has no close(): its processes and queues go with it


class ParallelMapperContender(MapperContender):
    """``ParallelMapper(source, fn, num_workers=W, method="process")``, default settings otherwise."""

    name = "ParallelMapper"

    def mapper(self, source, fn, num_workers):
        from torchdata.nodes import ParallelMapper

        return ParallelMapper(source, fn, num_workers=num_workers, method="process")


class RemoteMapperContender(MapperContender):
    """``RemoteMapper(source, fn, num_workers=W)``: local workers, default settings."""

    name = "RemoteMapper"

    def mapper(self, source, fn, num_workers):
        from rpc_reading_service import RemoteMapper

        return RemoteMapper(source, fn, num_workers=num_workers)


class RemoteIterableContender(LoaderContender):
    """``DataLoader(RemoteIterable(graph, num_workers=W), batch_size=None)``: the graph of
    ``workloads.build_datapipe`` on local workers, torch's DataLoader in the trainer."""

    name = "RemoteIterable"

    @contextlib.contextmanager
    def epochs(self, workload, num_workers):
        from torch.utils.data import DataLoader

        from rpc_reading_service import RemoteIterable

        dataset = RemoteIterable(build_datapipe(workload), num_workers=num_workers)
        loader = DataLoader(dataset, batch_size=None)
        try:
            yield lambda: iter(loader)
        finally:
            dataset.close()


FRONT_ENDS = (ParallelMapperContender, RemoteMapperContender, RemoteIterableContender)
