"""``TorchRPCTransport``: the trainer's ``connect`` (socket handshake, then the rendezvous that has
the session join this process's world) and the worker server's ``listen``."""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Optional

from ...addresses import format_address, is_loopback_host
from ...errors import ConfigurationError, RemoteProtocolError, WorkerRefusedError
from ...protocol import Join, MessageKind, Ready, SetupRefused, decode_reject
from ..base import PROBE_SECONDS, Allocator, PeerLostError, Transport
from ..socket_transport import SocketConnection, SocketTransport
from .agent import rpc_api
from .codec import BOOTSTRAP_VERSION, TRANSPORT_NAME, RPCInbox, inboxes
from .connection import TorchRPCConnection
from .interfaces import local_interface_address
from .session import TorchRPCListener
from .world import RPCWorld, acquire_world, check_no_foreign_agent, release_world

log = logging.getLogger(__name__)


class TorchRPCTransport(Transport):
    """Frames as torch.distributed.rpc calls (TensorPipe), bootstrapped over an authenticated socket.

    Args:
        rpc_timeout: Seconds an RPC call (one frame) may take before the peer counts as lost.
        trainer_threads: RPC worker threads of the trainer's agent.
        session_threads: RPC worker threads of each session's agent.
        socket_options: Options of the bootstrap socket, as for the socket transport:
            ``max_frame_bytes`` (which also bounds RPC frames). TLS options are refused:
            TensorPipe cannot encrypt, so TLS on the bootstrap alone would only pretend to.
    """

    name = TRANSPORT_NAME
    supports_fork = True

    def __init__(
        self,
        rpc_timeout: float = 60.0,
        trainer_threads: int = 8,
        session_threads: int = 4,
        **socket_options: Any,
    ):
        rpc_api()
        tls = sorted(k for k, v in socket_options.items() if k.startswith("tls_") and v is not None)
        if tls:
            raise ConfigurationError(
                f"transport 'torch_rpc' cannot use TLS ({', '.join(tls)}): torch RPC (TensorPipe) sends everything "
                "unencrypted. Use transport='socket' for TLS, or a trusted network / VPN for torch_rpc"
            )
        if rpc_timeout <= 0:
            raise ConfigurationError(f"rpc_timeout must be positive, got {rpc_timeout}")
        self.rpc_timeout = rpc_timeout
        self.trainer_threads = trainer_threads
        self.session_threads = session_threads
        # Items travel over torch RPC; the bootstrap socket carries control frames only.
        self._socket = SocketTransport(**{**socket_options, "shared_memory": False})
        self.max_frame_bytes = self._socket.max_frame_bytes

    def probe(self, address: str, timeout: float = PROBE_SECONDS) -> Optional[str]:
        return self._socket.probe(address, timeout)  # the bootstrap socket answers as a socket server's

    def listen(self, host: str, port: int, auth_key: bytes, handshake_timeout: float = 10.0) -> TorchRPCListener:
        return TorchRPCListener(self._socket.listen(host, port, auth_key, handshake_timeout), self.max_frame_bytes)

    def connect(
        self,
        address: str,
        auth_key: bytes,
        timeout: float,
        allocate: Optional[Allocator] = None,
    ) -> TorchRPCConnection:
        deadline = time.monotonic() + timeout
        check_no_foreign_agent()
        bootstrap = self._socket.connect(address, auth_key, timeout)
        try:
            local_host = local_interface_address(bootstrap)
            world = acquire_world(is_loopback_host(local_host), local_host, self.rpc_timeout, self.trainer_threads)
        except BaseException:
            bootstrap.close()
            raise
        inbox = RPCInbox(self.max_frame_bytes, allocate)
        conn_id = secrets.token_hex(16)
        conn = TorchRPCConnection(
            bootstrap, address, conn_id, inbox, self.rpc_timeout, on_close=lambda closed: release_world(world, closed)
        )
        try:
            if not world.join_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise PeerLostError(
                    f"torch RPC rendezvous with worker at {address} did not start within {timeout:.1f} s: "
                    "other sessions of this trainer were still joining"
                )
            try:
                session_name = self._rendezvous(world, bootstrap, address, local_host, conn_id, inbox, deadline, timeout)
            finally:
                world.join_lock.release()
            conn._start(session_name)
        except BaseException:
            inboxes.pop(conn_id, None)
            conn.close()
            raise
        return conn

    def _rendezvous(
        self,
        world: RPCWorld,
        bootstrap: SocketConnection,
        address: str,
        local_host: str,
        conn_id: str,
        inbox: RPCInbox,
        deadline: float,
        timeout: float,
    ) -> str:
        """Have the session join ``world``; returns its RPC name (called with ``world.join_lock`` held).

        ``local_host`` is this end's address on the bootstrap connection: the session reached
        this host there, so that is where it finds the rendezvous store (a trainer on several
        networks has a different one per network).
        """
        rank, name = world.next_member()
        world.prepare_join()
        inboxes[conn_id] = inbox
        remaining = deadline - time.monotonic()
        request = Join(
            transport=TRANSPORT_NAME,
            bootstrap_version=BOOTSTRAP_VERSION,
            init_method=world.init_method_for(local_host),
            rank=rank,
            name=name,
            trainer_name=world.name,
            conn_id=conn_id,
            # The session must finish (or give up) before this trainer stops waiting.
            join_timeout=max(0.5, remaining * 0.9 - 0.2),
            rpc_timeout=self.rpc_timeout,
            num_worker_threads=self.session_threads,
            transports=world.transports,
            channels=world.channels,
            # Checked by the session before it joins: TensorPipe aborts a process that cannot reach it.
            tensorpipe_address=world.tensorpipe_address and format_address(*world.tensorpipe_address),
            store_prefix_index=world.store_prefix_index,
        )
        bootstrap.send(request.encode())
        frame = None
        try:
            while frame is None or frame.kind == MessageKind.HEARTBEAT:
                remaining = deadline - time.monotonic()
                frame = bootstrap.recv(timeout=remaining) if remaining > 0 else None
                if frame is None and remaining <= 0:
                    break
        except PeerLostError as exc:
            world.abandon(name)
            raise PeerLostError(
                f"worker at {address} closed the connection during the torch_rpc rendezvous ({exc}); is it an "
                "rpc-reading-worker started with --transport torch_rpc?"
            ) from exc
        if frame is None:
            world.abandon(name)
            raise PeerLostError(
                f"torch RPC rendezvous with worker at {address} did not complete within {timeout:.1f} s: its "
                f"session must reach this trainer's rendezvous store at {request.init_method} and the "
                "trainer's TensorPipe ports (set TP_SOCKET_IFNAME to pick the interface); see docs/transports.md"
            )
        if frame.kind == MessageKind.REJECT:
            world.abandon(name)
            raise WorkerRefusedError(f"worker at {address} refused the session: {decode_reject(frame)}")
        reply = {MessageKind.READY: Ready, MessageKind.SETUP_REFUSED: SetupRefused}.get(frame.kind)
        try:
            answer = reply.decode(frame) if reply is not None else None
        except RemoteProtocolError:
            world.abandon(name)
            raise
        if answer is None or answer.transport != TRANSPORT_NAME:
            world.abandon(name)
            raise ConfigurationError(
                f"the worker at {address} does not speak torch_rpc: it answered the torch RPC rendezvous with "
                f"{frame.kind.name}, as a server started with another --transport (probably socket) does. Start it "
                "with `rpc-reading-worker --transport torch_rpc`, or use transport='socket' in the trainer"
            )
        if isinstance(answer, SetupRefused):
            world.abandon(name)
            message = f"worker at {address} could not join the torch RPC world: {answer.message}"
            if answer.reason == "join":
                raise PeerLostError(message)
            raise ConfigurationError(message)
        log.info("worker at %s joined torch RPC world %s as %s", address, world.name, name)
        return name
