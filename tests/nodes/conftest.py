"""The front ends that need no DataLoader2, run by ``make test-nodes`` in .venv-nodes (torchdata
0.11). Where torchdata still has DataLoader2 (``make test``'s .venv, torchdata 0.9) they are skipped:
that suite covers the engine under the DataLoader2 front end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DATALOADER2 = importlib.util.find_spec("torchdata") is not None and importlib.util.find_spec(
    "torchdata.dataloader2"
) is not None


def pytest_collection_modifyitems(config, items):
    """Skip this folder's tests where torchdata has DataLoader2 (they run in .venv-nodes)."""
    if not DATALOADER2:
        return
    skip = pytest.mark.skip(reason="torchdata >= 0.10 front ends: run with `make test-nodes` (.venv-nodes)")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)
