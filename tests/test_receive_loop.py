"""The trainer's receive loop on its own: its sessions are plain socket pairs (no worker, no protocol)."""

from __future__ import annotations

import socket
import threading
from typing import List, Optional

import pytest

from _server_helpers import wait_until
from rpc_reading_service.trainer.receive_loop import HAND_OVER_MAX, ReceiveLoop

pytestmark = pytest.mark.timeout(10)


class Session:
    """A :class:`~rpc_reading_service.trainer.receive_loop.Watched` whose bytes come through a socket pair;
    each byte read is handed over to ``delivered``, and each read notes what was delivered by then."""

    def __init__(self, loop: ReceiveLoop, delivered: List[bytes], read_bytes: int = 64):
        self.loop, self.delivered, self.read_bytes = loop, delivered, read_bytes
        self.ours, self.theirs = socket.socketpair()
        self.ours.setblocking(False)
        self.seen_when_reading: List[List[bytes]] = []
        #: How many items were delivered when each read (and its hand-overs) ended.
        self.delivered_after_reading: List[int] = []
        self.reads = 0
        #: Set: its reads wait for this event (to hold the loop's thread in a turn).
        self.gate: Optional[threading.Event] = None

    def fileno(self) -> Optional[int]:
        return self.ours.fileno()

    def on_readable(self) -> bool:
        self.reads += 1
        if self.gate is not None:
            self.gate.wait(5.0)
        try:
            data = self.ours.recv(self.read_bytes)
        except BlockingIOError:
            return False
        self.seen_when_reading.append(list(self.delivered))
        for byte in data:
            self.loop.hand_over(self.delivered.append, bytes([byte]))
        self.delivered_after_reading.append(len(self.delivered))
        return not data

    def on_tick(self, now: float) -> Optional[float]:
        return 1.0

    def send_due(self) -> bool:
        return True

    def close(self) -> None:
        self.ours.close()
        self.theirs.close()


def test_what_sessions_hand_over_in_one_turn_is_delivered_after_the_turn_in_order():
    loop, delivered = ReceiveLoop(), []
    sessions = [Session(loop, delivered) for _ in range(2)]
    gate = Session(loop, [])
    try:
        for session in sessions + [gate]:
            loop.add(session)
        assert wait_until(lambda: all(session.reads for session in sessions + [gate]), 5.0)  # watched
        # Hold the loop's thread in a turn while both sessions' bytes arrive: the next turn reads both.
        gate.gate = threading.Event()
        gate.theirs.send(b"g")
        assert wait_until(lambda: gate.reads == 2, 5.0)
        for session in sessions:
            session.theirs.send(b"ab")
        gate.gate.set()
        assert wait_until(lambda: len(delivered) == 4, 5.0)
        assert delivered == [b"a", b"b", b"a", b"b"]  # in the order handed over: each session's in its order
        # The turn's second read came before anything of its first was delivered.
        assert [session.seen_when_reading[-1] for session in sessions] == [[], []]
        sessions[0].theirs.send(b"c")
        assert wait_until(lambda: delivered[-1:] == [b"c"], 5.0)  # a later turn: delivered too
        assert sessions[0].seen_when_reading[-1] == delivered[:4]
    finally:
        loop.close()
        for session in sessions + [gate]:
            session.close()


def test_a_turn_that_holds_many_hand_overs_delivers_them_in_batches_before_it_ends():
    """A turn that reads a long backlog hands on every :data:`HAND_OVER_MAX` items, in order,
    instead of keeping the consumer waiting for the whole turn."""
    loop, delivered = ReceiveLoop(), []
    session = Session(loop, delivered, read_bytes=4096)
    gate = Session(loop, [])
    count = 3 * HAND_OVER_MAX + 10
    try:
        for each in (session, gate):
            loop.add(each)
        assert wait_until(lambda: session.reads and gate.reads, 5.0)
        gate.gate = threading.Event()  # hold the loop in a turn while the backlog arrives
        gate.theirs.send(b"g")
        assert wait_until(lambda: gate.reads == 2, 5.0)
        session.theirs.send(bytes(range(256)) * (count // 256) + bytes(count % 256))
        gate.gate.set()
        assert wait_until(lambda: len(delivered) == count, 5.0)
        assert b"".join(delivered) == bytes(range(256)) * (count // 256) + bytes(count % 256)  # in order
        assert session.delivered_after_reading[-1] == 3 * HAND_OVER_MAX  # before the turn ended: all but the tail
    finally:
        loop.close()


def test_a_hand_over_outside_the_loops_thread_is_delivered_at_once():
    loop, delivered = ReceiveLoop(), []
    try:
        loop.hand_over(delivered.append, 1)
        assert delivered == [1]
    finally:
        loop.close()


class Holding(Session):
    """A session that takes in what arrived at once but hands over at most ``per_turn`` bytes a
    turn, asking the loop to come back for the rest (:meth:`ReceiveLoop.again`)."""

    def __init__(self, loop: ReceiveLoop, delivered: List[bytes], per_turn: int):
        super().__init__(loop, delivered)
        self.per_turn, self.held = per_turn, b""

    def on_readable(self) -> bool:
        self.reads += 1
        try:
            self.held += self.ours.recv(4096)
        except BlockingIOError:
            pass
        self.seen_when_reading.append(list(self.delivered))
        now, self.held = self.held[: self.per_turn], self.held[self.per_turn :]
        for byte in now:
            self.loop.hand_over(self.delivered.append, bytes([byte]))
        if self.held:
            self.loop.again(self)
        return False


def test_sessions_that_hold_input_are_served_in_turns_with_their_sockets_idle_and_handed_on_in_batches():
    loop, delivered = ReceiveLoop(), []
    sessions = [Holding(loop, delivered, per_turn=4) for _ in range(2)]
    gate = threading.Event()
    blocker = Session(loop, delivered)  # holds the loop's thread until both backlogs arrived
    blocker.gate = gate
    try:
        loop.add(blocker)
        assert wait_until(lambda: blocker.reads == 1, 5)
        for session, byte in zip(sessions, b"ab"):
            loop.add(session)
            session.theirs.sendall(bytes([byte]) * 40)
        gate.set()
        # Nothing more arrives: the loop comes back for what the sessions hold by itself.
        assert wait_until(lambda: len(delivered) == 80, 5), len(delivered)
        assert set(delivered[:8]) == {b"a", b"b"}  # four of each per turn, not one backlog first
        assert [delivered.count(b) for b in (b"a", b"b")] == [40, 40]
        # While they held input, the turns handed on nothing: all of it in one batch at the end.
        assert all(seen == [] for session in sessions for seen in session.seen_when_reading)
        assert all(session.reads >= 10 for session in sessions)
    finally:
        gate.set()
        loop.close()
        for session in sessions + [blocker]:
            session.close()
