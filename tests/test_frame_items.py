"""The trainer's unpickling of a DATA frame's items: a bare tensor of a dtype and shape seen
before is rebuilt on its buffer without the unpickler, to the same tensor pickle would give."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Any, List

import numpy as np
import pytest
import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import python_calls
from protocol_link import data_frame
from rpc_reading_service import RPCReadingService
from rpc_reading_service.frame_items import loads_payloads
from rpc_reading_service.protocol import decode_data_parts
from rpc_reading_service.serialization import OUT_OF_BAND_MIN_BYTES, ItemEncoder

ELEMENTS = OUT_OF_BAND_MIN_BYTES // 4  # 64 KiB of float32: out of band


def received(items: List[Any], encoder: ItemEncoder) -> Any:
    """``(payloads, buffers)`` of one DATA frame of ``items``, encoded and sent as bytes."""
    return decode_data_parts(data_frame([encoder.encode(item) for item in items]))[2:]


def address(buffer: Any) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


KINDS = [
    lambda i: torch.full((ELEMENTS,), float(i)),
    lambda i: torch.full((64, ELEMENTS // 64), i, dtype=torch.int32),
    lambda i: torch.full((2, 4, OUT_OF_BAND_MIN_BYTES // 8), i % 2 == 0),
    lambda i: torch.full((ELEMENTS // 2,), complex(i, -i), dtype=torch.complex64),
    lambda i: torch.full((ELEMENTS * 2,), i, dtype=torch.bfloat16),  # no numpy dtype: pickled otherwise
    lambda i: torch.full((256, ELEMENTS // 128), float(i))[:, ::2],  # not contiguous
    lambda i: torch.full((ELEMENTS,), float(i))[None, :].expand(2, ELEMENTS),  # a view of half its size
]


@pytest.mark.parametrize("make", KINDS, ids=lambda make: f"{make(0).dtype}-{tuple(make(0).shape)}")
def test_bare_tensors_decode_as_pickle_does_on_their_own_buffers(make):
    encoder = ItemEncoder()
    for frame in range(3):  # the first frame of a kind is unpickled; later ones rebuilt from its stream
        items = [make(frame * 4 + i) for i in range(4)]
        payloads, buffers = received(items, encoder)
        decoded = loads_payloads(payloads, buffers)
        pickled = [pickle.loads(payload, buffers=each) for payload, each in zip(payloads, buffers)]
        for out, expected, item, item_buffers in zip(decoded, pickled, items, buffers):
            assert type(out) is torch.Tensor
            assert (out.dtype, out.shape, out.stride()) == (expected.dtype, expected.shape, expected.stride())
            assert torch.equal(out, item) and torch.equal(out, expected)
            assert out.data_ptr() == expected.data_ptr() == address(item_buffers[0])  # no copy


#: Bare tensors whose stream (torch's own reduction) carries more than their bytes, dtype and shape.
TORCH_REDUCED = {
    "quantized": "torch.quantize_per_tensor(torch.arange(N * 4.0) % 7, 0.5, 1, torch.qint8)",
    "requires-grad": "torch.ones(N).requires_grad_(True)",
}
#: The same stream again and again: rebuilt from the buffer alone as a plain tensor, a quantized one
#: had lost its quantizer (q_scale() crashed the process: hence one of its own) and one requiring grad its flag.
DECODE_AGAIN_AND_AGAIN = """
import warnings; warnings.filterwarnings("ignore")
import torch
from protocol_link import data_frame
from rpc_reading_service.frame_items import loads_payloads
from rpc_reading_service.protocol import decode_data_parts
from rpc_reading_service.serialization import ItemEncoder
N = {elements}
encoder, tensor = ItemEncoder(), {make}
for _frame in range(3):
    parts = decode_data_parts(data_frame([encoder.encode(item) for item in [tensor] * 3]))[2:]
    for out in loads_payloads(*parts):
        assert (out.dtype, out.is_quantized, out.requires_grad) == (tensor.dtype, tensor.is_quantized, tensor.requires_grad)
        if tensor.is_quantized:
            assert (out.q_scale(), out.q_zero_point()) == (0.5, 1) and torch.equal(out.int_repr(), tensor.int_repr())
        else:
            assert torch.equal(out.detach(), tensor.detach())
print("ok")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", TORCH_REDUCED.values(), ids=TORCH_REDUCED.keys())
def test_a_bare_tensor_that_torch_reduces_keeps_what_its_bytes_do_not_say(make):
    script = DECODE_AGAIN_AND_AGAIN.format(elements=ELEMENTS, make=make)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50, env=env)
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr[-2000:]


def test_a_bare_tensor_of_a_kind_seen_before_costs_one_python_call():
    encoder = ItemEncoder()
    loads_payloads(*received([torch.zeros(64, ELEMENTS // 64)] * 2, encoder))  # the kind is learnt
    payloads, buffers = received([torch.full((64, ELEMENTS // 64), float(i)) for i in range(4)], encoder)
    decoded, calls = python_calls(loads_payloads, payloads, buffers)
    assert [float(tensor[0, 0]) for tensor in decoded] == [0.0, 1.0, 2.0, 3.0]
    assert calls == ["_rebuild_tensor"] * 4 + ["release_sparse_tensors"], calls


def test_other_items_of_one_buffer_decode_between_bare_tensors():
    encoder = ItemEncoder()
    make = [
        lambda i: torch.full((ELEMENTS,), float(i)),
        lambda i: (torch.full((ELEMENTS,), float(i)), i),
        lambda i: {"image": torch.full((ELEMENTS,), float(i)), "label": i},
        lambda i: [torch.full((ELEMENTS,), float(i))],
    ]
    for frame in range(3):
        items = [kind(frame * 10 + k) for k, kind in enumerate(make)]
        decoded = loads_payloads(*received(items, encoder))
        assert torch.equal(decoded[0], items[0])
        assert isinstance(decoded[1], tuple) and decoded[1][1] == items[1][1]
        assert torch.equal(decoded[1][0], items[1][0])
        assert decoded[2].keys() == items[2].keys() and torch.equal(decoded[2]["image"], items[2]["image"])
        assert isinstance(decoded[3], list) and torch.equal(decoded[3][0], items[3][0])


def test_a_known_stream_with_a_buffer_of_another_size_fails_as_unpickling_it_does():
    encoder = ItemEncoder()
    shape = (64, ELEMENTS // 64)
    payloads, buffers = received([torch.zeros(shape)] * 2, encoder)
    loads_payloads(payloads, buffers)  # the stream is known from here on
    short = [[np.zeros(OUT_OF_BAND_MIN_BYTES - 4, dtype=np.uint8)]]
    with pytest.raises(RuntimeError) as unpickled:
        pickle.loads(payloads[0], buffers=short[0])
    with pytest.raises(RuntimeError) as decoded:
        loads_payloads(payloads[:1], short)
    assert str(decoded.value) == str(unpickled.value)


def tensor_of(index: int) -> Any:
    """Each index a bare tensor of one of four kinds (the third with no numpy dtype, the fourth
    large enough for a local worker's shared memory) that says which index it is (its first two
    elements: ``index // 256``, ``index % 256``, exact in each)."""
    kinds = [(torch.float32, (64, ELEMENTS // 64)), (torch.int64, (ELEMENTS,)), (torch.bfloat16, (ELEMENTS,)),
             (torch.float32, (8, ELEMENTS))]
    dtype, shape = kinds[index % 4]
    tensor = torch.full(shape, index % 256, dtype=dtype)
    tensor.view(-1)[0] = index // 256
    return tensor


@pytest.mark.timeout(60)
def test_bare_tensors_from_local_workers_arrive_as_made():
    graph = IterableWrapper(range(600)).sharding_filter().map(tensor_of)
    with DataLoader2(graph, reading_service=RPCReadingService(num_workers=2)) as loader:
        for _epoch in range(2):
            indices = []
            for tensor in loader:
                flat = tensor.reshape(-1)
                index = int(flat[0].item()) * 256 + int(flat[1].item())
                assert torch.equal(tensor, tensor_of(index)), index
                indices.append(index)
            assert sorted(indices) == list(range(600))


def test_a_stream_of_ever_new_shapes_is_unpickled_and_never_encoded_again():
    encoder = ItemEncoder()
    tensors = [torch.full((ELEMENTS + 4 * k,), float(k)) for k in range(20)]  # 20 shapes, each once
    payloads, buffers = received(tensors, encoder)
    decoded, calls = python_calls(loads_payloads, payloads, buffers)
    assert all(torch.equal(out, tensor) for out, tensor in zip(decoded, tensors))
    assert "encode" not in calls and "dump" not in calls, sorted(set(calls))


@pytest.mark.parametrize("payload", [b"", b".", b"R\x94", b"\x80\x05R\x94."])
def test_a_short_or_malformed_stream_fails_as_unpickling_it_does(payload):
    buffers = [[np.zeros(OUT_OF_BAND_MIN_BYTES, dtype=np.uint8)]]
    with pytest.raises(Exception) as unpickled:
        pickle.loads(payload, buffers=buffers[0])
    with pytest.raises(Exception) as decoded:
        loads_payloads([memoryview(bytearray(payload))], buffers)
    assert type(decoded.value) is type(unpickled.value) and str(decoded.value) == str(unpickled.value)
