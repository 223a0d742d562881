"""Two trainer processes (torch.distributed, gloo) sharing the same worker servers.

The test starts two ``python -m rpc_reading_service.worker --port 0`` servers (keyed through
``RPC_READING_SERVICE_AUTH_KEY``), then starts two trainers (forked from the tests'
forkserver) that form a gloo process group on a free loopback port. Each trainer runs every
scenario below on the same servers and prints its items; the test checks them:

- ``RPCReadingService`` alone under the initialised process group: the global shard is
  ``dist_rank * N + worker_rank`` of ``world * N``, disjoint across ranks, union = dataset.
- ``SequentialReadingService(DistributedReadingService(), RPCReadingService(...))``: the same,
  plus ``fullsync`` (kept in the trainer) makes every rank yield the same number of items.
- ``RPCReadingService`` alone with a graph that ends in ``.fullsync()`` itself.
- Each rank seeds its DataLoader2 differently (or not at all): the shuffle before the
  sharding point must still use one seed for the whole job, or items would repeat or go missing.
- Mid-epoch checkpoint/resume on both ranks equals the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import selectors
import subprocess
import time
import traceback
from datetime import timedelta
from typing import Any

import pytest
from _server_forkserver import forked_python
from _server_helpers import free_port, reap, start_server, subprocess_env

WORLD = 2
WORKERS_PER_TRAINER = 2
EPOCHS = 2


def tag(x: int):
    """Randomness after the sharding point (per-worker seeds)."""
    return (x, random.randint(0, 10**9))


def make_graph(n: int, fullsync: bool = False):
    from torchdata.datapipes.iter import IterableWrapper

    dp = IterableWrapper(range(n)).shuffle().sharding_filter().map(tag)
    return dp.fullsync(timeout=30) if fullsync else dp


def make_rs(kind: str, addresses: list[str], key: str):
    from torchdata.dataloader2 import DistributedReadingService, SequentialReadingService

    from rpc_reading_service import RPCReadingService

    rs = RPCReadingService(num_workers=WORKERS_PER_TRAINER, workers=addresses, auth_key=key, timeout=20.0)
    if kind == "sequential":
        return SequentialReadingService(DistributedReadingService(timeout=30), rs)
    return rs


# name -> (reading service kind, dataset size, graph ends in fullsync, per-rank seed or None)
SCENARIOS: dict[str, tuple] = {
    "rpc-alone": ("rpc", 40, False, "per-rank"),
    "rpc-alone-uneven-unseeded": ("rpc", 43, False, None),
    "rpc-alone-graph-fullsync": ("rpc", 43, True, "per-rank"),
    "sequential-drs": ("sequential", 40, False, "per-rank"),
    "sequential-drs-uneven": ("sequential", 43, False, None),
}
# name -> (reading service kind, dataset size, cut: items into epoch 0, or None: after epoch 0)
CHECKPOINT_SCENARIOS: dict[str, tuple] = {
    "checkpoint-rpc-alone": ("rpc", 40, 7),
    "checkpoint-sequential-drs": ("sequential", 40, 7),
    # fullsync ends the epoch at 21 items on both ranks; rank 0's stream still holds its 22nd
    "checkpoint-sequential-drs-uneven-last-item": ("sequential", 43, 21),
    "checkpoint-sequential-drs-uneven-between-epochs": ("sequential", 43, None),
}
CHECKPOINT_SEED = 99


def _run_epochs(dl, epochs: int) -> list[list[Any]]:
    return [list(dl) for _ in range(epochs)]


def _scenario(name: str, addresses: list[str], key: str, rank: int) -> Any:
    from torchdata.dataloader2 import DataLoader2

    kind, n, fullsync, seeding = SCENARIOS[name]
    dl = DataLoader2(make_graph(n, fullsync), reading_service=make_rs(kind, addresses, key))
    if seeding == "per-rank":
        dl.seed(1000 + rank)  # deliberately different: the job must still agree on one shuffle
    try:
        return _run_epochs(dl, EPOCHS)
    finally:
        dl.shutdown()


def _checkpoint_scenario(name: str, addresses: list[str], key: str, rank: int) -> Any:
    from torchdata.dataloader2 import DataLoader2

    kind, n, cut = CHECKPOINT_SCENARIOS[name]
    dl = DataLoader2(make_graph(n), reading_service=make_rs(kind, addresses, key))
    dl.seed(CHECKPOINT_SEED)
    try:
        uninterrupted = _run_epochs(dl, EPOCHS)
    finally:
        dl.shutdown()

    dl = DataLoader2(make_graph(n), reading_service=make_rs(kind, addresses, key))
    dl.seed(CHECKPOINT_SEED)
    try:
        if cut is None:
            before = list(dl)
        else:
            it = iter(dl)
            before = [next(it) for _ in range(cut)]
        time.sleep(0.3)  # a training step: trainer-side prefetchers (fullsync) run ahead meanwhile
        state = dl.state_dict()
    finally:
        dl.shutdown()
    dl = DataLoader2.from_state(state, make_rs(kind, addresses, key))
    try:
        if cut is None:
            resumed = [before] + _run_epochs(dl, EPOCHS - 1)
        else:
            resumed = [before + list(dl)] + _run_epochs(dl, EPOCHS - 1)
    finally:
        dl.shutdown()
    return {"uninterrupted": uninterrupted, "resumed": resumed, "epoch_seed": _epoch_seed(state)}


def _other_rank_scenario(addresses: list[str], key: str, rank: int) -> Any:
    """Resuming from the other rank's state is refused (it would repeat that rank's shards)."""
    import torch.distributed as dist
    from torchdata.dataloader2 import DataLoader2

    from rpc_reading_service import ConfigurationError

    dl = DataLoader2(make_graph(40), reading_service=make_rs("sequential", addresses, key))
    dl.seed(CHECKPOINT_SEED)
    try:
        it = iter(dl)
        next(it)
        state = dl.state_dict()
    finally:
        dl.shutdown()
    states: list[Any] = [None] * WORLD
    dist.all_gather_object(states, state)
    dl = DataLoader2.from_state(states[1 - rank], make_rs("sequential", addresses, key))
    try:
        iter(dl)
    except ConfigurationError as exc:
        return str(exc)
    finally:
        dl.shutdown()
    return None


def _epoch_seed(state: dict) -> int:
    """The epoch seed in our reading service's checkpoint (inside SequentialReadingService's list)."""
    raw = state["reading_service_state"]
    if not raw.startswith(b"{"):
        raw = [s for s in pickle.loads(raw) if s][-1]  # SequentialReadingService: [b"" (DRS), ours]
    return json.loads(raw)["epoch_seed"]


def trainer(
    rank: int, port: int, addresses: list[str], key: str, names: list[str], results, hang_after: float
) -> None:
    """One trainer process: join the process group, run each scenario, report on ``results``."""
    import faulthandler

    import torch.distributed as dist

    faulthandler.dump_traceback_later(hang_after)  # stacks on stderr if this trainer hangs

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        for name in names:
            try:
                if name in SCENARIOS:
                    outcome = ("ok", _scenario(name, addresses, key, rank))
                elif name == "resume-other-rank-refused":
                    outcome = ("ok", _other_rank_scenario(addresses, key, rank))
                else:
                    outcome = ("ok", _checkpoint_scenario(name, addresses, key, rank))
            except BaseException:  # noqa: BLE001 - report, the test decides
                outcome = ("error", traceback.format_exc())
            results.put((rank, name, outcome))
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two keyed worker servers (one key), shared by both trainers."""
    tmp = tmp_path_factory.mktemp("fleet")
    key = os.urandom(16).hex()
    servers = []
    try:
        for _ in range(2):
            servers.append(start_server(tmp, key=key))
        yield [s.address for s in servers], key, servers
    finally:
        for server in servers:
            server.stop()


class PrintedResults:
    """A trainer's ``results``: each ``(rank, name, outcome)`` a line of stdout, pickled (hex)."""

    def put(self, result: tuple) -> None:
        print(RESULT_PREFIX + pickle.dumps(result).hex(), flush=True)


RESULT_PREFIX = "result "
TRAINER = (
    "import json, sys, test_multi_trainer as t; a = sys.argv; t.trainer(int(a[1]), int(a[2]), "
    "json.loads(a[3]), a[4], json.loads(a[5]), t.PrintedResults(), float(a[6]))"
)


def run_trainers(fleet, names: list[str], timeout: float, workdir) -> dict[str, dict[int, Any]]:
    """Start the two trainers (forked from the tests' forkserver, torch imported already), collect
    ``{scenario: {rank: outcome}}`` within ``timeout`` seconds."""
    addresses, key, _ = fleet
    port = free_port()
    procs = []
    collected: dict[str, dict[int, Any]] = {name: {} for name in names}
    deadline = time.monotonic() + timeout
    try:
        for rank in range(WORLD):
            argv = ["-c", TRAINER, str(rank), str(port), json.dumps(addresses), key, json.dumps(names)]
            argv.append(str(timeout - 5))  # the trainer's own bound: then it prints its stacks
            with open(workdir / f"trainer{rank}.log", "wb") as log:
                procs.append(forked_python(argv, subprocess_env(), str(workdir), log.fileno()))
            assert procs[-1] is not None, "the forkserver runs the tests' interpreters"
        expected, received = WORLD * len(names), 0
        with selectors.DefaultSelector() as selector:
            for proc in procs:
                selector.register(proc.stdout.fileno(), selectors.EVENT_READ, data=[b""])
            while received < expected:
                for line in _read_lines(selector):
                    rank, name, outcome = pickle.loads(bytes.fromhex(line[len(RESULT_PREFIX):]))
                    collected[name][rank] = outcome
                    received += 1
                dead = [proc.poll() for proc in procs if proc.poll() not in (None, 0)]
                if received < expected and (dead or time.monotonic() > deadline):
                    missing = {n: sorted(set(range(WORLD)) - set(r))
                               for n, r in collected.items() if len(r) < WORLD}  # fmt: skip
                    logs = "\n".join((workdir / f"trainer{r}.log").read_text()[-2000:] for r in range(WORLD))
                    pytest.fail(f"trainers ended (exit codes {dead}) or did not report within {timeout} s; "
                                f"missing (scenario: ranks): {missing}\n{logs}")  # fmt: skip
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # ended below, as a hung one would be
                proc.wait(max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc is not None:
                reap(proc)
    return collected


def _read_lines(selector: selectors.BaseSelector) -> list[str]:
    """The result lines the trainers printed within half a second (a line's start waits for its end)."""
    lines = []
    for key, _ in selector.select(timeout=0.5):
        data = os.read(key.fd, 65536)
        if not data:  # this trainer ended (its exit code is checked)
            selector.unregister(key.fd)
            continue
        *complete, key.data[0] = (key.data[0] + data).split(b"\n")
        lines += [line.decode() for line in complete if line.startswith(RESULT_PREFIX.encode())]
    return lines


def _ok(outcomes: dict[int, Any], name: str) -> dict[int, Any]:
    errors = {rank: out[1] for rank, out in outcomes.items() if out[0] != "ok"}
    assert not errors, f"{name}: " + "\n".join(f"rank {r}:\n{tb}" for r, tb in errors.items())
    return {rank: out[1] for rank, out in outcomes.items()}


@pytest.mark.timeout(120)
def test_two_trainers_share_the_worker_servers(fleet, tmp_path):
    names = list(SCENARIOS) + list(CHECKPOINT_SCENARIOS) + ["resume-other-rank-refused"]
    collected = run_trainers(fleet, names, timeout=100, workdir=tmp_path)

    shards = WORLD * WORKERS_PER_TRAINER
    for name, (kind, n, fullsync, _) in SCENARIOS.items():
        per_rank = _ok(collected[name], name)
        # Rank r reads the global shards r * N .. r * N + N - 1 of world * N.
        rank_sizes = [
            sum(
                len(range(g, n, shards))
                for g in range(r * WORKERS_PER_TRAINER, (r + 1) * WORKERS_PER_TRAINER)
            )
            for r in range(WORLD)
        ]
        synced = fullsync or kind == "sequential"
        for epoch in range(EPOCHS):
            keys = {rank: [x for x, _ in per_rank[rank][epoch]] for rank in range(WORLD)}
            for rank in range(WORLD):
                assert len(keys[rank]) == len(set(keys[rank])), f"{name}: rank {rank} repeats items"
                # fullsync: every rank stops with the shortest one
                assert len(keys[rank]) == (min(rank_sizes) if synced else rank_sizes[rank]), (
                    name,
                    rank,
                    epoch,
                )
            assert not set(keys[0]) & set(keys[1]), f"{name}: shards overlap in epoch {epoch}"
            union = set(keys[0]) | set(keys[1])
            assert union <= set(range(n))
            if not synced or len(set(rank_sizes)) == 1:
                assert union == set(range(n)), (
                    f"{name}: epoch {epoch} lost items: {sorted(set(range(n)) - union)}"
                )
        # One shuffle per epoch for the whole job, a new one each epoch: a rank's items change.
        assert {x for x, _ in per_rank[0][0]} != {x for x, _ in per_rank[0][1]}, name

    for name in CHECKPOINT_SCENARIOS:
        per_rank = _ok(collected[name], name)
        assert per_rank[0]["epoch_seed"] == per_rank[1]["epoch_seed"], (
            f"{name}: ranks drew different epoch seeds"
        )
        for rank in range(WORLD):
            assert per_rank[rank]["resumed"] == per_rank[rank]["uninterrupted"], f"{name}: rank {rank}"

    refused = _ok(collected["resume-other-rank-refused"], "resume-other-rank-refused")
    for rank in range(WORLD):
        assert refused[rank] is not None, f"rank {rank} resumed from the other rank's state"
        assert f"taken by trainer rank {1 - rank} of 2, this is rank {rank} of 2" in refused[rank]
