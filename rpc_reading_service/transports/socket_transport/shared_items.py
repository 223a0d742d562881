"""Items made directly in shared memory: what a worker's graph calls to skip the hand-over copy.

A local worker hands every large buffer over in a shared segment, which costs one copy of
the item in the worker. A stage that makes its output in a segment of the session's pool
instead (a decoder writing into a buffer it was given, a collate stacking into one) saves
that copy: the transport recognises the memory and lends the segment as it is.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence, Union

import numpy
import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from ...serialization import SHARED_MEMORY_MIN_BYTES
from .shared_memory import allocate

__all__ = ["shared_collate", "shared_empty"]


def shared_empty(shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised CPU tensor, like ``torch.empty(shape, dtype=dtype)``, which a local
    worker hands over to the trainer with no copy when it is (part of) an item.

    Inside the session of a local worker (Unix socket, shared memory offered by the trainer,
    the session in a process of its own: the default), the tensor lives in a segment of that
    session's pool; write every element, then yield it in an item. Everywhere else (remote
    workers over TCP, a server running sessions in threads, in-process iteration, tensors under 256 KiB, a full pool) it is ordinary memory,
    so a graph that calls it runs unchanged anywhere. The trainer receives an ordinary,
    writable tensor either way. Do not write to the tensor after yielding it: the trainer
    reads the same memory. A quantized ``dtype`` raises TypeError (the memory alone has no
    quantizer); :func:`shared_collate` stacks quantized tensors in ordinary memory.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"shared_empty: dtype must be a torch.dtype, got {dtype!r}")
    if _is_quantized(dtype):
        # Its memory alone would make a tensor without scale and zero point, which no quantized op can read.
        raise TypeError(
            f"shared_empty: {dtype} is a quantized dtype, and shared_empty makes plain tensors; make the "
            "quantized tensor with torch.quantize_per_tensor or torch.quantize_per_channel instead: it reaches "
            "the trainer intact, in ordinary memory"
        )
    size = torch.Size((shape,) if isinstance(shape, int) else tuple(shape))
    if any(d < 0 for d in size):
        raise ValueError(f"shared_empty: every dimension must be >= 0, got shape {tuple(size)}")
    nbytes = math.prod(size) * dtype.itemsize
    if nbytes < SHARED_MEMORY_MIN_BYTES:
        return torch.empty(size, dtype=dtype)
    memory = allocate(nbytes)
    if memory is None:
        # numpy's memory, not torch.empty's: numpy asks for huge pages for large arrays, which
        # made a fresh 8 MiB tensor cost half as much to write here.
        return torch.from_numpy(numpy.empty(nbytes, dtype=numpy.uint8)).view(dtype).view(size)
    tensor = torch.frombuffer(memory, dtype=dtype)
    return tensor if len(size) == 1 else tensor.view(size)


@functools.lru_cache(maxsize=None)
def _is_quantized(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` are quantized (torch.dtype does not say; a tensor does)."""
    return torch.empty((0,), dtype=dtype).is_quantized


def _stack_in_shared_memory(batch: Sequence[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    elem = batch[0]
    if elem.device.type != "cpu" or elem.layout != torch.strided or elem.is_nested or elem.is_quantized:
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # its own checks and errors
    return torch.stack(batch, 0, out=shared_empty((len(batch), *elem.shape), elem.dtype))


_SHARED_COLLATE_FN_MAP = {**default_collate_fn_map, torch.Tensor: _stack_in_shared_memory}


def shared_collate(batch: Any) -> Any:
    """``torch.utils.data.default_collate``, stacking tensors (and numpy arrays) into
    :func:`shared_empty` memory: a local worker hands the batch over with no copy, as torch's
    DataLoader workers stack theirs into shared memory. Use it where the graph collates:
    ``datapipe.batch(64).collate(collate_fn=shared_collate)``.
    """
    return collate(batch, collate_fn_map=_SHARED_COLLATE_FN_MAP)
