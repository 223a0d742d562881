"""The interface between the reading service / worker server and whatever moves frames.

A transport knows frames (:class:`~rpc_reading_service.protocol.Frame`), peers and
authentication; it knows nothing about DataPipes. The reading service and the worker
server use only these three classes.
"""

from __future__ import annotations

import abc
from typing import Callable, List, Optional, Sequence

from ..protocol import Buffer, Frame, encode_reject

__all__ = ["Connection", "Listener", "WrappingListener", "Transport", "PeerLostError", "Allocator", "PROBE_SECONDS"]

Allocator = Callable[[int], Buffer]

#: Seconds :meth:`Transport.probe` waits for a server's answer by default: a live server
#: answers in milliseconds, but one as busy as a loaded host makes it may take a while.
PROBE_SECONDS = 3.0


class PeerLostError(ConnectionError):
    """The other side closed the connection, reset it, or sent nothing for too long."""


class Connection(abc.ABC):
    """An authenticated, bidirectional channel of frames to one peer."""

    #: ``host:port`` (or another transport-specific name) of the peer, for messages.
    peer: str
    #: True when :meth:`send` returns only once the memory of the chunks it was given is no
    #: longer needed (written to the kernel, or copied): a worker may then send an item's large
    #: buffers from the producer's own memory, uncopied. False (the default) for a transport
    #: that may still read them after returning (an asynchronous send).
    sends_synchronously: bool = False
    #: The smallest buffer :meth:`stage_buffer` may stage: the worker's encoder calls it for none
    #: smaller (the default 0: for every large buffer).
    stage_min_bytes: int = 0

    def stage_buffer(self, view: memoryview) -> Optional[Buffer]:
        """Where an item's large buffer ``view`` goes as the worker encodes it (an ``ItemEncoder``'s
        ``stage``): memory this transport hands over without a further copy; None (the default):
        an ordinary copy."""
        return None

    @abc.abstractmethod
    def send(self, chunks: Sequence[Buffer]) -> None:
        """Send one encoded frame (the chunks from ``protocol.encode_frame``).

        Thread-safe: a frame is never interleaved with another. Raises
        :class:`PeerLostError` when the peer is gone.
        """

    def send_frames(self, frames: Sequence[Sequence[Buffer]]) -> None:
        """Send several encoded frames, in order and never interleaved with another send, in one
        write where the transport can (small frames that leave together then cost the peer one
        wake-up). The default sends them one by one."""
        for chunks in frames:
            self.send(chunks)

    @abc.abstractmethod
    def recv(self, timeout: Optional[float] = None) -> Optional[Frame]:
        """Receive the next frame; None if nothing complete arrived within ``timeout`` seconds.

        Call from one thread at a time. Raises :class:`PeerLostError` on EOF or reset and
        :class:`~rpc_reading_service.errors.ProtocolError` on a malformed frame.
        """

    def fileno(self) -> Optional[int]:
        """A file descriptor that turns readable when frames arrive, for an event loop
        (``selectors``) that reads many connections in one thread with :meth:`recv_ready`;
        None (the default): this connection is read by a thread of its own calling :meth:`recv`."""
        return None

    def has_room(self) -> bool:
        """Whether a small frame (a heartbeat, a credit) can be sent now without blocking; a
        peer that stopped reading fills the connection until a send waits. True (the default)
        when the transport cannot tell."""
        return True

    def bound_buffers(self, frames: int, frame_bytes: int) -> None:
        """Keep at most ``frames`` frames (the connection's share of the credit window, plus
        one) of ``frame_bytes`` each (or of the largest buffer seen, if larger) in this end's
        reuse pools: received buffers, shared segments lent. The default does nothing.

        Args:
            frames: Frames in flight at once, plus one.
            frame_bytes: Bytes counted per frame (a trainer: ``batch_max_bytes``; a worker: ``frame_max_bytes``).
        """

    #: Whether the last :meth:`recv_ready` left frames (or bytes) in this end that the next
    #: one returns even if :meth:`fileno` does not turn readable again.
    ready_left = False

    def recv_ready(self, most: int = 0) -> List[Frame]:
        """The frames that can be received without blocking (often none), for an event loop
        that found :meth:`fileno` readable. Raises as :meth:`recv` does.

        The default takes at most one complete frame; a transport with a :meth:`fileno`
        overrides it to read what has arrived in one go.

        Args:
            most: Return at most this many frames (0: no bound); the rest set :attr:`ready_left`.
        """
        frame = self.recv(timeout=0)
        return [] if frame is None else [frame]

    @abc.abstractmethod
    def close(self) -> None:
        """Close the connection (idempotent). Wakes a thread blocked in ``recv``."""

    def refuse(self, reason: str, linger: float = 0.0) -> None:
        """End the connection with ``reason``, which the peer receives in a REJECT frame
        (raised there as :class:`~rpc_reading_service.errors.WorkerRefusedError`), then close.

        Never raises. ``linger``: seconds this call may wait for the peer to read the reason
        (0 never blocks)."""
        try:
            self.send(encode_reject(reason))
        except (PeerLostError, OSError):
            pass
        self.close()

    def release(self) -> None:
        """Drop this process's handle without disturbing the peer (after handing it to a child)."""
        self.close()


class Listener(abc.ABC):
    """A server endpoint that yields authenticated connections."""

    #: ``host:port`` this listener is reachable at.
    address: str

    #: Set by the server: ``admit(peer) -> None`` accepts an authenticated peer; a string
    #: refuses it with that reason (e.g. the server is at its ``--max-sessions`` limit). A
    #: listener with ``supports_admission`` asks before completing the handshake and answers
    #: a refusal with the reason; the server checks connections from other listeners itself.
    admit: Optional[Callable[[str], Optional[str]]] = None
    supports_admission: bool = False

    def queued(self) -> int:
        """Authenticated connections waiting for :meth:`accept` (admitted, not yet served)."""
        return 0

    @abc.abstractmethod
    def accept(self, timeout: Optional[float] = None) -> Optional[Connection]:
        """Return the next authenticated connection, or None after ``timeout`` seconds.

        Failed handshakes are logged and answered, never raised: a bad peer cannot stop
        the server.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop listening (idempotent)."""

    def inheritable_fds(self) -> List[int]:
        """File descriptors a forked session process should close."""
        return []

    def wake_on(self, fd: int) -> bool:
        """Make :meth:`accept` return None as soon as ``fd`` turns readable (it reads what is there).

        Returns False when this listener cannot (the default): the server then notices a stop
        request at the end of its next ``accept(timeout)`` instead.

        Args:
            fd: The non-blocking read end of a pipe (the server's ``signal.set_wakeup_fd``).
        """
        return False


class WrappingListener(Listener):
    """A listener that serves through another one (say, the socket transport's) and wraps
    every connection it accepts with :meth:`wrap`. The usual base for a transport that
    bootstraps over sockets."""

    def __init__(self, inner: Listener):
        self._inner = inner
        self.address = inner.address
        self.supports_admission = inner.supports_admission

    @property  # type: ignore[override]
    def admit(self) -> Optional[Callable[[str], Optional[str]]]:
        """The inner listener's admission check (:attr:`Listener.admit`); setting it here sets it there."""
        return self._inner.admit

    @admit.setter
    def admit(self, admit: Optional[Callable[[str], Optional[str]]]) -> None:
        self._inner.admit = admit

    def wrap(self, conn: Connection) -> Connection:
        """The connection to hand to the server for an accepted ``conn``."""
        return conn

    def queued(self) -> int:
        return self._inner.queued()

    def accept(self, timeout: Optional[float] = None) -> Optional[Connection]:
        conn = self._inner.accept(timeout)
        return None if conn is None else self.wrap(conn)

    def close(self) -> None:
        self._inner.close()

    def inheritable_fds(self) -> List[int]:
        return self._inner.inheritable_fds()

    def wake_on(self, fd: int) -> bool:
        return self._inner.wake_on(fd)


class Transport(abc.ABC):
    """A way of moving frames between a trainer and worker servers."""

    #: The registry name, e.g. ``"socket"``.
    name: str = ""
    #: Whether an accepted connection survives ``os.fork`` into a session process.
    supports_fork: bool = False

    @abc.abstractmethod
    def connect(
        self,
        address: str,
        auth_key: bytes,
        timeout: float,
        allocate: Optional[Allocator] = None,
    ) -> Connection:
        """Connect to a worker server at ``address`` and authenticate, within ``timeout`` seconds."""

    @abc.abstractmethod
    def listen(self, host: str, port: int, auth_key: bytes, handshake_timeout: float = 10.0) -> Listener:
        """Start a server endpoint on ``host:port`` (port 0 picks a free one)."""

    def probe(self, address: str, timeout: float = PROBE_SECONDS) -> Optional[str]:
        """None if a worker server answers at ``address`` within ``timeout`` seconds, else why not.

        Cheap and unauthenticated: discovery asks it of every registered worker, and a lost
        worker's replacement of every candidate server. The default only connects (a stopped
        process's kernel still accepts); a transport that can ask its server overrides it.

        Args:
            address: The server's ``HOST:PORT``.
            timeout: Seconds for the whole probe.
        """
        from ..discovery.store import probe_address

        return probe_address(address, timeout)
