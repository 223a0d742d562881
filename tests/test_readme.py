"""Every Python block of the README: blocks that use local workers run, the others compile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
REMOTE_MARKERS = ("workers=[", "WorkerAddresses(", "StoreDiscovery(", "Hostfile(")


def python_blocks() -> List[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def uses_local_workers(block: str) -> bool:
    return "RPCReadingService(" in block and not any(marker in block for marker in REMOTE_MARKERS)


BLOCKS = python_blocks()
LOCAL = [b for b in BLOCKS if uses_local_workers(b)]
OTHERS = [b for b in BLOCKS if not uses_local_workers(b)]


def test_readme_has_runnable_blocks():
    assert len(LOCAL) >= 3, "the README should show runnable local-worker examples"


@pytest.mark.parametrize("block", OTHERS, ids=[f"compile{i}" for i in range(len(OTHERS))])
def test_other_blocks_compile(block):
    compile(block, "README.md", "exec")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", LOCAL, ids=[f"run{i}" for i in range(len(LOCAL))])
def test_local_worker_blocks_run(block, tmp_path):
    script = tmp_path / "readme_block.py"
    script.write_text(block)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110
    )
    assert result.returncode == 0, result.stderr[-3000:]
