"""The engine on its own: a run's workers and epochs with no DataLoader2 around them."""

from __future__ import annotations

import os

import pytest
from _server_helpers import wait_until
from conftest import children_of
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service.trainer.config import ReadingServiceConfig
from rpc_reading_service.trainer.engine import Engine


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
