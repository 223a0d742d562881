"""Parsing and formatting ``HOST:PORT`` addresses, with messages that say how to fix a typo."""

from __future__ import annotations

import ipaddress
from typing import Tuple

from .errors import ConfigurationError

__all__ = ["parse_address", "format_address", "is_loopback_host"]


def parse_address(address: str) -> Tuple[str, int]:
    """Split ``"host:port"`` or ``"[v6addr]:port"`` into ``(host, port)``."""
    if not isinstance(address, str) or not address.strip():
        raise ConfigurationError(f"worker address {address!r} is empty: write it as HOST:PORT, e.g. cpu-node-1:29600")
    text = address.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if not sep:
            raise ConfigurationError(f"worker address {address!r} has an unclosed '[': write IPv6 as [::1]:29600")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ConfigurationError(
                f"worker address {address!r} has no port: write it as HOST:PORT, e.g. {text}:29600"
            )
        if ":" in host:
            raise ConfigurationError(f"IPv6 worker address {address!r} needs brackets: [{host}]:{port_text}")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigurationError(
            f"worker address {address!r} has port {port_text!r}, which is not a number: write HOST:PORT"
        ) from None
    if not 0 <= port <= 65535:
        raise ConfigurationError(f"worker address {address!r} has port {port}, outside 0-65535")
    if not host:
        raise ConfigurationError(f"worker address {address!r} has no host: write HOST:PORT")
    return host, port


def format_address(host: str, port: int) -> str:
    """The inverse of :func:`parse_address`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
