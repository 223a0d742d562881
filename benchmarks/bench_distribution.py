#!/usr/bin/env python
"""Work distribution policies against an unequal fleet: epoch time vs the ideal.

Four local workers with sleep-bound items (so the 2-core machine does not distort it: the
items wait, they do not compute). In the unequal fleet one worker is 4x slower: its
``worker_init_fn`` makes it sleep four times as long per item. The ideal epoch time is the
total work divided by the fleet's summed speed (``items * ms / (3 + 1/4)`` for 3 normal
workers and one 4x slower); each policy's epoch is measured against it (the best of
``--epochs`` epochs after a warm-up epoch, so session setup is not counted). A ``time.sleep``
waits longer than asked (more so on a busy host), so each sleep-bound item also reports how
long its sleeps really took, and each table gives the ideal of those measured sleeps too:
``items / (3 / fast item + 1 / slow item)``, the host's oversleeping taken out and every cost
of ours (between the sleeps) still counted.

The same unequal fleet with a dispatch point (``sharding_round_robin_dispatch``: the trainer
deals the items; a unit of "dynamic" is one dispatched item), round-robin against dynamic.

Also the overhead of "dynamic" against round-robin where balancing cannot help: equal
workers with sleep-bound items, and tiny items (no sleep at all: the per-item and per-chunk
cost of the machinery itself). The tiny-items row keeps one loader of each policy open at
once and alternates their epochs (``--rounds`` of each, after a warm-up epoch each), and beside
the wall time gives the CPU seconds of the trainer process and of its worker processes per
item: both policies get the same rounds on the same machine state.

Run standalone, from the repo root::

    PYTHONPATH=$PWD python benchmarks/bench_distribution.py [--items 800] [--ms 5] [--quick]

Prints markdown tables. "dynamic" runs with its defaults but for ``--chunk-size`` (16): chunks of
16 in the warm-up epoch (the stream's length unknown), a guided schedule in the timed ones (up to
256 positions while much is left, shrinking to 1 at the end). ``--chunk-sizes 4,16,64`` adds a
sweep of fixed chunk sizes (``guided=False``) on the unequal fleet (how the first epoch's default
was chosen). Every worker started here is stopped on exit.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import RPCReadingService
from rpc_reading_service.policies.dynamic.trainer import DEFAULT_CHUNK_SIZE, DEFAULT_MAX_CHUNK_SIZE, Dynamic

WORKERS = 4
SLOWDOWN = 4.0


class SleepPerItem:
    """The item's work: ``seconds`` of waiting (what reading from remote storage looks like).

    With ``measured`` the item becomes the tuple of the seconds its sleeps really took (one
    per ``SleepPerItem`` it went through): what the ideal of the measured sleeps is made of."""

    def __init__(self, seconds: float, measured: bool = False):
        self.seconds, self.measured = seconds, measured

    def __call__(self, item: Any) -> Any:
        if not self.seconds:
            return item
        start = time.perf_counter()
        time.sleep(self.seconds)
        if not self.measured:
            return item
        slept = time.perf_counter() - start
        return (*item, slept) if isinstance(item, tuple) else (slept,)


class SlowWorker:
    """``worker_init_fn``: worker ``rank`` spends ``extra`` more seconds on each of its items."""

    def __init__(self, rank: int, extra: float):
        self.rank, self.extra = rank, extra

    def __call__(self, datapipe: Any, info: Any) -> Any:
        if info.worker_id != self.rank or not self.extra:
            return datapipe
        return datapipe.map(SleepPerItem(self.extra, measured=True))


def graph(items: int, seconds: float) -> Any:
    return IterableWrapper(range(items)).shuffle().sharding_filter().map(SleepPerItem(seconds, measured=True))


def dispatching_graph(items: int, seconds: float) -> Any:
    """The same work behind a dispatch point: the trainer deals the shuffled items to the workers."""
    dispatched = IterableWrapper(range(items)).shuffle().sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    return dispatched.map(SleepPerItem(seconds, measured=True))


def measured_ideal(items: List[Any]) -> Optional[float]:
    """The unequal fleet's ideal epoch from what its sleeps really took: ``len(items)`` items over
    the normal workers' speed (one item: its one sleep) and the slow one's (its item: two sleeps)."""
    fast = [sleeps[0] for sleeps in items if isinstance(sleeps, tuple) and len(sleeps) == 1]
    slow = [sum(sleeps) for sleeps in items if isinstance(sleeps, tuple) and len(sleeps) == 2]
    if not fast or not slow:
        return None
    return len(items) / ((WORKERS - 1) * len(fast) / sum(fast) + len(slow) / sum(slow))


def epoch_seconds(
    distribution: Any, items: int, seconds: float, slow_extra: float, epochs: int,
    make_graph: Callable[[int, float], Any] = graph,
) -> float:  # fmt: skip
    """The best epoch time of ``epochs`` epochs (after one warm-up epoch) of one policy."""
    return best_epoch(distribution, items, seconds, slow_extra, epochs, make_graph)[0]


def best_epoch(
    distribution: Any, items: int, seconds: float, slow_extra: float, epochs: int,
    make_graph: Callable[[int, float], Any] = graph,
) -> Tuple[float, List[Any]]:  # fmt: skip
    """:func:`epoch_seconds`, and the items of that best epoch."""
    service = RPCReadingService(
        num_workers=WORKERS, distribution=distribution, worker_init_fn=SlowWorker(0, slow_extra)
    )
    best: Tuple[float, List[Any]] = (float("inf"), [])
    with DataLoader2(make_graph(items, seconds), reading_service=service) as dl:
        dl.seed(0)
        assert len(list(dl)) == items  # warm-up: sessions set up, first epoch
        for _ in range(epochs):
            start = time.perf_counter()
            taken = list(dl)
            best = min(best, (time.perf_counter() - start, taken), key=lambda pair: pair[0])
            assert len(taken) == items
    return best


def descendants(pid: int) -> List[int]:
    """Every live descendant process of ``pid`` (from /proc/<pid>/task/*/children, Linux)."""
    found: List[int] = []
    for task in _listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                children = [int(child) for child in handle.read().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def _listdir(path: str) -> List[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of the processes ``pids`` so far (the ones gone count 0)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def tiny_items_rounds(items: int, rounds: int, chunk_size: int) -> str:
    """Tiny items (no work), round-robin against dynamic: a loader of each open at once, their
    epochs alternating (round-robin first in each round), the wall and the CPU of every round, and
    the ratio of each round's pair (taken back to back, so the least moved by a changing load)."""
    contenders = {"round_robin": "round_robin", dynamic_label(chunk_size): Dynamic(chunk_size)}
    results: Dict[str, List[Tuple[float, float, float]]] = {name: [] for name in contenders}
    loaders: Dict[str, Any] = {}
    workers: Dict[str, List[int]] = {}
    try:
        for name, distribution in contenders.items():
            before = set(descendants(os.getpid()))
            service = RPCReadingService(num_workers=WORKERS, distribution=distribution)
            loader = loaders[name] = DataLoader2(graph(items, 0.0), reading_service=service)
            loader.seed(0)
            assert len(list(loader)) == items  # warm-up: sessions set up, first epoch
            workers[name] = [pid for pid in descendants(os.getpid()) if pid not in before]
        for _ in range(rounds):
            for name, loader in loaders.items():
                trainer, fleet, start = time.process_time(), cpu_seconds(workers[name]), time.perf_counter()
                count = sum(1 for _item in loader)
                wall = time.perf_counter() - start
                results[name].append((wall, time.process_time() - trainer, cpu_seconds(workers[name]) - fleet))
                assert count == items
    finally:
        for loader in loaders.values():
            loader.shutdown()
    rows = []
    for name, runs in results.items():
        walls = ", ".join(f"{wall:.3f}" for wall, _t, _w in runs)
        cpus = ", ".join(f"{trainer:.2f} + {fleet:.2f}" for _wall, trainer, fleet in runs)
        best_cpu = min(trainer + fleet for _wall, trainer, fleet in runs)
        rows.append((name, walls, f"{min(r[0] for r in runs):.3f}", cpus, f"{best_cpu / items * 1e6:.1f}"))
    base, dynamic = results.values()
    wall_ratio = min(r[0] for r in dynamic) / min(r[0] for r in base)
    cpu_ratio = min(r[1] + r[2] for r in dynamic) / min(r[1] + r[2] for r in base)
    per_round = ", ".join(f"{d[0] / r[0]:.2f}x" for r, d in zip(base, dynamic))  # each round's pair, back to back
    rows.append(("dynamic / round_robin", per_round, f"**{wall_ratio:.2f}x**", "", f"{cpu_ratio:.2f}x"))
    return table(
        f"Tiny items (no work), {items} items, {WORKERS} workers: {rounds} rounds, the policies' epochs alternating",
        ("policy", "wall s per round", "best wall s", "CPU s per round (trainer + workers)", "best CPU us per item"),
        rows,
    )  # fmt: skip


def dynamic_label(chunk_size: int) -> str:
    """How the tables name dynamic with its default guided schedule."""
    return f"dynamic (chunk {chunk_size}, guided up to {DEFAULT_MAX_CHUNK_SIZE})"


def policies(chunk_size: int) -> Dict[str, Any]:
    return {"round_robin": "round_robin", "first_ready": "first_ready", dynamic_label(chunk_size): Dynamic(chunk_size)}


def table(title: str, header: Sequence[str], rows: List[Sequence[str]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def unequal_fleet(items: int, ms: float, epochs: int, chunk_size: int) -> str:
    seconds = ms / 1000
    ideal = items * seconds / (WORKERS - 1 + 1 / SLOWDOWN)
    rows = []
    for name, distribution in policies(chunk_size).items():
        took, taken = best_epoch(distribution, items, seconds, seconds * (SLOWDOWN - 1), epochs)
        rows.append((name, f"{took:.2f}", f"{ideal:.2f}", f"{took / ideal:.2f}x", *_measured(took, taken)))
    return table(
        f"{WORKERS} workers, one {SLOWDOWN:g}x slower: {items} items of {ms:g} ms",
        ("policy", "epoch s", "ideal s", "vs ideal", "ideal of the measured sleeps s", "vs it"), rows,
    )  # fmt: skip


def _measured(took: float, taken: List[Any]) -> Tuple[str, str]:
    """The cells of the ideal of the measured sleeps, and the epoch against it."""
    ideal = measured_ideal(taken)
    return ("-", "-") if ideal is None else (f"{ideal:.2f}", f"{took / ideal:.2f}x")


def dispatch_fleet(items: int, ms: float, epochs: int) -> str:
    """The unequal fleet with a dispatch point: a unit of "dynamic" is one dispatched item."""
    seconds = ms / 1000
    ideal = items * seconds / (WORKERS - 1 + 1 / SLOWDOWN)
    rows = []
    for name in ("round_robin", "dynamic"):
        took, taken = best_epoch(name, items, seconds, seconds * (SLOWDOWN - 1), epochs, dispatching_graph)
        rows.append((name, f"{took:.2f}", f"{ideal:.2f}", f"{took / ideal:.2f}x", *_measured(took, taken)))
    return table(
        f"sharding_round_robin_dispatch, {WORKERS} workers, one {SLOWDOWN:g}x slower: {items} items of {ms:g} ms",
        ("policy", "epoch s", "ideal s", "vs ideal", "ideal of the measured sleeps s", "vs it"), rows,
    )  # fmt: skip


def overhead(items: int, ms: float, epochs: int, chunk_size: int) -> str:
    rows = []
    for label, count, seconds in ((f"equal workers, {ms:g} ms items", items, ms / 1000),):
        base = epoch_seconds("round_robin", count, seconds, 0.0, epochs)
        dynamic = epoch_seconds(Dynamic(chunk_size), count, seconds, 0.0, epochs)
        rows.append((f"{label}, {count} items", f"{base:.3f}", f"{dynamic:.3f}", f"{dynamic / base:.2f}x"))
    return table(
        f"Overhead of {dynamic_label(chunk_size)} vs round_robin where balancing cannot help",
        ("workload", "round_robin s", "dynamic s", "dynamic / round_robin"), rows,
    )  # fmt: skip


def chunk_sweep(items: int, ms: float, epochs: int, sizes: Sequence[int], tiny_items: int) -> str:
    seconds = ms / 1000
    ideal = items * seconds / (WORKERS - 1 + 1 / SLOWDOWN)
    base = epoch_seconds("round_robin", tiny_items, 0.0, 0.0, epochs)
    rows = []
    for size in sizes:
        took = epoch_seconds(Dynamic(size, guided=False), items, seconds, seconds * (SLOWDOWN - 1), epochs)
        tiny = epoch_seconds(Dynamic(size, guided=False), tiny_items, 0.0, 0.0, epochs)
        rows.append((str(size), f"{took / ideal:.2f}x", f"{tiny / base:.2f}x"))
    return table(
        "dynamic's fixed chunk size (guided=False): unequal fleet vs ideal, and tiny items vs round_robin",
        ("chunk_size", "unequal fleet vs ideal", "tiny items vs round_robin"), rows,
    )  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=800, help="items per epoch (sleep-bound)")
    parser.add_argument("--ms", type=float, default=5.0, help="milliseconds per item on a normal worker")
    parser.add_argument("--tiny-items", type=int, default=100000, help="items per epoch of the no-work workload")
    parser.add_argument("--rounds", type=int, default=3, help="alternating epochs of each policy on tiny items")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per run (the best counts)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--chunk-sizes", default="", help="comma-separated chunk sizes to sweep (e.g. 4,16,64)")
    parser.add_argument("--quick", action="store_true", help="fewer items and epochs (under a minute)")
    args = parser.parse_args(argv)
    if args.quick:
        args.items, args.tiny_items, args.epochs, args.rounds = 400, 20000, 1, 2
    print(f"load average at the start: {os.getloadavg()[0]:.1f} (a shared machine distorts the tiny-items row most)\n")
    print(unequal_fleet(args.items, args.ms, args.epochs, args.chunk_size))
    print(overhead(args.items, args.ms, args.epochs, args.chunk_size))
    print(tiny_items_rounds(args.tiny_items, args.rounds, args.chunk_size))
    print(dispatch_fleet(args.items, args.ms, args.epochs))
    if args.chunk_sizes:
        sizes = [int(size) for size in args.chunk_sizes.split(",")]
        print(chunk_sweep(args.items, args.ms, args.epochs, sizes, args.tiny_items))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
