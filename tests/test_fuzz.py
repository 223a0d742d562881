"""Hostile input against a LIVE worker server (a subprocess on loopback).

Hypothesis generates well over 10,000 frames per run: before authentication (any kind,
magic, version, sizes, truncations, random bytes in front) and after it (valid-shaped
control frames the session must digest, then a malformed or random tail). Plus explicit
truncated, oversize, wrong-version and wrong-magic frames. Throughout: the server never
dies, never unpickles a byte before authentication (a pickle that would create a marker
file is sent pre-auth in every position), its memory stays bounded, and it serves a real
DataLoader2 epoch afterwards.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import (
    authenticate,
    connect,
    frame_bytes,
    read_until_closed,
    reject_reason,
    running_server,
    send_and_read_until_closed,
)
from rpc_reading_service import RPCReadingService
from rpc_reading_service.trainer.channel import WorkerChannel
from rpc_reading_service.protocol import (
    HANDSHAKE_KINDS,
    MAGIC,
    PROTOCOL_VERSION,
    ClientHandshake,
    FrameReader,
    MessageKind,
    encode_control,
    encode_frame,
)
from rpc_reading_service.serialization import dumps_graph
from rpc_reading_service.transports.base import PeerLostError
from rpc_reading_service.transports.socket_transport import SocketTransport

pytestmark = pytest.mark.timeout(90)

MAX_FRAME = 1 << 20
HEADER = struct.Struct("!4sBBHQ")
KINDS = [int(kind) for kind in MessageKind]
FUZZ_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)


class _CreatesFile:
    """Unpickling this creates a file: proof of whether a peer's bytes were unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def marker(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("marker") / "UNPICKLED-BEFORE-AUTH")
    return path


@pytest.fixture(scope="module")
def evil(marker):
    return pickle.dumps(_CreatesFile(marker))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--max-frame-bytes", str(MAX_FRAME), "--handshake-timeout", "3", "--idle-timeout", "3", "--log-level", "WARNING"]
    with running_server(tmp_path_factory.mktemp("fuzz"), args) as server:
        # Warm up (first connections allocate selector and logging state), then measure.
        for _ in range(50):
            sock = connect(server.address)
            sock.sendall(b"warm up: this is not a frame")
            read_until_closed(sock)
            sock.close()
        server.baseline_rss_kib = server.rss_kib()
        yield server


def test_the_marker_pickle_is_live(tmp_path):
    """Control: unpickling the payload does create the file (so its absence means something)."""
    path = tmp_path / "control"
    pickle.loads(pickle.dumps(_CreatesFile(str(path)))).close()
    assert path.exists()


# -- strategies ---------------------------------------------------------------------------------
def build_frame(seed: bytes, payloads=()) -> bytes:
    """Decode hypothesis-drawn bytes into one frame: mostly plausible, sometimes with a wrong
    magic, version or kind, lying sizes (up to 2**64 - 1), too many buffers, a payload from
    ``payloads`` as its body, or cut short. (One ``binary`` draw per frame keeps generation
    fast; all-zero bytes, where shrinking goes, decode to a well-formed HELLO.)"""
    b = seed.ljust(16, b"\0")
    mode, rest = b[0], b[16:]
    magic = b[1:5] if mode & 0b11 == 0b11 else MAGIC
    version = b[5] if (mode >> 2) & 0b11 == 0b11 else PROTOCOL_VERSION
    kind = b[6] if (mode >> 4) & 1 else KINDS[b[6] % len(KINDS)]
    body = payloads[b[7] % len(payloads)] if payloads and b[8] % 8 == 7 else rest
    n_buffers = b[9] % 4
    cut = [len(body) * i // (n_buffers + 1) for i in range(n_buffers + 2)]
    pieces = [body[cut[i] : cut[i + 1]] for i in range(n_buffers + 1)]
    body, buffers = pieces[0], pieces[1:]
    lengths = [len(x) for x in buffers]
    body_length = len(body)
    if b[10] % 8 == 7:  # lie about a size
        lie = int.from_bytes(b[1:9], "big")
        if buffers and b[11] & 1:
            lengths[-1] = lie
        else:
            body_length = lie
    announced = n_buffers
    if b[12] % 16 == 15:  # announce more buffers than the frame carries (up to 65535)
        announced = int.from_bytes(b[13:15], "big")
        lengths = (lengths + [0] * 4)[: min(announced, 4)]
    data = HEADER.pack(magic, version, kind, announced, body_length)
    data += b"".join(struct.pack("!Q", n) for n in lengths) + body + b"".join(buffers)
    if b[15] % 10 == 9:  # truncated
        data = data[: b[14] % (len(data) + 1)]
    return data


FRAME_SEEDS = st.binary(min_size=16, max_size=112)


@st.composite
def session_frames(draw):
    """Valid-shaped frames an authenticated session must digest and carry on."""
    kind = draw(st.sampled_from(["heartbeat", "credit", "stop"]))
    if kind == "heartbeat":
        body = draw(st.binary(max_size=64))
        buffers = draw(st.lists(st.binary(max_size=64), max_size=3))
        return frame_bytes(encode_frame(MessageKind.HEARTBEAT, [body], buffers))
    if kind == "credit":
        epoch, credits = draw(st.integers(1000, 2**32 - 1)), draw(st.integers(0, 2**64 - 1))
        return frame_bytes(encode_frame(MessageKind.CREDIT, [struct.pack("!IQ", epoch, credits)]))
    return frame_bytes(encode_control(MessageKind.STOP_EPOCH, {"epoch": draw(st.integers(1000, 2**40))}))


def _tails():
    close = frame_bytes(encode_control(MessageKind.CLOSE))
    oversize = HEADER.pack(MAGIC, PROTOCOL_VERSION, MessageKind.SETUP, 0, 1 << 40)
    return st.one_of(
        FRAME_SEEDS.map(build_frame),
        st.binary(min_size=1, max_size=256),
        st.just(close),
        st.just(oversize),
        st.just(HEADER.pack(b"XXXX", PROTOCOL_VERSION, MessageKind.CREDIT, 0, 8)),
        st.just(HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, MessageKind.CREDIT, 0, 8)),
    )


def _handshake_replies(data: bytes) -> list:
    reader = FrameReader(allowed_kinds=HANDSHAKE_KINDS)
    reader.feed(data)
    kinds = []
    while (frame := reader.next_frame()) is not None:
        kinds.append(frame.kind)
    return kinds


# -- before authentication ----------------------------------------------------------------------
def test_preauth_frames_are_never_unpickled(server, marker, evil):
    """The marker pickle as the body of every kind, first and after a HELLO: never unpickled."""
    hello = frame_bytes(ClientHandshake(b"not the key").hello())
    for position in ("first", "after HELLO", "after HELLO, as PROOF"):
        for kind in MessageKind:
            if position == "after HELLO, as PROOF" and kind != MessageKind.PROOF:
                continue
            sent = frame_bytes(encode_frame(kind, [evil]))
            data, closed = send_and_read_until_closed(
                connect(server.address), (hello if position != "first" else b"") + sent
            )
            assert closed
            assert MessageKind.WELCOME not in _handshake_replies(data)
    assert server.alive()
    time.sleep(0.2)
    assert not os.path.exists(marker), "the server unpickled bytes from an unauthenticated peer"


def test_preauth_fuzz(server, marker, evil):
    frames_sent = [0]

    # Random bytes in front of the frames one time in four (they end the handshake at once).
    prefixes = st.one_of(st.just(b""), st.just(b""), st.just(b""), st.binary(min_size=1, max_size=48))

    @settings(max_examples=400, **FUZZ_SETTINGS)
    @given(prefix=prefixes, seeds=st.lists(FRAME_SEEDS, min_size=8, max_size=24))
    def attack(prefix, seeds):
        frames = [build_frame(seed, [evil]) for seed in seeds]
        data, closed = send_and_read_until_closed(connect(server.address), prefix + b"".join(frames))
        frames_sent[0] += len(frames)
        assert closed, "the server kept a connection that sent garbage and EOF"
        assert set(_handshake_replies(data)) <= {MessageKind.CHALLENGE, MessageKind.REJECT}

    attack()
    assert frames_sent[0] >= 5000, frames_sent
    assert server.alive()
    assert not os.path.exists(marker)


def test_random_bytes_before_a_valid_handshake(server):
    @settings(max_examples=60, **FUZZ_SETTINGS)
    @given(prefix=st.binary(min_size=1, max_size=64))
    def attack(prefix):
        hello = frame_bytes(ClientHandshake(server.key.encode()).hello())
        data, closed = send_and_read_until_closed(connect(server.address), prefix + hello)
        assert closed and MessageKind.WELCOME not in _handshake_replies(data)

    attack()
    assert server.alive()


@pytest.mark.parametrize(
    "data, reason",
    [
        (HEADER.pack(b"GET ", PROTOCOL_VERSION, MessageKind.HELLO, 0, 40), "not an rpc_reading_service frame"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, MessageKind.HELLO, 0, 40), "protocol version"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, MessageKind.HELLO, 0, 1 << 62), "over the maximum"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, MessageKind.HELLO, 5000, 0), "at most 4096"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, 99, 0, 0), "unknown message kind"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, MessageKind.SETUP, 0, 10), "not allowed"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, MessageKind.HELLO, 0, 40)[:9], None),  # truncated header
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, MessageKind.HELLO, 0, 40) + b"x" * 10, None),  # truncated body
    ],
    ids=["wrong-magic", "wrong-version", "oversize", "too-many-buffers", "unknown-kind", "session-kind", "cut-header", "cut-body"],
)
def test_malformed_preauth_frames(server, data, reason):
    reply, closed = send_and_read_until_closed(connect(server.address), data)
    assert closed
    if reason is not None:
        assert reason in reject_reason(reply)
    assert server.alive()


# -- after authentication -----------------------------------------------------------------------
def _open_session(server):
    conn = SocketTransport().connect(server.address, server.key.encode(), timeout=10)
    channel = WorkerChannel(conn, 0, heartbeat_interval=1.0, peer_timeout=10.0)
    graph = dumps_graph((IterableWrapper(range(8)), None, None))
    channel.setup({"graph": graph, "worker_rank": 0, "num_workers": 1, "options": {}}, timeout=10)
    return conn, channel


def _run_epoch(conn, channel, epoch: int) -> int:
    """Start ``epoch`` and count its items: proof the session digested everything before."""
    from rpc_reading_service.protocol import decode_data

    channel.start_epoch(epoch, seed=0, global_worker_id=0, credits=100)
    items = 0
    while True:
        frame = conn.recv(timeout=10)
        assert frame is not None, "the session went silent"
        if frame.kind == MessageKind.DATA:
            items += len(decode_data(frame)[2])
        elif frame.kind == MessageKind.END_OF_SHARD:
            return items
        else:
            assert frame.kind == MessageKind.HEARTBEAT, frame.kind


def test_postauth_fuzz(server):
    frames_sent = [0]

    @settings(max_examples=50, **FUZZ_SETTINGS)
    @given(frames=st.lists(session_frames(), min_size=100, max_size=160), tail=_tails())
    def attack(frames, tail):
        conn, channel = _open_session(server)
        try:
            conn._sock.sendall(b"".join(frames))
            assert _run_epoch(conn, channel, epoch=7) == 8
            try:
                conn._sock.sendall(tail)
                conn._sock.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass
            with pytest.raises(PeerLostError):
                while True:  # heartbeats until the server ends the session
                    conn.recv(timeout=10)
        finally:
            channel.close(timeout=1)
            conn.close()
        frames_sent[0] += len(frames) + 1

    attack()
    assert frames_sent[0] >= 5000
    assert server.alive()


@pytest.mark.parametrize(
    "tail",
    [
        HEADER.pack(MAGIC, PROTOCOL_VERSION, MessageKind.START_EPOCH, 0, MAX_FRAME + 1),
        HEADER.pack(MAGIC, PROTOCOL_VERSION, MessageKind.HEARTBEAT, 2, 0) + struct.pack("!QQ", MAX_FRAME, 1),
        HEADER.pack(b"RRSX", PROTOCOL_VERSION, MessageKind.CREDIT, 0, 8),
        HEADER.pack(MAGIC, 0, MessageKind.CREDIT, 0, 8),
        HEADER.pack(MAGIC, PROTOCOL_VERSION, MessageKind.CREDIT, 0, 12) + b"\x00" * 3,
        frame_bytes(encode_frame(MessageKind.CREDIT, [b"\x00" * 5])),
        frame_bytes(encode_frame(MessageKind.START_EPOCH, [b"not a pickle"])),
        frame_bytes(encode_control(MessageKind.ITEM_TIMED_OUT, {"epoch": 1, "position": -1})),
    ],
    ids=[
        "oversize", "oversize-buffers", "wrong-magic", "wrong-version", "truncated", "bad-credit", "bad-control",
        "a-workers-failure",
    ],
)
def test_malformed_postauth_frames_end_only_that_session(server, tail):
    sock, _ = authenticate(server.address, server.key)
    _, closed = send_and_read_until_closed(sock, tail)
    assert closed and server.alive()


def test_server_survives_stays_small_and_serves(server, marker):
    assert server.alive()
    assert not os.path.exists(marker), "the server unpickled bytes from an unauthenticated peer"
    server.wait_idle(10)  # every fuzzed session ended and was reaped
    growth = server.rss_kib() - server.baseline_rss_kib
    assert growth < 16 * 1024, f"server memory grew by {growth} KiB during the fuzz"
    service = RPCReadingService(workers=[server.address], num_workers=2, auth_key=server.key)
    dl = DataLoader2(IterableWrapper(range(100)).sharding_filter(), reading_service=service)
    try:
        assert sorted(dl) == list(range(100))
    finally:
        dl.shutdown()
    sock, _ = authenticate(server.address, server.key)  # and the raw handshake still works
    sock.close()
    assert server.alive()
    log = server.log()
    assert "refused connection from 127.0.0.1:" in log
    assert "Traceback" not in log.split("serving on")[0]

