"""The worker session's Outbox: packing, linger, credits (backpressure) and cancellation.

Real threads, no sockets: the Outbox is the hand-off between a producer and the sender.
"""

from __future__ import annotations

import threading
import time

import pytest
from _server_helpers import python_calls, wait_until

from rpc_reading_service.protocol import (
    ChunkDone,
    Credit,
    EncodedItem,
    FrameReader,
    Lease,
    MessageKind,
    Ready,
    Setup,
    StartEpoch,
    WorkerProtocol,
    data_cost,
    data_nbytes,
    decode_data,
    encode_end_of_shard,
)
from rpc_reading_service.worker.session import Outbox, SessionOptions
from rpc_reading_service.worker.inbox import Cancelled

pytestmark = pytest.mark.timeout(20)


def frame_of(chunks):
    reader = FrameReader()
    reader.feed(b"".join(bytes(c) for c in chunks))
    return reader.next_frame()


class DrivenOutbox(Outbox):
    """An Outbox over a real WorkerProtocol, which hears the trainer's START_EPOCH and CREDIT
    first, under the same lock, as in a session's control loop (the counts are the protocol's).
    Its credits count frames of one one-byte item (:data:`FRAME`): credit is bytes on the wire."""

    def __init__(self, options, send=None, room=lambda: True):
        self.lock = threading.RLock()
        self.protocol = WorkerProtocol("trainer at 127.0.0.1:1", lenient=True)
        super().__init__(options, self.protocol, self.lock, send, room)
        self._hear(Setup(b"graph", 0, 1))
        self.protocol.send(Ready(1, "host", "0.1.0"))

    def _hear(self, message):
        return self.protocol.receive_frame(frame_of(message.encode()))

    def start_epoch(self, epoch, credits, leased=False):
        with self.lock:
            self._hear(StartEpoch(epoch, 0, 0, credits * FRAME, leased=leased))
            super().start_epoch(epoch)

    def lease(self, epoch, chunk, count):
        with self.lock:
            self._hear(Lease(epoch, chunk, count=count))

    def grant(self, epoch, credits):
        with self.lock:
            if self._hear(Credit(epoch, credits * FRAME)):
                super().grant(epoch)


def item(i):
    return EncodedItem(str(i).encode())


#: The bytes of credit of a DATA frame of one item of one byte.
FRAME = data_cost(data_nbytes([item(0)]))


def data_items(chunks):
    frame = frame_of(chunks)
    assert frame.kind == MessageKind.DATA
    epoch, sequence, items = decode_data(frame)
    return epoch, sequence, [int(bytes(i.payload)) for i in items]


def test_items_are_packed_into_frames_and_numbered():
    outbox = DrivenOutbox(SessionOptions(batch_max_items=3, linger=0.001))
    outbox.start_epoch(1, credits=10)
    frames = []
    sender = threading.Thread(target=lambda: frames.extend(outbox.take(1.0) for _ in range(4)), daemon=True)
    sender.start()
    for i in range(7):
        outbox.put(1, item(i))
    outbox.finish(1, encode_end_of_shard(1, 7))
    sender.join(5.0)
    assert [data_items(f) for f in frames[:3]] == [(1, 0, [0, 1, 2]), (1, 1, [3, 4, 5]), (1, 2, [6])]
    assert frame_of(frames[3]).kind == MessageKind.END_OF_SHARD
    assert outbox.take(0.05) is None


@pytest.mark.parametrize("out_of_band", [False, True])
def test_a_frame_holds_the_in_band_bound_of_pickled_bytes_and_the_frame_bound_of_buffers(out_of_band):
    # Pickled bytes are fresh memory per item at both ends; buffers sent out of band are copied
    # into, and received into, reused memory: a frame takes twice as many bytes of them.
    options = SessionOptions(batch_max_items=100, batch_max_bytes=1000, frame_max_bytes=2000, linger=10.0)
    written = []
    outbox = DrivenOutbox(options, send=written.append)
    outbox.start_epoch(1, credits=10_000)
    for i in range(8):
        digits = str(i).encode()
        if out_of_band:  # one byte pickled, 249 in a buffer: 250 bytes in all
            outbox.put(1, EncodedItem(digits, [bytes(250 - len(digits))], nbytes=250))
        else:
            outbox.put(1, EncodedItem(digits + b" " * (250 - len(digits))))
    sealed = [data_items(f)[2] for frames in written for f in frames]
    assert sealed == ([list(range(8))] if out_of_band else [[0, 1, 2, 3], [4, 5, 6, 7]])


def test_partial_batch_leaves_after_linger():
    outbox = DrivenOutbox(SessionOptions(batch_max_items=100, linger=0.05))
    outbox.start_epoch(1, credits=1)
    start = time.monotonic()  # before the put: the linger runs from it, however late this thread runs after it
    outbox.put(1, item(5))
    assert outbox.take(0.01) is None  # still lingering for more items
    frame = outbox.take(1.0)
    assert data_items(frame)[2] == [5]
    assert time.monotonic() - start >= 0.04


def test_credits_bound_the_frames_in_flight():
    outbox = DrivenOutbox(SessionOptions(batch_max_items=2, linger=0.0))
    outbox.start_epoch(1, credits=1)
    produced = []

    def produce():
        try:
            for i in range(100):
                outbox.put(1, item(i))
                produced.append(i)
        except Cancelled:
            pass

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    assert data_items(outbox.take(1.0))[2] == [0, 1]  # the one credit
    time.sleep(0.2)
    assert outbox.take(0.05) is None  # no credit, no frame
    # Bounded: one sealed batch waiting plus one open batch, no more.
    assert len(produced) <= 6 and producer.is_alive()
    outbox.grant(1, 1)
    assert data_items(outbox.take(1.0))[2] == [2, 3]
    outbox.grant(99, 5)  # a stale epoch's grant is ignored
    assert outbox.take(0.05) is None
    outbox.stop_epoch(1)  # cancels the blocked producer
    producer.join(2.0)
    assert not producer.is_alive()


def test_new_epoch_drops_old_items_and_cancels_old_producer():
    outbox = DrivenOutbox(SessionOptions(batch_max_items=1, linger=0.0))
    outbox.start_epoch(1, credits=0)
    outbox.put(1, item(1))
    outbox.start_epoch(2, credits=1)
    with pytest.raises(Cancelled):
        outbox.put(1, item(2))
    outbox.put(2, item(3))
    assert data_items(outbox.take(1.0)) == (2, 0, [3])


def test_close_wakes_the_sender():
    outbox = DrivenOutbox(SessionOptions())
    result = []
    sender = threading.Thread(target=lambda: result.append(outbox.take(30.0)), daemon=True)
    sender.start()
    time.sleep(0.05)
    outbox.close()
    sender.join(2.0)
    assert not sender.is_alive() and result == [None]


def test_a_final_frame_that_ends_the_session_goes_after_the_data_and_refuses_more():
    outbox = DrivenOutbox(SessionOptions(batch_max_items=10, linger=0.0))
    outbox.start_epoch(1, credits=2)
    outbox.put(1, item(1))
    outbox.finish(1, encode_end_of_shard(1, 1), end_session=True)  # as the item watchdog does
    with pytest.raises(Cancelled):
        outbox.put(1, item(2))  # a producer that came unstuck afterwards
    with pytest.raises(Cancelled):
        outbox.finish(1, encode_end_of_shard(1, 1))
    assert data_items(outbox.take(1.0)) == (1, 0, [1])
    assert not outbox.session_over
    assert frame_of(outbox.take(1.0)).kind == MessageKind.END_OF_SHARD
    assert outbox.session_over


def test_chunk_ends_share_a_data_frame_and_the_wait_for_a_lease_is_not_a_slow_item():
    outbox = DrivenOutbox(SessionOptions(batch_max_items=100, linger=0.05))
    outbox.start_epoch(1, credits=4, leased=True)
    outbox.lease(1, 0, count=3)
    outbox.put(1, item(0))
    outbox.put(1, item(1))
    outbox.mark(1, ChunkDone(1, 0, (2,)))  # chunk 0's items stay open for the next chunk's to join
    outbox.put(1, item(2))
    outbox.mark(1, ChunkDone(1, 1, (1,)))
    frames = outbox.take_frames(1.0)
    kinds = [frame_of(f).kind for f in frames]
    assert kinds == [MessageKind.CHUNK_DONE, MessageKind.DATA]  # counts go ahead, both chunks' in one frame
    assert ChunkDone.decode(frame_of(frames[0])) == ChunkDone(1, 0, (2, 1))
    assert data_items(frames[1])[2] == [0, 1, 2]
    time.sleep(0.08)  # longer than linger: the walk waited for its next lease
    outbox.put(1, item(3))
    assert outbox.take_frames(0.01) is None  # lingers for company, not sealed alone as a slow item
    outbox.put(1, item(4))
    assert data_items(outbox.take_frames(1.0)[0])[2] == [3, 4]


def test_an_item_slower_than_linger_leaves_at_once():
    # A sleep-bound stage: batching could not pack a second item within linger anyway.
    outbox = DrivenOutbox(SessionOptions(batch_max_items=100, linger=0.1))
    outbox.start_epoch(1, credits=4)
    outbox.put(1, item(0))
    assert outbox.take(0.02) is None  # the epoch's first item lingers for company
    assert data_items(outbox.take(1.0))[2] == [0]
    time.sleep(0.15)  # longer than linger since the previous item
    outbox.put(1, item(1))
    assert data_items(outbox.take(0.02))[2] == [1]  # no linger: sealed when it came
    outbox.put(1, item(2))  # right after: lingers again, as fast items do
    assert outbox.take(0.02) is None
    assert data_items(outbox.take(1.0))[2] == [2]
    time.sleep(0.15)
    outbox.put(1, item(3))  # slow, the last credit: at once too (a slow stage is credited per window)
    assert data_items(outbox.take(0.02))[2] == [3]
    time.sleep(0.15)
    outbox.put(1, item(4))  # slow, no credit left: it waits for the CREDIT ...
    assert outbox.take(0.02) is None
    outbox.grant(1, 4)
    assert data_items(outbox.take(0.02))[2] == [4]  # ... and leaves with it, without lingering


def test_a_small_slow_item_is_written_by_its_producer_and_a_big_one_by_the_sender_when_the_socket_is_full():
    # One slow item per frame without a hand-off: the producer's put writes it (no wake-up of
    # the sender); a big one goes to the sender when the connection has no room (a write that
    # would block), so that producing overlaps sending it.
    written = []
    outbox = DrivenOutbox(
        SessionOptions(batch_max_items=100, linger=0.01),
        send=lambda frames: written.append((threading.current_thread(), [frame_of(f).kind for f in frames])),
        room=lambda: False,
    )
    outbox.start_epoch(1, credits=4)
    outbox.put(1, item(0))  # the epoch's first item lingers for company: the sender's
    assert outbox.send_next(1.0) and written == [(threading.current_thread(), [MessageKind.DATA])]
    written.clear()
    producer = threading.Thread(target=lambda: (time.sleep(0.03), outbox.put(1, item(1))))
    producer.start()
    producer.join(5.0)
    assert written == [(producer, [MessageKind.DATA])]
    assert outbox.take(0.0) is None  # nothing left for the sender
    time.sleep(0.03)
    outbox.put(1, EncodedItem(b"x" * (100 << 10)))  # slow, but big (not a full frame)
    assert len(written) == 1
    assert outbox.send_next(1.0) and written[1] == (threading.current_thread(), [MessageKind.DATA])


def test_an_item_joining_an_open_batch_costs_no_python_call_beyond_put():
    # A worker's CPU per small item is mostly calls: an item that joins an open batch without
    # filling it is checked and added inline (the lock entered directly, its epoch and bounds checked once).
    written = []
    outbox = DrivenOutbox(SessionOptions(batch_max_items=4, linger=10.0), send=written.append)
    outbox.start_epoch(1, credits=4)
    items = [item(i) for i in range(4)]
    assert [i.nbytes for i in items] == [1] * 4  # counted now, as an encoder gives it
    outbox.put(1, items[0])  # opens the batch
    assert [python_calls(outbox.put, 1, i)[1] for i in items[1:3]] == [[], []]
    _, calls = python_calls(outbox.put, 1, items[3])  # fills it: sealed and written by its producer
    assert [name for name in calls if name in OUTBOX_CALLS] == WRITTEN_BY_ITS_PRODUCER, calls
    assert [data_items(f)[2] for frames in written for f in frames] == [[0, 1, 2, 3]]


@pytest.mark.parametrize("borrowed", [False, True])
def test_an_item_that_fills_its_frame_costs_its_producer_few_python_calls(borrowed):
    # A large item makes a frame alone: its producer seals, encodes and writes it itself (a
    # borrowed one before it makes the next item: its memory). The outbox's own calls for it are
    # bounded (the credit read once per step, no wait looked for where nothing waits); the rest
    # are the protocol's checks and the frame's encoding.
    written = []
    outbox = DrivenOutbox(SessionOptions(batch_max_items=1, linger=10.0), send=written.append)
    outbox.start_epoch(1, credits=4)
    outbox.put(1, item(0))
    large = EncodedItem(b"1", [b"x" * 100], borrowed=borrowed, nbytes=101)
    _, calls = python_calls(outbox.put, 1, large)
    assert [name for name in calls if name in OUTBOX_CALLS] == WRITTEN_BY_ITS_PRODUCER, calls
    assert calls.count("credits") <= 2 and "_pack" not in calls, calls  # the DATA head packed inline
    assert [data_items(f)[2] for frames in written for f in frames] == [[0], [1]]


#: The outbox's calls in a ``put`` that seals its batch and writes it.
WRITTEN_BY_ITS_PRODUCER = ["_seal", "_take_for_producer", "_ready_frames", "_next_frame", "_write_inline"]
#: The outbox's own methods (of the calls one ``put`` makes).
OUTBOX_CALLS = {name for name, value in vars(Outbox).items() if callable(value) and not name.startswith("__")}


def test_a_slow_item_short_of_credit_waits_for_the_credit_owed_without_waking_the_sender():
    # A slow stage spends every credit (the trainer returns them once the whole window is due);
    # with none left, the slow item waits for that CREDIT and leaves from the thread that
    # grants it, at once; the sender, asleep, is not woken for it.
    written = []
    outbox = DrivenOutbox(
        SessionOptions(batch_max_items=100, linger=0.01),
        send=lambda frames: written.append((threading.current_thread(), [data_items(f)[2] for f in frames])),
    )
    outbox.start_epoch(1, credits=4)
    outbox.put(1, item(0))  # the epoch's first item lingers for company: the sender's
    assert outbox.send_next(1.0)
    sender = threading.Thread(target=outbox.send_next, args=(5.0,))
    sender.start()
    try:
        for i in (1, 2, 3):  # slow, a credit left (the last one too): written by the producer (this thread)
            time.sleep(0.03)
            outbox.put(1, item(i))
        time.sleep(0.03)
        outbox.put(1, item(4))  # slow, no credit left: the trainer owes the window's CREDIT
        time.sleep(0.1)  # ten lingers: a woken sender would have found no credit either
        assert [items for _thread, items in written] == [[[0]], [[1]], [[2]], [[3]]]
        notified = []
        notify_all = outbox._cond.notify_all
        outbox._cond.notify_all = lambda: (notified.append(True), notify_all())
        outbox.grant(1, 4)  # the CREDIT the trainer owed
        outbox.write_taken()
        assert written[-1] == (threading.current_thread(), [[4]])
        # Sealed and taken by the granting thread: nobody was woken (the sender twice, before:
        # for the sealed frame, then at the end of the write it found in progress).
        assert notified == []
    finally:
        outbox.close()
        sender.join(5.0)
    assert not sender.is_alive()


def test_a_borrowed_item_is_written_before_its_put_returns():
    # A borrowed item's buffers are the producer's memory (a TCP worker's large tensors, sent
    # uncopied): its producer writes it itself when credit allows, else its put waits until
    # the thread that takes it (here the granting one) has written it, never returning before.
    written = []
    outbox = DrivenOutbox(
        SessionOptions(batch_max_items=100, linger=10.0),
        send=lambda frames: written.append((threading.current_thread(), [data_items(f)[2] for f in frames])),
    )
    outbox.start_epoch(1, credits=1)
    outbox.put(1, EncodedItem(b"0", borrowed=True))  # no linger: written at once, by its producer
    assert written == [(threading.current_thread(), [[0]])]
    returned = threading.Event()
    producer = threading.Thread(target=lambda: (outbox.put(1, EncodedItem(b"1", borrowed=True)), returned.set()))
    producer.start()
    try:
        assert not returned.wait(0.1) and len(written) == 1  # no credit: not written, put waits
        outbox.grant(1, 1)
        outbox.write_taken()
        assert written[-1] == (threading.current_thread(), [[1]])
        assert returned.wait(5.0)
    finally:
        outbox.close()
        producer.join(5.0)


def test_items_that_each_make_a_frame_leave_the_sender_asleep():
    # Borrowed items (or items as large as a frame) leave no batch open: the sender does not time
    # a linger for them, and when a CREDIT lets one go, waking its producer does not wake the sender.
    current, written, notified = threading.current_thread(), [], []
    outbox = DrivenOutbox(
        SessionOptions(batch_max_items=100, linger=0.5),
        send=lambda frames: written.append((threading.current_thread(), [data_items(f)[2] for f in frames])),
    )
    outbox.start_epoch(1, credits=3)
    notify_all = outbox._cond.notify_all
    outbox._cond.notify_all = lambda: (notified.append(True), notify_all())
    outbox.put(1, EncodedItem(b"0", borrowed=True))
    outbox.put(1, EncodedItem(b"1", borrowed=True))
    assert written == [(current, [[0]]), (current, [[1]])] and notified == []
    outbox.put(1, item(2))  # an item that shares its batch: left open, the sender looks at it
    assert outbox.send_next(1.0) and written[-1] == (current, [[2]])  # this thread as the sender
    notified.clear()
    producer = threading.Thread(target=outbox.put, args=(1, EncodedItem(b"3", borrowed=True)))
    producer.start()  # no credit: waits until the granting thread wrote its item
    try:
        assert wait_until(lambda: outbox._producer_waiting, 5.0)
        outbox.grant(1, 1)
        outbox.write_taken()
        producer.join(5.0)
        assert not producer.is_alive() and written[-1] == (current, [[3]]) and notified == []
    finally:
        outbox.close()
        producer.join(5.0)


def test_a_staged_item_that_fills_its_batch_is_written_by_its_producer_or_waits_to_be_taken():
    # A local worker's large buffers are staged in shared segments, so the frame is small on the
    # wire: the producer writes a batch that such an item fills itself, waking nobody (the sender
    # would wake once per frame). Without credit its put returns once the thread that grants the
    # credit took the frame (the trainer maps every segment: the next item, made meanwhile, would
    # hold one more), the sender is not woken for a frame it cannot send either.
    current = threading.current_thread()
    written = []
    outbox = DrivenOutbox(
        SessionOptions(batch_max_items=2, linger=10.0),
        send=lambda frames: written.append((threading.current_thread(), [data_items(f)[2] for f in frames])),
    )
    outbox.start_epoch(1, credits=1)
    outbox.put(1, EncodedItem(b"0", staged=True))  # does not fill its batch: lingers as any item
    assert written == []
    notified = []
    notify_all = outbox._cond.notify_all
    outbox._cond.notify_all = lambda: (notified.append(True), notify_all())
    outbox.put(1, EncodedItem(b"1", staged=True))  # fills it: written by this thread
    assert written == [(current, [[0, 1]])] and notified == []
    outbox.put(1, EncodedItem(b"2", staged=True))
    returned = threading.Event()
    producer = threading.Thread(target=lambda: (outbox.put(1, EncodedItem(b"3", staged=True)), returned.set()))
    producer.start()  # fills it, no credit left: sealed, put waits
    try:
        assert not returned.wait(0.1) and len(written) == 1
        outbox.grant(1, 1)
        outbox.write_taken()
        assert written[-1] == (current, [[2, 3]]) and returned.wait(5.0)
    finally:
        outbox.close()
        producer.join(5.0)


def test_a_full_or_lingering_batch_is_written_by_its_producer_and_a_left_one_by_the_sender():
    # A fast stream: the producer seals each batch it fills, or that has been open for linger,
    # and writes it itself (the sender would take the interpreter lock from it to write it); a
    # batch it leaves open (a stall) leaves after linger from the sender. Frames leave in order.
    current, written = threading.current_thread(), []
    outbox = DrivenOutbox(
        SessionOptions(batch_max_items=2, linger=0.2),
        send=lambda frames: written.append((threading.current_thread(), [data_items(f)[1:] for f in frames])),
    )
    outbox.start_epoch(1, credits=8)
    stop = threading.Event()
    sender = threading.Thread(target=lambda: [outbox.send_next(0.05) for _ in iter(stop.is_set, True)])
    sender.start()
    try:
        for i in range(5):
            outbox.put(1, item(i))
        assert written == [(current, [(0, [0, 1])]), (current, [(1, [2, 3])])]
        assert wait_until(lambda: len(written) == 3, 5.0)  # the one left open, after linger
        assert written[2] == (sender, [(2, [4])])
        outbox.put(1, item(5))  # after the stall: a slow item, written alone at once
        assert written[3] == (current, [(3, [5])])
        outbox.put(1, item(6))
        while len(written) == 4:  # the batch stays open while items come, at most linger
            time.sleep(0.05)
            outbox.put(1, item(7))
        assert written[4][0] is current and written[4][1][0][1][:2] == [6, 7]
    finally:
        stop.set()
        outbox.close()
        sender.join(5.0)
    assert not sender.is_alive()


def test_while_its_producer_puts_items_the_sender_looks_for_a_stall_ever_less_often():
    # Each look takes the interpreter lock from the producer: the sender looks after linger, then
    # twice as long each time it finds the producer putting, up to 16 lingers, and after linger
    # again once the producer stops or waits for the trainer.
    outbox = DrivenOutbox(SessionOptions(batch_max_items=100, linger=0.01))
    outbox.start_epoch(1, credits=8)
    outbox.put(1, item(0))
    looks = [outbox._next_look(time.monotonic(), 0.0) for _ in range(7)]
    assert looks == [0.01 * 2**k for k in range(5)] + [0.16, 0.16]
    outbox._last_put -= 0.02  # the producer went quiet
    assert outbox._next_look(time.monotonic(), 0.005) == 0.005
    outbox.put(1, item(1))
    assert outbox._next_look(time.monotonic(), 0.0) == 0.01
    outbox.producer_idle()  # it waits for the trainer: the open batch leaves after linger
    assert outbox._next_look(time.monotonic(), 0.004) == 0.004


def test_a_chunks_end_wakes_a_sender_that_would_look_late():
    # After a CHUNK_DONE the producer may wait for its next lease: the open batch and the marker
    # must leave within linger, not at a look armed for a busy producer.
    outbox = DrivenOutbox(SessionOptions(batch_max_items=100, linger=0.01))
    outbox.start_epoch(1, credits=8, leased=True)
    outbox.lease(1, 0, count=2)
    outbox.put(1, item(0))
    notified = []
    notify_all = outbox._cond.notify_all
    outbox._cond.notify_all = lambda: (notified.append(True), notify_all())
    outbox._sender_wakes_at = time.monotonic() + 0.005  # a look within linger: no wake-up needed
    outbox.mark(1, ChunkDone(1, 0, (1,), None))
    assert notified == []
    outbox._sender_wakes_at = time.monotonic() + 0.16  # the longest look
    outbox.mark(1, ChunkDone(1, 1, (0,), None))
    assert notified == [True]
    frames = outbox.take_frames(1.0)  # after linger (the producer waits for its next lease)
    assert [frame_of(f).kind for f in frames] == [MessageKind.CHUNK_DONE, MessageKind.DATA]
    assert ChunkDone.decode(frame_of(frames[0])) == ChunkDone(1, 0, (1, 0))


def test_a_producer_waiting_for_the_trainer_wakes_a_sender_that_would_look_late():
    # Waiting for dispatched input or a lease: the open batch must leave within linger, not at a
    # look armed while the producer was busy.
    outbox = DrivenOutbox(SessionOptions(batch_max_items=100, linger=0.01))
    outbox.start_epoch(1, credits=8)
    outbox.put(1, item(0))
    notified = []
    notify_all = outbox._cond.notify_all
    outbox._cond.notify_all = lambda: (notified.append(True), notify_all())
    outbox._sender_wakes_at = time.monotonic() + 0.005  # a look within linger: no wake-up needed
    outbox.producer_idle()
    assert notified == []
    outbox._sender_wakes_at = time.monotonic() + 0.16  # the longest look
    outbox.producer_idle()
    assert notified == [True]
    assert data_items(outbox.take(1.0))[2] == [0]


def test_a_credit_while_the_producer_fills_a_batch_does_not_wake_the_sender():
    # The producer seals and writes the batch it fills: a CREDIT that finds only that batch (not
    # due) wakes nobody while the sender's next look is near; one that finds the sender asleep for
    # longer (it slept without credit) wakes it, to look for a stall.
    written = []
    outbox = DrivenOutbox(SessionOptions(batch_max_items=100, linger=0.05), send=written.append)
    outbox.start_epoch(1, credits=4)
    notified = []
    notify_all = outbox._cond.notify_all
    outbox._cond.notify_all = lambda: (notified.append(True), notify_all())
    outbox.put(1, item(0))  # opens a batch: wakes the sender, asleep for good, to look in time
    outbox.put(1, item(1))
    assert notified == [True]
    notified.clear()
    outbox._sender_wakes_at = time.monotonic() + 0.05  # the sender looks within linger
    outbox.grant(1, 4)
    assert notified == [] and outbox._taken == []
    outbox._sender_wakes_at = float("inf")  # asleep without a look armed
    outbox.grant(1, 4)
    assert notified == [True] and outbox._taken == [] and written == []
