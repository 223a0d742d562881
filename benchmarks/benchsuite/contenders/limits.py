"""The limits the reading services are compared with: making the items in-process, N
processes that only make them (the ceiling for local workers), and one raw socket stream
(TCP and Unix) with the same per-item production cost."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from typing import Iterator

from workloads import build_datapipe, made_in_shared_memory, produce_graph_share, produce_share, receive_into

from benchsuite.contenders.base import Contender
from benchsuite.measure import CLOCK_START, MadeElsewhere
from benchsuite.processes import SERVER_START_TIMEOUT_S, spawn, stop_processes


class InProcess(Contender):
    """Plain iteration of the DataPipe graph, no reading service."""

    name = "in-process"
    one_stream = True

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        yield build_datapipe(workload)


class ProductionLimit(Contender):
    """The ceiling for local workers: ``num_workers`` processes that only make their share
    of the items (the same items as every contender) and hand them nowhere; nothing is moved.
    Each item stays alive while its producer makes the next ``workloads.ITEMS_IN_FLIGHT``
    (as a hand-over holds it): dropped at once, the allocator would give the next item
    the same cache-hot buffer, and the "limit" would be a fill of the CPU cache.

    The producers start together when the epoch's iterator starts, which first yields
    ``CLOCK_START`` (so that the first items' making is timed too), then one
    :class:`MadeElsewhere` per byte the producers write to a pipe (one per item made).  A
    late wakeup of this process can only lower the rate, never raise it.
    """

    name = "production-limit"
    copies_to_shared_memory = False
    clock_starts_at_go = True  # False: the rate counts as any contender's (from its first items)

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        context = multiprocessing.get_context("fork")
        read_fd, write_fd = os.pipe()
        go = context.Event()
        producers = [context.Process(target=target, args=args, daemon=True)
                     for target, args in self.producers(workload, num_workers, write_fd, go)]
        try:
            for producer in producers:
                producer.start()
            os.close(write_fd)
            write_fd = None
            yield self._count(read_fd, workload, go)
        finally:
            for producer in producers:
                if producer.pid is not None:
                    producer.terminate()
                    producer.join()
            os.close(read_fd)
            if write_fd is not None:
                os.close(write_fd)

    def producers(self, workload, num_workers: int, write_fd: int, go) -> list[tuple]:
        """(target, args) of each producer process: one per worker, each making its share."""
        return [(produce_share, (workload, rank, num_workers, write_fd, go, self.copies_to_shared_memory))
                for rank in range(num_workers)]

    def _count(self, read_fd: int, workload, go) -> Iterator[MadeElsewhere]:
        go.set()
        if self.clock_starts_at_go:
            yield CLOCK_START
        item = MadeElsewhere(workload.item_bytes)
        made = 0
        while made < workload.n_items:
            chunk = os.read(read_fd, 4096)
            if not chunk:
                raise ConnectionError(f"producers exited after {made} of {workload.n_items} items")
            for _ in chunk:
                yield item
            made += len(chunk)


class ProductionLimitMadeInSharedMemory(ProductionLimit):
    """:class:`ProductionLimit` for items made with ``rpc_reading_service.shared_empty``
    (``workloads.make_tensor_in_shared_memory``): the same production code as
    ``RPCRS-local-shm``, run outside a worker session, so its memory is ordinary memory."""

    name = "production-limit-shm"
    production_limit = name

    def epoch(self, workload, num_workers):
        import rpc_reading_service.transports.socket_transport.shared_items  # noqa: F401 - imported before the producers fork, untimed

        return super().epoch(made_in_shared_memory(workload), num_workers)


class CopyLimit(ProductionLimit):
    """The ceiling for local workers that copy each item once into shared memory (the
    default hand-over, ``RPCRS-local``): :class:`ProductionLimit`'s processes, each copying
    every item it makes into the next of ``workloads.ITEMS_IN_FLIGHT`` warm shared segments
    (made before the clock starts) and letting it go once the next is made (as a worker's
    DataPipe graph holds it), as a worker's segment pool does; nothing is moved, nothing is
    received."""

    name = "copy-limit"
    copies_to_shared_memory = True


class GraphLimit(ProductionLimit):
    """The most ``num_workers`` DataLoader2 workers can produce: ONE process iterating the
    workload's DataPipe graph as worker 0 of ``num_workers`` (``workloads.produce_graph_share``:
    the same items, torch's sharding and per-item DataPipe hooks), nothing encoded or moved;
    each item it makes counts for ``num_workers``, as if every worker ran as fast on a core
    of its own.  Its rate counts from its first items, as the reading services' do."""

    name = "graph-limit"
    clock_starts_at_go = False

    def producers(self, workload, num_workers, write_fd, go):
        """One producer: worker 0's part of the graph, each item counted ``num_workers`` times."""
        if workload.kind != "tensor":
            raise ValueError(f"{self.name} only makes tensors")
        return [(produce_graph_share, (workload, 0, num_workers, write_fd, go))]


class LoaderLimit(Contender):
    """The most a trainer's DataLoader2 can hand on: ``DataLoader2`` without a reading service
    iterating ``received.ReceivedItems`` (items made before, so nothing is produced or moved); the
    consuming side's own per-item work, what no reading service's trainer avoids."""

    name = "loader-limit"
    one_stream = True

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        from torchdata.dataloader2 import DataLoader2

        from benchsuite.contenders.received import ReceivedItems

        if workload.kind != "tensor":
            raise ValueError(f"{self.name} only hands on tensors")
        loader = DataLoader2(ReceivedItems(workload))
        try:
            yield loader
        finally:
            loader.shutdown()


class RawSocket(Contender):
    """The transport limit: a sender process makes each item as every contender does
    (``workloads.make_array``) and ``sendall``s it over loopback TCP; this process
    ``recv_into``s a preallocated bytearray."""

    name = "raw-socket"
    one_stream = True
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
            sender = spawn([sys.executable, "-m", "workloads", "raw-sender", address, str(nbytes), str(count)])
            try:
                conn = accept_from(listener, [sender])
                with conn:
                    yield self._receive(conn, nbytes, count)
            finally:
                stop_processes([sender])

    @staticmethod
    def _receive(conn: socket.socket, nbytes: int, count: int) -> Iterator[bytearray]:
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        for _ in range(count):
            receive_into(conn, view, "raw sender")
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


class PipelineLimit(RawSocket):
    """The least any DataLoader2 reading service does per item, over loopback TCP: one sender
    process per worker iterates its part of the workload's DataPipe graph as a worker does
    (``workloads.pipeline_sender``: torch's sharding and per-item hooks) and ``sendall``s each
    tensor's bytes; this process's DataLoader2, without a reading service, iterates
    ``received.StreamedItems`` over those streams (each item received into a reused buffer and
    handed on as a fresh tensor).  Nothing is encoded, framed or credited, no thread hands over:
    on a machine where the trainer and the workers share the cores, the graph, the move and
    DataLoader2's loop add up, and this is their sum."""

    name = "pipeline-limit"
    one_stream = False

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        from torchdata.dataloader2 import DataLoader2

        from benchsuite.contenders.received import StreamedItems

        if workload.kind != "tensor" or workload.block:
            raise ValueError(f"{self.name} only moves tensors of a plain graph")
        with contextlib.ExitStack() as stack:
            listener, address = stack.enter_context(self.listen())
            senders = [spawn([sys.executable, "-m", "workloads", "pipeline-sender", address, str(rank),
                              str(num_workers), str(workload.item_bytes), str(workload.n_items)])
                       for rank in range(num_workers)]
            stack.callback(stop_processes, senders)
            streams = [stack.enter_context(accept_from(listener, senders)) for _ in range(num_workers)]
            streams.sort(key=sender_rank)  # the senders connect in any order; each says its rank first
            loader = DataLoader2(StreamedItems(workload, [conn.fileno() for conn in streams], self.family))
            stack.callback(loader.shutdown)
            yield loader


def accept_from(listener: socket.socket, senders: list,
                timeout: float = SERVER_START_TIMEOUT_S) -> socket.socket:
    """The next connection to ``listener`` (blocking, as the receives that follow are), within ``timeout``;
    ConnectionError at once if one of ``senders`` (processes that dial it) exited instead."""
    deadline = time.monotonic() + timeout
    listener.settimeout(0.2)
    while True:
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            exited = [sender.returncode for sender in senders if sender.poll() not in (None, 0)]
            if exited or time.monotonic() > deadline:
                raise ConnectionError(f"no sender connected (exit codes {exited})") from None
            continue
        conn.settimeout(SERVER_START_TIMEOUT_S)
        return conn


def sender_rank(conn: socket.socket) -> int:
    """The rank a pipeline sender says first (4 bytes, little-endian)."""
    said = bytearray(4)
    receive_into(conn, memoryview(said), "pipeline sender (before its rank)")
    return int.from_bytes(said, "little")


class PipelineLimitUnix(PipelineLimit, RawUnixSocket):
    """:class:`PipelineLimit` over Unix domain sockets (as local workers move their items)."""

    name = "pipeline-limit-unix"
    family = socket.AF_UNIX
