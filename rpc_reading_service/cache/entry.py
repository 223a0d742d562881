"""The bytes of one cache entry on disk: a header that lets a reader tell a whole entry from a
corrupt or partial one.

``MAGIC (8) | payload length (8, big endian) | blake2b-256 of the payload (32) | payload``.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Optional

__all__ = ["HEADER_BYTES", "encode_entry", "decode_entry"]

MAGIC = b"RRSCACH1"
_HEADER = struct.Struct(">8sQ32s")
HEADER_BYTES = _HEADER.size


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


def encode_entry(payload: bytes) -> bytes:
    """The entry for ``payload``: header, then the payload."""
    return _HEADER.pack(MAGIC, len(payload), _digest(payload)) + payload


def decode_entry(data: bytes) -> Optional[bytes]:
    """The payload of an entry, or ``None`` when ``data`` is not a whole, intact entry
    (wrong magic, truncated, extra bytes, or a checksum that does not match)."""
    if len(data) < HEADER_BYTES:
        return None
    magic, length, digest = _HEADER.unpack_from(data)
    payload = data[HEADER_BYTES:]
    if magic != MAGIC or length != len(payload) or _digest(payload) != digest:
        return None
    return payload
