"""The worker session under hostile graphs and mismatched setups.

Real worker processes (local fork/spawn workers and ``rpc-reading-worker`` servers):

- an exception that cannot be printed, pickled or rebuilt still ends the epoch with an
  error naming the worker and the exception type, at once;
- items whose class is defined in the training script (a real ``__main__`` file) or in a
  ``pickle_by_value`` module reach the trainer as instances of the trainer's own class,
  on fork, spawn and CLI workers and over both transports;
- ``item_timeout``: an item that never comes ends the session with the item's position and
  the worker's stack; with ``on_worker_failure="reassign"`` the shard is replayed;
- a module missing on the worker, and a trainer of another transport, are explained.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import resource
import sys
import textwrap
import threading
import time

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from _server_helpers import python_run, wait_until
from conftest import _pythonpath, run_epochs
from rpc_reading_service import (
    ConfigurationError,
    ItemTimeoutError,
    Liveness,
    Reassign,
    RPCReadingService,
    WorkerLostError,
    WorkerStartupError,
)

N = 20


# -- graph functions (module level: servers import them by reference) -------------------------
class UnprintableError(ValueError):
    """str() and repr() of it raise."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ is broken")


class UnpicklableUnprintableError(UnprintableError):
    """Cannot be printed, and its pickle cannot be rebuilt (its constructor needs two arguments)."""

    def __init__(self, first, second):
        super().__init__(first)
        self.lock = threading.Lock()  # not even cloudpickle pickles a lock


def raise_unprintable_at_3(x):
    if x == 3:
        raise UnprintableError("hidden")
    return x


def raise_unpicklable_at_3(x):
    if x == 3:
        raise UnpicklableUnprintableError("a", "b")
    return x


def block_forever_at_5(x):
    if x == 5:
        threading.Event().wait()
    return x


class BlocksWhenPickled:
    """An item whose pickling never ends."""

    def __reduce__(self):
        threading.Event().wait()


def unpicklable_at_2(x):
    return BlocksWhenPickled() if x == 2 else x


def hold_the_interpreter_lock_at_3(x):
    if x == 3:
        ctypes.PyDLL(None).sleep(60)  # C code that keeps the interpreter lock: no thread of the process runs
    return x


def segfault_at_3(x):
    if x == 3:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return x


def block_at_5_in_first_session(marker, x):
    if x == 5 and not os.path.exists(marker):
        open(marker, "w").close()
        threading.Event().wait()
    return x


# -- bug 3: exceptions that break the error path ----------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "fn, type_name",
    [(raise_unprintable_at_3, "UnprintableError"), (raise_unpicklable_at_3, "UnpicklableUnprintableError")],
)
def test_an_unprintable_exception_reaches_the_trainer_at_once(fn, type_name):
    rs = RPCReadingService(num_workers=2, timeout=30)
    with DataLoader2(IterableWrapper(range(N)).sharding_filter().map(fn), reading_service=rs) as dl:
        it = iter(dl)
        next(it)  # the workers are set up and streaming
        started = time.monotonic()
        with pytest.raises(Exception) as caught:
            list(it)
        elapsed = time.monotonic() - started
    text = str(caught.value)
    assert f"Caught {type_name} in worker process 1 (" in text
    assert f"<unprintable {type_name} object>" in text or "<exception str() failed>" in text
    assert elapsed < 5.0, f"the error took {elapsed:.1f} s"  # at once, not by the 30 s timeout


@pytest.mark.timeout(30)
def test_an_unprintable_exception_on_a_server_leaves_it_serving(worker_server):
    rs = RPCReadingService(num_workers=1, workers=[worker_server.address], auth_key=worker_server.key)
    with pytest.raises(Exception, match="Caught UnprintableError in worker process 0"):
        run_epochs(IterableWrapper(range(N)).sharding_filter().map(raise_unprintable_at_3), rs, n_epochs=1)
    rs = RPCReadingService(num_workers=1, workers=[worker_server.address], auth_key=worker_server.key)
    assert run_epochs(IterableWrapper(range(4)).sharding_filter(), rs, n_epochs=1) == [[0, 1, 2, 3]]


# -- bug 5: item classes defined in the training script -----------------------------------------
POINT_MODULE = '''
class Point:
    """A class from a module shipped with pickle_by_value."""

    def __init__(self, x):
        self.x = x
'''

TRAINING_SCRIPT = """
import json
import sys
from dataclasses import dataclass

from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import point_module
from rpc_reading_service import Liveness, LocalWorkers, RPCReadingService


@dataclass
class Sample:
    index: int
    point: point_module.Point


def make(i):
    return Sample(i, point_module.Point(i * i))


def items_from(kind, transport, address=None, key=None):
    options = dict(transport=transport, pickle_by_value=[point_module], liveness=Liveness(connect_timeout=30), num_workers=2)
    if kind == "cli":
        options.update(workers=[address], auth_key=key)
    else:
        options.update(workers=LocalWorkers(start_method=kind))
    graph = IterableWrapper(range(10)).sharding_filter().map(make)
    with DataLoader2(graph, reading_service=RPCReadingService(**options)) as dl:
        return list(dl)


if __name__ == "__main__":
    transport, kinds = sys.argv[1], sys.argv[2].split(",")
    for kind in kinds:
        try:
            items = items_from(kind, transport, *sys.argv[3:])
            result = {
                "own_classes": all(type(s) is Sample and type(s.point) is point_module.Point for s in items),
                "values": [[s.index, s.point.x] for s in items],
            }
        except Exception as exc:
            result = {"error": repr(exc)}
        print(kind, json.dumps(result), flush=True)
"""


def run_script(directory, args, timeout=40.0):
    """Run ``directory/train.py *args`` as a real ``__main__`` script (forked from the tests'
    forkserver, torch imported already); reaped on any outcome."""
    env = dict(os.environ, PYTHONPATH=_pythonpath(), PYTHONWARNINGS="ignore")
    done = python_run(["train.py", *args], env, str(directory), timeout)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport, kinds", [("socket", ["fork", "spawn", "cli"]), ("torch_rpc", ["spawn"])])
def test_items_of_script_classes_arrive_as_the_trainers_own_classes(tmp_path, fresh_server, transport, kinds):
    trainer = tmp_path / "trainer"  # not on any worker's sys.path
    trainer.mkdir()
    (trainer / "point_module.py").write_text(POINT_MODULE)
    (trainer / "train.py").write_text(TRAINING_SCRIPT)
    args = [transport, ",".join(kinds)]
    if "cli" in kinds:
        server = fresh_server()
        args += [server.address, server.key]
    code, out, err = run_script(trainer, args)
    assert code == 0, err[-3000:]
    results = dict(line.split(" ", 1) for line in out.strip().splitlines())
    expected = {"own_classes": True, "values": [[i, i * i] for i in range(10)]}
    assert {kind: json.loads(results.get(kind, "null")) for kind in kinds} == {kind: expected for kind in kinds}


# -- item_timeout ----------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_a_stuck_item_is_reported_with_its_position_and_the_workers_stack(fresh_server):
    server = fresh_server()
    rs = RPCReadingService(
        num_workers=1, workers=[server.address], auth_key=server.key, item_timeout=1.0, timeout=30
    )
    received = []
    with DataLoader2(IterableWrapper(range(N)).sharding_filter().map(block_forever_at_5), reading_service=rs) as dl:
        started = time.monotonic()
        with pytest.raises(ItemTimeoutError) as caught:
            for item in dl:
                received.append(item)
        elapsed = time.monotonic() - started
    error = caught.value
    assert received == [0, 1, 2, 3, 4]
    assert error.rank == 0 and error.position == 5 and error.address == server.address
    assert "block_forever_at_5" in error.stack and "threading.Event().wait()" in error.stack
    assert "item 5 of its shard" in str(error) and f"worker 0 ({server.address})" in str(error)
    assert "block_forever_at_5" in str(error)
    assert elapsed < 6.0, f"detected after {elapsed:.1f} s"
    # The session process ends although its producer thread is stuck for good; the server serves on.
    assert wait_until(lambda: not server.session_pids(), 5.0), server.session_pids()
    assert "item 5 of the shard took more than 1.0 s" in server.stderr()
    rs = RPCReadingService(num_workers=1, workers=[server.address], auth_key=server.key)
    assert run_epochs(IterableWrapper(range(4)).sharding_filter(), rs, n_epochs=1) == [[0, 1, 2, 3]]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pause", [0.0, 2.0], ids=["next-epoch-at-once", "next-epoch-after-the-timeout"])
def test_a_stuck_item_of_an_abandoned_epoch_is_reported_in_the_next_one(pause):
    rs = RPCReadingService(num_workers=1, item_timeout=1.0, timeout=30)
    with DataLoader2(IterableWrapper(range(N)).sharding_filter().map(block_forever_at_5), reading_service=rs) as dl:
        for index, _item in enumerate(dl):
            if index == 1:
                stuck_epoch = dl.reading_service.stats().epoch
                break  # the epoch is abandoned; its producer goes on to item 5 and sticks there
        time.sleep(pause)  # the worker's watchdog fires before (or after) the next epoch starts
        started = time.monotonic()
        with pytest.raises(ItemTimeoutError, match=f"item 5 of its shard in epoch {stuck_epoch} and") as caught:
            list(dl)
        assert time.monotonic() - started < 6.0
    assert stuck_epoch == 0  # the message counts epochs as stats() does
    assert "block_forever_at_5" in caught.value.stack


@pytest.mark.timeout(40)
def test_a_stuck_item_that_reassign_gives_up_on_stays_an_item_timeout_naming_the_users_file():
    """The graph's lambda travels by value (cloudpickle): the stack still names this file. Each
    replacement sticks at the same item: after max_reassignments the error keeps its type."""
    graph = IterableWrapper(range(N)).sharding_filter().map(lambda x: threading.Event().wait() if x == 3 else x)
    rs = RPCReadingService(num_workers=1, item_timeout=1.0, timeout=30, on_worker_failure=Reassign(max_reassignments=1))
    with pytest.raises(ItemTimeoutError, match="(?s)item 3 of its shard in epoch 0 .*gave up") as caught:
        run_epochs(graph, rs, n_epochs=1)
    assert caught.value.position == 3 and caught.value.rank == 0
    assert f'File "{__file__}", line' in caught.value.stack and "<dynamic-code>" not in caught.value.stack


@pytest.mark.timeout(60)
def test_an_item_stuck_in_c_code_holding_the_interpreter_lock_ends_its_session_with_its_stack_logged(fresh_server):
    """No thread of the session runs (no heartbeats, no item_timeout check): faulthandler's watchdog
    ends the process past item_timeout, the server logs the stacks, and the trainer hears of the end
    then (not after its timeout)."""
    server = fresh_server()
    rs = RPCReadingService(num_workers=1, workers=[server.address], auth_key=server.key, item_timeout=1.0, timeout=30)
    started = time.monotonic()
    with pytest.raises(WorkerLostError, match="interpreter lock .* the worker server's log shows where"):
        run_epochs(IterableWrapper(range(N)).sharding_filter().map(hold_the_interpreter_lock_at_3), rs, n_epochs=1)
    assert time.monotonic() - started < 15  # about item_timeout + 2 s; it was the trainer's timeout (30 s)
    assert wait_until(lambda: "C code held its interpreter lock" in server.stderr(), 5.0), server.stderr()
    stderr = server.stderr()
    assert f'File "{__file__}", line' in stderr and "in hold_the_interpreter_lock_at_3" in stderr
    assert wait_until(lambda: not server.session_pids(), 5.0), server.session_pids()


@pytest.mark.timeout(30)
def test_a_session_that_dies_of_a_signal_is_logged_by_its_server_with_its_stacks(worker_server):
    worker_server.wait_idle()
    fds = lambda: len(os.listdir(f"/proc/{worker_server.proc.pid}/fd"))  # noqa: E731
    before = fds()
    rs = RPCReadingService(num_workers=1, workers=[worker_server.address], auth_key=worker_server.key, timeout=20)
    with pytest.raises(WorkerLostError):
        run_epochs(IterableWrapper(range(N)).sharding_filter().map(segfault_at_3), rs, n_epochs=1)
    assert wait_until(lambda: "(SIGSEGV). Its threads were here:" in worker_server.stderr(), 5.0), worker_server.stderr()
    logged = worker_server.stderr().split("(SIGSEGV). Its threads were here:")[1]
    assert "Segmentation fault" in logged and "in segfault_at_3" in logged
    assert wait_until(lambda: fds() <= before, 5.0), (fds(), before)  # the session's pipe closed too


@pytest.mark.timeout(30)
def test_an_item_whose_pickling_never_ends_is_a_stuck_item():
    rs = RPCReadingService(num_workers=1, item_timeout=1.0, timeout=30)
    with pytest.raises(ItemTimeoutError, match="item 2 of its shard") as caught:
        run_epochs(IterableWrapper(range(N)).sharding_filter().map(unpicklable_at_2), rs, n_epochs=1)
    assert "in __reduce__" in caught.value.stack and "encode" in caught.value.stack


@pytest.mark.timeout(30)
def test_a_stuck_item_is_replayed_elsewhere_with_reassign(tmp_path):
    marker = str(tmp_path / "blocked-once")
    graph = IterableWrapper(range(N)).sharding_filter().map(functools.partial(block_at_5_in_first_session, marker))
    rs = RPCReadingService(num_workers=2, item_timeout=1.0, on_worker_failure="reassign", timeout=30)
    assert run_epochs(graph, rs, n_epochs=2) == [list(range(N)), list(range(N))]
    assert os.path.exists(marker)


@pytest.mark.timeout(30)
def test_waiting_for_a_slow_trainer_is_not_a_stuck_item():
    # 5000 tiny items fill more than two packed frames (1024 items each): with one credit
    # the producer waits in the outbox for as long as the trainer sleeps, past item_timeout.
    rs = RPCReadingService(num_workers=1, item_timeout=0.5, prefetch=1)
    with DataLoader2(IterableWrapper(range(5000)).sharding_filter(), reading_service=rs) as dl:
        received = []
        for item in dl:
            if not received:
                time.sleep(1.0)  # 2x item_timeout: a check that counted this wait would fire in it
            received.append(item)
    assert received == list(range(5000))


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "1"])
def test_item_timeout_must_be_a_positive_number(value):
    with pytest.raises(ConfigurationError, match="item_timeout"):
        RPCReadingService(num_workers=1, item_timeout=value)


# -- messages that teach ------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_a_module_missing_on_the_worker_is_named_with_the_fix(tmp_path, worker_server, monkeypatch):
    (tmp_path / "trainer_only_module.py").write_text("def double(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import trainer_only_module

    try:
        graph = IterableWrapper(range(4)).sharding_filter().map(trainer_only_module.double)
        remote = dict(num_workers=1, workers=[worker_server.address], auth_key=worker_server.key)
        with pytest.raises(WorkerStartupError) as caught:
            run_epochs(graph, RPCReadingService(**remote), n_epochs=1)
        text = str(caught.value)
        assert "ModuleNotFoundError" in text and "'trainer_only_module'" in text
        assert "pickle_by_value=[trainer_only_module]" in text and "install" in text
        # ... and the suggested fix works.
        rs = RPCReadingService(pickle_by_value=[trainer_only_module], **remote)
        assert run_epochs(graph, rs, n_epochs=1) == [[0, 2, 4, 6]]
    finally:
        sys.modules.pop("trainer_only_module", None)


@pytest.mark.timeout(60)
def test_a_socket_worker_logs_a_torch_rpc_trainer_as_a_transport_mismatch(fresh_server):
    server = fresh_server()
    rs = RPCReadingService(
        num_workers=1,
        workers=[server.address],
        transport="torch_rpc",
        liveness=Liveness(connect_timeout=20),
        auth_key=server.key,
    )
    with pytest.raises(ConfigurationError, match="does not speak torch_rpc"):
        run_epochs(IterableWrapper(range(4)).sharding_filter(), rs, n_epochs=1)
    assert wait_until(lambda: "uses transport 'torch_rpc'" in server.stderr(), 5.0), server.stderr()
    log = server.stderr()
    assert "--transport torch_rpc" in log and "KeyError" not in log
