"""A real trainer fed by a hostile worker: a raw socket server that passes the handshake with the
right key, then answers SETUP or the first epoch with frames a real worker would not send (items
the trainer cannot unpickle, a failure whose exception description is malformed).

The trainer must raise a typed error naming the worker at once: never a bare error of the
trainer's own code, never a hang.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from rpc_reading_service import (
    ItemUnpicklingError,
    RemoteProtocolError,
    RemoteWorkerError,
    RPCReadingService,
    WorkerLostError,
    WorkerStartupError,
    __version__,
)
from rpc_reading_service.protocol import HANDSHAKE_KINDS, FrameReader, MessageKind, ServerHandshake, encode_control, encode_frame
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
    """A worker server on a free port that serves one session: the handshake, then ``at_setup``'s
    frame instead of READY, or READY and ``in_epoch(epoch)``'s frame when the first epoch starts;
    it holds the connection until closed.

    Args:
        at_setup: The chunks of the frame that answers SETUP (None: READY).
        in_epoch: The chunks of the frame sent when an epoch starts, from its number.
    """

    def __init__(self, at_setup=None, in_epoch=None) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._at_setup, self._in_epoch = at_setup, in_epoch
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
            if self._at_setup is not None:
                _send(conn, self._at_setup)
            else:
                _send(conn, Ready(os.getpid(), "hostile", __version__).encode())
                while not isinstance(start := decode_message(_next_frame(conn, reader)), StartEpoch):
                    pass
                _send(conn, self._in_epoch(start.epoch))
            self._done.wait(30)

    def close(self) -> None:
        """Let the session go and join the server's thread."""
        self._done.set()
        self._listener.close()
        self._thread.join(10)
        assert not self._thread.is_alive()


def _first_epoch_error(worker: HostileWorker, expected):
    """The error (of type ``expected``) that a DataLoader2 over ``worker`` raises, at once."""
    try:
        rs = RPCReadingService(num_workers=1, workers=[worker.address], auth_key=KEY, timeout=20)
        started = time.monotonic()
        with pytest.raises(expected) as caught:
            with DataLoader2(IterableWrapper(range(10)).sharding_filter(), reading_service=rs) as dl:
                list(dl)
        assert time.monotonic() - started < 10  # at once, not by the 20 s timeout of a silent worker
    finally:
        worker.close()
    assert worker.address in str(caught.value)
    return caught.value


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
    items = [EncodedItem(pickle.dumps(1), []), EncodedItem(payload, [])]
    error = _first_epoch_error(HostileWorker(in_epoch=lambda epoch: Data(epoch, 0, items).encode()), ItemUnpicklingError)
    assert error.rank == 0
    assert f"worker 0 ({error.address}) sent an item this trainer cannot unpickle ({cause})" in str(error)
    assert isinstance(error, pickle.UnpicklingError)  # what callers caught before it named the worker
    assert error.__cause__ is not None


#: Exception descriptions a real worker never sends, and what the trainer says of each.
MALFORMED_DESCRIPTIONS = [
    ({"type_name": 5, "traceback": "tb"}, "exception's 'type_name' is int 5, expected str"),
    ({"type_name": "X", "pickled": 12}, "exception's 'pickled' is int 12, expected bytes or None"),
]
#: Descriptions whose pickle rebuilds something that is not an exception: told by their text.
NOT_AN_EXCEPTION = [pickle.dumps("text"), pickle.dumps([1])]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("description, problem", MALFORMED_DESCRIPTIONS, ids=["type-name", "pickled"])
def test_a_malformed_failure_is_a_protocol_error_naming_the_worker(description, problem):
    at_setup = encode_control(MessageKind.SETUP_FAILED, {"exception": description})
    error = _first_epoch_error(HostileWorker(at_setup=at_setup), RemoteProtocolError)
    assert f"it sent a malformed SETUP_FAILED (received a SETUP_FAILED message whose {problem})" in str(error)
    in_epoch = lambda epoch: encode_control(MessageKind.SHARD_FAILED, {"epoch": epoch, "exception": description})  # noqa: E731
    error = _first_epoch_error(HostileWorker(in_epoch=in_epoch), WorkerLostError)
    assert f"it sent a malformed SHARD_FAILED (received a SHARD_FAILED message whose {problem})" in str(error)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pickled", NOT_AN_EXCEPTION, ids=["str", "list"])
def test_a_failure_whose_pickle_is_not_an_exception_is_told_by_its_text(pickled):
    description = {"type_name": "BadThing", "traceback": "Traceback: the worker's text", "pickled": pickled}
    at_setup = encode_control(MessageKind.SETUP_FAILED, {"exception": description})
    error = _first_epoch_error(HostileWorker(at_setup=at_setup), WorkerStartupError)
    assert "Caught BadThing in worker process 0" in str(error) and "the worker's text" in str(error)
    in_epoch = lambda epoch: encode_control(MessageKind.SHARD_FAILED, {"epoch": epoch, "exception": description})  # noqa: E731
    error = _first_epoch_error(HostileWorker(in_epoch=in_epoch), RemoteWorkerError)
    assert str(error).startswith("Caught BadThing in worker process 0") and "the worker's text" in str(error)
    assert error.remote_exception is None


_HEAD, _ITEM = struct.Struct("!IQI"), struct.Struct("!QI")  # a DATA frame's head and item table entry
_SEVEN = pickle.dumps(7)
#: DATA frames whose item table does not match their body and buffers: (body chunks, buffers).
BAD_TABLES = {
    "more-items-than-table": lambda e: ([_HEAD.pack(e, 0, 5) + _ITEM.pack(len(_SEVEN), 0), _SEVEN], []),
    "payload-past-body": lambda e: ([_HEAD.pack(e, 0, 1) + _ITEM.pack(len(_SEVEN) + 100, 0), _SEVEN], []),
    "missing-buffers": lambda e: ([_HEAD.pack(e, 0, 1) + _ITEM.pack(len(_SEVEN), 3), _SEVEN], []),
    "extra-buffer": lambda e: ([_HEAD.pack(e, 0, 1) + _ITEM.pack(len(_SEVEN), 0), _SEVEN], [b"xx"]),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(BAD_TABLES))
def test_a_data_frame_whose_item_table_lies_names_its_worker(name):
    in_epoch = lambda epoch: encode_frame(MessageKind.DATA, *BAD_TABLES[name](epoch))  # noqa: E731
    error = _first_epoch_error(HostileWorker(in_epoch=in_epoch), WorkerLostError)
    assert error.rank == 0 and str(error).startswith(f"worker 0 ({error.address}) broke the session protocol: DATA frame")
    assert isinstance(error.__cause__, RemoteProtocolError)
