"""Worker discovery: real ``rpc-reading-worker --store`` subprocesses in a real TCPStore, and hostfiles."""

from __future__ import annotations

import datetime
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _server_helpers import wait_until
from conftest import _pythonpath, start_server
from torch.distributed import TCPStore
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import _pythonpath, free_port, python_run, start_server, wait_until
from rpc_reading_service import (
    ConfigurationError,
    DiscoveryTimeoutError,
    Hostfile,
    Liveness,
    RPCReadingService,
    StoreDiscovery,
)
from rpc_reading_service.discovery import (
    KEY_PREFIX,
    advertised_address,
    connect_store,
    read_hostfile,
    registered_workers,
    wait_for_hostfile,
    wait_for_workers,
)

KEY = secrets.token_hex(16)


def host_store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))


def start_workers(tmp_path, count, store_address, job, extra=()):
    with ThreadPoolExecutor(count) as pool:
        futures = [
            pool.submit(start_server, tmp_path, key=KEY, args=["--store", store_address, "--job", job, *extra])
            for _ in range(count)
        ]
    return [f.result() for f in futures]


def wait_registered(store, job, count, timeout=20.0):
    """The addresses of ``job``'s workers in ``store``, once ``count`` have registered."""
    registered = lambda: len(registered_workers(store, job)) >= count  # noqa: E731
    assert wait_until(registered, timeout), f"only {registered_workers(store, job)} registered"
    return [address for _, address in registered_workers(store, job)]


def epoch(reading_service, n=40):
    dl = DataLoader2(IterableWrapper(range(n)).sharding_filter().map(lambda x: x * 2), reading_service=reading_service)
    try:
        items = sorted(dl)
        addresses = dl.reading_service.worker_addresses
    finally:
        dl.shutdown()
    return items, addresses


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A TCPStore hosted by the test, and two workers registered in it under job 'fleet'."""
    store = host_store()
    address = f"127.0.0.1:{store.port}"
    servers = start_workers(tmp_path_factory.mktemp("fleet"), 2, address, "fleet")
    try:
        wait_registered(store, "fleet", 2)
        yield store, address, servers
    finally:
        for server in servers:
            server.stop()


# -- store discovery ------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_trainer_finds_n_registered_workers(fleet):
    store, address, servers = fleet
    service = RPCReadingService(
        workers=StoreDiscovery(address, job="fleet", min_workers=2, timeout=30), auth_key=KEY
    )
    assert service.num_workers == 2  # one session per worker, known before initialize
    items, used = epoch(service)
    assert items == [2 * i for i in range(40)]
    assert sorted(used) == sorted(s.address for s in servers)


@pytest.mark.timeout(60)
def test_more_sessions_than_workers_spread_round_robin(fleet):
    _, address, servers = fleet
    items, used = epoch(
        RPCReadingService(
            workers=StoreDiscovery(address, job="fleet", min_workers=2), num_workers=4, auth_key=KEY
        )
    )
    assert items == [2 * i for i in range(40)]
    assert len(used) == 4 and set(used) == {s.address for s in servers}


@pytest.mark.timeout(60)
def test_timeout_when_fewer_than_min_workers_register(fleet):
    _, address, _ = fleet
    service = RPCReadingService(
        workers=StoreDiscovery(address, job="fleet", min_workers=3, timeout=1.5), auth_key=KEY
    )
    start = time.monotonic()
    with pytest.raises(DiscoveryTimeoutError) as info:
        epoch(service)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "only 2 of 3 registered" in message
    assert address in message and "'fleet'" in message
    assert "rpc-reading-worker --store" in message


@pytest.mark.timeout(60)
def test_unknown_job_times_out_with_zero_registered(fleet):
    _, address, _ = fleet
    with pytest.raises(DiscoveryTimeoutError, match="only 0 of 1 registered"):
        epoch(
            RPCReadingService(workers=StoreDiscovery(address, job="no-such-job", timeout=0.5), auth_key=KEY)
        )


@pytest.mark.timeout(60)
def test_stale_and_duplicate_entries_are_skipped(fleet):
    """Entries of crashed workers (nothing listens) are skipped; re-registrations count once."""
    store, address, servers = fleet
    job = "stale"
    dead = f"127.0.0.1:{free_port()}"
    for entry in (dead, servers[0].address, servers[0].address):  # a dead one, then a restart at the same address
        slot = store.add(f"{KEY_PREFIX}/{job}/count", 1)
        store.set(f"{KEY_PREFIX}/{job}/worker/{slot}", entry)
    assert wait_for_workers(store, job, 1, timeout=5) == [servers[0].address]
    with pytest.raises(DiscoveryTimeoutError) as info:
        wait_for_workers(store, job, 2, timeout=1.0, store_address=address)
    assert f"registered but not answering: {dead}" in str(info.value)


@pytest.mark.timeout(90)
def test_stopped_worker_and_second_spellings_are_skipped_within_seconds(fleet, tmp_path):
    """A registered worker that hangs (SIGSTOP: its kernel still accepts connections) fails the
    probe's handshake within seconds instead of stalling setup for connect_timeout; and
    ``localhost:P`` registered next to ``127.0.0.1:P`` is one server, given one session."""
    store, address, servers = fleet
    job = "stopped"
    stopped = start_server(tmp_path, key=KEY)
    live = servers[0].address
    try:
        os.killpg(stopped.pid, signal.SIGSTOP)
        alias = "localhost:" + live.rpartition(":")[2]
        for entry in (stopped.address, live, alias):
            slot = store.add(f"{KEY_PREFIX}/{job}/count", 1)
            store.set(f"{KEY_PREFIX}/{job}/worker/{slot}", entry)
        started = time.monotonic()
        items, used = epoch(
            RPCReadingService(
                workers=StoreDiscovery(address, job=job, min_workers=1, timeout=20), auth_key=KEY,
                liveness=Liveness(connect_timeout=30.0),
            )  # fmt: skip
        )
        took = time.monotonic() - started
    finally:
        os.killpg(stopped.pid, signal.SIGKILL)
        stopped.stop()
    assert items == [2 * i for i in range(40)] and used == [live]
    assert took < 15.0, f"discovery and the epoch took {took:.1f} s"


@pytest.mark.timeout(90)
def test_killed_worker_is_skipped_and_clean_stop_deregisters(tmp_path):
    store = host_store()
    address = f"127.0.0.1:{store.port}"
    first, second = start_workers(tmp_path, 2, address, "restart")
    try:
        wait_registered(store, "restart", 2)
        first.proc.send_signal(signal.SIGKILL)  # a crash: its entry stays behind
        first.proc.wait(10)
        second.stop()  # a clean stop (SIGTERM): it deletes its entry
        assert [a for _, a in registered_workers(store, "restart")] == [first.address]
        (third,) = start_workers(tmp_path, 1, address, "restart")  # "the restarted worker"
        try:
            assert wait_for_workers(store, "restart", 1, timeout=20) == [third.address]
            items, used = epoch(
                RPCReadingService(workers=StoreDiscovery(address, job="restart", min_workers=1), auth_key=KEY)
            )
            assert items == [2 * i for i in range(40)] and used == [third.address]
        finally:
            third.stop()
    finally:
        first.stop()
        second.stop()


@pytest.mark.timeout(90)
def test_trainer_hosts_the_store_and_workers_wait_for_it(tmp_path):
    """Workers started before the trainer's store exists register once it comes up."""
    port = free_port()
    (server,) = start_workers(tmp_path, 1, f"127.0.0.1:{port}", "hosted", extra=["--store-timeout", "60"])
    try:
        time.sleep(0.5)  # the worker is now retrying the (absent) store
        service = RPCReadingService(
            workers=StoreDiscovery(
                f"127.0.0.1:{port}", job="hosted", min_workers=1, host_store=True, timeout=30
            ),
            auth_key=KEY,
        )
        items, used = epoch(service)
        assert items == [2 * i for i in range(40)] and used == [server.address]
        with pytest.raises(OSError):  # finalize released the hosted store
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_worker_on_all_interfaces_advertises_a_reachable_address(tmp_path):
    store = host_store()
    address = f"127.0.0.1:{store.port}"
    servers = [
        start_server(tmp_path, key=KEY, args=["--host", "0.0.0.0", "--store", address, "--job", "wild"]),
        start_server(
            tmp_path, key=KEY, args=["--host", "0.0.0.0", "--store", address, "--job", "named", "--advertise-host", "localhost"]
        ),
    ]
    try:
        port0, port1 = (s.address.rsplit(":", 1)[1] for s in servers)
        assert servers[0].address.startswith("0.0.0.0:")
        # Listening on 0.0.0.0: the IP on the route to the store (loopback here), never 0.0.0.0.
        assert wait_registered(store, "wild", 1) == [f"127.0.0.1:{port0}"]
        assert wait_registered(store, "named", 1) == [f"localhost:{port1}"]
    finally:
        for server in servers:
            server.stop()


def test_advertised_address_rules():
    assert advertised_address("10.1.2.3:29600", None, "store:29700") == "10.1.2.3:29600"
    assert advertised_address("0.0.0.0:29600", "cpu-7.cluster", "store:29700") == "cpu-7.cluster:29600"
    assert advertised_address("0.0.0.0:29600", None, "127.0.0.1:29700") == "127.0.0.1:29600"
    with pytest.raises(ConfigurationError, match="Unix socket"):
        advertised_address("unix:/tmp/w.sock", None, "127.0.0.1:29700")


@pytest.mark.timeout(60)
def test_worker_exits_with_a_clear_error_when_the_store_never_comes(tmp_path):
    port = free_port()
    argv = ["-m", "rpc_reading_service.worker", "--port", "0", "--store", f"127.0.0.1:{port}", "--store-timeout", "1"]
    result = python_run(argv, {"PYTHONPATH": _pythonpath(), "PATH": "/usr/bin:/bin"}, str(tmp_path), timeout=45)
    assert result.returncode == 1, result.stderr
    assert f"no TCPStore answers at 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_worker_refuses_to_register_a_unix_socket(tmp_path):
    argv = ["-m", "rpc_reading_service.worker", "--host", f"unix:{tmp_path}/w.sock", "--store", "127.0.0.1:1"]
    result = python_run(argv, {"PYTHONPATH": _pythonpath()}, str(tmp_path), timeout=45)
    assert result.returncode == 2
    assert "cannot reach a Unix socket" in result.stderr


# -- configuration checks (nothing is opened in __init__) -----------------------------------------
def test_discovery_opens_nothing_before_initialize():
    port = free_port()  # nothing listens here
    start = time.monotonic()
    service = RPCReadingService(
        workers=StoreDiscovery(f"127.0.0.1:{port}", job="x", min_workers=3, timeout=10)
    )
    clone = pickle.loads(pickle.dumps(service))  # DataLoader2 clones the service like this
    assert time.monotonic() - start < 5  # a look-up would wait out the 10 s discovery timeout
    assert clone.num_workers == 3


@pytest.mark.timeout(30)
def test_no_store_at_the_address():
    port = free_port()
    service = RPCReadingService(workers=StoreDiscovery(f"127.0.0.1:{port}", min_workers=1, timeout=0.5))
    with pytest.raises(ConfigurationError, match=f"no TCPStore answers at 127.0.0.1:{port}"):
        epoch(service)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: StoreDiscovery("localhost"), "store address 'localhost' has no port"),
        (lambda: StoreDiscovery("localhost:x"), "store address 'localhost:x' has port 'x'"),
        # One source of workers at a time, by type: a bare string is no list of addresses.
        (lambda: RPCReadingService(workers="h:1"), "workers must be LocalWorkers"),
        (lambda: StoreDiscovery("h:1", min_workers=0), "StoreDiscovery.min_workers must be an int >= 1"),
        (lambda: Hostfile("f", min_workers=0), "Hostfile.min_workers must be an int >= 1"),
        (lambda: StoreDiscovery("h:1", job=""), "job name '' is empty"),
    ],
)
def test_bad_discovery_arguments(build, message):
    with pytest.raises(ConfigurationError, match=message):
        build()


@pytest.mark.timeout(30)
def test_unknown_store_host_is_reported_at_once():
    service = RPCReadingService(workers=StoreDiscovery("no-such-host.invalid:29700", timeout=30))
    start = time.monotonic()
    with pytest.raises(ConfigurationError, match="cannot resolve the host of store address"):
        epoch(service)
    assert time.monotonic() - start < 10


# -- hostfiles --------------------------------------------------------------------------------------
def test_hostfile_comments_and_blank_lines(tmp_path):
    path = tmp_path / "workers.txt"
    path.write_text(
        "# CPU nodes of the data tier\n\ncpu-1:29600\n   cpu-2:29600   # the second one\n\n[::1]:29601\n  # done\n"
    )
    assert read_hostfile(str(path)) == ["cpu-1:29600", "cpu-2:29600", "[::1]:29601"]


@pytest.mark.parametrize(
    "line, message",
    [("cpu-1", "has no port"), ("cpu-1:29x00", "not a number"), ("cpu-1:70000", "outside 1-65535")],
)
def test_hostfile_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "workers.txt"
    path.write_text(f"# header\ncpu-0:29600\n{line}\n")
    with pytest.raises(ConfigurationError) as info:
        read_hostfile(str(path))
    text = str(info.value)
    assert f"hostfile {path}, line 3" in text and message in text and "one HOST:PORT" in text


def test_hostfile_missing_or_empty(tmp_path):
    with pytest.raises(ConfigurationError, match="cannot read hostfile"):
        read_hostfile(str(tmp_path / "absent.txt"))
    (tmp_path / "empty.txt").write_text("# nobody yet\n")
    with pytest.raises(ConfigurationError, match="lists no worker"):
        wait_for_hostfile(str(tmp_path / "empty.txt"), None, 1.0)
    with pytest.raises(DiscoveryTimeoutError, match="to list 2 workers: it lists 0 .the file does not exist"):
        wait_for_hostfile(str(tmp_path / "later.txt"), 2, 0.5)


@pytest.mark.timeout(60)
def test_hostfile_end_to_end(fleet, tmp_path):
    _, _, servers = fleet
    path = tmp_path / "workers.txt"
    path.write_text("# the fleet\n" + "".join(f"{s.address}\n" for s in servers))
    items, used = epoch(RPCReadingService(workers=Hostfile(str(path)), auth_key=KEY))
    assert items == [2 * i for i in range(40)]
    assert used == [s.address for s in servers]


# -- a store that goes away and comes back ----------------------------------------------------------
def serve_store(tmp_path, port):
    """``python -m rpc_reading_service.discovery serve`` on loopback at ``port``; returns (proc, stderr file)."""
    stderr_path = tmp_path / f"store-{secrets.token_hex(4)}.log"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rpc_reading_service.discovery", "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True, cwd=str(tmp_path),
            env={"PYTHONPATH": _pythonpath(), "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line == f"TCPStore listening on 127.0.0.1:{port}\n", line + stderr_path.read_text()
    except BaseException:
        stop_store(proc)
        raise
    return proc, stderr_path


def stop_store(proc):
    proc.kill()
    proc.wait()
    proc.stdout.close()


def listening_sockets(port):
    """The local addresses (hex, as in /proc/net/tcp*) of the TCP sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.append(local.rsplit(":", 1)[0])
    return found


@pytest.mark.timeout(60)
def test_store_cli_serves_on_loopback_only_and_warns_nothing(tmp_path):
    port = free_port()
    proc, stderr_path = serve_store(tmp_path, port)
    try:
        assert listening_sockets(port) == ["0100007F"]  # 127.0.0.1, not every interface
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        stop_store(proc)
    assert "RuntimeWarning" not in stderr_path.read_text()


@pytest.mark.timeout(90)
def test_workers_register_again_when_the_store_comes_back_and_exit_quietly_without_it(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    store = connect_store(address, host=True)  # as a trainer with host_store=True hosts it
    (server,) = start_workers(tmp_path, 1, address, "comeback")
    try:
        assert wait_registered(store, "comeback", 1) == [server.address]
        store = None  # the trainer that hosted it exits (or the store restarts) ...
        assert wait_until(lambda: "is gone" in server.stderr(), timeout=10), server.stderr()
        time.sleep(2.5)  # ... the worker keeps waiting for it, and says so once
        items, used = epoch(
            RPCReadingService(
                workers=StoreDiscovery(address, job="comeback", min_workers=1, host_store=True, timeout=20),
                auth_key=KEY,
            )
        )  # a second trainer hosts a new, empty store at the same address, and finds the worker
        assert items == [2 * i for i in range(40)] and used == [server.address]
        assert "answers again" in server.stderr()
        # The second trainer has shut down, with its store: gone again, said once more.
        assert wait_until(lambda: server.stderr().count("is gone") == 2, timeout=10), server.stderr()
        server.proc.terminate()  # the worker exits cleanly, without a C++ stack trace
        assert server.proc.wait(10) == 0
        log = server.stderr()
        assert "frame #" not in log and "TCPStore.cpp" not in log and "Traceback" not in log, log
    finally:
        server.stop()
