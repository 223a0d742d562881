"""Work distribution policies: the chunk book of "dynamic" (in memory), the configuration, and
end to end over real worker processes: every built-in policy gives every item exactly once,
"dynamic" gives the same order for a seed whatever the workers' speeds, survives a killed
worker in reassign mode exactly once, shows its chunks per worker in ``stats()``, and a
third-party policy registered by name runs.

Transports: tests/test_transport_conformance.py (dynamic's order on every transport);
checkpoints: tests/test_checkpoint.py (dynamic resume).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any, List

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import remote, run_epochs, slow_rank, wait_until
from rpc_reading_service import (
    ConfigurationError,
    Liveness,
    RPCReadingService,
    available_distributions,
    register_distribution,
)
from rpc_reading_service.trainer.config import ReadingServiceConfig
from rpc_reading_service.policies.first_ready.trainer import FirstReady
from rpc_reading_service.policies.round_robin.trainer import RoundRobin
from rpc_reading_service.policies.dynamic.trainer import Dynamic
from rpc_reading_service.policies.dynamic.leases import LeaseBook, check_book_state, checkpoint_schedule
from rpc_reading_service.policies.dynamic.schedule import FixedChunks, GuidedChunks
from rpc_reading_service.policies.dynamic.worker import LeasedChunks
from rpc_reading_service.selection import LeaseInbox, SelectionContext, SelectionFilter, StopSelection, WorkerSelection

N = 60


def noisy(x: int) -> tuple:
    """Randomness after the sharding point (per worker, or per chunk with "dynamic")."""
    return x, random.randrange(10**9)


def shuffled(n: int = N):
    return IterableWrapper(range(n)).shuffle().sharding_filter().map(noisy)


# -- the chunk book, in memory ------------------------------------------------------------------
def test_leases_go_in_increasing_order_to_whoever_has_room_and_stay_within_the_window():
    book = LeaseBook(num_workers=2, chunk_size=10, depth=2, window=3)
    assert [book.lease(0), book.lease(0), book.lease(0)] == [(0, 0), (1, 0), None]  # depth 2
    assert [book.lease(1), book.lease(1)] == [(2, 0), None]  # the window: chunks 0..2 only
    book.done(0, 0, items=10, stream_length=None)
    assert book.lease(0) is None  # chunk 0 is done but not delivered: still in the window
    for _ in range(10):
        book.deliver(0)
    assert book.complete_below == 1 and book.lease(0) == (3, 0)
    assert book.units == {0: 3, 1: 1}


@pytest.mark.parametrize("expected", [None, 100000])
def test_a_slow_worker_is_kept_one_chunk_ahead_and_a_fast_one_further(expected):
    # A window wide enough that the slow worker would not hold it (the window rule: tests/test_stragglers.py).
    book = LeaseBook(num_workers=2, chunk_size=4, depth=2, window=10000, expected_chunks=expected)
    assert book.depth_of(0) == book.depth_of(1) == 2  # nothing measured yet
    for rank, gap in ((0, 0.2), (1, 0.0001)):
        for _ in range(2):
            book.lease(rank)
        book.done(rank, book.outstanding[rank][0], 4, None, now=10.0)
        book.done(rank, book.outstanding[rank][0], 4, None, now=10.0 + gap)
    # Two ahead once the stream's length is expected: the tail rule (ends_last) keeps its last chunk from it.
    assert book.depth_of(0) == (1 if expected is None else 2) and book.depth_of(1) > 2
    assert book.lease(0) is not None and (book.lease(0) is None) == (expected is None)


def test_chunks_reported_in_one_chunk_done_share_the_time_since_the_previous_report():
    book = LeaseBook(num_workers=1, chunk_size=4, depth=8, window=100)
    for _ in range(5):
        book.lease(0)
    book.done_many(0, 0, (4,), None, now=10.0)
    book.done_many(0, 1, (4, 4, 3), None, now=10.3)  # three chunks of 0.1 s (4 positions each), one frame
    assert book.position_seconds[0] == pytest.approx(0.1 / 4) and list(book.outstanding[0]) == [4]
    assert book.totals == {0: 4, 1: 4, 2: 4, 3: 3}
    assert book.arrived(0, 20) == [(0, 4), (1, 4), (2, 4), (3, 3), (4, 5)]


def test_a_fast_worker_is_topped_up_from_half_its_depth_to_full_at_once():
    book = LeaseBook(num_workers=1, chunk_size=4, depth=2, window=1000)
    for now in (10.0, 10.0001):  # two reports a tenth of a millisecond apart: a fast worker
        book.lease(0)
        book.done(0, book.outstanding[0][0], 4, None, now=now)
    depth = book.depth_of(0)
    assert depth > 4 and book.wants_leases(0)
    while book.lease(0) is not None:
        pass
    assert len(book.outstanding[0]) == depth
    for reported in range(depth - depth // 2):
        assert not book.wants_leases(0), reported  # no lease per report ...
        book.done(0, book.outstanding[0][0], 4, None, now=10.0002)
    assert book.wants_leases(0)  # ... until half its depth is left


def test_a_fast_worker_is_not_sent_lone_leases_as_the_window_moves_unless_it_holds_none():
    book = LeaseBook(num_workers=2, chunk_size=4, depth=2, window=12)
    for now in (10.0, 10.0001):  # rank 0 is fast: its depth grows past the window's room
        book.lease(0)
        assert book.arrived(0, 4) == [(book.outstanding[0][0], 4)]
        book.done(0, book.outstanding[0][0], 4, None, now=now)
    while book.lease(0) is not None:
        pass
    assert book.depth_of(0) > 8 and len(book.outstanding[0]) == 10  # chunks 2..11: the window is full
    for chunk in range(2):
        for _ in range(4):
            book.deliver(chunk)
    for chunk in range(2, 8):
        book.done(0, chunk, 4, None, now=10.0002)  # not delivered: the window stays
    # The window has room for 2 more, the worker holds 4 of its depth: no send of one or two leases ...
    assert not book.wants_leases(0) and book.wants_leases(1)  # ... but a worker holding nothing gets them
    assert book.lease(1) == (12, 0)


def _simulated_epoch(book: LeaseBook, chunk_seconds: List[float], chunks: int) -> List[float]:
    """Run one epoch of ``chunks`` chunks through ``book`` in simulated time, every worker doing each of
    its chunks in ``chunk_seconds[rank]`` and topped up as the merger does; return when each worker ended."""
    free_at = [0.0] * len(chunk_seconds)  # when each worker is done with what it holds
    finishing = []  # (time, rank, chunk), one per chunk leased

    def top_up(rank: int, now: float) -> None:
        while book.wants_leases(rank) and book.next_chunk < chunks and (lease := book.lease(rank)) is not None:
            free_at[rank] = max(free_at[rank], now) + chunk_seconds[rank]
            finishing.append((free_at[rank], rank, lease[0]))

    for rank in range(len(chunk_seconds)):
        top_up(rank, 0.0)
    ended = [0.0] * len(chunk_seconds)
    while finishing:
        finishing.sort()
        now, rank, chunk = finishing.pop(0)
        book.done(rank, chunk, book.chunk_size, None, now=now)
        ended[rank] = now
        for other in [rank] + [r for r in range(len(chunk_seconds)) if r != rank]:
            top_up(other, now)  # the reporter, then everyone (the merger does as the window moves)
    assert book.next_chunk == chunks, "every chunk was leased"
    return ended


@pytest.mark.parametrize("expected", [None, 50])
def test_near_the_end_a_slow_worker_is_not_leased_a_chunk_the_others_would_finish_sooner(expected):
    # One worker about 4x slower (chunks of 16 items of 5 ms and of 20 ms, each with the same
    # per-item cost on top, as bench_distribution.py measures them).
    speeds = [0.3, 0.08, 0.08, 0.08]
    book = LeaseBook(num_workers=4, chunk_size=16, depth=2, window=1000, expected_chunks=expected)
    ended = _simulated_epoch(book, speeds, 50)
    ideal = 50 * 0.08 / (3 + 0.08 / 0.3)
    if expected is None:  # the stream's length unknown: whoever has room is leased, to the end
        assert book.units[0] == 5 and max(ended) > 1.2 * ideal
    else:  # the previous epoch's length: the slow worker's last chunk would end the epoch late
        assert book.units[0] == 4 and max(ended) < 1.1 * ideal
    assert sum(book.units.values()) == 50


def test_the_tail_rule_never_holds_back_equal_workers():
    book = LeaseBook(num_workers=4, chunk_size=16, depth=2, window=1000, expected_chunks=41)
    ended = _simulated_epoch(book, [0.08] * 4, 41)
    assert max(ended) == pytest.approx(11 * 0.08) and sorted(book.units.values()) == [10, 10, 10, 11]


def test_dynamic_refuses_graphs_it_cannot_cut_into_chunks():
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

    with pytest.raises(ConfigurationError, match="has none: add .sharding_filter()"):
        Dynamic().check_graph(IterableWrapper(range(3)).map(noisy))
    dispatched = IterableWrapper(range(3)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    Dynamic().check_graph(dispatched.map(noisy))  # a unit is a dispatched item: no sharding_filter needed
    with pytest.raises(ConfigurationError, match="graph after the dispatch point has Batcher"):
        Dynamic().check_graph(dispatched.map(noisy).batch(2))


def test_the_stream_end_is_learnt_and_chunks_past_it_are_empty():
    book = LeaseBook(num_workers=2, chunk_size=10, depth=2, window=100)
    for rank in (0, 0, 1, 1):
        book.lease(rank)  # 0: chunks 0, 1; 1: chunks 2, 3
    book.done(1, 2, items=5, stream_length=25)  # the stream ended in chunk 2: 3 chunks
    assert book.stream_chunks == 3 and book.lease(1) is None
    assert book.to_finish() == [0, 1] and book.to_finish() == []  # told once: no more leases
    book.end(1)  # rank 1's END_OF_SHARD: its chunk 3 lay past the end
    assert book.totals[3] == 0 and not book.over
    book.done(0, 0, 10, None)
    book.done(0, 1, 10, None)
    for chunk, count in ((0, 10), (1, 10), (2, 5)):
        for _ in range(count):
            book.deliver(chunk)
    assert book.over


def test_a_lost_session_gives_back_its_undelivered_chunks_with_what_was_delivered_as_skip():
    book = LeaseBook(num_workers=2, chunk_size=4, depth=2, window=100)
    book.lease(0), book.lease(1), book.lease(0), book.lease(1)  # 0: chunks 0, 2; 1: chunks 1, 3
    assert book.arrived(1, 4) == [(1, 4)]
    book.done(1, 1, 4, None)
    for _ in range(3):
        book.deliver(3)  # first-ready delivery: 3 items of chunk 3 already handed on
    assert book.lost(1) == [3]  # chunk 1 is done (its items are here); chunk 3 is not
    assert book.lease(1) == (3, 3)  # the fresh replacement: chunk 3, skipping the 3 delivered
    book.done(0, 0, 4, None)
    assert book.lease(0) == (4, 0)
    book.lost(1)  # again: chunk 3 is pending once more, but below rank 0's latest lease (4)
    book.done(0, 2, 4, None)
    assert book.lease(0) == (5, 0), "a session walks its stream once: never a chunk below its latest lease"
    assert book.lease(1) == (3, 3)


def test_a_drained_sessions_take_over_is_leased_its_chunks_at_once_and_no_other_then_ends():
    book = LeaseBook(num_workers=3, chunk_size=4, depth=2, window=100)
    for rank in (0, 1, 2, 0, 1, 2):
        book.lease(rank)  # 0: chunks 0, 3; 1: chunks 1, 4; 2: chunks 2, 5
    book.hand_back(1, book.lost(1))
    assert [book.lease(1), book.lease(1), book.lease(1)] == [(1, 0), (4, 0), None]  # both at once, no new chunk
    assert book.lease(2) is None and book.lease(0) is None  # the others hold their depth
    book.done(1, 1, 4, None)
    assert book.arrived(1, 4) == [(1, 4)] and not book.handed_back(1)  # chunk 4 still out
    book.done(1, 4, 4, None)
    assert not book.handed_back(1)  # reported, its items not here yet
    assert book.arrived(1, 4) == [(4, 4)] and book.handed_back(1) and 1 in book.ended
    book.done(0, 0, 4, None)
    assert book.lease(0) == (6, 0) and book.lease(1) is None  # the next chunks go to the sessions left


def test_a_frame_is_split_by_the_reported_counts_and_a_reported_chunk_whose_tail_was_lost_is_leased_again():
    book = LeaseBook(num_workers=1, chunk_size=4, depth=4, window=100)
    for _ in range(3):
        book.lease(0)  # chunks 0, 1, 2
    assert book.arrived(0, 3) == [(0, 3)]
    book.done(0, 0, 4, None)  # reported with its last item still packed: it comes in the next frame
    book.done(0, 1, 2, None)  # a chunk whose items all travel after its report
    assert book.arrived(0, 5) == [(0, 1), (1, 2), (2, 2)]  # one frame: the tail of 0, all of 1, head of 2
    book.done(0, 2, 4, None)
    assert book.arrived(0, 1) == [(2, 1)] and book.arrived(0, 1) == [(2, 1)]
    book.lease(0)  # chunk 3
    book.done(0, 3, 3, None)
    assert book.arrived(0, 1) == [(3, 1)]
    book.deliver(3)  # first-ready: handed on already
    assert book.lost(0) == [3] and book.lease(0) == (3, 1)  # reported, but 2 of its 3 items never came


def test_checkpoint_state_gives_back_held_items_and_resumes_the_rest():
    book = LeaseBook(num_workers=1, chunk_size=2, depth=3, window=100)
    for _ in range(3):
        book.lease(0)
    book.done(0, 0, 2, None)
    book.done(0, 1, 2, None)
    for chunk in (0, 0, 1):
        book.deliver(chunk)
    state = book.state(given_back=[1, 0])  # the last two items handed on were not received
    check_book_state(state, chunk_size=2)
    assert state == {"chunk_size": 2, "next_chunk": 3, "complete_below": 0, "complete": [], "delivered": [[0, 1]]}
    resumed = LeaseBook(num_workers=2, chunk_size=2, depth=3, window=100)
    resumed.resume(state, open_limit=100)
    assert [resumed.lease(0), resumed.lease(1), resumed.lease(1)] == [(0, 1), (1, 0), (2, 0)]
    with pytest.raises(ConfigurationError, match="chunk_size=2, this run has chunk_size=4"):
        check_book_state(state, chunk_size=4)
    with pytest.raises(ConfigurationError, match="delivered"):
        check_book_state(dict(state, delivered=[[7, 1]]), chunk_size=2)


def test_a_leased_walk_reports_each_chunk_after_its_last_item_and_is_asked_only_at_span_ends():
    class Counted(LeasedChunks):
        def passed(self, position: int) -> None:
            passed.append(position)
            super().passed(position)

    passed: List[int] = []
    out: List[Any] = []
    reports: List[tuple] = []
    inbox = LeaseInbox()
    inbox.add(0, count=2, start=0, size=3)  # positions 0-5: chunks 0 and 1
    inbox.add(4, count=1, start=10, size=5)  # 6-9 are another worker's; 10-14: chunk 4
    inbox.finish()
    walk = SelectionFilter(IterableWrapper(range(20)), Counted())
    context = SelectionContext(epoch=1, seed=0, global_worker_id=0, leases=inbox)
    context.chunk_done = lambda chunk, length: reports.append((chunk, length, len(out)))
    walk.set_context(context)
    for item in walk:
        out.append(item)
    assert out == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14]
    assert reports == [(0, None, 3), (1, None, 6), (4, None, 11)]  # each once its last item was taken
    assert passed == [2, 5, 9, 14]  # the last position of each span, not every position


def test_a_walk_waiting_for_its_next_lease_says_so_outside_the_lease_inboxs_lock():
    # The session's hook takes the outbox's lock (to wake its sender): never under the inbox's.
    inbox = LeaseInbox()
    calls: List[tuple] = []

    def waiting(flag: bool) -> None:
        other = threading.Thread(target=inbox.outstanding, args=(0,))
        other.start()
        other.join(2)
        calls.append((flag, not other.is_alive()))

    inbox.waiting = waiting
    decided: List[tuple] = []
    walk = threading.Thread(target=lambda: decided.append(inbox.decide(0)), daemon=True)
    walk.start()
    try:
        assert wait_until(lambda: calls == [(True, True)], timeout=5)
        inbox.add(0, count=1, start=0, size=3)
    finally:
        walk.join(5)
        if walk.is_alive():
            inbox.cancel()  # a failed check leaves no walk waiting
    assert decided == [(0, 0, 3)] and calls == [(True, True), (False, True)]
    inbox = LeaseInbox()
    inbox.waiting = waiting
    inbox.finish()
    with pytest.raises(StopSelection):
        inbox.decide(3)  # no lease will come: no wait, no call
    assert len(calls) == 2


# -- the guided chunk schedule (pure) ------------------------------------------------------------
@pytest.mark.parametrize("length", [0, 1, 7, 800, 100000])
@pytest.mark.parametrize("workers", [1, 4])
def test_a_guided_schedule_covers_the_expected_stream_exactly_and_shrinks_toward_its_end(length, workers):
    schedule = GuidedChunks(length, workers, first_size=16, largest=256, divisor=8, smallest=1, warmup=2 * workers)
    chunks = schedule.chunks_below(length)
    sizes = [schedule.size(chunk) for chunk in range(chunks)]
    assert sum(sizes) == length and all(size >= 1 for size in sizes)  # no gap, no overlap, no empty chunk
    assert [schedule.start(chunk) for chunk in range(chunks)] == [sum(sizes[:chunk]) for chunk in range(chunks)]
    assert all(size <= 16 for size in sizes[: 2 * workers]) and max(sizes, default=1) <= 256  # warm-up, largest
    after = sizes[2 * workers :]
    assert after == sorted(after, reverse=True)  # never growing once measured: shrinking toward the end
    if length >= 800:
        assert sizes[-1] == 1 and max(sizes) > 16  # single items at the end, larger chunks while much is left
    # Past the expected length (a longer stream): chunks of first_size, as when the length is unknown.
    assert [schedule.size(chunks + extra) for extra in range(3)] == [16] * 3
    for position in range(0, length + 40, max(1, length // 97)):  # every position lies in its chunk
        chunk = schedule.chunks_below(position + 1) - 1
        assert schedule.start(chunk) <= position < schedule.start(chunk + 1)
    # A pure function of its parameters: rebuilt from its checkpoint state, the same bounds.
    again = GuidedChunks(**schedule.state())
    assert [again.start(chunk) for chunk in range(chunks + 3)] == [schedule.start(chunk) for chunk in range(chunks + 3)]


def test_a_guided_schedule_of_a_long_stream_is_built_without_listing_its_chunks():
    started = time.perf_counter()
    schedule = GuidedChunks(10**12, 64, first_size=16, largest=256, divisor=8, smallest=1, warmup=128)
    assert time.perf_counter() - started < 0.5
    chunks = schedule.chunks_below(10**12)
    assert schedule.start(chunks) == 10**12 and schedule.size(chunks - 1) == 1 and schedule.size(1000) == 256


def _simulated_guided_epoch(book: LeaseBook, position_seconds: List[float], length: int) -> List[float]:
    """:func:`_simulated_epoch` with chunks of the book's schedule, each taking its size times the
    worker's seconds per position, plus a lease's round trip of 1.5 ms when the worker waited for it."""
    free_at, finishing, chunks = [0.0] * len(position_seconds), [], book.schedule.chunks_below(length)

    def top_up(rank: int, now: float) -> None:
        while book.wants_leases(rank) and book.next_chunk < chunks and (lease := book.lease(rank)) is not None:
            start, size = book.bounds(lease[0])
            free_at[rank] = max(free_at[rank], now + 0.0015) + size * position_seconds[rank]
            finishing.append((free_at[rank], rank, lease[0], size))

    for rank in range(len(position_seconds)):
        top_up(rank, 0.0)
    ended = [0.0] * len(position_seconds)
    while finishing:
        finishing.sort()
        now, rank, chunk, size = finishing.pop(0)
        book.done(rank, chunk, size, None, now=now)
        ended[rank] = now
        for other in [rank] + [r for r in range(len(position_seconds)) if r != rank]:
            top_up(other, now)
    return ended


@pytest.mark.parametrize("slow", [0.018, 0.0204, 0.0225])
def test_a_guided_epoch_ends_near_the_ideal_where_fixed_chunks_of_16_leave_the_grain(slow):
    # bench_distribution.py's unequal fleet in simulated time: 800 items, one worker about 4x slower.
    speeds, length = [slow, 0.0055, 0.0055, 0.0055], 800
    ideal = length / sum(1 / seconds for seconds in speeds)
    ends = {}
    for name, schedule in (("fixed", FixedChunks(16)), ("guided", GuidedChunks(length, 4, 16, warmup=8))):
        book = LeaseBook(4, 16, 2, 10000, expected_chunks=schedule.chunks_below(length), schedule=schedule)
        ends[name] = max(_simulated_guided_epoch(book, speeds, length)) / ideal
        assert sum(book.units.values()) == schedule.chunks_below(length)
    assert ends["guided"] < 1.03 and ends["guided"] < ends["fixed"], ends


def test_a_guided_checkpoint_holds_its_schedule_and_length_and_is_checked_strictly():
    schedule = GuidedChunks(40, 2, first_size=4, warmup=4)
    book = LeaseBook(num_workers=2, chunk_size=4, depth=2, window=100, schedule=schedule)
    assert [book.lease(0), book.lease(1)] == [(0, 0), (1, 0)] and book.bounds(1) == (3, 3)  # ceil(40 / 16)
    book.done(0, 0, 3, None)
    book.done(1, 1, 2, 5)  # the stream ended in chunk 1, at position 5 (not the expected 40)
    state = book.state(given_back=[])
    check_book_state(state, chunk_size=4)
    assert state["schedule"] == schedule.state() and state["stream_length"] == 5 and book.stream_chunks == 2
    assert Dynamic(chunk_size=4).hint_from_state(state) == 5
    assert checkpoint_schedule(state).state() == schedule.state()
    assert checkpoint_schedule({k: v for k, v in state.items() if k != "schedule"}) is None  # fixed chunks
    for tampered, words in (
        (dict(state, schedule=dict(schedule.state(), divisor=0)), "divisor is 0"),
        (dict(state, schedule={"length": 40}), "'schedule' that is not an object"),
        (dict(state, schedule=dict(schedule.state(), first_size=8)), "first_size=8, not its chunk_size=4"),
        (dict(state, stream_length=-1), "stream_length that is not a count"),
        (dict(state, extra=1), "must be an object with"),
    ):
        with pytest.raises(ConfigurationError, match=words):
            check_book_state(tampered, chunk_size=4)


def _guided_book_past_the_end():
    """A guided epoch of 23 positions (chunks of one position) on 3 workers, every chunk delivered;
    ranks 0-2 hold chunks 23-25, past the end, and none was received: their ends tell the trainer."""
    schedule = GuidedChunks(23, 3, first_size=3, largest=256, warmup=6)
    book = LeaseBook(num_workers=3, chunk_size=3, depth=2, window=100, expected_chunks=23, schedule=schedule)
    for chunk in range(23):
        rank, now = chunk % 3, 10.0 + chunk  # every rank as fast (measured times would make one a straggler under load)
        assert book.lease(rank, now=now) == (chunk, 0)
        book.done(rank, chunk, 1, None, now=now + 0.5)  # the last one ends at the stream's end: reported without a length
        book.deliver(chunk)
    assert [book.lease(rank, now=40.0) for rank in range(3)] == [(23, 0), (24, 0), (25, 0)]
    return book


def test_a_checkpoint_holds_the_stream_length_only_once_known_and_the_resumed_epoch_learns_it_as_the_uninterrupted():
    """A rank whose walk ended before its lease past the end arrived only bounds the stream (chunk 25
    would start at 29): the checkpoint holds no length, and not chunk 25 (complete, past the end),
    which a resumed epoch not knowing the end would refuse. The next epoch's schedule follows the
    length the epoch ends with, resumed or not."""
    book = _guided_book_past_the_end()
    book.end(2)
    assert book.stream_chunks == 25 and not book.over
    state = book.state(given_back=[])
    check_book_state(state, chunk_size=3)
    assert "stream_length" not in state and Dynamic(chunk_size=3).hint_from_state(state) is None
    assert (state["complete_below"], state["next_chunk"], state["complete"]) == (23, 25, [])
    book.end(0), book.end(1)
    assert book.over and book.length_hint() == 23 and book.state(given_back=[])["stream_length"] == 23
    resumed = LeaseBook(num_workers=3, chunk_size=3, depth=2, window=100, schedule=checkpoint_schedule(state))
    resumed.resume(state, open_limit=100)
    assert [resumed.lease(rank) for rank in range(2)] == [(23, 0), (24, 0)]
    resumed.end(0), resumed.end(1)
    assert resumed.over and resumed.length_hint() == 23


# -- configuration -----------------------------------------------------------------------------
def test_distribution_names_objects_and_the_in_order_shorthand():
    assert {"round_robin", "first_ready", "dynamic", "sticky"} <= set(available_distributions())
    create = ReadingServiceConfig.create
    assert type(create(num_workers=2).distribution) is RoundRobin
    assert type(create(num_workers=2, in_order=False).distribution) is FirstReady
    lazy = create(num_workers=2, distribution="dynamic", in_order=False)
    assert isinstance(lazy.distribution, Dynamic) and not lazy.distribution.in_order and not lazy.in_order
    policy = Dynamic(chunk_size=8)
    assert create(num_workers=2, distribution=policy).distribution is policy
    with pytest.raises(ConfigurationError, match="in_order=False asks for first-ready delivery"):
        create(num_workers=2, distribution="round_robin", in_order=False)
    with pytest.raises(ConfigurationError, match="unknown distribution 'fastest'; available distributions: .*dynamic"):
        create(num_workers=2, distribution="fastest")
    with pytest.raises(ConfigurationError, match="Dynamic.chunk_size"):
        Dynamic(chunk_size=0)
    with pytest.raises(ConfigurationError, match="already registered"):
        register_distribution("dynamic", lambda: RoundRobin())


def test_an_installed_policy_is_found_by_its_entry_point(tmp_path, monkeypatch):
    from rpc_reading_service import policies as distributions

    dist_info = tmp_path / "rrs_policy-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: rrs-policy\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{distributions.ENTRY_POINT_GROUP}]\nbackwards_ep = test_distribution:BackwardsRoundRobin\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(distributions._registry, "factories", dict(distributions._registry.factories))
    monkeypatch.setattr(distributions._registry, "entry_points_loaded", False)
    assert "backwards_ep" in available_distributions()
    assert type(ReadingServiceConfig.create(num_workers=2, distribution="backwards_ep").distribution).__name__ == (
        "BackwardsRoundRobin"
    )


# -- end to end ---------------------------------------------------------------------------------
class Backwards(WorkerSelection):
    """A third-party worker-side selection: worker r keeps the positions a sharding_filter gives worker n-1-r."""

    def keep(self, position: int, item: Any) -> bool:
        return position % self.num_workers == self.num_workers - 1 - self.worker_rank


class BackwardsRoundRobin(RoundRobin):
    name = "backwards"

    def __init__(self) -> None:
        super().__init__(selection=Backwards())


if "backwards" not in available_distributions():
    register_distribution("backwards", BackwardsRoundRobin)


@pytest.mark.timeout(60)
def test_every_policy_gives_every_item_exactly_once_and_dynamic_shows_its_chunks(worker_server):
    dp = IterableWrapper(range(N)).sharding_filter()
    orders = {}
    for name, distribution in (("round_robin",) * 2, ("first_ready",) * 2, ("dynamic",) * 2,
                               ("dynamic, as they arrive", Dynamic(in_order=False)),
                               ("dynamic, narrow window", Dynamic(chunk_size=1, window=1)), ("sticky",) * 2,
                               ("backwards",) * 2):  # fmt: skip
        service = remote(worker_server, 3, distribution=distribution)
        policy = distribution if isinstance(distribution, Dynamic) else Dynamic()
        # The first epoch's chunks are of chunk_size (the length unknown), the second's guided by
        # the first's length; stats() counts no chunk past the end.
        chunks = [-(-N // policy.chunk_size), GuidedChunks(N, 3, policy.chunk_size, warmup=3 * policy.depth).chunks_below(N)]
        with DataLoader2(dp, reading_service=service) as dl:
            for number in range(2):
                epoch = list(dl)
                assert sorted(epoch) == list(range(N)), name
                units = [worker.units for worker in dl.reading_service.stats().workers]
                if name.startswith("dynamic"):
                    assert len(units) == 3 and sum(units) == chunks[number], (number, units)
                else:
                    assert units == [None] * 3
        orders[name] = epoch
    assert orders["round_robin"] == list(range(N))
    # worker 0 now holds what worker 2 had: the round-robin merge starts with position 2
    assert orders["backwards"][:3] == [2, 1, 0]


@pytest.mark.timeout(60)
def test_dynamic_order_depends_on_the_seed_only_and_the_slow_worker_does_less(worker_server):
    """Two runs with a different slow worker: the same items, the same order, the same random
    values; the slow worker got fewer chunks than the others."""
    runs, units = [], []
    for slow in (0, 2):
        service = remote(worker_server, 3, distribution=Dynamic(chunk_size=2), worker_init_fn=slow_rank(slow, 0.02))
        with DataLoader2(shuffled(), reading_service=service) as dl:
            dl.seed(7)
            runs.append([list(dl) for _ in range(2)])
            units.append([worker.units for worker in dl.reading_service.stats().workers])
    assert runs[0] == runs[1]
    for epoch in runs[0]:
        assert sorted(x for x, _ in epoch) == list(range(N))
    assert runs[0][0] != runs[0][1]
    assert units[0][0] < max(units[0][1:]) and units[1][2] < max(units[1][:2]), units


@pytest.mark.timeout(60)
def test_dynamic_with_a_killed_worker_in_reassign_mode_is_exactly_once_in_the_same_order():
    def service() -> RPCReadingService:
        return RPCReadingService(
            num_workers=3, distribution=Dynamic(chunk_size=4), on_worker_failure="reassign",
            worker_init_fn=slow_rank(1, 0.005), timeout=3.0, liveness=Liveness(heartbeat_interval=0.5),
        )  # fmt: skip

    reference = run_epochs(shuffled(), service(), n_epochs=2, seed=3)
    victims: List[int] = []
    dl = DataLoader2(shuffled(), reading_service=service())
    try:
        dl.seed(3)
        first: List[Any] = []
        for item in dl:
            first.append(item)
            if len(first) == 20:
                victims.append(dl.reading_service.stats().workers[1].pid)
                os.kill(victims[-1], signal.SIGKILL)
        second = list(dl)
        assert dl.reading_service.stats().workers[1].pid != victims[0]
    finally:
        dl.shutdown()
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert [first, second] == reference



def test_the_default_window_grows_while_items_are_small_up_to_its_ceiling_never_below_its_first_size():
    def fast_worker_holds(window_bytes: Any, frames: List[tuple]) -> List[int]:
        book = LeaseBook(num_workers=1, chunk_size=4, depth=2, window=4, max_depth=8, window_bytes=window_bytes)
        for items, nbytes in frames:
            book.received(items, nbytes)
        for now in (10.0, 10.0001):  # its chunks take 0.1 ms: it may hold max_depth chunks
            book.lease(0)
            book.done(0, book.outstanding[0][0], 4, None, now=now)
        while book.lease(0) is not None:
            pass
        return list(book.outstanding[0])

    small = [(4, 4000), (996, 0)]  # 4 bytes an item over the epoch: 62 chunks hold 1000 bytes, capped at 16
    assert fast_worker_holds(1000, small) == list(range(2, 10))  # max_depth: past the first window (chunks < 4)
    assert fast_worker_holds(None, small) == [2, 3]  # a window given by the user stays as given
    assert fast_worker_holds(1000, [(4, 4000)]) == [2, 3]  # 1000 bytes an item: the first window
    book = LeaseBook(num_workers=1, chunk_size=4, depth=2, window=4, max_depth=8, window_bytes=1000)
    book.received(1000, 4000)
    assert book.window == 16  # 2 * max_depth * num_workers
