"""examples/slurm_hetjob.sbatch submitted with sbatch to a real, single-node Slurm (tests/slurm.py), and
the autoscaled run's worker jobs of examples/slurm_autoscale.py submitted and drained there.

Opt-in (``make test-slurm``, or ``pytest -m slurm tests/test_slurm.py``): it needs root and
Debian's ``slurm-wlm`` and ``munge``, and skips with the reason where either is missing or
the daemons do not start. The recipe runs as shipped; sbatch options on the command line
scale each component down to one node, and its environment variables pick free ports,
loopback addresses and two CPU trainer ranks.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

import slurm as slurm_module
from conftest import _pythonpath
from _server_helpers import free_port
from test_launch_recipes import EXAMPLES

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(170)]

VENV_BIN = Path(sys.executable).parent
JOB_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def slurm():
    reason = slurm_module.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no Slurm here: {reason}")
    try:
        cluster = slurm_module.MiniSlurm.start()
    except slurm_module.SlurmUnavailable as exc:
        pytest.skip(f"Slurm's daemons do not start here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
    assert cluster.processes() == [] and not cluster.root.exists()


def job_state(slurm, job_id: str) -> dict:
    shown = slurm.run("scontrol", "show", "job", job_id, check=False).stdout
    return dict(re.findall(r"\b(JobState|ExitCode)=(\S+)", shown))


def test_hetjob_recipe_trains_exactly_once_and_stops_its_workers(slurm, tmp_path):
    """Discovery through the recipe's TCPStore (its default). Its hostfile mode dials the worker
    nodes by name, which here are no host names (only the trainer's node is: localhost)."""
    env = dict(
        slurm.env,
        PATH=f"{VENV_BIN}:{slurm.env.get('PATH', '/usr/bin:/bin')}",  # rpc-reading-worker, torchrun, python
        PYTHONPATH=_pythonpath(),
        DISCOVERY="store",
        LISTEN_HOST="127.0.0.1", STORE_HOST="127.0.0.1", NPROC_PER_NODE="2", SESSIONS_PER_WORKER="2",
        WORKER_PORT=str(free_port()), STORE_PORT=str(free_port()), RDZV_PORT=str(free_port()),
        WORKER_LOG_LEVEL="INFO", TRAIN_SCRIPT=str(EXAMPLES / "torchrun_train.py"),
    )  # fmt: skip
    env.pop("RPC_READING_SERVICE_AUTH_KEY", None)
    per_component = ["--nodes=1", "--cpus-per-task=1", "--time=3"]
    # Submitted from tmp_path: the recipe's run directory (key, hostfile) is $SLURM_SUBMIT_DIR/rrs-<job>.
    submitted = slurm.run(
        "sbatch", "--parsable", f"--output={tmp_path}/job.out", *per_component,
        ":", *per_component, str(EXAMPLES / "slurm_hetjob.sbatch"), env=env, cwd=tmp_path,
    )  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT
    while job_state(slurm, job_id).get("JobState") in ("PENDING", "RUNNING", "COMPLETING", None):
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} still {job_state(slurm, job_id)} after {JOB_TIMEOUT} s; logs:\n{slurm.logs()}")
        time.sleep(0.5)
    output = (tmp_path / "job.out").read_text()
    state = job_state(slurm, job_id)
    assert state == {"JobState": "COMPLETED", "ExitCode": "0:0"}, output + slurm.logs()
    assert output.count("each exactly once: True") == 2, output  # both epochs, over both ranks
    assert "rank 1 epoch 1:" in output, output
    # Stopped, not killed (SIGTERM, then the step ended on its own): in store mode the worker
    # deleted its entry while the store still ran.
    assert "Killed" not in output and "forcing job termination" not in output, output
    assert re.search(r"deregistered worker slot \d+ of job", output), output
    assert (tmp_path / f"rrs-{job_id}" / "key").exists()


def test_autoscale_worker_jobs_register_and_drain(slurm, tmp_path, monkeypatch):
    """examples/slurm_autoscale.py's on_scale against a real Slurm: a worker job submitted for a
    server wanted registers in the run's store under the run's job; one no longer wanted is sent
    SIGTERM (scancel --signal=TERM), drains (its store entry deleted) and its job completes."""
    from torch.distributed import TCPStore

    from rpc_reading_service.discovery import registered_workers
    from test_launch_recipes import load_slurm_autoscale

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    key_file = tmp_path / "key"
    key_file.write_text("slurm-autoscale-key")
    key_file.chmod(0o600)
    environment = dict(slurm.env, PATH=f"{VENV_BIN}:{slurm.env.get('PATH', '/usr/bin:/bin')}", PYTHONPATH=_pythonpath(),
                       LISTEN_HOST="127.0.0.1", WORKER_PORT=str(free_port()), WORKER_LOG_LEVEL="INFO")  # fmt: skip
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RPC_READING_SERVICE_AUTH_KEY", raising=False)
    jobs = load_slurm_autoscale().SlurmWorkerJobs(
        store=f"127.0.0.1:{store.port}", run="autoscaled", key_file=str(key_file),
        sbatch_args=["--cpus-per-task=1", "--time=3", f"--output={tmp_path}/worker-%j.out"],
    )  # fmt: skip
    jobs(1)
    [(job_id, _state)] = jobs.jobs()
    deadline = time.monotonic() + JOB_TIMEOUT
    while not registered_workers(store, "autoscaled"):
        if time.monotonic() > deadline:
            pytest.fail(f"worker job {job_id} never registered ({job_state(slurm, job_id)}); logs:\n{slurm.logs()}")
        time.sleep(0.5)
    jobs(0)
    while job_state(slurm, job_id).get("JobState") in ("PENDING", "RUNNING", "COMPLETING", None):
        if time.monotonic() > deadline:
            pytest.fail(f"worker job {job_id} still {job_state(slurm, job_id)}; logs:\n{slurm.logs()}")
        time.sleep(0.5)
    output = (tmp_path / f"worker-{job_id}.out").read_text()
    assert job_state(slurm, job_id) == {"JobState": "COMPLETED", "ExitCode": "0:0"}, output + slurm.logs()
    assert registered_workers(store, "autoscaled") == [] and jobs.jobs() == [], output
    assert "Killed" not in output and "forcing job termination" not in output, output
