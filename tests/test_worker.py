"""The worker server as a real subprocess: CLI, authentication, hostile peers, many
sessions, and sessions or servers that die mid-epoch.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import (
    AUTH_KEY_ENV,
    VENV_BIN,
    _pythonpath,
    authenticate,
    connect,
    open_file_targets,
    process_alive,
    python_run,
    read_line,
    read_until_closed,
    reap,
    reject_reason,
    remote,
    run_epochs,
    start_server,
    wait_dead,
    wait_until,
)
from rpc_reading_service import AuthenticationError, ConfigurationError, Liveness, RPCReadingService, WorkerLostError
from rpc_reading_service.addresses import parse_address
from rpc_reading_service.protocol import (
    ClientHandshake,
    MessageKind,
    encode_control,
    encode_frame,
)
from rpc_reading_service.serialization import dumps_graph
from rpc_reading_service.transports.socket_transport import SocketTransport
from rpc_reading_service.worker import WorkerServer

pytestmark = pytest.mark.timeout(60)


def with_pid(x):
    return (os.getpid(), x)


def exit_on_5(x):
    if x == 5:
        os._exit(3)  # the graph kills its own session process
    return x


def run_epoch(server, n=20, **kwargs):
    return run_epochs(IterableWrapper(range(n)).sharding_filter(), remote(server, **kwargs), n_epochs=1)[0]


@pytest.fixture(scope="module")
def worker_server(tmp_path_factory):
    """This module's shared server is the plain ``python -m rpc_reading_service.worker``."""
    server = start_server(
        tmp_path_factory.mktemp("server"), command=[sys.executable, "-m", "rpc_reading_service.worker"]
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory):
    """A server started with the ``rpc-reading-worker`` console script and ``--auth-key-file``,
    with a short handshake timeout so that half-open peers are dropped quickly."""
    tmp = tmp_path_factory.mktemp("cli")
    key_file = tmp / "key.txt"
    key_file.write_text("  file-key-0123456789\n")
    server = start_server(
        tmp,
        key="env-key-must-not-be-used",
        command=[str(VENV_BIN / "rpc-reading-worker")],
        args=["--auth-key-file", str(key_file), "--handshake-timeout", "1"],
    )
    server.key = "file-key-0123456789"
    yield server
    server.stop()


# -- the command line -------------------------------------------------------------------------
def test_console_script_serves_with_key_file(cli_server):
    host, port = parse_address(cli_server.address)
    assert host == "127.0.0.1" and port > 0
    assert run_epoch(cli_server) == list(range(20))


def test_python_dash_m_prints_listening_line(worker_server):
    # This module's shared server is `python -m rpc_reading_service.worker --port 0`.
    assert worker_server.proc.args[1:3] == ["-m", "rpc_reading_service.worker"]
    host, port = parse_address(worker_server.address)
    assert host == "127.0.0.1" and port > 0
    assert run_epoch(worker_server, n=5) == list(range(5))


def test_refuses_public_address_without_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != AUTH_KEY_ENV}
    env["PYTHONPATH"] = _pythonpath()
    argv = ["-m", "rpc_reading_service.worker", "--host", "0.0.0.0", "--port", "0"]
    result = python_run(argv, env, str(tmp_path), timeout=30)
    assert result.returncode == 2
    assert "refusing to listen on 0.0.0.0 without an auth key" in result.stderr
    assert "--auth-key-file" in result.stderr
    assert "listening on" not in result.stdout


def test_without_key_only_loopback_is_allowed():
    for host in ("0.0.0.0", "10.1.2.3", "::"):
        with pytest.raises(ConfigurationError, match="without an auth key"):
            WorkerServer(host=host, port=0, auth_key=b"")
    server = WorkerServer(host="127.0.0.1", port=0, auth_key=b"")
    try:
        assert server.address.startswith("127.0.0.1:")
    finally:
        server._listener.close()


# -- authentication ---------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["wrong-key", None])
def test_wrong_or_missing_key_fails_fast(worker_server, key):
    rs = RPCReadingService(num_workers=1, workers=[worker_server.address], auth_key=key)
    start = time.monotonic()
    with pytest.raises(AuthenticationError, match="auth key"):
        with DataLoader2(IterableWrapper(range(3)), reading_service=rs) as dl:
            list(dl)
    assert time.monotonic() - start < 5


# -- hostile and broken peers ------------------------------------------------------------------
def read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """What the peer sends until it closes, which it must do within ``timeout`` seconds."""
    data, closed = read_until_closed(sock, timeout)
    assert closed, f"the server kept the connection open for {timeout} s"
    return data


def test_garbage_bytes_are_refused_and_server_serves_on(cli_server):
    with connect(cli_server.address) as sock:
        sock.sendall(os.urandom(64))
        reply = read_all(sock)
    assert "not an rpc_reading_service frame" in reject_reason(reply)
    assert run_epoch(cli_server) == list(range(20))


def test_http_request_is_refused_and_server_serves_on(cli_server):
    with connect(cli_server.address) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        reply = read_all(sock)
    reason = reject_reason(reply)
    assert "magic b'GET '" in reason
    assert run_epoch(cli_server) == list(range(20))


def test_oversized_or_unauthenticated_frames_are_refused_unread(cli_server):
    with connect(cli_server.address) as sock:  # a HELLO announcing 1 GiB
        header = b"".join(bytes(c) for c in encode_frame(MessageKind.HELLO))
        sock.sendall(header[:8] + (1 << 30).to_bytes(8, "big"))
        assert "refused before reading it" in reject_reason(read_all(sock))
    with connect(cli_server.address) as sock:  # a SETUP with a pickled graph before authenticating
        sock.sendall(b"".join(bytes(c) for c in encode_control(MessageKind.SETUP, {"graph": b"x"})))
        assert "not allowed" in reject_reason(read_all(sock))
    assert run_epoch(cli_server) == list(range(20))


def test_half_handshakes_neither_block_others_nor_linger(cli_server):
    silent = connect(cli_server.address)  # connects and says nothing
    half = connect(cli_server.address)  # says HELLO, never proves the key
    try:
        half.sendall(b"".join(bytes(c) for c in ClientHandshake(b"whatever").hello()))
        half.settimeout(5)
        challenge = half.recv(4096)
        assert challenge  # the server answered with its CHALLENGE
        # Meanwhile a real trainer is served without waiting for them.
        start = time.monotonic()
        assert run_epoch(cli_server) == list(range(20))
        assert time.monotonic() - start < 5
        # The server drops both after its --handshake-timeout (1 s).
        start = time.monotonic()
        assert read_all(silent) == b""
        assert read_all(half) == b""
        assert time.monotonic() - start < 4
    finally:
        silent.close()
        half.close()
    assert "no handshake within" in cli_server.stderr()
    assert run_epoch(cli_server) == list(range(20))


def test_trainer_vanishing_mid_epoch_ends_only_its_session(worker_server):
    before = set(worker_server.session_pids())
    graph = dumps_graph((IterableWrapper(range(10**6)).sharding_filter(), None, None))
    conn = SocketTransport().connect(worker_server.address, worker_server.key.encode(), 10)
    conn.send(encode_control(MessageKind.SETUP, {"graph": graph, "worker_rank": 0, "num_workers": 1, "options": {}}))
    ready = conn.recv(timeout=10)
    assert ready.kind == MessageKind.READY
    conn.send(encode_control(MessageKind.START_EPOCH, {"epoch": 1, "seed": 0, "global_worker_id": 0, "credits": 2}))
    first = conn.recv(timeout=10)
    assert first.kind == MessageKind.DATA
    session = set(worker_server.session_pids()) - before
    assert len(session) == 1
    # The trainer disappears without a word (a reset, as when its process is killed).
    conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    conn.close()
    wait_dead(session, timeout=10, what="sessions outlived their vanished trainer")
    assert worker_server.proc.poll() is None
    assert run_epoch(worker_server) == list(range(20))


# -- many trainers ------------------------------------------------------------------------------
def test_two_dataloaders_on_the_same_server_at_the_same_time(worker_server):
    dp_a = IterableWrapper(range(0, 300)).shuffle().sharding_filter()
    dp_b = IterableWrapper(range(1000, 1200)).sharding_filter()
    dl_a = DataLoader2(dp_a, reading_service=remote(worker_server, 2))
    dl_b = DataLoader2(dp_b, reading_service=remote(worker_server, 3))
    try:
        for _ in range(2):
            # Interleaved: both sets of sessions stream at once.
            pairs = list(itertools.zip_longest(iter(dl_a), iter(dl_b), fillvalue=None))
            a = [x for x, _ in pairs if x is not None]
            b = [y for _, y in pairs if y is not None]
            assert sorted(a) == list(range(300))
            assert b == list(range(1000, 1200))
    finally:
        dl_a.shutdown()
        dl_b.shutdown()


# -- lost workers -------------------------------------------------------------------------------
def wait_for_loss(it, start_deadline=10.0):
    """Iterate until WorkerLostError; return it and the seconds it took."""
    start = time.monotonic()
    with pytest.raises(WorkerLostError) as info:
        for _ in it:
            assert time.monotonic() - start < start_deadline, "no WorkerLostError: the loader kept going"
    return info.value, time.monotonic() - start


def test_session_process_killed_mid_epoch(worker_server):
    dp = IterableWrapper(range(10**6)).sharding_filter().map(with_pid)
    with DataLoader2(dp, reading_service=remote(worker_server, 2)) as dl:
        it = iter(dl)
        (pid0, x0), (pid1, x1) = next(it), next(it)
        assert (x0, x1) == (0, 1) and pid0 != pid1
        os.kill(pid1, signal.SIGKILL)
        error, seconds = wait_for_loss(it)
    assert seconds < 5
    assert error.rank == 1 and error.address == worker_server.address
    assert "worker 1" in str(error) and worker_server.address in str(error)
    assert worker_server.proc.poll() is None  # the server survives its session
    assert run_epoch(worker_server) == list(range(20))


def test_graph_exiting_its_process_is_a_lost_worker(worker_server):
    dp = IterableWrapper(range(20)).sharding_filter().map(exit_on_5)
    start = time.monotonic()
    with pytest.raises(WorkerLostError) as info:
        run = DataLoader2(dp, reading_service=remote(worker_server, 2))
        try:
            list(run)
        finally:
            run.shutdown()
    assert time.monotonic() - start < 5
    assert info.value.rank == 1  # item 5 belongs to worker 1 of 2
    assert run_epoch(worker_server) == list(range(20))


@pytest.mark.timeout(30)
def test_forked_test_servers_start_as_fresh_ones_and_report_their_exit(fresh_server, tmp_path):
    """The suite's default servers come from a forkserver (tests/_server_forkserver.py): each
    leads a session of its own in its working directory, holds none of the forkserver's pipes
    (not the one the first server's exit code comes on), and its exit code reaches the test."""
    first, second = fresh_server(), fresh_server(args=["--session-mode", "thread"])
    for server in (first, second):
        assert os.getsid(server.pid) == server.pid and os.readlink(f"/proc/{server.pid}/cwd") == str(tmp_path)
        assert run_epoch(server) == list(range(20))  # the key came from its environment
    first_status_pipe = os.readlink(f"/proc/self/fd/{first.proc._status_fd}")  # noqa: SLF001
    held = open_file_targets(second.pid)
    assert first_status_pipe not in held, held
    first.proc.terminate()
    assert first.proc.wait(10) == 0  # clean SIGTERM stop
    second.proc.send_signal(signal.SIGKILL)
    assert second.proc.wait(10) == -signal.SIGKILL and second.proc.poll() == -signal.SIGKILL


TEST_PROCESS_THAT_CRASHES = """
import os, signal, sys
from pathlib import Path
from _server_helpers import start_server
server = start_server(Path(sys.argv[1]))
print(server.pid, flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGSEGV)
"""


@pytest.mark.timeout(60)
def test_a_forked_test_server_ends_with_the_test_process_that_crashed(tmp_path):
    """A test process that dies of a signal (an xdist worker's crash) leaves no server of its
    forkserver behind: the forkserver exits, and its servers watch it."""
    test_process = subprocess.Popen(
        [sys.executable, "-c", TEST_PROCESS_THAT_CRASHES, str(tmp_path)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=_pythonpath()), start_new_session=True,
    )  # fmt: skip
    server_pid = None
    try:
        server_pid = int(read_line(test_process, timeout=45))
        assert process_alive(server_pid)
        test_process.stdin.write(b"go\n")
        test_process.stdin.flush()
        assert test_process.wait(10) == -signal.SIGSEGV
        assert wait_until(lambda: not process_alive(server_pid), timeout=10), f"server {server_pid} outlived its test process"
    finally:
        reap(test_process)
        if server_pid is not None and process_alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_server_killed_mid_epoch(fresh_server):
    server = fresh_server()
    dp = IterableWrapper(range(10**6)).sharding_filter()
    with DataLoader2(dp, reading_service=remote(server, 2)) as dl:
        it = iter(dl)
        assert [next(it) for _ in range(4)] == [0, 1, 2, 3]
        os.killpg(server.pid, signal.SIGKILL)  # the host goes away: server and sessions
        error, seconds = wait_for_loss(it)
    assert seconds < 5
    assert error.address == server.address and server.address in str(error)
    assert error.rank in (0, 1) and f"worker {error.rank}" in str(error)


def test_hung_worker_is_detected_by_heartbeat_timeout(worker_server):
    dp = IterableWrapper(range(10**6)).sharding_filter().map(with_pid)
    rs = remote(worker_server, 2, timeout=2.0, liveness=Liveness(heartbeat_interval=0.5))
    with DataLoader2(dp, reading_service=rs) as dl:
        it = iter(dl)
        pid0, _ = next(it)
        os.kill(pid0, signal.SIGSTOP)  # alive but silent: no data, no heartbeats
        try:
            error, seconds = wait_for_loss(it)
        finally:
            os.kill(pid0, signal.SIGKILL)
    assert seconds > 1.0, seconds  # by the 2 s heartbeat timeout, not at once ...
    assert seconds < 8, seconds  # ... and not never
    assert error.rank == 0 and "worker 0" in str(error)
    assert "2.0 s" in str(error)


def _slow_init(datapipe, info):
    time.sleep(3.0)  # longer than the trainer's timeout below
    return datapipe


def test_a_session_whose_setup_outlasts_the_timeout_does_not_take_the_trainer_for_silent(worker_server):
    """The worker reads the trainer's heartbeats only after its setup (loading the graph, the
    worker_init_fn, imports on a loaded host): its timeout counts from READY."""
    rs = remote(worker_server, 2, timeout=2.0, liveness=Liveness(heartbeat_interval=0.5), worker_init_fn=_slow_init)
    assert run_epochs(IterableWrapper(range(20)).sharding_filter(), rs, n_epochs=1)[0] == list(range(20))


def _slow_identity(x):
    time.sleep(0.002)
    return x


@pytest.mark.timeout(60)
def test_sessions_log_their_throughput_periodically(tmp_path):
    server = start_server(tmp_path, args=["--stats-interval", "0.3"])
    try:
        dp = IterableWrapper(range(600)).sharding_filter().map(_slow_identity)
        dl = DataLoader2(dp, reading_service=RPCReadingService(workers=[server.address], auth_key=server.key))
        try:
            assert sorted(dl) == list(range(600))
        finally:
            dl.shutdown()
        lines = [line for line in server.stderr().splitlines() if "items/s" in line]
        assert lines, server.stderr()
        rate = float(lines[0].split("items/s")[0].rsplit(":", 1)[1])
        assert 0 < rate < 600, lines[0]  # one 2 ms item at a time: at most 500 items/s
        assert "waiting for trainer credit" in lines[0]
    finally:
        server.stop()


def _fork_sessions_until(server, stop: threading.Event, forked: threading.Event) -> None:
    """Authenticate to ``server`` over and over (each connection forks a session) until ``stop``."""
    sockets = []
    try:
        while not stop.is_set():
            try:
                sockets.append(authenticate(server.address, server.key)[0])
                forked.set()
            except (OSError, AssertionError):
                return  # the server is going away
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.timeout(120)
def test_sigterm_while_forking_sessions_stops_quietly_and_promptly(tmp_path):
    """SIGTERM (a drain: SIGUSR1 to every session) then SIGINT (stop at once) landing in the middle
    of a fork (its at-fork hooks, or a session's first instructions) neither prints "Exception
    ignored" nor leaves the session unkillable."""
    for cycle in range(20):
        server = start_server(tmp_path)
        stop, forked = threading.Event(), threading.Event()
        clients = [threading.Thread(target=_fork_sessions_until, args=(server, stop, forked)) for _ in range(3)]
        try:
            for client in clients:
                client.start()
            assert forked.wait(20), "no session was forked"
            server.proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            assert wait_until(lambda: "draining: no new sessions" in server.stderr(), 5), server.stderr()
            server.proc.send_signal(signal.SIGINT)
            code = server.proc.wait(10)
            took = time.monotonic() - started
        finally:
            stop.set()
            for client in clients:
                client.join(10)
            server.stop()
        log = server.stderr()
        assert "Exception ignored" not in log and "Traceback" not in log, f"cycle {cycle}:\n{log}"
        assert code == 0, f"cycle {cycle}: exit code {code}\n{log}"
        assert took < 5.0, f"cycle {cycle}: took {took:.1f} s to stop"
