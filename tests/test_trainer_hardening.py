"""A real trainer fed by a hostile worker: a raw socket server that passes the handshake with the
right key, answers SETUP, then sends DATA frames whose items the trainer cannot unpickle.

The trainer must raise a typed error naming the worker, not a bare pickle error (and not hang).
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import ItemUnpicklingError, RPCReadingService, __version__
from rpc_reading_service.protocol import HANDSHAKE_KINDS, FrameReader, ServerHandshake
from rpc_reading_service.protocol.messages import Data, Ready, StartEpoch, decode_message, decode_setup
from rpc_reading_service.serialization import EncodedItem

KEY = b"k" * 32


def _next_frame(conn: socket.socket, reader: FrameReader):
    while (frame := reader.next_frame()) is None:
        data = conn.recv(65536)
        if not data:
            raise EOFError("the trainer closed the connection")
        reader.feed(data)
    return frame


def _send(conn: socket.socket, chunks) -> None:
    conn.sendall(b"".join(bytes(c) for c in chunks))


class HostileWorker:
    """A worker server on a free port that serves one session: handshake, READY, then ``payloads``
    as the items of the first epoch's DATA frame 0; it holds the connection until closed.

    Args:
        payloads: The pickle streams of the frame's items.
    """

    def __init__(self, payloads) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._payloads = payloads
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hostile-worker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            reader = FrameReader(1 << 20, allowed_kinds=HANDSHAKE_KINDS)
            handshake = ServerHandshake(KEY, package_version=__version__)
            _send(conn, handshake.receive_hello(_next_frame(conn, reader)))
            _send(conn, handshake.receive_proof(_next_frame(conn, reader)))
            reader.allowed_kinds, reader.max_frame_bytes = None, 1 << 26
            decode_setup(_next_frame(conn, reader))
            _send(conn, Ready(os.getpid(), "hostile", __version__).encode())
            while not isinstance(start := decode_message(_next_frame(conn, reader)), StartEpoch):
                pass
            items = [EncodedItem(payload, []) for payload in self._payloads]
            _send(conn, Data(start.epoch, 0, items).encode())
            self._done.wait(30)

    def close(self) -> None:
        """Let the session go and join the server's thread."""
        self._done.set()
        self._listener.close()
        self._thread.join(10)
        assert not self._thread.is_alive()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "payload, cause",
    [
        (b"\x80\x05garbage", "UnpicklingError: pickle data was truncated"),
        (b"cno_module_on_this_trainer\nPoint\n.", "ModuleNotFoundError: No module named 'no_module_on_this_trainer'"),
    ],
    ids=["corrupt", "missing-module"],
)
def test_an_item_the_trainer_cannot_unpickle_names_its_worker(payload, cause):
    worker = HostileWorker([pickle.dumps(1), payload])
    try:
        rs = RPCReadingService(num_workers=1, workers=[worker.address], auth_key=KEY, timeout=5)
        started = time.monotonic()
        with DataLoader2(IterableWrapper(range(10)).sharding_filter(), reading_service=rs) as dl:
            with pytest.raises(ItemUnpicklingError) as caught:
                list(dl)
        assert time.monotonic() - started < 10  # at once, not by a timeout
    finally:
        worker.close()
    error = caught.value
    assert (error.rank, error.address) == (0, worker.address)
    assert f"worker 0 ({worker.address}) sent an item this trainer cannot unpickle ({cause})" in str(error)
    assert isinstance(error, pickle.UnpicklingError)  # what callers caught before it named the worker
    assert error.__cause__ is not None
