"""Reused memory for received out-of-band buffers and DATA bodies (a connection's ``allocate``)."""

from __future__ import annotations

import itertools
import sys
from typing import Any, List, Sequence

import numpy

__all__ = ["REUSED_BUFFER_MIN_BYTES", "REUSED_BUFFERS_MAX_BYTES", "ReusedBuffers", "uninitialised_bytes"]


def uninitialised_bytes(nbytes: int) -> Any:
    """``nbytes`` of memory, not zero-filled (``recv_into`` is about to overwrite it)."""
    # Not bytearray: it zero-fills every buffer, which cost about half of the trainer's receive
    # time on 8 MiB tensors.
    return numpy.empty(nbytes, dtype=numpy.uint8)


#: Buffers of at least this size (every out-of-band one) are reused: malloc hands 64 KiB-1 MiB
#: ones back to the system too (measured: 15 page faults per 256 KiB item received over TCP, 28
#: per item copied in its worker); smaller ones come from malloc's free lists.
REUSED_BUFFER_MIN_BYTES = 64 * 1024
#: At most this many bytes of free buffers wait for reuse per connection (a few items of the credit window).
REUSED_BUFFERS_MAX_BYTES = 64 * 1024 * 1024


class ReusedBuffers:
    """Uninitialised receive buffers; a large one is handed out again, for a buffer of the same
    size, once nothing refers to it any more (its tensor and every view of it are gone).

    At most :meth:`bound` (or :data:`REUSED_BUFFERS_MAX_BYTES`). Not thread-safe but :meth:`bound`:
    one per allocating thread. Why: docs/architecture.md (page faults of fresh buffers).
    """

    __slots__ = ("_buffers", "_bytes", "_next", "_frames", "_frame_bytes", "_largest")

    def __init__(self) -> None:
        self._buffers: List[numpy.ndarray] = []
        self._bytes = 0
        #: Where the search for a free buffer starts: after the one handed out last (buffers are
        #: let go in about the order they were handed out, so the next one is usually free).
        self._next = 0
        #: What :meth:`bound` set (0: no bound but :data:`REUSED_BUFFERS_MAX_BYTES`), and the
        #: largest buffer asked for (a frame holds at least one).
        self._frames, self._frame_bytes, self._largest = 0, 0, 0

    def bound(self, frames: int, frame_bytes: int) -> None:
        """Keep at most ``frames`` frames' worth of buffers (a connection's share of the credit
        window, plus one), a frame being ``frame_bytes`` (the batch bound) or the largest buffer
        asked for, if larger. Any thread may call it: the allocating one applies it.

        Args:
            frames: Frames in flight at once, plus one.
            frame_bytes: Bytes counted per frame (a trainer: ``batch_max_bytes``; a worker: ``frame_max_bytes``).
        """
        self._frames, self._frame_bytes = frames, frame_bytes

    def _max_bytes(self) -> int:
        if not self._frames:
            return REUSED_BUFFERS_MAX_BYTES
        return min(REUSED_BUFFERS_MAX_BYTES, self._frames * max(self._frame_bytes, self._largest))

    def __call__(self, nbytes: int) -> Any:
        if nbytes < REUSED_BUFFER_MIN_BYTES:
            return uninitialised_bytes(nbytes)
        buffers = self._buffers
        count = len(buffers)
        start = self._next if self._next < count else 0
        for index in itertools.chain(range(start, count), range(start)):
            # _only_in(buffers, index), without a call per item: the same references counted.
            if buffers[index].nbytes == nbytes and sys.getrefcount(buffers[index]) == _ONLY_IN_A_LIST:
                self._next = index + 1
                return buffers[index]
        return self._make(nbytes)

    def many(self, lengths: Sequence[int]) -> List[Any]:
        """Buffers of ``lengths`` bytes each, as that many calls would hand them out (one call
        for a frame's buffers)."""
        buffers, found = self._buffers, []
        count = len(buffers)
        start = self._next if self._next < count else 0
        for nbytes in lengths:
            if nbytes < REUSED_BUFFER_MIN_BYTES:
                found.append(uninitialised_bytes(nbytes))
                continue
            # The search's first look, without making its iterators: the next one is usually free.
            if start < count and buffers[start].nbytes == nbytes and sys.getrefcount(buffers[start]) == _ONLY_IN_A_LIST:
                found.append(buffers[start])
                start += 1
                continue
            for index in itertools.chain(range(start, count), range(start)):
                # as in __call__ (a buffer found holds a reference from ``found`` from then on)
                if buffers[index].nbytes == nbytes and sys.getrefcount(buffers[index]) == _ONLY_IN_A_LIST:
                    start = index + 1
                    found.append(buffers[index])
                    break
            else:  # none free: a new one
                self._next = start
                found.append(self._make(nbytes))
                count = len(buffers)
                start = self._next if self._next < count else 0
        self._next = start
        return found

    def _make(self, nbytes: int) -> Any:
        """A new buffer of ``nbytes`` (none is free), kept for reuse if it fits the bound."""
        self._largest = max(self._largest, nbytes)
        max_bytes = self._max_bytes()
        self._make_room(nbytes, max_bytes)
        buffer = uninitialised_bytes(nbytes)
        if self._bytes + nbytes <= max_bytes:
            buffers = self._buffers
            buffers.append(buffer)
            self._bytes += nbytes
            self._next = len(buffers)
        return buffer

    def _make_room(self, nbytes: int, max_bytes: int) -> None:
        """Drop free buffers, oldest first, until ``nbytes`` more fit under ``max_bytes`` (items
        of another size replace those of the old one)."""
        buffers = self._buffers
        index = 0
        while self._bytes + nbytes > max_bytes and index < len(buffers):
            if _only_in(buffers, index):
                self._bytes -= buffers.pop(index).nbytes
            else:
                index += 1


def _references(buffers: List[Any], index: int) -> int:
    return sys.getrefcount(buffers[index])


#: What :func:`_references` counts for an object only ``buffers`` refers to (measured, not
#: assumed: interpreters differ in the temporary references they count).
_ONLY_IN_A_LIST = _references([numpy.empty(0)], 0)


def _only_in(buffers: List[Any], index: int) -> bool:
    """Whether nothing but ``buffers`` refers to ``buffers[index]``."""
    return _references(buffers, index) == _ONLY_IN_A_LIST


