"""``dp.remote_map`` with torchdata 0.11 (no DataLoader2): torch's DataPipes alone, under torch's
DataLoader; the cases shared with the torchdata 0.9 suite come from tests/test_remote_map.py."""

from __future__ import annotations

import pytest
from test_remote_map import check_early_break_then_reiterate, check_torch_dataloader_workers


@pytest.mark.timeout(90)
def test_under_torch_dataloader_workers():
    check_torch_dataloader_workers()


@pytest.mark.timeout(60)
def test_early_break_then_reiterate():
    check_early_break_then_reiterate()
