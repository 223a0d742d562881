"""Items, graphs and exceptions to bytes and back (pure functions, no I/O)."""

from __future__ import annotations

import os
import pickle
import pickletools
import subprocess
import sys
import threading
import types
import weakref

import cloudpickle
import numpy as np
import pytest
import torch
from _server_helpers import python_calls
from protocol_link import data_frame

from rpc_reading_service.errors import ItemPicklingError, RemoteWorkerError
from rpc_reading_service.protocol import EncodedItem, decode_data
from rpc_reading_service.serialization import (
    EXCEPTION_FIELD_TYPES,
    OUT_OF_BAND_MIN_BYTES,
    REUSED_BUFFER_MIN_BYTES,
    REUSED_BUFFERS_MAX_BYTES,
    ItemEncoder,
    ReusedBuffers,
    accepts_shared_memory,
    buffer_allocator,
    dumps_graph,
    dumps_item,
    exception_summary,
    fallback_exception_info,
    loads_graph,
    loads_item,
    pack_exception,
    rebuild_exception,
)
from rpc_reading_service.tensor_streams import TensorStreams


def over_the_wire(item: EncodedItem) -> EncodedItem:
    """Send one item through a real DATA frame as bytes, as the transport would."""
    _, _, items = decode_data(data_frame([item]))
    return items[0]


def roundtrip(obj):
    return loads_item(over_the_wire(dumps_item(obj)))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(10, dtype=torch.int64),
        torch.randn(3, 4, dtype=torch.float32),
        torch.randn(2, 3, 5, dtype=torch.float64),
        torch.randn(4, 4).to(torch.float16),
        torch.randn(4, 4).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.randint(0, 255, (7, 3), dtype=torch.uint8),
        torch.randint(-100, 100, (5,), dtype=torch.int8),
        torch.randn(3, dtype=torch.complex64),
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 3),  # empty
        torch.randn(200, 300),  # large: out of band
    ],
    ids=lambda t: f"{t.dtype}-{tuple(t.shape)}",
)
def test_tensor_round_trip(tensor):
    out = roundtrip(tensor)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)


def test_non_contiguous_and_views_round_trip():
    base = torch.arange(600, dtype=torch.float32).reshape(20, 30)
    for t in (base.t(), base[::2, 1::3], base[5], base.expand(2, 20, 30)[1], torch.randn(300, 300)[:, 7]):
        out = roundtrip(t)
        assert torch.equal(out, t) and out.shape == t.shape


def test_conj_and_neg_views_resolved():
    c = torch.randn(4, dtype=torch.complex64)
    assert torch.equal(roundtrip(c.conj()), c.conj().resolve_conj())


def test_numpy_arrays_round_trip():
    arrays = [
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.random.rand(5, 2),
        np.random.rand(300, 300).astype(np.float32),  # large: out of band
        np.asfortranarray(np.random.rand(4, 6)),
        np.array(["a", "bc"]),
    ]
    for array in arrays:
        out = roundtrip(array)
        assert out.dtype == array.dtype and out.shape == array.shape
        np.testing.assert_array_equal(out, array)


def test_nested_structures_round_trip():
    obj = {
        "image": torch.randn(3, 64, 64),
        "label": 7,
        "meta": ("name", [1.5, None, {"x": np.arange(4)}]),
        "tensors": [torch.zeros(2), torch.ones(300, 300, dtype=torch.int16)],
        b"bytes": bytearray(b"abc"),
    }
    out = roundtrip(obj)
    assert out.keys() == obj.keys()
    assert torch.equal(out["image"], obj["image"])
    assert out["label"] == 7
    assert out["meta"][0] == "name" and out["meta"][1][:2] == [1.5, None]
    np.testing.assert_array_equal(out["meta"][1][2]["x"], np.arange(4))
    assert all(torch.equal(a, b) for a, b in zip(out["tensors"], obj["tensors"]))
    assert out[b"bytes"] == bytearray(b"abc")


def test_small_tensors_stay_in_band():
    encoded = dumps_item([torch.zeros(10), np.zeros(10)])
    assert encoded.buffers == []


def test_zero_dimensional_tensors_arrive_with_their_value():
    # A label as torch.tensor(8): its bytes, not bytearray(8)'s eight zero bytes (read as tensor(0)).
    for value in (0, 5, 8, 100):
        for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32, torch.bool):
            tensor = torch.tensor(value, dtype=dtype)
            for item in (tensor, (tensor, value)):
                out = loads_item(over_the_wire(dumps_item(item)))
                received = out if isinstance(out, torch.Tensor) else out[0]
                assert received.shape == () and received.dtype == dtype and torch.equal(received, tensor), (value, dtype)


def test_large_tensor_goes_out_of_band_and_is_rebuilt_on_received_memory():
    tensor = torch.randn(256, 256)  # 256 KiB
    assert tensor.numel() * tensor.element_size() >= OUT_OF_BAND_MIN_BYTES
    encoded = dumps_item(tensor)
    assert len(encoded.buffers) == 1
    assert memoryview(encoded.buffers[0]).nbytes == tensor.numel() * 4
    # The pickle stream itself stays small: the storage was not copied into it.
    assert len(encoded.payload) < 1024

    received = over_the_wire(encoded)
    out = loads_item(received)
    assert torch.equal(out, tensor)
    # The tensor shares the memory the buffer was received into (no copy on receipt).
    buffer = received.buffers[0]
    assert isinstance(buffer, bytearray)
    buffer_address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    assert out.data_ptr() == buffer_address
    buffer[:4] = b"\x00\x00\x00\x00"
    assert out.view(-1)[0].item() == 0.0


def _received(tensor, allocate):
    """``tensor`` sent through a DATA frame whose buffers a reader received into ``allocate``'s memory."""
    _, _, items = decode_data(data_frame([dumps_item(tensor)], allocate))
    return loads_item(items[0])


def test_a_large_receive_buffer_is_reused_only_once_nothing_refers_to_it():
    allocate = buffer_allocator(pin_memory=False)
    assert isinstance(allocate, ReusedBuffers) and accepts_shared_memory(allocate)
    n = REUSED_BUFFER_MIN_BYTES // 4
    first = _received(torch.full((n,), 1.0), allocate)
    address = first.data_ptr()
    view = first[10:20].numpy()  # a numpy view of its memory keeps the buffer busy
    del first
    second = _received(torch.full((n,), 2.0), allocate)
    assert second.data_ptr() != address and float(view[0]) == 1.0
    del view
    third = _received(torch.full((2, n // 2), 3.0), allocate)  # same bytes, another shape
    assert third.data_ptr() == address and torch.equal(third, torch.full((2, n // 2), 3.0))
    assert torch.equal(second, torch.full((n,), 2.0))  # the buffer still in use was left alone


def test_reused_receive_buffers_are_bounded_and_small_ones_are_not_kept():
    allocate = ReusedBuffers()
    small = weakref.ref(allocate(REUSED_BUFFER_MIN_BYTES - 1))
    assert small() is None  # not kept
    size = REUSED_BUFFERS_MAX_BYTES // 4
    in_use = [allocate(size) for _ in range(6)]  # all in use at once: six buffers
    held = [weakref.ref(buffer) for buffer in in_use]
    del in_use
    kept = [ref() for ref in held if ref() is not None]
    assert len(kept) == 4  # the pool's bound
    del kept
    again = [allocate(size) for _ in range(4)]
    assert all(buffer is ref() for buffer, ref in zip(again, held))
    del again
    allocate(size + 1)  # another size takes the place of free buffers of the old one, oldest first
    assert [ref() is not None for ref in held[:4]] == [False, False, True, True]


def test_reused_receive_buffers_are_bounded_by_the_window_given():
    # A connection's share of the credit window, plus one frame: what was in use at once past
    # that goes back to the allocator once let go; frames of one larger item count at its size.
    allocate = ReusedBuffers()
    allocate.bound(3, 4 * REUSED_BUFFER_MIN_BYTES)
    in_use = [allocate(REUSED_BUFFER_MIN_BYTES) for _ in range(16)]  # four frames of four
    held = [weakref.ref(buffer) for buffer in in_use]
    del in_use
    assert sum(ref() is not None for ref in held) == 12
    big = 8 * REUSED_BUFFER_MIN_BYTES
    in_use = [allocate(big) for _ in range(5)]
    held = [weakref.ref(buffer) for buffer in in_use]
    del in_use
    assert sum(ref() is not None for ref in held) == 3


def test_a_frames_reused_buffers_at_once_are_those_one_call_each_would_hand_out():
    # ReusedBuffers.many: the sizes asked for, free buffers reused (never one twice, never one in
    # use), the small ones fresh, and the pool kept as one call per buffer keeps it.
    sizes = (100, REUSED_BUFFER_MIN_BYTES, 2 * REUSED_BUFFER_MIN_BYTES, REUSED_BUFFER_MIN_BYTES)

    def frames(take):
        allocate = ReusedBuffers()
        allocate.bound(2, 4 * REUSED_BUFFER_MIN_BYTES)
        first = take(allocate, sizes)
        assert [buffer.nbytes for buffer in first] == list(sizes) and len({id(b) for b in first}) == 4
        held = first[2]  # still in use
        addresses = {id(buffer) for buffer in first[1:]}
        del first
        second = take(allocate, sizes)
        assert [buffer.nbytes for buffer in second] == list(sizes)
        assert second[2] is not held and {id(second[1]), id(second[3])} <= addresses  # the free ones, each once
        third = take(allocate, [REUSED_BUFFER_MIN_BYTES] * 12)  # past the bound: handed out, not all kept
        assert len({id(b) for b in third}) == 12
        refs = [weakref.ref(b) for b in third]
        del third, second
        return [ref() is not None for ref in refs]

    kept = frames(lambda allocate, lengths: allocate.many(lengths))
    assert kept == frames(lambda allocate, lengths: [allocate(n) for n in lengths]) and any(kept) and not all(kept)


def test_every_out_of_band_receive_buffer_is_reused_once_let_go():
    # malloc hands 64 KiB-1 MiB buffers back to the system too: each new one cost page faults
    allocate = buffer_allocator(pin_memory=False)
    first = weakref.ref(allocate(OUT_OF_BAND_MIN_BYTES))
    again = allocate(OUT_OF_BAND_MIN_BYTES)
    assert again is first()


def test_an_encoders_copies_are_reused_once_their_item_is_gone():
    encoder = ItemEncoder()
    first = encoder.encode(torch.full((OUT_OF_BAND_MIN_BYTES,), 1, dtype=torch.uint8))
    copy = weakref.ref(first.buffers[0].obj)
    second = encoder.encode(torch.full((OUT_OF_BAND_MIN_BYTES,), 2, dtype=torch.uint8))
    assert second.buffers[0].obj is not copy()  # the first item is still to be sent: left alone
    assert set(bytes(first.buffers[0])) == {1} and set(bytes(second.buffers[0])) == {2}
    del first
    third = encoder.encode(torch.full((OUT_OF_BAND_MIN_BYTES,), 3, dtype=torch.uint8))
    assert third.buffers[0].obj is copy() and set(bytes(third.buffers[0])) == {3}
    assert set(bytes(second.buffers[0])) == {2}


def test_large_numpy_array_goes_out_of_band():
    array = np.random.rand(200, 200)
    encoded = dumps_item(array)
    assert len(encoded.buffers) == 1 and memoryview(encoded.buffers[0]).nbytes == array.nbytes
    np.testing.assert_array_equal(loads_item(over_the_wire(encoded)), array)


def test_an_encoded_item_keeps_its_buffers_as_they_were_when_encoded():
    tensor = torch.randn(128, 1024)
    expected = tensor.clone()
    encoded = dumps_item(tensor)
    assert len(encoded.buffers) == 1  # out of band: sent with no further copy
    view = memoryview(encoded.buffers[0])
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data != tensor.data_ptr()
    tensor.fill_(0)  # a graph that refills its buffer for the next item
    assert torch.equal(loads_item(encoded), expected)


def test_an_encoder_lets_go_of_each_item_once_it_is_encoded():
    # Held until the next item's encode, an item's memory cannot go back to the allocator warm
    # for the next one, and a worker waiting for credit would keep a whole item alive.
    import weakref

    encoder = ItemEncoder()
    big, small = torch.randn(256, 1024), torch.arange(4)
    refs = [weakref.ref(big), weakref.ref(small)]
    encoded = encoder.encode({"big": big, "small": small})
    del big, small
    assert [ref() for ref in refs] == [None, None]
    assert loads_item(over_the_wire(encoded))["big"].shape == (256, 1024)
    held = torch.ones(256, 1024)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        encoder.encode({"held": held, "unpicklable": lambda: None})
    held_ref = weakref.ref(held)
    del held
    assert held_ref() is None  # let go of when pickling fails too


def test_an_encoded_item_knows_its_bytes_on_the_wire():
    encoder = ItemEncoder()
    items = [torch.arange(16), torch.ones(OUT_OF_BAND_MIN_BYTES, dtype=torch.uint8),
             {"a": torch.zeros(40_000), "b": torch.ones(20_000, dtype=torch.float64), "label": 3}]
    for item in items:
        encoded = encoder.encode(item)
        counted = EncodedItem(encoded.payload, encoded.buffers)  # as the trainer's frames make them
        expected = len(encoded.payload) + sum(memoryview(b).nbytes for b in encoded.buffers)
        assert encoded.nbytes == counted.nbytes == expected
    with pytest.raises(AttributeError, match="no attribute 'nbites'"):
        encoded.nbites  # noqa: B018


@pytest.mark.parametrize("nbytes, budget", [(1024, 1), (OUT_OF_BAND_MIN_BYTES, 3)])
def test_encoding_a_plain_tensor_costs_a_fewpython_calls(nbytes, budget):
    # A worker's CPU per small item is mostly calls: the encoder's part of them is bounded here.
    # A bare tensor of a dtype and shape encoded twice before costs no pickler call (its stream is
    # the earlier one's, with its own bytes in band); a large one, its buffer's reused copy (encode,
    # the buffers' step, the copy's buffer); no call to make the item or to read its size twice.
    encoder = ItemEncoder()
    for _ in range(2):  # the reused copy exists, the stream is kept: as in a stream of such tensors
        encoder.encode(torch.ones(nbytes, dtype=torch.uint8))

    def encode_and_size(tensor):
        encoded = encoder.encode(tensor)
        return encoded, encoded.nbytes + encoded.nbytes

    tensor = torch.full((nbytes,), 7, dtype=torch.uint8)
    (encoded, _), calls = python_calls(encode_and_size, tensor)
    assert len(calls) <= budget, calls
    assert "reducer_override" not in calls
    assert torch.equal(loads_item(over_the_wire(encoded)), tensor)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(8),
        torch.tensor(2.5, dtype=torch.float64),
        torch.zeros(0, 3, dtype=torch.int16),
        torch.arange(12, dtype=torch.int32).reshape(3, 4),
        torch.randn(10, 10)[2:5],  # contiguous, not at the start of its storage
        torch.tensor([True, False, True]),
        torch.arange(OUT_OF_BAND_MIN_BYTES - 1, dtype=torch.uint8),
        torch.arange(OUT_OF_BAND_MIN_BYTES // 4, dtype=torch.float32),
        torch.randn(4, 3).t(),  # not contiguous: pickled every time
        torch.randn(5, dtype=torch.bfloat16),  # no numpy dtype: pickled every time
    ],
    ids=lambda t: f"{t.dtype}-{tuple(t.shape)}",
)
def test_a_bare_tensor_encoded_from_an_earlier_ones_stream_is_the_picklers_stream(tensor):
    warm = ItemEncoder()
    for _ in range(2):  # the second of its dtype and shape: the pickler's stream kept
        warm.encode(torch.zeros_like(tensor))
    for fill in (1, 3):
        item = torch.full_like(tensor, fill) if tensor.is_contiguous() else tensor * fill
        encoded, pickled = warm.encode(item), ItemEncoder().encode(item)
        assert encoded.payload == pickled.payload and encoded.nbytes == pickled.nbytes
        assert [bytes(b) for b in encoded.buffers] == [bytes(b) for b in pickled.buffers]
        out = loads_item(over_the_wire(encoded))
        assert out.dtype == item.dtype and out.shape == item.shape and torch.equal(out, item)


def test_an_encoder_keeps_the_streams_of_a_bounded_number_of_tensor_kinds():
    encoder, streams = ItemEncoder(), TensorStreams()
    for length in range(200):  # ever new shapes: each pickled, and kept the second time only
        for _ in range(2):
            tensor = torch.arange(length, dtype=torch.int16)
            encoded = encoder.encode(tensor)
            assert torch.equal(loads_item(over_the_wire(encoded)), tensor)
            streams.keep(tensor, (tensor.dtype, tensor.shape), encoded.payload, [])
        assert len(streams) <= 64
    assert streams  # the latest kinds are kept


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([True, False, True]),
        torch.randn(5, dtype=torch.bfloat16),
        torch.randn(3, 2, dtype=torch.complex128)[:, 0],  # not contiguous
        torch.zeros(4, dtype=torch.float8_e4m3fn),
        torch.zeros(0, 3, dtype=torch.int16),
        torch.arange(OUT_OF_BAND_MIN_BYTES, dtype=torch.float16),
    ],
    ids=lambda t: f"{t.dtype}-{tuple(t.shape)}",
)
def test_a_tensor_carries_its_dtype_by_name_and_its_rebuild_function_as_the_only_global(tensor):
    # A dtype pickled as a torch global costs an import check, a getattr and a reducer_override
    # call per tensor on the worker (and a find_class on the trainer): its name does not.
    encoded = ItemEncoder().encode({"x": tensor, "y": [tensor[:1].clone()]})
    globals_ = [op.name for op, _arg, _pos in pickletools.genops(encoded.payload) if "GLOBAL" in op.name]
    assert globals_ == ["STACK_GLOBAL"]  # the rebuild function, once: the memo has it for the second tensor
    out = loads_item(over_the_wire(encoded))
    for got, sent in ((out["x"], tensor), (out["y"][0], tensor[:1])):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        dense = torch.empty_like(sent, memory_format=torch.contiguous_format).copy_(sent)
        assert torch.equal(got.view(torch.uint8), dense.view(torch.uint8))


def test_a_dtype_the_trainers_torch_lacks_is_refused_by_name():
    encoded = ItemEncoder().encode(torch.ones(3, dtype=torch.float32))
    assert encoded.payload.count(b"float32") == 1
    renamed = EncodedItem(encoded.payload.replace(b"float32", b"float99"), encoded.buffers)
    with pytest.raises(pickle.UnpicklingError, match="dtype 'float99', which this process's torch .* does not have"):
        loads_item(renamed)


def test_an_encoder_goes_on_after_an_item_it_could_not_pickle():
    encoder = ItemEncoder()
    with pytest.raises((pickle.PicklingError, AttributeError)):
        encoder.encode({"big": torch.ones(OUT_OF_BAND_MIN_BYTES), "unpicklable": lambda: None})
    for item in (torch.arange(10), {"big": torch.full((OUT_OF_BAND_MIN_BYTES,), 2.0)}):
        encoded = encoder.encode(item)
        assert len(encoded.buffers) == (0 if isinstance(item, torch.Tensor) else 1)
        out = loads_item(over_the_wire(encoded))
        assert torch.equal(out, item) if isinstance(item, torch.Tensor) else torch.equal(out["big"], item["big"])


def test_requires_grad_tensor_uses_torch_reduction():
    t = torch.randn(3, requires_grad=True)
    out = roundtrip(t)
    assert out.requires_grad and torch.equal(out.detach(), t.detach())


def _quantized(dtype, size=(10,)):
    return torch.quantize_per_tensor(torch.rand(size) * 4, 0.1, 0 if dtype is torch.qint32 else 10, dtype)


#: Tensors the out-of-band fast path must not take for plain ones (or must take right), made
#: when the test runs (quantize_* warns that it is deprecated).
EXOTIC_TENSORS = {
    "quint8": lambda: _quantized(torch.quint8),
    "qint8": lambda: _quantized(torch.qint8),
    "qint32": lambda: _quantized(torch.qint32),
    "quint4x2": lambda: _quantized(torch.quint4x2),
    "quint8-large": lambda: _quantized(torch.quint8, (4 * OUT_OF_BAND_MIN_BYTES,)),
    "quint8-transposed": lambda: _quantized(torch.quint8, (8, 16)).t(),
    "quint8-offset": lambda: _quantized(torch.quint8, (100,))[10:30],
    "quint8-empty": lambda: _quantized(torch.quint8, (0, 3)),
    "per-channel-qint8": lambda: torch.quantize_per_channel(
        torch.randn(3, 4), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, -2]), 0, torch.qint8
    ),
    "per-channel-float-qparams": lambda: torch.quantize_per_channel(
        torch.randn(3, 4), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.0, 0.5, 1.0]), 0, torch.quint8
    ),
    "sparse-coo": lambda: torch.randn(4, 5).relu().to_sparse(),
    "sparse-csr": lambda: torch.randn(4, 5).relu().to_sparse_csr(),
    "nested": lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
    "float8": lambda: torch.randn(6).to(torch.float8_e4m3fn),
    "float8-transposed": lambda: torch.randn(3, 4).to(torch.float8_e5m2).t(),
    "uint16": lambda: torch.tensor([1, 2, 65535], dtype=torch.uint16),
    "complex32": lambda: torch.randn(4, dtype=torch.complex64).to(torch.complex32),
    "complex128-conj": lambda: torch.randn(4, dtype=torch.complex128).conj(),
    "bool-large": lambda: torch.rand(OUT_OF_BAND_MIN_BYTES * 2) > 0.5,
    "zero-dim": lambda: torch.tensor(-2.5, dtype=torch.bfloat16),
    "storage-offset-large": lambda: torch.randn(3 * OUT_OF_BAND_MIN_BYTES)[7 : 2 * OUT_OF_BAND_MIN_BYTES],
    "requires-grad-large": lambda: torch.randn(OUT_OF_BAND_MIN_BYTES, requires_grad=True),
    "requires-grad-non-leaf": lambda: torch.randn(5, requires_grad=True) * 2,
    "requires-grad-empty": lambda: torch.empty(0, requires_grad=True),
    "parameter": lambda: torch.nn.Parameter(torch.randn(3)),
}


def _as_plain(tensor):
    """What two tensors must agree on, as plain strided tensors torch.equal can compare (bytes
    for the dtypes it cannot), with the quantization parameters alongside."""
    params = ()
    if tensor.is_quantized:
        if tensor.qscheme() == torch.per_tensor_affine:
            params = (tensor.q_scale(), tensor.q_zero_point())
        else:
            params = (tensor.q_per_channel_scales(), tensor.q_per_channel_zero_points(), tensor.q_per_channel_axis())
        return [tensor.int_repr()], (tensor.qscheme(), *params)
    if tensor.is_nested:
        return list(tensor.detach().unbind()), ()
    plain = (tensor.detach().to_dense() if tensor.layout != torch.strided else tensor.detach()).resolve_conj()
    return [plain.contiguous().view(torch.uint8) if plain.dim() else plain.reshape(1).view(torch.uint8)], ()


@pytest.mark.filterwarnings("ignore::UserWarning")  # deprecated quantized creation, beta sparse CSR
@pytest.mark.parametrize("bare", [False, True], ids=["in-a-dict", "bare"])
@pytest.mark.parametrize("make", EXOTIC_TENSORS.values(), ids=EXOTIC_TENSORS.keys())
def test_exotic_tensors_arrive_as_they_were_sent(make, bare):
    tensor = make()
    encoder = ItemEncoder()
    for _ in range(3):  # the third of its kind: where an encoder makes items from a kept stream
        encoded = encoder.encode(tensor if bare else {"tensor": tensor, "after": torch.arange(3)})
    out = loads_item(over_the_wire(encoded))
    received, after = (out, torch.arange(3)) if bare else (out["tensor"], out["after"])
    assert type(received) is type(tensor)
    assert (received.dtype, received.layout, received.is_quantized, received.requires_grad) == (
        tensor.dtype, tensor.layout, tensor.is_quantized, tensor.requires_grad
    )  # fmt: skip
    if not tensor.is_nested:
        assert received.shape == tensor.shape
    (sent_values, sent_params), (received_values, received_params) = _as_plain(tensor), _as_plain(received)
    assert len(received_values) == len(sent_values)
    assert all(torch.equal(r, s) for r, s in zip(received_values, sent_values))
    assert len(received_params) == len(sent_params)
    assert all(torch.equal(r, s) if isinstance(s, torch.Tensor) else r == s for r, s in zip(received_params, sent_params))
    assert torch.equal(after, torch.arange(3))  # the stream goes on after it


@pytest.mark.filterwarnings("ignore::UserWarning")  # deprecated quantized creation
def test_storages_in_torch_reductions_go_out_of_band_and_are_rebuilt_on_received_memory():
    quantized = _quantized(torch.quint8, (4 * OUT_OF_BAND_MIN_BYTES,))
    for tensor in (quantized, torch.randn(OUT_OF_BAND_MIN_BYTES, requires_grad=True)):
        encoded = over_the_wire(dumps_item(tensor))
        assert len(encoded.buffers) == 1 and len(encoded.payload) < 1024  # not torch.save's bytes in band
        received = loads_item(encoded)
        assert received.untyped_storage().data_ptr() == np.frombuffer(encoded.buffers[0], np.uint8).ctypes.data
    assert torch.equal(received.detach(), tensor.detach()) and received.requires_grad
    assert received.untyped_storage().nbytes() == tensor.untyped_storage().nbytes()


def test_a_tensor_torch_cannot_pickle_is_a_clear_error():
    with pytest.raises(ItemPicklingError, match=r"torch\.Tensor that cannot be pickled \(layout torch\._mkldnn.*to_dense"):
        dumps_item({"image": torch.randn(2, 3).to_mkldnn()})


# -- graphs -------------------------------------------------------------------------------------
def test_graph_with_lambda_and_local_function_round_trips():
    from torchdata.datapipes.iter import IterableWrapper

    offset = 100

    def add(x):
        return x + offset

    dp = IterableWrapper(range(5)).map(add).map(lambda x: x * 2)
    rebuilt = loads_graph(dumps_graph(dp))
    assert list(rebuilt) == [(x + 100) * 2 for x in range(5)]


# -- exceptions ---------------------------------------------------------------------------------
class TwoArgError(Exception):
    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")
        self.code = code


def raise_and_pack(exc):
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return pack_exception(caught)


def test_pack_exception_fields():
    info = raise_and_pack(ValueError("boom 7"))
    assert info["type_name"] == "ValueError"
    assert info["type_module"] == "builtins"
    assert info["message"] == "boom 7"
    assert "raise exc" in info["traceback"] and "ValueError: boom 7" in info["traceback"]
    assert pickle.loads(info["pickled"]).args == ("boom 7",)


def test_pack_exception_gives_each_field_the_type_the_protocol_checks():
    for exc in (ValueError("boom 7"), BrokenStrError("hidden"), BrokenReduceError("x")):
        info = raise_and_pack(exc)
        assert set(info) == set(EXCEPTION_FIELD_TYPES)
        assert all(isinstance(info[key], types) for key, types in EXCEPTION_FIELD_TYPES.items()), info


def test_exception_summary_names_the_type_and_never_raises():
    assert exception_summary(ValueError("boom 7")) == "ValueError: boom 7"
    assert exception_summary(BrokenStrError("hidden")) == "BrokenStrError: <unprintable BrokenStrError object>"


def test_rebuild_keeps_type_and_names_worker():
    info = raise_and_pack(ValueError("boom 7"))
    exc = rebuild_exception(info, 1, "127.0.0.1:5555")
    assert type(exc) is ValueError
    text = str(exc)
    assert text.startswith("Caught ValueError in worker process 1 (127.0.0.1:5555).")
    assert "Original Traceback" in text and "boom 7" in text
    assert exc.worker_rank == 1 and exc.worker_address == "127.0.0.1:5555"
    assert "ValueError: boom 7" in exc.remote_traceback


def test_rebuild_key_error_reads_well():
    exc = rebuild_exception(raise_and_pack(KeyError("missing")), 0, "h:1")
    assert isinstance(exc, KeyError)
    assert str(exc).startswith("Caught KeyError in worker process 0 (h:1)")


def test_unrebuildable_exception_becomes_remote_worker_error():
    exc = rebuild_exception(raise_and_pack(TwoArgError(3, "bad")), 2, "h:2")
    assert isinstance(exc, RemoteWorkerError)
    assert "TwoArgError" in str(exc) and "3: bad" in str(exc) and "worker process 2 (h:2)" in str(exc)


def test_unpicklable_exception_becomes_remote_worker_error():
    class Local(Exception):
        pass

    exc = Local("x")
    exc.lock = threading.Lock()  # a lock cannot be pickled, not even by cloudpickle
    info = raise_and_pack(exc)
    assert info["pickled"] is None
    rebuilt = rebuild_exception(info, 0, None)
    assert isinstance(rebuilt, RemoteWorkerError)
    assert "Local in worker process 0" in str(rebuilt) and "Local: x" in str(rebuilt)


def test_exception_of_unknown_type_becomes_remote_worker_error():
    info = raise_and_pack(ValueError("x"))
    info["pickled"] = b"\x80\x05\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x0cno_such_mod\x94\x8c\x03Err\x94\x93\x94."
    assert isinstance(rebuild_exception(info, 0, "a:1"), RemoteWorkerError)


class BrokenStrError(ValueError):
    def __str__(self):
        raise RuntimeError("no str")

    def __repr__(self):
        raise RuntimeError("no repr")


class BrokenReduceError(Exception):
    def __reduce__(self):
        raise SystemExit("reduce says exit")


def test_pack_exception_of_an_unprintable_exception_uses_a_placeholder():
    info = raise_and_pack(BrokenStrError("hidden"))
    assert info["type_name"] == "BrokenStrError"
    assert info["message"] == "<unprintable BrokenStrError object>"
    assert "BrokenStrError" in info["traceback"]
    rebuilt = rebuild_exception(info, 1, "h:1")
    # The same type would hide the message again behind its broken __str__: ours is readable.
    assert isinstance(rebuilt, RemoteWorkerError)
    assert str(rebuilt).startswith("Caught BrokenStrError in worker process 1 (h:1).")


def test_pack_exception_of_an_exception_whose_pickling_raises_base_exception():
    info = raise_and_pack(BrokenReduceError("x"))
    assert info["pickled"] is None and info["message"] == "x"
    assert isinstance(rebuild_exception(info, 0, None), RemoteWorkerError)


def test_fallback_exception_info_is_a_plain_runtime_error():
    info = fallback_exception_info(BrokenStrError(), MemoryError())
    rebuilt = rebuild_exception(info, 3, "h:3")
    assert isinstance(rebuilt, RemoteWorkerError)
    assert "Caught RuntimeError in worker process 3 (h:3)" in str(rebuilt)
    assert "could not describe the BrokenStrError" in str(rebuilt) and "MemoryError" in str(rebuilt)


def test_a_class_received_by_value_travels_back_by_name():
    # The trainer's module, shipped by value to a "worker" that cannot import it (in one
    # process cloudpickle hands back the same class object; the real-process tests in
    # test_session_hardening.py cover distinct ones).
    module = types.ModuleType("rrs_trainer_only_module")
    exec("class Point:\n    def __init__(self, x):\n        self.x = x\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        cloudpickle.register_pickle_by_value(module)
        try:
            shipped = cloudpickle.dumps(module.Point)
        finally:
            cloudpickle.unregister_pickle_by_value(module)
        del sys.modules[module.__name__]  # the worker side: the module is not importable
        worker_class = pickle.loads(shipped)
        encoded = dumps_item([worker_class(3), worker_class(4)])
        sys.modules[module.__name__] = module  # the trainer side
        received = loads_item(over_the_wire(encoded))
        assert [type(p) for p in received] == [module.Point, module.Point] and [p.x for p in received] == [3, 4]
    finally:
        sys.modules.pop(module.__name__, None)


def test_a_local_class_travels_by_value():
    def make():
        class Local:
            def __init__(self, x):
                self.x = x

        return Local

    item = roundtrip(make()(5))
    assert type(item).__name__ == "Local" and item.x == 5


def test_an_item_class_the_trainer_lacks_is_named_in_the_error():
    module = types.ModuleType("rrs_worker_only_module")
    exec("class Thing:\n    pass\n", module.__dict__)
    sys.modules[module.__name__] = module
    cloudpickle.register_pickle_by_value(module)
    try:
        worker_class = pickle.loads(cloudpickle.dumps(module.Thing))
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        del sys.modules[module.__name__]
    with pytest.raises(pickle.UnpicklingError, match="rrs_worker_only_module.Thing"):
        loads_item(dumps_item(worker_class()))


def test_a_graph_needing_a_missing_module_names_it_and_the_fix():
    data = pickle.dumps(pickle.PickleBuffer).replace(b"pickle", b"nosuch")  # a reference into a missing module
    with pytest.raises(ModuleNotFoundError, match=r"'nosuch'.*install.*pickle_by_value=\[nosuch\]") as caught:
        loads_graph(data)
    assert caught.value.name == "nosuch"



# An encoder pickling items while another thread's garbage collection traverses its pickler (the
# receive loop's, as a dispatcher encodes; one thread-mode session's, as another one's producer
# does). A tensor torch reduces itself (sparse, requiring grad) leaves tensors in the pickle memo,
# and freeing one lets other threads run. PYTHONMALLOC=debug poisons freed memory: a traversal
# that reaches a freed object crashes at once.
_ENCODE_WHILE_COLLECTED = """
import gc, pickle, sys, threading, time
import torch
from rpc_reading_service.serialization import ItemEncoder

encoder = ItemEncoder()
# the pickler, as a collection finds it
pickler = next(o for o in gc.get_referents(encoder) if isinstance(o, pickle.Pickler))
done = threading.Event()

def traverse():  # what every collection does to the pickler, as often as it can
    while not done.is_set():
        for obj in gc.get_referents(pickler):
            type(obj).__name__

class Doubled:  # whose own reduction makes a tensor that only the pickle memo holds
    def __init__(self, tensor):
        self.tensor = tensor

    def __reduce__(self):
        return Doubled, (self.tensor * 2,)

traverser = threading.Thread(target=traverse, daemon=True)  # a failed encode still ends the process
traverser.start()
indices, values = torch.stack([torch.arange(10), torch.arange(10)]), torch.ones(10)
for group in sys.argv[2:]:  # each group of kinds in turn, then it says so
    kinds = group.split(",")
    deadline = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < deadline:
        if "sparse" in kinds:  # torch's own reduction
            encoder.encode(torch.sparse_coo_tensor(indices, values, (10, 10), check_invariants=False).coalesce())
        if "grad" in kinds:
            encoder.encode(torch.ones(10, requires_grad=True))
        if "class" in kinds:
            encoder.encode({"a": Doubled(values), "b": [values, 3]})
    print(group, "ok", flush=True)
done.set()
traverser.join()  # ended before the interpreter's: a thread still running at exit can abort it
"""
_ENCODED_KINDS = ["sparse,grad", "class"]


@pytest.fixture(scope="module")
def encoding_while_collected() -> subprocess.CompletedProcess:
    """One fresh ``PYTHONMALLOC=debug`` interpreter encoding each group of :data:`_ENCODED_KINDS` in turn."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONMALLOC="debug", PYTHONFAULTHANDLER="1")
    command = [sys.executable, "-c", _ENCODE_WHILE_COLLECTED, "2", *_ENCODED_KINDS]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=50)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kinds", _ENCODED_KINDS)
def test_encoding_leaves_no_freed_object_where_another_threads_collection_looks(encoding_while_collected, kinds):
    done = encoding_while_collected
    assert f"{kinds} ok" in done.stdout.splitlines(), (
        f"the encoding process ended with {done.returncode} before {kinds} was done:\n{done.stderr[-3000:]}"
    )
    if kinds == _ENCODED_KINDS[-1]:  # and, after the last group, the process ended well
        assert done.returncode == 0, f"the encoding process ended with {done.returncode}:\n{done.stderr[-3000:]}"
