"""Prometheus metrics of the trainer and of the worker servers (needs ``prometheus_client``:
``pip install 'rpc-reading-service[metrics]'``; importing this package does not).

:mod:`.trainer`: :class:`ReadingServiceCollector` and :func:`serve_metrics` for a reading
service's ``stats()``. :mod:`.worker_server`: what ``rpc-reading-worker --metrics-port`` serves.
:mod:`.counters`: how a server's session processes report their counters to it (shared memory).
:mod:`.endpoint`: the HTTP endpoint. See docs/deployment.md "Metrics".
"""

from .endpoint import MetricsEndpoint
from .trainer import ReadingServiceCollector, serve_metrics
from .worker_server import WorkerServerCollector

__all__ = ["MetricsEndpoint", "ReadingServiceCollector", "serve_metrics", "WorkerServerCollector"]
