"""Parsing and formatting ``HOST:PORT`` addresses, with messages that say how to fix a typo."""

from __future__ import annotations

import ipaddress
import socket
from typing import Dict, Iterable, List, Optional, Tuple

from .errors import ConfigurationError

__all__ = [
    "parse_address",
    "format_address",
    "is_loopback_host",
    "UNIX_PREFIX",
    "unix_socket_path",
    "server_key",
    "distinct_servers",
]

UNIX_PREFIX = "unix:"


def unix_socket_path(address: str) -> str:
    """The socket path of a ``unix:/path`` address, or "" for a TCP address.

    ``unix:@NAME`` is a Linux abstract socket: no file, so nothing to clean up after a
    crash; its path is ``"\\0NAME"``, as ``socket.bind`` and ``connect`` take it.
    """
    if not address.startswith(UNIX_PREFIX):
        return ""
    path = address[len(UNIX_PREFIX) :]
    return "\0" + path[1:] if path.startswith("@") else path


def parse_address(address: str, what: str = "worker address", any_port: bool = False) -> Tuple[str, int]:
    """Split ``"host:port"`` or ``"[v6addr]:port"`` into ``(host, port)``.

    The port is ASCII digits in 1-65535 (no sign, no spaces, no other scripts' digits), and
    nothing pads the address: a typo is refused here rather than dialled.

    Args:
        address: The text to parse. A same-host ``"unix:/path"`` address comes back whole as
            the host, with port 0.
        what: Names the address in error messages (``"worker address"``, ``"store address"``).
        any_port: Also allow port 0 (an address to listen on, where 0 picks a free port).
    """
    if not isinstance(address, str) or not address.strip():
        raise ConfigurationError(f"{what} {address!r} is empty: write it as HOST:PORT, e.g. cpu-node-1:29600")
    text = address.strip()
    if text != address or any(char.isspace() for char in text):
        raise ConfigurationError(
            f"{what} {address!r} contains spaces: write it as HOST:PORT, e.g. {''.join(text.split())!r}"
        )
    if text.startswith(UNIX_PREFIX):
        if not unix_socket_path(text):
            raise ConfigurationError(f"{what} {address!r} names no socket path: write unix:/path/to/socket")
        return text, 0
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if not sep:
            raise ConfigurationError(f"{what} {address!r} has an unclosed '[': write IPv6 as [::1]:29600")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ConfigurationError(
                f"{what} {address!r} has no port: write it as HOST:PORT, e.g. {text}:29600"
            )
        if ":" in host:
            raise ConfigurationError(f"IPv6 {what} {address!r} needs brackets: [{host}]:{port_text}")
    if not (port_text.isascii() and port_text.isdigit()):
        raise ConfigurationError(
            f"{what} {address!r} has port {port_text!r}, which is not a number (digits 0-9 only): write HOST:PORT"
        )
    port = int(port_text)
    if not (0 if any_port else 1) <= port <= 65535:
        raise ConfigurationError(f"{what} {address!r} has port {port}, outside {0 if any_port else 1}-65535")
    if not host:
        raise ConfigurationError(f"{what} {address!r} has no host: write HOST:PORT")
    return host, port


def format_address(host: str, port: int) -> str:
    """The inverse of :func:`parse_address`."""
    if host.startswith(UNIX_PREFIX):
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, loopback IP addresses (127.0.0.0/8, ::1) and Unix sockets."""
    if host == "localhost" or host.startswith(UNIX_PREFIX):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_key(address: str) -> Tuple[str, int]:
    """What identifies the server at ``address``: its resolved IP (IPv4 first) and port, so that
    ``localhost:P`` and ``127.0.0.1:P`` are one server; the text itself if it does not resolve.

    Args:
        address: A ``HOST:PORT`` or ``unix:`` address.
    """
    host, port = parse_address(address)
    if host.startswith(UNIX_PREFIX):
        return host, port
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return host, port
    ips = sorted((info[0] != socket.AF_INET, info[4][0]) for info in found)
    return (ips[0][1], port) if ips else (host, port)


def distinct_servers(addresses: Iterable[str], keys: Optional[Dict[str, Tuple[str, int]]] = None) -> List[str]:
    """``addresses`` in order, without a second spelling of a server already listed (:func:`server_key`).

    Args:
        addresses: ``HOST:PORT`` or ``unix:`` addresses.
        keys: Server keys resolved before, by address (filled in): a caller that asks again
            and again resolves each name once.
    """
    keys = {} if keys is None else keys
    seen: Dict[Tuple[str, int], str] = {}
    for address in addresses:
        if address not in keys:
            keys[address] = server_key(address)
        seen.setdefault(keys[address], address)
    return list(seen.values())
