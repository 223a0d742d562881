"""The default transport: length-prefixed frames over TCP or Unix sockets, optionally TLS.

Its modules and design: docs/architecture.md."""

from __future__ import annotations

from .connection import SocketConnection
from .listener import SocketListener
# The handshake caps, still read by their old name here; they act (and are patched) in .listener.
from .listener import MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_HOST, STALE_HANDSHAKE_SECONDS  # noqa: F401
from .shared_memory_connection import SharedMemoryConnection
from .tls import TLSSocketConnection
from .transport import SocketTransport

__all__ = ["SocketTransport", "SocketConnection", "SharedMemoryConnection", "TLSSocketConnection", "SocketListener"]
