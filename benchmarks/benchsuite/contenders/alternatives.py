"""What users run instead: torchdata's MultiProcessingReadingService, torch's DataLoader
and the rpcdataloader package."""

from __future__ import annotations

import contextlib
import gc

from workloads import MapDataset, build_datapipe

from benchsuite.contenders.base import Contender, DataLoader2Contender


class MPRS(DataLoader2Contender):
    """torchdata's MultiProcessingReadingService, default settings.

    Its shutdown in the middle of an epoch can hang (meta-pytorch/data#1228 family), so
    its epochs always run to their end: workloads are sized (item caps) to finish.
    """

    name = "MPRS"
    stops_early_cleanly = False

    def reading_service(self, num_workers):
        from torchdata.dataloader2 import MultiProcessingReadingService

        return MultiProcessingReadingService(num_workers=num_workers)


class TorchDataLoader(Contender):
    """``torch.utils.data.DataLoader(graph, num_workers=N, batch_size=None)``: what most users
    run today.  It shards a DataPipe graph by worker itself (``sharding_filter``), so every
    worker makes the same items as under the reading services.  Default settings otherwise
    (fork, ``prefetch_factor=2``, no pinning).
    """

    name = "torch-DataLoader"

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        from torch.utils.data import DataLoader

        loader = DataLoader(build_datapipe(workload), batch_size=None, num_workers=num_workers)
        iterator = iter(loader)
        try:
            yield iterator
        finally:
            _shut_down(iterator)

    @contextlib.contextmanager
    def epochs(self, workload, num_workers):
        """With ``persistent_workers=True``: its workers serve every epoch, as the reading
        services' do (by default it would start new workers for each epoch)."""
        from torch.utils.data import DataLoader

        loader = DataLoader(build_datapipe(workload), batch_size=None, num_workers=num_workers,
                            persistent_workers=num_workers > 0)
        try:
            yield lambda: iter(loader)
        finally:
            _shut_down(loader._iterator)


def _shut_down(iterator) -> None:
    """What a DataLoader iterator's ``__del__`` does, called here so that its shutdown is timed
    as the others' are, not whenever the last reference goes."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


class RPCDataloaderContender(Contender):
    """rpcdataloader 0.2.1: a map-style dataset on running ``rpcdataloader.launch`` workers."""

    name = "RPCDataloader"
    network_timeout_s = 60

    def load(self) -> None:
        import rpcdataloader  # noqa: F401

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        import rpcdataloader

        dataset = rpcdataloader.RPCDataset(self.servers["addresses"][:num_workers], MapDataset,
                                           workload.to_dict())
        loader = rpcdataloader.RPCDataloader(dataset, batch_size=None, timeout=self.network_timeout_s)
        try:
            yield loader
        finally:
            del loader, dataset
            gc.collect()  # its remote-handle finalizers free the remote datasets
