"""Servers that join a running run: by ``add_workers``, by registering in a TCPStore, by a line
added to a hostfile.

Real CLI servers on loopback. Under ``distribution="dynamic"`` a server that joins mid-epoch
takes leases in that epoch: the first server's session stops at its 10th item until a session of
another server has produced an item (:class:`WaitForJoiner`), so the epoch cannot end unless the
joined server took work; its items equal a fixed fleet's, in order. Under ``"round_robin"`` it
serves from the next epoch on, each epoch exactly once. A join and a drain in one run lose nothing.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import time
from pathlib import Path

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import FileGate, run_epochs, start_server, wait_until
from prometheus_client import CollectorRegistry, generate_latest
from test_drain import Hold
from test_metrics import parse, trainer_value
from rpc_reading_service import Hostfile, RPCReadingService, StoreDiscovery
from rpc_reading_service.metrics import ReadingServiceCollector
from rpc_reading_service.discovery import connect_store
from rpc_reading_service.discovery.store import registered_workers, slot_key

ITEMS = 160
DELAY = 0.004  # seconds per item: a chunk of 16 takes longer than a lease's round trip


class WaitForJoiner:
    """A map function: slow items; in the sessions of server ``first`` (their parent process) item
    ``at`` waits until a session of another server produced an item (``marker`` opens)."""

    def __init__(self, first: int, marker: FileGate, at: int = 10):
        self.first, self.marker, self.at = first, marker, at
        self.seen = 0

    def __call__(self, item: int) -> int:
        time.sleep(DELAY)
        if os.getppid() != self.first:
            self.marker.open()
        else:
            self.seen += 1
            if self.seen == self.at:
                self.marker.wait()
        return item


def slow(item: int) -> int:
    """An item, after :data:`DELAY`."""
    time.sleep(DELAY)
    return item


def graph(fn=slow):
    return IterableWrapper(range(ITEMS)).shuffle().sharding_filter().map(fn)


@pytest.fixture
def servers(tmp_path):
    """``start(*args)``: a server sharing the first one's key; every one stopped after the test."""
    started = []

    def start(*args: str):
        key = started[0].key if started else None
        started.append(start_server(tmp_path, ["--drain-timeout", "10", *args], key=key))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def service(first, distribution, **options):
    options.setdefault("workers", [first.address])
    return RPCReadingService(num_workers=1, auth_key=first.key, distribution=distribution, timeout=20.0, **options)


def reference(first, distribution, epochs=1):
    return run_epochs(graph(), service(first, distribution), n_epochs=epochs, seed=11)


def consumed_by(stats, address):
    return sum(worker.items_consumed for worker in stats.workers if worker.address == address)


@pytest.mark.timeout(60)
def test_a_server_added_mid_epoch_takes_leases_in_that_epoch_under_dynamic(servers, tmp_path, caplog):
    first, joiner = servers(), servers()
    expected = reference(first, "dynamic")[0]
    marker = FileGate(tmp_path / "joined", timeout=30)
    items, added = [], None
    with DataLoader2(graph(WaitForJoiner(first.pid, marker)), reading_service=service(first, "dynamic")) as dl:
        dl.seed(11)
        for item in dl:
            items.append(item)
            if added is None:
                # Another spelling of the joiner, the first server again, nothing listening, another key.
                with caplog.at_level(logging.WARNING):
                    added = dl.reading_service.add_workers(
                        [joiner.address.replace("127.0.0.1", "localhost"), first.address, "127.0.0.1:1"]
                    )
                assert dl.reading_service.add_workers([joiner.address]) == []  # not twice
        stats = dl.reading_service.stats()
        registry = CollectorRegistry()
        registry.register(ReadingServiceCollector(dl))
        assert trainer_value(parse(generate_latest(registry).decode()), "joins_total") == 1
    assert added == [joiner.address.replace("127.0.0.1", "localhost")]
    assert "worker server 127.0.0.1:1 cannot join the run" in caplog.text
    assert items == expected  # the fixed fleet's items, in its order
    assert consumed_by(stats, added[0]) > 0 and stats.joins == 1
    assert "1 server joined" in stats.summary()


@pytest.mark.timeout(60)
def test_a_server_that_fails_its_handshake_is_skipped(servers, tmp_path, caplog):
    first = servers()
    stranger = start_server(tmp_path)  # another key
    try:
        with DataLoader2(graph(), reading_service=service(first, "dynamic")) as dl:
            dl.seed(11)
            iterator = iter(dl)
            items = [next(iterator)]
            with caplog.at_level(logging.WARNING):
                assert dl.reading_service.add_workers([stranger.address]) == []
            items += list(iterator)
    finally:
        stranger.stop()
    assert sorted(items) == list(range(ITEMS))
    assert f"worker server {stranger.address} cannot join the run" in caplog.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("distribution", ["round_robin", "first_ready", "sticky"])
def test_a_server_added_mid_epoch_serves_from_the_next_epoch_under_a_static_policy(servers, distribution):
    first, joiner = servers(), servers()
    expected = reference(first, distribution)[0]
    epochs = []
    with DataLoader2(graph(), reading_service=service(first, distribution)) as dl:
        dl.seed(11)
        epoch = []
        for item in dl:
            epoch.append(item)
            if len(epoch) == 5:
                assert dl.reading_service.add_workers([joiner.address]) == [joiner.address]
        epochs.append((epoch, dl.reading_service.stats()))
        epochs.append((list(dl), dl.reading_service.stats()))
    (first_epoch, during), (second_epoch, after) = epochs
    assert first_epoch == expected and consumed_by(during, joiner.address) == 0 and during.joins == 0
    assert sorted(second_epoch) == list(range(ITEMS))  # exactly once over the grown fleet
    assert consumed_by(after, joiner.address) > 0 and after.joins == 1 and len(after.workers) == 2


@pytest.mark.timeout(60)
def test_a_server_that_registers_in_the_store_mid_epoch_joins_it(servers, tmp_path):
    store = connect_store("127.0.0.1:0", host=True)
    where = f"127.0.0.1:{store.port}"
    first = servers("--store", where, "--job", "join")
    expected = reference(first, "dynamic")[0]
    marker = FileGate(tmp_path / "joined", timeout=30)
    discovery = StoreDiscovery(where, job="join", min_workers=1, timeout=20, poll_interval=0.1)
    items, joiner = [], None
    with DataLoader2(graph(WaitForJoiner(first.pid, marker)), reading_service=service(first, "dynamic", workers=discovery)) as dl:
        dl.seed(11)
        for item in dl:
            items.append(item)
            if joiner is None:
                joiner = servers("--store", where, "--job", "join")
        stats = dl.reading_service.stats()
    assert items == expected
    assert consumed_by(stats, joiner.address) > 0 and stats.joins == 1


@pytest.mark.timeout(60)
def test_a_server_added_to_the_hostfile_joins_from_the_next_epoch(servers, tmp_path, caplog):
    first, joiner = servers(), servers()
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{first.address}\n")
    expected = reference(first, "round_robin")[0]
    options = dict(workers=Hostfile(str(hostfile), poll_interval=0.1))
    with caplog.at_level(logging.INFO, logger="rpc_reading_service.trainer.engine.run"):
        with DataLoader2(graph(), reading_service=service(first, "round_robin", **options)) as dl:
            dl.seed(11)
            epoch = []
            for item in dl:
                epoch.append(item)
                if len(epoch) == 5:
                    with open(hostfile, "a") as lines:
                        lines.write(f"# joined mid-epoch\n{joiner.address}\n")
            assert wait_until(lambda: f"worker server {joiner.address} joined" in caplog.text, 30)
            second = list(dl)
            stats = dl.reading_service.stats()
    assert epoch == expected and sorted(second) == list(range(ITEMS))
    assert consumed_by(stats, joiner.address) > 0 and stats.joins == 1


def two_epochs(rs, change, at=5, pipe=None) -> list:
    """Two epochs of ``pipe`` (default: :func:`graph`) on ``rs`` (seed 11), calling ``change(dl)``
    at the ``at``-th item of the first; each epoch's ``(items, stats)``."""
    epochs = []
    with DataLoader2(graph() if pipe is None else pipe, reading_service=rs) as dl:
        dl.seed(11)
        epoch = []
        for item in dl:
            epoch.append(item)
            if len(epoch) == at:
                change(dl)
        epochs.append((epoch, dl.reading_service.stats()))
        epochs.append((list(dl), dl.reading_service.stats()))
    return epochs


def free_port() -> int:
    """A port no one listens on (the OS's pick, released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("distribution", ["dynamic", "round_robin", "first_ready"])
def test_a_hostfile_entry_that_is_not_up_yet_joins_later_and_one_removed_is_retired(servers, tmp_path, caplog,
                                                                                     distribution):  # fmt: skip
    first, removed = servers(), servers()
    port = free_port()
    late = f"127.0.0.1:{port}"
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{first.address}\n{removed.address}\n")
    rs = RPCReadingService(workers=Hostfile(str(hostfile), poll_interval=0.1), num_workers=2, auth_key=first.key,
                           distribution=distribution, timeout=20.0)  # fmt: skip

    def change(_dl):  # the file rewritten in one step; the late entry does not answer yet
        (tmp_path / "hosts.new").write_text(f"{first.address}\n{late}\n")
        os.replace(tmp_path / "hosts.new", hostfile)
        assert wait_until(lambda: f"worker server {late} cannot join the run" in caplog.text, 20)
        assert wait_until(lambda: f"worker server {removed.address} left hostfile" in caplog.text, 20)
        servers("--port", str(port))
        assert wait_until(lambda: f"worker server {late} joined" in caplog.text, 20)

    with caplog.at_level(logging.INFO, logger="rpc_reading_service"):
        (first_epoch, during), (second_epoch, after) = two_epochs(rs, change)
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(ITEMS))
    assert {w.address for w in during.workers} >= {first.address, removed.address}  # the removed one served on
    assert dict(collections.Counter(w.address for w in after.workers)) == {first.address: 1, late: 1}
    assert consumed_by(after, late) > 0 and consumed_by(after, removed.address) == 0
    assert wait_until(lambda: not removed.session_pids(), 10) and removed.alive()  # closed, not stopped


@pytest.mark.timeout(60)
def test_a_server_removed_from_the_store_is_retired_at_the_next_epoch(servers, caplog):
    store = connect_store("127.0.0.1:0", host=True)
    where = f"127.0.0.1:{store.port}"
    first, removed = servers("--store", where, "--job", "leave"), servers("--store", where, "--job", "leave")
    discovery = StoreDiscovery(where, job="leave", min_workers=2, timeout=20, poll_interval=0.1)
    rs = RPCReadingService(workers=discovery, num_workers=2, auth_key=first.key, distribution="sticky", timeout=20.0)

    def change(_dl):  # its entry goes, the server stays up
        [slot] = [slot for slot, address in registered_workers(store, "leave") if address == removed.address]
        store.delete_key(slot_key("leave", slot))
        assert wait_until(lambda: f"worker server {removed.address} left the TCPStore" in caplog.text, 20)

    with caplog.at_level(logging.INFO, logger="rpc_reading_service"):
        (first_epoch, during), (second_epoch, after) = two_epochs(rs, change)
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(ITEMS))
    assert consumed_by(during, removed.address) > 0  # it served the epoch it left the store in
    assert [w.address for w in after.workers] == [first.address]
    assert wait_until(lambda: not removed.session_pids(), 10) and removed.alive()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("distribution", ["dynamic", "round_robin"])
def test_one_server_drains_while_another_joins_and_every_item_comes_once(servers, tmp_path, distribution):
    first, leaving, joiner = servers(), servers(), servers()
    fixed = dict(workers=[first.address, leaving.address], num_workers=2, auth_key=first.key)
    expected = run_epochs(graph(), RPCReadingService(distribution=distribution, timeout=20.0, **fixed), 2, seed=5)
    gate = FileGate(tmp_path / "gate", timeout=30)  # the leaving server's session waits mid-shard: it drains there
    epochs = []
    rs = RPCReadingService(distribution=distribution, timeout=20.0, **fixed)
    try:
        with DataLoader2(graph(Hold(leaving.pid, gate)), reading_service=rs) as dl:
            dl.seed(5)
            epoch = []
            for item in dl:
                epoch.append(item)
                if len(epoch) == 1:
                    assert wait_until(Path(gate.path + ".held").exists, 20), "the leaving server's session never held"
                    assert dl.reading_service.add_workers([joiner.address]) == [joiner.address]
                    os.kill(leaving.pid, signal.SIGTERM)
            epochs.append((epoch, dl.reading_service.stats()))
            epochs.append((list(dl), dl.reading_service.stats()))
    finally:
        gate.open()
    (first_epoch, during), (second_epoch, after) = epochs
    assert first_epoch == expected[0]  # the fixed fleet's order, though one left and one came
    assert during.drains == 1 and (during.joins, after.joins) == ((1, 0) if distribution == "dynamic" else (0, 1))
    assert sorted(second_epoch) == list(range(ITEMS))
    assert consumed_by(after, joiner.address) > 0 and consumed_by(after, leaving.address) == 0
    assert sorted(w.address for w in after.workers) == sorted([first.address, joiner.address])  # the leaving one's rank retired
    assert wait_until(lambda: not leaving.alive(), 15)
