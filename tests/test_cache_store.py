"""The worker cache's parts without servers: the entry format, the disk store (LRU bound,
corrupt entries, a full disk, compute-once across processes), the memory tier, keys, config."""

from __future__ import annotations

import functools
import hashlib
import logging
import multiprocessing
import os
import pickle
import stat
import time

import pytest
import torch

from rpc_reading_service.cache import CacheConfig, DiskStore, WorkerCache, parse_size
from rpc_reading_service.cache.entry import HEADER_BYTES, decode_entry, encode_entry
from rpc_reading_service.cache.keys import cache_key, function_namespace
from rpc_reading_service.cache.memory import MemoryTier
from rpc_reading_service.errors import CacheKeyError, ConfigurationError

KEYS = [cache_key("test|", name) for name in "abcdefgh"]


def test_an_entry_round_trips_and_any_damage_is_detected():
    payload = os.urandom(1000)
    entry = encode_entry(KEYS[0], payload)
    assert decode_entry(entry, KEYS[0]) == payload
    assert decode_entry(entry, KEYS[1]) is None  # another key's entry
    flipped = bytearray(entry)
    flipped[HEADER_BYTES + 500] ^= 0x01
    for damaged in (
        bytes(flipped),
        entry[:-1],
        entry + b"x",
        entry[: HEADER_BYTES - 1],
        b"",
        b"XX" + entry[2:],
    ):
        assert decode_entry(damaged, KEYS[0]) is None


def test_store_hit_miss_and_restart(tmp_path):
    store = DiskStore(str(tmp_path), 1 << 20)
    assert store.get(KEYS[0]) is None
    assert store.put(KEYS[0], b"value")
    assert store.get(KEYS[0]) == b"value"
    assert DiskStore(str(tmp_path), 1 << 20).get(KEYS[0]) == b"value"  # another process, a later run


def test_lru_eviction_keeps_the_store_under_its_bound(tmp_path):
    payload = b"x" * 1000
    entry_bytes = len(encode_entry(KEYS[0], payload))
    store = DiskStore(str(tmp_path), int(entry_bytes * 3.5))  # room for three entries
    for key in KEYS[:3]:
        assert store.put(key, payload)
    assert store.get(KEYS[0]) == payload  # KEYS[0] is now more recent than KEYS[1] and KEYS[2]
    assert store.put(KEYS[3], payload)  # over the bound: the least recently used (KEYS[1]) goes
    present = [key for key in KEYS[:4] if store.get(key) is not None]
    assert present == [KEYS[0], KEYS[2], KEYS[3]]
    assert store.total_bytes() == 3 * entry_bytes <= store.max_bytes
    for key in KEYS[4:]:
        store.put(key, payload)
    assert store.total_bytes() <= store.max_bytes
    assert store.get(KEYS[-1]) == payload  # the newest survives


def test_an_entry_larger_than_the_bound_is_not_stored(tmp_path):
    store = DiskStore(str(tmp_path), 100)
    assert not store.put(KEYS[0], b"x" * 200)
    assert store.get(KEYS[0]) is None


def test_a_corrupt_entry_is_a_miss_and_is_deleted(tmp_path, caplog):
    store = DiskStore(str(tmp_path), 1 << 20)
    store.put(KEYS[0], b"good value")
    path = store.entry_path(KEYS[0])
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING, "rpc_reading_service.cache"):
        assert store.get(KEYS[0]) is None
    assert not os.path.exists(path)
    assert "corrupt" in caplog.text and path in caplog.text


def test_an_entry_found_under_another_keys_name_is_a_miss_not_that_keys_value(tmp_path, caplog):
    store = DiskStore(str(tmp_path), 1 << 20)
    store.put(KEYS[0], b"value of key 0")
    store.put(KEYS[1], b"value of key 1")
    os.replace(store.entry_path(KEYS[0]), store.entry_path(KEYS[1]))  # misplaced: copied, renamed, restored
    with caplog.at_level(logging.WARNING, "rpc_reading_service.cache"):
        assert store.get(KEYS[1]) is None
    assert not os.path.exists(store.entry_path(KEYS[1])) and "another key's" in caplog.text
    assert store.total_bytes() == 0


def test_an_entry_larger_than_the_whole_cache_is_a_miss_and_deleted_without_reading_it(tmp_path, caplog):
    store = DiskStore(str(tmp_path), 1 << 20)
    store.put(KEYS[0], b"value")
    path = store.entry_path(KEYS[0])
    os.truncate(path, 1 << 40)  # 1 TiB (sparse): reading it raised MemoryError on every run
    with caplog.at_level(logging.WARNING, "rpc_reading_service.cache"):
        assert store.get(KEYS[0]) is None
    assert not os.path.exists(path) and "more than the whole cache may hold" in caplog.text
    assert store.put(KEYS[0], b"value") and store.get(KEYS[0]) == b"value"


def test_the_store_makes_its_files_0600_and_its_directories_0700_whatever_the_umask(tmp_path):
    store = DiskStore(str(tmp_path / "cache"), 1 << 20)
    old = os.umask(0)
    try:
        store.put(KEYS[0], b"value")
        with store.computing(KEYS[0]) as locked:
            assert locked
    finally:
        os.umask(old)
    cache = tmp_path / "cache"
    modes = {str(path.relative_to(cache)): (path.is_dir(), stat.S_IMODE(path.stat().st_mode)) for path in cache.rglob("*")}
    assert {"entries", "locks", "usage"} <= set(modes) and any(name.endswith(".entry") for name in modes), modes
    wrong = {name: oct(mode) for name, (folder, mode) in modes.items() if mode != (0o700 if folder else 0o600)}
    assert not wrong and stat.S_IMODE(cache.stat().st_mode) == 0o700, wrong


def test_an_entry_other_users_may_write_is_deleted_unread(tmp_path, caplog):
    store = DiskStore(str(tmp_path), 1 << 20)
    changes = [lambda path: os.chmod(path, 0o666), lambda path: os.chmod(path, 0o620)]
    if os.geteuid() == 0:
        changes.append(lambda path: os.chown(path, 65534, 65534))  # nobody's file
    for change in changes:
        store.put(KEYS[0], b"value")
        path = store.entry_path(KEYS[0])
        change(path)
        with caplog.at_level(logging.WARNING, "rpc_reading_service.cache"):
            assert store.get(KEYS[0]) is None
        assert not os.path.exists(path)
    assert caplog.text.count("not only by this worker's user, so it is not read") == len(changes)
    assert "every user" in caplog.text and "its group" in caplog.text


def test_an_entry_of_the_earlier_format_is_recomputed_without_a_corruption_warning(tmp_path, caplog):
    store = DiskStore(str(tmp_path), 1 << 20)
    store.put(KEYS[0], b"new")
    path = store.entry_path(KEYS[0])
    payload = pickle.dumps("old value", protocol=5)  # as 0.x wrote it: blake2b-256 header, plain pickle
    digest = hashlib.blake2b(payload, digest_size=32).digest()
    open(path, "wb").write(b"RRSCACH1" + len(payload).to_bytes(8, "big") + digest + payload)
    with caplog.at_level(logging.INFO, "rpc_reading_service.cache"):
        assert store.get(KEYS[0]) is None
    assert not os.path.exists(path) and "corrupt" not in caplog.text and "earlier version" in caplog.text


def test_an_entry_that_pickled_dtypes_as_globals_is_still_read(tmp_path):
    store = DiskStore(str(tmp_path), 1 << 20)
    store.put(KEYS[0], b"value")
    path = store.entry_path(KEYS[0])
    data = bytearray(open(path, "rb").read())
    assert data[:8] == b"RRSCACH4"
    data[:8] = b"RRSCACH3"  # the previous format: the same layout, dtypes pickled as torch globals
    open(path, "wb").write(data)
    assert bytes(store.get(KEYS[0])) == b"value"


def test_a_failing_write_warns_once_and_stops_writing(tmp_path, caplog):
    store = DiskStore(str(tmp_path), 1 << 20)
    (tmp_path / "entries").write_text("not a directory")  # every write fails with an OSError
    with caplog.at_level(logging.WARNING, "rpc_reading_service.cache"):
        assert not store.put(KEYS[0], b"v")
        assert not store.put(KEYS[1], b"v")
    assert not store.writable
    assert len([r for r in caplog.records if "writing an entry failed" in r.getMessage()]) == 1
    assert store.get(KEYS[0]) is None


def test_memory_tier_is_lru_bounded_in_bytes():
    tier = MemoryTier(250)
    for key in KEYS[:2]:
        tier.put(key, b"x" * 100)
    assert tier.get(KEYS[0]) is not None
    tier.put(KEYS[2], b"x" * 100)
    assert [tier.get(k) is not None for k in KEYS[:3]] == [True, False, True]
    tier.put(KEYS[3], b"x" * 300)  # larger than the bound: not kept, nothing evicted for it
    assert tier.get(KEYS[3]) is None and tier.get(KEYS[2]) is not None


def test_hits_are_fresh_copies(tmp_path):
    cache = WorkerCache(CacheConfig.create(str(tmp_path), "1M", "1M"))
    first = cache.get_or_compute(KEYS[0], lambda: [1, 2])
    first.append(3)  # a later step changing its input in place
    assert cache.get_or_compute(KEYS[0], lambda: pytest.fail("computed on a hit")) == [1, 2]


def test_a_tensor_hit_is_rebuilt_on_the_memory_it_was_read_into_and_is_a_fresh_copy(tmp_path, monkeypatch):
    cache = WorkerCache(CacheConfig.create(str(tmp_path), "1M", "1M"))
    image = torch.arange(16384, dtype=torch.float32)  # 64 KiB, the size of an item of bench_cache
    value = cache.get_or_compute(KEYS[0], lambda: {"image": image.clone(), "label": 3})
    value["image"].zero_()  # the computed value itself, changed in place: the tiers hold copies

    def torch_load(*args, **kwargs):
        pytest.fail("a hit went through torch.load (a tensor pickled by torch, not out of band)")

    monkeypatch.setattr(torch, "load", torch_load)
    for tier in ("disk", "memory"):  # the first hit reads the disk and fills the memory tier
        hit = cache.get_or_compute(KEYS[0], lambda: pytest.fail(f"computed on a {tier} hit"))
        assert torch.equal(hit["image"], image) and hit["label"] == 3, tier
        assert hit["image"].data_ptr() % 16 == 0, tier  # aligned: the entry keeps its buffers at multiples of 64
        hit["image"].zero_()  # a later step changing its input in place: the next hit is unchanged


def test_a_sparse_tensor_hit_is_rebuilt_and_leaves_nothing_behind(tmp_path):
    cache = WorkerCache(CacheConfig.create(str(tmp_path), "1M"))
    sparse = torch.randn(40, 50).relu().to_sparse()
    cache.get_or_compute(KEYS[0], lambda: sparse)
    for _ in range(3):
        hit = cache.get_or_compute(KEYS[0], lambda: pytest.fail("computed on a hit"))
        assert hit.layout == torch.sparse_coo and torch.equal(hit.to_dense(), sparse.to_dense())
    assert torch._utils._sparse_tensors_to_validate == []  # torch's list of tensors to check, never emptied before


def _compute_slowly(directory: str, calls: str, barrier) -> None:
    cache = WorkerCache(CacheConfig.create(directory, "1M"))

    def compute():
        with open(calls, "a") as handle:
            handle.write("call\n")
        time.sleep(0.3)
        return {"value": 42}

    barrier.wait()
    assert cache.get_or_compute(KEYS[0], compute) == {"value": 42}


@pytest.mark.timeout(20)
def test_processes_racing_on_one_key_compute_it_once(tmp_path):
    calls = tmp_path / "calls"
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(3)
    processes = [
        context.Process(target=_compute_slowly, args=(str(tmp_path / "cache"), str(calls), barrier))
        for _ in range(3)
    ]
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.join(15)
        assert [p.exitcode for p in processes] == [0, 0, 0]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    assert calls.read_text().count("call") == 1


def test_cache_keys_are_stable_and_tell_functions_apart():
    assert cache_key("ns", ("a.jpg", 3)) == cache_key("ns", ("a.jpg", 3))
    assert cache_key("ns", "a.jpg") != cache_key("other", "a.jpg")
    assert function_namespace(parse_size) != function_namespace(cache_key)
    assert function_namespace(parse_size, "v2") != function_namespace(parse_size)
    first, second = (lambda x: x), (lambda x: x + 1)
    assert function_namespace(first) != function_namespace(second)
    assert function_namespace(functools.partial(parse_size)).startswith(
        "rpc_reading_service.cache.config.parse_size"
    )
    with pytest.raises(CacheKeyError, match="key_fn"):
        cache_key("ns", lambda: None)
    assert pickle.loads(pickle.dumps(CacheKeyError("x"))).args == ("x",)


def test_equal_keys_share_a_cache_entry_however_they_were_built():
    name = "img/" + "a" * 20
    again = "".join(["img/", "a" * 20])  # equal, but another object
    assert pickle.dumps((name, name)) != pickle.dumps((name, again))  # pickle's memo: why keys are not pickled
    assert cache_key("ns", (name, name)) == cache_key("ns", (name, again)) == cache_key("ns", [name, again])
    assert cache_key("ns", frozenset({1})) == cache_key("ns", frozenset({1}))  # other picklable keys still work
    assert cache_key("ns", 1) != cache_key("ns", "1") != cache_key("ns", b"1")


def test_config_is_checked_once(tmp_path):
    assert parse_size("64K") == 65536 and parse_size("2GiB") == 2 << 30 and parse_size(7) == 7
    assert CacheConfig.create(None) is None
    config = CacheConfig.create(str(tmp_path / "new"), "1M", "1K")
    assert (config.max_bytes, config.memory_bytes) == (1 << 20, 1024) and os.path.isdir(tmp_path / "new")
    for bad in [
        dict(directory=str(tmp_path), max_bytes=None),
        dict(directory=str(tmp_path), max_bytes="lots"),
        dict(directory=str(tmp_path), max_bytes=0),
        dict(directory=None, max_bytes="1M"),
        dict(directory=str(tmp_path / "file" / "sub"), max_bytes="1M"),
    ]:
        (tmp_path / "file").write_text("")
        with pytest.raises(ConfigurationError):
            CacheConfig.create(**bad)


def test_a_cache_directory_others_may_write_is_refused(tmp_path):
    private = CacheConfig.create(str(tmp_path / "new" / "cache"), "1M")
    assert stat.S_IMODE(os.stat(private.directory).st_mode) == 0o700  # created private
    shared = tmp_path / "shared"
    shared.mkdir()
    modes = {0o777: "every user", 0o1777: "every user", 0o770: "its group"}  # 1777: sticky, as /tmp
    for mode, who in modes.items():
        shared.chmod(mode)
        with pytest.raises(ConfigurationError, match=rf"--cache-dir {shared} can be written by {who}.*pickles.*chmod 700"):
            CacheConfig.create(str(shared), "1M")
    with pytest.raises(ConfigurationError, match=r"^LocalWorkers.cache_dir .* its group"):
        CacheConfig.create(str(shared), "1M", option="LocalWorkers.cache_dir")
    shared.chmod(0o755)
    assert CacheConfig.create(str(shared), "1M").directory == str(shared)  # readable by others is fine
    if os.geteuid() == 0:
        os.chown(shared, 65534, 65534)  # nobody's directory, even if only nobody may write it
        with pytest.raises(ConfigurationError, match=r"can be written by uid 65534 \(its owner\), not only by this worker's user"):
            CacheConfig.create(str(shared), "1M")


def _defined(body: str, module: str = "user_module"):
    """A function ``load`` of ``module`` returning ``body``: the same name with other code."""
    scope = {"__name__": module}
    exec(f"def load(item):\n    return {body}\n", scope)
    return scope["load"]


def test_a_functions_namespace_changes_with_its_code_and_only_with_it():
    assert function_namespace(_defined("item + 1")) == function_namespace(_defined("item + 1"))
    assert function_namespace(_defined("item + 1")) != function_namespace(_defined("item + 2"))
    assert function_namespace(_defined("item.upper()")) != function_namespace(_defined("item.lower()"))
    assert function_namespace(_defined("[x + 1 for x in item]")) != function_namespace(_defined("[x + 2 for x in item]"))
    assert function_namespace(_defined("item + 1")).startswith("user_module.load@")
    assert function_namespace(_defined("item + 1"), "v2") != function_namespace(_defined("item + 1"))

    class Decode:
        def __call__(self, item):
            return item

    assert function_namespace(Decode()) == function_namespace(Decode()) != function_namespace(type(Decode()).__call__)


def test_a_functions_namespace_does_not_depend_on_the_order_of_a_set_constant():
    # A frozenset constant of strings iterates in another order under another hash seed, i.e.
    # in another process: two equal frozensets in two orders stand for it here.
    load = _defined("item in {1, 9}")
    ordered, reordered = frozenset([1, 9]), frozenset([9, 1])
    assert list(ordered) != list(reordered)
    consts = [tuple(ordered if isinstance(c, frozenset) else c for c in load.__code__.co_consts),
              tuple(reordered if isinstance(c, frozenset) else c for c in load.__code__.co_consts)]  # fmt: skip
    assert ordered in consts[0]
    names = set()
    for const in consts:
        load.__code__ = load.__code__.replace(co_consts=const)
        names.add(function_namespace(load))
    assert len(names) == 1 and names.pop().startswith("user_module.load@")  # keyed on the code


def test_a_payload_that_does_not_unpickle_is_computed_again(tmp_path):
    cache = WorkerCache(CacheConfig.create(str(tmp_path), "1M"))
    cache.disk.put(KEYS[0], b"intact on disk, but not a pickle")
    assert cache.get_or_compute(KEYS[0], lambda: "computed") == "computed"
    assert cache.get_or_compute(KEYS[0], lambda: pytest.fail("computed on a hit")) == "computed"


def test_a_memory_only_cache_needs_no_directory():
    cache = WorkerCache(CacheConfig.create(None, memory_bytes="1K"))
    assert cache.disk is None
    assert cache.get_or_compute(KEYS[0], lambda: 5) == 5
    assert cache.get_or_compute(KEYS[0], lambda: pytest.fail("computed on a hit")) == 5
