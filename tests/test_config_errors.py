"""Configuration mistakes: each one error that says what is wrong and what to do.

Address typos (no port, bad port, unknown host), nothing listening, a silent listener,
a missing or wrong auth key, and a version mismatch between trainer and worker packages
(protocol version byte in every frame, package version in HELLO and WELCOME).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import threading
import warnings
from typing import Tuple

import pytest
from conftest import _pythonpath
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import _pythonpath, free_port, worker_cli_runs
from rpc_reading_service import (
    AuthenticationError,
    ConfigurationError,
    Hostfile,
    Liveness,
    LocalWorkers,
    ProtocolError,
    Reassign,
    RPCReadingService,
    StoreDiscovery,
    TLS,
    TransportConfig,
    WorkerLostError,
    __version__,
)
from rpc_reading_service.protocol import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    ClientHandshake,
    FrameReader,
    MessageKind,
    encode_frame,
)


def run_epoch(**kwargs):
    kwargs.setdefault("liveness", Liveness(connect_timeout=5.0))
    dl = DataLoader2(IterableWrapper(range(8)).sharding_filter(), reading_service=RPCReadingService(**kwargs))
    try:
        return sorted(dl)
    finally:
        dl.shutdown()


# -- address typos: caught in __init__, before anything is opened -----------------------------------
@pytest.mark.parametrize(
    "address, expected",
    [
        ("cpu-node-1", "worker address 'cpu-node-1' has no port: write it as HOST:PORT, e.g. cpu-node-1:29600"),
        ("cpu-node-1:29x00", "worker address 'cpu-node-1:29x00' has port '29x00', which is not a number"),
        ("cpu-node-1:296000", "worker address 'cpu-node-1:296000' has port 296000, outside 1-65535"),
        (":29600", "worker address ':29600' has no host"),
        ("fe80::1:29600", "IPv6 worker address 'fe80::1:29600' needs brackets: [fe80::1]:29600"),
        ("", "worker address '' is empty"),
    ],
)
def test_address_typos(address, expected):
    with pytest.raises(ConfigurationError) as info:
        RPCReadingService(workers=[address], auth_key="k")
    assert expected in str(info.value)


@pytest.mark.timeout(30)
def test_unknown_host():
    with pytest.raises(ConfigurationError) as info:
        run_epoch(workers=["no-such-host.invalid:29600"], auth_key="k")
    message = str(info.value)
    assert "cannot resolve worker host 'no-such-host.invalid'" in message and "check the spelling" in message


# -- nothing there, or something that does not answer ----------------------------------------------
@pytest.mark.timeout(30)
def test_nothing_listening():
    port = free_port()
    with pytest.raises(WorkerLostError) as info:
        run_epoch(workers=[f"127.0.0.1:{port}"], auth_key="k")
    message = str(info.value)
    assert f"cannot connect to worker at 127.0.0.1:{port}" in message
    assert f"Is `rpc-reading-worker --port {port}` running there" in message
    assert info.value.address == f"127.0.0.1:{port}" and info.value.rank == 0


@pytest.mark.timeout(30)
def test_listener_that_never_answers():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the backlog, nobody ever answers
        address = "127.0.0.1:%d" % silent.getsockname()[1]
        with pytest.raises(WorkerLostError) as info:
            run_epoch(workers=[address], auth_key="k", liveness=Liveness(connect_timeout=1.0))
    message = str(info.value)
    assert f"handshake with worker at {address} timed out after 1.0 s" in message
    assert "does not answer like an rpc-reading-worker" in message and "connect_timeout" in message


class FakePeer:
    """A TCP server that answers every connection with fixed bytes, then closes."""

    def __init__(self, reply: bytes):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.sock.settimeout(0.1)
        self.reply = reply
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(4096)
                    conn.sendall(self.reply)
                    conn.shutdown(socket.SHUT_WR)
                    conn.recv(4096)
                except OSError:
                    pass

    def close(self):
        self.stopped.set()
        self.thread.join(5)
        self.sock.close()


def error_from_fake_peer(reply: bytes) -> Tuple[str, str]:
    """``(address, message)``: the ProtocolError of an epoch against a FakePeer answering ``reply``."""
    peer = FakePeer(reply)
    try:
        with pytest.raises(ProtocolError) as info:
            run_epoch(workers=[peer.address], auth_key="k")
    finally:
        peer.close()
    return peer.address, str(info.value)


@pytest.mark.timeout(30)
def test_another_service_on_the_port():
    address, message = error_from_fake_peer(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    assert message.startswith(f"worker at {address}: not an rpc_reading_service frame")
    assert "wrong port" in message


# -- keys ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_missing_key(worker_server):
    with pytest.raises(AuthenticationError) as info:
        run_epoch(workers=[worker_server.address])  # the server has a key, the trainer none
    message = str(info.value)
    assert f"worker at {worker_server.address}" in message
    assert "this trainer has no auth key (auth_key=None) but the worker requires one" in message
    assert "--auth-key-file" in message and "RPC_READING_SERVICE_AUTH_KEY" in message


@pytest.mark.timeout(60)
def test_wrong_key(worker_server):
    with pytest.raises(AuthenticationError) as info:
        run_epoch(workers=[worker_server.address], auth_key="not-" + worker_server.key)
    message = str(info.value)
    assert f"worker at {worker_server.address}" in message
    assert "does not hold the same auth key as this trainer" in message and "auth_key=" in message
    assert run_epoch(workers=[worker_server.address], auth_key=worker_server.key) == list(range(8))


@pytest.mark.timeout(60)
def test_worker_without_key_refuses_public_interfaces(tmp_path):
    env = {"PYTHONPATH": _pythonpath(), "PATH": "/usr/bin:/bin"}
    public = ["--host", "0.0.0.0", "--port", "0"]
    result, unreadable = worker_cli_runs(
        [public, ["--auth-key-file", str(tmp_path / "absent")]], env=env, cwd=str(tmp_path)
    )
    assert result.returncode == 2
    assert "refusing to listen on 0.0.0.0 without an auth key" in result.stderr
    assert "--auth-key-file" in result.stderr and "Traceback" not in result.stderr
    assert unreadable.returncode == 2 and "cannot read --auth-key-file" in unreadable.stderr


# -- versions -----------------------------------------------------------------------------------------
def hello_with_protocol_version(version: int) -> bytes:
    frame = b"".join(bytes(c) for c in ClientHandshake(b"k", "9.9.9").hello())
    magic, _, kind, n_buffers, body_length = HEADER.unpack(frame[: HEADER.size])
    return HEADER.pack(magic, version, kind, n_buffers, body_length) + frame[HEADER.size :]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1], ids=["older", "newer"])
def test_trainer_with_another_protocol_version_is_told_by_the_server(worker_server, version):
    """A trainer speaking an older or newer protocol version gets a REJECT that says what to do; the server serves on."""
    host, port = worker_server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(hello_with_protocol_version(version))
        reader = FrameReader()
        frame = None
        while frame is None:
            data = sock.recv(4096)
            assert data, "server closed without a REJECT"
            reader.feed(data)
            frame = reader.next_frame()
    assert frame.kind == MessageKind.REJECT
    reason = bytes(frame.body).decode()
    assert f"the peer speaks rpc_reading_service protocol version {version}" in reason
    assert f"this process (rpc_reading_service {__version__}) speaks version {PROTOCOL_VERSION}" in reason
    assert "Install the same rpc_reading_service version on the trainer and on every worker" in reason
    assert "protocol version mismatch" in worker_server.stderr()
    assert run_epoch(workers=[worker_server.address], auth_key=worker_server.key) == list(range(8))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("version", [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1], ids=["older", "newer"])
def test_worker_with_another_protocol_version(version):
    """A worker answering in an older or newer protocol version: the trainer names it and says what to do."""
    challenge = b"".join(bytes(c) for c in encode_frame(MessageKind.CHALLENGE, [b"x" * 64]))
    reply = struct.pack("!4sB", MAGIC, version) + challenge[5:]
    address, message = error_from_fake_peer(reply)
    assert message.startswith(f"worker at {address}: protocol version mismatch")
    assert f"the peer speaks rpc_reading_service protocol version {version}" in message
    assert "Install the same rpc_reading_service version on the trainer and on every worker" in message


@pytest.mark.timeout(90)
def test_package_version_mismatch_with_the_same_protocol_warns_both_sides(fresh_server, caplog):
    """Different package versions that speak the same protocol work, and both sides say so."""
    code = (
        "import sys, rpc_reading_service.transports.socket_transport.listener as st; st.__version__ = '0.0.9'; "
        "from rpc_reading_service.worker import main; sys.exit(main())"
    )
    server = fresh_server(command=[sys.executable, "-c", code])
    with caplog.at_level(logging.WARNING, logger="rpc_reading_service"):
        assert run_epoch(workers=[server.address], auth_key=server.key) == list(range(8))
    assert f"worker at {server.address} runs rpc_reading_service 0.0.9, this trainer {__version__}" in caplog.text
    assert "install the same version on both" in caplog.text
    assert f"runs rpc_reading_service {__version__}, this worker 0.0.9" in server.stderr()


# -- numeric and on/off settings: refused at construction, naming the parameter ---------------------
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "setting, value, allowed",
    [
        ("timeout", INF, "a finite number > 0 (seconds)"),
        ("timeout", NAN, "a finite number > 0 (seconds)"),
        ("timeout", -1.0, "a finite number > 0 (seconds)"),
        ("timeout", "10", "a finite number > 0 (seconds)"),
        ("Liveness.heartbeat_interval", 0, "a finite number > 0 (seconds)"),
        ("Liveness.heartbeat_interval", -0.5, "a finite number > 0 (seconds)"),
        ("Liveness.heartbeat_interval", NAN, "a finite number > 0 (seconds)"),
        ("Liveness.connect_timeout", 0.0, "a finite number > 0 (seconds)"),
        ("Liveness.connect_timeout", INF, "a finite number > 0 (seconds)"),
        ("StoreDiscovery.timeout", NAN, "a finite number > 0 (seconds)"),
        ("Hostfile.timeout", -INF, "a finite number > 0 (seconds)"),
        ("prefetch", 0, "an int >= 1 and <= 1048576 (frames per worker) or None"),
        ("prefetch", 2.5, "an int >= 1 and <= 1048576 (frames per worker) or None"),
        ("prefetch", True, "an int >= 1 and <= 1048576 (frames per worker) or None"),
        ("worker_prefetch_cnt", 0, "an int >= 1 and <= 1048576 (frames per worker) or None"),
        ("main_prefetch_cnt", -1, "an int >= 0 and <= 1048576 (items)"),
        ("TransportConfig.max_frame_bytes", 100, "an int >= 1024 (bytes) or None"),
        ("Reassign.max_reassignments", -1, "an int >= 0"),
        ("Reassign.max_reassignments", INF, "an int >= 0"),
        ("num_workers", -2, "an int >= 0 and <= 4096"),
        ("num_workers", 2.0, "an int >= 0 and <= 4096"),
        ("num_workers", None, "an int >= 0 and <= 4096"),
        ("StoreDiscovery.min_workers", 0, "an int >= 1 and <= 4096 or None"),
        ("Hostfile.min_workers", NAN, "an int >= 1 and <= 4096 or None"),
    ],
)
def test_bad_numeric_settings_are_refused_at_construction(setting, value, allowed):
    with pytest.raises(ConfigurationError) as info:
        build(setting, value)
    # worker_prefetch_cnt is MPRS's name for prefetch.
    named = {"worker_prefetch_cnt": "prefetch"}.get(setting, setting)
    assert str(info.value).startswith(f"{named} must be {allowed}, got {value!r}")


#: Option objects of RPCReadingService, by the name their settings carry in messages.
OPTION_OBJECTS = {
    "Liveness": Liveness,
    "Reassign": Reassign,
    "StoreDiscovery": lambda **kw: StoreDiscovery("127.0.0.1:29700", **kw),
    "Hostfile": lambda **kw: Hostfile("workers.txt", **kw),
    "TransportConfig": TransportConfig,
}


def build(setting, value):
    """RPCReadingService(setting=value), or the option object ``Owner`` of ``Owner.setting``."""
    owner, _, name = setting.rpartition(".")
    if owner:
        return OPTION_OBJECTS[owner](**{name: value})
    return RPCReadingService(**{setting: value})


@pytest.mark.parametrize("setting", ["in_order", "pin_memory", "StoreDiscovery.host_store"])
def test_flags_must_be_booleans(setting):
    with pytest.raises(ConfigurationError, match=f"^{setting} must be True or False, got 'no'$"):
        build(setting, "no")


def test_good_numeric_settings_are_accepted():
    service = RPCReadingService(
        timeout=2, liveness=Liveness(heartbeat_interval=0.25, connect_timeout=1e6), prefetch=1,
        on_worker_failure=Reassign(max_reassignments=0), in_order=False, pin_memory=False,
    )  # fmt: skip
    assert StoreDiscovery("127.0.0.1:29700", timeout=0.5).timeout == 0.5
    assert service.num_workers == 0 and service.in_order is False


@pytest.mark.parametrize(
    "setting, value, allowed",
    [
        ("auth_key", 1234, "a str, bytes or None"),
        ("worker_init_fn", "my_init", "a function fn(datapipe, worker_info) or None"),
        ("worker_reset_fn", 3, "a function fn(datapipe, worker_info, seed_generator) or None"),
        ("pickle_by_value", "my_package", "a list of imported modules"),
        ("pickle_by_value", ["my_package"], "a list of imported modules"),
        (
            "TransportConfig.options",
            [("max_frame_bytes", 1)],
            "a dict of keyword arguments for the transport",
        ),
    ],
)
def test_settings_of_the_wrong_kind_are_refused_at_construction(setting, value, allowed):
    with pytest.raises(ConfigurationError) as info:
        build(setting, value)
    assert str(info.value).startswith(f"{setting} must be {allowed}") and repr(value) in str(info.value)


# -- transport options, the local cache directory, bounds and weak keys: caught in __init__ too -------
@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: TransportConfig("torch_rpc", tls=TLS("ca.pem")), "transport 'torch_rpc' cannot use TLS"),
        (lambda: TransportConfig(tls=TLS("/no/such/ca.pem")), "cannot load the TLS CA bundle tls_ca_file='/no/such/ca.pem'"),
        (lambda: TransportConfig(options={"shared_memory": "no"}), "shared_memory must be True or False, got 'no'"),
        (lambda: TransportConfig(options={"tls_cafile": "ca.pem"}), "transport 'socket' does not accept the options ['tls_cafile']"),
        (lambda: TransportConfig("torch_rpc", options={"rpc_timeout": 0}), "rpc_timeout must be positive"),
    ],
)
def test_transport_options_are_refused_at_construction(make, expected):
    with pytest.raises(ConfigurationError) as info:
        RPCReadingService(workers=["127.0.0.1:29600"], transport=make())
    assert expected in str(info.value)


def test_unusable_cache_dir_is_refused_at_construction(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ConfigurationError, match="is not a directory"):
        RPCReadingService(num_workers=1, workers=LocalWorkers(cache_dir=str(a_file)))
    with pytest.raises(ConfigurationError, match="its parent .* does not exist. Create the parent"):
        RPCReadingService(num_workers=1, workers=LocalWorkers(cache_dir=str(tmp_path / "missing" / "cache")))
    with pytest.raises(ConfigurationError, match="its parent .* does not exist"):
        LocalWorkers(cache_dir=str(a_file / "cache"))
    LocalWorkers(cache_dir=str(tmp_path / "new"))  # missing, in a writable directory: created when the run starts
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any directory")
def test_read_only_cache_dir_is_refused_at_construction(tmp_path):
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    with pytest.raises(ConfigurationError, match="is not writable by this user"):
        LocalWorkers(cache_dir=str(read_only))
    with pytest.raises(ConfigurationError, match="is not writable by this user"):
        LocalWorkers(cache_dir=str(read_only / "cache"))


@pytest.mark.parametrize(
    "setting, bound, allowed",
    [
        ("num_workers", 4096, "an int >= 0 and <= 4096"),
        ("prefetch", 2**20, "an int >= 1 and <= 1048576 (frames per worker) or None"),
        ("main_prefetch_cnt", 2**20, "an int >= 0 and <= 1048576 (items)"),
        ("StoreDiscovery.min_workers", 4096, "an int >= 1 and <= 4096 or None"),
    ],
)
def test_absurdly_large_counts_are_refused_at_construction(setting, bound, allowed):
    with pytest.raises(ConfigurationError) as info:
        build(setting, bound + 1)
    assert str(info.value).startswith(f"{setting} must be {allowed}, got {bound + 1}")
    build(setting, bound)


def test_short_auth_key_warns_with_what_to_do():
    with pytest.warns(UserWarning, match="the auth key is only 5 bytes.*at least 16 random bytes") as record:
        RPCReadingService(workers=["127.0.0.1:29600"], auth_key="hunt2")
    assert record[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RPCReadingService(workers=["127.0.0.1:29600"], auth_key="x" * 16)
        RPCReadingService(workers=["127.0.0.1:29600"])
