"""The socket transport's connection over a Unix socket between processes of one host, which
hands large buffers over in shared memory."""

from __future__ import annotations

import array
import collections
import contextlib
import os
import socket
import time
from typing import List, Optional, Sequence, Tuple

from ...errors import RemoteProtocolError
from ...protocol import HEADER, Buffer, Frame, FrameReader, MessageKind
from ...protocol.frames import (
    TRANSPORT_KINDS, SharedBuffer, decode_shared_data, encode_shared_data, placed_body, split_frame,
)
from ...serialization import SHARED_MEMORY_MIN_BYTES
from ..base import PeerLostError
from .segment_map import SegmentMap
from .shared_memory import MAX_NEW_SEGMENTS_PER_FRAME, SegmentPool, copy_into_segment
from .connection import SocketConnection
from .sockets import descriptor_limit, send_chunks

__all__ = ["SharedMemoryConnection"]

#: As plain ints: ``flags & socket.MSG_CTRUNC`` is an enum operation, a Python call per receive.
_MSG_CTRUNC, _MSG_DONTWAIT = int(socket.MSG_CTRUNC), int(socket.MSG_DONTWAIT)
_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_NEW_SEGMENTS_PER_FRAME * array.array("i").itemsize) if hasattr(socket, "CMSG_SPACE") else 0


def _open_files() -> str:
    """This process's open descriptors against its soft limit, as text for an error."""
    try:
        count = str(len(os.listdir("/proc/self/fd")))
    except OSError:
        count = "?"
    return f"{count} open, soft limit {descriptor_limit()}"


class SharedMemoryConnection(SocketConnection):
    """A :class:`SocketConnection` over a Unix socket that hands large buffers over in
    shared memory (see :mod:`.shared_memory`).

    The trainer's end (``offered``) said SHARED_MEMORY_OFFER after the handshake; it
    receives the descriptors of new segments with the bytes (``recvmsg``) and turns every
    SHARED_DATA frame back into the DATA frame it wraps. The worker's end (``lend``) puts
    the large buffers of its DATA frames in segments once the trainer offered, and lets
    the graph make its items in them (``rpc_reading_service.shared_empty``). Transport
    frames never reach the session above. ``pin``: the trainer page-locks each segment it maps
    (``pin_memory`` with CUDA; see :class:`.shared_memory.SegmentMap`).
    """

    # A local worker's large buffers go into shared segments as they are encoded (the segment
    # pool decides where each one goes): they are not sent from the producer's own memory.
    sends_synchronously = False
    stage_min_bytes = SHARED_MEMORY_MIN_BYTES

    def __init__(
        self, sock: socket.socket, peer: str, reader: FrameReader, offered: bool = False, lend: bool = False,
        pin: bool = False,
    ):  # fmt: skip
        super().__init__(sock, peer, reader)
        self._lend = lend
        self._accepted_in = os.getpid()
        self._pool: Optional[SegmentPool] = None
        self._segments: Optional[SegmentMap] = SegmentMap(peer, pin) if offered else None
        self._fds: "collections.deque[int]" = collections.deque()
        self._bound: Optional[Tuple[int, int]] = None  # bound_buffers' arguments, for a pool made later

    # A large buffer goes into a segment of this process's session as it is encoded: the function
    # itself, one call per buffer (no method around it).
    stage_buffer = staticmethod(copy_into_segment)  # type: ignore[assignment]

    @property
    def shared_segments(self) -> int:
        """Shared segments this end holds (the worker's pool, or the trainer's mappings)."""
        if self._pool is not None:
            return self._pool.segments
        return self._segments.segments if self._segments is not None else 0

    def bound_buffers(self, frames: int, frame_bytes: int) -> None:
        super().bound_buffers(frames, frame_bytes)
        self._bound = (frames, frame_bytes)
        if self._pool is not None:
            self._pool.bound(frames, frame_bytes)
        if self._segments is not None:
            self._segments.bound(frames, frame_bytes)

    def _to_lend(self, chunks: Sequence[Buffer]) -> Optional[int]:
        """The bytes of this frame's body if its buffers or body may go into shared segments (a DATA
        frame with buffers or a body of :data:`SHARED_MEMORY_MIN_BYTES` or more, once offered), else None."""
        _magic, _version, kind, n_buffers, length = HEADER.unpack_from(memoryview(chunks[0]))
        lends = self._pool is not None and kind == MessageKind.DATA and (n_buffers > 0 or length >= SHARED_MEMORY_MIN_BYTES)
        return length if lends else None

    def send_frames(self, frames: Sequence[Sequence[Buffer]]) -> None:
        """One ``sendmsg`` for the frames, their large buffers lent in shared segments (a
        ``sendmsg`` per :data:`MAX_NEW_SEGMENTS_PER_FRAME` descriptors of new segments, which
        is what the trainer takes in with one receive)."""
        pool = self._pool
        lends = []
        if pool is not None:
            for chunks in frames:  # a plain loop: no call per frame but its check, made once
                lends.append(self._to_lend(chunks))
        if lends.count(None) == len(lends):
            return super().send_frames(frames)
        with self._send_lock:
            if self._closed:
                raise PeerLostError(f"connection to {self.peer} is closed")
            pending: List[Buffer] = []
            new_segments: List[Tuple[int, int, int]] = []
            try:
                for chunks, lend in zip(frames, lends):
                    if lend is not None:
                        shared, inline, new, retired, body, n_buffers = self._lend_frame(pool, chunks, lend)
                        if new and len(new_segments) + len(new) > MAX_NEW_SEGMENTS_PER_FRAME:
                            self._send_lent(pool, pending, new_segments)
                        new_segments += new
                        if shared or retired:
                            announced = [(i, n) for i, n, _ in new] if new else ()
                            chunks = encode_shared_data(MessageKind.DATA, body, n_buffers, shared, inline, announced, retired)
                    pending += chunks
                self._send_lent(pool, pending, new_segments)
            except OSError as exc:
                raise PeerLostError(f"lost connection to {self.peer} while sending: {exc}") from exc
            finally:
                if new_segments:  # those a failed send left open
                    pool.sent(new_segments)

    @staticmethod
    def _lend_frame(
        pool: SegmentPool, chunks: Sequence[Buffer], body_bytes: int
    ) -> Tuple[List[SharedBuffer], List[Buffer], List[Tuple[int, int, int]], List[int], List[Buffer], int]:
        """:meth:`SegmentPool.lend` of a DATA frame's buffers and body (``body_bytes``, from its header):
        ``(shared, inline, new, retired, body, n_buffers)``, ``body`` empty once a segment holds it
        (the last of ``shared``)."""
        _kind, body, buffers = split_frame(chunks)
        shared, inline, new, retired = pool.lend(buffers, SHARED_MEMORY_MIN_BYTES, body, body_bytes)
        if placed_body(shared, len(buffers)) is not None:
            body = []
        return shared, inline, new, retired, body, len(buffers)

    def _send_lent(self, pool: SegmentPool, pending: List[Buffer], new_segments: List[Tuple[int, int, int]]) -> None:
        """Send ``pending`` with the descriptors of ``new_segments`` (then closed here); empty both."""
        if not new_segments:
            send_chunks(self._sock, pending)
        else:
            send_chunks(self._sock, pending, [fd for _, _, fd in new_segments])
            pool.sent(new_segments)
        pending.clear()
        new_segments.clear()

    def send(self, chunks: Sequence[Buffer]) -> None:
        if self._pool is None or self._to_lend(chunks) is None:
            return super().send(chunks)
        self.send_frames([chunks])

    def recv(self, timeout: Optional[float] = None) -> Optional[Frame]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            frame = super().recv(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if frame is None:
                return None
            frame = self._session_frame(frame)
            if frame is not None:
                return frame

    def recv_ready(self, most: int = 0) -> List[Frame]:
        frames = super().recv_ready(most)
        for frame in frames:
            if frame.kind in TRANSPORT_KINDS:  # rare: the loop below only when one came
                return [each for each in map(self._session_frame, frames) if each is not None]
        return frames

    def _session_frame(self, frame: Frame) -> Optional[Frame]:
        """The frame for the session above: a SHARED_DATA frame turned back into its DATA frame,
        None for a transport frame this end consumed (SHARED_MEMORY_OFFER)."""
        if frame.kind not in TRANSPORT_KINDS:
            return frame
        if frame.kind == MessageKind.SHARED_MEMORY_OFFER and self._segments is None:
            if self._lend and self._pool is None:
                self._pool = SegmentPool()
                if self._bound is not None:
                    self._pool.bound(*self._bound)
                # Only a session in a process of its own (forked after the accept): one that
                # shares the server's process (threads) could leave its items' segments mapped
                # there after it ends, through anything still referencing them (a traceback).
                if os.getpid() != self._accepted_in:
                    self._pool.offer_to_producers()
            return None
        if frame.kind == MessageKind.SHARED_DATA and self._segments is not None:
            shared = decode_shared_data(frame)
            fds = [self._fds.popleft() for _ in range(min(len(shared.new_segments), len(self._fds)))]
            return self._segments.open(shared, fds, self._reader.max_frame_bytes)
        raise RemoteProtocolError(f"{self.peer} sent {frame.kind.name}, which this end of the connection never accepts")

    def _recv_some(self, views: List[memoryview]) -> int:
        if self._segments is None:  # descriptors sent to this end are dropped by the kernel
            return super()._recv_some(views)
        n, ancillary, flags, _ = self._sock.recvmsg_into(views, _ANCILLARY_BYTES, _MSG_DONTWAIT)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self._fds.extend(fds)
        if flags & _MSG_CTRUNC:
            raise RemoteProtocolError(
                f"could not take the descriptors that {self.peer} sent with a frame: more than a SHARED_DATA "
                f"frame may bring, or this process is at its limit of open files ({_open_files()}); "
                "raise `ulimit -n`"
            )
        return n

    def close(self) -> None:
        super().close()
        self._drop_shared()

    def release(self) -> None:
        super().release()
        self._drop_shared()

    def _drop_shared(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._segments is not None:
            self._segments.close()
        while self._fds:
            with contextlib.suppress(OSError):
                os.close(self._fds.popleft())
