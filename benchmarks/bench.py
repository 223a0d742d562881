#!/usr/bin/env python
"""Side-by-side benchmark of RPCReadingService and the alternatives.

One command measures every contender on every scenario in one run and prints a
plain-text table per scenario (measured value, ratios), then a table of targets::

    python benchmarks/bench.py                  # full run
    python benchmarks/bench.py --quick          # smaller sizes, fewer points
    python benchmarks/bench.py --scenario tiny --contender MPRS --contender RPCRS-tcp
    python benchmarks/bench.py --scenario tensor8m --json out.json --plot out.png

Contenders: ``in-process`` (plain iteration of the graph), ``MPRS`` (torchdata
MultiProcessingReadingService), ``RPCRS-local`` / ``RPCRS-torch_rpc``
(RPCReadingService with local workers, socket / torch_rpc transport), ``RPCRS-tcp``
(RPCReadingService with ``worker_addresses=[addr] * W``: all W sessions on ONE
``python -m rpc_reading_service.worker`` that the benchmark starts itself, as a
deployment runs one worker server per host), ``RPCDataloader`` (the rpcdataloader
package, map-style, one ``python -m rpcdataloader.launch`` process per worker, as its
README says), ``raw-socket`` (sendall / recv_into over loopback TCP, one stream: the
transport limit) and ``raw-unix`` (the same over a Unix socket, the path RPCRS-local
takes to its local server).

Scenarios: ``tiny`` (items/s, W=2), ``tensor1m`` / ``tensor8m`` (GB/s; the reading
services at W=1 and W=2), ``scaling`` (a sleep-bound stage at W = 1..16), ``memory``
(trainer peak RSS with a slow consumer), ``first_item`` (loader construction to first
item).  Then a table of targets (PASS / MISS with the measured ratio and both rates).

How it measures:

* Every (scenario, contender) runs in a forked child process in its own process group,
  with a timeout; on exit, error, timeout or Ctrl-C the whole group is killed and
  reaped.  A contender that is missing or fails is printed as ``n/a (reason)``.
* Throughputs are steady-state: counted from the first item received (worker startup
  is what the ``first_item`` scenario measures).  GB/s uses 1 GB = 1e9 bytes.
* Each received buffer has its first and last byte read, so lazy transfers cannot
  cheat.  Slow contenders get shorter epochs (item caps) and stop at a time budget;
  their rate is computed from what they did.  MPRS always runs its epoch to the end
  (its mid-epoch shutdown can hang).
* Full run: the throughput scenarios (tiny, tensor1m, tensor8m) run in two rounds,
  every contender once per round, interleaved, and keep each (contender, W)'s best
  round; every round's rate is printed.  A burst of load from other jobs then hits
  all contenders alike instead of one.
* Worker servers (one RPCRS server, two rpcdataloader launchers) are started once,
  before the clock starts, as they would be in a deployment, and reused by every
  scenario.  A failed task restarts its contender's servers.
* The trainer (the measuring child) runs torch with one intra-op thread.
* The machine's load average is printed: other jobs on a 2-core box move every number.
  Cost measured on the 2-core machine at a load of 1-3: full run ~100 s, --quick ~35 s.  Per-task
  wall and CPU times go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import math
import multiprocessing
import os
import platform
import re
import resource
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from workloads import MIB, Workload, build_datapipe, MapDataset  # noqa: E402

GB = 1e9
SERVER_START_TIMEOUT_S = 120.0  # a server importing torch on 2 cores busy with other jobs
LISTENING_RE = re.compile(rb"listening on (\S+):(\d+)")

# --------------------------------------------------------------------------------------
# Process helpers: everything started here dies with its parent and is reaped.
# --------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    """Call prctl(2) if libc is reachable (Linux); otherwise do nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (preexec_fn)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(cmd: list[str], env: Optional[dict] = None, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    """Start a helper process that is killed if the process starting it dies.

    Its stderr goes where its stdout goes.
    """
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float = 3.0) -> None:
    """Terminate, then kill after ``grace_s``, and reap every process in ``procs``."""
    procs = [p for p in procs if p is not None]
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(ready: Callable[[], Optional[str]], proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    """Poll ``ready()`` until it returns an address; fail if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        address = ready()
        if address:
            return address
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited (code {proc.returncode}) before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s")
        time.sleep(0.02)


def listening_line(log_path: str) -> Callable[[], Optional[str]]:
    """A readiness check: ``HOST:PORT`` once ``listening on HOST:PORT`` is in the log."""
    def ready() -> Optional[str]:
        with open(log_path, "rb") as log:
            match = LISTENING_RE.search(log.read(65536))
        return f"{match.group(1).decode()}:{match.group(2).decode()}" if match else None
    return ready


def accepts_connections(address: str) -> Callable[[], Optional[str]]:
    """A readiness check: ``address`` once a TCP connection to it succeeds."""
    host, port = address.rsplit(":", 1)

    def ready() -> Optional[str]:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return None
        return address
    return ready


Launch = Callable[[str], tuple[subprocess.Popen, Callable[[], Optional[str]], str]]


class ServerPool:
    """Long-lived worker servers of one kind, shared by all the tasks of a contender.

    Servers are started untimed, as in a deployment, and reused across scenarios (a
    worker server serves many sessions).  ``ensure(n)`` grows the pool to ``n`` servers,
    starting the missing ones in parallel; ``stop()`` kills and reaps them all.  Used
    from the parent process only.  ``launch(log_path)`` starts one server and returns
    ``(process, readiness check, what)``.
    """

    def __init__(self, name: str, launch: Launch, attempts: int = 3):
        self.name = name
        self.launch = launch
        self.attempts = attempts
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.log_dir = tempfile.mkdtemp(prefix=f"bench-{name}-")

    def ensure(self, count: int) -> list[str]:
        """Start servers until ``count`` run; return their ``host:port`` addresses."""
        for attempt in range(self.attempts):
            missing = count - len(self.procs)
            if missing <= 0:
                break
            launched = [self.launch(os.path.join(self.log_dir, f"server-{len(self.procs) + i}-{attempt}.log"))
                        for i in range(missing)]
            failure: Optional[BaseException] = None
            for proc, ready, what in launched:
                try:
                    address = wait_until(ready, proc, SERVER_START_TIMEOUT_S, what)
                except RuntimeError as exc:  # exited early (e.g. its port was taken): retry
                    stop_processes([proc])
                    failure = exc
                    continue
                except BaseException:
                    stop_processes(p for p, _, _ in launched)
                    raise
                self.procs.append(proc)
                self.addresses.append(address)
            if failure is not None and attempt == self.attempts - 1:
                raise failure
        return self.addresses[:count]

    def pids(self) -> set[int]:
        return {p.pid for p in self.procs}

    def stop(self) -> None:
        stop_processes(self.procs)
        self.procs, self.addresses = [], []


def launch_rpcrs_server(auth_key: str) -> Launch:
    """How to start one ``python -m rpc_reading_service.worker --port 0``: it prints
    ``listening on HOST:PORT`` (to a log file here) once ready."""
    def launch(log_path: str):
        env = dict(os.environ, RPC_READING_SERVICE_AUTH_KEY=auth_key)
        cmd = [sys.executable, "-m", "rpc_reading_service.worker", "--host", "127.0.0.1", "--port", "0"]
        with open(log_path, "wb") as log:
            proc = spawn(cmd, env=env, stdout=log)
        return proc, listening_line(log_path), "RPCRS worker server"
    return launch


def launch_rpcdataloader_server(log_path: str):
    """How to start one ``python -m rpcdataloader.launch`` (as its README says) on a free
    port.  The launcher prints nothing, so readiness is a successful TCP connect."""
    port = free_port()
    cmd = [sys.executable, "-m", "rpcdataloader.launch", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = spawn(cmd, stdout=log)
    return proc, accepts_connections(f"127.0.0.1:{port}"), "rpcdataloader worker"


# --------------------------------------------------------------------------------------
# Contenders (used only inside the measuring child process)
# --------------------------------------------------------------------------------------


class Contender:
    """One way of running an epoch of a workload.

    ``servers`` (RPCRS-tcp, RPCDataloader) holds the addresses of worker servers that
    the parent started ahead of time, untimed.  ``epoch`` builds the loader (timed: it is
    part of the time to the first item), yields an iterable of items, and shuts it down.
    """

    name = "?"
    stops_early_cleanly = True  # may an epoch be abandoned when the time budget runs out?

    def __init__(self, servers: Optional[dict] = None):
        self.servers = servers or {}

    @contextlib.contextmanager
    def epoch(self, workload: Workload, num_workers: int) -> Iterator[Iterable]:
        raise NotImplementedError


class InProcess(Contender):
    """Plain iteration of the DataPipe graph, no reading service."""

    name = "in-process"

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        yield build_datapipe(workload)


class DataLoader2Contender(Contender):
    """``DataLoader2(graph, reading_service=...)``; subclasses make the reading service."""

    def reading_service(self, num_workers: int):
        raise NotImplementedError

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        from torchdata.dataloader2 import DataLoader2

        loader = DataLoader2(build_datapipe(workload), reading_service=self.reading_service(num_workers))
        try:
            yield loader
        finally:
            loader.shutdown()


class MPRS(DataLoader2Contender):
    """torchdata's MultiProcessingReadingService, default settings.

    Its shutdown in the middle of an epoch can hang (meta-pytorch/data#1228 family), so
    its epochs always run to their end: workloads are sized (item caps) to finish.
    """

    name = "MPRS"
    stops_early_cleanly = False

    def reading_service(self, num_workers):
        from torchdata.dataloader2 import MultiProcessingReadingService

        return MultiProcessingReadingService(num_workers=num_workers)


class RPCRSLocal(DataLoader2Contender):
    """RPCReadingService with ``num_workers`` local workers (socket transport)."""

    name = "RPCRS-local"
    transport = "socket"

    def reading_service(self, num_workers):
        from rpc_reading_service import RPCReadingService

        if self.transport == "socket":
            return RPCReadingService(num_workers=num_workers)
        return RPCReadingService(num_workers=num_workers, transport=self.transport)


class RPCRSTorchRPC(RPCRSLocal):
    """RPCReadingService with local workers over the torch_rpc transport."""

    name = "RPCRS-torch_rpc"
    transport = "torch_rpc"


class RPCRSTcp(DataLoader2Contender):
    """RPCReadingService against ONE running ``python -m rpc_reading_service.worker``.

    As in a deployment (one ``rpc-reading-worker`` per host): the server forks one
    session process per worker, so all ``num_workers`` sessions name the same address.
    """

    name = "RPCRS-tcp"

    def reading_service(self, num_workers):
        from rpc_reading_service import RPCReadingService

        (address,) = self.servers["addresses"]
        return RPCReadingService(worker_addresses=[address] * num_workers, auth_key=self.servers["auth_key"])


class RPCDataloaderContender(Contender):
    """rpcdataloader 0.2.1: a map-style dataset on running ``rpcdataloader.launch`` workers."""

    name = "RPCDataloader"
    network_timeout_s = 60

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        import rpcdataloader

        dataset = rpcdataloader.RPCDataset(self.servers["addresses"][:num_workers], MapDataset,
                                           workload.to_dict())
        loader = rpcdataloader.RPCDataloader(dataset, batch_size=None, timeout=self.network_timeout_s)
        try:
            yield loader
        finally:
            del loader, dataset
            gc.collect()  # its remote-handle finalizers free the remote datasets


class RawSocket(Contender):
    """The transport limit: a sender process ``sendall``s one buffer per item over
    loopback TCP; this process ``recv_into``s a preallocated bytearray."""

    name = "raw-socket"
    family = socket.AF_INET

    @contextlib.contextmanager
    def listen(self) -> Iterator[tuple[socket.socket, str]]:
        """A listening socket and the address the sender dials."""
        with socket.create_server(("127.0.0.1", 0)) as listener:
            yield listener, f"tcp:{listener.getsockname()[1]}"

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        if workload.kind != "tensor":
            raise ValueError(f"{self.name} only moves byte buffers")
        nbytes, count = workload.item_bytes, workload.n_items
        with self.listen() as (listener, address):
            listener.settimeout(SERVER_START_TIMEOUT_S)
            sender = spawn([sys.executable, "-m", "workloads", "raw-sender", address, str(nbytes), str(count)])
            try:
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(SERVER_START_TIMEOUT_S)
                    yield self._receive(conn, nbytes, count)
            finally:
                stop_processes([sender])

    @staticmethod
    def _receive(conn: socket.socket, nbytes: int, count: int) -> Iterator[bytearray]:
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        for _ in range(count):
            received = 0
            while received < nbytes:
                n = conn.recv_into(view[received:])
                if not n:
                    raise ConnectionError("raw sender closed early")
                received += n
            yield buffer


class RawUnixSocket(RawSocket):
    """The same over a Unix domain socket: the limit for local workers, which
    RPCReadingService(num_workers=N) reaches through a Unix socket."""

    name = "raw-unix"

    @contextlib.contextmanager
    def listen(self):
        with tempfile.TemporaryDirectory(prefix="bench-unix-") as directory:
            path = os.path.join(directory, "raw.sock")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                listener.bind(path)
                listener.listen(1)
                yield listener, f"unix:{path}"


CONTENDERS: dict[str, type[Contender]] = {
    c.name: c for c in (InProcess, MPRS, RPCRSLocal, RPCRSTcp, RPCRSTorchRPC, RPCDataloaderContender,
                        RawSocket, RawUnixSocket)
}


# --------------------------------------------------------------------------------------
# Measurement primitives (child side)
# --------------------------------------------------------------------------------------


def touch(item) -> int:
    """Read the first and last byte of a received buffer; return its size in bytes."""
    if type(item) is int:  # fast path: the per-item overhead caps the rates measured on tiny
        return 0
    import torch

    if isinstance(item, torch.Tensor):
        flat = item.reshape(-1)
        if flat.numel():
            int(flat[0]), int(flat[-1])
        return flat.numel() * flat.element_size()
    if isinstance(item, (bytes, bytearray, memoryview)):
        if len(item):
            item[0], item[-1]
        return len(item)
    return 0


def read_all(item) -> int:
    """Read every byte of a received tensor (a consumer that uses its data)."""
    import torch

    if isinstance(item, torch.Tensor):
        item.reshape(-1).sum()
    return touch(item)


def drain(contender: Contender, workload: Workload, num_workers: int, budget_s: float,
          consume: Callable[[Any], int] = touch, consumer_sleep_s: float = 0.0,
          warmup_fraction: float = 0.0) -> dict:
    """Run one epoch and time it.

    Stops after ``budget_s`` seconds of items (unless the contender cannot stop early
    cleanly).  The rate is steady-state: counted from the item at ``warmup_fraction``
    of the epoch (the first item by default).
    """
    warmup_items = max(1, int(workload.n_items * warmup_fraction))
    items = nbytes = 0
    start_items = start_bytes = 0
    t_first = t_start = None
    stopped_by_budget = False
    item = None
    t0 = time.perf_counter()
    with contender.epoch(workload, num_workers) as loader:
        for item in loader:
            size = consume(item)
            now = time.perf_counter()
            items += 1
            nbytes += size
            if t_first is None:
                t_first = now
            if items == warmup_items:
                t_start, start_items, start_bytes = now, items, nbytes
            if consumer_sleep_s:
                time.sleep(consumer_sleep_s)
            if now - t_first > budget_s and items < workload.n_items and contender.stops_early_cleanly:
                stopped_by_budget = True
                break
        t_end = time.perf_counter()
        del item
    t_closed = time.perf_counter()
    steady_s = (t_end - t_start) if t_start is not None else 0.0
    steady_items = items - start_items
    return {
        "items": items,
        "bytes": nbytes,
        "first_item_s": (t_first - t0) if t_first is not None else None,
        "steady_s": steady_s,
        "total_s": t_end - t0,
        "shutdown_s": t_closed - t_end,
        "items_per_s": steady_items / steady_s if steady_items > 0 and steady_s > 0 else None,
        "bytes_per_s": (nbytes - start_bytes) / steady_s if steady_items > 0 and steady_s > 0 else None,
        "stopped_by_budget": stopped_by_budget,
        "expected_items": workload.n_items,
    }


def rss_kib(field: str = "VmRSS") -> Optional[int]:
    """A ``/proc/self/status`` memory field in KiB (VmRSS, VmHWM), or None."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakRss:
    """Peak resident memory of this process while the ``with`` block runs.

    Resets the kernel's peak (VmHWM) on entry where allowed, and samples VmRSS from a
    background thread every ``interval_s``; the peak is the larger of both.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, rss_kib() or 0)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakRss":
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # reset VmHWM to the current RSS
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.hwm_reset:
            self.peak_kib = max(self.peak_kib, rss_kib("VmHWM") or 0)


# --------------------------------------------------------------------------------------
# Scenario measurements (child side): (contender, params, emit) -> data
# --------------------------------------------------------------------------------------


def worker_counts(params: dict, name: str) -> list[int]:
    """The worker counts contender ``name`` runs in a scenario, smallest first."""
    if "workers_list" in params:
        return list(params["workers_list"])
    counts = (params.get("workers_by_contender") or {}).get(name, params.get("workers", 1))
    return list(counts) if isinstance(counts, (list, tuple)) else [counts]


def measure_throughput(contender: Contender, params: dict, emit: Callable[[dict], None]) -> dict:
    """One epoch of ``params['workload']`` per worker count of the contender
    (:func:`worker_counts`); one point per count.

    A contender in ``params['item_caps']`` runs a shorter epoch: slow ones finish in
    seconds, and MPRS must run its epochs to their end (see :class:`MPRS`).
    """
    workload = Workload.from_dict(params["workload"])
    cap = params.get("item_caps", {}).get(contender.name)
    if cap:
        workload = dataclasses.replace(workload, n_items=min(cap, workload.n_items))
    points = []
    for workers in worker_counts(params, contender.name):
        try:
            point = drain(contender, workload, workers, params["budget_s"])
        except Exception as exc:  # one broken worker count must not hide the others
            point = {"error": describe_exception(exc)}
        point["workers"] = workers
        emit(point)
        points.append(point)
    if all("error" in p for p in points):
        raise RuntimeError(points[0]["error"])
    return {"points": points}


def measure_scaling(contender: Contender, params: dict, emit: Callable[[dict], None]) -> dict:
    """One epoch of the sleep-bound stage per worker count; efficiency vs W / sleep."""
    points = []
    for workers in params["workers_list"]:
        workload = Workload("sleep", int(workers * params["point_s"] / params["sleep_s"]) + workers,
                            sleep_s=params["sleep_s"])
        try:
            point = drain(contender, workload, workers, params["budget_s"], warmup_fraction=0.1)
            ideal = workers / params["sleep_s"]
            point["efficiency"] = point["items_per_s"] / ideal if point["items_per_s"] else None
        except Exception as exc:  # one broken worker count must not hide the others
            point = {"error": describe_exception(exc)}
        point["workers"] = workers
        emit(point)
        points.append(point)
    return {"points": points}


def warm_up_consumer(workload: Workload, items: int = 64) -> None:
    """Run the consumer on local items first, so that torch's thread pool and the
    allocator's arenas (tens of MiB, whoever the contender) are in the baseline."""
    from workloads import item_function

    make = item_function(workload)
    for index in range(items):
        read_all(make(index))


def measure_memory(contender: Contender, params: dict, emit: Callable[[dict], None]) -> dict:
    """Peak trainer RSS above baseline while a slow consumer reads 1 MiB tensors."""
    workload = Workload.from_dict(params["workload"])
    warm_up_consumer(workload)
    gc.collect()
    baseline = rss_kib() or 0
    with PeakRss() as peak:
        data = drain(contender, workload, params["workers"], params["budget_s"],
                     consume=read_all, consumer_sleep_s=params["consumer_sleep_s"])
    data.update(baseline_mib=baseline / 1024, peak_mib=peak.peak_kib / 1024,
                growth_mib=max(0, peak.peak_kib - baseline) / 1024)
    return data


def measure_first_item(contender: Contender, params: dict, emit: Callable[[dict], None]) -> dict:
    """Time from building the loader (DataLoader2 init, worker startup) to the first item."""
    workload = Workload.from_dict(params["workload"])
    first, shutdown = [], []
    for _ in range(params["repeats"]):
        t0 = time.perf_counter()
        with contender.epoch(workload, params["workers"]) as loader:
            iterator = iter(loader)
            next(iterator)
            t1 = time.perf_counter()
            for _ in iterator:  # finish the short epoch: MPRS can hang if shut down mid-epoch
                pass
            t2 = time.perf_counter()
            del iterator
        shutdown.append(time.perf_counter() - t2)
        first.append(t1 - t0)
    return {
        "cold_s": first[0],
        "warm_s": statistics.median(first[1:]) if len(first) > 1 else None,
        "all_s": first,
        "shutdown_s": statistics.median(shutdown),
    }


# --------------------------------------------------------------------------------------
# Child processes: fork, own process group, result over a pipe, timeout, cleanup
# --------------------------------------------------------------------------------------


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0] if text else type(exc).__name__


def probe() -> dict:
    """Versions and which contenders can run here (import / construction checks)."""
    import torch
    import torchdata

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "torchdata": torchdata.__version__, "cpus": os.cpu_count(), "unavailable": {},
    }
    try:
        import rpc_reading_service
        from rpc_reading_service import RPCReadingService

        info["rpc_reading_service"] = os.path.dirname(rpc_reading_service.__file__)
        RPCReadingService(num_workers=1)
    except Exception as exc:
        for name in ("RPCRS-local", "RPCRS-tcp", "RPCRS-torch_rpc"):
            info["unavailable"][name] = describe_exception(exc)
    else:
        transports = getattr(rpc_reading_service, "available_transports", lambda: ["socket"])()
        info["transports"] = list(transports)
        if "torch_rpc" not in transports:
            info["unavailable"]["RPCRS-torch_rpc"] = (f"transport 'torch_rpc' not available; "
                                                      f"available: {', '.join(transports)}")
    try:
        import importlib.metadata

        import rpcdataloader  # noqa: F401

        info["rpcdataloader"] = importlib.metadata.version("rpcdataloader")
    except Exception as exc:
        info["unavailable"]["RPCDataloader"] = describe_exception(exc)
    return info


def execute(task: dict, emit: Callable[[dict], None]) -> Any:
    """Run one task inside the child: a probe, or one contender on one scenario."""
    if task["kind"] == "probe":
        return probe()
    contender = CONTENDERS[task["contender"]](task.get("servers"))
    return SCENARIOS[task["scenario"]].measure(contender, task["params"], emit)


def _child_main(task: dict, conn, log_path: Optional[str]) -> None:
    """Entry point of a forked child: new process group, quiet output, send outcome."""
    os.setsid()
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    torch.set_num_threads(1)  # no OpenMP threads spinning in the trainer: it only moves data
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        outcome = {"ok": True, "data": execute(task, lambda point: conn.send({"partial": point}))}
    except BaseException as exc:
        outcome = {"ok": False, "reason": describe_exception(exc), "traceback": traceback.format_exc()}
    conn.send(outcome)
    conn.close()


def _tail(path: Optional[str], lines: int = 1) -> str:
    """The last non-empty lines of a log file."""
    if not path:
        return ""
    try:
        with open(path, errors="replace") as log:
            content = [line.rstrip() for line in log if line.strip()]
    except OSError:
        return ""
    return " | ".join(content[-lines:])


def kill_process_group(pgid: int) -> None:
    """SIGKILL what is left of a child's process group (by its id)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def reap_adopted_children(keep: set[int]) -> None:
    """Kill and reap descendants that were re-parented to this (subreaper) process.

    Called when no task child is running, so every child not in ``keep`` (the server
    pools) is an orphan of one.
    """
    for task_dir in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task_dir}/children") as children:
                pids = [int(p) for p in children.read().split()]
        except OSError:
            continue
        for pid in pids:
            if pid in keep:
                continue
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def wait_exit_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for child ``pid`` to exit, leaving it unreaped: while it
    is a zombie its pid, hence its process-group id, cannot be reused by anyone else."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def stop_child(proc: multiprocessing.process.BaseProcess, finished: bool) -> Optional[int]:
    """Let a child that sent its result exit by itself, then SIGTERM and SIGKILL what
    is left of its process group (MPRS workers, raw sender...); reap it, return its
    exit code."""
    if finished:
        wait_exit_unreaped(proc.pid, 3)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    wait_exit_unreaped(proc.pid, 3)
    kill_process_group(proc.pid)
    proc.join()
    return proc.exitcode


def run_task(task: dict, timeout_s: float, verbose: bool = False,
             on_partial: Optional[Callable[[dict], None]] = None, keep: frozenset = frozenset()) -> dict:
    """Run ``task`` in a forked child with a timeout; always kill and reap its processes.

    Returns ``{"ok": True, "data": ...}`` or ``{"ok": False, "reason": ...}``, plus
    ``"partial"`` (points the child reported before it finished) and ``"wall_s"``.
    """
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    log_fd, log_path = (None, None) if verbose else tempfile.mkstemp(prefix="bench-", suffix=".log")
    if log_fd is not None:
        os.close(log_fd)
    proc = context.Process(target=_child_main, args=(task, sender, log_path), daemon=False)
    partial: list = []
    outcome: Optional[dict] = None
    t0 = time.monotonic()
    proc.start()
    sender.close()
    try:
        deadline = t0 + timeout_s
        while outcome is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                outcome = {"ok": False, "reason": f"timeout after {timeout_s:.0f} s"}
            elif receiver.poll(min(remaining, 0.5)):
                try:
                    message = receiver.recv()
                except EOFError:
                    outcome = {"ok": False, "reason": "child died", "died": True}
                    continue
                if "partial" in message:
                    partial.append(message["partial"])
                    if on_partial:
                        on_partial(message["partial"])
                else:
                    outcome = message
    finally:
        exit_code = stop_child(proc, finished=outcome is not None and "data" in outcome)
        reap_adopted_children(keep)
        receiver.close()
        if log_path:
            if outcome is not None and not outcome.get("ok"):
                outcome.setdefault("log_tail", _tail(log_path, 15))
                if outcome.pop("died", False):
                    tail = _tail(log_path)
                    outcome["reason"] = f"child died (exit code {exit_code})" + (f": {tail}" if tail else "")
            with contextlib.suppress(OSError):
                os.unlink(log_path)
    outcome["partial"] = partial
    outcome["wall_s"] = time.monotonic() - t0
    return outcome


# --------------------------------------------------------------------------------------
# Scenarios: plan (parent), measure (child), report (parent)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Scenario:
    """A named measurement: which contenders, their parameters, how to report them."""

    name: str
    contenders: tuple[str, ...]
    plan: Callable[[bool], dict]
    measure: Callable[[Contender, dict, Callable], dict]
    report: Callable[["Scenario", dict, dict], str]
    timeout_s: Callable[[dict], float]


SLOW_ON_TINY_ITEMS = ("MPRS", "RPCDataloader")  # ~1-2k items/s: capped so they finish in seconds


ROUNDS = 2  # full run: throughput scenarios run every contender twice, interleaved; best round kept


def plan_tiny(quick: bool) -> dict:
    n, cap = (50_000, 1_500) if quick else (150_000, 3_000)
    return {"workload": Workload("ints", n).to_dict(), "workers": 2, "budget_s": 1.5 if quick else 3.0,
            "item_caps": {name: cap for name in SLOW_ON_TINY_ITEMS},
            "rounds": 1 if quick else ROUNDS, "rate_key": "items_per_s"}


ONE_STREAM = ("raw-socket", "raw-unix", "in-process")  # not reading services: no worker count


def plan_tensor(mib: int) -> Callable[[bool], dict]:
    """Bandwidth: the reading services at W=1 and W=2.  W=1 is one stream, as the raw
    socket limit; W=2 puts three busy processes (trainer + 2 workers) on a 2-core box."""
    def plan(quick: bool) -> dict:
        total = (512 if quick else 768) * MIB
        both = [1, 2]
        return {"workload": Workload("tensor", total // (mib * MIB), item_bytes=mib * MIB).to_dict(),
                "workers": [2],  # RPCRS-torch_rpc: one point, at the default W
                "workers_by_contender": {**{name: [1] for name in ONE_STREAM},
                                         **{name: both for name in ("MPRS", "RPCRS-local", "RPCRS-tcp",
                                                                    "RPCDataloader")}},
                # MPRS runs its epochs to the end (see MPRS): ~0.3-0.7 GB/s here, so a shorter one
                "item_caps": {"MPRS": total // 2 // (mib * MIB)},
                "budget_s": 1.0 if quick else 1.5, "rounds": 1 if quick else ROUNDS,
                "rate_key": "bytes_per_s"}
    return plan


def plan_scaling(quick: bool) -> dict:
    # RPCRS-tcp: the W sessions of every point run on ONE worker server (it forks a
    # process per session), as a deployment with one rpc-reading-worker per host.
    return {"workers_list": [1, 4, 16] if quick else [1, 2, 4, 8, 16], "sleep_s": 0.01,
            "point_s": 0.5 if quick else 1.0, "budget_s": 2.0 if quick else 3.0}


def plan_memory(quick: bool) -> dict:
    return {"workload": Workload("tensor", 100 if quick else 250, item_bytes=MIB).to_dict(),
            "workers": 2, "consumer_sleep_s": 0.005, "budget_s": 20.0}


def plan_first_item(quick: bool) -> dict:
    return {"workload": Workload("ints", 32).to_dict(), "workers": 2, "repeats": 2 if quick else 3}


STARTUP_ALLOWANCE_S = 40.0


def timeout_budgeted(params: dict) -> float:
    points = max(len(worker_counts(params, name)) for name in CONTENDERS)
    return STARTUP_ALLOWANCE_S + points * (10 + 2 * params["budget_s"])


def timeout_scaling(params: dict) -> float:
    return STARTUP_ALLOWANCE_S + len(params["workers_list"]) * (10 + 2 * params["budget_s"])


def timeout_first_item(params: dict) -> float:
    return STARTUP_ALLOWANCE_S + 20 * params["repeats"]


# ---- formatting ----------------------------------------------------------------------


def fmt_ratio(value: Optional[float]) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if value >= 100:
        return f"{value:,.0f}x"
    if value >= 10:
        return f"{value:.1f}x"
    if value >= 0.01:
        return f"{value:.2f}x"
    return f"{value:.2g}x"


def fmt_num(value: Optional[float], spec: str, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{spec}}{unit}"


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def na(outcome: dict, width: int = 90) -> str:
    """``n/a (reason)`` for a contender that did not produce a result."""
    reason = outcome.get("reason", "unknown")
    if len(reason) > width:
        reason = reason[: width - 3] + "..."
    return f"n/a ({reason})"


def render_table(title: str, headers: list[str], rows: list, notes: Iterable[str] = ()) -> str:
    """A plain-text table.  A row is a list of cells, or ``(first_cell, text)`` for a
    row whose text spans all the other columns (``n/a (...)``)."""
    widths = [len(h) for h in headers]
    for row in rows:
        cells = [row[0]] if isinstance(row, tuple) else row
        widths = [max(w, len(str(c))) for w, c in zip(widths, cells)] + widths[len(cells):]

    text_last = headers[-1] in ("note", "detail")  # a text column: left-aligned

    def line(cells: list[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        rest = [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:])]
        if text_last and len(cells) == len(headers):
            rest[-1] = str(cells[-1])
        return "  ".join([first] + rest).rstrip()

    out = [title, line(headers), line(["-" * w for w in widths])]
    for row in rows:
        out.append(f"{str(row[0]).ljust(widths[0])}  {row[1]}" if isinstance(row, tuple) else line(row))
    out.extend(f"  {note}" for note in notes)
    return "\n".join(out)


def value(results: dict, contender: str, key: str) -> Optional[float]:
    """``key`` of a contender's data in one scenario's results, or None."""
    outcome = results.get(contender) or {}
    return (outcome.get("data") or {}).get(key) if outcome.get("ok") else None


def rounds_text(data: dict, scale: float, spec: str) -> str:
    """Every round's rate of a point (the best one is the point's rate), or '-'."""
    rates = data.get("round_rates") or []
    if len(rates) < 2:
        return "-"
    return " / ".join(fmt_num(r / scale if r else None, spec) for r in rates)


def budget_note(data: dict) -> str:
    """Why an epoch has fewer items than it should: time budget, or items lost (a bug)."""
    if data.get("stopped_by_budget"):
        return "stopped at time budget"
    if data.get("items", 0) != data.get("expected_items", data.get("items")):
        return f"WRONG COUNT: {data['items']} of {data['expected_items']} items"
    return ""


# ---- per-scenario reports ------------------------------------------------------------


def points_of(results: dict, contender: str) -> list[dict]:
    """A contender's points in a per-worker-count scenario (partial ones if it failed)."""
    outcome = results.get(contender) or {}
    return (outcome.get("data") or {}).get("points") or outcome.get("partial") or []


def point_value(results: dict, contender: str, key: str, workers: int) -> Optional[float]:
    """``key`` of a contender's point at ``workers`` workers (one-stream contenders: any)."""
    for p in points_of(results, contender):
        if "error" not in p and (p.get("workers") == workers or contender in ONE_STREAM):
            return p.get(key)
    return None


def point_rows(results: dict, cells: Callable[[str, dict], list]) -> list:
    """One table row per (contender, worker count); ``n/a`` rows for failures."""
    rows = []
    for name, outcome in results.items():
        for p in points_of(results, name):
            label = f"{name} W={p['workers']}" if name not in ONE_STREAM else name
            rows.append((label, f"n/a ({p['error'][:90]})") if "error" in p else [label] + cells(name, p))
        if not outcome.get("ok"):
            rows.append((name, na(outcome)))
    return rows


def rounds_notes(params: dict) -> list[str]:
    if params.get("rounds", 1) < 2:
        return []
    return [f"rate: the best of {params['rounds']} rounds (all contenders once per round, interleaved; "
            f"'rounds' lists each round's rate); {', '.join(ONE_ROUND)}: one round"]


def report_tiny(scenario: Scenario, params: dict, results: dict) -> str:
    w = Workload.from_dict(params["workload"])
    base = point_value(results, "in-process", "items_per_s", 1)

    def cells(name: str, d: dict) -> list:
        mprs = point_value(results, "MPRS", "items_per_s", d["workers"])
        return [f"{d['items']:,}", fmt_num(d["steady_s"], ".2f", " s"), fmt_num(d["items_per_s"], ",.0f"),
                rounds_text(d, 1, ",.0f"), fmt_ratio(ratio(d["items_per_s"], mprs)),
                fmt_ratio(ratio(d["items_per_s"], base)), budget_note(d)]

    title = (f"== tiny: up to {w.n_items:,} small ints, IterableWrapper(range(N)).sharding_filter(), "
             f"W = {params['workers']} workers ==")
    caps = params.get("item_caps") or {}
    notes = ["vs MPRS: at the same W"] + rounds_notes(params)
    if caps:
        notes.append(f"{', '.join(caps)}: epoch capped at {min(caps.values()):,} items "
                     "(rate from what they did)")
    headers = ["contender", "items", "time", "items/s", "rounds", "vs MPRS", "vs in-process", "note"]
    return render_table(title, headers, point_rows(results, cells), notes=notes)


def report_tensor(scenario: Scenario, params: dict, results: dict) -> str:
    w = Workload.from_dict(params["workload"])
    raw = {ref: point_value(results, ref, "bytes_per_s", 1) for ref in ("raw-socket", "raw-unix")}

    def cells(name: str, d: dict) -> list:
        rate = d["bytes_per_s"]
        same_w = [point_value(results, ref, "bytes_per_s", d["workers"]) for ref in ("MPRS", "RPCDataloader")]
        return ([f"{d['items']:,}", fmt_num(d["bytes"] / GB, ".2f", " GB"),
                 fmt_num(rate / GB if rate else None, ".2f", " GB/s"), rounds_text(d, GB, ".2f")]
                + [fmt_ratio(ratio(rate, ref)) for ref in list(raw.values()) + same_w] + [budget_note(d)])

    title = (f"== {scenario.name}: {w.n_items} x {w.item_bytes // MIB} MiB torch.uint8 tensors made in the "
             f"workers, W = 1 and 2 workers ==")
    headers = ["contender", "items", "moved", "rate", "rounds", "vs raw-socket", "vs raw-unix",
               "vs MPRS (same W)", "vs RPCDataloader (same W)", "note"]
    return render_table(title, headers, point_rows(results, cells), notes=[
        "GB = 1e9 bytes; first and last byte of every item read",
        "raw-socket: one TCP stream over loopback; raw-unix: one Unix socket stream "
        "(RPCRS-local talks to its local server over a Unix socket, RPCRS-tcp over TCP to one worker server)",
        "raw-*: the receiver recv_into's one reused buffer (a 1 MiB one stays in the CPU cache); the reading "
        "services hand a fresh buffer to the consumer for every item",
        "W=1 is one stream, like the raw limits; "
        "at W=2 three busy processes (trainer + 2 workers) share 2 cores",
        "in-process moves nothing: it is the cost of making the items"] + rounds_notes(params)
        + [f"{', '.join(caps)}: epoch capped at {min(caps.values()):,} items (runs its epochs to the end)"
           for caps in [params.get("item_caps") or {}] if caps])


def report_scaling(scenario: Scenario, params: dict, results: dict) -> str:
    rows = []
    for name, outcome in results.items():
        points = (outcome.get("data") or {}).get("points") or outcome.get("partial") or []
        for p in points:
            if "error" in p:
                rows.append((f"{name} W={p['workers']}", f"n/a ({p['error'][:90]})"))
                continue
            rows.append([name, str(p["workers"]), f"{p['items']:,}", fmt_num(p["items_per_s"], ",.0f"),
                         fmt_num(p["workers"] / params["sleep_s"], ",.0f"), fmt_num(p["efficiency"], ".2f"),
                         fmt_num(p["first_item_s"], ".2f", " s")])
        if not outcome.get("ok"):
            rows.append((name, na(outcome)))
    title = (f"== scaling: map(sleep {params['sleep_s'] * 1000:.0f} ms) per item, "
             f"W = {', '.join(map(str, params['workers_list']))} workers ==")
    headers = ["contender", "W", "items", "items/s", "ideal/s", "efficiency", "first item"]
    notes = ["efficiency = steady items/s / (W / sleep); first 10% of items excluded"]
    notes.append("RPCRS-tcp: the W sessions of each point run on one worker server (one process per session)")
    return render_table(title, headers, rows, notes=notes)


def report_memory(scenario: Scenario, params: dict, results: dict) -> str:
    w = Workload.from_dict(params["workload"])
    mprs = value(results, "MPRS", "growth_mib")
    rows = []
    for name, outcome in results.items():
        if not outcome.get("ok"):
            rows.append((name, na(outcome)))
            continue
        d = outcome["data"]
        rows.append([name, fmt_num(d["growth_mib"], ".1f", " MiB"), fmt_num(d["baseline_mib"], ".0f", " MiB"),
                     f"{d['items']:,}", fmt_ratio(ratio(d["growth_mib"], mprs)), budget_note(d)])
    title = (f"== memory: trainer peak RSS above baseline, {w.n_items} x {w.item_bytes // MIB} MiB tensors, "
             f"consumer reads each and sleeps {params['consumer_sleep_s'] * 1000:.0f} ms, "
             f"{params['workers']} workers ==")
    return render_table(title, ["contender", "peak growth", "baseline", "items", "vs MPRS", "note"], rows)


def report_first_item(scenario: Scenario, params: dict, results: dict) -> str:
    mprs = value(results, "MPRS", "cold_s")
    rows = []
    for name, outcome in results.items():
        if not outcome.get("ok"):
            rows.append((name, na(outcome)))
            continue
        d = outcome["data"]
        rows.append([name, fmt_num(d["cold_s"], ".3f", " s"), fmt_num(d["warm_s"], ".3f", " s"),
                     fmt_ratio(ratio(d["cold_s"], mprs)), fmt_num(d["shutdown_s"], ".3f", " s")])
    title = (f"== first_item: loader construction + iter() to first item, {params['workers']} workers, "
             f"{params['repeats']} epochs ==")
    return render_table(title, ["contender", "first epoch", "later (median)", "vs MPRS", "shutdown"], rows,
                        notes=["RPCRS-tcp / RPCDataloader servers were already running (started untimed)"])


DATALOADERS = ("in-process", "MPRS", "RPCRS-local", "RPCRS-tcp")
SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("tiny", DATALOADERS + ("RPCRS-torch_rpc", "RPCDataloader"), plan_tiny,
                 measure_throughput, report_tiny, timeout_budgeted),
        Scenario("tensor1m", ("raw-socket", "raw-unix") + DATALOADERS + ("RPCRS-torch_rpc", "RPCDataloader"),
                 plan_tensor(1), measure_throughput, report_tensor, timeout_budgeted),
        Scenario("tensor8m", ("raw-socket", "raw-unix") + DATALOADERS + ("RPCRS-torch_rpc", "RPCDataloader"),
                 plan_tensor(8), measure_throughput, report_tensor, timeout_budgeted),
        Scenario("scaling", ("MPRS", "RPCRS-local", "RPCRS-tcp"), plan_scaling, measure_scaling,
                 report_scaling, timeout_scaling),
        Scenario("memory", DATALOADERS + ("RPCDataloader",), plan_memory, measure_memory,
                 report_memory, timeout_budgeted),
        Scenario("first_item", DATALOADERS + ("RPCDataloader",), plan_first_item, measure_first_item,
                 report_first_item, timeout_first_item),
    ]
}


# --------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    """A goal: ``measured(results) >= threshold``; measured returns (value, why-missing)."""

    goal: str
    threshold: float
    measured: Callable[[dict], tuple[Optional[float], str]]


def outcome_of(all_results: dict, scenario: str, contender: str) -> tuple[Optional[dict], str]:
    """A contender's data in a scenario, or (None, why not)."""
    if scenario not in all_results:
        return None, f"{scenario} not run"
    outcome = all_results[scenario]["contenders"].get(contender)
    if outcome is None:
        return None, f"{contender} not run"
    if not outcome.get("ok"):
        return None, f"{contender}: {outcome.get('reason', '?')}"
    return outcome["data"], ""


def rate_text(key: str, rate: float) -> str:
    return f"{rate / GB:.2f} GB/s" if key == "bytes_per_s" else f"{rate:,.0f}/s"


def ratio_at(scenario: str, key: str, contender: tuple[str, int], reference: tuple[str, int]):
    """A measure: ``contender``'s ``key`` at its W over ``reference``'s at its W."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        if scenario not in all_results:
            return None, f"{scenario} not run"
        results = all_results[scenario]["contenders"]
        values = []
        for name, workers in (contender, reference):
            v = point_value(results, name, key, workers)
            if v is None:
                outcome = results.get(name)
                return None, (f"{name} not run" if outcome is None else
                              outcome.get("reason") or f"{name}: no W={workers} point")
            values.append(v)
        return values[0] / values[1], f"{rate_text(key, values[0])} vs {rate_text(key, values[1])}"
    return measured


def best_ratio(scenario: str, key: str, contender: str, reference: str):
    """A measure: the best W of ``contender`` over the best W of ``reference`` (labelled)."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        if scenario not in all_results:
            return None, f"{scenario} not run"
        results = all_results[scenario]["contenders"]
        best = []
        for name in (contender, reference):
            points = [p for p in points_of(results, name) if "error" not in p and p.get(key)]
            if not points:
                outcome = results.get(name) or {}
                return None, outcome.get("reason") or f"{name}: no point"
            best.append(max(points, key=lambda p: p[key]))
        (a, b) = best
        return a[key] / b[key], (f"W={a['workers']} {rate_text(key, a[key])} vs "
                                 f"W={b['workers']} {rate_text(key, b[key])}")
    return measured


def efficiency_at(contender: str, workers: int):
    """A measure: ``contender``'s scaling efficiency at ``workers`` workers."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        if "scaling" not in all_results:
            return None, "scaling not run"
        outcome = all_results["scaling"]["contenders"].get(contender) or {}
        points = (outcome.get("data") or {}).get("points") or outcome.get("partial") or []
        for p in points:
            if p.get("workers") == workers and p.get("efficiency") is not None:
                ideal = workers / all_results["scaling"]["params"]["sleep_s"]
                return p["efficiency"], f"{p['items_per_s']:,.0f} of {ideal:,.0f} items/s"
        return None, outcome.get("reason") or f"no W={workers} point"
    return measured


TARGETS = [
    Target("tiny: RPCRS-local W=2 items/s >= 50x MPRS W=2", 50,
           ratio_at("tiny", "items_per_s", ("RPCRS-local", 2), ("MPRS", 2))),
    Target("tiny: RPCRS-tcp W=2 items/s >= 50x MPRS W=2", 50,
           ratio_at("tiny", "items_per_s", ("RPCRS-tcp", 2), ("MPRS", 2))),
    Target("tensor8m: RPCRS-tcp W=1 >= 0.8x raw-socket (both one stream)", 0.8,
           ratio_at("tensor8m", "bytes_per_s", ("RPCRS-tcp", 1), ("raw-socket", 1))),
    Target("tensor8m: RPCRS-tcp >= 2x RPCDataloader (best W of each) *", 2,
           best_ratio("tensor8m", "bytes_per_s", "RPCRS-tcp", "RPCDataloader")),
    Target("tensor8m: RPCRS-local W=2 >= 1x MPRS W=2", 1,
           ratio_at("tensor8m", "bytes_per_s", ("RPCRS-local", 2), ("MPRS", 2))),
    Target("scaling: RPCRS-local efficiency at W=16 >= 0.9", 0.9, efficiency_at("RPCRS-local", 16)),
    Target("scaling: RPCRS-tcp efficiency at W=16 >= 0.9", 0.9, efficiency_at("RPCRS-tcp", 16)),
]
TARGET_NOTES = [
    "* best W of each side (W=1 or 2, labelled in 'detail'); the same-W ratios are in the tensor8m table "
    "(column 'vs RPCDataloader (same W)')",
    "raw-socket is one TCP stream, so it is compared with RPCRS-tcp at W=1 (one stream); at W=2 three busy "
    "processes share 2 cores",
]


def evaluate_targets(all_results: dict) -> list[dict]:
    """Each target with its measured value and PASS / MISS / n/a."""
    rows = []
    for target in TARGETS:
        measured, detail = target.measured(all_results)
        status = "n/a" if measured is None else ("PASS" if measured >= target.threshold else "MISS")
        rows.append({"goal": target.goal, "threshold": target.threshold, "measured": measured,
                     "status": status, "detail": detail})
    return rows


def report_targets(rows: list[dict]) -> str:
    table_rows = []
    for row in rows:
        if row["measured"] is None:
            table_rows.append((row["goal"], f"n/a ({row['detail'][:80]})"))
        else:
            efficiency = "efficiency" in row["goal"]
            measured = f"{row['measured']:.2f}" if efficiency else fmt_ratio(row["measured"])
            table_rows.append([row["goal"], measured,
                               str(row["threshold"]) if efficiency else f"{row['threshold']}x",
                               row["status"], row["detail"]])
    return render_table("== targets ==", ["goal", "measured", "needed", "status", "detail"], table_rows,
                        notes=TARGET_NOTES)


# --------------------------------------------------------------------------------------
# Plot and JSON
# --------------------------------------------------------------------------------------


def write_plot(path: str, all_results: dict) -> str:
    """Scaling (items/s vs W) and bandwidth (GB/s per contender) figure; returns a message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot: matplotlib is not installed, no figure written"
    fig, (ax_scaling, ax_bw) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [2, 3]})
    scaling = all_results.get("scaling")
    if scaling:
        sleep_s = scaling["params"]["sleep_s"]
        workers = scaling["params"]["workers_list"]
        ax_scaling.axhline(1.0, color="k", linestyle="--", linewidth=1, label="ideal (W / sleep)")
        ax_scaling.axhline(0.9, color="r", linestyle=":", linewidth=1, label="target 0.9")
        for name, outcome in scaling["contenders"].items():
            points = [p for p in ((outcome.get("data") or {}).get("points") or outcome.get("partial") or [])
                      if p.get("efficiency")]
            if points:
                ax_scaling.plot([p["workers"] for p in points], [p["efficiency"] for p in points], "o-",
                                label=name)
        ax_scaling.set(xscale="log", xlabel="workers (W)", ylabel="efficiency = items/s / (W / sleep)",
                       ylim=(0, 1.1), title=f"scaling efficiency: sleep {sleep_s * 1000:.0f} ms per item")
        ax_scaling.set_xticks(workers, [str(w) for w in workers])
        ax_scaling.minorticks_off()
        ax_scaling.legend(loc="lower left")
    else:
        ax_scaling.set_title("scaling: not run")
    bw = {s: r for s, r in all_results.items() if s.startswith("tensor")}
    order = ["raw-socket", "raw-unix"] + [n for n in CONTENDERS if not n.startswith("raw-")]
    bars: dict[tuple[int, int], str] = {}  # (contender order, W) -> label; in-process moves nothing
    for res in bw.values():
        for name in res["contenders"]:
            for p in points_of(res["contenders"], name):
                if name != "in-process" and "error" not in p and p.get("bytes_per_s"):
                    label = name if name in ONE_STREAM else f"{name}\nW={p['workers']}"
                    bars[(order.index(name), p["workers"])] = label
    keys = sorted(bars)
    width = 0.8 / max(1, len(bw))
    for i, (scenario, res) in enumerate(bw.items()):
        rates = [point_value(res["contenders"], order[k[0]], "bytes_per_s", k[1]) or 0 for k in keys]
        xs = [x + i * width for x in range(len(keys))]
        ax_bw.bar(xs, [r / GB for r in rates], width,
                  label=scenario.replace("tensor", "").upper() + "iB tensors")
        for x, r in zip(xs, rates):
            if r:
                ax_bw.text(x, r / GB, f"{r / GB:.1f}", ha="center", va="bottom", fontsize=7)
    ax_bw.set_xticks([x + width * (len(bw) - 1) / 2 for x in range(len(keys))],
                     [bars[k].replace("\n", " ") for k in keys], fontsize=8, rotation=30, ha="right")
    ax_bw.set(ylabel="GB/s (1e9 bytes)",
              title="bandwidth, one host (W = workers; raw-* = one stream, one reused buffer)")
    if bw:
        ax_bw.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"figure written to {path}"


def write_json(path: str, document: dict) -> None:
    with open(path, "w") as out:
        json.dump(document, out, indent=2, default=str)


# --------------------------------------------------------------------------------------
# Main (parent)
# --------------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, budgets and worker counts")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                        help="run only this scenario (repeatable)")
    parser.add_argument("--contender", action="append", choices=list(CONTENDERS),
                        help="run only this contender (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="write all results to PATH")
    parser.add_argument("--plot", metavar="PATH", help="write a scaling + bandwidth figure (needs matplotlib)")
    parser.add_argument("--verbose", action="store_true", help="show the children's output")
    return parser.parse_args(argv)


def setup_environment() -> None:
    """PYTHONPATH for every process started from here: the work tree's package, then
    this directory (workloads are pickled by reference).  Also quiet known warnings."""
    paths = [REPO_ROOT, BENCH_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    for path in (REPO_ROOT, BENCH_DIR):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning")
    warnings.filterwarnings("ignore", category=UserWarning)


def _interrupt(signum, frame) -> None:
    """SIGTERM handler: unwind like Ctrl-C so every child is stopped."""
    raise KeyboardInterrupt


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


QUICK_SKIPS = ("RPCRS-torch_rpc",)  # a second transport: same code path, its own worker startup
ONE_ROUND = ("RPCRS-torch_rpc",)  # no target depends on it; its worker startup costs seconds


def best_of_rounds(outcomes: list[dict], rate_key: Optional[str]) -> dict:
    """One outcome from a contender's rounds: for each W, the point of the best round,
    with every round's rate in ``round_rates``.  One round: returned as it is."""
    if len(outcomes) == 1 or not rate_key:
        return outcomes[0]
    by_workers: dict[int, list[dict]] = {}
    for outcome in outcomes:
        if outcome.get("ok"):
            for p in outcome["data"]["points"]:
                by_workers.setdefault(p["workers"], []).append(p)
    points = []
    for _, candidates in sorted(by_workers.items()):
        good = [p for p in candidates if "error" not in p and p.get(rate_key)]
        best = dict(max(good, key=lambda p: p[rate_key])) if good else dict(candidates[0])
        best["round_rates"] = [p.get(rate_key) for p in candidates]
        points.append(best)
    merged = {"ok": any(o.get("ok") for o in outcomes), "data": {"points": points}, "partial": [],
              "rounds": len(outcomes)}
    if not merged["ok"]:
        merged.update(outcomes[0])
    for key in ("wall_s", "cpu_s"):
        merged[key] = sum(o.get(key, 0.0) for o in outcomes)
    return merged


def children_cpu_s() -> float:
    """User + system CPU seconds of every reaped descendant so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def servers_needed(name: str, params: dict) -> int:
    """Worker servers contender ``name`` needs in a scenario: one RPCRS server serves any
    number of sessions; rpcdataloader needs one launcher process per worker."""
    if name == "RPCRS-tcp":
        return 1
    return max(worker_counts(params, name))


class Runner:
    """Runs each (scenario, contender) as a child task, with the server pools it needs."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.unavailable: dict[str, str] = {}
        auth_key = secrets.token_hex(16)
        self.auth_keys = {"RPCRS-tcp": auth_key}
        self.pools = {
            "RPCRS-tcp": ServerPool("rpcrs", launch_rpcrs_server(auth_key)),
            "RPCDataloader": ServerPool("rpcdataloader", launch_rpcdataloader_server),
        }

    def probe(self) -> dict:
        """Versions and unavailable contenders (checked in a child, once)."""
        outcome = run_task({"kind": "probe"}, 120, self.args.verbose)
        if not outcome.get("ok"):
            progress(f"probe failed: {outcome.get('reason')}")
        info = outcome.get("data") or {"unavailable": {}}
        self.unavailable = dict(info["unavailable"])
        return info

    def servers_for(self, name: str, count: int) -> Optional[dict]:
        """Addresses (and key) of ``count`` running servers for a pooled contender."""
        if name not in self.pools:
            return None
        t0 = time.monotonic()
        addresses = self.pools[name].ensure(count)
        if time.monotonic() - t0 > 0.05:
            progress(f"  started {name} servers: {len(addresses)} running ({time.monotonic() - t0:.1f} s, untimed)")
        return {"addresses": addresses, "auth_key": self.auth_keys.get(name)}

    def run_one(self, scenario: Scenario, name: str, params: dict) -> dict:
        """One contender on one scenario; never raises for a contender's failure."""
        if name in self.unavailable:
            return {"ok": False, "reason": self.unavailable[name], "wall_s": 0.0}
        try:
            servers = self.servers_for(name, servers_needed(name, params))
        except Exception as exc:
            self.pools[name].stop()
            return {"ok": False, "reason": "servers did not start: " + describe_exception(exc), "wall_s": 0.0}
        task = {"kind": "measure", "scenario": scenario.name, "contender": name, "params": params,
                "servers": servers}
        keep = frozenset(pid for pool in self.pools.values() for pid in pool.pids())
        cpu_before = children_cpu_s()
        outcome = run_task(task, scenario.timeout_s(params), self.args.verbose, keep=keep,
                           on_partial=lambda p: progress(f"    {name} W={p.get('workers')}: "
                                                         f"{fmt_num(p.get('items_per_s'), ',.0f')} items/s"))
        outcome["cpu_s"] = children_cpu_s() - cpu_before  # the task's processes (not the servers')
        if not outcome.get("ok") and name in self.pools:
            self.pools[name].stop()  # a failed session may have left its servers unusable
        return outcome

    def run_scenario(self, scenario: Scenario) -> dict:
        """Every selected contender of ``scenario``: its params and outcomes.

        With ``params['rounds'] > 1`` every contender runs once per round, interleaved
        (round 1: all contenders, then round 2...), so that a burst of load from other
        jobs hits all of them alike; each (contender, W) keeps its best round.
        """
        params = scenario.plan(self.args.quick)
        rounds: dict[str, list[dict]] = {}
        for round_index in range(params.get("rounds", 1)):
            for name in scenario.contenders:
                if self.args.contender and name not in self.args.contender:
                    continue
                if self.args.quick and name in QUICK_SKIPS and not self.args.contender:
                    rounds[name] = [{"ok": False, "wall_s": 0.0,
                                     "reason": "skipped with --quick (select it with --contender)"}]
                    continue
                if round_index and (name in ONE_ROUND or not rounds[name][0].get("ok")):
                    continue  # failed once: do not pay its timeout again
                outcome = self.run_one(scenario, name, params)
                rounds.setdefault(name, []).append(outcome)
                status = "ok" if outcome.get("ok") else f"n/a: {outcome.get('reason')}"
                progress(f"  {scenario.name:<10} {name:<16} {outcome['wall_s']:6.1f} s wall "
                         f"{outcome.get('cpu_s', 0):6.1f} s cpu  {status}"
                         + (f"  (round {round_index + 1})" if params.get("rounds", 1) > 1 else ""))
                if not outcome.get("ok") and self.args.verbose:
                    progress(outcome.get("traceback") or outcome.get("log_tail") or "")
        outcomes = {name: best_of_rounds(outs, params.get("rate_key")) for name, outs in rounds.items()}
        return {"params": params, "contenders": outcomes}

    def close(self) -> None:
        """Stop every server pool and reap anything left."""
        for pool in self.pools.values():
            pool.stop()
            shutil.rmtree(pool.log_dir, ignore_errors=True)
        reap_adopted_children(set())


def print_header(info: dict, quick: bool) -> None:
    print(f"rpc_reading_service benchmark ({'quick' if quick else 'full'} run): "
          f"python {info.get('python')}, torch {info.get('torch')}, torchdata {info.get('torchdata')}, "
          f"{info.get('cpus')} CPUs, rpcdataloader {info.get('rpcdataloader', 'n/a')}")
    print(f"rpc_reading_service: {info.get('rpc_reading_service') or 'n/a'}"
          + (f" (transports: {', '.join(info['transports'])})" if info.get("transports") else ""))
    print(f"load average at start: {load_average()} (other jobs on this machine make every number noisy)\n",
          flush=True)


def load_average() -> str:
    """The 1-minute load average, or '?'."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    setup_environment()
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of our children come back to us to be reaped
    signal.signal(signal.SIGTERM, _interrupt)
    import torch  # noqa: F401  (imported once here, before forking the children)
    import torchdata.dataloader2  # noqa: F401

    started = time.monotonic()
    selected = [SCENARIOS[s] for s in (args.scenario or list(SCENARIOS))]
    all_results: dict[str, dict] = {}
    runner = Runner(args)
    try:
        info = runner.probe()
        print_header(info, args.quick)
        for scenario in selected:
            result = all_results[scenario.name] = runner.run_scenario(scenario)
            print(scenario.report(scenario, result["params"], result["contenders"]) + "\n", flush=True)
    except KeyboardInterrupt:
        progress("interrupted: stopping every process started")
        return 130
    finally:
        runner.close()
    targets = evaluate_targets(all_results)
    print(report_targets(targets))
    print(f"\ntotal wall time {time.monotonic() - started:.1f} s, load average at end: {load_average()}")
    if args.json:
        write_json(args.json, {"info": info, "quick": args.quick, "results": all_results, "targets": targets})
        print(f"results written to {args.json}")
    if args.plot:
        print(write_plot(args.plot, all_results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
