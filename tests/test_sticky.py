"""The sticky distribution: consistent hashing of keys to worker servers, and the worker-side
selection by key (unit tests; the end-to-end test with real servers is at the end)."""

from __future__ import annotations

import os

import pytest
import torch
from _server_helpers import run_epochs
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service.policies.sticky.trainer import Sticky
from rpc_reading_service.errors import ConfigurationError, StickyKeyError
from rpc_reading_service.graph import init_worker_graph, reset_worker_graph
from rpc_reading_service.selection import selection_in_place
from rpc_reading_service.serialization import dumps_graph, loads_graph
from rpc_reading_service.policies.sticky import StickyAssignment, trainer_rank_of
from rpc_reading_service.stable_keys import encode_key

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


def test_placement_is_pinned():
    # The placement is a contract between processes, runs and versions (a server's cache is
    # only warm if the next run sends it the same keys): it depends on the key's canonical
    # bytes and blake2b alone, never on Python's per-process hash(). A change here moves
    # every user's keys: make it on purpose only.
    table = ["10.0.0.1:29600", "10.0.0.2:29600", "10.0.0.1:29600", "10.0.0.3:29600"]
    keys = ["/data/000001.jpg", b"raw", 12345, -7, 2.5, None, ("shard-3", 17), "naïve"]
    keys += [f"k{i}" for i in range(16)]
    expected = [1, 2, 1, 1, 2, 3, 1, 2, 3, 3, 3, 0, 2, 1, 2, 1, 3, 0, 2, 2, 3, 2, 1, 3]
    assert [StickyAssignment(table).rank_of(key) for key in keys] == expected
    assert encode_key(("shard-3", 17)).hex() == (
        "74000000000000001a73000000000000000773686172642d3369000000000000000111"
    )


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


class _Servers:
    """A fleet's view for the policy: the server address of every rank."""

    def __init__(self, table):
        self.table, self.num_workers = list(table), len(table)

    def rank_addresses(self):
        return self.table


def _shipped(graph, table, key_fn=None) -> bytes:
    """The graph as the trainer ships it with ``Sticky(key_fn)`` over the servers of ``table``."""
    policy = Sticky(key_fn)
    policy.check_graph(graph)
    with selection_in_place(graph, policy.worker_selection(_Servers(table))) as shipped:
        return dumps_graph((shipped, None, None))


def _worker_epoch(shipped: bytes, rank: int, num_workers: int, seed: int):
    graph, _, _ = loads_graph(shipped)
    graph = init_worker_graph(graph, WorkerInfo(num_workers, rank), None)
    return list(reset_worker_graph(graph, WorkerInfo(num_workers, rank), seed, rank, None))


def test_selection_is_exactly_once_and_the_same_every_epoch():
    table = ["a:1", "b:1", "a:1"]
    graph = IterableWrapper(range(200)).shuffle().sharding_filter().map(lambda x: -x)
    shipped = _shipped(graph, table)
    epochs = [[_worker_epoch(shipped, rank, 3, seed) for rank in range(3)] for seed in (1, 2)]
    for shards in epochs:
        assert sorted(x for shard in shards for x in shard) == sorted(-x for x in range(200))
    assignment = StickyAssignment(table)
    for rank in range(3):
        first, second = epochs[0][rank], epochs[1][rank]
        assert set(first) == set(second) and first != second  # same items, new order
        assert all(assignment.rank_of(-x) == rank for x in first)
    assert _worker_epoch(shipped, 1, 3, 1) == epochs[0][1]  # deterministic for a seed


def test_under_torch_distributed_keys_are_split_among_trainer_ranks_too():
    # Each trainer rank shards its graph (DistributedInfo level) before the policy's selection
    # replaces sharding_filter; each rank has its own fleet of two sessions. Every item is kept
    # once in the job, split by key (not by position) among the trainer ranks too.
    from rpc_reading_service.graph import DistributedInfo, apply_distributed_sharding

    kept = []
    for trainer in range(2):
        graph = IterableWrapper(range(300)).shuffle().sharding_filter()
        apply_distributed_sharding(graph, DistributedInfo(trainer, 2))
        shipped = _shipped(graph, ["a:1", "b:1"])
        shards = [_worker_epoch(shipped, rank, 2, seed=5) for rank in range(2)]
        assert all(shards) and set(shards[0]) == set(_worker_epoch(shipped, 0, 2, seed=6))
        assert all(trainer_rank_of(encode_key(x), 2) == trainer for shard in shards for x in shard)
        kept += [x for shard in shards for x in shard]
    assert sorted(kept) == list(range(300))


def test_key_fn_and_refusals():
    table = ["a:1", "b:1"]
    items = [{"path": f"p{i}", "label": i % 3} for i in range(50)]
    shipped = _shipped(IterableWrapper(items).sharding_filter(), table, key_fn=lambda d: d["path"])
    shards = [_worker_epoch(shipped, rank, 2, 0) for rank in range(2)]
    assert sorted(d["path"] for s in shards for d in s) == sorted(d["path"] for d in items)
    with pytest.raises(StickyKeyError):  # a dict item without key_fn
        _worker_epoch(_shipped(IterableWrapper(items).sharding_filter(), table), 0, 2, 0)
    with pytest.raises(ConfigurationError, match="needs a sharding_filter"):
        _shipped(IterableWrapper(items).map(str), table)
    with pytest.raises(ConfigurationError, match="sharding_group_filter"):
        _shipped(IterableWrapper(items).sharding_filter(SHARDING_PRIORITIES.MULTIPROCESSING), table)
    with pytest.raises(ConfigurationError, match="2 worker ranks"):
        _worker_epoch(shipped, 0, 3, 0)
    with pytest.raises(ConfigurationError, match="deals them to the workers by position"):
        dispatched = IterableWrapper(items).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
        _shipped(dispatched.sharding_filter(), table)
    with pytest.raises(ConfigurationError, match="key_fn"):
        Sticky(key_fn="path")


def test_the_placement_digest_is_the_table_of_servers():
    # What a checkpoint compares: the servers in rank order; a sole server's address decides
    # nothing (a local server's differs every run), only how many ranks it has.
    alone, moved = StickyAssignment(["unix:/tmp/a.sock"] * 3), StickyAssignment(["unix:/tmp/b.sock"] * 3)
    assert [alone.rank_of(k) for k in KEYS[:300]] == [moved.rank_of(k) for k in KEYS[:300]]
    assert alone.digest() == moved.digest() != StickyAssignment(["unix:/tmp/a.sock"] * 2).digest()
    two = StickyAssignment(["a:1", "b:1"])
    assert two.digest() == StickyAssignment(("a:1", "b:1")).digest()
    others = [StickyAssignment(["b:1", "a:1"]), StickyAssignment(["a:1", "c:1"])]
    assert len({two.digest(), *(other.digest() for other in others)}) == 3


# -- end to end: real rpc-reading-worker servers ------------------------------------------------
def tag_with_server(item: str):
    """``(item, pid of the server whose session produced it)``: sessions are forked by their server."""
    return item, os.getppid()


def _sticky_epochs(servers, n_epochs: int, seed: int):
    """Per epoch, ``{server address: [items in the order that server produced them]}``."""
    from rpc_reading_service import RPCReadingService

    # str keys: their hash() is salted per process, so the servers (other processes) agreeing
    # with this one's StickyAssignment shows the placement does not depend on it.
    graph = IterableWrapper(ITEMS).shuffle().sharding_filter().map(tag_with_server)
    service = RPCReadingService(
        num_workers=len(servers), workers=[s.address for s in servers], auth_key=servers[0].key,
        distribution="sticky",
    )  # fmt: skip
    address_of = {s.pid: s.address for s in servers}
    produced = []
    for epoch in run_epochs(graph, service, n_epochs, seed=seed):
        assert sorted(item for item, _ in epoch) == sorted(ITEMS)  # exactly once
        by_server = {s.address: [] for s in servers}
        for item, pid in epoch:
            by_server[address_of[pid]].append(item)
        produced.append(by_server)
    return produced


N_ITEMS = 150
ITEMS = [f"img-{i}.jpg" for i in range(N_ITEMS)]


@pytest.mark.timeout(60)
def test_servers_keep_their_items_every_epoch_and_a_new_server_takes_only_its_share(fresh_server):
    from concurrent.futures import ThreadPoolExecutor

    key = "sticky-" + "0" * 16
    with ThreadPoolExecutor(3) as pool:  # start the three servers at once
        servers = list(pool.map(lambda _: fresh_server(key=key), range(3)))
    two, three = servers[:2], servers

    first, second = _sticky_epochs(two, 2, seed=7)
    for server in two:
        mine = first[server.address]
        assert mine and set(mine) == set(second[server.address]) and mine != second[server.address]
        assert all(StickyAssignment([s.address for s in two]).server_of(i) == server.address for i in mine)

    (grown,) = _sticky_epochs(three, 1, seed=7)
    owner_before = {item: address for address, items in first.items() for item in items}
    owner_after = {item: address for address, items in grown.items() for item in items}
    moved = [item for item in owner_before if owner_before[item] != owner_after[item]]
    assert {owner_after[item] for item in moved} == {servers[2].address}  # only to the new server
    assert len(moved) == len(grown[servers[2].address])  # and it took nothing else
    assert N_ITEMS / 3 * 0.6 < len(moved) < N_ITEMS / 3 * 1.4, len(moved)  # about its share, 1/3
