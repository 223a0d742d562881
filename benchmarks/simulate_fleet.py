"""A fleet simulation at sizes this machine cannot hold: the real "dynamic" lease book, simulated workers.

A discrete-event simulation (heapq, virtual clock, no threads, no sockets) drives the trainer's
:class:`~rpc_reading_service.policies.dynamic.leases.LeaseBook` and its chunk schedule with the
calls :class:`~rpc_reading_service.policies.dynamic.merger.DynamicMerger` makes (``wants_leases``,
``lease``, ``to_finish``, ``arrived``, ``done_many``, ``settle``, ``add_rank``, ``lost``), with
simulated workers that walk their leases at their own rate, join and drain at given rates, and
checks that every position is delivered exactly once and in order. Run:
``python benchmarks/simulate_fleet.py [--quick]`` (prints a Markdown table; see benchmarks/FLEET.md).
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools
import random
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from rpc_reading_service.policies.dynamic.leases import (
    CHUNK_LEAD_SECONDS,
    MAX_CHUNK_DEPTH,
    WINDOW_BYTES_PER_WORKER,
    LeaseBook,
)
from rpc_reading_service.policies.dynamic.schedule import DIVISOR, SMALLEST, GuidedChunks
from rpc_reading_service.policies.dynamic.trainer import Dynamic

#: One-way latency between the trainer and a worker (simulated seconds).
LATENCY = 0.0005
#: A normal worker's items per second (each worker's rate varies by +-10 %).
RATE = 50.0
#: How long a drained worker's rank takes to go on in a new session elsewhere (simulated seconds).
RECONNECT = 1.0
#: An epoch this many times longer than the scenario's ideal at the start is taken as stalled.
STALLED = 100
#: Bytes per item (what the book's byte-sized window reads).
ITEM_BYTES = 64 * 1024


@dataclass
class Scenario:
    """One run: ``workers`` at the start, ``churn`` joining and draining per simulated minute
    (fractions of the starting fleet), ``stragglers`` (a fraction, 5-10x slower), ``seconds`` of
    ideal epoch at the starting fleet's speed, and the random ``seed``."""

    workers: int
    churn: float
    stragglers: float
    seconds: float = 180.0
    seed: int = 0


@dataclass
class Result:
    """What one run measured (see :func:`table` for the columns)."""

    scenario: Scenario
    positions: int
    epoch_seconds: float
    ideal_seconds: float
    leases: int
    lease_messages: int
    chunk_done: int
    max_buffered: int
    joined: int
    drained: int
    delivered: List[Tuple[int, int]] = field(repr=False, default_factory=list)

    @property
    def ratio(self) -> float:
        """Epoch time over the ideal."""
        return self.epoch_seconds / self.ideal_seconds


class Fleet:
    """The simulated workers and the trainer's side of one epoch (the merger's calls on the book)."""

    def __init__(self, scenario: Scenario):
        self.scenario, self.random = scenario, random.Random(scenario.seed)
        self.events: List[Tuple[float, int, str, tuple]] = []
        self.order = itertools.count()
        self.now = 0.0
        self.rates: Dict[int, float] = {}
        self.session: Dict[int, int] = {}  # rank -> session number (events of an older one are stale)
        self.queue: Dict[int, collections.deque] = {}  # rank -> leases received, not yet walked
        self.busy: Dict[int, bool] = {}
        self.gone: set = set()
        self.hungry: set = set(range(scenario.workers))  # ranks that may take a lease
        for _ in range(scenario.workers):
            self.rates[len(self.rates)] = self._rate()
        self.positions = int(scenario.seconds * sum(self.rates.values()))
        policy = Dynamic()
        workers = scenario.workers
        schedule = GuidedChunks(
            self.positions, workers, policy.chunk_size, policy.max_chunk_size, DIVISOR, SMALLEST,
            warmup=policy.depth * workers,
        )  # fmt: skip
        self.book = LeaseBook(
            workers, policy.chunk_size, policy.depth, 4 * policy.depth * workers, max_depth=MAX_CHUNK_DEPTH,
            window_bytes=WINDOW_BYTES_PER_WORKER * workers, lead_seconds=CHUNK_LEAD_SECONDS,
            expected_chunks=schedule.chunks_below(self.positions), schedule=schedule,
        )  # fmt: skip
        for rank in self.rates:
            self._start(rank)
        self.lease_messages = self.chunk_done = self.joined = self.drained = 0
        self.buffers: Dict[int, int] = {}  # chunk -> items received and not handed on
        self.buffered = self.max_buffered = 0
        self.delivered: List[Tuple[int, int]] = []
        self.capacity: List[Tuple[float, float]] = [(0.0, sum(self.rates.values()))]

    def _rate(self) -> float:
        rate = RATE * self.random.uniform(0.9, 1.1)
        if self.random.random() < self.scenario.stragglers:
            rate /= self.random.uniform(5, 10)
        return rate

    def _start(self, rank: int) -> None:
        self.session[rank] = self.session.get(rank, -1) + 1
        self.queue[rank], self.busy[rank] = collections.deque(), False

    def _at(self, delay: float, kind: str, *args: object) -> None:
        heapq.heappush(self.events, (self.now + delay, next(self.order), kind, args))

    # -- the trainer (what DynamicMerger does) ---------------------------------------------------
    def top_up(self, rank: int) -> None:
        """The merger's ``_top_up``: leases for ``rank`` in one LEASE send, then the final ones."""
        book, leases = self.book, []
        if rank not in self.gone and book.wants_leases(rank):
            while (lease := book.lease(rank, self.now)) is not None:
                leases.append(lease)
        finish = book.to_finish()
        if leases or rank in finish:
            self.lease_messages += 1
            self._at(LATENCY, "lease", rank, self.session[rank], [(c, *book.bounds(c)) for c, _skip in leases])
        self.lease_messages += sum(1 for r in finish if r != rank)
        if rank not in self.gone and len(book.outstanding[rank]) < book.depth_of(rank):
            self.hungry.add(rank)
        else:
            self.hungry.discard(rank)

    def top_up_all(self) -> None:
        """The merger's ``_top_up_all``, over the ranks holding less than their depth (the others
        would get nothing: the same leases, without a call per rank of a fleet of thousands)."""
        for rank in sorted(self.hungry):
            self.top_up(rank)

    def on_done(self, rank: int, session: int, chunk: int, items: int) -> None:
        """A DATA frame with ``chunk``'s items, then its CHUNK_DONE, arrived from ``rank``."""
        if session != self.session[rank] or rank in self.gone:
            return  # left over from a drained session
        book = self.book
        book.received(items, items * ITEM_BYTES)
        for filed, count in book.arrived(rank, items):
            self.buffers[filed] = self.buffers.get(filed, 0) + count
            self.buffered += count
        self.chunk_done += 1
        length = self.positions if book.schedule.start(chunk + 1) >= self.positions else None  # its walk reached the end
        book.done_many(rank, chunk, (items,), length, self.now)
        self.max_buffered = max(self.max_buffered, self.buffered)
        before = book.complete_below
        self.deliver()
        self.top_up(rank)
        if length is not None or book.complete_below != before:
            self.top_up_all()

    def deliver(self) -> None:
        """The merger's ``_deliver_ready``: hand on the oldest chunks' items as far as they are here."""
        book = self.book
        while not book.over:
            chunk = book.complete_below
            items = self.buffers.pop(chunk, 0)
            if not items:
                return
            start = book.schedule.start(chunk) + book.delivered.get(chunk, 0)
            self.delivered.append((start, items))
            book.delivered[chunk] = book.delivered.get(chunk, 0) + items
            self.buffered -= items
            book.settle(chunk)

    # -- the workers -----------------------------------------------------------------------------
    def on_lease(self, rank: int, session: int, leases: list) -> None:
        """LEASE arrived at ``rank``'s worker: it walks the chunks in order."""
        if session != self.session[rank] or rank in self.gone:
            return
        self.queue[rank].extend(leases)
        self.walk(rank)

    def walk(self, rank: int) -> None:
        """Start ``rank``'s next chunk if it is idle and holds one."""
        if self.busy[rank] or not self.queue[rank]:
            return
        chunk, start, size = self.queue[rank].popleft()
        items = max(0, min(size, self.positions - start))
        self.busy[rank] = True
        self._at(max(items, 1) / self.rates[rank], "walked", rank, self.session[rank], chunk, items)

    def on_walked(self, rank: int, session: int, chunk: int, items: int) -> None:
        """``rank`` packed ``chunk``'s last item: its DATA and CHUNK_DONE go out."""
        if session != self.session[rank] or rank in self.gone:
            return
        self.busy[rank] = False
        self._at(LATENCY, "done", rank, session, chunk, items)
        self.walk(rank)

    # -- churn ----------------------------------------------------------------------------------
    def on_join(self) -> None:
        """A server joined: its session takes the next leases (the merger's ``_adopt``)."""
        rank = len(self.rates)
        self.rates[rank] = self._rate()
        self._start(rank)
        self.book.add_rank(rank)
        self.joined += 1
        self._capacity()
        self.top_up(rank)

    def on_drain(self) -> None:
        """A server drains (LEAVING): its session is lost (its chunks not done go back to pending,
        as ``book.lost`` does) and, as the engine's take-over does, its rank goes on in a fresh
        session on another server after :data:`RECONNECT` seconds (modelled as a new server)."""
        active = [rank for rank in self.rates if rank not in self.gone]
        if not active:
            return
        rank = self.random.choice(active)
        self.gone.add(rank)
        self.session[rank] += 1  # what the drained session still sends is stale
        self.book.lost(rank)
        self.drained += 1
        self._capacity()
        self._at(RECONNECT, "reopen", rank)
        self.top_up_all()

    def on_reopen(self, rank: int) -> None:
        """``rank``'s new session is ready on its new server."""
        self.gone.discard(rank)
        self.rates[rank] = self._rate()
        self._start(rank)
        self._capacity()
        self.top_up(rank)

    def _capacity(self) -> None:
        self.capacity.append((self.now, sum(r for k, r in self.rates.items() if k not in self.gone)))

    def ideal(self) -> float:
        """When the fleet as it was at each moment, with no overhead, would have produced every position."""
        work, steps = float(self.positions), self.capacity + [(float("inf"), 0.0)]
        for (start, rate), (end, _next) in zip(steps, steps[1:]):
            if rate * (end - start) >= work:
                return start + work / rate
            work -= rate * (end - start)
        raise AssertionError("unreachable: the last step lasts forever")

    def run(self) -> Result:
        """Simulate the epoch to its end and check what was delivered."""
        churn = self.scenario.churn * self.scenario.workers / 60.0  # events per simulated second, each way
        if churn:
            self._at(self.random.expovariate(churn), "join")
            self._at(self.random.expovariate(churn), "drain")
        self.top_up_all()
        handlers = {"reopen": self.on_reopen, "lease": self.on_lease, "walked": self.on_walked, "done": self.on_done}
        while not self.book.over:
            if not self.events or self.now > STALLED * self.scenario.seconds:
                raise RuntimeError(f"the simulation stalled at {self.now:.1f} s with the epoch not over")
            self.now, _order, kind, args = heapq.heappop(self.events)
            if kind == "join":
                self.on_join()
                self._at(self.random.expovariate(churn), "join")
            elif kind == "drain":
                self.on_drain()
                self._at(self.random.expovariate(churn), "drain")
            else:
                handlers[kind](*args)
        for rank, held in self.book.outstanding.items():
            if held:  # leased past the end before the end was known: END_OF_SHARD ends them
                self.book.end(rank)
        check_delivery(self.delivered, self.positions)
        return Result(
            self.scenario, self.positions, self.now, self.ideal(), sum(self.book.units.values()),
            self.lease_messages, self.chunk_done, self.max_buffered, self.joined, self.drained, self.delivered,
        )  # fmt: skip


def check_delivery(delivered: List[Tuple[int, int]], positions: int) -> None:
    """Raise unless the ``(first position, items)`` runs handed on cover ``[0, positions)`` once, in order."""
    expected = 0
    for start, items in delivered:
        if start != expected:
            raise AssertionError(f"delivered position {start} next, expected {expected} (a gap or a repeat)")
        expected += items
    if expected != positions:
        raise AssertionError(f"delivered {expected} positions of {positions}")


def scenarios(quick: bool, sizes: Optional[List[int]] = None, stragglers_only: bool = False) -> List[Scenario]:
    """The table's runs: 256 and 1,024 workers (``quick``: 16 and 32; or ``sizes``), with and without
    churn, 0/1/5 % stragglers (``stragglers_only``: 1/5 %)."""
    default, seconds = ((16, 32), 30.0) if quick else ((256, 1024), 60.0)
    return [
        Scenario(workers, churn, stragglers, seconds)
        for workers in sizes or default
        for churn in (0.0, 0.1)
        for stragglers in ((0.01, 0.05) if stragglers_only else (0.0, 0.01, 0.05))
    ]


def table(results: List[Result]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| workers | churn/min | stragglers | positions | joined | drained | epoch s | ideal s | ratio "
        "| LEASE msgs/item | chunks/item | CHUNK_DONE/item | max resequencing buffer (items) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s, n = r.scenario, r.positions
        lines.append(
            f"| {s.workers} | {s.churn:.0%} | {s.stragglers:.0%} | {n} | {r.joined} | {r.drained} "
            f"| {r.epoch_seconds:.1f} | {r.ideal_seconds:.1f} | {r.ratio:.3f} | {r.lease_messages / n:.2e} "
            f"| {r.leases / n:.2e} | {r.chunk_done / n:.2e} | {r.max_buffered} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the scenarios and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small fleets and a short epoch (seconds)")
    parser.add_argument("--workers", type=int, action="append", help="only fleets of this size (repeatable)")
    parser.add_argument("--stragglers-only", action="store_true", help="only the runs with stragglers")
    args = parser.parse_args(argv)
    header = True
    for scenario in scenarios(args.quick, args.workers, args.stragglers_only):  # row by row: a 1,024-worker run takes minutes
        lines = table([Fleet(scenario).run()]).splitlines()
        print("\n".join(lines if header else lines[2:]), flush=True)
        header = False
    return 0


if __name__ == "__main__":
    sys.exit(main())
