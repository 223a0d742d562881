"""The trainer's receive loop serves its sessions in turns: a loop that fell behind takes a few
frames of every session's backlog per turn, not one session's whole backlog after the other, and
comes back to frames its connections hold even when no socket turns readable again."""

from __future__ import annotations

import array
import fcntl
import functools
import socket
import termios
import threading
from typing import List, Tuple

import pytest
from torchdata.datapipes.iter import IterableWrapper
from torchdata.dataloader2 import DataLoader2

from _server_helpers import frame_bytes, remote, slow_identity, wait_until
from rpc_reading_service import Liveness
from rpc_reading_service.protocol import HEADER, FrameReader, MessageKind, data_nbytes, encode_frame
from rpc_reading_service.serialization import dumps_item
from rpc_reading_service.trainer.channel import WorkerChannel
from rpc_reading_service.trainer.receive_loop import FRAMES_PER_TURN
from rpc_reading_service.transports.base import PeerLostError
from rpc_reading_service.transports.socket_transport import SocketConnection


def _queued_bytes(fd: int) -> int:
    """Bytes waiting in the socket's receive queue."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


#: A slow stage's items (well over the 2 ms ``linger``): each is sealed in a DATA frame of its own,
#: unless the worker's sender falls behind (a loaded host), which packs some of them together.
slow_item = functools.partial(slow_identity, delay=0.005)


def _data_frames_bytes(items) -> int:
    """Wire bytes of DATA frames of one item each (a slow stage's frames)."""
    return sum(HEADER.size + data_nbytes([dumps_item(item)]) for item in items)


def _packed_bytes(items) -> int:
    """Wire bytes of ``items`` packed in one DATA frame: the least they arrive in."""
    return HEADER.size + data_nbytes([dumps_item(item) for item in items])


class HeldLoop:
    """Holds the receive loop in its first ``on_readable`` call until :meth:`release` (a loop that
    fell behind) and records what each later call took in: ``(rank, DATA frames)``, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.channels: List[WorkerChannel] = []
        self.taken: List[Tuple[int, int]] = []
        self.held, self._release = threading.Event(), threading.Event()
        on_readable, start_receiver = WorkerChannel.on_readable, WorkerChannel.start_receiver
        hook = self

        def counting(channel: WorkerChannel) -> bool:
            if not hook.held.is_set():
                hook.held.set()
                hook._release.wait(30)
            before = channel.frames_received
            over = on_readable(channel)
            hook.taken.append((channel.rank, channel.frames_received - before))
            return over

        def collecting(channel: WorkerChannel, sink) -> None:
            hook.channels.append(channel)
            start_receiver(channel, sink)

        monkeypatch.setattr(WorkerChannel, "on_readable", counting)
        monkeypatch.setattr(WorkerChannel, "start_receiver", collecting)

    def wait_for_backlog(self, sessions: int, nbytes: int) -> bool:
        """Wait until ``sessions`` sessions each have ``nbytes`` waiting in their sockets."""
        return self.held.wait(20) and wait_until(
            lambda: len(self.channels) == sessions and all(_queued_bytes(ch.fileno()) >= nbytes for ch in self.channels), 20
        )

    def release(self) -> None:
        """Let the loop go on."""
        self._release.set()


def _consume(dl: DataLoader2, items: list) -> threading.Thread:
    """Iterate ``dl`` into ``items`` in a thread of its own (the test holds the receive loop)."""
    thread = threading.Thread(target=lambda: items.extend(dl), name="consumer")
    thread.start()
    return thread


@pytest.mark.timeout(60)
def test_a_loop_that_fell_behind_takes_a_few_frames_of_every_sessions_backlog_per_turn(worker_server, monkeypatch):
    sessions, backlog, items_each = 8, 60, 200
    least = _data_frames_bytes(range(backlog))  # under what a session's items packed tightest take
    assert least < _packed_bytes(range(items_each))
    hook = HeldLoop(monkeypatch)
    graph = IterableWrapper(range(sessions * items_each)).sharding_filter().map(slow_item)
    dl = DataLoader2(graph, reading_service=remote(worker_server, sessions))
    items: list = []
    consumer = _consume(dl, items)
    try:
        assert hook.wait_for_backlog(sessions, least)
        start = len(hook.taken)
        hook.release()
        consumer.join(30)
        assert not consumer.is_alive()
    finally:
        hook.release()
        dl.shutdown()
        consumer.join(10)
    assert items == list(range(sessions * items_each))  # every item once, in order
    taken = hook.taken[start:]
    assert max(n for _rank, n in taken) <= FRAMES_PER_TURN, taken[: 2 * sessions]
    # Each session's backlog came in turns: the first two turns' frames are of every session.
    order = [rank for rank, n in taken for _ in range(n)]
    assert set(order[: 2 * FRAMES_PER_TURN * sessions]) == set(range(sessions)), taken[: 2 * sessions]


@pytest.mark.timeout(60)
def test_frames_a_connection_holds_are_taken_in_later_turns_with_its_socket_idle(worker_server, monkeypatch):
    """The whole epoch arrives while the loop is held: one read takes it all, then the socket
    stays silent (heartbeats a minute apart); the frames held beyond the first turn's still come."""
    count = 6 * FRAMES_PER_TURN
    hook = HeldLoop(monkeypatch)
    graph = IterableWrapper(range(count)).sharding_filter().map(slow_item)
    service = remote(worker_server, 1, timeout=120.0, liveness=Liveness(heartbeat_interval=60.0))
    dl = DataLoader2(graph, reading_service=service)
    items: list = []
    consumer = _consume(dl, items)
    try:
        assert hook.wait_for_backlog(1, _packed_bytes(range(count)))
        # every item sent (the least they take), and then each in a frame of its own if it was
        wait_until(lambda: _queued_bytes(hook.channels[0].fileno()) >= _data_frames_bytes(range(count)), 5)
        hook.release()
        consumer.join(20)
        assert not consumer.is_alive(), f"{len(items)} of {count} items after 20 s"
    finally:
        hook.release()
        dl.shutdown()
        consumer.join(10)
    assert items == list(range(count))
    assert max(n for _rank, n in hook.taken) <= FRAMES_PER_TURN


def test_recv_ready_hands_out_at_most_the_frames_asked_for_and_reads_none_while_it_holds_some():
    ours, theirs = socket.socketpair()
    conn = SocketConnection(ours, "peer", FrameReader())
    try:
        frames = [frame_bytes(encode_frame(MessageKind.HEARTBEAT, [bytes([i]) * 10])) for i in range(5)]
        theirs.sendall(b"".join(frames[:3]))
        assert [bytes(f.body) for f in conn.recv_ready(2)] == [b"\0" * 10, b"\1" * 10]
        assert conn.ready_left  # the third frame waits here, not in the socket
        theirs.sendall(frames[3])
        assert [bytes(f.body) for f in conn.recv_ready(2)] == [b"\2" * 10]  # no read while one was held
        assert not conn.ready_left
        theirs.sendall(frames[4])
        theirs.close()
        assert [bytes(f.body) for f in conn.recv_ready(1)] == [b"\3" * 10]
        assert conn.ready_left
        assert [bytes(f.body) for f in conn.recv_ready(1)] == [b"\4" * 10]  # before the EOF behind it
        with pytest.raises(PeerLostError):
            conn.recv_ready(1)
    finally:
        conn.close()
        theirs.close()
