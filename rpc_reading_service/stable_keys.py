"""Canonical bytes of an item's key: the same in every process and run (the sticky placement
and the cache's keys hash them), unlike Python's salted ``hash()`` or a pickle, whose memo
makes equal tuples pickle differently."""

from __future__ import annotations

import operator
import struct
from typing import Any

from .errors import StickyKeyError

__all__ = ["encode_key", "sized"]


def sized(tag: bytes, data: bytes) -> bytes:
    """``data`` behind its ``tag`` and its length: concatenations of these cannot collide."""
    return tag + len(data).to_bytes(8, "big") + data


def encode_key(key: Any) -> bytes:
    """The canonical bytes of ``key``: bytes, str, int, float, None, and tuples or lists of them.

    Anything with ``__index__`` counts as an int (numpy integers, one-element integer
    tensors), so ``3``, ``numpy.int64(3)`` and ``torch.tensor(3)`` are one key; a list is
    the same key as the tuple of its elements; ``True`` is ``1`` (Python's equality), but
    ``1.0`` is a float and another key. Raises :class:`StickyKeyError` otherwise (dicts,
    sets, other tensors, arbitrary objects: give a ``key_fn``).
    """
    if isinstance(key, (bytes, bytearray, memoryview)):
        return sized(b"b", bytes(key))
    if isinstance(key, str):
        return sized(b"s", key.encode("utf-8", "surrogatepass"))
    if isinstance(key, float):
        return b"f" + struct.pack(">d", key)
    if key is None:
        return b"n"
    if isinstance(key, (tuple, list)):
        return sized(b"t", b"".join(encode_key(element) for element in key))
    try:
        number = operator.index(key)
    except TypeError:
        raise StickyKeyError(
            f"the sticky distribution cannot hash the key {key!r:.80} of type {type(key).__name__}: keys are "
            "bytes, str, int, float, None or tuples of them; pass distribution=Sticky(key_fn=...) "
            "returning one (e.g. the file path)"
        ) from None
    return sized(b"i", number.to_bytes(number.bit_length() // 8 + 1, "big", signed=True))
