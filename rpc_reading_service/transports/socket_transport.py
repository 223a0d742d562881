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

import array
import collections
import contextlib
import errno
import logging
import os
import select
import selectors
import socket
import ssl
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from ..version import __version__
from ..addresses import format_address, parse_address, unix_socket_path
from ..errors import AuthenticationError, ConfigurationError, ProtocolError, RemoteProtocolError, WorkerRefusedError
from ..safe_text import printable
from ..protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    HANDSHAKE_KINDS,
    HANDSHAKE_MAX_FRAME_BYTES,
    HEADER,
    Buffer,
    MessageKind,
    ClientHandshake,
    Frame,
    FrameReader,
    ServerHandshake,
    decode_reject,
    encode_frame,
    encode_reject,
)
from ..protocol.frames import TRANSPORT_KINDS, decode_shared_data, encode_shared_data, split_frame
from ..serialization import SHARED_MEMORY_MIN_BYTES, accepts_shared_memory
from .base import Allocator, Connection, Listener, PeerLostError, Transport
from .shared_memory import MAX_NEW_SEGMENTS_PER_FRAME, SegmentMap, SegmentPool, shared_memory_available

__all__ = ["SocketTransport", "SocketConnection", "SharedMemoryConnection", "TLSSocketConnection", "SocketListener"]

log = logging.getLogger(__name__)

_STAGING_BYTES = 256 * 1024
# While a large section is being received over TCP, the socket reports readable only once this
# much of it (or all that is left) has arrived (SO_RCVLOWAT): a wake-up and a receive per
# 2 MiB instead of one per few loopback segments, which cost the trainer about a third of its
# CPU per 8 MiB tensor. 2 MiB beat 0.5 MiB (4 of 4 interleaved rounds), 1 and 4 MiB (3 of 3)
# over loopback with 8 MiB tensors; Linux grows the receive buffer to fit. It never waits for
# bytes the frame did not announce.
_LOW_WATER_BYTES = 2 * 1024 * 1024
_IOV_MAX = 512
# Handshakes in progress at once, in all and per peer address. A good handshake takes a few
# round trips; one that waited past _STALE_HANDSHAKE_SECONDS makes room for a newcomer, so
# silent sockets can neither lock out a good trainer for the handshake timeout nor, from one
# host, crowd out the others.
_MAX_PENDING_HANDSHAKES = 512
_MAX_PENDING_PER_HOST = 128
_STALE_HANDSHAKE_SECONDS = 1.0
_ACCEPT_BACKOFF_SECONDS = (0.05, 1.0)  # first and longest pause of accept() when out of descriptors
_RECURRING_LOG_SECONDS = 10.0
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_TLS_WRITE_BYTES = 256 * 1024  # one SSL_write call
_TLS_COALESCE_BYTES = 64 * 1024  # chunks below this are joined, so small frames make few TLS records
_TLS_HANDSHAKE_RECORD = 0x16  # first byte of a TLS ClientHello; a plain frame starts with MAGIC ("R")
_KEY_MISMATCH = "the trainer's auth key does not match this worker's (or one of the two has none)"


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


def _send_chunks(sock: socket.socket, chunks: Sequence[Buffer], fds: Sequence[int] = ()) -> None:
    """Send every byte of ``chunks`` with as few system calls as possible (``fds``, on a
    Unix socket, go with the first byte)."""
    views = [memoryview(c).cast("B") for c in chunks]
    views = [v for v in views if v.nbytes]
    if not hasattr(sock, "sendmsg"):  # pragma: no cover - Windows
        for view in views:
            sock.sendall(view)
        return
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX], ancillary)
        ancillary = []
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


class SocketConnection(Connection):
    """An authenticated TCP connection carrying frames."""

    sends_synchronously = True  # sendmsg (or SSL_write) has taken every byte when send() returns

    def __init__(self, sock: socket.socket, peer: str, reader: FrameReader):
        self.peer = peer
        self._sock = sock
        self._reader = reader
        self._send_lock = threading.Lock()
        self._staging = memoryview(bytearray(_STAGING_BYTES))
        self._pending = memoryview(b"")
        self._closed = False
        # the socket's receive low-water mark; 0: left alone (Unix sockets, TLS: its records)
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and not isinstance(sock, ssl.SSLSocket)
        self._low_water = 1 if tcp and hasattr(socket, "SO_RCVLOWAT") else 0

    def fileno(self) -> int:
        """The socket's file descriptor."""
        return self._sock.fileno()

    def set_max_frame_bytes(self, max_frame_bytes: int) -> None:
        self._reader.max_frame_bytes = max_frame_bytes

    def has_room(self) -> bool:
        # The kernel reports a socket writable while a good part of its send buffer is free
        # (a quarter to a third): plenty for a small frame.
        fd = self._sock.fileno()
        if fd < 0:
            return True  # closed: its send says so
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return bool(poller.poll(0))

    def send(self, chunks: Sequence[Buffer]) -> None:
        with self._send_lock:
            if self._closed:
                raise PeerLostError(f"connection to {self.peer} is closed")
            try:
                _send_chunks(self._sock, chunks)
            except OSError as exc:
                raise PeerLostError(f"lost connection to {self.peer} while sending: {exc}") from exc

    def send_frames(self, frames: Sequence[Sequence[Buffer]]) -> None:
        """Send the frames with one ``sendmsg`` (as far as the socket takes them at once)."""
        self.send([chunk for chunks in frames for chunk in chunks])

    def recv(self, timeout: Optional[float] = None) -> Optional[Frame]:
        deadline = None if timeout is None else time.monotonic() + timeout
        reader = self._reader
        while True:
            frame = reader.next_frame()
            if frame is not None:
                return frame
            if self._pending:
                self._parse_pending()
            elif not self._read(deadline):
                return None

    def recv_ready(self) -> List[Frame]:
        """The frames completed by what has arrived, read without blocking (for an event loop).

        One read per call, so that a peer that never stops sending cannot starve the other
        connections of the loop; a TLS connection reads on while OpenSSL holds decrypted
        bytes, which ``select`` cannot see. The frames of a read come out before the EOF
        or reset of a later read is raised.
        """
        reader, frames, read = self._reader, [], False
        while True:
            frame = reader.next_frame()
            if frame is not None:
                frames.append(frame)
            elif self._pending:
                self._parse_pending()
            elif (read and not self._buffered()) or not self._read(time.monotonic()):
                if self._low_water:
                    self._arm_low_water()
                return frames
            else:
                read = True

    def _parse_pending(self) -> None:
        """Move staged bytes into the frame reader, as far as its current section goes."""
        target = self._reader.writable()
        n = min(len(target), len(self._pending))
        target[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        self._reader.advance(n)

    def _read(self, deadline: Optional[float]) -> bool:
        """One read: a large section straight into its memory, else into the staging buffer.
        False if nothing arrived by ``deadline``."""
        target = self._reader.writable()
        direct = len(target) >= _STAGING_BYTES // 2
        if self._low_water:
            self._arm_low_water()
        received = self._recv_into(target if direct else self._staging, deadline)
        if received is None:
            return False
        if direct:
            self._reader.advance(received)
        else:
            self._pending = self._staging[:received]
        return True

    def _arm_low_water(self) -> None:
        """Before waiting for input: the low-water mark for the section being received (at
        most what is left of it, so a frame's last bytes and the next small frame still wake)."""
        target = len(self._reader.writable())
        nbytes = min(target, _LOW_WATER_BYTES) if target >= _STAGING_BYTES // 2 else 1
        if nbytes != self._low_water:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            except OSError:
                return
            self._low_water = nbytes

    def _buffered(self) -> bool:
        """Whether received bytes wait below the socket (in a TLS layer)."""
        return False

    def _recv_into(self, view: memoryview, deadline: Optional[float]) -> Optional[int]:
        while True:
            if self._closed:
                raise PeerLostError(f"connection to {self.peer} is closed")
            try:
                n = self._recv_some(view)
            except (BlockingIOError, InterruptedError):
                if not self._wait_for_input(deadline):
                    return None
                continue
            except OSError as exc:
                raise PeerLostError(f"lost connection to {self.peer}: {exc}") from exc
            if n == 0:
                raise self._closed_by_peer()
            return n

    def _recv_some(self, view: memoryview) -> int:
        """One non-blocking receive into ``view`` (raises BlockingIOError when nothing is there)."""
        return self._sock.recv_into(view, 0, socket.MSG_DONTWAIT)

    def _wait_for_input(self, deadline: Optional[float]) -> bool:
        """Wait until the socket is readable; False once ``deadline`` has passed."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        return self._wait(True, remaining) or deadline is None or time.monotonic() < deadline

    def _wait(self, readable: bool, timeout: Optional[float]) -> bool:
        """Wait up to ``timeout`` until the socket is readable (or writable); True if it is."""
        try:
            if readable:
                ready, _, _ = select.select([self._sock], [], [], timeout)
            else:
                _, ready, _ = select.select([], [self._sock], [], timeout)
        except (OSError, ValueError) as exc:  # closed under us by another thread
            raise PeerLostError(f"connection to {self.peer} is closed") from exc
        return bool(ready)

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

    def refuse(self, reason: str, linger: float = 0.0) -> None:
        deadline = time.monotonic() + linger
        try:
            self.send(encode_reject(reason))
            # FIN after the REJECT, then take in what the peer still sends (a SETUP, say) until
            # it has read the reason and closed: closing on unread input would reset.
            socket.socket.shutdown(self._sock, socket.SHUT_WR)
        except (PeerLostError, OSError):
            pass
        _discard_input(self._sock, deadline)
        self.close()

    def release(self) -> None:
        self._closed = True
        self._sock.close()


_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_NEW_SEGMENTS_PER_FRAME * array.array("i").itemsize) if hasattr(socket, "CMSG_SPACE") else 0


class SharedMemoryConnection(SocketConnection):
    """A :class:`SocketConnection` over a Unix socket that hands large buffers over in
    shared memory (see :mod:`.shared_memory`).

    The trainer's end (``offered``) said SHARED_MEMORY_OFFER after the handshake; it
    receives the descriptors of new segments with the bytes (``recvmsg``) and turns every
    SHARED_DATA frame back into the DATA frame it wraps. The worker's end (``lend``) puts
    the large buffers of its DATA frames in segments once the trainer offered, and lets
    the graph make its items in them (``rpc_reading_service.shared_empty``). Transport
    frames never reach the session above.
    """

    # A local worker's large buffers go into shared segments as they are encoded (the segment
    # pool decides where each one goes): they are not sent from the producer's own memory.
    sends_synchronously = False

    def __init__(self, sock: socket.socket, peer: str, reader: FrameReader, offered: bool = False, lend: bool = False):
        super().__init__(sock, peer, reader)
        self._lend = lend
        self._accepted_in = os.getpid()
        self._pool: Optional[SegmentPool] = None
        self._segments: Optional[SegmentMap] = SegmentMap(peer) if offered else None
        self._fds: "collections.deque[int]" = collections.deque()

    @property
    def shared_segments(self) -> int:
        """Shared segments this end holds (the worker's pool, or the trainer's mappings)."""
        if self._pool is not None:
            return self._pool.segments
        return self._segments.segments if self._segments is not None else 0

    def _lends(self, chunks: Sequence[Buffer]) -> bool:
        """Whether this frame's buffers may go into shared segments (a DATA frame with buffers, once offered)."""
        _magic, _version, kind, n_buffers, _length = HEADER.unpack_from(memoryview(chunks[0]))
        return self._pool is not None and kind == MessageKind.DATA and n_buffers > 0

    def send_frames(self, frames: Sequence[Sequence[Buffer]]) -> None:
        """One ``sendmsg`` for the frames, their large buffers lent in shared segments (a
        ``sendmsg`` per :data:`MAX_NEW_SEGMENTS_PER_FRAME` descriptors of new segments, which
        is what the trainer takes in with one receive)."""
        pool = self._pool
        if pool is None or not any(self._lends(chunks) for chunks in frames):
            return super().send_frames(frames)
        with self._send_lock:
            if self._closed:
                raise PeerLostError(f"connection to {self.peer} is closed")
            pending: List[Buffer] = []
            new_segments: List[Tuple[int, int, int]] = []
            try:
                for chunks in frames:
                    if self._lends(chunks):
                        kind, body, buffers = split_frame(chunks)
                        shared, inline, new, retired = pool.lend(buffers, SHARED_MEMORY_MIN_BYTES)
                        if new and len(new_segments) + len(new) > MAX_NEW_SEGMENTS_PER_FRAME:
                            self._send_lent(pool, pending, new_segments)
                        new_segments += new
                        if shared or retired:
                            chunks = encode_shared_data(kind, body, len(buffers), shared, inline,
                                                        [(i, n) for i, n, _ in new], retired)
                    pending += chunks
                self._send_lent(pool, pending, new_segments)
            except OSError as exc:
                raise PeerLostError(f"lost connection to {self.peer} while sending: {exc}") from exc
            finally:
                pool.sent(new_segments)  # those a failed send left open

    def _send_lent(self, pool: SegmentPool, pending: List[Buffer], new_segments: List[Tuple[int, int, int]]) -> None:
        """Send ``pending`` with the descriptors of ``new_segments`` (then closed here); empty both."""
        _send_chunks(self._sock, pending, [fd for _, _, fd in new_segments])
        pool.sent(new_segments)
        pending.clear()
        new_segments.clear()

    def send(self, chunks: Sequence[Buffer]) -> None:
        if self._pool is None or not self._lends(chunks):
            return super().send(chunks)
        self.send_frames([chunks])

    def recv(self, timeout: Optional[float] = None) -> Optional[Frame]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            frame = super().recv(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if frame is None:
                return None
            frame = self._session_frame(frame)
            if frame is not None:
                return frame

    def recv_ready(self) -> List[Frame]:
        frames = (self._session_frame(frame) for frame in super().recv_ready())
        return [frame for frame in frames if frame is not None]

    def _session_frame(self, frame: Frame) -> Optional[Frame]:
        """The frame for the session above: a SHARED_DATA frame turned back into its DATA frame,
        None for a transport frame this end consumed (SHARED_MEMORY_OFFER)."""
        if frame.kind not in TRANSPORT_KINDS:
            return frame
        if frame.kind == MessageKind.SHARED_MEMORY_OFFER and self._segments is None:
            if self._lend and self._pool is None:
                self._pool = SegmentPool()
                # Only a session in a process of its own (forked after the accept): one that
                # shares the server's process (threads) could leave its items' segments mapped
                # there after it ends, through anything still referencing them (a traceback).
                if os.getpid() != self._accepted_in:
                    self._pool.offer_to_producers()
            return None
        if frame.kind == MessageKind.SHARED_DATA and self._segments is not None:
            shared = decode_shared_data(frame)
            fds = [self._fds.popleft() for _ in range(min(len(shared.new_segments), len(self._fds)))]
            return self._segments.open(shared, fds, self._reader.max_frame_bytes)
        raise RemoteProtocolError(f"{self.peer} sent {frame.kind.name}, which this end of the connection never accepts")

    def _recv_some(self, view: memoryview) -> int:
        if self._segments is None:  # descriptors sent to this end are dropped by the kernel
            return super()._recv_some(view)
        n, ancillary, flags, _ = self._sock.recvmsg_into([view], _ANCILLARY_BYTES, socket.MSG_DONTWAIT)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise RemoteProtocolError(f"{self.peer} sent more descriptors with one frame than a SHARED_DATA frame may bring")
        return n

    def close(self) -> None:
        super().close()
        self._drop_shared()

    def release(self) -> None:
        super().release()
        self._drop_shared()

    def _drop_shared(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._segments is not None:
            self._segments.close()
        while self._fds:
            with contextlib.suppress(OSError):
                os.close(self._fds.popleft())


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

    def _buffered(self) -> bool:
        with self._tls_lock:
            return not self._closed and self._sock.pending() > 0

    def _close_socket(self) -> None:
        with self._tls_lock:
            self._sock.close()


def _connection(sock: socket.socket, peer: str, reader: FrameReader, lend: bool = False) -> SocketConnection:
    if isinstance(sock, ssl.SSLSocket):
        return TLSSocketConnection(sock, peer, reader)
    if sock.family == socket.AF_UNIX:
        return SharedMemoryConnection(sock, peer, reader, lend=lend and shared_memory_available())
    return SocketConnection(sock, peer, reader)


def _discard_input(sock: socket.socket, deadline: float) -> None:
    """Read and drop what the peer sends until it closes or ``deadline`` passes (reading
    at least what has arrived already; never blocking past ``deadline``).

    Unread input makes close() send a TCP reset, which can destroy a REJECT before the peer
    reads it. Raw reads (also under TLS): the connection is being closed anyway.
    """
    while True:
        try:
            if not socket.socket.recv(sock, 65536, socket.MSG_DONTWAIT):
                return
        except (BlockingIOError, InterruptedError):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                select.select([sock], [], [], remaining)
            except (OSError, ValueError):
                return
        except (OSError, ValueError):
            return


def _refuse_quietly(sock: socket.socket, reject: Optional[str]) -> None:
    """Answer a refused peer with a REJECT frame (if any) and close, without a reset."""
    _discard_input(sock, time.monotonic())
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
            reader._allocate = allocate  # noqa: SLF001 - the reader's allocator is set once, here
        if self._offers_shared_memory(sock, allocate, handshake.peer_package_version):
            try:
                sock.sendall(b"".join(bytes(c) for c in encode_frame(MessageKind.SHARED_MEMORY_OFFER)))
            except OSError as exc:
                sock.close()
                raise PeerLostError(f"lost the worker at {address} right after the handshake: {exc}") from exc
            return SharedMemoryConnection(sock, address, reader, offered=True)
        return _connection(sock, address, reader)

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


def _descriptor_limit() -> str:
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return "?"
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


class SocketListener(Listener):
    """A listening TCP socket that authenticates peers before handing them out.

    Bounded under abuse: at most ``_MAX_PENDING_PER_HOST`` handshakes in progress per peer
    address and ``_MAX_PENDING_HANDSHAKES`` in all (past either, the longest-waiting one is
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
            for key, _ in self._selector.select(wait):
                if key.data is None:
                    self._accept_new()
                else:
                    self._advance(key.data)
            self._expire(time.monotonic())
            if self._accepting_again_at is not None and time.monotonic() >= self._accepting_again_at:
                self._accepting_again_at = None
                self._selector.register(self._sock, selectors.EVENT_READ, None)
            if not self._ready and deadline is not None and time.monotonic() >= deadline:
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
                _refuse_quietly(sock, busy)
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
            "--max-sessions", exc, _descriptor_limit(), len(self._pending),
        )  # fmt: skip

    def _make_room(self, host: str) -> Optional[str]:
        """Make room for a new handshake from ``host``; or return why the server is too busy.

        At a cap (``host``'s or everybody's), the longest-waiting handshake under it is
        answered "server busy" and dropped if it is stale; if none is, the newcomer is."""
        same_host = [p for p in self._pending.values() if p.host == host]
        if len(same_host) >= _MAX_PENDING_PER_HOST:
            crowd, scope = same_host, f"{len(same_host)} connections from {host} (at most {_MAX_PENDING_PER_HOST} per address)"
        elif len(self._pending) >= _MAX_PENDING_HANDSHAKES:
            crowd, scope = list(self._pending.values()), f"{len(self._pending)} connections (at most {_MAX_PENDING_HANDSHAKES})"
        else:
            return None
        self.refused_handshakes += 1
        reason = (
            f"server busy: {scope} were waiting to authenticate. Retry; if this trainer did not open that many, "
            "something else floods the worker"
        )
        oldest = min(crowd, key=lambda p: p.deadline)
        if oldest.deadline - self._handshake_timeout + _STALE_HANDSHAKE_SECONDS > time.monotonic():
            self._warn_busy("refused a connection from %s: %s", host, reason)
            return reason
        self._warn_busy("dropped the connection from %s that waited longest to authenticate: %s", oldest.peer, reason)
        self._drop(oldest)
        _refuse_quietly(oldest.sock, reason)
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
            _refuse_quietly(pending.sock, str(exc))
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
            _tune(pending.sock)
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
            self._ready.append(_connection(pending.sock, pending.peer, reader, lend=self._shared_memory))
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
