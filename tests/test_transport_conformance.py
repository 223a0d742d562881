"""One conformance suite, run against every registered transport.

Parametrised over ``available_transports()`` at collection time: the built-in ``socket`` and
``torch_rpc``, whatever a plugin package registers through the entry-point group, and
``test_plugin`` (``tests/transport_plugin.py``), a third-party transport this module
registers itself with ``register_transport``. Worker servers find ``test_plugin`` through its
entry point (``tests/plugin_dist``, put on their ``PYTHONPATH``): see ``transport_plugin.py``.

Every transport must give the same end-to-end semantics: every item exactly once per epoch,
seeded runs reproducible and epochs different, the *same item order for the same seed on
every transport*, remote exceptions with their type, early break, bounded shutdown with
every session process reaped, and local workers.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from _server_helpers import wait_until
from conftest import _pythonpath, children_of, process_alive, run_epochs, start_server
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe
from transport_plugin import DIST_DIR, LOG_ENV, PLUGIN_NAME, Counters, CountingTransport

from _server_helpers import _pythonpath, children_of, process_alive, run_epochs, start_server, wait_until
from _server_helpers import remote as shared_remote
from rpc_reading_service import Liveness, RPCReadingService, available_transports, register_transport
from transport_plugin import DIST_DIR, LOG_ENV, PLUGIN_NAME, CountingTransport, Counters

# The plugin path, trainer side. (Worker processes import this module to unpickle the
# graph functions below; their servers already know the plugin from its entry point.)
if PLUGIN_NAME not in available_transports():
    register_transport(PLUGIN_NAME, CountingTransport)

TRANSPORTS = available_transports()
N_ITEMS = 40

pytestmark = pytest.mark.timeout(60)


def with_noise(x):
    # Randomness after the sharding point: per-worker seeds must make it reproducible.
    return (x, random.randrange(1_000_000))


def fail_at_7(x):
    if x == 7:
        raise ValueError(f"bad item {x}")
    return x


def big_item(x):
    return {"index": x, "tensor": torch.full((40_000,), float(x))}  # 160 KB: out-of-band buffers


class ReusedBuffer(IterDataPipe):
    """Yields (i, the same tensor refilled with i): a graph that writes one buffer for every
    item, faster than the trainer takes them (from 64 KiB: out of band, over TCP sent from the
    graph's memory itself, uncopied; from 256 KiB in shared memory for local workers)."""

    def __init__(self, nbytes: int = 300 * 1024):
        self.nbytes = nbytes

    def __iter__(self):
        buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        for index in range(N_ITEMS):
            buffer.fill_(index)
            yield index, buffer


#: Item sizes from in-band to far over a frame, odd ones among them: each kind of buffer a
#: transport moves (in band, copied out of band, in shared memory, lent uncopied over TCP).
SIZES = [1024, 16 << 10, (64 << 10) - 1, 64 << 10, (200 << 10) + 7, 256 << 10, (512 << 10) - 1, 512 << 10,
         (768 << 10) + 3, 1 << 20, 2 << 20]


def random_bytes(index: int) -> torch.Tensor:
    """Item ``index``'s tensor: ``SIZES[index]`` bytes drawn from a generator seeded with ``index``."""
    generator = torch.Generator().manual_seed(index)
    return torch.randint(0, 256, (SIZES[index],), dtype=torch.uint8, generator=generator)


def sized_item(index):
    return index, random_bytes(index)


def assert_bit_exact(items):
    assert [index for index, _ in items] == list(range(len(SIZES)))
    for index, tensor in items:
        assert torch.equal(tensor, random_bytes(index)), f"item of {SIZES[index]} bytes changed"


def assert_each_item_as_yielded(items):
    assert [index for index, _ in items] == list(range(N_ITEMS))
    assert [(int(t.min()), int(t.max())) for _, t in items] == [(index, index) for index in range(N_ITEMS)]


def shuffled():
    return IterableWrapper(range(N_ITEMS)).shuffle().sharding_filter().map(with_noise)


def dispatched():
    """The shuffle in the trainer's dispatcher, the rest (with its global RNG draws) on the workers."""
    return IterableWrapper(range(N_ITEMS)).shuffle().sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).map(with_noise)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``servers(transport)``: one CLI worker server per transport, started on first use."""
    started = {}
    plugin_log = tmp_path_factory.mktemp("plugin") / "plugin.log"

    def get(transport):
        if transport not in started:
            env = {LOG_ENV: str(plugin_log), "PYTHONPATH": os.pathsep.join([DIST_DIR, _pythonpath()])}
            started[transport] = start_server(
                tmp_path_factory.mktemp(transport), args=["--transport", transport], env=env
            )
        return started[transport]

    get.plugin_log = plugin_log
    yield get
    for server in started.values():
        server.stop()


def remote(server, transport, num_workers=2, **kwargs):
    """A reading service on ``server`` over ``transport``, with a generous connect timeout."""
    return shared_remote(server, num_workers, transport=transport, liveness=Liveness(connect_timeout=30), **kwargs)


_reference = {}


def socket_reference(servers):
    """The socket transport's epochs for seed 11: what every transport must reproduce."""
    if "order" not in _reference:
        _reference["order"] = run_epochs(shuffled(), remote(servers("socket"), "socket"), seed=11)
    return _reference["order"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_exactly_once_seeded_and_epochs_differ(servers, transport):
    server = servers(transport)
    first = run_epochs(shuffled(), remote(server, transport), seed=3)
    second = run_epochs(shuffled(), remote(server, transport), seed=3)
    assert first == second, "same seed, different run"
    for epoch in first:
        assert sorted(x for x, _ in epoch) == list(range(N_ITEMS)), "not every item exactly once"
    assert first[0] != first[1], "two epochs in the same order"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_same_order_as_every_other_transport(servers, transport):
    assert run_epochs(shuffled(), remote(servers(transport), transport), seed=11) == socket_reference(servers)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dynamic_distribution_gives_the_same_order_on_every_transport(servers, transport):
    """"dynamic" resequences by chunk: exactly once, and the socket transport's order for the seed."""
    got = run_epochs(shuffled(), remote(servers(transport), transport, distribution="dynamic"), seed=11)
    for epoch in got:
        assert sorted(x for x, _ in epoch) == list(range(N_ITEMS))
    if "dynamic" not in _reference:
        _reference["dynamic"] = run_epochs(shuffled(), remote(servers("socket"), "socket", distribution="dynamic"), seed=11)
    assert got == _reference["dynamic"]


@pytest.mark.parametrize("transport", ["socket", "torch_rpc"])  # the built-in ones (the suite's time budget)
def test_dynamic_with_a_dispatch_point_gives_the_same_order_on_every_transport(servers, transport):
    """A unit is one dispatched item, leased with its item: exactly once, and one order for the seed."""
    got = run_epochs(dispatched(), remote(servers(transport), transport, distribution="dynamic"), n_epochs=1, seed=11)
    assert sorted(x for x, _ in got[0]) == list(range(N_ITEMS))
    if transport == "socket":
        _reference["dispatched"] = got
    elif "dispatched" not in _reference:  # run on its own
        _reference["dispatched"] = run_epochs(
            dispatched(), remote(servers("socket"), "socket", distribution="dynamic"), n_epochs=1, seed=11
        )
    assert got == _reference["dispatched"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tensors_arrive_intact(servers, transport):
    dp = IterableWrapper(range(6)).sharding_filter().map(big_item)
    (epoch,) = run_epochs(dp, remote(servers(transport), transport), n_epochs=1)
    assert [item["index"] for item in epoch] == list(range(6))
    for item in epoch:
        assert torch.equal(item["tensor"], torch.full((40_000,), float(item["index"])))
    # every size bit-exact (one worker: each item its own frame or a frame of its own size)
    sizes = IterableWrapper(range(len(SIZES))).sharding_filter().map(sized_item)
    (epoch,) = run_epochs(sizes, remote(servers(transport), transport, num_workers=1), n_epochs=1)
    assert_bit_exact(epoch)
    # a graph that refills one buffer for every item: each arrives as it was yielded, not as
    # the buffer was when it was sent (prefetch=1: items wait for credit while it is refilled)
    # from 64 KiB (out of band) on: sent uncopied from the graph's own buffer where the
    # connection's send is synchronous (the socket transport's), each in a frame of its own
    small = (64 << 10, 128 << 10, 300 * 1024, 512 << 10)
    for nbytes in small + (2 << 20,) if transport == "socket" else (64 << 10, 300 * 1024):
        rs = remote(servers(transport), transport, num_workers=1, prefetch=1)
        with DataLoader2(ReusedBuffer(nbytes).sharding_filter(), reading_service=rs) as dl:
            assert_each_item_as_yielded(list(dl))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_remote_exception_keeps_its_type(servers, transport):
    server = servers(transport)
    dp = IterableWrapper(range(20)).sharding_filter().map(fail_at_7)
    with DataLoader2(dp, reading_service=remote(server, transport)) as dl:
        with pytest.raises(ValueError, match="bad item 7") as info:
            list(dl)
    message = str(info.value)
    assert server.address in message and "Traceback" in message


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_early_break_then_a_full_epoch(servers, transport):
    dp = IterableWrapper(range(N_ITEMS)).sharding_filter()
    with DataLoader2(dp, reading_service=remote(servers(transport), transport, prefetch=1)) as dl:
        for index, _ in enumerate(dl):
            if index == 3:
                break
        assert sorted(dl) == list(range(N_ITEMS))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shutdown_is_bounded_and_reaps_sessions(servers, transport):
    server = servers(transport)
    dl = DataLoader2(IterableWrapper(range(10_000)).sharding_filter(), reading_service=remote(server, transport, num_workers=3))
    try:
        iterator = iter(dl)
        next(iterator)
        # Sessions start the epoch as each is set up: the first item may come before the last fork.
        assert wait_until(lambda: len(children_of(server.pid)) >= 3, 10.0), "the server did not fork 3 sessions"
    finally:
        started = time.monotonic()
        dl.shutdown()
    assert time.monotonic() - started < 5.0
    assert wait_until(lambda: not children_of(server.pid), 5.0), "session processes left behind"
    assert server.proc.poll() is None, "the server must outlive its sessions"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_local_workers(transport, monkeypatch, tmp_path):
    # Local workers run `rpc-reading-worker --transport NAME` with the trainer's sys.path.
    monkeypatch.syspath_prepend(DIST_DIR)
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "plugin.log"))
    rs = RPCReadingService(num_workers=2, transport=transport, liveness=Liveness(connect_timeout=30))
    with DataLoader2(IterableWrapper(range(N_ITEMS)).sharding_filter(), reading_service=rs) as dl:
        assert sorted(dl) == list(range(N_ITEMS))
        server_pid = dl.reading_service._local_server.pid  # DataLoader2 works on a clone of rs
    assert wait_until(lambda: not process_alive(server_pid), 5.0), "local worker server left behind"
    if transport == PLUGIN_NAME:
        assert f"listen {server_pid}" in (tmp_path / "plugin.log").read_text()
    if transport == "socket":  # local workers hand buffers over in shared memory
        rs = RPCReadingService(num_workers=1, prefetch=1)
        with DataLoader2(ReusedBuffer().sharding_filter(), reading_service=rs) as dl:
            assert_each_item_as_yielded(list(dl))
        rs = RPCReadingService(num_workers=2)
        with DataLoader2(IterableWrapper(range(len(SIZES))).sharding_filter().map(sized_item), reading_service=rs) as dl:
            assert_bit_exact(list(dl))


def test_the_plugin_carried_the_traffic_on_both_sides(servers):
    server = servers(PLUGIN_NAME)
    sent, received = Counters.sent, Counters.received
    assert run_epochs(IterableWrapper(range(10)).sharding_filter(), remote(server, PLUGIN_NAME), n_epochs=1) == [list(range(10))]
    assert Counters.sent > sent and Counters.received > received  # this (trainer) side
    log = servers.plugin_log.read_text().split("\n")
    assert f"listen {server.pid}" in log  # the server found the plugin by its entry point
    assert any(line.startswith("accept ") for line in log)
