"""Frames as torch RPC calls: a frame split into RPC arguments, checked and rebuilt on delivery,
and each connection's inbox, which restores the send order (RPC handlers may run out of order)."""

from __future__ import annotations

import collections
import struct
import threading
import time
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ...errors import FrameTooLargeError, LocalProtocolError, ProtocolError, RemoteProtocolError
from ...protocol import HEADER, Buffer, Frame
from ...protocol.frames import header_kind
from ..base import Allocator

TRANSPORT_NAME = "torch_rpc"
#: Bootstrap protocol of this transport (inside SETUP/READY/SETUP_REFUSED control frames).
BOOTSTRAP_VERSION = 1
#: Bodies at least this large travel as a tensor (outside the RPC pickle stream).
_TENSOR_BODY_MIN_BYTES = 64 * 1024
_LENGTH = struct.Struct("!Q")

TensorOrBytes = Union[bytes, torch.Tensor]


class _ChunkCursor:
    """Reads a frame's chunks (``protocol.encode_frame`` output) as one byte stream."""

    def __init__(self, chunks: Sequence[Buffer]):
        self._views: Deque[memoryview] = collections.deque()
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if view.nbytes:
                self._views.append(view)

    def parts(self, nbytes: int) -> List[memoryview]:
        """The next ``nbytes`` bytes, as views of the caller's memory."""
        parts = []
        while nbytes:
            if not self._views:
                raise LocalProtocolError("frame chunks are shorter than the frame header announces")
            view = self._views[0]
            if view.nbytes <= nbytes:
                parts.append(self._views.popleft())
                nbytes -= view.nbytes
            else:
                parts.append(view[:nbytes])
                self._views[0] = view[nbytes:]
                nbytes = 0
        return parts

    def take_bytes(self, nbytes: int) -> bytes:
        return b"".join(self.parts(nbytes))

    def take_tensor(self, nbytes: int) -> torch.Tensor:
        """Copy the next ``nbytes`` into a fresh uint8 CPU tensor (the caller may reuse its memory)."""
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            target = memoryview(tensor.numpy()).cast("B")
            offset = 0
            for part in self.parts(nbytes):
                target[offset : offset + part.nbytes] = part
                offset += part.nbytes
        return tensor

    @property
    def exhausted(self) -> bool:
        return not self._views


def split_rpc_frame(chunks: Sequence[Buffer]) -> Tuple[bytes, TensorOrBytes, List[torch.Tensor]]:
    """Turn an encoded frame into ``(header_and_lengths, body, buffers)`` for an RPC call."""
    cursor = _ChunkCursor(chunks)
    head = cursor.take_bytes(HEADER.size)
    _magic, _version, _kind, n_buffers, body_length = HEADER.unpack(head)
    lengths_raw = cursor.take_bytes(_LENGTH.size * n_buffers)
    lengths = struct.unpack(f"!{n_buffers}Q", lengths_raw) if n_buffers else ()
    body: TensorOrBytes
    if body_length >= _TENSOR_BODY_MIN_BYTES:
        body = cursor.take_tensor(body_length)
    else:
        body = cursor.take_bytes(body_length)
    buffers = [cursor.take_tensor(length) for length in lengths]
    if not cursor.exhausted:
        raise LocalProtocolError("frame chunks are longer than the frame header announces")
    return head + lengths_raw, body, buffers


def _memory_of(tensor: torch.Tensor, allocate: Optional[Allocator]) -> Buffer:
    """Writable memory holding a received uint8 tensor's bytes (no copy without ``allocate``)."""
    view = memoryview(tensor.contiguous().numpy()).cast("B")
    if allocate is None or allocate is bytearray:  # the tensor's own memory is as good
        return view
    target = allocate(view.nbytes)
    memoryview(target).cast("B")[:] = view
    return target


def _join_frame(
    head: bytes,
    body: TensorOrBytes,
    buffers: Sequence[torch.Tensor],
    max_frame_bytes: int,
    allocate: Optional[Allocator],
) -> Frame:
    """Check a delivered frame against its header and rebuild it (the inverse of :func:`split_rpc_frame`)."""
    if not isinstance(head, bytes) or len(head) < HEADER.size:
        raise RemoteProtocolError("torch_rpc frame without a valid header")
    magic, version, kind, n_buffers, body_length = HEADER.unpack_from(head)
    kind = header_kind(magic, version, kind)
    if len(head) != HEADER.size + _LENGTH.size * n_buffers or len(buffers) != n_buffers:
        raise RemoteProtocolError(f"{kind.name} frame: header announces {n_buffers} buffers, got {len(buffers)}")
    lengths = struct.unpack_from(f"!{n_buffers}Q", head, HEADER.size) if n_buffers else ()
    body_bytes = body.numel() if isinstance(body, torch.Tensor) else len(body)
    if body_bytes != body_length or any(
        not isinstance(b, torch.Tensor) or b.dtype != torch.uint8 or b.numel() != n for b, n in zip(buffers, lengths)
    ):
        raise RemoteProtocolError(f"{kind.name} frame does not match the sizes its header announces")
    total = body_length + sum(lengths)
    if total > max_frame_bytes:
        raise FrameTooLargeError(
            f"peer sent a {kind.name} frame of {total} bytes, over the maximum of {max_frame_bytes} bytes "
            "(torch RPC delivers whole messages, so it was dropped after receipt)"
        )
    body_memory: Buffer = _memory_of(body, None) if isinstance(body, torch.Tensor) else body
    return Frame(kind, body_memory, [_memory_of(b, allocate) for b in buffers])


class RPCInbox:
    """Frames delivered to one connection, handed out in send order."""

    def __init__(self, max_frame_bytes: int, allocate: Optional[Allocator] = None):
        self.max_frame_bytes = max_frame_bytes
        self.allocate = allocate
        self._cond = threading.Condition()
        self._expected = 0
        self._early: Dict[int, Frame] = {}
        self._ready: Deque[Frame] = collections.deque()
        self._error: Optional[BaseException] = None

    def put(self, seq: int, frame: Frame) -> None:
        """File frame number ``seq``; frames are handed on in sequence order, duplicates dropped."""
        with self._cond:
            if seq < self._expected or seq in self._early:
                return  # a duplicate: cannot happen with TensorPipe, but never deliver twice
            self._early[seq] = frame
            while self._expected in self._early:
                self._ready.append(self._early.pop(self._expected))
                self._expected += 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Report ``error`` from ``get`` once the frames already in order are taken (first error wins)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    @property
    def failed(self) -> bool:
        """True once the connection failed (:meth:`get` raises its error)."""
        return self._error is not None

    def get(self, timeout: Optional[float]) -> Optional[Frame]:
        """The next frame in order, waiting up to ``timeout`` (None: no frame came in time)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._ready:
                    return self._ready.popleft()
                if self._error is not None:
                    raise self._error
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)


# Every connection of this process, by the id both ends agreed on in the bootstrap.
inboxes: Dict[str, RPCInbox] = {}


def deliver(conn_id: str, seq: int, head: bytes, body: TensorOrBytes, buffers: List[torch.Tensor]) -> bool:
    """The RPC target: runs on the receiver's RPC thread pool; never blocks, never raises."""
    inbox = inboxes.get(conn_id)
    if inbox is None:
        return False  # the connection is closed (or never existed here)
    try:
        frame = _join_frame(head, body, buffers, inbox.max_frame_bytes, inbox.allocate)
    except ProtocolError as exc:
        inbox.fail(exc)
        return False
    except Exception as exc:  # noqa: BLE001 - never let a handler error travel back as a remote exception
        inbox.fail(RemoteProtocolError(f"could not rebuild a delivered frame: {exc!r}"))
        return False
    inbox.put(seq, frame)
    return True
