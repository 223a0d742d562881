"""One session's frames as RPC calls to the peer's agent, next to the bootstrap socket that
tells each side at once when the other one is gone (both ends use it)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional, Sequence

from ...errors import ProtocolError
from ...protocol import Buffer, Frame, MessageKind, encode_control
from ..base import Connection, PeerLostError
from ..socket_transport import SocketConnection
from .agent import _rpc, _short
from .codec import TRANSPORT_NAME, _deliver, _Inbox, _inboxes, _split_frame

log = logging.getLogger(__name__)

_WATCHER_JOIN_SECONDS = 1.0


class TorchRPCConnection(Connection):
    """One session's frames, sent as RPC calls to the peer's RPC agent.

    The bootstrap socket stays open next to it: its EOF (or a CLOSE on it) is how each side
    learns at once that the other one is gone.
    """

    #: How long ``close`` waits for frames still in flight (e.g. a CLOSE or a final ERROR).
    flush_seconds = 1.0

    def __init__(
        self,
        bootstrap: SocketConnection,
        peer: str,
        conn_id: str,
        inbox: _Inbox,
        rpc_timeout: float,
        on_close: Optional[Any] = None,
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
        self._watcher: Optional[threading.Thread] = None

    def _start(self, peer_rpc_name: Optional[str]) -> None:
        """Begin sending to ``peer_rpc_name`` and watching the bootstrap socket."""
        if peer_rpc_name is not None:
            self._peer_info = _rpc().get_worker_info(peer_rpc_name)
        self._watcher = threading.Thread(target=self._watch, name=f"rrs-rpc-watch-{self.peer}", daemon=True)
        self._watcher.start()

    # -- Connection -------------------------------------------------------------------------------
    def set_max_frame_bytes(self, max_frame_bytes: int) -> None:
        self._inbox.max_frame_bytes = max_frame_bytes

    def send(self, chunks: Sequence[Buffer]) -> None:
        head, body, buffers = _split_frame(chunks)
        rpc = _rpc()
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
                    self._peer_info, _deliver, args=(self._conn_id, seq, head, body, buffers), timeout=self._rpc_timeout
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
            self._lost(f"a torch RPC call to {self.peer} failed: {_short(exc)}")
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
        if not self._inbox.failed:  # a lost peer answers nothing more
            self._flush(self.flush_seconds)
        self._inbox.fail(PeerLostError(f"connection to {self.peer} is closed"))
        try:
            self._bootstrap.send(encode_control(MessageKind.CLOSE, {"transport": TRANSPORT_NAME}))
        except (PeerLostError, OSError):
            pass
        self._bootstrap.close()  # wakes the watcher
        _inboxes.pop(self._conn_id, None)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(_WATCHER_JOIN_SECONDS)
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def release(self) -> None:
        self._bootstrap.release()

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
        """Report the peer lost when its bootstrap socket ends (or says CLOSE)."""
        try:
            while True:
                frame = self._bootstrap.recv(timeout=None)
                if frame is not None and frame.kind == MessageKind.CLOSE:
                    if not self._closed:
                        self._lost(f"{self.peer} closed the session")
                    return
        except (PeerLostError, ProtocolError, OSError) as exc:
            if not self._closed:
                self._lost(f"{self.peer} is gone (its process exited or the connection broke): {exc}")
