"""Several threads and one DataLoader2: a clear error at once, never a hang or a duplicate.

DataLoader2 serves one iterator at a time, but does not lock. Two threads that iterate one
DataLoader2 at once used to share the workers' streams: one thread received both epochs'
items (200 of 100), the other waited forever while heartbeats flowed.

The choice made here: the thread that starts the second, concurrent iteration gets a
``RuntimeError`` at once (from ``iter(dl)``, so DataLoader2 does not shut down) and the
first thread's epoch goes on untouched. MultiProcessingReadingService has no such check,
and nothing to copy (observed with torchdata 0.9, two workers): a second thread starting
while the first iterates makes the first thread's epoch end early and silently (4,291 of
100,000 items) while the second thread waits forever; two threads starting together fail
with an unrelated "Attempt to override existing reduce_ex_hook" or hang. Sequential use
from several threads keeps working: a new epoch
after an abandoned one invalidates the old iterator (torchdata's own rule, DataLoader2's
``RuntimeError``), and an iterator handed to another thread is fine. ``dl.shutdown()`` from
another thread wakes the iterating thread with an error instead of leaving it waiting.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from _server_helpers import wait_until
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import Liveness, RPCReadingService

N = 40
GATE_AT = 4  # items from here on wait for the gate file: the iterating thread blocks inside next()


def gated(gate: str, x: int) -> int:
    """Item ``x``, once ``gate`` exists (for ``x >= GATE_AT``); gives up after 20 s."""
    deadline = time.monotonic() + 20
    while x >= GATE_AT and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.005)
    return x


def _loader(gate: Path) -> DataLoader2:
    graph = IterableWrapper(range(N)).sharding_filter().map(functools.partial(gated, str(gate)))
    service = RPCReadingService(num_workers=2, timeout=5.0, liveness=Liveness(heartbeat_interval=0.5))
    return DataLoader2(graph, reading_service=service)


class _Iterating(threading.Thread):
    """A thread that takes every item of one epoch of ``dl``, or the error it got."""

    def __init__(self, dl: DataLoader2):
        super().__init__(name="first-iterator", daemon=True)
        self.dl, self.items, self.error = dl, [], None  # type: ignore[var-annotated]

    def run(self) -> None:
        try:
            for item in self.dl:
                self.items.append(item)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc


@pytest.fixture
def blocked_iteration(tmp_path) -> Iterator[Tuple[DataLoader2, _Iterating, Path]]:
    """A DataLoader2, a thread waiting inside next() for its item GATE_AT, and the gate file."""
    gate = tmp_path / "gate"
    dl = _loader(gate)
    first = _Iterating(dl)
    try:
        first.start()
        # Items from GATE_AT on are held back by the workers: having the ones before, the
        # thread can only be waiting inside next().
        assert wait_until(lambda: len(first.items) == GATE_AT, 30), (first.items, first.error)
        yield dl, first, gate
    finally:
        gate.touch()
        dl.shutdown()
        first.join(10)


@pytest.mark.timeout(60)
def test_a_second_concurrent_iteration_is_refused_at_once_and_the_first_goes_on(blocked_iteration):
    dl, first, gate = blocked_iteration
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        iter(dl)  # what `for item in dl` in a second thread does first
    assert time.monotonic() - start < 5.0  # at once: not when the first iteration's gate opens
    message = str(info.value)
    assert "two threads use one DataLoader2 at once" in message
    assert f"thread {threading.current_thread().name!r} is starting an epoch" in message
    assert "thread 'first-iterator' is taking an item" in message
    assert "give each thread its own DataLoader2" in message
    gate.touch()
    first.join(20)
    assert not first.is_alive() and first.error is None, first.error
    assert sorted(first.items) == list(range(N))  # the whole epoch, each item once
    assert sorted(dl) == list(range(N))  # and the loader serves the next epoch as usual


@pytest.mark.timeout(60)
def test_sequential_use_from_several_threads_keeps_working(tmp_path):
    """An epoch abandoned in one thread and a new one in another: torchdata's invalidation."""
    gate = tmp_path / "gate"
    gate.touch()
    dl = _loader(gate)
    try:
        abandoned = iter(dl)
        taken: List[Any] = []
        worker = threading.Thread(target=lambda: taken.extend(next(abandoned) for _ in range(5)))
        worker.start()
        worker.join(30)
        assert len(taken) == 5
        results: Dict[str, Any] = {}
        thread = threading.Thread(target=lambda: results.setdefault("epoch", sorted(dl)))
        thread.start()
        thread.join(30)
        assert results["epoch"] == list(range(N))  # a whole new epoch, nothing taken by the old one
        with pytest.raises(RuntimeError, match="This iterator has been invalidated"):
            next(abandoned)
        assert sorted(dl) == list(range(N))
    finally:
        dl.shutdown()


@pytest.mark.timeout(60)
def test_shutdown_from_another_thread_wakes_the_iterating_thread(blocked_iteration):
    dl, first, _gate = blocked_iteration
    start = time.monotonic()
    dl.shutdown()
    first.join(5)
    assert not first.is_alive(), "the iterating thread still waits for items after shutdown()"
    assert time.monotonic() - start < 5.0
    assert isinstance(first.error, RuntimeError)
    assert "the DataLoader2 was shut down while this iteration waited for items from worker" in str(first.error)


@pytest.mark.timeout(60)
def test_two_threads_starting_together_get_a_whole_epoch_or_a_runtime_error(tmp_path):
    """Whoever wins, nobody hangs, and nobody gets a partial or duplicated epoch without an error."""
    gate = tmp_path / "gate"
    gate.touch()
    dl = _loader(gate)
    start = threading.Barrier(2)
    outcomes: Dict[str, Any] = {}

    def iterate(name: str) -> None:
        start.wait()
        try:
            outcomes[name] = sorted(dl)
        except RuntimeError as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=iterate, args=(name,), name=name, daemon=True) for name in "AB"]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads), f"a thread hangs: {outcomes}"
        for name, outcome in outcomes.items():
            assert isinstance(outcome, RuntimeError) or outcome == list(range(N)), (name, outcome)
        assert any(isinstance(outcome, RuntimeError) for outcome in outcomes.values()), outcomes
    finally:
        dl.shutdown()
