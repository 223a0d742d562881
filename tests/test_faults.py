"""Fault detection by heartbeats, both ways, against real server subprocesses.

- A worker session process SIGKILLed (dies) or SIGSTOPped (hangs) mid-epoch: the trainer
  raises WorkerLostError naming the worker's rank and address within ``timeout``.
- A trainer SIGKILLed (dies) or SIGSTOPped (hangs): the server notices, ends the session
  (its process exits) and serves the next client, with the session slots freed.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import time

import pytest
from _server_helpers import (
    process_alive,
    process_state,
    read_line,
    reap,
    running_server,
    slow_identity,
    spawn_python,
    wait_until,
)
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import Liveness, RPCReadingService, WorkerLostError

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 2.5  # the trainer's bound (default 10 s); heartbeats every HEARTBEAT s
HEARTBEAT = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # --max-sessions 2: the next client after a dead trainer only fits if its sessions were freed.
    with running_server(tmp_path_factory.mktemp("faults"), ["--max-sessions", "2"]) as server:
        yield server


def _service(server, **kwargs) -> RPCReadingService:
    return RPCReadingService(
        workers=[server.address], liveness=Liveness(heartbeat_interval=HEARTBEAT), num_workers=2,
        auth_key=server.key, timeout=TIMEOUT, **kwargs,
    )  # fmt: skip


def _long_epoch() -> IterableWrapper:
    return IterableWrapper(range(1_000_000)).sharding_filter().map(slow_identity)


def test_default_bound_is_at_most_10_seconds():
    assert inspect.signature(RPCReadingService).parameters["timeout"].default <= 10


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_lost_worker_session_is_detected_within_timeout(server, fault):
    server.wait_idle()
    dl = DataLoader2(_long_epoch(), reading_service=_service(server))
    victim = None
    try:
        it = iter(dl)
        for _ in range(50):
            next(it)
        sessions = server.session_pids()
        assert len(sessions) == 2
        victim = sessions[0]
        os.kill(victim, getattr(signal, fault))
        start = time.monotonic()
        with pytest.raises(WorkerLostError) as info:
            for _ in it:
                pass
        elapsed = time.monotonic() - start
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):  # SIGKILL: its server may have reaped it already
                os.kill(victim, signal.SIGKILL)  # also ends a stopped process
        dl.shutdown()
    error = info.value
    assert error.address == server.address and error.rank in (0, 1)
    assert f"worker {error.rank} ({server.address})" in str(error)
    if fault == "SIGKILL":  # the connection breaks: no need to wait for the heartbeat timeout
        assert elapsed < TIMEOUT, elapsed
    else:  # silence: detected by the missing heartbeats, within the bound
        assert "sent nothing" in str(error)
        assert elapsed > TIMEOUT - HEARTBEAT - 0.5, elapsed  # by the timeout, not before
        assert elapsed < TIMEOUT + HEARTBEAT + 3.0, elapsed  # nor long after
    server.wait_idle(5)  # the surviving session was closed cleanly by dl.shutdown()
    assert server.alive()


TRAINER = """
import sys
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from rpc_reading_service import Liveness, RPCReadingService
from _server_helpers import slow_identity

sys.stdin.readline()  # "go"
service = RPCReadingService(workers=[{address!r}], num_workers=1, auth_key={key!r},
                            timeout={timeout}, liveness=Liveness(heartbeat_interval={heartbeat}))
dl = DataLoader2(IterableWrapper(range(1_000_000)).sharding_filter().map(slow_identity), reading_service=service)
for index, item in enumerate(dl):
    if index == 20:
        print("started", flush=True)
"""


def test_dead_and_hung_trainers_are_detected_and_their_sessions_freed(server, tmp_path):
    server.wait_idle()
    code = TRAINER.format(address=server.address, key=server.key, timeout=TIMEOUT, heartbeat=HEARTBEAT)
    killed, stopped = spawn_python(code, tmp_path), spawn_python(code, tmp_path)  # they import in parallel
    try:
        sessions = {}
        for trainer in (killed, stopped):
            before = set(server.session_pids())
            trainer.stdin.write(b"go\n")
            trainer.stdin.flush()
            assert read_line(trainer, timeout=45) == "started"
            (sessions[trainer.pid],) = set(server.session_pids()) - before

        os.killpg(killed.pid, signal.SIGKILL)  # dies: its sockets close
        os.killpg(stopped.pid, signal.SIGSTOP)  # hangs: its sockets stay open, silent
        start = time.monotonic()
        assert wait_until(lambda: process_state(stopped.pid) == "T", 2)

        assert wait_until(lambda: not process_alive(sessions[killed.pid]), 3), "session of a dead trainer lives on"
        died = time.monotonic() - start
        assert wait_until(lambda: not process_alive(sessions[stopped.pid]), TIMEOUT + 3), "session of a hung trainer lives on"
        hung = time.monotonic() - start
        assert died < 2.0, died
        assert hung > TIMEOUT - HEARTBEAT - 0.3, hung  # by the trainer-silence timeout, not before
        assert hung < TIMEOUT + 3.0, hung  # (the wait above allows no more)
    finally:
        reap(killed)
        reap(stopped)
    log = server.log()
    assert "silent for 2.5 s; ending its session" in log
    server.wait_idle(5)
    # Both session slots (--max-sessions 2) are free again: the next client gets them.
    dl = DataLoader2(IterableWrapper(range(40)).sharding_filter(), reading_service=_service(server))
    try:
        assert sorted(dl) == list(range(40))
    finally:
        dl.shutdown()
    assert server.alive()
