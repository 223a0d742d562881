"""MultiProcessingReadingService's arguments and trainer-side graph, side by side with ours.

Changing the class name is the only edit a user of MPRS makes: the same keyword arguments,
the same attributes, the same items, and ``_end_datapipe`` is the user's own last DataPipe.
"""

from __future__ import annotations

import pytest
from _server_helpers import slow_identity
from torchdata.dataloader2 import DataLoader2, MultiProcessingReadingService
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from rpc_reading_service import ConfigurationError, RPCReadingService, WorkerAddresses

MPRS_KWARGS = dict(num_workers=2, multiprocessing_context="fork", worker_prefetch_cnt=3, main_prefetch_cnt=2)
READING_SERVICES = [MultiProcessingReadingService, RPCReadingService]


def double(x: int) -> int:
    return 2 * x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("service_class", READING_SERVICES, ids=lambda cls: cls.__name__)
def test_mprs_arguments_and_attributes(service_class):
    service = service_class(**MPRS_KWARGS)
    for name, value in MPRS_KWARGS.items():
        assert getattr(service, name) == value, name
    graph = IterableWrapper(range(20)).shuffle().sharding_filter().map(double)
    dl = DataLoader2(graph, reading_service=service)
    try:
        dl.seed(7)
        epoch = list(dl)
    finally:
        dl.shutdown()
    assert sorted(epoch) == [double(x) for x in range(20)]


class EndOfGraph(IterDataPipe):
    """A user's own DataPipe at the end of the graph, kept in the trainer (not replicable)."""

    def __init__(self, source: IterDataPipe):
        self.source = source

    def __iter__(self):
        yield from self.source

    def is_replicable(self) -> bool:
        return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("service_class", READING_SERVICES, ids=lambda cls: cls.__name__)
def test_end_datapipe_is_the_users_own(service_class):
    graph = EndOfGraph(IterableWrapper(range(12)).sharding_filter().map(double))
    dl = DataLoader2(graph, reading_service=service_class(num_workers=2))
    try:
        items = list(dl)
        assert type(dl.reading_service._end_datapipe) is EndOfGraph
    finally:
        dl.shutdown()
    assert sorted(items) == [double(x) for x in range(12)]


def test_multiprocessing_context_is_for_local_workers():
    with pytest.raises(ConfigurationError, match="multiprocessing_context='spawn' is for local workers"):
        RPCReadingService(workers=WorkerAddresses(["127.0.0.1:29600"]), multiprocessing_context="spawn")
    with pytest.raises(ConfigurationError, match="give prefetch or worker_prefetch_cnt"):
        RPCReadingService(prefetch=2, worker_prefetch_cnt=3)


@pytest.mark.timeout(60)
def test_main_prefetch_cnt_keeps_epochs_and_checkpoints_exact():
    # Slow items: the prefetching thread waits inside the stream when the next epoch starts.
    graph = IterableWrapper(range(60)).sharding_filter().map(slow_identity).map(double)
    dl = DataLoader2(graph, reading_service=RPCReadingService(num_workers=2, main_prefetch_cnt=3))
    try:
        first = iter(dl)
        head = [next(first) for _ in range(5)]
        state = dl.state_dict()  # the prefetching thread holds items the loop has not received
        assert sorted(dl) == [double(x) for x in range(60)]  # a new epoch after an abandoned one
    finally:
        dl.shutdown()
    resumed = DataLoader2.from_state(state, RPCReadingService(num_workers=2, main_prefetch_cnt=3))
    try:
        rest = list(resumed)
    finally:
        resumed.shutdown()
    assert head + rest == [double(x) for x in range(60)]  # in order: exactly the items not received
