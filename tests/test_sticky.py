"""The sticky distribution: consistent hashing of keys to worker servers, and the worker-side
selection by key (unit tests; the end-to-end test with real servers is at the end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service.errors import ConfigurationError, StickyKeyError
from rpc_reading_service.graph import init_worker_graph, reset_worker_graph
from rpc_reading_service.serialization import dumps_graph, loads_graph
from rpc_reading_service.sticky import StickyAssignment, encode_key, make_sticky

KEYS = [f"/data/shard-{i:05d}.jpg" for i in range(6000)]
SERVERS = [f"10.0.0.{i}:29600" for i in range(1, 5)]


def _owners(servers, keys=KEYS):
    assignment = StickyAssignment(servers)
    return [assignment.server_of(key) for key in keys]


def test_keys_are_encoded_canonically():
    # Equal keys built differently (tuples whose pickles differ through pickle's memo, lists,
    # numpy-style integers) are one key; types that are not equal in Python stay apart.
    shared = "abc" * 3
    assert encode_key((shared, shared)) == encode_key(("abc" * 3, "".join(["abc"] * 3)))
    assert encode_key([1, "a"]) == encode_key((1, "a"))
    assert encode_key(torch.tensor(7)) == encode_key(7) == encode_key(torch.tensor([7]))
    assert len({encode_key(k) for k in (1, 1.0, "1", b"1", (1,), None, -1, 2**70)}) == 8
    assert encode_key(("a", "bc")) != encode_key(("ab", "c"))
    for bad in ({"a": 1}, {1, 2}, torch.zeros(3), object()):
        with pytest.raises(StickyKeyError, match="key_fn"):
            encode_key(bad)


def test_placement_is_the_same_in_another_process():
    # Python's hash() is salted per process: the placement must not depend on it.
    code = (
        "import json, sys; from rpc_reading_service.sticky import StickyAssignment; "
        "a = StickyAssignment(json.loads(sys.argv[1])); "
        "print(json.dumps([a.rank_of(k) for k in json.loads(sys.argv[2])]))"
    )
    table, keys = SERVERS + SERVERS[:2], KEYS[:300]
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(table), json.dumps(keys)],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assignment = StickyAssignment(table)
    assert json.loads(out.stdout) == [assignment.rank_of(k) for k in keys]


def test_adding_a_server_moves_only_its_share_to_it():
    before, after = _owners(SERVERS), _owners(SERVERS + ["10.0.0.9:29600"])
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert all(a == "10.0.0.9:29600" for _, a in moved)  # only to the new server
    share = len(moved) / len(KEYS)
    assert abs(share - 1 / 5) < 0.03, share  # about 1/(N+1)
    # The servers are about evenly loaded.
    counts = [after.count(s) for s in set(after)]
    assert max(counts) / min(counts) < 1.2, counts


def test_removing_a_server_moves_only_its_keys():
    before, after = _owners(SERVERS), _owners(SERVERS[:2] + SERVERS[3:])
    moved = [b for b, a in zip(before, after) if b != a]
    assert moved and set(moved) == {SERVERS[2]}
    assert len(moved) == before.count(SERVERS[2])


def test_sessions_of_one_server_split_its_keys():
    table = ["a:1", "b:1", "a:1", "a:1"]  # ranks 0, 2, 3 on server a
    assignment = StickyAssignment(table)
    ranks = [assignment.rank_of(k) for k in KEYS]
    on_a = [r for k, r in zip(KEYS, ranks) if assignment.server_of(k) == "a:1"]
    assert set(on_a) == {0, 2, 3} and set(ranks) == {0, 1, 2, 3}
    assert min(on_a.count(r) for r in (0, 2, 3)) > len(on_a) / 3 * 0.85


def _worker_epoch(shipped: bytes, rank: int, num_workers: int, seed: int):
    graph, _, _ = loads_graph(shipped)
    graph = init_worker_graph(graph, WorkerInfo(num_workers, rank), None)
    return list(reset_worker_graph(graph, WorkerInfo(num_workers, rank), seed, rank, None))


def test_selection_is_exactly_once_and_the_same_every_epoch():
    table = ["a:1", "b:1", "a:1"]
    graph = IterableWrapper(range(200)).shuffle().sharding_filter().map(lambda x: -x)
    shipped = dumps_graph((make_sticky(graph, StickyAssignment(table)), None, None))
    epochs = [[_worker_epoch(shipped, rank, 3, seed) for rank in range(3)] for seed in (1, 2)]
    for shards in epochs:
        assert sorted(x for shard in shards for x in shard) == sorted(-x for x in range(200))
    assignment = StickyAssignment(table)
    for rank in range(3):
        first, second = epochs[0][rank], epochs[1][rank]
        assert set(first) == set(second) and first != second  # same items, new order
        assert all(assignment.rank_of(-x) == rank for x in first)
    assert _worker_epoch(shipped, 1, 3, 1) == epochs[0][1]  # deterministic for a seed


def test_key_fn_and_refusals():
    table = ["a:1", "b:1"]
    items = [{"path": f"p{i}", "label": i % 3} for i in range(50)]
    graph = make_sticky(IterableWrapper(items).sharding_filter(), StickyAssignment(table), key_fn=lambda d: d["path"])
    shipped = dumps_graph((graph, None, None))
    shards = [_worker_epoch(shipped, rank, 2, 0) for rank in range(2)]
    assert sorted(d["path"] for s in shards for d in s) == sorted(d["path"] for d in items)
    with pytest.raises(StickyKeyError):  # a dict item without key_fn
        _worker_epoch(dumps_graph((make_sticky(IterableWrapper(items).sharding_filter(), StickyAssignment(table)), None, None)), 0, 2, 0)
    with pytest.raises(ConfigurationError, match="sharding_filter"):
        make_sticky(IterableWrapper(items).map(str), StickyAssignment(table))
    with pytest.raises(ConfigurationError, match="2 worker ranks"):
        _worker_epoch(shipped, 0, 3, 0)
