"""Starting and stopping a worker server on this host for ``RPCReadingService(num_workers=N)``.

One local server is enough for any number of local workers: it forks one session
process per worker. With the socket transport it listens on a Unix socket in a private
directory (the same-host fast path: about twice the bandwidth of loopback TCP, and only
this user can connect). The server gets a fresh random key through its environment (not its
command line, which other users can read), the trainer's ``sys.path`` so that functions
from the trainer's modules resolve, and the trainer's pid, so it exits if the trainer dies.
"""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import subprocess
import tempfile
import sys
import time
from typing import List, Optional

from .errors import WorkerStartupError
from .keys import AUTH_KEY_ENV

__all__ = ["LocalWorkerServer"]


class LocalWorkerServer:
    """An ``rpc-reading-worker`` subprocess listening on a free loopback port."""

    def __init__(self, auth_key: bytes, transport: str = "socket", startup_timeout: float = 60.0, log_level: str = "WARNING"):
        self.auth_key = auth_key
        self.transport = transport
        self.startup_timeout = startup_timeout
        self.log_level = log_level
        self.address: Optional[str] = None
        self._process: Optional[subprocess.Popen] = None
        self._socket_dir: Optional[str] = None

    def _listen_host(self) -> str:
        if self.transport == "socket" and hasattr(socket, "AF_UNIX"):
            self._socket_dir = tempfile.mkdtemp(prefix="rrs-")  # mode 0700: only this user
            return "unix:" + os.path.join(self._socket_dir, "worker.sock")
        return "127.0.0.1"

    def command(self) -> List[str]:
        """The server's command line."""
        return [
            sys.executable, "-m", "rpc_reading_service.worker",
            "--host", self._listen_host(), "--port", "0",
            "--transport", self.transport,
            "--parent-pid", str(os.getpid()),
            "--log-level", self.log_level,
        ]  # fmt: skip

    def start(self) -> str:
        """Start the server and return its ``host:port`` once it listens."""
        env = dict(os.environ)
        env[AUTH_KEY_ENV] = self.auth_key.decode("ascii")
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self._process = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, close_fds=True
        )
        try:
            self.address = self._read_address()
        except BaseException:
            self.stop()
            raise
        return self.address

    def _read_address(self) -> str:
        assert self._process is not None and self._process.stdout is not None
        deadline = time.monotonic() + self.startup_timeout
        line = b""
        with selectors.DefaultSelector() as selector:
            selector.register(self._process.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WorkerStartupError(
                        f"local worker server did not start listening within {self.startup_timeout:.0f} s"
                    )
                if selector.select(remaining):
                    chunk = os.read(self._process.stdout.fileno(), 256)
                    if not chunk:
                        code = self._process.wait(timeout=5)
                        raise WorkerStartupError(
                            f"local worker server exited with code {code} before listening; its error output is above"
                        )
                    line += chunk
        text = line.decode("utf-8", "replace").strip()
        if not text.startswith("listening on "):
            raise WorkerStartupError(f"local worker server printed {text!r} instead of 'listening on HOST:PORT'")
        return text[len("listening on ") :]

    def alive(self) -> bool:
        """True while the server process runs."""
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> Optional[int]:
        """The server's process id."""
        return self._process.pid if self._process is not None else None

    def stop(self, timeout: float = 3.0) -> None:
        """Stop the server and its session processes (idempotent)."""
        process, self._process = self._process, None
        if process is not None:
            self._stop_process(process, timeout)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    @staticmethod
    def _stop_process(process: subprocess.Popen, timeout: float) -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()
