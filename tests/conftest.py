"""Shared fixtures: real ``rpc-reading-worker`` server subprocesses on loopback.

Every server is started in its own process group (``start_new_session``) so that the
finalizer can reap the server *and* every forked session process it left behind.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

# Tests talk to loopback only: gloo process groups (spawned trainers inherit this) would
# otherwise use whatever address this host's name resolves to.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from rpc_reading_service.local_fleet import read_listening_address

AUTH_KEY_ENV = "RPC_READING_SERVICE_AUTH_KEY"
VENV_BIN = Path(sys.executable).parent

# ``python -m rpc_reading_service.worker`` with pytest imported before the server starts
# forking sessions. Workers import test-module graph functions by reference, and every test
# module imports pytest (~0.3 s a session otherwise). The server code is unchanged: this is
# what the server already does for torch and torchdata (import before the first fork).
PRELOADED_WORKER = [
    sys.executable,
    "-c",
    "import sys, runpy, pytest; runpy.run_module('rpc_reading_service.worker', run_name='__main__', alter_sys=True)",
]


def _pythonpath(extra: Sequence[str] = (), exclude: Sequence[str] = ()) -> str:
    """The trainer's sys.path (so workers import test modules by reference), minus ``exclude``."""
    excluded = {os.path.realpath(p) for p in exclude}
    paths = [p for p in (*extra, *sys.path) if p and os.path.isdir(p) and os.path.realpath(p) not in excluded]
    return os.pathsep.join(dict.fromkeys(paths))


@dataclass
class ServerProcess:
    """A running worker server subprocess."""

    proc: subprocess.Popen
    address: str
    key: str
    stderr_path: Path
    children: List[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def session_pids(self) -> List[int]:
        """Pids of the server's live session processes (children of the server), via /proc."""
        return children_of(self.proc.pid)

    def stop(self) -> None:
        """Terminate the server, then SIGKILL whatever is left of its process group; reap."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def children_of(pid: int) -> List[int]:
    """Pids of the live (non-zombie) children of ``pid``, read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == pid and state != "Z":
            found.append(int(entry))
    return found


def process_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def read_listening_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """Read the server's first stdout line (``listening on HOST:PORT``) and return the address."""
    return read_listening_address(proc, timeout)


def run_epochs(datapipe, reading_service, n_epochs=2, seed=None):
    """The items of ``n_epochs`` epochs of a DataLoader2 (seeded if ``seed``), shut down after."""
    from torchdata.dataloader2 import DataLoader2

    with DataLoader2(datapipe, reading_service=reading_service) as dl:
        if seed is not None:
            dl.seed(seed)
        return [list(dl) for _ in range(n_epochs)]


def start_server(
    tmp_path: Path,
    key: Optional[str] = None,
    command: Optional[Sequence[str]] = None,
    args: Sequence[str] = (),
    exclude_paths: Sequence[str] = (),
    env: Optional[Dict[str, str]] = None,
) -> ServerProcess:
    """Start a worker server on 127.0.0.1 with ``--port 0`` and return once it listens.

    ``command`` defaults to :data:`PRELOADED_WORKER`; pass
    ``[sys.executable, "-m", "rpc_reading_service.worker"]`` for the plain CLI.
    """
    key = secrets.token_hex(16) if key is None else key
    full_env = dict(os.environ)
    full_env[AUTH_KEY_ENV] = key
    full_env["PYTHONPATH"] = _pythonpath(exclude=exclude_paths)
    full_env.update(env or {})
    command = list(command or PRELOADED_WORKER)
    stderr_path = tmp_path / f"server-{secrets.token_hex(4)}.log"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", "0", "--log-level", "INFO", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=full_env,
            start_new_session=True,
            # Run outside the repo so that only PYTHONPATH decides what the server can import.
            cwd=str(tmp_path),
        )
    server = ServerProcess(proc, "", key, stderr_path)
    try:
        server.address = read_listening_line(proc)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def worker_server(tmp_path_factory):
    """One keyed worker server shared by a test module; yields a :class:`ServerProcess`."""
    server = start_server(tmp_path_factory.mktemp("server"))
    yield server
    server.stop()


@pytest.fixture
def fresh_server(tmp_path):
    """A worker server of this test's own (for tests that kill or disturb it)."""
    servers: List[ServerProcess] = []

    def start(**kwargs) -> ServerProcess:
        server = start_server(tmp_path, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    """Fail a test that leaves non-daemon rpc_reading_service threads behind."""
    yield
    deadline = time.monotonic() + 3.0
    while True:
        leaked = [t for t in threading.enumerate() if t.name.startswith("rrs-") and not t.daemon]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"non-daemon threads left behind: {leaked}"
