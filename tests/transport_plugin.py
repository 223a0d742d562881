"""A third-party transport, as a plugin author would write one: the socket transport,
wrapped to count frames. Used by ``test_transport_conformance.py``.

How each side finds it (the two plugin paths):

- The trainer (the pytest process) calls ``register_transport("test_plugin", CountingTransport)``.
- A worker server is a separate process that never runs test code, so it discovers the
  plugin the way it discovers any installed third-party transport: through the entry-point
  group ``rpc_reading_service.transports``. ``tests/plugin_dist`` holds the metadata an
  installed package would have (``rrs_test_plugin-0.1.dist-info/entry_points.txt`` with
  ``test_plugin = transport_plugin:CountingTransport``); the tests put that directory (and
  ``tests/``, for this module) on the server's ``PYTHONPATH``, so ``importlib.metadata``
  finds it as it would find a pip-installed distribution.

A server using the plugin appends ``listen PID`` / ``accept PID`` lines to the file named by
``$RRS_TEST_PLUGIN_LOG``, so a test can tell that the server side ran this code too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

from rpc_reading_service.protocol import Buffer, Frame
from rpc_reading_service.transports.base import Allocator, Connection, Transport, WrappingListener
from rpc_reading_service.transports.socket_transport import SocketTransport

PLUGIN_NAME = "test_plugin"
LOG_ENV = "RRS_TEST_PLUGIN_LOG"
DIST_DIR = str(Path(__file__).resolve().parent / "plugin_dist")


class Counters:
    """Frames moved through the plugin in this process."""

    sent = 0
    received = 0


def _log(event: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as handle:
            handle.write(f"{event} {os.getpid()}\n")


class CountingConnection(Connection):
    def __init__(self, inner: Connection):
        self._inner = inner
        self.peer = inner.peer

    def send(self, chunks: Sequence[Buffer]) -> None:
        Counters.sent += 1
        self._inner.send(chunks)

    def recv(self, timeout: Optional[float] = None) -> Optional[Frame]:
        frame = self._inner.recv(timeout)
        if frame is not None:
            Counters.received += 1
        return frame

    def close(self) -> None:
        self._inner.close()

    def release(self) -> None:
        self._inner.release()


class CountingListener(WrappingListener):
    def wrap(self, conn: Connection) -> Connection:
        _log("accept")
        return CountingConnection(conn)


class CountingTransport(Transport):
    """The plugin: frames over the socket transport, counted."""

    name = PLUGIN_NAME
    supports_fork = True

    def __init__(self, **options: Any):
        self._inner = SocketTransport(**options)

    def connect(self, address: str, auth_key: bytes, timeout: float, allocate: Optional[Allocator] = None) -> Connection:
        return CountingConnection(self._inner.connect(address, auth_key, timeout, allocate))

    def listen(self, host: str, port: int, auth_key: bytes, handshake_timeout: float = 10.0) -> WrappingListener:
        _log("listen")
        return CountingListener(self._inner.listen(host, port, auth_key, handshake_timeout))
