"""Task groups: every thread of the package has an owner that stops and joins it.

The group itself (stop and join, a stuck thread reported with its stack, a thread's exception
surfaced to its owner), and a source check that no module starts a thread outside one.
"""

from __future__ import annotations

import ast
import logging
import threading
import time
from pathlib import Path

import pytest

from rpc_reading_service.tasks import TaskGroup, package_threads

pytestmark = pytest.mark.timeout(20)

PACKAGE = Path(__file__).resolve().parent.parent / "rpc_reading_service"
#: Modules allowed to make threads or thread pools themselves, and why.
THREAD_MAKERS = {
    "rpc_reading_service/tasks.py": "the task group: every other thread is started through it",
}


def stuck_here(gate: threading.Event) -> None:
    gate.wait()


def test_stop_sets_the_event_and_joins_every_thread():
    group = TaskGroup("the test")
    seen = []
    for n in range(3):
        group.start(f"test-loop-{n}", lambda n=n: (group.stopping.wait(), seen.append(n)))
    assert len(group.threads) == 3 and all(t.name.startswith("rrs-test-loop-") for t in group.threads)
    assert group.stop(5.0) == []
    assert sorted(seen) == [0, 1, 2] and group.threads == [] and group.left_behind == 0


def test_a_stuck_thread_is_reported_with_its_stack_and_counted(caplog):
    gate = threading.Event()
    group = TaskGroup("worker 1 (host:1)")
    try:
        thread = group.start("test-stuck", stuck_here, gate)
        with caplog.at_level(logging.WARNING, logger="rpc_reading_service.tasks"):
            started = time.monotonic()
            assert group.stop(0.3) == [thread]
        assert time.monotonic() - started < 2.0
        assert group.left_behind == 1
        message = caplog.text
        assert "rrs-test-stuck of worker 1 (host:1) did not end within 0.3 s" in message, message
        assert "in stuck_here" in message and "gate.wait()" in message, message
    finally:
        gate.set()
        assert group.join(5.0) == []


def test_an_exception_in_a_thread_is_surfaced_to_its_owner(caplog):
    def boom() -> None:
        raise ValueError("boom in a thread")

    group = TaskGroup("epoch 2")
    with caplog.at_level(logging.ERROR, logger="rpc_reading_service.tasks"):
        group.start("test-boom", boom)
        assert group.stop(5.0) == []
    assert "thread rrs-test-boom of epoch 2 failed" in caplog.text
    assert [str(e) for e in group.errors] == ["boom in a thread"]
    with pytest.raises(ValueError, match="boom in a thread"):
        group.raise_errors()
    group.raise_errors()  # raised once


def test_the_context_manager_stops_joins_and_raises_a_thread_error():
    with pytest.raises(RuntimeError, match="late failure"):
        with TaskGroup("the test") as group:
            group.start("test-late", lambda: (group.stopping.wait(), (_ for _ in ()).throw(RuntimeError("late failure"))))
    assert group.threads == []


def test_a_thread_does_not_join_itself():
    group = TaskGroup()
    result = []
    group.start("test-self", lambda: result.append(group.stop(1.0)))
    assert group.join(5.0) == [] and result == [[]]


def test_map_runs_every_item_in_bounded_threads_and_raises_the_first_failure():
    group = TaskGroup("the test")
    running, most = [0], [0]
    lock = threading.Lock()

    def square(x: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        if x == 7:
            raise KeyError(7)
        return x * x

    assert group.map("test-map", square, range(7), width=3) == [x * x for x in range(7)]
    assert most[0] <= 3
    with pytest.raises(KeyError):
        group.map("test-map", square, range(10), width=4)
    assert group.threads == []


def test_start_each_runs_no_item_once_stopping():
    group = TaskGroup("the test")
    gate, done = threading.Event(), []
    group.start_each("test-each", lambda x: (gate.wait(), done.append(x)), range(10), width=2)
    group.stopping.set()
    gate.set()
    assert group.join(5.0) == []
    assert len(done) == 2  # the two items already started


def test_package_threads_are_the_ones_named_rrs():
    group = TaskGroup()
    gate = threading.Event()
    thread = group.start("test-named", stuck_here, gate)
    try:
        assert thread in package_threads() and threading.main_thread() not in package_threads()
    finally:
        gate.set()
        group.join(5.0)


def thread_makers():
    """``path:line`` of every ``threading.Thread(...)``, ``threading.Timer(...)`` and thread pool made
    in the package, outside the allowed modules."""
    names = {"Thread", "Timer", "ThreadPoolExecutor", "ThreadPool", "start_new_thread"}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE.parent))
        if where in THREAD_MAKERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), where)):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in names:
                    yield f"{where}:{node.lineno} {name}"
            elif isinstance(node, ast.ClassDef):
                for base in node.bases:
                    name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                    if name == "Thread":
                        yield f"{where}:{node.lineno} a Thread subclass"


def test_threads_are_made_only_in_task_groups():
    found = list(thread_makers())
    assert found == [], "threads started outside rpc_reading_service.tasks.TaskGroup:\n" + "\n".join(found)


# -- a worker session joins its producers ----------------------------------------------------------
#: Released by the test: item 2 of the first epoch waits for it.
GATE = threading.Event()
#: (thread, other producer threads alive) for every item the graph makes.
MADE: list = []


def recorded(x: int) -> int:
    """``x``, recording which producer made it and which other producers were alive; item 2 of
    epoch 1 waits for GATE (a producer stuck in user code)."""
    me = threading.current_thread()
    others = [t.name for t in threading.enumerate() if "producer" in t.name and t is not me and t.is_alive()]
    MADE.append((me.name, others))
    if x == 2 and me.name.split(" ")[0] == "rrs-producer-1":
        GATE.wait(10)
    return x


@pytest.fixture
def session_pair():
    """A trainer's channel and a real WorkerSession serving it in a thread (in-memory connection)."""
    import queue

    from memory_connection import connection_pair
    from rpc_reading_service.serialization import dumps_graph
    from rpc_reading_service.trainer.channel import WorkerChannel
    from rpc_reading_service.worker.session import WorkerSession
    from torchdata.datapipes.iter import IterableWrapper

    GATE.clear()
    MADE.clear()
    trainer_conn, worker_conn = connection_pair()
    session = WorkerSession(worker_conn, server_address="memory")
    group = TaskGroup("the test")
    runner = group.start("test-session", session.run)
    channel = WorkerChannel(trainer_conn, 0, 0.1, 5.0)
    graph = dumps_graph((IterableWrapper(range(6)).sharding_filter().map(recorded), None, None))
    options = {"heartbeat_interval": 0.1, "peer_timeout": 5.0, "batch_max_items": 1, "linger": 0.0}
    channel.setup({"graph": graph, "worker_rank": 0, "num_workers": 1, "options": options}, timeout=5.0)
    channel.start_receiver(queue.SimpleQueue())
    try:
        yield channel, session
    finally:
        GATE.set()
        channel.close(timeout=2.0)
        worker_conn.close()
        assert group.join(5.0) == [] and not runner.is_alive(), "the worker session did not end"


def test_a_worker_session_joins_every_earlier_producer_before_the_next_epoch_produces(session_pair):
    """Epoch 1's producer is stuck in an item; epochs 2 and 3 start: epoch 3's producer makes
    nothing while epoch 1's is alive (a graph serves one iterator at a time), then every item."""
    from _server_helpers import wait_until
    from rpc_reading_service.policies.merge import EpochProgress, iterate_in_order

    channel, session = session_pair
    channel.start_epoch(1, seed=1, global_worker_id=0, credits=8)
    assert wait_until(lambda: len(MADE) == 3, 5.0), MADE  # epoch 1 waits in its item 2
    channel.start_epoch(2, seed=2, global_worker_id=0, credits=8)
    channel.start_epoch(3, seed=3, global_worker_id=0, credits=8)
    # epoch 2's producer gives up (superseded); epoch 3's waits for epoch 1's
    assert not wait_until(lambda: len(MADE) > 3, 1.0), MADE
    GATE.set()
    assert sorted(iterate_in_order([channel], EpochProgress(3, [0]))) == list(range(6))
    overlapping = [(name, others) for name, others in MADE if others]
    assert overlapping == [], overlapping
    assert {name.split(" ")[0] for name, _ in MADE} == {"rrs-producer-1", "rrs-producer-3"}


def test_a_worker_session_joins_its_threads_when_it_ends(session_pair, caplog):
    """The session's end joins its sender and its producers; one stuck in an item is reported
    with its stack (and counted), not left in silence."""
    channel, session = session_pair
    channel.start_epoch(1, seed=1, global_worker_id=0, credits=8)
    from _server_helpers import wait_until

    assert wait_until(lambda: len(MADE) >= 3, 5.0), MADE
    with caplog.at_level(logging.WARNING, logger="rpc_reading_service.tasks"):
        channel.close(timeout=2.0)
        assert wait_until(lambda: session.producers.left_behind == 1, 10.0)
    assert "rrs-producer-1 for" in caplog.text and "in recorded" in caplog.text, caplog.text
    GATE.set()
    assert wait_until(lambda: not [t for t in package_threads() if "trainer" in t.name or " for " in t.name], 5.0)


# -- the trainer joins what it started -------------------------------------------------------------
def _dispatching_loader(n: int):
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

    from rpc_reading_service import RPCReadingService

    dp = IterableWrapper(range(n)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    return DataLoader2(dp, reading_service=RPCReadingService(num_workers=2, item_timeout=30.0))


def _names() -> list:
    return sorted(thread.name for thread in package_threads())


@pytest.mark.timeout(60)
def test_an_abandoned_epochs_threads_are_joined_when_the_next_starts_and_none_outlive_the_loader():
    """Real worker processes: the dispatching threads of epoch 1 (abandoned half-read) are gone as
    soon as epoch 2 started, and no thread of the package is left once the loader shut down."""
    assert _names() == []
    dl = _dispatching_loader(40)
    try:
        it = iter(dl)
        assert len([next(it) for _ in range(5)]) == 5
        assert "rrs-dispatch-send-1" in _names()  # (the dispatcher may have dealt every item already)
        it = iter(dl)  # epoch 1 is abandoned
        next(it)
        assert [n for n in _names() if n.startswith("rrs-dispatch") and n.endswith("-1")] == []
        assert len(list(it)) == 39
    finally:
        dl.shutdown()
    assert _names() == []


@pytest.mark.timeout(30)
def test_a_stopped_worker_server_ends_and_joins_its_thread_sessions():
    """A server in thread mode stops its sessions (their connections close) and joins them
    before ``serve_forever`` returns, as it ends its forked sessions."""
    from _server_helpers import wait_until
    from rpc_reading_service.transports import create_transport
    from rpc_reading_service.worker.server import WorkerServer

    server = WorkerServer(host="127.0.0.1", port=0, auth_key=b"", session_mode="thread", drain_timeout=0)
    group = TaskGroup("the test")
    serving = group.start("test-serve", server.serve_forever)
    conn = create_transport("socket").connect(server.address, b"", 10.0)  # no SETUP: it waits for one
    try:
        assert wait_until(lambda: [n for n in _names() if n.startswith("rrs-session-")], 10.0), _names()
        server.stop()
        serving.join(15.0)
        assert not serving.is_alive()
        assert [n for n in _names() if n.startswith("rrs-session-")] == []
    finally:
        conn.close()
        server.stop()
        assert group.join(10.0) == []
