"""``RPCReadingService(on_worker_failure=...)`` against real faults: exactly-once recovery.

A worker's session process is SIGKILLed (dies) or SIGSTOPped (hangs) at several points of
an epoch, and the epoch is compared with a fault-free run of the same seeded graph:

- ``"raise"``: :class:`WorkerLostError` naming the lost worker's rank and address, within
  the ``timeout`` bound, after a prefix of the fault-free epoch.
- ``"reassign"``: the lost worker's shard is replayed on a new session from the same seed,
  skipping what the trainer already took; the epoch yields exactly the fault-free items (in
  the same order with ``in_order=True``), including the randomness after the sharding
  point, and so does the next epoch.

The graph (three local workers) has uneven shards so that every kill point exists:
worker 0 and 1 read 100 items each, worker 2 only 10 (``worker_init_fn``). Worker 1's graph
holds (stops until the test releases it, at the strike) where the kill point needs it to be
still at work: after its last item before ending its shard (the trainer can hold all of its
items while its END_OF_SHARD is still to come), or mid-shard. Without the hold, on a loaded
machine its small items, packed, run far ahead of the trainer: it could have sent its whole
shard and its END before the strike.

Also: remote servers (a session replaced on the same server; a whole server killed and
its shards replayed on the other one), and a graph that kills its process at the same
item every time (gives up after ``max_reassignments``).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
from _server_helpers import FileGate, process_halted, wait_dead, wait_until
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from rpc_reading_service import Liveness, Reassign, RPCReadingService, WorkerLostError

TIMEOUT = 2.0  # the trainer's bound for a silent (stopped) worker
HEARTBEAT = 0.5
SEED = 5
N = 300
SHARDS = [100, 100, 10]  # items per worker rank (worker 2's shard is cut short)
HOLD_WAIT = 20.0  # seconds a held worker waits for its release at most (then it fails)
EPOCH_ITEMS = sum(SHARDS)


# -- graph functions (module level: remote servers import them by reference) ------------------
def tag(x: int) -> Tuple[int, int]:
    """Some work, and randomness after the sharding point (per-worker seeds)."""
    time.sleep(0.001)
    return x, random.randint(0, 10**9)


class Hold(FileGate):
    """Where worker 1 stops (before its item ``before``; its shard's length: before ending it)
    until the file ``release`` exists. The test closes it before an epoch and opens it when it strikes."""

    def __init__(self, release: Path, before: int):
        super().__init__(release, HOLD_WAIT)
        self.before = before


class HoldAt(IterDataPipe):
    """Yields its source's items, stopping at ``hold`` (before item ``hold.before``, or at the end)."""

    def __init__(self, datapipe: IterDataPipe, hold: Hold):
        self.datapipe, self.hold = datapipe, hold

    def __iter__(self) -> Iterator[Any]:
        count = 0
        for item in self.datapipe:
            if count == self.hold.before:
                self.hold.wait()
            yield item
            count += 1
        if count <= self.hold.before:
            self.hold.wait()


class UnevenShards:
    """``worker_init_fn``: worker 2's shard is cut short; worker 1 stops at ``hold`` (if any)."""

    def __init__(self, hold: Optional[Hold] = None):
        self.hold = hold

    def __call__(self, datapipe: IterDataPipe, worker_info: Any) -> IterDataPipe:
        if worker_info.worker_id == 1 and self.hold is not None:
            return HoldAt(datapipe, self.hold)
        if worker_info.worker_id == 2:
            return datapipe.header(SHARDS[2])
        return datapipe


class HoldWorker:
    """``worker_init_fn``: worker ``worker_id`` stops at ``hold``; the others run as they are."""

    def __init__(self, hold: Hold, worker_id: int):
        self.hold, self.worker_id = hold, worker_id

    def __call__(self, datapipe: IterDataPipe, worker_info: Any) -> IterDataPipe:
        return HoldAt(datapipe, self.hold) if worker_info.worker_id == self.worker_id else datapipe


def exit_at(k: int, x: int) -> int:
    """Kill the process at item ``k``, every time (a poison item)."""
    if x == k:
        os._exit(3)
    return x


def _graph(n: int = N) -> IterDataPipe:
    return IterableWrapper(range(n)).shuffle().sharding_filter().map(tag)


# -- helpers --------------------------------------------------------------------------------
def _local_loader(hold: Optional[Hold] = None, **kwargs: Any) -> DataLoader2:
    service = RPCReadingService(
        num_workers=3,
        worker_init_fn=UnevenShards(hold),
        timeout=TIMEOUT,
        liveness=Liveness(heartbeat_interval=HEARTBEAT),
        **kwargs,
    )
    dl = DataLoader2(_graph(), reading_service=service)
    dl.seed(SEED)
    return dl


def _pids(dl: DataLoader2) -> List[Optional[int]]:
    return [worker.pid for worker in dl.reading_service.stats().workers]


def _consumed(dl: DataLoader2) -> List[int]:
    return [worker.items_consumed for worker in dl.reading_service.stats().workers]


def _shard_ended(dl: DataLoader2, rank: int) -> bool:
    """Whether the trainer has received worker ``rank``'s END_OF_SHARD (its last item, taken
    as completed, may come before it: the END follows after the batching linger)."""
    from rpc_reading_service.protocol import SessionState

    return dl.reading_service._engine.channels[rank].protocol.state is SessionState.READY


def _assert_exactly_once(epoch: List[Any], reference: List[Any], in_order: bool) -> None:
    ids = [x for x, _ in epoch]
    assert len(ids) == len(set(ids)), "an item arrived twice"
    assert sorted(epoch) == sorted(reference), "items lost, duplicated or with other random values"
    if in_order:
        assert epoch == reference


class _Victims:
    """Signals session processes and ends them in cleanup (a stopped one too)."""

    def __init__(self) -> None:
        self.pids: List[int] = []

    def hit(self, pid: Optional[int], fault: str) -> float:
        """Signal ``pid`` and return the time, once none of its threads runs any more (until then
        a thread the signal has not taken yet could pass the hold and send more items)."""
        assert pid is not None and pid != os.getpid()
        self.pids.append(pid)
        os.kill(pid, getattr(signal, fault))
        at = time.monotonic()
        assert wait_until(lambda: process_halted(pid), 5), f"{fault} did not halt process {pid}"
        return at

    def cleanup(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)  # also ends a stopped process
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def reference() -> Dict[str, Any]:
    """Two fault-free epochs of the local graph, and the shard sizes they had."""
    dl = _local_loader()
    try:
        epochs = [list(dl)]
        consumed = _consumed(dl)
        epochs.append(list(dl))
    finally:
        dl.shutdown()
    assert consumed == SHARDS, consumed
    assert epochs[0] != epochs[1]  # a fresh seed every epoch
    for epoch in epochs:
        assert len({x for x, _ in epoch}) == len(epoch) == EPOCH_ITEMS
    return {"epochs": epochs}


# Kill points: (victim rank, when to strike given the per-rank consumed counts (None: right
# after iter(dl), before the first item), the item worker 1 holds before until the strike).
POINTS: Dict[str, Tuple[int, Optional[Callable[[List[int]], bool]], Optional[int]]] = {
    "before-first-item": (1, None, SHARDS[1]),
    "mid-epoch": (1, lambda consumed: consumed[1] == 40, 50),
    # The trainer took worker 1's last item; its END_OF_SHARD is held back.
    "end-of-shard": (1, lambda consumed: consumed[1] == SHARDS[1], SHARDS[1]),
    # Worker 2's short shard is over (END received) while the others still stream.
    "after-end-of-shard": (2, lambda consumed: consumed[2] == SHARDS[2] and sum(consumed) >= 40, None),
}


def _hold(point: str, directory: Path) -> Optional[Hold]:
    """Worker 1's hold for kill point ``point`` (its release file in ``directory``)."""
    before = POINTS[point][2]
    return None if before is None else Hold(directory / "release", before)
FAULTS = ["SIGKILL", "SIGSTOP"]


class _Strike:
    """What :func:`_epoch_with_fault` saw: the epoch's items, its error, and the victim."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.items: List[Any] = []
        self.error: Optional[WorkerLostError] = None
        self.at = 0.0  # time.monotonic() of the signal
        self.error_at = 0.0
        self.pids: List[Optional[int]] = []  # every worker's session pid when it struck
        self.server_pid: Optional[int] = None  # the local worker server's
        self.addresses: List[str] = []  # every worker's address
        self.consumed: List[int] = []  # every worker's items the trainer took when it struck

    @property
    def victim(self) -> Optional[int]:
        return self.pids[self.rank] if self.pids else None


def _epoch_with_fault(dl: DataLoader2, point: str, fault: str, victims: _Victims, hold: Optional[Hold]) -> _Strike:
    """One epoch, signalling worker ``rank``'s session process at ``point`` (``hold``: worker 1's, opened then)."""
    rank, when, _ = POINTS[point]
    strike = _Strike(rank)
    if hold is not None:
        hold.close()

    def hit() -> None:
        # Sessions start as each is set up: with first-ready delivery the kill point can come
        # before another worker's session is up. Its pid is part of what the test compares.
        assert wait_until(lambda: None not in _pids(dl), 10), "the sessions did not all set up"
        strike.pids = _pids(dl)
        strike.consumed = _consumed(dl)
        strike.at = victims.hit(strike.victim, fault)
        if hold is not None:
            hold.open()

    it = iter(dl)
    strike.server_pid = dl.reading_service._local_server.pid
    strike.addresses = dl.reading_service.worker_addresses
    try:
        if when is None:
            # iter() returns while sessions still set up (each starts the epoch once it is set up):
            # strike once every session runs, before the first item is taken.
            hit()
        for item in it:
            strike.items.append(item)
            if not strike.pids and when(_consumed(dl)) and (point != "after-end-of-shard" or _shard_ended(dl, rank)):
                hit()
    except WorkerLostError as exc:
        strike.error, strike.error_at = exc, time.monotonic()
    assert strike.pids, f"the kill point {point!r} never came"
    return strike


def _assert_lost_error(error: BaseException, rank: int, address: str, fault: str, elapsed: float) -> None:
    assert isinstance(error, WorkerLostError)
    assert error.rank == rank and error.address == address
    assert f"worker {rank} ({address})" in str(error)
    bound = 1.5 if fault == "SIGKILL" else TIMEOUT + HEARTBEAT + 1.5
    assert elapsed < bound, f"lost worker reported after {elapsed:.1f} s (bound {bound} s)"
    if fault == "SIGSTOP":
        assert "sent nothing" in str(error)


# -- local workers: "raise" ---------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("point", list(POINTS))
def test_raise_names_the_lost_worker_within_the_bound(reference, point, fault, tmp_path):
    hold = _hold(point, tmp_path)
    dl = _local_loader(hold, on_worker_failure="raise")
    victims = _Victims()
    try:
        strike = _epoch_with_fault(dl, point, fault, victims, hold)
        items, error, rank = strike.items, strike.error, strike.rank
        server_pid = strike.server_pid
        address = strike.addresses[rank]
        pids = list(strike.pids)
        if error is None:
            # Lost after its shard was complete (END received): this epoch is whole, and the
            # loss is reported at the latest when the next epoch needs the worker.
            assert point == "after-end-of-shard", (strike.consumed, len(items))
            _assert_exactly_once(items, reference["epochs"][0], in_order=True)
            with pytest.raises(WorkerLostError) as info:
                list(dl)
            error, strike.error_at = info.value, time.monotonic()
        else:
            assert items == reference["epochs"][0][: len(items)]  # a prefix of the fault-free epoch
        _assert_lost_error(error, rank, address, fault, strike.error_at - strike.at)
        # The error shut the other workers' sessions down (the victim may still be stopped).
        wait_dead([pid for r, pid in enumerate(pids) if r != rank], timeout=3)
    finally:
        victims.cleanup()
        dl.shutdown()
    wait_dead([server_pid, *pids])  # the local server is gone, and every session


# -- local workers: "reassign" ------------------------------------------------------------------
REASSIGN_CASES = [(point, fault, True) for point in POINTS for fault in FAULTS] + [
    (point, "SIGKILL", False) for point in POINTS
] + [("mid-epoch", "SIGSTOP", False)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("point,fault,in_order", REASSIGN_CASES)
def test_reassign_yields_the_fault_free_epoch(reference, point, fault, in_order, caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="rpc_reading_service.trainer.engine.epoch")
    hold = _hold(point, tmp_path)
    dl = _local_loader(hold, on_worker_failure="reassign", in_order=in_order)
    victims = _Victims()
    try:
        strike = _epoch_with_fault(dl, point, fault, victims, hold)
        assert strike.error is None, strike.error
        first, rank, victim, pids_before = strike.items, strike.rank, strike.victim, strike.pids
        # The next epoch after a reassignment: exactly once again.
        second = list(dl)
        pids_after = _pids(dl)
        server_pid = strike.server_pid
    finally:
        victims.cleanup()
        dl.shutdown()
    _assert_exactly_once(first, reference["epochs"][0], in_order)
    _assert_exactly_once(second, reference["epochs"][1], in_order)
    # Only the lost worker was replaced (in this epoch, or when the next one needed it).
    assert pids_after[rank] not in (None, victim)
    others = [r for r in range(len(SHARDS)) if r != rank]
    assert [pids_after[r] for r in others] == [pids_before[r] for r in others]
    replayed = re.findall(rf"worker {rank} \(.*replaying its shard from item (\d+)", caplog.text)
    replays = [int(n) for n in replayed]
    assert len(replays) == 1, (strike.consumed, caplog.text)
    if point == "mid-epoch":
        # Struck after the trainer took 40 of its items, while it held before its 50th.
        assert 50 >= replays[0] >= 40, (strike.consumed, caplog.text)
    elif point == "end-of-shard":
        assert replays[0] == SHARDS[1], caplog.text  # lost before its END_OF_SHARD: replayed to the end
    elif point == "after-end-of-shard" and in_order:
        assert replays[0] == 0, caplog.text  # this epoch did not need it any more; replaced for the next one
    wait_dead([server_pid, victim, *pids_before, *pids_after])


def slow_tag(x: int) -> Tuple[int, int]:
    time.sleep(0.002)
    return x, random.randint(0, 10**9)


def short_last_shard(datapipe: IterDataPipe, worker_info: Any) -> IterDataPipe:
    return datapipe.header(5) if worker_info.worker_id == 2 else datapipe


@pytest.mark.timeout(30)
def test_reassign_out_of_order_counts_each_shard_end_once():
    """in_order=False: a worker lost after its END_OF_SHARD is replaced, and the replacement
    (skipping the whole shard) ends it again while the others still stream. That second END
    must not end the epoch early (it did: items of the other workers went missing)."""

    def loader() -> DataLoader2:
        service = RPCReadingService(
            num_workers=3, in_order=False, liveness=Liveness(heartbeat_interval=HEARTBEAT),
            on_worker_failure="reassign", worker_init_fn=short_last_shard, timeout=TIMEOUT,
        )  # fmt: skip
        graph = IterableWrapper(range(450)).shuffle().sharding_filter().map(slow_tag)
        dl = DataLoader2(graph, reading_service=service)
        dl.seed(SEED)
        return dl

    dl = loader()
    try:
        reference = [list(dl), list(dl)]
    finally:
        dl.shutdown()
    dl, victims = loader(), _Victims()
    try:
        first = []
        for item in dl:
            first.append(item)
            # Worker 2's 5 items are in and its END came right after; 250 more to go.
            if not victims.pids and _consumed(dl)[2] == 5 and len(first) >= 60:
                victims.hit(_pids(dl)[2], "SIGKILL")
        second = list(dl)
    finally:
        victims.cleanup()
        dl.shutdown()
    assert victims.pids
    _assert_exactly_once(first, reference[0], in_order=False)
    _assert_exactly_once(second, reference[1], in_order=False)


@pytest.mark.timeout(30)
def test_reassign_gives_up_on_a_graph_that_kills_its_process_every_time():
    """The poison item kills every replacement too: a WorkerLostError says so, no endless loop."""
    service = RPCReadingService(
        num_workers=3, liveness=Liveness(heartbeat_interval=HEARTBEAT),
        on_worker_failure=Reassign(max_reassignments=2), timeout=TIMEOUT,
    )  # fmt: skip
    graph = IterableWrapper(range(60)).sharding_filter().map(functools.partial(exit_at, 17))
    dl = DataLoader2(graph, reading_service=service)
    start = time.monotonic()
    try:
        it = iter(dl)
        server_pid = dl.reading_service._local_server.pid
        pids = [pid for pid in _pids(dl) if pid is not None]
        with pytest.raises(WorkerLostError) as info:
            list(it)
    finally:
        dl.shutdown()
    assert time.monotonic() - start < 15
    error = info.value
    assert error.rank == 17 % 3
    message = str(error)
    position = int(re.search(r"after (\d+) of its items", message).group(1))
    assert 0 <= position <= 17 // 3  # the poison item is worker 2's item 5
    assert "gave up: worker 2's shard was lost 3 times in this epoch with the trainer at the same position" in message
    assert "max_reassignments=2 allows 2 replays from one position" in message
    assert "crash its process at that item every time" in message
    wait_dead([server_pid, *pids])


@pytest.mark.timeout(30)
def test_unrelated_losses_in_successive_epochs_do_not_add_up(caplog, tmp_path):
    """One loss of worker 1 in each of four epochs: each epoch counts its own (max_reassignments=3)."""
    caplog.set_level(logging.WARNING, logger="rpc_reading_service.trainer.engine.epoch")
    hold = _hold("mid-epoch", tmp_path)
    dl = _local_loader(hold, on_worker_failure="reassign")
    victims = _Victims()
    pids: List[Optional[int]] = []
    try:
        server_pid = dl.reading_service._local_server.pid if dl.reading_service._local_server else None
        for epoch in range(4):
            strike = _epoch_with_fault(dl, "mid-epoch", "SIGKILL", victims, hold)
            assert strike.error is None, f"epoch {epoch}: {strike.error}"
            ids = [x for x, _ in strike.items]
            assert len(ids) == len(set(ids)) == EPOCH_ITEMS, f"epoch {epoch}: items lost or duplicated"
            pids += strike.pids
            server_pid = strike.server_pid
        pids += _pids(dl)
    finally:
        victims.cleanup()
        dl.shutdown()
    replays = re.findall(r"worker 1 \(.*replaying its shard from item \d+ .*\(replay (\d+) of 3", caplog.text)
    assert replays == ["1", "1", "1", "1"], caplog.text  # a fresh count every epoch
    wait_dead([server_pid, *pids])



# -- remote servers -------------------------------------------------------------------------------
def _remote_loader(
    addresses: List[str], key: str, num_workers: int, in_order: bool = True, distribution: Optional[str] = None
) -> DataLoader2:
    service = RPCReadingService(
        num_workers=num_workers, workers=addresses, liveness=Liveness(heartbeat_interval=HEARTBEAT),
        on_worker_failure="reassign", auth_key=key, in_order=in_order, timeout=TIMEOUT, distribution=distribution,
    )  # fmt: skip
    dl = DataLoader2(_graph(200), reading_service=service)
    dl.seed(SEED)
    return dl


def _two_epochs(dl: DataLoader2) -> List[List[Any]]:
    try:
        return [list(dl), list(dl)]
    finally:
        dl.shutdown()


@pytest.mark.timeout(60)
def test_remote_session_killed_is_replaced_on_the_same_server(fresh_server):
    server = fresh_server()
    addresses = [server.address, server.address]
    reference = _two_epochs(_remote_loader(addresses, server.key, 2))
    server.wait_idle(5)
    dl = _remote_loader(addresses, server.key, 2)
    victims = _Victims()
    try:
        first = []
        for item in dl:
            first.append(item)
            if len(first) == 50:
                pids = _pids(dl)
                assert sorted(pids) == sorted(server.session_pids())
                victims.hit(pids[1], "SIGKILL")
        second = list(dl)
        pids_after = _pids(dl)
        assert sorted(pids_after) == sorted(server.session_pids())  # the new session runs on the same server
        assert dl.reading_service.worker_addresses == addresses
    finally:
        victims.cleanup()
        dl.shutdown()
    _assert_exactly_once(first, reference[0], in_order=True)
    _assert_exactly_once(second, reference[1], in_order=True)
    assert pids_after[0] == pids[0] and pids_after[1] not in (None, pids[1])
    wait_dead([*pids, *pids_after])
    assert server.proc.poll() is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("distribution", [None, "sticky"])
def test_killed_server_has_its_shards_replayed_on_the_other_server(fresh_server, distribution):
    """With sticky too: a replayed shard keeps its items (the table of servers travels with the graph)."""
    a = fresh_server()
    b = fresh_server(key=a.key)
    addresses = [a.address, b.address]
    reference = _two_epochs(_remote_loader(addresses, a.key, 4, distribution=distribution))
    a.wait_idle(5)
    b.wait_idle(5)
    dl = _remote_loader(addresses, a.key, 4, distribution=distribution)
    try:
        first = []
        for item in dl:
            first.append(item)
            if len(first) == 60:
                assert dl.reading_service.worker_addresses == [a.address, b.address, a.address, b.address]
                os.killpg(a.pid, signal.SIGKILL)  # the server and every session it forked
        second = list(dl)
        assert dl.reading_service.worker_addresses == [b.address] * 4
        pids_after = _pids(dl)
        assert sorted(pids_after) == sorted(b.session_pids())
    finally:
        dl.shutdown()
    _assert_exactly_once(first, reference[0], in_order=True)
    _assert_exactly_once(second, reference[1], in_order=True)
    wait_dead(pids_after)
    assert b.proc.poll() is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("in_order", [True, False])
def test_raise_after_a_complete_shard_reports_at_the_next_epoch_in_both_orders(reference, in_order):
    # The lost worker's items all arrived: the epoch completes in either order, and the next
    # epoch, which needs that worker, raises.
    dl = _local_loader(on_worker_failure="raise", in_order=in_order)
    victims = _Victims()
    try:
        strike = _epoch_with_fault(dl, "after-end-of-shard", "SIGKILL", victims, None)
        assert strike.error is None, strike.error
        _assert_exactly_once(strike.items, reference["epochs"][0], in_order=in_order)
        with pytest.raises(WorkerLostError) as info:
            list(dl)
        assert info.value.rank == strike.rank
    finally:
        victims.cleanup()
        dl.shutdown()


@pytest.mark.timeout(90)
def test_stopped_server_is_not_retried_while_another_is_live(fresh_server, tmp_path):
    """A server that hangs (SIGSTOP: its kernel still accepts connections) loses its sessions;
    their shards go to the live server at once, not after a connect_timeout spent on the
    hung one first."""
    a = fresh_server()
    b = fresh_server(key=a.key)
    reference = _two_epochs(_remote_loader([a.address, b.address], a.key, 2))[0]
    a.wait_idle(5)
    b.wait_idle(5)
    # Worker 0 (on a) waits at its 10th item until the stop: one whose whole shard is already
    # sent when its server stops is never missed (a slow start of b's session lets a run ahead).
    hold = Hold(tmp_path / "release", before=10)
    service = RPCReadingService(
        num_workers=2, workers=[a.address, b.address], auth_key=a.key, on_worker_failure="reassign",
        liveness=Liveness(heartbeat_interval=HEARTBEAT, connect_timeout=30.0), timeout=TIMEOUT,
        worker_init_fn=HoldWorker(hold, worker_id=0),
    )  # fmt: skip
    dl = DataLoader2(_graph(200), reading_service=service)
    dl.seed(SEED)
    stopped_at = None
    try:
        epoch = []
        for item in dl:
            epoch.append(item)
            if len(epoch) == 4:
                os.killpg(a.pid, signal.SIGSTOP)  # the server and every session it forked
                stopped_at = time.monotonic()
                hold.open()  # for worker 0's replacement on b
        took = time.monotonic() - stopped_at
        assert dl.reading_service.worker_addresses == [b.address, b.address]
    finally:
        dl.shutdown()
        os.killpg(a.pid, signal.SIGKILL)
    _assert_exactly_once(epoch, reference, in_order=True)
    # The lost worker is noticed after TIMEOUT, the hung server fails its probe within seconds.
    assert took < 15.0, f"the epoch took {took:.1f} s after the server stopped"
