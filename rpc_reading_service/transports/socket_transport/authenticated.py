"""The connection an authenticated socket becomes: TLS, shared memory over a Unix socket, or plain TCP."""

from __future__ import annotations

import socket
import ssl

from ...protocol import FrameReader
from .shared_memory import shared_memory_available
from .connection import SocketConnection
from .shared_memory_connection import SharedMemoryConnection
from .tls import TLSSocketConnection


def authenticated_connection(sock: socket.socket, peer: str, reader: FrameReader, lend: bool = False) -> SocketConnection:
    """The connection for an authenticated socket: TLS, shared memory (a Unix socket) or plain TCP."""
    if isinstance(sock, ssl.SSLSocket):
        return TLSSocketConnection(sock, peer, reader)
    if sock.family == socket.AF_UNIX:
        return SharedMemoryConnection(sock, peer, reader, lend=lend and shared_memory_available())
    return SocketConnection(sock, peer, reader)
