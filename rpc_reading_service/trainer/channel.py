"""The trainer's end of worker sessions (``WorkerChannel``) and the typed events it reports."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import (
    FrameTooLargeError,
    ItemTimeoutError,
    RemoteProtocolError,
    WorkerDrainedError,
    WorkerLostError,
    WorkerRefusedError,
    WorkerStartupError,
    describe_worker,
)  # fmt: skip
from .receive_loop import FRAMES_PER_TURN, ReceiveLoop
from ..protocol import (
    DATA_HEAD,
    DATA_ITEM,
    ChunkDone,
    Close,
    Credit,
    DataReceived,
    EndOfInput,
    EndOfShard,
    Frame,
    ItemCredit,
    Items,
    ItemTimedOut,
    Lease,
    Leaving,
    Message,
    Ready,
    Refused,
    SessionState,
    Setup,
    SetupFailed,
    SetupRefused,
    ShardFailed,
    StartEpoch,
    Tick,
    TrainerSession,
    CreditWindow,
    lease_runs,
    with_window,
)
from ..serialization import rebuild_exception
from ..tasks import TaskGroup
from ..transports.base import Connection, PeerLostError

__all__ = [
    "Event",
    "FrameReceived",
    "ShardEnded",
    "ChunkFinished",
    "Failure",
    "EpochFailed",
    "SessionLost",
    "ChannelClosed",
    "UnitsDispatched",
    "ServersJoined",
    "ChannelStats",
    "WorkerChannel",
    "drop_items",
    "slow_frame",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Event:
    """Something a worker channel reports to the consumer (one subclass per kind), of ``epoch``."""

    channel: "WorkerChannel"
    epoch: Optional[int]


@dataclass(frozen=True, eq=False)
class FrameReceived(Event):
    """A DATA frame of the epoch, decoded by the consumer."""

    frame: Frame


@dataclass(frozen=True, eq=False)
class ShardEnded(Event):
    """The worker's shard of the epoch ended (END_OF_SHARD)."""


@dataclass(frozen=True, eq=False)
class ChunkFinished(Event):
    """The worker finished leased chunks of the epoch ("dynamic": its CHUNK_DONE)."""

    chunk: ChunkDone


@dataclass(frozen=True, eq=False)
class Failure(Event):
    """An event whose ``error`` the consumer raises."""

    error: BaseException


@dataclass(frozen=True, eq=False)
class EpochFailed(Failure):
    """The worker's epoch raised (its SHARD_FAILED) or timed out on an item, or the dispatching part raised."""


@dataclass(frozen=True, eq=False)
class SessionLost(Failure):
    """The session is lost (epoch None): its process died, the connection broke, it left or timed out."""


@dataclass(frozen=True, eq=False)
class ChannelClosed(Failure):
    """The trainer shut the channel down (epoch None)."""


@dataclass(frozen=True, eq=False)
class UnitsDispatched(Event):
    """Not a worker's: the trainer's dispatcher pulled more units of the epoch (``channel``: any one)."""


@dataclass(frozen=True, eq=False)
class ServersJoined(Event):
    """Not a worker's: servers joined the run; their sessions take part in the epoch (``channel``: any one)."""


def drop_items(events: "queue.SimpleQueue[Event]") -> None:
    """Drop the items no one will take from ``events`` of closed channels; the other events stay, in order."""
    kept = []
    while not events.empty():  # not by queue.Empty: a service finalized at exit finds this module's names cleared
        try:
            event = events.get_nowait()
        except queue.Empty:  # another thread took the last one
            break
        if not isinstance(event, FrameReceived):
            kept.append(event)
    for event in kept:
        events.put(event)


@dataclass
class ChannelStats:
    """Counters of one worker channel for the current epoch, for ``RPCReadingService.stats()``."""

    items: int = 0
    bytes: int = 0
    wait_seconds: float = 0.0


class WorkerChannel:
    """The trainer's end of one worker session: a driver of its :class:`TrainerSession`."""

    def __init__(
        self,
        conn: Optional[Connection],
        rank: int,
        heartbeat_interval: float,
        peer_timeout: float,
        loop: Optional[ReceiveLoop] = None,
        address: Optional[str] = None,
    ):
        """
        Args:
            conn: the session's connection; None: :meth:`attach` it once connected, then :meth:`setup`.
            loop: the receive loop to receive in, when the connection allows (:meth:`start_receiver`).
            address: the worker's address (needed without ``conn``).
        """
        self.conn = conn
        self.rank = rank
        if conn is None and address is None:
            raise ValueError("a WorkerChannel made without a connection needs its worker's address")
        self.address: str = conn.peer if conn is not None else str(address)
        self.heartbeat_interval = heartbeat_interval
        self.peer_timeout = peer_timeout
        self.epoch: Optional[int] = None
        self.queue: "queue.SimpleQueue[Event]" = queue.SimpleQueue()
        self.stats = ChannelStats()
        self.info: Dict[str, Any] = {}
        #: A loss noticed after this worker's shard ended, to report when the next epoch needs it.
        self.held_loss: Optional[SessionLost] = None
        self.protocol = TrainerSession(self.name, heartbeat_interval, peer_timeout)
        #: Around every call of the state machine (the receiver and the consumer both use it).
        self._state_lock = threading.Lock()
        #: Held from recording a frame to writing it: frames leave in the order recorded.
        self._send_lock = threading.Lock()
        #: Why the worker ended the session, if it said (item_timeout, LEAVING).
        self.ended_by: Optional[WorkerLostError] = None
        #: Said after "its process died" when the connection closes: what else ends a session's process.
        self.closed_hint = ""
        #: The user's number of each epoch started here, by its number on the wire.
        self._numbers: Dict[int, int] = {}
        self._closing = False
        #: Sends asked for before the session is set up (START_EPOCH, LEASE ...): sent in order
        #: as soon as READY arrives (:meth:`setup`); None from then on.
        self._held: Optional[List[Tuple[Tuple[Message, ...], Optional[int], bool]]] = []
        self._loop = loop
        self._in_loop = False
        #: The latest epoch's window (its frames bound the buffers), in frames of the session's bound
        #: once SETUP gives it, and the credit the consumer handed on and not sent back yet (:meth:`grant`).
        self._credit = CreditWindow()
        #: Around :attr:`_credit` (the consumer adds, the receive loop sends), and
        #: whether the loop was told that they are due.
        self._credit_lock = threading.Lock()
        self._credit_due = False
        #: The receiver thread of a connection no receive loop watches.
        self._tasks = TaskGroup(self.name)
        #: When dispatching, the epoch's dispatcher hears this session's ITEM_CREDIT, END_OF_SHARD,
        #: SHARD_FAILED and ITEM_TIMED_OUT events here (from the receiver thread).
        self.input_sink: Optional[Callable[[Any], None]] = None
        self._on_event: Dict[type, Callable[[Any], bool]] = {
            DataReceived: self._on_data,
            ItemCredit: self._on_item_credit,
            EndOfShard: self._on_end_of_shard,
            ChunkDone: self._on_chunk_done,
            ShardFailed: self._on_shard_failed,
            ItemTimedOut: self._on_item_timed_out,
            Refused: lambda refused: self._lost(f"{self.name} ended the session: {refused.reason}"),
            Close: lambda close: self._lost(f"{self.name} ended the session (it said CLOSE)"),
            Leaving: self._on_leaving,
        }

    @property
    def name(self) -> str:
        """``worker R (host:port)``, for messages."""
        return describe_worker(self.rank, self.address)

    def _send_or_report(
        self, *messages: Message, wait: float = -1, epoch: Optional[int] = None, if_room: bool = False
    ) -> None:
        """Send ``messages`` in one write unless the session is over (the receiver reports a failed send).

        Args:
            wait: seconds to wait for a send in progress (-1: as long as it takes), else nothing is sent.
            epoch: nothing is sent once another epoch started (or this one stopped).
            if_room: nothing is sent when the connection has no room for it now.
        """
        if not self._send_lock.acquire(timeout=wait):
            log.debug("not sending %s to %s: another send is stuck", _kinds(messages), self.name)
            return
        try:
            if self._held is not None:  # still setting up: the worker could not take them yet
                self._held.append((messages, epoch, if_room))
                return
            self._send_now(messages, epoch, if_room)
        finally:
            self._send_lock.release()

    def _send_now(self, messages: Sequence[Message], epoch: Optional[int], if_room: bool) -> None:
        """:meth:`_send_or_report`'s sending, holding the send lock."""
        assert self.conn is not None, "attach() the connection first"
        if if_room and not self.conn.has_room():
            log.debug("not sending %s to %s: its connection is full", _kinds(messages), self.name)
            return
        with self._state_lock:
            if self.protocol.state is SessionState.CLOSED:
                return  # the receiver reports why it ended
            if epoch is not None and (epoch != self.protocol.epoch or self.protocol.stopped):
                return
            frames = [self.protocol.send(message) for message in messages]
        try:
            self.conn.send_frames(frames)
        except (PeerLostError, OSError) as exc:
            # Not the end yet: the peer's last frames (a failure, a REJECT that explains
            # why it closed) may still wait to be read; recv reports the loss.
            log.debug("send to %s failed: %s", self.name, exc)

    def _release_held(self) -> None:
        """The session is set up: send what was asked for meanwhile, in order; from now on
        every send goes out at once."""
        with self._send_lock:
            held, self._held = self._held or [], None
            if self._closing:
                return
            for messages, epoch, if_room in held:  # a START_EPOCH's window: now that the frame bound is known
                self._send_now(with_window(messages, self._credit.window), epoch, if_room)

    def _tick(self, now: Optional[float] = None, blocking: bool = True) -> Tick:
        """The state machine's liveness: send the heartbeat due, return what else it found.

        Args:
            blocking: False: no heartbeat while another send is in progress or the connection is full.
        """
        sending = self._send_lock.acquire(blocking)
        try:
            with self._state_lock:
                due = self.protocol.tick(now)
            if due.chunks and sending and (blocking or self.conn.has_room()):
                try:
                    self.conn.send(due.chunks)
                except (PeerLostError, OSError) as exc:
                    log.debug("heartbeat to %s failed: %s", self.name, exc)
        finally:
            if sending:
                self._send_lock.release()
        return due

    @property
    def frames_received(self) -> int:
        """DATA frames of the current epoch received (the state machine's count)."""
        return self.protocol.next_sequence

    def heard_since(self, since: float) -> bool:
        """Whether a frame from the worker came half a heartbeat interval or more after ``since``."""
        return self.protocol.last_received >= since + self.heartbeat_interval / 2

    def _receive(self, frame: Frame) -> List[Any]:
        with self._state_lock:
            return self.protocol.receive_frame(frame)

    # -- setup ----------------------------------------------------------------------------------
    def attach(self, conn: Connection) -> None:
        """Give a channel made without a connection the one it was opened with; a channel the
        trainer closed meanwhile closes ``conn`` and raises :class:`WorkerLostError`."""
        with self._state_lock:
            closing = self._closing
            if not closing:
                self.conn = conn
        if closing:
            conn.close()
            raise WorkerLostError(f"{self.name}: the trainer closed the session while connecting", self.rank, self.address)

    def setup(self, setup: Union[Setup, Mapping[str, Any]], timeout: float) -> None:
        """Send SETUP (a :class:`Setup` or its fields), wait for READY, then send what was held meanwhile.

        Raises:
            WorkerStartupError: setup failed on the worker. WorkerRefusedError: its server refused
            the session. WorkerLostError: no READY within ``timeout``.
        """
        assert self.conn is not None, "attach() the connection first"
        message = setup if isinstance(setup, Setup) else Setup(**setup)
        with self._credit_lock:  # an epoch started while connecting: its frames, of this bound
            self._credit.set_bound(message.options.batch_max_bytes)
        self._bound_buffers()
        with self._state_lock:
            self.protocol.setup_timeout = timeout
        # A server that refuses the session may close before reading all of SETUP: its
        # REJECT is still there to read below.
        with self._send_lock:
            self._send_now((message,), None, False)
        while True:
            due = self._tick()
            if due.events:
                raise WorkerLostError(f"{self.name} did not finish setup within {timeout:.0f} s", self.rank, self.address)
            try:
                frame = self.conn.recv(timeout=due.wait)
            except PeerLostError as exc:
                raise WorkerLostError(f"{self.name} closed the session during setup: {exc}", self.rank, self.address) from exc
            if frame is None:
                continue
            for event in self._receive(frame):
                if isinstance(event, Ready):
                    self.info = dataclasses.asdict(event)
                    self._release_held()
                    return
                self._raise_setup_failure(event)

    def _raise_setup_failure(self, event: Any) -> None:
        if isinstance(event, Refused):
            raise WorkerRefusedError(f"{self.name} refused the session: {event.reason}")
        if isinstance(event, SetupRefused):  # e.g. the server runs another transport
            raise WorkerStartupError(f"{self.name} refused the session: {event.message}")
        if isinstance(event, SetupFailed):
            error = rebuild_exception(dict(event.exception), self.rank, self.address)
            raise WorkerStartupError(
                f"{self.name} could not set up the graph (unpickling it or running worker_init_fn): {error}"
            ) from error
        if isinstance(event, Leaving):
            raise self._drained(event)
        raise WorkerLostError(f"{self.name} ended the session during setup (it said CLOSE)", self.rank, self.address)

    def fail_setup(self, error: BaseException) -> None:
        """Setting up in the background failed with ``error``: close the connection, report the loss."""
        if self.conn is not None:
            self.conn.close()
        if not self._closing:
            self.queue.put(SessionLost(self, None, error))

    def start_receiver(self, sink: "queue.SimpleQueue[Event]") -> None:
        """Start receiving into ``sink``: in the receive loop if the connection allows, else in a thread."""
        assert self.conn is not None, "attach() the connection first"
        self.queue = sink
        if self._loop is not None and self.conn.fileno() is not None:
            with self._state_lock:  # against close(): it removes the channel only if it was added
                if self._closing:
                    return
                self._in_loop = True
                self._loop.add(self)
            return
        self._tasks.start(f"recv-{self.rank} {self.address}", self._receive_loop)

    # -- epochs ---------------------------------------------------------------------------------
    def start_epoch(
        self,
        epoch: int,
        seed: int,
        global_worker_id: int,
        credits: int,
        skip: int = 0,
        dispatched: bool = False,
        leased: bool = False,
        number: Optional[int] = None,
        grow_to: int = 0,
    ) -> None:
        """Start ``epoch`` on the worker, superseding any epoch still running there.

        Args:
            credits: its credit window in frames.
            dispatched: its input comes from the trainer (:meth:`send_input`).
            leased: the worker walks its stream by the chunks :meth:`lease` hands it.
            number: the epoch as the user counts it (from 0), for messages.
            grow_to: the frames that window may grow to with larger items (0: it does not).
        """
        if number is not None:
            self._numbers[epoch] = number
        with self._credit_lock:
            self.epoch = epoch
            window = self._credit.start(credits, grow_to)
        self._bound_buffers()
        self.stats = ChannelStats()
        # Its frames: what the worker bounds its buffer pools by, the most this window may grow to.
        self._send_or_report(StartEpoch(epoch, seed, global_worker_id, window, skip, dispatched, leased, max(credits, grow_to)))

    def _bound_buffers(self) -> None:
        """Bound the connection's reuse pools by the session's credit window as it is now, plus one
        frame (a larger pool hands out colder memory: its buffers are reused in turn)."""
        if self.conn is not None and self._credit.bound is not None:  # else setup() bounds them
            self.conn.bound_buffers(self._credit.frames_held() + 1, self._credit.bound)

    def send_input(self, message: Union[Items, EndOfInput]) -> None:
        """Send an ITEMS or END_OF_INPUT frame of the dispatched input (nothing once its epoch is over)."""
        self._send_or_report(message, epoch=message.epoch)

    def grant(self, epoch: int, nbytes: int, after_slow_frame: bool = False, items: int = 1) -> None:
        """Give back the credit of a DATA frame of ``epoch`` of ``nbytes`` (``Frame.nbytes``) and
        ``items`` items whose last item was handed on, in batches (the consumer's thread)."""
        if epoch != self.epoch:
            return
        with self._credit_lock:
            window = self._credit.window
            due = self._credit.handed_on(nbytes, after_slow_frame, items)
            grew = self._credit.window > window
            tell = False
            if due:
                if self._in_loop:
                    tell, self._credit_due = not self._credit_due, True
                else:
                    credits = self._credit.take()
        if grew:
            self._bound_buffers()
        if not due:
            return
        if tell:
            assert self._loop is not None
            self._loop.due(self)
        elif not self._in_loop:
            self._send_or_report(Credit(epoch, credits))

    def send_due(self) -> bool:
        """Send the CREDIT :meth:`grant` marked due (the receive loop's call); False: retry later."""
        if self._closing or self.conn is None:
            return True
        if not self._send_lock.acquire(blocking=False):
            return False
        try:
            if not self.conn.has_room():
                return False
            with self._credit_lock:
                epoch, credits, self._credit_due = self.epoch, self._credit.take(), False
            if credits and epoch is not None:  # none: a LEASE took them along meanwhile
                self._send_now([Credit(epoch, credits)], epoch, False)
            return True
        finally:
            self._send_lock.release()

    def lease(
        self, epoch: int, chunks: Sequence[Tuple[int, int, int, int]] = (), final: bool = False,
        items: Sequence[Items] = (),
    ) -> None:  # fmt: skip
        """Lease chunks of ``epoch``'s stream to the worker, with the credits not sent yet ("dynamic").

        Args:
            chunks: ``(chunk, skip, first position, positions)``: its first ``skip`` items are not sent.
            final: no more chunks come.
            items: ITEMS frames that follow the leases (a dispatched epoch's units, one item each).
        """
        if epoch != self.epoch:
            return
        messages: List[Message] = [
            Lease(epoch, chunk, skip, count=count, start=start, size=size) for chunk, skip, count, start, size in lease_runs(chunks)
        ]
        messages.extend(items)
        if final:
            messages.append(Lease(epoch, final=True))
        with self._credit_lock:
            credits = self._credit.take()
        if credits:
            messages.insert(0, Credit(epoch, credits))
        self._send_or_report(*messages)

    def close(self, timeout: float = 2.0) -> None:
        """Say CLOSE, stop receiving and close the connection (idempotent); wake a waiting consumer."""
        with self._state_lock:
            if self._closing:
                return
            self._closing = True
        # A dispatched ITEMS frame may be stuck in a send to a worker that stopped reading:
        # closing the connection below wakes it, so do not wait for it to say CLOSE.
        self._send_or_report(Close(), wait=min(timeout, 1.0), if_room=True)
        if self._in_loop:
            assert self._loop is not None
            self._loop.remove(self, timeout)  # before closing: the loop must not poll a closed descriptor
        if self.conn is not None:  # else the setup's attach() closes it
            self.conn.close()
        self._tasks.stop(timeout)  # not the receiver itself, if it closes the channel
        closed = RuntimeError(
            f"the DataLoader2 was shut down while this iteration waited for items from {self.name} "
            "(dl.shutdown() or an error in another thread); start a new DataLoader2 to go on"
        )
        self.queue.put(ChannelClosed(self, None, closed))

    # -- receiving ------------------------------------------------------------------------------
    def fileno(self) -> Optional[int]:
        """The connection's descriptor, for the receive loop."""
        return self.conn.fileno()

    def on_readable(self) -> bool:
        """Take in the frames that arrived (the receive loop's call); True once receiving is over."""
        if self._closing:
            return True
        try:
            frames = self.conn.recv_ready(FRAMES_PER_TURN)
            if self.conn.ready_left:  # frames kept for the next turns, which serve the other sessions first
                self._loop.again(self)  # type: ignore[union-attr]
            return self._deliver(frames) if frames else False
        except Exception as exc:  # noqa: BLE001 - reported, as by _receiving() (one call less per read)
            return self._receiving_failed(exc)

    def on_tick(self, now: float) -> Optional[float]:
        """Send the heartbeat due and report a silent worker; seconds until the next check,
        None once receiving is over."""
        if self._closing:
            return None
        due = self._tick(now, blocking=False)
        if due.events:  # PeerTimedOut
            # Silent that long, it is gone: shutting the connection down ends the sends still
            # waiting for it to read (they fail quietly), so the consumer gets to the loss.
            self.conn.close()
            self._lost(due.events[0].message)
            return None
        return min(due.wait, self.heartbeat_interval)

    def _deliver(self, frames: Sequence[Frame]) -> bool:
        """Frames through the state machine, its events to the queue; True: receiving is over."""
        on_event = self._on_event
        for frame in frames:
            for event in self._receive(frame):
                if on_event.get(type(event), _ignore)(event):
                    return True
        return False

    def _receiving(self, step: Callable[[], bool]) -> bool:
        """``step()``, reporting the session lost if receiving failed; True: receiving is over."""
        try:
            return step()
        except Exception as exc:  # noqa: BLE001 - never stop silently: the consumer would wait forever
            return self._receiving_failed(exc)

    def _receiving_failed(self, exc: Exception) -> bool:
        """Report the session lost for ``exc``, which receiving raised; True: the receiver stops."""
        if isinstance(exc, PeerLostError):
            return self._lost(f"lost {self.name}: {exc}. Its process died or the connection broke{self.closed_hint}")
        if isinstance(exc, FrameTooLargeError):  # an older worker's item, or its error's traceback
            return self._lost(f"{self.name} sent more than this trainer accepts: {exc}. Raise the trainer's "
                              "TransportConfig(max_frame_bytes=...), or make the items smaller")
        if isinstance(exc, RemoteProtocolError):
            return self._lost(str(exc))
        log.error("receiver for %s failed", self.name, exc_info=exc)
        return self._lost(f"receiving from {self.name} failed: {exc!r}")

    def _lost(self, message: str) -> bool:
        """Report the session lost (unless the trainer closed it); True: the receiver stops."""
        if not self._closing:
            # A session the worker ended for a stuck item: say so also in a later epoch.
            error = self.ended_by or WorkerLostError(message, self.rank, self.address)
            self._report(SessionLost(self, None, error))
        return True

    def _report(self, event: Event) -> None:
        """Queue ``event`` for the consumer: in a receive loop, with the others of the loop's turn."""
        if self._in_loop:
            assert self._loop is not None
            self._loop.hand_over(self.queue.put, event)
        else:
            self.queue.put(event)

    def _receive_loop(self) -> None:
        """The receiver thread of a connection no receive loop can watch."""
        next_tick = 0.0
        while not self._closing:
            now = time.monotonic()
            if now >= next_tick:
                wait = self.on_tick(now)
                if wait is None:
                    return
                next_tick = now + wait
            if self._receiving(lambda: self._deliver(self._recv_one(max(0.0, next_tick - time.monotonic())))):
                return

    def _recv_one(self, timeout: float) -> List[Frame]:
        frame = self.conn.recv(timeout=timeout)
        return [] if frame is None else [frame]

    def _on_data(self, event: DataReceived) -> bool:
        # Only the header was read: the consumer decodes, so this thread holds the GIL briefly.
        frame = event.frame
        self.stats.bytes += frame.nbytes
        self._report(FrameReceived(self, event.epoch, frame))
        return False

    def _on_item_credit(self, event: ItemCredit) -> bool:
        self._tell_input(event)
        return False

    def _tell_input(self, event: Any) -> None:
        sink = self.input_sink
        if sink is not None:
            sink(event)

    def _on_chunk_done(self, event: ChunkDone) -> bool:
        self._report(ChunkFinished(self, event.epoch, event))
        return False

    def _on_end_of_shard(self, event: EndOfShard) -> bool:
        self._tell_input(event)
        self._report(ShardEnded(self, event.epoch))
        return False

    def _on_shard_failed(self, event: ShardFailed) -> bool:
        self._tell_input(event)
        self._report(EpochFailed(self, event.epoch, rebuild_exception(dict(event.exception), self.rank, self.address)))
        return False

    def _on_item_timed_out(self, event: ItemTimedOut) -> bool:
        self._tell_input(event)
        self.ended_by = self._item_timeout_error(event)
        self._report(EpochFailed(self, event.epoch, self.ended_by))
        return False

    def _on_leaving(self, event: Leaving) -> bool:
        self.ended_by = self._drained(event)
        self.conn.close()  # nothing more comes: the worker's session ends now, not when the consumer gets here
        return self._lost(str(self.ended_by))

    def _drained(self, event: Leaving) -> WorkerDrainedError:
        """The worker's LEAVING as the error its loss carries (the engine hands its work on)."""
        log.info("%s is leaving: %s", self.name, event.reason or "its server drains")
        reason = event.reason or "its worker server is draining"
        return WorkerDrainedError(f"{self.name} left the run: {reason}", self.rank, self.address)

    def _item_timeout_error(self, event: ItemTimedOut) -> ItemTimeoutError:
        position, stuck = event.position, event.stuck_epoch
        epoch = self._numbers.get(stuck, f"{stuck} (on the wire)")
        message = (
            f"{self.name} spent more than {event.item_timeout} s (item_timeout) producing item {position} "
            f"of its shard in epoch {epoch} and ended its session. Its graph was here:\n{event.stack}"
            "Fix what blocks there, or raise item_timeout if items legitimately take that long"
        )
        return ItemTimeoutError(message, self.rank, self.address, position=position, stack=event.stack)


#: A DATA frame of one item of at most this many bytes is a slow stage's (see :func:`slow_frame`).
SLOW_FRAME_MAX_BYTES = 64 * 1024


def slow_frame(items: int, nbytes: int) -> bool:
    """Whether a DATA frame of ``items`` items and ``nbytes`` (``Frame.nbytes``) is a slow stage's: one small item."""
    return items == 1 and nbytes - DATA_HEAD.size - DATA_ITEM.size <= SLOW_FRAME_MAX_BYTES


def _kinds(messages: Sequence[Message]) -> str:
    """``CREDIT+LEASE``: the kinds of ``messages``, for log lines."""
    return "+".join(message.kind.name for message in messages)


def _ignore(event: Any) -> bool:
    """Events this driver does not act on."""
    return False
