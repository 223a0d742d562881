"""The worker side of discovery: the address a worker advertises, and its entry in the store,
kept while it serves (see docs/deployment.md)."""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from typing import Any, Callable, Optional

from ..addresses import format_address, parse_address, unix_socket_path
from ..errors import ConfigurationError
from ..tasks import TaskGroup
from .store import (
    PROBE_TIMEOUT,
    check_job,
    connect_store,
    job_key,
    probe_address,
    slot_key,
    stored_value,
    wait_until_listening,
)

__all__ = ["advertised_address", "WorkerRegistration"]

log = logging.getLogger(__package__)

_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}
#: Seconds :meth:`WorkerRegistration.stop` waits for its thread to end.
STOP_JOIN_SECONDS = 2.0


def advertised_address(listen_address: str, advertise_host: Optional[str], store_address: str) -> str:
    """The ``host:port`` a worker listening at ``listen_address`` registers.

    ``advertise_host`` if given; else the listening host if it is a specific address; else
    (listening on 0.0.0.0 or ::) this host's IP on the route towards the store host, which
    the trainer (usually next to the store) can reach; failing that, the host name.
    """
    if unix_socket_path(listen_address):
        raise ConfigurationError(
            f"a worker listening on {listen_address} cannot register in a store: trainers on other hosts "
            "cannot reach a Unix socket. Listen on TCP (--host 0.0.0.0 --port 29600)"
        )
    host, port = parse_address(listen_address)
    if advertise_host:
        return format_address(advertise_host.strip("[]"), port)
    if host not in _WILDCARD_HOSTS:
        return listen_address
    store_host, store_port = parse_address(store_address, what="store address")
    try:
        family = socket.AF_INET6 if host == "::" else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((store_host, store_port or 9))  # UDP: no packet is sent, only a route chosen
            local_ip = probe.getsockname()[0]
    except OSError:
        local_ip = ""
    if not local_ip or local_ip in _WILDCARD_HOSTS:
        local_ip = socket.gethostname()
    return format_address(local_ip, port)


class WorkerRegistration:
    """A worker's entry in the store: registered in a background thread, kept, deleted on stop.

    Registering waits up to ``timeout`` seconds for the store to come up (so workers may
    start before the trainer that hosts the store); meanwhile the worker already serves
    trainers that dial it directly. Once registered, the thread keeps an idle connection to
    the store open, which breaks the moment the store goes away (a restart, or the trainer
    that hosted it exits): it logs that once, and registers again as soon as a store answers
    at the same address, so the next trainer finds this worker there.

    Every store call goes through a fresh client connection made after a quiet TCP probe:
    a call on a dead connection would make torch print a C++ stack trace.
    """

    def __init__(self, store_address: str, job: str, timeout: float = 300.0, retry_interval: float = 1.0):
        parse_address(store_address, what="store address")
        self.store_address = store_address
        self.job = check_job(job)
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.address: Optional[str] = None
        self.slot: Optional[int] = None
        self.error: Optional[BaseException] = None
        self._tasks = TaskGroup(f"the registration in the TCPStore at {store_address}")
        self._lock = threading.Lock()
        self._stopped = self._tasks.stopping

    def start(self, address: str, on_failure: Callable[[], None] = lambda: None) -> None:
        """Register ``address`` in the background and keep it registered; call
        ``on_failure`` if the first registration fails."""
        self.address = address
        self._tasks.start(f"registration {address}", self._keep_registered, on_failure)

    def register(self, timeout: Optional[float] = None) -> int:
        """Register now (blocking) unless this address is registered already; returns the slot."""
        assert self.address is not None
        store = self._client(self.timeout if timeout is None else timeout)
        with self._lock:
            if self._stopped.is_set():
                return 0
            slot = self.slot
            if slot is not None and stored_value(store, slot_key(self.job, slot)) == self.address:
                return slot
            slot = int(store.add(job_key(self.job, "count"), 1))
            store.set(slot_key(self.job, slot), self.address)
            self.slot = slot
        log.info(
            "registered %s as worker slot %d of job %r in the TCPStore at %s",
            self.address, slot, self.job, self.store_address,
        )  # fmt: skip
        return slot

    def _client(self, timeout: float) -> Any:
        store = connect_store(self.store_address, timeout=timeout)
        store.set_timeout(datetime.timedelta(seconds=10))
        return store

    def _keep_registered(self, on_failure: Callable[[], None]) -> None:
        host, port = parse_address(self.store_address, what="store address")
        first, gone = True, False
        while not self._stopped.is_set():
            try:
                if first:
                    wait_until_listening(host, port, time.monotonic() + self.timeout, self.store_address)
                # Opened before registering, so that a restart after the check cannot go unseen.
                with socket.create_connection((host, port), timeout=PROBE_TIMEOUT) as watch:
                    slot = self.register(timeout=self.timeout if first else PROBE_TIMEOUT)
                    if gone:
                        log.warning(
                            "the TCPStore at %s answers again: %s is worker slot %d",
                            self.store_address, self.address, slot,
                        )  # fmt: skip
                    first, gone = False, False
                    watch.settimeout(self.retry_interval)
                    while not self._stopped.is_set():
                        try:
                            if not watch.recv(1):
                                break
                        except socket.timeout:
                            continue
                reason = "it closed the connection"
            except Exception as exc:  # noqa: BLE001 - the store is gone (or going): wait for it
                if first:
                    self.error = exc
                    log.error("could not register in the TCPStore at %s: %s", self.store_address, exc)
                    on_failure()
                    return
                reason = str(exc) or type(exc).__name__
            if self._stopped.is_set():
                return
            if not gone:
                log.warning(
                    "the TCPStore at %s is gone (%s); worker %s registers again when it answers",
                    self.store_address, reason, self.address,
                )  # fmt: skip
                gone = True
            while not self._stopped.wait(self.retry_interval):
                if probe_address(self.store_address) is None:
                    break

    def stop(self) -> None:
        """Stop keeping the entry and delete it (best effort: the store may be gone already)."""
        with self._lock:
            self._stopped.set()
            slot, self.slot = self.slot, None
        self._tasks.join(STOP_JOIN_SECONDS)  # it wakes within its retry interval; one stuck in the store is reported
        if slot is None:
            return
        reason = probe_address(self.store_address)
        if reason is None:
            try:
                self._client(PROBE_TIMEOUT).delete_key(slot_key(self.job, slot))
                log.info("deregistered worker slot %d of job %r", slot, self.job)
                return
            except Exception as exc:  # noqa: BLE001
                reason = str(exc)
        log.info("could not deregister from the TCPStore at %s (gone?): %s", self.store_address, reason)
