"""The default transport: length-prefixed frames over plain TCP sockets.

Sends are scatter/gather (``sendmsg``) so out-of-band buffers leave from the memory
they live in; receives land small frame sections in a staging buffer (few system
calls for small frames) and large sections straight in their final memory
(``recv_into``), so tensors are never copied on receipt. Handshakes on the server run
on non-blocking sockets in one selector loop, so a peer that connects and stays
silent cannot stall anyone else.

TLS (optional, stdlib ``ssl``): the server wraps accepted sockets with
``do_handshake_on_connect=False`` and drives the TLS handshake in the same non-blocking
selector loop; the HMAC handshake then runs inside TLS, unchanged. A TLS connection
(:class:`TLSSocketConnection`) cannot use ``sendmsg`` or ``MSG_DONTWAIT``, so it has its
own send/receive path; the plain-TCP fast path is untouched.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import selectors
import socket
import ssl
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

from .. import __version__
from ..addresses import format_address, parse_address, unix_socket_path
from ..errors import AuthenticationError, ConfigurationError, ProtocolError, WorkerRefusedError
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

__all__ = ["SocketTransport", "SocketConnection", "TLSSocketConnection", "SocketListener"]

log = logging.getLogger(__name__)

_STAGING_BYTES = 256 * 1024
_IOV_MAX = 512
_MAX_PENDING_HANDSHAKES = 256
_TLS_WRITE_BYTES = 256 * 1024  # one SSL_write call
_TLS_COALESCE_BYTES = 64 * 1024  # chunks below this are joined, so small frames make few TLS records
_TLS_HANDSHAKE_RECORD = 0x16  # first byte of a TLS ClientHello; a plain frame starts with MAGIC ("R")


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
                raise self._closed_by_peer()
            return n

    def _closed_by_peer(self) -> PeerLostError:
        what = "in the middle of a frame" if self._reader.mid_frame else ""
        return PeerLostError(f"{self.peer} closed the connection {what}".rstrip())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # The plain socket's shutdown (also for TLS: SSLSocket.shutdown would drop the SSL
            # object under a thread that may still be reading); it wakes every waiting thread.
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        except OSError:
            pass
        self._close_socket()

    def _close_socket(self) -> None:
        self._sock.close()

    def release(self) -> None:
        self._closed = True
        self._sock.close()


def _coalesce(chunks: Sequence[Buffer]) -> Iterator[memoryview]:
    """Join small chunks (headers, packed items) into larger pieces; pass large ones through."""
    joined = bytearray()
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        if view.nbytes >= _TLS_COALESCE_BYTES:
            if joined:
                yield memoryview(joined)
                joined = bytearray()
            yield view
        elif view.nbytes:
            joined += view
            if len(joined) >= _TLS_WRITE_BYTES:
                yield memoryview(joined)
                joined = bytearray()
    if joined:
        yield memoryview(joined)


class TLSSocketConnection(SocketConnection):
    """A :class:`SocketConnection` over TLS.

    ``ssl.SSLSocket`` has no ``sendmsg`` and takes no ``recv`` flags, and one SSL object
    must not be driven by two threads at once. So the socket is non-blocking, every SSL
    call runs under a lock, and waiting happens in ``select`` outside the lock: the
    receiver and the sender (heartbeats, credits) never block each other.
    """

    def __init__(self, sock: ssl.SSLSocket, peer: str, reader: FrameReader):
        super().__init__(sock, peer, reader)
        self._tls_lock = threading.Lock()
        sock.setblocking(False)

    def send(self, chunks: Sequence[Buffer]) -> None:
        with self._send_lock:
            if self._closed:
                raise PeerLostError(f"connection to {self.peer} is closed")
            try:
                for piece in _coalesce(chunks):
                    self._send_all(piece)
            except PeerLostError:
                raise
            except (OSError, ValueError) as exc:
                raise PeerLostError(f"lost connection to {self.peer} while sending: {exc}") from exc

    def _send_all(self, view: memoryview) -> None:
        while view.nbytes:
            # After SSLWantWrite, OpenSSL wants the same bytes again: `piece` is the same slice.
            piece = view[:_TLS_WRITE_BYTES]
            want_read = False
            with self._tls_lock:
                if self._closed:
                    raise PeerLostError(f"connection to {self.peer} is closed")
                try:
                    sent = self._sock.send(piece)
                except ssl.SSLWantWriteError:
                    sent = 0
                except ssl.SSLWantReadError:
                    sent, want_read = 0, True
            if sent:
                view = view[sent:]
            else:
                self._wait(want_read, 1.0)

    def _wait(self, readable: bool, timeout: Optional[float]) -> None:
        try:
            if readable:
                select.select([self._sock], [], [], timeout)
            else:
                select.select([], [self._sock], [], timeout)
        except (OSError, ValueError) as exc:  # closed under us by another thread
            raise PeerLostError(f"connection to {self.peer} is closed") from exc

    def _recv_into(self, view: memoryview, deadline: Optional[float]) -> Optional[int]:
        while True:
            want_read = True
            with self._tls_lock:
                if self._closed:
                    raise PeerLostError(f"connection to {self.peer} is closed")
                try:
                    n: Optional[int] = self._sock.recv_into(view)
                except ssl.SSLWantReadError:
                    n = None
                except ssl.SSLWantWriteError:
                    n, want_read = None, False
                except ssl.SSLZeroReturnError:
                    n = 0
                except (OSError, ValueError) as exc:
                    raise PeerLostError(f"lost connection to {self.peer}: {exc}") from exc
            if n is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._wait(want_read, remaining)
                continue
            if n == 0:
                raise self._closed_by_peer()
            return n

    def _close_socket(self) -> None:
        with self._tls_lock:
            self._sock.close()


def _connection(sock: socket.socket, peer: str, reader: FrameReader) -> SocketConnection:
    if isinstance(sock, ssl.SSLSocket):
        return TLSSocketConnection(sock, peer, reader)
    return SocketConnection(sock, peer, reader)


def _refuse_quietly(sock: socket.socket, reject: Optional[str]) -> None:
    """Answer a refused peer with a REJECT frame (if any) and close, without a reset.

    Unread input makes close() send a TCP reset, which can destroy the REJECT before the
    peer reads it: read what has arrived first.
    """
    try:
        sock.recv(65536)
    except (OSError, ValueError):
        pass
    if reject is not None:
        try:
            sock.send(b"".join(bytes(c) for c in encode_reject(reject)))
        except (OSError, ValueError):
            pass
    sock.close()


def _load_server_tls(tls_cert: Optional[str], tls_key: Optional[str]) -> Optional[ssl.SSLContext]:
    if tls_cert is None:
        if tls_key is not None:
            raise ConfigurationError("--tls-key needs --tls-cert: give the certificate (chain) that goes with the key")
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.num_tickets = 0  # sessions are long-lived; no resumption tickets
    try:
        context.load_cert_chain(tls_cert, tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(
            f"cannot load the TLS certificate {tls_cert!r}" + (f" with key {tls_key!r}" if tls_key else "") + f": {exc}"
        ) from exc
    return context


def _load_client_tls(tls_ca_file: Optional[str], tls_server_hostname: Optional[str]) -> Optional[ssl.SSLContext]:
    if tls_ca_file is None:
        if tls_server_hostname is not None:
            raise ConfigurationError("tls_server_hostname needs tls_ca_file: give the CA bundle that signed the workers' certificates")
        return None
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(f"cannot load the TLS CA bundle tls_ca_file={tls_ca_file!r}: {exc}") from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _recv_handshake_frame(sock: socket.socket, reader: FrameReader, deadline: float, peer: str) -> Frame:
    while True:
        frame = reader.next_frame()
        if frame is not None and frame.kind == MessageKind.REJECT:
            reason = bytes(frame.body[:1024]).decode("utf-8", "replace")
            raise WorkerRefusedError(f"worker at {peer} refused the connection: {reason}")
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
    ):
        """``tls_cert``/``tls_key``: serve TLS (server side). ``tls_ca_file``: connect with TLS,
        verifying the worker's certificate against this CA bundle (trainer side), and its
        name against ``tls_server_hostname`` (default: the host of the worker's address)."""
        if max_frame_bytes < 1024:
            raise ConfigurationError(f"max_frame_bytes must be at least 1024, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self.tls_server_hostname = tls_server_hostname
        self._server_tls = _load_server_tls(tls_cert, tls_key)
        self._client_tls = _load_client_tls(tls_ca_file, tls_server_hostname)

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
            raise ProtocolError(
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
            if self._client_tls is not None:
                sock = self._client_tls_handshake(sock, host, address)
            reader = FrameReader(HANDSHAKE_MAX_FRAME_BYTES, allowed_kinds=HANDSHAKE_KINDS)
            handshake = ClientHandshake(auth_key, __version__)
            sock.sendall(b"".join(bytes(c) for c in handshake.hello()))
            challenge = _recv_handshake_frame(sock, reader, deadline, address)
            sock.sendall(b"".join(bytes(c) for c in handshake.receive_challenge(challenge)))
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
                "the same version on both", address, handshake.peer_package_version, __version__,
            )  # fmt: skip
        reader.max_frame_bytes = self.max_frame_bytes
        reader.allowed_kinds = None
        if allocate is not None:
            reader._allocate = allocate  # noqa: SLF001 - the reader's allocator is set once, here
        return _connection(sock, address, reader)

    def listen(self, host: str, port: int, auth_key: bytes, handshake_timeout: float = 10.0) -> "SocketListener":
        return SocketListener(host, port, auth_key, handshake_timeout, self.max_frame_bytes, self._server_tls)


class _Refused(Exception):
    """An authenticated peer is refused a session (the reason goes back in a REJECT)."""


#: ``admit(peer) -> None`` to accept an authenticated peer, or a reason to refuse it.
Admission = Callable[[str], Optional[str]]


class _PendingHandshake:
    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        auth_key: bytes,
        deadline: float,
        tls_context: Optional[ssl.SSLContext] = None,
        admit: Optional[Admission] = None,
    ):
        self.sock: Union[socket.socket, ssl.SSLSocket] = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.deadline = deadline
        self.reader = FrameReader(HANDSHAKE_MAX_FRAME_BYTES, allowed_kinds=HANDSHAKE_KINDS)
        self.handshake = ServerHandshake(auth_key, package_version=__version__)
        self.tls_context = tls_context
        self.tls_done = tls_context is None
        self.want_write = False  # the TLS handshake waits for the socket to be writable
        self.admit = admit

    def on_readable(self) -> bool:
        """Advance the (TLS and then HMAC) handshake; True once the peer is authenticated."""
        if not self.tls_done and not self._tls_step():
            return False
        while True:
            try:
                n = self.sock.recv_into(self.reader.writable())
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return False  # TLS may hold decrypted bytes select() cannot see: read until empty
            if n == 0:
                raise PeerLostError("peer closed the connection during the handshake")
            self.reader.advance(n)
            while True:
                frame = self.reader.next_frame()
                if frame is None:
                    break
                if frame.kind == MessageKind.HELLO:
                    self._reply(self.handshake.receive_hello(frame))
                    continue
                welcome = self.handshake.receive_proof(frame)
                refusal = self.admit(self.peer) if self.admit is not None else None
                if refusal:
                    raise _Refused(refusal)
                self._reply(welcome)
                return True

    def _tls_step(self) -> bool:
        """Advance the non-blocking TLS handshake; True once it is complete."""
        assert self.tls_context is not None
        if not isinstance(self.sock, ssl.SSLSocket):
            first = self.sock.recv(1, socket.MSG_PEEK)
            if not first:
                raise PeerLostError("peer closed the connection before the TLS handshake")
            if first[0] != _TLS_HANDSHAKE_RECORD:
                raise ProtocolError(
                    "this worker requires TLS: connect with RPCReadingService(tls_ca_file=...), "
                    "the CA bundle that signed the worker's --tls-cert"
                )
            self.sock = self.tls_context.wrap_socket(self.sock, server_side=True, do_handshake_on_connect=False)
        try:
            self.sock.do_handshake()
        except ssl.SSLWantReadError:
            self.want_write = False
            return False
        except ssl.SSLWantWriteError:
            self.want_write = True
            return False
        self.want_write = False
        self.tls_done = True
        return True

    def _reply(self, chunks: Sequence[Buffer]) -> None:
        data = b"".join(bytes(c) for c in chunks)
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            sent = 0
        if sent != len(data):  # a few dozen bytes into an empty send buffer
            raise PeerLostError("peer is not reading its end of the handshake")


class SocketListener(Listener):
    """A listening TCP socket that authenticates peers before handing them out."""

    supports_admission = True

    def __init__(
        self,
        host: str,
        port: int,
        auth_key: bytes,
        handshake_timeout: float,
        max_frame_bytes: int,
        tls_context: Optional[ssl.SSLContext] = None,
    ):
        self._tls_context = tls_context
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
        self.refused_sessions = 0

    def inheritable_fds(self) -> List[int]:
        # Connections still queued belong to other sessions: a child must not hold them open.
        return [self._sock.fileno(), self._selector.fileno(), *self._pending, *(c.fileno() for c in self._ready)]

    def queued(self) -> int:
        return len(self._ready)

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
            pending = _PendingHandshake(
                sock, peer, self._auth_key, time.monotonic() + self._handshake_timeout, self._tls_context, self.admit
            )
            self._pending[pending.fd] = pending
            self._selector.register(pending.fd, selectors.EVENT_READ, pending)

    def _drop(self, pending: _PendingHandshake) -> None:
        self._pending.pop(pending.fd, None)
        self._selector.unregister(pending.fd)

    def _advance(self, pending: _PendingHandshake) -> None:
        try:
            authenticated = pending.on_readable()
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except _Refused as exc:
            self.refused_sessions += 1
            log.warning("refused a session to %s: %s", pending.peer, exc)
            self._drop(pending)
            _refuse_quietly(pending.sock, str(exc))
            return
        except (ProtocolError, AuthenticationError) as exc:
            self.refused_handshakes += 1
            log.warning("refused connection from %s: %s", pending.peer, exc)
            self._drop(pending)
            _refuse_quietly(pending.sock, str(exc))
            return
        except ssl.SSLError as exc:
            self.refused_handshakes += 1
            log.warning("refused connection from %s: TLS handshake failed: %s", pending.peer, exc)
            self._drop(pending)
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
            if not isinstance(pending.sock, ssl.SSLSocket):
                pending.sock.setblocking(True)
            _tune(pending.sock)
            reader = pending.reader
            reader.max_frame_bytes = self._max_frame_bytes
            reader.allowed_kinds = None
            log.info("authenticated %s (package %s)", pending.peer, pending.handshake.peer_package_version or "?")
            if pending.handshake.peer_package_version not in ("", __version__):
                log.warning(
                    "trainer %s runs rpc_reading_service %s, this worker %s: the protocol matches, but install "
                    "the same version on both", pending.peer, pending.handshake.peer_package_version, __version__,
                )  # fmt: skip
            self._ready.append(_connection(pending.sock, pending.peer, reader))
        elif pending.fd in self._pending:
            events = selectors.EVENT_WRITE if pending.want_write else selectors.EVENT_READ
            if self._selector.get_key(pending.fd).events != events:
                self._selector.modify(pending.fd, events, pending)

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
        if self._unix_path and not self._unix_path.startswith("\0"):  # an abstract socket has no file
            try:
                os.unlink(self._unix_path)
            except OSError:
                pass
