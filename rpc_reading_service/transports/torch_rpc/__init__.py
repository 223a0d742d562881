"""``transport="torch_rpc"``: frames move as torch.distributed.rpc calls (TensorPipe backend).

Design
======

torch RPC has one agent per process, and its worlds are closed: an agent joins one world
when it is created and never another. Trainers and worker servers, on the other hand, open
and close sessions at any time. This package reconciles the two like this.

Bootstrap over the authenticated socket
    A session starts exactly like a socket-transport session: TCP connection to the worker
    server and the HMAC challenge-response of :mod:`~rpc_reading_service.protocol` (so
    nothing is unpickled before both sides proved the key). That socket then carries the
    rendezvous: the trainer sends a typed :class:`~rpc_reading_service.protocol.Join`
    (a SETUP frame: ``transport="torch_rpc"``, ``init_method="tcp://TRAINER_HOST:PORT"``,
    rank, name, ...), the session joins the trainer's RPC world and answers a typed READY
    (or a setup ERROR with a ``reason`` and a ``message``). From then on the socket
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
    calls ``rpc.rpc_async(peer, deliver, args=(conn_id, seq, header, body, buffers))``.
    Large bodies and all buffers travel as uint8 CPU tensors (TensorPipe moves tensor
    storage outside the pickle stream); they are copied once into fresh tensors at send
    time, so, as with a socket, the caller may reuse its memory when ``send`` returns.
    ``deliver`` runs on the receiver's RPC thread pool, checks the header (magic,
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
    ``ConfigurationError`` at once (a process cannot be in two RPC worlds). Closing waits
    at most ~1-2 s for in-flight calls. TensorPipe warns about every pipe that closes under
    an agent still in its group, so the world's shutdown is ordered: the trainer leaves the
    group and half-closes the bootstrap sockets of its closed connections; each session,
    which waited for that (at most ``goodbye_seconds``), leaves too and shuts its agent down;
    then the trainer shuts its own down (``rpc.shutdown(graceful=False)``), all bounded.

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

Modules (each imports only the ones listed before it)
    ``agent`` (this process's RPC agent), ``codec`` (frames as RPC arguments, the RPC target,
    inboxes), ``interfaces`` (TensorPipe's interface), ``connection`` (one session's frames,
    both ends), ``world`` (the trainer's world), ``session`` (the worker's end: listener and
    the join), ``transport`` (:class:`TorchRPCTransport`: connect and rendezvous, listen).
"""

from __future__ import annotations

from .connection import TorchRPCConnection
from .session import TorchRPCListener
from .transport import TorchRPCTransport

__all__ = ["TorchRPCTransport", "TorchRPCConnection", "TorchRPCListener"]
