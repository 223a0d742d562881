"""Autoscale on Slurm: ``on_scale`` submits one worker job per server wanted and drains the rest.

Each worker job runs ``examples/slurm_autoscale_worker.sbatch`` (one ``rpc-reading-worker``,
registered in the run's TCPStore under the run's job id), named ``rrs-worker-<run>`` so that the
jobs of a run are found with ``squeue --name``. Growing submits jobs; shrinking cancels the newest:
a pending one with ``scancel``, a running one with ``scancel --signal=TERM`` (its server drains, its
sessions' work goes to the others). The jobs are looked up with each call, so the pickled copy of the
reading service that DataLoader2 runs and the caller's object act on the same jobs; a job sent
SIGTERM is running until its server has drained, and is not counted again by the object that sent it.

In the trainer's job (the run directory on a shared file system, as in slurm_hetjob.sbatch)::

    run = os.environ["SLURM_JOB_ID"]
    jobs = SlurmWorkerJobs(store=f"{socket.gethostname()}:29700", run=run, key_file=f"{run_dir}/key")
    jobs(1)  # the first server, before the trainer waits for it
    rs = RPCReadingService(
        workers=StoreDiscovery("0.0.0.0:29700", job=run, host_store=True), num_workers=1,
        auth_key=open(f"{run_dir}/key").read().strip(),
        autoscale=Autoscale(min_sessions=1, max_sessions=32, sessions_per_server=1, on_scale=jobs),
    )
    try:
        ...  # train
    finally:
        jobs.stop()
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Any, List, Optional, Sequence, Tuple

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slurm_autoscale_worker.sbatch")

log = logging.getLogger(__name__)


class SlurmWorkerJobs:
    """``on_scale`` for Slurm: keep ``wanted_servers`` worker jobs of this run submitted.

    Args:
        store: ``HOST:PORT`` of the run's TCPStore, as the worker nodes reach it.
        run: The job name the workers register under (the trainer's ``StoreDiscovery(job=...)``).
        key_file: The run's key file, on a file system the worker nodes share.
        script: The worker job's batch script.
        sbatch_args: More ``sbatch`` options (``--partition=...``, ``--time=...``).
    """

    def __init__(
        self, store: str, run: str, key_file: str, script: str = WORKER_SCRIPT, sbatch_args: Sequence[str] = ()
    ) -> None:
        self.store, self.run, self.key_file = store, run, key_file
        self.script, self.sbatch_args = script, list(sbatch_args)
        self.draining: set = set()

    @property
    def name(self) -> str:
        """The Slurm job name of this run's worker jobs."""
        return f"rrs-worker-{self.run}"

    def jobs(self) -> List[Tuple[str, str]]:
        """``(job id, state)`` of this run's worker jobs not ended, oldest first (``PD``: pending)."""
        listed = subprocess.run(["squeue", "--noheader", f"--name={self.name}", "--format=%i %t"],
                                check=True, capture_output=True, text=True).stdout  # fmt: skip
        found = [tuple(line.split()[:2]) for line in listed.splitlines() if len(line.split()) >= 2]
        return sorted(found, key=lambda job: int(job[0].split("_")[0]))  # type: ignore[misc]

    def __call__(self, wanted_servers: int, stats: Optional[Any] = None) -> None:
        """Submit or cancel worker jobs until ``wanted_servers`` are pending or running."""
        jobs = [job for job in self.jobs() if job[0] not in self.draining and job[1] in ("PD", "CF", "R")]
        for _ in range(wanted_servers - len(jobs)):
            exports = f"ALL,RRS_STORE={self.store},RRS_JOB={self.run},RRS_KEY_FILE={self.key_file}"
            command = ["sbatch", "--parsable", f"--job-name={self.name}", f"--export={exports}", *self.sbatch_args]
            submitted = subprocess.run([*command, self.script], check=True, capture_output=True, text=True).stdout
            log.info("submitted worker job %s for run %s", submitted.strip(), self.run)
        for job, state in reversed(jobs[max(wanted_servers, 0):]):
            self.cancel(job, state)

    def cancel(self, job: str, state: str) -> None:
        """Cancel worker job ``job``: at once if pending, else by SIGTERM, which its server drains on."""
        how = [] if state == "PD" else ["--signal=TERM"]
        subprocess.run(["scancel", *how, job], check=True, capture_output=True)
        if how:
            self.draining.add(job)
        log.info("cancelled worker job %s (%s) of run %s", job, "draining" if how else "pending", self.run)

    def stop(self) -> None:
        """Drain every worker job of this run (at the end of the training)."""
        self(0)
