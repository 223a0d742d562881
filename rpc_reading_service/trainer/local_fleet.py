"""Starting and stopping a worker server on this host for ``RPCReadingService(num_workers=N)`` (docs/architecture.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, List, Optional, Tuple

from ..cache.config import CacheConfig
from ..cache.temporary import HeldDirectory, make_temporary_cache
from ..errors import ConfigurationError, WorkerStartupError
from ..keys import AUTH_KEY_ENV

__all__ = [
    "LocalWorkerServer", "read_line", "read_listening_address", "release_inherited_descriptors", "DEFAULT_LOCAL_CACHE_BYTES",
]

DEFAULT_LOCAL_CACHE_BYTES = 1 << 30

log = logging.getLogger(__name__)


def read_line(process: Any, timeout: float, stream: Any = None) -> str:
    """The next line ``process`` writes to ``stream`` (default: its stdout pipe), within ``timeout`` seconds.

    Raises ``TimeoutError`` when no full line came in time and ``EOFError`` when the
    process closed the pipe (exited) first.
    """
    stream = process.stdout if stream is None else stream
    deadline = time.monotonic() + timeout
    line = b""
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no line within {timeout:.0f} s (got {line!r})")
            if selector.select(remaining):
                chunk = os.read(stream.fileno(), 1)  # one byte: never read past the line
                if not chunk:
                    raise EOFError(f"exited with code {process.wait(5)} (printed {line!r})")
                line += chunk
    return line.decode("utf-8", "replace").strip()


def read_listening_address(process: Any, timeout: float, stream: Any = None) -> str:
    """Wait for a worker server's ``listening on ADDRESS`` line (on ``stream``, default its
    stdout) and return ADDRESS.

    A forked server reports ``error: ...`` instead when it could not start.
    """
    text = read_line(process, timeout, stream)
    if text.startswith("error: "):
        raise WorkerStartupError(f"local worker server could not start: {text[len('error: '):]}")
    if not text.startswith("listening on "):
        raise WorkerStartupError(f"worker server printed {text!r} instead of 'listening on HOST:PORT'")
    return text[len("listening on ") :]


class ForkedProcess:
    """Just enough of ``subprocess.Popen`` for a forked server: poll, wait, terminate, kill."""

    def __init__(self, pid: int):
        self.pid = pid
        self.stdout = None
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, signum: int) -> None:
        """Signal the process unless it has ended (also when another process reaped it meanwhile)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


def release_inherited_descriptors(keep: Tuple[int, ...]) -> None:
    """Point this forked process's copies of the trainer's sockets and pipes at /dev/null, except ``keep``.

    A copy would keep each open past the trainer's own close or death: a peer waiting for EOF
    (a remote worker's session, the reader of a pipe such as a test runner's) would wait for this
    process too. The numbers stay taken, so the trainer's objects inherited here close nothing else.

    Args:
        keep: The descriptors this process still needs (its stdout and stderr, its announcement pipe).
    """
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: keep them (the server still exits with its trainer)
        return
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in fds:
            if fd in keep or fd == devnull:
                continue
            try:
                mode = os.fstat(fd).st_mode
            except OSError:  # the directory listing's own descriptor, closed by now
                continue
            if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode):
                os.dup2(devnull, fd, inheritable=False)
    finally:
        os.close(devnull)


def _fork_server(
    auth_key: bytes, host: str, transport: str, cache: Optional[CacheConfig], announce_fd: int, read_end: int,
    watch_locks: bool,
) -> ForkedProcess:
    """Fork a worker server that writes ``listening on ADDRESS`` (or an error) to ``announce_fd``;
    ``watch_locks``: its sessions may have an item_timeout (probe faulthandler's timer for them)."""
    from ..worker import die_with_parent, serve_until_signalled
    from ..worker.lock_watch import timer_usable

    parent = os.getpid()
    # The kernel signals the child when the thread that forked it ends: only the main thread's
    # end is the trainer's (a trainer thread that ends would stop the server under a live trainer).
    on_main_thread = threading.current_thread() is threading.main_thread()
    sys.stdout.flush()  # the server shares the trainer's streams: it must not inherit their buffers
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the server process
        code = 0
        try:
            os.close(read_end)
            if on_main_thread:
                die_with_parent(signal.SIGTERM)  # stops it at once, as its trainer would (the parent poll: 0.5 s)
            release_inherited_descriptors(keep=(0, 1, 2, announce_fd))
            lock_watch = watch_locks and timer_usable()
            if watch_locks and not lock_watch:
                log.warning(
                    "this trainer's faulthandler timer (faulthandler.dump_traceback_later) was armed when it forked its "
                    "local workers, where that timer no longer works: item_timeout cannot end a session stuck in C "
                    "code that holds the interpreter lock. LocalWorkers(start_method='spawn') has no such limit"
                )
            code = serve_until_signalled(
                dict(
                    host=host, port=0, auth_key=auth_key, transport=transport, parent_pid=parent, cache=cache,
                    drain_timeout=0,  # its trainer stops it: no trainer to hand work to
                    lock_watch=lock_watch,
                ),
                announce=lambda line: os.write(announce_fd, line.encode("utf-8") + b"\n"),
            )
        except BaseException as exc:  # noqa: BLE001 - report, never return into the trainer's code
            try:
                os.write(announce_fd, f"error: {exc}\n".encode("utf-8", "replace"))
            except OSError:
                pass
            code = 1
        finally:
            os._exit(code)
    return ForkedProcess(pid)


class LocalWorkerServer:
    """A worker server on this host (forked or spawned) listening on a private socket."""

    def __init__(
        self,
        auth_key: bytes,
        transport: str = "socket",
        startup_timeout: float = 60.0,
        log_level: str = "WARNING",
        start_method: Optional[str] = None,
        cache_dir: Optional[str] = None,
        cache_size: int = DEFAULT_LOCAL_CACHE_BYTES,
        watch_locks: bool = True,
    ):
        """``cache_dir``: keep the ``cached_map`` cache there (default: a temporary directory
        removed by :meth:`stop`); ``cache_size``: its bound in bytes; ``watch_locks``: False when
        no session it serves has an item_timeout (a forked server then skips probing faulthandler's timer)."""
        if start_method is None:
            start_method = "fork" if transport == "socket" and hasattr(os, "fork") else "spawn"
        if start_method not in ("fork", "spawn"):
            raise ConfigurationError(f"start_method must be 'fork' or 'spawn', got {start_method!r}")
        self.start_method = start_method
        self.auth_key = auth_key
        self.transport = transport
        self.startup_timeout = startup_timeout
        self.log_level = log_level
        self.address: Optional[str] = None
        self._process: Any = None  # subprocess.Popen or ForkedProcess
        self._socket_dir: Optional[str] = None
        self.cache_dir = cache_dir
        self.cache_size = cache_size
        self._cache: Optional[CacheConfig] = None
        self._cache_temp: Optional[HeldDirectory] = None
        self.watch_locks = watch_locks

    def _listen_host(self) -> str:
        if self.transport == "socket" and sys.platform.startswith("linux"):
            # An abstract socket: no file or directory that a SIGKILL could leave behind. Any
            # local user could dial it, as loopback TCP, and meets the server's fresh random key.
            return f"unix:@rrs-{os.getpid()}-{secrets.token_hex(8)}"
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
            "--drain-timeout", "0",  # its trainer stops it: no trainer to hand work to
            "--log-level", self.log_level,
            *self._cache_args(),
        ]  # fmt: skip

    def _cache_args(self) -> List[str]:
        if self._cache is None or self._cache.directory is None:
            return []
        temporary = ["--cache-dir-temporary"] if self._cache.temporary else []
        return ["--cache-dir", self._cache.directory, "--cache-size", str(self._cache.max_bytes), *temporary]

    def _cache_config(self) -> Optional[CacheConfig]:
        if self.cache_dir is not None:
            return CacheConfig.create(self.cache_dir, self.cache_size, option="LocalWorkers.cache_dir")
        # The server removes it when it stops, also after the trainer was killed; stop() too; the
        # next run's trainer when both were killed at once (each holds it while it runs).
        self._cache_temp = make_temporary_cache()
        cache = CacheConfig.create(self._cache_temp.path, self.cache_size)
        return None if cache is None else dataclasses.replace(cache, temporary=True)

    def start(self) -> str:
        """Start the server and return its ``host:port`` once it listens.

        The server writes to the trainer's own stdout and stderr (as torch's DataLoader
        workers do); its address comes on a pipe of its own, read once, so no pipe is left
        for the graph's output to fill.
        """
        self._cache = self._cache_config()
        read_end, write_end = os.pipe()
        try:
            if self.start_method == "fork":
                host = self._listen_host()
                self._process = _fork_server(
                    self.auth_key, host, self.transport, self._cache, write_end, read_end, self.watch_locks
                )
            else:
                self._process = self._spawn(write_end)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        with os.fdopen(read_end, "rb", buffering=0) as announcements:
            try:
                self.address = self._read_address(announcements)
            except BaseException:
                self.stop()
                raise
        return self.address

    def _spawn(self, announce_fd: int) -> subprocess.Popen:
        env = dict(os.environ)
        env[AUTH_KEY_ENV] = self.auth_key.decode("ascii")
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        command = [*self.command(), "--announce-fd", str(announce_fd)]
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, env=env, close_fds=True, pass_fds=(announce_fd,)
        )

    def _read_address(self, announcements: Any) -> str:
        try:
            return read_listening_address(self._process, self.startup_timeout, announcements)
        except TimeoutError as exc:
            raise WorkerStartupError(f"local worker server did not start listening: {exc}") from exc
        except EOFError as exc:
            raise WorkerStartupError(f"local worker server {exc}; its error output is above") from exc

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
        if self._cache_temp is not None:
            self._cache_temp.remove()
            self._cache_temp = None

    @staticmethod
    def _stop_process(process: Any, timeout: float) -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()
