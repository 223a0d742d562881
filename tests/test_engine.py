"""The engine on its own: a run's workers and epochs with no DataLoader2 around them."""

from __future__ import annotations

import collections
import itertools
import os

import pytest
from _server_helpers import python_calls, wait_until
from conftest import children_of
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service.protocol import SessionOptions
from rpc_reading_service.trainer.config import ReadingServiceConfig
from rpc_reading_service.trainer.engine import Engine
from rpc_reading_service.trainer.engine.fleet import Fleet


def square(x: int) -> int:
    return x * x


@pytest.mark.timeout(60)
def test_epochs_positions_and_resume_without_dataloader2():
    before = set(children_of(os.getpid()))  # an earlier test's processes, still being reaped
    engine = Engine(ReadingServiceConfig.create(num_workers=2))
    try:
        engine.start(IterableWrapper(range(10)).sharding_filter().map(square))
        assert engine.num_workers == 2 and len(engine.worker_addresses) == 2
        full = list(engine.start_epoch(seed=1))
        assert sorted(full) == [square(x) for x in range(10)]
        assert engine.stats().items == 10

        partial = engine.start_epoch(seed=1)
        items = iter(partial)
        head = [next(items) for _ in range(3)]
        positions = partial.positions()
        assert sum(positions.consumed) == 3
        # Resuming at those positions (same seed) yields exactly the rest, in order.
        rest = list(engine.start_epoch(seed=1, positions=positions, number=partial.number))
        assert head + rest == full
        with pytest.raises(RuntimeError, match="invalidated"):
            next(items)  # the superseded epoch's iterator takes nothing from the new one
    finally:
        engine.close()
    assert wait_until(lambda: not set(children_of(os.getpid())) - before, timeout=10)
    engine.close()  # idempotent


def small_tensor(x: int) -> "torch.Tensor":
    import torch

    return torch.full((256,), x, dtype=torch.float32)  # 1 KiB: pickled in band


def large_tensor(x: int) -> "torch.Tensor":
    import torch

    return torch.full((16384,), x, dtype=torch.float32)  # 64 KiB: an out-of-band buffer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make, per_frame", [(small_tensor, 16), (large_tensor, 4)])
def test_the_consuming_thread_makes_no_python_call_per_item_but_its_tensor_rebuild(monkeypatch, make, per_frame):
    # Between a received DATA frame and next(): the frame is decoded and unpickled, and its items
    # handed on, with Python calls per frame only; each item costs only the rebuild of its tensor.
    frames = 10
    options = SessionOptions(batch_max_items=per_frame, linger=5.0)  # frames of exactly per_frame items
    monkeypatch.setattr(Fleet, "session_options", lambda self: options)
    engine = Engine(ReadingServiceConfig.create(num_workers=1))
    try:
        engine.start(IterableWrapper(range(frames * per_frame)).sharding_filter().map(make))
        items = iter(engine.start_epoch(seed=1))
        first = next(items)  # the session set up, its first frame taken
        assert wait_until(lambda: engine.channels[0].frames_received == frames, timeout=20)
        rest = frames * per_frame - 1
        taken, calls = python_calls(lambda: list(itertools.islice(items, rest)))
        assert [int(t[0]) for t in [first] + taken] == list(range(frames * per_frame))
        assert list(items) == []
    finally:
        engine.close()
    counts = collections.Counter(calls)
    assert counts.pop("_rebuild_tensor") == (frames - 1) * per_frame  # the first frame was unpickled before
    per_item = {name: n for name, n in counts.items() if n > 2 * (frames - 1)}
    assert not per_item, f"Python calls per item on the consuming thread: {per_item}"
    assert sum(counts.values()) <= 24 * (frames - 1), counts  # ~20 per frame (its decode, credit, run)
