"""The limits the reading services are compared with: making the items in-process, and
one raw socket stream (TCP and Unix)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
from typing import Iterator

from benchsuite.contenders.base import Contender
from benchsuite.processes import SERVER_START_TIMEOUT_S, spawn, stop_processes
from workloads import build_datapipe

class InProcess(Contender):
    """Plain iteration of the DataPipe graph, no reading service."""

    name = "in-process"
    one_stream = True

    @contextlib.contextmanager
    def epoch(self, workload, num_workers):
        yield build_datapipe(workload)


class RawSocket(Contender):
    """The transport limit: a sender process ``sendall``s one buffer per item over
    loopback TCP; this process ``recv_into``s a preallocated bytearray."""

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
