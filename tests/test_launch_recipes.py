"""The launch recipes in examples/: the local fleet script and torchrun run here; the Slurm
script is checked with bash -n (it runs on a real Slurm in the opt-in tests/test_slurm.py) and
the Kubernetes manifest against the Kubernetes schema (kubernetes-validate, the test extra)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import _pythonpath
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import VENV_BIN, _pythonpath, free_port, process_group_members, reap, wait_until
from rpc_reading_service import Hostfile, RPCReadingService, StoreDiscovery
from rpc_reading_service.discovery import registered_workers

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def recipe_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"  # rpc-reading-worker, torchrun
    env["PYTHON"] = sys.executable
    env["PYTHONPATH"] = _pythonpath()
    env.pop("RPC_READING_SERVICE_AUTH_KEY", None)
    return env


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Fleet:
    """examples/launch_local_fleet.sh running in its own process group; ``sigint_ignored``: started
    with SIGINT ignored, as a background job of a non-interactive shell is (a test suite run so too)."""

    def __init__(self, *args: str, sigint_ignored: bool = False):
        self.proc = subprocess.Popen(
            ["bash", str(EXAMPLES / "launch_local_fleet.sh"), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=recipe_env(), start_new_session=True, text=True,
            preexec_fn=_ignore_sigint if sigint_ignored else None,
        )  # fmt: skip
        self.lines = []
        try:
            deadline = time.monotonic() + 120
            while not any(line.startswith("Press Ctrl-C") for line in self.lines):
                assert time.monotonic() < deadline, "fleet did not start in time:\n" + "".join(self.lines)
                line = self.proc.stdout.readline()
                assert line, "fleet script exited early:\n" + "".join(self.lines)
                self.lines.append(line)
        except BaseException:
            self.kill()
            raise
        self.text = "".join(self.lines)

    def value(self, label: str) -> str:
        return re.search(rf"^{label}: (.*)$", self.text, re.M).group(1)

    def service_lines(self):
        return [line.strip() for line in self.lines if line.startswith("RPCReadingService(")]

    def kill(self) -> None:
        """SIGKILL the script's process group (the script and its workers) and reap the script."""
        reap(self.proc)


@pytest.fixture(scope="module")
def fleet():
    """Two local workers from the fleet script, also registered (once it exists) in a store
    at a port that torchrun will serve. Started with SIGINT ignored: Ctrl-C must stop it even so
    (it did not when the test suite ran in the background: its INT trap was ignored too)."""
    store_port = free_port()
    fleet = Fleet("-n", "2", "--store", f"127.0.0.1:{store_port}", "--job", "recipes", sigint_ignored=True)
    fleet.store_port = store_port
    try:
        yield fleet
    finally:
        fleet.kill()


@pytest.mark.timeout(180)
def test_fleet_script_prints_working_service_lines(fleet):
    lines = fleet.service_lines()
    assert len(lines) == 3  # addresses, hostfile, store
    key_file = Path(fleet.value("key file"))
    assert len(key_file.read_text().strip()) == 64 and (key_file.stat().st_mode & 0o077) == 0
    assert len(Path(fleet.value("hostfile")).read_text().split()) == 2
    for line in lines[:2]:
        names = {"RPCReadingService": RPCReadingService, "Hostfile": Hostfile, "StoreDiscovery": StoreDiscovery}
        service = eval(line, names)  # exactly what the user copies
        dl = DataLoader2(IterableWrapper(range(50)).sharding_filter().map(lambda x: -x), reading_service=service)
        try:
            assert sorted(dl) == sorted(-x for x in range(50))
            assert len(set(dl.reading_service.worker_addresses)) == 2
        finally:
            dl.shutdown()


@pytest.mark.timeout(180)
def test_torchrun_recipe_with_torchruns_own_store(fleet):
    """Two trainer ranks under torchrun find the fleet in torchrun's store (MASTER_ADDR:MASTER_PORT)."""
    command = [
        str(VENV_BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(fleet.store_port),
        str(EXAMPLES / "torchrun_train.py"), "--store", "env", "--job", "recipes", "--min-workers", "2",
        "--auth-key-file", fleet.value("key file"), "--items", "300", "--epochs", "2", "--step-ms", "0",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=150, env=recipe_env(), cwd=str(REPO))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("each exactly once: True") == 2, result.stdout
    assert result.stdout.count("rank 1 epoch") == 2


@pytest.mark.timeout(180)
def test_torchrun_recipe_with_a_hostfile(fleet):
    command = [
        str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "torchrun_train.py"),
        "--hostfile", fleet.value("hostfile"), "--sessions", "3", "--auth-key-file", fleet.value("key file"),
        "--items", "200", "--epochs", "1", "--step-ms", "0",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=150, env=recipe_env(), cwd=str(REPO))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "each exactly once: True" in result.stdout


def _group_report(group: int, run_dir: Path) -> str:
    """What is still running in process group ``group`` (pid, state, command line) and the logs in ``run_dir``."""
    lines = []
    for pid in process_group_members(group):
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            lines.append(f"pid {pid} state {state} wchan {wchan}: {command}")
    for log in sorted(run_dir.glob("worker-*.log")) if run_dir.exists() else []:
        lines.append(f"--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}")
    return "\n".join(lines)


@pytest.mark.timeout(60)
def test_fleet_script_stops_everything_on_ctrl_c(fleet):
    """Runs last in this module: Ctrl-C stops the workers and removes the temp dir."""
    run_dir = Path(fleet.value("hostfile")).parent
    assert len(process_group_members(fleet.proc.pid)) >= 3  # the script and two workers
    start = time.monotonic()
    fleet.proc.send_signal(signal.SIGINT)
    try:
        fleet.proc.wait(20)
    except subprocess.TimeoutExpired:
        os.set_blocking(fleet.proc.stdout.fileno(), False)
        output = fleet.proc.stdout.read() or ""
        pytest.fail(f"the script did not stop within 20 s of Ctrl-C; it printed {output!r}\n{_group_report(fleet.proc.pid, run_dir)}")
    took = time.monotonic() - start
    assert fleet.proc.returncode == 130, fleet.proc.stdout.read()
    assert took < 15, (took, fleet.proc.stdout.read())
    group = fleet.proc.pid
    assert wait_until(lambda: not process_group_members(group), 5), process_group_members(group)
    assert not run_dir.exists()


@pytest.mark.timeout(60)
def test_fleet_script_registers_in_a_store_and_cleans_up_on_sigterm(tmp_path):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fleet = Fleet("-n", "1", "--store", f"127.0.0.1:{store.port}", "--job", "sigterm", "--dir", str(tmp_path / "run"))
    try:
        assert wait_until(lambda: registered_workers(store, "sigterm"), 20), "the worker never registered"
        fleet.proc.send_signal(signal.SIGTERM)
        assert fleet.proc.wait(20) == 143
        assert registered_workers(store, "sigterm") == []  # the worker deleted its entry
        assert (tmp_path / "run" / "key").exists()  # --dir is the user's: left in place
    finally:
        fleet.kill()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("python", [None, "/nonexistent/python3"])
def test_fleet_script_without_the_venv_says_to_set_python_or_activate_it(tmp_path, python):
    """No rpc-reading-worker on PATH, and a Python without the package: a hint, not a worker's traceback."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    if python is not None:
        env["PYTHON"] = python
    result = subprocess.run(
        ["bash", str(EXAMPLES / "launch_local_fleet.sh"), "-n", "1"],
        capture_output=True, text=True, timeout=20, env=env, cwd=str(tmp_path), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "rpc-reading-worker is not on PATH" in result.stderr
    assert "PYTHON=/path/to/venv/bin/python" in result.stderr and ".venv/bin/activate" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no run directory was made


# -- recipes that cannot run here --------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_shell_recipes_parse():
    for name in ("launch_local_fleet.sh", "slurm_hetjob.sbatch", "slurm_autoscale_worker.sbatch"):
        command = ["bash", "-n", str(EXAMPLES / name)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=20)
        assert result.returncode == 0, f"{name}: {result.stderr}"
    sbatch = (EXAMPLES / "slurm_hetjob.sbatch").read_text()
    assert "#SBATCH hetjob" in sbatch and "--het-group=0" in sbatch and "--het-group=1" in sbatch
    assert "rpc-reading-worker" in sbatch and "torchrun" in sbatch


# -- Slurm autoscaling: the worker job's script under a stand-in srun, on_scale with stand-in commands --------
FAKE_SLURM = {
    # srun: drop its options, run the task in its place
    "srun": 'while [[ "${1:-}" == --* ]]; do shift; done\nexec "$@"\n',
    # sbatch --parsable: a new pending job named by --job-name; prints its id
    "sbatch": 'echo "sbatch $*" >>"$FAKE_SLURM/log"\nid=$(( $(cat "$FAKE_SLURM/next" 2>/dev/null || echo 100) + 1 ))\n'
              'echo $id >"$FAKE_SLURM/next"\nfor a in "$@"; do [[ $a == --job-name=* ]] && name=${a#--job-name=}; done\n'
              'echo "$id PD $name" >>"$FAKE_SLURM/jobs"\necho $id\n',
    # squeue --name=NAME: "id state" of the jobs of that name
    "squeue": 'for a in "$@"; do [[ $a == --name=* ]] && name=${a#--name=}; done\n'
              'awk -v n="$name" \'$3 == n {print $1, $2}\' "$FAKE_SLURM/jobs"\n',
    # scancel [--signal=TERM] ID: logged; without --signal the job is gone
    "scancel": 'echo "scancel $*" >>"$FAKE_SLURM/log"\n[[ $1 == --signal=* ]] || sed -i "/^$1 /d" "$FAKE_SLURM/jobs"\n',
}


def fake_slurm(tmp_path: Path, *names: str) -> dict:
    """The recipes' environment with stand-ins for the Slurm commands ``names`` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in names:
        (bin_dir / name).write_text("#!/bin/bash\n" + FAKE_SLURM[name])
        (bin_dir / name).chmod(0o755)
    (tmp_path / "jobs").touch()
    env = recipe_env()
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_SLURM=str(tmp_path))
    return env


@pytest.mark.timeout(90)
def test_slurm_autoscale_worker_registers_serves_and_drains(tmp_path):
    """The worker job's script (srun standing in): its server registers in the run's store under the
    run's job, a trainer finds it there and reads from it, and SIGTERM (scancel --signal=TERM) drains it:
    exit 0, its entry deleted."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    key_file = tmp_path / "key"
    key_file.write_text("slurm-autoscale-key")
    key_file.chmod(0o600)
    env = fake_slurm(tmp_path, "srun")
    env.update(RRS_STORE=f"127.0.0.1:{store.port}", RRS_JOB="4242", RRS_KEY_FILE=str(key_file),
               LISTEN_HOST="127.0.0.1", WORKER_PORT="0", WORKER_LOG_LEVEL="INFO")  # fmt: skip
    proc = subprocess.Popen(["bash", str(EXAMPLES / "slurm_autoscale_worker.sbatch")], env=env, cwd=tmp_path,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        assert wait_until(lambda: registered_workers(store, "4242"), 60), "the worker never registered"
        rs = RPCReadingService(workers=StoreDiscovery(f"127.0.0.1:{store.port}", job="4242", timeout=30),
                               auth_key="slurm-autoscale-key", num_workers=1)  # fmt: skip
        with DataLoader2(IterableWrapper(range(20)).sharding_filter(), reading_service=rs) as loader:
            assert sorted(loader) == list(range(20))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert registered_workers(store, "4242") == []
    finally:
        reap(proc)


def load_slurm_autoscale():
    """examples/slurm_autoscale.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("slurm_autoscale", EXAMPLES / "slurm_autoscale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(30)
def test_slurm_autoscale_on_scale_keeps_the_wanted_worker_jobs(tmp_path, monkeypatch):
    """on_scale submits a job per server wanted (named for the run, told the store, job and key);
    shrinking cancels the newest, a pending one at once, a running one by SIGTERM (its server drains),
    not counted again while it drains; stop() drains the rest."""
    for name, value in fake_slurm(tmp_path, "sbatch", "squeue", "scancel").items():
        monkeypatch.setenv(name, value)
    log, jobs_file = tmp_path / "log", tmp_path / "jobs"
    jobs = load_slurm_autoscale().SlurmWorkerJobs(store="trainer:29700", run="77", key_file="/shared/rrs-77/key")
    jobs(3, None)
    submitted = log.read_text().splitlines()
    assert len(submitted) == 3 and all(
        "--job-name=rrs-worker-77" in line and "RRS_STORE=trainer:29700,RRS_JOB=77,RRS_KEY_FILE=/shared/rrs-77/key" in line
        and line.endswith("slurm_autoscale_worker.sbatch") for line in submitted
    ), submitted  # fmt: skip
    jobs_file.write_text("101 R rrs-worker-77\n102 R rrs-worker-77\n103 PD rrs-worker-77\n999 R rrs-worker-other\n")
    jobs(1, None)
    assert log.read_text().splitlines()[3:] == ["scancel 103", "scancel --signal=TERM 102"]
    jobs(1, None)  # 102 drains (still running): not cancelled again, nothing submitted
    jobs(2, None)  # one more server: 102 does not count
    assert log.read_text().splitlines()[5:6] == [submitted[0]] and len(log.read_text().splitlines()) == 6
    jobs.stop()
    assert log.read_text().splitlines()[6:] == ["scancel 104", "scancel --signal=TERM 101"]


def _load_yaml_documents(path: Path):
    try:
        import yaml
    except ImportError:
        yaml = None
    if yaml is not None:
        return list(yaml.safe_load_all(path.read_text()))
    # Not in this venv: use another interpreter that has PyYAML, if any.
    import json

    for python in filter(None, (shutil.which("python3"), "/usr/bin/python3")):
        code = "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))"
        result = subprocess.run([python, "-c", code, str(path)], capture_output=True, text=True, timeout=20)
        if result.returncode == 0:
            return json.loads(result.stdout)
    pytest.skip("PyYAML is not available")


@pytest.mark.timeout(30)
def test_kubernetes_manifest():
    docs = [d for d in _load_yaml_documents(EXAMPLES / "k8s" / "workers.yaml") if d]
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert set(by_name) == {
        ("Secret", "rrs-auth-key"), ("Deployment", "rrs-store"), ("Service", "rrs-store"),
        ("Deployment", "rrs-workers"), ("Service", "rrs-workers"),
    }  # fmt: skip
    pod = by_name[("Deployment", "rrs-workers")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    mount = container["volumeMounts"][0]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "rrs-auth-key"
    assert f"--auth-key-file={mount['mountPath']}/key" in container["args"]
    assert container["readinessProbe"]["tcpSocket"]["port"] == container["ports"][0]["name"]
    assert "--host=0.0.0.0" in container["args"] and "--advertise-host=$(POD_IP)" in container["args"]
    assert by_name[("Service", "rrs-workers")]["spec"]["clusterIP"] == "None"
    deployment = by_name[("Deployment", "rrs-workers")]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("version", ["1.25.0", "1.37.0"])  # the oldest and newest schemas kubernetes-validate bundles
def test_kubernetes_manifest_matches_the_kubernetes_schema(version):
    """Every document of workers.yaml against Kubernetes' own OpenAPI schema, strictly (no unknown fields)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra)")
    docs = [d for d in _load_yaml_documents(EXAMPLES / "k8s" / "workers.yaml") if d]
    assert len(docs) == 5
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError
    # ... and the validator does catch a mistake of the kind it is here for.
    worker = next(d for d in docs if d["metadata"]["name"] == "rrs-workers" and d["kind"] == "Deployment")
    worker["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["tcpSocket"]["prot"] = "rrs"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, version, strict=True)
