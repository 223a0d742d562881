"""The suite's own hygiene: processes a test starts end with its test process.

Each test runs pytest in a subprocess (a test process of its own, with this suite's conftest)
on a tiny test file, which crashes after starting a server, or leaves a child running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Tuple

import pytest
from _server_forkserver import forked_python
from _server_helpers import children_of, process_alive, reap, signal_process, subprocess_env, wait_until

pytestmark = pytest.mark.timeout(90)

SPAWNS_A_SERVER_AND_DIES = """
import os, signal
from pathlib import Path
from typing import Tuple
from _server_helpers import WORKER_CLI, start_server

def test_dies_with_a_server_running(tmp_path):
    server = start_server(tmp_path, command=WORKER_CLI)  # spawned, not forked
    Path(os.environ["CHILD_PID_FILE"]).write_text(str(server.pid))
    if os.environ["HOW"] == "exit":
        os._exit(1)
    os.kill(os.getpid(), signal.SIGKILL)
"""

LEAVES_A_CHILD = """
import os, subprocess, sys
from pathlib import Path
from typing import Tuple

def test_leaves_a_child_running():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # left-behind"])
    Path(os.environ["CHILD_PID_FILE"]).write_text(str(child.pid))
"""


def run_test_process(tmp_path: Path, source: str, **env: str) -> Tuple[subprocess.CompletedProcess, int]:
    """pytest with this suite's conftest on a test file of ``source``; its result and the pid it wrote."""
    test_file = tmp_path / "test_tiny.py"
    test_file.write_text(source)
    pid_file = tmp_path / "child.pid"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", str(test_file)]
    full_env = subprocess_env(CHILD_PID_FILE=str(pid_file), **env)
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
        cwd=str(tmp_path), start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        reap(proc)
    assert pid_file.exists(), f"the test process wrote no pid ({proc.returncode}):\n{out.decode(errors='replace')}"
    done = subprocess.CompletedProcess(command, proc.returncode, out.decode(errors="replace"))
    return done, int(pid_file.read_text())


@contextlib.contextmanager
def killed_at_exit(pid: int):
    """Kill ``pid`` (and its process group if it leads one) after the block, if it is still alive."""
    try:
        yield
    finally:
        if process_alive(pid):
            signal_process(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_spawned_test_server_ends_with_a_test_process_that_dies(tmp_path, how):
    done, server_pid = run_test_process(tmp_path, SPAWNS_A_SERVER_AND_DIES, HOW=how)
    with killed_at_exit(server_pid):
        assert done.returncode == (1 if how == "exit" else -signal.SIGKILL), done.stdout
        assert wait_until(lambda: not process_alive(server_pid), 5), f"server {server_pid} outlived its test process"


def test_a_child_left_running_is_ended_at_session_end_with_a_warning(tmp_path):
    done, child_pid = run_test_process(tmp_path, LEAVES_A_CHILD)
    with killed_at_exit(child_pid):
        assert not process_alive(child_pid), f"child {child_pid} outlived the test session"
        assert done.returncode == 0, done.stdout
        assert "child process(es) left running by the tests, ended" in done.stdout
        assert "time.sleep(120)  # left-behind" in done.stdout


# -- interpreters forked from the tests' forkserver (trainers, README blocks) ----------------------
FORKED_SCRIPT = """
import atexit, json, sys, warnings
atexit.register(lambda: print("atexit ran", flush=True))
warnings.warn("a warning PYTHONWARNINGS=ignore hides")
print(json.dumps({"argv": sys.argv, "main": __name__, "file": globals().get("__file__"), "path0": sys.path[0],
                  "stdin": sys.stdin.readline()}), flush=True)
if sys.argv[-1] == "raise":
    raise ValueError("uncaught")
"""


@pytest.mark.parametrize("how, ends", [("-c", "returns"), ("script", "raise")])
def test_a_forked_interpreter_runs_its_code_as_main_and_exits_as_a_fresh_one(tmp_path, how, ends):
    script = tmp_path / "script.py"
    script.write_text(FORKED_SCRIPT)
    argv = ["-c", FORKED_SCRIPT, "x", ends] if how == "-c" else ["script.py", "x", ends]
    with open(tmp_path / "stderr.txt", "wb") as stderr:
        proc = forked_python(argv, subprocess_env(PYTHONWARNINGS="ignore"), str(tmp_path), stderr.fileno(),
                             stdin_pipe=True)  # fmt: skip
    assert proc is not None
    try:
        proc.stdin.write(b"from stdin\n")
        proc.stdin.close()
        code = proc.wait(30)
        lines = proc.stdout.read().decode().splitlines()
    finally:
        reap(proc)
    said = json.loads(lines[0])
    if how == "-c":
        assert said == {"argv": ["-c", "x", ends], "main": "__main__", "file": None, "path0": "",
                        "stdin": "from stdin\n"}  # fmt: skip
    else:
        assert said == {"argv": ["script.py", "x", ends], "main": "__main__", "file": str(script),
                        "path0": str(tmp_path), "stdin": "from stdin\n"}  # fmt: skip
    assert lines[1:] == ["atexit ran"]  # the interpreter's exit ran
    stderr = (tmp_path / "stderr.txt").read_text()
    if ends == "raise":
        assert code == 1 and stderr.rstrip().endswith("ValueError: uncaught"), stderr
    else:
        assert code == 0 and stderr == "", stderr
    assert proc.pid not in children_of(os.getpid())  # the forkserver's child, not this process's


def test_stopping_a_forked_server_that_the_forkserver_reaped_meanwhile_does_not_raise():
    """A killed forked server may be reaped by the forkserver between our poll and our signal
    (its exit code not written yet): stopping it then is not an error."""
    from _server_forkserver import ForkedServerProcess

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)  # reaped: its pid names no process, as a server the forkserver just reaped
    status_read, status_write = os.pipe()  # nothing written yet: poll() says it still runs
    try:
        server = ForkedServerProcess(child.pid, [], None, status_read)
        assert server.poll() is None
        server.send_signal(signal.SIGINT)
        server.kill()
        os.write(status_write, b"-9")
        assert server.wait(5) == -9
    finally:
        os.close(status_write)
