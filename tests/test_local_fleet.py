"""Local worker servers (``RPCReadingService(num_workers=N)``): where their output goes, and
that they leave nothing behind. Real forked and spawned servers, real sockets."""

from __future__ import annotations

import pytest
from torchdata.datapipes.iter import IterableWrapper

from conftest import run_epochs
from rpc_reading_service import RPCReadingService

PRINT_LINE = "rrs-test-print " + "x" * 1009  # 1 KiB with its newline
LINES_PER_ITEM = 128  # 128 KiB per item


def print_a_lot(item: int) -> int:
    """A graph step that prints 128 KiB to stdout and to stderr (imported by reference)."""
    import sys

    for _ in range(LINES_PER_ITEM):
        print(PRINT_LINE)
        print(PRINT_LINE, file=sys.stderr)
    return item


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_worker_output_reaches_the_trainer_and_never_blocks_the_graph(start_method, capfd):
    """16 items x 128 KiB: 1 MiB per worker on each of stdout and stderr, far past a 64 KiB pipe."""
    service = RPCReadingService(num_workers=2, start_method=start_method, timeout=30)
    [items] = run_epochs(IterableWrapper(range(16)).sharding_filter().map(print_a_lot), service, n_epochs=1)
    assert sorted(items) == list(range(16))
    out, err = capfd.readouterr()
    # (capfd's sys.stdout writes print's newline separately, so a line of one worker may end
    # after the next line of the other: count the lines' text, which is one write each.)
    assert out.count(PRINT_LINE) == 16 * LINES_PER_ITEM
    assert err.count(PRINT_LINE) == 16 * LINES_PER_ITEM
    assert "listening on" not in out  # the address travels on a pipe of its own
