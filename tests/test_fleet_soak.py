"""A join and drain soak: for several epochs a server joins mid-epoch and another drains (SIGTERM)
mid-epoch, on loopback CLI servers under ``distribution="dynamic"``.

Every epoch delivers every item exactly once; the trainer's threads and open descriptors do not
grow from epoch to epoch; every drained server exits 0. Bounded: about 15 s. Known: the number of sessions grows by one
per join and drain (the drained server's session stays on a survivor in the next epochs).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from torchdata.dataloader2 import DataLoader2

from _server_helpers import wait_until
from test_join import ITEMS, consumed_by, graph
from rpc_reading_service import RPCReadingService

EPOCHS = 5
JOIN_AT, DRAIN_AT = 20, 60  # items into each epoch


def paced(item: int) -> int:
    """An item, after 15 ms (an epoch on two servers takes about 1.5 s)."""
    time.sleep(0.015)
    return item


def trainer_resources(dl) -> tuple:
    """The trainer's threads, and its open descriptors less one socket per session."""
    sessions = len(dl.reading_service.stats().workers)
    return len(threading.enumerate()), len(os.listdir("/proc/self/fd")) - sessions


@pytest.mark.timeout(60)
def test_servers_join_and_drain_every_epoch_and_every_epoch_is_exactly_once(fresh_server):
    args = ["--drain-timeout", "10"]
    fleet = [fresh_server(args=args)]
    fleet.append(fresh_server(args=args, key=fleet[0].key))
    rs = RPCReadingService(workers=[s.address for s in fleet], num_workers=1, auth_key=fleet[0].key,
                           distribution="dynamic", timeout=20.0)  # fmt: skip
    joiners = [fresh_server(args=args, key=fleet[0].key) for _ in range(EPOCHS)]  # before any count is taken
    drained, baseline, sessions, drains, started = [], None, [], [], time.monotonic()
    with DataLoader2(graph(paced), reading_service=rs) as dl:
        dl.seed(1)
        for epoch in range(EPOCHS):
            joiner = joiners[epoch]
            items = []
            for item in dl:
                items.append(item)
                if len(items) == JOIN_AT:
                    assert dl.reading_service.add_workers([joiner.address]) == [joiner.address]
                    fleet.append(joiner)
                elif len(items) == DRAIN_AT:
                    drained.append(fleet.pop(0))
                    os.kill(drained[-1].pid, signal.SIGTERM)
            assert sorted(items) == list(range(ITEMS)), f"epoch {epoch} lost or repeated items"
            stats = dl.reading_service.stats()
            sessions.append(len(stats.workers))
            drains.append(stats.drains)
            assert stats.joins == 1, (epoch, stats.joins)  # counted per epoch
            if baseline is None:  # after the first join and drain: the steady state
                baseline = trainer_resources(dl)
            else:
                assert wait_until(lambda: trainer_resources(dl) <= baseline, 5), (epoch, trainer_resources(dl), baseline)
    assert all(consumed_by(stats, s.address) > 0 for s in fleet)  # the last joiners served
    for server in drained:
        assert wait_until(lambda: server.proc.poll() is not None, 15) and server.proc.poll() == 0, server.stderr()
    assert time.monotonic() - started < 15
    assert sum(drains) >= 1, drains
    if sessions[-1] > sessions[0]:  # a drained server's session moves to a survivor and stays there
        pytest.xfail(f"sessions per epoch grow with each join and drain: {sessions}, drains {drains} (known, not fixed yet)")
