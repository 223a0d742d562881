"""torch's DataLoader and torchdata's StatefulDataLoader over local worker servers, with RemoteIterable.

    python examples/torch_dataloader.py [--num-workers 2] [--items 400]

The items are decoded on the workers; the trainer (this script) batches them with torch's
DataLoader, takes a checkpoint mid-epoch with StatefulDataLoader and resumes from it in a new
loader, and checks that the resumed epoch is the uninterrupted one. Needs no DataLoader2: works
with torchdata 0.11 (or without torchdata, for torch's DataLoader alone).
"""

import argparse
import functools
import sys

import torch
from torch.utils.data import DataLoader

from rpc_reading_service import RemoteIterable


def decode(index):
    """Stand-in for real decoding: a little CPU work per item, on a worker."""
    return index, torch.sin(torch.linspace(0.0, 1.0, steps=64) * (index + 1))


def shard(worker_info, items):
    """A factory source: worker ``worker_id`` of ``num_workers`` decodes every num_workers-th item."""
    return (decode(i) for i in range(worker_info.worker_id, items, worker_info.num_workers))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2, help="local worker servers (default: 2)")
    parser.add_argument("--items", type=int, default=400, help="items per epoch (default: 400)")
    args = parser.parse_args(argv)

    # torch's DataLoader: the pipeline runs on the workers, the DataLoader batches here (num_workers=0).
    with RemoteIterable(functools.partial(shard, items=args.items), num_workers=args.num_workers, seed=0) as dataset:
        loader = DataLoader(dataset, batch_size=32)
        indexes = [int(i) for batch, _ in loader for i in batch]
        assert sorted(indexes) == list(range(args.items)), "every item exactly once"
        print(f"DataLoader: {len(indexes)} items in batches of 32 from {args.num_workers} workers")

    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        print("StatefulDataLoader needs torchdata (pip install 'torchdata>=0.8'): skipped")
        return 0

    def stateful():
        return StatefulDataLoader(RemoteIterable(functools.partial(shard, items=args.items), num_workers=args.num_workers, seed=0), batch_size=32)

    reference = stateful()
    uninterrupted = [batch.tolist() for batch, _ in reference]
    reference.dataset.close()
    first = stateful()
    iterator = iter(first)
    head = [next(iterator)[0].tolist() for _ in range(3)]
    state = first.state_dict()  # seeds and positions only: small, JSON-able
    first.dataset.close()
    resumed = stateful()
    resumed.load_state_dict(state)
    rest = [batch.tolist() for batch, _ in resumed]
    resumed.dataset.close()
    assert head + rest == uninterrupted, "the resumed epoch is the uninterrupted one"
    print(f"StatefulDataLoader: resumed after {len(head)} batches, the other {len(rest)} exactly as uninterrupted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
