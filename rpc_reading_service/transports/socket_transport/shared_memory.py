"""Shared-memory hand-over of large buffers between the processes of one host (``memfd`` segments).

Used by the socket transport on Unix sockets (local workers); the design: docs/architecture.md."""

from __future__ import annotations

import collections
import ctypes
import heapq
import logging
import mmap
import operator
import os
import threading
import weakref
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import numpy

from ...protocol.frames import Buffer, SharedBuffer
from ...serialization import SHARED_MEMORY_MIN_BYTES
from .mappings import SegmentMapping, map_shared, unmap
from .segments import FREE, HEADER_BYTES, LENT, Segment

__all__ = ["SegmentPool", "allocate", "copy_into_segment", "shared_memory_available"]

log = logging.getLogger(__name__)

_CAPACITY, _SIZE = operator.attrgetter("capacity"), operator.attrgetter("size")
_PAGE = mmap.PAGESIZE
#: New segments one frame may bring (each one a descriptor in its ancillary data).
MAX_NEW_SEGMENTS_PER_FRAME = 16
#: What a new empty segment's pages are written with (see :func:`_write_pages`).
_ZEROS = memoryview(bytes(256 * 1024))


def shared_memory_available() -> bool:
    """Whether this host can hand buffers over in shared memory (Linux: memfd)."""
    return hasattr(os, "memfd_create")


def _write_pages(fd: int, size: int, view: Optional[memoryview]) -> None:
    """Make the ``size`` bytes of a new segment by writing them: ``view``'s bytes after the
    header, else zeros. The kernel allocates each page as it writes it, with no fault per
    page and no zeroing of a page about to be overwritten: a fresh 8 MiB segment ready to be
    written costs ~6.4 ms instead of ~8 ms when its pages are faulted in (MAP_POPULATE,
    MADV_POPULATE_WRITE and posix_fallocate cost the same or more here)."""
    if view is not None:
        written = 0
        while written < view.nbytes:
            written += os.pwrite(fd, view[written:], HEADER_BYTES + written)
        return
    offset = 0
    while offset < size:
        left = size - offset
        offset += os.pwritev(fd, [_ZEROS] * min(64, left // len(_ZEROS)) or [_ZEROS[:left]], offset)


#: A frame body's chunks are copied into a segment one by one where they hold this much on average,
#: else joined first: a Python step per chunk costs about what copying 4 KiB does.
GATHER_MIN_CHUNK_BYTES = 4096


def _gather(data: numpy.ndarray, chunks: Sequence[Buffer], nbytes: int) -> None:
    """Copy ``chunks`` (``nbytes`` in all) one after another to the start of ``data``."""
    if nbytes < GATHER_MIN_CHUNK_BYTES * len(chunks):
        data[:nbytes] = numpy.frombuffer(b"".join(chunks), dtype=numpy.uint8)
        return
    target, offset = memoryview(data), 0
    for chunk in chunks:
        source = memoryview(chunk).cast("B")
        target[offset : offset + source.nbytes] = source
        offset += source.nbytes


def _address(view: memoryview) -> int:
    """Where ``view``'s first byte is in this process: through ctypes for a writable view (a sixth
    of the cost of wrapping it in a numpy array), through numpy for a read-only one."""
    if view.readonly:
        return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


#: The pools whose connections let producers make items in their segments (see :func:`allocate`).
_producer_pools: "weakref.WeakSet[SegmentPool]" = weakref.WeakSet()
#: The one pool of ``_producer_pools`` (None with none or several), kept as they change: looked
#: up for every item made and every large buffer encoded.
_sole_producer_pool: Optional["weakref.ref[SegmentPool]"] = None
_producer_pools_lock = threading.Lock()


def _change_producer_pools(pool: "SegmentPool", offered: bool) -> None:
    global _sole_producer_pool
    with _producer_pools_lock:
        if offered:
            _producer_pools.add(pool)
        else:
            _producer_pools.discard(pool)
        pools = list(_producer_pools)
        # several sessions in one process (threads): which one sends an item made here?
        _sole_producer_pool = weakref.ref(pools[0]) if len(pools) == 1 else None


def _note_fork() -> None:
    """In a forked child: no producer pool (the parent's sessions are not its own)."""
    global _producer_pools, _sole_producer_pool, _producer_pools_lock
    _producer_pools, _sole_producer_pool, _producer_pools_lock = weakref.WeakSet(), None, threading.Lock()


os.register_at_fork(after_in_child=_note_fork)


def _producer_pool() -> Optional["SegmentPool"]:
    """The pool of this process's one session that lets producers make items in its segments."""
    sole = _sole_producer_pool
    return sole() if sole is not None else None


def allocate(nbytes: int) -> Optional[Buffer]:
    """``nbytes`` of writable memory in a segment of this process's session, which its
    connection will hand over without a copy; None when there is no such session (no
    local worker session here, the trainer did not offer shared memory, a session that
    shares its server's process, or the pool is full)."""
    pool = _producer_pool()
    return pool.allocate(nbytes) if pool is not None else None


def copy_into_segment(view: memoryview) -> Optional[Buffer]:
    """Where an item's large buffer ``view`` goes as it is encoded (the ``stage`` of an
    ``ItemEncoder`` in a local worker's session): ``view`` itself if a producer made it in
    one of this process's segments (:func:`allocate`: it must not write it again), else a
    copy in a segment, made now; None where :func:`allocate` gives nothing or for a buffer
    under ``SHARED_MEMORY_MIN_BYTES`` (the encoder then copies it to ordinary memory)."""
    sole = _sole_producer_pool if view.nbytes >= SHARED_MEMORY_MIN_BYTES else None  # no call per buffer
    pool = sole() if sole is not None else None
    return pool.stage(view) if pool is not None else None


def _segment_bytes(nbytes: int) -> int:
    """The size of a segment made for ``nbytes``: the header and the bytes, in whole pages."""
    return -(-(nbytes + HEADER_BYTES) // _PAGE) * _PAGE


def _new_segment(size: int, view: Optional[memoryview]) -> Tuple[SegmentMapping, int]:
    """A new memfd segment of ``size`` bytes holding ``view``'s bytes after the header (or
    zeros), mapped: ``(mapping, descriptor)``. Raises OSError or ValueError if the system
    refuses one."""
    fd = os.memfd_create("rpc-reading-service", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        _write_pages(fd, size, view)
        return map_shared(fd, size), fd
    except BaseException:
        os.close(fd)
        raise


class SegmentPool:
    """The worker's segments of one connection: lends one to each large buffer it sends (thread-safe).

    Args:
        max_bytes: The most bytes of segments the pool holds, or what :meth:`bound` keeps if more
            (a window of very large items); past that a buffer that finds no free segment goes
            through the socket.
        max_free: The most free segments kept before :meth:`bound` (then its bytes bound them).
    """

    def __init__(self, max_bytes: int = 1 << 30, max_free: int = 8):
        self.max_bytes = max_bytes
        self.max_free = max_free
        #: What :meth:`bound` set: frames' worth of segments kept (0: no bound), a frame's bytes.
        self._frames, self._frame_bytes = 0, 0
        self._segments: Dict[int, Segment] = {}
        #: Segments as lent (the trainer lets go in about that order), and a heap of the ids of
        #: those found let go at its front: see :meth:`_fitting`.
        self._lent_order: Deque[int] = collections.deque()
        self._reusable: List[int] = []
        self._bytes = 0
        self._next_id = 1
        self._lock = threading.Lock()
        self._warned = False
        self._closed = False
        self._retired: List[int] = []  # retired between frames (by allocate): told with the next one
        #: Segments in hand, by the id of the memory given out; those a graph makes items in, by segment id.
        self._in_hand: Dict[int, Segment] = {}
        self._made_by_producers: Dict[int, Segment] = {}

    def bound(self, frames: int, frame_bytes: int) -> None:
        """Keep no free segment past ``frames`` frames' worth of segments (the connection's share
        of the credit window, plus one), a frame being ``frame_bytes`` or the largest segment, if
        larger; more are made while that many are lent (a consumer holding items), and retired
        once free again. Up to that many bytes, free segments are kept whatever their number
        (not ``max_free``): the window's worth of small segments is lent again and again.

        Args:
            frames: Frames in flight at once, plus one.
            frame_bytes: Bytes counted per frame (a trainer: ``batch_max_bytes``; a worker: ``frame_max_bytes``).
        """
        with self._lock:
            self._frames, self._frame_bytes = frames, frame_bytes

    def offer_to_producers(self) -> None:
        """Let this process's graph make items in this pool's segments (:func:`allocate`)."""
        with self._lock:
            if not self._closed:
                _change_producer_pools(self, True)

    def allocate(self, nbytes: int) -> Optional[Buffer]:
        """``nbytes`` of a free (or new) segment, in the producer's hands while the returned
        memory lives here; None when the pool cannot hold another segment of that size.

        A new segment is made outside the lock (its pages cost milliseconds): meanwhile the
        connection goes on lending and sending what is ready."""
        return self._allocate(nbytes, True)

    def _allocate(self, nbytes: int, for_producer: bool) -> Optional[Buffer]:
        if nbytes <= 0:
            return None
        with self._lock:
            if self._closed:
                return None
            segment = self._fitting(nbytes)
            if segment is not None:
                return self._hand_out(segment, nbytes, for_producer)
            size = self._reserve(nbytes, self._retired)
        if size is None:
            return None
        try:
            mapping, fd = _new_segment(size, None)
        except (OSError, ValueError) as exc:
            with self._lock:
                self._bytes -= size
                self._warn(exc)
            return None
        with self._lock:
            if self._closed:
                self._bytes -= size
                unmap(mapping)
                os.close(fd)
                return None
            return self._hand_out(self._register(size, mapping, fd, None), nbytes, for_producer)

    def stage(self, view: memoryview) -> Optional[Buffer]:
        """:func:`copy_into_segment` for this pool: ``view`` itself if a producer made it in one
        of its segments, else a copy in one (:meth:`allocate`), or None if none is to be had."""
        with self._lock:
            if self._made_in(view) is not None:
                return view
        memory = self._allocate(view.nbytes, False)
        if memory is not None:  # the segment is in this producer's hands: copied without the lock
            numpy.frombuffer(memory, dtype=numpy.uint8)[:] = numpy.frombuffer(view, dtype=numpy.uint8)
        return memory

    def _hand_out(self, segment: Segment, nbytes: int, for_producer: bool) -> Buffer:
        memory = (ctypes.c_ubyte * nbytes).from_buffer(segment.mapping, HEADER_BYTES)
        segment.in_hand = True
        segment.hand = weakref.ref(memory, segment.put_down)
        segment.hand_key = id(memory)
        segment.held_in = (self._in_hand, self._made_by_producers)
        self._in_hand[segment.hand_key] = segment
        if for_producer:
            self._made_by_producers[segment.id] = segment
        return memory  # type: ignore[return-value]

    def _made_in(self, view: memoryview) -> Optional[Tuple[Segment, int]]:
        """The segment a producer made ``view`` in (or that holds a staged copy, all of it) and its
        offset there, if any; no look at each segment (this runs for every large buffer)."""
        if not view.nbytes:
            return None
        memory = view.obj
        segment = self._in_hand.get(id(memory))
        if segment is not None:
            hand = segment.hand() if segment.hand is not None else None
            if hand is memory and len(hand) == view.nbytes:  # all of the memory handed out (staged)
                return segment, 0
        if not self._made_by_producers:
            return None
        address = _address(view)
        for segment in tuple(self._made_by_producers.values()):  # a copy: a drop elsewhere may put one down
            if segment.address <= address and address + view.nbytes <= segment.address + segment.capacity:
                return segment, address - segment.address
        return None

    @property
    def segments(self) -> int:
        """Segments this pool holds (lent or free)."""
        return len(self._segments)

    def lend(
        self, buffers: Sequence[Buffer], min_bytes: int, body: Sequence[Buffer] = (), body_bytes: int = 0
    ) -> Tuple[List[SharedBuffer], List[Buffer], List[Tuple[int, int, int]], List[int]]:
        """Put each buffer of at least ``min_bytes`` in a segment (a copy), and the frame's
        ``body`` chunks (``body_bytes`` in all) too if that large and a segment is to be had.

        Returns ``(shared, inline, new, retired)``: where the shared buffers are (the body last,
        as index ``len(buffers)``, if placed), the others (in order), the new segments as ``(id,
        size, fd)`` (the caller sends the descriptors with the frame, then calls :meth:`sent`),
        and the retired segment ids.
        """
        shared: List[SharedBuffer] = []
        inline: List[Buffer] = []
        new: List[Tuple[int, int, int]] = []
        with self._lock:
            retired, self._retired = self._retired, []
            kept = min(self.max_bytes, self._frames * self._frame_bytes or self.max_bytes)  # at least, by bound()
            if (not self._frames and len(self._segments) > self.max_free) or self._bytes > kept:  # else no call
                self._retire_surplus(retired, 0, self._bound_bytes(0))  # a consumer let go of many at once
            for index, buffer in enumerate(buffers):
                view = memoryview(buffer).cast("B")
                segment = None
                if view.nbytes >= min_bytes and not self._closed:
                    made = self._made_in(view)
                    if made is not None and self._lend_made(*made, view.nbytes, index, shared, new):
                        continue
                    segment = self._segment_for(view.nbytes, new, retired, view)
                if segment is None:
                    inline.append(buffer)
                    continue
                if not (new and new[-1][0] == segment.id):  # a new one holds the bytes already
                    if segment.fd is not None:  # made for a producer, which let it go unsent: announce it
                        new.append((segment.id, segment.size, segment.fd))
                        segment.fd = None
                    numpy.copyto(segment.data[: view.nbytes], numpy.frombuffer(view, dtype=numpy.uint8))
                segment.state[0] = LENT
                self._lent_order.append(segment.id)
                shared.append(SharedBuffer(index, segment.id, HEADER_BYTES, view.nbytes))
            if body_bytes >= min_bytes and not self._closed:
                segment = self._segment_for(body_bytes, new, retired)
                if segment is not None:
                    if segment.fd is not None:  # made for a producer, which let it go unsent: announce it
                        new.append((segment.id, segment.size, segment.fd))
                        segment.fd = None
                    _gather(segment.data, body, body_bytes)
                    segment.state[0] = LENT
                    self._lent_order.append(segment.id)
                    shared.append(SharedBuffer(len(buffers), segment.id, HEADER_BYTES, body_bytes))
        return shared, inline, new, retired

    def _lend_made(self, segment: Segment, offset: int, nbytes: int, index: int, shared: list, new: list) -> bool:
        """Lend a buffer a producer made in ``segment`` as it is; False when it must be copied
        (the segment is lent already: its memory was sent before and is still in use)."""
        if segment.state[0] != FREE:
            return False
        if segment.fd is not None:
            if len(new) >= MAX_NEW_SEGMENTS_PER_FRAME:
                return False
            new.append((segment.id, segment.size, segment.fd))
            segment.fd = None
        segment.state[0] = LENT
        self._lent_order.append(segment.id)
        shared.append(SharedBuffer(index, segment.id, HEADER_BYTES + offset, nbytes))
        return True

    def sent(self, new: Sequence[Tuple[int, int, int]]) -> None:
        """The descriptors of ``new`` segments were sent (or the send failed): close ours."""
        for _id, _size, fd in new:
            os.close(fd)

    def _fitting(self, nbytes: int, announced: bool = False) -> Optional[Segment]:
        """The smallest available segment that holds ``nbytes`` and is at most twice that
        (with ``announced``: only one the trainer knows already), the oldest of those."""
        smallest = _segment_bytes(nbytes) - HEADER_BYTES  # what a segment made for it holds: none less
        lent, reusable, segments = self._lent_order, self._reusable, self._segments
        while lent:  # ids, not segments: a retired one's mapping goes at once
            segment = segments.get(lent[0])
            if segment is not None and segment.state[0] != FREE and len(lent) <= 2 * len(segments):
                break  # still lent (one held long is let go past twice the pool: the scan finds it then)
            lent.popleft()
            if segment is not None and segment.state[0] == FREE:
                heapq.heappush(reusable, segment.id)
        if len(reusable) > 2 * len(segments):  # ids pile up behind one that no size asked for fits
            reusable.clear()
        while reusable:  # the oldest first, as the scan below (and the trainer's SegmentMap expects)
            segment = segments.get(reusable[0])
            if segment is None or segment.state[0] != FREE or segment.in_hand:
                heapq.heappop(reusable)  # retired, or taken by the scan below since
            elif segment.capacity == smallest and not (announced and segment.fd is not None):
                heapq.heappop(reusable)
                return segment
            else:
                break
        best = None
        for segment in segments.values():  # the free ones (as :meth:`_free`), with no call per allocation
            capacity = segment.capacity
            if segment.state[0] != FREE or segment.in_hand:
                continue
            if nbytes <= capacity <= 2 * nbytes and not (announced and segment.fd is not None):
                if capacity == smallest:  # no smaller one further on: the rest are not looked at
                    return segment
                if best is None or capacity < best.capacity:
                    best = segment
        return best

    def _free(self) -> List[Segment]:
        """The segments neither lent to the trainer nor in a producer's hands (free to reuse or
        retire), oldest first; no call per segment (this runs for every allocation)."""
        free = []
        for segment in self._segments.values():
            if segment.state[0] == FREE and not segment.in_hand:
                free.append(segment)
        return free

    def _segment_for(self, nbytes: int, new: list, retired: list, view: Optional[memoryview] = None) -> Optional[Segment]:
        full = len(new) >= MAX_NEW_SEGMENTS_PER_FRAME  # no room for another descriptor in this frame
        fitting = self._fitting(nbytes, announced=full)
        if fitting is not None or full:
            return fitting
        return self._make_room_for(nbytes, retired, view, new)

    def _make_room_for(self, nbytes: int, retired: list, view: Optional[memoryview], new: list) -> Optional[Segment]:
        """A new segment for ``nbytes``, holding ``view``'s bytes if given, announced in ``new`` (see :meth:`_reserve`)."""
        size = self._reserve(nbytes, retired)
        if size is None:
            return None
        try:
            mapping, fd = _new_segment(size, view)
        except (OSError, ValueError) as exc:
            self._bytes -= size
            self._warn(exc)
            return None
        return self._register(size, mapping, fd, new)

    def _reserve(self, nbytes: int, retired: list) -> Optional[int]:
        """Room for a new segment for ``nbytes``, after retiring free segments past what the pool
        keeps (:meth:`_retire_surplus`): its size, counted in the pool's bytes; None if there is no room."""
        size = _segment_bytes(nbytes)
        bound = self._bound_bytes(size)
        self._retire_surplus(retired, size, bound)
        if self._bytes + size > max(self.max_bytes, bound):
            return None
        self._bytes += size
        return size

    def _bound_bytes(self, size: int) -> int:
        """What :meth:`bound` keeps with a new segment of ``size`` bytes: its frames, each of the
        frame's bytes or the largest segment if larger (0: not bound)."""
        if not self._frames:
            return 0
        largest = max(map(_SIZE, self._segments.values()), default=size)
        return self._frames * max(self._frame_bytes, largest, size)

    def _retire_surplus(self, retired: list, size: int, bound: int) -> None:
        """Retire free segments, smallest first, until the pool with a new one of ``size`` bytes
        holds at most what :meth:`bound` keeps (``bound`` bytes), or unbound ``max_bytes`` with at
        most ``max_free`` free segments left, one less with a new one to make."""
        free = self._free()
        free.sort(key=_CAPACITY)
        if bound:
            surplus, keep = 0, bound
        else:
            surplus, keep = len(free) - self.max_free + (1 if size else 0), self.max_bytes
        for segment in free:
            if surplus <= 0 and self._bytes + size <= keep:
                break
            self._retire(segment, retired)
            surplus -= 1

    def _register(self, size: int, mapping: SegmentMapping, fd: int, new: Optional[list]) -> Segment:
        """Add a new segment (its ``size`` already counted by :meth:`_reserve`); its descriptor goes
        in ``new``, or (made for a producer) stays with it until it is first lent."""
        segment = Segment(self._next_id, size, mapping)
        self._next_id += 1
        self._segments[segment.id] = segment
        if new is None:
            segment.fd = fd
        else:
            new.append((segment.id, size, fd))
        return segment

    def _retire(self, segment: Segment, retired: list) -> None:
        del self._segments[segment.id]
        self._bytes -= segment.size
        if segment.fd is not None:  # never announced: the trainer does not know it
            os.close(segment.fd)
            segment.fd = None
        else:
            retired.append(segment.id)

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("cannot create a shared memory segment (%s): large buffers go through the socket", exc)

    def close(self) -> None:
        """Drop every segment (the trainer's mappings keep what it still uses alive)."""
        with self._lock:
            self._closed = True
            _change_producer_pools(self, False)
            for segment in self._segments.values():
                if segment.fd is not None:
                    os.close(segment.fd)
                    segment.fd = None
            self._segments.clear()
            self._lent_order.clear()
            self._reusable.clear()
            self._in_hand.clear()
            self._made_by_producers.clear()
            self._bytes = 0
