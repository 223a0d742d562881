"""A shared-memory segment as the worker's pool and the trainer's map both see it (docs/architecture.md)."""

from __future__ import annotations

import weakref
from typing import Optional, Tuple

import numpy

from .mappings import SegmentMapping

__all__ = ["HEADER_BYTES", "FREE", "LENT", "Segment"]

#: Bytes before a segment's data: byte 0 is its state (lent to the trainer, or free).
HEADER_BYTES = 64
#: A segment's state byte: free to reuse (the trainer let go), or lent to the trainer.
FREE, LENT = 0, 1


class Segment:
    """One shared-memory segment as either end maps it: a header (byte 0 its state) and the data."""

    __slots__ = ("id", "size", "capacity", "mapping", "state", "data", "address", "fd", "in_hand", "hand", "hand_key",
                 "held_in", "pinned", "resident")

    def __init__(self, segment_id: int, size: int, mapping: SegmentMapping):
        self.id = segment_id
        self.size = size
        self.capacity = size - HEADER_BYTES  # its data's bytes
        self.mapping = mapping
        self.state = memoryview(mapping).cast("B")[:1]
        self.data = numpy.frombuffer(mapping, dtype=numpy.uint8, offset=HEADER_BYTES)
        self.address = self.data.ctypes.data
        self.fd: Optional[int] = None  # a segment made for a producer: its descriptor, until announced
        self.in_hand = False  # memory of it given to a producer lives in this process
        self.hand: Optional[weakref.ref] = None  # that memory, whose end puts the segment down
        self.hand_key = 0  # the id of that memory (a key of its pool's map of memory in hand)
        self.held_in: Tuple[dict, ...] = ()  # the pool's maps that hold it while in hand
        self.pinned = False  # page-locked for CUDA (a trainer's pin_memory): see SegmentMap
        self.resident = True  # its pages are mapped in this process (see SegmentMap.bound)

    def put_down(self, _memory: weakref.ref) -> None:
        """The memory given to a producer is gone (a weak reference's callback): out of its pool's
        maps, then free to hand out again (in that order: another thread may hand it out at once)."""
        held_in, self.held_in = self.held_in, ()
        if held_in:
            by_memory, made_by_producers = held_in
            by_memory.pop(self.hand_key, None)
            made_by_producers.pop(self.id, None)
        self.hand = None
        self.in_hand = False
