"""A join and drain soak: for several epochs a server joins mid-epoch and another drains (SIGTERM)
mid-epoch, on loopback CLI servers under ``distribution="dynamic"``.

Every epoch delivers every item exactly once, in a fixed fleet's order for the seed; from the next
epoch on the run's sessions are those of the servers left (a drained server's ranks are retired,
not kept on a survivor); the trainer's threads and open descriptors do not grow from epoch to
epoch; every drained server exits 0. Bounded: about 15 s.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import pytest
from torchdata.dataloader2 import DataLoader2

from _server_helpers import run_epochs, wait_until
from test_join import ITEMS, consumed_by, graph
from rpc_reading_service import RPCReadingService
from rpc_reading_service.policies.dynamic.trainer import Dynamic

EPOCHS = 5
JOIN_AT, DRAIN_AT = 20, 60  # items into each epoch
PER_SERVER = 2  # sessions of each server (num_workers=4 over the first two): a joiner gets as many
#: Small chunks, few ahead: every session holds work until the epoch's end (the drained ones too).


def paced(item: int) -> int:
    """An item, after 15 ms (an epoch on two servers takes about 1 s)."""
    time.sleep(0.015)
    return item


def trainer_resources(dl) -> tuple:
    """The trainer's threads, and its open descriptors less one socket per session."""
    sessions = len(dl.reading_service.stats().workers)
    return len(threading.enumerate()), len(os.listdir("/proc/self/fd")) - sessions


def sessions_by_server(dl) -> dict:
    return dict(collections.Counter(worker.address for worker in dl.reading_service.stats().workers))


@pytest.mark.timeout(60)
def test_servers_join_and_drain_every_epoch_and_every_epoch_is_exactly_once(fresh_server):
    args = ["--drain-timeout", "10"]
    fleet = [fresh_server(args=args)]
    fleet.append(fresh_server(args=args, key=fleet[0].key))
    rs = lambda: RPCReadingService(workers=[s.address for s in fleet], num_workers=2 * PER_SERVER,  # noqa: E731
                                   auth_key=fleet[0].key, distribution=Dynamic(chunk_size=4, window=16), timeout=20.0)  # fmt: skip
    expected = run_epochs(graph(int), rs(), EPOCHS, seed=1)  # a fixed fleet's epochs, the same seeds
    joiners = [fresh_server(args=args, key=fleet[0].key) for _ in range(EPOCHS)]  # before any count is taken
    drained, baseline, started = [], None, time.monotonic()
    with DataLoader2(graph(paced), reading_service=rs()) as dl:
        dl.seed(1)
        for epoch in range(EPOCHS):
            joiner = joiners[epoch]
            items = []
            for item in dl:
                items.append(item)
                if len(items) == 1:  # the sessions of the servers the run has, each its share
                    assert sessions_by_server(dl) == {s.address: PER_SERVER for s in fleet}, (epoch, fleet)
                elif len(items) == JOIN_AT:
                    assert dl.reading_service.add_workers([joiner.address]) == [joiner.address]
                    fleet.append(joiner)
                elif len(items) == DRAIN_AT:
                    drained.append(fleet.pop(0))
                    os.kill(drained[-1].pid, signal.SIGTERM)
            assert items == expected[epoch], f"epoch {epoch} lost, repeated or reordered items"
            stats = dl.reading_service.stats()
            assert (stats.joins, stats.drains, stats.reassignments) == (1, PER_SERVER, 0), (epoch, stats)
            assert stats.items == ITEMS and sessions_by_server(dl) == {s.address: PER_SERVER for s in fleet}  # no take-over left
            if baseline is None:  # after the first join and drain: the steady state
                baseline = trainer_resources(dl)
            else:
                assert wait_until(lambda: trainer_resources(dl) <= baseline, 5), (epoch, trainer_resources(dl), baseline)
        assert consumed_by(stats, fleet[-1].address) > 0  # the last joiner served
        next(iter(dl))  # one more epoch: after the last drain too
        assert sessions_by_server(dl) == {s.address: PER_SERVER for s in fleet}
    for server in drained:
        assert wait_until(lambda: server.proc.poll() is not None, 15) and server.proc.poll() == 0, server.stderr()
    assert time.monotonic() - started < 45  # about 15 s alone: no drain timeout (10 s) was waited out
