"""Helper processes and worker servers: everything started here dies with its parent and is reaped."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterable, Optional

SERVER_START_TIMEOUT_S = 120.0  # a server importing torch on 2 cores busy with other jobs
LISTENING_RE = re.compile(rb"listening on (\S+):(\d+)")

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    """Call prctl(2) if libc is reachable (Linux); otherwise do nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (preexec_fn)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(cmd: list[str], env: Optional[dict] = None, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    """Start a helper process that is killed if the process starting it dies.

    Its stderr goes where its stdout goes.
    """
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float = 3.0) -> None:
    """Terminate, then kill after ``grace_s``, and reap every process in ``procs``."""
    procs = [p for p in procs if p is not None]
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(ready: Callable[[], Optional[str]], proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    """Poll ``ready()`` until it returns an address; fail if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        address = ready()
        if address:
            return address
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited (code {proc.returncode}) before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s")
        time.sleep(0.02)


def listening_line(log_path: str) -> Callable[[], Optional[str]]:
    """A readiness check: ``HOST:PORT`` once ``listening on HOST:PORT`` is in the log."""
    def ready() -> Optional[str]:
        with open(log_path, "rb") as log:
            match = LISTENING_RE.search(log.read(65536))
        return f"{match.group(1).decode()}:{match.group(2).decode()}" if match else None
    return ready


def accepts_connections(address: str) -> Callable[[], Optional[str]]:
    """A readiness check: ``address`` once a TCP connection to it succeeds."""
    host, port = address.rsplit(":", 1)

    def ready() -> Optional[str]:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return None
        return address
    return ready


Launch = Callable[[str], tuple[subprocess.Popen, Callable[[], Optional[str]], str]]


class ServerPool:
    """Long-lived worker servers of one kind, shared by all the tasks of a contender.

    Servers are started untimed, as in a deployment, and reused across scenarios (a
    worker server serves many sessions).  ``ensure(n)`` grows the pool to ``n`` servers,
    starting the missing ones in parallel; ``stop()`` kills and reaps them all; ``close()`` also removes their logs.  Used
    from the parent process only.  ``launch(log_path)`` starts one server and returns
    ``(process, readiness check, what)``.
    """

    def __init__(self, name: str, launch: Launch, attempts: int = 3):
        self.name = name
        self.launch = launch
        self.attempts = attempts
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.pending: list[tuple[subprocess.Popen, Callable[[], Optional[str]], str]] = []
        self.log_dir = tempfile.mkdtemp(prefix=f"bench-{name}-")

    def launch_missing(self, count: int, attempt: int = 0) -> None:
        """Start, without waiting for them, the servers that bring the pool to ``count``
        (so that several pools start at once; ``ensure`` waits for them)."""
        started = len(self.procs) + len(self.pending)
        self.pending += [self.launch(os.path.join(self.log_dir, f"server-{started + i}-{attempt}.log"))
                         for i in range(count - started)]

    def ensure(self, count: int) -> list[str]:
        """Start servers until ``count`` run; return their ``host:port`` addresses."""
        for attempt in range(self.attempts):
            self.launch_missing(count, attempt)
            if not self.pending:
                break
            launched, self.pending = self.pending, []
            failure: Optional[BaseException] = None
            for proc, ready, what in launched:
                try:
                    address = wait_until(ready, proc, SERVER_START_TIMEOUT_S, what)
                except RuntimeError as exc:  # exited early (e.g. its port was taken): retry
                    stop_processes([proc])
                    failure = exc
                    continue
                except BaseException:
                    stop_processes(p for p, _, _ in launched)
                    raise
                self.procs.append(proc)
                self.addresses.append(address)
            if failure is not None and attempt == self.attempts - 1:
                raise failure
        return self.addresses[:count]

    def pids(self) -> set[int]:
        """The process ids of the pool's servers, started or starting."""
        return {p.pid for p in self.procs} | {p.pid for p, _, _ in self.pending}

    def stop(self) -> None:
        """Kill and reap every server of the pool."""
        stop_processes(self.procs + [p for p, _, _ in self.pending])
        self.procs, self.addresses, self.pending = [], [], []

    def close(self) -> None:
        """Stop every server of the pool and remove its log directory."""
        self.stop()
        shutil.rmtree(self.log_dir, ignore_errors=True)


def launch_rpcrs_server(auth_key: str) -> Launch:
    """How to start one ``python -m rpc_reading_service.worker --port 0``: it prints
    ``listening on HOST:PORT`` (to a log file here) once ready."""
    def launch(log_path: str):
        env = dict(os.environ, RPC_READING_SERVICE_AUTH_KEY=auth_key)
        cmd = [sys.executable, "-m", "rpc_reading_service.worker", "--host", "127.0.0.1", "--port", "0"]
        with open(log_path, "wb") as log:
            proc = spawn(cmd, env=env, stdout=log)
        return proc, listening_line(log_path), "RPCRS worker server"
    return launch


def launch_rpcdataloader_server(log_path: str):
    """How to start one ``python -m rpcdataloader.launch`` (as its README says) on a free
    port.  The launcher prints nothing, so readiness is a successful TCP connect."""
    port = free_port()
    cmd = [sys.executable, "-m", "rpcdataloader.launch", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = spawn(cmd, stdout=log)
    return proc, accepts_connections(f"127.0.0.1:{port}"), "rpcdataloader worker"


def kill_process_group(pgid: int) -> None:
    """SIGKILL what is left of a child's process group (by its id)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def reap_adopted_children(keep: set[int]) -> None:
    """Kill and reap descendants that were re-parented to this (subreaper) process.

    Called when no task child is running, so every child not in ``keep`` (the server
    pools) is an orphan of one.
    """
    for task_dir in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task_dir}/children") as children:
                pids = [int(p) for p in children.read().split()]
        except OSError:
            continue
        for pid in pids:
            if pid in keep:
                continue
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def become_subreaper() -> None:
    """Make orphans of this process's children come back to it, to be reaped (Linux)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
