"""Prometheus metrics: a worker server's ``--metrics-port`` and the trainer's ``serve_metrics``.

Real servers and trainers; ``/metrics`` is read over HTTP and parsed with prometheus_client's
own parser. The server's numbers are the sums over its session processes (shared memory),
checked exactly against the items streamed and the cache's hits and misses; the trainer's
match ``stats()``. Without prometheus_client the package still imports, and asking for
metrics says what to install.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Tuple

import pytest
from _server_helpers import remote, start_server, wait_until, worker_cli_runs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import (
    ConfigurationError,
    MissingDependencyError,
    ReadingServiceCollector,
    RPCReadingService,
    serve_metrics,
)
from rpc_reading_service.metrics import MetricsEndpoint
from rpc_reading_service.metrics.endpoint import MAX_CONNECTIONS

Samples = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


def double(x: int) -> int:
    return 2 * x


class ExitOnce:
    """Ends its process at item ``at``, the first time only (a marker file remembers)."""

    def __init__(self, marker: Path, at: int):
        self.marker, self.at = str(marker), at

    def __call__(self, x: int) -> int:
        if x == self.at and not os.path.exists(self.marker):
            Path(self.marker).touch()
            os._exit(3)
        return x


def parse(text: str) -> Samples:
    """``{(sample name, sorted labels): value}`` of a text exposition."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(response.read().decode())


def metrics_url(server) -> str:
    """The URL the server logged for its ``--metrics-port 0``."""
    found = []
    assert wait_until(lambda: found.extend(re.findall(r"metrics at (http://\S+)", server.stderr())) or found, 10)
    return found[0]


def worker_value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(f"rpc_reading_worker_{name}", tuple(sorted(labels.items())))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("session_mode", ["fork", "thread"])
def test_a_worker_servers_metrics_sum_its_sessions_items_and_cache_hits(tmp_path, session_mode):
    n = 60
    server = start_server(tmp_path, ["--metrics-port", "0", "--session-mode", session_mode, "--cache-memory", "1M"])
    try:
        url = metrics_url(server)
        before = scrape(url)
        assert worker_value(before, "sessions_open") == 0 and worker_value(before, "items_sent_total") == 0
        assert worker_value(before, "info", address=server.address, session_mode=session_mode, version=_version()) == 1
        dl = DataLoader2(IterableWrapper(range(n)).sharding_filter().cached_map(double), reading_service=remote(server, 2))
        try:
            epochs = [list(dl) for _ in range(2)]
            assert sorted(epochs[1]) == [2 * x for x in range(n)]

            # Sessions publish at least once a second: wait for the second epoch's last items.
            now = {}
            assert wait_until(lambda: now.update(scrape(url)) or worker_value(now, "items_sent_total") == 2 * n, 10), now
            assert worker_value(now, "sessions_open") == 2 and worker_value(now, "sessions_total") == 2
            assert worker_value(now, "cache_misses_total") == n  # the first epoch computed every item once
            assert worker_value(now, "cache_hits_total", tier="memory") == n  # the second found them all
            assert worker_value(now, "cache_hits_total", tier="disk") == 0
            assert worker_value(now, "sent_bytes_total") > 0
        finally:
            dl.shutdown()
        # Ended sessions leave the open count; their counts stay in the totals.
        after = {}
        assert wait_until(lambda: after.update(scrape(url)) or worker_value(after, "sessions_open") == 0, 10), after
        for name in ("sessions_total", "items_sent_total", "sent_bytes_total", "cache_misses_total"):
            assert worker_value(after, name) == worker_value(now, name), name
        assert worker_value(after, "cache_hits_total", tier="memory") == n
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)  # the endpoint ended with the server


def _version() -> str:
    from rpc_reading_service import __version__

    return __version__


def quarter_mib(index: int) -> bytes:
    """An item of 256 KiB: four of them fill the credit window of ``prefetch=1`` (1 MiB)."""
    return bytes(256 << 10)


@pytest.mark.timeout(90)
def test_time_a_session_waits_for_trainer_credit_counts_while_it_waits(tmp_path):
    server = start_server(tmp_path, ["--metrics-port", "0"])
    try:
        url = metrics_url(server)
        service = remote(server, 1, prefetch=1)
        dl = DataLoader2(IterableWrapper(range(10_000)).map(quarter_mib), reading_service=service)
        try:
            it = iter(dl)
            next(it)  # the worker fills its one frame's worth of credit and waits for the trainer
            seen = {}
            waited = lambda: seen.update(scrape(url)) or worker_value(seen, "credit_wait_seconds_total") >= 0.5  # noqa: E731
            assert wait_until(waited, 15), seen
            assert worker_value(seen, "sessions_open") == 1
        finally:
            dl.shutdown()
    finally:
        server.stop()


def trainer_value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(f"rpc_reading_service_{name}", tuple(sorted(labels.items())))]


@pytest.mark.timeout(90)
def test_the_trainers_metrics_match_its_stats(worker_server):
    dl = DataLoader2(IterableWrapper(range(50)).sharding_filter(), reading_service=remote(worker_server, 2))
    try:
        with serve_metrics(dl, port=0) as endpoint:  # the DataLoader2 itself, or dl.reading_service
            assert endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
            assert trainer_value(scrape(endpoint.url), "items_total") == 0  # before the first epoch
            it = iter(dl)
            for _ in range(20):
                next(it)
            mid, stats = scrape(endpoint.url), dl.reading_service.stats()
            assert trainer_value(mid, "items_total") == stats.items == 20
            assert trainer_value(mid, "sessions") == 2 and trainer_value(mid, "epoch") == 0
            for worker in stats.workers:
                labels = {"worker": str(worker.rank), "address": worker.address}
                assert trainer_value(mid, "worker_items_total", **labels) == worker.items_consumed
            assert sum(trainer_value(mid, "worker_items_total", worker=str(w.rank), address=w.address) for w in stats.workers) == 20
            list(it)  # the rest of the epoch: its numbers stand still now
            end, stats = scrape(endpoint.url), dl.reading_service.stats()
            assert trainer_value(end, "items_total") == stats.items == 50
            assert trainer_value(end, "data_stall_ratio") == pytest.approx(stats.data_stall, rel=1e-12)
            assert trainer_value(end, "wait_seconds_total") == pytest.approx(stats.wait_seconds, rel=1e-12)
            assert trainer_value(end, "epoch_elapsed_seconds") == pytest.approx(stats.elapsed_seconds, rel=1e-12)
            assert trainer_value(end, "reassignments_total") == 0
            for worker in stats.workers:
                labels = {"worker": str(worker.rank), "address": worker.address}
                assert trainer_value(end, "worker_items_total", **labels) == worker.items_consumed
                assert trainer_value(end, "worker_received_bytes_total", **labels) == worker.bytes_received
                assert trainer_value(end, "worker_wait_seconds_total", **labels) == pytest.approx(worker.wait_seconds, rel=1e-12)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(endpoint.url.replace("/metrics", "/other"), timeout=10)
            assert refused.value.code == 404

            # The same numbers through a collector in the user's own registry.
            registry = CollectorRegistry()
            registry.register(ReadingServiceCollector(dl.reading_service))
            own = parse(generate_latest(registry).decode())
            assert trainer_value(own, "data_stall_ratio") == trainer_value(end, "data_stall_ratio")
            assert own.keys() == end.keys()
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(endpoint.url, timeout=5)  # closed: its thread joined (the thread guard checks)
    finally:
        dl.shutdown()
    with pytest.raises(TypeError, match="RPCReadingService"):
        ReadingServiceCollector(object())


@pytest.mark.timeout(120)
def test_reassignments_are_counted(tmp_path):
    service = RPCReadingService(num_workers=2, on_worker_failure="reassign", timeout=5.0)
    graph = IterableWrapper(range(40)).sharding_filter().map(ExitOnce(tmp_path / "exited", 21))
    with DataLoader2(graph, reading_service=service) as dl:
        assert sorted(dl) == list(range(40))
        stats = dl.reading_service.stats()
        assert stats.reassignments == 1
        registry = CollectorRegistry()
        registry.register(ReadingServiceCollector(dl))
        assert trainer_value(parse(generate_latest(registry).decode()), "reassignments_total") == 1


@pytest.mark.timeout(60)
def test_without_prometheus_client_the_package_works_and_metrics_say_what_to_install():
    script = """
import sys
import time
sys.modules["prometheus_client"] = None  # as if not installed
import rpc_reading_service as rrs
from rpc_reading_service.worker import main
for ask in (lambda: rrs.serve_metrics(object()), lambda: rrs.ReadingServiceCollector(object())):
    try:
        ask()
    except rrs.MissingDependencyError as exc:
        assert isinstance(exc, ImportError), type(exc).__mro__
        print("error:", exc)
print("exit", main(["--port", "0", "--metrics-port", "0"]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=45,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    hint = "pip install 'rpc-reading-service[metrics]'"
    lines = done.stdout.splitlines()
    assert [line.split(" needs ")[0] for line in lines[:2]] == ["error: serve_metrics", "error: the reading service's metrics"]
    assert all(hint in line for line in lines[:2]), lines
    assert lines[2] == "exit 2"  # the worker refused to start, and said why
    assert "rpc-reading-worker: error: --metrics-port needs the prometheus_client package" in done.stderr
    assert hint in done.stderr


@pytest.mark.timeout(60)
def test_a_metrics_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match=f"cannot serve metrics on 127.0.0.1:{port}: .*Pick another port"):
            MetricsEndpoint(CollectorRegistry(), "127.0.0.1", port)
        (run,) = worker_cli_runs([["--port", "0", "--metrics-port", str(port)]])
    assert run.returncode == 2
    assert f"rpc-reading-worker: error: cannot serve metrics on 127.0.0.1:{port}" in run.stderr


def listening_ports() -> set:
    """The TCP ports (IPv4 and IPv6) on which a socket of this network namespace listens."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A":  # TCP_LISTEN
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.timeout(30)
def test_a_forked_child_keeps_no_socket_of_the_endpoint():
    """A session forked while the server serves metrics must not hold the metrics port: else a
    restarted server could not bind it while old sessions run, and a scrape could wait on a child."""
    endpoint = MetricsEndpoint(CollectorRegistry())
    port = endpoint.port
    assert scrape(endpoint.url) == {}
    release_r, release_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: say it runs (its fork hooks ran), then hold on until released
        try:
            os.close(release_w)
            os.write(ready_w, b"r")
            os.read(release_r, 1)
        finally:
            os._exit(0)
    try:
        os.close(release_r)
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"r"  # the fork hooks run in the child after the parent's fork returns
        endpoint.close()
        # nothing listens on the port although the child still runs (a bind could also meet another
        # test's connection that the OS gave the same local port)
        assert port not in listening_ports()
    finally:
        os.close(release_w)
        os.close(ready_r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.timeout(30)
def test_a_scraper_that_sends_nothing_delays_no_other_scrape_nor_close():
    """A connection left silent (a port scanner, a half-open probe) holds one thread until its
    timeout (10 s): other scrapes are answered meanwhile, and close() ends it at once."""
    endpoint = MetricsEndpoint(CollectorRegistry())
    silent = socket.create_connection(("127.0.0.1", endpoint.port))
    try:
        started = time.monotonic()
        assert scrape(endpoint.url) == {}
        assert time.monotonic() - started < 5  # before: ~10 s, the silent connection's timeout
        started = time.monotonic()
        endpoint.close()
        assert time.monotonic() - started < 5
        silent.settimeout(5)
        assert silent.recv(1) == b""  # the endpoint shut the silent connection down
    finally:
        silent.close()
        endpoint.close()


@pytest.mark.timeout(30)
def test_connections_beyond_the_limit_are_closed_unanswered_and_the_endpoint_recovers():
    endpoint = MetricsEndpoint(CollectorRegistry())
    silent = [socket.create_connection(("127.0.0.1", endpoint.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = socket.create_connection(("127.0.0.1", endpoint.port))
        with extra:
            extra.settimeout(5)
            assert extra.recv(1) == b""  # accepted after the silent ones, closed: no thread for it
        silent.pop().close()  # one thread free again once the endpoint sees it closed

        def answered() -> bool:
            try:
                return scrape(endpoint.url) == {}
            except OSError:  # closed unanswered while the thread still ran (URLError is an OSError)
                return False

        assert wait_until(answered, 10)
    finally:
        for connection in silent:
            connection.close()
        endpoint.close()
