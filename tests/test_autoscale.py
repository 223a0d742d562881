"""Autoscaling: the fleet sized by the data stall, at epoch boundaries.

The rule (``decide``) over tables of epochs; then real runs on the module's worker server: a
graph whose items take :data:`DELAY` each in at most :data:`SLOTS` sessions at once (they share
file locks), read by a fast trainer, grows from one session and stops once another session adds
nothing (Cachew's rule); a slow trainer makes the sessions shrink to ``min_sessions``. Every
epoch comes exactly once, and under "dynamic" in a fixed fleet's order.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from prometheus_client import CollectorRegistry, generate_latest
from test_metrics import parse, trainer_value
from rpc_reading_service import Autoscale, ConfigurationError, RemoteIterable, RPCReadingService
from rpc_reading_service.metrics import ReadingServiceCollector
from rpc_reading_service.trainer.engine.autoscale import EpochSample, decide
from rpc_reading_service.trainer.stats import ReadingServiceStats

ITEMS = 200
DELAY = 0.005  # seconds per item
SLOTS = 2  # sessions that make items at once


class Slotted:
    """A map function: each item holds one of :data:`SLOTS` file locks in ``directory`` for ``delay`` seconds."""

    def __init__(self, directory: Path, delay: float = DELAY):
        self.directory = str(directory)
        self.delay = delay

    def __call__(self, item: int) -> int:
        while True:
            for slot in range(SLOTS):
                fd = os.open(os.path.join(self.directory, f"slot{slot}"), os.O_CREAT | os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                try:
                    time.sleep(self.delay)
                    return item
                finally:
                    os.close(fd)  # releases the lock
            time.sleep(0.001)


def graph(fn=None):
    pipe = IterableWrapper(range(ITEMS)).shuffle().sharding_filter()
    return pipe.map(fn) if fn is not None else pipe


SCALE = Autoscale(min_sessions=1, max_sessions=4, target_stall=0.05, min_gain=0.2)


@pytest.mark.parametrize(
    "epochs, expected",
    [
        ([(1, 100, 0.9)], ("grow", 2)),
        ([(1, 100, 0.9), (2, 190, 0.8)], ("grow", 3)),
        ([(1, 100, 0.9), (2, 190, 0.8), (3, 200, 0.7)], ("hold", 3)),  # +5% < min_gain: stop growing
        ([(1, 100, 0.9), (2, 110, 0.8)], ("hold", 2)),
        ([(4, 400, 0.5)], ("hold", 4)),  # max_sessions
        ([(3, 100, 0.0)], ("shrink", 2)),
        ([(3, 100, 0.0), (2, 100, 0.001)], ("shrink", 1)),
        ([(1, 100, 0.0)], ("hold", 1)),  # min_sessions
        ([(3, 100, 0.03)], ("hold", 3)),  # within the target
        ([(2, 100, 0.3), (3, 150, 0.0)], ("hold", 3)),  # the trainer starved with 2
        ([(6, 100, 0.0)], ("shrink", 4)),  # above max_sessions (servers that joined)
    ],
)
def test_the_rule_grows_stops_shrinks_and_holds_within_bounds(epochs, expected):
    samples = [EpochSample(*epoch) for epoch in epochs]
    action, sessions, reason = decide(samples, SCALE)
    assert (action, sessions) == expected and reason


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(min_sessions=0, max_sessions=2), "min_sessions must be an integer of at least 1"),
        (dict(min_sessions=3, max_sessions=2), r"max_sessions \(2\) is below min_sessions \(3\)"),
        (dict(min_sessions=1, max_sessions=2, target_stall=0), "target_stall must be a number between"),
        (dict(min_sessions=1, max_sessions=2, min_gain=1.5), "min_gain must be a number between"),
        (dict(min_sessions=1, max_sessions=2, sessions_per_server=0), "sessions_per_server must be"),
        (dict(min_sessions=1, max_sessions=2, on_scale="k8s"), "on_scale must be a function"),
    ],
)
def test_bad_autoscale_arguments_are_refused_at_construction(arguments, message):
    with pytest.raises(ConfigurationError, match=message):
        Autoscale(**arguments)


def test_a_run_outside_the_bounds_or_in_the_trainer_is_refused():
    with pytest.raises(ConfigurationError, match=r"starts with 5 worker sessions, outside Autoscale's bounds \[1, 4\]"):
        RPCReadingService(num_workers=5, autoscale=SCALE)
    with pytest.raises(ConfigurationError, match="num_workers=0 runs the graph in the trainer"):
        RemoteIterable(graph(), autoscale=SCALE)
    with pytest.raises(ConfigurationError, match="autoscale must be an Autoscale"):
        RPCReadingService(num_workers=1, autoscale=2)


def _run(server, epochs, distribution, autoscale, fn=None, consume=None, num_workers=1):
    """Items and stats of each epoch of an autoscaled run on ``server``."""
    service = RPCReadingService(
        num_workers=num_workers, workers=[server.address], auth_key=server.key, distribution=distribution,
        autoscale=autoscale, timeout=20.0,
    )  # fmt: skip
    got = []
    with DataLoader2(graph(fn), reading_service=service) as dl:
        dl.seed(7)
        for _ in range(epochs):
            items = []
            for item in dl:
                items.append(item)
                if consume is not None:
                    consume()
            got.append((items, dl.reading_service.stats()))
        registry = CollectorRegistry()
        registry.register(ReadingServiceCollector(dl))
        samples = parse(generate_latest(registry).decode())
        metrics = {name: trainer_value(samples, name) for name in ("scale_ups_total", "scale_downs_total", "wanted_servers")}
    return got, metrics


def _reference(server, epochs, distribution):
    """The items of each epoch of a fixed one-session run."""
    service = RPCReadingService(num_workers=1, workers=[server.address], auth_key=server.key, distribution=distribution)
    with DataLoader2(graph(), reading_service=service) as dl:
        dl.seed(7)
        return [list(dl) for _ in range(epochs)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("distribution", ["round_robin", "dynamic"])
def test_a_starved_trainer_grows_the_sessions_until_one_more_adds_nothing(worker_server, tmp_path, distribution):
    # min_gain 0.5: a second session doubles the items/s, a third adds none; the margin absorbs a loaded
    # machine's stalls: at 0.25 a third session once looked 25 % faster under load, and with epochs of
    # ~0.5 s at two sessions once 50 % faster (an epoch of two sessions stalled by ~0.25 s): ~1 s now
    autoscale = Autoscale(min_sessions=1, max_sessions=4, target_stall=0.05, min_gain=0.5, sessions_per_server=4)
    got, metrics = _run(worker_server, 5, distribution, autoscale, fn=Slotted(tmp_path, delay=2 * DELAY))
    sessions = [len(stats.workers) for _items, stats in got]
    # 1 (its first epoch is not judged), 1 -> 2 -> 3 (twice the items/s), 3: the third session added nothing
    assert sessions == [1, 1, 2, 3, 3], [stats.scale_decisions for _i, stats in got]
    last = got[-1][1]
    assert last.scale_ups == 2 and last.scale_downs == 0
    assert metrics == {"scale_ups_total": 2, "scale_downs_total": 0, "wanted_servers": 1}
    assert [d.action for d in last.scale_decisions] == ["hold", "grow", "grow", "hold"]
    assert "more sessions do not help" in last.scale_decisions[-1].reason
    for items, _stats in got:
        assert sorted(items) == list(range(ITEMS))
    if distribution == "dynamic":  # the order does not depend on the number of sessions
        assert [items for items, _stats in got] == _reference(worker_server, 5, distribution)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("distribution", ["round_robin", "dynamic"])
def test_a_slow_trainer_shrinks_the_sessions_to_the_minimum(worker_server, distribution):
    autoscale = Autoscale(min_sessions=1, max_sessions=3, target_stall=0.1, sessions_per_server=3)
    got, metrics = _run(worker_server, 4, distribution, autoscale, consume=lambda: time.sleep(0.005), num_workers=3)
    sessions = [len(stats.workers) for _items, stats in got]
    assert sessions == [3, 3, 2, 1], [stats.scale_decisions for _i, stats in got]
    assert got[-1][1].scale_downs == 2 and metrics["scale_downs_total"] == 2
    assert "the workers wait on the trainer" in got[-1][1].scale_decisions[-1].reason
    for items, _stats in got:
        assert sorted(items) == list(range(ITEMS))
    if distribution == "dynamic":
        assert [items for items, _stats in got] == _reference(worker_server, 4, distribution)


class Record:
    """An ``on_scale`` that appends its call to a file (DataLoader2 works on a pickled copy of the service)."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, wanted_servers: int, stats: ReadingServiceStats) -> None:
        with open(self.path, "a") as handle:
            handle.write(f"{wanted_servers} {stats.data_stall}\n")


@pytest.mark.timeout(60)
def test_on_scale_is_asked_for_more_servers_when_the_known_ones_are_full(worker_server, tmp_path):
    record = tmp_path / "asked"
    autoscale = Autoscale(min_sessions=1, max_sessions=3, sessions_per_server=1, on_scale=Record(record))
    got, _metrics = _run(worker_server, 3, "round_robin", autoscale, fn=Slotted(tmp_path))
    assert [len(stats.workers) for _items, stats in got] == [1, 1, 1]  # one server, one session each
    asked = [line.split() for line in record.read_text().splitlines()]
    assert [int(wanted) for wanted, _stall in asked] == [2]  # asked once for the number it wants
    assert float(asked[0][1]) > 0.05  # with the stats that made it ask
    assert got[-1][1].wanted_servers == 2
    assert "the 1 servers known host 1 sessions" in got[-1][1].scale_decisions[-1].reason


@pytest.mark.timeout(60)
def test_remote_iterable_and_remote_map_take_autoscale(worker_server):
    from torch.utils.data import DataLoader

    autoscale = Autoscale(min_sessions=1, max_sessions=3, target_stall=0.1, sessions_per_server=3)
    dataset = RemoteIterable(
        graph(), num_workers=3, workers=[worker_server.address], auth_key=worker_server.key, distribution="dynamic",
        autoscale=autoscale, seed=7,
    )  # fmt: skip
    loader = DataLoader(dataset, batch_size=None)
    sessions = []
    try:
        for _epoch in range(3):
            items = []
            for item in loader:
                items.append(item)
                time.sleep(0.005)
            assert sorted(items) == list(range(ITEMS))
            sessions.append(len(dataset.stats().workers))
    finally:
        dataset.close()
    assert sessions == [3, 3, 2]
    assert IterableWrapper(range(4)).remote_map(abs, num_workers=1, autoscale=autoscale).config.autoscale is autoscale


def test_autoscale_under_torch_distributed_needs_dynamic():
    from rpc_reading_service.graph import DistributedInfo
    from rpc_reading_service.trainer.config import ReadingServiceConfig
    from rpc_reading_service.trainer.engine import Engine

    config = ReadingServiceConfig.create(num_workers=1, autoscale=SCALE)
    with pytest.raises(ConfigurationError, match=r"autoscale under torch.distributed \(2 trainer ranks\).*'dynamic'"):
        Engine(config).start(graph(), dist=DistributedInfo(0, 2))


def test_the_autoscaler_places_on_the_emptiest_server_and_holds_after_a_join(caplog):
    from rpc_reading_service.trainer.engine.autoscale import Autoscaler

    def failing(wanted_servers, stats):
        raise RuntimeError("the cluster says no")

    scaler = Autoscaler(Autoscale(min_sessions=1, max_sessions=6, on_scale=failing), per_server=2)
    stats = ReadingServiceStats(0, 1.0, 100, 100.0, 0.9, 0.9)
    starved = EpochSample(3, 100.0, 0.9)
    decision, ranks = scaler.plan(stats, starved, ["a:1", "a:1", "b:1"], ["a:1", "b:1", "c:1"])
    assert (decision.action, ranks) == ("hold", ["a:1", "a:1", "b:1"])  # the first epoch: a warm-up
    decision, ranks = scaler.plan(stats, starved, ["a:1", "a:1", "b:1"], ["a:1", "b:1", "c:1"])
    assert (decision.action, ranks) == ("grow", ["a:1", "a:1", "b:1", "c:1"])  # c has none
    decision, ranks = scaler.plan(stats, EpochSample(4, 200.0, 0.9), ranks, ["a:1", "b:1", "c:1"], joined=1)
    assert (decision.action, decision.reason) == ("hold", "1 servers joined the run")
    with caplog.at_level("ERROR"):
        decision, ranks = scaler.plan(stats, EpochSample(4, 200.0, 0.9), ["a:1", "a:1", "b:1", "b:1"], ["a:1", "b:1"])
    assert ranks == ["a:1", "a:1", "b:1", "b:1"] and "servers known host 4 sessions" in decision.reason
    assert "Autoscale.on_scale(3, stats) failed" in caplog.text  # logged, the run goes on


def slow(item: int) -> int:
    """An item, after :data:`DELAY`."""
    time.sleep(DELAY)
    return item


@pytest.mark.timeout(90)
def test_a_server_that_joins_is_judged_after_its_first_epoch(worker_server, tmp_path):
    from _server_helpers import start_server

    joiner = start_server(tmp_path, key=worker_server.key)
    try:
        autoscale = Autoscale(min_sessions=1, max_sessions=4, sessions_per_server=2)
        service = RPCReadingService(
            num_workers=1, workers=[worker_server.address], auth_key=worker_server.key, autoscale=autoscale, timeout=20.0
        )
        got = []
        with DataLoader2(graph(slow), reading_service=service) as dl:
            for epoch in range(4):
                items = list(dl)
                if epoch == 1:
                    assert dl.reading_service.add_workers([joiner.address]) == [joiner.address]
                got.append((items, dl.reading_service.stats()))
    finally:
        joiner.stop()
    # 1 (warm-up), 1 -> 2 (the joiner's session; no decision), 2 -> 3 (a tie: on the first server)
    assert [len(stats.workers) for _items, stats in got] == [1, 1, 2, 3]
    decisions = got[-1][1].scale_decisions
    assert [(d.action, d.sessions) for d in decisions] == [("hold", 1), ("hold", 2), ("grow", 3)]
    assert decisions[1].reason == "1 servers joined the run"
    addresses = [worker.address for worker in got[-1][1].workers]
    assert addresses == [worker_server.address, joiner.address, worker_server.address]
    for items, _stats in got:
        assert sorted(items) == list(range(ITEMS))
