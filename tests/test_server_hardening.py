"""The worker server under hostile or exhausted conditions: a failed fork, no file
descriptors left, a flood of silent sockets, a too-large graph, a wrong or missing key, text
meant to forge log lines, and a clean run's stderr. Every refusal reaches the trainer with
its reason; the server and the sessions it already runs go on."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import secrets
import selectors
import socket
import subprocess
import time
import warnings
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import connect, frame_bytes, recv_frame, slow_identity, wait_until
from conftest import VENV_BIN, _pythonpath, run_epochs, start_server
from rpc_reading_service import AuthenticationError, Liveness, RPCReadingService, WorkerRefusedError
from rpc_reading_service.protocol import HANDSHAKE_KINDS, ClientHandshake, FrameReader, MessageKind, encode_reject

PIDS_CGROUPS = Path("/sys/fs/cgroup/pids")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A keyed server for the tests that do not change it for good (they may disturb it)."""
    server = start_server(tmp_path_factory.mktemp("hardening"))
    yield server
    server.stop()


def _service(server, num_workers: int = 1, key=None) -> RPCReadingService:
    return RPCReadingService(
        workers=[server.address], num_workers=num_workers, auth_key=server.key if key is None else key
    )


def _small_epoch(server, n: int = 6) -> List[int]:
    return sorted(run_epochs(IterableWrapper(range(n)).sharding_filter(), _service(server), n_epochs=1)[0])


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _log_lines(server, text: str) -> List[str]:
    return [line for line in server.stderr().splitlines() if text in line]


@contextlib.contextmanager
def _pids_limit(server) -> Iterator[None]:
    """Move the ``server`` process into a cgroup-v1 pids group of its own whose limit is below the tasks it
    has, so that its every fork (or new thread) fails with EAGAIN, as at a container's pids
    limit (RLIMIT_NPROC does not apply to root); move it back and remove the group afterwards."""
    if not os.access(PIDS_CGROUPS / "cgroup.procs", os.W_OK):
        pytest.skip(f"needs a writable cgroup-v1 pids controller at {PIDS_CGROUPS}")
    pid = server.pid
    with open(f"/proc/{pid}/cgroup") as handle:
        home = next(line.split(":", 2)[2].strip() for line in handle if line.split(":")[1] == "pids")
    group = PIDS_CGROUPS / f"rrs-test-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a pids cgroup under {PIDS_CGROUPS}: {exc}")
    try:
        (group / "cgroup.procs").write_text(str(pid))
        (group / "pids.max").write_text("1")
        yield
    finally:
        server.proc.poll()  # a server that died is reaped, so that it leaves the group
        with contextlib.suppress(OSError):  # the process may be gone
            (PIDS_CGROUPS / home.lstrip("/") / "cgroup.procs").write_text(str(pid))
        assert wait_until(lambda: _removed(group), 5), f"could not remove {group}"


def _removed(group: Path) -> bool:
    try:
        group.rmdir()
    except OSError:  # EBUSY while a task is still in it
        return False
    return True


# -- 1. a failed fork refuses one session; the server and its other sessions go on -------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["fork", "thread"])
def test_failed_fork_refuses_only_the_new_session(tmp_path, mode):
    server = start_server(tmp_path, args=["--session-mode", mode])
    graph = IterableWrapper(range(30)).sharding_filter().map(slow_identity)
    busy = DataLoader2(graph, reading_service=_service(server, 2))
    try:
        items = iter(busy)
        taken = [next(items) for _ in range(4)]  # trainer A holds running sessions
        with _pids_limit(server):
            start = time.monotonic()
            with pytest.raises(WorkerRefusedError) as info:
                _small_epoch(server)
            assert time.monotonic() - start < 5
            what = "fork failed" if mode == "fork" else "cannot start a thread"
            assert f"refused the session: server cannot start a session: {what}: " in str(info.value)
            assert server.address in str(info.value) and "--max-sessions" in str(info.value)
            assert sorted(taken + list(items)) == list(range(30))  # A is unaffected
            assert server.proc.poll() is None
        assert _log_lines(server, "cannot start a session") and "Traceback" not in server.stderr()
    finally:
        busy.shutdown()
        server.stop()  # (after the check: stop() also reaps a server that died)
    assert server.proc.returncode == 0  # it was still serving, and stopped cleanly on SIGTERM


def _same(item: int) -> int:
    return item


@pytest.mark.timeout(60)
def test_sessions_of_a_thread_mode_server_set_up_their_graphs_at_once(tmp_path):
    """Six sessions of one thread-mode server set up a deep graph at the same moment. torch
    traverses a graph under process-wide pickling hooks, so the sessions must take turns: before
    they did, 9 of 15 such loaders failed with "Attempt to override existing getstate_hook"."""
    server = start_server(tmp_path, args=["--session-mode", "thread"])
    graph = IterableWrapper(range(24)).sharding_filter()
    for _ in range(40):
        graph = graph.map(_same)
    try:
        for _ in range(6):
            assert sorted(run_epochs(graph, _service(server, 6), n_epochs=1)[0]) == list(range(24))
    finally:
        server.stop()
    assert "Traceback" not in server.stderr()


@pytest.mark.timeout(60)
def test_server_serves_again_once_it_can_fork(tmp_path):
    server = start_server(tmp_path)
    try:
        with _pids_limit(server):
            with pytest.raises(WorkerRefusedError, match="fork failed"):
                _small_epoch(server)
        assert _small_epoch(server) == list(range(6))
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_failed_fork_reaches_a_torch_rpc_trainer_too(tmp_path):
    server = start_server(tmp_path, args=["--transport", "torch_rpc"])
    try:
        service = RPCReadingService(
            workers=[server.address],
            transport="torch_rpc",
            liveness=Liveness(connect_timeout=20),
            num_workers=1,
            auth_key=server.key,
        )
        with _pids_limit(server):
            with pytest.raises(WorkerRefusedError, match="refused the session: server cannot start a session: fork failed"):
                run_epochs(IterableWrapper(range(3)), service, n_epochs=1)
            assert server.proc.poll() is None
    finally:
        server.stop()


# -- 2. out of file descriptors: back off, log once, serve again -------------------------------
@pytest.mark.timeout(60)
def test_out_of_descriptors_backs_off_quietly_and_serves_again(tmp_path):
    server = start_server(tmp_path)
    idle: List[socket.socket] = []
    try:
        spare = 6
        open_fds = len(os.listdir(f"/proc/{server.pid}/fd"))
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (open_fds + spare, open_fds + spare))
        for _ in range(60):  # silent connections: the first few take every descriptor left
            idle.append(connect(server.address))
        assert wait_until(lambda: _log_lines(server, "cannot accept connections"), 5), server.stderr()
        cpu, start = _cpu_seconds(server.pid), time.monotonic()
        time.sleep(1.0)  # a window to measure what the server does meanwhile (it used to spin at 100 % CPU)
        assert _cpu_seconds(server.pid) - cpu < 0.1 * (time.monotonic() - start)
        assert len(_log_lines(server, "cannot accept connections")) == 1
        assert "ulimit -n" in _log_lines(server, "cannot accept connections")[0]
        for sock in idle:
            sock.close()
        idle.clear()
        start = time.monotonic()
        assert _small_epoch(server) == list(range(6))
        assert time.monotonic() - start < 5
        assert len(server.stderr().splitlines()) < 200
    finally:
        for sock in idle:
            sock.close()
        server.stop()


# -- 3. a refusal after authentication reaches the trainer with its reason ----------------------
@pytest.mark.timeout(60)
def test_graph_over_max_frame_bytes_is_refused_with_the_flag_to_raise(tmp_path):
    server = start_server(tmp_path, args=["--max-frame-bytes", "65536"])
    try:
        large = IterableWrapper([bytes(300_000)])  # the graph holds a 300 kB item
        start = time.monotonic()
        with pytest.raises(WorkerRefusedError) as info:
            run_epochs(large, _service(server), n_epochs=1)
        assert time.monotonic() - start < 5
        message = str(info.value)
        assert f"worker 0 ({server.address}) refused the session" in message
        assert "SETUP frame of" in message and "over the maximum of 65536 bytes" in message
        assert "larger --max-frame-bytes" in message
        assert _small_epoch(server) == list(range(6))  # the server serves on
    finally:
        server.stop()


# -- 4. keys: a keyless worker says so; a wrong key is an authentication failure there ----------
@pytest.mark.timeout(60)
def test_keyed_trainer_is_told_the_worker_has_no_key(tmp_path):
    server = start_server(tmp_path, key="")
    try:
        with pytest.raises(AuthenticationError) as info:
            run_epochs(IterableWrapper(range(3)), _service(server, key="k" * 16), n_epochs=1)
        message = str(info.value)
        assert "the worker has no auth key" in message and "--auth-key-file" in message
        assert "does not hold the same auth key" not in message
    finally:
        server.stop()


@pytest.mark.timeout(30)
def test_wrong_key_is_logged_as_an_authentication_failure(server):
    with pytest.raises(AuthenticationError, match="does not hold the same auth key"):
        run_epochs(IterableWrapper(range(3)), _service(server, key="wrong-key"), n_epochs=1)
    assert wait_until(lambda: _log_lines(server, "authentication failed for 127.0.0.1:"), 3), server.stderr()
    assert "auth key does not match" in _log_lines(server, "authentication failed for")[0]
    assert not _log_lines(server, "closed the connection")


# -- 5. silent sockets cannot lock trainers out -----------------------------------------------
@pytest.mark.timeout(30)
def test_silent_sockets_neither_fill_the_server_nor_lock_out_a_trainer(server):
    from rpc_reading_service.transports import socket_transport

    per_host = socket_transport.MAX_PENDING_PER_HOST  # noqa: SLF001 - the cap under test
    extra = 20
    # The server's handshake timeout is 10 s: the silent sockets used to hold on that long.
    silent: List[socket.socket] = []
    try:
        for _ in range(per_host + extra):
            silent.append(connect(server.address))
        # Past the cap, each newcomer costs one socket its place, told at once that the server is
        # busy: the newcomer itself, or the oldest one if it waited long enough to be stale (the
        # server may have taken that long to accept them all, on a loaded host).
        busy = _answered(silent, extra, timeout=5.0)
        assert len(busy) == extra, busy
        for reason in busy.values():
            assert (reason or "").startswith("server busy: "), busy
            assert "127.0.0.1" in reason and f"at most {per_host} per address" in reason, reason
        time.sleep(socket_transport.STALE_HANDSHAKE_SECONDS)  # noqa: SLF001 - the silent ones are stale now
        start = time.monotonic()
        assert _small_epoch(server) == list(range(6))  # room made by dropping the oldest silent one
        assert time.monotonic() - start < 6  # not after the silent ones' 10 s handshake timeout
        waiting = [sock for index, sock in enumerate(silent) if index not in busy]
        dropped = list(_answered(waiting, 1, timeout=3.0).values())
        assert len(dropped) == 1 and (dropped[0] or "").startswith("server busy: "), dropped
        assert len(_log_lines(server, "server busy")) <= 2  # logged once per interval
    finally:
        for sock in silent:
            sock.close()


def _answered(socks: List[socket.socket], count: int, timeout: float) -> Dict[int, Optional[str]]:
    """The first ``count`` of ``socks`` that the server answers within ``timeout`` seconds: their
    REJECT reasons (None if it closed without one) by index; fewer if fewer were answered."""
    answered: Dict[int, Optional[str]] = {}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for index, sock in enumerate(socks):
            selector.register(sock, selectors.EVENT_READ, index)
        while len(answered) < count and time.monotonic() < deadline:
            for key, _ in selector.select(deadline - time.monotonic()):
                if len(answered) < count:
                    selector.unregister(key.fileobj)
                    answered[key.data] = _reject_or_none(key.fileobj, 3.0)
    return answered


def _reject_or_none(sock: socket.socket, timeout: float):
    """The reason of the REJECT ``sock`` receives within ``timeout``, else None."""
    try:
        frame = recv_frame(sock, FrameReader(allowed_kinds=HANDSHAKE_KINDS), timeout)
    except socket.timeout:
        return None
    return None if frame is None or frame.kind != MessageKind.REJECT else bytes(frame.body).decode()


# -- 6. peer text cannot forge log lines ----------------------------------------------------------
@pytest.mark.timeout(30)
def test_peer_text_is_escaped_in_the_log(server):
    # An authenticated peer with a newline in its HELLO's package version.
    handshake = ClientHandshake(server.key.encode(), package_version="9.9\n2026-01-01 FORGED-VERSION-LINE")
    with connect(server.address) as sock:
        reader = FrameReader(allowed_kinds=HANDSHAKE_KINDS)
        sock.sendall(frame_bytes(handshake.hello()))
        sock.sendall(frame_bytes(handshake.receive_challenge(recv_frame(sock, reader))))
        assert recv_frame(sock, reader).kind == MessageKind.WELCOME
        assert wait_until(lambda: _log_lines(server, "FORGED-VERSION-LINE"), 3)
    # An unauthenticated one that answers the challenge with a REJECT carrying a newline.
    with connect(server.address) as sock:
        sock.sendall(frame_bytes(ClientHandshake(b"any").hello()))
        assert recv_frame(sock, FrameReader(allowed_kinds=HANDSHAKE_KINDS)).kind == MessageKind.CHALLENGE
        sock.sendall(frame_bytes(encode_reject("bye\n2026-01-01 FORGED-REASON-LINE\x1b[2J")))
        assert wait_until(lambda: _log_lines(server, "FORGED-REASON-LINE"), 3)
    log = server.stderr()
    assert "(package 9.9\\n2026-01-01 FORGED-VERSION-LINE)" in log
    assert "bye\\n2026-01-01 FORGED-REASON-LINE\\x1b[2J" in log
    assert not re.search(r"^2026-01-01 FORGED", log, re.MULTILINE) and "\x1b" not in log


# -- 7. a clean run prints only the serving lines ---------------------------------------------------
def _quiet_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # warnings show as by default
    env["PYTHONPATH"] = _pythonpath()
    return env


def warn_once(item: int) -> int:
    """A graph function that warns (the worker server imports it from this module)."""
    if item == 0:
        warnings.warn("a warning of the user", stacklevel=1)
    return item


@pytest.mark.timeout(60)
def test_clean_start_serve_stop_prints_only_serving_lines(tmp_path):
    server = start_server(tmp_path, command=[str(VENV_BIN / "rpc-reading-worker")], env=_quiet_env())
    try:
        graph = IterableWrapper(range(20)).sharding_filter().map(warn_once)
        dl = DataLoader2(graph, reading_service=_service(server, 2))
        try:
            items = iter(dl)
            taken = [next(items) for _ in range(3)]
            assert wait_until(lambda: len(server.session_pids()) == 2, 5)
            server.proc.terminate()  # SIGTERM drains: its sessions leave, then it exits
            assert server.proc.wait(10) == 0
            assert len(taken) == 3
        finally:
            dl.shutdown()
    finally:
        server.stop()
    lines = server.stderr().splitlines()
    assert any("UserWarning: a warning of the user" in line for line in lines)  # a graph's warnings show
    lines = [line for line in lines if "a warning of the user" not in line]  # (its line, and its source line)
    assert lines and all(re.match(r"\S+ \S+ rpc_reading_service\.\S+\[\d+\] INFO ", line) for line in lines), lines
    assert any("serving on" in line for line in lines)


@pytest.mark.timeout(60)
def test_help_prints_no_warnings():
    helped = subprocess.run(
        [str(VENV_BIN / "rpc-reading-worker"), "--help"], capture_output=True, text=True, env=_quiet_env(), timeout=50
    )
    assert helped.returncode == 0 and "--max-frame-bytes" in helped.stdout
    assert helped.stderr == ""


@pytest.mark.timeout(30)
def test_overall_handshake_cap_answers_server_busy(monkeypatch):
    """The cap over all peer addresses (one address can reach it only with a small cap)."""
    import threading

    from rpc_reading_service.transports import socket_transport
    from rpc_reading_service.transports.socket_transport import listener as socket_listener

    monkeypatch.setattr(socket_listener, "MAX_PENDING_HANDSHAKES", 4)
    monkeypatch.setattr(socket_listener, "STALE_HANDSHAKE_SECONDS", 0.3)
    transport = socket_transport.SocketTransport()
    listener = transport.listen("127.0.0.1", 0, b"k" * 16, handshake_timeout=10.0)
    silent: List[socket.socket] = []
    try:
        silent = [connect(listener.address) for _ in range(6)]
        assert listener.accept(timeout=0.2) is None
        # None of the 4 in progress is stale yet: the 2 newcomers are told the server is busy.
        assert [_reject_or_none(sock, 0.1) for sock in silent[:4]] == [None] * 4
        for sock in silent[4:]:
            assert (_reject_or_none(sock, 2.0) or "").startswith("server busy: 4 connections (at most 4)")
        time.sleep(0.3)
        accepted: list = []
        serving = threading.Thread(target=lambda: accepted.append(listener.accept(timeout=5.0)), name="test-accept")
        serving.start()
        good = transport.connect(listener.address, b"k" * 16, timeout=5.0)  # room made: the oldest goes
        serving.join(5.0)
        good.close()
        assert accepted and accepted[0] is not None
        accepted[0].close()
        assert (_reject_or_none(silent[0], 2.0) or "").startswith("server busy: ")
    finally:
        for sock in silent:
            sock.close()
        listener.close()


def test_protocol_tells_a_keyed_trainer_that_the_worker_has_no_key():
    """The sans-I/O side of the keyless-worker message, and of escaped REJECT reasons."""
    from rpc_reading_service.protocol import ServerHandshake, decode_reject

    def challenge(client_key: bytes, server_key: bytes):
        client, server = ClientHandshake(client_key), ServerHandshake(server_key)
        reader = FrameReader(allowed_kinds=HANDSHAKE_KINDS)
        reader.feed(frame_bytes(client.hello()))
        reader.feed(frame_bytes(server.receive_hello(reader.next_frame())))
        return client, reader.next_frame()

    client, frame = challenge(b"a key", b"")
    with pytest.raises(AuthenticationError, match="the worker has no auth key, but this trainer passes one"):
        client.receive_challenge(frame)
    client, frame = challenge(b"a key", b"another key")
    with pytest.raises(AuthenticationError, match="does not hold the same auth key"):
        client.receive_challenge(frame)
    reader = FrameReader(allowed_kinds=HANDSHAKE_KINDS)
    reader.feed(frame_bytes(encode_reject("line one\nline two\x1b[0m \\ end")))
    assert decode_reject(reader.next_frame()) == "line one\\nline two\\x1b[0m \\\\ end"
