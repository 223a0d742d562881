"""A local worker's DATA frames of items pickled in band: their body handed over in a shared segment
(no copy into the Unix socket and out of it), freed once the trainer has unpickled the items."""

from __future__ import annotations

import contextlib
import gc
import os
import socket

import numpy
import pytest
import torch
from test_shared_memory import frames_of, in_shared_memory, shared_ranges, wire

from rpc_reading_service.errors import LocalProtocolError, RemoteProtocolError
from rpc_reading_service.protocol import FrameReader, MessageKind, decode_data, encode_data, encode_frame
from rpc_reading_service.protocol.frames import SharedBuffer, decode_shared_data, encode_shared_data
from rpc_reading_service.serialization import SHARED_MEMORY_MIN_BYTES, dumps_item, loads_item
from rpc_reading_service.transports.socket_transport import SharedMemoryConnection
from rpc_reading_service.transports.socket_transport.shared_memory import (
    GATHER_MIN_CHUNK_BYTES,
    shared_memory_available,
)

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="needs memfd (Linux)")


def test_a_body_in_a_segment_is_the_last_entry_and_no_body_travels_with_it():
    body_placed = SharedBuffer(1, 9, 64, 70_000)
    placements = [SharedBuffer(0, 7, 64, 300), body_placed]
    chunks = encode_shared_data(MessageKind.DATA, [], 1, placements, [], [(9, 1 << 17)])
    (frame,) = frames_of(wire(chunks))
    shared = decode_shared_data(frame)
    assert shared.shared == [SharedBuffer(0, 7, 64, 300)] and shared.body_placed == body_placed
    assert bytes(shared.body) == b"" and shared.shared_bytes == 70_300 and shared.placed_segments == {7, 9}
    with pytest.raises(LocalProtocolError, match="sends no body too"):
        encode_shared_data(MessageKind.DATA, [b"BODY"], 0, [SharedBuffer(0, 9, 64, 8)], [])
    # A frame that says its body is in a segment and carries one too is refused, not half read.
    table = bytes.fromhex("15 0000 0000 0000 0001")  # DATA, no buffers, one placement: the body
    table += bytes.fromhex("0000 00000009 0000000000000040 0000000000000008")
    (frame,) = frames_of(wire(encode_frame(MessageKind.SHARED_DATA, [table, b"BODY"])))
    with pytest.raises(RemoteProtocolError, match="sends a body too"):
        decode_shared_data(frame)


@contextlib.contextmanager
def _pair():
    """A worker's and a trainer's connection over a Unix socket pair, shared memory offered."""
    worker_sock, trainer_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    worker = SharedMemoryConnection(worker_sock, "trainer", FrameReader(), lend=True)
    trainer = SharedMemoryConnection(trainer_sock, "worker 0", FrameReader(), offered=True)
    try:
        trainer.send(encode_frame(MessageKind.SHARED_MEMORY_OFFER, []))  # in the worker's socket once sent
        assert worker.recv_ready() == []  # the offer, consumed by the connection
        yield worker, trainer
    finally:
        worker.close()
        trainer.close()


@pytest.mark.parametrize("item_bytes", [1024, 2 * GATHER_MIN_CHUNK_BYTES], ids=["joined", "gathered"])
def test_in_band_items_arrive_on_a_segment_the_worker_reuses_once_they_are_unpickled(item_bytes):
    with _pair() as (worker, trainer):
        count = 2 * SHARED_MEMORY_MIN_BYTES // item_bytes  # a body of 128 KiB and a little more
        for sequence in range(6):
            items = [dumps_item(numpy.full(item_bytes, (sequence * count + i) % 251, dtype=numpy.uint8))
                     for i in range(count)]  # fmt: skip
            assert not any(item.buffers for item in items)  # every one pickled in band
            worker.send_frames([encode_frame(MessageKind.DATA, *encode_data(0, sequence, items))])
            frame = trainer.recv(timeout=5.0)
            assert frame is not None and frame.kind == MessageKind.DATA
            body_at = numpy.frombuffer(frame.body, dtype=numpy.uint8).ctypes.data
            assert in_shared_memory(body_at, shared_ranges(os.getpid()))  # not read from the socket
            _epoch, got, received = decode_data(frame)
            values = [int(loads_item(item)[-1]) for item in received]
            assert got == sequence and values == [(sequence * count + i) % 251 for i in range(count)]
            del frame, received
            gc.collect()
        # Each body's segment was free again when the next frame was sent: one segment in all.
        assert worker.shared_segments == trainer.shared_segments == 1


def test_a_frame_with_its_body_and_a_large_buffer_in_segments_unpickles_as_the_trainer_does():
    from rpc_reading_service.frame_items import loads_payloads
    from rpc_reading_service.protocol import decode_data_parts

    with _pair() as (worker, trainer):
        small = [torch.full((4096,), i, dtype=torch.uint8) for i in range(20)]  # in band: a body of 80 KiB
        large = torch.full((SHARED_MEMORY_MIN_BYTES,), 7, dtype=torch.uint8)  # out of band
        items = [dumps_item(item) for item in [*small, large]]
        assert [len(item.buffers) for item in items] == [0] * 20 + [1]
        worker.send_frames([encode_frame(MessageKind.DATA, *encode_data(0, 0, items))])
        frame = trainer.recv(timeout=5.0)
        assert frame is not None and worker.shared_segments == 2  # the buffer's segment and the body's
        _epoch, _sequence, payloads, buffers = decode_data_parts(frame)
        received = loads_payloads(payloads, buffers)
        assert all(torch.equal(got, sent) for got, sent in zip(received, [*small, large]))


def test_a_small_body_travels_in_the_frame():
    with _pair() as (worker, trainer):
        items = [dumps_item(torch.arange(10))]
        worker.send_frames([encode_frame(MessageKind.DATA, *encode_data(0, 0, items))])
        frame = trainer.recv(timeout=5.0)
        assert frame is not None and torch.equal(loads_item(decode_data(frame)[2][0]), torch.arange(10))
        assert worker.shared_segments == trainer.shared_segments == 0


def _sixteen_kib(index: int) -> torch.Tensor:
    return torch.full((16 * 1024,), index % 251, dtype=torch.uint8)


@pytest.mark.timeout(60)
def test_local_workers_hand_frames_of_small_items_over_in_shared_memory():
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    from rpc_reading_service import RPCReadingService

    graph = IterableWrapper(range(600)).sharding_filter().map(_sixteen_kib)
    with DataLoader2(graph, reading_service=RPCReadingService(num_workers=2)) as dl:
        for _epoch in range(2):
            mapped, got = 0, []
            for item in dl:
                got.append(int(item[0]))
                assert bool((item == item[0]).all())
                mapped = max(mapped, len(shared_ranges(os.getpid())))
            assert sorted(got) == sorted(index % 251 for index in range(600))
            assert mapped > 0  # the frames' bodies came in segments (items of 16 KiB have no large buffer)
    gc.collect()
    assert shared_ranges(os.getpid()) == []
