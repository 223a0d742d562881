"""``RPCReadingService.stats()``: per-worker counts, data stall, ``summary()``, session pids."""

from __future__ import annotations

import os
import time

import pytest
from conftest import children_of
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import RPCReadingService


def sleepy(x: int) -> int:
    time.sleep(0.01)
    return x


def _assert_table(stats) -> None:
    """``str(stats)``: the summary line, a header, then one aligned line per worker."""
    lines = str(stats).splitlines()
    assert lines[0] == stats.summary()
    assert lines[1].split() == ["rank", "address", "items", "units", "items/s", "wait", "s", "queue", "pid"]
    assert len(lines) == 2 + len(stats.workers)
    for line, worker in zip(lines[2:], stats.workers):
        rank, address, items, units, rate, wait, queue, pid = line.split()
        assert (int(rank), address, int(items.replace(",", "")), int(pid)) == (
            worker.rank, worker.address, worker.items_consumed, worker.pid,
        )  # fmt: skip
        assert units == ("-" if worker.units is None else f"{worker.units:,}")
        assert float(rate.replace(",", "")) == pytest.approx(worker.items_per_second, abs=0.5)
        assert float(wait) == pytest.approx(worker.wait_seconds, abs=0.005) and int(queue) == worker.queue_depth
    # Aligned: the last column (pid) is right-aligned, so the header and every row end together.
    assert len({len(line) for line in lines[1:]}) == 1, lines


@pytest.mark.timeout(60)
def test_counts_add_up_to_the_epoch_and_pids_are_the_session_processes(worker_server):
    addresses = [worker_server.address] * 3
    service = RPCReadingService(workers=addresses, auth_key=worker_server.key)
    dl = DataLoader2(IterableWrapper(range(200)).sharding_filter(), reading_service=service)
    try:
        assert dl.reading_service.stats().items == 0  # before the first epoch
        it = iter(dl)
        for _ in range(50):
            next(it)
        mid = dl.reading_service.stats()
        assert mid.epoch == 0 and mid.items == 50  # the first epoch, as in range(epochs) == sum(w.items_consumed for w in mid.workers)
        rest = list(it)
        assert len(rest) == 150
        first = dl.reading_service.stats()
        assert sorted(list(dl)) == list(range(200))
        second = dl.reading_service.stats()
        sessions = sorted(worker_server.session_pids())
    finally:
        dl.shutdown()

    for stats, epoch in ((first, 0), (second, 1)):
        assert stats.epoch == epoch
        assert stats.items == 200  # this epoch's, not the run's
        assert [w.rank for w in stats.workers] == [0, 1, 2]
        assert [w.items_consumed for w in stats.workers] == [67, 67, 66]  # the shards of 200 over 3
        for worker in stats.workers:
            assert worker.address == worker_server.address
            assert worker.items_received == worker.items_consumed
            assert worker.frames_received >= 1 and worker.bytes_received > 0
            assert worker.items_per_second > 0
        assert stats.elapsed_seconds > 0 and stats.items_per_second > 0
        assert 0.0 <= stats.data_stall <= 1.0
        summary = stats.summary()
        assert "\n" not in summary and f"epoch {epoch}: 200 items" in summary and "data stall" in summary
        assert stats.as_dict()["workers"][0]["items_consumed"] == 67
        _assert_table(stats)
    # pid: each worker's own session process on the server, the same in every epoch.
    pids = [w.pid for w in first.workers]
    assert pids == [w.pid for w in second.workers]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert sorted(pids) == sessions


@pytest.mark.timeout(60)
def test_data_stall_is_near_1_when_the_workers_are_slow():
    service = RPCReadingService(num_workers=2)
    dl = DataLoader2(IterableWrapper(range(60)).sharding_filter().map(sleepy), reading_service=service)
    try:
        assert sorted(dl) == list(range(60))  # the consumer does nothing: it waits for the workers
        stats = dl.reading_service.stats()
        sessions = sorted(children_of(dl.reading_service._local_server.pid))
    finally:
        dl.shutdown()
    assert stats.data_stall > 0.8, stats.summary()
    assert stats.wait_seconds == pytest.approx(sum(w.wait_seconds for w in stats.workers), abs=0.05)
    assert sorted(w.pid for w in stats.workers) == sessions  # local workers: children of the local server


@pytest.mark.timeout(60)
def test_data_stall_is_near_0_when_the_consumer_is_slow():
    service = RPCReadingService(num_workers=2)
    dl = DataLoader2(IterableWrapper(range(400)).sharding_filter(), reading_service=service)
    try:
        items = []
        for item in dl:
            time.sleep(0.005)  # the training step
            items.append(item)
        stats = dl.reading_service.stats()
    finally:
        dl.shutdown()
    assert sorted(items) == list(range(400))
    # Waiting happens only for the first item (the workers starting the epoch).
    assert stats.data_stall < 0.25, stats.summary()
    assert stats.items == 400 == sum(w.items_consumed for w in stats.workers)
