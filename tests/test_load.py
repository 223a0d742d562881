"""Load: 4 trainer processes × 3 workers each, several epochs, against ONE worker server.

The four trainers are separate interpreters (as on a real cluster), each with its own
DataLoader2 and ``RPCReadingService(num_workers=3)`` on the same ``rpc-reading-worker``
server: 12 concurrent sessions. Every epoch carries a few thousand small items and some
64 KiB tensors. Checked: per trainer and epoch, every item exactly once (tensors intact);
the server's memory flat from the end of epoch 1 to the end of the last epoch (so are the
sessions'); every session process exits once its trainer is done.

The trainers run each epoch concurrently and wait at a barrier after it (a line on stdin),
so that memory is read at the same quiet point of every epoch.
"""

from __future__ import annotations

import json
from typing import Dict, List

import pytest
from _server_helpers import process_alive, read_line, reap, rss_kib, spawn_python, wait_dead

TRAINERS = 4
WORKERS = 3
EPOCHS = 4
ITEMS = 6000  # per epoch and trainer
TENSOR_EVERY = 40  # every 40th item carries a 64 KiB tensor: 150 per epoch and trainer
TENSOR_FLOATS = 16384  # float32: 64 KiB
MAX_SERVER_GROWTH_KIB = 20 * 1024
MAX_SESSION_GROWTH_KIB = 10 * 1024

TRAINER = """
import json, sys
import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from rpc_reading_service import RPCReadingService

def make_item(x):
    if x % {tensor_every} == 0:
        return x, torch.full(({tensor_floats},), float(x))
    return x

service = RPCReadingService(num_workers={workers}, workers=[{address!r}], auth_key={key!r}, timeout=20.0)
dl = DataLoader2(IterableWrapper(range({items})).shuffle().sharding_filter().map(make_item), reading_service=service)
dl.seed({index})
for epoch in range({epochs}):
    ids, tensors, bad = [], 0, []
    for item in dl:
        if isinstance(item, tuple):
            x, tensor = item
            tensors += 1
            if tensor.shape != ({tensor_floats},) or not bool((tensor == float(x)).all()):
                bad.append(x)
            item = x
        ids.append(item)
    stats = dl.reading_service.stats()
    result = dict(ids=ids, tensors=tensors, bad=bad, pids=[w.pid for w in stats.workers], items=stats.items)
    with open({out!r} + f".{{epoch}}.json", "w") as handle:
        json.dump(result, handle)
    print(f"epoch {{epoch}}", flush=True)
    sys.stdin.readline()  # the barrier: wait for "go"
dl.shutdown()
print("done", flush=True)
"""


def _go(trainers) -> None:
    for trainer in trainers:
        trainer.stdin.write(b"go\n")
        trainer.stdin.flush()


@pytest.mark.timeout(120)
def test_four_trainers_three_workers_each_share_one_server(fresh_server, tmp_path):
    server = fresh_server()
    trainers = []
    try:
        for index in range(TRAINERS):
            code = TRAINER.format(
                tensor_every=TENSOR_EVERY, tensor_floats=TENSOR_FLOATS, workers=WORKERS, address=server.address,
                key=server.key, items=ITEMS, index=index, epochs=EPOCHS, out=str(tmp_path / f"trainer{index}"),
            )  # fmt: skip
            trainers.append(spawn_python(code, tmp_path))
        sessions: Dict[int, List[int]] = {}
        rss: Dict[str, List[int]] = {}
        for epoch in range(EPOCHS):
            for trainer in trainers:  # the first epoch includes importing torch in 4 processes
                assert read_line(trainer, timeout=60 if epoch == 0 else 30) == f"epoch {epoch}"
            # Everybody is at the barrier: the 12 sessions idle between epochs.
            if epoch in (0, EPOCHS - 1):
                pids = sorted(server.session_pids())
                rss[f"server{epoch}"] = [rss_kib(server.pid)]
                rss[f"sessions{epoch}"] = [rss_kib(pid) for pid in pids]
            for index in range(TRAINERS):
                with open(tmp_path / f"trainer{index}.{epoch}.json") as handle:
                    result = json.load(handle)
                ids = result["ids"]
                assert len(ids) == result["items"] == ITEMS, (index, epoch, len(ids))
                assert sorted(ids) == list(range(ITEMS)), f"trainer {index}, epoch {epoch}: items lost or duplicated"
                assert result["tensors"] == ITEMS // TENSOR_EVERY and result["bad"] == []
                if epoch == 0:
                    sessions[index] = result["pids"]
                else:
                    assert result["pids"] == sessions[index]  # the same sessions, every epoch
            if epoch == 0:
                all_sessions = sorted(pid for pids in sessions.values() for pid in pids)
                assert len(set(all_sessions)) == TRAINERS * WORKERS
                assert all_sessions == sorted(server.session_pids())  # 12 concurrent sessions, on this server
            if epoch < EPOCHS - 1:
                _go(trainers)

        growth = rss[f"server{EPOCHS - 1}"][0] - rss["server0"][0]
        assert growth < MAX_SERVER_GROWTH_KIB, f"server RSS grew by {growth} KiB over {EPOCHS - 1} epochs"
        for before, after in zip(rss["sessions0"], rss[f"sessions{EPOCHS - 1}"]):
            assert after - before < MAX_SESSION_GROWTH_KIB, f"a session's RSS grew by {after - before} KiB"

        # Trainer 0 finishes first: its 3 sessions exit, the other trainers' live on.
        _go(trainers[:1])
        assert read_line(trainers[0], timeout=20) == "done"
        assert trainers[0].wait(20) == 0
        wait_dead(sessions[0], what="session processes outlived their trainer")
        assert all(process_alive(pid) for index in range(1, TRAINERS) for pid in sessions[index])
        _go(trainers[1:])
        for trainer in trainers[1:]:
            assert read_line(trainer, timeout=20) == "done"
            assert trainer.wait(20) == 0
        wait_dead(all_sessions, what="session processes outlived their trainer")
        assert server.session_pids() == []
        assert server.proc.poll() is None  # the server is still up
    finally:
        for trainer in trainers:
            reap(trainer)


