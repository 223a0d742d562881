"""Finding worker servers: through torch's ``TCPStore`` (the store torchrun uses) or a hostfile.

Store discovery
---------------
A worker started with ``rpc-reading-worker --store HOST:PORT --job NAME`` registers the
address the trainer should dial; ``RPCReadingService(workers=StoreDiscovery("HOST:PORT", job="NAME",
min_workers=N))`` waits until N registered workers answer, then uses them. Keys, all
under ``rpc_reading_service/<job>/``::

    count       a TCPStore ``add`` counter: how many registrations ever happened
    worker/<i>  the advertised ``host:port`` of registration ``i`` (1-based); a worker
                deletes its key when it shuts down cleanly

``add`` is atomic, so concurrent workers never overwrite each other's slot.

Workers that restart, and stale entries: a restarted worker registers again under a new
slot. If it comes back on the same address (a fixed ``--port``), the trainer sees the
address twice and keeps one. If it comes back elsewhere (``--port 0``), its old slot
was deleted on a clean shutdown; after a crash (``kill -9``, a lost node) the old slot
stays. So the trainer does not trust the registry blindly: it probes every registered
address with a TCP connect and counts only the ones that answer, and it waits for
``min_workers`` *live* workers. Entries left by an earlier run of the same job in a
long-lived store are handled the same way (dead ones are skipped); to keep runs apart
entirely, use a job name per run (``$SLURM_JOB_ID``, ``$TORCHELASTIC_RUN_ID``) or a store
that lives as long as the run (a trainer-hosted store, torchrun's own store).

Who hosts the store: the trainer (``StoreDiscovery("0.0.0.0:PORT",
host_store=True)``, on one rank only), torchrun's existing store
(``$MASTER_ADDR:$MASTER_PORT``), or a stand-alone one::

    python -m rpc_reading_service.discovery serve --port 29700   # --host 127.0.0.1: loopback only
    python -m rpc_reading_service.discovery list --store HOST:29700 --job NAME

Workers wait (``--store-timeout``) for the store to come up, so start order does not matter.
A store that goes away (restarted, or the trainer that hosted it exited) loses every entry:
each worker notices at once (it holds an idle connection to the store), logs it once, and
registers again when a store answers at the same address, so the next trainer finds it.

Hostfile
--------
One ``host:port`` per line; ``#`` starts a comment; blank lines are ignored.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..addresses import format_address, parse_address, unix_socket_path
from ..errors import ConfigurationError, DiscoveryTimeoutError

__all__ = [
    "DiscoveryTimeoutError",
    "check_discovery_options",
    "KEY_PREFIX",
    "advertised_address",
    "connect_store",
    "discover_workers",
    "read_hostfile",
    "registered_workers",
    "wait_for_hostfile",
    "wait_for_workers",
    "WorkerRegistration",
]

log = logging.getLogger(__name__)

KEY_PREFIX = "rpc_reading_service"
_POLL_SECONDS = 0.1
_PROBE_TIMEOUT = 1.0
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}
_MISSING = "\x00missing"


def _key(job: str, *parts: str) -> str:
    return "/".join((KEY_PREFIX, job, *parts))


def _check_job(job: str) -> str:
    if not isinstance(job, str) or not job.strip():
        raise ConfigurationError(
            f"job name {job!r} is empty: pick a name shared by the trainer and its workers"
        )
    return job.strip()


# -- the store ----------------------------------------------------------------------------------
def _wait_until_listening(host: str, port: int, deadline: float, address: str) -> None:
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
    store_host, port = parse_address(address, what="store address")
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
    _wait_until_listening(store_host, port, time.monotonic() + timeout, address)
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
    count = int(store.add(_key(job, "count"), 0))
    found = []
    for slot in range(1, count + 1):
        value = _value(store, _key(job, "worker", str(slot)))
        if value is not None:
            found.append((slot, value))
    return found


def _value(store: Any, key: str) -> Optional[str]:
    """The value at ``key``, or None if it is missing (deleted on a clean shutdown, or counted
    but not written yet). compare_set with expected == desired is a get that neither blocks on
    a missing key nor creates it."""
    value = store.compare_set(key, _MISSING, _MISSING)
    return None if value == _MISSING.encode() else value.decode("utf-8")


def _probe(address: str, timeout: float = _PROBE_TIMEOUT) -> Optional[str]:
    """None if a TCP connect to ``address`` succeeds, else the reason it failed."""
    try:
        host, port = parse_address(address)
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except (OSError, ConfigurationError) as exc:
        return str(exc) or type(exc).__name__


def wait_for_workers(
    store: Any,
    job: str,
    min_workers: int,
    timeout: float,
    store_address: str = "the store",
    probe: Callable[[str], Optional[str]] = _probe,
) -> List[str]:
    """Wait until at least ``min_workers`` distinct registered workers answer a TCP connect.

    Returns every live registered address (oldest registration first). Raises
    :class:`DiscoveryTimeoutError` saying how many of ``min_workers`` registered and which
    registered addresses did not answer.
    """
    job = _check_job(job)
    deadline = time.monotonic() + timeout
    answered: Set[str] = set()  # probed once each: a worker sees one bare connect per trainer
    failed: Dict[str, Tuple[str, float]] = {}  # address -> (reason, when): re-probed every second
    with ThreadPoolExecutor(max_workers=16, thread_name_prefix="rrs-probe") as pool:
        while True:
            now = time.monotonic()
            addresses = list(dict.fromkeys(address for _, address in registered_workers(store, job)))
            due = [
                a for a in addresses if a not in answered and (a not in failed or now - failed[a][1] >= 1.0)
            ]
            for address, reason in zip(due, pool.map(probe, due)):
                if reason is None:
                    answered.add(address)
                    failed.pop(address, None)
                else:
                    failed[address] = (reason, now)
            live = [address for address in addresses if address in answered]
            dead = {address: failed[address][0] for address in addresses if address in failed}
            if len(live) >= min_workers:
                if dead:
                    log.warning("skipping registered workers that do not answer: %s", _describe(dead))
                log.info("found %d live workers of job %r: %s", len(live), job, ", ".join(live))
                return live
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_SECONDS)
    message = (
        f"waited {timeout:.0f} s for {min_workers} workers of job {job!r} "
        f"in the TCPStore at {store_address}: "
        f"only {len(live)} of {min_workers} registered and answering"
    )
    if live:
        message += f" ({', '.join(live)})"
    if dead:
        message += (
            f"; registered but not answering: {_describe(dead)} (dead, or advertising an address this host "
            "cannot reach: see --advertise-host)"
        )
    message += (
        f". Start more workers with `rpc-reading-worker --store {store_address} --job {job} ...`, "
        "lower min_workers, or raise the timeout of StoreDiscovery/Hostfile"
    )
    raise DiscoveryTimeoutError(message)


def _describe(reasons: Dict[str, str]) -> str:
    return ", ".join(f"{address} ({reason})" for address, reason in reasons.items())


# -- hostfiles ----------------------------------------------------------------------------------
def read_hostfile(path: str) -> List[str]:
    """The ``host:port`` lines of a hostfile (``#`` comments and blank lines skipped).

    A malformed line raises :class:`ConfigurationError` naming the file and line.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise ConfigurationError(f"cannot read hostfile {path!r}: {exc.strerror}") from exc
    addresses = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            parse_address(text)
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"hostfile {path}, line {number}: {exc} (each line holds one HOST:PORT; '#' starts a comment)"
            ) from None
        addresses.append(text)
    return addresses


def wait_for_hostfile(path: str, min_workers: Optional[int], timeout: float) -> List[str]:
    """Read a hostfile; with ``min_workers``, wait until it exists and lists that many addresses."""
    if min_workers is None:
        addresses = read_hostfile(path)
        if not addresses:
            raise ConfigurationError(f"hostfile {path!r} lists no worker: put one HOST:PORT per line")
        return addresses
    deadline = time.monotonic() + timeout
    addresses: List[str] = []
    while True:
        if os.path.exists(path):
            addresses = list(dict.fromkeys(read_hostfile(path)))
            if len(addresses) >= min_workers:
                return addresses
        if time.monotonic() >= deadline:
            raise DiscoveryTimeoutError(
                f"waited {timeout:.0f} s for hostfile {path!r} to list {min_workers} workers: it lists "
                f"{len(addresses)}{'' if os.path.exists(path) else ' (the file does not exist)'}. Add "
                "HOST:PORT lines, lower min_workers, or raise the timeout of StoreDiscovery/Hostfile"
            )
        time.sleep(_POLL_SECONDS * 2)


def check_discovery_options(store: Any, job: Any = "default") -> None:
    """Validate a store address and job name for :class:`~rpc_reading_service.StoreDiscovery`.

    Opens nothing: the reading service is cloned by pickling before it is initialised.
    """
    if not isinstance(store, str) or unix_socket_path(store):
        raise ConfigurationError(f"store address {store!r} must be a 'HOST:PORT' string")
    parse_address(store, what="store address")
    _check_job(job)


def discover_workers(
    store: Optional[str] = None,
    job: str = "default",
    min_workers: Optional[int] = None,
    hostfile: Optional[str] = None,
    host_store: bool = False,
    timeout: float = 300.0,
) -> Tuple[List[str], Any]:
    """Resolve worker addresses for :class:`~rpc_reading_service.RPCReadingService`.

    Returns ``(addresses, hosted_store)``; ``hosted_store`` is the TCPStore this process
    serves (``host_store=True``), which must stay alive while workers register and
    deregister, or None.
    """
    if hostfile is not None:
        return wait_for_hostfile(hostfile, min_workers, timeout), None
    assert store is not None
    handle = connect_store(store, timeout=timeout, host=host_store)
    error: Optional[BaseException] = None
    try:
        addresses = wait_for_workers(handle, job, min_workers or 1, timeout, store_address=store)
    except BaseException as exc:  # noqa: BLE001 - re-raised below, once the store is released
        error = exc.with_traceback(None)  # the traceback's frames would keep a hosted store listening
    if error is not None:
        handle = None
        raise error
    return addresses, handle if host_store else None


# -- the worker side ----------------------------------------------------------------------------
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
        self.job = _check_job(job)
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.address: Optional[str] = None
        self.slot: Optional[int] = None
        self.error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def start(self, address: str, on_failure: Callable[[], None] = lambda: None) -> None:
        """Register ``address`` in the background and keep it registered; call
        ``on_failure`` if the first registration fails."""
        self.address = address
        self._thread = threading.Thread(
            target=self._keep_registered, args=(on_failure,), name="rrs-registration", daemon=True
        )
        self._thread.start()

    def register(self, timeout: Optional[float] = None) -> int:
        """Register now (blocking) unless this address is registered already; returns the slot."""
        assert self.address is not None
        store = self._client(self.timeout if timeout is None else timeout)
        with self._lock:
            if self._stopped.is_set():
                return 0
            slot = self.slot
            if slot is not None and _value(store, _key(self.job, "worker", str(slot))) == self.address:
                return slot
            slot = int(store.add(_key(self.job, "count"), 1))
            store.set(_key(self.job, "worker", str(slot)), self.address)
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
                    _wait_until_listening(host, port, time.monotonic() + self.timeout, self.store_address)
                # Opened before registering, so that a restart after the check cannot go unseen.
                with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT) as watch:
                    slot = self.register(timeout=self.timeout if first else _PROBE_TIMEOUT)
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
            while not self._stopped.wait(self.retry_interval) and _probe(self.store_address) is not None:
                pass

    def stop(self) -> None:
        """Stop keeping the entry and delete it (best effort: the store may be gone already)."""
        with self._lock:
            self._stopped.set()
            slot, self.slot = self.slot, None
        if slot is None:
            return
        reason = _probe(self.store_address)
        if reason is None:
            try:
                self._client(_PROBE_TIMEOUT).delete_key(_key(self.job, "worker", str(slot)))
                log.info("deregistered worker slot %d of job %r", slot, self.job)
                return
            except Exception as exc:  # noqa: BLE001
                reason = str(exc)
        log.info("could not deregister from the TCPStore at %s (gone?): %s", self.store_address, reason)
