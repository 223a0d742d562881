"""Shared fixtures: real ``rpc-reading-worker`` server subprocesses on loopback, and a guard
against threads a test leaves behind.

Plain helpers live in ``_server_helpers``; the names below are re-exported for the test
modules that import them from here.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
import warnings
from typing import Dict, List, Optional

import pytest

# Tests talk to loopback only: gloo process groups (spawned trainers inherit this) would
# otherwise use whatever address this host's name resolves to.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from _server_forkserver import close_forkserver  # noqa: E402
from _server_helpers import (  # noqa: E402, F401 - re-exported: test modules import these from conftest
    AUTH_KEY_ENV,
    PRELOADED_WORKER,
    VENV_BIN,
    Server,
    ServerProcess,
    _pythonpath,
    children_of,
    process_alive,
    read_listening_line,
    reap_children,
    run_epochs,
    start_server,
    threads_left_behind,
)


# Test files, longest first (about 15 s or more each on this 2-core machine, measured with
# `make test` on 2026-12-04): collected first, so that `make test` (xdist keeps this order with
# --no-loadscope-reorder) hands them out first and ends with the short files. xdist's own order
# (most tests first) left one-test files of 20-30 s to the end, each the tail of the run. Files not
# listed follow in collection order. The list decides the order only: a stale one costs balance,
# never a check. The `system` files keep their place for `make test-system`.
LONGEST_FILES_FIRST = (
    "test_mprs_parity.py", "test_reassign.py", "test_transport_conformance.py", "test_checkpoint.py",
    "test_checkpoint_bounds.py", "test_local_fleet.py", "test_readme.py", "test_worker.py",
    "test_cluster.py", "test_launch_recipes.py", "test_benchmarks.py", "test_join.py",
    "test_session_hardening.py", "test_discovery.py", "test_fork_safety.py", "test_shared_memory_processes.py",
    "test_autoscale.py", "test_cache.py", "test_fleet_checkpoint.py", "test_torch_rpc_transport.py",
    "test_reading_service.py", "test_end_to_end.py", "test_example_ddp_train.py", "test_metrics.py",
    "test_suite_processes.py", "test_serialization.py", "test_dispatch.py", "test_server_hardening.py",
    "test_multi_trainer.py", "test_load.py", "test_fleet_soak.py",
)  # fmt: skip


# Whole-system runs, marked ``system``: the examples under torchrun, the launch recipes, the
# benchmark harness and hosts in network namespaces. Each starts many fresh interpreters (about
# 3 s of CPU each, importing torch), so `make test` leaves them to `make test-system`; CI runs both.
SYSTEM_FILES = (
    "test_example_ddp_train.py", "test_example_image_augmentation.py", "test_launch_recipes.py",
    "test_benchmarks.py", "test_cluster.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    """Mark the tests of :data:`SYSTEM_FILES` ``system``; run the files of
    :data:`LONGEST_FILES_FIRST` first, in its order (a stable sort: each file's tests keep their order)."""
    for item in items:
        if item.path.name in SYSTEM_FILES:
            item.add_marker(pytest.mark.system)
    rank = {name: index for index, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


#: Seconds past a test's pytest-timeout limit after which :func:`pytest_runtest_protocol` ends its
#: test process: pytest-timeout's SIGALRM cannot stop a test stuck in C code or in a teardown
#: that blocks after it fired.
HARD_LIMIT_MARGIN_S = 60.0


def hard_limit(item: pytest.Item) -> Optional[float]:
    """Seconds after which ``item``'s test process is ended: its timeout (marker, else the ini's
    ``timeout``) plus :data:`HARD_LIMIT_MARGIN_S`; None when it has no timeout."""
    marker = item.get_closest_marker("timeout")
    limit = None
    if marker is not None:
        limit = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
    if limit is None:
        limit = item.config.getini("timeout")
    limit = float(limit or 0)
    return limit + HARD_LIMIT_MARGIN_S if limit > 0 else None


class HardLimit:
    """faulthandler's watchdog over one test, disarmed around every ``os.fork`` of this process.

    A child forked while the watchdog is armed inherits it as running without its thread: its
    first ``dump_traceback_later`` (a forked worker session's ``LockWatch``) waits for that thread
    forever. So the watchdog is cancelled before a fork and armed again in the parent after it.
    """

    deadline: Optional[float] = None

    @classmethod
    def arm(cls, seconds: float) -> None:
        """End this process, with every thread's stack, ``seconds`` from now unless :meth:`disarm`."""
        cls.deadline = time.monotonic() + seconds
        cls.resume()

    @classmethod
    def disarm(cls) -> None:
        """Cancel the watchdog."""
        cls.deadline = None
        faulthandler.cancel_dump_traceback_later()

    @classmethod
    def _pause(cls) -> None:
        if cls.deadline is not None:
            faulthandler.cancel_dump_traceback_later()

    @classmethod
    def resume(cls) -> None:
        """Arm the watchdog again for what is left of the test's time (after something cancelled it)."""
        if cls.deadline is not None:
            left = max(cls.deadline - time.monotonic(), 0.001)
            faulthandler.dump_traceback_later(left, exit=True, file=_STDERR_COPY[0])

    @classmethod
    def _forget(cls) -> None:
        cls.deadline = None


os.register_at_fork(before=HardLimit._pause, after_in_parent=HardLimit.resume, after_in_child=HardLimit._forget)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]):
    """End the test process if one test (setup, call and teardown, with the module fixtures it
    tears down) outlives :func:`hard_limit`: faulthandler's C watchdog writes every thread's stack
    to the process's stderr and exits, however the test blocks; xdist reports the test as crashed
    and goes on (see :func:`pytest_xdist_make_scheduler`)."""
    limit = hard_limit(item)
    if limit is not None:
        HardLimit.arm(limit)
    try:
        yield
    finally:
        if limit is not None:
            HardLimit.disarm()


@pytest.hookimpl(trylast=True)
def pytest_exception_interact() -> None:
    """pytest's faulthandler plugin cancels the watchdog when a test fails: arm it again (a
    teardown that blocks after pytest-timeout failed the test has no other limit)."""
    HardLimit.resume()


#: A copy of the process's own stderr (not pytest's capture of it), for the stacks of a stuck test.
_STDERR_COPY: List[int] = []


def pytest_configure(config: pytest.Config) -> None:
    """Keep a copy of stderr while pytest does not capture it (between loading conftests and the session)."""
    _STDERR_COPY.append(os.dup(2))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """End what the tests left running: the forkserver (its servers follow it), then every child
    process this test process still has, with a warning that names their command lines. Not in
    xdist's controller, which runs no test (its children are the test processes)."""
    if getattr(session.config, "workerinput", None) is None and getattr(session.config.option, "dist", "no") != "no":
        return
    close_forkserver()
    left = reap_children()
    if left:
        message = f"{len(left)} child process(es) left running by the tests, ended: " + "; ".join(left)
        os.write(_STDERR_COPY[0], f"\nWARNING: {message}\n".encode())  # seen under xdist too
        warnings.warn(message, pytest.PytestWarning, stacklevel=1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` without xdist's hang after a crashed worker: see :func:`crash_safe_loadfile`."""
    if config.getvalue("dist") != "loadfile":
        return None
    return crash_safe_loadfile()(config, log)


def crash_safe_loadfile() -> type:
    """xdist's ``LoadFileScheduling``, except that a crashed worker's files are handed out again
    without the test it crashed in (reported failed, as ``--dist load`` does) and without the files
    it had finished.

    xdist 3.8 requeues every file the worker was given, finished or not, and the crashing test:
    a finished file reaches the replacement worker as an empty batch, which never completes, so
    the files queued behind it are never handed out and the run waits forever (and the crashing
    test crashed each replacement in turn).
    """
    from xdist.scheduler import LoadFileScheduling

    class CrashSafeLoadFile(LoadFileScheduling):
        def remove_node(self, node) -> Optional[str]:
            workload: Dict[str, Dict[str, bool]] = self.assigned_work.pop(node)
            pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
            if not pending:
                return None
            crashitem = pending[0]  # a worker runs its files, and their tests, in order
            for scope, unit in workload.items():
                unit.pop(crashitem, None)
                if not all(unit.values()):
                    self.workqueue[scope] = unit
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

    return CrashSafeLoadFile


@pytest.fixture(scope="module")
def worker_server(tmp_path_factory):
    """One keyed worker server shared by a test module; yields a :class:`Server`."""
    server = start_server(tmp_path_factory.mktemp("server"))
    yield server
    server.stop()


@pytest.fixture
def fresh_server(tmp_path):
    """A worker server of this test's own (for tests that kill or disturb it): call it with
    :func:`start_server`'s keyword arguments; every server it started is stopped after the test."""
    servers: List[Server] = []

    def start(**kwargs) -> Server:
        server = start_server(tmp_path, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    """Fail a test that leaves threads behind: every thread started during the test must have
    ended within a few seconds of its end (daemon or not; see ``ALLOWED_THREAD_PREFIXES``)."""
    before = set(threading.enumerate())
    yield
    leaked = threads_left_behind(before)
    assert not leaked, "threads left behind by this test: " + ", ".join(
        f"{t.name!r} (daemon={t.daemon})" for t in leaked
    )
