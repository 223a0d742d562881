"""The pickle streams of bare tensors by dtype and shape, kept by an item encoder to make the next
ones of a kind without its pickler (docs/architecture.md, "Serialization")."""

from __future__ import annotations

import pickle
from typing import Any, List, Set, Tuple

__all__ = ["TensorStreams"]

#: Dtypes and shapes of bare tensors whose pickle streams an encoder keeps (cleared when full).
_KEPT = 64
#: The opcode of a bytearray's bytes in a protocol 5 stream, with its 8-byte length after it.
_BYTEARRAY8 = pickle.BYTEARRAY8


class TensorStreams(dict):
    """A bare tensor's pickle stream by ``(dtype, shape)``: the bytes before and after its in-band
    data (None after: its data is out of band, the stream is all of it). A dict: the encoder's
    look-up is ``get``, no Python call."""

    def __init__(self) -> None:
        super().__init__()
        #: The dtypes and shapes of bare tensors pickled once (their streams are kept the second time).
        self._seen: Set[Tuple[Any, Any]] = set()

    def keep(self, tensor: Any, key: Tuple[Any, Any], payload: bytes, out_of_band: List[memoryview]) -> None:
        """Keep a bare tensor's pickle stream for the next ones of its dtype and shape, the second
        time one is pickled (not for a stream of ever new shapes).

        Args:
            tensor: The tensor pickled (a ``torch.Tensor``, not a subclass).
            key: Its dtype and shape.
            payload: The pickler's stream of it.
            out_of_band: The buffers the pickler gave out of band.
        """
        if key not in self._seen:
            if len(self._seen) >= _KEPT:
                self._seen.clear()
            self._seen.add(key)
            return
        try:
            array = tensor.numpy()
        except (RuntimeError, TypeError):
            return
        if not array.flags.c_contiguous:
            return
        if len(self) >= _KEPT:
            self.clear()  # more dtypes and shapes than that: start again
        if out_of_band:
            if len(out_of_band) == 1 and out_of_band[0].nbytes == array.nbytes:
                self[key] = (payload, None)
            return
        data = bytes(pickle.PickleBuffer(array).raw())
        start = payload.find(_BYTEARRAY8 + len(data).to_bytes(8, "little")) + len(_BYTEARRAY8) + 8
        if start >= len(_BYTEARRAY8) + 8 and payload[start : start + len(data)] == data:
            self[key] = (payload[:start], payload[start + len(data) :])
