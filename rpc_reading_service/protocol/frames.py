"""Frames: the byte layout of every message and its codec, sans I/O (the layout: docs/architecture.md)."""

from __future__ import annotations

import enum
import operator
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from ..errors import LocalProtocolError, RemoteProtocolError
from ..serialization import Buffer, EncodedItem
from ..version import __version__

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_LEASE_RUN",
    "lease_runs",
    "MAGIC",
    "HEADER",
    "Buffer",
    "MessageKind",
    "HANDSHAKE_KINDS",
    "TRANSPORT_KINDS",
    "SharedBuffer",
    "SharedFrame",
    "placed_body",
    "split_frame",
    "encode_shared_data",
    "decode_shared_data",
    "Frame",
    "header_kind",
    "encode_frame",
    "buffers_nbytes",
    "encode_control",
    "decode_control",
    "encode_credit",
    "decode_credit",
    "EncodedItem",
    "encode_data",
    "data_header",
    "DATA_HEAD",
    "DATA_ITEM",
    "data_nbytes",
    "data_cost",
    "DATA_FRAME_OVERHEAD",
    "encode_end_of_shard",
    "decode_end_of_shard",
    "HANDSHAKE_MAX_FRAME_BYTES",
    "DEFAULT_MAX_FRAME_BYTES",
]

#: 2: a LEASE grants a run of consecutive chunks, a CHUNK_DONE reports several chunks' item counts.
#: 3: a LEASE gives its chunks' positions (first position and size: chunks may differ in size).
#: 4: a worker may say LEAVING (its server drains) and end the session.
#: 5: a message per failure (SETUP_FAILED, SETUP_REFUSED, SHARD_FAILED, ITEM_TIMED_OUT) replaces ERROR.
#: 6: DATA credit counts bytes (START_EPOCH's window and CREDIT; a frame goes while any is left), a u64 in CREDIT.
#: 7: an item's tensor carries its dtype by name (``"float32"``), not as a pickled ``torch`` global.
#: 8: a SHARED_DATA frame may place its DATA frame's body in a segment (a last entry of index n_buffers).
PROTOCOL_VERSION = 8
MAGIC = b"RRSV"
HEADER = struct.Struct("!4sBBHQ")
BUFFER_LENGTH = struct.Struct("!Q")
MAX_BUFFERS_PER_FRAME = 4096
HANDSHAKE_MAX_FRAME_BYTES = 4096
DEFAULT_MAX_FRAME_BYTES = 1 << 31


class MessageKind(enum.IntEnum):
    """The type byte of a frame."""

    # An int's hash (Enum's hashes the name in Python): kinds are looked up per frame.
    __hash__ = int.__hash__

    # Handshake: raw bytes, allowed before authentication.
    HELLO = 1
    CHALLENGE = 2
    PROOF = 3
    WELCOME = 4
    REJECT = 5
    # Session control: pickled dicts, only after authentication.
    SETUP = 10
    READY = 11
    START_EPOCH = 12
    STOP_EPOCH = 13
    SETUP_FAILED = 14  # ERROR, of every failure, until protocol version 4
    CLOSE = 15
    LEAVING = 16
    SETUP_REFUSED = 17
    SHARD_FAILED = 18
    ITEM_TIMED_OUT = 19
    # Streaming: compact binary.
    CREDIT = 20
    DATA = 21
    END_OF_SHARD = 22
    HEARTBEAT = 23
    # Trainer to worker, for dispatched items (the twins of CREDIT, DATA, END_OF_SHARD).
    ITEM_CREDIT = 24
    ITEMS = 25
    END_OF_INPUT = 26
    # "dynamic" distribution: chunks of the stream leased to a worker, and reported done.
    LEASE = 27
    CHUNK_DONE = 28
    # Transport-level, on Unix sockets only: the transport consumes them, a session never sees them.
    SHARED_MEMORY_OFFER = 40
    SHARED_DATA = 41


HANDSHAKE_KINDS = frozenset(
    {MessageKind.HELLO, MessageKind.CHALLENGE, MessageKind.PROOF, MessageKind.WELCOME, MessageKind.REJECT}
)
#: Kinds a transport sends and consumes itself (shared-memory hand-over); never a session's.
TRANSPORT_KINDS = frozenset({MessageKind.SHARED_MEMORY_OFFER, MessageKind.SHARED_DATA})
#: The kind of each type byte (a dict lookup by int: ``MessageKind(kind)`` costs a Python call).
_KINDS: Dict[int, MessageKind] = {int(k): k for k in MessageKind}


def header_kind(magic: bytes, version: int, kind: int) -> MessageKind:
    """The kind of a frame whose header holds ``magic``, ``version`` and ``kind``; a
    RemoteProtocolError saying what the peer is when it is no frame of this protocol version."""
    if magic != MAGIC:
        raise RemoteProtocolError(
            f"not an rpc_reading_service frame (magic {bytes(magic)!r}, expected {MAGIC!r}): "
            "the other end is not rpc_reading_service (a wrong port, or another service on it?)"
        )
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"protocol version mismatch: the peer speaks rpc_reading_service protocol version {version}, "
            f"this process (rpc_reading_service {__version__}) speaks version {PROTOCOL_VERSION}. Install "
            "the same rpc_reading_service version on the trainer and on every worker"
        )
    known = _KINDS.get(kind)
    if known is None:
        raise RemoteProtocolError(f"unknown message kind {kind}")
    return known


@dataclass
class Frame:
    """One decoded frame: its kind, its body and its out-of-band buffers."""

    kind: MessageKind
    body: Buffer
    buffers: List[Buffer] = field(default_factory=list)
    #: :attr:`nbytes` as the receiver counted it (None: counted when asked, a loop over the buffers).
    size: Optional[int] = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes this frame occupies in memory (body plus buffers)."""
        if self.size is not None:
            return self.size
        buffers = self.buffers
        return len(self.body) + buffers_nbytes(buffers) if buffers else len(self.body)


def buffers_nbytes(buffers: Sequence[Buffer]) -> int:
    """The bytes of ``buffers`` (a plain loop: no call per buffer).

    Args:
        buffers: Buffers of any format.
    """
    nbytes = 0
    for buffer in buffers:
        nbytes += memoryview(buffer).nbytes
    return nbytes


def encode_frame(kind: MessageKind, body: Sequence[Buffer] = (), buffers: Sequence[Buffer] = ()) -> List[Buffer]:
    """Return the chunks of one frame, ready for a scatter/gather send (``socket.sendmsg``).

    ``body`` is a sequence of chunks that together make the body; nothing is copied.
    """
    if len(buffers) > MAX_BUFFERS_PER_FRAME:
        raise LocalProtocolError(f"a frame may carry at most {MAX_BUFFERS_PER_FRAME} out-of-band buffers, got {len(buffers)}")
    chunks: List[Buffer] = [b""]  # the head, once the lengths are known
    body_length = 0
    for part in body:  # plain loops: no call per part (a frame is encoded for every item or few)
        nbytes = memoryview(part).nbytes
        if nbytes:
            body_length += nbytes
            chunks.append(part)
    head = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(kind), len(buffers), body_length)
    if buffers:
        lengths = []
        for buffer in buffers:
            nbytes = memoryview(buffer).nbytes
            lengths.append(nbytes)
            if nbytes:
                chunks.append(buffer)
        head += struct.pack(f"!{len(lengths)}Q", *lengths)
    chunks[0] = head
    return chunks


# -- control messages (pickled dicts, after authentication only) -------------------------------
def encode_control(kind: MessageKind, payload: Optional[Dict[str, Any]] = None) -> List[Buffer]:
    """Encode a session-control message whose payload is a dict of plain Python values."""
    body = pickle.dumps(payload or {}, protocol=pickle.HIGHEST_PROTOCOL)
    return encode_frame(kind, [body])


def decode_control(frame: Frame) -> Dict[str, Any]:
    """Decode a control message. Only call on an authenticated connection."""
    if not frame.body:
        return {}
    try:
        payload = pickle.loads(frame.body)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a protocol violation
        raise RemoteProtocolError(f"could not decode {frame.kind.name} message: {exc!r}") from exc
    if not isinstance(payload, dict):
        raise RemoteProtocolError(f"{frame.kind.name} message is not a dict but {type(payload).__name__}")
    return payload


_CREDIT = struct.Struct("!IQ")


def _pack(layout: struct.Struct, kind: MessageKind, *values: int) -> bytes:
    try:
        return layout.pack(*values)
    except struct.error as exc:
        raise LocalProtocolError(f"cannot encode {kind.name} {values}: {exc} (a value is negative or too large)") from exc


def encode_credit(epoch: int, credits: int, kind: MessageKind = MessageKind.CREDIT) -> List[Buffer]:
    """Encode a grant of ``credits`` more bytes of DATA frames (ITEMS frames for ITEM_CREDIT) for ``epoch``."""
    return encode_frame(kind, [_pack(_CREDIT, kind, epoch, credits)])


def decode_credit(frame: Frame) -> Tuple[int, int]:
    """Decode a CREDIT (or ITEM_CREDIT) frame into ``(epoch, credits)``."""
    return _unpack(_CREDIT, frame)


def _unpack(layout: struct.Struct, frame: Frame) -> Tuple[int, ...]:
    """The values of a frame whose body is exactly ``layout``."""
    if len(frame.body) != layout.size:
        raise RemoteProtocolError(f"{frame.kind.name} frame body has {len(frame.body)} bytes, expected {layout.size}")
    return layout.unpack(frame.body)


# -- DATA frames: many items packed into one frame ---------------------------------------------
_DATA_HEAD = struct.Struct("!IQI")
_DATA_ITEM = struct.Struct("!QI")
#: A DATA frame's head (epoch, sequence, item count) and its table's row per item (payload bytes,
#: buffers), for its decoder (:mod:`.data_decode`).
DATA_HEAD, DATA_ITEM = _DATA_HEAD, _DATA_ITEM
_NBYTES = operator.attrgetter("nbytes")


def encode_data(epoch: int, sequence: int, items: Sequence[EncodedItem]) -> Tuple[List[Buffer], List[Buffer]]:
    """Pack ``items`` into one DATA (or ITEMS) frame: ``(body_chunks, buffers)`` for :func:`encode_frame`
    (``sequence`` numbers an epoch's frames from 0: the receiver checks that nothing was lost)."""
    try:  # packed inline (no call per frame); _pack names a value out of range
        table = bytearray(_DATA_HEAD.pack(epoch, sequence, len(items)))
    except struct.error:
        table = bytearray(_pack(_DATA_HEAD, MessageKind.DATA, epoch, sequence, len(items)))
    body: List[Buffer] = [table]
    buffers: List[Buffer] = []
    for item in items:
        table += _DATA_ITEM.pack(len(item.payload), len(item.buffers))
        body.append(item.payload)
        buffers.extend(item.buffers)
    return body, buffers


#: What a DATA frame costs of the trainer's credit beyond its bytes: its objects there, and a bound
#: on the frames one window holds (a window of 4 MiB: at most 1,024 frames of tiny items).
DATA_FRAME_OVERHEAD = 4096


def data_cost(nbytes: int) -> int:
    """The credit a DATA frame of ``nbytes`` (its body and buffers, ``Frame.nbytes``) costs."""
    return nbytes + DATA_FRAME_OVERHEAD


def data_table_bytes(items: int) -> int:
    """Bytes a DATA frame of ``items`` items adds to theirs: its header and the items' table."""
    return _DATA_HEAD.size + _DATA_ITEM.size * items


def data_nbytes(items: Sequence[EncodedItem]) -> int:
    """Bytes of the body and buffers of a DATA frame packing ``items`` (its ``Frame.nbytes``)."""
    return data_table_bytes(len(items)) + sum(map(_NBYTES, items))


def data_header(frame: Frame) -> Tuple[int, int, int]:
    """``(epoch, sequence, item count)`` of a DATA (or ITEMS) frame, from its header alone."""
    if len(frame.body) < _DATA_HEAD.size:
        raise RemoteProtocolError(f"{frame.kind.name} frame too short for its header")
    return _DATA_HEAD.unpack_from(frame.body)


_EPOCH_MARK = struct.Struct("!IQ")


def encode_end_of_shard(epoch: int, items_sent: int, kind: MessageKind = MessageKind.END_OF_SHARD) -> List[Buffer]:
    """Encode the end of a worker's shard (of the dispatched input for END_OF_INPUT) for
    ``epoch`` after ``items_sent`` items."""
    return encode_frame(kind, [_pack(_EPOCH_MARK, kind, epoch, items_sent)])


def decode_end_of_shard(frame: Frame) -> Tuple[int, int]:
    """Decode an END_OF_SHARD (or END_OF_INPUT) frame into ``(epoch, items_sent)``."""
    return _unpack(_EPOCH_MARK, frame)


# -- shared-memory hand-over (transport-level, Unix sockets only) -------------------------------
# A trainer that can map shared memory says so with SHARED_MEMORY_OFFER (empty body) right
# after the handshake. From then on, the worker may send a frame whose large buffers it put
# in shared memory segments as a SHARED_DATA frame instead::
#
#     body     inner_kind(1) n_buffers(2) n_new(2) n_retired(2) n_shared(2)       9 bytes
#              n_new     x segment(4) size(8)         segments whose descriptors come with
#                                                     this frame (SCM_RIGHTS), in this order
#              n_retired x segment(4)                 segments the worker closed: forget them
#              n_shared  x index(2) segment(4) offset(8) length(8)
#              the inner frame's body (empty when a segment holds it)
#     buffers  the inner frame's other buffers (those not shared), in order
#
# Rules: the inner kind is DATA; shared indexes ascend, each below n_buffers, and the
# shared plus the inline buffers are exactly n_buffers, but for one last entry of index
# n_buffers: the inner frame's body, then not in this frame; a shared buffer lies inside its
# segment. The receiver rebuilds the inner frame with the shared buffers (and body) on its
# mapping of each segment. Which segments are free again is not a message: the first byte of each
# segment says it (see transports/socket_transport/shared_memory.py).
_SHARED_HEAD = struct.Struct("!BHHHH")
_SHARED_NEW = struct.Struct("!IQ")
_SHARED_RETIRED = struct.Struct("!I")
_SHARED_BUFFER = struct.Struct("!HIQQ")


class SharedBuffer(NamedTuple):
    """Buffer ``index`` of a frame, ``length`` bytes at ``offset`` of shared segment ``segment``
    (a named tuple: one or more per frame of large items, made and read on the hot path)."""

    index: int
    segment: int
    offset: int
    length: int


def placed_body(shared: Sequence[SharedBuffer], n_buffers: int) -> Optional[SharedBuffer]:
    """The entry of ``shared`` that places a DATA frame's body in a segment (the last one, of index
    ``n_buffers``), if any."""
    return shared[-1] if shared and shared[-1].index == n_buffers else None


@dataclass
class SharedFrame:
    """A decoded SHARED_DATA frame: the inner frame's kind, body and inline buffers, and
    where its shared buffers are."""

    kind: MessageKind
    n_buffers: int
    new_segments: List[Tuple[int, int]]  # (segment, size), one received descriptor each
    retired: List[int]
    shared: List[SharedBuffer]
    body: Buffer
    inline: List[Buffer]
    #: Where the inner frame's body is, when a segment holds it (``body`` is then empty).
    body_placed: Optional[SharedBuffer] = None

    @property
    def shared_bytes(self) -> int:
        """Bytes of the inner frame that are in shared memory."""
        placed = self.body_placed.length if self.body_placed is not None else 0
        return sum(b.length for b in self.shared) + placed

    @property
    def placed_segments(self) -> Set[int]:
        """The segments that hold this frame's shared buffers (and body)."""
        placed = {b.segment for b in self.shared}
        if self.body_placed is not None:
            placed.add(self.body_placed.segment)
        return placed


def split_frame(chunks: Sequence[Buffer]) -> Tuple[MessageKind, List[Buffer], List[Buffer]]:
    """Take apart the chunks :func:`encode_frame` made: ``(kind, body chunks, buffers)``,
    zero-length buffers included (they have no chunk)."""
    head = memoryview(chunks[0]).cast("B")
    _magic, _version, kind, n_buffers, _body_length = HEADER.unpack_from(head)
    lengths = struct.unpack_from(f"!{n_buffers}Q", head, HEADER.size) if n_buffers else ()
    split = len(chunks) - (len(lengths) - lengths.count(0))  # where the buffers' chunks start
    body, sent = list(chunks[1:split]), list(chunks[split:])
    if len(sent) == len(lengths):  # no empty buffer: the chunks are the buffers
        return _KINDS[kind], body, sent
    buffers: List[Buffer] = []
    taken = 0
    for length in lengths:
        if length:
            buffers.append(sent[taken])
            taken += 1
        else:
            buffers.append(b"")
    return _KINDS[kind], body, buffers


def encode_shared_data(
    kind: MessageKind,
    body: Sequence[Buffer],
    n_buffers: int,
    shared: Sequence[SharedBuffer],
    inline: Sequence[Buffer],
    new_segments: Sequence[Tuple[int, int]] = (),
    retired: Sequence[int] = (),
) -> List[Buffer]:
    """Encode a frame of ``kind`` (body chunks ``body``, ``n_buffers`` buffers) whose
    ``shared`` buffers are in shared memory and whose others, ``inline``, travel with it; a last
    shared entry of index ``n_buffers`` places the body (``body`` then empty)."""
    if kind != MessageKind.DATA:
        raise LocalProtocolError(f"only DATA frames hand buffers over in shared memory, not {kind.name}")
    if placed_body(shared, n_buffers) is not None:
        if any(memoryview(chunk).nbytes for chunk in body):
            raise LocalProtocolError("a DATA frame whose body is in a segment sends no body too")
        shared, placed = shared[:-1], shared[-1:]
    else:
        placed = []
    if len(shared) + len(inline) != n_buffers:
        raise LocalProtocolError(f"{len(shared)} shared and {len(inline)} inline buffers are not the frame's {n_buffers}")
    parts = [_pack(_SHARED_HEAD, kind, int(kind), n_buffers, len(new_segments), len(retired), len(shared) + len(placed))]
    for segment, size in new_segments:
        parts.append(_pack(_SHARED_NEW, MessageKind.SHARED_DATA, segment, size))
    for segment in retired:
        parts.append(_pack(_SHARED_RETIRED, MessageKind.SHARED_DATA, segment))
    for index, segment, offset, length in [*shared, *placed]:  # checked by the pool: no call per buffer
        parts.append(_SHARED_BUFFER.pack(index, segment, offset, length))
    return encode_frame(MessageKind.SHARED_DATA, [b"".join(parts), *body], inline)


def decode_shared_data(frame: Frame) -> SharedFrame:
    """Decode a SHARED_DATA frame (checking its rules; not yet whether its segments exist)."""
    body = memoryview(frame.body).cast("B")
    if len(body) < _SHARED_HEAD.size:
        raise RemoteProtocolError("SHARED_DATA frame too short for its header")
    kind, n_buffers, n_new, n_retired, n_shared = _SHARED_HEAD.unpack_from(body)
    if kind != MessageKind.DATA:
        raise RemoteProtocolError(f"SHARED_DATA frame wraps kind {kind}: only DATA frames hand buffers over in shared memory")
    end = _SHARED_HEAD.size + n_new * _SHARED_NEW.size + n_retired * _SHARED_RETIRED.size + n_shared * _SHARED_BUFFER.size
    if end > len(body):
        raise RemoteProtocolError("SHARED_DATA frame too short for its tables")
    offset = _SHARED_HEAD.size
    new = list(_SHARED_NEW.iter_unpack(body[offset : offset + n_new * _SHARED_NEW.size]))
    offset += n_new * _SHARED_NEW.size
    retired = [segment for (segment,) in _SHARED_RETIRED.iter_unpack(body[offset : offset + n_retired * _SHARED_RETIRED.size])]
    offset += n_retired * _SHARED_RETIRED.size
    shared = list(map(SharedBuffer._make, _SHARED_BUFFER.iter_unpack(body[offset:end])))
    body_placed = placed_body(shared, n_buffers)
    if body_placed is not None:
        shared.pop()
        if len(body) > end:
            raise RemoteProtocolError("SHARED_DATA frame places its body in a segment and sends a body too")
    last = -1
    for placed in shared:
        if placed.index <= last or placed.index >= n_buffers:
            indexes = [b.index for b in shared]
            raise RemoteProtocolError(f"SHARED_DATA frame's shared buffer indexes {indexes} do not ascend below {n_buffers}")
        last = placed.index
    if len(shared) + len(frame.buffers) != n_buffers:
        raise RemoteProtocolError(
            f"SHARED_DATA frame has {len(shared)} shared and {len(frame.buffers)} inline buffers, not {n_buffers}"
        )
    return SharedFrame(MessageKind.DATA, n_buffers, new, retired, shared, body[end:], list(frame.buffers), body_placed)
# -- LEASE / CHUNK_DONE: the chunks of a "dynamic" epoch ------------------------------------------
_LEASE = struct.Struct("!IQQIBQI")
_CHUNK_DONE_HEAD = struct.Struct("!IQqI")
_CHUNK_COUNT = struct.Struct("!Q")
#: Most chunks one LEASE may grant (the trainer leases a worker at most ``MAX_CHUNK_DEPTH`` at once).
MAX_LEASE_RUN = 4096


def encode_lease(epoch: int, chunk: int, skip: int, count: int, final: bool, start: int, size: int) -> List[Buffer]:
    """Encode the lease of the ``count`` consecutive chunks from ``chunk`` of ``epoch``, of ``size``
    positions each from position ``start`` on (the first ``skip`` items of the first one are not
    to be sent); ``final``: no more leases this epoch (``count``, ``start`` and ``size`` are then 0)."""
    kind = MessageKind.LEASE
    return encode_frame(kind, [_pack(_LEASE, kind, epoch, chunk, skip, count, int(final), start, size)])


def lease_runs(chunks: Sequence[Tuple[int, int, int, int]]) -> List[Tuple[int, int, int, int, int]]:
    """Leases ``(chunk, skip, first position, positions)`` as runs, one LEASE each.

    Returns:
        ``(first chunk, skip, count, first position, positions each)`` per run.
    """
    runs: List[List[int]] = []
    for chunk, skip, start, size in chunks:
        if runs:
            first, _skip, count, run_start, run_size = runs[-1]
            if (
                not skip and chunk == first + count and size == run_size and start == run_start + count * size
                and count < MAX_LEASE_RUN
            ):  # fmt: skip
                runs[-1][2] += 1
                continue
        runs.append([chunk, skip, 1, start, size])
    return [(chunk, skip, count, start, size) for chunk, skip, count, start, size in runs]


def decode_lease(frame: Frame) -> Tuple[int, int, int, bool, int, int, int]:
    """Decode a LEASE frame into ``(epoch, chunk, skip, final, count, start, size)``."""
    epoch, chunk, skip, count, final, start, size = _unpack(_LEASE, frame)
    if final not in (0, 1):
        raise RemoteProtocolError(f"{frame.kind.name} frame has final flag {final}, expected 0 or 1")
    if final and (count or start or size):
        raise RemoteProtocolError(
            f"final {frame.kind.name} frame leases {count} chunks of {size} positions from {start}, expected 0"
        )
    if not final and not 1 <= count <= MAX_LEASE_RUN:
        raise RemoteProtocolError(f"{frame.kind.name} frame leases {count} chunks, expected 1 to {MAX_LEASE_RUN}")
    if not final and (size < 1 or start + count * size >= 2**64):
        raise RemoteProtocolError(
            f"{frame.kind.name} frame leases {count} chunks of {size} positions from position {start}: expected "
            "chunks of at least 1 position within 64 bits"
        )
    return epoch, chunk, skip, bool(final), count, start, size


def encode_chunk_done(epoch: int, chunk: int, counts: Sequence[int], stream_length: int) -> List[Buffer]:
    """Encode that the leases of ``epoch`` from ``chunk`` on (the worker's next ones, in the order
    leased) are done with ``counts`` items each; ``stream_length`` is the stream's length in
    positions when it ended in the last of them, else -1."""
    kind = MessageKind.CHUNK_DONE
    head = _pack(_CHUNK_DONE_HEAD, kind, epoch, chunk, stream_length, len(counts))
    try:
        body = struct.pack(f"!{len(counts)}Q", *counts)
    except struct.error as exc:
        raise LocalProtocolError(f"cannot encode {kind.name} counts {list(counts)}: {exc}") from exc
    return encode_frame(kind, [head, body])


def decode_chunk_done(frame: Frame) -> Tuple[int, int, Tuple[int, ...], int]:
    """Decode a CHUNK_DONE frame into ``(epoch, chunk, counts, stream_length)``."""
    body = frame.body
    if len(body) < _CHUNK_DONE_HEAD.size:
        raise RemoteProtocolError(f"{frame.kind.name} frame body has {len(body)} bytes, expected at least {_CHUNK_DONE_HEAD.size}")
    epoch, chunk, length, n = _CHUNK_DONE_HEAD.unpack_from(body)
    expected = _CHUNK_DONE_HEAD.size + n * _CHUNK_COUNT.size
    if n < 1 or len(body) != expected:
        raise RemoteProtocolError(
            f"{frame.kind.name} frame reports {n} chunks in a body of {len(body)} bytes, expected at least 1 chunk "
            f"and {expected} bytes"
        )
    return epoch, chunk, struct.unpack_from(f"!{n}Q", body, _CHUNK_DONE_HEAD.size), length
