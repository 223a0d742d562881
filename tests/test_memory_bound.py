"""The trainer's memory is bounded by the credit window: a slow consumer that holds no item makes
the trainer's resident memory grow by at most 1.25 x the window (workers x each one's window at
the default ``prefetch``, in frames of one item) + 4 MiB, locally (shared memory) and over TCP, for 1 MiB and 8 MiB items.

Measured as the benchmark's memory scenario does (benchmarks/benchsuite/scenarios/memory.py):
the peak of resident memory (the larger of RssAnon + RssShmem + RssFile sampled every millisecond
by a thread and the kernel's VmHWM) above the resident memory after a warm-up epoch (8 items of the same size) on a loader of the same
kind, closed: what a process loads once at its first loader (DataLoader2, the package, the
libraries they map: ~20 MiB) is in the baseline, as it holds no item.
The workers make their tensors where a local worker hands them over without a copy
(``shared_empty``)."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from _server_helpers import remote
from rpc_reading_service.trainer.config import ReadingServiceConfig

MIB = 1 << 20
ITEMS = {768 << 10: 64, MIB: 48, 8 * MIB: 24}
WARM_UP_ITEMS = 8  # as the benchmark's memory scenario
CONSUMER_SLEEP_S = 0.03  # slower than the workers: the window fills


def tensor_of(size_and_index):
    """A fresh tensor of ``size`` bytes, every byte written, made where a local worker hands it
    over without a copy (a segment of its pool: ``shared_empty``), as a decoder would."""
    from rpc_reading_service import shared_empty

    size, index = size_and_index
    tensor = shared_empty(size, dtype=torch.uint8)
    tensor.fill_(index % 251)
    return tensor


def _status_kib(*fields):
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in fields:
                values[name] = int(rest.split()[0])
    return values


def _resident_kib():
    values = _status_kib("RssAnon", "RssFile", "RssShmem")
    return sum(values.values())


class _Peak:
    """The peak resident memory while the ``with`` block runs: sampled every millisecond, and the
    kernel's own peak (VmHWM, reset on entry where this process may), the larger of both."""

    def __enter__(self):
        self.peak = self.sampled = 0
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # VmHWM := the current resident memory
            self._hwm = True
        except OSError:
            self._hwm = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="memory-sampler")
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.sampled = max(self.sampled, _resident_kib())
            self._stop.wait(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.sampled, _status_kib("VmHWM")["VmHWM"] if self._hwm else 0)


def _drain(reading_service, size, items):
    """Run one epoch of ``items`` tensors of ``size`` bytes, the consumer holding none of them."""
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    graph = IterableWrapper([(size, i) for i in range(items)]).sharding_filter().map(tensor_of)
    count = 0
    with DataLoader2(graph, reading_service=reading_service) as loader:
        iterator = iter(loader)
        while True:
            try:
                count += int(next(iterator)[-1] >= 0)  # read, then dropped at once
            except StopIteration:
                break
            time.sleep(CONSUMER_SLEEP_S)
    return count


def _growth_mib(make_service, workers, size):
    """The trainer's peak resident growth (MiB) over one epoch after a warm-up one (each on a loader
    of its own), and the bound the window sets."""
    _drain(make_service(), size, WARM_UP_ITEMS)
    gc.collect()
    baseline = _resident_kib()
    with _Peak() as peak:
        assert _drain(make_service(), size, ITEMS[size]) == ITEMS[size]
    window_mib = ReadingServiceConfig().in_flight_bytes(workers, size) / MIB
    return (peak.peak - baseline) / 1024, 1.25 * window_mib + 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [MIB, 8 * MIB], ids=["1MiB", "8MiB"])
def test_local_workers_hold_the_trainer_to_the_window(size):
    from rpc_reading_service import RPCReadingService

    growth, bound = _growth_mib(lambda: RPCReadingService(num_workers=2), 2, size)
    assert growth <= bound, f"the trainer grew by {growth:.1f} MiB with 2 local workers, over {bound:.1f} MiB"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [768 << 10, MIB, 8 * MIB], ids=["768KiB", "1MiB", "8MiB"])
def test_a_tcp_session_holds_the_trainer_to_the_window(worker_server, size):
    # 768 KiB items are copied in the worker and share frames (1.5 MiB each); larger ones are lent, a frame each
    growth, bound = _growth_mib(lambda: remote(worker_server, num_workers=1), 1, size)
    assert growth <= bound, f"the trainer grew by {growth:.1f} MiB over TCP, over {bound:.1f} MiB"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("distribution", ["round_robin", "first_ready"])
def test_a_consumer_that_keeps_more_items_than_the_window_is_never_held_up(distribution):
    # A frame's credit goes back when its last item is handed on (at the next request), not
    # when the consumer lets go of it: keeping every item (a batcher, a prefetcher) cannot stall.
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    from rpc_reading_service import RPCReadingService

    graph = IterableWrapper([(MIB, i) for i in range(16)]).sharding_filter().map(tensor_of)
    service = RPCReadingService(num_workers=2, prefetch=1, distribution=distribution)
    with DataLoader2(graph, reading_service=service) as loader:
        kept = list(loader)  # 16 MiB kept, a window of 2 MiB
    assert sorted(int(t[0]) for t in kept) == list(range(16))


def _in_segments(tensors):
    """Whether every tensor's memory lies in a shared segment this process maps (no copy made here)."""
    with open("/proc/self/maps") as maps:
        ranges = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps if "memfd:rpc-reading-service" in line]
    return all(any(start <= t.data_ptr() < end for start, end in ranges) for t in tensors)


@pytest.mark.timeout(120)
def test_pin_memory_without_cuda_changes_nothing_on_the_shared_memory_path():
    # pin_memory page-locks the shared segments where CUDA is; without it the option is a
    # no-op: the same items, still in the segments (no copy), the same page faults and memory.
    import resource

    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    from rpc_reading_service import RPCReadingService

    graph = IterableWrapper([(MIB, i) for i in range(24)]).sharding_filter().map(tensor_of)
    _drain(RPCReadingService(num_workers=2), MIB, WARM_UP_ITEMS)  # what the first loader loads, in both baselines
    seen = {}
    for pin in (False, True):
        gc.collect()
        baseline, faults = _resident_kib(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with _Peak() as peak, DataLoader2(graph, reading_service=RPCReadingService(num_workers=2, pin_memory=pin)) as dl:
            held = list(dl)  # held: their memory is checked below
            assert _in_segments(held)
            values = sorted(int(t[0]) for t in held if bool((t == t[0]).all()))
            del held
        seen[pin] = (values, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, (peak.peak - baseline) / 1024)
    assert seen[True][0] == seen[False][0] == sorted(i % 251 for i in range(24))
    assert seen[True][1] <= 1.5 * seen[False][1] + 2048, seen  # minor faults: no copy of 24 MiB (6,144 pages)
    assert seen[True][2] <= seen[False][2] + 8, seen  # MiB
