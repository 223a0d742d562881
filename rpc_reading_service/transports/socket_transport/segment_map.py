"""The trainer's side of the shared-memory hand-over: its mappings of a worker's segments.

The design: docs/architecture.md."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import operator
import os
import weakref
from typing import Dict, List, Type

from ...errors import FrameTooLargeError, RemoteProtocolError
from ...protocol.credits import FRAMES_PAST_WINDOW
from ...protocol.frames import Buffer, Frame, SharedBuffer, SharedFrame
from .mappings import advise, map_shared
from .segments import FREE, HEADER_BYTES, Segment

__all__ = ["SegmentMap"]

log = logging.getLogger(__name__)

_SIZE, _ID = operator.attrgetter("size"), operator.attrgetter("id")

#: This process's id, kept by a fork hook: read for every received buffer and every release,
#: where ``os.getpid()`` would be a system call each.
_pid = os.getpid()


def _note_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_note_fork)


#: ``madvise`` advice that maps a range's pages at once (Linux 5.14: MADV_POPULATE_READ; the
#: mmap module of Python 3.11 does not name it); an older kernel refuses it: pages then fault in.
_MADV_POPULATE_READ = 22


class _Lent(weakref.ref):
    """A weak reference to memory the trainer was lent on a segment (frees it once the memory is gone)."""

    __slots__ = ("state", "owner")


#: The references to lent memory still alive (a weak reference that dies calls no callback).
_lent: Dict[int, _Lent] = {}


def _released(lent: _Lent) -> None:
    _lent.pop(id(lent), None)
    # A process forked from the owner shares the mapping: only the owner may free the segment.
    if _pid == lent.owner:
        lent.state[0] = FREE


def _cuda_host_register(segment: Segment) -> bool:
    """Page-lock ``segment``'s mapping for CUDA (``cudaHostRegister``), so that tensors on it go to
    a GPU with ``non_blocking=True`` without a staging copy; False without CUDA, or if refused."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        return int(torch.cuda.cudart().cudaHostRegister(segment.address - HEADER_BYTES, segment.size, 0)) == 0
    except (RuntimeError, AttributeError, TypeError) as exc:
        log.debug("cudaHostRegister of a shared segment failed: %s", exc)
        return False


def _cuda_host_unregister(segment: Segment) -> None:
    """Undo :func:`_cuda_host_register` while the mapping is still there (tensors left on it stay
    valid, in pageable memory)."""
    if segment.pinned:
        import torch

        with contextlib.suppress(RuntimeError, AttributeError, TypeError):
            torch.cuda.cudart().cudaHostUnregister(segment.address - HEADER_BYTES)
        segment.pinned = False


class SegmentMap:
    """The trainer's mappings of one connection's segments; builds received buffers on them.

    Each buffer is a numpy array on the mapping; when it (and every tensor or array built
    on it) is gone, its segment is marked free for the worker to reuse. Used by the
    receiving thread only. With ``pin`` (a trainer's ``pin_memory`` where CUDA is available)
    each segment is page-locked where it is mapped (``cudaHostRegister``), not copied.
    """

    def __init__(self, peer: str, pin: bool = False):
        self.peer = peer
        self.pin = pin
        self._segments: Dict[int, Segment] = {}
        #: What :meth:`bound` set: frames' worth of segments resident here (0: no bound), a frame's bytes.
        self._frames, self._frame_bytes = 0, 0
        #: The resident segments' bytes, how many segments are not resident, the largest one's size:
        #: kept as they change, so that a frame within the bound costs no look at every segment.
        self._resident_bytes, self._dropped, self._largest = 0, 0, 0

    def bound(self, frames: int, frame_bytes: int) -> None:
        """Keep at most ``frames`` frames' worth of segments resident here (the connection's share
        of the credit window, plus one), a frame being ``frame_bytes`` or the largest segment, and
        the ``frame_bytes`` of each frame a worker fills past the window: before more arrive, the
        pages of free segments past that leave this process's resident memory (``MADV_DONTNEED``:
        the memory stays the worker's), and come back when one is lent again.

        Args:
            frames: Frames in flight at once, plus one.
            frame_bytes: Bytes counted per frame (a trainer: ``batch_max_bytes``; a worker: ``frame_max_bytes``).
        """
        self._frames, self._frame_bytes = frames, frame_bytes

    def _make_room(self, shared: SharedFrame) -> None:
        """Drop the pages of free segments (let go here, not page-locked) until what ``shared``
        brings in fits under :meth:`bound` with the segments resident already."""
        if not self._frames:
            return
        resident, largest = self._resident_bytes, self._largest
        for _id, size in shared.new_segments:
            resident += size
            largest = size if size > largest else largest
        placed = None
        if self._dropped:  # a placed segment whose pages were dropped comes back
            placed = shared.placed_segments
            resident += sum(s.size for i in placed if (s := self._segments.get(i)) is not None and not s.resident)
        keep = self._frames * max(self._frame_bytes, largest) + FRAMES_PAST_WINDOW * self._frame_bytes
        if resident <= keep:
            return
        if placed is None:
            placed = shared.placed_segments
        # The newest first: a worker lends the oldest free segment that fits, so those stay warm.
        for segment in sorted(self._segments.values(), key=_ID, reverse=True):
            if resident <= keep:
                return
            if segment.resident and not segment.pinned and segment.id not in placed and segment.state[0] == FREE:
                with contextlib.suppress(OSError, ValueError):
                    advise(segment.mapping, mmap.MADV_DONTNEED)
                self._resident(segment, False)
                resident -= segment.size

    def _resident(self, segment: Segment, resident: bool) -> None:
        """Mark ``segment``'s pages mapped here or dropped (counted for :meth:`_make_room`)."""
        segment.resident = resident
        self._resident_bytes += segment.size if resident else -segment.size
        self._dropped += -1 if resident else 1

    def open(self, shared: SharedFrame, fds: List[int], max_frame_bytes: int) -> Frame:
        """The inner frame of ``shared``, its buffers (and body, if placed) on the segments; ``fds`` are the
        descriptors of its new segments, in order (this call owns them)."""
        try:
            if len(fds) != len(shared.new_segments):
                raise self._error(f"brought {len(fds)} descriptors for {len(shared.new_segments)} new segments")
            if len(shared.body) + shared.shared_bytes + sum(memoryview(b).nbytes for b in shared.inline) > max_frame_bytes:
                raise self._error(f"announced a frame over the maximum of {max_frame_bytes} bytes", FrameTooLargeError)
            for segment_id in shared.retired:
                retired = self._segments.pop(segment_id, None)
                if retired is not None:
                    self._forget(retired)
            self._make_room(shared)
            for (segment_id, size), fd in zip(shared.new_segments, fds):
                self._add(segment_id, size, fd)
        finally:
            for fd in fds:
                os.close(fd)
        buffers: List[Buffer] = list(shared.inline)
        for placed in shared.shared:
            buffers.insert(placed.index, self._buffer(placed))
        body = shared.body
        if shared.body_placed is not None:  # bytes, as a body read from the socket is (the array's format is "<B")
            body = memoryview(self._buffer(shared.body_placed)).cast("B")
        return Frame(shared.kind, body, buffers)

    def _add(self, segment_id: int, size: int, fd: int) -> None:
        if segment_id in self._segments:
            raise self._error(f"announced segment {segment_id} twice")
        if not HEADER_BYTES < size <= os.fstat(fd).st_size:
            raise self._error(f"announced segment {segment_id} of {size} bytes, which its descriptor does not hold")
        segment = self._segments[segment_id] = Segment(segment_id, size, map_shared(fd, size))
        self._resident_bytes += size
        self._largest = max(self._largest, size)
        if self.pin:
            segment.pinned = _cuda_host_register(segment)

    def _buffer(self, placed: SharedBuffer) -> Buffer:
        segment = self._segments.get(placed.segment)
        if segment is None:
            raise self._error(f"placed a buffer in segment {placed.segment}, which it never announced")
        if placed.offset < HEADER_BYTES or placed.offset + placed.length > segment.size:
            raise self._error(f"placed {placed.length} bytes at offset {placed.offset} of a {segment.size}-byte segment")
        # A ctypes array, not a numpy view: numpy collapses a view's base to the mapping, so
        # the view could die while arrays built on it live; this object lives as long as they do.
        if not segment.resident:  # its pages were dropped (see bound): map them in one call
            with contextlib.suppress(OSError, ValueError):
                advise(segment.mapping, _MADV_POPULATE_READ)
            self._resident(segment, True)
        memory = (ctypes.c_ubyte * placed.length).from_buffer(segment.mapping, placed.offset)
        lent = _Lent(memory, _released)
        lent.state, lent.owner = segment.state, _pid
        _lent[id(lent)] = lent
        return memory  # type: ignore[return-value]

    def _forget(self, segment: Segment) -> None:
        """A retired segment is no longer counted (its mapping goes with the last buffer on it)."""
        if segment.resident:
            self._resident_bytes -= segment.size
        else:
            self._dropped -= 1
        if segment.size >= self._largest:
            self._largest = max(map(_SIZE, self._segments.values()), default=0)
        _cuda_host_unregister(segment)

    def _error(self, what: str, kind: Type[RemoteProtocolError] = RemoteProtocolError) -> RemoteProtocolError:
        return kind(f"the worker at {self.peer} {what} (SHARED_DATA frame)")

    @property
    def segments(self) -> int:
        """Segments mapped (the worker lent or may lend again)."""
        return len(self._segments)

    def close(self) -> None:
        """Forget every segment (each mapping goes with the last buffer built on it)."""
        for segment in self._segments.values():
            _cuda_host_unregister(segment)
        self._segments.clear()
        self._resident_bytes, self._dropped, self._largest = 0, 0, 0
