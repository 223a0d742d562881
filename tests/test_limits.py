"""Server limits: handshake timeout, idle timeout before SETUP, maximum frame size and a
cap on concurrent sessions. Each refusal is logged with the peer's address and answered
with a clear error; the server serves on."""

from __future__ import annotations

import struct
import time

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import (
    authenticate, connect, frame_bytes, read_until_closed, remote, run_epochs, running_server, wait_until,
)
from rpc_reading_service import RPCReadingService, WorkerRefusedError
from rpc_reading_service.protocol import MAGIC, PROTOCOL_VERSION, ClientHandshake, FrameReader, MessageKind

pytestmark = pytest.mark.timeout(60)

MAX_FRAME = 65536


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = [
        "--max-sessions", "2", "--idle-timeout", "1.5", "--handshake-timeout", "1",
        "--max-frame-bytes", str(MAX_FRAME),
    ]  # fmt: skip
    with running_server(tmp_path_factory.mktemp("limits"), args) as server:
        yield server


def _peer(sock) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def _epoch(server, num_workers: int = 1, n: int = 20) -> list:
    (items,) = run_epochs(IterableWrapper(range(n)).sharding_filter(), remote(server, num_workers), 1)
    return sorted(items)


@pytest.mark.parametrize("stage", ["silent", "after HELLO"])
def test_handshake_timeout_drops_a_stalled_peer(server, stage):
    sock = connect(server.address)
    try:
        peer = _peer(sock)
        if stage == "after HELLO":
            sock.sendall(frame_bytes(ClientHandshake(b"whatever").hello()))
        start = time.monotonic()
        _, closed = read_until_closed(sock, timeout=5)
        assert closed and time.monotonic() - start < 3
    finally:
        sock.close()
    assert wait_until(lambda: f"refused connection from {peer}: no handshake within 1.0 s" in server.log(), 2)


def test_idle_timeout_drops_a_trainer_that_never_sends_setup(server):
    server.wait_idle()
    sock, _ = authenticate(server.address, server.key)
    try:
        peer = _peer(sock)
        assert wait_until(lambda: len(server.session_pids()) == 1, 5)
        start = time.monotonic()
        data, closed = read_until_closed(sock, timeout=8)
        assert closed, "a trainer that never sent SETUP kept its session"
        waited = time.monotonic() - start
        assert waited > 1.0, waited  # by the 1.5 s --idle-timeout, not at once ...
        assert waited < 6, waited  # ... and not much later
        reader = FrameReader()
        reader.feed(data)
        frame = reader.next_frame()  # the reason comes along (heartbeats do not start before SETUP)
        assert frame is not None and frame.kind == MessageKind.REJECT, data
        assert "no SETUP within 1.5 s of connecting (the server's --idle-timeout)" in bytes(frame.body).decode()
    finally:
        sock.close()
    server.wait_idle(5)
    assert f"{peer} sent no SETUP" in server.log()


def test_oversized_frame_is_refused_unread(server):
    sock, _ = authenticate(server.address, server.key)
    try:
        peer = _peer(sock)
        # Announce a 1 GiB SETUP frame and send only its header: refused before it is read.
        sock.sendall(struct.pack("!4sBBHQ", MAGIC, PROTOCOL_VERSION, MessageKind.SETUP, 0, 1 << 30))
        start = time.monotonic()
        _, closed = read_until_closed(sock, timeout=5)
        assert closed and time.monotonic() - start < 4  # at once, not after reading 1 GiB
    finally:
        sock.close()
    assert wait_until(lambda: f"refused a frame from {peer}" in server.log(), 3)
    assert f"over the maximum of {MAX_FRAME} bytes" in server.log()
    assert _epoch(server) == list(range(20))


def test_session_cap(server):
    server.wait_idle()
    service = RPCReadingService(workers=[server.address], num_workers=2, auth_key=server.key)
    busy = DataLoader2(IterableWrapper(range(10)).sharding_filter(), reading_service=service)
    try:
        it = iter(busy)
        first = next(it)  # both sessions of the cap are now taken
        start = time.monotonic()
        with pytest.raises(WorkerRefusedError) as info:
            _epoch(server)
        assert time.monotonic() - start < 5
        message = str(info.value)
        assert f"worker at {server.address}" in message
        assert "already serves 2 sessions (--max-sessions 2)" in message
        assert wait_until(lambda: "refused a session to 127.0.0.1:" in server.log(), 2)
        assert sorted([first, *it]) == list(range(10))  # the busy trainer is unaffected
    finally:
        busy.shutdown()
    server.wait_idle(5)
    assert _epoch(server, num_workers=2) == list(range(20))
