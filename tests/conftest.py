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
