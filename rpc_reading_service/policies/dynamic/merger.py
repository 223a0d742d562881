"""The trainer's half of "dynamic": one epoch's merger (leasing, receiving, resequencing).

The policy (:class:`~.trainer.Dynamic`) holds the settings; a :class:`DynamicMerger` per epoch
leases chunks by its :class:`~.leases.LeaseBook` and delivers their items; with a dispatch
point :class:`~.dispatched.DispatchedMerger` leases dispatched items instead.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Protocol, Tuple

from ...trainer.channel import (
    ChunkFinished,
    FrameReceived,
    ServersJoined,
    SessionLost,
    ShardEnded,
    UnitsDispatched,
    WorkerChannel,
)
from ...addresses import server_key
from ...errors import WorkerDrainedError, WorkerLostError
from ..base import EpochRun, Merger
from .leases import CHUNK_LEAD_SECONDS, MAX_CHUNK_DEPTH, WINDOW_BYTES_PER_WORKER, LeaseBook, checkpoint_schedule
from .schedule import DIVISOR, SMALLEST, ChunkSchedule, FixedChunks, GuidedChunks
from ..merge import next_frame, report_held_losses, take_items

__all__ = ["DynamicMerger", "DynamicSettings"]


class DynamicSettings(Protocol):
    """What a merger reads of its policy (:class:`~.trainer.Dynamic`)."""

    chunk_size: int
    max_chunk_size: int
    guided: bool
    depth: int
    window: Optional[int]

    @property
    def in_order(self) -> bool:
        """Whether delivery is resequenced by chunk."""


class DynamicMerger(Merger):
    """One dynamic epoch: keeps every worker leased, files items under their chunks, delivers them."""

    #: How many units a fast worker may hold, how much of its work ahead, and whether the default
    #: window grows while items are small.
    max_depth = MAX_CHUNK_DEPTH
    lead_seconds = CHUNK_LEAD_SECONDS
    sized_window = True

    def __init__(self, policy: DynamicSettings, run: EpochRun):
        self.run = run
        count = len(run.channels)
        window = self._window(policy, count)
        window_bytes = WINDOW_BYTES_PER_WORKER * count if policy.window is None and self.sized_window else None
        expected = run.hint if isinstance(run.hint, int) and not isinstance(run.hint, bool) else None
        schedule = self._schedule(policy, expected, count)
        self.book = LeaseBook(
            count, policy.chunk_size, policy.depth, max(window, policy.depth * count),
            max_depth=self.max_depth, window_bytes=window_bytes, lead_seconds=self.lead_seconds,
            expected_chunks=None if expected is None else schedule.chunks_below(expected), schedule=schedule,
        )  # fmt: skip
        if run.resume is not None:  # a checkpoint's open chunks: at most a window, and what a trainer-side stage held
            self.book.resume(run.resume, self.book.widest_window + (run.progress.recent.maxlen or 0))
        self.in_order = policy.in_order
        #: Items received and not yet handed on, by chunk (in order mode).
        self.buffers: Dict[int, Deque[Any]] = collections.defaultdict(collections.deque)
        #: The rank whose session produced each chunk's items (for the per-worker counts).
        self.producers: Dict[int, int] = {}
        #: The chunk of each of the latest items handed on (a checkpoint gives back undelivered ones).
        self.recent: Deque[int] = collections.deque(maxlen=run.progress.recent.maxlen)

    def _window(self, policy: DynamicSettings, workers: int) -> int:
        """The lease window's first size, in chunks."""
        return policy.window or 4 * policy.depth * max(1, workers)

    def _schedule(self, policy: DynamicSettings, expected: Optional[int], workers: int) -> ChunkSchedule:
        """The epoch's chunk bounds: a resumed epoch's own (positions are what a checkpoint
        holds); guided once the stream's length is expected (the previous epoch's); else fixed."""
        if self.run.resume is not None:
            schedule = checkpoint_schedule(self.run.resume)
            if schedule is not None:
                return schedule
        elif policy.guided and expected:
            return GuidedChunks(
                expected, workers, policy.chunk_size, policy.max_chunk_size, DIVISOR, SMALLEST,
                warmup=policy.depth * workers,
            )  # fmt: skip
        return FixedChunks(policy.chunk_size)

    def state(self, undelivered: int = 0) -> Dict[str, Any]:
        """The chunk book, giving back the last ``undelivered`` items handed on."""
        recent = list(self.recent)
        given_back = recent[len(recent) - undelivered :] if undelivered else []
        return self.book.state(given_back)

    def units(self) -> Dict[int, int]:
        """Chunks leased to each rank this epoch."""
        return dict(self.book.units)

    def hint(self) -> Optional[int]:
        """The stream's length in positions, once known: the next epoch's expected length (its
        guided schedule, and its estimate of what is left near its end)."""
        return self.book.length_hint()

    # -- leasing --------------------------------------------------------------------------------
    def _top_up(self, channel: WorkerChannel) -> None:
        book, leases = self.book, []
        if book.wants_leases(channel.rank):  # then up to its full depth, in one send
            now = time.monotonic()
            while (lease := book.lease(channel.rank, now)) is not None:
                leases.append(lease)
        finish = book.to_finish()
        if leases or channel.rank in finish:
            channel.lease(self.run.wire, self._with_bounds(leases), final=channel.rank in finish)
        self._finish(rank for rank in finish if rank != channel.rank)

    def _with_bounds(self, leases: List[Tuple[int, int]]) -> List[Tuple[int, int, int, int]]:
        """``(chunk, skip)`` leases as ``(chunk, skip, first position, positions)``, what LEASE carries."""
        bounds = self.book.bounds
        return [(chunk, skip, *bounds(chunk)) for chunk, skip in leases]

    def _top_up_all(self) -> None:
        for channel in self.run.channels:
            self._top_up(channel)
        self._finish_all()

    def _finish_all(self) -> None:
        self._finish(self.book.to_finish())

    def _finish(self, ranks: Iterable[int]) -> None:
        for rank in ranks:
            self.run.channels[rank].lease(self.run.wire, final=True)

    # -- the epoch ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        run, book, progress = self.run, self.book, self.run.progress
        channels = run.channels
        if not channels:  # the engine was closed
            progress.finish()
            return
        report_held_losses(channels, run.events)
        self._top_up_all()
        window_from = book.complete_below
        while not (book.over and len(book.ended) == len(channels)):
            if self.in_order:
                yield from self._deliver_ready()
                if book.over and len(book.ended) == len(channels):
                    break
            if book.complete_below != window_from:
                # Delivery moved the window: a chunk's last items may come after its report, so
                # the workers the window held back may wait for a lease with nothing to report.
                window_from = book.complete_below
                self._top_up_all()
            event = next_frame(run.events, progress)
            if isinstance(event, UnitsDispatched):  # the trainer's dispatcher pulled more units
                self._top_up_all()
                continue
            if isinstance(event, ServersJoined):  # a server joined: its sessions take the next leases
                self._adopt()
                continue
            rank = event.channel.rank
            if rank >= len(channels):  # a joined session's event came before the wake-up
                self._adopt()
            if rank >= len(channels) or event.channel is not channels[rank] or rank in progress.left:
                continue  # left over from a replaced (or closed) session
            if isinstance(event, ChunkFinished):
                done = event.chunk
                book.done_many(rank, done.chunk, done.counts, done.stream_length)
                self._top_up(event.channel)
                self._end_if_handed_back(event.channel)
                if done.stream_length is not None:
                    # The stream's end is known: the others may be leased its last chunks, or told
                    # that none come. A report gives them no other room: the window moves only as
                    # items are delivered, and the check above tops everyone up then.
                    self._top_up_all()
            elif isinstance(event, ShardEnded):
                self._stream_ended(event.channel)
            elif isinstance(event, FrameReceived):
                try:
                    items = take_items(event, run.wire)
                except WorkerLostError as exc:
                    self._replace(event.channel, exc)
                    continue
                book.received(len(items), event.frame.nbytes)
                start = 0
                for chunk, count in book.arrived(rank, len(items)):
                    self.producers[chunk] = rank
                    if self.in_order:
                        self.buffers[chunk].extend(items[start : start + count])
                    else:
                        for item in items[start : start + count]:
                            self._hand_on(rank, chunk)
                            yield item
                    start += count
                self._end_if_handed_back(event.channel)
            elif isinstance(event, SessionLost) and rank in book.ended and not (run.replace and run.reassign):
                event.channel.held_loss = event  # this epoch has all of its items: the next one needs it
            else:
                try:
                    take_items(event, run.wire)  # raises the worker's error, or that it was lost
                except WorkerLostError as exc:
                    self._replace(event.channel, exc)
        progress.finish()

    def _stream_ended(self, channel: WorkerChannel) -> None:
        """``channel``'s stream ended (END_OF_SHARD): its leases still outstanding lie past the stream's end."""
        self.book.end(channel.rank)
        self._end_if_handed_back(channel)
        self._finish_all()

    def _deliver_ready(self) -> Iterator[Any]:
        """Hand on the buffered items of the oldest chunks, in chunk order, as far as they are here.

        The per-item path of an in-order epoch: the chunk, its buffer, producer and count are
        looked up once per chunk, and each item costs a store of its chunk's count in the book
        (what a checkpoint reads) instead of a :meth:`LeaseBook.deliver` call; a chunk can only
        be complete once its last item here is handed on, so that is checked once, there."""
        book, buffers, recent, count = self.book, self.buffers, self.recent, self.run.progress.count
        delivered = book.delivered
        while not book.over:
            chunk = book.complete_below
            buffer = buffers.pop(chunk, None)
            if not buffer:
                return
            rank, handed = self.producers[chunk], delivered.get(chunk, 0)
            while buffer:
                item = buffer.popleft()
                handed += 1
                delivered[chunk] = handed
                if not buffer:
                    book.settle(chunk)  # as deliver() would have: complete before the item goes out
                recent.append(chunk)
                count(rank)
                yield item

    def _hand_on(self, rank: int, chunk: int) -> None:
        self.recent.append(chunk)
        self.book.deliver(chunk)
        self.run.progress.count(rank)

    def _adopt(self) -> None:
        """Lease to the sessions of servers that joined since the last call."""
        if self.run.join is None:
            return
        for channel in self.run.join():
            self.book.add_rank(channel.rank)
            self._top_up(channel)

    def _replace(self, lost: WorkerChannel, error: WorkerLostError) -> None:
        """Lease the lost session's chunks that were not delivered completely to its replacement."""
        if self.run.replace is None:
            raise error
        book, rank = self.book, lost.rank
        chunks = book.lost(rank)
        for chunk in chunks:
            self.buffers.pop(chunk, None)  # received but not handed on: the new lease sends them again
        channel = self.run.replace(lost, error)
        self.run.channels[rank] = channel
        if rank in book.handing_back or (isinstance(error, WorkerDrainedError) and self._has_peer(channel)):
            book.hand_back(rank, chunks)  # a drained session's take-over: its chunks, then it ends
        self._top_up(channel)
        self._end_if_handed_back(channel)

    def _has_peer(self, channel: WorkerChannel) -> bool:
        """Whether another session of the epoch is on ``channel``'s server (it stays a rank of the run)."""
        key, left = server_key(channel.address), self.run.progress.left
        return any(
            other is not channel and other.rank not in left and other.rank not in self.book.handing_back
            and server_key(other.address) == key
            for other in self.run.channels
        )  # fmt: skip

    def _end_if_handed_back(self, channel: WorkerChannel) -> None:
        """End ``channel``'s session once it handed back a drained session's chunks (its items are here)."""
        if self.book.handed_back(channel.rank):
            self.run.progress.left.add(channel.rank)
            channel.close()
