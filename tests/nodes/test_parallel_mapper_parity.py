"""``RemoteMapper`` against torchdata's ``ParallelMapper(method="process")``, side by side.

Every test takes the ``make_mapper`` fixture, parametrized over the two: the same source, ``fn``
and calls run on each, and the test asserts the same observable result. Where ours differs on
purpose (docs/api.md, "RemoteMapper and ParallelMapper"), the test asserts each side's
documented behaviour. Our workers are local (two sessions, forked) and stopped after every test.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Iterator, List

import pytest

nodes = pytest.importorskip("torchdata.nodes", reason="torchdata.nodes needs torchdata >= 0.10")
from rpc_reading_service import RemoteMapper  # noqa: E402 - after torchdata.nodes is known to exist
from test_remote_map import boom_on_7, slow_on_even, square  # noqa: E402 - the graph functions of both suites

N = 30
Make = Callable[..., Any]


@pytest.fixture(params=["ParallelMapper", "RemoteMapper"])
def make_mapper(request) -> Iterator[Make]:
    """``make(items, fn, in_order=True)``: the mapper under test over ``IterableWrapper(items)``, two workers."""
    made: List[Any] = []

    def make(items: Any, fn: Callable[[Any], Any], in_order: bool = True) -> Any:
        source = nodes.IterableWrapper(items)
        if request.param == "ParallelMapper":
            mapper = nodes.ParallelMapper(source, fn, num_workers=2, in_order=in_order, method="process")
        else:
            mapper = RemoteMapper(source, fn, num_workers=2, in_order=in_order)
            made.append(mapper)
        return mapper

    make.name = request.param  # type: ignore[attr-defined]
    yield make
    for mapper in made:
        mapper.close()
    # ParallelMapper has no close(): its queues' feeder threads end when the collector finalizes them.
    gc.collect()


@pytest.mark.timeout(60)
def test_items_and_order_in_order_over_epochs(make_mapper):
    loader = nodes.Loader(make_mapper(range(N), square))
    assert [list(loader) for _ in range(2)] == [[square(x) for x in range(N)]] * 2


@pytest.mark.timeout(60)
def test_the_same_set_out_of_order(make_mapper):
    items = list(nodes.Loader(make_mapper(range(N), slow_on_even, in_order=False)))
    assert sorted(items) == [square(x) for x in range(N)]


@pytest.mark.timeout(60)
def test_fns_exception_after_the_items_before_it(make_mapper):
    mapper = make_mapper(range(20), boom_on_7)
    got: List[int] = []
    with pytest.raises(KeyError, match="no item 7") as caught:
        for item in nodes.Loader(mapper):
            got.append(item)
    assert got == list(range(7))
    message = str(caught.value)
    assert "Original Traceback" in message and "boom_on_7" in message
    where = "in _apply_udf" if make_mapper.name == "ParallelMapper" else "in worker process"
    assert f"Caught KeyError {where}" in message  # documented: ours names the worker


@pytest.mark.timeout(60)
def test_fns_exception_out_of_order_comes_after_some_items(make_mapper):
    mapper = make_mapper(range(20), boom_on_7, in_order=False)
    got: List[int] = []
    with pytest.raises(KeyError, match="no item 7"):
        for item in nodes.Loader(mapper):
            got.append(item)
    assert 7 not in got and len(set(got)) == len(got) and set(got) <= set(range(20))


@pytest.mark.timeout(90)
def test_state_dict_mid_epoch_then_reset_resumes_the_remaining_items(make_mapper):
    mapper = make_mapper(range(N), square)
    mapper.reset()
    head = [next(mapper) for _ in range(11)]
    state = mapper.state_dict()
    assert head == [square(x) for x in range(11)]
    resumed = make_mapper(range(N), square)
    resumed.reset(state)
    assert list(resumed) == [square(x) for x in range(11, N)]
    resumed.reset()
    assert list(resumed) == [square(x) for x in range(N)]  # the next epoch is whole


@pytest.mark.timeout(60)
def test_composition_with_batcher_and_loader(make_mapper):
    loader = nodes.Loader(nodes.Batcher(make_mapper(range(10), square), 4, drop_last=False))
    assert list(loader) == [[0, 1, 4, 9], [16, 25, 36, 49], [64, 81]]


@pytest.mark.timeout(60)
def test_an_empty_source_gives_empty_epochs(make_mapper):
    loader = nodes.Loader(make_mapper([], square))
    assert [list(loader) for _ in range(2)] == [[], []]
