"""An in-memory ``Connection`` pair: the two session drivers in one process, no sockets.

Every frame is encoded by the sender and parsed by a real ``FrameReader`` on the way, so
the codec runs as it does over a socket. ``drop_outgoing`` turns one end into a stuck peer
(its process stopped: nothing it sends arrives, its end stays open).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Deque, Optional, Sequence, Tuple

from rpc_reading_service.protocol import Buffer, Frame, FrameReader
from rpc_reading_service.transports.base import Connection, PeerLostError


class MemoryConnection(Connection):
    """One end of :func:`connection_pair`."""

    def __init__(self, peer: str):
        self.peer = peer
        self.other: Optional["MemoryConnection"] = None
        #: While true, frames this end sends vanish (a stopped process, a dead network).
        self.drop_outgoing = False
        self._frames: Deque[Frame] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False  # this end closed
        self._peer_closed = False  # EOF: the other end closed
        self._reader = FrameReader()

    def send(self, chunks: Sequence[Buffer]) -> None:
        other = self.other
        assert other is not None
        if self._closed or self._peer_closed:
            raise PeerLostError(f"connection to {self.peer} is closed")
        if self.drop_outgoing:
            return
        with other._cond:  # one frame at a time, as Connection.send promises
            other._reader.feed(b"".join(bytes(chunk) for chunk in chunks))
            while (frame := other._reader.next_frame()) is not None:
                other._frames.append(frame)
            other._cond.notify_all()

    def recv(self, timeout: Optional[float] = None) -> Optional[Frame]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._frames:
                if self._closed:
                    raise PeerLostError(f"connection to {self.peer} is closed")
                if self._peer_closed:
                    raise PeerLostError(f"{self.peer} closed the connection")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._frames.popleft()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        other = self.other
        if other is not None:
            with other._cond:
                other._peer_closed = True
                other._cond.notify_all()


def connection_pair(trainer: str = "127.0.0.1:40000", worker: str = "127.0.0.1:29600") -> Tuple[MemoryConnection, MemoryConnection]:
    """``(trainer_end, worker_end)``; each end's ``peer`` names the other one."""
    trainer_end, worker_end = MemoryConnection(worker), MemoryConnection(trainer)
    trainer_end.other, worker_end.other = worker_end, trainer_end
    return trainer_end, worker_end
