"""The trainer's book of a "dynamic" epoch's chunks: who holds which lease, what is done and delivered.

Pure bookkeeping (no I/O, no threads), driven by the dynamic merger; the rules it keeps (depth,
window, the tail rule) are in docs/architecture.md."""

from __future__ import annotations

import collections
import math
import statistics
import time
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from ...settings import MAX_POSITION
from ...errors import ConfigurationError
from .schedule import ChunkSchedule, FixedChunks, schedule_from_state

__all__ = [
    "LeaseBook", "check_book_state", "checkpoint_schedule", "SLOW_CHUNK_SECONDS", "MAX_CHUNK_DEPTH", "CHUNK_LEAD_SECONDS",
    "WINDOW_BYTES_PER_WORKER", "STRAGGLER_FACTOR", "WINDOW_SHARE",
    "PROBE_CHUNKS",
]  # fmt: skip

#: A worker whose chunks take longer than this (between its reports) is kept one chunk ahead only.
SLOW_CHUNK_SECONDS = 0.05
#: A worker whose chunks take less is kept this much of its own work ahead (more than ``depth``
#: chunks, up to :data:`MAX_DEPTH`): tiny items would otherwise wait for the round trip of every lease.
LEAD_SECONDS = 0.02
#: The lead of a chunked epoch's fast workers: chunks are reported in batches (one CHUNK_DONE for
#: the chunks finished since the last send), so each of them is timed at its share of the time
#: between reports, and 20 ms of lead would leave a worker of tiny items a few chunks, topped up
#: in many sends; 100 ms keeps it dozens ahead, topped up in few (each send hands the GIL around).
CHUNK_LEAD_SECONDS = 0.1
MAX_DEPTH = 16
#: A worker whose positions take longer than this many times the fleet's median is a straggler,
#: which the window rule (:meth:`LeaseBook.holds_window`) may keep from a chunk.
STRAGGLER_FACTOR = 2.0
#: The window rule: a straggler is not leased a chunk it would likely finish only after the others
#: had walked what they hold and this share of the window's positions.
WINDOW_SHARE = 0.5
#: A straggler kept idle by the window rule for this many of its chunks' time is leased one again
#: (its speed measured anew), so that one slow for a while only is not kept idle to the epoch's
#: end; not while the others would be done with the stream within that time.
PROBE_CHUNKS = 8
#: The default ``max_depth`` of a chunked epoch (a dispatched one keeps :data:`MAX_DEPTH` units).
MAX_CHUNK_DEPTH = 64
#: What the default window of a chunked epoch may hold per worker, in bytes received: what
#: round-robin's default credits let a worker queue (4 frames of up to 1 MiB).
WINDOW_BYTES_PER_WORKER = 4 * 1024 * 1024


class LeaseBook:
    """The chunks of one "dynamic" epoch over ``num_workers`` sessions (ranks)."""

    def __init__(
        self, num_workers: int, chunk_size: int, depth: int, window: int, slow_chunk_seconds: float = SLOW_CHUNK_SECONDS,
        max_depth: int = MAX_DEPTH, window_bytes: Optional[int] = None, expected_chunks: Optional[int] = None,
        lead_seconds: float = LEAD_SECONDS, schedule: Optional[ChunkSchedule] = None,
    ):  # fmt: skip
        self.chunk_size, self.depth, self.window = chunk_size, depth, window
        #: Where each chunk begins and ends (fixed chunks of ``chunk_size`` unless given).
        self.schedule = FixedChunks(chunk_size) if schedule is None else schedule
        #: The stream's chunks as the previous epoch had them (None: unknown), for :meth:`ends_last`.
        self.expected_chunks = expected_chunks
        self.slow_chunk_seconds, self.max_depth, self.lead_seconds = slow_chunk_seconds, max_depth, lead_seconds
        #: The window's bounds when it is sized by bytes (``window_bytes``), and the bytes and
        #: items received so far this epoch.
        self._window_bytes = window_bytes
        self._window_bounds = (window, max(window, 2 * max_depth * num_workers))
        self._bytes_received = self._items_received = 0
        #: When each rank last reported a chunk done, and how long a position of its chunks takes (smoothed).
        self._reported_at: Dict[int, float] = {}
        self.position_seconds: Dict[int, float] = {}
        #: Positions of the chunks each rank holds (not reported done), and when it started the
        #: oldest of them (its previous report, or its lease if it held nothing then).
        self._held: Dict[int, int] = {rank: 0 for rank in range(num_workers)}
        self._held_total = 0
        self._head_started: Dict[int, float] = {}
        #: When each rank holding nothing was leased a chunk (its time per position counts from there),
        #: and the ranks timed from a lease at their first report only (which counts their session's
        #: start: replaced by the next report's time, and not kept idle long by the window rule).
        self._idle_until: Dict[int, float] = {}
        self._first_timed: Set[int] = set()
        #: The fleet's median seconds per position and items per second (:meth:`_fleet`), and
        #: the reports since they were measured.
        self._median_seconds, self._fleet_rate, self._since_fleet = 0.0, 0.0, -1
        #: The latest report's time: what :meth:`ends_last` counts the work done of current chunks to.
        self._clock = 0.0
        #: Every chunk below was leased at least once.
        self.next_chunk = 0
        #: The number of chunks of the stream, once a worker's walk reached its end, and its
        #: length in positions once a worker reported it.
        self.stream_chunks: Optional[int] = None
        self.stream_length: Optional[int] = None
        self.outstanding: Dict[int, Deque[int]] = {rank: collections.deque() for rank in range(num_workers)}
        #: Per rank, ``(chunk, items still to come)`` of the chunks reported done before all their
        #: items arrived, oldest first; and the items arrived of its oldest outstanding chunk.
        self.arriving: Dict[int, Deque[Tuple[int, int]]] = {rank: collections.deque() for rank in range(num_workers)}
        self._arrived_of_head: Dict[int, int] = {rank: 0 for rank in range(num_workers)}
        #: The latest chunk leased to each rank's current session (-1: a fresh session).
        self.latest: Dict[int, int] = {rank: -1 for rank in range(num_workers)}
        #: The skip each outstanding chunk was leased with.
        self.skips: Dict[int, int] = {}
        #: ``(chunk, skip)`` to lease again (a lost session's, or a resumed epoch's), smallest first.
        self.pending: List[Tuple[int, int]] = []
        #: Items of each chunk in all (its skip plus what its worker reported), once done.
        self.totals: Dict[int, int] = {}
        #: Items delivered of each chunk that is not complete.
        self.delivered: Dict[int, int] = {}
        #: Every chunk below was delivered completely; ``complete`` holds the ones above.
        self.complete_below = 0
        self.complete: Set[int] = set()
        #: Ranks whose stream ended this epoch, and ranks told that no more leases come.
        self.ended: Set[int] = set()
        self.finished: Set[int] = set()
        #: Ranks whose session joined the epoch after it started (a new server's, or a lost one's replacement).
        self.joined: Set[int] = set()
        #: Ranks whose session only finishes a drained session's chunks (its take-over), and those
        #: chunks not leased yet: :meth:`hand_back`.
        self.handing_back: Dict[int, Set[int]] = {}
        #: Chunks leased per rank this epoch, less those that lay past the stream's end (``stats()``'s units).
        self.units: Dict[int, int] = {rank: 0 for rank in range(num_workers)}
        #: Chunks below this exist yet (None: all of them; a dispatched epoch's units exist once pulled).
        self.available: Optional[int] = None
        #: A resumed epoch's first chunk above its complete ones, while the stream's end is not known.
        self._resumed_complete: Optional[int] = None

    def add_rank(self, rank: int) -> None:
        """A session joined the epoch as ``rank`` (the next one): it is leased like the others from now on."""
        for book in (self.outstanding, self.arriving):
            book[rank] = collections.deque()
        self._held[rank] = self._arrived_of_head[rank] = self.units[rank] = 0
        self.latest[rank] = -1
        self.joined.add(rank)
        floor, ceiling = self._window_bounds
        self._window_bounds = (floor, max(ceiling, 2 * self.max_depth * len(self.outstanding)))

    def hand_back(self, rank: int, chunks: Sequence[int]) -> None:
        """``rank``'s new session takes over a drained one's ``chunks`` (pending) and is leased no
        other: it is done once they are (:meth:`handed_back`)."""
        self.handing_back[rank] = self.handing_back.get(rank, set()) | set(chunks)

    def handed_back(self, rank: int) -> bool:
        """Whether ``rank`` handing back delivered its chunks: it is then ended for the epoch."""
        if rank not in self.handing_back or self.handing_back[rank] or self.outstanding[rank] or self.arriving[rank]:
            return False
        del self.handing_back[rank]
        self.ended.add(rank)
        return True

    # -- leasing --------------------------------------------------------------------------------
    def lease(self, rank: int, now: Optional[float] = None) -> Optional[Tuple[int, int]]:
        """The next ``(chunk, skip)`` for ``rank`` if it has room and one is due, else None (recorded
        as leased), at ``now`` (monotonic; given, a worker's time waiting for it is not timed as work)."""
        if rank in self.ended or rank in self.finished or len(self.outstanding[rank]) >= self.depth_of(rank):
            return None
        latest, reserved = self.latest[rank], self.handing_back.get(rank)
        choice: Optional[Tuple[int, int]] = None
        for index, (chunk, skip) in enumerate(self.pending):
            if self.available is not None and chunk >= self.available:
                break  # pending is sorted: none after it exists yet either
            if chunk > latest and (reserved is None or chunk in reserved):  # a session walks its stream once
                size = self.schedule.size(chunk)
                if reserved is None and self.holds_window(rank, size, now) and self._others_may_take(rank, chunk, size, now):
                    return None
                choice = self.pending.pop(index)
                for chunks in self.handing_back.values():
                    chunks.discard(chunk)
                break
        if choice is None:
            if reserved is not None:
                return None
            chunk = self.next_chunk
            if self.stream_chunks is not None and chunk >= self.stream_chunks:
                return None
            if chunk >= self.complete_below + self.window or chunk <= latest:
                return None
            if self.available is not None and chunk >= self.available:
                return None
            if self.ends_last(rank) or self.holds_window(rank, self.schedule.size(chunk), now):
                return None
            self.next_chunk += 1
            choice = (chunk, 0)
        chunk, skip = choice
        if not self.outstanding[rank]:
            self._head_started[rank] = self._clock
            if now is not None:
                self._idle_until[rank] = now
        self.outstanding[rank].append(chunk)
        self._hold(rank, self.schedule.size(chunk))
        self.skips[chunk] = skip
        self.latest[rank] = chunk
        self.units[rank] += 1
        self.delivered.setdefault(chunk, skip)
        return choice

    def _others_may_take(self, rank: int, chunk: int, size: int, now: Optional[float]) -> bool:
        """Whether a session other than ``rank`` may be leased the pending ``chunk`` (of ``size``
        positions) at ``now``: one that has not walked past it, takes chunks and is not kept from it
        by the window rule itself (else holding it back would stall the window's head)."""
        idle = self.ended | self.finished
        return any(
            other != rank and latest < chunk and other not in idle and other not in self.handing_back
            and not self.holds_window(other, size, now)
            for other, latest in self.latest.items()
        )  # fmt: skip

    def bounds(self, chunk: int) -> Tuple[int, int]:
        """``(first position, positions)`` of ``chunk`` (what its LEASE tells the worker)."""
        return self.schedule.start(chunk), self.schedule.size(chunk)

    def _ahead(self, rank: int, per_position: float) -> float:
        """Positions ``rank`` still has to walk of the chunks it holds: those of its current chunk
        that it had not walked by the latest report (at ``per_position`` seconds each), and the rest."""
        if not self.outstanding[rank]:
            return 0.0
        walked = (self._clock - self._head_started.get(rank, self._clock)) / max(per_position, 1e-9)
        return max(0.0, self._held[rank] - min(walked, self.schedule.size(self.outstanding[rank][0])))

    def _hold(self, rank: int, positions: int) -> None:
        """``rank`` holds ``positions`` more (fewer, if negative) of leased chunks not reported done."""
        self._held[rank] += positions
        self._held_total += positions

    def _fleet(self) -> Tuple[float, float]:
        """The median seconds per position of the measured sessions, and the positions per second
        of the fleet (sessions whose stream ended left out; those not measured yet taken as fast
        as the measured ones on average); measured again once as many reports came as an eighth
        of the sessions measured (and at least one)."""
        seconds = self.position_seconds
        if self._since_fleet < 0 or self._since_fleet > len(seconds) // 8:
            idle = self.ended | self.finished
            working = [value for rank, value in seconds.items() if rank not in idle]
            self._median_seconds = statistics.median_low(working) if working else 0.0
            sessions = len(self.outstanding) - len(idle)
            self._fleet_rate = sum(1 / max(value, 1e-9) for value in working) * sessions / max(1, len(working))
            self._since_fleet = 0
        return self._median_seconds, self._fleet_rate

    def holds_window(self, rank: int, size: int, now: Optional[float] = None) -> bool:
        """Whether a straggler ``rank`` taking a chunk of ``size`` positions at ``now`` would likely
        hold the window's head: finish it only after the others walked what they hold and
        :data:`WINDOW_SHARE` of the window (the window rule of docs/architecture.md)."""
        mine = self.position_seconds.get(rank)
        if mine is None:
            return False  # not measured yet
        median, rate = self._fleet()
        if mine <= STRAGGLER_FACTOR * median:
            return False  # not a straggler: half the fleet or more is never held back
        others = rate - 1 / max(mine, 1e-9)
        if others <= 0:
            return False
        if self._probe(rank, size * mine, others, now):
            return False
        mine_end = (self._ahead(rank, mine) + size) * mine
        return mine_end * others > self._held_total - self._held[rank] + WINDOW_SHARE * self.window * size

    def _probe(self, rank: int, chunk_seconds: float, others: float, now: Optional[float]) -> bool:
        """Whether straggler ``rank``, idle, is due a chunk (of ``chunk_seconds`` at its speed) to be
        measured anew: idle for :data:`PROBE_CHUNKS` such chunks (one, if timed by its first
        report only), and the others (``others`` positions per second) would not be done with the
        expected stream sooner."""
        if self.outstanding[rank]:
            return False
        due = (1 if rank in self._first_timed else PROBE_CHUNKS) * chunk_seconds
        if (self._clock if now is None else now) - self._reported_at.get(rank, math.inf) <= due:
            return False
        expected = self.stream_chunks if self.stream_chunks is not None else self.expected_chunks
        if expected is None or self.next_chunk >= expected:
            return True  # how much is left is not known
        return self.schedule.start(expected) - self.schedule.start(self.next_chunk) > due * others

    def ends_last(self, rank: int) -> bool:
        """Whether ``rank`` taking the next chunk would likely end the epoch later than leaving it to
        the others (the tail rule of docs/architecture.md; times are measured seconds per position)."""
        expected = self.stream_chunks if self.stream_chunks is not None else self.expected_chunks
        mine = self.position_seconds.get(rank)
        if expected is None or mine is None or self.next_chunk >= expected:
            return False  # the stream's length is unknown (or runs past the previous epoch's)
        schedule = self.schedule
        size = schedule.size(self.next_chunk)
        left = schedule.start(expected) - schedule.start(self.next_chunk)
        left += sum(schedule.size(chunk) for chunk, _skip in self.pending)
        mine_end = (self._ahead(rank, mine) + size) * mine
        if left * min(self.position_seconds.values()) >= mine_end * len(self.outstanding):
            return False  # far from the end: even the fastest could not do what is left before ``rank`` is done
        rate, held, soonest, fastest = 0.0, 0.0, math.inf, math.inf
        for other in self.outstanding:
            if other == rank or other in self.ended or other in self.finished:
                continue
            seconds = self.position_seconds.get(other)
            if seconds is None:
                return False  # not measured yet: no estimate
            ahead = self._ahead(other, seconds)
            rate += 1 / max(seconds, 1e-9)
            held += ahead
            soonest = min(soonest, (ahead + size) * seconds)
            fastest = min(fastest, seconds)
        if not rate:
            return False
        others_end = max((left + held) / rate, soonest)
        return mine_end > others_end + 0.5 * fastest * size

    def wants_leases(self, rank: int) -> bool:
        """Whether ``rank`` is due a top-up: it holds at most half its :meth:`depth_of` (then it is
        leased up to the full depth at once, so a fast worker gets its leases a few in one send
        instead of one per chunk it reports done), and the window has room for half its depth
        (else every chunk delivered would cost a send of one lease) or it holds nothing."""
        held, depth = len(self.outstanding[rank]), self.depth_of(rank)
        if held > depth // 2:
            return False
        if not held or self.pending:
            return True
        room = self.complete_below + self.window - self.next_chunk
        if self.stream_chunks is not None:
            room = min(room, self.stream_chunks - self.next_chunk)
        return room >= min(depth - held, max(1, depth // 2)) or (self.stream_chunks is not None and room > 0)

    def depth_of(self, rank: int) -> int:
        """Chunks ``rank`` may hold ahead: ``depth`` (1 for a session that joined the epoch, until
        its speed is measured); for a worker whose chunks take long, 1, or at
        most 2 while the stream's length is known or expected (then :meth:`ends_last` keeps a
        second chunk from the worker that would end the epoch with it, and the others do not
        wait a lease's round trip at each chunk boundary); more for one whose chunks take less
        than a round trip (enough for ``lead_seconds`` of its work); all its chunks for one handing back."""
        if rank in self.handing_back:  # all of them at once: no other session can start that far back
            return max(self.depth, len(self.outstanding[rank]) + len(self.handing_back[rank]))
        per_position = self.position_seconds.get(rank)
        if per_position is None:  # a session that joined mid-epoch may be a straggler: one chunk until measured
            return 1 if rank in self.joined else self.depth
        seconds = per_position * self.schedule.size(self.next_chunk)
        if seconds >= self.slow_chunk_seconds:
            known = self.stream_chunks is not None or self.expected_chunks is not None
            return min(self.depth, 2) if known else 1
        return max(self.depth, min(self.max_depth, math.ceil(self.lead_seconds / max(seconds, 1e-6))))

    def to_finish(self) -> List[int]:
        """Ranks to tell that no more chunks come (the stream's end is known and nothing is pending)."""
        if self.stream_chunks is None or self.pending or self.next_chunk < self.stream_chunks:
            return []
        ranks = [r for r in self.outstanding if r not in self.finished and r not in self.ended]
        self.finished.update(ranks)
        return ranks

    # -- what the workers report ----------------------------------------------------------------
    def arrived(self, rank: int, count: int) -> List[Tuple[int, int]]:
        """File ``count`` items that came from ``rank`` (one DATA frame): ``(chunk, items)`` in order.

        A worker reports a chunk done as soon as its last item is packed, so the first items
        of a frame may finish chunks reported before it; the rest belong to its oldest lease
        not reported done."""
        segments: List[Tuple[int, int]] = []
        arriving = self.arriving[rank]
        while count and arriving:
            chunk, left = arriving[0]
            taken = min(left, count)
            segments.append((chunk, taken))
            count -= taken
            if taken == left:
                arriving.popleft()
            else:
                arriving[0] = (chunk, left - taken)
        if count:
            segments.append((self.outstanding[rank][0], count))  # the state machine checked there is one
            self._arrived_of_head[rank] += count
        return segments

    def received(self, items: int, nbytes: int) -> None:
        """A DATA frame of ``items`` items and ``nbytes`` bytes arrived: with ``window_bytes``, size the
        window to the chunks that many bytes hold at the epoch's bytes per item, within its bounds."""
        if self._window_bytes is None or not items:
            return
        self._bytes_received += nbytes
        self._items_received += items
        chunk_bytes = self.schedule.largest * self._bytes_received / self._items_received
        floor, ceiling = self._window_bounds
        self.window = max(floor, min(ceiling, int(self._window_bytes / chunk_bytes)))

    def done(self, rank: int, chunk: int, items: int, stream_length: Optional[int], now: Optional[float] = None) -> None:
        """``rank`` finished ``chunk`` with ``items`` items (after its skip), at ``now`` (monotonic)."""
        self.done_many(rank, chunk, (items,), stream_length, now)

    def done_many(
        self, rank: int, chunk: int, counts: Sequence[int], stream_length: Optional[int], now: Optional[float] = None
    ) -> None:  # fmt: skip
        """``rank`` finished its oldest leases, from ``chunk`` on, with ``counts`` items each (after
        their skips), at ``now`` (monotonic): one CHUNK_DONE. Each of their positions took its share
        of the time since ``rank``'s previous report."""
        now = time.monotonic() if now is None else now
        previous, idle_until = self._reported_at.get(rank), self._idle_until.pop(rank, None)
        first = previous is None
        if idle_until is not None and (previous is None or idle_until > previous):
            previous = idle_until  # it held nothing until then: waiting is not work
        self._reported_at[rank] = self._head_started[rank] = now
        self._clock = max(self._clock, now)
        assert self.outstanding[rank][0] == chunk, (self.outstanding[rank][0], chunk)  # the state machine checked it
        if previous is not None:
            outstanding, size = self.outstanding[rank], self.schedule.size
            positions = sum(size(outstanding[index]) for index in range(len(counts)))
            seconds, last = (now - previous) / positions, self.position_seconds.get(rank)
            if last is None or rank in self._first_timed:  # a first report's time counts the session's start
                self.position_seconds[rank] = seconds
            else:
                self.position_seconds[rank] = 0.5 * last + 0.5 * seconds
            (self._first_timed.add if first else self._first_timed.discard)(rank)
            self._since_fleet += 1
        for items in counts:
            self._done(rank, items, stream_length)

    def _done(self, rank: int, items: int, stream_length: Optional[int]) -> None:
        """``rank``'s oldest lease is done with ``items`` items."""
        chunk = self.outstanding[rank].popleft()
        self._hold(rank, -self.schedule.size(chunk))
        to_come = items - self._arrived_of_head[rank]
        self._arrived_of_head[rank] = 0
        if to_come > 0:
            self.arriving[rank].append((chunk, to_come))
        self.totals[chunk] = self.skips.pop(chunk) + items
        if stream_length is not None:
            self.length_known(stream_length)
            if self.schedule.start(chunk) >= stream_length:
                self.units[rank] -= 1  # it lay past the end: stats() counts the chunks a worker worked on
        self._maybe_complete(chunk)

    def end(self, rank: int) -> None:
        """``rank``'s stream ended: its leases still outstanding lie past the end of the stream."""
        self.ended.add(rank)
        leftover = self.outstanding[rank]
        if leftover:
            self.stream_ends_at(leftover[0])
        while leftover:
            chunk = leftover.popleft()
            self._hold(rank, -self.schedule.size(chunk))
            if self.skips[chunk]:
                raise _refuse(f"has items of chunk {chunk} delivered, which lies past the end of this epoch's stream")
            self.totals[chunk] = self.skips.pop(chunk)
            self.units[rank] -= 1  # it lay past the end, as in done()
            self._maybe_complete(chunk)

    def length_known(self, length: int) -> None:
        """The stream has ``length`` positions (a worker's walk reached its end, or the trainer's dispatcher's)."""
        self.stream_length = length if self.stream_length is None else min(self.stream_length, length)
        self.stream_ends_at(self.schedule.chunks_below(length))

    def stream_ends_at(self, chunks: int) -> None:
        """The stream has at most ``chunks`` chunks (a rank's walk ended before a lease of one of them arrived)."""
        self.stream_chunks = chunks if self.stream_chunks is None else min(self.stream_chunks, chunks)
        if self._resumed_complete is not None and self._resumed_complete > self.stream_chunks:
            raise _refuse(
                f"has chunks up to {self._resumed_complete - 1} complete, but the stream has {self.stream_chunks} "
                "chunks in this epoch (was the checkpoint edited, or the data changed?)"
            )
        past = [(chunk, skip) for chunk, skip in self.pending if chunk >= self.stream_chunks]
        for chunk, skip in past:  # a resumed book's open chunks there hold nothing: none to wait for
            if skip:
                raise _refuse(f"has items of chunk {chunk} delivered, which lies past the end of this epoch's stream")
            self.pending.remove((chunk, skip))
            self.delivered.pop(chunk, None)

    def lost(self, rank: int) -> List[int]:
        """``rank``'s session is lost: its chunks not done, and the ones done whose items did not
        all arrive, go back to pending (skipping what was delivered of them) and its
        replacement starts fresh. Returns those chunks."""
        arriving = [chunk for chunk, _left in self.arriving[rank]]
        for chunk in arriving:
            del self.totals[chunk]
        for chunk in self.outstanding[rank]:
            self.skips.pop(chunk)
        chunks = arriving + list(self.outstanding[rank])
        self.pending.extend((chunk, self.delivered.get(chunk, 0)) for chunk in chunks)
        self.pending.sort()
        self.outstanding[rank].clear()
        self._hold(rank, -self._held[rank])
        self.arriving[rank].clear()
        self._arrived_of_head[rank] = 0
        self._reported_at.pop(rank, None)
        self._idle_until.pop(rank, None)
        self._first_timed.discard(rank)
        self.position_seconds.pop(rank, None)
        self.latest[rank] = -1
        self.ended.discard(rank)
        self.finished.discard(rank)
        self.joined.add(rank)
        return chunks

    # -- delivery -------------------------------------------------------------------------------
    def deliver(self, chunk: int) -> None:
        """One more item of ``chunk`` was handed on."""
        delivered = self.delivered[chunk] = self.delivered.get(chunk, 0) + 1
        total = self.totals.get(chunk)
        if total is not None and delivered >= total:
            self._complete(chunk)

    def settle(self, chunk: int) -> None:
        """Complete ``chunk`` if every item of it was handed on: for a caller that counts the items
        handed on in :attr:`delivered` itself (one store per item instead of a :meth:`deliver` call)."""
        self._maybe_complete(chunk)

    def _maybe_complete(self, chunk: int) -> None:
        total = self.totals.get(chunk)
        if total is not None and self.delivered.get(chunk, 0) >= total:
            self._complete(chunk)

    def _complete(self, chunk: int) -> None:
        """Every item of ``chunk`` was delivered."""
        self.delivered.pop(chunk, None)
        self.complete.add(chunk)
        while self.complete_below in self.complete:
            self.complete.discard(self.complete_below)
            self.complete_below += 1

    @property
    def over(self) -> bool:
        """Every chunk of the stream was delivered completely."""
        return self.stream_chunks is not None and self.complete_below >= self.stream_chunks

    # -- checkpoint -----------------------------------------------------------------------------
    def state(self, given_back: List[int]) -> Dict[str, Any]:
        """The book as a checkpoint (JSON-able): what was delivered, as if the items of the chunks
        in ``given_back`` (the latest delivered, one entry per item) had not been."""
        delivered = dict(self.delivered)
        complete, below = set(self.complete), self.complete_below
        for chunk in given_back:
            if chunk < below:  # reopen it: the chunks above it stay complete
                complete.update(range(chunk, below))
                below = chunk
            if chunk in complete:
                complete.discard(chunk)
                delivered[chunk] = self.totals[chunk]
            delivered[chunk] -= 1
        # Chunks past the stream's end hold nothing: left out, as if never leased (a resumed epoch
        # that does not know the end yet refuses chunks complete past it: resume).
        top = self.next_chunk if self.stream_chunks is None else min(self.next_chunk, self.stream_chunks)
        below = min(below, top)
        state = {
            "chunk_size": self.chunk_size,
            "next_chunk": top,
            "complete_below": below,
            "complete": sorted(c for c in complete if below <= c < top),
            "delivered": [[c, n] for c, n in sorted(delivered.items()) if n > 0 and below <= c < top and c not in complete],
        }
        schedule = self.schedule.state()
        if schedule is not None:  # a guided epoch's bounds (fixed chunks: chunk_size, as before it existed)
            state["schedule"] = schedule
        length = self.length_hint() if self.over else self.stream_length
        if length is not None:  # the next epoch's expected length, also after a checkpoint between epochs
            state["stream_length"] = length  # never a bound: a resumed epoch takes it as known (resume)
        return state

    def length_hint(self) -> Optional[int]:
        """The stream's length in positions as far as known: reported, else where the first chunk
        past its end begins (exact once the epoch is over; None: its end not reached)."""
        if self.stream_length is not None:
            return self.stream_length
        return None if self.stream_chunks is None else self.schedule.start(self.stream_chunks)

    @property
    def widest_window(self) -> int:
        """The most chunks the window can span this epoch (it may grow to this: :meth:`received`)."""
        return self._window_bounds[1]

    def resume(self, state: Mapping[str, Any], open_limit: int) -> None:
        """Start from a checkpoint's :meth:`state`: every chunk not complete is leased again (the
        book must have been built with the state's schedule: :func:`checkpoint_schedule`).
        ``open_limit``: the most chunks a checkpoint of this run can hold open (leased, not complete)."""
        below, top, complete = state["complete_below"], state["next_chunk"], set(state["complete"])
        if top - below - len(complete) > open_limit:
            raise _refuse(
                f"has {top - below - len(complete)} chunks open (next_chunk {top}, complete_below {below}), more "
                f"than a run of this configuration can have ({open_limit}): it was edited, or taken with a larger "
                "window or depth (resume with the same Dynamic settings)"
            )
        known = state.get("stream_length")
        if known is not None and top > self.schedule.chunks_below(known) + open_limit:
            raise _refuse(f"has next_chunk {top}, past the end of its stream of {known} positions")
        #: With the stream's end unknown at the checkpoint, no chunk at or past it was complete then.
        self._resumed_complete = None if known is not None else max(complete, default=below - 1) + 1
        self.stream_length = known  # so that a checkpoint of this epoch holds it too
        self.next_chunk, self.complete_below, self.complete = top, below, complete
        partial = {c: n for c, n in state["delivered"]}
        self.pending = [(c, partial.get(c, 0)) for c in range(below, top) if c not in complete]
        self.delivered = {c: n for c, n in self.pending}


_BOOK_KEYS = frozenset({"chunk_size", "next_chunk", "complete_below", "complete", "delivered"})


def _refuse(problem: str) -> ConfigurationError:
    return ConfigurationError(
        f"malformed RPCReadingService checkpoint: the 'dynamic' distribution state {problem}. Resume from an "
        "unmodified state_dict() taken with distribution='dynamic' and the same chunk_size"
    )


def checkpoint_schedule(state: Mapping[str, Any]) -> Optional[ChunkSchedule]:
    """The chunk bounds of a checked checkpoint's epoch: its guided schedule, or None (fixed
    chunks of its ``chunk_size``: every checkpoint taken before guided schedules existed)."""
    schedule = state.get("schedule")
    return None if schedule is None else schedule_from_state(schedule, _refuse)


def check_book_state(state: Any, chunk_size: int) -> None:
    """Refuse a malformed "dynamic" checkpoint state (or one taken with another ``chunk_size``)."""
    refuse = _refuse

    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63

    if not isinstance(state, dict) or not _BOOK_KEYS <= set(state) <= _BOOK_KEYS | {"schedule", "stream_length"}:
        raise refuse(
            "must be an object with chunk_size, next_chunk, complete_below, complete and delivered (and a "
            f"guided epoch's schedule, the stream's length once known), got {state!r:.200}"
        )
    if state["chunk_size"] != chunk_size:
        raise refuse(f"was taken with chunk_size={state['chunk_size']!r}, this run has chunk_size={chunk_size}")
    if not (count(state["next_chunk"]) and count(state["complete_below"])) or state["complete_below"] > state["next_chunk"]:
        raise refuse("has next_chunk and complete_below that are not counts with complete_below <= next_chunk")
    below, top = state["complete_below"], state["next_chunk"]
    complete = state["complete"]
    if not isinstance(complete, list) or not all(count(c) and below < c < top for c in complete):
        raise refuse("has 'complete' chunks outside (complete_below, next_chunk)")
    delivered = state["delivered"]
    if not isinstance(delivered, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and count(pair[0]) and count(pair[1]) and below <= pair[0] < top
        and pair[0] not in complete
        for pair in delivered
    ):
        raise refuse("has 'delivered' entries that are not [chunk, items] pairs of incomplete leased chunks")
    if "stream_length" in state and not count(state["stream_length"]):
        raise refuse(f"has a stream_length that is not a count: {state['stream_length']!r:.40}")
    schedule: ChunkSchedule = FixedChunks(chunk_size)
    if "schedule" in state:
        schedule = schedule_from_state(state["schedule"], refuse)
        if schedule.first_size != chunk_size:
            raise refuse(f"has a schedule with first_size={schedule.first_size}, not its chunk_size={chunk_size}")
    if schedule.start(top) > MAX_POSITION:
        raise refuse(f"has next_chunk {top}, which begins past the last position of any stream")
