"""``"dynamic"``: chunks of the stream leased on demand, results resequenced by chunk.

Every worker walks the sharded stream (the stream at the ``sharding_filter``) and keeps
the chunks leased to it (:class:`~rpc_reading_service.selection.LeasedChunks`), each a run of
consecutive positions whose bounds its LEASE gives. Chunk bounds are a pure function of the
position (:mod:`.schedule`): ``chunk_size`` positions while the stream's length is unknown
(a run's first epoch); once the previous epoch's length is known, a guided schedule: chunks of
up to ``max_chunk_size`` positions while much is left, shrinking to single items at the end.
The trainer leases chunks in increasing order to whichever worker has room, keeping each
``depth`` chunks ahead so it never waits; a fast worker reports its chunks done sooner and
so gets more of them. Delivery is resequenced by chunk (chunk 0's items, then chunk 1's ...):
the same seed gives the same items in the same order whatever the workers' speeds, or with
``in_order=False`` items go on as they arrive. A lost worker's chunks that were not
delivered completely are leased again to its replacement, skipping what was delivered
(exactly once); a checkpoint records which chunks were delivered, and how much of the
partly delivered ones.

On the wire a chunk costs (nearly) nothing of its own: its item count leaves in a CHUNK_DONE
as soon as its last item is packed, ahead of the DATA frame that holds that item, so the
items of many chunks share one packed frame and the trainer splits a frame by the counts
(:meth:`~.leases.LeaseBook.arrived`); one CHUNK_DONE carries the counts of every chunk the
worker finished since its last send, and one LEASE grants a run of consecutive chunks.
Leases go out several at a time, further ahead for a worker whose chunks finish fast. Chunk boundaries are positions of the stream, never
a matter of timing: the per-chunk seeds keep the same seed giving the same items.

Buffering is bounded by ``window``: no chunk at or past (the oldest chunk not delivered
completely + ``window``) is leased, so at most ``window`` chunks of items wait in the trainer.
The default window grows while the items are small (to what 4 MiB per worker holds), so that
a fast worker of tiny items is leased dozens of chunks per send instead of a few.

The DataPipes after ``sharding_filter`` should pass items one by one (map, filter,
flatmap, ...): a ``batch`` there groups items of consecutive leased chunks of one worker,
which depend on the workers' speeds.

With a dispatch point (``sharding_round_robin_dispatch``) a unit is one dispatched item
instead: see :mod:`.dispatched`.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Tuple

from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe

from ...checkpoint import MAX_POSITION
from ...client import WorkerChannel
from ...errors import ConfigurationError, WorkerLostError
from ...graph import check_per_item_after_dispatch
from ...graph_utils import DispatchPlaceholder, find_dps, find_lca_round_robin_sharding_dp, traverse_dps
from ...selection import LeasedChunks, WorkerSelection
from ...settings import NumberRule, check_number
from .base import DistributionPolicy, EpochRun, FleetView, Merger
from .leases import (
    CHUNK_LEAD_SECONDS, MAX_CHUNK_DEPTH, WINDOW_BYTES_PER_WORKER, LeaseBook, check_book_state, checkpoint_schedule,
)  # fmt: skip
from .schedule import DIVISOR, LARGEST, SMALLEST, ChunkSchedule, FixedChunks, GuidedChunks
from .merge import _next_frame, _report_held_losses, _take

__all__ = ["Dynamic", "DEFAULT_CHUNK_SIZE", "DEFAULT_MAX_CHUNK_SIZE"]

#: Positions per chunk while the stream's length is unknown, unless given: measured with
#: benchmarks/bench_distribution.py (see DISTRIBUTION.md).
DEFAULT_CHUNK_SIZE = 16
#: The largest chunk of a guided schedule, unless given (see :mod:`.schedule`).
DEFAULT_MAX_CHUNK_SIZE = LARGEST
#: The credit window of a "dynamic" epoch's workers (DATA frames; see :meth:`Dynamic.credits`).
CREDITS = 32


def _positive(name: str, value: Any) -> int:
    try:
        check_number(NumberRule(name, integer=True, minimum=1), value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"Dynamic.{exc}") from None
    return value


class Dynamic(DistributionPolicy):
    """Work handed out on demand in chunks of the stream, delivered resequenced (``"dynamic"``).

    Args:
        chunk_size: Consecutive positions of the sharded stream per chunk while the stream's
            length is unknown (a run's first epoch, or past the previous epoch's length), and
            at most this for each worker's first leases of a guided epoch, before its speed is
            measured (default :data:`DEFAULT_CHUNK_SIZE`). Smaller balances better at the end
            of an epoch, larger costs fewer messages.
        max_chunk_size: The largest chunk of a guided epoch (default :data:`DEFAULT_MAX_CHUNK_SIZE`):
            chunks are ``ceil(left / (8 * workers))`` positions of what is left of the expected
            stream, at most this, shrinking to 1 at the end (:mod:`.schedule`).
        guided: True (default): once the stream's length is known from the previous epoch, a
            guided schedule; False: chunks of ``chunk_size`` always.
        depth: Chunks each worker holds ahead (not yet reported done); 2 keeps it busy while
            its report travels.
        window: At most this many chunks past the oldest one not yet delivered are leased
            (bounds the trainer's buffer). Default: ``4 * depth * num_workers``, growing while
            the items are small to as many chunks as hold 4 MiB per worker (up to
            ``128 * num_workers``), so that fast workers of tiny items get their leases in
            few sends (:class:`~.leases.LeaseBook`).
        in_order: True (default): resequenced by chunk, deterministic for a seed; False:
            items in arrival order (also ``RPCReadingService(distribution="dynamic", in_order=False)``).

    With a dispatch point a unit is one dispatched item (:mod:`.dispatched`): ``depth`` and
    ``window`` count units, and the default window is ``chunk_size`` times the chunks' (the
    same bound in items).
    """

    name = "dynamic"
    shared_queue = True
    leased = True
    dispatch_units = True

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, depth: int = 2, window: Optional[int] = None,
                 in_order: bool = True, max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE, guided: bool = True):  # fmt: skip
        self.chunk_size = _positive("chunk_size", chunk_size)
        self.max_chunk_size = _positive("max_chunk_size", max_chunk_size)
        if not isinstance(guided, bool):
            raise ConfigurationError(f"Dynamic.guided must be True or False, got {guided!r}")
        self.guided = guided
        self.depth = _positive("depth", depth)
        self.window = None if window is None else _positive("window", window)
        if not isinstance(in_order, bool):
            raise ConfigurationError(f"Dynamic.in_order must be True or False, got {in_order!r}")
        self._in_order = in_order

    @property
    def in_order(self) -> bool:
        """Whether delivery is resequenced by chunk (deterministic for a seed)."""
        return self._in_order

    def __repr__(self) -> str:
        return (
            f"Dynamic(chunk_size={self.chunk_size}, depth={self.depth}, window={self.window}, in_order={self._in_order}, "
            f"max_chunk_size={self.max_chunk_size}, guided={self.guided})"
        )

    def check_graph(self, graph: Any) -> None:
        """Refuse a graph without ``sharding_filter``, or with a dispatch point and DataPipes
        after it that do not map each dispatched item to its outputs alone.

        The engine checks the workers' part of a dispatching graph, in which torchdata's
        placeholder stands for the dispatch point."""
        dps = traverse_dps(graph)  # pickles every DataPipe of the graph: once
        if find_lca_round_robin_sharding_dp(dps) is not None or find_dps(dps, DispatchPlaceholder):
            check_per_item_after_dispatch(graph, self.name)
            return
        if not find_dps(dps, ShardingFilterIterDataPipe):
            raise ConfigurationError(
                "distribution='dynamic' leases chunks of the stream at a sharding_filter, and this graph has "
                "none: add .sharding_filter() where the items should be split among the workers"
            )

    def worker_selection(self, fleet: FleetView) -> WorkerSelection:
        """Each worker keeps the chunks leased to it."""
        return LeasedChunks()

    def credits(self, prefetch: int) -> int:
        """More than ``prefetch``: the merger takes every frame as it comes and the lease window
        bounds what waits in the trainer, so credits only pace the socket. With a window of
        :data:`CREDITS` (credits go back in halves) most of them ride along with a LEASE send
        instead of costing the worker a wake-up of their own."""
        return max(prefetch, CREDITS)

    def hint_from_state(self, state: Any) -> Optional[int]:
        """The stream's length the checkpointed epoch found (what the next epoch's schedule follows)."""
        length = state.get("stream_length") if isinstance(state, dict) else None
        valid = isinstance(length, int) and not isinstance(length, bool) and 0 <= length <= MAX_POSITION
        return length if valid else None

    def skip(self, progress: Any, rank: int) -> int:
        """Nothing is skipped by position: leases carry what was delivered of their chunk."""
        return 0

    def merger(self, run: EpochRun) -> Merger:
        """Lease, receive and resequence one epoch (with a dispatch point: its dispatched items)."""
        if run.dispatched is not None:
            from .dispatched import DispatchedMerger  # a subclass of _DynamicMerger, below

            return DispatchedMerger(self, run)
        return _DynamicMerger(self, run)

    def check_state(self, state: Any) -> None:
        """A checkpoint of a "dynamic" epoch must hold its chunk book."""
        if state is None:
            raise ConfigurationError(
                "the checkpoint was taken mid-epoch with a distribution other than 'dynamic' (it holds per-worker "
                "positions only): resume it with the distribution it was taken with"
            )
        check_book_state(state, self.chunk_size)


class _DynamicMerger(Merger):
    """One dynamic epoch: keeps every worker leased, files items under their chunks, delivers them."""

    #: How many units a fast worker may hold, how much of its work ahead, and whether the default
    #: window grows while items are small.
    max_depth = MAX_CHUNK_DEPTH
    lead_seconds = CHUNK_LEAD_SECONDS
    sized_window = True

    def __init__(self, policy: Dynamic, run: EpochRun):
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

    def _window(self, policy: Dynamic, workers: int) -> int:
        """The lease window's first size, in chunks."""
        return policy.window or 4 * policy.depth * max(1, workers)

    def _schedule(self, policy: Dynamic, expected: Optional[int], workers: int) -> ChunkSchedule:
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
            while (lease := book.lease(channel.rank)) is not None:
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
        _report_held_losses(channels, run.events)
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
            event = _next_frame(run.events, progress)
            if event.kind == "dispatched":  # the trainer's dispatcher pulled more units
                self._top_up_all()
                continue
            rank = event.channel.rank
            if event.channel is not channels[rank]:
                continue  # left over from a replaced session
            if event.kind == "chunk_done":
                assert event.chunk is not None
                done = event.chunk
                book.done_many(rank, done.chunk, done.counts, done.stream_length)
                self._top_up(event.channel)
                if done.stream_length is not None:
                    # The stream's end is known: the others may be leased its last chunks, or told
                    # that none come. A report gives them no other room: the window moves only as
                    # items are delivered, and the check above tops everyone up then.
                    self._top_up_all()
            elif event.kind == "end":
                self._stream_ended(event.channel)
            elif event.kind == "data":
                try:
                    items = _take(event, run.wire)
                except WorkerLostError as exc:
                    self._replace(event.channel, exc)
                    continue
                assert event.frame is not None
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
            elif event.kind == "lost" and (run.replace is None or not run.reassign) and rank in book.ended:
                event.channel.held_loss = event  # this epoch has all of its items: the next one needs it
            else:
                try:
                    _take(event, run.wire)  # raises the worker's error, or that it was lost
                except WorkerLostError as exc:
                    self._replace(event.channel, exc)
        progress.finish()

    def _stream_ended(self, channel: WorkerChannel) -> None:
        """``channel``'s stream ended (END_OF_SHARD): its leases still outstanding lie past the stream's end."""
        self.book.end(channel.rank)
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

    def _replace(self, lost: WorkerChannel, error: WorkerLostError) -> None:
        """Lease the lost session's chunks that were not delivered completely to its replacement."""
        if self.run.replace is None:
            raise error
        for chunk in self.book.lost(lost.rank):
            self.buffers.pop(chunk, None)  # received but not handed on: the new lease sends them again
        channel = self.run.replace(lost, error)
        self.run.channels[lost.rank] = channel
        self._top_up(channel)

