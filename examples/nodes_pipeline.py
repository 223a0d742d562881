"""A torchdata.nodes pipeline whose map runs on local worker servers, with RemoteMapper and RemoteNode.

    python examples/nodes_pipeline.py [--num-workers 2] [--items 300]

RemoteMapper deals the items of a trainer-side node to the workers, which apply ``decode``;
they come back in the source's order into Batcher, Prefetcher and Loader. RemoteNode runs a
whole DataPipe graph on the workers. A checkpoint taken mid-epoch resumes exactly. Needs
torchdata >= 0.10 (torchdata.nodes).
"""

import argparse
import sys

import torch
from torch.utils.data.datapipes.iter import IterableWrapper as DataPipeWrapper
from torchdata.nodes import Batcher, IterableWrapper, Loader, Prefetcher

from rpc_reading_service import RemoteMapper, RemoteNode


def decode(index):
    """Stand-in for real decoding: a little CPU work per item, on a worker."""
    return index, float(torch.sin(torch.linspace(0.0, 1.0, steps=64) * (index + 1)).sum())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2, help="local worker servers (default: 2)")
    parser.add_argument("--items", type=int, default=300, help="items per epoch (default: 300)")
    args = parser.parse_args(argv)

    with RemoteMapper(IterableWrapper(range(args.items)), decode, num_workers=args.num_workers) as node:
        loader = Loader(Prefetcher(Batcher(node, 16, drop_last=False), 2))
        for epoch in range(2):
            indexes = [index for batch in loader for index, _ in batch]
            assert indexes == list(range(args.items)), "the source's order, every item once"
            print(f"RemoteMapper epoch {epoch}: {len(indexes)} items in order from {args.num_workers} workers")

    def remote_node():
        graph = DataPipeWrapper(range(args.items)).shuffle().sharding_filter().map(decode)
        return RemoteNode(graph, num_workers=args.num_workers, seed=1)

    with remote_node() as node:
        uninterrupted = list(Loader(Batcher(node, 16, drop_last=False)))
    with remote_node() as node:
        loader = Loader(Batcher(node, 16, drop_last=False))
        iterator = iter(loader)
        head = [next(iterator) for _ in range(5)]
        state = loader.state_dict()
    with remote_node() as node:
        loader = Loader(Batcher(node, 16, drop_last=False))
        loader.load_state_dict(state)
        rest = list(loader)
    assert head + rest == uninterrupted, "the resumed epoch is the uninterrupted one"
    print(f"RemoteNode: resumed after {len(head)} batches, the other {len(rest)} exactly as uninterrupted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
