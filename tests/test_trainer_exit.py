"""A training script that exits without ``dl.shutdown()``: its local workers stop with it, silently.

DataLoader2 finalizes its reading service in ``shutdown()`` or ``__del__``; at interpreter
exit ``__del__`` runs late (after ``concurrent.futures`` refuses new work: "cannot schedule
new futures after interpreter shutdown") or never (a reference cycle). The reading service
stops its workers at exit itself: nothing is printed, and no worker process outlives the
trainer (not even until the server's parent watchdog notices, which prints a warning).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _server_helpers import process_alive, reap, spawn_python

SCRIPT = """
import sys
import time
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from rpc_reading_service import RPCReadingService


def start():
    service = RPCReadingService(num_workers=2, in_order={in_order})
    dl = DataLoader2(IterableWrapper(range(100_000)).sharding_filter(), reading_service=service)
    it = iter(dl)
    taken = [next(it) for _ in range(10)]
    rs = dl.reading_service
    # Sessions start as each is set up: first-ready's 10 items may all come from one worker.
    deadline = time.monotonic() + 20
    while any(worker.pid is None for worker in rs.stats().workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    print(rs._local_server.pid, *(worker.pid for worker in rs.stats().workers), flush=True)
    return dl, it


dl, it = start()
if "{keep}" == "cycle":  # only the cycle collector could free it, and it does not run at exit
    cycle = [dl, it]
    cycle.append(cycle)
    del dl, it
# exits here, mid-epoch, without dl.shutdown()
"""

@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep, in_order", [("global", True), ("cycle", False)])
def test_exit_without_shutdown_stops_the_workers_silently(tmp_path: Path, keep: str, in_order: bool):
    trainer = spawn_python(SCRIPT.format(keep=keep, in_order=in_order), tmp_path)
    try:
        line = trainer.stdout.readline().decode()
        pids = [int(pid) for pid in line.split()]
        assert len(pids) == 3, f"trainer printed {line!r}; stderr: {_stderr(tmp_path)}"
        assert trainer.wait(30) == 0, _stderr(tmp_path)
        # At once: the server's own watchdog would stop it too, but only ~0.5 s later, and loudly.
        survivors = [pid for pid in pids if process_alive(pid)]
        assert not survivors, f"worker processes outlived the trainer: {survivors} of {pids}"
    finally:
        reap(trainer)  # SIGKILLs its process group: any surviving server and session with it
    assert _stderr(tmp_path) == ""


SHUT_DOWN_SCRIPT = """
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from rpc_reading_service import RPCReadingService

service = RPCReadingService(num_workers=2)  # a global: finalized only at interpreter exit
dl = DataLoader2(IterableWrapper(range(100)).sharding_filter(), reading_service=service)
print(len(list(dl)), flush=True)
dl.shutdown()
"""


@pytest.mark.timeout(60)
def test_a_reading_service_kept_in_a_global_is_finalized_silently_at_exit(tmp_path: Path):
    """DataLoader2 runs a copy of the service it is given: the user's own object, never started,
    is finalized at interpreter exit, when the modules' names are already cleared."""
    trainer = spawn_python(SHUT_DOWN_SCRIPT, tmp_path)
    try:
        assert trainer.stdout.readline() == b"100\n", _stderr(tmp_path)
        assert trainer.wait(30) == 0, _stderr(tmp_path)
    finally:
        reap(trainer)
    assert _stderr(tmp_path) == ""


def _stderr(tmp_path: Path) -> str:
    (log,) = tmp_path.glob("trainer-*.log")
    return log.read_text(errors="replace")
