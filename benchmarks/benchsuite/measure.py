"""Timing of one epoch (child side): steady-state rates, every received buffer touched."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from workloads import Workload


@dataclasses.dataclass(frozen=True)
class MadeElsewhere:
    """Stands for an item another process made and kept (the production limit moves
    nothing): counts as ``nbytes`` bytes."""

    nbytes: int


CLOCK_START = MadeElsewhere(0)  # yielded before the first item: the rate counts from here, not from it


class CorruptItem(AssertionError):
    """A received buffer whose first and last bytes differ: every item is one fill value."""


def touch(item) -> int:
    """Read the first and last byte of a received buffer, check they are the same fill
    value (see ``workloads.make_tensor``); return its size in bytes."""
    if type(item) is int:  # fast path: the per-item overhead caps the rates measured on tiny
        return 0
    if type(item) is MadeElsewhere:
        return item.nbytes
    if type(item) is tuple:  # an image and its label
        return touch(item[0])
    import torch

    if isinstance(item, torch.Tensor):
        try:
            flat = item.numpy().reshape(-1)  # ~1.5 us a tensor; indexing it in torch costs ~5 us
        except (TypeError, RuntimeError):  # a dtype numpy lacks, a tensor that needs grad
            flat = item.reshape(-1)
        if len(flat) and int(flat[0]) != int(flat[-1]):
            raise CorruptItem(f"received tensor starts with {int(flat[0])} and ends with {int(flat[-1])}")
        return item.numel() * item.element_size()
    if isinstance(item, (bytes, bytearray, memoryview)):
        if len(item) and item[0] != item[-1]:
            raise CorruptItem(f"received buffer starts with {item[0]} and ends with {item[-1]}")
        return len(item)
    return 0


def read_all(item) -> int:
    """Read every byte of a received tensor (a consumer that uses its data).

    ``max`` reads every byte and allocates nothing; ``sum`` of a uint8 tensor accumulates in
    int64, and behind torch's DataLoader it left ~7 MiB per 1 MiB item in the trainer's
    resident memory: the consumer, not the contender, would be measured.
    """
    import torch

    if isinstance(item, torch.Tensor):
        item.reshape(-1).max()
    return touch(item)


def drain(contender, workload: Workload, num_workers: int, budget_s: float,
          consume: Callable[[Any], int] = touch, consumer_sleep_s: float = 0.0,
          warmup_fraction: float = 0.0, warmup_epochs: int = 0, warmup_s: float = 0.0) -> dict:
    """Run one epoch of ``contender`` (see ``contenders.base.Contender``) and time it.

    Stops after ``budget_s`` seconds of items (unless the contender cannot stop early
    cleanly).  The rate is steady-state: counted from the item at ``warmup_fraction``
    of the epoch (the first item by default), or from ``CLOCK_START`` if the loader
    yields it first; with ``warmup_s``, from the first item that comes that long after the first
    one (or the middle of the epoch, if sooner: a short epoch still gets a rate), and the
    budget is that much longer.  With ``warmup_epochs``, that many whole epochs of the same loader
    (its workers kept) run first, untimed: the timed epoch is the next one, its times
    count from its own start, and ``loader_first_item_s`` is the wait from building the
    loader to its very first item.
    """
    warmup_items = max(1, int(workload.n_items * warmup_fraction))
    items = nbytes = 0
    start_items = start_bytes = 0
    t_first = t_start = None
    cpu_start = 0.0
    stopped_by_budget = False
    item = None
    t0 = time.perf_counter()
    loader_first_item_s = None
    with contender.epochs(workload, num_workers) as next_epoch:
        for _ in range(warmup_epochs):
            for item in next_epoch():
                if loader_first_item_s is None:
                    loader_first_item_s = time.perf_counter() - t0
                consume(item)
            t0 = time.perf_counter()
        for item in next_epoch():
            if item is CLOCK_START:
                t_first = t_start = time.perf_counter()
                cpu_start = time.process_time()
                continue
            size = consume(item)
            now = time.perf_counter()
            items += 1
            nbytes += size
            if t_first is None:
                t_first = now
            if (t_start is None and items >= warmup_items
                    and (now - t_first >= warmup_s or items >= workload.n_items // 2)):
                t_start, start_items, start_bytes = now, items, nbytes
                cpu_start = time.process_time()
            if consumer_sleep_s:
                time.sleep(consumer_sleep_s)
            if (now - t_first > budget_s + warmup_s and (t_start is None or items > start_items)
                    and items < workload.n_items and contender.stops_early_cleanly):  # a timed item or none
                stopped_by_budget = True
                break
        t_end = time.perf_counter()
        cpu_end = time.process_time()
        del item
    t_closed = time.perf_counter()
    steady_s = (t_end - t_start) if t_start is not None else 0.0
    first_item_s = (t_first - t0) if t_first is not None else None
    steady_items = items - start_items
    return {
        "items": items,
        "bytes": nbytes,
        "first_item_s": first_item_s,
        "loader_first_item_s": loader_first_item_s if warmup_epochs else first_item_s,
        "steady_s": steady_s,
        "steady_items": steady_items,
        "total_s": t_end - t0,
        "shutdown_s": t_closed - t_end,
        "items_per_s": steady_items / steady_s if steady_items > 0 and steady_s > 0 else None,
        "bytes_per_s": (nbytes - start_bytes) / steady_s if steady_items > 0 and steady_s > 0 else None,
        "stopped_by_budget": stopped_by_budget,
        # CPU seconds of this process (the trainer: every thread of it) over the steady part
        "cpu_steady_s": cpu_end - cpu_start if t_start is not None else None,
        "expected_items": workload.n_items,
    }
