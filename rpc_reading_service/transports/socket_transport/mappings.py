"""Shared mappings of segments that keep no file descriptor open (Python's ``mmap.mmap`` keeps a
copy of one per mapping, so a trainer mapping thousands of segments ran out of descriptors)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import weakref

__all__ = ["SegmentMapping", "map_shared", "advise", "unmap"]

#: What :func:`map_shared` returns: a ctypes array of ``c_ubyte`` over the mapped bytes.
SegmentMapping = ctypes.Array


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    # address, length, protection, flags, descriptor, offset
    pointer, length, flag = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    libc.mmap.argtypes = [pointer, length, flag, flag, flag, ctypes.c_long]
    libc.munmap.argtypes = [pointer, length]
    libc.madvise.argtypes = [pointer, length, flag]
    return libc


def _raise_errno() -> None:
    code = ctypes.get_errno()
    raise OSError(code, os.strerror(code))


def map_shared(fd: int, size: int) -> SegmentMapping:
    """``size`` bytes of ``fd`` mapped shared and writable, their pages mapped at once where the
    system can (MAP_POPULATE), inherited by forked children (no MADV_DONTFORK: a child left with
    objects on unmapped memory crashed); unmapped once the array and every buffer on it are gone.

    Args:
        fd: The descriptor to map (the caller may close it at once).
        size: Bytes to map from its start.
    """
    libc = _libc()
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        _raise_errno()
    mapping = (ctypes.c_ubyte * size).from_address(address)
    finalizer = weakref.finalize(mapping, libc.munmap, address, size)
    finalizer.atexit = False  # at exit, objects still on the memory may outlive it
    mapping.unmapped_by = finalizer  # type: ignore[attr-defined]
    return mapping


def advise(mapping: SegmentMapping, advice: int) -> None:
    """``madvise`` the whole of ``mapping`` (raises OSError if the kernel refuses).

    Args:
        mapping: What :func:`map_shared` returned.
        advice: An ``mmap.MADV_*`` value.
    """
    if _libc().madvise(ctypes.addressof(mapping), len(mapping), advice) != 0:
        _raise_errno()


def unmap(mapping: SegmentMapping) -> None:
    """Unmap ``mapping`` now: only where nothing was made on it."""
    mapping.unmapped_by()  # type: ignore[attr-defined]
