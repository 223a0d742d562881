"""``examples/ddp_train.py`` under torchrun: 2 gloo ranks, a shared local fleet, preempted and resumed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _server_helpers import free_port

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_train.py"


@pytest.mark.timeout(140)
def test_ddp_train_quick_resumes_exactly(tmp_path):
    # About 16 s and 28 s of CPU alone on 2 cores (torchrun, 2 ranks, 2 worker servers, each
    # importing torch; two runs): a loaded host (load 10-18) stretches that past a minute.
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--master_port", str(free_port()), "--monitor-interval", "0.2",
        str(EXAMPLE), "--quick", "--checkpoint-dir", str(tmp_path / "ckpt"),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RPC_READING_SERVICE_AUTH_KEY", None)
    # Its own process group, so that a timeout kills torchrun, both ranks and the fleet.
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=130)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(
            "ddp_train.py --quick did not finish within 130 s:\n" + out.decode(errors="replace")[-4000:]
        )
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers (the fleet exits with rank 0 anyway)
        except ProcessLookupError:
            pass
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert "rank 0 started 2 worker servers" in text
    for rank in (0, 1):
        assert f"rank {rank}: checkpoint at epoch 1" in text, text[-4000:]
        assert f"rank {rank}: resumed from" in text
    assert "every item of every epoch seen exactly once across 2 ranks: True" in text
    assert "resumed run identical to an uninterrupted run (weights and items): True" in text
    assert (tmp_path / "ckpt" / "rank0.pt").exists() and (tmp_path / "ckpt" / "rank1.pt").exists()
