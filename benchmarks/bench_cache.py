#!/usr/bin/env python
"""The worker cache against slow storage: two ``rpc-reading-worker`` servers with ``--cache-dir``.

A storage stub takes 5 ms per read and counts its reads (one line per read in a file, so the
counts of every worker process add up). Each item is read and decoded (a 64 KiB tensor)
inside ``cached_map``. Two servers with two sessions each; measured: epoch 1 (cold cache),
epoch 2, and epoch 1 of a second run over the same servers. Three set-ups:

* ``fixed slices``: ``sharding_filter`` before any shuffle (round-robin), so each worker sees
  the same items every epoch: the cache of its server has them all from epoch 2 on, but every
  epoch delivers them in the same order.
* ``shuffled, round-robin``: ``shuffle().sharding_filter()``: round-robin deals each epoch's
  items to other workers, so an item lands on the server that cached it about half the time.
* ``shuffled, sticky``: the same graph with ``distribution="sticky"``: each item goes to the
  server its key hashes to, every epoch, in the epoch's shuffled order.

A second table shows what the locality costs in shuffle quality, from the delivered order of
the three epochs (each item tagged with the server that produced it): how far apart in the
dataset two consecutive items are (mean |index difference|, over n/3, which a uniform random
order gives), how often two consecutive items come from one server, how many items changed
server between epochs, and the share of all pairs of items that shared a server in at least
one of the three epochs (only such pairs can meet in a worker-side batch or shuffle buffer).

For the sticky set-up, a third run over the same servers replaces ``cached_map`` by a plain
``map(decode)`` (no storage, no cache): its second epoch is what delivering the items costs
without any cache, the floor under a cached epoch.

Run 1 is seeded 0 and run 2 seeded 1, so the shuffled graph deals run 2 a new order too. The
first epoch of a run includes setting up its sessions (a few hundred ms on a loaded machine).

Run standalone, from the repo root::

    PYTHONPATH=$PWD python benchmarks/bench_cache.py [--items 400] [--read-ms 5]

Prints a markdown table. Everything started here is stopped and reaped on exit.
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import RPCReadingService
from rpc_reading_service.trainer.local_fleet import read_listening_address

SESSIONS_PER_SERVER = 2


def decode(item: int) -> torch.Tensor:
    """The decode: a fresh 64 KiB tensor."""
    return torch.full((16384,), float(item))


def read_and_decode(counter: str, read_seconds: float, item: int) -> torch.Tensor:
    """The storage stub: ``read_seconds`` of latency, one counted read, then a decoded item."""
    time.sleep(read_seconds)
    with open(counter, "a") as handle:
        handle.write("r\n")
    return decode(item)


def tag_with_server(decoded: torch.Tensor) -> Tuple[int, int, torch.Tensor]:
    """``(dataset index, pid of the server whose session produced it, the item)``: sessions
    are processes forked by their server."""
    return int(decoded[0]), os.getppid(), decoded


def reads(counter: str) -> int:
    """How many storage reads happened so far."""
    try:
        with open(counter) as handle:
            return sum(1 for _ in handle)
    except FileNotFoundError:
        return 0


def start_server(cache_dir: str, key: str, workdir: str) -> Tuple[subprocess.Popen, str]:
    """An ``rpc-reading-worker`` on loopback with its own ``--cache-dir``; returns it and its address."""
    env = dict(os.environ, RPC_READING_SERVICE_AUTH_KEY=key)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    command = [
        sys.executable, "-m", "rpc_reading_service.worker", "--host", "127.0.0.1", "--port", "0",
        "--cache-dir", cache_dir, "--cache-size", "1G", "--log-level", "WARNING",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        env=env,
        start_new_session=True,
        cwd=workdir,
    )
    return proc, read_listening_address(proc, 120.0)


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate a server and whatever is left of its process group; reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


Delivered = List[Tuple[int, int]]  # (dataset index, server pid) of each item, in delivered order


def timed_epochs(
    datapipe, service: RPCReadingService, counter: str, n_epochs: int, n_items: int, seed: int
) -> List[Tuple[float, int, Delivered]]:
    """``(seconds, storage reads, delivered order)`` of each epoch of one run (a DataLoader2
    seeded ``seed``)."""
    measured = []
    with DataLoader2(datapipe, reading_service=service) as dl:
        dl.seed(seed)
        for _ in range(n_epochs):
            before = reads(counter)
            start = time.perf_counter()
            delivered = [(index, server) for index, server, _ in dl]
            measured.append((time.perf_counter() - start, reads(counter) - before, delivered))
            indices = sorted(index for index, _ in delivered)
            assert indices == list(range(n_items)), f"an epoch did not yield each of the {n_items} items once"
    return measured


def shuffle_quality(epochs: Sequence[Delivered], n_items: int) -> Tuple[float, float, float, float]:
    """``(mean |index difference| of neighbours / (n/3), chance that neighbours share a server,
    share of items on another server than in the epoch before, share of item pairs that shared
    a server in at least one epoch)``."""
    gaps, same, pairs = [], [], 0
    for delivered in epochs:
        gaps += [abs(a[0] - b[0]) for a, b in zip(delivered, delivered[1:])]
        same += [a[1] == b[1] for a, b in zip(delivered, delivered[1:])]
    servers: List[Dict[int, int]] = [dict(delivered) for delivered in epochs]
    moved = [sum(b[i] != a[i] for i in range(n_items)) / n_items for b, a in zip(servers, servers[1:])]
    for i in range(n_items):
        for j in range(i + 1, n_items):
            pairs += any(where[i] == where[j] for where in servers)
    return (
        sum(gaps) / len(gaps) / (n_items / 3),
        sum(same) / len(same),
        sum(moved) / len(moved),
        pairs / (n_items * (n_items - 1) / 2),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=400, help="items per epoch (default 400)")
    parser.add_argument(
        "--read-ms", type=float, default=5.0, help="storage latency per read in ms (default 5)"
    )
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench-cache-")
    key = secrets.token_hex(16)
    rows, quality, floor = [], [], None
    setups = (
        ("fixed slices", False, None),
        ("shuffled, round-robin", True, None),
        ("shuffled, sticky", True, "sticky"),
    )
    try:
        for number, (name, shuffled, distribution) in enumerate(setups):
            counter = os.path.join(workdir, f"reads-{number}")
            servers = [
                start_server(os.path.join(workdir, f"cache-{number}-{i}"), key, workdir) for i in range(2)
            ]
            try:
                addresses = [address for _, address in servers] * SESSIONS_PER_SERVER
                fn = functools.partial(read_and_decode, counter, args.read_ms / 1000)
                items = IterableWrapper(range(args.items))
                datapipe = (
                    items.shuffle().sharding_filter() if shuffled else items.sharding_filter()
                ).cached_map(fn).map(tag_with_server)

                service = functools.partial(
                    RPCReadingService, num_workers=len(addresses), workers=addresses, auth_key=key,
                    distribution=distribution,
                )  # fmt: skip
                (cold, warm) = timed_epochs(datapipe, service(), counter, 2, args.items, seed=0)
                (second_run,) = timed_epochs(datapipe, service(), counter, 1, args.items, seed=1)
                if distribution == "sticky":
                    uncached = items.shuffle().sharding_filter().map(decode).map(tag_with_server)
                    floor = timed_epochs(uncached, service(), counter, 2, args.items, seed=0)[1][0]
            finally:
                for proc, _ in servers:
                    stop_server(proc)
            for phase, (seconds, n_reads, _) in (
                ("epoch 1 (cold)", cold),
                ("epoch 2", warm),
                ("run 2, epoch 1", second_run),
            ):
                rows.append((name, phase, seconds, n_reads, 1 - n_reads / args.items, cold[0] / seconds))
            quality.append((name, *shuffle_quality([cold[2], warm[2], second_run[2]], args.items)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"{args.items} items of 64 KiB, {args.read_ms:g} ms per storage read, "
        f"2 servers x {SESSIONS_PER_SERVER} sessions\n"
    )
    print("| graph | phase | time (s) | storage reads | hit rate | epoch 1 / this |")
    print("|---|---|---:|---:|---:|---:|")
    for name, phase, seconds, n_reads, hit_rate, ratio in rows:
        print(f"| {name} | {phase} | {seconds:.3f} | {n_reads} | {hit_rate:.0%} | {ratio:.1f}x |")
    if floor is not None:
        print(f"\nfloor, shuffled, sticky: the same graph with map(decode) instead of cached_map, epoch 2: {floor:.3f} s")
    print("\nShuffle quality over the three epochs (a uniform random order: gap 1.00, same server ~50%)\n")
    print(
        "| set-up | neighbours' index gap / (n/3) | neighbours from one server | items that changed server "
        "| pairs that ever shared a server |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, gap, same, moved, met in quality:
        print(f"| {name} | {gap:.2f} | {same:.0%} | {moved:.0%} | {met:.0%} |")
    for name in ("fixed slices", "shuffled, sticky"):
        measured = [row for row in rows if row[0] == name]
        no_reads = all(row[3] == 0 for row in measured[1:])
        print(f"\ntarget, {name}: no storage reads after epoch 1: {'PASS' if no_reads else 'MISS'}")
        fast = "PASS" if measured[1][5] >= 5 else "MISS"
        print(f"target, {name}: epoch 2 at least 5x faster than epoch 1: {fast} ({measured[1][5]:.1f}x)")


if __name__ == "__main__":
    main()
