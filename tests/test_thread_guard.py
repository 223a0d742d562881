"""The leaked-thread guard of conftest.py can fail: a pytest run of its own on tests that leak."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _server_helpers import TESTS_DIR, _pythonpath

LEAKY_TESTS = '''
import threading
import time

import _server_helpers

never = threading.Event()
# set for the whole run: a fixture (monkeypatch) would be undone before the guard looks
_server_helpers.ALLOWED_THREAD_PREFIXES = ("rrs-agent-",)
# each leak costs the guard's whole wait: a shorter one, still well past rrs-finishing's 0.3 s
_server_helpers.THREAD_END_WAIT_S = 1.0


def test_leaks_a_daemon_thread():
    threading.Thread(target=never.wait, name="rrs-deliberate-leak", daemon=True).start()


def test_leaks_a_thread_of_any_name():
    threading.Thread(target=never.wait, name="Thread-pool-leak", daemon=True).start()


def test_a_thread_ending_just_after_the_test_is_no_leak():
    threading.Thread(target=time.sleep, args=(0.3,), name="rrs-finishing", daemon=True).start()


def test_threads_earlier_tests_leaked_are_not_blamed_on_a_later_one():
    pass


def test_an_allowed_thread_is_no_leak():
    threading.Thread(target=never.wait, name="rrs-agent-1", daemon=True).start()
'''


@pytest.mark.timeout(60)
def test_the_guard_fails_a_test_that_leaves_a_thread_behind(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS)
    run = subprocess.run(
        # conftest.py as a plugin: its fixtures (the guard among them) apply to a directory outside tests/
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-v", "test_leaky.py"],
        capture_output=True, text=True, timeout=50, cwd=str(tmp_path),
        env={"PYTHONPATH": _pythonpath(extra=[str(TESTS_DIR)]), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    for name in ("test_leaks_a_daemon_thread", "test_leaks_a_thread_of_any_name"):
        assert f"{name} PASSED" in out and f"{name} ERROR" in out, out  # the call passed, the guard failed it
    assert "threads left behind by this test: 'rrs-deliberate-leak' (daemon=True)" in out, out
    assert "threads left behind by this test: 'Thread-pool-leak' (daemon=True)" in out, out
    for name in (
        "test_a_thread_ending_just_after_the_test_is_no_leak",
        "test_threads_earlier_tests_leaked_are_not_blamed_on_a_later_one",
        "test_an_allowed_thread_is_no_leak",
    ):
        assert f"{name} PASSED" in out and f"{name} ERROR" not in out, out
    assert "5 passed, 2 errors" in out, out  # pytest counts a call that passed before its teardown failed
