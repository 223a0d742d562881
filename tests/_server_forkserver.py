"""A pre-imported interpreter that forks the tests' worker servers and trainers (one per test
process).

A fresh ``PRELOADED_WORKER`` server spends ~2.5 s of CPU importing torch, torchdata and
pytest before it listens, and the suite starts ~70 of them on a 2-core machine. The
forkserver imports the same modules once, then forks one server per request. The child first
makes itself what a fresh ``python -c ... ARGS`` would be: a session of its own, the
requested working directory, environment and fds 0-2 (nothing else open), default signal
handlers; then it runs ``rpc_reading_service.worker`` as ``__main__``, as ``PRELOADED_WORKER``
does. The server code is the same; only the imports are done before the fork (which the
server itself does before forking its sessions).

``multiprocessing``'s forkserver is not used: its children run inside multiprocessing's
bootstrap (stdin replaced, the test process's resource tracker, finalizers), which a server
started from a shell does not.

:func:`forked_python` forks ``python -c CODE``, ``-m MODULE`` or ``SCRIPT ...`` the same way (a
trainer, a README block): the code runs as ``__main__`` and the child exits as that interpreter
would (atexit handlers, finalizers; an uncaught exception's traceback and exit code 1). Tests
that check a fresh interpreter itself still start one.

Only interpreters that would start the same way can come from here: the same ``PYTHON*``
environment (PYTHONPATH above all) as the forkserver's, except PYTHONWARNINGS of plain actions
(``ignore``), which the child applies.
:func:`forked_server` and :func:`forked_python` say so by returning None.

A server's parent is the forkserver, which reaps it and writes its exit code on a pipe of its
own, read by :class:`ForkedServerProcess` (the part of ``subprocess.Popen`` the tests use). The
forkserver exits when the test process closes its control socket (or dies), and each server
watches the forkserver (``--parent-pid``) and stops then.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.util
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
import warnings
from typing import Dict, List, Optional

from rpc_reading_service.trainer.local_fleet import ForkedProcess

_MAX_REQUEST = 1 << 20
# What _server_helpers.PRELOADED_WORKER runs (kept here: that module imports this one).
PRELOADED_COMMAND = [
    sys.executable,
    "-c",
    "import sys, runpy, pytest, hypothesis; "
    "runpy.run_module('rpc_reading_service.worker', run_name='__main__', alter_sys=True)",
]
_PRELOADS = ("pytest", "hypothesis", "rpc_reading_service.worker", "torchdata.dataloader2")

# The forkserver: preload, then serve requests on the control socket (fd given as argv[1]).
_SCRIPT = "import sys, _server_forkserver as f; f.serve(int(sys.argv[1]))"


def _python_env(env: Dict[str, str]) -> Dict[str, str]:
    """The variables that decide how an interpreter starts (PYTHONPATH, PYTHONWARNINGS, ...)."""
    return {name: value for name, value in env.items() if name.startswith("PYTHON")}


def _warnings_actions(env: Dict[str, str]) -> Optional[List[str]]:
    """``env``'s PYTHONWARNINGS as plain actions (``ignore``, ``error``, ...), or None if it has filters
    with a category, module or line (which a forked child does not apply)."""
    options = [option.strip() for option in env.get("PYTHONWARNINGS", "").split(",") if option.strip()]
    return None if any(":" in option for option in options) else options


# -- the forkserver process -------------------------------------------------------------------
def serve(control_fd: int) -> None:
    """Preload, then fork a server per request until the test process closes the control socket."""
    for name in _PRELOADS:
        importlib.import_module(name)
    # The child runs the worker module as __main__; a fresh server has no other copy of it.
    del sys.modules["rpc_reading_service.worker"]
    del sys.modules["rpc_reading_service"].worker
    control = socket.socket(fileno=control_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select through wake_w
    status_fds: Dict[int, int] = {}  # server pid -> the pipe its exit code goes to
    with selectors.DefaultSelector() as selector:
        selector.register(control, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is wake_r:
                    os.read(wake_r, 4096)
                    continue
                message, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST, 4)
                if not message:  # the test process is gone (or done): its servers are its to reap
                    os._exit(0)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    request = json.loads(message)
                    if "argv" in request:
                        _become_interpreter(request, fds, control)
                        return  # raises SystemExit: the interpreter exits as a fresh one would
                    _become_server(request, fds, control)
                for fd in fds[:3]:
                    os.close(fd)
                status_fds[pid] = fds[3]
                control.send(json.dumps({"pid": pid}).encode())
            _reap(status_fds)


def _reap(status_fds: Dict[int, int]) -> None:
    while status_fds:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        fd = status_fds.pop(pid, None)
        if fd is not None:
            os.write(fd, str(os.waitstatus_to_exitcode(status)).encode())
            os.close(fd)


def _set_up_child(request: dict, fds: List[int], control: socket.socket) -> None:
    """In the forked child: a session of its own, fds 0-2, the working directory and environment
    (and warnings options) of ``request``, default signal handlers, nothing else open."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    control.close()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    # Nothing else stays open: not the wake-up pipe, not the exit-code pipes (this
    # server's, or those of the servers forked before it, which would never see EOF).
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    # A fresh interpreter lists its working directory ('' on sys.path) while it imports
    # at start-up: do so now too, not at the server's first late import (which may come
    # when it has no descriptor left to list it with).
    importlib.util.find_spec("_no_such_module_")
    os.environ.clear()
    os.environ.update(request["env"])
    for action in _warnings_actions(request["env"]) or ():
        warnings.simplefilter(action)  # in order, as at start-up: the last one wins


def _become_interpreter(request: dict, fds: List[int], control: socket.socket) -> None:
    """In the forked child: set up, then run ``python ARGV`` (``-c CODE ...``, ``-m MODULE ...`` or
    ``SCRIPT ...``) as ``__main__``; an exception ends it as it ends a fresh interpreter (traceback,
    exit code 1)."""
    _set_up_child(request, fds, control)
    sys.argv = list(request["argv"])
    if sys.argv[0] == "-m":
        sys.path[0] = os.getcwd()  # where ``python -m`` looks first
        module = sys.argv.pop(1)
        run = functools.partial(runpy.run_module, module, run_name="__main__", alter_sys=True)
    else:
        main = types.ModuleType("__main__")
        main.__spec__ = None
        if sys.argv[0] == "-c":
            code = compile(sys.argv.pop(1), "<string>", "exec")
        else:
            main.__file__ = os.path.abspath(sys.argv[0])  # as Python gives a script's __file__
            sys.path[0] = os.path.dirname(main.__file__)
            with open(main.__file__, "rb") as source:
                code = compile(source.read(), main.__file__, "exec")
        sys.modules["__main__"] = main
        run = functools.partial(exec, code, main.__dict__)
    try:
        run()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        raise SystemExit(1)
    raise SystemExit(0)


def _become_server(request: dict, fds: List[int], control: socket.socket) -> None:
    """In the forked child: set up as a fresh interpreter would be, run the worker, exit."""
    code = 1
    try:
        _set_up_child(request, fds, control)
        # It ends once the forkserver does (when the test process is gone, even killed): a test
        # process that crashed leaves no server behind.
        sys.argv = ["-c", *request["args"], "--parent-pid", str(os.getppid())]

        runpy.run_module("rpc_reading_service.worker", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # as the interpreter treats it
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - report as an uncaught exception would be, then exit
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


# -- the test process's side ------------------------------------------------------------------
class ForkedServerProcess(ForkedProcess):
    """A server forked by the forkserver, with what ``subprocess.Popen`` has that the tests use:
    local_fleet's handle of a forked server, its exit code read from the forkserver's pipe (the
    server is the forkserver's child, not this process's)."""

    def __init__(self, pid: int, args: List[str], stdout, status_fd: int) -> None:
        super().__init__(pid)
        self.args = args
        self.stdin = None
        self.stdout = stdout
        self.stderr = None
        os.set_blocking(status_fd, False)
        self._status_fd = status_fd

    def __repr__(self) -> str:
        return f"ForkedServerProcess(pid={self.pid}, returncode={self.returncode})"

    def poll(self) -> Optional[int]:
        """The exit code, or None while the server runs."""
        if self.returncode is None:
            try:
                text = os.read(self._status_fd, 64)  # written at once, when the forkserver reaped it
            except BlockingIOError:
                return None
            os.close(self._status_fd)
            if not text:
                raise RuntimeError(f"the forkserver ended before server {self.pid}: no exit code for it")
            self.returncode = int(text)
        return self.returncode


class _ForkServer:
    def __init__(self, python_env: Dict[str, str]) -> None:
        self.python_env = python_env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {name: value for name, value in os.environ.items() if not name.startswith("PYTHON")}
        env.update(python_env)
        self.stderr = tempfile.TemporaryFile()  # read only to say why it failed
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SCRIPT, str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.stderr,
                start_new_session=True, cwd=os.path.dirname(os.path.abspath(__file__)),
            )  # fmt: skip
        self.control = ours
        self.lock = threading.Lock()

    def fork(
        self, request: dict, stderr_fd: int, timeout: float, stdout_fd: Optional[int] = None,
        stdin_pipe: bool = False,
    ) -> ForkedServerProcess:
        """Fork a child for ``request``: stdout a pipe unless ``stdout_fd``, stdin a pipe if ``stdin_pipe``
        else /dev/null."""
        ours: List = []  # the test process's ends: stdout's read end, stdin's write end
        theirs: List[int] = []  # the child's ends, closed here once sent
        if stdin_pipe:
            stdin_r, stdin_w = os.pipe()
            theirs.append(stdin_r)
            ours.append(stdin_w)
        else:
            theirs.append(os.open(os.devnull, os.O_RDONLY))
        if stdout_fd is None:
            stdout_r, stdout_w = os.pipe()
            ours.append(stdout_r)
            theirs.append(stdout_w)
        status_r, status_w = os.pipe()
        child_fds = [theirs[0], stdout_fd if stdout_fd is not None else theirs[1], stderr_fd, status_w]
        try:
            with self.lock:
                try:
                    self.control.settimeout(timeout)
                    socket.send_fds(self.control, [json.dumps(request).encode()], child_fds)
                    reply = self.control.recv(4096)
                except ConnectionError:  # the forkserver is gone (said below)
                    reply = b""
        finally:
            for fd in (*theirs, status_w):
                os.close(fd)
        if not reply:
            for fd in (*ours, status_r):
                os.close(fd)
            self.stderr.seek(0)
            said = self.stderr.read()[-3000:].decode(errors="replace")
            raise RuntimeError(f"the tests' server forkserver exited (code {self.proc.wait(5)}):\n{said}")
        pid = json.loads(reply)["pid"]
        stdout = os.fdopen(stdout_r, "rb") if stdout_fd is None else None
        process = ForkedServerProcess(pid, request.get("argv") or request["args"], stdout, status_r)
        if stdin_pipe:
            process.stdin = os.fdopen(stdin_w, "wb")
        return process

    def close(self) -> None:
        self.control.close()  # the forkserver exits on EOF
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


_forkserver: Optional[_ForkServer] = None
_forkserver_lock = threading.Lock()


def close_forkserver() -> None:
    """Stop this process's forkserver, if it started one (its servers then stop too: they watch it)."""
    global _forkserver
    with _forkserver_lock:
        server, _forkserver = _forkserver, None
    if server is not None:
        server.close()


def _forkserver_for(env: Dict[str, str]) -> Optional[_ForkServer]:
    """This process's forkserver (started now if need be), or None if ``env`` would start an
    interpreter otherwise than it (other ``PYTHON*`` variables than PYTHONWARNINGS's plain actions)."""
    global _forkserver
    if _warnings_actions(env) is None:
        return None
    python_env = _python_env(env)
    python_env.pop("PYTHONWARNINGS", None)  # the child applies them (_set_up_child)
    with _forkserver_lock:
        if _forkserver is None:
            _forkserver = _ForkServer(python_env)
            atexit.register(close_forkserver)
        server = _forkserver
    return server if python_env == server.python_env else None


def forked_server(
    command: List[str], env: Dict[str, str], cwd: str, stderr_fd: int, timeout: float = 60.0
) -> Optional[ForkedServerProcess]:
    """``command`` (``PRELOADED_WORKER`` and its arguments) forked with ``env`` in ``cwd``, stderr
    to ``stderr_fd``, stdout a pipe; None if ``command`` is another one or ``env`` would start its
    interpreter otherwise than this process's forkserver (the caller then spawns the server)."""
    if command[: len(PRELOADED_COMMAND)] != PRELOADED_COMMAND:
        return None
    server = _forkserver_for(env)
    if server is None:
        return None
    request = {"args": command[len(PRELOADED_COMMAND):], "env": env, "cwd": cwd}
    return server.fork(request, stderr_fd, timeout)


def forked_python(
    argv: List[str], env: Dict[str, str], cwd: str, stderr_fd: int, *,
    stdout_fd: Optional[int] = None, stdin_pipe: bool = False, timeout: float = 60.0,
) -> Optional[ForkedServerProcess]:
    """``python *argv`` (``-c CODE``, ``-m MODULE`` or ``SCRIPT ...``) forked from the forkserver, in
    a session of its own, with ``env`` in ``cwd``; stderr to ``stderr_fd``, stdout to ``stdout_fd``
    or a pipe, stdin a pipe if ``stdin_pipe``; None if ``env`` would start its interpreter otherwise."""
    server = _forkserver_for(env)
    if server is None:
        return None
    request = {"argv": list(argv), "env": env, "cwd": cwd}
    return server.fork(request, stderr_fd, timeout, stdout_fd=stdout_fd, stdin_pipe=stdin_pipe)
