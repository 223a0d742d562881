"""The pickle streams of bare tensors by dtype and shape, and of flat tuples, lists and dicts of
tensors, ints and floats by their kind, kept by an item encoder to make the next ones of a kind
without its pickler (docs/architecture.md, "Serialization")."""

from __future__ import annotations

import pickle
import struct
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from .receive_buffers import REUSED_BUFFER_MIN_BYTES

__all__ = [
    "CONTAINERS",
    "ContainerStreams",
    "TensorStreams",
    "container_kind",
    "first_sighting",
    "keep_bounded",
]

#: Kinds (dtypes and shapes, or containers) whose pickle streams an encoder keeps (cleared when full).
_KEPT = 64
#: The opcode of a bytearray's bytes in a protocol 5 stream, with its 8-byte length after it.
_BYTEARRAY8 = pickle.BYTEARRAY8
#: The containers whose streams are kept (exactly these types: no subclass).
CONTAINERS = frozenset((tuple, list, dict))
#: A container of more elements than this is pickled every time.
_MAX_ELEMENTS = 16
#: How an element of a kept container travels: a tensor's bytes in band or out of band, an int in
#: 1 or 2 unsigned or 4 signed bytes (pickle's BININT1, BININT2, BININT), a float (BINFLOAT).
_IN_BAND, _OUT_OF_BAND, _INT1, _INT2, _INT4, _FLOAT = range(6)
#: The bytes of each scalar slot in the stream, and which of them its changed value alters.
_SCALAR_BYTES = {_INT1: (1, 0), _INT2: (2, 0), _INT4: (4, 0), _FLOAT: (8, 7)}
_Tensor = torch.Tensor
_PickleBuffer = pickle.PickleBuffer
_double = struct.Struct(">d")
#: A container kind's kept stream: the pieces around its elements' changing bytes, each element's slot.
Kept = Tuple[Tuple[bytes, ...], Tuple[int, ...]]


def _array(tensor: Any) -> Optional[Any]:
    """The C-contiguous numpy view of ``tensor``, or None if it has none (the pickler's case)."""
    try:
        array = tensor.numpy()
    except (RuntimeError, TypeError):
        return None
    return array if array.flags.c_contiguous else None


def _arrays(tensors: Iterable[Any]) -> Optional[List[Any]]:
    """The C-contiguous numpy views of ``tensors``, or None if one has none."""
    arrays = [_array(tensor) for tensor in tensors]
    return None if any(array is None for array in arrays) else arrays


def _in_band(array: Any) -> Any:
    """An array's bytes as a buffer (a 0-d one's ``bytes()`` would be that many zeros: its ``data``)."""
    return array if array.ndim else array.data


def _data_places(
    payload: bytes, arrays: List[Any], out_of_band: List[memoryview]
) -> Optional[List[Optional[int]]]:
    """Where each array's bytes start in the pickler's stream ``payload`` (None: out of band);
    None where the stream is not of that shape.

    Args:
        payload: The pickler's stream.
        arrays: The numpy views of the tensors pickled, in the stream's order.
        out_of_band: The buffers the pickler gave out of band.
    """
    outside = [array.nbytes for array in arrays if array.nbytes >= REUSED_BUFFER_MIN_BYTES]
    if outside != [view.nbytes for view in out_of_band]:
        return None
    places: List[Optional[int]] = []
    start = 0
    for array in arrays:
        if array.nbytes >= REUSED_BUFFER_MIN_BYTES:
            places.append(None)
            continue
        data = bytes(_in_band(array))
        found = payload.find(_BYTEARRAY8 + len(data).to_bytes(8, "little"), start)
        if found < 0:
            return None
        at = found + len(_BYTEARRAY8) + 8
        if payload[at : at + len(data)] != data:
            return None
        places.append(at)
        start = at + len(data)
    return places


def first_sighting(seen: Set[Any], key: Any) -> bool:
    """Whether ``key`` is met for the first time (then remembered; ``seen`` is bounded)."""
    if key in seen:
        return False
    if len(seen) >= _KEPT:
        seen.clear()
    seen.add(key)
    return True


def keep_bounded(kept: Dict[Any, Any], key: Any, value: Any) -> None:
    """``kept[key] = value``; a dict of as many kinds as are kept is emptied first (it starts again).

    Args:
        kept: A dict of kept streams by kind.
        key: The kind.
        value: What is kept of it.
    """
    if len(kept) >= _KEPT:
        kept.clear()
    kept[key] = value


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
        if first_sighting(self._seen, key):
            return
        arrays = _arrays((tensor,))
        places = _data_places(payload, arrays, out_of_band) if arrays is not None else None
        if places is None:
            return
        (at,) = places
        kept = (payload, None) if at is None else (payload[:at], payload[at + arrays[0].nbytes :])
        keep_bounded(self, key, kept)


def container_kind(obj: Any) -> Optional[Tuple[Any, ...]]:
    """The kind of a tuple, list or dict (``str`` keys) of distinct bare tensors, ints and floats:
    its type, keys, and each element's dtype and shape or scalar width; None for any other item.

    Args:
        obj: An item whose type is one of :data:`CONTAINERS`.
    """
    if not 0 < len(obj) <= _MAX_ELEMENTS:
        return None
    keys = None
    values = obj
    if type(obj) is dict:
        keys = tuple(obj)
        for key in keys:
            if type(key) is not str:
                return None
        values = obj.values()
    kinds: List[Any] = []
    tensors = 0
    for value in values:
        kind = type(value)
        if kind is _Tensor:
            try:
                kinds.append((value.dtype, value.shape))
            except RuntimeError:  # a nested tensor has no shape: pickled
                return None
            tensors += 1
        elif kind is int:
            if 0 <= value < 256:
                kinds.append(_INT1)
            elif 0 <= value < 65536:
                kinds.append(_INT2)
            elif -(2**31) <= value < 2**31:
                kinds.append(_INT4)
            else:
                return None
        elif kind is float:
            kinds.append(_FLOAT)
        else:
            return None
    if tensors > 1 and len({id(value) for value in values if type(value) is _Tensor}) != tensors:
        return None  # one tensor twice: the pickler's stream refers back to it
    return type(obj), keys, tuple(kinds)


class ContainerStreams(dict):
    """A flat container's pickle stream by :func:`container_kind`: the bytes before each
    element's changing bytes (in-band tensor data, a scalar) and after the last, and how each
    element travels."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: Set[Tuple[Any, ...]] = set()

    def make(self, obj: Any, kind: Tuple[Any, ...]) -> Optional[Tuple[bytes, List[memoryview]]]:
        """The stream and out-of-band buffers of ``obj`` from its kind's kept stream; None if
        none is kept or a tensor needs the pickler (not contiguous, requires grad ...).

        Args:
            obj: The container.
            kind: Its :func:`container_kind`.
        """
        kept = self.get(kind)
        if kept is None:
            return None
        return _joined(kept, obj.values() if kind[1] is not None else obj)

    def keep(
        self, obj: Any, kind: Tuple[Any, ...], payload: bytes, out_of_band: List[memoryview],
        pickled: Callable[[Any], bytes],
    ) -> None:  # fmt: skip
        """Keep the pickler's stream of ``obj`` for the next containers of its kind, the second
        time one is pickled.

        Args:
            obj: The container pickled.
            kind: Its :func:`container_kind`.
            payload: The pickler's stream of it.
            out_of_band: The buffers the pickler gave out of band.
            pickled: A pickler's stream of another item (``obj`` with each scalar changed, to find them).
        """
        if kind in self or first_sighting(self._seen, kind):
            return
        values = list(obj.values() if kind[1] is not None else obj)
        arrays = _arrays(value for value in values if type(value) is _Tensor)
        places = _data_places(payload, arrays, out_of_band) if arrays is not None else None
        if places is None:
            return
        changed = [value if type(value) is _Tensor else _changed(value) for value in values]
        probe = type(obj)(zip(obj, changed)) if kind[1] is not None else type(obj)(changed)
        other = pickled(probe)
        kept = _template(payload, other, kind[2], arrays, places)
        if kept is None:
            return
        made, made_other = _joined(kept, values), _joined(kept, changed)
        if made is None or made_other is None or made[0] != payload or made_other[0] != other:
            return
        if [bytes(buffer) for buffer in made[1]] != [bytes(buffer) for buffer in out_of_band]:
            return
        keep_bounded(self, kind, kept)


def _changed(value: Any) -> Any:
    """A scalar pickled in as many bytes as ``value``, of which exactly one differs."""
    if type(value) is float:
        packed = _double.pack(value)
        return _double.unpack(packed[:7] + bytes((packed[7] ^ 1,)))[0]
    return value ^ 1


def _template(
    payload: bytes, other: bytes, kinds: Sequence[Any], arrays: List[Any], places: List[Optional[int]],
) -> Optional[Kept]:  # fmt: skip
    """A container's kept stream: the pieces of ``payload`` before each element's changing bytes
    and after the last, and each element's slot; None where the streams are not of that shape.

    Args:
        payload: The pickler's stream of the container.
        other: Its stream with each scalar changed (:func:`_changed`).
        kinds: The elements' kinds (:func:`container_kind`).
        arrays: The numpy views of its tensors, in order.
        places: Where each tensor's bytes start in ``payload`` (None: out of band).
    """
    if len(other) != len(payload):
        return None
    differ = iter([at for at, (a, b) in enumerate(zip(payload, other)) if a != b])
    slots, spans = [], []
    tensors = iter(zip(arrays, places))
    for kind in kinds:
        if type(kind) is tuple:
            array, at = next(tensors)
            slots.append(_OUT_OF_BAND if at is None else _IN_BAND)
            spans.append((None, None) if at is None else (at, at + array.nbytes))
        else:
            width, last = _SCALAR_BYTES[kind]
            at = next(differ, None)
            if at is None:
                return None
            slots.append(kind)
            spans.append((at - last, at - last + width))
    if next(differ, None) is not None:
        return None
    pieces, end = [], 0
    for start, stop in spans:
        if start is None:
            pieces.append(b"")
            continue
        if start < end:
            return None
        pieces.append(payload[end:start])
        end = stop
    pieces.append(payload[end:])
    return tuple(pieces), tuple(slots)


def _joined(kept: Kept, values: Iterable[Any]) -> Optional[Tuple[bytes, List[memoryview]]]:
    """The stream of a container of ``values`` made from its kind's kept stream, and its
    out-of-band buffers; None if a tensor needs the pickler."""
    pieces, slots = kept
    parts, out_of_band = [], []
    for piece, slot, value in zip(pieces, slots, values):
        parts.append(piece)
        if slot <= _OUT_OF_BAND:
            array = _array(value)
            if array is None:
                return None
            if slot == _IN_BAND:
                parts.append(_in_band(array))
            else:
                out_of_band.append(_PickleBuffer(array).raw())
        elif slot == _FLOAT:
            parts.append(_double.pack(value))
        else:
            parts.append(value.to_bytes(_SCALAR_BYTES[slot][0], "little", signed=slot == _INT4))
    parts.append(pieces[-1])
    return b"".join(parts), out_of_band
