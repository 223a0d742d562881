"""Which network interface TensorPipe listens on: the one that reaches the peer."""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
from typing import Optional

from ..socket_transport import SocketConnection

log = logging.getLogger(__name__)

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


def pin_tensorpipe_interface(local_ip: str) -> None:
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


def local_interface_address(conn: SocketConnection) -> str:
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
