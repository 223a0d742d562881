"""The socket transport itself: its options, and the trainer's end of a connection (connect, TLS,
the HMAC handshake, the shared-memory offer); the server's end is :mod:`.listener`."""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import time
from typing import Optional

from ...version import __version__
from ...addresses import parse_address
from ...errors import AuthenticationError, ConfigurationError, ProtocolError, RemoteProtocolError, WorkerRefusedError
from ...safe_text import printable
from ...protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    HANDSHAKE_KINDS,
    HANDSHAKE_MAX_FRAME_BYTES,
    MessageKind,
    ClientHandshake,
    Frame,
    FrameReader,
    decode_reject,
    encode_frame,
    encode_reject,
)
from ...serialization import accepts_shared_memory, pins_shared_memory
from ..base import PROBE_SECONDS, Allocator, PeerLostError, Transport
from .shared_memory import shared_memory_available
from .authenticated import authenticated_connection
from .connection import SocketConnection
from .listener import SocketListener
from .shared_memory_connection import SharedMemoryConnection
from .sockets import open_client_socket, tune_socket
from .tls import load_client_tls, load_server_tls

__all__ = ["SocketTransport"]

log = logging.getLogger(__name__)

_KEY_MISMATCH = "the trainer's auth key does not match this worker's (or one of the two has none)"


def _recv_handshake_frame(sock: socket.socket, reader: FrameReader, deadline: float, peer: str) -> Frame:
    while True:
        frame = reader.next_frame()
        if frame is not None and frame.kind == MessageKind.REJECT:
            raise WorkerRefusedError(f"worker at {peer} refused the connection: {decode_reject(frame)}")
        if frame is not None:
            return frame
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"handshake with {peer} timed out")
        sock.settimeout(remaining)
        try:
            n = sock.recv_into(reader.writable())
        except (socket.timeout, TimeoutError):
            raise
        except OSError as exc:  # e.g. a reset right after the server refused us
            raise PeerLostError(f"{peer} broke the connection during the handshake: {exc}") from exc
        if n == 0:
            raise PeerLostError(
                f"{peer} closed the connection during the handshake (is it an rpc-reading-worker "
                "of the same version, and does it accept this trainer's address?)"
            )
        reader.advance(n)


class SocketTransport(Transport):
    """Frames over TCP. The default transport."""

    name = "socket"
    supports_fork = True

    def __init__(
        self,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        tls_ca_file: Optional[str] = None,
        tls_server_hostname: Optional[str] = None,
        shared_memory: bool = True,
    ):
        """``tls_cert``/``tls_key``: serve TLS (server side). ``tls_ca_file``: connect with TLS,
        verifying the worker's certificate against this CA bundle (trainer side), and its
        name against ``tls_server_hostname`` (default: the host of the worker's address).
        ``shared_memory``: over Unix sockets, hand large buffers over in shared memory
        (where the host supports it; TCP and TLS connections never do)."""
        if max_frame_bytes < 1024:
            raise ConfigurationError(f"max_frame_bytes must be at least 1024, got {max_frame_bytes}")
        if not isinstance(shared_memory, bool):
            raise ConfigurationError(f"shared_memory must be True or False, got {shared_memory!r}")
        self.shared_memory = shared_memory
        self.max_frame_bytes = max_frame_bytes
        self.tls_server_hostname = tls_server_hostname
        self._server_tls = load_server_tls(tls_cert, tls_key)
        self._client_tls = load_client_tls(tls_ca_file, tls_server_hostname)

    def _client_tls_handshake(self, sock: socket.socket, host: str, address: str) -> ssl.SSLSocket:
        assert self._client_tls is not None
        try:
            return self._client_tls.wrap_socket(sock, server_hostname=self.tls_server_hostname or host)
        except ssl.SSLCertVerificationError as exc:
            raise AuthenticationError(
                f"the TLS certificate of the worker at {address} failed verification ({exc.verify_message}): "
                "is tls_ca_file the CA that signed its --tls-cert, and does the certificate name "
                f"{self.tls_server_hostname or host!r} (else set tls_server_hostname)?"
            ) from exc
        except (socket.timeout, TimeoutError):
            raise
        except OSError as exc:  # ssl.SSLError included
            raise RemoteProtocolError(
                f"TLS handshake with the worker at {address} failed ({exc}): the worker does not seem to "
                "speak TLS. Start it with --tls-cert and --tls-key, or connect without tls_ca_file"
            ) from exc

    def connect(
        self,
        address: str,
        auth_key: bytes,
        timeout: float,
        allocate: Optional[Allocator] = None,
    ) -> SocketConnection:
        host, port = parse_address(address)
        deadline = time.monotonic() + timeout
        try:
            sock = open_client_socket(host, port, timeout)
        except socket.gaierror as exc:
            raise ConfigurationError(
                f"cannot resolve worker host {host!r} of address {address!r}: {exc.strerror}; check the spelling"
            ) from exc
        except (ConnectionRefusedError, socket.timeout, OSError) as exc:
            raise PeerLostError(
                f"cannot connect to worker at {address}: {exc}. Is `rpc-reading-worker --port {port}` "
                "running there, and is the port reachable from this host?"
            ) from exc
        try:
            tune_socket(sock)
            if self._client_tls is not None:
                sock = self._client_tls_handshake(sock, host, address)
            reader = FrameReader(HANDSHAKE_MAX_FRAME_BYTES, allowed_kinds=HANDSHAKE_KINDS)
            handshake = ClientHandshake(auth_key, __version__)
            sock.sendall(b"".join(bytes(c) for c in handshake.hello()))
            challenge = _recv_handshake_frame(sock, reader, deadline, address)
            try:
                proof = handshake.receive_challenge(challenge)
            except AuthenticationError:
                # Tell the worker, so that it logs an authentication failure (not a dropped connection).
                with contextlib.suppress(OSError):
                    sock.sendall(b"".join(bytes(c) for c in encode_reject(_KEY_MISMATCH)))
                raise
            sock.sendall(b"".join(bytes(c) for c in proof))
            handshake.receive_welcome(_recv_handshake_frame(sock, reader, deadline, address))
            sock.settimeout(None)
        except (socket.timeout, TimeoutError) as exc:
            sock.close()
            raise PeerLostError(
                f"handshake with worker at {address} timed out after {timeout:.1f} s: something accepts "
                "connections there but does not answer like an rpc-reading-worker (another service on that "
                "port, or a worker too busy to answer: check the address, or raise connect_timeout)"
            ) from exc
        except (ProtocolError, AuthenticationError) as exc:
            sock.close()
            if address in str(exc):
                raise
            raise type(exc)(f"worker at {address}: {exc}") from exc  # say which worker
        except BaseException:
            sock.close()
            raise
        if handshake.peer_package_version and handshake.peer_package_version != __version__:
            log.warning(
                "worker at %s runs rpc_reading_service %s, this trainer %s: the protocol matches, but install "
                "the same version on both", address, printable(handshake.peer_package_version, limit=64), __version__,
            )  # fmt: skip
        reader.max_frame_bytes = self.max_frame_bytes
        reader.allowed_kinds = None
        if allocate is not None:
            reader.allocate = allocate
        if self._offers_shared_memory(sock, allocate, handshake.peer_package_version):
            try:
                sock.sendall(b"".join(bytes(c) for c in encode_frame(MessageKind.SHARED_MEMORY_OFFER)))
            except OSError as exc:
                sock.close()
                raise PeerLostError(f"lost the worker at {address} right after the handshake: {exc}") from exc
            return SharedMemoryConnection(sock, address, reader, offered=True, pin=pins_shared_memory(allocate))
        return authenticated_connection(sock, address, reader)

    def probe(self, address: str, timeout: float = PROBE_SECONDS) -> Optional[str]:
        """None if a worker server answers the handshake's first message (HELLO: its CHALLENGE, or a
        REJECT) at ``address`` within ``timeout`` seconds, else why not. Proves nothing about keys.

        Args:
            address: The server's ``HOST:PORT``.
            timeout: Seconds for the connect, TLS and the answer together.
        """
        deadline = time.monotonic() + timeout
        try:
            host, port = parse_address(address)
            sock = open_client_socket(host, port, timeout)
        except (OSError, ConfigurationError) as exc:
            return str(exc) or type(exc).__name__
        try:
            if self._client_tls is not None:
                sock = self._client_tls_handshake(sock, host, address)
            sock.sendall(b"".join(bytes(c) for c in ClientHandshake(b"", __version__).hello()))
            reader = FrameReader(HANDSHAKE_MAX_FRAME_BYTES, allowed_kinds=HANDSHAKE_KINDS)
            _recv_handshake_frame(sock, reader, deadline, address)
        except WorkerRefusedError:
            return None  # it answered
        except (socket.timeout, TimeoutError):
            return f"no answer to a handshake within {timeout:.1f} s (the server is hung, stopped or overloaded)"
        except (OSError, ProtocolError, AuthenticationError) as exc:
            return str(exc) or type(exc).__name__
        finally:
            sock.close()
        return None

    def _offers_shared_memory(self, sock: socket.socket, allocate: Optional[Allocator], peer_version: str) -> bool:
        # A worker of another package version may not know the offer: it would end the session.
        return (
            self.shared_memory and sock.family == socket.AF_UNIX and not isinstance(sock, ssl.SSLSocket)
            and shared_memory_available() and accepts_shared_memory(allocate) and peer_version == __version__
        )

    def listen(self, host: str, port: int, auth_key: bytes, handshake_timeout: float = 10.0) -> "SocketListener":
        return SocketListener(
            host, port, auth_key, handshake_timeout, self.max_frame_bytes, self._server_tls, self.shared_memory
        )
