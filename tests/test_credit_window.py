"""The byte credit window against a real worker process: a session's window is the epoch's
credits in frames of the session's own frame bound (``batch_max_bytes``), also for an epoch
started while the session was still being set up (its START_EPOCH waits for READY); and the
ITEM_CREDIT of dispatched input stays the window in frames after large items grew its bytes; and
a frame holds 2 MiB of tensors but 1 MiB of pickled bytes."""

from __future__ import annotations

import queue
from typing import List, Tuple

import pytest
import torch
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import wait_until
from rpc_reading_service import RPCReadingService
from rpc_reading_service.policies.merge import EpochProgress, iterate_in_order
from rpc_reading_service.protocol import data_cost, data_nbytes
from rpc_reading_service.serialization import dumps_graph, dumps_item
from rpc_reading_service.trainer.channel import WorkerChannel
from rpc_reading_service.trainer.engine.dispatch import RankInput
from rpc_reading_service.trainer.config import ReadingServiceConfig
from rpc_reading_service.transports.socket_transport import SocketTransport

pytestmark = pytest.mark.timeout(30)

#: Not the default (1 MiB): a window taken from the default would be 16 times too wide.
FRAME_BOUND = 64 << 10
CREDITS = 3
ITEMS = 200


def item_of_16_kib(index: int) -> tuple:
    """An item of 16 KiB (each in a frame of its own: ``batch_max_items=1``)."""
    return index, bytes(16 << 10)


def test_an_epoch_started_while_its_session_sets_up_gets_its_credits_in_frames_of_the_sessions_bound(worker_server):
    channel = WorkerChannel(None, 0, heartbeat_interval=0.2, peer_timeout=10.0, address=worker_server.address)
    try:
        channel.start_epoch(1, seed=1, global_worker_id=0, credits=CREDITS)  # held until READY, as the engine does
        channel.attach(SocketTransport().connect(worker_server.address, worker_server.key.encode(), timeout=10))
        graph = dumps_graph((IterableWrapper(range(ITEMS)).sharding_filter().map(item_of_16_kib), None, None))
        options = {"batch_max_bytes": FRAME_BOUND, "batch_max_items": 1, "linger": 0.0, "heartbeat_interval": 0.2}
        channel.setup({"graph": graph, "worker_rank": 0, "num_workers": 1, "options": options}, timeout=10)
        channel.start_receiver(queue.SimpleQueue())
        assert channel.protocol.window == CREDITS * FRAME_BOUND  # START_EPOCH's credits, as sent
        # The worker holds the same window: with nothing taken it spends it (the last frame may
        # overdraw it) and then waits, sending heartbeats only (a frame more would break the rule).
        cost = data_cost(data_nbytes([dumps_item(item_of_16_kib(0))]))
        assert wait_until(lambda: channel.protocol.credits <= 0, 10)
        spent = channel.protocol.last_received
        assert wait_until(lambda: channel.heard_since(spent), 10)  # silence: the worker waits for credit
        assert channel.frames_received == -(-CREDITS * FRAME_BOUND // cost)
        assert channel.queue.qsize() == channel.frames_received  # every event a frame: no loss, no refusal
        items = list(iterate_in_order([channel], EpochProgress(1, [0])))
        assert [index for index, _payload in items] == list(range(ITEMS))
    finally:
        channel.close(timeout=2.0)


def tensor_of_256_kib(index: int):
    """A tensor of 256 KiB: its storage goes out of band."""
    return torch.full((256 << 10,), index % 251, dtype=torch.uint8)


def bytes_of_256_kib(index: int) -> bytes:
    """256 KiB pickled in band."""
    return bytes([index % 251]) * (256 << 10)


@pytest.mark.parametrize("make, per_frame", [(tensor_of_256_kib, 8), (bytes_of_256_kib, 4)])
def test_a_frame_takes_2_mib_of_tensors_and_1_mib_of_pickled_bytes_over_a_socket(worker_server, make, per_frame):
    channel = WorkerChannel(None, 0, heartbeat_interval=0.2, peer_timeout=10.0, address=worker_server.address)
    items = 32
    try:
        channel.attach(SocketTransport().connect(worker_server.address, worker_server.key.encode(), timeout=10))
        graph = dumps_graph((IterableWrapper(range(items)).sharding_filter().map(make), None, None))
        options = {"linger": 10.0, "heartbeat_interval": 0.2}  # sealed by their bounds only (and the last by the shard's end)
        channel.setup({"graph": graph, "worker_rank": 0, "num_workers": 1, "options": options}, timeout=10)
        channel.start_receiver(queue.SimpleQueue())
        channel.start_epoch(1, seed=1, global_worker_id=0, credits=64)
        received = list(iterate_in_order([channel], EpochProgress(1, [0])))
        assert [bytes(memoryview(item.numpy() if hasattr(item, "numpy") else item)[:1]) for item in received] == [
            bytes([index % 251]) for index in range(items)
        ]
        assert channel.frames_received == items // per_frame
    finally:
        channel.close(timeout=2.0)


def item_of_2_mib(index: int) -> tuple:
    """An item larger than the default frame bound (1 MiB): each frame of it grows the window."""
    return index, bytes(2 << 20)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_dispatched_input_credit_stays_prefetch_frames_after_the_window_grew(worker_server, monkeypatch, prefetch):
    """The worker's first ITEM_CREDIT of an epoch is the window in frames (``prefetch``): also in an
    epoch after one whose items, larger than a frame, grew the DATA window (which then counts
    ``prefetch`` frames of their size, not more frames of the frame bound)."""
    grants: List[Tuple[int, int]] = []
    real_grant = RankInput.grant

    def record(self: RankInput, epoch: int, credits: int, session: int = 0) -> None:
        grants.append((epoch, credits))
        real_grant(self, epoch, credits, session)

    monkeypatch.setattr(RankInput, "grant", record)
    dp = IterableWrapper(range(6)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).map(item_of_2_mib)
    rs = RPCReadingService(num_workers=1, workers=[worker_server.address], auth_key=worker_server.key, prefetch=prefetch)
    with DataLoader2(dp, reading_service=rs) as dl:
        windows = []
        for _epoch in range(2):
            dl.seed(1)
            assert sorted(index for index, _payload in dl) == list(range(6))
            windows.append(dl.reading_service._engine.channels[0].protocol.window)
    assert windows[1] > prefetch * (1 << 20)  # the first epoch grew the window past the frame bound
    first = {}
    for epoch, credits in grants:
        first.setdefault(epoch, credits)
    assert len(first) == 2 and set(first.values()) == {prefetch}, f"first ITEM_CREDIT of each epoch: {first}"


def test_the_default_window_shrinks_as_the_fleet_grows_and_an_explicit_one_stays():
    auto = ReadingServiceConfig()
    grown = [auto.frames_in_flight(w)[1] for w in (1, 2, 4, 5, 8, 16, 1000)]
    assert auto.frames_in_flight(1)[0] == 4 and grown == [16, 16, 16, 12, 8, 4, 4]
    assert ReadingServiceConfig(prefetch=3).frames_in_flight(1000) == (3, 0)


def item_of(size_and_index):
    size, index = size_and_index
    return index, bytes(size)


@pytest.mark.parametrize(
    "prefetch, size, window_mib",
    [
        (None, 1 << 10, 4), (None, 64 << 10, 16), (None, 256 << 10, 16), (2, 256 << 10, 2), (None, 8 << 20, 32),
        (2, 8 << 20, 16),
    ],
)
def test_local_workers_get_the_window_of_their_prefetch_and_items(prefetch, size, window_mib):
    """By default 4 MiB, grown to 256 items of a kind that few fill a frame, at most 16 MiB, or 4
    items larger than a frame; ``prefetch`` frames as given (of items larger than a frame: that many)."""
    n = 16 if size > 1 << 20 else 200
    dp = IterableWrapper([(size, index) for index in range(n)]).sharding_filter().map(item_of)
    with DataLoader2(dp, reading_service=RPCReadingService(num_workers=2, prefetch=prefetch)) as dl:
        for _epoch in range(2):  # the second epoch starts with the window the first one grew to
            assert sorted(index for index, _payload in dl) == list(range(n))
        windows = [channel.protocol.window for channel in dl.reading_service._engine.channels]
    assert all(window_mib << 20 <= window <= (window_mib << 20) * 1.02 for window in windows), windows
    # the bound the benchmark and the memory tests hold the trainer to: these windows, the frames' headers aside
    assert ReadingServiceConfig(prefetch=prefetch).in_flight_bytes(2, size, in_band=True) == 2 * (window_mib << 20)
