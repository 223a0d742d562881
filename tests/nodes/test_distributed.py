"""``RemoteIterable`` under torch.distributed: each trainer rank gets its own global shards, from
a DataPipe graph and from a factory source, and the ranks share each epoch's seed."""

from __future__ import annotations

import json
import os

import pytest
import torch.multiprocessing as mp
from _server_helpers import VENV_BIN, free_port
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

from rpc_reading_service import RemoteIterable

N = 24


def global_shard(info):
    """A factory source: global worker ``worker_id`` of ``num_workers`` (both ranks' workers)."""
    return [(info.worker_id, info.num_workers, x) for x in range(info.worker_id, N, info.num_workers)]


def trainer(rank, world_size, port, address, key, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = {}
        sources = {"graph": IterableWrapper(range(N)).shuffle().sharding_filter(), "factory": global_shard}
        for name, source in sources.items():
            # No seed: the shuffle's seed must still agree across ranks (shared over gloo).
            with RemoteIterable(source, num_workers=2, workers=[address], auth_key=key) as dataset:
                loader = DataLoader(dataset, batch_size=None)
                results[name] = [[item if isinstance(item, int) else list(item) for item in loader] for _ in range(2)]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(results, handle)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ranks_get_disjoint_global_shards(fresh_server, tmp_path):
    server = fresh_server(command=[str(VENV_BIN / "rpc-reading-worker")])
    mp.spawn(trainer, args=(2, free_port(), server.address, server.key, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):
        r0, r1 = ranks[0]["graph"][epoch], ranks[1]["graph"][epoch]
        assert len(r0) == len(r1) == N // 2 and sorted(r0 + r1) == list(range(N))
    assert ranks[0]["graph"][0] != ranks[0]["graph"][1]  # epochs differ
    for rank in range(2):
        workers = {(worker, count) for worker, count, _ in ranks[rank]["factory"][0]}
        assert workers == {(2 * rank, 4), (2 * rank + 1, 4)}  # global worker ids: rank * 2 + i of 4
    items = sorted(x for rank in range(2) for _, _, x in ranks[rank]["factory"][0])
    assert items == list(range(N))
