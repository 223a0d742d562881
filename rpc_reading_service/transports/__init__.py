"""Transports move frames between trainer and workers; this module is their registry.

Built in: ``"socket"`` (TCP, the default) and ``"torch_rpc"`` (torch.distributed.rpc with
the TensorPipe backend, bootstrapped over an authenticated socket). Third-party transports register with
:func:`register_transport` or through the entry-point group
``rpc_reading_service.transports`` (``name = "package.module:factory"``).
"""

from __future__ import annotations

from typing import Any, Callable, List

from ..registry import Registry
from .base import Connection, Listener, PeerLostError, Transport

__all__ = [
    "Connection",
    "Listener",
    "PeerLostError",
    "Transport",
    "register_transport",
    "available_transports",
    "create_transport",
    "ENTRY_POINT_GROUP",
]

ENTRY_POINT_GROUP = "rpc_reading_service.transports"
#: ``factory(**options) -> Transport``; options come from ``TransportConfig(options=...)``
#: on the trainer and from the ``rpc-reading-worker`` command line on the server.
TransportFactory = Callable[..., Transport]

_registry = Registry("transport", ENTRY_POINT_GROUP)


def register_transport(name: str, factory: TransportFactory, *, replace: bool = False) -> None:
    """Make ``factory()`` available as ``RPCReadingService(transport=name)`` and ``--transport name``."""
    _registry.register(name, factory, replace=replace)


def available_transports() -> List[str]:
    """Names of every registered transport, built-in, registered and discovered."""
    return _registry.names()


def create_transport(name: str, **options: Any) -> Transport:
    """Instantiate the transport registered under ``name`` with transport-specific ``options``
    (for ``"socket"``: ``max_frame_bytes``, ``tls_cert``, ``tls_key``, ``tls_ca_file``,
    ``tls_server_hostname``)."""
    return _registry.create(name, Transport, **options)


_registry.register_builtin("socket", "rpc_reading_service.transports.socket_transport:SocketTransport")
_registry.register_builtin("torch_rpc", "rpc_reading_service.transports.torch_rpc:TorchRPCTransport")
