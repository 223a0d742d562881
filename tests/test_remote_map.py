"""``dp.remote_map``: one stage of a DataPipe graph run on local worker servers, the rest where
it runs (this process, torch's DataLoader workers, MPRS workers, our own worker servers).

The ``check_*`` functions are shared with tests/nodes/test_remote_map.py (torchdata 0.11)."""

from __future__ import annotations

import os
import pickle
import time
from typing import Any, List, Set

import pytest
from _server_helpers import children_of, wait_dead
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

import rpc_reading_service  # noqa: F401 - registers dp.remote_map
from rpc_reading_service import ConfigurationError

N = 24


def square(x: int) -> int:
    return x * x


def square_where(x: int) -> tuple:
    """The square, with the pid of the worker server that computed it (a session's parent)."""
    return x * x, os.getppid()


def slow_on_even(x: int) -> int:
    """Later for even items: arrival order differs from the source's."""
    time.sleep(0.02 if x % 2 == 0 else 0)
    return x * x


def boom_on_7(x: int) -> int:
    if x == 7:
        raise KeyError(f"no item {x}")
    return x


def bad_upstream(x: int) -> int:
    if x == 5:
        raise ValueError(f"bad upstream item {x}")
    return x


def upstream() -> Any:
    """Shuffled before its sharding_filter: a loader's workers must all shuffle with one seed."""
    return IterableWrapper(range(N)).shuffle().sharding_filter()


def flat(batches: List[list]) -> List[Any]:
    return [x for batch in batches for x in batch]


def servers_of(results: List[tuple]) -> Set[int]:
    return {pid for _, pid in results}


def check_torch_dataloader_workers() -> None:
    """Under DataLoader(num_workers=2) each loader worker maps its shard on its own run, exactly
    once per epoch, and its local servers stop when the loader worker ends."""
    dp = upstream().remote_map(square_where, num_workers=1).batch(4)
    loader = DataLoader(dp, batch_size=None, num_workers=2)
    servers: Set[int] = set()
    for _ in range(2):
        results = flat(list(loader))
        assert sorted(x for x, _ in results) == [square(x) for x in range(N)]
        servers |= servers_of(results)
    assert len(servers) == 4  # one server per loader worker, per epoch (the workers are not persistent)
    wait_dead(servers, timeout=20, what="local servers of the loader's workers")


def check_early_break_then_reiterate() -> None:
    """Breaking off an epoch and iterating again starts a new, whole epoch."""
    dp = IterableWrapper(range(N)).remote_map(square, num_workers=2)
    try:
        for i, item in enumerate(dp):
            if i == 5:
                break
        assert list(dp) == [square(x) for x in range(N)]
        assert list(dp) == [square(x) for x in range(N)]
    finally:
        dp.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("distribution", [None, "dynamic"])
def test_order_and_exactly_once_over_epochs(distribution):
    dp = IterableWrapper(range(N)).remote_map(square, num_workers=2, distribution=distribution)
    try:
        assert len(dp) == N
        assert [list(dp) for _ in range(2)] == [[square(x) for x in range(N)]] * 2
    finally:
        dp.close()


@pytest.mark.timeout(60)
def test_in_order_false_delivers_each_item_once():
    dp = IterableWrapper(range(N)).remote_map(slow_on_even, num_workers=2, in_order=False)
    try:
        items = list(dp)
    finally:
        dp.close()
    assert sorted(items) == [square(x) for x in range(N)]


@pytest.mark.timeout(60)
def test_construction_starts_nothing_and_a_pickled_copy_carries_settings_not_the_run():
    before = set(children_of(os.getpid()))  # this test process's own (the tests' server forkserver)
    dp = IterableWrapper(range(N)).remote_map(square, num_workers=2, pickle_by_value=[os.path])
    assert set(children_of(os.getpid())) == before
    assert list(dp)[:3] == [0, 1, 4]
    copy = pickle.loads(pickle.dumps(dp))
    try:
        assert copy._run is None and copy.config.num_workers == 2 and copy.config.pickle_by_value == (os.path,)
        assert list(copy) == [square(x) for x in range(N)]  # its own run
        assert copy._run is not dp._run
    finally:
        dp.close()
        copy.close()
    assert set(children_of(os.getpid())) == before


@pytest.mark.timeout(60)
def test_composition_with_batch_and_no_workers_runs_fn_here():
    before = set(children_of(os.getpid()))
    remote = IterableWrapper(range(10)).remote_map(square, num_workers=2)
    here = IterableWrapper(range(10)).remote_map(square)  # num_workers=0: in this process
    try:
        assert list(remote.batch(4)) == list(here.batch(4)) == [[0, 1, 4, 9], [16, 25, 36, 49], [64, 81]]
    finally:
        remote.close()
        here.close()
    assert set(children_of(os.getpid())) == before


@pytest.mark.timeout(60)
def test_fns_exception_arrives_with_its_type_and_traceback():
    dp = IterableWrapper(range(20)).remote_map(boom_on_7, num_workers=2)
    try:
        with pytest.raises(KeyError, match="no item 7") as caught:
            list(dp)
    finally:
        dp.close()
    message = str(caught.value)
    assert "Caught KeyError in worker process 1" in message
    assert "Original Traceback" in message and "boom_on_7" in message


@pytest.mark.timeout(60)
def test_an_upstream_exception_comes_after_the_items_before_it():
    dp = IterableWrapper(range(10)).map(bad_upstream).remote_map(square, num_workers=2)
    got: List[int] = []
    try:
        with pytest.raises(ValueError, match="bad upstream item 5") as caught:
            for item in dp:
                got.append(item)
    finally:
        dp.close()
    assert got == [square(x) for x in range(5)]
    assert "Caught ValueError in dispatching process" in str(caught.value)  # MPRS's words


@pytest.mark.timeout(60)
def test_early_break_then_reiterate():
    check_early_break_then_reiterate()


@pytest.mark.timeout(90)
def test_under_torch_dataloader_workers():
    check_torch_dataloader_workers()


def check_a_run_per_process(reading_service: Any) -> None:
    """Under DataLoader2 with ``reading_service`` (two worker processes or sessions), each maps its
    shard on a run of its own, kept across epochs, whose local server stops after the loader."""
    from torchdata.dataloader2 import DataLoader2

    dp = upstream().remote_map(square_where, num_workers=1).batch(4)
    loader = DataLoader2(dp, reading_service=reading_service)
    try:
        epochs = [flat(list(loader)) for _ in range(2)]
    finally:
        loader.shutdown()
    for results in epochs:
        assert sorted(x for x, _ in results) == [square(x) for x in range(N)]
    servers = servers_of(epochs[0]) | servers_of(epochs[1])
    assert len(servers) == 2
    wait_dead(servers, timeout=20, what="local servers of the loader's workers")  # they watch their parent


@pytest.mark.timeout(90)
def test_under_dataloader2_with_mprs():
    from torchdata.dataloader2 import MultiProcessingReadingService

    check_a_run_per_process(MultiProcessingReadingService(num_workers=2))


@pytest.mark.timeout(90)
def test_inside_a_graph_run_by_our_reading_service():
    from rpc_reading_service import RPCReadingService

    check_a_run_per_process(RPCReadingService(num_workers=2))


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(ConfigurationError, match="callable"):
        IterableWrapper(range(3)).remote_map(5)
    with pytest.raises(ConfigurationError, match="prefetch"):
        IterableWrapper(range(3)).remote_map(square, prefetch=0)
    with pytest.raises(ConfigurationError, match="seed"):
        IterableWrapper(range(3)).remote_map(square, seed=-1)

