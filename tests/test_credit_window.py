"""The byte credit window against a real worker process: a session's window is the epoch's
credits in frames of the session's own frame bound (``batch_max_bytes``), also for an epoch
started while the session was still being set up (its START_EPOCH waits for READY)."""

from __future__ import annotations

import queue

import pytest
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import wait_until
from rpc_reading_service.policies.merge import EpochProgress, iterate_in_order
from rpc_reading_service.protocol import data_cost, data_nbytes
from rpc_reading_service.serialization import dumps_graph, dumps_item
from rpc_reading_service.trainer.channel import WorkerChannel
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
