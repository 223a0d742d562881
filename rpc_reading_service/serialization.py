"""Turning items, graphs and exceptions into bytes and back. Pure functions, no I/O.

Items: pickle protocol 5, large buffers out of band; graphs: cloudpickle; exceptions: type,
message and traceback text. The design: docs/architecture.md."""

from __future__ import annotations

import contextlib
import importlib
import io
import pickle
import sys
import traceback
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import cloudpickle
import numpy
import torch

from .errors import ItemPicklingError, RemoteWorkerError, describe_worker
from .receive_buffers import REUSED_BUFFER_MIN_BYTES, REUSED_BUFFERS_MAX_BYTES, ReusedBuffers, uninitialised_bytes
from .tensor_streams import CONTAINERS, ContainerStreams, TensorStreams, container_kind

__all__ = [
    "OUT_OF_BAND_MIN_BYTES",
    "SHARED_MEMORY_MIN_BYTES",
    "accepts_shared_memory",
    "Buffer",
    "EncodedItem",
    "ItemEncoder",
    "PinnedBuffers",
    "ReusedBuffers",
    "REUSED_BUFFER_MIN_BYTES",
    "REUSED_BUFFERS_MAX_BYTES",
    "buffer_allocator",
    "dumps_item",
    "loads_item",
    "rebuild_tensor",
    "travels_as_bytes",
    "pins_shared_memory",
    "release_sparse_tensors",
    "dumps_graph",
    "loads_graph",
    "pack_exception",
    "EXCEPTION_FIELD_TYPES",
    "exception_summary",
    "fallback_exception_info",
    "rebuild_exception",
]

#: Buffers of at least this size go out of band (and are received into reused memory).
OUT_OF_BAND_MIN_BYTES = REUSED_BUFFER_MIN_BYTES
#: Items are pickled with protocol 5: its out-of-band buffers carry tensor storage.
_ITEM_PROTOCOL = 5
#: Out-of-band buffers of at least this size leave a local worker (Unix socket) in shared
#: memory; smaller ones cost less to send than to place and release (where the two cross on
#: the project's host: benchmarks/SWEEP.md).
SHARED_MEMORY_MIN_BYTES = 64 * 1024

#: Memory that can be sent or received as is (a frame chunk, a payload, an out-of-band buffer).
Buffer = Union[bytes, bytearray, memoryview]


class EncodedItem:
    """One pickled item: its pickle stream and the out-of-band buffers it refers to.

    Attributes:
        borrowed: Some buffers are the producer's own memory (``borrow_min_bytes``): write the
            item out before the producer makes its next one.
        staged: Some buffers went where the encoder's ``stage`` put them (shared segments).
    """

    #: One per item on the hot path: keep it light. ``nbytes``, the item's bytes on the wire, is
    #: given by its encoder (read without a call), else counted when first asked for.
    __slots__ = ("payload", "buffers", "borrowed", "staged", "nbytes")

    def __init__(self, payload: Buffer, buffers: Optional[List[Buffer]] = None, borrowed: bool = False,
                 staged: bool = False, nbytes: Optional[int] = None):
        self.payload = payload
        self.buffers = buffers if buffers is not None else []
        self.borrowed = borrowed
        self.staged = staged
        if nbytes is not None:
            self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"EncodedItem({len(self.payload)} bytes, {len(self.buffers)} buffers)"

    def __getattr__(self, name: str) -> Any:
        """Count :attr:`nbytes` when first asked for (an item not made by an encoder)."""
        if name != "nbytes":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.nbytes = len(self.payload) + sum(memoryview(b).nbytes for b in self.buffers)
        return self.nbytes


#: Every dtype of this torch by itself and by its name (``"float32"``), which is what a tensor's
#: reduction carries: a short string, in band (a dtype is a global to pickle and import per tensor).
_DTYPES: Dict[Any, torch.dtype] = {value: value for value in vars(torch).values() if isinstance(value, torch.dtype)}
_DTYPE_NAMES = {dtype: str(dtype).rpartition(".")[2] for dtype in _DTYPES}
_DTYPES.update({name: dtype for dtype, name in _DTYPE_NAMES.items()})


def _rebuild_tensor(data: Any, dtype: Union[str, torch.dtype], shape: Sequence[int]) -> torch.Tensor:
    """Rebuild a CPU tensor of ``dtype`` (its name, or itself) on ``data``'s memory (no copy when writable)."""
    try:
        dtype = _DTYPES[dtype]
    except KeyError:
        raise pickle.UnpicklingError(f"a worker sent a tensor of dtype {dtype!r}, which this process's torch "
                                     f"{torch.__version__} does not have: install one torch version everywhere") from None
    # One torch call where it can (each costs ~1-2 us, more on the receiving thread's cold cache).
    try:
        tensor = torch.frombuffer(data, dtype=dtype)
    except ValueError:  # torch makes no tensor on no bytes
        if memoryview(data).nbytes:
            raise
        return torch.empty(tuple(shape), dtype=dtype)
    if len(shape) == 1 and shape[0] == tensor.shape[0]:
        return tensor
    return tensor.view(tuple(shape))


#: The rebuild of a tensor's pickle stream, for a receiver that knows its arguments without unpickling.
rebuild_tensor = _rebuild_tensor


def travels_as_bytes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` crosses as its bytes, dtype and shape alone (:data:`rebuild_tensor`), not by
    torch's own reduction, which carries what those do not (a quantizer, ``requires_grad`` ...)."""
    reduction = _tensor_reduction(tensor)
    return isinstance(reduction, tuple) and reduction[0] is _rebuild_tensor


def _same(obj: Any) -> Any:
    return obj


def _lookup(module_name: str, qualname: str) -> Any:
    obj: Any = sys.modules.get(module_name)
    if obj is None:
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _class_by_name(module_name: str, qualname: str) -> type:
    """Resolve, in the receiving process, a class a worker sent by name (see :func:`_class_reduction`)."""
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
    except ImportError:
        module = None
    cls = _lookup(module_name, qualname) if module is not None else None
    if not isinstance(cls, type):
        raise pickle.UnpicklingError(
            f"a worker sent an item of class {module_name}.{qualname}, which this process does not define: "
            "define it in the training script (or a module the trainer imports) under the same name"
        )
    return cls


def _class_reduction(cls: type) -> Any:
    """How an item's class travels: by plain pickle when this process can name it, else by name
    (a class the worker got by value with the graph; see docs/architecture.md)."""
    module_name = getattr(cls, "__module__", None)
    qualname = getattr(cls, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        return NotImplemented
    if _lookup(module_name, qualname) is cls:
        return NotImplemented
    if "<locals>" in qualname:
        return cloudpickle.loads, (cloudpickle.dumps(cls, protocol=pickle.HIGHEST_PROTOCOL),)
    return _class_by_name, (module_name, qualname)


_Tensor = torch.Tensor
_TypedStorage = torch.storage.TypedStorage
_PickleBuffer = pickle.PickleBuffer
#: Makes an :class:`EncodedItem` without a call of its ``__init__`` (the encoder sets every slot).
_new_item = object.__new__
#: Types pickle saves by itself, making no object: what a tensor's reduction holds (its rebuild
#: function; a dtype without a name) and containers. Looked up first.
_PLAIN_TYPES = frozenset({types.FunctionType, types.BuiltinFunctionType, torch.dtype, dict, list, tuple, set,
                          frozenset, bytearray, _PickleBuffer})


class ItemPickler(pickle.Pickler):
    """Pickler that sends CPU tensor storage as a pickle protocol 5 buffer, and classes
    this process cannot name by the name the trainer knows them by."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._class_reductions: Dict[type, Any] = {}
        self.made_objects = False  # a reduction (torch's, a class's own) made objects only the memo may hold

    def reducer_override(self, obj: Any) -> Any:
        """Classes by name or value, CPU tensors and storages by their buffers; else pickle's default."""
        # Called for nearly every object of an item: the common kinds are looked at first.
        kind = type(obj)
        if kind is _Tensor:
            # numpy() alone checks what the slow path asks one torch call at a time (each ~5-20 us
            # on a cold cache): CPU, strided, no grad, no conjugate or negative bit, a numpy dtype.
            try:
                array = obj.numpy()
            except (RuntimeError, TypeError):
                self.made_objects = True
                return _tensor_reduction(obj)
            if not array.flags.c_contiguous:
                self.made_objects = True
                return _tensor_reduction(obj)
            dtype = _DTYPE_NAMES.get(obj.dtype, obj.dtype)  # one this torch does not name travels as itself
            if array.nbytes < OUT_OF_BAND_MIN_BYTES:  # in band, as its PickleBuffer would go: no buffer_callback
                # bytearray() of a 0-d integer array is that many zero bytes (it is an index): its bytes, from .data
                return _rebuild_tensor, (bytearray(array if array.ndim else array.data), dtype, array.shape)
            return _rebuild_tensor, (_PickleBuffer(array), dtype, array.shape)
        if kind in _PLAIN_TYPES:
            return NotImplemented
        if isinstance(obj, type):
            reduction = self._class_reductions.get(obj)
            if reduction is None:
                reduction = self._class_reductions[obj] = _class_reduction(obj)
            return reduction
        if kind is _TypedStorage and obj._untyped_storage.device.type == "cpu":  # .device warns
            self.made_objects = True
            return _storage_reduction(obj)
        if kind is torch.qscheme:  # plain pickle searches every module for it: 2 ms per item
            return _lookup, ("torch", obj.__reduce__())
        self.made_objects = True  # pickle calls the object's own reduction
        return NotImplemented


def _tensor_reduction(obj: torch.Tensor) -> Any:
    """How a tensor that is not a contiguous CPU tensor numpy can view travels (the slow path of
    :meth:`ItemPickler.reducer_override`)."""
    if not obj.is_cpu:
        if obj.device.type == "meta":
            return NotImplemented
        # CUDA (and other accelerator) tensors cross as CPU tensors, on every transport:
        # no device maps, and a trainer without that device can still read them.
        return _same, (obj.detach().cpu().requires_grad_(obj.requires_grad),)
    # A quantized tensor's dtype has no numpy equivalent, so the reducer's numpy() refused it; its
    # bytes alone would arrive as a plain tensor without its quantizer: torch's reduction.
    if obj.layout != torch.strided or obj.requires_grad or obj.is_quantized:
        return _torch_reduction(obj)
    try:
        if not obj.is_contiguous() or obj.is_conj() or obj.is_neg():
            obj = obj.contiguous().resolve_conj().resolve_neg()
        flat = obj.reshape(-1)
        raw = (flat if obj.dtype is torch.uint8 else flat.view(torch.uint8)).numpy()
    except (RuntimeError, TypeError):
        return _torch_reduction(obj)  # nested and other exotic tensors
    return _rebuild_tensor, (pickle.PickleBuffer(raw), _DTYPE_NAMES.get(obj.dtype, obj.dtype), tuple(obj.shape))


def _storage_reduction(storage: "torch.storage.TypedStorage") -> Any:
    """A storage in torch's reduction of a tensor (quantized, requiring grad ...) crosses as a
    pickle protocol 5 buffer of its bytes, not as torch.save's bytes in the stream (which cost
    ~20x more to make and read back): torch's own rebuild then makes the tensor on it."""
    raw = torch.empty(0, dtype=torch.uint8).set_(storage._untyped_storage).numpy()
    return _rebuild_storage, (pickle.PickleBuffer(raw), storage.dtype)


def _rebuild_storage(data: Any, dtype: torch.dtype) -> "torch.storage.TypedStorage":
    """Rebuild a CPU storage of ``dtype`` on the memory of ``data`` (see :func:`_storage_reduction`)."""
    raw = memoryview(data).cast("B")
    untyped = torch.frombuffer(raw, dtype=torch.uint8).untyped_storage() if raw.nbytes else torch.UntypedStorage(0)
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _torch_reduction(tensor: torch.Tensor) -> Any:
    """Torch's own reduction of a tensor our buffers cannot carry (quantized, sparse, nested,
    requiring grad ...), a sparse one rebuilt by :func:`_rebuild_sparse_tensor`, or
    :class:`ItemPicklingError` naming the tensor's kind when torch has none (an MKL-DNN tensor
    has no storage to pickle)."""
    try:
        reduction = tensor.__reduce_ex__(_ITEM_PROTOCOL)
    except (RuntimeError, TypeError) as exc:  # NotImplementedError is a RuntimeError
        raise ItemPicklingError(
            f"an item holds a torch.Tensor that cannot be pickled (layout {tensor.layout}, dtype {tensor.dtype}, "
            f"device {tensor.device}: {type(exc).__name__}: {exc}); convert it in the graph before yielding it, "
            "e.g. with .to_dense() for an MKL-DNN tensor"
        ) from exc
    if reduction[0] is torch._utils._rebuild_sparse_tensor:
        return (_rebuild_sparse_tensor,) + tuple(reduction[1:])
    return reduction


def _rebuild_sparse_tensor(layout: torch.layout, data: Sequence[Any]) -> torch.Tensor:
    """Rebuild a sparse tensor from torch's reduction of it, checked at once when
    ``torch.sparse.check_sparse_tensor_invariants`` is on (torch's own rebuild queues it on a
    module-wide list that only ``torch.load`` empties: every received item stayed on it).

    Args:
        layout: The tensor's sparse layout.
        data: Its parts, as torch's reduction gives them.
    """
    check = torch.sparse.check_sparse_tensor_invariants.is_enabled()
    if layout == torch.sparse_coo:
        indices, values, size, coalesced = data
        return torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced, check_invariants=check)
    compressed_indices, plain_indices, values, size = data
    return torch.sparse_compressed_tensor(
        compressed_indices, plain_indices, values, size, layout=layout, check_invariants=check
    )


#: Sparse tensors torch's own rebuild made (in a tensor subclass's reduction, say), waiting for
#: the check that ``torch.load`` runs and that plain unpickling never does.
_SPARSE_TENSORS_TO_CHECK = torch._utils._sparse_tensors_to_validate


def release_sparse_tensors() -> None:
    """Check and let go of the sparse tensors torch's own rebuild left on its module-wide list
    while unpickling, as ``torch.load`` does (else each stays alive there for good); call it
    after every unpickling of data from elsewhere. Another thread's tensors may be let go
    unchecked (only with ``check_sparse_tensor_invariants`` on), as with ``torch.load``."""
    if _SPARSE_TENSORS_TO_CHECK:
        torch._utils._validate_loaded_sparse_tensors()


class ItemEncoder:
    """Pickles items one by one, reusing one pickler; a large buffer is copied out of band as it is now.

    Not thread-safe: one encoder per producing thread. Why it copies: docs/architecture.md.

    Args:
        stage: Where a large buffer's copy goes (say, a shared-memory segment), or the buffer
            itself for memory the producer must not write again; None: an ordinary copy.
        borrow_min_bytes: A buffer at least this large that ``stage`` left alone is not copied:
            the item refers to the producer's memory (:attr:`EncodedItem.borrowed`).
        stage_min_bytes: ``stage`` is called for no buffer smaller than this (0: for every one).
    """

    def __init__(
        self, stage: Optional[Callable[[memoryview], Optional[Any]]] = None, borrow_min_bytes: Optional[int] = None,
        stage_min_bytes: int = 0,
    ) -> None:  # fmt: skip
        self._stream = io.BytesIO()
        #: The item's out-of-band buffers, as the pickler met them (each a flat ``"B"`` view).
        self._out_of_band: List[memoryview] = []
        self._pickler = ItemPickler(self._stream, protocol=_ITEM_PROTOCOL, buffer_callback=self._collect)
        self._stage = stage
        #: No buffer is this large without a ``stage``: one comparison per buffer says whether to call it.
        self._stage_min_bytes = stage_min_bytes if stage is not None else sys.maxsize
        self._borrow_min_bytes = borrow_min_bytes
        self._copies = ReusedBuffers()
        self._tensor_streams = TensorStreams()
        self._container_streams = ContainerStreams()

    def _collect(self, buffer: pickle.PickleBuffer) -> bool:
        # pickle's buffer_callback contract: a true result serialises the buffer in band.
        raw = buffer.raw()
        if raw.nbytes < OUT_OF_BAND_MIN_BYTES:
            return True
        self._out_of_band.append(raw)
        return False

    def encode(self, obj: Any) -> EncodedItem:
        """Pickle one item; large buffers are returned separately (copies of them as they are
        now) for a send with no further copy."""
        # Once per item on the producer's hot path: no Python call but the pickler's own (the
        # item made without running EncodedItem.__init__, each buffer's copy inline).
        key, payload, kind = None, None, type(obj)
        if kind is _Tensor:  # a bare tensor: its stream from the one of its dtype and shape, no pickler
            try:
                key = (obj.dtype, obj.shape)
            except RuntimeError:  # a nested tensor has no shape: pickled
                key = None
            kept = self._tensor_streams.get(key) if key is not None else None
            if kept is not None:
                try:
                    array = obj.numpy()
                except (RuntimeError, TypeError):
                    array = None  # the pickler's reduction says what it is
                if array is not None and array.flags.c_contiguous:
                    before, after = kept
                    if after is None:
                        return self._with_buffers(before, [_PickleBuffer(array).raw()])
                    payload = b"".join((before, array, after))
                else:
                    key = None  # pickled, and not kept
        elif kind in CONTAINERS:  # a tuple, list or dict of bare tensors: the same from its kind's stream
            key = container_kind(obj)
            made = self._container_streams.make(obj, key) if key is not None else None
            if made is not None:
                payload, out_of_band = made
                if out_of_band:
                    return self._with_buffers(payload, out_of_band)
        if payload is None:
            stream = self._stream
            stream.seek(0)
            stream.truncate()
            try:
                self._pickler.dump(obj)
                payload = stream.getvalue()
                out_of_band = self._out_of_band
                if key is not None:
                    if kind is _Tensor:
                        self._tensor_streams.keep(obj, key, payload, out_of_band)
                    else:
                        self._container_streams.keep(obj, key, payload, out_of_band, _pickled_alone)
                if out_of_band:
                    return self._with_buffers(payload, out_of_band)
            finally:
                # The memo and the out-of-band list hold the item: let go of it now (its memory is
                # then the next item's, cache-warm: a third less time to make and copy an 8 MiB
                # tensor). What a reduction made goes once the memo is empty, as other threads may
                # run meanwhile (clear_memo() frees before it empties: docs/architecture.md, "Serialization").
                held = self._pickler.memo.copy() if self._pickler.made_objects else None
                self._pickler.clear_memo()
                self._pickler.made_objects = False
                if self._out_of_band:
                    self._out_of_band = []
                del held
        item = _new_item(EncodedItem)  # its bytes all in band
        item.payload = payload
        item.nbytes = len(payload)
        item.borrowed = item.staged = False
        item.buffers = []
        return item

    def _with_buffers(self, payload: bytes, out_of_band: List[memoryview]) -> EncodedItem:
        """The item of ``payload`` and its out-of-band buffers, each staged, borrowed or copied.

        Args:
            payload: The item's pickle stream.
            out_of_band: Its out-of-band buffers, as the pickler met them (flat ``"B"`` views).
        """
        item = _new_item(EncodedItem)
        item.payload = payload
        item.nbytes = len(payload)
        item.borrowed = item.staged = False
        buffers = item.buffers = []
        stage, stage_min_bytes, borrow_min_bytes = self._stage, self._stage_min_bytes, self._borrow_min_bytes
        for view in out_of_band:
            item.nbytes += view.nbytes
            staged = stage(view) if view.nbytes >= stage_min_bytes else None
            if staged is not None:
                item.staged = True
                buffers.append(staged)
            elif borrow_min_bytes is not None and view.nbytes >= borrow_min_bytes:
                item.borrowed = True
                buffers.append(view)
            else:
                copy = memoryview(self._copies(view.nbytes))  # one sent (and let go) before is written again: no page faults
                copy[:] = view
                buffers.append(copy)
        return item


def dumps_item(obj: Any) -> EncodedItem:
    """Pickle one item with a fresh :class:`ItemEncoder` (use an encoder for many items)."""
    return ItemEncoder().encode(obj)


def _pickled_alone(obj: Any) -> bytes:
    """The pickle stream of ``obj`` from a fresh encoder."""
    return ItemEncoder().encode(obj).payload


def loads_item(item: EncodedItem) -> Any:
    """Unpickle one item, rebuilding its buffers on the memory they were received into."""
    try:
        return pickle.loads(item.payload, buffers=item.buffers)
    finally:
        release_sparse_tensors()


def buffer_allocator(pin_memory: bool) -> Callable[[int], Any]:
    """Memory that received out-of-band buffers (tensor storage) land in, for one connection.

    Args:
        pin_memory: Page-locked memory when CUDA is available; otherwise :class:`ReusedBuffers`.
    """
    if pin_memory and torch.cuda.is_available():
        return PinnedBuffers()
    return ReusedBuffers()


class PinnedBuffers:
    """Page-locked receive buffers (``pin_memory`` with CUDA). A local worker's shared segments
    are not copied into them: the trainer page-locks each segment where it maps it
    (:func:`pins_shared_memory`)."""

    def __call__(self, nbytes: int) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def pins_shared_memory(allocate: Optional[Callable[[int], Any]]) -> bool:
    """Whether shared segments received with ``allocate`` are to be page-locked (``pin_memory``
    with CUDA: :class:`PinnedBuffers`)."""
    return isinstance(allocate, PinnedBuffers)


def accepts_shared_memory(allocate: Optional[Callable[[int], Any]]) -> bool:
    """Whether received buffers may live in shared memory instead of memory from
    ``allocate``: yes for plain memory and for pinned memory (``pin_memory`` with CUDA: the
    segments are page-locked where they are mapped), no for any other allocator."""
    return (allocate is None or allocate is bytearray or allocate is uninitialised_bytes
            or isinstance(allocate, (ReusedBuffers, PinnedBuffers)))


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


#: cloudpickle writes every code object it pickles by value with this file name.
_DYNAMIC_CODE = "<dynamic-code>"


def _code_in_file(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` with its file name back (the unpickling side of :class:`_GraphPickler`)."""
    return code.replace(co_filename=filename)


class _GraphPickler(cloudpickle.Pickler):
    """cloudpickle's pickler, keeping the file of the code it pickles by value: a worker's
    tracebacks and stacks (item_timeout) then name the user's file, not ``<dynamic-code>``."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType and obj.co_filename != _DYNAMIC_CODE:
            return _code_in_file, (obj.replace(co_filename=_DYNAMIC_CODE), obj.co_filename)
        return super().reducer_override(obj)


def dumps_graph(graph: Any, pickle_by_value: Sequence[types.ModuleType] = ()) -> bytes:
    """Serialise a DataPipe graph with cloudpickle.

    ``pickle_by_value`` names user modules not installed on the workers: their functions
    and classes travel by value (with their file names, for tracebacks).
    """
    with _pickled_by_value([*_main_modules(), *pickle_by_value]):
        buffer = io.BytesIO()
        _GraphPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(graph)
        return buffer.getvalue()


def loads_graph(data: bytes) -> Any:
    """Rebuild a graph serialised by :func:`dumps_graph`.

    A module the graph needs but this process cannot import raises ``ModuleNotFoundError``
    saying how to fix it (install it here, or ship it with ``pickle_by_value``).
    """
    try:
        return pickle.loads(data)
    except ModuleNotFoundError as exc:
        top = (exc.name or "?").split(".")[0]
        raise ModuleNotFoundError(
            f"the graph uses module {exc.name!r}, which this worker cannot import: install {top!r} on the worker "
            f"(the same version as on the trainer), or pass pickle_by_value=[{top}] to RPCReadingService so that "
            "its code travels with the graph",
            name=exc.name,
        ) from exc
    finally:
        release_sparse_tensors()  # a graph holding sparse tensors (torch pickled them for cloudpickle)


# -- exceptions ---------------------------------------------------------------------------------
def _type_attribute(exc: BaseException, attribute: str, default: str) -> str:
    try:  # a metaclass may compute these attributes in user code
        value = getattr(type(exc), attribute, None)
    except BaseException:  # noqa: BLE001
        value = None
    return str.__str__(value) if isinstance(value, str) else default


def _type_name(exc: BaseException) -> str:
    return _type_attribute(exc, "__qualname__", "exception")


def _text_or_placeholder(render: Callable[[], Any], exc: BaseException) -> str:
    """``render()`` as a plain ``str``, or ``<unprintable T object>`` when user code in it fails."""
    try:
        return str.__str__(render())  # a str subclass could misbehave later: copy to a plain str
    except BaseException:  # noqa: BLE001 - a broken __str__/__repr__ may raise anything
        return f"<unprintable {_type_name(exc)} object>"


def _rebuildable_pickle(exc: BaseException) -> Optional[bytes]:
    try:
        pickled = cloudpickle.dumps(exc)
        pickle.loads(pickled)  # an exception that pickles but cannot be rebuilt is useless
    except BaseException:  # noqa: BLE001 - any exception type may fail to pickle or rebuild
        return None
    return pickled


def exception_summary(exc: BaseException) -> str:
    """``T: message`` of ``exc``, never raising for it (``<unprintable T object>`` for a broken ``__str__``)."""
    return f"{_type_name(exc)}: {_text_or_placeholder(lambda: str(exc), exc)}"


#: The types of each field of :func:`pack_exception`'s description (the protocol checks a peer's).
EXCEPTION_FIELD_TYPES: Dict[str, Tuple[type, ...]] = {
    "type_name": (str,), "type_module": (str,), "message": (str,), "traceback": (str,), "pickled": (bytes, type(None)),
}


def pack_exception(exc: BaseException) -> Dict[str, Any]:
    """Describe an exception raised in a worker for the trainer.

    Never raises for the exception's sake: a message or traceback that cannot be
    rendered becomes ``<unprintable T object>``, an exception that cannot be pickled
    and rebuilt travels as text only.
    """
    return {
        "type_name": _type_name(exc),
        "type_module": _type_attribute(exc, "__module__", "?"),
        "message": _text_or_placeholder(lambda: str(exc), exc),
        "traceback": _text_or_placeholder(
            lambda: "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), exc
        ),
        "pickled": _rebuildable_pickle(exc),
    }


def fallback_exception_info(exc: Optional[BaseException], failure: BaseException) -> Dict[str, Any]:
    """A RuntimeError description built without calling user code: the last resort when
    describing ``exc`` (or ending an epoch, when ``exc`` is None) raised ``failure``."""
    if exc is None:
        message = f"the worker failed while ending the epoch ({_type_name(failure)}); see the worker's log"
    else:
        message = f"the worker could not describe the {_type_name(exc)} its graph raised ({_type_name(failure)} while describing it)"
    return {
        "type_name": "RuntimeError",
        "type_module": "builtins",
        "message": message,
        "traceback": f"RuntimeError: {message}\n",
        "pickled": None,
    }


class _ReprIsStr(str):
    def __repr__(self) -> str:
        return str(self)


def rebuild_exception(
    info: Dict[str, Any], rank: Optional[int], address: Optional[str], where: Optional[str] = None
) -> BaseException:
    """Build the exception to raise in the trainer for a remote error: the original type where it
    can be rebuilt, else :class:`RemoteWorkerError`, in MPRS's words (``Caught ValueError in worker
    process 0 (host:port).``, then ``Original Traceback ...``).

    Args:
        info: The packed exception.
        rank: The worker's rank, for the message.
        address: The worker's address, for the message.
        where: Another origin instead (``"dispatching process"``: the trainer's dispatcher).
    """
    where = where or describe_worker(rank, address, noun="worker process")
    type_name = info.get("type_name", "Exception").rsplit(".", 1)[-1]  # __name__, as MPRS says it
    message = f"Caught {type_name} in {where}.\nOriginal {info.get('traceback', '')}"
    original: Optional[BaseException] = None
    if info.get("pickled"):
        try:
            original = pickle.loads(info["pickled"])
        except Exception:  # noqa: BLE001 - the type may not exist here, or not rebuild here
            original = None
        if not isinstance(original, BaseException):
            original = None  # a peer's pickle of something else: described by its text alone
    rebuilt: BaseException
    if original is not None:
        if isinstance(original, KeyError):
            # KeyError's str() is the repr of its argument; keep the traceback readable.
            message = _ReprIsStr(message)
        try:
            rebuilt = type(original)(message)
            str(rebuilt)  # a type whose __str__ fails would hide the message: use ours then
        except Exception:  # noqa: BLE001 - constructors with required extra arguments, broken __str__
            rebuilt = RemoteWorkerError(message)
    else:
        rebuilt = RemoteWorkerError(message)
    rebuilt.worker_rank = rank  # type: ignore[attr-defined]
    rebuilt.worker_address = address  # type: ignore[attr-defined]
    rebuilt.remote_traceback = info.get("traceback", "")  # type: ignore[attr-defined]
    rebuilt.remote_exception = original  # type: ignore[attr-defined]
    return rebuilt
