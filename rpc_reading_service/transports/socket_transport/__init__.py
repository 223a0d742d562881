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

The package's modules, one job each: :mod:`.sockets` (plain socket I/O), :mod:`.connection`
(:class:`SocketConnection`), :mod:`.shared_memory_connection`, :mod:`.tls`,
:mod:`.authenticated` (which connection a socket becomes), :mod:`.listener` (the server's end)
and :mod:`.transport` (:class:`SocketTransport`, the trainer's end).
"""

from __future__ import annotations

from .connection import SocketConnection
from .listener import SocketListener
# The handshake caps, still read by their old name here; they act (and are patched) in .listener.
from .listener import MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_HOST, STALE_HANDSHAKE_SECONDS  # noqa: F401
from .shared_memory_connection import SharedMemoryConnection
from .tls import TLSSocketConnection
from .transport import SocketTransport

__all__ = ["SocketTransport", "SocketConnection", "SharedMemoryConnection", "TLSSocketConnection", "SocketListener"]
