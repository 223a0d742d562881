"""``"dynamic"`` with a dispatch point: a unit is one dispatched item, leased and sent with its lease."""

from __future__ import annotations

import time
from typing import Iterable, List, Optional, Protocol, Tuple

from ...trainer.channel import WorkerChannel
from ...errors import ConfigurationError
from ...protocol import EncodedItem, EndOfInput, Items
from ..base import EpochRun
from .merger import DynamicMerger, DynamicSettings
from .leases import LEAD_SECONDS, MAX_DEPTH
from .schedule import ChunkSchedule, FixedChunks

__all__ = ["DispatchedMerger", "UnitSource"]


class UnitSource(Protocol):
    """What the merger uses of the trainer's dispatcher
    (:class:`~rpc_reading_service.trainer.engine.dispatch.UnitDispatch`): the dispatched items, by index."""

    #: Items pulled so far; the stream's length once it ended (None before).
    produced: int
    total: Optional[int]
    #: At most this many items and bytes per ITEMS frame.
    max_items: int
    max_bytes: int

    def item(self, index: int, keep: bool = True) -> EncodedItem:
        """Unit ``index``'s item; ``keep=False`` forgets it."""

    def want(self, seen: int) -> None:
        """Every unit below ``seen`` was leased: notify once there are more."""

    def advance(self, limit: int, released: int) -> None:
        """Pull up to ``limit``; forget the items below ``released``."""


class DispatchedMerger(DynamicMerger):
    """One "dynamic" epoch of a dispatching graph: leases dispatched items, sends them with their leases."""

    max_depth = MAX_DEPTH  # units, each sent with its item: not the deeper leases of chunks
    lead_seconds = LEAD_SECONDS
    sized_window = False

    def _schedule(self, policy: DynamicSettings, expected: Optional[int], workers: int) -> ChunkSchedule:
        """A unit is one item: unit ``k`` is position ``k`` of the dispatched stream."""
        return FixedChunks(1)

    def _window(self, policy: DynamicSettings, workers: int) -> int:
        """A unit is one item: by default the trainer's buffer is bound by as many items as chunks are."""
        return policy.window or 4 * policy.depth * max(1, workers) * policy.chunk_size

    def __init__(self, policy: DynamicSettings, run: EpochRun):
        super().__init__(policy, run)
        self.units_source: UnitSource = run.dispatched
        self.book.available = 0

    def _top_up(self, channel: WorkerChannel) -> None:
        book, source, rank = self.book, self.units_source, channel.rank
        book.available = source.produced
        if source.total is not None:
            book.length_known(source.total)  # a unit is a position
        leases = []
        # Each lease may need an ITEMS frame of its own: no more leases than credits (only binds
        # at the start of a session's epoch, before its first ITEM_CREDIT, which notifies).
        credits = channel.protocol.item_credits
        if book.wants_leases(rank):
            now = time.monotonic()
            while len(leases) < credits and (lease := book.lease(rank, now)) is not None:
                leases.append(lease)
        if leases:
            self._send_units(channel, leases)
        for finished in book.to_finish():
            self._end_input(self.run.channels[finished])
        if source.total is None and (book.next_chunk >= book.available or book.pending):
            source.want(book.available)  # the next top-up comes with a "dispatched" event
        # Pull a full lease depth per worker ahead, never past the lease window.
        ahead = book.next_chunk + MAX_DEPTH * len(self.run.channels)
        source.advance(min(book.complete_below + book.window, ahead), book.complete_below)

    def _finish(self, ranks: Iterable[int]) -> None:
        for rank in ranks:
            self._end_input(self.run.channels[rank])

    def _send_units(self, channel: WorkerChannel, leases: List[Tuple[int, int]]) -> None:
        """LEASE each unit, then its item in ITEMS frames (packed up to a frame's bounds), in one write."""
        frames: List[Items] = []
        source = self.units_source
        # Numbered from the frames the session's state machine counted (this thread is the only one
        # that sends them): one ITEMS frame per batch, sent together below.
        sequence = channel.protocol.input_progress[0]
        batch: List[EncodedItem] = []
        nbytes = 0
        for chunk, _skip in leases:
            item = source.item(chunk, keep=self.run.replace is not None and self.run.reassign)
            if batch and (len(batch) >= source.max_items or nbytes + item.nbytes > source.max_bytes):
                frames.append(Items(self.run.wire, sequence + len(frames), batch))
                batch, nbytes = [], 0
            batch.append(item)
            nbytes += item.nbytes
        frames.append(Items(self.run.wire, sequence + len(frames), batch))
        channel.lease(self.run.wire, self._with_bounds(leases), items=frames)

    def _end_input(self, channel: WorkerChannel) -> None:
        channel.send_input(EndOfInput(self.run.wire, channel.protocol.input_progress[1]))

    def _stream_ended(self, channel: WorkerChannel) -> None:
        """A worker's graph ends after its last unit; one that ends before (a DataPipe after the
        dispatch point that stops early) would lose the units it holds: say so, not a short epoch."""
        held = list(self.book.outstanding[channel.rank])
        if held:
            raise ConfigurationError(
                f"worker {channel.rank} ({channel.address}) ended its stream with {len(held)} dispatched items "
                f"(units {held[:5]}) leased to it and not taken by its graph: with distribution='dynamic' the graph "
                "after sharding_round_robin_dispatch must take every item it is given (no header() or other "
                "DataPipe that stops early there); move it before the dispatch point, or use distribution='round_robin'"
            )
        super()._stream_ended(channel)

