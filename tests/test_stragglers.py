"""Stragglers under "dynamic": the window rule keeps a worker many times slower than the fleet
from a chunk it would finish only after the others ran out of window (in memory, then over real
worker processes: the same items and order as a fleet without a straggler, which does less)."""

from __future__ import annotations

import random
from typing import Any, List, Optional, Tuple

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import remote, slow_identity, slow_rank
from rpc_reading_service.policies.dynamic.leases import LeaseBook
from rpc_reading_service.policies.dynamic.trainer import Dynamic

N = 240


def _measured(window: int, chunk_seconds: List[float], expected: Optional[int] = None) -> LeaseBook:
    """A book of chunks of 16 positions (``expected`` chunks expected) whose ranks each did two
    chunks, one every ``chunk_seconds[rank]``."""
    book = LeaseBook(num_workers=len(chunk_seconds), chunk_size=16, depth=2, window=window, expected_chunks=expected)
    for rank in range(len(chunk_seconds)):
        assert book.lease(rank, now=0.0) is not None and book.lease(rank, now=0.0) is not None
    for rank, seconds in enumerate(chunk_seconds):
        for done in (1, 2):
            chunk = book.outstanding[rank][0]
            book.done(rank, chunk, 16, None, now=done * seconds)
            for _ in range(16):
                book.deliver(chunk)
    return book


def test_a_straggler_is_not_leased_a_chunk_the_fleet_would_wait_for_at_the_window_head():
    # Three workers do a chunk in 10 ms, the straggler in 100 ms: the others go through half
    # the window (8 chunks of 16 positions) in about 27 ms.
    book = _measured(16, [0.01, 0.01, 0.01, 0.1])
    assert book.position_seconds[3] == pytest.approx(0.1 / 16)
    assert book.lease(3, now=0.2) is None and not book.outstanding[3]
    assert all(book.lease(rank, now=0.2) is not None for rank in range(3))
    assert book.lease(3, now=0.9) is None
    assert book.lease(3, now=1.1) is not None  # idle for more than 8 of its chunks: measured anew
    # Near the end no such chunk is leased to measure it anew: the others are done sooner.
    near_end = _measured(16, [0.01, 0.01, 0.01, 0.1], expected=40)
    assert near_end.lease(3, now=1.1) is None
    # A window the others need longer for than the straggler for its chunk: it is leased as before.
    wide = _measured(1000, [0.01, 0.01, 0.01, 0.1])
    assert wide.lease(3, now=0.2) is not None


def test_a_worker_twice_as_slow_as_the_median_or_less_is_never_held_back():
    assert _measured(8, [0.01, 0.01, 0.01, 0.019]).lease(3, now=0.1) is not None
    assert _measured(8, [0.01, 0.01, 0.01, 0.05]).lease(3, now=0.1) is None


def test_the_time_a_worker_waits_for_a_lease_is_not_timed_as_its_work():
    book = LeaseBook(num_workers=1, chunk_size=16, depth=1, window=100)
    book.lease(0, now=0.0)
    book.done(0, 0, 16, None, now=0.1)
    book.lease(0, now=5.0)  # it held nothing from 0.1 s to 5 s
    book.done(0, 1, 16, None, now=5.1)
    assert book.position_seconds[0] == pytest.approx(0.1 / 16)


def test_a_session_that_started_late_is_measured_again_after_one_chunk_of_waiting():
    book = LeaseBook(num_workers=3, chunk_size=16, depth=2, window=16)
    for rank in [0, 0, 1, 1, 2, 2]:
        book.lease(rank, now=0.0)
    for rank in (0, 1):
        for done in (1, 2):
            book.done(rank, book.outstanding[rank][0], 16, None, now=done * 0.01)
    book.done_many(2, book.outstanding[2][0], (16, 16), None, now=0.5)  # its session was set up late
    assert book.lease(2, now=0.52) is None  # a straggler by its first report ...
    assert book.lease(2, now=0.8) is not None  # ... which counts its start: after one chunk's time, one more
    book.done(2, book.outstanding[2][0], 16, None, now=0.81)
    assert book.position_seconds[2] == pytest.approx(0.01 / 16) and book.lease(2, now=0.81) is not None


def test_a_session_that_joins_the_epoch_holds_one_chunk_until_its_speed_is_measured():
    book = _measured(100, [0.01, 0.01])
    book.add_rank(2)
    assert book.depth_of(2) == 1 and book.lease(2, now=0.1) is not None and book.lease(2, now=0.1) is None
    book.done(2, book.outstanding[2][0], 16, None, now=0.11)
    assert book.depth_of(2) > 1


def _replaced_stragglers(workers: int, lost: Tuple[int, ...]) -> LeaseBook:
    """``workers`` ranks doing a chunk of 16 positions in 10 ms; the sessions of ``lost`` lost holding
    two chunks each (the others walked past them), each replacement measured a straggler by the
    first of them (0.6 s)."""
    book = LeaseBook(num_workers=workers, chunk_size=16, depth=2, window=16)
    for rank in sorted(2 * list(range(workers))):
        book.lease(rank, now=0.0)

    def walked(rank: int, now: float) -> None:
        chunk = book.outstanding[rank][0]
        book.arrived(rank, 16)
        book.done(rank, chunk, 16, None, now=now)
        for _ in range(16):
            book.deliver(chunk)

    for rank in range(workers):
        walked(rank, 0.01)
        walked(rank, 0.02)
    for rank in [*sorted(2 * list(lost)), *(rank for rank in range(workers) if rank not in lost)]:
        book.lease(rank, now=0.03)
    for rank in lost:
        assert len(book.lost(rank)) == 2
    for rank in lost:
        assert book.lease(rank, now=0.05) is not None
        walked(rank, 0.65)
    return book


def test_a_lost_sessions_chunk_only_its_replacement_may_take_goes_to_it_even_if_it_is_a_straggler():
    book = _replaced_stragglers(3, lost=(1,))
    assert book.pending == [(7, 0)] and book.holds_window(1, 16, now=0.65)  # the rule would keep it from chunk 7 ...
    assert book.latest[0] > 7 and book.latest[2] > 7  # ... which no other session may take (a stream is walked once):
    assert book.lease(1, now=0.65) == (7, 0)  # held back, it would stall the window's head until a probe
    # While another session may take a pending chunk (a session that walked nothing yet), it gets it instead.
    book = _replaced_stragglers(3, lost=(1,))
    assert book.lost(0) == [8]
    assert book.lease(1, now=0.65) is None and book.lease(0, now=0.65) == (7, 0)
    # Two replacements, each a straggler the rule keeps from the pending chunks: neither waits for the other.
    book = _replaced_stragglers(5, lost=(1, 3))
    assert book.pending == [(12, 0), (13, 0)]
    assert book.holds_window(1, 16, now=0.65) and book.holds_window(3, 16, now=0.65)
    assert book.lease(1, now=0.65) == (12, 0) and book.lease(3, now=0.65) == (13, 0)


def noisy(x: int) -> tuple:
    """Randomness after the sharding point (seeded per chunk with "dynamic")."""
    return x, random.randrange(10**9)


def _epochs(server: Any, worker_init_fn: Optional[Any]) -> Tuple[List[list], int]:
    """Two seeded epochs over 3 sessions of ``server`` (a window of 6 chunks of 2 positions), and
    the items session 2 produced in both."""
    service = remote(server, 3, distribution=Dynamic(chunk_size=2, window=6), worker_init_fn=worker_init_fn)
    graph = IterableWrapper(range(N)).shuffle().sharding_filter().map(slow_identity).map(noisy)
    epochs, items = [], 0
    with DataLoader2(graph, reading_service=service) as dl:
        dl.seed(11)
        for _ in range(2):
            epochs.append(list(dl))
            items += dl.reading_service.stats().workers[2].items_consumed
    return epochs, items


@pytest.mark.timeout(60)
def test_a_straggler_does_less_and_the_items_and_order_are_a_fast_fleets(worker_server):
    # Items of about 2 ms, 27 ms on session 2: it would hold the window's head for about 50 ms a
    # chunk, while the others go through the window in about 15 ms. Before the window rule it
    # produced a sixth of the first epoch's items (the others waited for it), about 60 of both.
    fast, _ = _epochs(worker_server, None)
    slow, straggler_items = _epochs(worker_server, slow_rank(2, 0.025))
    assert slow == fast and slow[0] != slow[1]  # the same items, order and random values, per epoch
    for epoch in slow:
        assert sorted(x for x, _ in epoch) == list(range(N))
    assert straggler_items <= N // 8, straggler_items  # equal chunks: N / 3 per epoch
