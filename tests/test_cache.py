"""The worker cache end to end: ``cached_map`` in real DataLoader2 epochs on real
``rpc-reading-worker`` servers started with ``--cache-dir``, and on local fleets."""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from _server_helpers import read_line, reap, remote, run_epochs, spawn_python, worker_cli_runs  # noqa: E402 - tests/ is on sys.path
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import CacheKeyError, ConfigurationError, LocalWorkers, RPCReadingService
from rpc_reading_service.cache import DiskStore
from rpc_reading_service.cache.temporary import (
    TEMPORARY_CACHE_PREFIX, HeldDirectory, remove_abandoned_caches,
)

pytestmark = pytest.mark.timeout(60)


# -- graph functions the workers import by reference --------------------------------------------
def decode(calls_file: str, item: int, nbytes: int = 0, delay: float = 0.0):
    """The expensive, deterministic step: appends a line to ``calls_file`` per call."""
    with open(calls_file, "a") as handle:
        handle.write(f"{item}\n")
    if delay:
        threading.Event().wait(delay)
    return item * 10, bytes(nbytes)


def add_noise(value):
    return value[0] + torch.rand(()).item()


def unpicklable_key(item):
    return threading.Lock()


def calls(path: Path) -> int:
    return len(path.read_text().split()) if path.exists() else 0


def cached(items, calls_file: Path, **kwargs):
    return (
        IterableWrapper(items)
        .sharding_filter()
        .cached_map(functools.partial(decode, str(calls_file), **kwargs))
    )


def cache_args(directory: Path, size: str = "10M"):
    return ["--cache-dir", str(directory), "--cache-size", size]


def expected(items, nbytes: int = 0):
    return sorted((item * 10, bytes(nbytes)) for item in items)


# -- hits and misses -----------------------------------------------------------------------------
def test_second_epoch_and_second_run_call_fn_only_for_new_items(fresh_server, tmp_path):
    server = fresh_server(args=cache_args(tmp_path / "cache"))
    calls_file = tmp_path / "calls"
    with DataLoader2(cached(range(30), calls_file), reading_service=remote(server)) as dl:
        assert sorted(dl) == expected(range(30))
        assert calls(calls_file) == 30
        assert sorted(dl) == expected(range(30))
        assert calls(calls_file) == 30  # epoch 2: all hits
    assert sorted(run_epochs(cached(range(40), calls_file), remote(server), 1)[0]) == expected(range(40))
    assert calls(calls_file) == 40  # a second run: only the 10 new items missed


def test_without_a_cache_cached_map_just_calls_fn(fresh_server, tmp_path):
    server = fresh_server()
    calls_file = tmp_path / "calls"
    epochs = run_epochs(cached(range(10), calls_file), remote(server), 2)
    assert [sorted(e) for e in epochs] == [expected(range(10))] * 2
    assert calls(calls_file) == 20
    in_trainer = run_epochs(cached(range(10), calls_file), RPCReadingService(num_workers=0), 1)
    assert sorted(in_trainer[0]) == expected(range(10)) and calls(calls_file) == 30


def test_a_memory_tier_alone_serves_later_epochs_of_a_session(fresh_server, tmp_path):
    server = fresh_server(args=["--cache-memory", "1M"])
    calls_file = tmp_path / "calls"
    epochs = run_epochs(cached(range(10), calls_file), remote(server), 2)
    assert [sorted(e) for e in epochs] == [expected(range(10))] * 2
    assert calls(calls_file) == 10


def test_random_augmentation_after_cached_map_stays_random(fresh_server, tmp_path):
    server = fresh_server(args=cache_args(tmp_path / "cache"))
    calls_file = tmp_path / "calls"
    first, second = run_epochs(cached(range(8), calls_file).map(add_noise), remote(server), 2, seed=3)
    assert calls(calls_file) == 8
    assert sorted(int(v) for v in first) == sorted(int(v) for v in second) == [x * 10 for x in range(8)]
    assert all(a != b for a, b in zip(first, second)), (first, second)  # fresh noise on every cached value


def test_lru_eviction_keeps_the_disk_cache_under_its_size(fresh_server, tmp_path):
    size = 64 * 1024
    server = fresh_server(args=cache_args(tmp_path / "cache", str(size)))
    calls_file = tmp_path / "calls"
    one = functools.partial(remote, server, num_workers=1)  # one session: a known order of use
    epoch = run_epochs(cached(range(20), calls_file, nbytes=8000), one(), 1)[0]
    assert sorted(epoch) == expected(range(20), 8000)
    on_disk = DiskStore(str(tmp_path / "cache"), size).total_bytes()
    assert 0 < on_disk <= size  # 20 entries of 8 KB do not fit in 64 KB
    # The most recently used entries stayed, the least recently used ones went.
    run_epochs(cached(range(16, 20), calls_file, nbytes=8000), one(), 1)
    assert calls(calls_file) == 20
    run_epochs(cached(range(4), calls_file, nbytes=8000), one(), 1)
    assert calls(calls_file) == 24


# -- concurrency, corruption, restarts, full disks ------------------------------------------------
@pytest.mark.parametrize("session_mode", ["fork", "thread"])
def test_two_sessions_racing_on_one_key_compute_it_once(fresh_server, tmp_path, session_mode):
    server = fresh_server(args=[*cache_args(tmp_path / "cache"), "--session-mode", session_mode])
    calls_file = tmp_path / "calls"
    # Round-robin sharding gives each of the two sessions one of the two equal items, at once.
    items = run_epochs(cached([7, 7], calls_file, delay=0.5), remote(server), 1)[0]
    assert items == [(70, b""), (70, b"")]
    assert calls(calls_file) == 1


def test_a_corrupted_entry_is_recomputed_never_served(fresh_server, tmp_path):
    server = fresh_server(args=cache_args(tmp_path / "cache"))
    calls_file = tmp_path / "calls"
    run_epochs(cached(range(10), calls_file, nbytes=100), remote(server), 1)
    entries = sorted((tmp_path / "cache").rglob("*.entry"))
    assert len(entries) == 10
    flipped, truncated = entries[0], entries[1]
    data = bytearray(flipped.read_bytes())
    data[-50] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-10])
    epoch = run_epochs(cached(range(10), calls_file, nbytes=100), remote(server), 1)[0]
    assert sorted(epoch) == expected(range(10), 100)
    assert calls(calls_file) == 12
    assert server.stderr().count("is corrupt, partial or another key") == 2


def test_a_misplaced_or_absurdly_large_entry_is_a_miss_and_entries_are_private(fresh_server, tmp_path):
    cache = tmp_path / "cache"
    server = fresh_server(args=cache_args(cache))
    calls_file = tmp_path / "calls"
    run_epochs(cached(range(3), calls_file, nbytes=100), remote(server), 1)
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in cache.rglob("*")}
    assert modes and all(mode == (0o700 if path.is_dir() else 0o600) for path, mode in modes.items()), modes
    entries = sorted(cache.rglob("*.entry"))
    assert len(entries) == 3
    shutil.copyfile(entries[0], entries[1])  # a valid entry, under another item's name
    os.truncate(entries[2], 1 << 40)  # 1 TiB (sparse)
    epoch = run_epochs(cached(range(3), calls_file, nbytes=100), remote(server), 1)[0]
    assert sorted(epoch) == expected(range(3), 100)  # not item 0's value twice, no MemoryError
    assert calls(calls_file) == 5
    log = server.stderr()
    assert "is corrupt, partial or another key's" in log and "more than the whole cache may hold" in log, log
    assert sum(path.stat().st_size for path in cache.rglob("*.entry")) < 1 << 20  # the huge one is gone


def test_a_changed_function_body_is_not_served_its_old_results(fresh_server, tmp_path, monkeypatch):
    server = fresh_server(args=cache_args(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "changing_load.py"
    results = []
    for body in ("item + 1", "item * 1000"):
        source.write_text(f"def load(item):\n    return {body}\n")
        shutil.rmtree(tmp_path / "__pycache__", ignore_errors=True)
        module = importlib.reload(module) if results else importlib.import_module("changing_load")
        dp = IterableWrapper(range(4)).sharding_filter().cached_map(module.load)
        results.append(sorted(run_epochs(dp, remote(server, pickle_by_value=[module]), 1)[0]))
    monkeypatch.delitem(sys.modules, "changing_load")
    assert results == [[1, 2, 3, 4], [0, 1000, 2000, 3000]]


def test_a_restarted_server_keeps_its_disk_cache(fresh_server, tmp_path):
    calls_file = tmp_path / "calls"
    first = fresh_server(args=cache_args(tmp_path / "cache"))
    run_epochs(cached(range(12), calls_file), remote(first), 1)
    first.stop()
    second = fresh_server(args=cache_args(tmp_path / "cache"))
    assert sorted(run_epochs(cached(range(12), calls_file), remote(second), 1)[0]) == expected(range(12))
    assert calls(calls_file) == 12


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs under the test's directory, unmounted afterwards (skips unless mount works)."""
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    try:
        command = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mountpoint)]
        mounted = subprocess.run(command, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        mounted = False
    if not mounted:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=10)


def test_a_full_disk_degrades_to_no_caching_with_one_warning_per_session(fresh_server, tmp_path, tiny_disk):
    server = fresh_server(args=cache_args(tiny_disk / "cache", "10M"))
    calls_file = tmp_path / "calls"
    epochs = run_epochs(cached(range(20), calls_file, nbytes=16000), remote(server), 2)
    assert [sorted(e) for e in epochs] == [expected(range(20), 16000)] * 2
    assert server.proc.poll() is None
    warnings = server.stderr().count("writing an entry failed")
    assert 1 <= warnings <= 2, server.stderr()  # at most one per session (two sessions)
    assert calls(calls_file) > 20  # what did not fit is computed again in epoch 2


def test_an_unpicklable_key_is_a_clear_error_and_the_server_lives(fresh_server, tmp_path):
    server = fresh_server(args=cache_args(tmp_path / "cache"))
    dp = IterableWrapper(range(4)).sharding_filter().cached_map(abs, key_fn=unpicklable_key)
    with pytest.raises(CacheKeyError, match="key_fn"):
        run_epochs(dp, remote(server), 1)
    assert server.proc.poll() is None
    assert sorted(run_epochs(cached(range(4), tmp_path / "calls"), remote(server), 1)[0]) == expected(
        range(4)
    )


# -- local fleets ----------------------------------------------------------------------------------
def test_local_workers_share_a_temporary_cache_removed_at_the_end(tmp_path):
    calls_file = tmp_path / "calls"
    with DataLoader2(cached(range(16), calls_file), reading_service=RPCReadingService(num_workers=2)) as dl:
        assert [sorted(dl), sorted(dl)] == [expected(range(16))] * 2
        directory = dl.reading_service._local_server._cache_temp.path
        assert directory is not None and os.path.isdir(directory)
    assert calls(calls_file) == 16
    assert not os.path.exists(directory)


def test_only_an_unheld_old_temporary_cache_of_this_user_is_taken_for_abandoned(tmp_path):
    held, abandoned, young = (tempfile.mkdtemp(prefix=TEMPORARY_CACHE_PREFIX, dir=tmp_path) for _ in "abc")
    (Path(abandoned) / "entries").mkdir()
    (Path(abandoned) / "entries" / "x").write_bytes(b"payload")
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / (TEMPORARY_CACHE_PREFIX + "link")).symlink_to(outside)
    (tmp_path / (TEMPORARY_CACHE_PREFIX + "file")).write_bytes(b"")
    others = tmp_path / (TEMPORARY_CACHE_PREFIX + "another-users")
    others.mkdir()
    if os.getuid() == 0:  # root can give it away; other users test their own only
        os.chown(others, 65534, 65534)
    for path in (held, abandoned, outside, others):
        os.utime(path, (0, 0))
    holder = HeldDirectory(held)
    try:
        mine = [] if os.getuid() == 0 else [str(others)]
        assert sorted(remove_abandoned_caches(str(tmp_path))) == sorted([abandoned, *mine])
    finally:
        holder.close()
    assert os.path.isdir(held) and os.path.isdir(young) and os.path.isdir(outside)
    assert sorted(remove_abandoned_caches(str(tmp_path), min_age_s=0)) == sorted([held, young])
    assert others.is_dir() == (os.getuid() == 0)


TRAINER_WITH_A_TEMPORARY_CACHE = """
import sys, tempfile
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from rpc_reading_service import RPCReadingService

tempfile.tempdir = sys.argv[1]
graph = IterableWrapper(range(10**7)).sharding_filter()
dl = DataLoader2(graph, reading_service=RPCReadingService(num_workers=2))
if sys.argv[2] == "run":
    it = iter(dl)
    next(it), next(it)
    print("started", flush=True)
    sys.stdin.readline()
else:
    print(sum(x for x, _ in zip(dl, range(100))), flush=True)
    dl.shutdown()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked local workers: Linux")
def test_a_run_killed_with_its_workers_leaves_its_temporary_cache_to_the_next_run(tmp_path):
    temp = tmp_path / "temp"
    temp.mkdir()
    trainer = spawn_python(TRAINER_WITH_A_TEMPORARY_CACHE, tmp_path, [str(temp), "run"])
    try:
        assert read_line(trainer, timeout=45) == "started"
        (left,) = temp.glob(TEMPORARY_CACHE_PREFIX + "*")
        assert remove_abandoned_caches(str(temp), min_age_s=0) == []  # held by the trainer and its server
    finally:
        reap(trainer)  # SIGKILL to its process group: the trainer and its worker server at once
    assert left.is_dir()
    os.utime(left, (0, 0))
    next_run = spawn_python(TRAINER_WITH_A_TEMPORARY_CACHE, tmp_path, [str(temp), "once"])
    try:
        assert read_line(next_run, timeout=45) == str(sum(range(100)))
        assert next_run.wait(30) == 0
    finally:
        reap(next_run)
    assert list(temp.iterdir()) == []


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_local_workers_keep_a_given_cache_dir_for_the_next_run(tmp_path, start_method):
    calls_file = tmp_path / "calls"
    for _ in range(2):
        service = RPCReadingService(
            num_workers=2,
            workers=LocalWorkers(
                start_method=start_method, cache_dir=str(tmp_path / "cache"), cache_size="1M"
            ),
        )
        assert sorted(run_epochs(cached(range(16), calls_file), service, 1)[0]) == expected(range(16))
    assert calls(calls_file) == 16


@pytest.mark.timeout(30)
def test_the_cli_documents_and_checks_the_cache_flags(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    shown, *refused = worker_cli_runs(
        [["--help"], ["--port", "0", "--cache-dir", str(tmp_path)],
         ["--port", "0", "--cache-dir", str(tmp_path), "--cache-size", "lots"]], env=env,
    )  # fmt: skip
    assert shown.returncode == 0
    for flag in ("--cache-dir", "--cache-size", "--cache-memory"):
        assert flag in shown.stdout
    for run, words in zip(refused, ["needs --cache-size", "not a size"]):
        assert run.returncode == 2 and words in run.stderr, run.stderr


@pytest.mark.timeout(30)
def test_a_cache_dir_others_may_write_is_refused_by_the_cli_and_by_local_workers(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # world-writable, sticky as /tmp: still anyone's pickles
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    (run,) = worker_cli_runs([["--port", "0", *cache_args(shared)]], env=env)
    assert run.returncode == 2 and f"--cache-dir {shared} can be written by every user" in run.stderr, run.stderr
    assert "chmod 700" in run.stderr
    service = RPCReadingService(num_workers=1, workers=LocalWorkers(cache_dir=str(shared), cache_size="1M"))
    with pytest.raises(ConfigurationError, match=r"LocalWorkers.cache_dir .* can be written by every user"):
        run_epochs(IterableWrapper(range(2)), service, 1)
    assert list(shared.iterdir()) == []  # nothing written there


def test_the_reading_service_checks_its_cache_options():
    # The cache options belong to LocalWorkers: remote servers have their own --cache-dir.
    with pytest.raises(TypeError, match="cache_dir"):
        RPCReadingService(workers=["127.0.0.1:1"], cache_dir="/tmp/x")  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="cache_size 'lots' is not a size"):
        RPCReadingService(num_workers=1, workers=LocalWorkers(cache_size="lots"))
    with pytest.raises(ConfigurationError, match="cache_size must be positive"):
        RPCReadingService(num_workers=1, workers=LocalWorkers(cache_size=0))
