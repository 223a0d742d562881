"""The bytes of one cache entry on disk: a header that lets a reader tell a whole entry from a
corrupt or partial one.

``MAGIC (8) | payload length (8, big endian) | CRC-32 of the payload (4) | zeros to 64 | payload``.

The CRC-32 is there to catch damage (a torn or truncated write, a flipped bit on disk), not
tampering: whoever can write the cache directory can run code in the worker anyway (entries
are pickles), so a cryptographic hash would buy nothing, and it cost five times as much per
hit (blake2b: about 95 us per 64 KiB, CRC-32: about 18 us). The header is 64 bytes so that
the payload's buffers, rebuilt in place as tensors, start aligned.
"""

from __future__ import annotations

import struct
import zlib
from typing import Optional, Union

__all__ = ["HEADER_BYTES", "encode_entry", "decode_entry", "is_older_format"]

MAGIC = b"RRSCACH2"
_OLDER_MAGICS = (b"RRSCACH1",)  # blake2b, payloads pickled by torch: recomputed once, then rewritten
_HEADER = struct.Struct(">8sQI44x")
HEADER_BYTES = _HEADER.size

Payload = Union[bytes, bytearray, memoryview]


def encode_entry(payload: Payload) -> bytes:
    """The entry for ``payload``: header, then the payload."""
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def decode_entry(data: Payload) -> Optional[memoryview]:
    """The payload of an entry, as a view of ``data`` (no copy), or ``None`` when ``data`` is not
    a whole, intact entry (wrong magic, truncated, extra bytes, or a checksum that does not match)."""
    if len(data) < HEADER_BYTES:
        return None
    magic, length, checksum = _HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER_BYTES:]
    if magic != MAGIC or length != len(payload) or zlib.crc32(payload) != checksum:
        return None
    return payload


def is_older_format(data: Payload) -> bool:
    """Whether ``data`` is an entry an earlier version of this package wrote (not damage)."""
    return bytes(data[: len(MAGIC)]) in _OLDER_MAGICS
