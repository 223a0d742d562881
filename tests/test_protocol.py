"""The sans-I/O protocol: pure bytes in, frames and messages out. No sockets."""

from __future__ import annotations

import struct
import threading

import pytest
from _server_helpers import python_calls

from rpc_reading_service.errors import AuthenticationError, FrameTooLargeError, ProtocolError
from rpc_reading_service.protocol import (
    HANDSHAKE_KINDS,
    HANDSHAKE_MAX_FRAME_BYTES,
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    ClientHandshake,
    EncodedItem,
    Frame,
    FrameReader,
    MessageKind,
    ServerHandshake,
    decode_control,
    decode_credit,
    decode_data,
    decode_data_parts,
    decode_end_of_shard,
    encode_control,
    encode_credit,
    encode_data,
    encode_end_of_shard,
    encode_frame,
    encode_reject,
)


def wire(chunks) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def read_all(data: bytes, **kwargs):
    reader = FrameReader(**kwargs)
    reader.feed(data)
    frames = []
    while (frame := reader.next_frame()) is not None:
        frames.append(frame)
    return frames, reader


def roundtrip(chunks, **kwargs) -> Frame:
    frames, reader = read_all(wire(chunks), **kwargs)
    assert len(frames) == 1
    assert not reader.mid_frame
    return frames[0]


# -- framing ------------------------------------------------------------------------------------
def test_frame_round_trip_with_out_of_band_buffers():
    buffers = [b"x" * 100, bytearray(b"\x00\x01" * 5000), memoryview(b"abc"), b""]
    chunks = encode_frame(MessageKind.DATA, [b"head", b"", b"tail"], buffers)
    frame = roundtrip(chunks)
    assert frame.kind == MessageKind.DATA
    assert bytes(frame.body) == b"headtail"
    assert [bytes(b) for b in frame.buffers] == [bytes(b) for b in buffers]
    assert frame.nbytes == 8 + 100 + 10000 + 3


def test_header_layout_is_versioned_and_length_prefixed():
    data = wire(encode_frame(MessageKind.CLOSE, [b"12345"], [b"ab", b"cde"]))
    magic, version, kind, n_buffers, body_length = HEADER.unpack_from(data)
    assert (magic, version, kind, n_buffers, body_length) == (MAGIC, PROTOCOL_VERSION, MessageKind.CLOSE, 2, 5)
    assert struct.unpack_from("!2Q", data, HEADER.size) == (2, 3)
    assert data.endswith(b"12345abcde")


def test_feeding_byte_by_byte_yields_the_same_frames():
    chunks = (
        encode_frame(MessageKind.HEARTBEAT)
        + encode_frame(MessageKind.DATA, [b"body"], [b"A" * 33, b"B"])
        + encode_control(MessageKind.START_EPOCH, {"epoch": 3})
    )
    data = wire(chunks)
    reader = FrameReader()
    frames = []
    for i in range(len(data)):
        reader.feed(data[i : i + 1])
        while (frame := reader.next_frame()) is not None:
            frames.append(frame)
    assert [f.kind for f in frames] == [MessageKind.HEARTBEAT, MessageKind.DATA, MessageKind.START_EPOCH]
    assert [bytes(b) for b in frames[1].buffers] == [b"A" * 33, b"B"]
    assert decode_control(frames[2]) == {"epoch": 3}
    assert not reader.mid_frame


def test_a_data_frame_of_one_large_item_costs_a_few_python_calls_to_encode_and_to_read():
    # A large item makes a frame alone: the worker encodes it and the trainer decodes it and reads
    # the frame's size (is it a slow stage's?) with no call per part or buffer.
    item = EncodedItem(b"payload", [bytearray(b"\x01" * 300_000), b"", memoryview(b"abc")], nbytes=300_010)

    def encode():
        return encode_frame(MessageKind.DATA, *encode_data(1, 7, [item]))

    chunks, calls = python_calls(encode)
    assert len(calls) <= 3, calls
    frame = roundtrip(chunks)

    def decode():
        epoch, sequence, (payload,), (buffers,) = decode_data_parts(frame)
        return epoch, sequence, payload, buffers, frame.nbytes

    (epoch, sequence, payload, buffers, nbytes), calls = python_calls(decode)
    assert len(calls) <= 4, calls
    assert (epoch, sequence, nbytes, bytes(payload)) == (1, 7, 300_010 + 28, b"payload")
    assert [bytes(b) for b in buffers] == [b"\x01" * 300_000, b"", b"abc"]
    (decoded,) = decode_data(frame)[2]  # the worker's inbox reads ITEMS frames as encoded items
    assert (decoded.nbytes, bytes(decoded.payload), len(decoded.buffers)) == (300_010, b"payload", 3)


def test_whole_small_frames_in_one_go_are_the_frames_of_the_incremental_parser():
    # feed_frames takes whole frames without buffers and the head (header, lengths, body) of a frame
    # with buffers at once; its buffers, a partial frame and the bytes after them go through the
    # incremental parser, frames in order either way.
    chunks = (
        encode_frame(MessageKind.HEARTBEAT)
        + encode_credit(4, 2)
        + encode_frame(MessageKind.DATA, [b"body"], [b"A" * 33, b"B"])
        + encode_data_frame(4, 0, [b"one"])
        + encode_control(MessageKind.START_EPOCH, {"epoch": 3})
        + encode_data_frame(4, 1, [b"two", b"three"])
    )
    data = wire(chunks)
    bulk = FrameReader()
    head = len(wire(encode_frame(MessageKind.HEARTBEAT) + encode_credit(4, 2))) + HEADER.size + 2 * 8 + len(b"body")
    assert FrameReader().feed_frames(memoryview(data[:5])) == 0  # not a whole header
    assert bulk.feed_frames(memoryview(data)) == head
    assert bulk.feed_frames(memoryview(data[head:])) == 0  # in the buffers of a frame
    cut = len(data) - 4  # the last frame arrives in two reads
    bulk.feed(data[head:cut])
    assert bulk.mid_frame
    bulk.feed(data[cut:])
    frames = bulk.completed()
    assert bulk.completed() == [] and not bulk.mid_frame
    expected, _ = read_all(data)
    assert [(f.kind, bytes(f.body), [bytes(b) for b in f.buffers]) for f in frames] == [
        (f.kind, bytes(f.body), [bytes(b) for b in f.buffers]) for f in expected
    ]
    assert [f.kind for f in frames] == [
        MessageKind.HEARTBEAT, MessageKind.CREDIT, MessageKind.DATA, MessageKind.DATA, MessageKind.START_EPOCH,
        MessageKind.DATA,
    ]  # fmt: skip
    assert decode_credit(frames[1]) == (4, 2)
    assert [bytes(item.payload) for item in decode_data(frames[5])[2]] == [b"two", b"three"]


def test_whole_frames_path_leaves_refusals_to_the_incremental_parser():
    small = wire(encode_credit(1, 1))
    over = wire(encode_frame(MessageKind.DATA, [b"x" * 2000]))
    reader = FrameReader(max_frame_bytes=1000)
    assert reader.feed_frames(memoryview(small + over)) == len(small)
    with pytest.raises(FrameTooLargeError, match="2000 bytes"):
        reader.feed(small + over)
    reader = FrameReader(HANDSHAKE_MAX_FRAME_BYTES, allowed_kinds=HANDSHAKE_KINDS)
    assert reader.feed_frames(memoryview(small)) == 0
    with pytest.raises(ProtocolError, match="CREDIT is not allowed"):
        reader.feed(small)
    for header, match in [
        (HEADER.pack(b"GET ", PROTOCOL_VERSION, 1, 0, 0), "magic"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, 1, 0, 0), "version"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, 99, 0, 0), "unknown message kind 99"),
    ]:
        reader = FrameReader()
        assert reader.feed_frames(memoryview(small + header)) == len(small)
        with pytest.raises(ProtocolError, match=match):
            reader.feed(small + header)


def encode_data_frame(epoch: int, sequence: int, payloads) -> list:
    body, buffers = encode_data(epoch, sequence, [EncodedItem(payload) for payload in payloads])
    return encode_frame(MessageKind.DATA, body, buffers)


def test_writable_recv_into_style_reading():
    payload = bytes(range(256)) * 1000
    data = wire(encode_frame(MessageKind.DATA, [b"b"], [payload]))
    allocations = []

    def allocate(n):
        allocations.append(n)
        return bytearray(n)

    reader = FrameReader(allocate=allocate)
    offset = 0
    while offset < len(data):
        view = reader.writable()
        assert len(view) > 0
        n = min(len(view), 7777, len(data) - offset)
        view[:n] = data[offset : offset + n]
        offset += n
        reader.advance(n)
    frame = reader.next_frame()
    assert bytes(frame.buffers[0]) == payload
    assert allocations == [len(payload)]  # the buffer got its own exact allocation


def test_scatter_reading_fills_the_rest_of_a_frame_at_once():
    # Once a frame's buffer lengths are known, its body and every buffer after it can take one
    # read (recvmsg_into): writes spread over several sections complete the right frames.
    payloads = [bytes([k]) * (1000 + 37 * k) for k in range(6)] + [b""]
    data = wire(encode_frame(MessageKind.DATA, [b"body"], payloads)) + wire(encode_frame(MessageKind.CREDIT, [b"c"]))
    reader = FrameReader()
    offset = 0
    sections_seen = []
    while offset < len(data):
        views = reader.writable_sections(4)
        sections_seen.append(len(views))
        n = min(sum(map(len, views)), 2500, len(data) - offset)
        left = n
        for view in views:  # as the kernel fills a scatter read: in order
            step = min(len(view), left)
            view[:step] = data[offset + n - left : offset + n - left + step]
            left -= step
        offset += n
        reader.advance(n)
    frames = reader.completed()
    assert [frame.kind for frame in frames] == [MessageKind.DATA, MessageKind.CREDIT]
    assert bytes(frames[0].body) == b"body" and [bytes(b) for b in frames[0].buffers] == payloads
    assert max(sections_seen) == 4  # at most as many sections as asked for


def test_a_socket_connection_reads_a_frame_of_many_buffers_in_few_reads():
    import socket

    from rpc_reading_service.transports.socket_transport import SocketConnection

    class CountingConnection(SocketConnection):
        staged = 0  # bytes read into the staging buffer (to be copied into the frame's memory)

        def _recv_some(self, views):
            first = views[0] if isinstance(views, list) else views
            n = super()._recv_some(views)
            if first.obj is self._staging.obj:
                self.staged += n
            return n

    ours, theirs = socket.socketpair()
    receiver = CountingConnection(ours, "sender", FrameReader())
    sender = SocketConnection(theirs, "receiver", FrameReader())
    try:
        payloads = [bytes([k]) * (64 << 10) for k in range(16)]  # each under the direct-read size
        sent = threading.Thread(target=sender.send, args=(encode_frame(MessageKind.DATA, [b"b"], payloads),))
        sent.start()
        frame = receiver.recv(timeout=5.0)
        sent.join(5.0)
        assert frame is not None and [bytes(b) for b in frame.buffers] == payloads
        # Not a staging read and a copy per buffer: the frame's rest goes straight to its buffers.
        assert receiver.staged <= 256 << 10, receiver.staged
    finally:
        receiver.close()
        sender.close()


def send_and_wait_arrived(sender, receiving_socket, frames) -> None:
    """Send ``frames`` from another thread and wait until all their bytes wait in ``receiving_socket``."""
    import fcntl
    import termios
    import time

    total = len(wire([chunk for chunks in frames for chunk in chunks]))
    sent = threading.Thread(target=sender.send_frames, args=(frames,))
    sent.start()
    deadline = time.monotonic() + 10
    while fcntl.ioctl(receiving_socket, termios.FIONREAD, b"\0\0\0\0") != struct.pack("i", total):
        assert time.monotonic() < deadline, "the frames did not arrive"
        time.sleep(0.001)
    sent.join(5.0)


@pytest.mark.timeout(30)
def test_frames_of_large_buffers_cost_two_reads_and_few_python_calls_each():
    # Frames of 64 KiB buffers (the items of a DATA frame) that have arrived: each takes a small
    # read of its head (header, lengths, body) and one scatter read of its buffers and the next
    # head, with no Python call and no copy per buffer.
    import socket

    from rpc_reading_service.transports.socket_transport import SocketConnection

    class CountingConnection(SocketConnection):
        reads = 0

        def _recv_some(self, views):
            self.reads += 1
            return super()._recv_some(views)

    ours, theirs = socket.socketpair()
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    receiver = CountingConnection(ours, "sender", FrameReader())
    sender = SocketConnection(theirs, "receiver", FrameReader())
    try:
        frames = [encode_frame(MessageKind.DATA, [bytes(900)], [bytes([k, i]) * (32 << 10) for i in range(8)]) for k in range(4)]
        send_and_wait_arrived(sender, ours, frames)
        received, calls, allnames = [], 0, []
        while len(received) < len(frames):
            ready, names = python_calls(receiver.recv_ready)
            received += ready
            calls += len(names)
            allnames += names
        assert [[bytes(b) for b in frame.buffers] for frame in received] == [[bytes(b) for b in chunks[2:]] for chunks in frames]
        # main: 2 reads and 91 Python calls a frame (a take and two calls per buffer)
        assert receiver.reads <= len(frames) + 1, receiver.reads
        assert calls <= 30 * len(frames), (calls, allnames)
    finally:
        receiver.close()
        sender.close()


@pytest.mark.timeout(30)
def test_a_frames_reused_buffers_cost_no_python_call_each():
    # The trainer's receive memory (ReusedBuffers): a frame's sixteen 64 KiB buffers (a DATA frame
    # of 64 KiB items) are handed out with one call, reused once the frames are let go, and the
    # frame costs no Python call per buffer; its size, counted as it is received, no loop over them.
    import socket

    import numpy

    from rpc_reading_service.serialization import ReusedBuffers
    from rpc_reading_service.transports.socket_transport import SocketConnection

    ours, theirs = socket.socketpair()
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    receiver = SocketConnection(ours, "sender", FrameReader(allocate=ReusedBuffers()))
    sender = SocketConnection(theirs, "receiver", FrameReader())
    try:
        addresses, calls, allnames, received = [], 0, [], 0
        for turn in range(3):
            frames = [encode_frame(MessageKind.DATA, [bytes(900)], [bytes([turn * 32 + k * 16 + i]) * (64 << 10) for i in range(16)])
                      for k in range(2)]  # fmt: skip
            send_and_wait_arrived(sender, ours, frames)
            got: list = []
            while len(got) < len(frames):
                ready, names = python_calls(receiver.recv_ready)
                got += ready
                if turn:  # the first turn makes the buffers
                    calls += len(names)
                    allnames += names
            assert [[bytes(b) for b in frame.buffers] for frame in got] == [[bytes(b) for b in chunks[2:]] for chunks in frames]
            addresses.append(sorted(numpy.asarray(b).ctypes.data for frame in got for b in frame.buffers))
            sizes, names = python_calls(lambda: [frame.nbytes for frame in got])  # counted as received: no loop
            assert sizes == [900 + 16 * (64 << 10)] * 2 and "buffers_nbytes" not in names, names
            received += len(got) if turn else 0
            del got, ready  # the frames are let go: their buffers are free for the next ones
        assert addresses[0] == addresses[1] == addresses[2]  # reused, not made again
        # main: 41 Python calls a frame (a ReusedBuffers call per buffer)
        assert calls <= 30 * received and allnames.count("__call__") == 0, (calls / received, allnames)
    finally:
        receiver.close()
        sender.close()


def test_a_data_frames_body_is_received_into_reused_memory():
    # A large DATA body (items pickled in band) lands in the connection's reused buffers, not
    # in fresh zero-filled memory per frame: once a frame is let go, the next one reuses it.
    import numpy

    from rpc_reading_service.serialization import ReusedBuffers

    body = bytes(range(256)) * 512  # 128 KiB
    reader = FrameReader(allocate=ReusedBuffers())
    reader.feed(wire(encode_frame(MessageKind.DATA, [body])))
    first = reader.next_frame()
    assert bytes(first.body) == body
    address = numpy.asarray(first.body).ctypes.data
    del first
    reader.feed(wire(encode_frame(MessageKind.DATA, [body[::-1]])))
    second = reader.next_frame()
    assert bytes(second.body) == body[::-1] and numpy.asarray(second.body).ctypes.data == address
    reader.feed(wire(encode_frame(MessageKind.CREDIT, [body])))
    assert isinstance(reader.next_frame().body, bytearray)  # other kinds: their own bytes, as before


def test_truncated_frame_is_mid_frame():
    data = wire(encode_frame(MessageKind.DATA, [b"0123456789"]))
    frames, reader = read_all(data[:-3])
    assert frames == [] and reader.mid_frame


def test_oversize_frame_refused_before_allocation():
    allocated = []

    def allocate(n):
        allocated.append(n)
        return bytearray(n)

    # Only the header (and buffer-length table) is fed: the refusal must not wait for the body.
    header = wire(encode_frame(MessageKind.DATA, [b"x" * 2000]))[: HEADER.size]
    reader = FrameReader(max_frame_bytes=1000, allocate=allocate)
    with pytest.raises(FrameTooLargeError, match="2000 bytes"):
        reader.feed(header)

    # A frame announcing a 1 TiB buffer is refused from its length table alone.
    huge = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(MessageKind.DATA), 1, 10) + struct.pack("!Q", 1 << 40)
    reader = FrameReader(max_frame_bytes=1 << 20, allocate=allocate)
    with pytest.raises(FrameTooLargeError):
        reader.feed(huge)
    assert allocated == []
    assert issubclass(FrameTooLargeError, ProtocolError)


def test_frame_at_exact_limit_is_accepted():
    frame = roundtrip(encode_frame(MessageKind.DATA, [b"x" * 10], [b"y" * 90]), max_frame_bytes=100)
    assert frame.nbytes == 100


@pytest.mark.parametrize(
    "header, match",
    [
        (HEADER.pack(b"GET ", PROTOCOL_VERSION, 1, 0, 0), "magic"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, 1, 0, 0), "version"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, 99, 0, 0), "unknown message kind 99"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, 1, 5000, 0), "buffers"),
    ],
)
def test_bad_headers_raise_protocol_error(header, match):
    with pytest.raises(ProtocolError, match=match):
        FrameReader().feed(header)


def test_http_request_is_not_a_frame():
    with pytest.raises(ProtocolError, match="magic"):
        FrameReader().feed(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")


def test_kind_not_allowed_at_this_point():
    reader = FrameReader(HANDSHAKE_MAX_FRAME_BYTES, allowed_kinds=HANDSHAKE_KINDS)
    with pytest.raises(ProtocolError, match="SETUP is not allowed"):
        reader.feed(wire(encode_control(MessageKind.SETUP, {"graph": b"evil"})))


def test_encode_frame_refuses_too_many_buffers():
    with pytest.raises(ProtocolError):
        encode_frame(MessageKind.DATA, [b""], [b"x"] * 5000)


# -- messages -----------------------------------------------------------------------------------
def test_control_round_trip():
    payload = {"epoch": 2, "seed": 123456789, "nested": {"a": [1, 2]}}
    frame = roundtrip(encode_control(MessageKind.START_EPOCH, payload))
    assert frame.kind == MessageKind.START_EPOCH
    assert decode_control(frame) == payload
    assert decode_control(roundtrip(encode_control(MessageKind.CLOSE))) == {}


def test_control_rejects_non_dict_and_garbage():
    with pytest.raises(ProtocolError, match="not a dict"):
        decode_control(Frame(MessageKind.SETUP, b"\x80\x05K\x01."))  # pickle of int 1
    with pytest.raises(ProtocolError, match="could not decode"):
        decode_control(Frame(MessageKind.SETUP, b"not a pickle"))


def test_credit_round_trip():
    assert decode_credit(roundtrip(encode_credit(7, 3))) == (7, 3)
    # Credit counts bytes: a window of frames of several GiB fits (a u64), past a u32.
    assert decode_credit(roundtrip(encode_credit(7, 4 << 32))) == (7, 4 << 32)
    with pytest.raises(ProtocolError):
        decode_credit(Frame(MessageKind.CREDIT, b"short"))
    with pytest.raises(ProtocolError):
        decode_credit(Frame(MessageKind.CREDIT, bytes(8)))  # a version-5 CREDIT (u32 credits)


def test_end_of_shard_round_trip():
    assert decode_end_of_shard(roundtrip(encode_end_of_shard(4, 1 << 40))) == (4, 1 << 40)
    with pytest.raises(ProtocolError):
        decode_end_of_shard(Frame(MessageKind.END_OF_SHARD, b"x"))


def test_data_encode_decode_packs_many_items():
    items = [
        EncodedItem(b"first", []),
        EncodedItem(b"second", [b"B1" * 10, b"B2"]),
        EncodedItem(b"", []),
        EncodedItem(b"fourth", [b"B3"]),
    ]
    body, buffers = encode_data(5, 9, items)
    frame = roundtrip(encode_frame(MessageKind.DATA, body, buffers))
    epoch, sequence, decoded = decode_data(frame)
    assert (epoch, sequence) == (5, 9)
    assert [bytes(i.payload) for i in decoded] == [b"first", b"second", b"", b"fourth"]
    assert [[bytes(b) for b in i.buffers] for i in decoded] == [[], [b"B1" * 10, b"B2"], [], [b"B3"]]


def test_data_decode_rejects_inconsistent_frames():
    body, buffers = encode_data(1, 0, [EncodedItem(b"abc", [b"zz"])])
    good = roundtrip(encode_frame(MessageKind.DATA, body, buffers))
    with pytest.raises(ProtocolError):
        decode_data(Frame(MessageKind.DATA, good.body, []))  # buffer missing
    with pytest.raises(ProtocolError):
        decode_data(Frame(MessageKind.DATA, bytes(good.body) + b"junk", good.buffers))  # trailing bytes
    with pytest.raises(ProtocolError):
        decode_data(Frame(MessageKind.DATA, bytes(good.body)[:5], good.buffers))  # truncated header
    with pytest.raises(ProtocolError):
        decode_data(Frame(MessageKind.DATA, bytes(good.body)[:-2], good.buffers))  # truncated payload


# -- handshake ----------------------------------------------------------------------------------
def exchange(client: ClientHandshake, server: ServerHandshake):
    """Run a handshake through FrameReaders, as bytes; returns the WELCOME frame."""
    challenge = roundtrip(server.receive_hello(roundtrip(client.hello(), allowed_kinds=HANDSHAKE_KINDS)))
    proof = roundtrip(client.receive_challenge(challenge), allowed_kinds=HANDSHAKE_KINDS)
    welcome = roundtrip(server.receive_proof(proof))
    client.receive_welcome(welcome)
    return welcome


def test_handshake_success():
    client, server = ClientHandshake(b"k" * 32, "1.2.3"), ServerHandshake(b"k" * 32)
    assert exchange(client, server).kind == MessageKind.WELCOME
    assert client.done and server.done
    assert server.peer_package_version == "1.2.3"


def test_client_detects_server_with_wrong_key():
    client, server = ClientHandshake(b"right"), ServerHandshake(b"wrong")
    challenge = roundtrip(server.receive_hello(roundtrip(client.hello())))
    with pytest.raises(AuthenticationError, match="same auth key"):
        client.receive_challenge(challenge)
    assert not client.done


def test_server_detects_client_with_wrong_key():
    # A client that cannot check the server (forged CHALLENGE path skipped) still fails at PROOF.
    server = ServerHandshake(b"right")
    client = ClientHandshake(b"right")
    challenge = roundtrip(server.receive_hello(roundtrip(client.hello())))
    impostor_proof = encode_frame(MessageKind.PROOF, [b"\x00" * 32])
    with pytest.raises(AuthenticationError, match="wrong or missing auth key"):
        server.receive_proof(roundtrip(impostor_proof))
    assert not server.done
    # And a real client holding another key produces a proof the server refuses.
    other = ClientHandshake(b"other")
    server2 = ServerHandshake(b"right")
    challenge = roundtrip(server2.receive_hello(roundtrip(other.hello())))
    body = bytes(challenge.body)
    from rpc_reading_service.protocol import handshake_proof

    forged = encode_frame(MessageKind.PROOF, [handshake_proof(b"other", b"client", body[:32], other._nonce)])
    with pytest.raises(AuthenticationError):
        server2.receive_proof(roundtrip(forged))


def test_handshake_is_fresh_per_nonce():
    # Replaying a PROOF recorded from one handshake fails against a new server nonce.
    client, server = ClientHandshake(b"k"), ServerHandshake(b"k")
    challenge = roundtrip(server.receive_hello(roundtrip(client.hello())))
    recorded_proof = roundtrip(client.receive_challenge(challenge))
    server2 = ServerHandshake(b"k")
    server2.receive_hello(roundtrip(ClientHandshake(b"k", nonce=client._nonce).hello()))
    with pytest.raises(AuthenticationError):
        server2.receive_proof(recorded_proof)


def test_handshake_out_of_order_and_malformed():
    server = ServerHandshake(b"k")
    with pytest.raises(ProtocolError, match="expected HELLO"):
        server.receive_hello(roundtrip(encode_frame(MessageKind.PROOF, [b"x"])))
    with pytest.raises(ProtocolError, match="PROOF before HELLO"):
        ServerHandshake(b"k").receive_proof(roundtrip(encode_frame(MessageKind.PROOF, [b"x"])))
    with pytest.raises(ProtocolError, match="malformed HELLO"):
        ServerHandshake(b"k").receive_hello(roundtrip(encode_frame(MessageKind.HELLO, [b"short"])))
    client = ClientHandshake(b"k")
    with pytest.raises(ProtocolError, match="malformed CHALLENGE"):
        client.receive_challenge(roundtrip(encode_frame(MessageKind.CHALLENGE, [b"short"])))
    with pytest.raises(ProtocolError, match="WELCOME before CHALLENGE"):
        ClientHandshake(b"k").receive_welcome(roundtrip(encode_frame(MessageKind.WELCOME)))
    server = ServerHandshake(b"k")
    hello = roundtrip(ClientHandshake(b"k").hello())
    server.receive_hello(hello)
    with pytest.raises(ProtocolError, match="second HELLO"):
        server.receive_hello(hello)


def test_reject_decoding():
    frame = roundtrip(encode_reject("not an rpc_reading_service frame: go away"), allowed_kinds=HANDSHAKE_KINDS)
    assert frame.kind == MessageKind.REJECT
    with pytest.raises(AuthenticationError, match="peer refused the connection: not an rpc_reading_service frame"):
        ClientHandshake(b"k").receive_challenge(frame)
    with pytest.raises(AuthenticationError, match="go away"):
        ClientHandshake(b"k").receive_welcome(frame)
    # The reason reaches the user's terminal: the trainer escapes it (the peer may not have authenticated).
    forged = roundtrip(encode_reject("bye\n2026-01-01 FORGED\x1b[2J"), allowed_kinds=HANDSHAKE_KINDS)
    for receive in (ClientHandshake(b"k").receive_challenge, ClientHandshake(b"k").receive_welcome):
        with pytest.raises(AuthenticationError) as info:
            receive(forged)
        assert str(info.value) == "peer refused the connection: bye\\n2026-01-01 FORGED\\x1b[2J"
    # A reject reason is raw UTF-8, never unpickled, and bounded in size.
    long = roundtrip(encode_reject("é" * 5000))
    assert len(long.body) <= 1024
