"""Draining a worker server (SIGTERM): its sessions leave, the trainer hands their work to the others.

Two real CLI servers on loopback; one of them gets SIGTERM mid-epoch while its session is held
mid-shard (a :class:`Hold` in the graph stops only that server's sessions), and the epoch must
still deliver every item exactly once, in the order a fixed fleet delivers, without an error even
with ``on_worker_failure="raise"``; the drained server exits 0 within its ``--drain-timeout``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import FileGate, remote, run_epochs, start_server, wait_until
from rpc_reading_service.errors import WorkerDrainedError, WorkerLostError

ITEMS = 96
DRAIN_TIMEOUT = 10.0


class Hold:
    """A map function that stops at its ``at``-th item in the sessions of the server ``victim``
    (their parent process) until ``gate`` opens; with ``gil``, it holds the interpreter lock
    there instead (C code that never returns: nothing else of the session runs)."""

    def __init__(self, victim: int, gate: FileGate, at: int = 10, gil: bool = False):
        self.victim, self.gate, self.at, self.gil = victim, gate, at, gil
        self.seen = 0

    def __call__(self, item: int) -> int:
        self.seen += 1
        if self.seen == self.at and self.victim in (os.getppid(), os.getpid()):  # forked, or a thread
            Path(self.gate.path + ".held").touch()
            if self.gil:
                sum(range(1 << 60))  # one C call: the lock is never released
            self.gate.wait()
        return item


def graph(hold=None):
    pipe = IterableWrapper(range(ITEMS)).shuffle().sharding_filter()
    return pipe.map(hold) if hold is not None else pipe.map(int)


@pytest.fixture
def two_servers(tmp_path, request):
    """Two servers sharing a key (with the test's ``request.param`` arguments, if any); both
    stopped and reaped after the test."""
    args = ["--drain-timeout", str(DRAIN_TIMEOUT), *getattr(request, "param", [])]
    first = start_server(tmp_path, args, key_file=True)
    servers = [first]
    try:
        servers.append(start_server(tmp_path, args, key=first.key, key_file=True))
        yield servers
    finally:
        for server in servers:
            server.stop()


class Drained:
    """What :func:`_drain_mid_epoch` saw."""

    outcome: object = None  # the epoch's items, or the WorkerLostError it raised
    epoch_seconds = failed_after = exit_after = float("nan")  # seconds: the epoch; SIGTERM to the error, to the exit
    exit_code = None
    stats = None


def _drain_mid_epoch(servers, tmp_path, seed, gil=False, **options) -> Drained:
    """One epoch over both servers where the second one gets SIGTERM once its session is held
    mid-shard (after the first item)."""
    from torchdata.dataloader2 import DataLoader2

    victim, seen = servers[1], Drained()
    gate = FileGate(tmp_path / "gate", timeout=30)
    held = Path(gate.path + ".held")
    items, signalled = [], None
    started = time.monotonic()
    try:
        with DataLoader2(graph(Hold(victim.pid, gate, gil=gil)), reading_service=remote(servers, **options)) as dl:
            dl.seed(seed)
            try:
                for item in dl:
                    items.append(item)
                    if signalled is None:
                        assert wait_until(held.exists, 20), "the drained server's session never reached its hold"
                        os.kill(victim.pid, signal.SIGTERM)
                        signalled = time.monotonic()
                seen.outcome = items
            except WorkerLostError as exc:
                seen.outcome = exc
                seen.failed_after = time.monotonic() - signalled
            seen.epoch_seconds = time.monotonic() - started
            seen.stats = dl.reading_service.stats()
            wait_until(lambda: victim.proc.poll() is not None, DRAIN_TIMEOUT + 10)
            seen.exit_after, seen.exit_code = time.monotonic() - signalled, victim.proc.poll()
    finally:
        gate.open()
    return seen


def _reference(servers, seed, **options):
    return run_epochs(graph(), remote(servers, **options), n_epochs=1, seed=seed)[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("distribution", ["round_robin", "first_ready", "dynamic"])
def test_a_drained_server_hands_its_work_to_the_others_without_an_error(two_servers, tmp_path, distribution):
    options = dict(on_worker_failure="raise", distribution=distribution, timeout=20.0)
    expected = _reference(two_servers, 7, **options)
    assert sorted(expected) == list(range(ITEMS))
    seen = _drain_mid_epoch(two_servers, tmp_path, 7, **options)
    assert not isinstance(seen.outcome, BaseException), f"the drain raised: {seen.outcome!r}"
    if distribution == "first_ready":  # arrival order: every item exactly once
        assert sorted(seen.outcome) == sorted(expected)
    else:  # and in the fixed fleet's order for the seed
        assert seen.outcome == expected
    assert seen.epoch_seconds < DRAIN_TIMEOUT, f"the epoch took {seen.epoch_seconds:.1f} s"
    assert seen.exit_code == 0, f"the drained server exited with {seen.exit_code}:\n{two_servers[1].stderr()}"
    assert seen.exit_after < DRAIN_TIMEOUT, f"the drained server took {seen.exit_after:.1f} s to exit"
    assert seen.stats.drains == 1 and seen.stats.reassignments == 0
    assert "1 worker drained" in seen.stats.summary()
    log = two_servers[1].stderr()
    assert "draining: no new sessions" in log and "drained: every session has ended" in log
    assert two_servers[0].alive() and not two_servers[1].session_pids()


@pytest.mark.timeout(120)
def test_a_drain_timeout_ends_a_session_stuck_in_c_code_and_the_trainer_sees_it_lost(two_servers, tmp_path):
    victim = two_servers[1]
    seen = _drain_mid_epoch(two_servers, tmp_path, 3, gil=True, on_worker_failure="raise", timeout=60.0)
    assert seen.exit_code == 0, victim.stderr()
    lost = seen.outcome
    assert isinstance(lost, WorkerLostError) and not isinstance(lost, WorkerDrainedError), lost
    assert f"({victim.address})" in str(lost) and "Its process died" in str(lost)
    # The session was stopped when the drain timed out, not before; the server exited then.
    assert DRAIN_TIMEOUT - 1 < seen.failed_after < DRAIN_TIMEOUT + 5, seen.failed_after
    assert DRAIN_TIMEOUT - 1 < seen.exit_after < DRAIN_TIMEOUT + 8, seen.exit_after
    assert "still running after 10 s (--drain-timeout); stopping them" in victim.stderr()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("two_servers", [["--session-mode", "thread"]], indirect=True)
def test_a_server_with_sessions_in_threads_drains_too(two_servers, tmp_path):
    expected = _reference(two_servers, 5, on_worker_failure="raise")
    seen = _drain_mid_epoch(two_servers, tmp_path, 5, on_worker_failure="raise", timeout=20.0)
    assert seen.outcome == expected
    assert seen.exit_code == 0 and seen.exit_after < DRAIN_TIMEOUT, (seen.exit_code, seen.exit_after)
    assert seen.stats.drains == 1
