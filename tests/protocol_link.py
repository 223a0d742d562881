"""The session state machines joined in memory for the protocol tests: a link, a fake clock, frames."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from rpc_reading_service.protocol import (
    EncodedItem,
    Frame,
    FrameReader,
    MessageKind,
    Ready,
    Setup,
    StartEpoch,
    TrainerSession,
    WorkerProtocol,
    encode_data,
    encode_frame,
)

WORKER = "worker 0 (127.0.0.1:29600)"
TRAINER = "trainer at 127.0.0.1:40000"
EXCEPTION = {
    "type_name": "ValueError",
    "type_module": "builtins",
    "message": "bad",
    "traceback": "tb",
    "pickled": None,
}


class FakeClock:
    """An injectable monotonic clock that only moves when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def frames_of(chunks) -> List[Frame]:
    reader = FrameReader()
    reader.feed(b"".join(bytes(chunk) for chunk in chunks))
    frames = []
    while (frame := reader.next_frame()) is not None:
        frames.append(frame)
    assert not reader.mid_frame
    return frames


def data_frame(items: List[EncodedItem], allocate: Optional[Callable[[int], Any]] = None) -> Frame:
    """A DATA frame of ``items`` sent as bytes and read back (into ``allocate``'s memory, if given)."""
    body, buffers = encode_data(1, 0, items)
    reader = FrameReader() if allocate is None else FrameReader(allocate=allocate)
    reader.feed(b"".join(bytes(chunk) for chunk in encode_frame(MessageKind.DATA, body, buffers)))
    return reader.next_frame()


class Link:
    """A trainer and a worker state machine joined by an in-memory connection pair."""

    def __init__(self, **trainer_options) -> None:
        self.clock = FakeClock()
        options = {"heartbeat_interval": 1.0, "peer_timeout": 5.0, "setup_timeout": 20.0, **trainer_options}
        self.trainer = TrainerSession(WORKER, clock=self.clock, **options)
        self.worker = WorkerProtocol(TRAINER, clock=self.clock)

    @staticmethod
    def deliver(chunks, receiver) -> list:
        events = []
        for frame in frames_of(chunks):
            events += receiver.receive_frame(frame)
        return events

    def to_worker(self, message) -> list:
        return self.deliver(self.trainer.send(message), self.worker)

    def to_trainer(self, message) -> list:
        return self.deliver(self.worker.send(message), self.trainer)

    def set_up(self) -> "Link":
        (setup,) = self.to_worker(Setup(b"graph", 0, 2, {"heartbeat_interval": 1.0, "peer_timeout": 5.0}))
        assert isinstance(setup, Setup)
        assert self.to_trainer(Ready(4242, "host", "0.1.0")) == [Ready(4242, "host", "0.1.0")]
        return self

    def start(self, epoch: int, credits: int = 2, dispatched: bool = False, leased: bool = False) -> "Link":
        (start,) = self.to_worker(StartEpoch(epoch, 7, 0, credits, dispatched=dispatched, leased=leased))
        assert start == StartEpoch(epoch, 7, 0, credits, dispatched=dispatched, leased=leased)
        return self


def items(*payloads: bytes) -> List[EncodedItem]:
    return [EncodedItem(p) for p in payloads]


def payloads(message) -> List[bytes]:
    return [bytes(item.payload) for item in message.items]
