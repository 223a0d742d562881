"""The DataPipe of the loader limit (``limits.LoaderLimit``), apart because it imports torch:
imported by that contender's epoch only."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import IterDataPipe
from workloads import ITEMS_IN_FLIGHT, make_array, receive_into


class ReceivedItems(IterDataPipe):
    """What a trainer's DataLoader2 iterates: one DataPipe (standing for the workers' part of
    the graph, as a reading service's does) over items already made: each item's bytes copied
    into the next of ``workloads.ITEMS_IN_FLIGHT`` reused buffers (the receive's one copy) and
    handed on as a fresh tensor (``torch.frombuffer``), as a receiver rebuilds it."""

    _is_child_datapipe = False  # torch's per-item check finds the flag (see RemoteStream)

    def __init__(self, workload):
        self.workload = workload

    def __iter__(self) -> Iterator:
        nbytes, slots = self.workload.item_bytes, ITEMS_IN_FLIGHT
        made = [make_array(index, nbytes).data for index in range(slots)]
        buffers = [bytearray(nbytes) for _ in range(slots)]
        views = [memoryview(buffer) for buffer in buffers]
        for index in range(self.workload.n_items):
            views[index % slots][:] = made[index % slots]
            yield torch.frombuffer(buffers[index % slots], dtype=torch.uint8)


class StreamedItems(IterDataPipe):
    """What a trainer's DataLoader2 iterates in ``limits.PipelineLimit``: the items of one stream per
    worker (connected sockets, by file descriptor: DataLoader2 copies its DataPipe), item ``i`` from
    stream ``i % W`` as torch's sharding deals them, each received into the next of
    ``workloads.ITEMS_IN_FLIGHT`` reused buffers and handed on as a fresh tensor (``torch.frombuffer``)."""

    _is_child_datapipe = False  # torch's per-item check finds the flag (see RemoteStream)

    def __init__(self, workload, fds: list, family: int):
        self.workload, self.fds, self.family = workload, fds, family

    def __iter__(self) -> Iterator:
        import os
        import socket

        nbytes, slots = self.workload.item_bytes, ITEMS_IN_FLIGHT
        streams = [socket.socket(self.family, socket.SOCK_STREAM, fileno=os.dup(fd)) for fd in self.fds]
        for stream in streams:
            stream.setblocking(True)  # as the raw stream's receive (a duplicate knows no timeout)
        buffers = [bytearray(nbytes) for _ in range(slots)]
        views = [memoryview(buffer) for buffer in buffers]
        try:
            for index in range(self.workload.n_items):
                rank = index % len(streams)
                receive_into(streams[rank], views[index % slots], f"pipeline sender {rank}")
                yield torch.frombuffer(buffers[index % slots], dtype=torch.uint8)
        finally:
            for stream in streams:
                stream.close()
