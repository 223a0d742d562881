"""The README's blocks for torch's DataLoader and torchdata.nodes run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
FRONT_ENDS = ("RemoteIterable(", "RemoteNode(", "RemoteMapper(")
BLOCKS = [
    block
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    if any(name in block for name in FRONT_ENDS)
]


def test_the_readme_shows_both_front_ends():
    assert any("RemoteIterable(" in block for block in BLOCKS)
    assert any("RemoteMapper(" in block or "RemoteNode(" in block for block in BLOCKS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_block_runs(block, tmp_path):
    script = tmp_path / "readme_block.py"
    script.write_text(block)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=dict(os.environ, PYTHONWARNINGS="ignore"),
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
