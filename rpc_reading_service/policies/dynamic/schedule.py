"""Where the chunks of a "dynamic" epoch begin and end: a pure function of the position.

:class:`FixedChunks` while the stream's length is unknown, :class:`GuidedChunks` (guided
self-scheduling with factoring) once it is expected; see docs/architecture.md."""

from __future__ import annotations

import bisect
from typing import Any, Dict, List, Optional

__all__ = ["ChunkSchedule", "FixedChunks", "GuidedChunks", "schedule_from_state", "DIVISOR", "LARGEST", "SMALLEST"]

#: The guided schedule's defaults (how they were chosen: benchmarks/NOTES.md).
DIVISOR = 8
LARGEST = 256
SMALLEST = 1


class ChunkSchedule:
    """The bounds of every chunk of one epoch's stream (chunk ``c``: ``[start(c), start(c + 1))``)."""

    #: The largest chunk of the schedule (what the trainer's window is sized by).
    largest: int = 1

    def start(self, chunk: int) -> int:
        """The first position of ``chunk``."""
        raise NotImplementedError

    def size(self, chunk: int) -> int:
        """The positions of ``chunk``."""
        return self.start(chunk + 1) - self.start(chunk)

    def chunks_below(self, length: int) -> int:
        """How many chunks start before position ``length`` (a stream of ``length`` positions has these)."""
        raise NotImplementedError

    def state(self) -> Optional[Dict[str, int]]:
        """The schedule as a checkpoint (JSON-able); None for fixed chunks (the checkpoint's ``chunk_size``)."""
        return None


class FixedChunks(ChunkSchedule):
    """Chunks of ``size`` positions each."""

    def __init__(self, size: int):
        self.largest = self._size = size

    def start(self, chunk: int) -> int:
        """``chunk * size``."""
        return chunk * self._size

    def size(self, chunk: int) -> int:
        """``size``."""
        return self._size

    def chunks_below(self, length: int) -> int:
        """``ceil(length / size)``."""
        return -(-length // self._size)


class GuidedChunks(ChunkSchedule):
    """Chunks shrinking with what is left of an expected ``length`` (docs/architecture.md).

    Kept as three runs of chunks, so that a long stream costs no list of millions of starts:
    the warm-up chunks, the chunks of ``largest`` positions (while much is left) and the
    shrinking tail."""

    def __init__(
        self, length: int, workers: int, first_size: int, largest: int = LARGEST, divisor: int = DIVISOR,
        smallest: int = SMALLEST, warmup: int = 0,
    ):  # fmt: skip
        self.length, self.workers, self.first_size = length, workers, first_size
        self.largest, self.divisor, self.smallest, self.warmup = largest, divisor, smallest, warmup
        share = divisor * workers
        position, head = 0, [0]
        while len(head) <= warmup and position < length:
            position += self._size_at(length - position, share, first_size)
            head.append(position)
        #: The starts of the warm-up chunks, and of the chunk after them.
        self._head = head
        #: The chunks of ``largest`` positions: as many as start while more than ``share * (largest - 1)`` is left.
        self._capped = max(0, -(-(length - position - share * (largest - 1)) // largest))
        position += self._capped * largest
        #: The starts of the shrinking chunks, from the first after the capped ones, and ``length``.
        self._tail = [position]
        while position < length:
            position += self._size_at(length - position, share, largest)
            self._tail.append(position)
        self._first_tail = len(head) - 1 + self._capped
        #: Chunks below this lie within the expected length.
        self._guided = self._first_tail + len(self._tail) - 1

    def _size_at(self, left: int, share: int, most: int) -> int:
        return min(most, max(self.smallest, -(-left // share)), left)

    def start(self, chunk: int) -> int:
        """The first position of ``chunk`` (past the expected length: chunks of ``first_size``)."""
        head = len(self._head) - 1
        if chunk < head:
            return self._head[chunk]
        if chunk < self._first_tail:
            return self._head[-1] + (chunk - head) * self.largest
        if chunk <= self._guided:
            return self._tail[chunk - self._first_tail]
        return self.length + (chunk - self._guided) * self.first_size

    def chunks_below(self, length: int) -> int:
        """How many chunks start before position ``length``."""
        if length > self.length:
            return self._guided + -(-(length - self.length) // self.first_size)
        if length <= self._head[-1]:
            return bisect.bisect_left(self._head, length)
        if length <= self._tail[0]:
            return len(self._head) - 1 + -(-(length - self._head[-1]) // self.largest)
        return self._first_tail + bisect.bisect_left(self._tail, length)

    def state(self) -> Dict[str, int]:
        """Everything the bounds depend on (the constructor's arguments)."""
        return {key: getattr(self, key) for key in _STATE_KEYS}


#: The most chunk bounds a checkpoint's guided schedule may keep (about 8 MB; a run of 10000
#: worker sessions with the defaults keeps under a million).
MAX_SCHEDULE_ENTRIES = 2**20

#: What a guided schedule's bounds depend on: its constructor's arguments, and its checkpoint's keys.
_STATE_KEYS = ("length", "workers", "first_size", "largest", "divisor", "smallest", "warmup")


def schedule_from_state(state: Any, refuse: Any) -> GuidedChunks:
    """The :class:`GuidedChunks` of a checkpoint's ``schedule`` entry; ``refuse(problem)`` builds the
    error for a malformed one (a :class:`~rpc_reading_service.errors.ConfigurationError`)."""
    if not isinstance(state, dict) or set(state) != set(_STATE_KEYS):
        raise refuse(f"has a 'schedule' that is not an object with {', '.join(_STATE_KEYS)}: {state!r:.200}")
    for key in _STATE_KEYS:
        value = state[key]
        least = 0 if key in ("length", "warmup") else 1
        if not isinstance(value, int) or isinstance(value, bool) or not least <= value < 2**40:
            raise refuse(f"has a 'schedule' whose {key} is {value!r:.40}, expected an integer of at least {least}")
    # The warm-up chunks and the shrinking tail are lists, of at most ``warmup`` and about
    # ``share * ln(largest)`` entries (each tail chunk takes a ``share``-th of what is left), each
    # at most ``length``.
    length, share = state["length"], state["divisor"] * state["workers"]
    entries = min(state["warmup"], length) + min(length, share * (2 + state["largest"].bit_length()))
    if entries > MAX_SCHEDULE_ENTRIES:
        raise refuse(
            f"has a 'schedule' of {state['workers']} workers, divisor {state['divisor']}, warmup {state['warmup']} "
            f"and largest {state['largest']}: far more chunk bounds than any run's ({entries:.3g} > {MAX_SCHEDULE_ENTRIES})"
        )
    return GuidedChunks(**state)

