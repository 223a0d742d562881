"""Train under torchrun, with the data pipeline running on rpc-reading-worker servers.

Every trainer rank opens its own sessions on the workers; with torch.distributed
initialised, RPCReadingService shards globally (session ``i`` of rank ``r`` reads shard
``r * n + i`` of ``world * n``), so each item of an epoch reaches exactly one rank. Say
where the workers are in one of four ways::

    # an explicit list, or a hostfile (one host:port per line)
    torchrun --nproc-per-node 2 examples/torchrun_train.py --workers cpu1:29600,cpu2:29600 --auth-key-file key
    torchrun --nproc-per-node 2 examples/torchrun_train.py --hostfile workers.txt --auth-key-file key

    # workers registered in a TCPStore (rpc-reading-worker --store HOST:PORT --job NAME)
    torchrun --nproc-per-node 2 examples/torchrun_train.py --store store-host:29700 --job run42 --min-workers 4 ...

    # torchrun's own store: start the workers with --store MASTER_ADDR:MASTER_PORT
    torchrun --nnodes 1 --nproc-per-node 2 --master-addr $(hostname) --master-port 29500 \\
        examples/torchrun_train.py --store env --job run42 --min-workers 4 --auth-key-file key

The "model" is a stand-in (a matmul and a sleep per batch); at the end the ranks check
together that every item of every epoch arrived exactly once across the job.
"""

import argparse
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=r"(?s).*'datapipes', 'dataloader2' modules are deprecated")
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

from rpc_reading_service import Hostfile, RPCReadingService, StoreDiscovery  # noqa: E402


def featurize(index):
    """Per-item CPU work; runs on a worker."""
    x = torch.full((64,), float(index)).sin()
    return index, torch.outer(x, x)


def build_datapipe(items, batch_size):
    return IterableWrapper(range(items)).shuffle().sharding_filter().map(featurize).batch(batch_size)


def reading_service(args):
    if args.auth_key_file:
        key = open(args.auth_key_file).read().strip()
    else:
        key = os.environ.get("RPC_READING_SERVICE_AUTH_KEY")
    common = dict(auth_key=key, num_workers=args.sessions)
    if args.workers:
        return RPCReadingService(workers=args.workers.split(","), **common)
    if args.hostfile:
        return RPCReadingService(workers=Hostfile(args.hostfile), **common)
    store = args.store
    if store == "env":  # the TCPStore torchrun itself runs, at MASTER_ADDR:MASTER_PORT
        store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return RPCReadingService(
        workers=StoreDiscovery(store, job=args.job, min_workers=args.min_workers), **common
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--workers", help="comma-separated host:port list")
    where.add_argument("--hostfile", help="file with one host:port per line")
    where.add_argument("--store", help="HOST:PORT of the TCPStore the workers registered in, or 'env' for torchrun's")
    parser.add_argument("--job", default="default", help="job name the workers registered under (--store)")
    parser.add_argument("--min-workers", type=int, default=1, help="wait for this many workers (--store)")
    parser.add_argument("--sessions", type=int, default=0, help="worker sessions per rank (default: one per worker)")
    parser.add_argument("--auth-key-file", help="the workers' key (else $RPC_READING_SERVICE_AUTH_KEY)")
    parser.add_argument("--items", type=int, default=2000, help="items per epoch")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=2.0, help="fake GPU step time per batch")
    args = parser.parse_args(argv)

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    else:
        device = torch.device("cpu")
    weights = torch.zeros(64, 64, device=device)

    dl = DataLoader2(build_datapipe(args.items, args.batch_size), reading_service=reading_service(args))
    dl.seed(0)
    ok = True
    try:
        for epoch in range(args.epochs):
            seen = torch.zeros(args.items, dtype=torch.int64)
            start = time.perf_counter()
            for batch in dl:
                for index, features in batch:
                    seen[index] += 1
                    weights += features.to(device, non_blocking=True) * 1e-6  # the "training step"
                time.sleep(args.step_ms / 1000)
            elapsed = time.perf_counter() - start
            mine = int(seen.sum())
            dist.all_reduce(seen)  # exactly once across all ranks?
            if rank == 0:
                good = bool((seen == 1).all())
                ok = ok and good
                print(f"epoch {epoch}: {args.items} items over {world} ranks in {elapsed:.2f} s; "
                      f"each exactly once: {good}", flush=True)  # fmt: skip
            print(f"rank {rank} epoch {epoch}: {mine} items from {dl.reading_service.worker_addresses}", flush=True)
    finally:
        dl.shutdown()
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
