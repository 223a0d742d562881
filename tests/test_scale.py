"""Many sessions per trainer: 128 sessions on two worker servers, one receive loop.

The trainer receives for every socket session in one event-loop thread (no receiver
thread per worker), sets sessions up in parallel, and every item of an epoch still arrives
exactly once.
"""

from __future__ import annotations

import secrets
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from torchdata.datapipes.iter import IterableWrapper
from torchdata.dataloader2 import DataLoader2

from _server_helpers import remote, wait_until

SESSIONS = 128
ITEMS = SESSIONS * 3 + 77  # uneven shards: some workers get one item more


def triple(x: int) -> int:
    return 3 * x


def _trainer_threads() -> list:
    return [t.name for t in threading.enumerate() if t.name.startswith("rrs-") and t.is_alive()]


@pytest.mark.timeout(90)
def test_128_sessions_on_two_servers_give_every_item_once_through_one_receive_loop(fresh_server):
    key = secrets.token_hex(16)
    with ThreadPoolExecutor(2) as pool:  # both servers import torch at the same time
        a, b = pool.map(lambda _: fresh_server(key=key), range(2))
    graph = IterableWrapper(range(ITEMS)).shuffle().sharding_filter().map(triple)
    dl = DataLoader2(graph, reading_service=remote([a, b], SESSIONS, in_order=False))
    try:
        for _ in range(2):  # the second epoch reuses the 128 sessions
            items = list(dl)
            assert sorted(items) == [3 * x for x in range(ITEMS)]
            assert items != sorted(items)  # shuffled: the test really went through the graph
        # The sessions are spread over both servers, one process each...
        assert len(a.session_pids()) == len(b.session_pids()) == SESSIONS // 2
        # ...and the trainer receives for all of them in one thread.
        threads = _trainer_threads()
        assert threads.count("rrs-receive-loop") == 1, threads
        assert not [name for name in threads if name.startswith("rrs-recv-")], threads
    finally:
        dl.shutdown()
    # Every session ends with the trainer's CLOSE (the servers reap them).
    assert wait_until(lambda: not a.session_pids() and not b.session_pids(), 20), (a.session_pids(), b.session_pids())
    assert "rrs-receive-loop" not in _trainer_threads()


def test_recv_ready_returns_the_frames_that_arrived_without_blocking_then_the_loss():
    from rpc_reading_service.protocol import FrameReader, MessageKind, encode_frame
    from rpc_reading_service.transports.base import PeerLostError
    from rpc_reading_service.transports.socket_transport import SocketConnection

    ours, theirs = socket.socketpair()
    conn = SocketConnection(ours, "peer", FrameReader())
    try:
        frames = [b"".join(bytes(c) for c in encode_frame(MessageKind.HEARTBEAT, [bytes([i]) * 100])) for i in range(3)]
        assert conn.recv_ready() == []  # nothing there: no waiting
        theirs.sendall(frames[0] + frames[1] + frames[2][:50])
        assert [bytes(f.body) for f in conn.recv_ready()] == [b"\0" * 100, b"\1" * 100]
        assert conn.recv_ready() == []  # half a frame
        theirs.sendall(frames[2][50:])
        theirs.close()  # the frame before the EOF comes out first
        assert [bytes(f.body) for f in conn.recv_ready()] == [b"\2" * 100]
        with pytest.raises(PeerLostError):
            conn.recv_ready()
    finally:
        conn.close()
        theirs.close()


@pytest.mark.timeout(20)
def test_recv_without_a_deadline_waits_before_it_receives_and_close_ends_the_wait():
    """A worker session's control loop waits for the trainer's next frame with ``recv()``: one
    select and one receive per frame, no receive that finds nothing first (a wake-up of its
    own per CREDIT); a close() from another thread still ends the wait."""
    import time

    from rpc_reading_service.protocol import FrameReader, MessageKind, encode_frame
    from rpc_reading_service.transports.base import PeerLostError
    from rpc_reading_service.transports.socket_transport import SocketConnection

    class Counting(SocketConnection):
        empty = 0

        def _recv_some(self, view):
            try:
                return super()._recv_some(view)
            except BlockingIOError:
                self.empty += 1
                raise

    ours, theirs = socket.socketpair()
    conn = Counting(ours, "peer", FrameReader())
    frame = b"".join(bytes(c) for c in encode_frame(MessageKind.HEARTBEAT, [b"x" * 10]))
    later = threading.Timer(0.05, theirs.sendall, (frame,))
    later.start()
    try:
        for _ in range(2):
            assert bytes(conn.recv().body) == b"x" * 10
            later.join()
            later = threading.Timer(0.05, theirs.sendall, (frame,))
            later.start()
        assert conn.empty == 0
        later.join()
        assert bytes(conn.recv().body) == b"x" * 10  # arrived before the call: the select returns at once
        closer = threading.Timer(0.05, conn.close)
        closer.start()
        started = time.monotonic()
        with pytest.raises(PeerLostError):
            conn.recv()
        assert time.monotonic() - started < 5.0
        closer.join()
    finally:
        later.cancel()
        conn.close()
        theirs.close()


@pytest.mark.timeout(20)
def test_a_large_frame_then_a_small_one_both_wake_an_event_loop_over_tcp():
    """Over TCP a large buffer raises the socket's receive low-water mark (fewer wake-ups per
    tensor): the frame's last bytes, and a small frame after it with nothing behind, must
    still make the socket readable."""
    import select
    import time

    from rpc_reading_service.protocol import FrameReader, MessageKind, encode_frame
    from rpc_reading_service.transports.socket_transport import SocketConnection

    big = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB, not a multiple of the low-water mark
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    conn = SocketConnection(ours, "peer", FrameReader())
    try:
        for kind, buffers in ((MessageKind.HEARTBEAT, [big]), (MessageKind.HEARTBEAT, [])):
            theirs.sendall(b"".join(bytes(c) for c in encode_frame(kind, [b"head"], buffers)))
        frames, deadline = [], time.monotonic() + 10
        while len(frames) < 2 and time.monotonic() < deadline:  # the receive loop's way: wait, then read
            if select.select([ours], [], [], max(0.0, deadline - time.monotonic()))[0]:
                frames += conn.recv_ready()
        assert [bytes(f.buffers[0]) if f.buffers else None for f in frames] == [big, None]
    finally:
        conn.close()
        theirs.close()
