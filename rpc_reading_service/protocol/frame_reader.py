"""The incremental parser of a byte stream into frames, sans I/O (the frame layout: :mod:`.frames`)."""

from __future__ import annotations

import math
import struct
from typing import Callable, Dict, List, Optional

from ..errors import FrameTooLargeError, RemoteProtocolError
from ..serialization import REUSED_BUFFER_MIN_BYTES, Buffer, ReusedBuffers
from .frames import BUFFER_LENGTH, DEFAULT_MAX_FRAME_BYTES, HEADER, MAGIC, MAX_BUFFERS_PER_FRAME, PROTOCOL_VERSION
from .frames import Frame, MessageKind, header_kind

__all__ = ["FrameReader"]

#: The kind of each type byte (a dict lookup by int: ``MessageKind(kind)`` costs a Python call).
_KINDS: Dict[int, MessageKind] = {int(k): k for k in MessageKind}
_HEADER, _LENGTHS, _SECTIONS = range(3)


class FrameReader:
    """Incremental frame parser for a byte stream.

    Zero-copy use: ``view = reader.writable()``, ``n = sock.recv_into(view)``,
    ``reader.advance(n)``, then ``reader.next_frame()``. Simple use: ``reader.feed(data)``.
    Sizes are checked against ``max_frame_bytes`` as soon as the header (and the buffer
    length table) arrive, before any memory is allocated for them. Once they are known, a
    frame's body and buffers are its *sections*, received in order (:meth:`writable_sections`).
    """

    def __init__(
        self,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        allocate: Callable[[int], Buffer] = bytearray,
        allowed_kinds: Optional[frozenset] = None,
    ):
        self.max_frame_bytes = max_frame_bytes
        self.allowed_kinds = allowed_kinds
        #: Where each out-of-band buffer is received (set once, before the first frame).
        self.allocate = allocate
        self._frames: List[Frame] = []
        #: Bytes of the current frame's sections not received yet (0 while its head is read).
        self.frame_bytes_left = 0
        #: Whether the current frame (between frames: the last one) has out-of-band buffers.
        self.has_buffers = False
        self._frame_nbytes = 0  # the current frame's bytes, once its head is read
        self._start_header()

    # -- public -------------------------------------------------------------------------
    def writable(self) -> memoryview:
        """Memory where the next bytes of the stream belong (never empty)."""
        return self._target[self._filled :]

    def writable_sections(self, most: int) -> List[memoryview]:
        """Memory where the next bytes of the stream belong, in order: :meth:`writable` and, in a
        frame's body or buffers, the frame's sections after it (at most ``most`` sections in all)."""
        index = self._index
        return [self._target[self._filled :]] + self._views[index + 1 : index + most]

    def advance(self, nbytes: int) -> None:
        """Record that ``nbytes`` were written into the memory returned by ``writable()`` (or
        into the sections of :meth:`writable_sections`, in order)."""
        while self._state != _SECTIONS:
            step = min(nbytes, len(self._target) - self._filled)
            self._filled += step
            nbytes -= step
            if self._filled < len(self._target):
                return
            self._head_done()
            if not nbytes:
                return
        # The sections it filled, without a call per section.
        self.frame_bytes_left -= nbytes
        filled, index, sizes = self._filled + nbytes, self._index, self._sizes
        while filled >= sizes[index]:  # the last size is infinite
            filled -= sizes[index]
            index += 1
        if index == len(self._views):
            self._frame_done()
            return
        if index != self._index:
            self._index, self._target = index, self._views[index]
        self._filled = filled

    def feed(self, data: Buffer) -> None:
        """Copy ``data`` into the reader (convenience for tests and non-socket transports)."""
        data = memoryview(data).cast("B")
        while data:
            data = data[self.take(data) :]

    def take(self, data: memoryview) -> int:
        """Copy what the reader can take now from the start of ``data`` (bytes received, not
        empty): the whole small frames and a frame's head there at once, else as much of its
        current section as ``data`` holds; return how many bytes it took (at least one)."""
        whole = self.feed_frames(data)
        if whole:
            return whole
        target = self._target[self._filled :]
        n = min(len(target), len(data))
        target[:n] = data[:n]
        self.advance(n)
        return n

    def feed_frames(self, data: memoryview) -> int:
        """Take the whole frames without buffers at the start of ``data``, and the head (header,
        buffer lengths, body) of a frame with buffers after them, at once; the bytes taken (0: none).

        The fast path (one header unpack and one body copy a frame); anything else is left to
        :meth:`writable` and :meth:`advance`, with every check and error.
        """
        if self._state != _HEADER or self._filled:
            return 0
        offset, end, unpack, size = 0, len(data), HEADER.unpack_from, HEADER.size
        allowed, frames = self.allowed_kinds, self._frames
        while end - offset >= size:
            magic, version, kind, n_buffers, body_length = unpack(data, offset)
            body_start = offset + size + n_buffers * BUFFER_LENGTH.size
            frame_kind = _KINDS.get(kind) if magic == MAGIC and version == PROTOCOL_VERSION else None
            if (
                frame_kind is None or body_length > end - body_start or body_length > self.max_frame_bytes
                or (allowed is not None and frame_kind not in allowed) or n_buffers > MAX_BUFFERS_PER_FRAME
            ):  # fmt: skip
                break  # the incremental parser checks it, and raises what is wrong
            if n_buffers:
                lengths = struct.unpack_from(f"!{n_buffers}Q", data, offset + size)
                if body_length + sum(lengths) > self.max_frame_bytes:
                    break
                offset = body_start + body_length
                self._kind, self._body_length = frame_kind, body_length
                self._start_sections(lengths, data[body_start:offset])
                if self._state == _SECTIONS:
                    return offset  # its buffers are received where they belong
                continue
            offset = body_start + body_length
            self.has_buffers = False
            if body_length < REUSED_BUFFER_MIN_BYTES:
                frames.append(Frame(frame_kind, bytearray(data[body_start:offset])))
                continue
            body = self._new_body(frame_kind, body_length)
            memoryview(body).cast("B")[:] = data[body_start:offset]
            frames.append(Frame(frame_kind, body))
        return offset

    def next_frame(self) -> Optional[Frame]:
        """Return the oldest complete frame, or None if none is complete yet."""
        return self._frames.pop(0) if self._frames else None

    def completed(self, most: int = 0) -> List[Frame]:
        """The complete frames not taken yet, oldest first; the rest stay for the next call.

        Args:
            most: Take at most this many (0: every one).
        """
        frames = self._frames
        if not most or len(frames) <= most:
            self._frames = []
            return frames
        self._frames = frames[most:]
        return frames[:most]

    @property
    def waiting(self) -> int:
        """Complete frames not taken yet."""
        return len(self._frames)

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame has been read (EOF now means a truncated frame)."""
        return self._state != _HEADER or self._filled > 0

    # -- state machine ---------------------------------------------------------------------
    def _start_header(self) -> None:
        self._state = _HEADER
        self._target = memoryview(bytearray(HEADER.size))
        self._filled = 0
        #: The frame's sections (body, then buffers) as byte views, and their sizes (then infinity).
        self._views: List[memoryview] = []
        self._sizes: List[int] = []
        self._index = 0

    def _head_done(self) -> None:
        """The header or the buffer lengths are complete: what comes next."""
        if self._state == _HEADER:
            magic, version, kind, n_buffers, body_length = HEADER.unpack(self._target)
            kind = header_kind(magic, version, kind)
            if self.allowed_kinds is not None and kind not in self.allowed_kinds:
                raise RemoteProtocolError(f"message {kind.name} is not allowed at this point of the session")
            if n_buffers > MAX_BUFFERS_PER_FRAME:
                raise RemoteProtocolError(f"frame announces {n_buffers} buffers, at most {MAX_BUFFERS_PER_FRAME} are allowed")
            self._kind, self._body_length = kind, body_length
            if n_buffers:
                self._state, self._filled = _LENGTHS, 0
                self._target = memoryview(bytearray(BUFFER_LENGTH.size * n_buffers))
                return
            lengths: tuple = ()
        else:
            lengths = struct.unpack(f"!{len(self._target) // BUFFER_LENGTH.size}Q", self._target)
        self._start_sections(lengths)

    def _start_sections(self, lengths: tuple, body: Optional[memoryview] = None) -> None:
        """Check the frame's size, allocate its body and buffers and receive into them (the body
        copied from ``body`` when given)."""
        total = self._body_length + sum(lengths)
        if total > self.max_frame_bytes:
            raise FrameTooLargeError(
                f"peer announced {'an' if self._kind.name[0] in 'AEIOU' else 'a'} {self._kind.name} frame of {total} bytes, over the maximum of "
                f"{self.max_frame_bytes} bytes; refused before reading it"
            )
        allocate = self.allocate
        if isinstance(allocate, ReusedBuffers) and self._kind is MessageKind.DATA:
            # a DATA frame's body and buffers with one call (flat uint8 arrays: views need no cast)
            sections = allocate.many((self._body_length, *lengths))
            self._body, self._buffers = sections[0], sections[1:]
            views = list(map(memoryview, sections))
        else:
            self._body = self._new_body(self._kind, self._body_length)
            self._buffers = [allocate(length) for length in lengths]
            views = [memoryview(section).cast("B") for section in (self._body, *self._buffers)]
        self._views, self._sizes = views, [self._body_length, *lengths, math.inf]
        self._state, self._target, self._filled, self._index = _SECTIONS, views[0], 0, 0
        self.frame_bytes_left, self.has_buffers, self._frame_nbytes = total, bool(lengths), total
        if body is not None:
            views[0][:] = body
        self.advance(0 if body is None else len(body))  # past empty sections

    def _frame_done(self) -> None:
        self._frames.append(Frame(self._kind, self._body, self._buffers, self._frame_nbytes))
        self.frame_bytes_left = 0
        self._start_header()

    def _new_body(self, kind: MessageKind, nbytes: int) -> Buffer:
        """Memory for a body: a DATA frame's from the reader's :class:`ReusedBuffers` when it has
        them (its items are unpickled from it, then it is let go), else a new bytearray."""
        if kind is MessageKind.DATA and isinstance(self.allocate, ReusedBuffers):
            return self.allocate(nbytes)
        return bytearray(nbytes)
