"""Mid-epoch checkpoint/resume: ``DataLoader2.state_dict()`` then ``from_state``/``load_state_dict``.

The resumed run must continue with exactly the items, in exactly the order, of the
uninterrupted run (the same multiset with ``in_order=False``), and the epochs after it
must match too. The graph has randomness both before the sharding point (a shuffle with
the shared seed) and after it (a map drawing from ``random``, seeded per worker).

Workers are sessions on one keyed server shared by the module (a fork per session,
fast); one test uses ``RPCReadingService(num_workers=N)``'s own local workers, one runs on
each other registered transport. Trainer-side DataPipes that read ahead (as fullsync does)
must not make a checkpoint skip the items they hold. Multi-trainer checkpoints (with
DistributedReadingService and fullsync) are in ``test_multi_trainer.py``.
"""

from __future__ import annotations

import collections
import json
import random
from typing import Any, Callable

import pytest
from conftest import start_server
from test_checkpoint_bounds import signed
from torchdata.dataloader2 import DataLoader2, SequentialReadingService
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from rpc_reading_service import ConfigurationError, RPCReadingService, available_transports
from rpc_reading_service.errors import malformed_checkpoint, past_the_end
from rpc_reading_service.trainer.checkpoint import CHECKPOINT_VERSION, ReadingServiceState
from rpc_reading_service.policies.merge import EpochProgress

SEED = 1234
N_ITEMS = 23  # shards of 3 workers: 8, 8, 7 (uneven on purpose)
EPOCHS = 2
RS_STATE = "reading_service_state"


def tag(x: int) -> tuple[int, int]:
    """Randomness after the sharding point: a per-worker-seeded draw from ``random``."""
    return (x, random.randint(0, 10**9))


def make_graph(n: int = N_ITEMS):
    return IterableWrapper(range(n)).shuffle().sharding_filter().map(tag)


class ReadAhead(IterDataPipe):
    """A trainer-side DataPipe (not replicable) that holds ``k`` items, as fullsync's prefetch holds one."""

    def __init__(self, source, k: int):
        self.source, self.k = source, k

    def is_replicable(self) -> bool:
        return False

    def __iter__(self):
        buffer: collections.deque = collections.deque()
        for item in self.source:
            buffer.append(item)
            if len(buffer) > self.k:
                yield buffer.popleft()
        while buffer:
            yield buffer.popleft()


def read_ahead_graph():
    return ReadAhead(make_graph(), 5)


def other_graph():
    return IterableWrapper(range(N_ITEMS)).sharding_filter().map(tag).batch(2)


@pytest.fixture(scope="module")
def rs_factory(worker_server):
    """``make(num_workers, **kwargs)``: a fresh RPCReadingService (num_workers=0 runs in process)."""

    def make(num_workers: int, **kwargs: Any) -> RPCReadingService:
        if num_workers == 0:
            return RPCReadingService(num_workers=0, **kwargs)
        return RPCReadingService(
            num_workers=num_workers, workers=[worker_server.address], auth_key=worker_server.key, **kwargs
        )

    return make


_reference_cache: dict = {}


def reference(make_rs: Callable[[], Any], key: Any) -> list[list[Any]]:
    """The uninterrupted run: ``EPOCHS`` epochs with ``dl.seed(SEED)``."""
    if key not in _reference_cache:
        dl = DataLoader2(make_graph(), reading_service=make_rs())
        dl.seed(SEED)
        try:
            _reference_cache[key] = [list(dl) for _ in range(EPOCHS)]
        finally:
            dl.shutdown()
    return _reference_cache[key]


def interrupted_run(
    make_rs: Callable[[], Any],
    epoch: int | None,
    position: int | None,
    how: str = "from_state",
    graph: Callable[[], Any] = make_graph,
) -> tuple[list[list[Any]], dict]:
    """Run to the cut, take ``state_dict()``, shut down, restore in a new DataLoader2 and finish.

    Cut at ``position`` items into epoch ``epoch`` (its iterator created), or, with
    ``position=None``, between epoch ``epoch`` and the next (``epoch=-1``: before any
    iteration). Returns the items of every epoch (before + after the cut) and the state.
    """
    dl = DataLoader2(graph(), reading_service=make_rs())
    dl.seed(SEED)
    epochs: list[list[Any]] = []
    try:
        for _ in range(epoch + (1 if position is None else 0)):
            epochs.append(list(dl))
        if position is not None:
            it = iter(dl)
            epochs.append([next(it) for _ in range(position)])
        state = dl.state_dict()
    finally:
        dl.shutdown()

    if how == "from_state":
        dl2 = DataLoader2.from_state(state, make_rs())
    else:
        dl2 = DataLoader2(graph(), reading_service=make_rs())
        dl2.load_state_dict(state)
    try:
        if position is not None:
            epochs[-1].extend(dl2)  # the rest of the interrupted epoch
        while len(epochs) < EPOCHS:
            epochs.append(list(dl2))
    finally:
        dl2.shutdown()
    return epochs, state


# (epoch, position): before anything; 0 items into epoch 0; mid-way; after the last item (no
# StopIteration yet); between the epochs (after StopIteration); mid-way through epoch 1.
CUTS = {
    "before-iter": (-1, None),
    "after-0-items": (0, 0),
    "mid-epoch": (0, 10),
    "after-last-item": (0, N_ITEMS),
    "between-epochs": (0, None),
    "mid-epoch-2": (1, 13),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("cut", list(CUTS), ids=list(CUTS))
def test_resume_equals_uninterrupted_run(rs_factory, num_workers, cut):
    make_rs = lambda: rs_factory(num_workers)  # noqa: E731
    expected = reference(make_rs, ("in_order", num_workers))
    assert sorted(x for x, _ in expected[0]) == list(range(N_ITEMS))
    assert expected[0] != expected[1], "epochs should differ (fresh shared seed per epoch)"
    epoch, position = CUTS[cut]
    got, _ = _before_iter(make_rs) if epoch == -1 else interrupted_run(make_rs, epoch, position)
    assert got == expected


def _before_iter(make_rs):
    """Checkpoint a DataLoader2 that was seeded but never iterated."""
    dl = DataLoader2(make_graph(), reading_service=make_rs())
    dl.seed(SEED)
    state = dl.state_dict()
    dl.shutdown()
    dl2 = DataLoader2.from_state(state, make_rs())
    try:
        return [list(dl2) for _ in range(EPOCHS)], state
    finally:
        dl2.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers, cut", [(0, "mid-epoch"), (3, "mid-epoch"), (3, "mid-epoch-2")])
def test_resume_with_load_state_dict(rs_factory, num_workers, cut):
    make_rs = lambda: rs_factory(num_workers)  # noqa: E731
    expected = reference(make_rs, ("in_order", num_workers))
    got, _ = interrupted_run(make_rs, *CUTS[cut], how="load_state_dict")
    assert got == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", ["after-0-items", "mid-epoch", "after-last-item", "mid-epoch-2"])
def test_resume_out_of_order_gives_the_same_multiset(rs_factory, cut):
    make_rs = lambda: rs_factory(3, in_order=False)  # noqa: E731
    # Per-worker streams are deterministic, so the in-order run holds the same items per epoch.
    expected = reference(lambda: rs_factory(3), ("in_order", 3))
    got, _ = interrupted_run(make_rs, *CUTS[cut])
    assert [sorted(epoch) for epoch in got] == [sorted(epoch) for epoch in expected]
    for items in got:
        assert len(items) == len(set(items)) == N_ITEMS  # exactly once, nothing replayed twice


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "cut, in_order",
    [("mid-epoch", True), ("after-last-item", True), ("mid-epoch-2", True), ("mid-epoch", False)],
)
def test_items_held_by_trainer_side_datapipes_are_not_lost(rs_factory, cut, in_order):
    """A trainer-side DataPipe after the stream (here reading 5 ahead) holds items taken from the
    workers but not yet delivered: the checkpoint must record what the training loop received."""
    make_rs = lambda: rs_factory(3, in_order=in_order)  # noqa: E731
    expected = reference(lambda: rs_factory(3), ("in_order", 3))
    got, _ = interrupted_run(make_rs, *CUTS[cut], graph=read_ahead_graph)
    if in_order:
        assert got == expected
    else:
        assert [sorted(epoch) for epoch in got] == [sorted(epoch) for epoch in expected]


@pytest.mark.timeout(60)
def test_sticky_resume_equals_uninterrupted_run(rs_factory):
    """Sticky shards are uneven and chosen by key, but positions are per worker as in round-robin."""
    make_rs = lambda: rs_factory(3, distribution="sticky")  # noqa: E731
    expected = reference(make_rs, ("sticky", 3))
    assert expected != reference(lambda: rs_factory(3), ("in_order", 3))  # another dealing
    got, state = interrupted_run(make_rs, *CUTS["mid-epoch-2"])
    assert got == expected
    values = json.loads(state[RS_STATE])
    assert values["distribution_name"] == "sticky" and values["distribution"] is None
    assert values["placement"]  # one server: the digest of 3 ranks on it, whatever its address


@pytest.mark.timeout(60)
def test_sticky_state_is_refused_by_another_distribution_or_other_servers(rs_factory, worker_server):
    """A sticky epoch resumed with round-robin, or over another table of servers, would replay
    other shards: refused in restore(), before any session starts."""
    sticky = lambda: rs_factory(2, distribution="sticky")  # noqa: E731
    state, round_robin_state = _state_of(sticky, make_graph()), _state_of(lambda: rs_factory(2), make_graph())
    sessions_before = set(worker_server.session_pids())
    with pytest.raises(ConfigurationError, match=r"distribution='sticky'.*distribution='round_robin'"):
        _resume(state, rs_factory(2))
    with pytest.raises(ConfigurationError, match=r"distribution='round_robin'.*distribution='sticky'"):
        _resume(round_robin_state, sticky())
    # Rank 1 on another server (never reached: the placement differs before anything connects).
    elsewhere = RPCReadingService(
        num_workers=2, workers=[worker_server.address, "127.0.0.1:9"], auth_key=worker_server.key,
        distribution="sticky",
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match="other worker servers.*same worker addresses in the same"):
        _resume(state, elsewhere)
    assert set(worker_server.session_pids()) <= sessions_before


def test_the_distribution_is_checked_in_an_epoch_only():
    state = ReadingServiceState(num_workers=2, graph=["a.B"], consumed=[1, 0], in_epoch=True,
                                distribution_name="sticky", placement="ab12")  # fmt: skip
    state.check_distribution("sticky")
    state.check_placement("ab12")
    with pytest.raises(ConfigurationError, match="resume with distribution='sticky'"):
        state.check_distribution("dynamic")
    with pytest.raises(ConfigurationError, match="placement ab12, this run's is cd34"):
        state.check_placement("cd34")
    between_epochs = ReadingServiceState(
        num_workers=2, graph=["a.B"], distribution_name="sticky", placement="ab12"
    )
    between_epochs.check_distribution("round_robin")  # the next epoch starts afresh
    between_epochs.check_placement(None)
    older = ReadingServiceState(num_workers=2, graph=["a.B"], consumed=[1, 0], in_epoch=True)
    older.check_distribution("sticky")  # written before the name was recorded: nothing to compare
    older.check_placement("cd34")


@pytest.mark.timeout(60)
# Not "test_plugin": test_transport_conformance registers it in this process when collected first,
# and only that module's fixture lets worker servers load it (the plugin is checked there).
@pytest.mark.parametrize("transport", [t for t in available_transports() if t not in ("socket", "test_plugin")])
def test_resume_on_other_transports(rs_factory, tmp_path, transport):
    """Positions are counted by the trainer and skipped by the worker: no transport is special."""
    server = start_server(tmp_path, args=["--transport", transport])
    try:
        make_rs = lambda: RPCReadingService(
            num_workers=3, workers=[server.address], transport=transport, auth_key=server.key
        )
        got, _ = interrupted_run(make_rs, 0, 10)
    finally:
        server.stop()
    assert got == reference(lambda: rs_factory(3), ("in_order", 3))  # the socket transport's run


@pytest.mark.timeout(60)
def test_resume_with_local_workers(rs_factory):
    """The default path: ``RPCReadingService(num_workers=3)`` starts its own local workers."""
    make_rs = lambda: RPCReadingService(num_workers=3)  # noqa: E731
    got, _ = interrupted_run(make_rs, 0, 10)
    # Local workers shard and seed exactly as sessions on a shared server do.
    assert got == reference(lambda: rs_factory(3), ("in_order", 3))


@pytest.mark.timeout(60)
def test_resume_through_sequential_reading_service(rs_factory):
    """``SequentialReadingService`` checkpoints each member; ours restores mid-epoch."""
    make_rs = lambda: SequentialReadingService(rs_factory(3))  # noqa: E731
    expected = reference(lambda: rs_factory(3), ("in_order", 3))
    got, state = interrupted_run(make_rs, 0, 9)
    assert got == expected
    assert len(state[RS_STATE]) < 2048


@pytest.mark.timeout(60)
def test_state_is_small_versioned_and_holds_positions_not_data(rs_factory):
    dl = DataLoader2(make_graph(1000), reading_service=rs_factory(3))
    dl.seed(SEED)
    try:
        it = iter(dl)
        for _ in range(500):
            next(it)
        state = dl.state_dict()
    finally:
        dl.shutdown()
    raw = state[RS_STATE]
    assert isinstance(raw, bytes) and len(raw) < 2048, len(raw)
    values = json.loads(raw)  # plain JSON: nothing to unpickle
    assert values["version"] == CHECKPOINT_VERSION
    assert values["num_workers"] == 3
    assert values["in_epoch"] is True and values["epoch"] == 1
    assert sum(values["consumed"]) == 500
    assert values["consumed"] == [167, 167, 166] and values["next_rank"] == 2  # round-robin position


def _state_of(make_rs, graph) -> dict:
    dl = DataLoader2(graph, reading_service=make_rs())
    dl.seed(SEED)
    try:
        it = iter(dl)
        next(it)
        return dl.state_dict()
    finally:
        dl.shutdown()


def _resume(state, rs) -> None:
    dl = DataLoader2.from_state(state, rs)
    try:
        list(dl)
    finally:
        dl.shutdown()


@pytest.mark.timeout(60)
def test_state_of_other_num_workers_is_refused(rs_factory):
    state = _state_of(lambda: rs_factory(3), make_graph())
    with pytest.raises(ConfigurationError, match=r"in an epoch with num_workers=3.*num_workers=2.*resume with 3 worker"):
        _resume(state, rs_factory(2))
    with pytest.raises(ConfigurationError, match="num_workers"):
        _resume(state, rs_factory(0))


@pytest.mark.timeout(60)
def test_state_of_other_graph_is_refused(rs_factory):
    state = _state_of(lambda: rs_factory(1), make_graph())
    mixed = dict(_state_of(lambda: rs_factory(1), other_graph()))
    mixed[RS_STATE] = state[RS_STATE]  # our positions, someone else's graph
    with pytest.raises(ConfigurationError, match="different DataPipe graph"):
        _resume(mixed, rs_factory(1))


def test_other_versions_and_garbage_are_refused():
    good = ReadingServiceState(
        num_workers=2, graph=["a.B"], epoch=1, epoch_seed=5, consumed=[1, 2], in_epoch=True
    )
    assert ReadingServiceState.from_bytes(good.to_bytes()) == good
    future = json.loads(good.to_bytes())
    future["version"] = CHECKPOINT_VERSION + 1
    with pytest.raises(ConfigurationError, match="version"):
        ReadingServiceState.from_bytes(json.dumps(future).encode())
    with pytest.raises(ConfigurationError, match="not an RPCReadingService checkpoint"):
        ReadingServiceState.from_bytes(b"\x80\x04garbage")
    with pytest.raises(ConfigurationError):
        ReadingServiceState.from_bytes(b"[1, 2]")
    with pytest.raises(ConfigurationError, match="malformed"):
        ReadingServiceState.from_bytes(json.dumps({"version": CHECKPOINT_VERSION, "bogus": 1}).encode())


def test_state_of_another_trainer_rank_is_refused():
    state = ReadingServiceState(num_workers=2, graph=["a.B"], dist_rank=1, dist_world_size=2)
    state.check_compatible(2, ["a.B"], dist_rank=1, dist_world_size=2)
    with pytest.raises(ConfigurationError, match="taken by trainer rank 1 of 2, this is rank 0 of 2"):
        state.check_compatible(2, ["a.B"], dist_rank=0, dist_world_size=2)
    with pytest.raises(ConfigurationError, match="same world size"):
        state.check_compatible(2, ["a.B"], dist_rank=1, dist_world_size=4)


def test_positions_give_back_items_not_yet_delivered():
    progress = EpochProgress(1, [0, 0, 0])
    for rank, next_rank in [(0, 1), (1, 2), (2, 0), (0, 1)]:
        progress.count(rank, next_rank)
    assert progress.positions() == ([2, 1, 1], 1)  # no trainer-side DataPipes: all delivered
    progress.delivered = 2  # the last two (ranks 2 and 0) still sit in a trainer-side buffer
    assert progress.positions() == ([1, 1, 0], 2)
    progress.delivered = 5  # a trainer-side DataPipe that makes items: cannot be checkpointed
    with pytest.raises(RuntimeError, match="one for one"):
        progress.positions()


# -- tampered checkpoints: refused naming the field, never IndexError/KeyError or wrong counts --------
def _good_state_values() -> dict:
    from torchdata.dataloader2.random import SeedGenerator

    from rpc_reading_service.trainer.checkpoint import seed_generator_state

    generator = SeedGenerator(SEED)
    generator.generate_shared_seed()
    state = ReadingServiceState(
        num_workers=3, graph=["a.B", "c.D"], epoch=2, epoch_seed=99, consumed=[4, 3, 3], next_rank=1,
        in_epoch=True, seed_generator=seed_generator_state(generator),
        epoch_start_seed_generator=seed_generator_state(SeedGenerator(SEED)),
    )  # fmt: skip
    return json.loads(state.to_bytes())


def _set(values: dict, path: str, value: Any) -> dict:
    """``values`` with the entry at ``path`` (``a.b.2``) replaced, or deleted when ``value`` is DELETE."""
    *parents, last = path.split(".")
    target = values
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if value is DELETE:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return values


DELETE = object()
TAMPERED = {
    "consumed too short": ("consumed", [4, 3], "'consumed' has 2 entries, expected 3"),
    "consumed too long": ("consumed", [4, 3, 3, 0], "'consumed' has 4 entries, expected 3"),
    "consumed not a list": ("consumed", {"0": 4}, "'consumed' must be a list"),
    "negative position": ("consumed.1", -3, f"'consumed[1]' must be an int >= 0 and <= {2**63 - 1}, got -3"),
    "huge position": ("consumed.2", 10**30, f"'consumed[2]' must be an int >= 0 and <= {2**63 - 1}"),
    "position as float": ("consumed.0", 4.0, "'consumed[0]' must be an int >= 0"),
    "position as string": ("consumed.0", "4", "'consumed[0]' must be an int >= 0"),
    "position as bool": ("consumed.0", True, "'consumed[0]' must be an int >= 0"),
    "next_rank past the workers": ("next_rank", 3, "'next_rank' must be an int >= 0 and <= 2, got 3"),
    "negative epoch": ("epoch", -1, f"'epoch' must be an int >= 0 and <= {2**63 - 1}, got -1"),
    "huge epoch": ("epoch", 2**63, f"'epoch' must be an int >= 0 and <= {2**63 - 1}"),
    "seed too large": ("epoch_seed", 2**64, f"'epoch_seed' must be an int >= 0 and <= {2**64 - 1}"),
    "num_workers as string": ("num_workers", "3", "'num_workers' must be an int >= 0"),
    "in_epoch as int": ("in_epoch", 1, "'in_epoch' must be true or false, got 1"),
    "graph not a list": ("graph", "a.B", "'graph' must be a list"),
    "graph entry not a string": ("graph.0", 7, "'graph[0]' must be a DataPipe class name, got 7"),
    "dist_rank past the world": ("dist_rank", 1, "'dist_rank' must be an int >= 0 and <= 0, got 1"),
    "dist_world_size zero": ("dist_world_size", 0, "'dist_world_size' must be an int >= 1, got 0"),
    "missing field": ("consumed", DELETE, "'consumed' is missing"),
    "missing num_workers": ("num_workers", DELETE, "'num_workers' is missing"),
    "unknown field": ("surprise", 1, "'surprise' is not a field of this checkpoint version"),
    "seed generator not an object": ("seed_generator", [1, 2], "'seed_generator' must be null or an object"),
    "seed generator without an rng": (
        "seed_generator._worker_rng", DELETE, "'seed_generator' must be null or an object"
    ),
    "seed generator engine field missing": (
        "seed_generator._shared_rng._ctr", DELETE, "'seed_generator._shared_rng' must be an object with the keys"
    ),
    "seed generator counter too short": (
        "seed_generator._shared_rng._ctr", [1, 0], "'seed_generator._shared_rng._ctr' has 2 entries, expected 4"
    ),
    "seed generator word too large": (
        "seed_generator._worker_rng._seed.0", 2**32,
        f"'seed_generator._worker_rng._seed[0]' must be an int >= 0 and <= {2**32 - 1}",
    ),
    "seed generator word a string": (
        "seed_generator._worker_rng._spawn_seed.1", "x",
        "'seed_generator._worker_rng._spawn_seed[1]' must be an int",
    ),
    "epoch-start seed generator counter too short": (
        "epoch_start_seed_generator._worker_rng._ctr", [1],
        "'epoch_start_seed_generator._worker_rng._ctr' has 1 entries, expected 4",
    ),
    "distribution name not a string": (
        "distribution_name", 3, "'distribution_name' must be null or a string, got 3"
    ),
    "placement not a string": ("placement", ["a"], "'placement' must be null or a string, got ['a']"),
}


def test_the_untampered_state_round_trips():
    values = _good_state_values()
    state = ReadingServiceState.from_bytes(json.dumps(values).encode())
    assert state.to_bytes() == json.dumps(values, sort_keys=True).encode()
    before_any_epoch = ReadingServiceState(num_workers=3, graph=[])
    assert ReadingServiceState.from_bytes(before_any_epoch.to_bytes()) == before_any_epoch  # no positions yet
    in_process = ReadingServiceState(num_workers=0, graph=["a.B"], epoch=1, consumed=[5], in_epoch=True)
    assert ReadingServiceState.from_bytes(in_process.to_bytes()) == in_process  # one position: the trainer's


@pytest.mark.parametrize("case", list(TAMPERED), ids=list(TAMPERED))
def test_tampered_fields_are_refused_naming_the_field(case):
    path, value, expected = TAMPERED[case]
    data = json.dumps(_set(_good_state_values(), path, value)).encode()
    with pytest.raises(ConfigurationError) as info:
        ReadingServiceState.from_bytes(data)
    message = str(info.value)
    assert message.startswith("malformed RPCReadingService checkpoint: field ") and expected in message, message
    assert "resume from an unmodified state_dict()" in message


def test_a_malformed_field_and_a_position_past_the_end_give_the_same_advice():
    data = json.dumps(_set(_good_state_values(), "consumed", DELETE)).encode()
    with pytest.raises(ConfigurationError) as info:
        ReadingServiceState.from_bytes(data)
    assert str(info.value) == str(malformed_checkpoint("field 'consumed' is missing"))
    past = str(past_the_end("'consumed'", "this worker's shard", 9, 4))
    assert past == (
        "malformed RPCReadingService checkpoint: field 'consumed' says 9 items of this worker's shard were consumed, "
        "but it has 4 in this epoch. The checkpoint was edited, or the data or the graph changed since it was taken: "
        "resume from an unmodified state_dict() over the same data"
    )
    assert str(info.value).endswith("The checkpoint was edited, truncated or written by another program: "
                                     "resume from an unmodified state_dict()")


def test_a_state_written_before_the_epoch_start_generator_was_recorded_still_loads():
    values = _good_state_values()
    del values["epoch_start_seed_generator"], values["digest"]  # nor did such a state carry a digest
    with pytest.warns(UserWarning, match="has no digest"):
        state = ReadingServiceState.from_bytes(json.dumps(values).encode())
    assert state.epoch_start_seed_generator is None and state.consumed == [4, 3, 3]


def test_only_the_generator_the_epoch_began_with_asks_for_a_replay():
    from torchdata.dataloader2.random import SeedGenerator

    from rpc_reading_service.trainer.checkpoint import seed_generator_state

    generator = SeedGenerator(SEED)
    start = seed_generator_state(generator)
    generator.generate_shared_seed()  # a snapshot: later draws do not change it
    state = ReadingServiceState.from_bytes(json.dumps(_good_state_values()).encode())
    assert start == state.epoch_start_seed_generator != seed_generator_state(generator)
    assert state.replays_epoch(SeedGenerator(SEED))  # _restore_checkpoint_beginning_of_epoch()
    assert not state.replays_epoch(generator)  # DataLoader2's advanced generator: resume mid-epoch
    between_epochs = signed(_set(_good_state_values(), "in_epoch", False))
    assert not ReadingServiceState.from_bytes(json.dumps(between_epochs).encode()).replays_epoch(SeedGenerator(SEED))


def test_version_must_be_the_int_this_package_reads():
    for version in (True, "1", 1.0, None):
        values = _set(_good_state_values(), "version", version)
        expected = f"checkpoint has version {version!r}, this rpc_reading_service"
        with pytest.raises(ConfigurationError, match=expected):
            ReadingServiceState.from_bytes(json.dumps(values).encode())


@pytest.mark.timeout(60)
def test_tampered_positions_are_refused_before_any_worker_starts(rs_factory, worker_server):
    """Through DataLoader2.from_state: the error comes from restore(), naming the field."""
    state = _state_of(lambda: rs_factory(3), make_graph())
    values = json.loads(state[RS_STATE])
    values["consumed"] = values["consumed"][:2]  # one worker's position dropped
    tampered = dict(state, **{RS_STATE: json.dumps(values).encode()})
    sessions_before = set(worker_server.session_pids())
    with pytest.raises(ConfigurationError, match="field 'consumed' has 2 entries, expected 3"):
        _resume(tampered, rs_factory(3))
    assert set(worker_server.session_pids()) <= sessions_before  # refused before any session started


# -- "dynamic": the chunk book is the checkpoint ------------------------------------------------
def _dynamic_rs(rs_factory):
    from rpc_reading_service.policies.dynamic.trainer import Dynamic

    return lambda: rs_factory(3, distribution=Dynamic(chunk_size=3))  # 23 items: 8 chunks, one short


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "cut, graph",
    [("mid-epoch", make_graph), ("after-last-item", make_graph), ("mid-epoch-2", make_graph),
     ("between-epochs", make_graph), ("mid-epoch", read_ahead_graph)],
    ids=["mid-epoch", "after-last-item", "mid-epoch-2", "between-epochs", "mid-epoch-read-ahead"],
)  # fmt: skip
def test_dynamic_resume_equals_uninterrupted_run(rs_factory, cut, graph):
    """Resuming a "dynamic" epoch leases the chunks not delivered again, skipping what was: the
    items and their order are the uninterrupted run's (also with items held by a trainer-side stage)."""
    make_rs = _dynamic_rs(rs_factory)
    expected = reference(make_rs, ("dynamic", 3))
    assert sorted(x for x, _ in expected[0]) == list(range(N_ITEMS)) and expected[0] != expected[1]
    got, state = interrupted_run(make_rs, *CUTS[cut], graph=graph)
    assert got == expected
    book = json.loads(state[RS_STATE])["distribution"]
    assert book is not None and book["chunk_size"] == 3
    # The second epoch's chunks follow a guided schedule of the first's length: its checkpoint
    # holds it; one between the epochs holds the first's length, so the second is the same.
    assert ("schedule" in book) == (cut == "mid-epoch-2")
    assert book.get("schedule", {"length": N_ITEMS})["length"] == N_ITEMS and book.get("stream_length", N_ITEMS) == N_ITEMS


@pytest.mark.timeout(60)
def test_dynamic_as_completed_resumes_exactly_once(rs_factory):
    """``Dynamic(in_order=False)`` delivers chunks as they complete, so the order is the workers';
    a mid-epoch checkpoint still resumes with every item of the epoch exactly once."""
    from rpc_reading_service.policies.dynamic.trainer import Dynamic

    make_rs = lambda: rs_factory(3, distribution=Dynamic(chunk_size=3, in_order=False))  # noqa: E731
    got, state = interrupted_run(make_rs, *CUTS["mid-epoch"])
    for epoch in got:
        assert sorted(x for x, _ in epoch) == list(range(N_ITEMS))
    assert json.loads(state[RS_STATE])["distribution"] is not None


@pytest.mark.timeout(60)
def test_dynamic_state_is_refused_by_another_distribution_and_vice_versa(rs_factory):
    make_dynamic = _dynamic_rs(rs_factory)
    for take, resume, words in ((make_dynamic, lambda: rs_factory(3), "holds state of a distribution"),
                                (lambda: rs_factory(3), make_dynamic, "other than 'dynamic'")):  # fmt: skip
        state = _state_of(take, make_graph())
        with pytest.raises(ConfigurationError, match=words):
            _resume(state, resume())
