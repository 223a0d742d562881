"""Quick start: run a DataPipe graph on two local worker servers with RPCReadingService.

    python examples/quickstart.py [--num-workers 2] [--items 2000] [--epochs 2]

The graph below is shuffled, sharded across the workers and decoded on the workers; the
trainer process (this script) only receives the decoded items over TCP. The script checks
that every item of every epoch arrived exactly once.
"""

import argparse
import sys
import time
import warnings

# torchdata 0.9 warns on import that DataPipes/DataLoader2 are deprecated upstream; this
# project targets exactly those APIs, so keep the quick start's output readable.
warnings.filterwarnings("ignore", message=r"(?s).*'datapipes', 'dataloader2' modules are deprecated")
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

from rpc_reading_service import RPCReadingService  # noqa: E402


def decode(index):
    """Stand-in for real decoding/augmentation: a little CPU work per item, runs on a worker."""
    x = torch.linspace(0.0, 1.0, steps=256) * (index + 1)
    features = torch.sin(x).reshape(16, 16)
    features = features @ features.T  # a small matmul, so each item costs some CPU
    return index, features


def build_datapipe(num_items):
    # shuffle() before sharding_filter(): the shuffle is seeded identically on all workers,
    # then each worker keeps its own shard, so each item is produced exactly once per epoch.
    return IterableWrapper(range(num_items)).shuffle().sharding_filter().map(decode)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2, help="local worker servers (default: 2)")
    parser.add_argument("--items", type=int, default=2000, help="items per epoch (default: 2000)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs to run (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="DataLoader2 seed (default: 0)")
    args = parser.parse_args(argv)

    dp = build_datapipe(args.items)
    dl = DataLoader2(dp, reading_service=RPCReadingService(num_workers=args.num_workers))
    ok = True
    try:
        dl.seed(args.seed)
        print(f"{args.num_workers} local workers, {args.items} items per epoch, seed {args.seed}")
        orders = []
        for epoch in range(args.epochs):
            seen = []
            start = time.perf_counter()
            for index, features in dl:
                assert features.shape == (16, 16)
                seen.append(index)
                if len(seen) % 50 == 0:
                    print(f"\repoch {epoch}: {len(seen)}/{args.items}", end="", flush=True)
            elapsed = time.perf_counter() - start
            rate = len(seen) / elapsed if elapsed > 0 else float("inf")
            print(f"\repoch {epoch}: {len(seen)} items in {elapsed:.2f} s ({rate:.0f} items/s)", flush=True)

            missing = set(range(args.items)) - set(seen)
            duplicates = len(seen) - len(set(seen))
            if missing or duplicates or len(seen) != args.items:
                ok = False
                print(
                    f"  ERROR: epoch {epoch}: {len(missing)} items missing, {duplicates} duplicated",
                    file=sys.stderr,
                )
            orders.append(seen)
    finally:
        dl.shutdown()

    if not ok:
        return 1
    print(f"OK: every item arrived exactly once in each of {args.epochs} epochs")
    if len(orders) > 1:
        print("epoch orders differ (fresh shuffle each epoch):", orders[0] != orders[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
