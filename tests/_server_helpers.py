"""Helpers shared by test_tls, test_limits, test_fuzz and test_faults.

Real ``rpc-reading-worker`` subprocesses on loopback (``--port 0``), raw protocol
clients for poking at them, and /proc readers. Every server runs in its own process
group, so :meth:`Server.stop` reaps it and every session process it forked, even when a
test fails half-way.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from rpc_reading_service import __version__
from rpc_reading_service.addresses import parse_address
from rpc_reading_service.local_fleet import read_line, read_listening_address  # noqa: F401 - re-exported for tests
from rpc_reading_service.protocol import (
    HANDSHAKE_KINDS,
    ClientHandshake,
    Frame,
    FrameReader,
    MessageKind,
)

from conftest import ServerProcess  # noqa: E402 - tests/ is on sys.path

TESTS_DIR = Path(__file__).resolve().parent


def _pythonpath() -> str:
    paths = [str(TESTS_DIR), *(p for p in sys.path if p and os.path.isdir(p))]
    return os.pathsep.join(dict.fromkeys(paths))


class Server(ServerProcess):
    """A running ``rpc_reading_service.worker`` subprocess, with helpers for fault tests."""

    @property
    def log_path(self) -> Path:
        return self.stderr_path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.stderr()

    def rss_kib(self) -> int:
        return rss_kib(self.pid)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no session process is left (earlier tests' sessions have ended)."""
        assert wait_until(lambda: not self.session_pids(), timeout), f"sessions still running: {self.session_pids()}"


def start_server(workdir: Path, args: Sequence[str] = (), key: Optional[str] = None, timeout: float = 60.0) -> Server:
    """Start ``python -m rpc_reading_service.worker --host 127.0.0.1 --port 0 *args``; return once it listens."""
    key = secrets.token_hex(32) if key is None else key
    key_file = workdir / f"key-{secrets.token_hex(4)}.txt"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)  # as a careful user keeps it (the server warns otherwise)
    log_path = workdir / f"server-{secrets.token_hex(4)}.log"
    env = dict(os.environ, PYTHONPATH=_pythonpath(), PYTHONWARNINGS="ignore")
    env.pop("RPC_READING_SERVICE_AUTH_KEY", None)
    command = [
        sys.executable, "-m", "rpc_reading_service.worker",
        "--host", "127.0.0.1", "--port", "0", "--auth-key-file", str(key_file), *args,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env,
            start_new_session=True, cwd=str(workdir),
        )  # fmt: skip
    server = Server(proc, "", key, log_path)
    try:
        server.address = read_listening_address(proc, timeout)
    except BaseException:
        server.stop()
        raise
    return server



@contextlib.contextmanager
def running_server(workdir: Path, args: Sequence[str] = (), key: Optional[str] = None) -> Iterator[Server]:
    server = start_server(workdir, args, key)
    try:
        yield server
    finally:
        server.stop()


# -- /proc -----------------------------------------------------------------------------------
def children_of(pid: int) -> List[int]:
    """Live (non-zombie) children of ``pid``, from /proc/<pid>/task/*/children."""
    found: List[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found.extend(int(child) for child in handle.read().split())
        except OSError:
            continue
    return [child for child in found if process_alive(child)]


def process_state(pid: int) -> Optional[str]:
    """The one-letter state of ``pid`` (R, S, T, Z, ...), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def process_alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# -- raw protocol clients ----------------------------------------------------------------------
def frame_bytes(chunks: Sequence) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def connect(address: str, timeout: float = 5.0) -> socket.socket:
    host, port = parse_address(address)
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_frame(sock: socket.socket, reader: FrameReader, timeout: float = 5.0) -> Optional[Frame]:
    """The next frame, or None when the peer closed the connection first."""
    deadline = time.monotonic() + timeout
    while True:
        frame = reader.next_frame()
        if frame is not None:
            return frame
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return None
        if not data:
            return None
        reader.feed(data)


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> Tuple[bytes, bool]:
    """Read everything the peer sends until it closes; ``(data, closed)``."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return data, False
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data, True
        except socket.timeout:
            return data, False
        if not chunk:
            return data, True
        data += chunk


def authenticate(address: str, key: str) -> Tuple[socket.socket, FrameReader]:
    """A raw socket past the HMAC handshake (WELCOME received), and its frame reader."""
    sock = connect(address)
    try:
        reader = FrameReader(allowed_kinds=HANDSHAKE_KINDS)
        handshake = ClientHandshake(key.encode(), __version__)
        sock.sendall(frame_bytes(handshake.hello()))
        challenge = recv_frame(sock, reader)
        assert challenge is not None, "server closed the connection instead of answering HELLO"
        sock.sendall(frame_bytes(handshake.receive_challenge(challenge)))
        welcome = recv_frame(sock, reader)
        assert welcome is not None and welcome.kind == MessageKind.WELCOME, welcome
        reader.allowed_kinds = None
        return sock, reader
    except BaseException:
        sock.close()
        raise


# -- graph functions the worker servers import by reference (tests/ is on their PYTHONPATH) ---
def slow_identity(item: int, delay: float = 0.002) -> int:
    time.sleep(delay)
    return item


def spawn_python(code: str, workdir: Path) -> subprocess.Popen:
    """Run ``code`` in a fresh interpreter (a trainer) in its own process group; stdin and
    stdout are pipes, stderr goes to a log file in ``workdir``."""
    env = dict(os.environ, PYTHONPATH=_pythonpath(), PYTHONWARNINGS="ignore")
    with open(workdir / f"trainer-{secrets.token_hex(4)}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log, env=env, start_new_session=True, cwd=str(workdir),
        )  # fmt: skip


def reap(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and its process group (also when stopped) and wait for it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()



def big_item(item: int) -> tuple:
    """An item with a 160 KB tensor, to push large out-of-band buffers through a transport."""
    import torch

    return item, torch.full((40_000,), float(item))
