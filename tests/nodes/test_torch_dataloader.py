"""``RemoteIterable`` behind torch's DataLoader and StatefulDataLoader, with real workers: local
ones and a real ``rpc-reading-worker`` server."""

from __future__ import annotations

import gc
import os
import random
import signal
from pathlib import Path
from typing import Any, Iterator, List

import pytest
import torch
from _server_helpers import VENV_BIN, FileGate, wait_dead
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

from rpc_reading_service import ConfigurationError, Liveness, RemoteIterable

N = 60


def tag(x: int) -> tuple:
    """Randomness after the sharding point (per-worker, per-epoch seeds)."""
    return x, random.randint(0, 10**9)


def graph(n: int = N):
    return IterableWrapper(range(n)).shuffle().sharding_filter().map(tag)


def shard_of(info: Any) -> List[int]:
    """A factory source: worker ``i`` of ``n`` takes every n-th of 0..N-1 (uneven shards)."""
    return list(range(info.worker_id, N + 3, info.num_workers))[: 20 + 5 * info.worker_id]


def not_iterable(info: Any) -> int:
    return 5


def boom_on_7(x: int) -> int:
    if x == 7:
        raise ValueError(f"bad item {x}")
    return x


class GatedShards:
    """A factory source whose worker 1 stops before its item ``before`` until ``gate`` opens."""

    def __init__(self, gate: FileGate, before: int):
        self.gate, self.before = gate, before

    def __call__(self, info: Any) -> Iterator[int]:
        for index, item in enumerate(range(info.worker_id, 400, info.num_workers)):
            if info.worker_id == 1 and index == self.before:
                self.gate.wait()
            yield item * 10 + random.randint(0, 9)


def epochs(dataset: RemoteIterable, n: int = 2, **loader_kwargs: Any) -> List[list]:
    loader = DataLoader(dataset, batch_size=None, **loader_kwargs)
    try:
        return [list(loader) for _ in range(n)]
    finally:
        dataset.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("distribution", [None, "dynamic"])
def test_datapipe_graph_exactly_once_and_seeded_runs_repeat_with_epochs_differing(distribution):
    first = epochs(RemoteIterable(graph(), num_workers=2, seed=3, distribution=distribution))
    again = epochs(RemoteIterable(graph(), num_workers=2, seed=3, distribution=distribution))
    assert first == again  # one seed, one run: items, order and the workers' randomness
    assert first[0] != first[1]  # the epochs differ
    for epoch in first:
        assert sorted(x for x, _ in epoch) == list(range(N))  # exactly once
    other = epochs(RemoteIterable(graph(), num_workers=2, seed=4, distribution=distribution), n=1)
    assert other[0] != first[0]


@pytest.mark.timeout(60)
def test_unseeded_epochs_follow_torchs_global_seed():
    dataset = RemoteIterable(graph(), num_workers=2)
    loader = DataLoader(dataset, batch_size=None)
    try:
        torch.manual_seed(11)
        first = list(loader)
        second = list(loader)
        torch.manual_seed(11)
        assert list(loader) == first and first != second
    finally:
        dataset.close()


@pytest.mark.timeout(60)
def test_factory_source_shards_by_worker_info_in_round_robin_order():
    [items] = epochs(RemoteIterable(shard_of, num_workers=3), n=1)
    shards = [shard_of(type("Info", (), {"worker_id": i, "num_workers": 3})) for i in range(3)]
    expected = []
    for position in range(max(map(len, shards))):  # one item of each worker in turn, uneven shards
        expected.extend(shard[position] for shard in shards if position < len(shard))
    assert items == expected


@pytest.mark.timeout(60)
def test_batches_through_torchs_dataloader_and_in_process_run_agree():
    remote = epochs(RemoteIterable(graph(), num_workers=2, seed=1), n=1)[0]
    dataset = RemoteIterable(IterableWrapper(range(10)).sharding_filter(), num_workers=2)
    try:
        batches = [batch.tolist() for batch in DataLoader(dataset, batch_size=4)]
    finally:
        dataset.close()
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    in_process = epochs(RemoteIterable(graph(), num_workers=0, seed=1), n=1)[0]
    assert sorted(in_process) != [] and sorted(x for x, _ in in_process) == sorted(x for x, _ in remote)


@pytest.mark.timeout(60)
def test_workers_exception_arrives_with_its_type_and_traceback():
    dataset = RemoteIterable(IterableWrapper(range(20)).sharding_filter().map(boom_on_7), num_workers=2)
    try:
        with pytest.raises(ValueError, match="bad item 7") as caught:
            list(DataLoader(dataset, batch_size=None))
    finally:
        dataset.close()
    message = str(caught.value)
    assert "Caught ValueError in worker process 1" in message
    assert "Original Traceback" in message and "boom_on_7" in message


@pytest.mark.timeout(60)
def test_stateful_dataloader_resumes_mid_epoch_exactly():
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader() -> Any:
        return StatefulDataLoader(RemoteIterable(graph(), num_workers=3, seed=7), batch_size=4)

    def as_lists(batches: list) -> list:
        return [[tuple(t.tolist()) for t in batch] for batch in batches]

    reference = loader()
    try:
        uninterrupted = [as_lists(list(reference)) for _ in range(2)]
    finally:
        reference.dataset.close()
    interrupted = loader()
    try:
        iterator = iter(interrupted)
        head = as_lists([next(iterator) for _ in range(5)])
        state = interrupted.state_dict()
    finally:
        interrupted.dataset.close()
    assert state["dataset_state"]["in_epoch"] and sum(state["dataset_state"]["consumed"]) == 20
    resumed = loader()
    try:
        resumed.load_state_dict(state)
        rest, next_epoch = as_lists(list(resumed)), as_lists(list(resumed))
    finally:
        resumed.dataset.close()
    assert head + rest == uninterrupted[0]  # the rest of the epoch, exactly
    assert next_epoch == uninterrupted[1]  # and the epochs after it


@pytest.mark.timeout(60)
def test_state_of_another_run_is_refused():
    dataset = RemoteIterable(graph(), num_workers=2, seed=7)
    try:
        iterator = iter(DataLoader(dataset, batch_size=None))
        next(iterator)
        state = dataset.state_dict()
    finally:
        dataset.close()
    other = RemoteIterable(graph(), num_workers=3, seed=7)
    with pytest.raises(ConfigurationError, match="num_workers=2"):
        other.load_state_dict(state)
    with pytest.raises(ConfigurationError, match="malformed"):
        other.load_state_dict({**state, "consumed": [-1, 0]})
    other.close()


@pytest.mark.timeout(60)
def test_loader_worker_processes_are_refused():
    dataset = RemoteIterable(graph(), num_workers=2)
    iterator = iter(DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork"))
    try:
        with pytest.raises(ConfigurationError, match="num_workers=0"):
            next(iterator)
    finally:
        del iterator  # torch's DataLoader stops its worker and queue threads when its iterator goes
        gc.collect()
        dataset.close()


def test_bad_sources_are_refused():
    with pytest.raises(ConfigurationError, match="DataPipe graph or a picklable factory"):
        RemoteIterable([1, 2, 3])
    with pytest.raises(ConfigurationError, match="factory source"):
        RemoteIterable(shard_of, num_workers=2, distribution="dynamic")
    with pytest.raises(ConfigurationError, match="seed must be"):
        RemoteIterable(graph(), seed=-1)
    with RemoteIterable(not_iterable) as dataset, pytest.raises(ConfigurationError, match="returned int for worker 0"):
        list(DataLoader(dataset, batch_size=None))


@pytest.mark.timeout(90)
def test_worker_killed_on_a_cli_server_is_reassigned_exactly(fresh_server, tmp_path: Path):
    server = fresh_server(command=[str(VENV_BIN / "rpc-reading-worker")])
    gate = FileGate(tmp_path / "gate")

    def dataset() -> RemoteIterable:
        return RemoteIterable(
            GatedShards(gate, before=40), workers=[server.address, server.address], auth_key=server.key,
            seed=5, on_worker_failure="reassign", timeout=3.0, liveness=Liveness(heartbeat_interval=0.5),
        )  # fmt: skip

    gate.open()
    reference = epochs(dataset())
    server.wait_idle(10)
    gate.close()
    victim = dataset()
    loader = DataLoader(victim, batch_size=None)
    try:
        first, killed = [], None
        for item in loader:
            first.append(item)
            if len(first) == 30:  # worker 1 waits at its 41st item: still at work
                pids = [worker.pid for worker in victim.stats().workers]
                assert sorted(pids) == sorted(server.session_pids())
                killed = pids[1]
                os.kill(killed, signal.SIGKILL)
                gate.open()
        second = list(loader)
        after = [worker.pid for worker in victim.stats().workers]
    finally:
        gate.open()
        victim.close()
    assert first == reference[0] and second == reference[1]  # exactly the fault-free epochs, in order
    assert after[0] == pids[0] and after[1] not in (None, killed)
    wait_dead([*pids, *after])
    assert server.alive()
