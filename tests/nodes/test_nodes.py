"""``RemoteNode`` and ``RemoteMapper`` in torchdata.nodes pipelines, with real local workers."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from typing import Any, List

import pytest
from torch.utils.data.datapipes.iter import IterableWrapper as DataPipeWrapper

from rpc_reading_service import ConfigurationError

nodes = pytest.importorskip("torchdata.nodes", reason="torchdata.nodes needs torchdata >= 0.10")
from rpc_reading_service import RemoteMapper, RemoteNode  # noqa: E402 - after torchdata.nodes is known to exist
N = 40


def square(x: int) -> int:
    return x * x


def jitter(x: int) -> tuple:
    """Randomness after the sharding point (per-worker, per-epoch seeds)."""
    return x, random.randint(0, 10**9)


def boom_on_7(x: int) -> int:
    if x == 7:
        raise KeyError(f"no item {x}")
    return x


def graph():
    return DataPipeWrapper(range(N)).shuffle().sharding_filter().map(jitter)


def pipeline(node: Any) -> Any:
    return nodes.Loader(nodes.Prefetcher(nodes.Batcher(node, 3, drop_last=False), 2))


def run(node: Any, epochs: int = 2) -> List[list]:
    try:
        loader = pipeline(node)
        return [list(loader) for _ in range(epochs)]
    finally:
        node.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("distribution", [None, "dynamic"])
def test_remote_mapper_keeps_the_sources_order_exactly_once(distribution):
    epochs = run(RemoteMapper(nodes.IterableWrapper(range(N)), square, num_workers=3, distribution=distribution))
    expected = [[square(x) for x in range(start, min(start + 3, N))] for start in range(0, N, 3)]
    assert epochs == [expected, expected]


def big(x: int):
    """A 1 MiB tensor: over the shared-memory threshold of local workers."""
    import torch

    return torch.full((1 << 20,), x, dtype=torch.uint8)


@pytest.mark.timeout(90)
def test_pin_memory_is_accepted_and_without_cuda_changes_no_item():
    from rpc_reading_service import RemoteIterable

    source = DataPipeWrapper(range(8)).sharding_filter().map(big)
    for pin in (False, True):
        mapped = run(RemoteMapper(nodes.IterableWrapper(range(8)), big, num_workers=2, pin_memory=pin), epochs=1)
        assert [int(t[0]) for batch in mapped[0] for t in batch] == list(range(8))
        streamed = run(RemoteNode(source, num_workers=2, seed=1, pin_memory=pin), epochs=1)
        assert sorted(int(t[-1]) for batch in streamed[0] for t in batch) == list(range(8))
        dataset = RemoteIterable(source, num_workers=2, seed=1, pin_memory=pin)
        try:
            assert sorted(int(t[-1]) for t in torch_loader(dataset)) == list(range(8))
        finally:
            dataset.close()


def torch_loader(dataset):
    from torch.utils.data import DataLoader

    return list(DataLoader(dataset, batch_size=None))


@pytest.mark.timeout(60)
def test_remote_node_seeded_runs_repeat_and_epochs_differ():
    first = run(RemoteNode(graph(), num_workers=2, seed=9))
    assert first == run(RemoteNode(graph(), num_workers=2, seed=9))
    assert first[0] != first[1]
    for epoch in first:
        assert sorted(x for batch in epoch for x, _ in batch) == list(range(N))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("make", ["node", "mapper"])
def test_state_dict_resumes_mid_epoch_exactly_through_batcher_and_prefetcher(make):
    def node() -> Any:
        if make == "node":
            return RemoteNode(graph(), num_workers=3, seed=2)
        return RemoteMapper(nodes.IterableWrapper(range(N)), jitter, num_workers=3, seed=2)

    uninterrupted = run(node())
    interrupted = node()
    try:
        loader = pipeline(interrupted)
        iterator = iter(loader)
        head = [next(iterator) for _ in range(4)]
        state = loader.state_dict()
        assert head + list(iterator) == uninterrupted[0]  # (and the prefetcher's thread ends)
    finally:
        interrupted.close()
    resumed = node()
    try:
        loader = pipeline(resumed)
        loader.load_state_dict(state)
        rest = list(loader)
        after = list(loader)
    finally:
        resumed.close()
    assert head + rest == uninterrupted[0]
    assert after == uninterrupted[1]


@pytest.mark.timeout(60)
def test_mapper_exception_arrives_with_its_type_and_traceback():
    node = RemoteMapper(nodes.IterableWrapper(range(20)), boom_on_7, num_workers=2)
    try:
        with pytest.raises(KeyError, match="no item 7") as caught:
            list(nodes.Loader(node))
    finally:
        node.close()
    assert "Original Traceback" in str(caught.value) and "boom_on_7" in str(caught.value)


def test_remote_mapper_refuses_what_it_cannot_map():
    with pytest.raises(ConfigurationError, match="BaseNode"):
        RemoteMapper(range(3), square)
    with pytest.raises(ConfigurationError, match="callable"):
        RemoteMapper(nodes.IterableWrapper(range(3)), 5)


@pytest.mark.timeout(90)
def test_dataloader2_front_end_says_what_to_install_and_the_rest_runs_without_torchdata(tmp_path):
    # No torchdata at all, in the trainer and (through PYTHONPATH) in its local worker servers.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torchdata'] = None\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    hidden = subprocess.run([sys.executable, "-c", "import torchdata"], capture_output=True, text=True, env=env)
    assert "ModuleNotFoundError" in hidden.stderr or "ImportError" in hidden.stderr
    script = """
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper
from rpc_reading_service import RemoteIterable
try:
    from rpc_reading_service import RPCReadingService
except ImportError as exc:
    print("ImportError:", exc)
if __name__ == "__main__":
    graph = IterableWrapper(range(12)).shuffle().sharding_filter().map(abs)
    mapped = IterableWrapper(range(6)).remote_map(abs, num_workers=2)
    print(list(mapped))
    mapped.close()
    with RemoteIterable(graph, num_workers=2, seed=1) as ds:
        print(sorted(DataLoader(ds, batch_size=None)))
"""
    (tmp_path / "no_torchdata.py").write_text(script)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "no_torchdata.py")], capture_output=True, text=True, timeout=80, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'rpc-reading-service[dataloader2]'" in done.stdout
    assert str(list(range(6))) in done.stdout  # dp.remote_map, registered without torchdata
    assert done.stdout.strip().endswith(str(list(range(12))))


def slow_square(x: int) -> int:
    """A square, after 10 ms (an epoch lasts while a server joins)."""
    import time

    time.sleep(0.01)
    return x * x


@pytest.mark.timeout(60)
def test_a_server_added_to_a_remote_node_joins_its_run():
    from rpc_reading_service.trainer.local_fleet import LocalWorkerServer

    key = b"k" * 32
    joiner = LocalWorkerServer(key)  # a second server of this host, forked as the node's own
    address = joiner.start()
    source = DataPipeWrapper(range(N)).shuffle().sharding_filter().map(slow_square)
    node = RemoteNode(source, num_workers=1, auth_key=key, distribution="dynamic", seed=3)
    loader = pipeline(node)
    try:
        batches = iter(loader)
        epoch = list(next(batches))
        assert node.add_workers([address, address]) == [address]
        epoch += [item for batch in batches for item in batch]
        during = node.stats()
        second = [item for batch in loader for item in batch]
        after = node.stats()
    finally:
        node.close()
        joiner.stop()
    assert sorted(epoch) == sorted(second) == [square(x) for x in range(N)]
    assert during.joins + after.joins == 1 and node.num_workers == 2
    assert [worker.address for worker in after.workers][1:] == [address]
