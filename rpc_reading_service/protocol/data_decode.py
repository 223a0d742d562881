"""Decoding DATA (and ITEMS) frames: the item table read, each item's payload a view into the body.

The receiving half of :func:`~rpc_reading_service.protocol.frames.encode_data` (the layout:
docs/architecture.md); the trainer's hot path decodes with :func:`decode_data_parts`.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Tuple

from ..errors import RemoteProtocolError
from ..serialization import Buffer, EncodedItem
from .frames import DATA_HEAD, DATA_ITEM, Frame, data_header

__all__ = ["decode_data", "decode_data_parts"]

_LENGTH, _COUNT = operator.itemgetter(0), operator.itemgetter(1)


def decode_data(frame: Frame) -> Tuple[int, int, List[EncodedItem]]:
    """Unpack a DATA (or ITEMS) frame into ``(epoch, sequence, items)``, without copying payloads."""
    epoch, sequence, payloads, buffers = decode_data_parts(frame)
    if buffers is None:
        return epoch, sequence, [EncodedItem(payload) for payload in payloads]
    return epoch, sequence, [EncodedItem(payload, item_buffers) for payload, item_buffers in zip(payloads, buffers)]


def decode_data_parts(frame: Frame) -> Tuple[int, int, List[memoryview], Optional[List[List[Buffer]]]]:
    """``(epoch, sequence, payloads, buffers)`` of a DATA (or ITEMS) frame: each item's pickle
    stream (a view into the body) and its out-of-band buffers (None: the frame has none); no
    object per item beyond its view and its list of buffers (the trainer's hot path)."""
    epoch, sequence, count = data_header(frame)
    body = memoryview(frame.body)
    table_end = DATA_HEAD.size + count * DATA_ITEM.size
    if table_end > len(body):
        raise RemoteProtocolError(f"{frame.kind.name} frame announces {count} items but is too short for their table")
    table = list(DATA_ITEM.iter_unpack(body[DATA_HEAD.size : table_end]))
    buffers = frame.buffers
    if table_end + sum(map(_LENGTH, table)) != len(body) or sum(map(_COUNT, table)) != len(buffers):
        raise RemoteProtocolError(f"{frame.kind.name} frame item table does not match its body and buffers")
    if count == 1:  # a frame of one item (large ones)
        return epoch, sequence, [body[table_end:]], [list(buffers)] if buffers else None
    payloads: List[memoryview] = []
    offset = table_end
    for length, _ in table:
        payloads.append(body[offset : offset + length])
        offset += length
    if not buffers:  # the common case for small items: no out-of-band buffers at all
        return epoch, sequence, payloads, None
    per_item: List[List[Buffer]] = []
    offset = 0
    for _, n_buffers in table:
        per_item.append(buffers[offset : offset + n_buffers])
        offset += n_buffers
    return epoch, sequence, payloads, per_item
