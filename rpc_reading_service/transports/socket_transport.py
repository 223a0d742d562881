"""The default transport: length-prefixed frames over plain TCP sockets.

Sends are scatter/gather (``sendmsg``) so out-of-band buffers leave from the memory
they live in; receives land small frame sections in a staging buffer (few system
calls for small frames) and large sections straight in their final memory
(``recv_into``), so tensors are never copied on receipt. Handshakes on the server run
on non-blocking sockets in one selector loop, so a peer that connects and stays
silent cannot stall anyone else.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import selectors
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence

from .. import __version__
from ..addresses import format_address, parse_address, unix_socket_path
from ..errors import AuthenticationError, ConfigurationError, ProtocolError
from ..protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    HANDSHAKE_KINDS,
    HANDSHAKE_MAX_FRAME_BYTES,
    Buffer,
    MessageKind,
    ClientHandshake,
    Frame,
    FrameReader,
    ServerHandshake,
    encode_reject,
)
from .base import Allocator, Connection, Listener, PeerLostError, Transport

__all__ = ["SocketTransport", "SocketConnection", "SocketListener"]

log = logging.getLogger(__name__)

_STAGING_BYTES = 256 * 1024
_IOV_MAX = 512
_MAX_PENDING_HANDSHAKES = 256


def _tune(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def _open_client_socket(host: str, port: int, timeout: float) -> socket.socket:
    path = unix_socket_path(host)
    if not path:
        return socket.create_connection((host, port), timeout=timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def _send_chunks(sock: socket.socket, chunks: Sequence[Buffer]) -> None:
    """Send every byte of ``chunks`` with as few system calls as possible."""
    views = [memoryview(c).cast("B") for c in chunks]
    views = [v for v in views if v.nbytes]
    if not hasattr(sock, "sendmsg"):  # pragma: no cover - Windows
        for view in views:
            sock.sendall(view)
        return
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


class SocketConnection(Connection):
    """An authenticated TCP connection carrying frames."""

    def __init__(self, sock: socket.socket, peer: str, reader: FrameReader):
        self.peer = peer
        self._sock = sock
        self._reader = reader
        self._send_lock = threading.Lock()
        self._staging = memoryview(bytearray(_STAGING_BYTES))
        self._pending = memoryview(b"")
        self._closed = False

    def fileno(self) -> int:
        """The socket's file descriptor."""
        return self._sock.fileno()

    def set_max_frame_bytes(self, max_frame_bytes: int) -> None:
        self._reader.max_frame_bytes = max_frame_bytes

    def send(self, chunks: Sequence[Buffer]) -> None:
        with self._send_lock:
            if self._closed:
                raise PeerLostError(f"connection to {self.peer} is closed")
            try:
                _send_chunks(self._sock, chunks)
            except OSError as exc:
                raise PeerLostError(f"lost connection to {self.peer} while sending: {exc}") from exc

    def recv(self, timeout: Optional[float] = None) -> Optional[Frame]:
        deadline = None if timeout is None else time.monotonic() + timeout
        reader = self._reader
        while True:
            frame = reader.next_frame()
            if frame is not None:
                return frame
            if self._pending:
                target = reader.writable()
                n = min(len(target), len(self._pending))
                target[:n] = self._pending[:n]
                self._pending = self._pending[n:]
                reader.advance(n)
                continue
            target = reader.writable()
            direct = len(target) >= _STAGING_BYTES // 2
            received = self._recv_into(target if direct else self._staging, deadline)
            if received is None:
                return None
            if direct:
                reader.advance(received)
            else:
                self._pending = self._staging[:received]

    def _recv_into(self, view: memoryview, deadline: Optional[float]) -> Optional[int]:
        while True:
            if self._closed:
                raise PeerLostError(f"connection to {self.peer} is closed")
            try:
                n = self._sock.recv_into(view, 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                try:
                    ready, _, _ = select.select([self._sock], [], [], remaining)
                except (OSError, ValueError) as exc:  # closed under us by another thread
                    raise PeerLostError(f"connection to {self.peer} is closed") from exc
                if not ready and deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            except OSError as exc:
                raise PeerLostError(f"lost connection to {self.peer}: {exc}") from exc
            if n == 0:
                what = "in the middle of a frame" if self._reader.mid_frame else ""
                raise PeerLostError(f"{self.peer} closed the connection {what}".rstrip())
            return n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def release(self) -> None:
        self._closed = True
        self._sock.close()


def _recv_handshake_frame(sock: socket.socket, reader: FrameReader, deadline: float, peer: str) -> Frame:
    while True:
        frame = reader.next_frame()
        if frame is not None:
            return frame
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"handshake with {peer} timed out")
        sock.settimeout(remaining)
        n = sock.recv_into(reader.writable())
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

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes

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
            sock = _open_client_socket(host, port, timeout)
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
            _tune(sock)
            reader = FrameReader(HANDSHAKE_MAX_FRAME_BYTES, allowed_kinds=HANDSHAKE_KINDS)
            handshake = ClientHandshake(auth_key, __version__)
            sock.sendall(b"".join(bytes(c) for c in handshake.hello()))
            challenge = _recv_handshake_frame(sock, reader, deadline, address)
            sock.sendall(b"".join(bytes(c) for c in handshake.receive_challenge(challenge)))
            handshake.receive_welcome(_recv_handshake_frame(sock, reader, deadline, address))
            sock.settimeout(None)
        except (socket.timeout, TimeoutError) as exc:
            sock.close()
            raise PeerLostError(f"handshake with worker at {address} timed out after {timeout:.1f} s") from exc
        except BaseException:
            sock.close()
            raise
        reader.max_frame_bytes = self.max_frame_bytes
        reader.allowed_kinds = None
        if allocate is not None:
            reader._allocate = allocate  # noqa: SLF001 - the reader's allocator is set once, here
        return SocketConnection(sock, address, reader)

    def listen(self, host: str, port: int, auth_key: bytes, handshake_timeout: float = 10.0) -> "SocketListener":
        return SocketListener(host, port, auth_key, handshake_timeout, self.max_frame_bytes)


class _PendingHandshake:
    def __init__(self, sock: socket.socket, peer: str, auth_key: bytes, deadline: float):
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.reader = FrameReader(HANDSHAKE_MAX_FRAME_BYTES, allowed_kinds=HANDSHAKE_KINDS)
        self.handshake = ServerHandshake(auth_key)

    def on_readable(self) -> bool:
        """Advance the handshake; True once the peer is authenticated."""
        n = self.sock.recv_into(self.reader.writable())
        if n == 0:
            raise PeerLostError("peer closed the connection during the handshake")
        self.reader.advance(n)
        while True:
            frame = self.reader.next_frame()
            if frame is None:
                return False
            if frame.kind == MessageKind.HELLO:
                self._reply(self.handshake.receive_hello(frame))
            else:
                self._reply(self.handshake.receive_proof(frame))
                return True

    def _reply(self, chunks: Sequence[Buffer]) -> None:
        data = b"".join(bytes(c) for c in chunks)
        if self.sock.send(data) != len(data):  # a few dozen bytes into an empty send buffer
            raise PeerLostError("peer is not reading its end of the handshake")


class SocketListener(Listener):
    """A listening TCP socket that authenticates peers before handing them out."""

    def __init__(self, host: str, port: int, auth_key: bytes, handshake_timeout: float, max_frame_bytes: int):
        self._auth_key = auth_key
        self._handshake_timeout = handshake_timeout
        self._max_frame_bytes = max_frame_bytes
        path = unix_socket_path(host)
        family = socket.AF_UNIX if path else socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._unix_path = path
        try:
            if path:
                self._sock.bind(path)
            else:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._sock.bind((host, port))
            self._sock.listen(128)
        except OSError as exc:
            self._sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise ConfigurationError(f"port {port} on {host} is already in use: pick another --port (0 picks a free one)") from exc
            raise ConfigurationError(f"cannot listen on {format_address(host, port)}: {exc}") from exc
        self._sock.setblocking(False)
        if path:
            self.address = host
        else:
            bound_host, bound_port = self._sock.getsockname()[:2]
            self.address = format_address(bound_host, bound_port)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        self._pending: Dict[int, _PendingHandshake] = {}
        self._ready: List[SocketConnection] = []
        self.refused_handshakes = 0

    def inheritable_fds(self) -> List[int]:
        return [self._sock.fileno(), self._selector.fileno(), *self._pending]

    def accept(self, timeout: Optional[float] = None) -> Optional[SocketConnection]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            now = time.monotonic()
            waits = [p.deadline - now for p in self._pending.values()]
            if deadline is not None:
                waits.append(deadline - now)
            wait = max(0.0, min(waits)) if waits else None
            for key, _ in self._selector.select(wait):
                if key.data is None:
                    self._accept_new()
                else:
                    self._advance(key.data)
            self._expire(time.monotonic())
            if not self._ready and deadline is not None and time.monotonic() >= deadline:
                return None
        return self._ready.pop(0)

    def _accept_new(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: log and keep serving
                log.warning("accept failed: %s", exc)
                return
            peer = format_address(addr[0], addr[1]) if isinstance(addr, tuple) else f"{self.address} peer"
            if len(self._pending) >= _MAX_PENDING_HANDSHAKES:
                log.warning("refused %s: too many handshakes in progress", peer)
                sock.close()
                continue
            sock.setblocking(False)
            pending = _PendingHandshake(sock, peer, self._auth_key, time.monotonic() + self._handshake_timeout)
            self._pending[sock.fileno()] = pending
            self._selector.register(sock, selectors.EVENT_READ, pending)

    def _drop(self, pending: _PendingHandshake) -> None:
        self._pending.pop(pending.sock.fileno(), None)
        self._selector.unregister(pending.sock)

    def _advance(self, pending: _PendingHandshake) -> None:
        try:
            authenticated = pending.on_readable()
        except (BlockingIOError, InterruptedError):
            return
        except (ProtocolError, AuthenticationError) as exc:
            self.refused_handshakes += 1
            log.warning("refused connection from %s: %s", pending.peer, exc)
            self._drop(pending)
            try:
                pending.sock.send(b"".join(bytes(c) for c in encode_reject(str(exc))))
            except OSError:
                pass
            pending.sock.close()
            return
        except OSError as exc:
            self.refused_handshakes += 1
            log.info("connection from %s ended during the handshake: %s", pending.peer, exc)
            self._drop(pending)
            pending.sock.close()
            return
        if authenticated:
            self._drop(pending)
            pending.sock.setblocking(True)
            _tune(pending.sock)
            reader = pending.reader
            reader.max_frame_bytes = self._max_frame_bytes
            reader.allowed_kinds = None
            log.info("authenticated %s (package %s)", pending.peer, pending.handshake.peer_package_version or "?")
            self._ready.append(SocketConnection(pending.sock, pending.peer, reader))

    def _expire(self, now: float) -> None:
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            self.refused_handshakes += 1
            log.warning("refused connection from %s: no handshake within %.1f s", pending.peer, self._handshake_timeout)
            self._drop(pending)
            pending.sock.close()

    def close(self) -> None:
        for pending in list(self._pending.values()):
            self._drop(pending)
            pending.sock.close()
        for conn in self._ready:
            conn.close()
        self._ready.clear()
        try:
            self._selector.unregister(self._sock)
        except (KeyError, ValueError):
            pass
        self._selector.close()
        self._sock.close()
        if self._unix_path:
            try:
                os.unlink(self._unix_path)
            except OSError:
                pass
