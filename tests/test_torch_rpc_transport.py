"""``transport="torch_rpc"``: torch.distributed.rpc (TensorPipe) behind the Transport interface.

End to end against local workers and against a ``python -m rpc_reading_service.worker
--transport torch_rpc`` server, plus what is specific to torch RPC: one world per trainer
process shared by concurrent loaders, a trainer that already runs its own RPC agent, a
transport mismatch either way, a rendezvous that never completes, a dead session, loopback
worlds without network listeners, and the frame <-> RPC argument conversion itself.
"""

from __future__ import annotations

import functools
import os
import random
import re
import signal
import socket
import struct
import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import children_of, open_file_targets, process_alive, run_epochs, start_server, wait_until
from _server_helpers import remote as shared_remote
from rpc_reading_service import (
    ConfigurationError,
    Liveness,
    RPCReadingService,
    WorkerLostError,
    WorkerStartupError,
)
from rpc_reading_service.errors import FrameTooLargeError, ProtocolError
from rpc_reading_service.protocol import MessageKind, encode_control, encode_data, encode_frame
from rpc_reading_service.serialization import dumps_item
from rpc_reading_service.transports.torch_rpc import codec as trt
from rpc_reading_service.transports.base import PeerLostError
from rpc_reading_service.transports.socket_transport import SocketTransport

pytestmark = pytest.mark.timeout(60)

N_ITEMS = 40


def with_noise(x):
    return (x, random.randrange(1_000_000))


def fail_at_7(x):
    if x == 7:
        raise ValueError(f"bad item {x}")
    return x


def die_at_5(x):
    if x == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def die_once(marker, x):
    if x == 5 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def cuda_item(x):
    return torch.full((3,), float(x), device="cuda")


def shuffled():
    return IterableWrapper(range(N_ITEMS)).shuffle().sharding_filter().map(with_noise)


def no_rpc_agent():
    return not rpc._is_current_rpc_agent_set()


@pytest.fixture(scope="module")
def rpc_server(tmp_path_factory):
    """``python -m rpc_reading_service.worker --transport torch_rpc --port 0`` (keyed), on
    loopback: tests never send traffic to this host's network addresses."""
    server = start_server(tmp_path_factory.mktemp("torch_rpc_server"), args=["--transport", "torch_rpc"])
    yield server
    server.stop()


def remote(server, num_workers=2, transport="torch_rpc", **kwargs):
    """A reading service on ``server`` over ``transport`` (torch_rpc unless told), with a generous connect timeout."""
    kwargs.setdefault("liveness", Liveness(connect_timeout=30))
    return shared_remote(server, num_workers, transport=transport, **kwargs)


def listening_tcp_addresses():
    """(ip, port) of the TCP sockets this process listens on, from /proc."""
    inodes = {target[len("socket:[") : -1] for target in open_file_targets(os.getpid()) if target.startswith("socket:[")}
    found = []
    for table, width in (("/proc/self/net/tcp", 4), ("/proc/self/net/tcp6", 16)):
        with open(table) as handle:
            for line in handle.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_ip, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_ip)
                if width == 4:
                    ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:
                    ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
                found.append((ip, int(hex_port, 16)))
    return found


# -- end to end --------------------------------------------------------------------------------------
def test_local_workers_give_the_socket_transports_order(worker_server):
    expected = run_epochs(shuffled(), remote(worker_server, transport="socket"), seed=5)
    rpc_rs = RPCReadingService(num_workers=2, transport="torch_rpc", liveness=Liveness(connect_timeout=30))
    with DataLoader2(shuffled(), reading_service=rpc_rs) as dl:
        dl.seed(5)
        got = [list(dl) for _ in range(2)]
        server_pid = dl.reading_service._local_server.pid
        started = time.monotonic()
    assert time.monotonic() - started < 5.0, "shutdown took too long"
    assert got == expected
    assert all(sorted(x for x, _ in epoch) == list(range(N_ITEMS)) for epoch in got)
    assert got[0] != got[1]
    assert wait_until(lambda: not process_alive(server_pid), 5.0), "local worker server left behind"
    assert no_rpc_agent(), "the trainer's RPC world outlived its last connection"


def test_cli_server_with_more_sessions_than_addresses(rpc_server):
    listening = []
    dp = IterableWrapper(range(N_ITEMS)).sharding_filter().map(lambda x: {"x": x, "t": torch.full((40_000,), float(x))})
    with DataLoader2(dp, reading_service=remote(rpc_server, num_workers=3)) as dl:
        items = []
        for item in dl:
            if not listening:
                listening = listening_tcp_addresses()
            items.append(item)
    assert sorted(item["x"] for item in items) == list(range(N_ITEMS))
    assert all(torch.equal(item["t"], torch.full((40_000,), float(item["x"]))) for item in items)
    # A loopback world: the rendezvous store on 127.0.0.1, TensorPipe over shared memory only.
    assert listening and all(ip in ("127.0.0.1", "::1") for ip, _ in listening), listening
    assert wait_until(lambda: not children_of(rpc_server.pid), 5.0), "session processes left behind"


def test_seeded_runs_repeat_against_the_cli_server(rpc_server):
    first = run_epochs(shuffled(), remote(rpc_server), seed=9)
    assert run_epochs(shuffled(), remote(rpc_server), seed=9) == first
    assert first[0] != first[1]


def test_dispatching_over_cli_servers_of_both_transports_gives_local_workers_items(worker_server, rpc_server):
    """sharding_round_robin_dispatch: ITEM_CREDIT, ITEMS and END_OF_INPUT travel to servers started
    with the CLI, over the socket transport and over torch RPC, with the items of local workers."""

    def dispatched():
        dp = IterableWrapper(range(N_ITEMS)).shuffle().sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
        return dp.map(with_noise)

    expected = run_epochs(dispatched(), RPCReadingService(num_workers=2), seed=9)
    assert run_epochs(dispatched(), remote(worker_server, transport="socket"), seed=9) == expected
    assert run_epochs(dispatched(), remote(rpc_server), seed=9) == expected
    assert sorted(x for x, _ in expected[0]) == list(range(N_ITEMS)) and expected[0] != expected[1]


def test_remote_exception(rpc_server):
    dp = IterableWrapper(range(20)).sharding_filter().map(fail_at_7)
    with DataLoader2(dp, reading_service=remote(rpc_server)) as dl:
        with pytest.raises(ValueError, match="bad item 7") as info:
            list(dl)
    assert rpc_server.address in str(info.value) and "Traceback" in str(info.value)


def test_early_break_then_next_epoch_then_bounded_shutdown(rpc_server):
    dl = DataLoader2(IterableWrapper(range(5_000)).sharding_filter(), reading_service=remote(rpc_server, prefetch=1))
    for index, _ in enumerate(dl):
        if index == 5:
            break
    assert sorted(dl) == list(range(5_000))
    iterator = iter(dl)
    next(iterator)
    started = time.monotonic()
    dl.shutdown()
    assert time.monotonic() - started < 5.0
    assert wait_until(lambda: not children_of(rpc_server.pid), 5.0), "session processes left behind"
    assert wait_until(no_rpc_agent, 2.0)


def test_concurrent_loaders_share_one_world_and_departed_sessions_never_block_joins(rpc_server):
    dp = IterableWrapper(range(N_ITEMS)).sharding_filter()
    first = DataLoader2(dp, reading_service=remote(rpc_server))
    second = DataLoader2(dp, reading_service=remote(rpc_server))
    try:
        a, b = iter(first), iter(second)
        merged = [(next(a), next(b)) for _ in range(5)]
        assert sorted(x for x, _ in merged) == sorted(y for _, y in merged)
        assert sorted([x for x, _ in merged] + list(a)) == list(range(N_ITEMS))
        first.shutdown()  # its sessions leave the world while `second` keeps it open
        third = DataLoader2(dp, reading_service=remote(rpc_server))
        try:
            assert sorted(third) == list(range(N_ITEMS))
        finally:
            third.shutdown()
        assert sorted([y for _, y in merged] + list(b)) == list(range(N_ITEMS))
    finally:
        first.shutdown()
        second.shutdown()
    assert wait_until(no_rpc_agent, 2.0)


def test_a_dead_session_is_a_worker_lost_error_at_once(rpc_server):
    # timeout=30: the error must come from the closed bootstrap socket, not a heartbeat timeout.
    dp = IterableWrapper(range(20)).sharding_filter().map(die_at_5)
    started = time.monotonic()
    with DataLoader2(dp, reading_service=remote(rpc_server, timeout=30)) as dl:
        with pytest.raises(WorkerLostError, match=rpc_server.address.replace(".", r"\.")):
            list(dl)
    assert time.monotonic() - started < 10.0
    assert wait_until(lambda: not children_of(rpc_server.pid), 5.0)
    assert run_epochs(IterableWrapper(range(6)).sharding_filter(), remote(rpc_server), n_epochs=1) == [list(range(6))]


def test_a_lost_session_is_replaced_in_the_same_world(rpc_server, tmp_path):
    # The replacement joins a world whose member list still names the dead session.
    dp = IterableWrapper(range(N_ITEMS)).sharding_filter().map(functools.partial(die_once, str(tmp_path / "died")))
    rs = remote(rpc_server, on_worker_failure="reassign")
    (epoch,) = run_epochs(dp, rs, n_epochs=1)
    assert sorted(epoch) == list(range(N_ITEMS))
    assert (tmp_path / "died").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_arrive_on_the_cpu(rpc_server):
    (epoch,) = run_epochs(IterableWrapper(range(4)).sharding_filter().map(cuda_item), remote(rpc_server), n_epochs=1)
    assert all(t.device.type == "cpu" for t in epoch)


# -- configuration errors: clear and fast, never a hang -------------------------------------------
def test_a_trainer_with_its_own_rpc_agent_is_refused_clearly(rpc_server):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", _transports=["shm"], _channels=["basic"]
    )
    rpc.init_rpc("users_own_agent", rank=0, world_size=1, rpc_backend_options=options)
    try:
        started = time.monotonic()
        with pytest.raises(ConfigurationError, match="already initialised.*users_own_agent"):
            run_epochs(IterableWrapper(range(4)).sharding_filter(), remote(rpc_server), n_epochs=1)
        assert time.monotonic() - started < 5.0
    finally:
        rpc.shutdown()
        rpc.rendezvous_iterator = None  # torch keeps the static world's store alive through this
    assert run_epochs(IterableWrapper(range(4)).sharding_filter(), remote(rpc_server), n_epochs=1) == [[0, 1, 2, 3]]


def test_a_socket_worker_tells_a_torch_rpc_trainer(worker_server):
    started = time.monotonic()
    with pytest.raises(ConfigurationError, match="does not speak torch_rpc.*--transport torch_rpc"):
        run_epochs(IterableWrapper(range(4)).sharding_filter(), remote(worker_server), n_epochs=1)
    assert time.monotonic() - started < 10.0
    assert no_rpc_agent()
    assert run_epochs(IterableWrapper(range(4)).sharding_filter(), remote(worker_server, transport="socket"), n_epochs=1) == [
        [0, 1, 2, 3]
    ]


def test_a_torch_rpc_worker_tells_a_socket_trainer(rpc_server):
    started = time.monotonic()
    with pytest.raises(WorkerStartupError, match="runs transport 'torch_rpc'.*transport='torch_rpc'"):
        run_epochs(IterableWrapper(range(4)).sharding_filter(), remote(rpc_server, transport="socket"), n_epochs=1)
    assert time.monotonic() - started < 10.0


def test_a_rendezvous_that_never_completes_fails_within_the_timeout():
    key = b"k" * 32
    listener = SocketTransport().listen("127.0.0.1", 0, key)
    seen, release = [], threading.Event()

    def silent_worker():  # authenticates, takes the rendezvous request, never joins
        conn = listener.accept(timeout=10)
        if conn is not None:
            seen.append(conn.recv(timeout=10))
            release.wait(10)
            conn.close()

    thread = threading.Thread(target=silent_worker, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        rs = RPCReadingService(
            num_workers=1,
            workers=[listener.address],
            transport="torch_rpc",
            liveness=Liveness(connect_timeout=2),
            auth_key=key,
        )
        with pytest.raises(WorkerLostError, match="rendezvous .* did not complete within 2.0 s.*tcp://127.0.0.1:"):
            run_epochs(IterableWrapper(range(4)).sharding_filter(), rs, n_epochs=1)
        assert time.monotonic() - started < 6.0  # connect_timeout plus DataLoader2 setup, on a busy host
    finally:
        release.set()
        thread.join(5)
        listener.close()
    assert seen and seen[0].kind == MessageKind.SETUP
    assert no_rpc_agent(), "a failed rendezvous must not leave the trainer's world open"


# C++ (c10/TensorPipe) log lines at warning level or above, and Python log records of those levels.
WARNING_LINE = re.compile(r"^\[[WEF]\d{4} |\] (WARNING|ERROR|CRITICAL) ", re.MULTILINE)


@pytest.mark.timeout(30)
def test_a_clean_run_prints_no_warnings_on_the_trainer_or_the_workers(rpc_server, capfd):
    """An epoch and a shutdown against a CLI server: no TensorPipe warnings on the trainer's
    stderr (captured at the file descriptor, where C++ writes) nor on the server's (where its
    session processes write)."""
    assert wait_until(lambda: not rpc_server.session_pids(), 10.0), "sessions of earlier tests still run"
    server_log_start = len(rpc_server.stderr())
    capfd.readouterr()
    assert run_epochs(IterableWrapper(range(8)).sharding_filter(), remote(rpc_server), n_epochs=1)[0] != []
    trainer_stderr = capfd.readouterr().err

    def server_stderr() -> str:
        return rpc_server.stderr()[server_log_start:]

    assert wait_until(lambda: server_stderr().count(" ended") == 2, 10.0), server_stderr()
    assert not WARNING_LINE.search(trainer_stderr), trainer_stderr
    assert not WARNING_LINE.search(server_stderr()), server_stderr()


# -- frames <-> RPC arguments (no processes) -----------------------------------------------------------
def _roundtrip(chunks, max_frame_bytes=1 << 30, allocate=None):
    head, body, buffers = trt.split_rpc_frame(chunks)
    return trt._join_frame(head, body, buffers, max_frame_bytes, allocate)


def test_frames_survive_the_conversion_with_their_buffers():
    items = [dumps_item({"t": torch.arange(50_000)}), dumps_item("small"), dumps_item(b"x" * 100_000)]
    body, buffers = encode_data(3, 7, items)
    frame = _roundtrip(encode_frame(MessageKind.DATA, body, buffers))
    assert frame.kind == MessageKind.DATA
    assert bytes(frame.body) == b"".join(bytes(part) for part in body)
    assert [bytes(b) for b in frame.buffers] == [bytes(memoryview(b).cast("B")) for b in buffers]
    assert all(not memoryview(b).readonly for b in frame.buffers)
    control = _roundtrip(encode_control(MessageKind.START_EPOCH, {"epoch": 1}))
    assert control.kind == MessageKind.START_EPOCH and isinstance(control.body, bytes)
    big_body = _roundtrip(encode_frame(MessageKind.DATA, [b"a" * 100_000, b"b" * 50_000]))
    assert bytes(big_body.body) == b"a" * 100_000 + b"b" * 50_000  # a large body travels as a tensor
    allocated = []
    _roundtrip(encode_frame(MessageKind.DATA, [b""], [b"z" * 10]), allocate=lambda n: allocated.append(n) or bytearray(n))
    assert allocated == [10]


def test_send_copies_so_the_caller_may_reuse_its_memory():
    buffer = bytearray(b"a" * 100)
    head, body, buffers = trt.split_rpc_frame(encode_frame(MessageKind.DATA, [b"body"], [buffer]))
    buffer[:] = b"b" * 100
    assert bytes(buffers[0].numpy()) == b"a" * 100


def test_malformed_frames_are_protocol_errors():
    head, body, buffers = trt.split_rpc_frame(encode_frame(MessageKind.DATA, [b"body"], [b"12345"]))
    with pytest.raises(ProtocolError, match="not an rpc_reading_service frame"):
        trt._join_frame(b"XXXX" + head[4:], body, buffers, 1 << 30, None)
    with pytest.raises(ProtocolError, match="protocol version"):
        trt._join_frame(head[:4] + bytes([99]) + head[5:], body, buffers, 1 << 30, None)
    with pytest.raises(ProtocolError, match="sizes"):
        trt._join_frame(head, b"bod", buffers, 1 << 30, None)
    with pytest.raises(ProtocolError, match="buffers"):
        trt._join_frame(head, body, [], 1 << 30, None)
    with pytest.raises(FrameTooLargeError, match="over the maximum"):
        trt._join_frame(head, body, buffers, 8, None)
    with pytest.raises(ProtocolError, match="chunks"):
        trt.split_rpc_frame([struct.pack("!4sBBHQ", b"RRSV", 1, 21, 0, 10), b"short"])


def test_the_inbox_restores_send_order_and_reports_loss_after_the_frames():
    inbox = trt.RPCInbox(1 << 20)
    frames = [_roundtrip(encode_control(MessageKind.CREDIT, {"n": i})) for i in range(3)]
    inbox.put(2, frames[2])
    inbox.put(1, frames[1])
    assert inbox.get(timeout=0.01) is None  # frame 0 is still missing
    inbox.put(0, frames[0])
    inbox.put(1, frames[1])  # a duplicate is never delivered twice
    inbox.fail(PeerLostError("gone"))
    assert [inbox.get(timeout=0) for _ in range(3)] == frames
    with pytest.raises(PeerLostError, match="gone"):
        inbox.get(timeout=0)


def test_built_in_transports_are_found_without_their_entry_points(tmp_path, monkeypatch):
    """An installed distribution whose entry points name the built-ins at stale module paths
    (as an editable install made before a module moved does) changes nothing."""
    from rpc_reading_service import transports as registry
    from rpc_reading_service.transports.torch_rpc import TorchRPCTransport

    dist_info = tmp_path / "rrs_stale-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: rrs-stale\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\n"
        "socket = rpc_reading_service.transports.gone:SocketTransport\n"
        "torch_rpc = rpc_reading_service.transports.torch_rpc_transport:TorchRPCTransport\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry._registry, "factories", dict(registry._registry.factories))
    monkeypatch.setattr(registry._registry, "entry_points_loaded", False)
    stale = {ep.name for ep in registry._registry.entry_points() if ep.value.startswith("rpc_reading_service.transports.")}
    assert stale >= {"socket", "torch_rpc"}  # the stale metadata is visible to the registry
    assert {"socket", "torch_rpc"} <= set(registry.available_transports())
    assert isinstance(registry.create_transport("torch_rpc"), TorchRPCTransport)
    assert isinstance(registry.create_transport("socket"), SocketTransport)
