"""The socket transport's server end: a listening socket that runs the (TLS and HMAC) handshakes of
new peers in one non-blocking selector loop, bounded under abuse, and hands out authenticated connections."""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import ssl
import time
from typing import Callable, Dict, List, Optional, Sequence, Union

from ...version import __version__
from ...addresses import format_address, unix_socket_path
from ...errors import AuthenticationError, ConfigurationError, ProtocolError, RemoteProtocolError
from ...safe_text import printable
from ...protocol import HANDSHAKE_KINDS, HANDSHAKE_MAX_FRAME_BYTES, Buffer, FrameReader, MessageKind, ServerHandshake
from ..base import Listener, PeerLostError
from .authenticated import authenticated_connection
from .connection import SocketConnection
from .sockets import descriptor_limit, refuse_quietly, tune_socket

__all__ = ["SocketListener"]

log = logging.getLogger(__name__)

# Handshakes in progress at once, in all and per peer address. A good handshake takes a few
# round trips; one that waited past STALE_HANDSHAKE_SECONDS makes room for a newcomer, so
# silent sockets can neither lock out a good trainer for the handshake timeout nor, from one
# host, crowd out the others.
MAX_PENDING_HANDSHAKES = 512
MAX_PENDING_PER_HOST = 128
STALE_HANDSHAKE_SECONDS = 1.0
_ACCEPT_BACKOFF_SECONDS = (0.05, 1.0)  # first and longest pause of accept() when out of descriptors
_RECURRING_LOG_SECONDS = 10.0
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_WAKE = object()  # the selector's data for the wake-up fd of wake_on()
_TLS_HANDSHAKE_RECORD = 0x16  # first byte of a TLS ClientHello; a plain frame starts with MAGIC ("R")


class _Refused(Exception):
    """An authenticated peer is refused a session (the reason goes back in a REJECT)."""


#: ``admit(peer) -> None`` to accept an authenticated peer, or a reason to refuse it.
Admission = Callable[[str], Optional[str]]


class _PendingHandshake:
    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        host: str,
        auth_key: bytes,
        deadline: float,
        tls_context: Optional[ssl.SSLContext] = None,
        admit: Optional[Admission] = None,
    ):
        self.sock: Union[socket.socket, ssl.SSLSocket] = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.host = host
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
                raise RemoteProtocolError(
                    "this worker requires TLS: connect with RPCReadingService(transport=TransportConfig(tls=TLS(ca_file))), "
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


class _RecurringWarning:
    """Logs a condition that may recur many times a second at most once per interval,
    saying how often it recurred in between."""

    def __init__(self, interval: float = _RECURRING_LOG_SECONDS):
        self._interval = interval
        self._last = -interval
        self._unlogged = 0

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self._interval:
            self._unlogged += 1
            return
        if self._unlogged:
            message += " (%d more times since the last such line)"
            args += (self._unlogged,)
        log.warning(message, *args)
        self._last, self._unlogged = now, 0


def _drain(fd: int) -> bool:
    """Read everything waiting in the non-blocking pipe ``fd``; True (it woke us)."""
    try:
        while os.read(fd, 512):
            pass
    except (BlockingIOError, InterruptedError):
        pass
    return True


class SocketListener(Listener):
    """A listening TCP socket that authenticates peers before handing them out.

    Bounded under abuse: at most ``MAX_PENDING_PER_HOST`` handshakes in progress per peer
    address and ``MAX_PENDING_HANDSHAKES`` in all (past either, the longest-waiting one is
    answered "server busy" and dropped); out of file descriptors, it stops accepting for a
    growing pause (or until a handshake ends) instead of spinning.
    """

    supports_admission = True

    def __init__(
        self,
        host: str,
        port: int,
        auth_key: bytes,
        handshake_timeout: float,
        max_frame_bytes: int,
        tls_context: Optional[ssl.SSLContext] = None,
        shared_memory: bool = True,
    ):
        self._tls_context = tls_context
        self._shared_memory = shared_memory
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
        self._accept_backoff = 0.0
        self._accepting_again_at: Optional[float] = None  # set while accept() is paused
        self._warn_out_of_descriptors = _RecurringWarning()
        self._warn_busy = _RecurringWarning()

    def wake_on(self, fd: int) -> bool:
        self._selector.register(fd, selectors.EVENT_READ, _WAKE)
        return True

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
            if self._accepting_again_at is not None:
                waits.append(self._accepting_again_at - now)
            wait = max(0.0, min(waits)) if waits else None
            woken = False
            for key, _ in self._selector.select(wait):
                if key.data is None:
                    self._accept_new()
                elif key.data is _WAKE:
                    woken = _drain(key.fd)
                else:
                    self._advance(key.data)
            self._expire(time.monotonic())
            if self._accepting_again_at is not None and time.monotonic() >= self._accepting_again_at:
                self._accepting_again_at = None
                self._selector.register(self._sock, selectors.EVENT_READ, None)
            if not self._ready and (woken or (deadline is not None and time.monotonic() >= deadline)):
                return None
        return self._ready.pop(0)

    def _accept_new(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    self._pause_accepting(exc)
                else:  # e.g. ECONNABORTED: that peer is gone already
                    log.info("accept failed: %s", exc)
                return
            self._accept_backoff = 0.0
            host = addr[0] if isinstance(addr, tuple) else "local"
            peer = format_address(addr[0], addr[1]) if isinstance(addr, tuple) else f"{self.address} peer"
            busy = self._make_room(host)
            if busy is not None:
                refuse_quietly(sock, busy)
                continue
            sock.setblocking(False)
            pending = _PendingHandshake(
                sock, peer, host, self._auth_key, time.monotonic() + self._handshake_timeout, self._tls_context, self.admit
            )
            self._pending[pending.fd] = pending
            self._selector.register(pending.fd, selectors.EVENT_READ, pending)

    def _pause_accepting(self, exc: OSError) -> None:
        """Out of file descriptors: stop polling the listening socket for a while (connections
        wait in its backlog); a handshake that ends frees a descriptor and resumes at once."""
        first, longest = _ACCEPT_BACKOFF_SECONDS
        self._accept_backoff = min(longest, max(first, 2 * self._accept_backoff))
        if self._accepting_again_at is None:
            self._selector.unregister(self._sock)
        self._accepting_again_at = time.monotonic() + self._accept_backoff
        self._warn_out_of_descriptors(
            "cannot accept connections: %s (this process may open %s file descriptors, `ulimit -n`; %d "
            "handshakes in progress): pausing accepts until descriptors free up. Raise the limit, or lower "
            "--max-sessions", exc, descriptor_limit(), len(self._pending),
        )  # fmt: skip

    def _make_room(self, host: str) -> Optional[str]:
        """Make room for a new handshake from ``host``; or return why the server is too busy.

        At a cap (``host``'s or everybody's), the longest-waiting handshake under it is
        answered "server busy" and dropped if it is stale; if none is, the newcomer is."""
        same_host = [p for p in self._pending.values() if p.host == host]
        if len(same_host) >= MAX_PENDING_PER_HOST:
            crowd, scope = same_host, f"{len(same_host)} connections from {host} (at most {MAX_PENDING_PER_HOST} per address)"
        elif len(self._pending) >= MAX_PENDING_HANDSHAKES:
            crowd, scope = list(self._pending.values()), f"{len(self._pending)} connections (at most {MAX_PENDING_HANDSHAKES})"
        else:
            return None
        self.refused_handshakes += 1
        reason = (
            f"server busy: {scope} were waiting to authenticate. Retry; if this trainer did not open that many, "
            "something else floods the worker"
        )
        oldest = min(crowd, key=lambda p: p.deadline)
        if oldest.deadline - self._handshake_timeout + STALE_HANDSHAKE_SECONDS > time.monotonic():
            self._warn_busy("refused a connection from %s: %s", host, reason)
            return reason
        self._warn_busy("dropped the connection from %s that waited longest to authenticate: %s", oldest.peer, reason)
        self._drop(oldest)
        refuse_quietly(oldest.sock, reason)
        return None

    def _drop(self, pending: _PendingHandshake) -> None:
        self._pending.pop(pending.fd, None)
        self._selector.unregister(pending.fd)
        if self._accepting_again_at is not None:
            self._accepting_again_at = time.monotonic()  # a descriptor frees up: accept again

    def _end_handshake(
        self, pending: _PendingHandshake, message: str, exc: Exception, answer: bool = True, level: int = logging.WARNING
    ) -> None:
        """Log why ``pending``'s handshake failed (escaped: its text may come from the peer),
        drop it, and close, answering the peer with the reason if ``answer``."""
        if isinstance(exc, _Refused):
            self.refused_sessions += 1
        else:
            self.refused_handshakes += 1
        log.log(level, message, pending.peer, printable(str(exc)))
        self._drop(pending)
        if answer:
            refuse_quietly(pending.sock, str(exc))
        else:
            pending.sock.close()

    def _advance(self, pending: _PendingHandshake) -> None:
        try:
            authenticated = pending.on_readable()
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except _Refused as exc:
            self._end_handshake(pending, "refused a session to %s: %s", exc)
            return
        except AuthenticationError as exc:
            self._end_handshake(pending, "authentication failed for %s: %s", exc)
            return
        except ProtocolError as exc:
            self._end_handshake(pending, "refused connection from %s: %s", exc)
            return
        except ssl.SSLError as exc:
            self._end_handshake(pending, "refused connection from %s: TLS handshake failed: %s", exc, answer=False)
            return
        except OSError as exc:
            self._end_handshake(pending, "connection from %s ended during the handshake: %s", exc, False, logging.INFO)
            return
        if authenticated:
            self._drop(pending)
            if not isinstance(pending.sock, ssl.SSLSocket):
                pending.sock.setblocking(True)
            tune_socket(pending.sock)
            reader = pending.reader
            reader.max_frame_bytes = self._max_frame_bytes
            reader.allowed_kinds = None
            version = printable(pending.handshake.peer_package_version, limit=64)
            log.info("authenticated %s (package %s)", pending.peer, version or "?")
            if pending.handshake.peer_package_version not in ("", __version__):
                log.warning(
                    "trainer %s runs rpc_reading_service %s, this worker %s: the protocol matches, but install "
                    "the same version on both", pending.peer, version, __version__,
                )  # fmt: skip
            self._ready.append(authenticated_connection(pending.sock, pending.peer, reader, lend=self._shared_memory))
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
