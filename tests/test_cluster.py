"""The deployment paths between hosts, on a cluster in miniature (tests/cluster.py).

One cluster per module: a trainer host on networks 1 and 2, worker hosts w0 and w1 on
network 1 and w3 on network 2, and w2 on network 1 hosting a TCPStore. Worker servers listen on 0.0.0.0 with a key, each in its
host; the trainer is a script run inside the trainer host, which prints JSON results.
Needs root (network namespaces): skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

import pytest

import cluster as cluster_module
from conftest import PRELOADED_WORKER, ServerProcess, _pythonpath, start_server
from _server_helpers import wait_until

pytestmark = pytest.mark.timeout(60)

_REASON = cluster_module.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"no cluster in miniature: {_REASON}", allow_module_level=True)

HOSTS = {"trainer": [1, 2], "w0": [1], "w1": [1], "w2": [1], "w3": [2]}
JOB = "cluster-test"
N_ITEMS = 60

# What every trainer script starts with: the graph functions travel by value (they live in
# __main__), and each item is tagged with the host whose worker made it.
PRELUDE = '''
import json, os, sys, time, faulthandler
faulthandler.dump_traceback_later(40, exit=False)  # a stuck trainer's log says where
import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from rpc_reading_service import TLS, Liveness, RPCReadingService, StoreDiscovery, TransportConfig
from rpc_reading_service.errors import WorkerLostError

KEY = os.environ["RRS_TEST_KEY"]
import cluster; cluster.restrict_tensorpipe_to_links()  # torch_rpc's tensors cross the links, as between hosts
ARGS = json.loads(sys.argv[1])

def tagged(item):
    return item, os.environ.get("RRS_CLUSTER_HOST")

def slow(item):
    time.sleep(0.01)
    return item

def tensor_item(item):
    return item, os.environ.get("RRS_CLUSTER_HOST"), torch.full((65536,), float(item))

def epoch(datapipe, **options):
    options.setdefault("auth_key", KEY)
    with DataLoader2(datapipe, reading_service=RPCReadingService(**options)) as dl:
        return list(dl)

def tagged_epoch(n, **options):
    return epoch(IterableWrapper(range(n)).sharding_filter().map(tagged), **options)

def report(**result):
    print(json.dumps(result), flush=True)
'''


# For the partition tests: the trainer reads a few items, says "midway" and waits; the test
# takes w1's link down and lets it go on. Items are slow (10 ms each), so most of the epoch is still to come.
PARTITION = '''
def partitioned_epoch(**options):
    datapipe = IterableWrapper(range(300)).sharding_filter().map(slow)
    # connect_timeout: reassign tries the lost (unreachable) host's server first.
    service = RPCReadingService(workers=ARGS["addresses"], auth_key=KEY, timeout=2.0,
                                liveness=Liveness(heartbeat_interval=0.5, connect_timeout=3.0), **options)
    with DataLoader2(datapipe, reading_service=service) as dl:
        dl.seed(7)
        items = iter(dl)
        got = [next(items) for _ in range(10)]
        report(event="midway")
        sys.stdin.readline()
        start = time.monotonic()
        try:
            got.extend(items)
            return got, None, time.monotonic() - start
        except WorkerLostError as exc:
            return got, str(exc), time.monotonic() - start
'''



# The trainer host's "zygote": torch, torchdata and the package imported once; each test's
# trainer script is a fork of it (saves seconds of imports per test), with its stdin and stdout
# on FIFOs, stderr in a log, and its exit status as a last JSON line.
ZYGOTE = '''
import atexit, json, os, runpy, signal, sys, traceback
import torch, torchdata.dataloader2, torchdata.datapipes.iter, rpc_reading_service.trainer.reading_service
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the forks
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    if os.fork() == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        out = os.open(job["stdout"], os.O_WRONLY)
        inp = os.open(job["stdin"], os.O_RDONLY)
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((inp, 0), (out, 1), (log, 2)):
            os.dup2(fd, target)
        sys.stdin, sys.stdout, sys.stderr = open(0), open(1, "w"), open(2, "w")
        os.chdir(job["cwd"])
        os.environ.update(job["env"])
        sys.argv = [job["script"], job["args"]]
        code = 0
        try:
            runpy.run_path(job["script"], run_name="__main__")
        except SystemExit as exc:
            code = exc.code or 0
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
        print(json.dumps({"__exit__": code}), flush=True)
        sys.stderr.flush()
        os._exit(code)
'''


class Trainer:
    """A trainer script forked from the trainer host's zygote (stdin/stdout FIFOs, stderr to a log)."""

    def __init__(self, zygote: subprocess.Popen, body: str, args: dict, workdir: Path, env: Dict[str, str]):
        script = workdir / f"trainer-{secrets.token_hex(4)}.py"
        script.write_text(PRELUDE + PARTITION + textwrap.dedent(body))
        self.log_path = workdir / f"{script.stem}.log"
        fifos = {name: workdir / f"{script.stem}.{name}" for name in ("stdin", "stdout")}
        for fifo in fifos.values():
            os.mkfifo(fifo)
        job = {"script": str(script), "args": json.dumps(args), "log": str(self.log_path), "cwd": str(workdir),
               "env": env, **{name: str(fifo) for name, fifo in fifos.items()}}  # fmt: skip
        zygote.stdin.write(json.dumps(job).encode() + b"\n")
        zygote.stdin.flush()
        self.stdout = open(fifos["stdout"], "rb")  # opened in this order on both sides
        self.stdin = open(fifos["stdin"], "wb")
        self._lines = cluster_module.json_lines(self.stdout)
        self.exit_code = None

    def next(self) -> dict:
        """The next JSON line the script prints (fails with its log if it exits first)."""
        for result in self._lines:
            if "__exit__" in result:
                self.exit_code = result["__exit__"]
                break
            return result
        raise AssertionError(f"trainer exited ({self.exit_code}) without a result:\n{self.log()}")

    def wait(self) -> int:
        """The script's exit status, once it ended (closes the FIFOs)."""
        for result in self._lines:
            if "__exit__" in result:
                self.exit_code = result["__exit__"]
        self.stdout.close()
        self.stdin.close()
        return self.exit_code

    def tell(self, line: str = "go") -> None:
        self.stdin.write(line.encode() + b"\n")
        self.stdin.flush()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def cluster():
    made = cluster_module.Cluster.create(HOSTS)
    try:
        yield made
    finally:
        made.destroy()
        assert cluster_module.leftovers(made.run_pid) == []


@pytest.fixture(scope="module")
def certs(tmp_path_factory, cluster):
    """A CA (trustme) and, per TLS worker host, a certificate for its name and address."""
    import trustme

    path = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(path / "ca.pem"))
    files = {"ca": str(path / "ca.pem")}
    for name in ("w0", "w1"):
        host = cluster[name]
        cert = ca.issue_cert(host.fqdn, host.address)
        cert.private_key_and_cert_chain_pem.write_to_path(str(path / f"{name}.pem"))
        files[name] = str(path / f"{name}.pem")
    return files


@pytest.fixture(scope="module")
def servers(cluster, certs, tmp_path_factory):
    """Every worker server of the module, started in parallel: ``{kind: {host: "ip:port"}}``.

    ``socket``: plain socket transport on w0, w1 and w3 (w0 and w1 register in the TCPStore
    that w2 hosts); ``torch_rpc`` on w0, w1 and w3; ``tls`` on w0 and w1. And the trainer
    host's zygote.
    """
    workdir = tmp_path_factory.mktemp("servers")
    key = secrets.token_hex(32)
    store_proc = cluster["w2"].popen(
        [sys.executable, "-m", "rpc_reading_service.discovery", "serve", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=_pythonpath()),
    )  # fmt: skip
    zygote = cluster["trainer"].popen(
        [sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONPATH=_pythonpath(), PYTHONWARNINGS="ignore"), cwd=str(workdir),
    )  # fmt: skip
    store_port = int(store_proc.stdout.readline().split()[-1].rsplit(b":", 1)[-1])  # "TCPStore listening on HOST:PORT"
    store = f"{cluster['w2'].address}:{store_port}"
    plans = {
        **{("socket", h): ["--store", store, "--job", JOB] if h in ("w0", "w1") else [] for h in ("w0", "w1", "w3")},
        **{("torch_rpc", h): ["--transport", "torch_rpc"] for h in ("w0", "w1", "w3")},
        **{("tls", h): ["--tls-cert", certs[h]] for h in ("w0", "w1")},
    }

    def start(plan) -> ServerProcess:
        (kind, name), args = plan
        host = cluster[name]
        return start_server(
            workdir, key=key, command=host.command(PRELOADED_WORKER),
            args=["--host", "0.0.0.0", "--log-level", "WARNING", *args], env={"RRS_CLUSTER_HOST": name},
        )  # fmt: skip

    started: Dict[tuple, ServerProcess] = {}
    try:
        with ThreadPoolExecutor(len(plans)) as pool:
            futures = {plan: pool.submit(start, (plan, args)) for plan, args in plans.items()}
        failed = [future.exception() for future in futures.values() if future.exception() is not None]
        started.update((plan, future.result()) for plan, future in futures.items() if future.exception() is None)
        if failed:
            raise failed[0]
        addresses: Dict[str, Dict[str, str]] = {}
        for (kind, name), server in started.items():
            port = server.address.rsplit(":", 1)[1]
            addresses.setdefault(kind, {})[name] = f"{cluster[name].address}:{port}"
        assert zygote.stdout.readline().strip() == b"ready", "the trainer host's zygote did not start"
        yield {"key": key, "store": store, **addresses, "procs": started, "zygote": zygote}
    finally:
        for server in started.values():
            server.stop()


def run_trainer(servers, tmp_path, body: str, args: dict, env: Dict[str, str] = {}) -> Trainer:  # noqa: B006
    return Trainer(servers["zygote"], body, args, tmp_path, {"RRS_TEST_KEY": servers["key"], **env})


def result_of(trainer: Trainer) -> dict:
    """The script's last JSON line, once it exited cleanly."""
    result = trainer.next()
    assert trainer.wait() == 0, trainer.log()
    return result


def assert_exactly_once(items: List, n: int, hosts: List[str]) -> None:
    assert sorted(item for item, *_ in items) == list(range(n))
    assert {host for _item, host, *_ in items} == set(hosts)


# -- transports between hosts ------------------------------------------------------------------
def test_socket_transport_between_hosts_on_all_interfaces_with_a_key(cluster, servers, tmp_path):
    addresses = [servers["socket"][h] for h in ("w0", "w1", "w3")]
    trainer = run_trainer(servers, tmp_path, '''
        items = tagged_epoch(60, workers=ARGS["addresses"], num_workers=3)
        try:
            tagged_epoch(6, workers=ARGS["addresses"][:1], auth_key="not the key")
            wrong = None
        except Exception as exc:
            wrong = type(exc).__name__
        report(items=items, wrong_key=wrong)
    ''', {"addresses": addresses})  # fmt: skip
    result = result_of(trainer)
    assert_exactly_once(result["items"], N_ITEMS, ["w0", "w1", "w3"])
    assert result["wrong_key"] == "AuthenticationError"


def test_torch_rpc_transport_between_hosts(cluster, servers, tmp_path):
    addresses = [servers["torch_rpc"][h] for h in ("w0", "w1")]
    trainer = run_trainer(servers, tmp_path, '''
        dp = IterableWrapper(range(40)).sharding_filter().map(tensor_item)
        items = epoch(dp, workers=ARGS["addresses"], num_workers=2, transport="torch_rpc")
        report(items=[(i, host) for i, host, _ in items], tensors_ok=all(bool((t == i).all()) for i, _, t in items))
    ''', {"addresses": addresses})  # fmt: skip
    result = result_of(trainer)
    assert_exactly_once(result["items"], 40, ["w0", "w1"])
    assert result["tensors_ok"]


def test_tls_with_certificates_for_host_names_and_addresses(cluster, servers, certs, tmp_path):
    by_address = [servers["tls"][h] for h in ("w0", "w1")]
    by_name = [f"{cluster[h].fqdn}:{a.rsplit(':', 1)[1]}" for h, a in zip(("w0", "w1"), by_address)]
    trainer = run_trainer(servers, tmp_path, '''
        results = {}
        for how in ("by_name", "by_address"):
            results[how] = tagged_epoch(30, workers=ARGS[how], num_workers=2, transport=TransportConfig(tls=TLS(ARGS["ca"])))
        try:  # w1's certificate does not carry w0's name
            tagged_epoch(6, workers=ARGS["by_address"][1:], transport=TransportConfig(tls=TLS(ARGS["ca"], "w0.cluster.test")),
                         liveness=Liveness(connect_timeout=10))
            results["wrong_name"] = None
        except Exception as exc:
            results["wrong_name"] = str(exc)
        report(**results)
    ''', {"by_name": by_name, "by_address": by_address, "ca": certs["ca"]})  # fmt: skip
    result = result_of(trainer)
    assert_exactly_once(result["by_name"], 30, ["w0", "w1"])
    assert_exactly_once(result["by_address"], 30, ["w0", "w1"])
    assert result["wrong_name"] and "w0.cluster.test" in result["wrong_name"], result["wrong_name"]


def test_tcpstore_discovery_store_on_one_host_workers_on_others(cluster, servers, tmp_path):
    trainer = run_trainer(servers, tmp_path, '''
        report(items=tagged_epoch(40, workers=StoreDiscovery(ARGS["store"], job=ARGS["job"], min_workers=2, timeout=30)))
    ''', {"store": servers["store"], "job": JOB})  # fmt: skip
    assert_exactly_once(result_of(trainer)["items"], 40, ["w0", "w1"])


def test_trainer_with_two_networks_reaches_workers_on_both(cluster, servers, tmp_path):
    # w0 is on network 1 only, w3 on network 2 only, and neither has a route to the other network.
    trainer = run_trainer(servers, tmp_path, '''
        report(items=tagged_epoch(40, workers=ARGS, num_workers=2, liveness=Liveness(connect_timeout=20)))
    ''', [servers["socket"]["w0"], servers["socket"]["w3"]])  # fmt: skip
    assert_exactly_once(result_of(trainer)["items"], 40, ["w0", "w3"])


def test_torch_rpc_trainer_with_two_networks(cluster, servers, tmp_path):
    """TensorPipe listens on one address per trainer process (here on network 1, TP_SOCKET_IFNAME):
    a worker host on network 2 without a route to it is refused at once with what to do (it used
    to time out, its session killed by TensorPipe's abort); with a route, both networks work."""
    trainer = run_trainer(servers, tmp_path, '''
        def attempt():
            start = time.monotonic()
            try:
                return tagged_epoch(40, workers=ARGS, num_workers=2, transport="torch_rpc",
                                    liveness=Liveness(connect_timeout=20)), None, time.monotonic() - start
            except WorkerLostError as exc:
                return None, str(exc), time.monotonic() - start
        items, error, seconds = attempt()
        report(error=error, seconds=seconds)
        sys.stdin.readline()
        items, error, _ = attempt()
        report(items=items, error=error)
    ''', [servers["torch_rpc"]["w0"], servers["torch_rpc"]["w3"]], env={"TP_SOCKET_IFNAME": "eth1"})  # fmt: skip
    refused = trainer.next()
    trainer_tensorpipe = cluster["trainer"].addresses[1]
    assert refused["error"] and servers["torch_rpc"]["w3"] in refused["error"], refused
    assert f"cannot reach the trainer's torch RPC (TensorPipe) address {trainer_tensorpipe}:" in refused["error"]
    assert "TP_SOCKET_IFNAME" in refused["error"] and "transport='socket'" in refused["error"]
    assert refused["seconds"] < 15, refused  # not the 20 s connect_timeout
    w3_server = servers["procs"][("torch_rpc", "w3")]
    assert w3_server.proc.poll() is None and "killed by signal" not in w3_server.stderr()
    cluster["w3"].route(1, via=cluster["trainer"].addresses[2])
    try:
        trainer.tell()
        result = result_of(trainer)
    finally:
        cluster["w3"].route(1, via=cluster["trainer"].addresses[2], add=False)
    assert result["error"] is None, result["error"]
    assert_exactly_once(result["items"], 40, ["w0", "w3"])


@pytest.fixture
def partition(cluster):
    """``partition(host)`` takes the host's link down; the link is always brought back up."""
    downed = []

    def down(name: str) -> None:
        cluster[name].set_link(False)
        downed.append(name)

    yield down
    for name in downed:
        cluster[name].set_link(True)


def test_partition_mid_epoch_raises_within_timeout_and_the_host_comes_back(cluster, servers, partition, tmp_path):
    addresses = [servers["socket"][h] for h in ("w0", "w1")]
    trainer = run_trainer(servers, tmp_path, '''
        got, error, seconds = partitioned_epoch()
        report(event="lost", error=error, seconds=seconds)
        sys.stdin.readline()
        report(event="back", items=tagged_epoch(40, workers=ARGS["addresses"], num_workers=2))
    ''', {"addresses": addresses})  # fmt: skip
    assert trainer.next() == {"event": "midway"}
    partition("w1")
    trainer.tell()
    lost = trainer.next()
    assert lost["event"] == "lost" and lost["error"], lost
    assert servers["socket"]["w1"] in lost["error"], lost["error"]
    assert lost["seconds"] < 2.0 + 3.0, lost  # timeout, plus the heartbeat interval and slack
    cluster["w1"].set_link(True)
    trainer.tell()
    back = result_of(trainer)
    assert_exactly_once(back["items"], 40, ["w0", "w1"])


def test_partition_mid_epoch_reassign_gives_the_fault_free_epoch(cluster, servers, partition, tmp_path):
    addresses = [servers["socket"][h] for h in ("w0", "w1")]
    trainer = run_trainer(servers, tmp_path, '''
        fault_free, _, _ = partitioned_epoch()
        got, error, seconds = partitioned_epoch(on_worker_failure="reassign")
        report(fault_free=fault_free, got=got, error=error, seconds=seconds)
    ''', {"addresses": addresses})  # fmt: skip
    assert trainer.next() == {"event": "midway"}
    trainer.tell()  # the fault-free run
    assert trainer.next() == {"event": "midway"}
    partition("w1")
    trainer.tell()
    result = result_of(trainer)
    assert result["error"] is None
    assert sorted(result["fault_free"]) == list(range(300))
    assert result["got"] == result["fault_free"]
    assert result["seconds"] < 2.0 + 3.0 + 5.0, result["seconds"]  # timeout + connect_timeout + the replay


def test_a_new_cluster_sweeps_what_an_interrupted_run_left(tmp_path):
    """Objects named after a run whose process is gone (a crash, a SIGKILL) are removed."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = f"{cluster_module.PREFIX}{dead.pid}-w0"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    subprocess.run(["ip", "route", "add", "blackhole", cluster_module.TEST_RANGE, "metric", str(dead.pid)], check=True)
    try:
        assert cluster_module.leftovers(dead.pid)
        cluster_module.sweep_leftovers()
        assert cluster_module.leftovers(dead.pid) == []
    finally:
        subprocess.run(["ip", "netns", "del", leftover], capture_output=True)
        subprocess.run(["ip", "route", "del", "blackhole", cluster_module.TEST_RANGE, "metric", str(dead.pid)],
                       capture_output=True)  # fmt: skip


# -- servers that join and drain between hosts (test_join.py's graphs and helpers) -------------
FLEET = '''
import signal
from pathlib import Path
from types import SimpleNamespace
from _server_helpers import FileGate, run_epochs, wait_until
from test_drain import Hold
from test_join import ITEMS, WaitForJoiner, consumed_by, graph, reference, service

FIRST = SimpleNamespace(address=ARGS["first"], key=KEY)
'''


@pytest.fixture
def fleet(cluster, servers, tmp_path):
    """``start(host)``: a fresh server on that host with the module's key and ``--drain-timeout 10``,
    returned as ``(server, "ip:port")``; every one stopped after the test."""
    started = []

    def start(name: str):
        server = start_server(
            tmp_path, key=servers["key"], command=cluster[name].command(PRELOADED_WORKER),
            args=["--host", "0.0.0.0", "--log-level", "INFO", "--drain-timeout", "10"], env={"RRS_CLUSTER_HOST": name},
        )  # fmt: skip
        started.append(server)
        return server, f"{cluster[name].address}:{server.address.rsplit(':', 1)[1]}"

    yield start
    for server in started:
        server.stop()


@pytest.mark.timeout(90)
def test_a_server_on_another_network_joins_mid_epoch_under_dynamic(cluster, servers, fleet, tmp_path):
    (first, first_at), (_joiner, joiner_at) = fleet("w0"), fleet("w3")
    trainer = run_trainer(servers, tmp_path, FLEET + textwrap.dedent('''
        expected = reference(FIRST, "dynamic")[0]
        marker = FileGate(Path(ARGS["marker"]), timeout=30)  # w0's sessions wait at item 10 for the joiner's first
        items = []
        with DataLoader2(graph(WaitForJoiner(ARGS["first_pid"], marker)), reading_service=service(FIRST, "dynamic")) as dl:
            dl.seed(11)
            for item in dl:
                items.append(item)
                if len(items) == 1:
                    added = dl.reading_service.add_workers([ARGS["joiner"]])
            stats = dl.reading_service.stats()
        report(items=items, expected=expected, added=added, joins=stats.joins, by_joiner=consumed_by(stats, ARGS["joiner"]))
    '''), {"first": first_at, "first_pid": first.pid, "joiner": joiner_at, "marker": str(tmp_path / "joined")})  # fmt: skip
    result = result_of(trainer)
    assert result["added"] == [joiner_at] and result["joins"] == 1
    assert result["items"] == result["expected"]  # the fixed fleet's items, in its order
    assert result["by_joiner"] > 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("join", [False, True], ids=["drain", "drain_and_join"])
def test_a_server_drains_mid_epoch_between_hosts_alone_or_while_another_joins(cluster, servers, fleet, tmp_path, join):
    (_first, first_at), (leaving, leaving_at) = fleet("w0"), fleet("w1")
    joiner_at = fleet("w3")[1] if join else None
    trainer = run_trainer(servers, tmp_path, FLEET + textwrap.dedent('''
        fixed = lambda: RPCReadingService(workers=[ARGS["first"], ARGS["leaving"]], num_workers=2, auth_key=KEY,
                                          distribution="dynamic", timeout=20.0)
        expected = run_epochs(graph(), fixed(), 1, seed=5)[0]
        gate = FileGate(Path(ARGS["gate"]), timeout=30)  # the leaving server's session waits mid-shard
        items, signalled, added = [], None, []
        try:
            with DataLoader2(graph(Hold(ARGS["leaving_pid"], gate)), reading_service=fixed()) as dl:
                dl.seed(5)
                for item in dl:
                    items.append(item)
                    if signalled is None:
                        assert wait_until(Path(gate.path + ".held").exists, 20), "the leaving server never held"
                        if ARGS["joiner"]:
                            added = dl.reading_service.add_workers([ARGS["joiner"]])
                        os.kill(ARGS["leaving_pid"], signal.SIGTERM)
                        signalled = time.monotonic()
                seconds = time.monotonic() - signalled
                stats = dl.reading_service.stats()
        finally:
            gate.open()
        report(items=items, expected=expected, seconds=seconds, added=added, drains=stats.drains, joins=stats.joins,
               by_joiner=consumed_by(stats, ARGS["joiner"]) if ARGS["joiner"] else 0)
    '''), {"first": first_at, "leaving": leaving_at, "leaving_pid": leaving.pid, "joiner": joiner_at,
          "gate": str(tmp_path / "gate")})  # fmt: skip
    result = result_of(trainer)
    assert result["items"] == result["expected"]  # no error, every item once, the fixed fleet's order
    assert result["drains"] == 1 and result["seconds"] < 10, result["seconds"]  # within the drain timeout
    assert wait_until(lambda: leaving.proc.poll() is not None, 15) and leaving.proc.poll() == 0, leaving.stderr()
    if join:
        assert result["added"] == [joiner_at] and result["joins"] == 1


@pytest.mark.timeout(90)
def test_a_server_joining_under_sticky_at_an_epoch_boundary_takes_only_its_share(cluster, servers, tmp_path):
    addresses = [servers["socket"][h] for h in ("w0", "w1")]
    trainer = run_trainer(servers, tmp_path, '''
        dp = IterableWrapper(range(120)).shuffle().sharding_filter().map(tagged)
        rs = RPCReadingService(workers=ARGS["addresses"], num_workers=2, auth_key=KEY, distribution="sticky")
        with DataLoader2(dp, reading_service=rs) as dl:
            dl.seed(3)
            before = list(dl)
            added = dl.reading_service.add_workers([ARGS["joiner"]])
            after = list(dl)
        report(before=before, after=after, added=added)
    ''', {"addresses": addresses, "joiner": servers["socket"]["w3"]})  # fmt: skip
    result = result_of(trainer)
    assert result["added"] == [servers["socket"]["w3"]]
    assert_exactly_once(result["before"], 120, ["w0", "w1"])
    assert_exactly_once(result["after"], 120, ["w0", "w1", "w3"])
    host_before = dict(result["before"])
    moved = {item: host for item, host in result["after"] if host != host_before[item]}
    assert set(moved.values()) == {"w3"}  # only the joiner's share moved, all of it to the joiner
    assert 120 / 3 / 2 < len(moved) < 120 / 3 * 2, len(moved)


@pytest.mark.timeout(90)
def test_a_dynamic_checkpoint_on_two_hosts_resumes_exactly_on_three(cluster, servers, tmp_path):
    addresses = [servers["socket"][h] for h in ("w0", "w1", "w3")]
    trainer = run_trainer(servers, tmp_path, '''
        from rpc_reading_service import RemoteIterable
        from torch.utils.data import DataLoader

        def dataset(workers):
            dp = IterableWrapper(range(90)).shuffle().sharding_filter().map(tagged)
            return RemoteIterable(dp, num_workers=len(workers), workers=workers, auth_key=KEY, seed=7, distribution="dynamic")

        def run(workers, state=None, stop=None):
            data = dataset(workers)
            try:
                if state is not None:
                    data.load_state_dict(state)
                items = iter(DataLoader(data, batch_size=None))
                got = [next(items) for _ in range(stop)] if stop else list(items)
                return got, data.state_dict() if stop else None
            finally:
                data.close()

        whole, _ = run(ARGS["addresses"][:2])
        head, state = run(ARGS["addresses"][:2], stop=25)
        rest, _ = run(ARGS["addresses"], state)
        report(whole=whole, head=head, rest=rest)
    ''', {"addresses": addresses})  # fmt: skip
    result = result_of(trainer)
    order = lambda items: [item for item, _host in items]  # noqa: E731
    assert order(result["head"] + result["rest"]) == order(result["whole"])  # exact: the 2-server epoch's order
    assert_exactly_once(result["whole"], 90, ["w0", "w1"])
    assert "w3" in {host for _item, host in result["rest"]}  # the resumed epoch ran on 3 hosts
