"""The socket transport's connection: frames over a plain TCP or Unix socket, received with
few system calls and large sections straight into their final memory."""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from typing import List, Optional, Sequence

from ...protocol import Buffer, Frame, FrameReader, encode_reject
from ..base import Connection, PeerLostError
from .sockets import discard_input, send_chunks, wait_for

__all__ = ["SocketConnection"]

_STAGING_BYTES = 256 * 1024
# Once a frame's head (header, buffer lengths, body) is read, the rest of the frame goes straight
# into its memory with one scatter read (recvmsg_into) of at most _MAX_SECTIONS sections, the
# last of them the staging buffer (for the heads of the frames after it). Where frames carry
# out-of-band buffers (the one being received, or between frames the last one), only the first
# _HEAD_BYTES of the staging buffer are read into: a head comes with few bytes of its buffers
# to copy. Where they do not (items pickled in band, control frames), the whole staging buffer,
# which takes many such frames at once. A connection that cannot scatter (TLS) reads a section
# of _DIRECT_BYTES or more straight into it, less through the whole staging buffer.
_HEAD_BYTES = 32 * 1024
_DIRECT_BYTES = _STAGING_BYTES // 2
_MAX_SECTIONS = 64
# While a large section is being received over TCP, the socket reports readable only once this
# much of it (or all that is left) has arrived (SO_RCVLOWAT): a wake-up and a receive per
# 2 MiB instead of one per few loopback segments, which cost the trainer about a third of its
# CPU per 8 MiB tensor. 2 MiB beat 0.5 MiB (4 of 4 interleaved rounds), 1 and 4 MiB (3 of 3)
# over loopback with 8 MiB tensors; Linux grows the receive buffer to fit. It never waits for
# bytes the frame did not announce.
_LOW_WATER_BYTES = 2 * 1024 * 1024


class SocketConnection(Connection):
    """An authenticated TCP connection carrying frames."""

    sends_synchronously = True  # sendmsg (or SSL_write) has taken every byte when send() returns
    #: Whether a read may fill several sections of a frame at once (a TLS socket has no recvmsg).
    scatters = True
    #: Whether received bytes may wait in a layer below the socket (TLS): see :meth:`_buffered`.
    decrypts = False

    def __init__(self, sock: socket.socket, peer: str, reader: FrameReader):
        self.peer = peer
        self._sock = sock
        self._reader = reader
        self._send_lock = threading.Lock()
        self._staging = memoryview(bytearray(_STAGING_BYTES))
        self._head = self._staging[:_HEAD_BYTES]
        self._pending = memoryview(b"")
        self._closed = False
        self._room_poller: Optional["select.poll"] = None
        # the socket's receive low-water mark; 0: left alone (Unix sockets, TLS: its records)
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and not isinstance(sock, ssl.SSLSocket)
        self._low_water = 1 if tcp and hasattr(socket, "SO_RCVLOWAT") else 0

    def fileno(self) -> int:
        """The socket's file descriptor."""
        return self._sock.fileno()

    def has_room(self) -> bool:
        # The kernel reports a socket writable while a good part of its send buffer is free
        # (a quarter to a third): plenty for a small frame.
        fd = self._sock.fileno()
        if fd < 0:
            return True  # closed: its send says so
        poller = self._room_poller
        if poller is None:  # made once: a poll object per call cost about as much as the poll
            poller = self._room_poller = _writable_poller(fd)
        try:
            return bool(poller.poll(0))
        except RuntimeError:  # another thread polls it right now
            return bool(_writable_poller(fd).poll(0))

    def bound_buffers(self, frames: int, frame_bytes: int) -> None:
        bound = getattr(self._reader.allocate, "bound", None)  # ReusedBuffers; pinned memory is not reused
        if bound is not None:
            bound(frames, frame_bytes)

    def send(self, chunks: Sequence[Buffer]) -> None:
        with self._send_lock:
            if self._closed:
                raise PeerLostError(f"connection to {self.peer} is closed")
            try:
                send_chunks(self._sock, chunks)
            except OSError as exc:
                raise PeerLostError(f"lost connection to {self.peer} while sending: {exc}") from exc

    def send_frames(self, frames: Sequence[Sequence[Buffer]]) -> None:
        """Send the frames with one ``sendmsg`` (as far as the socket takes them at once)."""
        chunks: List[Buffer] = []
        for frame in frames:  # a plain loop: no call per send
            chunks += frame
        self.send(chunks)

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

    def recv_ready(self, most: int = 0) -> List[Frame]:
        """The frames completed by what has arrived, read without blocking (for an event loop).

        One read per call, and none while whole frames wait from an earlier one, so that a peer
        that never stops sending cannot starve the other connections of the loop; a TLS
        connection reads on while OpenSSL holds decrypted bytes (which ``select`` cannot see)
        and no frame is complete. The frames of a read come out before the EOF or reset of a
        later read is raised. What is left sets :attr:`ready_left`.
        """
        read = False
        reader = self._reader
        while True:
            if self._pending:
                self._parse_pending()
            elif reader.waiting or (read and not (self.decrypts and self._buffered())) or not self._read(time.monotonic(), False):
                if self._low_water:
                    self._arm_low_water()
                frames = reader.completed(most)
                self.ready_left = bool(reader.waiting) or (self.decrypts and self._buffered())
                return frames
            else:
                read = True

    def _parse_pending(self) -> None:
        """Move staged bytes into the frame reader: the whole small frames and a frame's head at
        once, else as far as its current section goes."""
        self._pending = self._pending[self._reader.take(self._pending) :]

    def _read(self, deadline: Optional[float], arm: bool = True) -> bool:
        """One read: the rest of a frame straight into its memory (and what follows into the
        staging buffer), else into the staging buffer. False if nothing arrived by ``deadline``.

        Args:
            arm: Set the low-water mark for this read first (not needed where it was set already).
        """
        reader = self._reader
        staging = self._head if reader.has_buffers and self.scatters else self._staging
        if reader.frame_bytes_left and self.scatters:
            views = reader.writable_sections(_MAX_SECTIONS - 1)
            # the frame's every section (no call per section), or as many as a read takes
            direct = reader.frame_bytes_left if len(views) < _MAX_SECTIONS - 1 else sum(map(len, views))
            views.append(staging)
        elif reader.frame_bytes_left and len(reader.writable()) >= _DIRECT_BYTES:
            views = [reader.writable()]
            direct = len(views[0])
        else:
            views, direct = [staging], 0
        if arm and self._low_water:
            self._arm_low_water()
        received = self._recv_into(views, deadline)
        if received is None:
            return False
        if direct:
            reader.advance(min(received, direct))
        if received > direct:
            self._pending = self._staging[: received - direct]
        return True

    def _arm_low_water(self) -> None:
        """Before waiting for input: the low-water mark for the frame being received (at most
        what is left of it, so a frame's last bytes and the next small frame still wake)."""
        left = self._reader.frame_bytes_left
        nbytes = min(left, _LOW_WATER_BYTES) if left >= _DIRECT_BYTES else 1
        if nbytes != self._low_water:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            except OSError:
                return
            self._low_water = nbytes

    def _buffered(self) -> bool:
        """Whether received bytes wait below the socket (in a TLS layer)."""
        return False

    def _recv_into(self, views: List[memoryview], deadline: Optional[float]) -> Optional[int]:
        if deadline is None and not self._reader.mid_frame:
            # Waiting for a new frame with no deadline (a worker session's control loop): it has
            # most likely not come yet, so wait first. A wake-up then costs a select and the
            # receive, not also a receive that finds nothing; a blocking receive would be one
            # call, but the kernel wakes a thread blocked in it each time the peer reads bytes
            # this end sent (once per frame a worker sends), where select sleeps on.
            self._wait_for_input(None)
        while True:
            if self._closed:
                raise PeerLostError(f"connection to {self.peer} is closed")
            try:
                n = self._recv_some(views)
            except (BlockingIOError, InterruptedError):
                if not self._wait_for_input(deadline):
                    return None
                continue
            except OSError as exc:
                raise PeerLostError(f"lost connection to {self.peer}: {exc}") from exc
            if n == 0:
                raise self._closed_by_peer()
            return n

    def _recv_some(self, views: List[memoryview]) -> int:
        """One non-blocking receive into ``views``, in order (raises BlockingIOError when nothing is there)."""
        if len(views) == 1:
            return self._sock.recv_into(views[0], 0, socket.MSG_DONTWAIT)
        return self._sock.recvmsg_into(views, 0, socket.MSG_DONTWAIT)[0]

    def _wait_for_input(self, deadline: Optional[float]) -> bool:
        """Wait until the socket is readable; False once ``deadline`` has passed."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        return self._wait(True, remaining) or deadline is None or time.monotonic() < deadline

    def _wait(self, readable: bool, timeout: Optional[float]) -> bool:
        """Wait up to ``timeout`` until the socket is readable (or writable); True if it is."""
        try:
            return wait_for(self._sock, readable, timeout)
        except (OSError, ValueError) as exc:  # closed under us by another thread
            raise PeerLostError(f"connection to {self.peer} is closed") from exc

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
        discard_input(self._sock, deadline)
        self.close()

    def release(self) -> None:
        self._closed = True
        self._sock.close()


def _writable_poller(fd: int) -> "select.poll":
    """A poll object watching ``fd`` for room to write."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return poller
