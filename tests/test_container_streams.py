"""Items that are flat tuples, lists and dicts of tensors, ints and floats: the encoder makes them
from the kept stream of their kind, byte for byte the pickler's, and pickles every other item."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from rpc_reading_service.serialization import OUT_OF_BAND_MIN_BYTES, EncodedItem, ItemEncoder, loads_item
from rpc_reading_service.tensor_streams import ContainerStreams, container_kind

Pair = collections.namedtuple("Pair", "image label")


def same_encoding(warm: ItemEncoder, item) -> EncodedItem:
    """``warm``'s encoding of ``item``, checked against a fresh encoder's (the pickler's)."""
    encoded, pickled = warm.encode(item), ItemEncoder().encode(item)
    assert encoded.payload == pickled.payload
    assert [bytes(b) for b in encoded.buffers] == [bytes(b) for b in pickled.buffers]
    assert encoded.nbytes == pickled.nbytes
    return encoded


def arrived(encoded: EncodedItem):
    """The item as a trainer unpickles it (its buffers as received bytes)."""
    return loads_item(EncodedItem(encoded.payload, [bytearray(b) for b in encoded.buffers]))


def assert_equal(out, item) -> None:
    """``out`` is ``item``: the same types, keys, dtypes, shapes and values, all the way down."""
    assert type(out) is type(item)
    if isinstance(item, torch.Tensor):
        assert out.dtype == item.dtype and out.shape == item.shape and torch.equal(out, item)
    elif isinstance(item, dict):
        assert list(out) == list(item)
        for key in item:
            assert_equal(out[key], item[key])
    elif isinstance(item, (tuple, list)):
        assert len(out) == len(item)
        for a, b in zip(out, item):
            assert_equal(a, b)
    elif isinstance(item, float) and math.isnan(item):
        assert math.isnan(out)
    elif isinstance(item, float):
        assert out == item and math.copysign(1, out) == math.copysign(1, item)
    else:
        assert out == item


def tensor(fill, n=16, dtype=torch.int64):
    return torch.full((n,), fill, dtype=dtype)


INT_RANGES = [(0, 255), (256, 65535), (65536, 2**31 - 1), (-(2**31), -1)]
KINDS = {
    "tuple of tensors": lambda v: (tensor(v), torch.full((3, 4), v, dtype=torch.float32)),
    "dict of tensors and a label": lambda v: {
        "input_ids": tensor(v, 512), "mask": tensor(v % 100, 512, torch.int8), "label": v,
    },
    "list, tensors in and out of band, 0-d": lambda v: [
        tensor(v, OUT_OF_BAND_MIN_BYTES, torch.uint8), torch.tensor(v), tensor(v, 2, torch.bool),
        tensor(v, 0),
    ],
    "shape that equals the label": lambda v: (tensor(v, 3), 3 if v < 128 else v),
    "image and label": lambda v: (tensor(v, 3 * 8 * 8, torch.uint8), v),
}


@pytest.mark.parametrize("make", KINDS.values(), ids=KINDS.keys())
def test_a_container_made_from_its_kinds_stream_is_the_picklers_stream(make):
    warm = ItemEncoder()
    for _ in range(2):  # the second of its kind: the pickler's stream kept
        warm.encode(make(0))
    for value in (1, 7, 100, 200):
        item = make(value)
        assert_equal(arrived(same_encoding(warm, item)), item)


@pytest.mark.parametrize("low, high", INT_RANGES)
def test_ints_of_each_width_are_written_where_the_pickler_writes_them(low, high):
    warm = ItemEncoder()
    make = lambda v: {"image": tensor(5, 3), "label": v, "index": low}  # noqa: E731
    for _ in range(2):
        warm.encode(make(low))
    for value in (low, high, low + 1, high - 1, (low + high) // 2):
        assert_equal(arrived(same_encoding(warm, make(value))), make(value))
    assert len(warm._container_streams) == 1


def test_floats_of_every_kind_are_written_where_the_pickler_writes_them():
    warm = ItemEncoder()
    make = lambda v: [v, tensor(1, 3, torch.float32), 2.5]  # noqa: E731
    for _ in range(2):
        warm.encode(make(0.0))
    for value in (1.5, -0.0, math.inf, -math.inf, math.nan, 1e308, 5e-324, -123.456):
        assert_equal(arrived(same_encoding(warm, make(value))), make(value))
    assert len(warm._container_streams) == 1


def test_ints_of_another_width_are_another_kind():
    warm = ItemEncoder()
    for value in (3, 3, 300, 300, 70000, 70000, -5, -5, 2, 299):
        assert_equal(arrived(same_encoding(warm, (tensor(1), value))), (tensor(1), value))
    assert len(warm._container_streams) == 3  # one, two and four bytes (70000 and -5 alike)


OTHERS = {
    "one tensor twice": lambda t: (t, t),
    "a bool": lambda t: (t, True),
    "an int past 32 bits": lambda t: (t, 2**40),
    "a string": lambda t: (t, "cat"),
    "a nested tuple": lambda t: (t, (t + 1,)),
    "a namedtuple": lambda t: Pair(t, 3),
    "an int key": lambda t: {1: t},
    "a bool key": lambda t: {True: t},
    "an empty tuple": lambda t: (),
    "seventeen tensors": lambda t: tuple(t + i for i in range(17)),
}


@pytest.mark.parametrize("make", OTHERS.values(), ids=OTHERS.keys())
def test_other_containers_are_pickled_every_time(make):
    warm = ItemEncoder()
    for _ in range(3):
        item = make(tensor(4))
        out = arrived(same_encoding(warm, item))
        assert_equal(out, item)
    assert not warm._container_streams
    if make is OTHERS["one tensor twice"]:
        assert out[0] is out[1]  # the pickler's stream refers back to the one tensor


@pytest.mark.parametrize(
    "odd",
    [
        lambda: tensor(3).requires_grad_(False).float().requires_grad_(),
        lambda: torch.arange(32, dtype=torch.int64).reshape(2, 16).t()[0],  # not contiguous
    ],
    ids=["requires grad", "not contiguous"],
)
def test_a_tensor_the_kept_stream_cannot_carry_goes_through_the_pickler(odd):
    warm = ItemEncoder()
    for _ in range(2):
        warm.encode((odd().detach().contiguous(), 1))
    item = (odd(), 2)
    out = arrived(warm.encode(item))
    assert torch.equal(out[0], item[0]) and out[0].requires_grad == item[0].requires_grad and out[1] == 2


def test_an_encoder_keeps_the_streams_of_a_bounded_number_of_container_kinds():
    warm = ItemEncoder()
    for length in range(1, 200):  # ever new kinds: each pickled, and kept the second time only
        for _ in range(2):
            item = {"ids": tensor(1, length), "label": 4}
            assert_equal(arrived(warm.encode(item)), item)
        assert len(warm._container_streams) <= 64
    assert warm._container_streams


def test_a_kind_is_its_type_keys_and_elements():
    t = tensor(1, 4)
    assert container_kind((t, 3)) == (tuple, None, ((torch.int64, torch.Size([4])), 2))
    assert container_kind({"a": t}) == (dict, ("a",), ((torch.int64, torch.Size([4])),))
    assert container_kind([t, 1.0]) != container_kind((t, 1.0))
    assert container_kind((t, 3)) != container_kind((t, 300))
    assert container_kind((t, t)) is None and container_kind([]) is None


def test_a_stream_that_is_not_the_kinds_is_not_kept():
    streams, t = ContainerStreams(), tensor(2, 4)
    payload = ItemEncoder().encode((t, 3)).payload
    for _ in range(2):  # a stream of another item than the one said: its scalar is not found
        streams.keep((t, 3), container_kind((t, 3)), payload, [], lambda probe: payload)
    assert not streams
