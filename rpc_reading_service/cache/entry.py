"""The bytes of one cache entry on disk: a header that lets a reader tell a whole entry of its key
from a corrupt, partial or misplaced one.

``MAGIC (8) | payload length (8, big endian) | CRC-32 of the payload (4) | key digest (16) |
zeros to 64 | payload``: the key digest (blake2b-128 of the key) makes an entry found under
another key's name (copied, renamed, restored to the wrong place) a miss, not that key's value.

The CRC-32 is there to catch damage (a torn or truncated write, a flipped bit on disk), not
tampering: whoever can write the cache directory can run code in the worker anyway (entries
are pickles), so a cryptographic hash would buy nothing, and it cost five times as much per
hit (blake2b: about 95 us per 64 KiB, CRC-32: about 18 us). The header is 64 bytes so that
the payload's buffers, rebuilt in place as tensors, start aligned.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Optional, Union

__all__ = ["HEADER_BYTES", "encode_entry", "decode_entry", "is_older_format"]

MAGIC = b"RRSCACH4"
#: RRSCACH3: tensors' dtypes pickled as torch globals, which this version still reads (an older
#: one reads no RRSCACH4 entry: it computes the item again instead of failing on a dtype's name).
_READABLE_MAGICS = (MAGIC, b"RRSCACH3")
#: RRSCACH1: blake2b, payloads pickled by torch; RRSCACH2: no key. Recomputed once, then rewritten.
_OLDER_MAGICS = (b"RRSCACH1", b"RRSCACH2")
_HEADER = struct.Struct(">8sQI16s28x")
HEADER_BYTES = _HEADER.size

Payload = Union[bytes, bytearray, memoryview]


def _key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def encode_entry(key: str, payload: Payload) -> bytes:
    """The entry for ``payload`` under ``key``: header, then the payload.

    Args:
        key: The key the entry is stored under.
        payload: The bytes to keep.
    """
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload), _key_digest(key)) + payload


def decode_entry(data: Payload, key: str) -> Optional[memoryview]:
    """The payload of an entry, as a view of ``data`` (no copy), or ``None`` when ``data`` is not
    a whole, intact entry of ``key`` (wrong magic, truncated, extra bytes, a checksum that does
    not match, or another key's entry).

    Args:
        data: The entry's bytes.
        key: The key it was looked up under.
    """
    if len(data) < HEADER_BYTES:
        return None
    magic, length, checksum, digest = _HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER_BYTES:]
    if magic not in _READABLE_MAGICS or length != len(payload) or digest != _key_digest(key) or zlib.crc32(payload) != checksum:
        return None
    return payload


def is_older_format(data: Payload) -> bool:
    """Whether ``data`` is an entry an earlier version of this package wrote (not damage)."""
    return bytes(data[: len(MAGIC)]) in _OLDER_MAGICS
