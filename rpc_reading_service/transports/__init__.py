"""Transports move frames between trainer and workers; this module is their registry.

Built in: ``"socket"`` (TCP, the default) and ``"torch_rpc"`` (torch.distributed.rpc with
the TensorPipe backend, bootstrapped over an authenticated socket). Third-party transports register with
:func:`register_transport` or through the entry-point group
``rpc_reading_service.transports`` (``name = "package.module:factory"``).
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Callable, Dict, List

from ..errors import ConfigurationError
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

log = logging.getLogger(__name__)
_lock = threading.Lock()
_factories: Dict[str, TransportFactory] = {}
_entry_points_loaded = False


def _socket_factory(**options: Any) -> Transport:
    from .socket_transport import SocketTransport

    return SocketTransport(**options)


def _torch_rpc_factory(**options: Any) -> Transport:
    from .torch_rpc import TorchRPCTransport

    return TorchRPCTransport(**options)


def register_transport(name: str, factory: TransportFactory, *, replace: bool = False) -> None:
    """Make ``factory()`` available as ``RPCReadingService(transport=name)`` and ``--transport name``."""
    if not name or not isinstance(name, str):
        raise ConfigurationError(f"transport name must be a non-empty string, got {name!r}")
    with _lock:
        if name in _factories and not replace and _factories[name] is not factory:
            raise ConfigurationError(f"transport {name!r} is already registered; pass replace=True to override it")
        _factories[name] = factory


def _entry_points() -> list:
    from importlib import metadata

    if sys.version_info >= (3, 10):
        return list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    return list(metadata.entry_points().get(ENTRY_POINT_GROUP, []))  # pragma: no cover - Python 3.9


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry_point in _entry_points():
        if entry_point.name in _factories:
            # Built-ins and explicit registrations win: installed metadata may name a moved module.
            continue

        def factory(ep=entry_point, **options: Any) -> Transport:
            return ep.load()(**options)

        _factories[entry_point.name] = factory


def available_transports() -> List[str]:
    """Names of every registered transport, built-in, registered and discovered."""
    with _lock:
        _load_entry_points()
        return sorted(_factories)


def create_transport(name: str, **options: Any) -> Transport:
    """Instantiate the transport registered under ``name`` with transport-specific ``options``
    (for ``"socket"``: ``max_frame_bytes``, ``tls_cert``, ``tls_key``, ``tls_ca_file``,
    ``tls_server_hostname``)."""
    names = available_transports()
    factory = _factories.get(name)
    if factory is None:
        raise ConfigurationError(f"unknown transport {name!r}; available transports: {', '.join(names)}")
    try:
        transport = factory(**options)
    except TypeError as exc:
        if not options:
            raise
        raise ConfigurationError(
            f"transport {name!r} does not accept the options {sorted(options)}: {exc}"
        ) from exc
    if not isinstance(transport, Transport):
        raise ConfigurationError(f"transport factory for {name!r} returned {type(transport).__name__}, not a Transport")
    return transport


register_transport("socket", _socket_factory)
register_transport("torch_rpc", _torch_rpc_factory)
