"""Local workers' shared-memory segments with real processes: big buffers handed over in segments,
nothing left behind by a killed worker or trainer, a frame of small buffers in one read."""

from __future__ import annotations

import gc
import multiprocessing
import os
import secrets
import signal
import time

import numpy
import pytest
import torch
from _server_helpers import open_file_targets, remote, wait_until
from test_shared_memory import BIG, SEGMENT_NAME, in_shared_memory, shared_ranges

from rpc_reading_service.errors import WorkerLostError
from rpc_reading_service.protocol import MessageKind, encode_data, encode_frame
from rpc_reading_service.serialization import (
    SHARED_MEMORY_MIN_BYTES,
    dumps_item,
    loads_item,
)
from rpc_reading_service.transports.socket_transport.shared_memory import (
    shared_memory_available,
)

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="needs memfd (Linux)")

QUANTIZED_HALF = SHARED_MEMORY_MIN_BYTES // 2  # a batch of two is as big as a plain one that is shared



# -- real processes -----------------------------------------------------------------------------------
def item_of_every_size(index: int):
    """A big tensor (shared), a batch collated in shared memory (lent with no copy), a big array
    (shared), a small one (in band: under the out-of-band and shared-memory threshold):
    every byte is ``index``; and quantized tensors, a big one, a small one and a batch."""
    from rpc_reading_service import shared_collate

    made = shared_collate([torch.full((BIG // 2,), index, dtype=torch.uint8)] * 2)
    return {
        "big": torch.full((BIG,), index, dtype=torch.uint8),
        "made": made,
        "made_in_a_segment": in_shared_memory(made.data_ptr(), shared_ranges(os.getpid())),  # in the worker
        "array": numpy.full(SHARED_MEMORY_MIN_BYTES // 4, index, dtype=numpy.int32),
        "small": torch.full((10,), index, dtype=torch.int64),
        # Quantized ones, as big as a plain one that is shared: their memory alone is no plain
        # tensor (torch's reduction rebuilds them on it). repeat(): quantizing a big one is slow.
        "quantized_big": torch.quantize_per_tensor(torch.tensor([index / 2]), 0.5, 3, torch.quint8).repeat(
            SHARED_MEMORY_MIN_BYTES
        ),
        "quantized_small": torch.quantize_per_channel(
            torch.full((2, 3), float(index)), torch.tensor([1.0, 0.5]), torch.tensor([0, -1]), 0, torch.qint8
        ),
        "quantized_made": shared_collate(
            [torch.quantize_per_tensor(torch.tensor([float(index)]), 1.0, 0, torch.quint8).repeat(QUANTIZED_HALF)] * 2
        ),
    }


def check_quantized(item, index: int) -> None:
    """The quantized tensors of :func:`item_of_every_size` arrived with their quantizers and values."""
    big, small, made = item.pop("quantized_big"), item.pop("quantized_small"), item.pop("quantized_made")
    assert (big.dtype, big.shape, big.q_scale(), big.q_zero_point()) == (torch.quint8, (SHARED_MEMORY_MIN_BYTES,), 0.5, 3)
    assert bool((big.int_repr() == index + 3).all()) and bool((big.dequantize() == index / 2).all())
    assert (small.dtype, small.q_per_channel_axis()) == (torch.qint8, 0)
    assert small.q_per_channel_scales().tolist() == [1.0, 0.5] and small.q_per_channel_zero_points().tolist() == [0, -1]
    assert small.int_repr().tolist() == [[index] * 3, [2 * index - 1] * 3]
    assert made.shape == (2, QUANTIZED_HALF) and made.q_scale() == 1.0 and bool((made.int_repr() == index).all())


def segment_descriptors(pid) -> int:
    """Descriptors of segments ``pid`` holds open."""
    return sum(SEGMENT_NAME in target for target in open_file_targets(pid))


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's own rebuild of a quantized tensor warns of TypedStorage
def test_local_workers_hand_big_buffers_over_in_shared_memory():
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    from rpc_reading_service import RPCReadingService

    graph = IterableWrapper(range(24)).sharding_filter().map(item_of_every_size)
    with DataLoader2(graph, reading_service=RPCReadingService(num_workers=2)) as dl:
        for epoch in range(2):
            items = list(dl)
            assert sorted(int(item["small"][0]) for item in items) == list(range(24))
            ranges = shared_ranges(os.getpid())
            for item in items:
                index = int(item["small"][0])
                assert item.pop("made_in_a_segment") is True  # a forked session's graph made it in its pool
                assert in_shared_memory(item["quantized_big"].data_ptr(), ranges)  # its storage, staged
                check_quantized(item, index)
                assert all(bool((value == index).all()) for value in item.values())
                assert in_shared_memory(item["big"].data_ptr(), ranges)
                assert in_shared_memory(item["made"].data_ptr(), ranges) and item["made"].shape == (2, BIG // 2)
                assert in_shared_memory(item["array"].ctypes.data, ranges)
            item["big"][:] = 0  # received memory is writable
            del items, item
    gc.collect()
    assert shared_ranges(os.getpid()) == [] and segment_descriptors(os.getpid()) == 0


def _tree(pid: int) -> list:
    from _server_helpers import children_of

    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        todo.extend(children_of(current))
    return pids


def _leaks(server, *pids) -> list:
    """Segments still mapped or open in ``pids`` and in the server's process tree."""
    found = []
    for pid in [*_tree(server.pid), *pids]:
        try:
            if shared_ranges(pid) or segment_descriptors(pid):
                found.append(pid)
        except OSError:  # gone meanwhile
            pass
    return found


def _trainer(address: str, key: str, report_fd: int) -> None:
    """A trainer that holds its last items and reports each one on ``report_fd``, until killed."""
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    from rpc_reading_service import RPCReadingService

    graph = IterableWrapper(range(10_000)).sharding_filter().map(item_of_every_size)
    service = RPCReadingService(num_workers=2, workers=[address] * 2, auth_key=key)
    held: list = []
    for item in DataLoader2(graph, reading_service=service):
        held = [item, *held[:3]]
        os.write(report_fd, b"." if in_shared_memory(item["big"].data_ptr(), shared_ranges(os.getpid())) else b"x")
        time.sleep(0.01)


def _kill_a_trainer_mid_epoch(server) -> None:
    """Fork a trainer of ``server`` and SIGKILL it once it holds items received in shared memory."""
    read_fd, write_fd = os.pipe()
    trainer = multiprocessing.get_context("fork").Process(target=_trainer, args=(server.address, server.key, write_fd))
    trainer.start()  # forked: torch is imported already
    os.close(write_fd)
    try:
        reports = b""
        while len(reports) < 8:
            chunk = os.read(read_fd, 8)
            assert chunk, f"the trainer exited early (code {trainer.exitcode})"
            reports += chunk
        assert set(reports) == {ord(".")}, "the trainer received big tensors outside shared memory"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(10)
    finally:
        if trainer.is_alive():
            trainer.kill()
        trainer.join()
        os.close(read_fd)


def _map_count(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as maps:
        return len(maps.readlines())


@pytest.mark.timeout(90)
def test_sigkill_of_a_worker_or_of_the_trainer_mid_epoch_leaves_nothing(fresh_server, tmp_path):
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    server = fresh_server(args=["--host", f"unix:@rrs-shm-test-{secrets.token_hex(6)}"], env={"TMPDIR": str(private_tmp)})
    dev_shm = set(os.listdir("/dev/shm"))
    server_fds = sorted(os.listdir(f"/proc/{server.pid}/fd"))
    server_maps = _map_count(server.pid)

    # A worker killed mid-epoch: the trainer sees the loss, and lets go of every segment.
    graph = IterableWrapper(range(10_000)).sharding_filter().map(item_of_every_size)
    dl = DataLoader2(graph, reading_service=remote(server, num_workers=2))
    try:
        iterator = iter(dl)
        held = [next(iterator) for _ in range(6)]
        assert all(in_shared_memory(item[key].data_ptr(), shared_ranges(os.getpid())) for item in held for key in ("big", "made"))
        victim = server.session_pids()[0]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerLostError):
            for _ in range(10_000):
                held.append(next(iterator))
        del iterator
    finally:
        dl.shutdown()
    assert all(bool((item[key] == int(item["small"][0])).all()) for item in held for key in ("big", "made"))  # intact after the kill
    del held
    gc.collect()
    assert wait_until(lambda: not server.session_pids(), 10)
    assert _leaks(server, os.getpid()) == []

    # The trainer killed mid-epoch (holding items): its sessions end and free theirs.
    _kill_a_trainer_mid_epoch(server)
    assert wait_until(lambda: not server.session_pids(), 15)
    assert _leaks(server) == []

    assert server.alive()
    # The server closes a session's descriptors (its stack-dump pipe) and unmaps its metrics page
    # just after it reaps the session: wait for it.
    assert wait_until(lambda: sorted(os.listdir(f"/proc/{server.pid}/fd")) == server_fds, 5), os.listdir(f"/proc/{server.pid}/fd")
    assert wait_until(lambda: _map_count(server.pid) == server_maps, 5), (_map_count(server.pid), server_maps)
    assert list(private_tmp.iterdir()) == []
    assert set(os.listdir("/dev/shm")) <= dev_shm | {name for name in os.listdir("/dev/shm") if name.startswith("torch_")}


@pytest.mark.timeout(60)
def test_a_server_running_sessions_in_threads_keeps_no_segment_of_a_killed_trainer(fresh_server):
    # Here the server process itself holds the sessions' segments: all of them must go.
    server = fresh_server(args=["--host", f"unix:@rrs-shm-test-{secrets.token_hex(6)}", "--session-mode", "thread"])
    server_fds = len(os.listdir(f"/proc/{server.pid}/fd"))
    _kill_a_trainer_mid_epoch(server)
    assert wait_until(lambda: _leaks(server) == [] and len(os.listdir(f"/proc/{server.pid}/fd")) == server_fds, 15)
    assert server.alive()


@pytest.mark.timeout(30)
def test_a_local_connection_takes_a_whole_frame_of_small_buffers_in_one_read():
    # A local worker's DATA frame of 64 KiB items (1 MiB, through the socket: under the shared
    # memory threshold) is queued whole by its send, so the trainer's receive loop takes it in
    # one read instead of one per piece the default send buffer (208 KiB) lets through.
    import contextlib
    import fcntl
    import struct
    import termios
    import threading

    from rpc_reading_service.protocol import decode_data
    from rpc_reading_service.transports.base import PeerLostError
    from rpc_reading_service.transports.socket_transport import SocketTransport
    from rpc_reading_service.transports.socket_transport.sockets import UNIX_SEND_BUFFER_BYTES

    with open("/proc/sys/net/core/wmem_max") as limit:
        if int(limit.read()) < UNIX_SEND_BUFFER_BYTES:
            pytest.skip("this host caps a socket's send buffer under what a local connection asks (net.core.wmem_max)")
    key, address = secrets.token_bytes(16), f"unix:@rrs-test-{secrets.token_hex(6)}"
    transport = SocketTransport()
    listener = transport.listen(address, 0, key)
    accepted = []
    accepting = threading.Thread(target=lambda: accepted.append(listener.accept(timeout=10)))
    accepting.start()
    trainer = transport.connect(address, key, timeout=10)
    accepting.join(10)
    [worker] = accepted
    reads, sending = [], None
    receive = trainer._recv_some
    trainer._recv_some = lambda views: reads.append(len(views)) or receive(views)
    try:
        items = [dumps_item(numpy.full(64 << 10, 10 * k + i, dtype=numpy.uint8)) for k in range(2) for i in range(16)]
        frames = [encode_frame(MessageKind.DATA, *encode_data(0, k, items[16 * k : 16 * (k + 1)])) for k in range(2)]
        total = sum(memoryview(chunk).nbytes for chunks in frames for chunk in chunks)

        def send() -> None:
            with contextlib.suppress(PeerLostError):  # main: the test closes the connection under it
                worker.send_frames(frames)

        sending = threading.Thread(target=send)
        sending.start()
        deadline = time.monotonic() + 5
        while struct.unpack("i", fcntl.ioctl(trainer.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0] < total:
            assert time.monotonic() < deadline, "the worker's send did not queue its frames whole"
            time.sleep(0.001)
        received = []
        while len(received) < len(frames):
            received += trainer.recv_ready()
        assert [[int(loads_item(item)[0]) for item in decode_data(frame)[2]] for frame in received] == [
            [10 * k + i for i in range(16)] for k in range(2)
        ]
        assert len(reads) <= len(frames) + 1, reads  # main: the frames did not fit the send buffer
    finally:
        trainer.close()
        worker.close()
        listener.close()
        if sending is not None:
            sending.join(5)

