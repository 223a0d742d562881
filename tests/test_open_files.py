"""A trainer's open files: one with more than 1,024 descriptors open (a dataset's files, a raised
limit) sets up and reads its workers, local and remote; one at a low limit maps the shared-memory
segments of its local workers without a descriptor each. Each trainer is a process of its own,
which sets its limit and opens its files before it imports the package's loaders."""

from __future__ import annotations

import resource

import pytest
from _server_helpers import python_run, subprocess_env

from rpc_reading_service.serialization import SHARED_MEMORY_MIN_BYTES

pytestmark = pytest.mark.timeout(60)

TRAINER = """
import os, resource, sys
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range({held})]
import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from rpc_reading_service import RPCReadingService

def make(index):
    return torch.full(({size},), index % 251, dtype=torch.uint8)

workers = {workers!r}
remote = {{"workers": workers, "auth_key": {key!r}}} if workers else {{}}
service = RPCReadingService(num_workers=2, timeout=20.0, **remote)
loader = DataLoader2(IterableWrapper(range({items})).sharding_filter().map(make), reading_service=service)
seen, peak = [], 0
for count, item in enumerate(loader):
    assert int(item[0]) == int(item[-1])
    seen.append(int(item[0]))
    if count % 200 == 0:
        peak = max(peak, len(os.listdir("/proc/self/fd")))
loader.shutdown()
assert sorted(seen) == sorted(index % 251 for index in range({items})), "items lost or changed"
print("ok", peak - len(held))
"""


def _run_trainer(tmp_path, soft: int, held: int, size: int, items: int, workers=None, key=None) -> int:
    """Run the trainer; the descriptors it held at its peak beyond its ``held`` files."""
    code = TRAINER.format(soft=soft, held=held, size=size, items=items, workers=workers or [], key=key)
    done = python_run(["-c", code], subprocess_env(PYTHONWARNINGS="ignore"), str(tmp_path), timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    status, peak = done.stdout.split()
    assert status == "ok", done.stdout
    return int(peak)


def test_a_trainer_maps_many_segments_with_few_descriptors(tmp_path):
    # 64 KiB items, two local workers: a credit window of segments each, hundreds mapped in the
    # trainer at once. A mapping keeps no descriptor open, so a soft limit of 256 holds them all.
    assert _run_trainer(tmp_path, soft=256, held=0, size=SHARED_MEMORY_MIN_BYTES, items=3000) < 100


HARD_LIMIT = resource.getrlimit(resource.RLIMIT_NOFILE)[1]


@pytest.mark.skipif(HARD_LIMIT < 2048, reason="a hard limit under 2,048 open files")
@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_trainer_with_over_1024_open_files_reads_its_workers(tmp_path, fresh_server, where):
    # Its sockets get numbers past 1,024, which select() cannot wait on (setup failed with
    # "closed the session during setup"); every wait is a poll().
    server = fresh_server() if where == "remote" else None
    workers, key = ([server.address], server.key) if server else (None, None)
    _run_trainer(tmp_path, soft=2048, held=1100, size=1024, items=2000, workers=workers, key=key)
