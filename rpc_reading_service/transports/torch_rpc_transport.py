"""``transport="torch_rpc"``: frames move as torch.distributed.rpc calls (TensorPipe backend).

Design
======

torch RPC has one agent per process, and its worlds are closed: an agent joins one world
when it is created and never another. Trainers and worker servers, on the other hand, open
and close sessions at any time. This module reconciles the two like this.

Bootstrap over the authenticated socket
    A session starts exactly like a socket-transport session: TCP connection to the worker
    server and the HMAC challenge-response of :mod:`~rpc_reading_service.protocol` (so
    nothing is unpickled before both sides proved the key). That socket then carries the
    rendezvous: the trainer sends a SETUP control frame ``{"transport": "torch_rpc",
    "init_method": "tcp://TRAINER_HOST:PORT", "rank": r, "name": ..., ...}``, the session
    joins the trainer's RPC world and answers READY (or ERROR). From then on the socket
    carries no data; it stays open as the session's liveness and close signal: its EOF
    means the peer process is gone, which surfaces at once as :class:`PeerLostError` from
    :meth:`Connection.recv` (and as ``WorkerLostError`` in the reading service) instead of
    waiting for a TensorPipe timeout.

One RPC world per trainer process, growing and shrinking
    The trainer process owns one *dynamic* RPC world (``init_rpc(world_size=None)``, rank
    0, named ``rrs_trainer_<id>``). It is created on the first ``connect`` and shut down
    (``rpc.shutdown(graceful=False)``, bounded) when its last connection closes; every
    connection made while it is open (several reading services, any number of sessions per
    worker server) joins the same world with a fresh rank. The rendezvous store is a
    ``TCPStore`` that the trainer hosts on a free port; the trainer binds it itself (on
    127.0.0.1 when the workers are reached over loopback, on all interfaces otherwise).
    Joins are serialised by the trainer, and before each one the trainer resets the
    world's member list in the store to itself only, so a joining session only ever talks
    to the trainer: sessions never need to reach each other, and a session that has
    exited (or crashed) can never stall a later join (torch's own dynamic join contacts
    every listed member and deadlocks until its store timeout if one is gone).

Sessions join from their own process
    A worker server never joins a world itself. ``supports_fork`` is true: the server
    accepts and authenticates the socket, forks the session process, and the connection
    bootstraps lazily on its first ``recv`` *inside the session process*, which calls
    ``init_rpc`` itself. So every session is its own RPC process, joined to its trainer's
    world; sessions of different trainers live in different worlds, and a session that
    crashes takes only itself down. With ``--session-mode thread`` a server process can
    hold one agent at a time: a second concurrent session is refused with a clear error.

Frames as RPC calls
    ``send`` splits the encoded frame into its header, body and out-of-band buffers and
    calls ``rpc.rpc_async(peer, _deliver, args=(conn_id, seq, header, body, buffers))``.
    Large bodies and all buffers travel as uint8 CPU tensors (TensorPipe moves tensor
    storage outside the pickle stream); they are copied once into fresh tensors at send
    time, so, as with a socket, the caller may reuse its memory when ``send`` returns.
    ``_deliver`` runs on the receiver's RPC thread pool, checks the header (magic,
    protocol version, kind, sizes) and puts the frame into the connection's inbox, which
    restores the send order by sequence number (RPC handlers may run out of order). A
    failed call (peer gone, RPC timeout) marks the connection lost.

CUDA tensors never cross as CUDA tensors
    A frame is bytes and CPU tensors only: items are pickled by the session before the
    transport sees them, and the item pickler copies tensors on other devices to the CPU
    first, as the graphlearn-for-pytorch maintainers do for torch RPC. No device
    maps are configured or needed; the trainer moves batches to its GPU itself.

Timeouts and errors
    ``connect(timeout)`` bounds everything: socket handshake, waiting for the join slot,
    and the session's ``init_rpc`` (which gets the remaining time as its RPC/store
    timeout). A rendezvous that does not finish in time raises :class:`PeerLostError`
    (the reading service's ``WorkerLostError``) naming the store address and the ports
    that must be open. A worker started with another transport answers the bootstrap like
    a socket server, and a socket trainer talking to a torch_rpc worker gets an ERROR
    reply: both are a :class:`~rpc_reading_service.errors.ConfigurationError` /
    ``WorkerStartupError`` saying which ``--transport`` to use, never a hang. If the
    trainer process already runs its own ``rpc.init_rpc`` agent, ``connect`` raises
    ``ConfigurationError`` at once (a process cannot be in two RPC worlds). Shutdown waits
    at most ~1-2 s for in-flight calls, then ``rpc.shutdown(graceful=False)``.

Interfaces
    TensorPipe listens where the host name resolves, often 127.0.1.1. Unless
    ``TP_SOCKET_IFNAME`` is set, remote worlds pin it (trainer and session alike) to the
    interface of their end of the bootstrap connection, which the peer is known to reach
    (torch reads the variable once per process). A world is either loopback (shared
    memory) or remote (TCP), so a trainer process serves loopback and remote workers one
    kind at a time (a clear error otherwise).

Security
    The auth key guards the bootstrap only. torch RPC itself has no authentication: anyone
    who can reach an RPC process's TensorPipe listener, or the trainer's rendezvous store,
    while the world is open can run code in it. Loopback worlds therefore use TensorPipe's
    shared-memory transport only (no TCP listener at all) and bind the store to 127.0.0.1;
    remote worlds must run on a trusted network (as ``torch.distributed`` in general).
    TensorPipe cannot encrypt, so TLS options are refused rather than applied to the
    bootstrap alone.

Private torch details relied on (checked against torch 2.13; each degrades to an error,
never a hang): the dynamic group's member list ``names/_ALL_WORKER_INFOS`` and join token
``RpcGroupManagementToken`` in the store, ``rpc._init_counter`` (the store namespace), and
``TCPStore(master_listen_fd=..., multi_tenant=True)`` being found again by ``init_rpc``.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from .. import __version__
from ..addresses import format_address, is_loopback_host
from ..errors import ConfigurationError, FrameTooLargeError, ProtocolError, WorkerRefusedError
from ..protocol import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    Buffer,
    Frame,
    MessageKind,
    decode_control,
    decode_reject,
    encode_control,
)
from .base import Allocator, Connection, PeerLostError, Transport, WrappingListener
from .socket_transport import SocketConnection, SocketListener, SocketTransport

__all__ = ["TorchRPCTransport", "TorchRPCConnection", "TorchRPCListener"]

log = logging.getLogger(__name__)

TRANSPORT_NAME = "torch_rpc"
#: Bootstrap protocol of this transport (inside SETUP/READY/ERROR control frames).
BOOTSTRAP_VERSION = 1
#: Bodies at least this large travel as a tensor (outside the RPC pickle stream).
_TENSOR_BODY_MIN_BYTES = 64 * 1024
_LENGTH = struct.Struct("!Q")
_WATCHER_JOIN_SECONDS = 1.0
# torch keeps the dynamic group's member list in the world's store under this key
# (torch/csrc/distributed/rpc/agent_utils.cpp, "names" prefix); see _World.prepare_join.
_MEMBER_LIST_PREFIX = "names"
_MEMBER_LIST_KEY = "_ALL_WORKER_INFOS"
_GROUP_TOKEN_KEY = "RpcGroupManagementToken"

TensorOrBytes = Union[bytes, torch.Tensor]


def _rpc() -> Any:
    """``torch.distributed.rpc``, imported on first use (a worker server never needs it)."""
    import torch.distributed.rpc as rpc

    if not rpc.is_available():  # pragma: no cover - builds without distributed support
        raise ConfigurationError(
            "transport 'torch_rpc' needs torch.distributed.rpc, which this torch build lacks; use transport='socket'"
        )
    return rpc


def _agent_exists() -> bool:
    rpc = _rpc()
    return bool(rpc._is_current_rpc_agent_set())  # noqa: SLF001 - the only way to ask without raising


def _current_agent_name() -> str:
    try:
        return _rpc().get_worker_info().name
    except Exception:  # noqa: BLE001
        return "?"


# -- frames <-> RPC arguments ---------------------------------------------------------------------
class _ChunkCursor:
    """Reads a frame's chunks (``protocol.encode_frame`` output) as one byte stream."""

    def __init__(self, chunks: Sequence[Buffer]):
        self._views: Deque[memoryview] = collections.deque()
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if view.nbytes:
                self._views.append(view)

    def parts(self, nbytes: int) -> List[memoryview]:
        """The next ``nbytes`` bytes, as views of the caller's memory."""
        parts = []
        while nbytes:
            if not self._views:
                raise ProtocolError("frame chunks are shorter than the frame header announces")
            view = self._views[0]
            if view.nbytes <= nbytes:
                parts.append(self._views.popleft())
                nbytes -= view.nbytes
            else:
                parts.append(view[:nbytes])
                self._views[0] = view[nbytes:]
                nbytes = 0
        return parts

    def take_bytes(self, nbytes: int) -> bytes:
        return b"".join(self.parts(nbytes))

    def take_tensor(self, nbytes: int) -> torch.Tensor:
        """Copy the next ``nbytes`` into a fresh uint8 CPU tensor (the caller may reuse its memory)."""
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            target = memoryview(tensor.numpy()).cast("B")
            offset = 0
            for part in self.parts(nbytes):
                target[offset : offset + part.nbytes] = part
                offset += part.nbytes
        return tensor

    @property
    def exhausted(self) -> bool:
        return not self._views


def _split_frame(chunks: Sequence[Buffer]) -> Tuple[bytes, TensorOrBytes, List[torch.Tensor]]:
    """Turn an encoded frame into ``(header_and_lengths, body, buffers)`` for an RPC call."""
    cursor = _ChunkCursor(chunks)
    head = cursor.take_bytes(HEADER.size)
    _magic, _version, _kind, n_buffers, body_length = HEADER.unpack(head)
    lengths_raw = cursor.take_bytes(_LENGTH.size * n_buffers)
    lengths = struct.unpack(f"!{n_buffers}Q", lengths_raw) if n_buffers else ()
    body: TensorOrBytes
    if body_length >= _TENSOR_BODY_MIN_BYTES:
        body = cursor.take_tensor(body_length)
    else:
        body = cursor.take_bytes(body_length)
    buffers = [cursor.take_tensor(length) for length in lengths]
    if not cursor.exhausted:
        raise ProtocolError("frame chunks are longer than the frame header announces")
    return head + lengths_raw, body, buffers


def _memory_of(tensor: torch.Tensor, allocate: Optional[Allocator]) -> Buffer:
    """Writable memory holding a received uint8 tensor's bytes (no copy without ``allocate``)."""
    view = memoryview(tensor.contiguous().numpy()).cast("B")
    if allocate is None or allocate is bytearray:  # the tensor's own memory is as good
        return view
    target = allocate(view.nbytes)
    memoryview(target).cast("B")[:] = view
    return target


def _join_frame(
    head: bytes,
    body: TensorOrBytes,
    buffers: Sequence[torch.Tensor],
    max_frame_bytes: int,
    allocate: Optional[Allocator],
) -> Frame:
    """Check a delivered frame against its header and rebuild it (the inverse of :func:`_split_frame`)."""
    if not isinstance(head, bytes) or len(head) < HEADER.size:
        raise ProtocolError("torch_rpc frame without a valid header")
    magic, version, kind, n_buffers, body_length = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise ProtocolError(f"not an rpc_reading_service frame (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version mismatch: the peer speaks rpc_reading_service protocol version {version}, "
            f"this process (rpc_reading_service {__version__}) speaks version {PROTOCOL_VERSION}. Install "
            "the same rpc_reading_service version on the trainer and on every worker"
        )
    try:
        kind = MessageKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind}") from None
    if len(head) != HEADER.size + _LENGTH.size * n_buffers or len(buffers) != n_buffers:
        raise ProtocolError(f"{kind.name} frame: header announces {n_buffers} buffers, got {len(buffers)}")
    lengths = struct.unpack_from(f"!{n_buffers}Q", head, HEADER.size) if n_buffers else ()
    body_bytes = body.numel() if isinstance(body, torch.Tensor) else len(body)
    if body_bytes != body_length or any(
        not isinstance(b, torch.Tensor) or b.dtype != torch.uint8 or b.numel() != n for b, n in zip(buffers, lengths)
    ):
        raise ProtocolError(f"{kind.name} frame does not match the sizes its header announces")
    total = body_length + sum(lengths)
    if total > max_frame_bytes:
        raise FrameTooLargeError(
            f"peer sent a {kind.name} frame of {total} bytes, over the maximum of {max_frame_bytes} bytes "
            "(torch RPC delivers whole messages, so it was dropped after receipt)"
        )
    body_memory: Buffer = _memory_of(body, None) if isinstance(body, torch.Tensor) else body
    return Frame(kind, body_memory, [_memory_of(b, allocate) for b in buffers])


class _Inbox:
    """Frames delivered to one connection, handed out in send order."""

    def __init__(self, max_frame_bytes: int, allocate: Optional[Allocator] = None):
        self.max_frame_bytes = max_frame_bytes
        self.allocate = allocate
        self._cond = threading.Condition()
        self._expected = 0
        self._early: Dict[int, Frame] = {}
        self._ready: Deque[Frame] = collections.deque()
        self._error: Optional[BaseException] = None

    def put(self, seq: int, frame: Frame) -> None:
        with self._cond:
            if seq < self._expected or seq in self._early:
                return  # a duplicate: cannot happen with TensorPipe, but never deliver twice
            self._early[seq] = frame
            while self._expected in self._early:
                self._ready.append(self._early.pop(self._expected))
                self._expected += 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Report ``error`` from ``get`` once the frames already in order are taken (first error wins)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def get(self, timeout: Optional[float]) -> Optional[Frame]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._ready:
                    return self._ready.popleft()
                if self._error is not None:
                    raise self._error
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)


# Every connection of this process, by the id both ends agreed on in the bootstrap.
_inboxes: Dict[str, _Inbox] = {}


def _deliver(conn_id: str, seq: int, head: bytes, body: TensorOrBytes, buffers: List[torch.Tensor]) -> bool:
    """The RPC target: runs on the receiver's RPC thread pool; never blocks, never raises."""
    inbox = _inboxes.get(conn_id)
    if inbox is None:
        return False  # the connection is closed (or never existed here)
    try:
        frame = _join_frame(head, body, buffers, inbox.max_frame_bytes, inbox.allocate)
    except ProtocolError as exc:
        inbox.fail(exc)
        return False
    except Exception as exc:  # noqa: BLE001 - never let a handler error travel back as a remote exception
        inbox.fail(ProtocolError(f"could not rebuild a delivered frame: {exc!r}"))
        return False
    inbox.put(seq, frame)
    return True


# -- the connection (both ends) -------------------------------------------------------------------
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


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# -- the trainer's world -----------------------------------------------------------------------------
class _World:
    """The trainer process's RPC world: rank 0, a rendezvous store, sessions joining one at a time."""

    def __init__(self, loopback: bool, advertise_host: str, rpc_timeout: float, num_worker_threads: int):
        import torch.distributed as dist

        rpc = _rpc()
        self.loopback = loopback
        self.advertise_host = advertise_host = "127.0.0.1" if loopback else advertise_host
        self.rpc_timeout = rpc_timeout
        self.id = secrets.token_hex(4)
        # No "-" in RPC names: torch's member list is "name-rank," and splits on "-".
        self.name = f"rrs_trainer_{self.id}"
        self.refs = 0
        self.join_lock = threading.Lock()
        self._next_rank = 1
        self._abandoned: Set[str] = set()
        # Loopback: shared memory only, no TCP listener; else TensorPipe's defaults.
        if loopback and sys.platform.startswith("linux"):
            self.transports: Optional[List[str]] = ["shm"]
            self.channels: Optional[List[str]] = ["basic"]
        else:
            self.transports = self.channels = None
            _pin_tensorpipe_interface(advertise_host)
        bind_host = "127.0.0.1" if loopback else ("::" if ":" in advertise_host else "0.0.0.0")
        listener = socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((bind_host, 0))
            listener.listen(128)
            self.port = listener.getsockname()[1]
            # The store takes over the listening socket; init_rpc below finds it by port
            # (multi_tenant), so the bind address is ours to choose.
            self._store = dist.TCPStore(
                advertise_host, self.port, None, True, timedelta(seconds=rpc_timeout),
                wait_for_workers=False, multi_tenant=True, master_listen_fd=listener.fileno(), use_libuv=True,
            )  # fmt: skip
            listener.detach()
        except BaseException:
            listener.close()
            raise
        self.init_method = f"tcp://{format_address(advertise_host, self.port)}"
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=self.init_method,
            rpc_timeout=rpc_timeout,
            num_worker_threads=num_worker_threads,
            _transports=self.transports,
            _channels=self.channels,
        )
        # init_rpc namespaces the store by a per-process counter ("rpc_prefix_<n>"). A session
        # process counts its own inits, so the trainer starts every world at 0 (each world has
        # a fresh store, nothing can collide) and tells sessions the value to use.
        with rpc._init_counter_lock:  # noqa: SLF001
            rpc._init_counter = 0  # noqa: SLF001
        self.store_prefix_index = 0
        try:
            rpc.init_rpc(self.name, rank=0, world_size=None, rpc_backend_options=options)
        except BaseException:
            self._store = None
            raise
        agent = rpc.api._get_current_rpc_agent()  # noqa: SLF001
        self._members = dist.PrefixStore(_MEMBER_LIST_PREFIX, agent.store)
        self._group_store = agent.store
        self._own_entry = f"{self.name}-0,"
        try:
            self._can_reset = self._members.get(_MEMBER_LIST_KEY).decode() == self._own_entry
        except Exception:  # noqa: BLE001 - another torch layout: fall back to torch's own joins
            self._can_reset = False
        if not self._can_reset:
            log.debug("torch RPC member list not found in the store; joins will contact every member")
        log.info("torch RPC world %s open, rendezvous %s", self.name, self.init_method)

    def next_member(self) -> Tuple[int, str]:
        rank = self._next_rank
        self._next_rank += 1
        return rank, f"rrs_session_{self.id}_{rank}"

    def prepare_join(self) -> None:
        """Make the next join contact the trainer only (called with ``join_lock`` held)."""
        for name in list(self._abandoned):
            self._release_token(name)
        if self._can_reset:
            self._members.set(_MEMBER_LIST_KEY, self._own_entry)

    def abandon(self, name: str) -> None:
        """A session gave up (or was given up on) while joining: free the join token it may hold."""
        self._abandoned.add(name)
        self._release_token(name)

    def _release_token(self, name: str) -> None:
        # compare_set swaps only if the abandoned joiner still holds the token; a slow
        # joiner may take it later, so abandoned names are checked before every join.
        try:
            self._group_store.compare_set(_GROUP_TOKEN_KEY, f"Token_for_{name}_join", "")
        except Exception as exc:  # noqa: BLE001
            log.debug("could not release the join token of %s: %s", name, exc)

    def shutdown(self) -> None:
        rpc = _rpc()
        try:
            if _agent_exists():
                rpc.shutdown(graceful=False)
        except Exception as exc:  # noqa: BLE001 - shutting down must not fail a close
            log.warning("torch RPC shutdown of %s failed: %s", self.name, exc)
        self._store = None
        self._members = None
        self._group_store = None
        log.info("torch RPC world %s closed", self.name)


_world_lock = threading.Lock()
_world: Optional[_World] = None


def _foreign_agent_error() -> ConfigurationError:
    return ConfigurationError(
        f"torch.distributed.rpc is already initialised in this process (agent {_current_agent_name()!r}, "
        "from an earlier rpc.init_rpc). torch allows one RPC agent per process, and transport='torch_rpc' "
        "needs a world of its own with the worker sessions. Call rpc.shutdown() first, run the data "
        "loading in a process without RPC, or use transport='socket'"
    )


def _check_no_foreign_agent() -> None:
    with _world_lock:
        if _world is None and _agent_exists():
            raise _foreign_agent_error()


def _acquire_world(loopback: bool, advertise_host: str, rpc_timeout: float, num_worker_threads: int) -> _World:
    global _world
    with _world_lock:
        world = _world
        if world is None:
            if _agent_exists():
                raise _foreign_agent_error()
            world = _World(loopback, advertise_host, rpc_timeout, num_worker_threads)
            _world = world
        elif world.loopback != loopback:
            where = "on this host (loopback)" if world.loopback else "on other hosts"
            raise ConfigurationError(
                f"this process's torch RPC world serves workers {where} while it is open; torch_rpc cannot mix "
                "loopback and remote workers in one trainer process at the same time. Finalize the other "
                "reading service first, give every worker a non-loopback address, or use transport='socket'"
            )
        world.refs += 1
        return world


def _release_world(world: _World) -> None:
    global _world
    with _world_lock:
        world.refs -= 1
        if world.refs > 0 or _world is not world:
            return
        _world = None
        world.shutdown()


@atexit.register
def _shutdown_at_exit() -> None:
    # An RPC agent still alive when the interpreter exits aborts the process.
    global _world
    with _world_lock:
        world, _world = _world, None
    if world is not None:
        world.shutdown()
    session = _session_agent_owner
    if session is not None:
        session._shutdown_agent()


_TP_IFNAME_ENV = "TP_SOCKET_IFNAME"


def _interface_of(ip: str) -> Optional[str]:
    """The name of the network interface holding ``ip`` (Linux; None where unknown)."""
    if not sys.platform.startswith("linux"):
        return None
    if ":" in ip:
        try:
            packed = socket.inet_pton(socket.AF_INET6, ip).hex()
            with open("/proc/net/if_inet6") as handle:
                for line in handle:
                    fields = line.split()
                    if len(fields) >= 6 and fields[0] == packed:
                        return fields[5]
        except OSError:
            return None
        return None
    import fcntl

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _index, name in socket.if_nameindex():
            try:
                info = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(info[20:24]) == ip:
                return name
    finally:
        probe.close()
    return None


def _pin_tensorpipe_interface(local_ip: str) -> None:
    """Make TensorPipe listen on the interface that reaches the peer, unless the user chose one.

    Without ``TP_SOCKET_IFNAME`` TensorPipe listens on the address the host name resolves to,
    which is 127.0.1.1 on many distributions: unreachable from other hosts. TensorPipe reads
    the variable once per process, when its first TCP transport starts.
    """
    if os.environ.get(_TP_IFNAME_ENV):
        return
    name = _interface_of(local_ip)
    if name is not None:
        os.environ[_TP_IFNAME_ENV] = name
        log.info("TensorPipe will listen on %s (%s), the interface that reaches the peer; set %s to override",
                 name, local_ip, _TP_IFNAME_ENV)  # fmt: skip


def _local_address(conn: SocketConnection) -> str:
    """This end's IP address on the bootstrap connection (``127.0.0.1`` for a Unix socket)."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return "127.0.0.1"
        host = sock.getsockname()[0]
    finally:
        sock.detach()
    if host.startswith("::ffff:"):  # an IPv4 peer on a dual-stack socket
        host = host[len("::ffff:") :]
    return host


# -- the worker server's end -------------------------------------------------------------------------
_session_agent_owner: Optional["_SessionConnection"] = None


class _SessionConnection(TorchRPCConnection):
    """The worker's end. Joins the trainer's world on the first ``recv``, in the session process."""

    flush_seconds = 2.0  # a session's last frame may be the ERROR that explains its end

    def __init__(self, bootstrap: SocketConnection, max_frame_bytes: int):
        super().__init__(bootstrap, bootstrap.peer, "", _Inbox(max_frame_bytes), rpc_timeout=60.0)
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
        self._shutdown_agent()

    def refuse(self, reason: str, linger: float = 0.0) -> None:
        if self._bootstrapped:
            super().refuse(reason, linger)
            return
        with self._send_lock:
            self._closed = True
        self._bootstrap.refuse(reason, linger)

    def _shutdown_agent(self) -> None:
        global _session_agent_owner
        if not self._owns_agent:
            return
        self._owns_agent = False
        if _session_agent_owner is self:
            _session_agent_owner = None
        try:
            if _agent_exists():
                _rpc().shutdown(graceful=False)
        except Exception as exc:  # noqa: BLE001
            log.debug("torch RPC shutdown failed: %s", exc)

    # -- bootstrap ------------------------------------------------------------------------------------
    def _refuse(self, message: str, reason: str, error: Optional[BaseException] = None) -> None:
        from ..serialization import pack_exception

        exc = error if error is not None else ConfigurationError(message)
        payload = {"transport": TRANSPORT_NAME, "reason": reason, "message": message,
                   "epoch": None, "phase": "setup", "exception": pack_exception(exc)}  # fmt: skip
        try:
            self._bootstrap.send(encode_control(MessageKind.ERROR, payload))
        except (PeerLostError, OSError):
            pass
        self._bootstrap.close()
        log.warning("torch_rpc session with %s refused: %s", self.peer, message)
        raise PeerLostError(message)

    def _bootstrap_session(self, timeout: Optional[float]) -> bool:
        frame = self._bootstrap.recv(timeout=timeout)
        if frame is None:
            return False
        request: Dict[str, Any] = decode_control(frame) if frame.kind == MessageKind.SETUP else {}
        if request.get("transport") != TRANSPORT_NAME:
            self._refuse(
                f"this worker server runs transport 'torch_rpc', but the trainer at {self.peer} uses another one "
                f"(it sent {frame.kind.name} instead of the torch_rpc rendezvous). Pass transport='torch_rpc' to "
                "RPCReadingService, or start the worker with --transport socket",
                "transport",
            )
        if int(request.get("bootstrap_version", 0)) != BOOTSTRAP_VERSION:
            self._refuse(
                f"the trainer's torch_rpc bootstrap version {request.get('bootstrap_version')} differs from this "
                f"worker's {BOOTSTRAP_VERSION}: install the same rpc_reading_service version on both",
                "config",
            )
        if _agent_exists():
            self._refuse(
                f"this worker process already belongs to a torch RPC world (agent {_current_agent_name()!r}): "
                "a process can join only one. Start the worker server with --session-mode fork (the default "
                "for torch_rpc), which gives every session its own process",
                "config",
            )
        try:
            self._conn_id = str(request["conn_id"])
            self._rpc_timeout = float(request["rpc_timeout"])
            join_timeout = float(request["join_timeout"])
            str(request["init_method"]), int(request["rank"]), str(request["name"]), str(request["trainer_name"])
        except (KeyError, TypeError, ValueError) as exc:
            self._refuse(f"malformed torch_rpc rendezvous request from {self.peer}: {exc!r}", "config")
        _inboxes[self._conn_id] = self._inbox
        if request.get("transports") is None:  # a remote world: TCP, on the interface the trainer reached
            _pin_tensorpipe_interface(_local_address(self._bootstrap))
        outcome: Dict[str, Any] = {}
        done = threading.Event()
        joiner = threading.Thread(target=self._join, args=(request, join_timeout, outcome, done), daemon=True)
        joiner.start()
        deadline = time.monotonic() + join_timeout
        while not done.wait(0.002):
            # The trainer says nothing while we join; its EOF or CLOSE means it gave up.
            try:
                early = self._bootstrap.recv(timeout=0.008)
            except (PeerLostError, ProtocolError, OSError) as exc:
                early, outcome["gone"] = None, exc
            if early is not None or "gone" in outcome:
                self._abandon_join()
                _inboxes.pop(self._conn_id, None)
                raise PeerLostError(f"trainer {self.peer} gave up while this session joined its torch RPC world")
            if time.monotonic() >= deadline:
                break
        if "error" in outcome or not done.is_set():
            self._abandon_join()
            _inboxes.pop(self._conn_id, None)
            error = outcome.get("error")
            self._refuse(
                f"could not join the trainer's torch RPC world at {request['init_method']} within "
                f"{join_timeout:.1f} s: {_short(error) if error else 'timed out'}. This worker host must reach the "
                "trainer's rendezvous port and its TensorPipe ports (see TP_SOCKET_IFNAME)",
                "join",
            )
        self._bootstrapped = True
        self._start(None)  # the joiner looked the trainer up
        self._bootstrap.send(
            encode_control(
                MessageKind.READY,
                {
                    "transport": TRANSPORT_NAME,
                    "pid": os.getpid(),
                    "hostname": socket.gethostname(),
                    "package_version": __version__,
                },
            )
        )
        log.info("session for %s joined torch RPC world as %s", self.peer, request["name"])
        return True

    def _join(
        self, request: Dict[str, Any], join_timeout: float, outcome: Dict[str, Any], done: threading.Event
    ) -> None:
        global _session_agent_owner
        try:
            rpc = _rpc()
            options = rpc.TensorPipeRpcBackendOptions(
                init_method=str(request["init_method"]),
                rpc_timeout=join_timeout,
                num_worker_threads=int(request.get("num_worker_threads", 4)),
                _transports=request.get("transports"),
                _channels=request.get("channels"),
            )
            with rpc._init_counter_lock:  # noqa: SLF001 - see _World: the trainer's store namespace
                rpc._init_counter = int(request.get("store_prefix_index", 0))  # noqa: SLF001
            rpc.init_rpc(str(request["name"]), rank=int(request["rank"]), world_size=None, rpc_backend_options=options)
            with self._send_lock:
                self._owns_agent = True
                _session_agent_owner = self
                abandoned = self._abandoned
            if abandoned:  # joined after giving up (thread mode): leave at once
                self._shutdown_agent()
            else:
                self._peer_info = rpc.get_worker_info(str(request["trainer_name"]))
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
        return self._inner.refused_handshakes


# -- the transport ---------------------------------------------------------------------------------
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
        _rpc()
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
        self._socket = SocketTransport(**socket_options)
        self.max_frame_bytes = self._socket.max_frame_bytes

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
        _check_no_foreign_agent()
        bootstrap = self._socket.connect(address, auth_key, timeout)
        try:
            local_host = _local_address(bootstrap)
            world = _acquire_world(is_loopback_host(local_host), local_host, self.rpc_timeout, self.trainer_threads)
        except BaseException:
            bootstrap.close()
            raise
        inbox = _Inbox(self.max_frame_bytes, allocate)
        conn_id = secrets.token_hex(16)
        conn = TorchRPCConnection(
            bootstrap, address, conn_id, inbox, self.rpc_timeout, on_close=lambda: _release_world(world)
        )
        try:
            if not world.join_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise PeerLostError(
                    f"torch RPC rendezvous with worker at {address} did not start within {timeout:.1f} s: "
                    "other sessions of this trainer were still joining"
                )
            try:
                session_name = self._rendezvous(world, bootstrap, address, conn_id, inbox, deadline, timeout)
            finally:
                world.join_lock.release()
            conn._start(session_name)
        except BaseException:
            _inboxes.pop(conn_id, None)
            conn.close()
            raise
        return conn

    def _rendezvous(
        self,
        world: _World,
        bootstrap: SocketConnection,
        address: str,
        conn_id: str,
        inbox: _Inbox,
        deadline: float,
        timeout: float,
    ) -> str:
        """Have the session join ``world``; returns its RPC name (called with ``world.join_lock`` held)."""
        rank, name = world.next_member()
        world.prepare_join()
        _inboxes[conn_id] = inbox
        remaining = deadline - time.monotonic()
        request = {
            "transport": TRANSPORT_NAME,
            "bootstrap_version": BOOTSTRAP_VERSION,
            "init_method": f"tcp://{format_address(world.advertise_host, world.port)}",
            "rank": rank,
            "name": name,
            "trainer_name": world.name,
            "conn_id": conn_id,
            # The session must finish (or give up) before this trainer stops waiting.
            "join_timeout": max(0.5, remaining * 0.9 - 0.2),
            "rpc_timeout": self.rpc_timeout,
            "num_worker_threads": self.session_threads,
            "transports": world.transports,
            "channels": world.channels,
            "store_prefix_index": world.store_prefix_index,
        }
        bootstrap.send(encode_control(MessageKind.SETUP, request))
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
                f"session must reach this trainer's rendezvous store at {request['init_method']} and the "
                "trainer's TensorPipe ports (set TP_SOCKET_IFNAME to pick the interface); see docs/transports.md"
            )
        if frame.kind == MessageKind.REJECT:
            world.abandon(name)
            raise WorkerRefusedError(f"worker at {address} refused the session: {decode_reject(frame)}")
        reply = decode_control(frame) if frame.kind in (MessageKind.READY, MessageKind.ERROR) else {}
        if reply.get("transport") != TRANSPORT_NAME:
            world.abandon(name)
            raise ConfigurationError(
                f"the worker at {address} does not speak torch_rpc: it answered the torch RPC rendezvous with "
                f"{frame.kind.name}, as a server started with another --transport (probably socket) does. Start it "
                "with `rpc-reading-worker --transport torch_rpc`, or use transport='socket' in the trainer"
            )
        if frame.kind == MessageKind.ERROR:
            world.abandon(name)
            message = f"worker at {address} could not join the torch RPC world: {reply.get('message', '?')}"
            if reply.get("reason") == "join":
                raise PeerLostError(message)
            raise ConfigurationError(message)
        log.info("worker at %s joined torch RPC world %s as %s", address, world.name, name)
        return name
