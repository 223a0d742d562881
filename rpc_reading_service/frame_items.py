"""Unpickling a DATA frame's items on the trainer, from their pickle streams and buffers.

The serialization layer's receiving half for a whole frame (:func:`~rpc_reading_service.protocol.decode_data_parts`
gives its parts); one item: :func:`~rpc_reading_service.serialization.loads_item`.
"""

from __future__ import annotations

import pickle
from typing import Any, List, Optional, Sequence

from .serialization import Buffer, release_sparse_tensors

__all__ = ["loads_payloads"]


def loads_payloads(payloads: Sequence[Buffer], buffers: Optional[Sequence[List[Buffer]]] = None) -> List[Any]:
    """Unpickle a frame's items from their pickle streams and each one's out-of-band buffers
    (None: the frame has none); no Python call per item beyond the items' own rebuilds."""
    try:
        if buffers is None:
            return list(map(pickle.loads, payloads))
        loads = pickle.loads
        return [loads(payload, buffers=item_buffers) for payload, item_buffers in zip(payloads, buffers)]
    finally:
        release_sparse_tensors()
