"""RPCReadingService semantics against real worker processes on loopback.

Most tests share one worker server (``workers=[server.address] * n`` sessions are
forked processes of that server, exactly as local workers are); a few start local workers
(``num_workers=N`` without addresses) where the local fleet itself is under test.
Graph functions are module-level: workers import them by reference.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import pickle
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import children_of, python_calls, remote, run_epochs, wait_dead, wait_until
from rpc_reading_service import (
    ConfigurationError,
    Liveness,
    RPCReadingService,
    RemoteWorkerError,
    WorkerLostError,
    WorkerStartupError,
)

pytestmark = pytest.mark.timeout(60)


# -- graph functions (module level: the workers import this module) -----------------------------
def double(x):
    return 2 * x


def keep_uneven(x):  # of range(20) over 2 workers: worker 0 keeps 10, worker 1 keeps 2
    return x % 2 == 0 or x < 5


def keep_even(x):  # worker 1 of 2 keeps nothing
    return x % 2 == 0


def keep_odd(x):  # worker 0 of 2 keeps nothing
    return x % 2 == 1


def with_random(x):
    return (x, random.random(), torch.rand(1).item())


def boom_on_7(x):
    if x == 7:
        raise ValueError("boom 7")
    return x


class TwoArgError(Exception):
    def __init__(self, code, detail):
        super().__init__(f"code {code}: {detail}")


def raise_two_arg(x):
    if x == 3:
        raise TwoArgError(3, "cannot be rebuilt with one argument")
    return x


def failing_init(datapipe, worker_info):
    raise RuntimeError("init failed on purpose")


def init_without_return(datapipe, worker_info):
    datapipe.map(str)  # forgot to return it


def tag(worker_id, x):
    return (worker_id, x)


def tag_with_worker(datapipe, worker_info):
    return datapipe.map(functools.partial(tag, worker_info.worker_id))


RESETS = [0]


def count_reset(datapipe, worker_info, seed_generator):
    RESETS[0] += 1
    return datapipe


def hold_setup_of_rank_2(directory, datapipe, worker_info):
    """worker_init_fn: worker 2's setup waits for ``directory/release`` (at most 10 s), then says it is done."""
    if worker_info.worker_id == 2:
        deadline = time.monotonic() + 10
        while not (Path(directory) / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        (Path(directory) / "set-up").touch()
    return datapipe


def exit_in_first_setup_of_rank_1(directory, datapipe, worker_info):
    """worker_init_fn: worker 1's first session dies in its setup; a session after it sets up."""
    died = Path(directory) / "died"
    if worker_info.worker_id == 1 and not died.exists():
        died.touch()
        os._exit(1)
    return datapipe


def with_reset_count(x):
    return (RESETS[0], x)


def big_tensor(x):
    return {"index": x, "tensor": torch.full((256, 512), float(x))}


# -- helpers ------------------------------------------------------------------------------------
def rrs_threads():
    return {t for t in threading.enumerate() if t.name.startswith("rrs-") and t.is_alive()}


# -- exactly once -------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers, n_items", [(1, 10), (2, 11), (3, 17), (4, 1), (3, 0)])
def test_every_item_exactly_once(worker_server, num_workers, n_items):
    dp = IterableWrapper(range(n_items)).shuffle().sharding_filter().map(double)
    for epoch in run_epochs(dp, remote(worker_server, num_workers), n_epochs=2):
        assert sorted(epoch) == [2 * x for x in range(n_items)]


@pytest.mark.parametrize("num_workers, n_items", [(2, 20), (3, 17), (4, 1), (3, 0)])
def test_in_order_is_strict_round_robin(worker_server, num_workers, n_items):
    # Worker w holds the items with i % n == w, so round-robin gives back 0, 1, 2, ...
    dp = IterableWrapper(range(n_items)).sharding_filter()
    assert run_epochs(dp, remote(worker_server, num_workers), n_epochs=1) == [list(range(n_items))]


@pytest.mark.parametrize(
    "keep, expected",
    [
        # Shard lengths (10, 2): round-robin while both run, then worker 0 alone.
        (keep_uneven, [0, 1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18]),
        # (10, 0) and (0, 10): an empty shard just drops out.
        (keep_even, list(range(0, 20, 2))),
        (keep_odd, list(range(1, 20, 2))),
    ],
    ids=["10-2", "10-0", "0-10"],
)
def test_uneven_and_empty_shards(worker_server, keep, expected):
    dp = IterableWrapper(range(20)).sharding_filter().filter(keep)
    ordered = run_epochs(dp, remote(worker_server, 2), n_epochs=2)
    assert ordered == [expected, expected]
    unordered = run_epochs(dp, remote(worker_server, 2, in_order=False), n_epochs=1)
    assert sorted(unordered[0]) == expected


def test_out_of_order_mode_yields_the_same_multiset(worker_server):
    dp = IterableWrapper(range(500)).shuffle().sharding_filter().map(double)
    for epoch in run_epochs(dp, remote(worker_server, 3, in_order=False), n_epochs=2):
        assert sorted(epoch) == [2 * x for x in range(500)]


def test_many_items_span_many_frames_with_small_prefetch(worker_server):
    dp = IterableWrapper(range(5000)).sharding_filter()
    (epoch,) = run_epochs(dp, remote(worker_server, 2, prefetch=1), n_epochs=1)
    assert epoch == list(range(5000))


def test_tiny_items_stream_fast(worker_server):
    # torchdata's MultiProcessingReadingService manages ~1,300 tiny items/s here (it polls
    # with sleeps); packing and credits must do far better even on a loaded 2-core machine.
    # The best of 3 epochs: other processes of a loaded host take the cores for a while (the
    # CPU time per item is what the code decides: about 25 us in all, trainer and sessions).
    n = 30_000
    rates = []
    with DataLoader2(IterableWrapper(range(n)).sharding_filter(), reading_service=remote(worker_server, 2)) as dl:
        assert sum(1 for _ in dl) == n  # warm-up epoch
        for _ in range(3):
            start = time.perf_counter()
            count = sum(1 for _ in dl)
            rates.append(count / (time.perf_counter() - start))
            assert count == n
    assert max(rates) > 13_000, f"only {max(rates):.0f} items/s (the best of {', '.join(f'{r:.0f}' for r in rates)})"


def test_the_training_loop_takes_each_item_with_one_python_call(worker_server):
    # Between the training loop's next() and the epoch's runs only DataLoader2's own __next__
    # runs per item: torch's iterator hook does not wrap the stream in its per-item checks.
    n = 3000
    with DataLoader2(IterableWrapper(range(n)).sharding_filter(), reading_service=remote(worker_server, 1)) as dl:
        items = iter(dl)
        first = next(items)  # the session set up, its first frame taken
        rest, calls = python_calls(lambda: list(itertools.islice(items, n - 1)))
        assert [first] + rest == list(range(n))
        assert list(items) == []
    per_item = {name: count for name, count in collections.Counter(calls).items() if count > (n - 1) // 4}
    assert per_item == {"__next__": n - 1}, per_item


def test_large_tensors_arrive_intact(worker_server):
    dp = IterableWrapper(range(6)).sharding_filter().map(big_tensor)
    (epoch,) = run_epochs(dp, remote(worker_server, 2), n_epochs=1)
    assert [item["index"] for item in epoch] == list(range(6))
    for item in epoch:
        assert item["tensor"].shape == (256, 512)
        assert torch.equal(item["tensor"], torch.full((256, 512), float(item["index"])))


# -- seeds and determinism ----------------------------------------------------------------------
def test_same_seed_reproduces_runs_epochs_differ_seeds_differ(worker_server):
    dp = IterableWrapper(range(30)).shuffle().sharding_filter().map(with_random)
    run_a = run_epochs(dp, remote(worker_server, 2), n_epochs=2, seed=123)
    run_b = run_epochs(dp, remote(worker_server, 2), n_epochs=2, seed=123)
    run_c = run_epochs(dp, remote(worker_server, 2), n_epochs=2, seed=456)
    assert run_a == run_b  # identical order and identical random draws
    first, second = run_a
    assert [x for x, *_ in first] != [x for x, *_ in second]  # epochs are shuffled differently
    assert [x for x, *_ in first] != list(range(30))
    assert [x for x, *_ in run_c[0]] != [x for x, *_ in first]
    for epoch in (*run_a, *run_c):
        assert sorted(x for x, *_ in epoch) == list(range(30))  # shuffle before sharding is shared


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epochs_differ_without_a_seed(worker_server, num_workers):
    # DataLoader2 reseeds its generator from torch's global RNG without advancing it; with
    # nothing else drawing from torch in between, epochs differ because every epoch takes one
    # draw from torch's RNG (as torch's DataLoader does), not because the epoch number is mixed in.
    dp = IterableWrapper(range(30)).shuffle().sharding_filter()
    rs = remote(worker_server, num_workers) if num_workers else RPCReadingService()
    first, second, third = run_epochs(dp, rs, n_epochs=3)
    assert first != second and second != third and first != third
    assert sorted(first) == sorted(second) == list(range(30))


def test_randomness_after_sharding_differs_per_worker(worker_server):
    dp = IterableWrapper(range(8)).sharding_filter().map(with_random)
    (epoch,) = run_epochs(dp, remote(worker_server, 2), seed=0, n_epochs=1)
    assert [x for x, *_ in epoch] == list(range(8))
    worker0, worker1 = epoch[0::2], epoch[1::2]
    # Same seeds on both workers would make these sequences equal.
    assert [r for _, r, _ in worker0] != [r for _, r, _ in worker1]
    assert [t for _, _, t in worker0] != [t for _, _, t in worker1]
    assert len({r for _, r, _ in epoch}) == 8


def test_in_process_mode_is_exactly_once_and_seeded():
    dp = IterableWrapper(range(20)).shuffle().sharding_filter().map(double)
    run_a = run_epochs(dp, RPCReadingService(num_workers=0), n_epochs=2, seed=7)
    run_b = run_epochs(dp, RPCReadingService(num_workers=0), n_epochs=2, seed=7)
    assert run_a == run_b
    assert run_a[0] != run_a[1]
    assert all(sorted(e) == [2 * x for x in range(20)] for e in run_a)


# -- errors from the remote graph -----------------------------------------------------------------
def test_remote_exception_keeps_type_message_traceback_and_worker(worker_server):
    dp = IterableWrapper(range(20)).sharding_filter().map(boom_on_7)
    with DataLoader2(dp, reading_service=remote(worker_server, 2)) as dl:
        seen = []
        with pytest.raises(ValueError) as info:
            for x in dl:
                seen.append(x)
    message = str(info.value)
    assert "boom 7" in message
    assert "Caught ValueError in worker process 1" in message  # item 7 belongs to worker 1 of 2
    assert worker_server.address in message
    assert "Original Traceback" in message and "boom_on_7" in message
    assert info.value.worker_rank == 1 and info.value.worker_address == worker_server.address
    assert seen == list(range(7))  # everything before the failing item arrived, in order


def test_unrebuildable_exception_type_becomes_remote_worker_error(worker_server):
    dp = IterableWrapper(range(10)).sharding_filter().map(raise_two_arg)
    with pytest.raises(RemoteWorkerError) as info:
        run_epochs(dp, remote(worker_server, 2), n_epochs=1)
    message = str(info.value)
    assert "TwoArgError" in message and "cannot be rebuilt with one argument" in message
    assert "worker process 1" in message and worker_server.address in message


RETURNS_NONE = (
    r"(?s)worker process [01] .*ConfigurationError: worker_init_fn init_without_return returned NoneType "
    r"on worker [01] of 2, not a DataPipe: return the DataPipe it was given"
)


@pytest.mark.parametrize(
    "init_fn, dispatching, cause, error",
    [
        (failing_init, False, RuntimeError, "init failed on purpose"),
        # torchdata's process_init_fn asserts the return (MPRS's worker dies of it and its trainer hangs)
        (init_without_return, False, ConfigurationError, RETURNS_NONE),
        (init_without_return, True, ConfigurationError, RETURNS_NONE),
    ],
    ids=["raises", "returns-none", "returns-none-dispatching"],
)
def test_worker_init_fn_failing_is_a_startup_error_not_a_hang(worker_server, init_fn, dispatching, cause, error):
    dp = IterableWrapper(range(10))
    if dispatching:
        dp = dp.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    else:
        dp = dp.sharding_filter()
    start = time.monotonic()
    with pytest.raises(WorkerStartupError, match=error) as info:
        run_epochs(dp, remote(worker_server, 2, worker_init_fn=init_fn), n_epochs=1)
    assert type(info.value.__cause__) is cause  # the worker's error, rebuilt
    assert time.monotonic() - start < 10


def test_each_session_starts_the_epoch_once_it_is_set_up(worker_server, tmp_path):
    # Worker 2's setup is held up on the server: workers 0 and 1 stream meanwhile, and the
    # epoch is exactly the same once worker 2 is set up.
    hold = functools.partial(hold_setup_of_rank_2, str(tmp_path))
    dp = IterableWrapper(range(30)).sharding_filter()
    with DataLoader2(dp, reading_service=remote(worker_server, 3, worker_init_fn=hold)) as dl:
        items = iter(dl)
        head = [next(items), next(items)]  # round-robin: worker 0's first item, then worker 1's
        assert not (tmp_path / "set-up").exists(), "the first items waited for every session's setup"
        assert dl.reading_service.stats().workers[2].pid is None  # its READY has not come
        (tmp_path / "release").touch()
        assert head + list(items) == list(range(30))
        assert list(dl) == list(range(30))  # and the next epoch


def test_shutting_down_while_a_session_sets_up_is_quick_and_leaves_nothing(worker_server, tmp_path):
    worker_server.wait_idle()
    hold = functools.partial(hold_setup_of_rank_2, str(tmp_path))
    dl = DataLoader2(IterableWrapper(range(30)).sharding_filter(), reading_service=remote(worker_server, 3, worker_init_fn=hold))
    items = iter(dl)
    assert next(items) == 0
    start = time.monotonic()
    dl.shutdown()  # worker 2 still sets up
    assert time.monotonic() - start < 3
    assert wait_until(lambda: not rrs_threads(), 2)  # its setup thread ended with it
    (tmp_path / "release").touch()
    assert wait_until(lambda: not worker_server.session_pids(), 5)  # the held session ends once it can


@pytest.mark.parametrize("failure, distribution", [("reassign", "round_robin"), ("reassign", "dynamic"), ("raise", "round_robin")])
def test_a_session_lost_in_its_setup_is_reassigned_or_raised(worker_server, tmp_path, failure, distribution):
    # The other sessions already stream when worker 1's setup fails: "reassign" sets its shard up
    # on a new session, "raise" names the worker.
    init = functools.partial(exit_in_first_setup_of_rank_1, str(tmp_path))
    rs = remote(worker_server, 3, worker_init_fn=init, on_worker_failure=failure, distribution=distribution)
    dp = IterableWrapper(range(30)).sharding_filter()
    if failure == "raise":
        with pytest.raises(WorkerLostError, match=r"worker 1 \(.*\) closed the session during setup"):
            run_epochs(dp, rs, n_epochs=1)
    else:
        assert run_epochs(dp, rs, n_epochs=2) == [list(range(30))] * 2
    assert (tmp_path / "died").exists()


def test_worker_init_fn_and_worker_reset_fn_are_applied(worker_server):
    dp = IterableWrapper(range(6)).sharding_filter()
    rs = remote(worker_server, 2, worker_init_fn=tag_with_worker)
    assert run_epochs(dp, rs, n_epochs=1) == [[(0, 0), (1, 1), (0, 2), (1, 3), (0, 4), (1, 5)]]

    dp = IterableWrapper(range(4)).sharding_filter().map(with_reset_count)
    first, second = run_epochs(dp, remote(worker_server, 2, worker_reset_fn=count_reset), n_epochs=2)
    assert first == [(1, x) for x in range(4)]  # reset ran once per worker before epoch 1
    assert second == [(2, x) for x in range(4)]  # and again before epoch 2


def test_lambdas_and_local_functions_travel(worker_server):
    offset = 1000

    def add_offset(x):
        return x + offset

    dp = IterableWrapper(range(6)).sharding_filter().map(add_offset).map(lambda x: -x)
    rs = remote(worker_server, 2, worker_init_fn=lambda dp, info: dp.map(lambda x: (info.worker_id, x)))
    assert run_epochs(dp, rs, n_epochs=1) == [[(x % 2, -(x + 1000)) for x in range(6)]]


# -- epochs, pause/limit, shutdown ---------------------------------------------------------------
@pytest.mark.parametrize("in_order", [True, False])
def test_break_out_of_an_epoch_then_a_full_epoch(worker_server, in_order):
    dp = IterableWrapper(range(3000)).shuffle().sharding_filter()
    with DataLoader2(dp, reading_service=remote(worker_server, 2, prefetch=2, in_order=in_order)) as dl:
        dl.seed(1)
        for i, _ in enumerate(dl):
            if i == 4:
                break
        assert sorted(dl) == list(range(3000))
        for _ in dl:
            break
        for _ in dl:
            break
        assert sorted(dl) == list(range(3000))


def test_limit_then_resume(worker_server):
    dp = IterableWrapper(range(20)).sharding_filter()
    with DataLoader2(dp, reading_service=remote(worker_server, 2)) as dl:
        it = iter(dl)
        it.limit(3)
        assert list(it) == [0, 1, 2]
        it.resume()
        assert list(it) == [3, 4, 5]  # the limit persists after resume
        it.resume()
        it.limit(None)
        assert list(it) == list(range(6, 20))
        assert list(dl) == list(range(20))  # a fresh epoch after a paused one


def test_local_workers_exactly_once_then_fast_shutdown_after_early_break():
    threads_before = rrs_threads()
    dp = IterableWrapper(range(2000)).shuffle().sharding_filter().map(double)
    dl = DataLoader2(dp, reading_service=RPCReadingService(num_workers=3))
    try:
        dl.seed(3)
        first, second = list(dl), list(dl)
        assert sorted(first) == sorted(second) == [2 * x for x in range(2000)]
        assert first != second
        it = iter(dl)
        next(it)  # then abandon the epoch mid-way
        rs = dl.reading_service  # DataLoader2 works on a clone of the service passed in
        server_pid = rs._local_server.pid
        sessions = children_of(server_pid)
        assert len(sessions) == 3  # one forked session process per worker
        assert rrs_threads() - threads_before
    finally:
        start = time.monotonic()
        dl.shutdown()
        elapsed = time.monotonic() - start
    assert elapsed < 5.0
    wait_dead([server_pid, *sessions], timeout=5.0, what="processes outlived shutdown()")
    assert not (rrs_threads() - threads_before), "threads outlived shutdown()"
    dl.shutdown()  # idempotent


# -- the ReadingServiceInterface contract ---------------------------------------------------------
def test_service_is_cloned_by_pickling_and_finalize_is_idempotent():
    children_before, threads_before = set(children_of(os.getpid())), rrs_threads()
    rs = RPCReadingService(num_workers=2, worker_init_fn=lambda dp, info: dp, prefetch=3)
    # __init__ opens nothing: no process, no thread (DataLoader2 clones it before use).
    assert set(children_of(os.getpid())) == children_before and rrs_threads() == threads_before
    clone = pickle.loads(pickle.dumps(rs))
    assert clone.num_workers == 2 and clone._config.prefetch == 3
    assert callable(clone._config.worker_init_fn)
    rs.finalize()  # never initialised
    rs.finalize()
    assert rs._local_server is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_workers": -1}, "num_workers"),
        ({"num_workers": 1, "workers": []}, "empty"),
        ({"num_workers": 1, "workers": ["nohost"]}, "no port"),
        ({"num_workers": 1, "prefetch": 0}, "prefetch"),
        ({"num_workers": 1, "transport": "pigeon"}, "unknown transport"),
        ({"num_workers": 1, "timeout": 0.5, "liveness": Liveness(heartbeat_interval=1.0)}, "timeout"),
    ],
)
def test_configuration_errors(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        RPCReadingService(**kwargs)


def test_addresses_without_num_workers_mean_one_session_each(worker_server):
    rs = RPCReadingService(workers=[worker_server.address] * 3, auth_key=worker_server.key)
    assert rs.num_workers == 3
    dp = IterableWrapper(range(9)).sharding_filter().map(functools.partial(tag, None))
    assert run_epochs(dp, rs, n_epochs=1) == [[(None, x) for x in range(9)]]


def test_session_processes_end_with_their_dataloader(worker_server):
    before = set(worker_server.session_pids())
    dl = DataLoader2(IterableWrapper(range(4)).sharding_filter(), reading_service=remote(worker_server, 2))
    assert sorted(dl) == [0, 1, 2, 3]
    sessions = set(worker_server.session_pids()) - before
    assert len(sessions) == 2
    dl.shutdown()
    wait_dead(sessions, timeout=5, what="sessions outlived their DataLoader2")
    assert os.getpid() not in sessions
