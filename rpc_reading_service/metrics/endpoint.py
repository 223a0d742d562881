"""``GET /metrics`` from a thread: a Prometheus registry in the text format.

A forked child (a server's session, a DataLoader worker) keeps none of the endpoint's sockets:
they are closed in the child right after the fork (see docs/deployment.md "Metrics").
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import weakref
from types import ModuleType
from typing import Any, List, Set

from ..addresses import format_address
from ..errors import ConfigurationError, MissingDependencyError
from ..tasks import TaskGroup

__all__ = ["MetricsEndpoint", "require_prometheus_client", "INSTALL_HINT"]

log = logging.getLogger("rpc_reading_service.metrics")

INSTALL_HINT = "pip install 'rpc-reading-service[metrics]'"
#: Seconds a scraper has to send its request.
_REQUEST_TIMEOUT = 10.0
#: Seconds :meth:`MetricsEndpoint.close` waits for its serving thread to end.
CLOSE_JOIN_SECONDS = 5.0
#: Connections served at once (each in its own thread); one more is closed unanswered.
MAX_CONNECTIONS = 8


def require_prometheus_client(what: str) -> ModuleType:
    """The ``prometheus_client`` module, or a :class:`MissingDependencyError` saying what to install."""
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401 - the metric families
        import prometheus_client.exposition  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(
            f"{what} needs the prometheus_client package, which is not installed: {INSTALL_HINT} "
            "(or pip install prometheus_client)"
        ) from exc
    return prometheus_client


class MetricsEndpoint:
    """An HTTP server in a thread answering ``GET /metrics`` with ``registry``'s metrics.

    Args:
        registry: A ``prometheus_client`` registry (or any object with ``collect()``).
        host: The address to listen on (``0.0.0.0``: every interface).
        port: The port; 0 lets the OS pick one (see :attr:`port`).

    :meth:`close` stops the thread and joins it; so does leaving a ``with`` block.
    """

    def __init__(self, registry: Any, host: str = "127.0.0.1", port: int = 0):
        exposition = require_prometheus_client("serving metrics").exposition
        self._owner = os.getpid()
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            self._server = _make_server(family, (host, port), lambda: exposition.generate_latest(registry))
        except (OSError, OverflowError) as exc:  # in use, no such address, port out of range
            raise ConfigurationError(
                f"cannot serve metrics on {format_address(host, port)}: {exc}. Pick another port (0: any free one) "
                "or host"
            ) from exc
        self.host: str = host
        #: The port it listens on (the one the OS picked for port 0).
        self.port: int = self._server.server_address[1]
        self._tasks = TaskGroup(f"the metrics endpoint at {format_address(host, self.port)}")
        self._tasks.start("metrics", self._server.serve_forever, 0.5)
        self._closed = False

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics``."""
        return f"http://{format_address(self.host, self.port)}/metrics"

    def close(self) -> None:
        """Stop serving, close the socket and join the thread; idempotent (a no-op in a forked child)."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        self._server.shutdown()
        self._server.drop_connections()  # a stuck scraper's thread ends now, not at its timeout
        self._server.server_close()  # joins the connections' threads
        self._tasks.stop(CLOSE_JOIN_SECONDS)

    def __enter__(self) -> "MetricsEndpoint":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsEndpoint({self.url!r}{', closed' if self._closed else ''})"


def _make_server(family: int, address: Any, render: Any) -> Any:
    """The HTTP server (``http.server`` is imported on first use: most processes serve no metrics)."""
    import http.server
    import socketserver
    from urllib.parse import urlsplit

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = _REQUEST_TIMEOUT

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if urlsplit(self.path).path not in ("/metrics", "/"):
                self._answer(404, b"not found: the metrics are at /metrics\n", "text/plain; charset=utf-8")
                return
            try:
                body = render()
            except Exception:  # noqa: BLE001 - a collector's failure is one failed scrape
                log.exception("collecting metrics failed")
                self._answer(500, b"collecting metrics failed; see the process's log\n", "text/plain; charset=utf-8")
                return
            self._answer(200, body, "text/plain; version=0.0.4; charset=utf-8")

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
            log.debug("metrics request from %s: " + format, self.client_address[0], *args)

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        address_family = family
        # Each connection in its own thread, joined by server_close(): a scraper that connects
        # and sends nothing delays no other scrape.
        daemon_threads = False
        block_on_close = True

        def __init__(self) -> None:
            #: Held while a connection is accepted, closed or shut down and around a fork: no socket
            #: leaks into a child half-tracked, none is shut down as another thread closes it.
            self.fork_lock = threading.Lock()
            self.connections: Set[socket.socket] = set()
            super().__init__(address, Handler)
            self.socket.setblocking(False)  # accept() after select() never blocks (a peer gone meanwhile)
            _serving.add(self)

        def server_bind(self) -> None:
            socketserver.TCPServer.server_bind(self)  # HTTPServer's would look the host name up (DNS)
            self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

        def get_request(self) -> Any:
            with self.fork_lock:
                connection, peer = self.socket.accept()
                self.connections.add(connection)
            return connection, peer

        def process_request(self, request: Any, client_address: Any) -> None:
            if len(self.connections) > MAX_CONNECTIONS:  # this one among them
                log.debug("metrics request from %s refused: %d connections already served", client_address,
                          MAX_CONNECTIONS)
                self.shutdown_request(request)
                return
            super().process_request(request, client_address)

        def shutdown_request(self, request: Any) -> None:
            with self.fork_lock:
                super().shutdown_request(request)
                self.connections.discard(request)

        def drop_connections(self) -> None:
            """Shut every open connection down: the threads serving them end."""
            with self.fork_lock:
                for connection in self.connections:
                    try:
                        connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # the peer has gone

        def handle_error(self, request: Any, client_address: Any) -> None:
            log.debug("metrics request from %s failed", client_address, exc_info=True)  # a scraper gone, say

        def server_close(self) -> None:
            _serving.discard(self)
            super().server_close()

        def forget_in_child(self) -> None:
            """After a fork, in the child: close the child's copies of this server's sockets."""
            for sock in [self.socket, *self.connections]:
                sock.close()

    return Server()


_serving: "weakref.WeakSet[Any]" = weakref.WeakSet()
_held: List[Any] = []


def _before_fork() -> None:
    for server in list(_serving):
        server.fork_lock.acquire()
        _held.append(server)


def _after_fork(in_child: bool) -> None:
    held = list(_held)
    _held.clear()
    for server in held:
        if in_child:
            server.forget_in_child()
            _serving.discard(server)
        server.fork_lock.release()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=lambda: _after_fork(False),
    after_in_child=lambda: _after_fork(True),
)
