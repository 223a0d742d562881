"""A worker server's metrics (``rpc-reading-worker --metrics-port``): sessions, items and bytes
sent, time waiting for trainer credit, cache hits and misses, summed over all its sessions."""

from __future__ import annotations

import logging
from typing import Any, Iterator

from ..version import __version__
from .counters import SessionLedger
from .endpoint import MetricsEndpoint, require_prometheus_client

__all__ = ["WorkerServerCollector", "serve_worker_metrics"]

log = logging.getLogger("rpc_reading_service.metrics")

PREFIX = "rpc_reading_worker"


class WorkerServerCollector:
    """A ``prometheus_client`` collector of a worker server's counters, read at scrape time.

    Args:
        server: The :class:`~rpc_reading_service.worker.WorkerServer` (its ``ledger``, ``address``,
            ``session_mode`` and ``max_sessions``).
    """

    def __init__(self, server: Any):
        self._core = require_prometheus_client("worker server metrics").core
        self._server = server

    def collect(self) -> Iterator[Any]:
        """The metric families, from the server's counters now."""
        core, server = self._core, self._server
        ledger: SessionLedger = server.ledger
        counts = ledger.snapshot()
        yield core.InfoMetricFamily(
            PREFIX, "The worker server: version, address, session mode",
            value={"version": __version__, "address": server.address, "session_mode": server.session_mode},
        )  # fmt: skip
        yield core.GaugeMetricFamily(f"{PREFIX}_sessions_open", "Trainer sessions running now", value=counts.sessions_open)
        if server.max_sessions is not None:
            yield core.GaugeMetricFamily(
                f"{PREFIX}_max_sessions", "Sessions the server accepts at once (--max-sessions)", value=server.max_sessions
            )
        yield core.CounterMetricFamily(f"{PREFIX}_sessions", "Trainer sessions started", value=counts.sessions_total)
        yield core.CounterMetricFamily(f"{PREFIX}_items_sent", "Items sent to trainers", value=counts.items_sent)
        yield core.CounterMetricFamily(
            f"{PREFIX}_sent_bytes", "Bytes of items sent to trainers (payload, without framing)", value=counts.bytes_sent
        )
        yield core.CounterMetricFamily(
            f"{PREFIX}_credit_wait_seconds",
            "Seconds sessions had items ready but waited for their trainer's credit, summed over sessions "
            "(rate per session near 1: the trainers take items slower than this worker makes them)",
            value=counts.credit_wait_seconds,
        )
        hits = core.CounterMetricFamily(f"{PREFIX}_cache_hits", "cached_map values found in the cache", labels=["tier"])
        hits.add_metric(["memory"], counts.cache_memory_hits)
        hits.add_metric(["disk"], counts.cache_disk_hits)
        yield hits
        yield core.CounterMetricFamily(
            f"{PREFIX}_cache_misses", "cached_map values computed (not in the cache)", value=counts.cache_misses
        )


def serve_worker_metrics(server: Any, host: str, port: int) -> MetricsEndpoint:
    """Serve ``server``'s metrics at ``http://HOST:PORT/metrics`` (port 0: one the OS picks), and log where."""
    registry = require_prometheus_client("--metrics-port").CollectorRegistry(auto_describe=True)
    registry.register(WorkerServerCollector(server))
    endpoint = MetricsEndpoint(registry, host, port)
    log.info("metrics at %s", endpoint.url)
    return endpoint
