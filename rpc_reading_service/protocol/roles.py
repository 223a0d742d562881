"""The two roles of a session: what each end checks and counts per message (the states: :mod:`.session`)."""

from __future__ import annotations

from typing import List, Optional, Union

from ..errors import RemoteProtocolError
from .frames import Frame, data_cost, data_nbytes
from .handshake import decode_reject
from .messages import (
    ChunkDone,
    Credit,
    Data,
    EndOfInput,
    EndOfShard,
    ItemCredit,
    Items,
    ItemTimedOut,
    Lease,
    Ready,
    Setup,
    ShardFailed,
    StartEpoch,
    StopEpoch,
    decode_setup,
)
from .session import DataReceived, Event, Refused, SessionProtocol

__all__ = ["TrainerSession", "WorkerProtocol"]


class TrainerSession(SessionProtocol):
    """The trainer's end of one worker session: Setup, epochs, credits, dispatched items."""

    role = "trainer"
    peer_role = "worker"

    # -- what the trainer sends -----------------------------------------------------------------
    def _send_setup(self, message: Setup) -> None:
        self._last_received = self._clock()  # the setup timeout counts from SETUP

    def _send_start_epoch(self, message: StartEpoch) -> None:
        self._start_epoch(message, self._local)

    def _send_stop_epoch(self, message: StopEpoch) -> None:
        self._sent_current(message.epoch, message.kind)
        self._stop_epoch(message)

    def _send_credit(self, message: Credit) -> None:
        # Also after END_OF_SHARD: the consumer grants for frames it takes later.
        self._sent_current(message.epoch, message.kind)
        self._data.credits += message.credits

    def _send_items(self, message: Items) -> None:
        self._sent_current(message.epoch, message.kind)
        if self._data.open:  # else the worker drops it, as the LEASE before it
            self._items_leased(message.epoch, message.sequence, len(message.items), self._local)
        flow = self._frame_in_flow(self._input, message.kind, message.epoch, message.sequence, self._local)
        flow.items += len(message.items)

    def _send_end_of_input(self, message: EndOfInput) -> None:
        self._sent_current(message.epoch, message.kind)
        self._end_flow(self._input, message, self._local)

    def _send_lease(self, message: Lease) -> None:
        self._sent_current(message.epoch, message.kind)
        if self._data.open:  # else the worker drops it: its END_OF_SHARD crossed it
            self._lease(message, self._local)

    # -- what the worker sends ------------------------------------------------------------------
    def _receive_chunk_done(self, frame: Frame) -> Optional[List[Event]]:
        message = self._decode(ChunkDone, frame)
        if not self._received_current(message.epoch, message.kind):
            return None
        self._chunk_done(message, self._remote)
        return [message]

    def _receive_shard_failed(self, frame: Frame) -> Optional[List[Event]]:
        message = self._decode(ShardFailed, frame)
        if not self._received_current(message.epoch, message.kind):
            return None
        if not self._data.open:
            raise self._remote(f"it sent SHARD_FAILED for epoch {message.epoch} after ending that epoch")
        self._end_data()
        return [message]

    def _receive_item_timed_out(self, frame: Frame) -> List[Event]:
        message = self._decode(ItemTimedOut, frame)
        # The worker ends the session after it, whichever epoch it names: report it.
        self._is_current(message.epoch, message.kind, self._remote)
        return [message]

    def _receive_data(self, frame: Frame) -> Optional[List[Event]]:
        epoch, sequence, count = self._header(frame)
        flow = self._data
        if (
            epoch == self.epoch and not self.stopped and self._leases is None and flow.open and flow.credits > 0
            and sequence == flow.sequence
        ):  # fmt: skip
            # The common frame, which passes every check below (a frame per item of a slow stage): in one test.
            flow.credits -= data_cost(frame.nbytes)
            flow.sequence += 1
            flow.items += count
            return [DataReceived(epoch, sequence, count, frame)]
        if not self._received_current(epoch, frame.kind):
            return None
        self._check_data_leased(epoch, sequence, count, self._remote)
        flow = self._frame_in_flow(self._data, frame.kind, epoch, sequence, self._remote, data_cost(frame.nbytes))
        flow.items += count
        return [DataReceived(epoch, sequence, count, frame)]

    def _receive_end_of_shard(self, frame: Frame) -> Optional[List[Event]]:
        message = self._decode(EndOfShard, frame)
        if not self._received_current(message.epoch, message.kind):
            return None
        self._check_reported_carried(message, self._remote)
        self._end_flow(self._data, message, self._remote)
        self._end_leases()
        return [message]

    def _receive_item_credit(self, frame: Frame) -> Optional[List[Event]]:
        message = self._decode(ItemCredit, frame)
        if not self._received_current(message.epoch, message.kind):
            return None
        if self._input is None:
            raise self._remote(
                f"it sent ITEM_CREDIT for epoch {message.epoch}, which was not started with dispatched=True"
            )
        if not self._input.open:
            return []  # granted before it saw END_OF_INPUT
        self._input.credits += message.credits
        return [message]

    def _receive_reject(self, frame: Frame) -> List[Event]:
        return [Refused(decode_reject(frame))]


class WorkerProtocol(SessionProtocol):
    """The worker's end of one trainer session (the protocol of ``worker.session.WorkerSession``)."""

    role = "worker"
    peer_role = "trainer"

    # -- what the trainer sends -----------------------------------------------------------------
    def _receive_setup(self, frame: Frame) -> List[Event]:
        """A session's Setup, or a bootstrap Join (which the driver refuses unless its
        transport serves it): either way the worker answers READY, SETUP_FAILED or SETUP_REFUSED."""
        try:
            message = decode_setup(frame)
        except RemoteProtocolError as exc:
            raise self._remote(f"it sent a malformed SETUP ({exc})") from exc
        if isinstance(message, Setup):
            for name in ("heartbeat_interval", "peer_timeout"):
                value = getattr(message.options, name)
                if not value > 0:
                    raise self._remote(f"it sent SETUP with {name}={value}, which must be positive")
            self.heartbeat_interval = float(message.options.heartbeat_interval)
            self.peer_timeout = float(message.options.peer_timeout)
        return [message]

    def _receive_start_epoch(self, frame: Frame) -> List[Event]:
        message = self._decode(StartEpoch, frame)
        self._start_epoch(message, self._remote)
        return [message]

    def _receive_stop_epoch(self, frame: Frame) -> Optional[List[Event]]:
        message = self._decode(StopEpoch, frame)
        if not self._received_current(message.epoch, message.kind):
            return None
        self._stop_epoch(message)
        return [message]  # also when the shard just ended: the producer is gone either way

    def _receive_credit(self, frame: Frame) -> Optional[List[Event]]:
        message = self._decode(Credit, frame)
        if not self._received_current(message.epoch, message.kind):
            return None
        self._data.credits += message.credits  # after END_OF_SHARD too: the trainer grants as it consumes
        return [message] if self._data.open else []

    def _receive_items(self, frame: Frame) -> Optional[List[Event]]:
        epoch, sequence, count = self._header(frame)
        if not self._received_current(epoch, frame.kind) or not self._data.open:
            return None
        self._items_leased(epoch, sequence, count, self._remote)
        flow = self._frame_in_flow(self._input, frame.kind, epoch, sequence, self._remote)
        message = self._decode(Items, frame)
        flow.items += len(message.items)
        return [message]

    def _receive_end_of_input(self, frame: Frame) -> Optional[List[Event]]:
        message = self._decode(EndOfInput, frame)
        if not self._received_current(message.epoch, message.kind) or not self._data.open:
            return None
        self._end_flow(self._input, message, self._remote)
        return [message]

    def _receive_lease(self, frame: Frame) -> Optional[List[Event]]:
        message = self._decode(Lease, frame)
        if not self._received_current(message.epoch, message.kind) or not self._data.open:
            return None  # in flight when the shard ended: past the stream's end
        self._lease(message, self._remote)
        return [message]

    # -- what the worker sends ------------------------------------------------------------------
    def _send_chunk_done(self, message: ChunkDone) -> None:
        self._sent_current(message.epoch, message.kind)
        self._chunk_done(message, self._local)

    def _send_ready(self, message: Ready) -> None:
        # The peer timeout counts from READY: what the trainer sent while this side loaded the
        # graph (heartbeats) waits unread until now, so the trainer was not silent meanwhile.
        self._last_received = self._clock()

    def _send_shard_failed(self, message: Union[ShardFailed, ItemTimedOut]) -> None:
        self._sent_current(message.epoch, message.kind)
        if not self._data.open:
            raise self._local(f"it sent {message.kind.name} for epoch {message.epoch} after ending that epoch")
        self._end_data()

    _send_item_timed_out = _send_shard_failed

    def _send_data(self, message: Data) -> None:
        self._sent_current(message.epoch, message.kind)
        self._check_data_leased(message.epoch, message.sequence, len(message.items), self._local)
        cost = data_cost(data_nbytes(message.items))
        flow = self._frame_in_flow(self._data, message.kind, message.epoch, message.sequence, self._local, cost)
        flow.items += len(message.items)

    def _send_end_of_shard(self, message: EndOfShard) -> None:
        self._sent_current(message.epoch, message.kind)
        self._check_reported_carried(message, self._local)
        self._end_flow(self._data, message, self._local)
        self._end_leases()

    def _send_item_credit(self, message: ItemCredit) -> None:
        self._sent_current(message.epoch, message.kind)
        if self._input is None or not self._input.open or not self._data.open:
            raise self._local(
                f"it sent ITEM_CREDIT for epoch {message.epoch}, whose dispatched input is not open"
            )
        self._input.credits += message.credits
