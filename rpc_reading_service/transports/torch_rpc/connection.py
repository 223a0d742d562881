"""One session's frames as RPC calls to the peer's agent, next to the bootstrap socket that
tells each side at once when the other one is gone (both ends use it)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable, Optional, Sequence

from ...errors import ProtocolError
from ...tasks import TaskGroup
from ...protocol import Buffer, Close, Frame, MessageKind
from ..base import Connection, PeerLostError
from ..socket_transport import SocketConnection
from .agent import rpc_api, short_error
from .codec import TRANSPORT_NAME, deliver, RPCInbox, inboxes, split_rpc_frame

log = logging.getLogger(__name__)

_WATCHER_JOIN_SECONDS = 1.0


class TorchRPCConnection(Connection):
    """One session's frames, sent as RPC calls to the peer's RPC agent.

    The bootstrap socket stays open next to it: its EOF (or a CLOSE on it) is how each side
    learns at once that the other one is gone.
    """

    #: How long ``close`` waits for frames still in flight (e.g. a CLOSE or a final failure).
    flush_seconds = 1.0
    #: How long an end that closed waits for the other end to leave its RPC world (its
    #: bootstrap EOF) before it leaves its own anyway (see :meth:`_say_goodbye`).
    goodbye_seconds = 2.0

    def __init__(
        self,
        bootstrap: SocketConnection,
        peer: str,
        conn_id: str,
        inbox: RPCInbox,
        rpc_timeout: float,
        on_close: Optional[Callable[["TorchRPCConnection"], None]] = None,
    ):
        self.peer = peer
        self._bootstrap = bootstrap
        self._conn_id = conn_id
        self._inbox = inbox
        self._rpc_timeout = rpc_timeout
        self._on_close = on_close
        self._peer_info: Any = None
        self._send_lock = threading.Lock()
        self._seq = 0
        self._closed = False
        self._in_flight = 0
        self._in_flight_cond = threading.Condition()
        #: The watcher of the bootstrap socket (and, on a worker, the thread joining the world).
        self._tasks = TaskGroup(f"the torch_rpc connection to {peer}")
        self._watcher: Optional[threading.Thread] = None
        self._peer_closing = threading.Event()  # the peer said CLOSE on the bootstrap socket
        self._peer_gone = threading.Event()  # the bootstrap socket ended
        self._lost_before_close = False

    def _start(self, peer_rpc_name: Optional[str]) -> None:
        """Begin sending to ``peer_rpc_name`` and watching the bootstrap socket."""
        if peer_rpc_name is not None:
            self._peer_info = rpc_api().get_worker_info(peer_rpc_name)
        self._watcher = self._tasks.start(f"rpc-watch-{self.peer}", self._watch)

    # -- Connection -------------------------------------------------------------------------------
    def send(self, chunks: Sequence[Buffer]) -> None:
        head, body, buffers = split_rpc_frame(chunks)
        rpc = rpc_api()
        with self._send_lock:
            if self._closed:
                raise PeerLostError(f"connection to {self.peer} is closed")
            if self._inbox.failed:
                raise PeerLostError(f"connection to {self.peer} is lost")
            seq = self._seq
            self._seq += 1
            with self._in_flight_cond:
                self._in_flight += 1
            try:
                future = rpc.rpc_async(
                    self._peer_info, deliver, args=(self._conn_id, seq, head, body, buffers), timeout=self._rpc_timeout
                )
            except Exception as exc:  # noqa: BLE001 - e.g. the agent is gone
                self._sent(None)
                self._lost(f"cannot send to {self.peer}: {exc}")
                raise PeerLostError(f"lost connection to {self.peer} while sending: {exc}") from exc
        future.add_done_callback(self._sent)

    def _sent(self, future: Any) -> None:
        try:
            if future is not None:
                future.value()
        except Exception as exc:  # noqa: BLE001 - any RPC failure means the peer is unreachable
            self._lost(f"a torch RPC call to {self.peer} failed: {short_error(exc)}")
        finally:
            with self._in_flight_cond:
                self._in_flight -= 1
                self._in_flight_cond.notify_all()

    def recv(self, timeout: Optional[float] = None) -> Optional[Frame]:
        return self._inbox.get(timeout)

    def close(self) -> None:
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        self._lost_before_close = self._inbox.failed
        if not self._lost_before_close:  # a lost peer answers nothing more
            self._flush(self.flush_seconds)
        self._inbox.fail(PeerLostError(f"connection to {self.peer} is closed"))
        try:
            self._bootstrap.send(Close(transport=TRANSPORT_NAME).encode())
        except (PeerLostError, OSError):
            pass
        inboxes.pop(self._conn_id, None)
        self._leave()

    def _leave(self) -> None:
        """After ``close``: hand the bootstrap socket to the world (``on_close``), or end it."""
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close(self)
        else:
            self._end()

    def release(self) -> None:
        self._bootstrap.release()

    # -- the end of a connection ----------------------------------------------------------------------
    # TensorPipe warns about every pipe that closes under an agent still in its group, so a
    # clean close is ordered: the trainer says CLOSE but keeps the bootstrap socket open;
    # when its world shuts down it leaves the group, then says goodbye (half-closes the
    # socket); each session, waiting for that, leaves its own group, shuts its agent down and
    # closes the socket; the trainer, having waited for that, shuts its agent down.
    @property
    def awaits_goodbye(self) -> bool:
        """Whether the peer, alive and joined, waits for :meth:`_say_goodbye` to leave its world."""
        return self._watcher is not None and not self._peer_gone.is_set() and not self._lost_before_close

    @property
    def peer_worker_info(self) -> Any:
        """The peer's ``rpc.WorkerInfo`` (name and rank in the world), or None before the join."""
        return self._peer_info

    @property
    def drained(self) -> bool:
        """Whether no call sent on this connection is still waiting for its answer."""
        with self._in_flight_cond:
            return self._in_flight == 0

    def _say_goodbye(self) -> None:
        """Tell the peer (by EOF on the bootstrap socket) that it may leave its RPC world now."""
        try:
            sock = socket.socket(fileno=self._bootstrap.fileno())
        except OSError:
            return
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            sock.detach()

    def _wait_peer_gone(self, timeout: float) -> bool:
        """Wait (bounded) for the peer to close the bootstrap socket; whether it did."""
        return self._peer_gone.wait(max(0.0, timeout))

    def _end(self) -> None:
        """Close the bootstrap socket and stop watching it."""
        self._bootstrap.close()  # wakes the watcher
        self._tasks.join(_WATCHER_JOIN_SECONDS)  # not the watcher itself, if it ends the connection

    # -- internals ----------------------------------------------------------------------------------
    def _flush(self, timeout: float) -> None:
        """Wait (bounded) until every call sent so far was delivered or failed."""
        deadline = time.monotonic() + timeout
        with self._in_flight_cond:
            while self._in_flight > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.debug("closing %s with %d calls still in flight", self.peer, self._in_flight)
                    return
                self._in_flight_cond.wait(remaining)

    def _lost(self, message: str) -> None:
        self._inbox.fail(PeerLostError(message))

    def _watch(self) -> None:
        """Report the peer lost when it says CLOSE on its bootstrap socket, or the socket ends."""
        try:
            while True:
                frame = self._bootstrap.recv(timeout=None)
                if frame is not None and frame.kind == MessageKind.CLOSE:
                    if not self._closed:
                        self._lost(f"{self.peer} closed the session")
                    self._peer_closing.set()  # its EOF follows once it has left its world
        except (PeerLostError, ProtocolError, OSError) as exc:
            if not self._closed and not self._peer_closing.is_set():
                self._lost(f"{self.peer} is gone (its process exited or the connection broke): {exc}")
        finally:
            self._peer_gone.set()
