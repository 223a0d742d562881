"""The trainer's frame limit (``TransportConfig(max_frame_bytes=...)``) reaches its workers in SETUP:
they pack frames within it, and an item too large for any frame fails in the graph, named, instead of
breaking the connection (and, under reassignment, every worker that replays it in turn)."""

from __future__ import annotations

import types

import pytest
import torch
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import remote, run_epochs, running_server
from rpc_reading_service import ItemTooLargeError, RPCReadingService, TransportConfig
from rpc_reading_service.protocol import DEFAULT_MAX_FRAME_BYTES, SessionOptions, data_nbytes

MiB = 1 << 20


@pytest.mark.parametrize("limit", [1024, 300_000, MiB, 2 * MiB, DEFAULT_MAX_FRAME_BYTES])
def test_frames_packed_within_a_limit_fit_it_with_the_largest_item_on_top(limit):
    options = SessionOptions().within(limit)
    largest = options.largest_item_bytes()
    # The worst frame: the batch open just short of its bounds, sealed by the largest item.
    small = [types.SimpleNamespace(nbytes=0)] * (options.batch_max_items - 2)
    frame = [*small, types.SimpleNamespace(nbytes=options.frame_max_bytes - 1), types.SimpleNamespace(nbytes=largest)]
    assert data_nbytes(frame) <= limit < data_nbytes(frame) + 2
    assert largest >= limit // 3
    assert options.trainer_max_frame_bytes == limit


def test_the_default_limit_leaves_the_packing_bounds_as_they_are():
    default, within = SessionOptions(), SessionOptions().within(DEFAULT_MAX_FRAME_BYTES)
    assert within == default
    assert (within.frame_max_bytes, within.batch_max_bytes, within.batch_max_items) == (2 * MiB, MiB, 1024)


def _item(index: int, big_at: int = -1):
    """A tensor of 100 kB holding ``index``; of 3 MiB at ``big_at``."""
    return torch.full((3 * MiB if index == big_at else 100_000,), index % 251, dtype=torch.uint8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("item-size")) as server:
        yield server


def _service(where: str, server, limit: int, **kwargs) -> RPCReadingService:
    transport = TransportConfig(max_frame_bytes=limit)
    if where == "local":
        return RPCReadingService(num_workers=2, transport=transport, timeout=20, **kwargs)
    return remote(server, 2, transport=transport, timeout=20, **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["local", "tcp"])
def test_a_trainer_with_a_small_frame_limit_receives_every_item(where, server):
    # The workers' frames of 2 MiB were refused by a trainer with max_frame_bytes=1 MiB: the
    # session was lost before its first item.
    datapipe = IterableWrapper(range(60)).sharding_filter().map(_item)
    (epoch,) = run_epochs(datapipe, _service(where, server, MiB), n_epochs=1)
    assert [int(item[0]) for item in epoch] == list(range(60))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["local", "tcp"])
@pytest.mark.parametrize("on_failure", ["raise", "reassign"])
def test_an_item_over_the_limit_fails_in_the_graph_named_after_the_items_before_it(where, on_failure, server):
    datapipe = IterableWrapper(range(12)).sharding_filter().map(lambda i: _item(i, big_at=5))
    service = _service(where, server, 2 * MiB, on_worker_failure=on_failure)
    received = []
    with pytest.raises(ItemTooLargeError) as info:
        for item in run_epochs_lazily(datapipe, service):
            received.append(int(item[0]))
    message = str(info.value)
    assert "Caught ItemTooLargeError in worker process 1 (" in message  # item 5: worker 1's third
    assert "an item of 3,145,8" in message and "max_frame_bytes" in message and "smaller" in message
    assert received == [0, 1, 2, 3, 4]  # in order, up to the item that failed


def run_epochs_lazily(datapipe, service):
    """The items of one epoch as they come, the loader shut down after."""
    from torchdata.dataloader2 import DataLoader2

    with DataLoader2(datapipe, reading_service=service) as loader:
        yield from loader
