"""The trainer's metrics: what ``RPCReadingService.stats()`` says, for Prometheus.

Counters (``..._total``) count within the current epoch and restart at 0 with the next one,
which Prometheus takes as a counter reset: ``rate()`` and ``increase()`` stay right.
"""

from __future__ import annotations

from typing import Any, Iterator

from .endpoint import MetricsEndpoint, require_prometheus_client

__all__ = ["ReadingServiceCollector", "serve_metrics"]

PREFIX = "rpc_reading_service"


class ReadingServiceCollector:
    """A ``prometheus_client`` collector of a reading service's ``stats()``, read at scrape time.

    Register it in your own registry (``prometheus_client.REGISTRY.register(...)``), or let
    :func:`serve_metrics` serve it.

    Args:
        reading_service: The reading service DataLoader2 uses (``dl.reading_service``: DataLoader2
            works on a copy of the one it was given), or the DataLoader2 itself.
    """

    def __init__(self, reading_service: Any):
        self._core = require_prometheus_client("the reading service's metrics").core
        source = getattr(reading_service, "reading_service", reading_service)  # a DataLoader2's own
        if not callable(getattr(source, "stats", None)):
            raise TypeError(
                f"ReadingServiceCollector needs an RPCReadingService or a DataLoader2 using one, got {reading_service!r}"
            )
        self._source = source

    def collect(self) -> Iterator[Any]:
        """The metric families, from ``stats()`` now."""
        core, stats = self._core, self._source.stats()

        def gauge(name: str, help_text: str, value: float) -> Any:
            return core.GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)

        def counter(name: str, help_text: str, value: float) -> Any:
            return core.CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=value)

        yield gauge("epoch", "The current (or last) epoch, counted from 0", stats.epoch)
        yield gauge("epoch_elapsed_seconds", "Seconds since the epoch started", stats.elapsed_seconds)
        yield counter("items", "Items the trainer took this epoch", stats.items)
        yield gauge("items_per_second", "Items per second taken by the trainer, this epoch's average", stats.items_per_second)
        yield counter("wait_seconds", "Seconds the trainer waited for items this epoch (its rate is the data stall)", stats.wait_seconds)
        yield gauge(
            "data_stall_ratio",
            "Share of the epoch's time the trainer waited for items (near 1: more workers would help)",
            stats.data_stall,
        )
        yield gauge("sessions", "Worker sessions", len(stats.workers))
        yield counter("reassignments", "Lost workers' shards replayed on new sessions this epoch", stats.reassignments)
        yield counter("drains", "Workers whose server drained this epoch, their work handed to other servers", stats.drains)
        yield counter("joins", "Worker servers that joined the run for this epoch", stats.joins)
        labels = ["worker", "address"]
        families = {
            "items": core.CounterMetricFamily(f"{PREFIX}_worker_items", "Items the trainer took from the worker", labels=labels),
            "received": core.CounterMetricFamily(
                f"{PREFIX}_worker_received_items", "Items received from the worker", labels=labels
            ),
            "bytes": core.CounterMetricFamily(
                f"{PREFIX}_worker_received_bytes", "Bytes of items received from the worker", labels=labels
            ),
            "rate": core.GaugeMetricFamily(
                f"{PREFIX}_worker_items_per_second", "Items per second taken from the worker, this epoch's average",
                labels=labels,
            ),
            "wait": core.CounterMetricFamily(
                f"{PREFIX}_worker_wait_seconds", "Seconds the trainer waited for this worker's next item", labels=labels
            ),
            "queue": core.GaugeMetricFamily(
                f"{PREFIX}_worker_queue_depth", "Items received from the worker, not taken yet", labels=labels
            ),
            "units": core.CounterMetricFamily(
                f"{PREFIX}_worker_units", "Units of work (chunks) the distribution gave the worker", labels=labels
            ),
        }  # fmt: skip
        for worker in stats.workers:
            key = [str(worker.rank), worker.address]
            families["items"].add_metric(key, worker.items_consumed)
            families["received"].add_metric(key, worker.items_received)
            families["bytes"].add_metric(key, worker.bytes_received)
            families["rate"].add_metric(key, worker.items_per_second)
            families["wait"].add_metric(key, worker.wait_seconds)
            families["queue"].add_metric(key, worker.queue_depth)
            if worker.units is not None:
                families["units"].add_metric(key, worker.units)
        yield from (family for family in families.values() if family.samples)


def serve_metrics(reading_service: Any, port: int = 0, host: str = "127.0.0.1") -> MetricsEndpoint:
    """Serve ``reading_service``'s stats at ``http://HOST:PORT/metrics`` from a thread.

    Args:
        reading_service: ``dl.reading_service`` (or the DataLoader2 ``dl``).
        port: The port; 0 lets the OS pick one (the handle's ``.port``).
        host: The address to listen on (``0.0.0.0``: every interface).

    Returns the :class:`~rpc_reading_service.metrics.MetricsEndpoint`: ``.port``, ``.url``,
    ``.close()`` (also a context manager).
    """
    registry = require_prometheus_client("serve_metrics").CollectorRegistry(auto_describe=True)
    registry.register(ReadingServiceCollector(reading_service))
    return MetricsEndpoint(registry, host, port)
