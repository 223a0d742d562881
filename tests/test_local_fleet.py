"""Local worker servers (``RPCReadingService(num_workers=N)``): where their output goes, and
that they leave nothing behind. Real forked and spawned servers, real sockets."""

from __future__ import annotations

import functools
import gc
import os
import secrets
import selectors
import signal
import sys
import time
from pathlib import Path
from typing import List

import pytest
from _server_helpers import children_of, process_alive, read_line, reap, spawn_python, wait_until
from conftest import run_epochs
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import LocalWorkers, RPCReadingService

PRINT_LINE = "rrs-test-print " + "x" * 1009  # 1 KiB with its newline
LINES_PER_ITEM = 128  # 128 KiB per item


def print_a_lot(item: int) -> int:
    """A graph step that prints 128 KiB to stdout and to stderr (imported by reference)."""
    import sys

    for _ in range(LINES_PER_ITEM):
        print(PRINT_LINE)
        print(PRINT_LINE, file=sys.stderr)
    return item


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "start_method, transport", [("fork", "socket"), ("spawn", "socket"), ("spawn", "torch_rpc")]
)
def test_worker_output_reaches_the_trainer_and_never_blocks_the_graph(start_method, transport, capfd):
    """16 items x 128 KiB: 1 MiB per worker on each of stdout and stderr, far past a 64 KiB pipe."""
    service = RPCReadingService(
        num_workers=2, workers=LocalWorkers(start_method=start_method), transport=transport, timeout=30
    )
    [items] = run_epochs(IterableWrapper(range(16)).sharding_filter().map(print_a_lot), service, n_epochs=1)
    assert sorted(items) == list(range(16))
    out, err = capfd.readouterr()
    # (capfd's sys.stdout writes print's newline separately, so a line of one worker may end
    # after the next line of the other: count the lines' text, which is one write each.)
    assert out.count(PRINT_LINE) == 16 * LINES_PER_ITEM
    assert err.count(PRINT_LINE) == 16 * LINES_PER_ITEM
    assert "listening on" not in out  # the address travels on a pipe of its own


def _tagged(item: int, frozen: int, warm: bool, field_types: int) -> tuple:
    return item, frozen, warm, field_types


def note_what_the_session_inherited(datapipe, worker_info):
    """A worker_init_fn (run as the session sets up): tag each item with what the session
    inherited from its server, before its first epoch ran anything."""
    from rpc_reading_service.protocol import messages

    inherited = dict(
        frozen=gc.get_freeze_count(),
        warm="numpy.random" in sys.modules,
        field_types=messages._field_types.cache_info().currsize,
    )
    return datapipe.map(functools.partial(_tagged, **inherited))


@pytest.mark.timeout(30)
def test_forked_sessions_inherit_a_warmed_up_frozen_server():
    """The local server warms torchdata's seeding path up (numpy.random is imported lazily by
    the first seeding) and freezes its heap out of the collector's reach before it forks, as a
    CLI server does: else each of 64 sessions paid ~25 ms of CPU for it in its first epoch.
    The protocol's field types are resolved there too (a session resolves only SETUP's own)."""
    service = RPCReadingService(num_workers=2, worker_init_fn=note_what_the_session_inherited, timeout=20)
    [items] = run_epochs(IterableWrapper(range(4)).sharding_filter(), service, n_epochs=1)
    assert sorted(item for item, *_ in items) == list(range(4))
    assert all(frozen > 10_000 and warm and field_types > 2 for _, frozen, warm, field_types in items), items


TRAINER = """
import os, sys, tempfile
tempfile.tempdir = {tmp!r}
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from rpc_reading_service import RPCReadingService

service = RPCReadingService(num_workers=2)
dl = DataLoader2(IterableWrapper(range(1000)).sharding_filter(), reading_service=service)
it = iter(dl)
next(it), next(it)  # one item of each session: both run (each starts once it is set up)
print("started", flush=True)
if sys.stdin.readline().strip() == "exit":
    os._exit(0)  # exits without shutdown(), without atexit hooks
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["SIGKILL", "exit without shutdown"])
def test_a_trainer_that_dies_leaves_no_file_and_no_worker(end, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    trainer = spawn_python(TRAINER.format(tmp=str(tmp)), tmp_path)
    try:
        assert read_line(trainer, timeout=45) == "started"
        server_pids = children_of(trainer.pid)
        workers = server_pids + [pid for server in server_pids for pid in children_of(server)]
        assert len(workers) == 3, workers  # the local server and its two sessions
        if end == "SIGKILL":
            trainer.kill()
        else:
            trainer.stdin.write(b"exit\n")
            trainer.stdin.flush()
        trainer.wait(10)
        assert wait_until(lambda: not any(process_alive(pid) for pid in workers), timeout=10), (
            f"workers still running after the trainer ended: {[p for p in workers if process_alive(p)]}"
        )
        assert list(tmp.iterdir()) == []
    finally:
        reap(trainer)


@pytest.mark.timeout(60)
def test_a_server_on_an_abstract_unix_socket_serves_and_leaves_no_file(fresh_server, tmp_path):
    name = f"unix:@rrs-test-{secrets.token_hex(6)}"
    server = fresh_server(args=["--host", name])
    assert server.address == name
    service = RPCReadingService(workers=[server.address], num_workers=2, auth_key=server.key)
    [items] = run_epochs(IterableWrapper(range(10)).sharding_filter(), service, n_epochs=1)
    assert sorted(items) == list(range(10))
    server.stop()
    assert list(tmp_path.iterdir()) == [server.stderr_path]  # nothing but the test's own log
    assert "@" + name[len("unix:@"):] not in Path("/proc/net/unix").read_text()  # the socket is gone


TRAINER_HOLDING_A_PIPE = """
import os, signal, sys
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from rpc_reading_service import RPCReadingService

graph, address, key = sys.argv[2], sys.argv[3], sys.argv[4]
held = os.open(sys.argv[1], os.O_WRONLY)  # the pipe's write end, inheritable as a passed-down one is
os.set_inheritable(held, True)
if address:
    service = RPCReadingService(workers=[address], num_workers=2, auth_key=key, timeout=30)
else:
    service = RPCReadingService(num_workers=2, timeout=30)
dp = IterableWrapper(range(10**7))
dp = dp.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING) if graph == "dispatch" else dp.sharding_filter()
it = iter(DataLoader2(dp, reading_service=service))
next(it), next(it)  # one item of each session: the epoch runs
print("started", flush=True)
command = sys.stdin.readline().strip()
if command == "close":
    os.close(held)
    print("closed", flush=True)
    sys.stdin.readline()
else:
    os.kill(os.getpid(), getattr(signal, command))
"""


def start_trainer_holding_a_pipe(tmp_path: Path, graph: str = "plain", server=None):
    """A trainer (pipes: stdin, stdout) that also holds the write end of a pipe, as an xdist
    worker holds its channel to pytest; returns it and the pipe's read end, once its epoch runs."""
    pipe = tmp_path / "held.fifo"
    os.mkfifo(pipe)
    read_end = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # the trainer opens the write end
    address, key = (server.address, server.key) if server is not None else ("", "")
    trainer = spawn_python(TRAINER_HOLDING_A_PIPE, tmp_path, [str(pipe), graph, address, key])
    try:
        assert read_line(trainer, timeout=45) == "started"
    except BaseException:
        os.close(read_end)
        reap(trainer)
        raise
    return trainer, read_end


def reaches_eof(fd: int, timeout: float) -> bool:
    """Whether the pipe ``fd`` reads to its end (every writer closed it) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(deadline - time.monotonic()) and not os.read(fd, 4096):
                return True
    return False


def descendants_of(pid: int) -> List[int]:
    """``pid``'s live children, theirs, and so on."""
    found, todo = [], [pid]
    while todo:
        children = children_of(todo.pop())
        found += children
        todo += children
    return found


def send(trainer, command: str) -> None:
    trainer.stdin.write(command.encode() + b"\n")
    trainer.stdin.flush()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum, graph", [("SIGSEGV", "plain"), ("SIGKILL", "dispatch")])
def test_a_trainer_killed_mid_epoch_leaves_no_worker_and_no_pipe_held(signum, graph, tmp_path):
    """Nothing of a trainer that dies of a signal outlives it by more than a few seconds: not its
    local server, not a session, not a copy of a pipe it held (a test runner would wait for it)."""
    trainer, pipe = start_trainer_holding_a_pipe(tmp_path, graph)
    try:
        workers = descendants_of(trainer.pid)
        assert len(workers) == 3, workers  # the local server and its two sessions
        send(trainer, signum)
        assert trainer.wait(10) == -getattr(signal, signum)
        assert reaches_eof(pipe, timeout=5), "a worker process still holds the dead trainer's pipe"
        assert wait_until(lambda: not any(process_alive(pid) for pid in workers), timeout=5), (
            f"still running after the trainer died: {[pid for pid in workers if process_alive(pid)]}"
        )
    finally:
        os.close(pipe)
        reap(trainer)


@pytest.mark.timeout(60)
def test_local_workers_hold_no_copy_of_a_pipe_their_trainer_closes(tmp_path):
    """The forked local server keeps no copy of the trainer's pipes and sockets: one the trainer
    closes reaches its end while the workers run."""
    trainer, pipe = start_trainer_holding_a_pipe(tmp_path)
    try:
        send(trainer, "close")
        assert read_line(trainer, timeout=10) == "closed"
        assert reaches_eof(pipe, timeout=5), "the local workers hold a copy of a pipe their trainer closed"
        assert len(descendants_of(trainer.pid)) == 3  # still serving
    finally:
        os.close(pipe)
        reap(trainer)


@pytest.mark.timeout(60)
def test_a_trainer_killed_mid_epoch_leaves_no_session_on_a_tcp_server(worker_server, tmp_path):
    before = set(children_of(worker_server.pid))
    trainer, pipe = start_trainer_holding_a_pipe(tmp_path, server=worker_server)
    try:
        sessions = set(children_of(worker_server.pid)) - before
        assert len(sessions) == 2, sessions
        send(trainer, "SIGSEGV")
        assert trainer.wait(10) == -signal.SIGSEGV
        assert reaches_eof(pipe, timeout=5)
        assert wait_until(lambda: not any(process_alive(pid) for pid in sessions), timeout=5), sessions
        assert process_alive(worker_server.pid)  # the server serves on
    finally:
        os.close(pipe)
        reap(trainer)


TRAINER_WITH_A_WATCHDOG = """
import faulthandler
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from rpc_reading_service import RPCReadingService

faulthandler.dump_traceback_later(600, exit=True)  # the trainer's own watchdog, as pytest's faulthandler_timeout
service = RPCReadingService(num_workers=2, item_timeout={item_timeout}, timeout=5)
try:
    print(sorted(DataLoader2(IterableWrapper(range(10)).sharding_filter(), reading_service=service)), flush=True)
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
faulthandler.cancel_dump_traceback_later()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("item_timeout", [5, None])
def test_local_workers_serve_a_trainer_whose_faulthandler_timer_is_armed(item_timeout, tmp_path):
    """A local server forked while the trainer's faulthandler timer runs inherits that timer
    without its thread: its sessions' item_timeout watch (faulthandler's timer) hung them.
    Without item_timeout nothing uses that timer: the server neither probes it nor warns."""
    trainer = spawn_python(TRAINER_WITH_A_WATCHDOG.format(item_timeout=item_timeout), tmp_path)
    try:
        assert read_line(trainer, timeout=45) == str(list(range(10)))
        assert trainer.wait(10) == 0
    finally:
        reap(trainer)
    log = next(tmp_path.glob("trainer-*.log")).read_text()
    warned = "faulthandler timer" in log and "start_method='spawn'" in log  # says what it cannot do
    assert warned == (item_timeout is not None), log
