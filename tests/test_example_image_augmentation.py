"""examples/image_augmentation.py --quick: the CPU-heavy pipeline runs on 1, 2 and 4 local workers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("PIL", reason="the example needs Pillow (the 'examples' extra)")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "image_augmentation.py"


@pytest.mark.timeout(180)
def test_image_augmentation_quick(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--quick"], capture_output=True, text=True, timeout=170, cwd=str(tmp_path)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)%\s+([\d.]+)s$", result.stdout, re.M)
    assert [int(workers) for workers, *_ in rows] == [1, 2, 4], result.stdout
    for _, images_per_second, stall, _ in rows:
        assert int(images_per_second) > 0 and 0 <= int(stall) <= 100
    assert "lowest data stall with" in result.stdout
