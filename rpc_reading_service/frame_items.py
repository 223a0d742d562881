"""Unpickling a DATA frame's items on the trainer, from their pickle streams and buffers.

The serialization layer's receiving half for a whole frame (:func:`~rpc_reading_service.protocol.decode_data_parts`
gives its parts); one item: :func:`~rpc_reading_service.serialization.loads_item`.
"""

from __future__ import annotations

import pickle
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from .serialization import Buffer, ItemEncoder, rebuild_tensor, release_sparse_tensors, travels_as_bytes
from .tensor_streams import first_sighting, keep_bounded

__all__ = ["loads_payloads"]

#: A bare tensor's pickle stream with its data out of band is about 90 bytes: longer streams
#: are never one (no look-up for them).
_BARE_TENSOR_STREAM_MAX_BYTES = 256
#: A bare tensor's stream ends with its rebuild's call: REDUCE, MEMOIZE, STOP (a container's does not).
_REDUCE = pickle.REDUCE[0]
_Tensor = torch.Tensor
#: Pickle streams of bare tensors received, by their bytes: the dtype and shape that unpickling
#: one would give ``rebuild_tensor`` (None: a stream of a tensor made otherwise, unpickled);
#: as many as an encoder keeps at most.
_bare_tensor_streams: Dict[bytes, Optional[Tuple[torch.dtype, Tuple[int, ...]]]] = {}
#: Streams of bare tensors unpickled once (a stream is learnt the second time: not one of ever new shapes).
_seen_once: Set[bytes] = set()
#: What a look-up of a stream not in ``_bare_tensor_streams`` gives (None is a stream known not to be one).
_UNKNOWN = ()


def loads_payloads(payloads: Sequence[Buffer], buffers: Optional[Sequence[List[Buffer]]] = None) -> List[Any]:
    """Unpickle a frame's items from their pickle streams and each one's out-of-band buffers
    (None: the frame has none); no Python call per item beyond the items' own rebuilds, and
    none but the tensor's for a bare tensor of a dtype and shape seen before."""
    try:
        if buffers is None:
            return list(map(pickle.loads, payloads))
        loads, streams, items = pickle.loads, _bare_tensor_streams, []
        append = items.append
        for payload, item_buffers in zip(payloads, buffers):
            if (
                len(item_buffers) != 1 or not 3 <= len(payload) <= _BARE_TENSOR_STREAM_MAX_BYTES
                or payload[-3] != _REDUCE
            ):  # fmt: skip
                append(loads(payload, buffers=item_buffers))
                continue
            stream = bytes(payload)
            kind = streams.get(stream, _UNKNOWN)
            if kind:
                append(rebuild_tensor(item_buffers[0], *kind))
                continue
            item = loads(stream, buffers=item_buffers)
            if kind is _UNKNOWN and type(item) is _Tensor:
                _learn(stream, item)
            append(item)
        return items
    finally:
        release_sparse_tensors()


def _learn(stream: bytes, tensor: torch.Tensor) -> None:
    """Remember, the second time ``stream`` is unpickled, whether it is the one an item encoder
    makes of a bare tensor of ``tensor``'s dtype and shape (its rebuild is then ``rebuild_tensor``
    on the buffer alone)."""
    if first_sighting(_seen_once, stream):
        return
    encoded = ItemEncoder(borrow_min_bytes=0).encode(tensor)  # its buffer lent as it is: no copy
    # The same stream again is torch's own reduction for a quantized tensor or one requiring grad:
    # rebuilt from its bytes alone, it had lost those (a quantized one without its quantizer crashed).
    same = encoded.payload == stream and len(encoded.buffers) == 1 and travels_as_bytes(tensor)
    known = (tensor.dtype, tuple(tensor.shape)) if same else None
    keep_bounded(_bare_tensor_streams, stream, known)
