"""A worker session's own process keeps the heap memory it frees: items pickled in band (below
the out-of-band threshold) are fresh bytes, a frame's worth at a time, and with glibc's default
settings the heap gave that memory back after each frame and faulted it in again for the next
(0.2-0.9 page faults per 16 KiB item, measured in the session processes of local workers).

The probe runs in each real session process as a step of the graph: it makes and frees 8 MiB of 16
KiB byte strings twice, then counts the page faults of making them a third time."""

from __future__ import annotations

import platform
import resource

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import RPCReadingService

BLOCK_BYTES = 16 * 1024
BLOCKS = 512  # 8 MiB: past what glibc's default heap keeps free, within what a session's keeps
PAGE_BYTES = resource.getpagesize()


def _faults_of_heap_reused(_index):
    """Page faults while making again the 8 MiB of byte strings just freed (in the session process)."""
    import os

    for _ in range(2):  # the heap (this thread's arena) grows to hold them: its new pages fault
        blocks = [bytes(BLOCK_BYTES) for _ in range(BLOCKS)]
        del blocks
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [bytes(BLOCK_BYTES) for _ in range(BLOCKS)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del blocks
    return os.getpid(), faults


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's (mallopt)")
@pytest.mark.timeout(60)
def test_session_processes_keep_the_heap_memory_they_free():
    loader = DataLoader2(
        IterableWrapper(range(2)).sharding_filter().map(_faults_of_heap_reused),
        reading_service=RPCReadingService(num_workers=2, timeout=20.0),
    )
    try:
        probes = list(loader)
        sessions = {worker.pid for worker in loader.reading_service.stats().workers}
    finally:
        loader.shutdown()
    assert {pid for pid, _ in probes} == sessions and len(sessions) == 2  # each in a session's own process
    fresh_pages = BLOCKS * BLOCK_BYTES // PAGE_BYTES  # 2,048: what a heap that gave the memory back faults
    for pid, faults in probes:
        assert faults < fresh_pages // 10, f"session {pid} faulted {faults} pages for 8 MiB it had just freed"
