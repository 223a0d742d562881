"""The C heap of a worker session's own process: freed memory stays mapped for the next items."""

from __future__ import annotations

import ctypes

__all__ = ["keep_freed_heap", "HEAP_MMAP_BYTES", "HEAP_TRIM_BYTES"]

#: Blocks up to this size come from the heap (glibc's own adaptive limit settles here for large items).
HEAP_MMAP_BYTES = 32 * 1024 * 1024
#: Free memory at the heap's top goes back to the kernel only past this much.
HEAP_TRIM_BYTES = 2 * HEAP_MMAP_BYTES

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_heap(mmap_bytes: int = HEAP_MMAP_BYTES, trim_bytes: int = HEAP_TRIM_BYTES) -> bool:
    """Set this process's heap to keep freed memory (glibc ``mallopt``); False where the C library
    has no such setting.

    Args:
        mmap_bytes: Allocations smaller than this come from the heap, not from a mapping of their own.
        trim_bytes: Free bytes the heap keeps at its top before it gives memory back.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt (macOS)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # Setting either one ends glibc's own adjustment of both: both are set.
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))
