"""The trainer side of discovery: check the options, then wait for enough live workers in the
store (or a hostfile) and return their addresses (see docs/deployment.md)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..addresses import distinct_servers, parse_address, unix_socket_path
from ..errors import ConfigurationError, DiscoveryTimeoutError
from .hostfile import wait_for_hostfile
from .store import check_job, connect_store, probe_address, registered_workers
from ..tasks import TaskGroup

__all__ = ["wait_for_workers", "check_discovery_options", "discover_workers"]

log = logging.getLogger(__package__)

_POLL_SECONDS = 0.1


def wait_for_workers(
    store: Any,
    job: str,
    min_workers: int,
    timeout: float,
    store_address: str = "the store",
    probe: Callable[[str], Optional[str]] = probe_address,
) -> List[str]:
    """Wait until at least ``min_workers`` distinct registered workers answer ``probe`` (a
    transport's :meth:`~rpc_reading_service.transports.Transport.probe`; by default a TCP connect).

    Returns every live registered address (oldest registration first; one per server, however
    many spellings registered it). Raises :class:`DiscoveryTimeoutError` saying how many of
    ``min_workers`` registered and which registered addresses did not answer.
    """
    job = check_job(job)
    deadline = time.monotonic() + timeout
    answered: Set[str] = set()  # probed once each: a worker sees one probe per trainer
    failed: Dict[str, Tuple[str, float]] = {}  # address -> (reason, when): re-probed every second
    keys: Dict[str, Tuple[str, int]] = {}  # each registered name resolved once
    probes = TaskGroup(f"the lookup of job {job!r}")
    while True:
        now = time.monotonic()
        addresses = distinct_servers((address for _, address in registered_workers(store, job)), keys)
        due = [
            a for a in addresses if a not in answered and (a not in failed or now - failed[a][1] >= 1.0)
        ]
        for address, reason in zip(due, probes.map("probe", probe, due, width=16)):
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


def check_discovery_options(store: Any, job: Any = "default") -> None:
    """Validate a store address and job name for :class:`~rpc_reading_service.StoreDiscovery`.

    Opens nothing: the reading service is cloned by pickling before it is initialised.
    """
    if not isinstance(store, str) or unix_socket_path(store):
        raise ConfigurationError(f"store address {store!r} must be a 'HOST:PORT' string")
    parse_address(store, what="store address")
    check_job(job)


def discover_workers(
    store: Optional[str] = None,
    job: str = "default",
    min_workers: Optional[int] = None,
    hostfile: Optional[str] = None,
    host_store: bool = False,
    timeout: float = 300.0,
    probe: Callable[[str], Optional[str]] = probe_address,
) -> Tuple[List[str], Any]:
    """Resolve worker addresses for :class:`~rpc_reading_service.RPCReadingService`.

    Returns ``(addresses, hosted_store)``; ``hosted_store`` is the TCPStore this process
    serves (``host_store=True``), which must stay alive while workers register and
    deregister, or None. ``probe(address)`` tells a live registered worker (None) from a dead one
    (the reason): the transport's probe, by default a TCP connect.
    """
    if hostfile is not None:
        return wait_for_hostfile(hostfile, min_workers, timeout), None
    assert store is not None
    handle = connect_store(store, timeout=timeout, host=host_store)
    error: Optional[BaseException] = None
    try:
        addresses = wait_for_workers(handle, job, min_workers or 1, timeout, store_address=store, probe=probe)
    except BaseException as exc:  # noqa: BLE001 - re-raised below, once the store is released
        error = exc.with_traceback(None)  # the traceback's frames would keep a hosted store listening
    if error is not None:
        handle = None
        raise error
    return addresses, handle if host_store else None
