"""A single-node Slurm of Debian's ``slurm-wlm`` and ``munge``, made and removed by a test.

:meth:`MiniSlurm.start` writes everything into one private temporary directory: a munge
key and socket (``munged`` runs with its own, so a system munge is neither used nor
touched), ``slurm.conf``, state, spool, logs and pid files. It runs ``munged``, one
``slurmctld`` and two ``slurmd`` as two nodes of this host: ``cpu0`` in partition ``cpu``
and ``localhost`` (the name resolves to 127.0.0.1 everywhere: the trainer's rendezvous
host) in partition ``gpu``, with eight GPUs declared as generic resources without
devices. A heterogeneous job's two components then schedule the way they do on a real
cluster, one per partition. Every daemon talks on 127.0.0.1, on ports the OS picked.

:meth:`MiniSlurm.stop` cancels the jobs, kills whatever still carries this Slurm's
``SLURM_CONF`` in its environment (job steps, their tasks and ``slurmstepd``, which
Slurm detaches from the daemons), stops the daemons and removes the directory.

Slurm's client commands find this Slurm through :attr:`MiniSlurm.env` (``SLURM_CONF``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from test_launch_recipes import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "srun", "sinfo")
NODES = {"cpu0": "cpu", "localhost": "gpu"}  # node name -> partition
GPUS_PER_NODE = 8
COMMAND_TIMEOUT = 20.0


def unavailable_reason() -> Optional[str]:
    """Why a Slurm cannot be started here (None when it can, as far as can be told without trying)."""
    if not sys.platform.startswith("linux"):
        return "Slurm needs Linux"
    if os.geteuid() != 0:
        return "running slurmd (and munged for it) needs root"
    missing = [tool for tool in DAEMONS + CLIENTS if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (Debian: apt-get install slurm-wlm munge; "
                "`make test-slurm` does that as root)")  # fmt: skip
    return None


def _environment(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


class SlurmUnavailable(RuntimeError):
    """Slurm's daemons did not come up here (the reason and their logs are in the message)."""


class MiniSlurm:
    """munged, slurmctld and two slurmd on this host, configured in a temporary directory."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rrs-slurm-"))
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.daemons: Dict[str, subprocess.Popen] = {}

    @classmethod
    def start(cls, timeout: float = 60.0) -> "MiniSlurm":
        """Start a Slurm and wait until both nodes are idle; stops it again if that fails."""
        slurm = cls()
        try:
            slurm._start(timeout)
        except BaseException:
            slurm.stop()
            raise
        return slurm

    def _start(self, timeout: float) -> None:
        os.chmod(self.root, 0o700)  # munged refuses a socket directory others can write
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        self.socket = self.root / "munge.socket"
        self._write_config()
        self._daemon("munged", [
            "munged", "--foreground", "--force", f"--socket={self.socket}", f"--key-file={key}",
            f"--log-file={self.root / 'munged.log'}", f"--pid-file={self.root / 'munged.pid'}",
            f"--seed-file={self.root / 'munged.seed'}",
        ])  # fmt: skip
        self._wait(lambda: self.socket.exists(), timeout, "munged did not create its socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in NODES:
            self._daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self._nodes_idle, timeout, "the nodes did not become idle")

    def _write_config(self) -> None:
        root = self.root
        nodes = "".join(
            f"NodeName={node} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={free_port()} "
            f"CPUs=2 RealMemory=2000 State=UNKNOWN{f' Gres=gpu:{GPUS_PER_NODE}' if part == 'gpu' else ''}\n"
            for node, part in NODES.items()
        )
        partitions = "".join(
            f"PartitionName={part} Nodes={node} MaxTime=INFINITE State=UP OverSubscribe=FORCE:4\n"
            for node, part in NODES.items()
        )
        # Slurm counts a GPU per device file; any file will do for a job that uses none.
        for index in range(GPUS_PER_NODE):
            (root / f"gpu{index}").touch()
        gpu_nodes = ",".join(node for node, part in NODES.items() if part == "gpu")
        (root / "gres.conf").write_text(f"NodeName={gpu_nodes} Name=gpu File={root}/gpu[0-{GPUS_PER_NODE - 1}]\n")
        for directory in ["state", *(f"spool-{node}" for node in NODES)]:
            (root / directory).mkdir()
        (root / "plugstack.conf").write_text("")
        (root / "cgroup.conf").write_text("")
        self.conf.write_text(
            f"ClusterName=rrstest\n"
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)\n"
            f"SlurmctldPort={free_port()}\n"
            f"SlurmUser=root\nSlurmdUser=root\n"
            f"AuthType=auth/munge\nAuthInfo=socket={self.socket}\nCredType=cred/munge\n"
            f"ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nMpiDefault=none\n"
            f"SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nGresTypes=gpu\n"
            f"JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
            f"ReturnToService=2\nKillWait=5\n"
            f"SchedulerParameters=bf_interval=1\n"  # heterogeneous jobs start on a backfill pass
            f"StateSaveLocation={root / 'state'}\nSlurmdSpoolDir={root / 'spool-%n'}\n"
            f"SlurmctldPidFile={root / 'slurmctld.pid'}\nSlurmdPidFile={root / 'slurmd-%n.pid'}\n"
            f"SlurmctldLogFile={root / 'slurmctld.log'}\nSlurmdLogFile={root / 'slurmd-%n.log'}\n"
            f"PlugStackConfig={root / 'plugstack.conf'}\n"
            f"{nodes}{partitions}"
        )

    def _daemon(self, name: str, argv: List[str]) -> None:
        log = open(self.root / f"{name}.out", "wb")
        with log:
            self.daemons[name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,
            )  # fmt: skip

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = {name: proc.returncode for name, proc in self.daemons.items() if proc.poll() is not None}
            if dead or time.monotonic() > deadline:
                raise SlurmUnavailable(f"{what} (exited: {dead or 'none'}); logs:\n{self.logs()}")
            time.sleep(0.2)

    def _nodes_idle(self) -> bool:
        states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split("\n")
        idle = {line.split()[0] for line in states if line.strip().endswith("idle")}
        return idle == set(NODES)

    def run(
        self, *argv: str, check: bool = True, timeout: float = COMMAND_TIMEOUT,
        env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None,
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this Slurm (``env``: an environment with :attr:`env`'s
        SLURM_CONF; ``cwd``: for sbatch, the job's $SLURM_SUBMIT_DIR)."""
        return subprocess.run(
            argv, capture_output=True, text=True, env=env or self.env, timeout=timeout, check=check, cwd=cwd
        )  # fmt: skip

    def logs(self) -> str:
        """The tails of every daemon's log, for a failure message."""
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            with contextlib.suppress(OSError):
                parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def processes(self) -> List[int]:
        """Pids of live processes with this Slurm's SLURM_CONF in their environment (daemons, steps, tasks)."""
        marker = f"SLURM_CONF={self.conf}".encode() + b"\0"
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid() and marker in _environment(int(entry)):
                found.append(int(entry))
        return found

    def stop(self) -> None:
        """Cancel every job, kill what is left of them, stop the daemons, remove the directory."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.run("scancel", "--full", "--user=root", check=False, timeout=10)
                deadline = time.monotonic() + 10
                while self.run("squeue", "-h", check=False, timeout=10).stdout.strip():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
        for proc in self.daemons.values():
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in self.daemons.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in self.processes():  # detached slurmstepd and the tasks they ran
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(self.root, ignore_errors=True)
