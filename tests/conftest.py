"""Shared fixtures: real ``rpc-reading-worker`` server subprocesses on loopback, and a guard
against threads a test leaves behind.

Plain helpers live in ``_server_helpers``; the names below are re-exported for the test
modules that import them from here.
"""

from __future__ import annotations

import os
import threading
from typing import List

import pytest

# Tests talk to loopback only: gloo process groups (spawned trainers inherit this) would
# otherwise use whatever address this host's name resolves to.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

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
    run_epochs,
    start_server,
    threads_left_behind,
)


# Test files, longest first (about 15 s or more each on this 2-core machine, measured with
# `make test` on 2026-12-01): collected first, so that `make test` (xdist keeps this order with
# --no-loadscope-reorder) hands them out first and ends with the short files. xdist's own order
# (most tests first) left one-test files of 20-30 s to the end, each the tail of the run. Files not
# listed follow in collection order. The list decides the order only: a stale one costs balance,
# never a check.
LONGEST_FILES_FIRST = (
    "test_checkpoint_bounds.py", "test_fork_safety.py", "test_reassign.py", "test_fleet_soak.py", "test_cache.py", "test_session_hardening.py", "test_readme.py",
    "test_discovery.py", "test_checkpoint.py", "test_cluster.py", "test_launch_recipes.py",
    "test_benchmarks.py", "test_server_hardening.py", "test_transport_conformance.py",
    "test_torch_rpc_transport.py", "test_end_to_end.py", "test_example_ddp_train.py", "test_worker.py",
    "test_multi_trainer.py", "test_local_fleet.py", "test_mprs_parity.py", "test_tls.py", "test_scale.py",
    "test_load.py",
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
