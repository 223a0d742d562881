"""Workloads shared by ``bench.py`` and the processes it starts.

Everything here lives at module level so that plain pickle (rpcdataloader) and
cloudpickle (RPCReadingService) ship it by reference: every process the benchmark
starts gets this directory on ``PYTHONPATH``.  The module imports only the standard
library at import time; torch and torchdata are imported inside the functions that
need them.

Every contender makes its items with :func:`item_function` (the raw-socket sender with
:func:`make_array`, its numpy half), the production limit too: one fresh tensor per item,
every byte written, as a real pipeline's decode or augmentation writes its output.  A
tensor made once and yielded again would let MPRS skip its copy into shared memory (it
is already shared), and a buffer that is never written costs its producer nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import socket
import sys
import time

MIB = 1 << 20
#: Items a producer's hand-over keeps alive after it made them: RPCReadingService's credit
#: window (``prefetch=4`` frames per worker).  An item dropped at once hands its memory back
#: to the allocator, which gives the next item the same, cache-hot buffer: an 8 MiB fill then
#: runs from the CPU cache at ~40 GB/s, which no item handed over to a trainer ever does.
ITEMS_IN_FLIGHT = 4


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one epoch yields: ``n_items`` items of one kind.

    kind: ``"ints"`` (the index itself), ``"tensor"`` (a fresh ``torch.uint8`` tensor
    of ``item_bytes`` bytes, see :func:`make_tensor`), ``"labelled-tensor"`` (the same in a
    tuple with an int label, see :func:`make_labelled_tensor`), ``"shared-tensor"`` (the same, made
    with ``rpc_reading_service.shared_empty``, see :func:`make_tensor_in_shared_memory`) or
    ``"sleep"`` (the index, after ``sleep_s`` seconds of sleep in the producing worker).
    ``block``: shard blocks of that many indices instead of single ones (see
    :func:`build_datapipe`).
    """

    kind: str
    n_items: int
    item_bytes: int = 0
    sleep_s: float = 0.0
    block: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Workload":
        return cls(**data)


def fill_value(index: int) -> int:
    """The byte every element of item ``index`` holds (a receiver can check it)."""
    return index % 251


def make_array(index: int, nbytes: int):
    """A fresh ``nbytes``-byte uint8 numpy array, every byte written with :func:`fill_value`
    (by one thread, whatever torch's thread settings in the producing process)."""
    import numpy

    return numpy.full(nbytes, fill_value(index), dtype=numpy.uint8)


def make_tensor(index: int, nbytes: int):
    """:func:`make_array` handed over with ``torch.from_numpy`` (no copy), as a decoder's
    output usually is: a fresh ``nbytes``-byte uint8 tensor, every byte written."""
    import torch

    return torch.from_numpy(make_array(index, nbytes))


def make_labelled_tensor(index: int, nbytes: int):
    """An image and its label: :func:`make_tensor`'s item and ``index % 1000`` in a tuple."""
    return make_tensor(index, nbytes), index % 1000


def make_tensor_in_shared_memory(index: int, nbytes: int):
    """:func:`make_tensor`'s item, written by the same one-thread numpy fill into memory from
    ``rpc_reading_service.shared_empty``: in a local worker's session a segment its
    transport hands over with no copy, elsewhere (the production limit) ordinary memory."""
    import torch
    from rpc_reading_service import shared_empty

    tensor = shared_empty(nbytes, dtype=torch.uint8)
    tensor.numpy().fill(fill_value(index))
    return tensor


def made_in_shared_memory(workload: "Workload") -> "Workload":
    """``workload`` with its tensors made by :func:`make_tensor_in_shared_memory`."""
    if workload.kind != "tensor":
        raise ValueError(f"only tensor workloads can be made in shared memory, not {workload.kind!r}")
    return dataclasses.replace(workload, kind="shared-tensor")


def sleep_then_return(index: int, seconds: float) -> int:
    """A sleep-bound stage: ``map(lambda x: (time.sleep(s), x)[1])``."""
    time.sleep(seconds)
    return index


def item_function(workload: Workload):
    """The per-item map function of ``workload``, or None for plain ints."""
    if workload.kind == "ints":
        return None
    if workload.kind == "tensor":
        return functools.partial(make_tensor, nbytes=workload.item_bytes)
    if workload.kind == "labelled-tensor":
        return functools.partial(make_labelled_tensor, nbytes=workload.item_bytes)
    if workload.kind == "shared-tensor":
        return functools.partial(make_tensor_in_shared_memory, nbytes=workload.item_bytes)
    if workload.kind == "sleep":
        return functools.partial(sleep_then_return, seconds=workload.sleep_s)
    raise ValueError(f"unknown workload kind {workload.kind!r}")


def block_of(index: int, block: int, n_items: int) -> range:
    """The indices of block ``index`` (``block`` of them, the last one shorter)."""
    return range(index * block, min(n_items, (index + 1) * block))


def build_datapipe(workload: Workload):
    """``IterableWrapper(range(N)).sharding_filter()[.map(fn)]`` for ``workload``.

    With ``workload.block``, ``IterableWrapper(range(N / block)).sharding_filter()``, each
    block flat-mapped into its indices: every worker skips only the other workers' blocks,
    not their items, so the work of an epoch does not grow with the number of workers
    (with W workers, a plain ``sharding_filter`` makes each of them read all N indices).
    """
    from torch.utils.data.datapipes.iter import IterableWrapper  # torchdata's (0.9) is this one; 0.11 has none

    if workload.block:
        blocks = -(-workload.n_items // workload.block)
        expand = functools.partial(block_of, block=workload.block, n_items=workload.n_items)
        datapipe = IterableWrapper(range(blocks)).sharding_filter().flatmap(expand)
    else:
        datapipe = IterableWrapper(range(workload.n_items)).sharding_filter()
    fn = item_function(workload)
    return datapipe if fn is None else datapipe.map(fn)


class MapDataset:
    """The same workload as a map-style dataset (what rpcdataloader consumes)."""

    def __init__(self, workload: dict):
        self.workload = Workload.from_dict(workload)
        self.fn = item_function(self.workload)

    def __len__(self) -> int:
        return self.workload.n_items

    def __getitem__(self, index: int):
        if not 0 <= index < self.workload.n_items:
            raise IndexError(index)
        return index if self.fn is None else self.fn(index)


def connect(address: str) -> socket.socket:
    """Connect to ``tcp:PORT`` (on 127.0.0.1) or ``unix:PATH``."""
    kind, _, where = address.partition(":")
    if kind == "tcp":
        return socket.create_connection(("127.0.0.1", int(where)))
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(where)
        return sock
    raise ValueError(f"unknown address {address!r}")


def receive_into(sock: socket.socket, view: memoryview, sender: str) -> None:
    """Fill ``view`` from ``sock``; ConnectionError naming ``sender`` if it closes first."""
    received, nbytes = 0, view.nbytes
    while received < nbytes:
        count = sock.recv_into(view[received:])
        if not count:
            raise ConnectionError(f"{sender} closed early")
        received += count


def raw_sender(address: str, nbytes: int, count: int) -> None:
    """Connect to ``address`` and ``sendall`` ``count`` items of ``nbytes`` bytes, each a fresh
    array made by :func:`make_array` (the production cost of every contender's items; the
    sender does not import torch, so it starts fast)."""
    with connect(address) as sock:
        try:
            for index in range(count):
                sock.sendall(make_array(index, nbytes))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the receiver stopped early (time budget): not an error


def pipeline_sender(address: str, rank: int, num_workers: int, nbytes: int, count: int) -> None:
    """Connect to ``address`` and ``sendall`` the bytes of every item of worker ``rank``'s part of
    :func:`build_datapipe` (``count`` tensors of ``nbytes``), iterated as a worker session iterates
    it (torch's sharding applied, every DataPipe settled for torch's per-item check): a worker's
    least work per item (its graph and the send), with nothing encoded, framed or credited."""
    import torch.utils.data.graph_settings as graph_settings
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

    from rpc_reading_service.graph import settle_iterator_checks

    datapipe = build_datapipe(Workload("tensor", count, item_bytes=nbytes))
    graph_settings.apply_sharding(datapipe, num_workers, rank, SHARDING_PRIORITIES.MULTIPROCESSING)
    with connect(address) as sock:
        try:
            sock.sendall(rank.to_bytes(4, "little"))
            for item in settle_iterator_checks(datapipe):
                sock.sendall(item.numpy())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the receiver stopped early (time budget): not an error


class SegmentRing:
    """:data:`ITEMS_IN_FLIGHT` shared segments of ``nbytes`` (memfd, every page mapped up
    front), written in turn: :meth:`append` copies an item's bytes into the next one and
    lets the item go once the next one is made, as a local worker's hand-over does with a
    pool of warm segments (the trainer holds up to that many), with nothing moved.

    The last item is kept until the next one arrives because a worker's DataPipe graph keeps
    it that long (torch's iterator hook holds each output until the next is made): dropped
    at once, the allocator would hand the next item the same cache-hot buffer, which no
    worker's graph gets (~0.25 ms less per 8 MiB tensor made here)."""

    def __init__(self, nbytes: int):
        import mmap

        import numpy

        self._segments = []
        for _ in range(ITEMS_IN_FLIGHT):
            fd = os.memfd_create("bench-copy-limit", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, nbytes)
                mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
            self._segments.append(numpy.frombuffer(mapping, dtype=numpy.uint8))
        self._next = 0
        self._last = None

    def append(self, item) -> None:
        """Copy ``item`` (a tensor or array of ``nbytes`` bytes) into the next segment; keep it
        until the next one is appended."""
        import numpy

        numpy.copyto(self._segments[self._next], numpy.asarray(item).reshape(-1).view(numpy.uint8))
        self._next = (self._next + 1) % len(self._segments)
        self._last = item

    def clear(self) -> None:
        """Let go of the last item (the segments live as long as the ring)."""
        self._last = None


def produce_share(workload: Workload, rank: int, num_workers: int, done_fd: int, go,
                  copy_to_shared_memory: bool = False) -> None:
    """Once ``go`` (an event) is set, make worker ``rank``'s share of ``workload`` and hand
    each item nowhere: nothing is moved.

    Each item stays alive while the producer makes the next :data:`ITEMS_IN_FLIGHT` (as
    a hand-over holds it), so every item is written to memory of its own, not to the
    previous item's cache-hot buffer.  With ``copy_to_shared_memory``, each item is
    instead copied once into a :class:`SegmentRing` (made before ``go``) and let go.  One
    byte per item goes to ``done_fd`` (a pipe), so the measuring process counts items as
    they are made.
    """
    make = item_function(workload)
    held = SegmentRing(workload.item_bytes) if copy_to_shared_memory else collections.deque(maxlen=ITEMS_IN_FLIGHT)
    go.wait()
    for index in range(rank, workload.n_items, num_workers):
        held.append(index if make is None else make(index))
        os.write(done_fd, b"\0")
    held.clear()


def count_every(item_bytes: int) -> int:
    """Items a limit's producer makes between two writes of their count: up to 64, at most
    1 MiB of them (a write per item would be a system call and a wake-up of the counting
    process per 1 KiB item, not the producer's own cost)."""
    return max(1, min(64, MIB // max(1, item_bytes)))


def produce_graph_share(workload: Workload, rank: int, num_workers: int, done_fd: int, go) -> None:
    """Once ``go`` (an event) is set, iterate worker ``rank``'s part of :func:`build_datapipe`
    as one of ``num_workers`` workers runs it (torch's sharding applied, every DataPipe settled
    for torch's per-item check as a worker session settles it), and hand each item nowhere.

    Each item stays alive while the next :data:`ITEMS_IN_FLIGHT` are made, as in
    :func:`produce_share`; as many items are made first, untimed, so that the process has its
    memory (a new process's first large items wait for their pages: ~0.2 s per 64 MiB item here,
    ~20 ms once it has them, as a running worker has).  Every item made counts as
    ``num_workers`` items (``num_workers`` workers, each as fast as this one alone):
    ``num_workers`` bytes go to ``done_fd`` per item, written every :func:`count_every`
    items, ``workload.n_items`` bytes in all.
    """
    import torch.utils.data.graph_settings as graph_settings
    from rpc_reading_service.graph import settle_iterator_checks
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

    datapipe = build_datapipe(workload)
    graph_settings.apply_sharding(datapipe, num_workers, rank, SHARDING_PRIORITIES.MULTIPROCESSING)
    items = iter(settle_iterator_checks(datapipe))
    held = collections.deque(maxlen=ITEMS_IN_FLIGHT)
    for index in range(ITEMS_IN_FLIGHT + 1):
        held.append(make_tensor(index, workload.item_bytes))
    held.clear()
    every, counted, pending = count_every(workload.item_bytes), 0, 0
    go.wait()
    for item in items:
        held.append(item)
        pending += 1
        if pending == every:
            counted += os.write(done_fd, b"\0" * min(pending * num_workers, workload.n_items - counted))
            pending = 0
    if pending:
        os.write(done_fd, b"\0" * min(pending * num_workers, workload.n_items - counted))
    held.clear()


USAGE = ("usage: python -m workloads raw-sender tcp:PORT|unix:PATH NBYTES COUNT\n"
         "       python -m workloads pipeline-sender tcp:PORT|unix:PATH RANK WORKERS NBYTES COUNT")


def main(argv: list[str]) -> int:
    """``python -m workloads raw-sender ...`` or ``pipeline-sender ...`` (:data:`USAGE`)."""
    if len(argv) == 4 and argv[0] == "raw-sender":
        raw_sender(argv[1], int(argv[2]), int(argv[3]))
        return 0
    if len(argv) == 6 and argv[0] == "pipeline-sender":
        pipeline_sender(argv[1], *(int(arg) for arg in argv[2:]))
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
