"""The TCPStore side of discovery: open or host the store, the keys of a job's registrations,
and quiet TCP probes of the addresses in it (see docs/deployment.md)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time
from typing import Any, List, Optional, Tuple

from ..addresses import parse_address, unix_socket_path
from ..errors import ConfigurationError

__all__ = [
    "KEY_PREFIX",
    "PROBE_TIMEOUT",
    "job_key",
    "slot_key",
    "check_job",
    "wait_until_listening",
    "connect_store",
    "registered_workers",
    "stored_value",
    "probe_address",
]

KEY_PREFIX = "rpc_reading_service"
#: Seconds a probe (a bare TCP connect) of a registered address or the store may take.
PROBE_TIMEOUT = 1.0
_MISSING = "\x00missing"


def job_key(job: str, *parts: str) -> str:
    """The store key of ``parts`` of ``job``'s registrations (``rpc_reading_service/<job>/...``)."""
    return "/".join((KEY_PREFIX, job, *parts))


def slot_key(job: str, slot: int) -> str:
    """The store key that holds the address of registration ``slot`` of ``job``."""
    return job_key(job, "worker", str(slot))


def check_job(job: str) -> str:
    """``job`` stripped; ConfigurationError if it is no name."""
    if not isinstance(job, str) or not job.strip():
        raise ConfigurationError(
            f"job name {job!r} is empty: pick a name shared by the trainer and its workers"
        )
    return job.strip()


def wait_until_listening(host: str, port: int, deadline: float, address: str) -> None:
    """Wait for something to listen at the store's address, with a plain error if nothing does.

    TCPStore retries by itself too, but prints a C++ stack trace per attempt; this wait is
    quiet and turns a typo in the host name into an immediate, readable error.
    """
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigurationError(
            f"cannot resolve the host of store address {address!r}: {exc.strerror}; check the spelling"
        ) from exc
    last: Optional[OSError] = None
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, remaining))):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise ConfigurationError(
                f"no TCPStore answers at {address} ({last}). Start one there (the trainer with "
                "StoreDiscovery('0.0.0.0:PORT', host_store=True), torchrun, or "
                "`python -m rpc_reading_service.discovery serve --port PORT`), or fix the address"
            )
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def connect_store(address: str, timeout: float = 60.0, host: bool = False) -> Any:
    """Open a ``torch.distributed.TCPStore`` at ``address`` (``HOST:PORT``).

    ``host=True`` serves the store from this process (``is_master``) at PORT (``0`` picks a
    free one: read it from ``store.port``): on HOST alone when it is an IP address or
    ``localhost`` (so ``127.0.0.1`` keeps it on loopback), else on every interface (a host
    name may resolve to a loopback alias such as Debian's 127.0.1.1). Otherwise this
    connects as a client, waiting up to ``timeout`` seconds for the store to come up.
    """
    from torch.distributed import TCPStore

    if unix_socket_path(address):
        raise ConfigurationError(f"store address {address!r} must be HOST:PORT, not a Unix socket")
    store_host, port = parse_address(address, what="store address", any_port=host)
    store_timeout = datetime.timedelta(seconds=max(1.0, timeout))
    if host:
        listen_fd = _bound_listener(store_host, port, address)
        try:
            return TCPStore(
                store_host, port, is_master=True, wait_for_workers=False, timeout=store_timeout,
                master_listen_fd=listen_fd,
            )  # fmt: skip
        except RuntimeError as exc:
            if listen_fd is not None:
                os.close(listen_fd)
            raise ConfigurationError(f"cannot host a TCPStore at {address}: {exc}") from exc
    wait_until_listening(store_host, port, time.monotonic() + timeout, address)
    try:
        return TCPStore(store_host, port, is_master=False, timeout=store_timeout)
    except RuntimeError as exc:
        raise ConfigurationError(f"cannot connect to the TCPStore at {address}: {exc}") from exc


def _bound_listener(host: str, port: int, address: str) -> Optional[int]:
    """A listening socket's fd on ``host`` for the store to serve on, or None for every interface."""
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_unspecified:
        return None
    sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise ConfigurationError(
            f"cannot host a TCPStore at {address}: {exc.strerror}; pick another port"
        ) from exc
    return sock.detach()  # the store owns it from now on


def registered_workers(store: Any, job: str) -> List[Tuple[int, str]]:
    """``(slot, address)`` of every current registration of ``job``, oldest first."""
    count = int(store.add(job_key(job, "count"), 0))
    found = []
    for slot in range(1, count + 1):
        value = stored_value(store, slot_key(job, slot))
        if value is not None:
            found.append((slot, value))
    return found


def stored_value(store: Any, key: str) -> Optional[str]:
    """The value at ``key``, or None if it is missing (deleted on a clean shutdown, or counted
    but not written yet). compare_set with expected == desired is a get that neither blocks on
    a missing key nor creates it."""
    value = store.compare_set(key, _MISSING, _MISSING)
    return None if value == _MISSING.encode() else value.decode("utf-8")


def probe_address(address: str, timeout: float = PROBE_TIMEOUT) -> Optional[str]:
    """None if a TCP connect to ``address`` succeeds, else the reason it failed."""
    try:
        host, port = parse_address(address)
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except (OSError, ConfigurationError) as exc:
        return str(exc) or type(exc).__name__
