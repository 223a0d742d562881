"""The two session state machines, sans I/O: one transition table and the checks around it.

The rules (states, the table, credits, leases, liveness) are in docs/architecture.md, "The session
protocol"; the roles are :class:`~.roles.TrainerSession` and :class:`~.roles.WorkerProtocol`.
"""

from __future__ import annotations

import collections
import enum
import math
import time
from dataclasses import dataclass, field
from typing import (
    Callable,
    ClassVar,
    Deque,
    Dict,
    FrozenSet,
    List,
    NamedTuple,
    Optional,
    Tuple,
    Type,
    TypeVar,
    Union,
)

from ..errors import LocalProtocolError, RemoteProtocolError
from .frames import Buffer, Frame, MessageKind, data_header
from .messages import MESSAGE_TYPES, ChunkDone, Data, EndOfShard, Heartbeat, Lease, Message, StartEpoch, StopEpoch

__all__ = [
    "SessionState",
    "TRANSITIONS",
    "SENDS",
    "Event",
    "DataReceived",
    "PeerTimedOut",
    "Refused",
    "Tick",
    "SessionProtocol",
]

K = MessageKind
M = TypeVar("M", bound=Message)


class SessionState(enum.Enum):
    """Where a session is; both ends pass through the same states."""

    # Identity's hash, as equality is identity (Enum's hashes the name in Python): per frame.
    __hash__ = object.__hash__

    NEW = "new (before SETUP)"
    SETTING_UP = "setting up (before READY)"
    READY = "ready (between epochs)"
    IN_EPOCH = "in an epoch"
    CLOSED = "closed"


S = SessionState

#: The transition table: for a message of a kind that a role sends in a state, the state after it
#: (on both ends: the sender's ``send`` and the peer's ``receive_frame``). A kind missing from a
#: state's row is illegal there. Beside it: a frame dropped as stale (of an older or stopped epoch)
#: leaves the state as it is; a broken rule (closed by "error") and a silent peer (``tick``: closed
#: by "timeout") close the session. A worker server may end a session at any point with a REJECT
#: that says why (``Connection.refuse``).
TRANSITIONS: Dict[str, Dict[SessionState, Dict[MessageKind, SessionState]]] = {
    "trainer": {
        S.NEW: {K.SETUP: S.SETTING_UP, K.HEARTBEAT: S.NEW, K.CLOSE: S.CLOSED},
        S.SETTING_UP: {K.HEARTBEAT: S.SETTING_UP, K.CLOSE: S.CLOSED},
        S.READY: {
            K.START_EPOCH: S.IN_EPOCH, K.STOP_EPOCH: S.READY, K.CREDIT: S.READY, K.ITEMS: S.READY,
            K.END_OF_INPUT: S.READY, K.LEASE: S.READY, K.HEARTBEAT: S.READY, K.CLOSE: S.CLOSED,
        },
        S.IN_EPOCH: {
            K.START_EPOCH: S.IN_EPOCH, K.STOP_EPOCH: S.READY, K.CREDIT: S.IN_EPOCH, K.ITEMS: S.IN_EPOCH,
            K.END_OF_INPUT: S.IN_EPOCH, K.LEASE: S.IN_EPOCH, K.HEARTBEAT: S.IN_EPOCH, K.CLOSE: S.CLOSED,
        },
    },
    "worker": {
        S.NEW: {K.HEARTBEAT: S.NEW, K.LEAVING: S.CLOSED, K.REJECT: S.CLOSED, K.CLOSE: S.CLOSED},
        S.SETTING_UP: {
            K.READY: S.READY, K.SETUP_FAILED: S.CLOSED, K.SETUP_REFUSED: S.CLOSED, K.HEARTBEAT: S.SETTING_UP,
            K.LEAVING: S.CLOSED, K.REJECT: S.CLOSED, K.CLOSE: S.CLOSED,
        },
        # DATA ... CHUNK_DONE here: only stale ones, sent before the trainer stopped the epoch; an
        # ITEM_TIMED_OUT sent before it is reported (whichever epoch it names) and ends the session.
        S.READY: {
            K.DATA: S.READY, K.END_OF_SHARD: S.READY, K.SHARD_FAILED: S.READY, K.ITEM_CREDIT: S.READY,
            K.CHUNK_DONE: S.READY, K.ITEM_TIMED_OUT: S.CLOSED, K.HEARTBEAT: S.READY, K.LEAVING: S.CLOSED,
            K.REJECT: S.CLOSED, K.CLOSE: S.CLOSED,
        },
        S.IN_EPOCH: {
            K.DATA: S.IN_EPOCH, K.END_OF_SHARD: S.READY, K.SHARD_FAILED: S.READY, K.ITEM_CREDIT: S.IN_EPOCH,
            K.CHUNK_DONE: S.IN_EPOCH, K.ITEM_TIMED_OUT: S.CLOSED, K.HEARTBEAT: S.IN_EPOCH, K.LEAVING: S.CLOSED,
            K.REJECT: S.CLOSED, K.CLOSE: S.CLOSED,
        },
    },
}  # fmt: skip
#: The kinds each role may send in each state (the peer may receive exactly these).
SENDS: Dict[str, Dict[SessionState, FrozenSet[MessageKind]]] = {
    role: {state: frozenset(row) for state, row in table.items()} for role, table in TRANSITIONS.items()
}
_EVER_SENT = {role: frozenset().union(*table.values()) for role, table in SENDS.items()}


@dataclass(frozen=True)
class DataReceived:
    """A DATA frame of the current epoch arrived (checked against credit and order).

    Only its header is read here; :meth:`decode` unpacks the items, so a receiver thread
    can hand the frame to the consumer cheaply.
    """

    epoch: int
    sequence: int
    count: int
    frame: Frame

    @property
    def nbytes(self) -> int:
        """Bytes of the frame in memory."""
        return self.frame.nbytes

    def decode(self) -> Data:
        """The typed DATA message, its item payloads views into the frame (no copies)."""
        return Data.decode(self.frame)


@dataclass(frozen=True)
class PeerTimedOut:
    """The peer sent nothing, not even a heartbeat, for too long; the session is closed."""

    peer: str
    silent_seconds: float
    message: str


@dataclass(frozen=True)
class Refused:
    """The worker server ended the session with a REJECT saying why; the session is closed."""

    reason: str


#: What ``receive_frame`` and ``tick`` return: the peer's typed messages, plus these three.
Event = Union[Message, DataReceived, PeerTimedOut, Refused]


class Tick(NamedTuple):
    """What :meth:`tick` found due: chunks to send, events, and seconds until the next tick."""

    chunks: List[Buffer]
    events: List[PeerTimedOut]
    wait: float


@dataclass
class _Flow:
    """One direction of one epoch's stream: credit left (DATA: bytes; ITEMS: frames), frames and items so far."""

    credits: int
    #: The credits it started with (START_EPOCH's ``credits`` for DATA: bytes).
    window: int = 0
    sequence: int = 0
    items: int = 0
    open: bool = True


@dataclass
class _Leases:
    """The chunks of a "dynamic" epoch leased to the worker: in increasing order, each reported
    done (CHUNK_DONE) in the order leased, with its item count (DATA carries them before or after)."""

    #: Runs ``[start, stop)`` of chunks leased and not reported done, oldest first (a LEASE of a
    #: long run costs one entry, not one per chunk).
    outstanding: Deque[List[int]] = field(default_factory=collections.deque)
    latest: int = -1
    #: The position after the last one leased (the next LEASE starts at or past it).
    positions_end: int = 0
    final: bool = False
    #: Items of the epoch's chunks reported done (DATA's items up to here belong to them).
    reported: int = 0
    #: Chunks leased in all (a dispatched epoch's units: each item needs its lease first).
    leased: int = 0

    @property
    def held(self) -> int:
        """Chunks leased and not reported done."""
        return sum(stop - start for start, stop in self.outstanding)


class SessionProtocol:
    """What both ends share: states, epochs, liveness, and the checks around every call
    (the roles are :class:`~.roles.TrainerSession` and :class:`~.roles.WorkerProtocol`)."""

    role: ClassVar[str]
    peer_role: ClassVar[str]
    #: Per kind, the method that checks its contents and counts it, found by name once per class:
    #: ``_send_<kind>(message)``, ``_receive_<kind>(frame)`` (its events, or None for a stale frame);
    #: a kind without a receiver is decoded and reported as it is.
    _on_send: ClassVar[Dict[MessageKind, Callable]]
    _on_receive: ClassVar[Dict[MessageKind, Callable]]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)  # type: ignore[arg-type]
        names = {kind: kind.name.lower() for kind in MessageKind}
        cls._on_send = {kind: getattr(cls, f"_send_{name}", _nothing_method) for kind, name in names.items()}
        cls._on_receive = {
            kind: getattr(cls, f"_receive_{name}", _receive_as_it_is) for kind, name in names.items()
        }

    def __init__(
        self,
        peer: str,
        heartbeat_interval: float = 1.0,
        peer_timeout: float = 10.0,
        setup_timeout: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        lenient: bool = False,
    ):
        self.peer = peer
        #: Drop the peer's well-formed frames about epochs it never started, and ignore
        #: heartbeat bodies, instead of ending the session (a worker server serves on
        #: whatever a sloppy trainer sends, as long as it can be understood).
        self.lenient = lenient
        self.heartbeat_interval = heartbeat_interval
        self.peer_timeout = peer_timeout
        self.setup_timeout = setup_timeout
        self._clock = clock
        self.state = SessionState.NEW
        #: Who ended the session: "us", "peer", "timeout", or "error" (the peer broke a rule).
        self.closed_by: Optional[str] = None
        #: The latest epoch started (None before the first).
        self.epoch: Optional[int] = None
        self.stopped = False
        self._data = _Flow(0, open=False)
        self._input: Optional[_Flow] = None
        self._leases: Optional[_Leases] = None
        #: Frames of older or stopped epochs that arrived and were dropped.
        self.stale_frames = 0
        now = clock()
        self._last_sent = self._last_received = self._last_tick = now

    # -- public ---------------------------------------------------------------------------------
    @property
    def last_received(self) -> float:
        """When (on the session's clock) the latest frame from the peer was taken in."""
        return self._last_received

    @property
    def credits(self) -> int:
        """Bytes of DATA credit left in the current epoch (a frame may go while it is positive)."""
        return self._data.credits if self._data.open and not self.stopped else 0

    @property
    def window(self) -> int:
        """The current epoch's credit window in bytes: START_EPOCH's ``credits``."""
        return self._data.window

    @property
    def next_sequence(self) -> int:
        """The number of the next DATA frame of the current epoch."""
        return self._data.sequence

    @property
    def input_progress(self) -> Tuple[int, int]:
        """ITEMS frames and items of the current epoch's dispatched input so far ((0, 0) without one)."""
        flow = self._input
        return (flow.sequence, flow.items) if flow is not None else (0, 0)

    @property
    def item_credits(self) -> int:
        """ITEMS frames the trainer may still send in the current epoch (dispatching)."""
        flow = self._input
        return flow.credits if flow is not None and flow.open and not self.stopped else 0

    def send(self, message: Message) -> List[Buffer]:
        """Check that this side may send ``message`` now, record it, and return its chunks.

        Raises LocalProtocolError (with nothing sent and the state unchanged) if not.
        """
        kind = message.kind
        if self.state is SessionState.CLOSED:
            raise self._local(
                f"it tried to send {kind.name} after the session closed (closed by: {self.closed_by})"
            )
        after = TRANSITIONS[self.role][self.state].get(kind)
        if after is None:
            raise self._local(self._not_now(kind, self.role))
        chunks = message.encode()
        self._on_send[kind](self, message)
        self._last_sent = self._clock()
        if after is not self.state:
            self._enter(after, "us")
        return chunks

    def receive_frame(self, frame: Frame) -> List[Event]:
        """Check a frame from the peer against the rules; return the events it makes.

        Stale frames and heartbeats make none. Raises RemoteProtocolError (and closes the
        session) if the peer broke a rule.
        """
        if self.state is SessionState.CLOSED:
            if self.closed_by == "peer":
                raise self._remote(f"it sent {frame.kind.name} after its CLOSE")
            return []  # in flight when this side closed or gave up on the peer
        self._last_received = self._clock()
        try:
            after = TRANSITIONS[self.peer_role][self.state].get(frame.kind)
            if after is None:
                raise self._remote(self._not_now(frame.kind, self.peer_role))
            events = self._on_receive[frame.kind](self, frame)
        except RemoteProtocolError:
            self._enter(SessionState.CLOSED, "error")
            raise
        if events is None:
            return []  # stale: dropped, the state stays
        if after is not self.state:
            self._enter(after, "peer")
        return events

    def tick(self, now: Optional[float] = None) -> Tick:
        """Heartbeats due, and PeerTimedOut after silence; ``wait`` is when to tick again."""
        if self.state is SessionState.CLOSED:
            return Tick([], [], math.inf)
        now = self._clock() if now is None else now
        timeout = (
            self.setup_timeout
            if self.state in (SessionState.NEW, SessionState.SETTING_UP)
            else self.peer_timeout
        )
        silent, idle = now - self._last_received, now - self._last_tick
        self._last_tick = now
        if silent > timeout:
            self._enter(SessionState.CLOSED, "timeout")
            message = (
                f"{self.peer} sent nothing (not even a heartbeat) for {timeout:.1f} s: its process is hung or "
                "stopped, or the network is down"
            )
            if idle > timeout:  # a driver ticks every heartbeat interval or sooner while it runs
                message += (
                    f"; but this {self.role} itself did not run for the {idle:.1f} s before this check (its process "
                    "stopped, suspended or starved of CPU): the silence may be its own, which the peer ends the "
                    "session for too. A longer timeout rides out such pauses"
                )
            return Tick([], [PeerTimedOut(self.peer, silent, message)], math.inf)
        chunks: List[Buffer] = []
        if now - self._last_sent >= self.heartbeat_interval:
            chunks = Heartbeat().encode()
            self._last_sent = now
        wait = min(self._last_sent + self.heartbeat_interval, self._last_received + timeout) - now
        return Tick(chunks, [], max(0.0, wait))

    # -- rule helpers ---------------------------------------------------------------------------
    def _local(self, rule: str) -> LocalProtocolError:
        rule = rule.replace("it sent", "it tried to send", 1)  # the rules are worded for the sender
        return LocalProtocolError(
            f"this {self.role} broke the session protocol with {self.peer}: {rule}. This is a bug in "
            "rpc_reading_service (or in the driver or transport using it): please report it with this message"
        )

    def _remote(self, rule: str) -> RemoteProtocolError:
        return RemoteProtocolError(
            f"{self.peer} broke the session protocol: {rule}. The session with it cannot continue; if this "
            "repeats, check that both sides run the same rpc_reading_service version"
        )

    def _decode(self, cls: Type[M], frame: Frame) -> M:
        try:
            return cls.decode(frame)
        except RemoteProtocolError as exc:
            raise self._remote(f"it sent a malformed {frame.kind.name} ({exc})") from exc

    def _header(self, frame: Frame) -> Tuple[int, int, int]:
        try:
            return data_header(frame)
        except RemoteProtocolError as exc:
            raise self._remote(f"it sent a malformed {frame.kind.name} ({exc})") from exc

    def _not_now(self, kind: MessageKind, sender: str) -> str:
        if kind not in _EVER_SENT[sender]:
            return f"it sent {kind.name}, which a {sender} never sends"
        return f"it sent {kind.name} while the session is {self.state.value}"

    def _enter(self, state: SessionState, by: str) -> None:
        """Move to ``state`` (``by``: who closed the session, if it closes now)."""
        self.state = state
        if state is SessionState.CLOSED:
            self.closed_by = by

    def _is_current(self, epoch: int, kind: MessageKind, error: Callable[[str], Exception]) -> bool:
        """True for the current, not stopped epoch; False for an older or stopped one."""
        if self.epoch is None or epoch > self.epoch:
            raise error(
                f"it sent {kind.name} for epoch {epoch}, which was never started (the latest is {self.epoch})"
            )
        return epoch == self.epoch and not self.stopped

    def _received_current(self, epoch: int, kind: MessageKind) -> bool:
        if self.lenient and (self.epoch is None or epoch > self.epoch):
            self.stale_frames += 1  # about an epoch never started: nothing to act on
            return False
        if self._is_current(epoch, kind, self._remote):
            return True
        self.stale_frames += 1
        return False

    def _receive_heartbeat(self, frame: Frame) -> Optional[List[Event]]:
        if not self.lenient:
            self._decode(Heartbeat, frame)
        return []

    def _sent_current(self, epoch: int, kind: MessageKind) -> None:
        if not self._is_current(epoch, kind, self._local):
            raise self._local(
                f"it sent {kind.name} for epoch {epoch}, which is over (the current one is {self.epoch}, stopped: {self.stopped})"
            )

    def _start_epoch(self, message: StartEpoch, error: Callable[[str], Exception]) -> None:
        if self.epoch is not None and message.epoch <= self.epoch:
            raise error(
                f"it sent START_EPOCH {message.epoch} after epoch {self.epoch}: epoch numbers of a session must increase"
            )
        self.epoch, self.stopped = message.epoch, False
        self._data = _Flow(message.credits, message.credits)
        self._input = _Flow(0) if message.dispatched else None
        self._leases = _Leases() if message.leased else None

    def _stop_epoch(self, message: StopEpoch) -> None:
        self.stopped = True

    def _end_data(self) -> None:
        self._data.open = False

    def _frame_in_flow(
        self,
        flow: Optional[_Flow],
        kind: MessageKind,
        epoch: int,
        sequence: int,
        error: Callable[[str], Exception],
        cost: int = 1,
    ) -> _Flow:
        """Check one DATA/ITEMS frame against its flow's credit and numbering, and count it
        (``cost``: its credit, a DATA frame's bytes; an ITEMS frame's 1)."""
        if flow is None:
            raise error(f"it sent {kind.name} for epoch {epoch}, which was not started with dispatched=True")
        if not flow.open:
            raise error(f"it sent {kind.name} frame {sequence} of epoch {epoch} after ending that stream")
        if flow.credits <= 0:
            raise error(
                f"it sent {kind.name} frame {sequence} of epoch {epoch} without credit: a frame may be sent only while the receiver's grants are not used up"
            )
        if sequence != flow.sequence:
            raise error(
                f"it sent {kind.name} frame {sequence} of epoch {epoch} where frame {flow.sequence} was due: a frame was lost or reordered"
            )
        flow.credits -= cost
        flow.sequence += 1
        return flow

    def _end_flow(
        self, flow: Optional[_Flow], message: EndOfShard, error: Callable[[str], Exception]
    ) -> None:
        kind = message.kind
        if flow is None:
            raise error(
                f"it sent {kind.name} for epoch {message.epoch}, which was not started with dispatched=True"
            )
        if not flow.open:
            raise error(f"it sent {kind.name} for epoch {message.epoch} twice")
        if message.items_sent != flow.items:
            raise error(
                f"it sent {kind.name} for epoch {message.epoch} after {message.items_sent} items, but its frames carried {flow.items}"
            )
        flow.open = False


    @property
    def leases_outstanding(self) -> List[int]:
        """Chunks leased in the current epoch and not reported done yet, in order ("dynamic")."""
        if self._leases is None:
            return []
        return [chunk for start, stop in self._leases.outstanding for chunk in range(start, stop)]

    def _lease(self, message: Lease, error: Callable[[str], Exception]) -> None:
        """Check and record a LEASE: only in a leased epoch, chunks increasing, nothing after the final one."""
        leases = self._leases
        if leases is None:
            raise error(f"it sent LEASE for epoch {message.epoch}, which was not started with leased=True")
        if leases.final:
            raise error(f"it sent LEASE for epoch {message.epoch} after its final LEASE")
        if message.final:
            leases.final = True
            return
        if message.chunk <= leases.latest:
            raise error(
                f"it sent LEASE of chunk {message.chunk} of epoch {message.epoch} after chunk {leases.latest}: "
                "the chunks leased to a worker must increase"
            )
        if (message.start or 0) < leases.positions_end:
            raise error(
                f"it sent LEASE of chunk {message.chunk} of epoch {message.epoch} from position {message.start}, "
                f"before the end of the previous lease (position {leases.positions_end}): the positions leased "
                "to a worker must increase"
            )
        stop = message.chunk + message.count
        leases.latest = stop - 1
        leases.positions_end = message.stop
        leases.leased += message.count
        runs = leases.outstanding
        if runs and runs[-1][1] == message.chunk:
            runs[-1][1] = stop
        else:
            runs.append([message.chunk, stop])

    def _items_leased(self, epoch: int, sequence: int, count: int, error: Callable[[str], Exception]) -> None:
        """In a dispatched and leased epoch, every item of an ITEMS frame needs its LEASE first."""
        leases, flow = self._leases, self._input
        if leases is not None and flow is not None and flow.items + count > leases.leased:
            raise error(
                f"it sent ITEMS frame {sequence} of epoch {epoch} with items {flow.items} to "
                f"{flow.items + count - 1} of its input, but leased only {leases.leased} units: in a "
                "dispatched 'dynamic' epoch each item is leased before the frame that carries it"
            )

    def _chunk_done(self, message: ChunkDone, error: Callable[[str], Exception]) -> None:
        """Check and record a CHUNK_DONE: the oldest outstanding leases, with at least the items DATA
        carried since the previous reported chunk's end (the rest follow in the next DATA frames)."""
        leases = self._leases
        if leases is None:
            raise error(f"it sent CHUNK_DONE for epoch {message.epoch}, which was not started with leased=True")
        if not self._data.open:
            raise error(f"it sent CHUNK_DONE for epoch {message.epoch} after ending that epoch")
        runs, count = leases.outstanding, len(message.counts)
        if not runs or runs[0][0] != message.chunk:
            due = f"chunk {runs[0][0]}" if runs else "no chunk (none is leased)"
            raise error(
                f"it sent CHUNK_DONE for chunk {message.chunk} of epoch {message.epoch} where {due} was due: "
                "chunks are reported done once each, in the order leased"
            )
        held = leases.held
        if count > held:
            raise error(
                f"it sent CHUNK_DONE for {count} chunks from chunk {message.chunk} of epoch {message.epoch}, but "
                f"holds {held} leases: chunks are reported done once each, in the order leased"
            )
        # DATA carried since the previous report holds the first chunk's items only: the worker
        # reports a chunk with the ones before it while no DATA frame was sealed in between.
        carried = self._data.items - leases.reported
        if message.counts[0] < carried:
            raise error(
                f"it sent CHUNK_DONE for chunk {message.chunk} of epoch {message.epoch} with {message.counts[0]} items, "
                f"but its DATA frames carried {carried} since the previous chunk's end"
            )
        while count:
            run = runs[0]
            taken = min(count, run[1] - run[0])
            run[0] += taken
            count -= taken
            if run[0] == run[1]:
                runs.popleft()
        leases.reported += sum(message.counts)

    def _check_data_leased(self, epoch: int, sequence: int, count: int, error: Callable[[str], Exception]) -> None:
        """DATA of a leased epoch: items past the chunks reported done belong to an outstanding lease."""
        leases = self._leases
        if count and leases is not None and not leases.outstanding and self._data.items + count > leases.reported:
            raise error(f"it sent DATA frame {sequence} of epoch {epoch} with items but holds no lease")

    def _check_reported_carried(self, message: EndOfShard, error: Callable[[str], Exception]) -> None:
        """END_OF_SHARD of a leased epoch: every item its CHUNK_DONEs reported was carried by DATA."""
        leases = self._leases
        if leases is not None and leases.reported > message.items_sent:
            raise error(
                f"it sent END_OF_SHARD for epoch {message.epoch} after {message.items_sent} items, but its CHUNK_DONEs "
                f"reported {leases.reported}"
            )

    def _end_leases(self) -> None:
        """END_OF_SHARD of a leased epoch: leases still outstanding lie past the stream's end (empty)."""
        if self._leases is not None:
            self._leases.outstanding.clear()


def _nothing_method(self: object, message: object) -> None:
    """For messages whose sending counts nothing."""


def _receive_as_it_is(self: SessionProtocol, frame: Frame) -> List[Event]:
    """For messages whose receiving counts nothing: the typed message is the event."""
    return [self._decode(MESSAGE_TYPES[frame.kind], frame)]
