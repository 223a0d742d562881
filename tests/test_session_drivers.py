"""The two session drivers against each other: a REAL ``WorkerChannel`` and a REAL
``WorkerSession`` (threads, graphs, outbox, watchdog) joined by an in-memory connection pair
(or, where the trainer's receive loop is tested, a socket pair).

No subprocess: what runs is exactly the drivers and their state machines. A
stuck peer is one end whose frames stop arriving (``drop_outgoing``).
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time

import numpy
import pytest
import torch
from torchdata.datapipes.iter import IterableWrapper

import rpc_reading_service
from _server_helpers import wait_until
from memory_connection import connection_pair
from rpc_reading_service.trainer.channel import (
    ChannelClosed,
    FrameReceived,
    SessionLost,
    ShardEnded,
    WorkerChannel,
)
from rpc_reading_service.policies.merge import EpochProgress, iterate_in_order
from rpc_reading_service.errors import ItemTimeoutError, WorkerLostError, WorkerStartupError
from rpc_reading_service.protocol import (
    DATA_FRAME_OVERHEAD,
    MessageKind,
    SessionState,
    StopEpoch,
    data_cost,
    data_nbytes,
    decode_data_parts,
    encode_frame,
)
from rpc_reading_service.trainer.receive_loop import ReceiveLoop
from rpc_reading_service.frame_items import loads_payloads
from rpc_reading_service.serialization import dumps_graph, dumps_item
from rpc_reading_service.protocol import FrameReader
from rpc_reading_service.transports.socket_transport import SocketConnection
from rpc_reading_service.tasks import THREAD_PREFIX
from rpc_reading_service.worker.session import WorkerSession

#: The bytes of credit of a DATA frame of one small int: a ``batch_max_bytes`` of it makes a window
#: of ``credits`` such frames.
FRAME = data_cost(data_nbytes([dumps_item(0)]))

pytestmark = pytest.mark.timeout(20)

#: Released at the end of every test: graph functions that block wait on it.
RELEASE = threading.Event()


def raise_at_3(x):
    if x == 3:
        raise ValueError("three is not allowed")
    return x


def block_at_2(x):
    if x == 2:
        RELEASE.wait()
    return x


def slow_then_block_at_3(x):
    """A slow stage (5 ms an item, each sealed alone) whose item 3 waits for RELEASE."""
    time.sleep(0.005)
    return block_at_2(x - 1) + 1


def failing_init(datapipe, worker_info):
    raise RuntimeError("worker_init_fn failed on purpose")


class SenderRecordingConnection(SocketConnection):
    """A socket connection that records the thread of every ``send_frames`` (the channel's
    sends; heartbeats go through ``send``)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.senders: list = []

    def send_frames(self, frames) -> None:
        self.senders.append(threading.current_thread().name)
        super().send_frames(frames)


class LendingConnection(SocketConnection):
    """A socket connection that records the address of every out-of-band buffer it sends."""

    def __init__(self, *args):
        super().__init__(*args)
        self.sent_from: set = set()

    def send(self, chunks) -> None:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if view.nbytes >= 64 << 10:
                self.sent_from.add(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)
        super().send(chunks)


#: (index, tensor) of each tensor :func:`fresh_tensor` made (the worker session runs in this
#: process), kept: no later tensor or copy gets the address of one of them.
MADE: list = []


def fresh_tensor(spec):
    index, nbytes = spec
    tensor = torch.full((nbytes,), index, dtype=torch.uint8)
    MADE.append((index, tensor))
    return index, tensor


class Pair:
    """A trainer's channel and a worker session serving it in a thread; ``over_sockets``: joined
    by a socket pair, the channel received for by a :class:`ReceiveLoop` (as in a trainer)."""

    def __init__(self, heartbeat_interval: float = 0.1, peer_timeout: float = 5.0, over_sockets: bool = False,
                 worker_conn=SocketConnection):
        self.loop = ReceiveLoop() if over_sockets else None
        if over_sockets:
            ours, theirs = socket.socketpair()
            self.trainer_conn = SenderRecordingConnection(ours, "worker", FrameReader())
            self.worker_conn = worker_conn(theirs, "trainer", FrameReader())
        else:
            self.trainer_conn, self.worker_conn = connection_pair()
        self.session = WorkerSession(self.worker_conn, server_address="memory")
        self.worker = threading.Thread(target=self.session.run, name="test-worker-session", daemon=True)
        self.worker.start()
        self.channel = WorkerChannel(self.trainer_conn, 0, heartbeat_interval, peer_timeout, loop=self.loop)
        self.options = {"heartbeat_interval": heartbeat_interval, "peer_timeout": peer_timeout}

    def setup(self, datapipe, init_fn=None, **options) -> "Pair":
        graph = dumps_graph((datapipe, init_fn, None))
        payload = {"graph": graph, "worker_rank": 0, "num_workers": 1, "options": {**self.options, **options}}
        self.channel.setup(payload, timeout=5.0)
        self.channel.start_receiver(queue.SimpleQueue())
        return self

    def epoch(self, epoch: int, credits: int = 2, skip: int = 0) -> list:
        self.channel.start_epoch(epoch, seed=epoch, global_worker_id=0, credits=credits, skip=skip)
        return list(iterate_in_order([self.channel], EpochProgress(epoch, [skip])))

    def close(self) -> None:
        RELEASE.set()
        self.channel.close(timeout=2.0)
        self.worker_conn.close()
        self.worker.join(5.0)
        if self.loop is not None:
            self.loop.close()
        assert not self.worker.is_alive(), "the worker session did not end"
        RELEASE.clear()


@pytest.fixture
def pair():
    made = []

    def make(**kwargs) -> Pair:
        made.append(Pair(**kwargs))
        return made[-1]

    yield make
    for each in made:
        each.close()


def consume_counting_credit(channel: WorkerChannel, epoch: int) -> list:
    """The items of ``epoch`` frame by frame, giving each frame's bytes back as it is taken (as
    the merge does), and checking that the trainer never received more bytes than it had granted
    plus one frame (a frame goes while any credit is left): the window the protocol guarantees,
    however the items were packed."""
    frames, granted, largest = [], channel.protocol.window, 0
    while True:
        event = channel.queue.get(timeout=5.0)
        assert isinstance(event, (FrameReceived, ShardEnded)), event
        if isinstance(event, ShardEnded):
            return frames
        largest = max(largest, event.frame.nbytes)
        received = channel.stats.bytes
        assert received < granted + largest, f"{received} bytes of DATA with {granted} granted"
        frames.append(loads_payloads(*decode_data_parts(event.frame)[2:]))
        granted += data_cost(event.frame.nbytes)
        channel.grant(epoch, event.frame.nbytes)


def test_setup_and_epochs_with_credits(pair):
    link = pair().setup(IterableWrapper(range(10)).sharding_filter(), batch_max_items=2, linger=0.0, batch_max_bytes=FRAME)
    assert link.channel.info["pid"] > 0 and link.channel.protocol.state is SessionState.READY
    # A window of one frame: the worker sends one frame and waits for the trainer to take it.
    link.channel.start_epoch(1, seed=1, global_worker_id=0, credits=1)
    assert wait_until(lambda: link.channel.queue.qsize() == 1, 5.0)
    assert link.session.protocol.credits <= 0 and link.channel.frames_received == 1
    # With linger=0 a frame leaves with what is ready when credit comes (1 or 2 items): how
    # many frames an epoch takes depends on timing, the items, their order and the bounds do not.
    frames = consume_counting_credit(link.channel, 1)
    assert [item for frame in frames for item in frame] == list(range(10))
    assert all(1 <= len(frame) <= 2 for frame in frames) and link.channel.frames_received == len(frames)
    assert link.epoch(2) == list(range(10))
    assert link.epoch(3, skip=7) == [7, 8, 9]  # a resumed epoch


def test_a_slow_stage_is_credited_once_its_whole_window_is_taken(pair):
    # Three one-item frames arrive, then the worker's graph blocks (no fourth frame comes yet).
    # One item a frame (batch_max_items): a sender that runs late (under load) packs no two.
    graph = IterableWrapper(range(12)).sharding_filter().map(slow_then_block_at_3)
    link = pair(heartbeat_interval=5.0, peer_timeout=20.0).setup(
        graph, linger=0.001, batch_max_items=1, batch_max_bytes=FRAME
    )
    channel, outbox = link.channel, link.session.outbox
    with outbox.sending:  # no frame leaves until the second item is made: as a sender late under load
        channel.start_epoch(1, seed=1, global_worker_id=0, credits=4)
        assert wait_until(lambda: outbox._producer_waiting or len(outbox._open) > 1, 5.0)
    assert wait_until(lambda: channel.frames_received == 3, 5.0)
    items = iterate_in_order([channel], EpochProgress(1, [0]))
    assert [next(items), next(items), next(items)] == [0, 1, 2]
    # All three taken, more than half the window: but the worker holds a credit for its next
    # slow item, so it needs none yet (one CREDIT per window for a slow stage, not per half).
    assert channel.protocol.credits == FRAME and channel.frames_received == 3
    RELEASE.set()
    assert next(items) == 3  # sent with the last credit
    assert channel._credit.ungranted == 3 * FRAME  # a frame's credit goes back at the request after its last item
    assert next(items) == 4  # the whole window handed on: all four went back in one CREDIT
    assert list(items) == list(range(5, 12))


def test_in_a_receive_loop_the_loop_sends_the_credits_the_consumer_grants(pair):
    link = pair(over_sockets=True).setup(
        IterableWrapper(range(40)).sharding_filter(), batch_max_items=1, linger=0.0, batch_max_bytes=FRAME
    )
    assert link.channel._in_loop
    sent_before = len(link.trainer_conn.senders)
    # A window of 2 one-item frames: the epoch needs a CREDIT for every other frame taken.
    assert link.epoch(1, credits=2) == list(range(40))
    senders = link.trainer_conn.senders[sent_before:]
    assert senders[0] == threading.current_thread().name  # START_EPOCH
    assert len(senders) >= 19 and set(senders[1:]) == {"rrs-receive-loop"}, senders  # every CREDIT


def test_a_credit_due_while_another_send_holds_the_connection_is_sent_once_it_is_free(pair):
    link = pair(over_sockets=True).setup(
        IterableWrapper(range(12)).sharding_filter(), batch_max_items=1, linger=0.0, batch_max_bytes=FRAME
    )
    channel = link.channel
    channel.start_epoch(1, seed=1, global_worker_id=0, credits=2)
    items = iterate_in_order([channel], EpochProgress(1, [0]))
    third = []
    with channel._send_lock:  # as a dispatcher's send in progress does
        assert [next(items), next(items)] == [0, 1]  # the window's frames taken
        taker = threading.Thread(target=lambda: third.append(next(items)))
        taker.start()  # the request after the window's last item: its CREDIT is due
        assert wait_until(lambda: link.loop._retry >= 0.004, 5.0)  # the loop tried, and retried
        assert link.session.protocol.credits <= 0 and channel.frames_received == 2
    taker.join(5.0)
    assert third == [2] and list(items) == list(range(3, 12))  # the loop's retry sent it


def test_a_buffer_that_fills_a_frame_is_sent_from_the_graphs_memory_and_arrives_intact(pair):
    # From the frame bound (1 MiB) a socket session lends its send the graph's own tensor (no
    # copy; written before the graph makes its next item); smaller ones are copied and batched.
    sizes = [256 << 10, 512 << 10, (768 << 10) + 3, 1 << 20, 256 << 10, (1 << 20) + 5, 512 << 10]
    MADE.clear()
    graph = IterableWrapper(list(enumerate(sizes))).sharding_filter().map(fresh_tensor)
    link = pair(over_sockets=True, worker_conn=LendingConnection).setup(graph)
    items = link.epoch(1, credits=1)
    assert [(index, tensor.numel()) for index, tensor in items] == list(enumerate(sizes))
    assert all(torch.equal(tensor, torch.full_like(tensor, index)) for index, tensor in items)
    lent = [index for index, tensor in MADE if tensor.data_ptr() in link.worker_conn.sent_from]
    MADE.clear()
    assert lent == [index for index, nbytes in enumerate(sizes) if nbytes >= 1 << 20]


#: The one tensor per size that :func:`written_in_place` writes again for every item.
WRITTEN_IN_PLACE: dict = {}


def written_in_place(spec):
    """The graph's one tensor of ``nbytes``, written with ``index`` for each item (a decoder that reuses its output)."""
    index, nbytes = spec
    tensor = WRITTEN_IN_PLACE.setdefault(nbytes, torch.empty((nbytes,), dtype=torch.uint8))
    tensor.fill_(index)
    return index, tensor


@pytest.mark.timeout(60)
def test_a_graph_that_writes_one_tensor_again_for_every_item_sends_each_as_it_was_yielded(pair):
    # Copied (below the frame bound, two to a frame) or lent (written before the next item is made):
    # either way no item carries a later one's bytes.
    sizes = [size for size in (512 << 10, (768 << 10) + 3, 1 << 20, 2 << 20) for _ in range(3)]  # each three times in a row
    graph = IterableWrapper(list(enumerate(sizes))).sharding_filter().map(written_in_place)
    items = pair(over_sockets=True).setup(graph).epoch(1, credits=1)
    WRITTEN_IN_PLACE.clear()
    assert [(index, tensor.numel()) for index, tensor in items] == list(enumerate(sizes))
    assert all(torch.equal(tensor, torch.full_like(tensor, index)) for index, tensor in items)


class BoundRecordingConnection(SocketConnection):
    """A socket connection that records every bound of its reuse pools."""

    def __init__(self, *args):
        super().__init__(*args)
        self.bounds: list = []

    def bound_buffers(self, frames: int, frame_bytes: int) -> None:
        self.bounds.append((frames, frame_bytes))
        super().bound_buffers(frames, frame_bytes)


def test_an_epoch_started_while_connecting_bounds_the_buffers_by_its_window():
    # The engine starts an epoch on every channel while their sessions still connect and set up
    # (each sends START_EPOCH once READY): setting up must not shrink the bound to one frame.
    ours, theirs = socket.socketpair()
    trainer_conn = BoundRecordingConnection(ours, "worker", FrameReader())
    session = WorkerSession(SocketConnection(theirs, "trainer", FrameReader()), server_address="memory")
    worker = threading.Thread(target=session.run, name="test-worker-session", daemon=True)
    worker.start()
    channel = WorkerChannel(None, 0, 0.1, 5.0, address="memory")
    try:
        channel.start_epoch(1, seed=1, global_worker_id=0, credits=4)  # held until READY
        channel.attach(trainer_conn)
        graph = dumps_graph((IterableWrapper(range(10)).sharding_filter(), None, None))
        channel.setup({"graph": graph, "worker_rank": 0, "num_workers": 1, "options": {}}, timeout=5.0)
        assert trainer_conn.bounds == [(5, 1 << 20)]  # the window (4 frames) plus one
        channel.start_receiver(queue.SimpleQueue())
        assert list(iterate_in_order([channel], EpochProgress(1, [0]))) == list(range(10))
    finally:
        channel.close(timeout=2.0)
        session.conn.close()
        worker.join(5.0)
    assert not worker.is_alive()


def test_a_new_epoch_supersedes_a_running_one(pair):
    link = pair().setup(IterableWrapper(range(50)).sharding_filter(), batch_max_items=1, linger=0.0)
    link.channel.start_epoch(1, seed=1, global_worker_id=0, credits=4)
    first = iterate_in_order([link.channel], EpochProgress(1, [0]))
    assert next(first) == 0  # epoch 1 abandoned with frames in flight
    assert link.epoch(2) == list(range(50))
    assert link.epoch(3) == list(range(50))


def test_a_window_of_tiny_frames_holds_at_most_a_window_over_the_frame_overhead(pair):
    # Credit counts bytes, and each frame costs a fixed overhead beside them: a consumer that takes
    # nothing holds at most window / DATA_FRAME_OVERHEAD frames of tiny items, not window / 45 bytes.
    link = pair().setup(IterableWrapper(range(100_000)).sharding_filter(), batch_max_items=1, linger=0.0)
    link.channel.start_epoch(1, seed=1, global_worker_id=0, credits=1)  # a window of 1 MiB
    worker = link.session.protocol
    assert wait_until(lambda: worker.epoch == 1 and worker.credits <= 0, 10.0)  # the worker spent the window
    sent = worker.next_sequence
    assert wait_until(lambda: link.channel.frames_received == sent, 5.0)
    assert link.channel.protocol.window == 1 << 20
    assert (1 << 20) // FRAME <= sent <= (1 << 20) // DATA_FRAME_OVERHEAD + 1


def test_a_stopped_epoch_ends_its_producer_and_the_next_one_runs(pair):
    link = pair().setup(IterableWrapper(range(50)).sharding_filter(), batch_max_items=1, linger=0.0, batch_max_bytes=FRAME)
    link.channel.start_epoch(1, seed=1, global_worker_id=0, credits=1)
    assert wait_until(lambda: link.channel.frames_received == 1, 5.0)
    link.channel._send_or_report(StopEpoch(1))
    assert wait_until(lambda: link.session.outbox.epoch is None, 5.0)
    assert link.epoch(2) == list(range(50))


def test_a_graph_error_ends_the_epoch_and_the_session_goes_on(pair):
    link = pair().setup(IterableWrapper(range(6)).sharding_filter().map(raise_at_3), batch_max_items=1, linger=0.0)
    for epoch in (1, 2):
        received = []
        link.channel.start_epoch(epoch, seed=epoch, global_worker_id=0, credits=2)
        with pytest.raises(ValueError, match="(?s)Caught ValueError in worker process 0 .*three is not allowed"):
            for item in iterate_in_order([link.channel], EpochProgress(epoch, [0])):
                received.append(item)
        assert received == [0, 1, 2]
        assert link.session.protocol.state is SessionState.READY and link.worker.is_alive()


def test_a_failed_setup_is_the_workers_error(pair):
    link = pair()
    with pytest.raises(WorkerStartupError, match="(?s)could not set up the graph.*worker_init_fn failed on purpose"):
        link.setup(IterableWrapper(range(3)), init_fn=failing_init)
    assert wait_until(lambda: not link.worker.is_alive(), 5.0)


def test_a_stuck_worker_is_lost_after_the_timeout(pair):
    link = pair(heartbeat_interval=0.05, peer_timeout=0.5).setup(IterableWrapper(range(4)).sharding_filter())
    link.worker_conn.drop_outgoing = True  # the worker's process stops: nothing more arrives
    started = time.monotonic()
    event = link.channel.queue.get(timeout=5.0)
    assert isinstance(event, SessionLost) and isinstance(event.error, WorkerLostError)
    assert "sent nothing (not even a heartbeat) for 0.5 s" in str(event.error)
    assert time.monotonic() - started < 3.0


def test_a_stuck_trainer_ends_the_worker_session(pair):
    link = pair(heartbeat_interval=0.05, peer_timeout=0.5).setup(IterableWrapper(range(4)).sharding_filter())
    link.trainer_conn.drop_outgoing = True  # the trainer stops: no more heartbeats reach the worker
    assert wait_until(lambda: not link.worker.is_alive(), 5.0)
    assert link.session.protocol.closed_by == "timeout"


def test_a_stuck_item_ends_the_session_with_its_position(pair):
    graph = IterableWrapper(range(6)).sharding_filter().map(block_at_2)
    link = pair().setup(graph, batch_max_items=1, linger=0.0, item_timeout=0.3)
    link.channel.start_epoch(1, seed=1, global_worker_id=0, credits=4)
    received = []
    with pytest.raises(ItemTimeoutError, match="item 2 of its shard in epoch 1") as caught:
        for item in iterate_in_order([link.channel], EpochProgress(1, [0])):
            received.append(item)
    assert received == [0, 1] and caught.value.position == 2 and "block_at_2" in caught.value.stack
    assert wait_until(lambda: not link.worker.is_alive(), 5.0)
    assert link.channel.protocol.closed_by == "peer"


def test_an_illegal_frame_is_refused_with_the_rule_and_reaches_the_trainer(pair):
    link = pair().setup(IterableWrapper(range(4)).sharding_filter())
    link.trainer_conn.send(encode_frame(MessageKind.DATA, [b"\x00" * 16]))  # bypasses the state machine
    event = link.channel.queue.get(timeout=5.0)
    assert isinstance(event, SessionLost)
    assert "ended the session: refused a malformed frame: trainer at" in str(event.error)
    assert "it sent DATA, which a trainer never sends" in str(event.error)
    assert wait_until(lambda: not link.worker.is_alive(), 5.0)


def test_close_ends_both_ends(pair):
    link = pair().setup(IterableWrapper(range(4)).sharding_filter())
    assert link.epoch(1) == [0, 1, 2, 3]
    link.channel.close()
    assert wait_until(lambda: not link.worker.is_alive(), 5.0)
    assert link.session.protocol.closed_by == "peer" and link.channel.protocol.closed_by == "us"
    event = link.channel.queue.get(timeout=1.0)
    assert isinstance(event, ChannelClosed)
    link.channel.start_epoch(2, seed=2, global_worker_id=0, credits=1)  # after close: nothing sent, no error
    assert link.channel.protocol.epoch == 1


def test_the_merge_hands_on_whole_turns_of_received_frames_at_once_and_positions_stay_exact(pair):
    from rpc_reading_service.policies.merge import flatten_runs, runs_in_order

    # Two workers, frames of 5 items each, all received: the round-robin takes as many whole
    # turns as both frames hold as one run (counted at once), not one step per item; a
    # checkpoint after any item handed on still says exactly which items were taken.
    links = [pair().setup(IterableWrapper(range(20)).sharding_filter(), batch_max_items=5, linger=5.0) for _ in range(2)]
    links[1].channel.rank = 1
    channels = [link.channel for link in links]
    for channel in channels:
        channel.start_epoch(1, seed=1, global_worker_id=channel.rank, credits=4)
    assert wait_until(lambda: all(channel.frames_received == 4 for channel in channels), 5.0)
    progress = EpochProgress(1, [0, 0])
    sizes: list = []

    def recorded(runs):
        for run in runs:
            sizes.append(progress.ahead)  # counted, none of it handed on yet
            yield run

    handed = []
    for item in flatten_runs(recorded(runs_in_order(channels, progress))):
        handed.append(item)
        taken = len(handed)
        assert progress.positions() == ([(taken + 1) // 2, taken // 2], taken % 2)
    assert handed == [x for x in range(20) for _ in range(2)]
    assert sum(sizes) == 40 and len(sizes) <= 12, sizes  # a step per frame or so, not per item
    assert progress.finished and progress.ahead == 0


def test_a_run_hands_on_its_items_without_comparing_them_and_a_dropped_run_ends():
    # A run's iterator pops its items: it never compares one with anything (a tensor's == with
    # another object costs ~40 us), lets go of each as it goes, and ends once the run is dropped.
    class Touchy:
        def __eq__(self, other):
            raise AssertionError("an item was compared")

        __hash__ = object.__hash__

    progress = EpochProgress(1, [0, 0])
    items = [Touchy() for _ in range(6)]
    run = progress.count_run([0, 1], 3, list(items), next_rank=0)
    assert (progress.yielded, progress.ahead, progress.handed_on()) == (6, 6, [0, 0])
    assert [next(run) is items[k] for k in range(4)] == [True] * 4
    assert (progress.ahead, progress.handed_on(), progress.positions()) == (2, [2, 2], ([2, 2], 0))
    progress.drop_run()  # a newer epoch superseded this one: it lets go of the rest, still not handed on
    assert list(run) == [] and (progress.ahead, progress.handed_on(), progress.positions()) == (2, [2, 2], ([2, 2], 0))


@pytest.mark.parametrize("item_timeout", [None, 5.0])
def test_the_producer_makes_few_calls_of_ours_per_item_with_or_without_item_timeout(pair, item_timeout):
    # A worker's CPU per small item is mostly Python calls: the producer thread's own (this
    # package's, beside the graph's) per item are its encoding and its put; item_timeout's watch
    # of the item being made is kept inline, without a call per item.
    package = os.path.dirname(rpc_reading_service.__file__) + os.sep
    producer_calls: dict = {}

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            if threading.current_thread().name.startswith(THREAD_PREFIX + "producer-"):
                name = frame.f_code.co_name
                producer_calls[name] = producer_calls.get(name, 0) + 1

    items = 3000
    link = pair().setup(IterableWrapper(range(items)).sharding_filter(), batch_max_items=100, linger=1.0,
                        item_timeout=item_timeout)
    threading.setprofile(count)  # the threads started from here on: the epoch's producer among them
    try:
        assert link.epoch(1, credits=64) == list(range(items))
    finally:
        threading.setprofile(None)
    per_item = {name: calls / items for name, calls in producer_calls.items() if calls >= items}
    assert set(per_item) == {"encode", "put"}, per_item  # the item encoded (its EncodedItem made inline), put
    assert sum(producer_calls.values()) / items < 2.8, producer_calls


def test_a_resumed_epoch_with_item_timeout_skips_the_items_delivered_before(pair):
    # With item_timeout the producer watches the skipped items too (each its own clock).
    link = pair().setup(IterableWrapper(range(10)).sharding_filter(), batch_max_items=2, item_timeout=5.0)
    assert link.epoch(1, skip=3) == list(range(3, 10))
    assert link.epoch(2, skip=10) == []
    assert link.session._producing is None  # nothing watched once the epoch ended
