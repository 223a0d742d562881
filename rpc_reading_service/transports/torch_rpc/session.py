"""The worker server's end: the listener, and the session connection that joins its trainer's
RPC world on its first ``recv``, inside the forked session process."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from typing import Any, Dict, NoReturn, Optional, Sequence

from ...addresses import parse_address
from ...version import __version__
from ...errors import ProtocolError, RemoteProtocolError
from ...protocol import Buffer, Frame, Join, MessageKind, Ready, SetupRefused, decode_setup
from ..base import Connection, PeerLostError, WrappingListener
from ..socket_transport import SocketConnection, SocketListener
from .agent import agent_exists, current_agent_name, leave_group, rpc_api, short_error, shutdown_agent
from .codec import BOOTSTRAP_VERSION, TRANSPORT_NAME, RPCInbox, inboxes
from .connection import TorchRPCConnection
from .interfaces import local_interface_address, pin_tensorpipe_interface

log = logging.getLogger(__name__)

_session_agent_owner: Optional["_SessionConnection"] = None


@atexit.register
def _shutdown_session_agent_at_exit() -> None:
    # An RPC agent still alive when the interpreter exits aborts the process.
    session = _session_agent_owner
    if session is not None:
        session._shutdown_agent()


class _SessionConnection(TorchRPCConnection):
    """The worker's end. Joins the trainer's world on the first ``recv``, in the session process."""

    flush_seconds = 2.0  # a session's last frame may be the failure that explains its end

    def __init__(self, bootstrap: SocketConnection, max_frame_bytes: int):
        super().__init__(bootstrap, bootstrap.peer, "", RPCInbox(max_frame_bytes), rpc_timeout=60.0)
        self._bootstrapped = False
        self._owns_agent = False
        self._abandoned = False

    def send(self, chunks: Sequence[Buffer]) -> None:
        if not self._bootstrapped:
            raise PeerLostError(f"torch_rpc session with {self.peer} has not joined its RPC world yet")
        super().send(chunks)

    def recv(self, timeout: Optional[float] = None) -> Optional[Frame]:
        if not self._bootstrapped:
            deadline = None if timeout is None else time.monotonic() + timeout
            if not self._bootstrap_session(timeout):
                return None
            timeout = None if deadline is None else max(1.0, deadline - time.monotonic())
        return super().recv(timeout)

    def close(self) -> None:
        if not self._bootstrapped:
            with self._send_lock:
                self._closed = True
            self._bootstrap.close()
            return
        super().close()

    def refuse(self, reason: str, linger: float = 0.0) -> None:
        if self._bootstrapped:
            super().refuse(reason, linger)
            return
        with self._send_lock:
            self._closed = True
        self._bootstrap.refuse(reason, linger)

    def _leave(self) -> None:
        # Wait for the trainer's goodbye: its world has left its group and answered every
        # call of ours, so neither side's TensorPipe warns about the pipes closing.
        self._wait_peer_gone(self.goodbye_seconds)
        trainer_there = self._peer_closing.is_set() or not self._peer_gone.is_set()
        self._shutdown_agent(leave_group=trainer_there and self.drained)
        self._end()

    def shutdown_agent(self, leave_group: bool = False) -> None:
        global _session_agent_owner
        if not self._owns_agent:
            return
        self._owns_agent = False
        if _session_agent_owner is self:
            _session_agent_owner = None
        try:
            if leave_group:
                leave_group()
            shutdown_agent()
        except Exception as exc:  # noqa: BLE001
            log.debug("torch RPC shutdown failed: %s", exc)

    # -- bootstrap ------------------------------------------------------------------------------------
    def _refuse(self, message: str, reason: str) -> NoReturn:
        """Answer the rendezvous with a SETUP_REFUSED saying why (``reason``: one of ``SetupRefused.REASONS``)."""
        refusal = SetupRefused(reason, message, TRANSPORT_NAME)
        try:
            self._bootstrap.send(refusal.encode())
        except (PeerLostError, OSError):
            pass
        self._bootstrap.close()
        log.warning("torch_rpc session with %s refused: %s", self.peer, message)
        raise PeerLostError(message)

    def _read_join(self, frame: Frame) -> Join:
        """The trainer's rendezvous request, or a refusal saying what the trainer sent instead."""
        try:
            request = decode_setup(frame) if frame.kind == MessageKind.SETUP else None
        except RemoteProtocolError as exc:
            self._refuse(f"malformed torch_rpc rendezvous request from {self.peer}: {exc}", "config")
        if not isinstance(request, Join) or request.transport != TRANSPORT_NAME:
            self._refuse(
                f"this worker server runs transport 'torch_rpc', but the trainer at {self.peer} uses another one "
                f"(it sent {frame.kind.name} instead of the torch_rpc rendezvous). Pass transport='torch_rpc' to "
                "RPCReadingService, or start the worker with --transport socket",
                "transport",
            )
        if request.bootstrap_version != BOOTSTRAP_VERSION:
            self._refuse(
                f"the trainer's torch_rpc bootstrap version {request.bootstrap_version} differs from this "
                f"worker's {BOOTSTRAP_VERSION}: install the same rpc_reading_service version on both",
                "config",
            )
        return request

    def _bootstrap_session(self, timeout: Optional[float]) -> bool:
        frame = self._bootstrap.recv(timeout=timeout)
        if frame is None:
            return False
        request = self._read_join(frame)
        if agent_exists():
            self._refuse(
                f"this worker process already belongs to a torch RPC world (agent {current_agent_name()!r}): "
                "a process can join only one. Start the worker server with --session-mode fork (the default "
                "for torch_rpc), which gives every session its own process",
                "config",
            )
        self._conn_id = request.conn_id
        self._rpc_timeout = request.rpc_timeout
        join_timeout = request.join_timeout
        inboxes[self._conn_id] = self._inbox
        if request.transports is None:  # a remote world: TCP, on the interface the trainer reached
            pin_tensorpipe_interface(local_interface_address(self._bootstrap))
            self._check_tensorpipe_reachable(request, join_timeout)
        outcome: Dict[str, Any] = {}
        done = threading.Event()
        # A daemon: the join may stay stuck in torch's C++ rendezvous (then abandoned).
        self._tasks.start(f"rpc-join {self.peer}", self._join, request, outcome, done)
        deadline = time.monotonic() + join_timeout
        while not done.wait(0.002):
            # The trainer says nothing while we join; its EOF or CLOSE means it gave up.
            try:
                early = self._bootstrap.recv(timeout=0.008)
            except (PeerLostError, ProtocolError, OSError) as exc:
                early, outcome["gone"] = None, exc
            if early is not None or "gone" in outcome:
                self._abandon_join()
                inboxes.pop(self._conn_id, None)
                raise PeerLostError(f"trainer {self.peer} gave up while this session joined its torch RPC world")
            if time.monotonic() >= deadline:
                break
        if "error" in outcome or not done.is_set():
            self._abandon_join()
            inboxes.pop(self._conn_id, None)
            error = outcome.get("error")
            self._refuse(
                f"could not join the trainer's torch RPC world at {request.init_method} within "
                f"{join_timeout:.1f} s: {short_error(error) if error else 'timed out'}. This worker host must reach the "
                "trainer's rendezvous port and its TensorPipe ports (see TP_SOCKET_IFNAME)",
                "join",
            )
        self._bootstrapped = True
        self._start(None)  # the joiner looked the trainer up
        self._bootstrap.send(Ready(os.getpid(), socket.gethostname(), __version__, transport=TRANSPORT_NAME).encode())
        log.info("session for %s joined torch RPC world as %s", self.peer, request.name)
        return True

    def _check_tensorpipe_reachable(self, request: Join, join_timeout: float) -> None:
        """Refuse, with what to do, when this host cannot reach the trainer's TensorPipe address.

        TensorPipe aborts the whole process (``std::terminate``) on "network is unreachable",
        which a trainer on several networks causes: torch listens on one address per process.
        The probe dials the rendezvous store's port on that address (the store listens on
        every interface of a remote world), so TensorPipe itself sees no stray connection.
        """
        tensorpipe = request.tensorpipe_address
        if not tensorpipe:
            return
        host, _port = parse_address(str(tensorpipe))
        _store_host, store_port = parse_address(request.init_method[len("tcp://") :])
        try:
            socket.create_connection((host, store_port), timeout=max(0.5, min(5.0, join_timeout / 3))).close()
        except OSError as exc:
            inboxes.pop(self._conn_id, None)
            self._refuse(
                f"this worker host cannot reach the trainer's torch RPC (TensorPipe) address {tensorpipe} ({exc}). "
                f"TensorPipe listens on one address per trainer process ({host}: on the network of its first "
                "torch_rpc worker, or TP_SOCKET_IFNAME's), and every worker host must reach it. Route this "
                "host's network to it, set TP_SOCKET_IFNAME in the trainer to an interface every worker host "
                "reaches, or use transport='socket', which serves workers on any network",
                "join",
            )

    def _join(self, request: Join, outcome: Dict[str, Any], done: threading.Event) -> None:
        global _session_agent_owner
        try:
            rpc = rpc_api()
            options = rpc.TensorPipeRpcBackendOptions(
                init_method=request.init_method,
                rpc_timeout=request.join_timeout,
                num_worker_threads=request.num_worker_threads,
                _transports=request.transports,
                _channels=request.channels,
            )
            with rpc._init_counter_lock:  # noqa: SLF001 - see _World: the trainer's store namespace
                rpc._init_counter = request.store_prefix_index  # noqa: SLF001
            rpc.init_rpc(request.name, rank=request.rank, world_size=None, rpc_backend_options=options)
            with self._send_lock:
                self._owns_agent = True
                _session_agent_owner = self
                abandoned = self._abandoned
            if abandoned:  # joined after giving up (thread mode): leave at once
                self._shutdown_agent()
            else:
                self._peer_info = rpc.get_worker_info(request.trainer_name)
        except BaseException as exc:  # noqa: BLE001 - reported to the trainer
            outcome["error"] = exc
        finally:
            done.set()

    def _abandon_join(self) -> None:
        with self._send_lock:
            self._abandoned = True
            owns = self._owns_agent
        if owns:
            self._shutdown_agent()


class TorchRPCListener(WrappingListener):
    """The socket listener of the worker server; sessions join RPC worlds after the fork."""

    def __init__(self, inner: SocketListener, max_frame_bytes: int):
        super().__init__(inner)
        self._max_frame_bytes = max_frame_bytes

    def wrap(self, conn: Connection) -> Connection:
        return _SessionConnection(conn, self._max_frame_bytes)

    @property
    def refused_handshakes(self) -> int:
        """Handshakes the socket listener underneath refused (bad key, garbage, too many at once)."""
        return self._inner.refused_handshakes
