"""Typed session messages: one frozen dataclass per message kind, each with its encode/decode."""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar, Union

from ..errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from ..serialization import EXCEPTION_FIELD_TYPES
from .data_decode import decode_data
from .frames import (
    DEFAULT_MAX_FRAME_BYTES,
    Buffer,
    EncodedItem,
    Frame,
    MessageKind,
    decode_control,
    decode_chunk_done,
    decode_credit,
    decode_end_of_shard,
    decode_lease,
    encode_chunk_done,
    encode_control,
    encode_credit,
    encode_data,
    encode_end_of_shard,
    encode_lease,
    encode_frame,
    data_table_bytes,
)

__all__ = [
    "Message",
    "SessionOptions",
    "Setup",
    "Join",
    "Ready",
    "StartEpoch",
    "StopEpoch",
    "SetupFailed",
    "SetupRefused",
    "ShardFailed",
    "ItemTimedOut",
    "Close",
    "Leaving",
    "Heartbeat",
    "Credit",
    "Data",
    "EndOfShard",
    "ItemCredit",
    "Items",
    "EndOfInput",
    "Lease",
    "ChunkDone",
    "MESSAGE_TYPES",
    "resolve_field_types",
    "decode_setup",
    "decode_message",
]

M = TypeVar("M", bound="Message")

#: Epochs travel as u32 in binary frames, so a control message must not carry a larger one.
MAX_EPOCH = (1 << 32) - 1


class Message:
    """Base of every session message: ``kind`` is its frame type."""

    kind: ClassVar[MessageKind]

    def encode(self) -> List[Buffer]:
        """The chunks of this message's frame, ready for ``Connection.send``."""
        raise NotImplementedError

    @classmethod
    def decode(cls: Type[M], frame: Frame) -> M:
        """Decode a frame of this message's kind, checking every field."""
        raise NotImplementedError


# -- control messages: pickled dicts with checked fields -----------------------------------------
def _accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` fits the type ``hint`` (the few types control messages use)."""
    origin = typing.get_origin(hint)
    if origin is Union:
        return any(_accepts(arg, value) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (dict, collections.abc.Mapping) or dataclasses.is_dataclass(hint):
        return isinstance(value, dict) and all(isinstance(key, str) for key in value)
    if origin in (list, collections.abc.Sequence):
        (item,) = typing.get_args(hint)
        return isinstance(value, (list, tuple)) and all(_accepts(item, element) for element in value)
    return isinstance(value, hint)


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


class _Control(Message):
    """A control message: its fields travel as a pickled dict keyed by field name."""

    #: int fields that may be negative (all others must be >= 0).
    _signed: ClassVar[frozenset] = frozenset()
    #: int fields that must fit a u32 on the wire.
    _u32: ClassVar[frozenset] = frozenset({"epoch"})

    def __post_init__(self) -> None:
        self._check(self.payload(), LocalProtocolError, "cannot build")

    def payload(self) -> Dict[str, Any]:
        """The dict this message travels as."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def encode(self) -> List[Buffer]:
        """The chunks of this message's frame (its payload, pickled)."""
        return encode_control(self.kind, self.payload())

    @classmethod
    def decode(cls: Type[M], frame: Frame) -> M:
        """Decode a control frame; unknown keys (from a newer peer) are ignored."""
        return cls._from_payload(decode_control(frame))  # type: ignore[attr-defined]

    @classmethod
    def _from_payload(cls: Type[M], payload: Mapping[str, Any]) -> M:
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        values = {name: value for name, value in payload.items() if name in known}
        cls._check(values, RemoteProtocolError, "received")  # type: ignore[attr-defined]
        return cls(**values)

    @classmethod
    def _check(cls, values: Mapping[str, Any], error: Type[ProtocolError], verb: str) -> None:
        """Raise ``error`` unless ``values`` are a valid set of this message's fields."""
        hints, where = _field_types(cls), f"{verb} a {cls.kind.name} message"
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in values:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise error(f"{where} without its field {f.name!r}")
                continue
            value = values[f.name]
            if not _accepts(hints[f.name], value):
                raise error(
                    f"{where} whose field {f.name!r} is {type(value).__name__} {value!r:.80}, expected {hints[f.name]}"
                )
            if isinstance(value, int) and not isinstance(value, bool):
                if value < 0 and f.name not in cls._signed:
                    raise error(f"{where} whose field {f.name!r} is negative ({value})")
                if value > MAX_EPOCH and f.name in cls._u32:
                    raise error(f"{where} whose field {f.name!r} is {value}, over the maximum of {MAX_EPOCH}")
        cls._check_together(values, error, where)

    @classmethod
    def _check_together(cls, values: Mapping[str, Any], error: Type[ProtocolError], where: str) -> None:
        """Rules between fields (each field's own type is already checked)."""


@dataclass(frozen=True)
class SessionOptions:
    """The tunables of one session, which the trainer sends in SETUP (a worker uses these
    defaults until then). They travel as a dict keyed by field name; a newer trainer's
    unknown keys are ignored."""

    #: A DATA frame is sealed at ``batch_max_items`` items, ``batch_max_bytes`` bytes pickled in band,
    #: ``frame_max_bytes`` bytes in all (out-of-band buffers and shared segments too), or after
    #: ``linger`` seconds. ``batch_max_bytes`` is also the credit window's unit (``prefetch``).
    batch_max_items: int = 1024
    batch_max_bytes: int = 1024 * 1024
    frame_max_bytes: int = 2 * 1024 * 1024
    linger: float = 0.002
    #: Liveness: a heartbeat after this much silence; the peer is lost after ``peer_timeout``.
    heartbeat_interval: float = 1.0
    peer_timeout: float = 10.0
    #: Seconds a worker waits for SETUP (the server's --idle-timeout).
    setup_timeout: float = 60.0
    #: Seconds the producer may spend on one item before the session ends with an error (None: no limit).
    item_timeout: Optional[float] = None
    #: The largest frame the trainer accepts (its ``TransportConfig.max_frame_bytes``): a larger item
    #: fails in the worker's graph (ItemTooLargeError) instead of breaking the connection.
    trainer_max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES

    def within(self, max_frame_bytes: int) -> "SessionOptions":
        """These options for a trainer that accepts frames of at most ``max_frame_bytes``: the
        packing bounds lowered to a quarter of that where larger, so that a frame of small items
        sealed by one large item still fits (:meth:`largest_item_bytes`)."""
        quarter = max(1, max_frame_bytes // 4)
        per_item = data_table_bytes(1) - data_table_bytes(0)
        return dataclasses.replace(
            self, trainer_max_frame_bytes=max_frame_bytes, frame_max_bytes=min(self.frame_max_bytes, quarter),
            batch_max_bytes=min(self.batch_max_bytes, quarter),
            batch_max_items=min(self.batch_max_items, max(1, quarter // per_item)),
        )

    def largest_item_bytes(self) -> int:
        """The largest item (pickled, with its buffers) a frame within ``trainer_max_frame_bytes``
        holds: the item that seals a frame comes on top of up to ``frame_max_bytes`` of others."""
        return self.trainer_max_frame_bytes - self.frame_max_bytes - data_table_bytes(self.batch_max_items)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "SessionOptions":
        """Options from their wire form, ignoring unknown keys (newer trainers)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in values.items() if name in known})


def credit_batch(window: int, slow: bool = False) -> int:
    """How many bytes of credit a trainer returns in one CREDIT with a window of ``window`` bytes.

    Args:
        slow: after a slow stage's frame (one small item): the whole window, else half of it (at least one).
    """
    return window if slow else max(1, window // 2)


@dataclass(frozen=True)
class Setup(_Control):
    """Trainer to worker, first after the handshake: the graph and this worker's place.

    ``options`` may be given as a dict of :class:`SessionOptions` fields; it is always a
    :class:`SessionOptions` once built.
    """

    kind: ClassVar[MessageKind] = MessageKind.SETUP
    graph: bytes
    worker_rank: int
    num_workers: int
    options: SessionOptions = field(default_factory=SessionOptions)

    def __post_init__(self) -> None:
        if isinstance(self.options, Mapping):
            object.__setattr__(self, "options", SessionOptions.from_dict(self.options))
        super().__post_init__()

    def payload(self) -> Dict[str, Any]:
        """The dict this message travels as (its options as a dict too)."""
        return dict(super().payload(), options=dataclasses.asdict(self.options))

    @classmethod
    def _check_together(cls, values: Mapping[str, Any], error: Type[ProtocolError], where: str) -> None:
        hints = _field_types(SessionOptions)
        for name, value in values.get("options", {}).items():
            if name in hints and not _accepts(hints[name], value):
                raise error(f"{where} whose option {name!r} is {type(value).__name__}, expected {hints[name]}")
        if values["worker_rank"] >= values["num_workers"]:
            raise error(
                f"{where} for worker rank {values['worker_rank']} of only {values['num_workers']} workers"
            )


@dataclass(frozen=True)
class Join(_Control):
    """Trainer to worker server, on the bootstrap connection of a transport whose session
    frames travel elsewhere (torch_rpc): join the trainer's world at ``init_method``.

    It travels as a SETUP frame without a graph (:func:`decode_setup` tells the two apart),
    so a server of another transport recognises it and refuses it with a SETUP_REFUSED of
    reason ``"transport"``. The worker answers READY (with its ``transport``) once joined.
    """

    kind: ClassVar[MessageKind] = MessageKind.SETUP
    transport: str
    bootstrap_version: int
    init_method: str
    rank: int
    name: str
    trainer_name: str
    conn_id: str
    join_timeout: float
    rpc_timeout: float
    num_worker_threads: int = 4
    #: The world's TensorPipe transports and channels (None: TensorPipe's defaults).
    transports: Optional[List[str]] = None
    channels: Optional[List[str]] = None
    #: The rendezvous store namespace of the trainer's world.
    store_prefix_index: int = 0
    #: The trainer's TensorPipe ``host:port``, which the session checks it can reach before it
    #: joins (TensorPipe aborts a process that cannot); None for a local world.
    tensorpipe_address: Optional[str] = None


@dataclass(frozen=True)
class Ready(_Control):
    """Worker to trainer: setup succeeded; who serves this session."""

    kind: ClassVar[MessageKind] = MessageKind.READY
    pid: int
    hostname: str
    package_version: str
    #: The transport of a bootstrap connection that answers a :class:`Join` (None in a session).
    transport: Optional[str] = None


@dataclass(frozen=True)
class StartEpoch(_Control):
    """Trainer to worker: start ``epoch`` (superseding any running one) with ``credits`` bytes of
    DATA frames (the window: a frame may go while any credit is left, so one larger than it still goes).

    ``skip`` items of the shard are not sent (a resumed epoch); with ``dispatched`` the
    worker's input comes from the trainer in ITEMS frames, which it asks for with ITEM_CREDIT;
    with ``leased`` the worker keeps the chunks of the stream the trainer leases to it (LEASE)
    and reports each one done (CHUNK_DONE). ``frames`` is the window in frames (the policy's
    credits), however large a frame grew: the ITEM_CREDIT of dispatched input; None (a trainer
    that does not say) means ``credits`` in frames of the session's frame bound.
    """

    kind: ClassVar[MessageKind] = MessageKind.START_EPOCH
    _signed: ClassVar[frozenset] = frozenset({"seed"})
    epoch: int
    seed: int
    global_worker_id: int
    credits: int
    skip: int = 0
    dispatched: bool = False
    leased: bool = False
    frames: Optional[int] = None


@dataclass(frozen=True)
class StopEpoch(_Control):
    """Trainer to worker: abandon ``epoch``; its producer stops, frames in flight are dropped."""

    kind: ClassVar[MessageKind] = MessageKind.STOP_EPOCH
    #: Any size: an epoch over the u32 of binary frames was simply never started.
    _u32: ClassVar[frozenset] = frozenset()
    epoch: int


class _Failure(_Control):
    """A worker's failure that carries ``exception``: ``serialization.pack_exception``'s description."""

    @classmethod
    def _check_together(cls, values: Mapping[str, Any], error: Type[ProtocolError], where: str) -> None:
        described = values["exception"]
        if not described:
            raise error(f"{where} whose field 'exception' is empty (no exception described)")
        for key, types in EXCEPTION_FIELD_TYPES.items():
            if key in described and not isinstance(described[key], types):
                value = described[key]
                wanted = " or ".join("None" if t is type(None) else t.__name__ for t in types)
                raise error(f"{where} whose exception's {key!r} is {type(value).__name__} {value!r:.80}, expected {wanted}")


@dataclass(frozen=True)
class SetupFailed(_Failure):
    """Worker to trainer, instead of READY: setting up the graph raised ``exception``; the session ends."""

    kind: ClassVar[MessageKind] = MessageKind.SETUP_FAILED
    exception: Mapping[str, Any]


@dataclass(frozen=True)
class SetupRefused(_Control):
    """Worker to trainer, instead of READY: it cannot serve this trainer (``reason``, one of
    :attr:`REASONS`) and says why in ``message``; the session ends. ``transport``: the transport
    of a bootstrap connection whose server runs the one a :class:`Join` asked for (else None)."""

    kind: ClassVar[MessageKind] = MessageKind.SETUP_REFUSED
    reason: str
    message: str
    transport: Optional[str] = None

    REASONS: ClassVar[frozenset] = frozenset({"transport", "config", "join"})

    @classmethod
    def _check_together(cls, values: Mapping[str, Any], error: Type[ProtocolError], where: str) -> None:
        if values["reason"] not in cls.REASONS:
            raise error(f"{where} of unknown reason {values['reason']!r} (one of {sorted(cls.REASONS)})")


@dataclass(frozen=True)
class ShardFailed(_Failure):
    """Worker to trainer: its shard of ``epoch`` raised ``exception``; the epoch ends there, the session goes on."""

    kind: ClassVar[MessageKind] = MessageKind.SHARD_FAILED
    epoch: int
    exception: Mapping[str, Any]


@dataclass(frozen=True)
class ItemTimedOut(_Control):
    """Worker to trainer: the producer spent ``seconds`` (more than ``item_timeout``) on item
    ``position`` of epoch ``stuck_epoch`` (``stack`` is where); the session ends. ``epoch`` is
    the epoch the trainer waits for (the stuck one, or one it started after it)."""

    kind: ClassVar[MessageKind] = MessageKind.ITEM_TIMED_OUT
    _u32: ClassVar[frozenset] = frozenset({"epoch", "stuck_epoch"})
    epoch: int
    stuck_epoch: int
    position: int
    item_timeout: float
    seconds: float
    stack: str


@dataclass(frozen=True)
class Close(_Control):
    """Either side: the session is over; the sender closes the connection next."""

    kind: ClassVar[MessageKind] = MessageKind.CLOSE
    #: Set on a bootstrap connection (the transport whose session ends), None in a session.
    transport: Optional[str] = None


@dataclass(frozen=True)
class Leaving(_Control):
    """Worker to trainer: its server drains (SIGTERM); the session ends after this message.

    Nothing more comes: items of the current epoch not sent are the trainer's to have produced
    elsewhere (from what it consumed). ``reason`` says why, for the trainer's log."""

    kind: ClassVar[MessageKind] = MessageKind.LEAVING
    reason: str = ""


# -- binary messages ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Heartbeat(Message):
    """Either side: nothing to say, but alive (an empty frame)."""

    kind: ClassVar[MessageKind] = MessageKind.HEARTBEAT
    _CHUNKS: ClassVar[List[Buffer]] = encode_frame(MessageKind.HEARTBEAT)

    def encode(self) -> List[Buffer]:
        """The heartbeat frame (the same immutable chunks every time)."""
        return list(self._CHUNKS)

    @classmethod
    def decode(cls, frame: Frame) -> "Heartbeat":
        """Decode a heartbeat: it has no body."""
        if frame.body or frame.buffers:
            raise RemoteProtocolError("received a HEARTBEAT frame with a body: heartbeats are empty")
        return cls()


@dataclass(frozen=True)
class Credit(Message):
    """Trainer to worker: ``credits`` more bytes of DATA frames of ``epoch`` may be sent (ITEM_CREDIT: frames)."""

    kind: ClassVar[MessageKind] = MessageKind.CREDIT
    epoch: int
    credits: int

    def encode(self) -> List[Buffer]:
        """The chunks of this CREDIT frame."""
        return encode_credit(self.epoch, self.credits, self.kind)

    @classmethod
    def decode(cls, frame: Frame) -> "Credit":
        """Decode a CREDIT frame."""
        return cls(*decode_credit(frame))


@dataclass(frozen=True)
class ItemCredit(Credit):
    """Worker to trainer: ``credits`` more ITEMS frames of ``epoch`` may be sent (dispatching)."""

    kind: ClassVar[MessageKind] = MessageKind.ITEM_CREDIT


@dataclass(frozen=True)
class Data(Message):
    """Worker to trainer: frame ``sequence`` (from 0 in each epoch) of ``epoch``, packing ``items``.

    The hot path: decoding makes the one ``EncodedItem`` per item it always made and no
    copies; the items' payloads are views into the frame's body.
    """

    kind: ClassVar[MessageKind] = MessageKind.DATA
    epoch: int
    sequence: int
    items: Sequence[EncodedItem]

    def encode(self) -> List[Buffer]:
        """The chunks of this frame: item table, payloads, then out-of-band buffers (no copies)."""
        body, buffers = encode_data(self.epoch, self.sequence, self.items)
        return encode_frame(self.kind, body, buffers)

    @classmethod
    def decode(cls, frame: Frame) -> "Data":
        """Decode a DATA frame without copying its payloads."""
        return cls(*decode_data(frame))


@dataclass(frozen=True)
class Items(Data):
    """Trainer to worker: frame ``sequence`` of the dispatched input of ``epoch``."""

    kind: ClassVar[MessageKind] = MessageKind.ITEMS


@dataclass(frozen=True)
class EndOfShard(Message):
    """Worker to trainer: the shard of ``epoch`` ended after ``items_sent`` items."""

    kind: ClassVar[MessageKind] = MessageKind.END_OF_SHARD
    epoch: int
    items_sent: int

    def encode(self) -> List[Buffer]:
        """The chunks of this frame."""
        return encode_end_of_shard(self.epoch, self.items_sent, self.kind)

    @classmethod
    def decode(cls, frame: Frame) -> "EndOfShard":
        """Decode an END_OF_SHARD frame."""
        return cls(*decode_end_of_shard(frame))


@dataclass(frozen=True)
class EndOfInput(EndOfShard):
    """Trainer to worker: the dispatched input of ``epoch`` ended after ``items_sent`` items."""

    kind: ClassVar[MessageKind] = MessageKind.END_OF_INPUT


@dataclass(frozen=True)
class Lease(Message):
    """Trainer to worker ("dynamic" epochs): the ``count`` consecutive chunks of the stream from
    ``chunk`` on are this worker's, chunk ``chunk + i`` being the ``size`` positions from
    ``start + i * size`` on; the first ``skip`` items of the first one were delivered already (a
    resumed or reassigned chunk) and are not sent. Without ``start``, chunk ``k`` is position
    ``k`` alone (a dispatched epoch's unit, one item).

    ``final``: no more chunks will be leased to this worker in ``epoch`` (then ``chunk``,
    ``skip``, ``count``, ``start`` and ``size`` are 0); the worker stops its walk where its leases end.
    """

    kind: ClassVar[MessageKind] = MessageKind.LEASE
    epoch: int
    chunk: int = 0
    skip: int = 0
    final: bool = False
    count: int = 1
    start: Optional[int] = None
    size: int = 1

    def __post_init__(self) -> None:
        if self.final:
            object.__setattr__(self, "count", 0)
            object.__setattr__(self, "start", 0)
            object.__setattr__(self, "size", 0)
        elif self.start is None:
            object.__setattr__(self, "start", self.chunk)

    @property
    def stop(self) -> int:
        """The position after the last one leased."""
        return (self.start or 0) + self.count * self.size

    @property
    def chunks(self) -> range:
        """The chunks leased (none in a final LEASE)."""
        return range(self.chunk, self.chunk + self.count)

    def encode(self) -> List[Buffer]:
        """The chunks of this LEASE frame."""
        return encode_lease(self.epoch, self.chunk, self.skip, self.count, self.final, self.start or 0, self.size)

    @classmethod
    def decode(cls, frame: Frame) -> "Lease":
        """Decode a LEASE frame."""
        return cls(*decode_lease(frame))


@dataclass(frozen=True)
class ChunkDone(Message):
    """Worker to trainer ("dynamic" epochs): the worker's oldest outstanding leases, from ``chunk``
    on in the order leased, are done with ``counts`` items each (one count per chunk: every chunk
    it finished since its previous CHUNK_DONE). The items are the ones DATA frames carried since
    the previous chunk's end, then the first ones of the DATA frames that follow (it is sent as
    soon as the last chunk's last item is packed, ahead of that item's frame, which may also hold
    the next chunk's first items). ``stream_length`` (positions) when the stream ended in the
    last of these chunks, else None."""

    kind: ClassVar[MessageKind] = MessageKind.CHUNK_DONE
    epoch: int
    chunk: int
    counts: Tuple[int, ...]
    stream_length: Optional[int] = None

    def encode(self) -> List[Buffer]:
        """The chunks of this CHUNK_DONE frame."""
        length = -1 if self.stream_length is None else self.stream_length
        return encode_chunk_done(self.epoch, self.chunk, self.counts, length)

    @classmethod
    def decode(cls, frame: Frame) -> "ChunkDone":
        """Decode a CHUNK_DONE frame."""
        epoch, chunk, counts, length = decode_chunk_done(frame)
        if length < -1:
            raise RemoteProtocolError(f"CHUNK_DONE frame has stream length {length}, expected -1 or more")
        return cls(epoch, chunk, counts, None if length < 0 else length)


MESSAGE_TYPES: Dict[MessageKind, Type[Message]] = {
    cls.kind: cls
    for cls in (
        Setup,
        Ready,
        StartEpoch,
        StopEpoch,
        SetupFailed,
        SetupRefused,
        ShardFailed,
        ItemTimedOut,
        Close,
        Leaving,
        Heartbeat,
        Credit,
        Data,
        EndOfShard,
        ItemCredit,
        Items,
        EndOfInput,
        Lease,
        ChunkDone,
    )
}


def decode_setup(frame: Frame) -> Union[Setup, Join]:
    """A SETUP frame's message: a session's :class:`Setup` (it has a graph) or a bootstrap :class:`Join`."""
    payload = decode_control(frame)
    return (Setup if "graph" in payload else Join)._from_payload(payload)  # type: ignore[return-value]


def decode_message(frame: Frame) -> Message:
    """The typed session message in ``frame`` (a handshake frame here is a remote error)."""
    cls = MESSAGE_TYPES.get(frame.kind)
    if cls is None:
        raise RemoteProtocolError(
            f"received a {frame.kind.name} frame after the handshake, which only the handshake uses"
        )
    return cls.decode(frame)


def resolve_field_types() -> None:
    """Resolve (and cache) the field types of every control message now (before forking sessions)."""
    classes, pending = [SessionOptions], list(_Control.__subclasses__())
    while pending:
        cls = pending.pop()
        classes.append(cls)
        pending.extend(cls.__subclasses__())
    for cls in classes:
        _field_types(cls)
