"""Ranks retired at an epoch boundary: the sessions of a run are those of the servers it has.

Two real CLI servers on loopback, two sessions each. A server that drains (SIGTERM) mid-epoch
has its work finished elsewhere in that epoch, and from the next epoch on its ranks are gone
under every distribution (a static policy's shards are recomputed over the servers left). A
server that dies (SIGKILL) keeps ``on_worker_failure``'s behaviour ("raise" raises); with
"reassign", under ``"dynamic"`` its rank is retired at the next epoch, under a static policy it
stays on the server that took it over.
"""

from __future__ import annotations

import collections
import os
import signal
from pathlib import Path

import pytest

from _server_helpers import FileGate, run_epochs, wait_until
from test_drain import ITEMS, Hold, graph
from test_join import two_epochs
from torchdata.dataloader2 import DataLoader2

from rpc_reading_service import RPCReadingService, WorkerDrainedError, WorkerLostError
from rpc_reading_service.policies.dynamic.trainer import Dynamic
from rpc_reading_service.trainer.config import ReadingServiceConfig
from rpc_reading_service.trainer.engine.fleet import Fleet

DISTRIBUTIONS = ["round_robin", "first_ready", "sticky", "dynamic"]


def sessions_by_server(stats) -> dict:
    return dict(collections.Counter(worker.address for worker in stats.workers))


def _two_epochs_struck(fresh_server, tmp_path, distribution, strike, **options):
    """Two epochs over two servers (two sessions each); ``strike(server)`` hits the second one in
    the first epoch while its sessions are held mid-shard. Returns the survivor, the struck
    server and each epoch's ``(items, stats)``."""
    survivor = fresh_server(args=["--drain-timeout", "10"])
    struck = fresh_server(args=["--drain-timeout", "10"], key=survivor.key)
    gate = FileGate(tmp_path / "gate", timeout=30)
    policy = Dynamic(chunk_size=4, window=16) if distribution == "dynamic" else distribution  # work left to lose
    rs = RPCReadingService(workers=[survivor.address, struck.address], num_workers=4, auth_key=survivor.key,
                           distribution=policy, timeout=20.0, **options)  # fmt: skip

    def strike_held(_dl):
        assert wait_until(Path(gate.path + ".held").exists, 20), "the struck server's sessions never held"
        strike(struck)

    try:
        epochs = two_epochs(rs, strike_held, at=1, pipe=graph(Hold(struck.pid, gate, at=5)))
    finally:
        gate.open()
    return survivor, struck, epochs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_a_drained_servers_ranks_are_retired_from_the_next_epoch(fresh_server, tmp_path, distribution):
    survivor, drained, ((first, during), (second, after)) = _two_epochs_struck(
        fresh_server, tmp_path, distribution, lambda server: os.kill(server.pid, signal.SIGTERM)
    )
    assert sorted(first) == sorted(second) == list(range(ITEMS))
    assert during.drains == 2 and during.reassignments == 0  # its work left was finished on the survivor
    # Under "dynamic" the take-overs ended with the drained sessions' chunks; static shards are theirs to the end.
    assert sessions_by_server(during) == {survivor.address: 2 if distribution == "dynamic" else 4}
    assert sessions_by_server(after) == {survivor.address: 2} and after.drains == 0  # its share, no more
    assert drained.proc.wait(15) == 0


@pytest.mark.timeout(60)
def test_under_dynamic_a_drained_servers_sessions_are_gone_before_the_epoch_ends(fresh_server, tmp_path):
    survivor = fresh_server(args=["--drain-timeout", "10"])
    drained = fresh_server(args=["--drain-timeout", "10"], key=survivor.key)
    gate = FileGate(tmp_path / "gate", timeout=30)
    rs = RPCReadingService(workers=[survivor.address, drained.address], num_workers=4, auth_key=survivor.key,
                           distribution=Dynamic(chunk_size=4, window=16), timeout=20.0)  # fmt: skip
    items, sessions = [], []  # sessions: by server, read after each item
    try:
        with DataLoader2(graph(Hold(drained.pid, gate, at=5)), reading_service=rs) as dl:
            dl.seed(11)
            for item in dl:
                items.append(item)
                if len(items) == 1:
                    assert wait_until(Path(gate.path + ".held").exists, 20), "the drained server's sessions never held"
                    os.kill(drained.pid, signal.SIGTERM)
                sessions.append(sessions_by_server(dl.reading_service.stats()))
            after = list(dl), sessions_by_server(dl.reading_service.stats())
    finally:
        gate.open()
    expected = run_epochs(graph(), RPCReadingService(workers=[survivor.address], num_workers=2, auth_key=survivor.key,
                                                     distribution="dynamic"), n_epochs=2, seed=11)  # fmt: skip
    assert [items, after[0]] == expected  # every item once, in the order of a fixed fleet
    gone = sessions.index({survivor.address: 2}) if {survivor.address: 2} in sessions else ITEMS
    assert gone < ITEMS - 1, f"the take-overs outlived their chunks: {[sum(s.values()) for s in sessions]}"
    assert all(s == {survivor.address: 2} for s in sessions[gone:]) and after[1] == {survivor.address: 2}
    assert drained.proc.wait(15) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("distribution", ["round_robin", "dynamic"])
def test_a_dead_servers_rank_is_retired_at_the_next_epoch_under_dynamic_only(fresh_server, tmp_path, distribution):
    survivor, dead, ((first, during), (second, after)) = _two_epochs_struck(
        fresh_server, tmp_path, distribution, lambda server: os.killpg(server.pid, signal.SIGKILL),
        on_worker_failure="reassign",
    )  # fmt: skip
    assert sorted(first) == sorted(second) == list(range(ITEMS))
    assert during.reassignments == 2 and sessions_by_server(during) == {survivor.address: 4}
    if distribution == "dynamic":  # the dead server is not dialed again: the survivor keeps its share
        assert sessions_by_server(after) == {survivor.address: 2}
    else:  # the shards stay as they were, on the server that took them over (on_worker_failure)
        assert sessions_by_server(after) == {survivor.address: 4}


@pytest.mark.timeout(60)
def test_a_dead_server_under_dynamic_with_raise_raises(fresh_server, tmp_path):
    with pytest.raises(WorkerLostError) as info:
        _two_epochs_struck(fresh_server, tmp_path, "dynamic", lambda server: os.killpg(server.pid, signal.SIGKILL))
    assert not isinstance(info.value, WorkerDrainedError) and f"worker {info.value.rank} (" in str(info.value)


def test_a_server_drained_under_one_spelling_is_drained_under_every_spelling():
    fleet = Fleet(ReadingServiceConfig.create(workers=["localhost:4001", "127.0.0.1:4002"], num_workers=2))
    fleet.mark_drained(["127.0.0.1:4001"])  # e.g. a hostfile that lists it by IP
    assert fleet.is_drained("localhost:4001") and not fleet.is_drained("localhost:4002")
    assert fleet.servers() == ["127.0.0.1:4002"]
    assert fleet.retirees(["localhost:4001", "127.0.0.1:4002"], []) == [0]
    fleet.serves_again(["localhost:4001"])  # listed again, by name
    assert fleet.servers() == ["localhost:4001", "127.0.0.1:4002"] and fleet.retirees(fleet.rank_addresses(), []) == []
