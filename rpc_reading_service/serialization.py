"""Turning items, graphs and exceptions into bytes and back. Pure functions, no I/O.

- Items use pickle protocol 5. CPU tensors and numpy arrays larger than
  ``OUT_OF_BAND_MIN_BYTES`` travel as out-of-band buffers: the sender hands their memory
  to a scatter/gather send, the receiver rebuilds them on the memory they were received
  into. Nothing is copied through the pickle stream.
- Graphs use cloudpickle, so lambdas and functions defined in ``__main__`` (or in a
  ``torch.multiprocessing.spawn`` child's ``__mp_main__``) travel by value.
- Exceptions travel as their type, message, traceback text and, where possible, the
  pickled exception itself.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import sys
import traceback
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import cloudpickle
import numpy
import torch

from .errors import RemoteWorkerError, describe_worker
from .protocol import EncodedItem

__all__ = [
    "OUT_OF_BAND_MIN_BYTES",
    "ItemEncoder",
    "buffer_allocator",
    "dumps_item",
    "loads_item",
    "loads_items",
    "dumps_graph",
    "loads_graph",
    "pack_exception",
    "rebuild_exception",
]

OUT_OF_BAND_MIN_BYTES = 64 * 1024


def _rebuild_tensor(data: Any, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Rebuild a CPU tensor on the memory of ``data`` (no copy when ``data`` is writable)."""
    raw = memoryview(data).cast("B")
    if raw.nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    flat = torch.frombuffer(raw, dtype=torch.uint8)
    return flat.view(dtype).view(tuple(shape))


def _same(obj: Any) -> Any:
    return obj


class _ItemPickler(pickle.Pickler):
    """Pickler that sends CPU tensor storage as a pickle protocol 5 buffer."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.device.type not in ("cpu", "meta"):
            # CUDA (and other accelerator) tensors cross as CPU tensors, on every transport:
            # no device maps, and a trainer without that device can still read them.
            return _same, (obj.detach().cpu().requires_grad_(obj.requires_grad),)
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided and not obj.requires_grad:
            try:
                contiguous = obj.contiguous().resolve_conj().resolve_neg()
                raw = contiguous.reshape(-1).view(torch.uint8).numpy()
            except (RuntimeError, TypeError):
                return NotImplemented  # quantized and other exotic tensors: torch's own reduction
            return _rebuild_tensor, (pickle.PickleBuffer(raw), obj.dtype, tuple(obj.shape))
        return NotImplemented


def _keep_small_buffers_in_band(buffer: pickle.PickleBuffer) -> bool:
    # pickle's buffer_callback contract: a true result serialises the buffer in band.
    return buffer.raw().nbytes < OUT_OF_BAND_MIN_BYTES


class ItemEncoder:
    """Pickles items one by one, reusing one pickler (a third of the cost of a new one per item).

    Not thread-safe: one encoder per producing thread.
    """

    def __init__(self) -> None:
        self._stream = io.BytesIO()
        self._out_of_band: List[pickle.PickleBuffer] = []
        self._pickler = _ItemPickler(self._stream, protocol=5, buffer_callback=self._collect)

    def _collect(self, buffer: pickle.PickleBuffer) -> bool:
        if _keep_small_buffers_in_band(buffer):
            return True
        self._out_of_band.append(buffer)
        return False

    def encode(self, obj: Any) -> EncodedItem:
        """Pickle one item; large buffers are returned separately for a zero-copy send."""
        stream = self._stream
        stream.seek(0)
        stream.truncate()
        self._pickler.clear_memo()
        self._out_of_band = []
        self._pickler.dump(obj)
        return EncodedItem(stream.getvalue(), [b.raw() for b in self._out_of_band])


def dumps_item(obj: Any) -> EncodedItem:
    """Pickle one item with a fresh :class:`ItemEncoder` (use an encoder for many items)."""
    return ItemEncoder().encode(obj)


def loads_item(item: EncodedItem) -> Any:
    """Unpickle one item, rebuilding its buffers on the memory they were received into."""
    return pickle.loads(item.payload, buffers=item.buffers)


def loads_items(items: Sequence[EncodedItem]) -> List[Any]:
    """Unpickle every item of a frame."""
    loads = pickle.loads
    return [loads(item.payload, buffers=item.buffers) for item in items]


def buffer_allocator(pin_memory: bool) -> Callable[[int], Any]:
    """Memory that received out-of-band buffers (tensor storage) land in.

    With ``pin_memory`` and CUDA available, page-locked memory, so received tensors can go
    to the GPU with ``non_blocking=True`` without another copy; otherwise uninitialised
    memory (every byte is written by the receive before anyone reads it).
    """
    if pin_memory and torch.cuda.is_available():
        return lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    # Not bytearray: it zero-fills every buffer that recv_into is about to overwrite, which
    # cost about half of the trainer's receive time on 8 MiB tensors.
    return _uninitialised_bytes


def _uninitialised_bytes(nbytes: int) -> Any:
    return numpy.empty(nbytes, dtype=numpy.uint8)


# -- graphs ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _pickled_by_value(modules: Sequence[types.ModuleType]) -> Iterator[None]:
    registered = []
    try:
        for module in modules:
            if module.__name__ not in cloudpickle.list_registry_pickle_by_value():
                cloudpickle.register_pickle_by_value(module)
                registered.append(module)
        yield
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


def _main_modules() -> List[types.ModuleType]:
    # A torch.multiprocessing.spawn child runs the user's script as "__mp_main__", which
    # cloudpickle would otherwise pickle by reference, and no worker can import it.
    return [sys.modules[name] for name in ("__mp_main__",) if name in sys.modules]


def dumps_graph(graph: Any, pickle_by_value: Sequence[types.ModuleType] = ()) -> bytes:
    """Serialise a DataPipe graph with cloudpickle.

    ``pickle_by_value`` names user modules not installed on the workers: their functions
    and classes travel by value.
    """
    with _pickled_by_value([*_main_modules(), *pickle_by_value]):
        return cloudpickle.dumps(graph, protocol=pickle.HIGHEST_PROTOCOL)


def loads_graph(data: bytes) -> Any:
    """Rebuild a graph serialised by :func:`dumps_graph`."""
    return pickle.loads(data)


# -- exceptions ---------------------------------------------------------------------------------
def pack_exception(exc: BaseException) -> Dict[str, Any]:
    """Describe an exception raised in a worker for the trainer."""
    try:
        pickled: Optional[bytes] = cloudpickle.dumps(exc)
        pickle.loads(pickled)  # an exception that pickles but cannot be rebuilt is useless
    except Exception:  # noqa: BLE001 - any exception type may fail to pickle
        pickled = None
    return {
        "type_name": type(exc).__qualname__,
        "type_module": type(exc).__module__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "pickled": pickled,
    }


class _ReprIsStr(str):
    def __repr__(self) -> str:
        return str(self)


def rebuild_exception(info: Dict[str, Any], rank: Optional[int], address: Optional[str]) -> BaseException:
    """Build the exception to raise in the trainer for a remote error.

    The result has the original type where it can be rebuilt (so ``except ValueError``
    works), else :class:`RemoteWorkerError`. Its message reads like torchdata's:
    ``Caught ValueError in worker 0 (host:port). Original Traceback ...``.
    """
    where = describe_worker(rank, address)
    message = f"Caught {info.get('type_name', 'Exception')} in {where}.\nOriginal {info.get('traceback', '')}"
    original: Optional[BaseException] = None
    if info.get("pickled"):
        try:
            original = pickle.loads(info["pickled"])
        except Exception:  # noqa: BLE001 - the type may not exist here
            original = None
    rebuilt: BaseException
    if original is not None:
        if isinstance(original, KeyError):
            # KeyError's str() is the repr of its argument; keep the traceback readable.
            message = _ReprIsStr(message)
        try:
            rebuilt = type(original)(message)
        except Exception:  # noqa: BLE001 - constructors with required extra arguments
            rebuilt = RemoteWorkerError(message)
    else:
        rebuilt = RemoteWorkerError(message)
    rebuilt.worker_rank = rank  # type: ignore[attr-defined]
    rebuilt.worker_address = address  # type: ignore[attr-defined]
    rebuilt.remote_traceback = info.get("traceback", "")  # type: ignore[attr-defined]
    rebuilt.remote_exception = original  # type: ignore[attr-defined]
    return rebuilt
