"""TLS in the socket transport: a TLS session end to end, mismatches fail fast and clearly,
the HMAC handshake stays on inside TLS, and the server's non-blocking TLS handshake is not
stalled by silent or garbage peers. Certificates come from ``trustme``, made here."""

from __future__ import annotations

import os
import time

import pytest
import trustme
from _server_helpers import big_item, connect, read_until_closed, running_server
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import big_item, connect, read_until_closed, run_epochs, running_server
from rpc_reading_service import (
    TLS,
    AuthenticationError,
    ConfigurationError,
    Liveness,
    ProtocolError,
    RPCReadingService,
    TransportConfig,
    WorkerRefusedError,
)
from rpc_reading_service import worker as worker_cli
from rpc_reading_service.transports.socket_transport import SocketTransport, TLSSocketConnection

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, and a server certificate for 127.0.0.1/localhost it signed, as PEM files."""
    path = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(path / "ca.pem"))
    cert.private_key_pem.write_to_path(str(path / "key.pem"))
    with open(path / "cert.pem", "wb") as handle:  # leaf first, then the chain
        for blob in cert.cert_chain_pems:
            handle.write(blob.bytes())
    trustme.CA().cert_pem.write_to_path(str(path / "other-ca.pem"))
    return {name: str(path / f"{name}.pem") for name in ("ca", "cert", "key", "other-ca")}


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, certs):
    args = ["--tls-cert", certs["cert"], "--tls-key", certs["key"], "--handshake-timeout", "3"]
    with running_server(tmp_path_factory.mktemp("tls"), args) as server:
        yield server


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("plain")) as server:
        yield server


def _epoch(service: RPCReadingService, datapipe) -> list:
    return run_epochs(datapipe, service, n_epochs=1)[0]


def test_tls_session_end_to_end(tls_server, certs):
    """Small items and 160 KB tensors (many TLS records per frame) arrive intact, twice."""
    service = RPCReadingService(
        workers=[tls_server.address],
        transport=TransportConfig(tls=TLS(certs["ca"])),
        num_workers=2,
        auth_key=tls_server.key,
    )
    datapipe = IterableWrapper(range(48)).sharding_filter().map(big_item)
    dl = DataLoader2(datapipe, reading_service=service)
    try:
        for _ in range(2):
            items = list(dl)
            assert sorted(i for i, _ in items) == list(range(48))
            assert all(tensor.shape == (40_000,) and bool((tensor == i).all()) for i, tensor in items)
    finally:
        dl.shutdown()
    assert "TLS" in tls_server.log()


def test_tls_connection_is_encrypted_and_named(tls_server, certs):
    transport = SocketTransport(tls_ca_file=certs["ca"], tls_server_hostname="localhost")
    conn = transport.connect(tls_server.address, tls_server.key.encode(), timeout=10)
    try:
        assert isinstance(conn, TLSSocketConnection)
        assert conn._sock.version() in ("TLSv1.2", "TLSv1.3")
    finally:
        conn.close()


def test_plain_trainer_against_tls_server_is_refused_quickly(tls_server):
    service = RPCReadingService(
        workers=[tls_server.address], liveness=Liveness(connect_timeout=30), auth_key=tls_server.key
    )
    start = time.monotonic()
    with pytest.raises(WorkerRefusedError, match=r"requires TLS.*TLS\(ca_file\)") as info:
        _epoch(service, IterableWrapper(range(4)))
    assert time.monotonic() - start < 5
    assert tls_server.address in str(info.value)
    assert "requires TLS" in tls_server.log()


def test_tls_trainer_against_plain_server_fails_quickly(plain_server, certs):
    service = RPCReadingService(
        workers=[plain_server.address],
        transport=TransportConfig(tls=TLS(certs["ca"])),
        liveness=Liveness(connect_timeout=30),
        auth_key=plain_server.key,
    )
    start = time.monotonic()
    with pytest.raises(ProtocolError, match="does not seem to speak TLS") as info:
        _epoch(service, IterableWrapper(range(4)))
    assert time.monotonic() - start < 5
    assert plain_server.address in str(info.value)


def test_certificate_from_another_ca_is_rejected(tls_server, certs):
    service = RPCReadingService(
        workers=[tls_server.address],
        transport=TransportConfig(tls=TLS(certs["other-ca"])),
        auth_key=tls_server.key,
    )
    with pytest.raises(AuthenticationError, match="failed verification"):
        _epoch(service, IterableWrapper(range(4)))


def test_wrong_hostname_is_rejected(tls_server, certs):
    transport = SocketTransport(tls_ca_file=certs["ca"], tls_server_hostname="not-the-worker.example")
    with pytest.raises(AuthenticationError, match="not-the-worker.example"):
        transport.connect(tls_server.address, tls_server.key.encode(), timeout=10)


def test_hmac_handshake_still_required_under_tls(tls_server, certs):
    service = RPCReadingService(
        workers=[tls_server.address], transport=TransportConfig(tls=TLS(certs["ca"])), auth_key="wrong key"
    )
    with pytest.raises(AuthenticationError, match="same auth key"):
        _epoch(service, IterableWrapper(range(4)))


def test_silent_and_garbage_peers_do_not_stall_tls_handshakes(tls_server, certs):
    """The server's TLS handshakes are non-blocking: stalled peers never hold up others."""
    silent = connect(tls_server.address)  # sends nothing at all
    stalled = connect(tls_server.address)
    stalled.sendall(b"\x16\x03\x01")  # the start of a TLS record, then nothing
    garbage = connect(tls_server.address)
    garbage.sendall(b"\x16" + os.urandom(300))  # looks like TLS, is not
    try:
        time.sleep(0.2)
        start = time.monotonic()
        conn = SocketTransport(tls_ca_file=certs["ca"]).connect(tls_server.address, tls_server.key.encode(), 10)
        conn.close()
        assert time.monotonic() - start < 2
        _, closed = read_until_closed(garbage, timeout=5)
        assert closed, "the server kept a garbage TLS peer"
        # The stalled peers are dropped at the handshake deadline (--handshake-timeout 3).
        for sock in (silent, stalled):
            _, closed = read_until_closed(sock, timeout=6)
            assert closed, "a silent peer outlived the handshake timeout"
    finally:
        for sock in (silent, stalled, garbage):
            sock.close()
    log = tls_server.log()
    assert "TLS handshake failed" in log
    assert "no handshake within 3.0 s" in log
    assert tls_server.alive()


def test_tls_configuration_errors(tmp_path, certs, capsys):
    assert worker_cli.main(["--port", "0", "--tls-key", certs["key"]]) == 2
    assert "--tls-key needs --tls-cert" in capsys.readouterr().err
    assert worker_cli.main(["--port", "0", "--tls-cert", str(tmp_path / "missing.pem")]) == 2
    assert "cannot load the TLS certificate" in capsys.readouterr().err
    with pytest.raises(ConfigurationError, match="remote workers"):
        RPCReadingService(num_workers=2, transport=TransportConfig(tls=TLS(certs["ca"])))
    with pytest.raises(ConfigurationError, match="tls_ca_file"):
        SocketTransport(tls_ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigurationError, match="does not accept"):
        RPCReadingService(
            workers=["127.0.0.1:1"], transport=TransportConfig(options={"no_such_option": 1})
        ).initialize(IterableWrapper(range(2)))
