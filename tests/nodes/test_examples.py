"""The examples of the front ends that need no DataLoader2 run and check themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "script, expected",
    [
        ("torch_dataloader.py", "StatefulDataLoader: resumed after 3 batches"),
        ("nodes_pipeline.py", "RemoteNode: resumed after 5 batches"),
    ],
)
def test_example_runs(script, expected, tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--items", "200"], capture_output=True, text=True, timeout=110,
        cwd=str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert expected in done.stdout, done.stdout
