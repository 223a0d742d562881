"""End to end: against torchdata's MultiProcessingReadingService, with trainers that are
``__main__`` scripts or ``torch.multiprocessing.spawn`` children, with user modules the
workers cannot import, and under torch.distributed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

import pytest
from _server_forkserver import forked_python
from _server_helpers import free_port, python_run, reap, remote, run_epochs, subprocess_env
from torchdata.dataloader2 import DataLoader2, MultiProcessingReadingService
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import RPCReadingService, WorkerStartupError

pytestmark = pytest.mark.timeout(90)


def double(x):
    return 2 * x


# -- against torchdata's MultiProcessingReadingService ------------------------------------------
def test_same_items_as_multiprocessing_reading_service(worker_server):
    shuffled = IterableWrapper(range(60)).shuffle().sharding_filter().map(double)
    ordered = IterableWrapper(range(41)).sharding_filter().map(double)
    mprs = run_epochs(shuffled, MultiProcessingReadingService(num_workers=2), seed=5, n_epochs=1)
    ours = run_epochs(shuffled, remote(worker_server), n_epochs=2, seed=5)
    assert sorted(mprs[0]) == sorted(ours[0]) == sorted(ours[1]) == [2 * x for x in range(60)]
    # Both are reproducible under the same seed.
    assert run_epochs(shuffled, MultiProcessingReadingService(num_workers=2), seed=5, n_epochs=1) == mprs
    assert run_epochs(shuffled, remote(worker_server), n_epochs=2, seed=5) == ours
    # Without a shuffle both merge the workers round-robin: identical order, not just items.
    mprs_ordered = run_epochs(ordered, MultiProcessingReadingService(num_workers=2), n_epochs=1)
    ours_ordered = run_epochs(ordered, remote(worker_server), n_epochs=1)
    assert ours_ordered == mprs_ordered == [[2 * x for x in range(41)]]


# -- functions the workers cannot import ----------------------------------------------------------
TRAINER_SCRIPT = '''
import json
import sys
import warnings

warnings.simplefilter("ignore")
import torch.multiprocessing as mp
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import RPCReadingService


def triple_plus(x):
    """Defined in the trainer's script: __main__ here, __mp_main__ in a spawn child."""
    return (__name__, 3 * x + OFFSET)


OFFSET = 1


def load(address, key):
    dp = IterableWrapper(range(10)).sharding_filter().map(triple_plus)
    rs = RPCReadingService(num_workers=2, workers=[address], auth_key=key)
    with DataLoader2(dp, reading_service=rs) as dl:
        return list(dl)


def child(index, address, key):
    print(json.dumps({"spawn": load(address, key)}), flush=True)


if __name__ == "__main__":
    address, key = sys.argv[1:3]
    print(json.dumps({"main": load(address, key)}), flush=True)
    mp.spawn(child, args=(address, key), nprocs=1)
'''


def test_functions_from_main_script_and_spawn_child(worker_server, tmp_path):
    script = tmp_path / "trainer_script.py"
    script.write_text(TRAINER_SCRIPT)
    # ``python trainer_script.py``, forked from the tests' forkserver (torch imported already); its
    # child is a real ``spawn`` child, reaped with it (a session of their own).
    args = [str(script), worker_server.address, worker_server.key]
    done = python_run(args, subprocess_env(), str(tmp_path), timeout=80)
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == 0, stderr[-3000:]
    outputs = {}
    for line in stdout.splitlines():
        outputs.update(json.loads(line))
    expected = [3 * x + 1 for x in range(10)]
    # The functions ran on the workers by value, keeping the module name they were defined in.
    assert outputs["main"] == [["__main__", y] for y in expected]
    assert outputs["spawn"] == [["__mp_main__", y] for y in expected]


USER_MODULE = '''
SCALE = 4


class Scaled:
    def __init__(self, value):
        self.value = value * SCALE


def scale(x):
    return Scaled(x).value
'''


def test_pickle_by_value_for_a_module_workers_cannot_import(worker_server, tmp_path, monkeypatch):
    name = f"rrs_user_module_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # on the trainer's path only
    module = __import__(name)
    try:
        dp = IterableWrapper(range(8)).sharding_filter().map(module.scale)
        # By reference (the default), the workers fail to import the module...
        with pytest.raises(WorkerStartupError, match=f"No module named '{name}'"):
            run_epochs(dp, remote(worker_server), n_epochs=1)
        # ...by value, its function and the class and global it uses travel with the graph.
        by_value = remote(worker_server, pickle_by_value=[module])
        assert run_epochs(dp, by_value, n_epochs=1) == [[4 * x for x in range(8)]]
    finally:
        sys.modules.pop(name, None)


# -- torch.distributed --------------------------------------------------------------------------
def distributed_trainer(rank, world_size, port, address, key, out_dir):
    import torch.distributed as dist
    from torchdata.dataloader2 import DistributedReadingService, SequentialReadingService

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = {}
        dp = IterableWrapper(range(24)).shuffle().sharding_filter()
        # No dl.seed(): the shuffle seed must still agree across ranks (shared over gloo).
        with DataLoader2(dp, reading_service=remote_at(address, key)) as dl:
            results["rpc"] = [list(dl) for _ in range(2)]
        sequential = SequentialReadingService(DistributedReadingService(), remote_at(address, key))
        with DataLoader2(dp, reading_service=sequential) as dl:
            results["sequential"] = [list(dl) for _ in range(2)]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(results, handle)
    finally:
        dist.destroy_process_group()


def remote_at(address, key):
    return RPCReadingService(num_workers=2, workers=[address], auth_key=key)


# rank, world size, port (numbers), address, key, directory
RANK = "import sys, test_end_to_end as t; t.distributed_trainer(*map(int, sys.argv[1:4]), *sys.argv[4:])"


def test_distributed_ranks_get_disjoint_global_shards(worker_server, tmp_path):
    world_size = 2
    args = [str(world_size), str(free_port()), worker_server.address, worker_server.key, str(tmp_path)]
    ranks = []  # each rank a trainer forked from the tests' forkserver (torch imported already)
    try:
        for rank in range(world_size):
            with open(tmp_path / f"rank{rank}.log", "wb") as log:
                argv, fd = ["-c", RANK, str(rank), *args], log.fileno()
                ranks.append(forked_python(argv, subprocess_env(), str(tmp_path), fd, stdout_fd=fd))
            assert ranks[-1] is not None, "the forkserver runs the tests' interpreters"
        deadline = time.monotonic() + 80
        for rank, proc in enumerate(ranks):
            code = proc.wait(max(0.1, deadline - time.monotonic()))
            assert code == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    finally:
        for proc in ranks:
            if proc is not None:
                reap(proc)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    for mode in ("rpc", "sequential"):
        for epoch in range(2):
            r0, r1 = ranks[0][mode][epoch], ranks[1][mode][epoch]
            assert len(r0) == len(r1) == 12
            assert not set(r0) & set(r1), f"{mode} epoch {epoch}: ranks overlap"
            assert sorted(r0 + r1) == list(range(24))
        assert ranks[0][mode][0] != ranks[0][mode][1]  # epochs differ
