"""Shared-memory hand-over of large buffers over Unix sockets (local workers).

The frames (golden bytes and their rules) and the segment pool and map against each other in
one process; real worker processes are in test_shared_memory_processes.py.
"""

from __future__ import annotations

import gc
import os

import numpy
import pytest
import torch
from _server_helpers import python_calls

from rpc_reading_service.errors import LocalProtocolError, RemoteProtocolError
from rpc_reading_service.protocol import (
    PROTOCOL_VERSION,
    EncodedItem,
    FrameReader,
    MessageKind,
    encode_data,
    encode_frame,
)
from rpc_reading_service.protocol.frames import (
    SharedBuffer,
    SharedFrame,
    decode_shared_data,
    encode_shared_data,
    split_frame,
)
from rpc_reading_service.serialization import (
    SHARED_MEMORY_MIN_BYTES,
    ItemEncoder,
    accepts_shared_memory,
    buffer_allocator,
    dumps_item,
    loads_item,
    pins_shared_memory,
)
from rpc_reading_service.transports.socket_transport.segment_map import SegmentMap
from rpc_reading_service.transports.socket_transport.segments import HEADER_BYTES
from rpc_reading_service.transports.socket_transport.shared_memory import (
    SegmentPool,
    copy_into_segment,
    shared_memory_available,
)

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="needs memfd (Linux)")

SEGMENT_NAME = "memfd:rpc-reading-service"
BIG = 1 << 20


def header(kind: int, n_buffers: int, body_length: int) -> bytes:
    return b"RRSV" + bytes([PROTOCOL_VERSION, kind]) + n_buffers.to_bytes(2, "big") + body_length.to_bytes(8, "big")


def wire(chunks) -> bytes:
    return b"".join(bytes(chunk) for chunk in chunks)


def frames_of(data: bytes):
    reader = FrameReader()
    reader.feed(data)
    frames = []
    while (frame := reader.next_frame()) is not None:
        frames.append(frame)
    return frames


# -- frames ---------------------------------------------------------------------------------------
def test_golden_offer_and_shared_data():
    assert wire(encode_frame(MessageKind.SHARED_MEMORY_OFFER)) == header(40, 0, 0)
    chunks = encode_shared_data(
        MessageKind.DATA, [b"BODY"], 2, [SharedBuffer(1, 7, 64, 300)], [b"xy"], new_segments=[(7, 4096)], retired=[3]
    )
    expected = (
        header(41, 1, 9 + 12 + 4 + 22 + 4)
        + bytes.fromhex("0000000000000002")  # the inline buffer's length
        + bytes.fromhex("15 0002 0001 0001 0001")  # inner kind DATA, 2 buffers, 1 new, 1 retired, 1 shared
        + bytes.fromhex("00000007 0000000000001000")  # new segment 7 of 4096 bytes
        + bytes.fromhex("00000003")  # retired segment 3
        + bytes.fromhex("0001 00000007 0000000000000040 000000000000012c")  # buffer 1: segment 7, offset 64, 300 bytes
        + b"BODY"
        + b"xy"
    )
    assert wire(chunks) == expected
    (frame,) = frames_of(expected)
    shared = decode_shared_data(frame)
    assert (shared.kind, shared.n_buffers, shared.new_segments, shared.retired) == (MessageKind.DATA, 2, [(7, 4096)], [3])
    assert shared.shared == [SharedBuffer(1, 7, 64, 300)] and bytes(shared.body) == b"BODY"
    assert [bytes(b) for b in shared.inline] == [b"xy"] and shared.shared_bytes == 300


def test_split_frame_gives_back_what_encode_frame_took():
    body, buffers = encode_data(3, 0, [EncodedItem(b"p", [b"", b"abc"]), EncodedItem(b"q", [b"zz"])])
    kind, split_body, split_buffers = split_frame(encode_frame(MessageKind.DATA, body, buffers))
    assert kind == MessageKind.DATA
    assert wire(split_body) == wire(body) and [bytes(b) for b in split_buffers] == [b"", b"abc", b"zz"]


@pytest.mark.parametrize(
    "shared, inline, n_buffers, match",
    [
        ([SharedBuffer(1, 1, 64, 8), SharedBuffer(0, 1, 64, 8)], [], 2, "do not ascend"),
        ([SharedBuffer(2, 1, 64, 8)], [b"a", b"b"], 3, None),
        ([SharedBuffer(5, 1, 64, 8)], [b"a"], 2, "below 2"),
    ],
)
def test_shared_data_rules(shared, inline, n_buffers, match):
    if match is None:  # the valid one
        (frame,) = frames_of(wire(encode_shared_data(MessageKind.DATA, [b""], n_buffers, shared, inline)))
        assert [b.index for b in decode_shared_data(frame).shared] == [2]
        return
    table = bytes.fromhex("15") + n_buffers.to_bytes(2, "big") + bytes(4) + len(shared).to_bytes(2, "big")
    table += b"".join(b.index.to_bytes(2, "big") + b.segment.to_bytes(4, "big") + b.offset.to_bytes(8, "big")
                      + b.length.to_bytes(8, "big") for b in shared)  # fmt: skip
    (frame,) = frames_of(wire(encode_frame(MessageKind.SHARED_DATA, [table], inline)))
    with pytest.raises(RemoteProtocolError, match=match):
        decode_shared_data(frame)


def test_shared_data_wraps_only_data_and_counts_every_buffer():
    with pytest.raises(LocalProtocolError, match="only DATA"):
        encode_shared_data(MessageKind.ITEMS, [], 0, [], [])
    with pytest.raises(LocalProtocolError, match="not the frame's 3"):
        encode_shared_data(MessageKind.DATA, [], 3, [SharedBuffer(0, 1, 64, 1)], [b"a"])
    (frame,) = frames_of(wire(encode_frame(MessageKind.SHARED_DATA, [bytes.fromhex("16 0000 0000 0000 0000")])))
    with pytest.raises(RemoteProtocolError, match="only DATA"):
        decode_shared_data(frame)
    (frame,) = frames_of(wire(encode_frame(MessageKind.SHARED_DATA, [bytes.fromhex("15 0000 0001 0000 0000")])))
    with pytest.raises(RemoteProtocolError, match="too short"):
        decode_shared_data(frame)


def shared_ranges(pid) -> list:
    """The address ranges ``pid`` maps of segments."""
    with open(f"/proc/{pid}/maps") as maps:
        lines = [line.split() for line in maps if SEGMENT_NAME in line]
    return [tuple(int(x, 16) for x in fields[0].split("-")) for fields in lines]


def in_shared_memory(address: int, ranges) -> bool:
    return any(start <= address < end for start, end in ranges)



# -- pool and map, in one process -------------------------------------------------------------------
def encode_in_session(item) -> EncodedItem:
    """Encode ``item`` as a local worker's session does (large buffers staged in its segments)."""
    return ItemEncoder(stage=copy_into_segment).encode(item)


def _hand_over(pool: SegmentPool, segments: SegmentMap, buffers, max_frame_bytes: int = 1 << 30, made=None):
    """What the two ends of a connection do with one frame's buffers: the received buffers
    (the ids of the segments it made go in ``made``)."""
    shared, inline, new, retired = pool.lend(buffers, SHARED_MEMORY_MIN_BYTES)
    if made is not None:
        made += [segment_id for segment_id, _, _ in new]
    fds = [os.dup(fd) for _, _, fd in new]  # what SCM_RIGHTS does
    pool.sent(new)
    (frame,) = frames_of(wire(encode_shared_data(MessageKind.DATA, [], len(buffers), shared, inline,
                                                 [(i, n) for i, n, _ in new], retired)))  # fmt: skip
    return segments.open(decode_shared_data(frame), fds, max_frame_bytes).buffers


def test_segments_are_reused_once_the_trainer_lets_go_and_stay_bounded():
    pool, segments = SegmentPool(max_bytes=4 * (BIG + 4096), max_free=2), SegmentMap("test")
    item = torch.full((BIG,), 7, dtype=torch.uint8)
    encoded = dumps_item(item)
    for _ in range(5):  # one item at a time: one segment serves them all
        (buffer,) = _hand_over(pool, segments, encoded.buffers)
        received = loads_item(EncodedItem(encoded.payload, [buffer]))
        assert torch.equal(received, item)
        del buffer, received
    assert pool.segments == 1 == segments.segments
    held = []
    for _ in range(6):  # a consumer that keeps everything: the pool stops at max_bytes
        (buffer,) = _hand_over(pool, segments, encoded.buffers)
        held.append(loads_item(EncodedItem(encoded.payload, [buffer])))
        del buffer
    assert pool.segments == 4
    assert [isinstance(b, (bytes, bytearray, memoryview)) for b in _hand_over(pool, segments, encoded.buffers)] == [True]
    assert all(torch.equal(t, item) for t in held)
    held.clear()  # four free segments, two kept: the next frame retires the others
    gc.collect()
    (buffer,) = _hand_over(pool, segments, encoded.buffers)
    assert pool.segments == 2 == segments.segments and torch.equal(loads_item(EncodedItem(encoded.payload, [buffer])), item)
    small = numpy.full(SHARED_MEMORY_MIN_BYTES, 3, dtype=numpy.uint8)
    (buffer,) = _hand_over(pool, segments, [memoryview(small)])
    assert pool.segments == segments.segments <= 3 and bytes(buffer) == small.tobytes()
    pool.close()  # a closed connection's pool lends nothing more
    assert pool.segments == 0 and isinstance(_hand_over(pool, segments, encoded.buffers)[0], (bytes, bytearray, memoryview))


def _bound_pool(frames: int):
    """A pool bound to ``frames`` frames, its trainer's map, a 1 MiB tensor and its encoding."""
    pool, segments = SegmentPool(), SegmentMap("test")
    pool.bound(frames, BIG)
    item = torch.full((BIG,), 7, dtype=torch.uint8)
    return pool, segments, item, dumps_item(item)


def test_a_bound_pool_retires_free_segments_past_the_window_and_lends_past_it_while_held():
    # The trainer maps every segment of the pool: free ones past the connection's share of the
    # credit window (plus one) are retired; a consumer holding more gets new ones, not a stall.
    mapped_before = len(shared_ranges(os.getpid()))
    pool, segments, item, encoded = _bound_pool(2)
    held = []
    for _ in range(5):  # a consumer that keeps five items: five segments lent
        (buffer,) = _hand_over(pool, segments, encoded.buffers)
        held.append(loads_item(EncodedItem(encoded.payload, [buffer])))
        del buffer
    assert pool.segments == 5 and all(torch.equal(t, item) for t in held)
    held.clear()
    gc.collect()
    (buffer,) = _hand_over(pool, segments, encoded.buffers)  # the next frame retires the surplus
    assert pool.segments == 2 == segments.segments
    assert torch.equal(loads_item(EncodedItem(encoded.payload, [buffer])), item)
    gc.collect()
    assert len(shared_ranges(os.getpid())) - mapped_before == 4  # the retired ones unmapped on both ends


def test_a_bound_pool_holds_its_window_of_items_larger_than_its_max_bytes_in_segments():
    # Items so large that the credit window's worth of them is over max_bytes (a window of 4
    # batches of 700 MiB against 1 GiB): each one still gets a segment (went through the socket,
    # copied on both ends, at half the rate); past the bound, the cap holds as before.
    pool, segments = SegmentPool(max_bytes=2 * (BIG + 4096)), SegmentMap("test")
    item = torch.full((BIG,), 5, dtype=torch.uint8)
    encoded = dumps_item(item)
    unbound = [_hand_over(pool, segments, encoded.buffers)[0] for _ in range(3)]
    assert [isinstance(b, (bytes, bytearray, memoryview)) for b in unbound] == [False, False, True]  # max_bytes
    del unbound
    gc.collect()
    pool.bound(4, BIG // 2)  # four frames, each of the largest segment (1 MiB and its header)
    held = [_hand_over(pool, segments, encoded.buffers)[0] for _ in range(5)]
    assert [isinstance(b, (bytes, bytearray, memoryview)) for b in held] == [False] * 4 + [True]
    assert pool.segments == 4 and all(bytes(b[-1:]) == b"\x05" for b in held)
    pool.close()


def test_a_retired_segment_is_unmapped_while_an_older_one_is_still_held():
    # The pool's record of the order it lent in keeps no retired segment (and its memory) alive.
    mapped_before = len(shared_ranges(os.getpid()))
    pool, segments, _item, encoded = _bound_pool(4)
    (oldest,) = _hand_over(pool, segments, encoded.buffers)  # held for the whole test
    later = [_hand_over(pool, segments, encoded.buffers)[0] for _ in range(7)]
    assert pool.segments == 8
    del later
    gc.collect()
    (buffer,) = _hand_over(pool, segments, encoded.buffers)  # retires the free ones past the bound
    assert pool.segments == segments.segments < 8
    assert bytes(oldest[:1]) == bytes(buffer[-1:]) == b"\x07"
    gc.collect()
    assert len(shared_ranges(os.getpid())) - mapped_before == 2 * pool.segments  # on both ends
    pool.close()


def test_a_bound_pool_lends_its_window_of_small_segments_again_and_makes_no_more():
    # A consumer that holds a window's worth of 256 KiB items, then lets them go, again and
    # again: the pool keeps the window's segments (bound by their bytes, not by a count of free
    # ones) and makes none after the first window (main: all but 8 retired and made again).
    pool, segments = SegmentPool(), SegmentMap("test")
    pool.bound(5, BIG)
    segments.bound(5, BIG)
    item = numpy.arange(SHARED_MEMORY_MIN_BYTES, dtype=numpy.uint8)
    made = []
    for _ in range(4):
        held = [_hand_over(pool, segments, [memoryview(item)], made=made)[0] for _ in range(16)]
        assert all(numpy.array_equal(numpy.frombuffer(buffer, dtype=numpy.uint8), item) for buffer in held)
        del held
        gc.collect()
    assert len(made) == 16 == pool.segments == segments.segments, made
    pool.close()


def _shmem_kib() -> int:
    """This process's resident shared memory (every mapping of a segment counts its pages)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssShmem:"))


def test_a_bound_map_drops_the_pages_of_free_segments_past_its_window_and_maps_them_when_lent_again():
    # The trainer keeps the window (two frames here) and the two frames a worker fills past it
    # resident (two 1 MiB segments, then 2 MiB): once the consumer let go of six, the next frame drops
    # the pages of the newest free ones; a dropped one lent again is mapped again with its bytes.
    pool, segments = SegmentPool(), SegmentMap("test")
    segments.bound(2, BIG)
    items = [numpy.full(BIG, i, dtype=numpy.uint8) for i in range(6)]
    held = [_hand_over(pool, segments, [memoryview(item)])[0] for item in items]
    assert pool.segments == segments.segments == 6
    before = _shmem_kib()
    del held
    gc.collect()
    (first,) = _hand_over(pool, segments, [memoryview(items[0])])  # lent in the oldest segment
    assert before - _shmem_kib() >= 3 * BIG // 1024  # the newest three dropped
    again = [_hand_over(pool, segments, [memoryview(item)])[0] for item in items[1:]]  # every segment again
    assert _shmem_kib() - before >= -BIG // 1024 and pool.segments == segments.segments == 6
    assert [int(numpy.frombuffer(b, dtype=numpy.uint8)[-1]) for b in [first] + again] == list(range(6))
    pool.close()


def test_a_frame_within_the_bound_costs_the_map_no_look_at_each_segment():
    # Before each frame the trainer checks that the segments it keeps resident stay within its
    # bound: counted as they change, not by a call per mapped segment (32 here) per frame.
    pool, segments = SegmentPool(), SegmentMap("test")
    pool.bound(64, BIG)
    segments.bound(64, BIG)
    item = numpy.full(SHARED_MEMORY_MIN_BYTES, 5, dtype=numpy.uint8)
    held = [_hand_over(pool, segments, [memoryview(item)])[0] for _ in range(32)]
    del held
    gc.collect()
    shared, inline, new, retired = pool.lend([memoryview(item)], SHARED_MEMORY_MIN_BYTES)
    frame = SharedFrame(MessageKind.DATA, 1, [], retired, shared, b"", inline)
    received, calls = python_calls(segments.open, frame, [], 1 << 30)
    # The frame's byte counts, then one call to keep the bound and the buffer's, and the Frame's.
    assert calls == ["shared_bytes", "<genexpr>", "<genexpr>", "<genexpr>", "_make_room", "_buffer", "__init__"], calls
    assert bytes(received.buffers[0]) == item.tobytes() and segments.segments == 32
    pool.close()


def test_the_frames_a_worker_fills_past_the_window_stay_resident_in_the_trainer():
    # A worker's pool keeps the window plus its own frames (the batch open, the one sealed for
    # credit, the item being made), and stages items two frames ahead of what the trainer holds:
    # the trainer keeps those two frames resident too, so a stream maps and drops no page
    # (main: a madvise pair, ~40-160 us, for every few 256 KiB-1 MiB items).
    import collections
    import sys

    pool, segments = SegmentPool(), SegmentMap("test")
    pool.bound(2 + 3, BIG)  # a window of two frames, as a worker's session bounds its pool
    segments.bound(2 + 1, BIG)  # and as the trainer's channel bounds its map
    pool.offer_to_producers()
    madvised = [0]

    def count(frame, event, arg):
        madvised[0] += event == "c_call" and arg.__name__ == "madvise"

    held, staged = collections.deque(), collections.deque()
    try:
        for step in range(30):
            item = numpy.full(SHARED_MEMORY_MIN_BYTES, step, dtype=numpy.uint8)
            staged.append([copy_into_segment(memoryview(item)) for _ in range(3)])  # 3 items a 1 MiB frame
            if len(staged) > 2:
                lent = staged.popleft()
                sys.setprofile(count if step >= 10 else None)
                held.append(_hand_over(pool, segments, lent))
                sys.setprofile(None)
                del lent
                if len(held) > 2:
                    held.popleft()
        assert [int(numpy.frombuffer(b, dtype=numpy.uint8)[0]) for b in held[-1]] == [27] * 3
    finally:
        sys.setprofile(None)
    assert madvised[0] == 0
    del held, staged
    pool.close()


def test_numpy_arrays_keep_their_segment_lent_while_they_live():
    pool, segments = SegmentPool(), SegmentMap("test")
    array = numpy.arange(BIG, dtype=numpy.int32)
    encoded = dumps_item(array)
    (buffer,) = _hand_over(pool, segments, encoded.buffers)
    received = loads_item(EncodedItem(encoded.payload, [buffer]))
    del buffer
    gc.collect()
    (other,) = _hand_over(pool, segments, encoded.buffers)  # the first segment is still lent
    assert pool.segments == 2 and numpy.array_equal(received, array)
    del received, other
    gc.collect()
    _hand_over(pool, segments, encoded.buffers)
    assert pool.segments == 2  # both free again: reused


def test_staging_and_lending_a_buffer_cost_no_python_call_per_segment_of_the_pool():
    # Locally every large buffer is staged in a segment as it is encoded and lent with its frame:
    # neither looks at each of the pool's segments through a call, and the smallest fitting one is
    # taken; a pool with nothing to retire does not look for it, and the staged memory is known as
    # itself (its address not computed again).
    pool, segments = SegmentPool(), SegmentMap("test")
    held = [_hand_over(pool, segments, [numpy.full(BIG + (7 - i) * 4096, i, dtype=numpy.uint8)]) for i in range(8)]
    del held
    gc.collect()  # eight free segments, the smallest made last
    item = numpy.full(BIG, 5, dtype=numpy.uint8)
    staged, calls = python_calls(pool.stage, memoryview(item))
    assert calls == ["_made_in", "_allocate", "_fitting", "_segment_bytes", "_hand_out"], calls
    (shared, inline, new, retired), calls = python_calls(pool.lend, [staged], SHARED_MEMORY_MIN_BYTES)
    assert calls == ["_made_in", "_lend_made", "<lambda>"], calls  # <lambda>: its SharedBuffer's __new__
    assert [b.segment for b in shared] == [8] and not (inline or new or retired) and pool.segments == 8
    del staged
    (received,) = segments.open(SharedFrame(MessageKind.DATA, 1, [], [], shared, b"", []), [], 1 << 30).buffers
    assert bytes(received) == item.tobytes()


def test_a_buffer_is_told_apart_from_the_pools_segments_without_a_look_at_each():
    # With a frame's worth of items staged and not yet sent, the next item's buffer (ordinary
    # memory) is known to be none of theirs without its address: only segments a graph makes
    # items in (allocate, behind shared_empty) are compared by address.
    pool = SegmentPool()
    staged = [pool.stage(memoryview(numpy.full(BIG, i, dtype=numpy.uint8))) for i in range(40)]
    item = memoryview(numpy.full(BIG, 7, dtype=numpy.uint8))
    copy, calls = python_calls(pool.stage, item)
    assert "_address" not in calls and bytes(copy) == bytes(item), calls
    (shared, inline, new, retired), calls = python_calls(pool.lend, [staged[3]], SHARED_MEMORY_MIN_BYTES)
    assert "_address" not in calls and "_lend_made" in calls and len(shared) == 1 and not inline, calls
    in_segment = pool.allocate(BIG)  # as shared_empty asks for one
    made = memoryview(in_segment).cast("B")
    same, calls = python_calls(pool.stage, made[4096:])
    assert "_address" in calls and same.obj is in_segment, calls  # lent as it is, no copy
    del in_segment, made, same
    gc.collect()
    assert "_address" not in python_calls(pool.stage, item)[1]  # let go: no segment a graph makes items in
    del staged, copy
    pool.close()


def test_a_local_workers_encoder_calls_its_stage_only_for_buffers_that_may_go_in_segments():
    # A worker's session makes its encoder from its connection's stage_buffer and stage_min_bytes:
    # a buffer under the shared-memory threshold is copied as over any socket with no call to
    # learn that, a larger one costs one call (the pool's function itself, no method around it).
    import socket

    from rpc_reading_service.transports.socket_transport import SharedMemoryConnection

    worker_sock, trainer_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = SharedMemoryConnection(worker_sock, "trainer", FrameReader(), lend=True)
    pool = SegmentPool()
    pool.offer_to_producers()
    try:
        encoder = ItemEncoder(conn.stage_buffer, stage_min_bytes=conn.stage_min_bytes)
        for nbytes, staged in [(SHARED_MEMORY_MIN_BYTES // 2, False), (SHARED_MEMORY_MIN_BYTES, True)]:
            tensor = torch.full((nbytes,), 7, dtype=torch.uint8)
            encoder.encode(tensor)  # the reused copy (or the segment) exists: as in a stream
            encoded, calls = python_calls(encoder.encode, tensor)
            stage_calls = [name for name in calls if name in ("stage_buffer", "copy_into_segment")]
            assert stage_calls == (["copy_into_segment"] if staged else []), calls
            assert encoded.staged is staged and torch.equal(loads_item(encoded), tensor)
    finally:
        pool.close()
        conn.close()
        trainer_sock.close()


def _lines_run_in(function_name: str, function, *args):
    """``function(*args)``'s result and how many lines of the functions named ``function_name`` ran."""
    import sys

    lines = [0]

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_name == function_name:
            def count(frame, event, arg):
                lines[0] += event == "line"
                return count
            return count
        return None

    sys.settrace(trace)
    try:
        result = function(*args)
    finally:
        sys.settrace(None)
    return result, lines[0]


def test_a_buffer_takes_the_first_free_segment_made_for_its_size_without_looking_further():
    # A stream of same-sized buffers: the oldest segment let go that was made for that size is the
    # smallest that fits, so the pool looks no further whether it holds 4 segments or 32, and
    # whether the older ones are lent again (the trainer lets go in about the order lent: the first
    # buffer after it let go of them all finds them, once).
    looked = []
    for count in (4, 32):
        pool, segments = SegmentPool(), SegmentMap("test")
        pool.bound(64, BIG)
        item = numpy.full(SHARED_MEMORY_MIN_BYTES, 6, dtype=numpy.uint8)
        held = [_hand_over(pool, segments, [memoryview(item)]) for _ in range(count)]
        del held
        gc.collect()
        lent_again = [_hand_over(pool, segments, [memoryview(item)]) for _ in range(count - 1)]  # the oldest
        staged, lines = _lines_run_in("_fitting", pool.stage, memoryview(item))
        (received,) = _hand_over(pool, segments, [staged])
        assert bytes(received) == item.tobytes() and pool.segments == count and len(lent_again) == count - 1
        looked.append(lines)
        del staged, received
        pool.close()
    assert looked[0] == looked[1], looked


def test_a_buffer_the_consumer_never_lets_go_leaves_the_pools_bookkeeping_bounded():
    import tracemalloc

    from rpc_reading_service.transports.socket_transport import shared_memory

    pool, segments = SegmentPool(), SegmentMap("test")
    pool.bound(64, BIG)
    item = numpy.full(SHARED_MEMORY_MIN_BYTES, 6, dtype=numpy.uint8)
    kept = _hand_over(pool, segments, [memoryview(item)])  # the oldest lent segment, held for ever

    def hand_over(frames: int) -> int:
        for _ in range(frames):
            (received,) = _hand_over(pool, segments, [memoryview(item)])
            assert bytes(received[:1]) == b"\x06"
            del received
        traces = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, shared_memory.__file__)])
        return sum(stat.size for stat in traces.statistics("filename"))

    tracemalloc.start()
    try:
        hand_over(200)
        before = hand_over(200)
        after = hand_over(2000)
    finally:
        tracemalloc.stop()
    assert after - before < 4096, (before, after)
    assert pool.segments == 2 and len(kept) == 1
    pool.close()


def test_items_made_in_a_segment_are_lent_as_they_are_and_reused_once_both_sides_let_go():
    from rpc_reading_service import shared_collate, shared_empty

    pool, segments = SegmentPool(max_bytes=3 * (BIG + 4096)), SegmentMap("test")
    def shared(tensor) -> bool:
        return in_shared_memory(tensor.data_ptr(), shared_ranges(os.getpid()))

    assert not shared(shared_empty((BIG,))) and pool.segments == 0  # no session here: ordinary memory
    pool.offer_to_producers()
    try:
        samples = [{"x": numpy.full(BIG // 8, i, dtype=numpy.int32), "i": i} for i in range(2)]
        batch = shared_collate(samples)  # torch's default_collate, stacked into a segment
        assert shared(batch["x"]) and pool.segments == 1
        expected = torch.utils.data.default_collate(samples)
        assert torch.equal(batch["x"], expected["x"]) and torch.equal(batch["i"], expected["i"])
        del batch
        quantized = [torch.quantize_per_tensor(torch.full((4,), float(i)), 0.5, 1, torch.quint8) for i in range(2)]
        stacked = shared_collate(quantized)  # by torch, in ordinary memory: its quantizer is no segment's
        assert (stacked.q_scale(), stacked.q_zero_point(), stacked.int_repr().tolist()) == (0.5, 1, [[1] * 4, [3] * 4])
        with pytest.raises(TypeError, match="torch.quint8 is a quantized dtype"):
            shared_empty((BIG,), torch.quint8)
        assert pool.segments == 1
        for round_ in range(3):
            made = shared_empty((BIG // 4,), torch.int32)
            made.fill_(round_)
            encoded = encode_in_session(made)
            (buffer,) = _hand_over(pool, segments, encoded.buffers)
            received = loads_item(EncodedItem(encoded.payload, [buffer]))
            made[0] = -1  # the very same memory: nothing was copied
            assert int(received[0]) == -1 and bool((received[1:] == round_).all())
            (again,) = _hand_over(pool, segments, encoded.buffers)  # sent twice while lent: copied then
            made[1] = -2
            assert int(loads_item(EncodedItem(encoded.payload, [again]))[1]) == round_
            del made, encoded, buffer, received, again
            gc.collect()
        assert pool.segments == 2 == segments.segments  # the made one and the copy's, reused every round
        held = [shared_empty((BIG,)) for _ in range(3)]  # in the producer's hands: never lent to copies
        assert all(shared(t) for t in held) and pool.segments == 3
        assert not shared(shared_empty((BIG,))) and not shared(shared_empty((SHARED_MEMORY_MIN_BYTES - 1,)))
        assert pool.segments == 3  # full, or too small to be worth a segment: ordinary memory
        (buffer,) = _hand_over(pool, segments, encode_in_session(held[0]).buffers)
        held[0][5] = 9  # lent as it is, though the pool was full
        assert numpy.frombuffer(buffer, numpy.uint8)[5] == 9
    finally:
        pool.close()
    assert not shared(shared_empty((BIG,)))  # a closed pool gives out nothing


def test_a_segment_a_producer_let_go_unsent_is_announced_when_a_copy_reuses_it():
    from rpc_reading_service import shared_empty

    pool, segments = SegmentPool(), SegmentMap("test")
    pool.offer_to_producers()
    try:
        scratch = shared_empty((BIG,))  # made in a segment, dropped without being yielded
        del scratch
        gc.collect()
        assert pool.segments == 1
        item = torch.full((BIG,), 7, dtype=torch.uint8)  # ordinary memory: copied into that segment
        encoded = dumps_item(item)
        (buffer,) = _hand_over(pool, segments, encoded.buffers)
        assert pool.segments == 1 == segments.segments
        assert torch.equal(loads_item(EncodedItem(encoded.payload, [buffer])), item)
    finally:
        pool.close()


def test_frames_sent_together_bring_every_new_segment_over_a_real_socket():
    import socket

    from rpc_reading_service.protocol import decode_data
    from rpc_reading_service.transports.socket_transport import SharedMemoryConnection
    from rpc_reading_service.transports.socket_transport.shared_memory import MAX_NEW_SEGMENTS_PER_FRAME

    worker_sock, trainer_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    worker = SharedMemoryConnection(worker_sock, "trainer", FrameReader(), lend=True)
    trainer = SharedMemoryConnection(trainer_sock, "worker 0", FrameReader(), offered=True)
    try:
        trainer.send(encode_frame(MessageKind.SHARED_MEMORY_OFFER, []))
        assert worker.recv(timeout=5.0) is None and worker.shared_segments == 0  # the offer is consumed
        per_frame = MAX_NEW_SEGMENTS_PER_FRAME // 2 + 1  # two frames bring more descriptors than one send may
        frames, expected = [], []
        for sequence in range(3):
            items = [dumps_item(numpy.full(SHARED_MEMORY_MIN_BYTES, 10 * sequence + i, dtype=numpy.uint8))
                     for i in range(per_frame)]
            expected.append([10 * sequence + i for i in range(per_frame)])
            frames.append(encode_frame(MessageKind.DATA, *encode_data(0, sequence, items)))
        worker.send_frames(frames)
        for sequence in range(3):
            frame = trainer.recv(timeout=5.0)
            assert frame is not None and frame.kind == MessageKind.DATA
            _epoch, got_sequence, items = decode_data(frame)
            assert got_sequence == sequence
            assert [int(loads_item(item)[-1]) for item in items] == expected[sequence]
        assert worker.shared_segments == trainer.shared_segments == 3 * per_frame
    finally:
        worker.close()
        trainer.close()


def test_the_map_refuses_placements_outside_what_the_worker_announced():
    pool, segments = SegmentPool(), SegmentMap("worker 0 (unix:@x)")
    (buffer,) = _hand_over(pool, segments, [bytes(SHARED_MEMORY_MIN_BYTES)])
    del buffer
    for placed, match in [
        (SharedBuffer(0, 99, HEADER_BYTES, 8), "never announced"),
        (SharedBuffer(0, 1, HEADER_BYTES, 1 << 30), "offset 64 of a"),
        (SharedBuffer(0, 1, 0, 8), "offset 0 of a"),
    ]:
        (frame,) = frames_of(wire(encode_shared_data(MessageKind.DATA, [], 1, [placed], [])))
        with pytest.raises(RemoteProtocolError, match=match):
            segments.open(decode_shared_data(frame), [], 1 << 40)
    (frame,) = frames_of(wire(encode_shared_data(MessageKind.DATA, [], 1, [SharedBuffer(0, 1, 64, 8)], [], [(5, 8192)])))
    with pytest.raises(RemoteProtocolError, match="0 descriptors for 1 new segments"):
        segments.open(decode_shared_data(frame), [], 1 << 40)
    with pytest.raises(RemoteProtocolError, match="over the maximum"):
        segments.open(decode_shared_data(frame), [os.memfd_create("x")], 4)


@pytest.mark.timeout(20)
def test_a_process_forked_from_the_trainer_can_drop_received_buffers():
    # The local worker server is forked from the trainer: it has the trainer's objects and
    # mappings, and must not crash (nor free the trainer's segment) when one of them goes.
    pool, segments = SegmentPool(), SegmentMap("test")
    (buffer,) = _hand_over(pool, segments, [bytes(SHARED_MEMORY_MIN_BYTES)])
    pid = os.fork()
    if pid == 0:
        try:
            del buffer
            gc.collect()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0, "the forked process crashed dropping a received buffer"
    assert shared_ranges(os.getpid())  # the trainer still maps it


def test_pin_memory_keeps_the_shared_segments_and_page_locks_them_where_cuda_is():
    assert accepts_shared_memory(buffer_allocator(False)) and accepts_shared_memory(None)
    assert not accepts_shared_memory(lambda n: torch.empty(n, dtype=torch.uint8).numpy())  # an unknown allocator
    assert accepts_shared_memory(buffer_allocator(True))  # pinned or not: the segments are kept
    assert pins_shared_memory(buffer_allocator(True)) == torch.cuda.is_available()
    assert not pins_shared_memory(buffer_allocator(False))
    pool, segments = SegmentPool(), SegmentMap("test", pin=True)  # without CUDA: mapped as they are
    item = torch.full((BIG,), 5, dtype=torch.uint8)
    encoded = dumps_item(item)
    (buffer,) = _hand_over(pool, segments, encoded.buffers)
    received = loads_item(EncodedItem(encoded.payload, [buffer]))
    assert torch.equal(received, item) and in_shared_memory(received.data_ptr(), shared_ranges(os.getpid()))
    del buffer, received
    gc.collect()
    (buffer,) = _hand_over(pool, segments, encoded.buffers)
    assert pool.segments == 1 == segments.segments  # let go, reused
    segments.close()
