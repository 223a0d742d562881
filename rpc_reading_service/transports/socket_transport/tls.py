"""TLS under the socket transport (stdlib ``ssl``): the TLS connection's own send and receive
path, and the server's and the trainer's TLS contexts."""

from __future__ import annotations

import ssl
import threading
import time
from typing import Iterator, List, Optional, Sequence

from ...errors import ConfigurationError
from ...protocol import Buffer, FrameReader
from ..base import PeerLostError
from .connection import SocketConnection

__all__ = ["TLSSocketConnection"]

_TLS_WRITE_BYTES = 256 * 1024  # one SSL_write call
_TLS_COALESCE_BYTES = 64 * 1024  # chunks below this are joined, so small frames make few TLS records


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

    scatters = False
    decrypts = True

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

    def _recv_into(self, views: List[memoryview], deadline: Optional[float]) -> Optional[int]:
        view = views[0]  # one section at a time: no scatter read through OpenSSL
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

    def _buffered(self) -> bool:
        with self._tls_lock:
            return not self._closed and self._sock.pending() > 0

    def _close_socket(self) -> None:
        with self._tls_lock:
            self._sock.close()


def load_server_tls(tls_cert: Optional[str], tls_key: Optional[str]) -> Optional[ssl.SSLContext]:
    """The server's TLS context from ``--tls-cert``/``--tls-key``; None without a certificate."""
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


def load_client_tls(tls_ca_file: Optional[str], tls_server_hostname: Optional[str]) -> Optional[ssl.SSLContext]:
    """The trainer's TLS context verifying the workers against ``tls_ca_file``; None without one."""
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
