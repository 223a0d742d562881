"""Plain helpers shared by the whole test suite (fixtures live in ``conftest.py``).

Real ``rpc-reading-worker`` subprocesses on loopback (``--port 0``), raw protocol
clients for poking at them, /proc readers, and small waits on conditions. Every server
runs in its own process group, so :meth:`Server.stop` reaps it and every session process
it forked, even when a test fails half-way.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Collection, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from _server_forkserver import PRELOADED_COMMAND, forked_python, forked_server
from rpc_reading_service import __version__
from rpc_reading_service.addresses import parse_address
from rpc_reading_service.trainer.local_fleet import read_line, read_listening_address  # noqa: F401 - re-exported for tests
from rpc_reading_service.protocol import (
    HANDSHAKE_KINDS,
    ClientHandshake,
    Frame,
    FrameReader,
    MessageKind,
)

TESTS_DIR = Path(__file__).resolve().parent
AUTH_KEY_ENV = "RPC_READING_SERVICE_AUTH_KEY"
VENV_BIN = Path(sys.executable).parent

# The plain server CLI, as a user runs it.
WORKER_CLI = [sys.executable, "-m", "rpc_reading_service.worker"]

# ``python -m rpc_reading_service.worker`` with pytest and hypothesis imported before the server
# starts forking sessions. Workers import test-module graph functions by reference, and every
# test module imports pytest (~0.3 s of CPU a session otherwise), the checkpoint and fuzzing
# ones hypothesis (~0.15 s a session). The server code is unchanged: this is
# what the server already does for torch and torchdata (import before the first fork).
# start_server forks it from a forkserver that did those imports once (see _server_forkserver).
PRELOADED_WORKER = PRELOADED_COMMAND


def _pythonpath(extra: Sequence[str] = (), exclude: Sequence[str] = ()) -> str:
    """tests/ and the trainer's sys.path (so workers import test modules by reference), minus ``exclude``."""
    excluded = {os.path.realpath(p) for p in exclude}
    candidates = (*extra, str(TESTS_DIR), *sys.path)
    paths = [p for p in candidates if p and os.path.isdir(p) and os.path.realpath(p) not in excluded]
    return os.pathsep.join(dict.fromkeys(paths))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS just reported free (for servers that cannot take port 0).

    Chosen at random below the kernel's ephemeral range and checked by binding it: a port the OS
    hands out for ``bind(0)`` lies in that range, where any outgoing connection of a parallel test
    may take it as its local port before our server binds it (EADDRINUSE in torch.distributed's
    rendezvous, seen in CI); ports below the range are only ever taken on purpose."""
    low = _ephemeral_low()
    for _ in range(64):
        port = 10_000 + secrets.randbelow(low - 10_000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # below the range is crowded: let the OS pick, as before
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default; elsewhere the same range is common
    return max(low, 10_001)


# The worker's own ``main`` once per argument list of argv[1] (JSON), output captured per run.
_CLI_RUNS_SCRIPT = """
import contextlib, io, json, sys
from rpc_reading_service.worker import main
runs = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # --help, argparse's refusals
            code = exc.code
    runs.append([argv, code, out.getvalue(), err.getvalue()])
print(json.dumps(runs))
"""


def worker_cli_runs(
    argvs: Sequence[Sequence[str]], env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None
) -> List[subprocess.CompletedProcess]:
    """``python -m rpc_reading_service.worker ARGS`` for each list in ``argvs``, all in ONE
    interpreter (forked from the forkserver: torch imported already), one result per list, with
    ``env`` (PYTHONPATH: the tests' own) in ``cwd``. Only for arguments the worker answers and
    exits on (help, refusals): one that starts a server serves on."""
    env = dict(os.environ if env is None else env, PYTHONPATH=_pythonpath())
    argv = ["-c", _CLI_RUNS_SCRIPT, json.dumps([list(a) for a in argvs])]
    done = python_run(argv, env, cwd or os.getcwd(), timeout=45)
    assert done.returncode == 0, f"the worker CLI runs failed ({done.returncode}):\n{done.stderr}"
    return [subprocess.CompletedProcess([*WORKER_CLI, *run[0]], *run[1:]) for run in json.loads(done.stdout)]


# -- worker servers --------------------------------------------------------------------------
class Server:
    """A running worker server subprocess in its own process group."""

    def __init__(self, proc: subprocess.Popen, address: str, key: str, stderr_path: Path) -> None:
        self.proc = proc
        self.address = address
        self.key = key
        self.stderr_path = stderr_path

    def __repr__(self) -> str:
        return f"Server(pid={self.proc.pid}, address={self.address!r})"

    @property
    def pid(self) -> int:
        """The server process's pid."""
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        """The file the server's stderr (its log) goes to."""
        return self.stderr_path

    def stderr(self) -> str:
        """Everything the server has logged so far."""
        return self.stderr_path.read_text(errors="replace")

    log = stderr

    def alive(self) -> bool:
        """True while the server process runs."""
        return self.proc.poll() is None

    def rss_kib(self) -> int:
        """The server process's resident memory, in KiB."""
        return rss_kib(self.pid)

    def session_pids(self) -> List[int]:
        """Pids of the server's live session processes (children of the server), via /proc."""
        return children_of(self.proc.pid)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no session process is left (earlier tests' sessions have ended)."""
        assert wait_until(lambda: not self.session_pids(), timeout), f"sessions still running: {self.session_pids()}"

    def stop(self) -> None:
        """Stop the server at once (SIGINT: SIGTERM would drain it), then SIGKILL whatever is left
        of its process group; reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        reap(self.proc)


ServerProcess = Server  # the name conftest.py exported before the two server helpers were merged


def start_server(
    workdir: Path,
    args: Sequence[str] = (),
    key: Optional[str] = None,
    *,
    key_file: bool = False,
    command: Optional[Sequence[str]] = None,
    exclude_paths: Sequence[str] = (),
    env: Optional[Dict[str, str]] = None,
    timeout: float = 60.0,
) -> Server:
    """Start a worker server on 127.0.0.1 with ``--port 0 *args`` and return once it listens.

    The key (random unless given) reaches the server through ``$RPC_READING_SERVICE_AUTH_KEY``,
    or with ``key_file`` through an ``--auth-key-file`` of mode 0600, as a careful user keeps it.
    ``command`` defaults to :data:`PRELOADED_WORKER`; pass :data:`WORKER_CLI` or the console
    script for the plain CLI. ``exclude_paths`` are left off the server's PYTHONPATH; ``env``
    is added to its environment. The server runs in ``workdir`` (outside the repo, so that only
    PYTHONPATH decides what it can import) and logs to a file there.

    The default command without ``exclude_paths`` or ``env`` is forked from this test process's
    forkserver (:mod:`_server_forkserver`: the same server, without importing torch again);
    anything else is spawned, with ``--parent-pid`` of this process. Either way the server ends
    with the test process, however that ends.
    """
    if isinstance(args, str):  # conftest's old start_server took the key second
        raise TypeError(f"start_server(workdir, args, key): args is a list of CLI arguments, not {args!r}")
    key = secrets.token_hex(16) if key is None else key
    full_env = dict(os.environ)
    full_env.pop(AUTH_KEY_ENV, None)
    key_args: List[str] = []
    if key_file:
        path = workdir / f"key-{secrets.token_hex(4)}.txt"
        path.write_text(key + "\n")
        path.chmod(0o600)
        key_args = ["--auth-key-file", str(path)]
    else:
        full_env[AUTH_KEY_ENV] = key
    full_env["PYTHONPATH"] = _pythonpath(exclude=exclude_paths)
    full_env.update(env or {})
    command = list(command or PRELOADED_WORKER)
    stderr_path = workdir / f"server-{secrets.token_hex(4)}.log"
    argv = [*command, "--host", "127.0.0.1", "--port", "0", "--log-level", "INFO", *key_args, *args]
    with open(stderr_path, "wb") as stderr:
        proc = None if env or exclude_paths else forked_server(argv, full_env, str(workdir), stderr.fileno(), timeout)
        if proc is None:
            proc = subprocess.Popen(
                [*argv, "--parent-pid", str(os.getpid())], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=stderr, env=full_env, start_new_session=True, cwd=str(workdir),
            )  # fmt: skip
    server = Server(proc, "", key, stderr_path)
    try:
        server.address = read_listening_address(proc, timeout)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running_server(workdir: Path, args: Sequence[str] = (), key: Optional[str] = None) -> Iterator[Server]:
    """A plain-CLI server keyed by a key file, warnings silenced, stopped on exit."""
    quiet = {"PYTHONWARNINGS": "ignore"}
    server = start_server(workdir, args, key, key_file=True, command=WORKER_CLI, env=quiet)
    try:
        yield server
    finally:
        server.stop()


def read_listening_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """Read the server's first stdout line (``listening on HOST:PORT``) and return the address."""
    return read_listening_address(proc, timeout)


def remote(server, num_workers: int = 2, **kwargs):
    """An RPCReadingService of ``num_workers`` sessions on ``server`` (or a list of servers sharing a key)."""
    from rpc_reading_service import RPCReadingService

    servers = list(server) if isinstance(server, (list, tuple)) else [server]
    addresses, key = [s.address for s in servers], servers[0].key
    return RPCReadingService(num_workers=num_workers, workers=addresses, auth_key=key, **kwargs)


def run_epochs(datapipe, reading_service, n_epochs=2, seed=None):
    """The items of ``n_epochs`` epochs of a DataLoader2 (seeded if ``seed``), shut down after."""
    from torchdata.dataloader2 import DataLoader2

    with DataLoader2(datapipe, reading_service=reading_service) as dl:
        if seed is not None:
            dl.seed(seed)
        return [list(dl) for _ in range(n_epochs)]


# -- /proc -----------------------------------------------------------------------------------
def children_of(pid: int) -> List[int]:
    """Live children of ``pid`` (see :func:`process_alive`), from /proc/<pid>/task/*/children."""
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


def command_line(pid: int) -> str:
    """The command line of ``pid`` (its arguments joined by spaces; empty once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


#: Children the interpreter keeps until it exits (multiprocessing's and torch's helper daemons),
#: by a part of their command line: not a test's leftovers.
INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch_shm_manager")


def signal_process(pid: int, signum: int) -> None:
    """Send ``signum`` to ``pid``, to its whole process group if it leads one; nothing if it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)


def reap_children(grace: float = 2.0) -> List[str]:
    """End every child this process still has (but :data:`INTERPRETER_HELPERS`), each with its
    process group if it leads one: SIGTERM, SIGKILL after ``grace`` seconds; reap them and return
    their command lines."""
    children = {pid: command_line(pid) for pid in children_of(os.getpid())}
    children = {pid: line for pid, line in children.items() if not any(h in line for h in INTERPRETER_HELPERS)}

    for pid in children:
        signal_process(pid, signal.SIGTERM)
    if not wait_until(lambda: not any(process_alive(pid) for pid in children), grace):
        for pid in children:
            signal_process(pid, signal.SIGKILL)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return list(children.values())


def _live_processes() -> Iterator[Tuple[int, List[str]]]:
    """``(pid, fields after the command name in /proc/<pid>/stat)`` of every live process."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") or process_alive(int(entry)):
            yield int(entry), fields


def session_members(sid: int) -> List[int]:
    """Pids of the live processes of session ``sid``."""
    return [pid for pid, fields in _live_processes() if int(fields[4]) == sid]


def process_group_members(pgid: int) -> List[int]:
    """Pids of the live processes of process group ``pgid``."""
    return [pid for pid, fields in _live_processes() if int(fields[2]) == pgid]


def process_state(pid: int, thread: Optional[int] = None) -> Optional[str]:
    """The one-letter state of ``pid`` (R, S, T, Z, ...), or of its ``thread``; None if it is gone."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        with open(path) as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def process_halted(pid: int) -> bool:
    """True once no thread of ``pid`` runs any more: each one stopped (SIGSTOP) or ended.

    kill() returns before the signal acts: a stop or kill takes a thread when that thread next
    runs, and on a loaded machine the process's other threads go on meanwhile."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return all(process_state(pid, int(thread)) in (None, "T", "t", "Z", "X") for thread in threads)


def process_alive(pid: int) -> bool:
    """True until ``pid`` has ended entirely (its parent can reap it, or has).

    Its main thread alone turning zombie is not the end: the process's other threads may
    still be exiting (or running, holding its sockets), and its parent cannot reap it yet: a
    worker server still counts such a session."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return tasks != [str(pid)] or process_state(pid) not in (None, "Z", "X")


def open_file_targets(pid: int) -> List[str]:
    """What each descriptor ``pid`` holds open names (``/proc/PID/fd``); one closed while read is left out."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed since the listing (a session thread ending, say)
            pass
    return targets


def rss_kib(pid: int) -> int:
    """The resident memory of ``pid``, in KiB."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


# -- waiting on conditions -------------------------------------------------------------------
def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


class FileGate:
    """A gate a worker process stops at until the test opens it: the file ``path`` exists.

    Holds a worker where a test needs it still at work (e.g. until a kill) without sleeps; the
    object pickles to the worker with the graph, and every process sees the same file."""

    def __init__(self, path: Path, timeout: float = 20.0):
        self.path, self.timeout = str(path), timeout

    def close(self) -> None:
        """Make the next :meth:`wait` stop (until :meth:`open`)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def open(self) -> None:
        """Let every process waiting at the gate, and every later one, go on."""
        Path(self.path).touch()

    def wait(self) -> None:
        """In the worker: stop until the gate is open (an AssertionError after ``timeout`` seconds)."""
        assert wait_until(lambda: os.path.exists(self.path), self.timeout), f"the gate {self.path} never opened"


def wait_dead(
    pids: Iterable[Optional[int]], timeout: float = 5.0, what: str = "processes left behind"
) -> None:
    """Assert that every pid in ``pids`` (None entries ignored) is gone within ``timeout``."""
    pids = list(pids)
    alive = lambda: [pid for pid in pids if pid is not None and process_alive(pid)]  # noqa: E731
    assert wait_until(lambda: not alive(), timeout), f"{what}: {alive()}"


# -- threads ---------------------------------------------------------------------------------
# Name prefixes of threads that outlive a test by design (a process-wide agent started on first
# use, say). Keep it short, and say why next to each entry.
ALLOWED_THREAD_PREFIXES: Tuple[str, ...] = ()
# How long the guard waits for a test's threads to end before it calls them leaked (read at call time).
THREAD_END_WAIT_S = 3.0


def threads_left_behind(
    before: Collection[threading.Thread],
    timeout: Optional[float] = None,
    allowed: Optional[Sequence[str]] = None,
) -> List[threading.Thread]:
    """Threads started since ``before`` still alive after waiting up to ``timeout`` (by default
    :data:`THREAD_END_WAIT_S`) for them to end.

    Daemon threads count too. Threads whose name starts with one of ``allowed`` (by default
    :data:`ALLOWED_THREAD_PREFIXES`, read at call time) do not.
    """
    prefixes = tuple(ALLOWED_THREAD_PREFIXES if allowed is None else allowed)
    known: Set[int] = {id(t) for t in before}

    def leaked() -> List[threading.Thread]:
        new = (t for t in threading.enumerate() if id(t) not in known and t.is_alive())
        # A "Dummy-N" stands for a thread Python did not start (TensorPipe's or gloo's C++ threads
        # that ran a Python callback): it never ends in threading's eyes, and no test started it.
        return [t for t in new if not t.name.startswith(prefixes) and not isinstance(t, threading._DummyThread)]

    wait_until(lambda: not leaked(), THREAD_END_WAIT_S if timeout is None else timeout)
    return leaked()


# -- raw protocol clients ----------------------------------------------------------------------
def frame_bytes(chunks: Sequence) -> bytes:
    """The wire bytes of a frame given as its encoder's chunks."""
    return b"".join(bytes(c) for c in chunks)


def connect(address: str, timeout: float = 5.0) -> socket.socket:
    """A TCP_NODELAY socket connected to ``address`` (nothing sent yet)."""
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


def send_and_read_until_closed(sock: socket.socket, data: bytes, timeout: float = 5.0) -> Tuple[bytes, bool]:
    """Send ``data``, half-close, and read what the peer sends until it closes; ``(data, closed)``.
    Closes ``sock``. A peer that hangs up before reading it all is no error: its reply is read."""
    try:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return read_until_closed(sock, timeout)
    finally:
        sock.close()


def reject_reason(data: bytes) -> str:
    """The reason in the REJECT frame that ``data`` (a server's reply to a bad handshake) starts with."""
    reader = FrameReader(allowed_kinds=HANDSHAKE_KINDS)
    reader.feed(data)
    frame = reader.next_frame()
    assert frame is not None and frame.kind == MessageKind.REJECT, data
    return bytes(frame.body).decode()


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
    """``item``, after ``delay`` seconds of work."""
    time.sleep(delay)
    return item


def slow_rank(rank: int, seconds: float) -> Callable[[Any, Any], Any]:
    """A ``worker_init_fn`` that makes worker ``rank`` spend ``seconds`` on each of its items."""

    def init(datapipe: Any, info: Any) -> Any:
        if info.worker_id != rank:
            return datapipe
        return datapipe.map(_Sleep(seconds))

    return init


class _Sleep:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, item: Any) -> Any:
        time.sleep(self.seconds)
        return item


def subprocess_env(**extra: str) -> Dict[str, str]:
    """This process's environment for a Python subprocess that imports the tests' modules (the
    PYTHONPATH of :func:`_pythonpath`), with ``extra`` variables."""
    return dict(os.environ, PYTHONPATH=_pythonpath(), **extra)


def spawn_python(code: str, workdir: Path, args: Sequence[str] = ()) -> subprocess.Popen:
    """Run ``python -c code *args`` (a trainer) in its own process group, forked from the forkserver
    (:func:`_server_forkserver.forked_python`: torch imported already); stdin and stdout are
    pipes, stderr goes to a log file in ``workdir``."""
    env = subprocess_env(PYTHONWARNINGS="ignore")
    with open(workdir / f"trainer-{secrets.token_hex(4)}.log", "wb") as log:
        forked = forked_python(["-c", code, *args], env, str(workdir), log.fileno(), stdin_pipe=True)
        if forked is not None:
            return forked  # type: ignore[return-value] - the part of Popen the tests use
        return subprocess.Popen(
            [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log, env=env, start_new_session=True, cwd=str(workdir),
        )  # fmt: skip


def python_run(argv: Sequence[str], env: Dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """``python *argv`` to its end, as ``subprocess.run`` with text output captured: forked from the
    forkserver (:func:`_server_forkserver.forked_python`: torch imported already) if ``env`` allows,
    else spawned; in a session of its own, reaped with it on any outcome (a timeout raises)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = forked_python(list(argv), env, cwd, err.fileno(), stdout_fd=out.fileno())
        if proc is None:
            proc = subprocess.Popen(
                [sys.executable, *argv], stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=cwd,
                start_new_session=True,
            )  # fmt: skip
        try:
            code = proc.wait(timeout)
        finally:
            reap(proc)
        out.seek(0)
        err.seek(0)
        said = [stream.read().decode(errors="replace") for stream in (out, err)]
    return subprocess.CompletedProcess([sys.executable, *argv], code, *said)


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


def python_calls(function: Callable[..., Any], *args: Any) -> Tuple[Any, List[str]]:
    """``function(*args)``'s result and the names of the Python functions (not C ones) it called."""
    calls: List[str] = []
    enabled = gc.isenabled()
    gc.disable()  # no collection's callbacks (weak references, finalizers) among the calls counted
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
    try:
        result = function(*args)
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return result, calls[1:]  # not the frame of ``function`` itself
