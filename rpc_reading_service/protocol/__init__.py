"""The wire protocol, sans I/O: bytes in, frames, typed messages and events out. No sockets here.

- :mod:`.frames`: the frame layout and codec (``encode_frame``, the
  binary DATA/CREDIT/END_OF_SHARD bodies, pickled control bodies); :mod:`.frame_reader`: the
  incremental parser of a byte stream into frames (``FrameReader``).
- :mod:`.handshake`: the mutual HMAC challenge-response before anything is unpickled.
- :mod:`.messages`: one typed, frozen class per session message, each with encode/decode.
- :mod:`.session`: the trainer's and the worker's state machines, where every rule about
  which message may come when lives.

The names the rest of the package imported from the former ``protocol`` module are
re-exported here unchanged.
"""

from .frame_reader import FrameReader
from .frames import (
    DEFAULT_MAX_FRAME_BYTES,
    HANDSHAKE_KINDS,
    HANDSHAKE_MAX_FRAME_BYTES,
    HEADER,
    MAGIC,
    MAX_LEASE_RUN,
    PROTOCOL_VERSION,
    Buffer,
    EncodedItem,
    Frame,
    MessageKind,
    data_header,
    DATA_HEAD,
    DATA_ITEM,
    data_nbytes,
    data_table_bytes,
    data_cost,
    DATA_FRAME_OVERHEAD,
    decode_control,
    decode_credit,
    decode_end_of_shard,
    encode_control,
    encode_credit,
    encode_data,
    encode_end_of_shard,
    encode_frame,
    lease_runs,
)
from .data_decode import decode_data, decode_data_parts
from .handshake import NONCE_BYTES, ClientHandshake, ServerHandshake, handshake_proof, decode_reject, encode_reject  # noqa: F401 - handshake_proof: tests forge proofs
from .messages import (
    MESSAGE_TYPES,
    ChunkDone,
    Close,
    Leaving,
    Credit,
    Data,
    EndOfInput,
    EndOfShard,
    ItemTimedOut,
    SetupFailed,
    SetupRefused,
    ShardFailed,
    Heartbeat,
    ItemCredit,
    Items,
    Join,
    Lease,
    Message,
    Ready,
    SessionOptions,
    credit_batch,
    Setup,
    StartEpoch,
    StopEpoch,
    decode_message,
    decode_setup,
)
from .credits import FRAMES_PAST_WINDOW, CreditWindow, window_bytes, window_frames, with_window
from .session import DataReceived, Event, PeerTimedOut, Refused, SessionState, Tick
from .roles import TrainerSession, WorkerProtocol

__all__ = [
    # frames
    "PROTOCOL_VERSION",
    "MAX_LEASE_RUN",
    "lease_runs",
    "MAGIC",
    "HEADER",
    "Buffer",
    "MessageKind",
    "HANDSHAKE_KINDS",
    "HANDSHAKE_MAX_FRAME_BYTES",
    "DEFAULT_MAX_FRAME_BYTES",
    "Frame",
    "FrameReader",
    "encode_frame",
    "encode_control",
    "decode_control",
    "encode_credit",
    "decode_credit",
    "EncodedItem",
    "encode_data",
    "decode_data",
    "decode_data_parts",
    "data_header",
    "DATA_HEAD",
    "DATA_ITEM",
    "data_nbytes",
    "data_table_bytes",
    "data_cost",
    "DATA_FRAME_OVERHEAD",
    "encode_end_of_shard",
    "decode_end_of_shard",
    # handshake
    "NONCE_BYTES",
    "ClientHandshake",
    "ServerHandshake",
    "encode_reject",
    "decode_reject",
    # messages
    "Message",
    "SessionOptions",
    "credit_batch",
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
    "Lease",
    "ChunkDone",
    "EndOfInput",
    "MESSAGE_TYPES",
    "decode_message",
    "decode_setup",
    # credits
    "CreditWindow",
    "FRAMES_PAST_WINDOW",
    "window_bytes",
    "window_frames",
    "with_window",
    # session state machines
    "SessionState",
    "Event",
    "DataReceived",
    "PeerTimedOut",
    "Refused",
    "Tick",
    "TrainerSession",
    "WorkerProtocol",
]
