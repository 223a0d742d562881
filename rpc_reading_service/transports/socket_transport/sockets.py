"""Plain socket I/O under the socket transport's connections: opening and tuning a socket,
scatter/gather sends, and closing a refused peer without a reset."""

from __future__ import annotations

import array
import math
import select
import socket
import time
from typing import List, Optional, Sequence

from ...addresses import unix_socket_path
from ...protocol import Buffer, encode_reject

_IOV_MAX = 512
#: The send buffer a Unix socket asks for (Linux doubles it, within ``net.core.wmem_max``):
#: room for a few default frames, so a send queues a whole frame and the peer reads it at once,
#: not in pieces of the default buffer (208 KiB). Credit bounds what is in flight anyway.
UNIX_SEND_BUFFER_BYTES = 2 << 20


def tune_socket(sock: socket.socket) -> None:
    """TCP_NODELAY and keep-alive on a TCP socket; a larger send buffer on a Unix socket."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)
    except OSError:  # a host that refuses it keeps its default
        pass


def open_client_socket(host: str, port: int, timeout: float) -> socket.socket:
    """A connected socket to ``host:port``, or to the Unix socket a ``unix:`` host names."""
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


def send_chunks(sock: socket.socket, chunks: Sequence[Buffer], fds: Sequence[int] = ()) -> None:
    """Send every byte of ``chunks`` with as few system calls as possible (``fds``, on a
    Unix socket, go with the first byte)."""
    views: List[memoryview] = []
    for chunk in chunks:  # a plain loop: no call per send
        view = memoryview(chunk).cast("B")
        if view.nbytes:
            views.append(view)
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


def descriptor_limit() -> str:
    """This process's soft limit of open files, as text for a message."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return "?"
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


def wait_for(sock: socket.socket, readable: bool, timeout: Optional[float]) -> bool:
    """Wait up to ``timeout`` seconds (None: no limit) until ``sock`` is readable (or writable);
    True if it is. ``poll``, not ``select``: a process with over 1,024 open files has sockets
    whose numbers ``select`` cannot take.

    Args:
        sock: The socket (raises ValueError if it is closed).
        readable: Wait for input, else for room to write.
        timeout: Seconds, or None.
    """
    poller = select.poll()
    poller.register(sock, select.POLLIN if readable else select.POLLOUT)
    return bool(poller.poll(None if timeout is None else math.ceil(max(0.0, timeout) * 1000)))


def discard_input(sock: socket.socket, deadline: float) -> None:
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
                wait_for(sock, True, remaining)
            except (OSError, ValueError):
                return
        except (OSError, ValueError):
            return


def refuse_quietly(sock: socket.socket, reject: Optional[str]) -> None:
    """Answer a refused peer with a REJECT frame (if any) and close, without a reset."""
    discard_input(sock, time.monotonic())
    if reject is not None:
        try:
            sock.send(b"".join(bytes(c) for c in encode_reject(reject)))
        except (OSError, ValueError):
            pass
    sock.close()
