"""The session state machines against each other, in memory: no sockets, no processes, no clock.

Every message travels as real bytes through a FrameReader, so the codec is exercised too.
A misbehaving peer is simulated by encoding a message directly (bypassing its state machine).
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_link import EXCEPTION, TRAINER, WORKER, Link, frames_of, items, payloads

from rpc_reading_service.errors import LocalProtocolError, RemoteProtocolError
from rpc_reading_service.protocol import (
    DATA_FRAME_OVERHEAD,
    ChunkDone,
    ClientHandshake,
    Close,
    Credit,
    CreditWindow,
    Data,
    DataReceived,
    EncodedItem,
    EndOfInput,
    EndOfShard,
    Heartbeat,
    ItemCredit,
    Items,
    ItemTimedOut,
    Lease,
    Leaving,
    MessageKind,
    PeerTimedOut,
    Ready,
    SessionState,
    Setup,
    SetupFailed,
    SetupRefused,
    ShardFailed,
    StartEpoch,
    StopEpoch,
    WorkerProtocol,
    data_cost,
    data_nbytes,
    decode_message,
    encode_control,
    encode_frame,
    window_frames,
    window_bytes,
    with_window,
)


# -- full sessions --------------------------------------------------------------------------------
def test_setup_epochs_with_credits_and_close():
    link = Link().set_up()
    assert link.trainer.state is link.worker.state is SessionState.READY
    for epoch in (1, 2):
        link.start(epoch, credits=2)
        assert link.worker.state is SessionState.IN_EPOCH and link.worker.credits == 2
        received = []
        for sequence, batch in enumerate([(b"a", b"b"), (b"c",), (b"d", b"e")]):
            if link.worker.credits <= 0:
                with pytest.raises(LocalProtocolError, match="without credit"):
                    link.worker.send(Data(epoch, sequence, items(*batch)))
                grant = 1 - link.worker.credits
                (credit,) = link.deliver(link.trainer.send(Credit(epoch, grant)), link.worker)
                assert credit == Credit(epoch, grant)
            (event,) = link.to_trainer(Data(epoch, sequence, items(*batch)))
            assert isinstance(event, DataReceived) and (event.epoch, event.sequence, event.count) == (
                epoch,
                sequence,
                len(batch),
            )
            received += payloads(event.decode())
        assert received == [b"a", b"b", b"c", b"d", b"e"]
        assert link.to_trainer(EndOfShard(epoch, 5)) == [EndOfShard(epoch, 5)]
        assert link.trainer.state is link.worker.state is SessionState.READY
        # The consumer still grants for frames it takes after the end: legal, and ignored by the worker.
        assert link.to_worker(Credit(epoch, 1)) == []
    assert link.to_worker(Close()) == [Close()]
    assert (link.trainer.state, link.trainer.closed_by) == (SessionState.CLOSED, "us")
    assert (link.worker.state, link.worker.closed_by) == (SessionState.CLOSED, "peer")


def test_data_credit_counts_bytes_and_a_frame_goes_while_any_is_left():
    batches = [(b"a", b"b"), (b"c",), (b"d", b"e")]
    # A frame costs its body and buffers plus a fixed overhead (a bound on a window's frames).
    costs = [data_cost(16 + 12 * len(batch) + len(batch)) for batch in batches]
    assert costs[1] == 16 + 12 + 1 + DATA_FRAME_OVERHEAD
    link = Link().set_up().start(1, credits=costs[0] + costs[1] + 29)
    for sequence, batch in enumerate(batches):
        (event,) = link.to_trainer(Data(1, sequence, items(*batch)))
        assert data_cost(event.nbytes) == data_cost(data_nbytes(items(*batch))) == costs[sequence]
    # Both ends count the same bytes; the third frame went with 29 bytes left, past the window.
    left = 29 - costs[2]
    assert link.worker.credits == link.trainer.credits == left < 0
    with pytest.raises(LocalProtocolError, match="without credit"):
        link.worker.send(Data(1, 3, items(b"f")))
    link.to_worker(Credit(1, -left))  # back to 0: still none left
    with pytest.raises(LocalProtocolError, match="without credit"):
        link.worker.send(Data(1, 3, items(b"f")))
    link.to_worker(Credit(1, 1))
    (event,) = link.to_trainer(Data(1, 3, [EncodedItem(b"g", [bytes(5000)])]))  # one frame over the window goes
    assert event.nbytes == 16 + 12 + 1 + 5000 and link.trainer.credits == 1 - data_cost(event.nbytes)
    # A worker that sends once its credit is used up breaks the rule on the trainer's end.
    with pytest.raises(RemoteProtocolError, match="DATA frame 4 of epoch 1 without credit"):
        link.deliver(Data(1, 4, items(b"h")).encode(), link.trainer)


def test_the_trainers_credit_window_is_frames_of_the_largest_frame_and_goes_back_by_halves():
    full = 10000 - DATA_FRAME_OVERHEAD  # a frame of these bytes costs 10000
    window = CreditWindow(frame_bytes=10000)
    assert window.start(4) == 40000  # four frames of the frame bound
    assert not window.handed_on(full) and window.handed_on(full)  # half the window: a CREDIT is due
    assert window.take() == 20000 and window.take() == 0
    # A slow stage's frames go back a whole window at a time.
    assert [window.handed_on(full, slow=True) for _ in range(4)] == [False, False, False, True]
    assert window.take() == 40000
    # A frame over the bound grows the window to four of it: its CREDIT carries the growth.
    assert window.handed_on(30000 - DATA_FRAME_OVERHEAD) and window.window == 120000
    assert window.take() == 30000 + (120000 - 40000)
    assert window.start(4) == 120000 and window.ungranted == 0  # kept for the session's next epochs
    assert window_frames(12000, 1000) == 12 and window_frames(1, 1000) == 1 and window_frames(0, 1000) == 1


def test_a_window_that_may_grow_holds_256_items_of_the_costliest_kind_up_to_its_frames():
    full = 10000 - DATA_FRAME_OVERHEAD
    window = CreditWindow(frame_bytes=10000)
    assert window.start(4, grow_to=16) == 40000
    assert not window.handed_on(full, items=100) and window.window == 40000  # 256 items of 100 bytes fit
    assert window.handed_on(full, items=2) and window.window == 160000  # 256 of 5000 bytes: 16 frames at most
    assert window.take() == 2 * 10000 + 120000  # the CREDIT carries the growth
    assert window.start(4, grow_to=16) == 160000 and window.start(4) == 40000  # kept; an explicit window stays
    assert window_bytes(4, 10000, 80000, 16, 80000) == 320000  # frames larger than the bound: 4 of them


def test_the_pools_hold_the_window_in_frames_of_the_bound_or_of_the_costliest_item():
    # Frames of several items count as their items: the pools multiply by their largest buffer,
    # and the frames a worker fills past the window are counted at the bound (the memory bound).
    window = CreditWindow(frame_bytes=10000)
    window.start(4, grow_to=16)
    window.handed_on(20000 - DATA_FRAME_OVERHEAD, items=4)  # a frame twice the bound of four items of half the bound
    assert window.window == 160000 and window.frames_held() == 16  # not 8: frames of the bound
    large = CreditWindow(frame_bytes=10000)
    large.start(4, grow_to=16)
    large.handed_on(80000 - DATA_FRAME_OVERHEAD, items=1)  # one item of eight times the bound
    assert large.window == 320000 and large.frames_held() == 4  # four of its size


def test_an_epoch_started_before_the_sessions_frame_bound_is_known_gets_its_frames_of_that_bound():
    window = CreditWindow()  # a channel still connecting: SETUP has not said the bound yet
    assert window.start(3) == 0 and window.bound is None
    assert window.set_bound(64 << 10) == 3 * (64 << 10) and window.window == 3 * (64 << 10)
    held = (StartEpoch(1, 7, 0, 0, dispatched=True), StopEpoch(1))
    assert with_window(held, window.window) == (StartEpoch(1, 7, 0, 3 * (64 << 10), dispatched=True), StopEpoch(1))


def test_stop_and_restart_epoch_drops_frames_in_flight():
    link = Link().set_up().start(1, credits=4)
    in_flight_data = link.worker.send(Data(1, 0, items(b"old")))
    assert link.to_worker(StopEpoch(1)) == [StopEpoch(1)]
    with pytest.raises(LocalProtocolError, match="epoch 1, which is over"):
        link.worker.send(EndOfShard(1, 1))
    link.start(2, credits=1)
    assert link.deliver(in_flight_data, link.trainer) == []  # stale: dropped
    assert link.trainer.stale_frames == 1
    late_credit = Credit(1, 1).encode()  # a misbehaving-looking but legal late grant for the old epoch
    assert link.deliver(late_credit, link.worker) == [] and link.worker.stale_frames == 1
    (event,) = link.to_trainer(Data(2, 0, items(b"new")))
    assert payloads(event.decode()) == [b"new"]
    assert link.to_trainer(EndOfShard(2, 1)) == [EndOfShard(2, 1)]
    # Stopping an epoch whose END_OF_SHARD crossed the STOP_EPOCH is legal on both sides.
    link.start(3, credits=1)
    end = link.worker.send(EndOfShard(3, 0))
    assert link.to_worker(StopEpoch(3)) == [StopEpoch(3)]
    assert link.deliver(end, link.trainer) == []


def test_epoch_error_ends_the_epoch_and_the_session_goes_on():
    link = Link().set_up().start(1)
    link.to_trainer(Data(1, 0, items(b"x")))
    (error,) = link.to_trainer(ShardFailed(1, EXCEPTION))
    assert error == ShardFailed(1, EXCEPTION)
    assert link.trainer.state is link.worker.state is SessionState.READY
    link.start(2)
    assert link.to_trainer(EndOfShard(2, 0)) == [EndOfShard(2, 0)]


def test_setup_error_closes_the_session_on_both_sides():
    link = Link()
    link.to_worker(Setup(b"graph", 1, 2))
    (error,) = link.to_trainer(SetupFailed(EXCEPTION))
    assert error == SetupFailed(EXCEPTION)
    assert (link.worker.state, link.worker.closed_by) == (SessionState.CLOSED, "us")
    assert (link.trainer.state, link.trainer.closed_by) == (SessionState.CLOSED, "peer")


def test_dispatched_items_flow_with_the_workers_credit():
    link = Link().set_up().start(1, credits=1, dispatched=True)
    assert link.trainer.item_credits == 0
    with pytest.raises(
        LocalProtocolError, match=r"this trainer broke .* ITEMS frame 0 of epoch 1 without credit"
    ):
        link.trainer.send(Items(1, 0, items(b"i0")))
    assert link.to_trainer(ItemCredit(1, 2)) == [ItemCredit(1, 2)]
    assert link.trainer.item_credits == 2
    got = []
    for sequence, batch in enumerate([(b"i0", b"i1"), (b"i2",)]):
        (event,) = link.to_worker(Items(1, sequence, items(*batch)))
        assert isinstance(event, Items) and event.sequence == sequence
        got += payloads(event)
    assert got == [b"i0", b"i1", b"i2"] and link.trainer.item_credits == 0
    with pytest.raises(LocalProtocolError, match="without credit"):
        link.trainer.send(Items(1, 2, items(b"i3")))
    link.to_trainer(ItemCredit(1, 1))
    with pytest.raises(LocalProtocolError, match="after 2 items, but its frames carried 3"):
        link.trainer.send(EndOfInput(1, 2))
    assert link.to_worker(EndOfInput(1, 3)) == [EndOfInput(1, 3)]
    with pytest.raises(LocalProtocolError, match="after ending that stream"):
        link.trainer.send(Items(1, 2, items(b"late")))
    with pytest.raises(LocalProtocolError, match="dispatched input is not open"):
        link.worker.send(ItemCredit(1, 1))
    link.to_trainer(Data(1, 0, items(b"out")))
    assert link.to_trainer(EndOfShard(1, 1)) == [EndOfShard(1, 1)]


#: Moving data is likelier than starting and stopping epochs, so that epochs get somewhere.
ACTIONS = st.sampled_from(["to_trainer"] * 4 + ["produce"] * 4 + ["to_worker"] * 3 + ["end", "start", "stop"])


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_interleaving_of_legal_drivers_keeps_the_rules_and_loses_nothing(data):
    """Drivers that follow the public state (credits, state) never trip a rule, whatever is in flight.

    Frames cross in flight in both directions (FIFO each way, as on one connection), epochs are
    stopped and restarted at random; every epoch the trainer saw end has all its items, in order.
    """
    link = Link().set_up()
    trainer, worker = link.trainer, link.worker
    to_worker: "collections.deque" = collections.deque()
    to_trainer: "collections.deque" = collections.deque()
    sent = {}  # epoch -> items the worker sent
    received = {}  # epoch -> items the trainer received
    ended, stopped = set(), set()
    epoch = 0
    for _ in range(data.draw(st.integers(10, 120))):
        action = data.draw(ACTIONS)
        if action == "start" or (action == "stop" and trainer.state is SessionState.IN_EPOCH):
            if action == "start":
                epoch += 1
                to_worker.append(trainer.send(StartEpoch(epoch, 0, 0, data.draw(st.integers(1, 100)))))
            else:
                to_worker.append(trainer.send(StopEpoch(epoch)))
                stopped.add(epoch)
        elif action == "produce" and worker.credits > 0:
            batch = sent[worker.epoch]
            payload = f"{worker.epoch}:{len(batch)}".encode()
            batch.append(payload)
            to_trainer.append(worker.send(Data(worker.epoch, len(batch) - 1, items(payload))))
        elif action == "end" and worker.state is SessionState.IN_EPOCH:
            to_trainer.append(worker.send(EndOfShard(worker.epoch, len(sent[worker.epoch]))))
        elif action == "to_worker" and to_worker:
            for event in link.deliver(to_worker.popleft(), worker):
                if isinstance(event, StartEpoch):
                    sent[event.epoch] = []
        elif action == "to_trainer" and to_trainer:
            for event in link.deliver(to_trainer.popleft(), trainer):
                if isinstance(event, DataReceived):
                    assert event.epoch == epoch and epoch not in stopped  # stale frames never surface
                    received.setdefault(event.epoch, []).extend(payloads(event.decode()))
                    to_worker.append(trainer.send(Credit(event.epoch, data_cost(event.nbytes))))
                elif isinstance(event, EndOfShard):
                    ended.add(event.epoch)
    for done in ended:
        assert received.get(done, []) == sent[done]
    assert set(received) <= set(sent)


# -- liveness -------------------------------------------------------------------------------------
def test_heartbeats_due_and_peer_timeout_with_an_injected_clock():
    link = Link().set_up()
    clock, trainer = link.clock, link.trainer
    assert trainer.tick().chunks == [] and trainer.tick().wait == pytest.approx(1.0)
    clock.now += 0.6
    assert trainer.tick().chunks == []
    clock.now += 0.4
    due = trainer.tick()
    assert [f.kind for f in frames_of(due.chunks)] == [MessageKind.HEARTBEAT] and due.events == []
    assert link.deliver(due.chunks, link.worker) == []  # a heartbeat makes no event, only liveness
    assert trainer.tick().chunks == []  # just sent one
    clock.now += 4.0
    link.deliver(link.worker.tick().chunks, trainer)  # the worker is alive: its heartbeat resets the silence
    clock.now += 4.9
    assert trainer.tick().events == []
    clock.now += 0.2
    (timeout,) = trainer.tick().events
    assert isinstance(timeout, PeerTimedOut) and timeout.peer == WORKER
    assert "worker 0 (127.0.0.1:29600) sent nothing (not even a heartbeat) for 5.0 s" in timeout.message
    assert (trainer.state, trainer.closed_by) == (SessionState.CLOSED, "timeout")
    assert trainer.tick().events == []  # reported once
    assert link.deliver(Heartbeat().encode(), trainer) == []  # a late frame is dropped, not an error


def test_a_timeout_after_this_side_itself_stood_still_says_so():
    # A trainer stopped (SIGSTOP, a suspended VM) for longer than the timeout finds every worker
    # silent when it runs again: the workers ended their sessions for the trainer's own silence.
    link = Link().set_up()
    clock, trainer = link.clock, link.trainer
    for _ in range(3):  # a driver ticks every heartbeat interval or sooner while it runs
        clock.now += 1.0
        trainer.tick()
    clock.now += 3.0  # up to here, a plain timeout: this side ticked a second ago
    (timeout,) = trainer.tick().events
    assert "sent nothing (not even a heartbeat) for 5.0 s" in timeout.message and "itself" not in timeout.message
    link = Link().set_up()
    clock, trainer = link.clock, link.trainer
    clock.now += 1.0
    trainer.tick()
    clock.now += 8.0  # not run for 8 s
    (timeout,) = trainer.tick().events
    assert "sent nothing (not even a heartbeat) for 5.0 s" in timeout.message
    assert "this trainer itself did not run for the 8.0 s before this check" in timeout.message


def test_worker_takes_liveness_from_setup_and_times_out_before_setup():
    link = Link()
    assert (link.worker.heartbeat_interval, link.worker.peer_timeout) == (1.0, 10.0)
    link.to_worker(Setup(b"g", 0, 1, {"heartbeat_interval": 0.25, "peer_timeout": 2.0, "linger": 0.002}))
    assert (link.worker.heartbeat_interval, link.worker.peer_timeout) == (0.25, 2.0)
    waiting = WorkerProtocol(TRAINER, setup_timeout=3.0, clock=link.clock)
    link.clock.now += 3.5
    (timeout,) = waiting.tick().events
    assert "trainer at 127.0.0.1:40000 sent nothing" in timeout.message and "3.0 s" in timeout.message



def test_the_workers_peer_timeout_counts_from_ready_not_from_a_setup_longer_than_it():
    """Frames the trainer sent while the worker loaded its graph are read only after READY."""
    link = Link()
    link.to_worker(Setup(b"g", 0, 1, {"heartbeat_interval": 0.5, "peer_timeout": 2.0}))
    link.clock.now += 3.0  # loading the graph (a slow worker_init_fn, imports on a loaded host)
    link.to_trainer(Ready(4242, "host", "0.1.0"))
    assert link.worker.tick().events == []
    link.clock.now += 2.1
    (timeout,) = link.worker.tick().events
    assert "2.0 s" in timeout.message


# -- illegal transitions --------------------------------------------------------------------------
def _set_up(link):
    return link.set_up()


def _in_epoch(link):
    return link.set_up().start(1, credits=1)


def _dispatched(link):
    return link.set_up().start(1, credits=1, dispatched=True)


def _after_end(link):
    _in_epoch(link)
    link.to_trainer(EndOfShard(1, 0))
    return link


LOCAL_CASES = [
    # (setup, side, message, words of the rule)
    (lambda link: link, "trainer", StartEpoch(1, 0, 0, 1), "START_EPOCH while the session is new"),
    (_set_up, "trainer", Setup(b"g", 0, 1), "SETUP while the session is ready"),
    (_set_up, "trainer", Data(1, 0, []), "DATA, which a trainer never sends"),
    (_set_up, "trainer", Credit(1, 1), "CREDIT for epoch 1, which was never started"),
    (_in_epoch, "trainer", StartEpoch(1, 0, 0, 1), "epoch numbers of a session must increase"),
    (_in_epoch, "trainer", Items(1, 0, []), "not started with dispatched=True"),
    (_in_epoch, "trainer", StopEpoch(2), "STOP_EPOCH for epoch 2, which was never started"),
    (_in_epoch, "worker", Data(1, 1, []), "where frame 0 was due"),
    (_in_epoch, "worker", EndOfShard(1, 3), "after 3 items, but its frames carried 0"),
    (_in_epoch, "worker", StartEpoch(2, 0, 0, 1), "START_EPOCH, which a worker never sends"),
    (_set_up, "worker", Ready(1, "h", "v"), "READY while the session is ready"),
    (_set_up, "worker", SetupFailed(EXCEPTION), "SETUP_FAILED while the session is ready"),
    (_set_up, "worker", SetupRefused("config", "no"), "SETUP_REFUSED while the session is ready"),
    (_after_end, "worker", ShardFailed(1, EXCEPTION), "SHARD_FAILED for epoch 1 after ending that epoch"),
    (_after_end, "worker", ItemTimedOut(1, 1, 0, 1.0, 1.5, ""), "ITEM_TIMED_OUT for epoch 1 after ending that epoch"),
    (_after_end, "worker", Data(1, 0, []), "after ending that stream"),
    (_dispatched, "worker", ItemCredit(2, 1), "ITEM_CREDIT for epoch 2, which was never started"),
]


@pytest.mark.parametrize(
    "prepare, side, message, rule",
    LOCAL_CASES,
    ids=[f"{c[1]}-{c[2].kind.name}-{c[3][:30]}" for c in LOCAL_CASES],
)
def test_illegal_send_is_refused_as_local_with_state_unchanged(prepare, side, message, rule):
    link = prepare(Link())
    machine = getattr(link, side)
    before = (machine.state, machine.epoch, machine.credits, machine.item_credits)
    with pytest.raises(LocalProtocolError) as info:
        machine.send(message)
    text = str(info.value)
    assert text.startswith(f"this {side} broke the session protocol with {machine.peer}: it tried to send")
    assert rule in text and "bug" in text
    assert (machine.state, machine.epoch, machine.credits, machine.item_credits) == before


def test_send_after_close_is_local():
    link = Link().set_up()
    link.to_worker(Close())
    with pytest.raises(LocalProtocolError, match="this trainer .* after the session closed"):
        link.trainer.send(Heartbeat())


def _ready_without_pid():
    return encode_control(MessageKind.READY, {"hostname": "h", "package_version": "v"})


REMOTE_CASES = [
    # (setup, receiving side, raw chunks a misbehaving peer sends, words of the rule)
    (
        lambda link: link,
        "worker",
        StartEpoch(1, 0, 0, 1).encode(),
        "sent START_EPOCH while the session is new",
    ),
    (_set_up, "worker", Setup(b"g", 0, 1).encode(), "sent SETUP while the session is ready"),
    (_set_up, "worker", Credit(1, 1).encode(), "CREDIT for epoch 1, which was never started"),
    (_in_epoch, "worker", StartEpoch(1, 0, 0, 1).encode(), "epoch numbers of a session must increase"),
    (_in_epoch, "worker", Items(1, 0, items(b"x")).encode(), "not started with dispatched=True"),
    (_dispatched, "worker", Items(1, 0, items(b"x")).encode(), "ITEMS frame 0 of epoch 1 without credit"),
    (_in_epoch, "worker", Data(1, 0, []).encode(), "sent DATA, which a trainer never sends"),
    (
        lambda link: link.to_worker(Setup(b"g", 0, 1)) and link,
        "trainer",
        Data(1, 0, []).encode(),
        "DATA while the session is setting up",
    ),
    (_set_up, "trainer", Data(1, 0, []).encode(), "DATA for epoch 1, which was never started"),
    (_in_epoch, "trainer", Data(1, 1, []).encode(), "frame 1 of epoch 1 where frame 0 was due"),
    (
        _in_epoch,
        "trainer",
        Data(1, 0, []).encode() + Data(1, 1, []).encode(),
        "DATA frame 1 of epoch 1 without credit",
    ),
    (_in_epoch, "trainer", EndOfShard(1, 9).encode(), "after 9 items, but its frames carried 0"),
    (_after_end, "trainer", Data(1, 0, []).encode(), "after ending that stream"),
    (_after_end, "trainer", EndOfShard(1, 0).encode(), "END_OF_SHARD for epoch 1 twice"),
    (_after_end, "trainer", ShardFailed(1, EXCEPTION).encode(), "SHARD_FAILED for epoch 1 after ending that epoch"),
    (_set_up, "trainer", ItemTimedOut(3, 3, 0, 1.0, 1.5, "").encode(), "ITEM_TIMED_OUT for epoch 3, which was never started"),
    (_set_up, "trainer", SetupFailed(EXCEPTION).encode(), "SETUP_FAILED while the session is ready"),
    (_in_epoch, "trainer", StopEpoch(1).encode(), "STOP_EPOCH, which a worker never sends"),
    (_in_epoch, "trainer", ItemCredit(1, 1).encode(), "not started with dispatched=True"),
    (
        lambda link: link.to_worker(Setup(b"g", 0, 1)) and link,
        "trainer",
        _ready_without_pid(),
        "malformed READY",
    ),
    (_set_up, "trainer", ClientHandshake(b"k").hello(), "HELLO, which a worker never sends"),
    (_in_epoch, "trainer", encode_frame(MessageKind.END_OF_SHARD, [b"\x00"]), "malformed END_OF_SHARD"),
    (_in_epoch, "worker", encode_frame(MessageKind.CREDIT, [b"\x00"]), "malformed CREDIT"),
    (_in_epoch, "trainer", encode_frame(MessageKind.DATA, [b"\x00"]), "malformed DATA"),
]


@pytest.mark.parametrize(
    "prepare, side, chunks, rule", REMOTE_CASES, ids=[f"at-{c[1]}-{c[3][:40]}" for c in REMOTE_CASES]
)
def test_illegal_frame_from_the_peer_is_remote_and_closes(prepare, side, chunks, rule):
    link = prepare(Link())
    machine = getattr(link, side)
    with pytest.raises(RemoteProtocolError) as info:
        link.deliver(chunks, machine)
    text = str(info.value)
    assert text.startswith(f"{machine.peer} broke the session protocol: it sent"), text
    assert rule in text
    assert (machine.state, machine.closed_by) == (SessionState.CLOSED, "error")


def test_frame_after_the_peers_close_is_remote():
    link = Link().set_up()
    link.to_trainer(Close())
    with pytest.raises(
        RemoteProtocolError, match=r"worker 0 \(127.0.0.1:29600\) broke the session protocol: it sent HEARTBEAT after its CLOSE"
    ):
        link.deliver(Heartbeat().encode(), link.trainer)


def test_setup_with_a_non_positive_heartbeat_is_remote():
    link = Link()
    with pytest.raises(RemoteProtocolError, match="heartbeat_interval=0, which must be positive"):
        link.deliver(Setup(b"g", 0, 1, {"heartbeat_interval": 0}).encode(), link.worker)


# -- what the drivers need: refusals, item_timeout, lenient workers, typed options, Join ----------
def test_a_reject_after_setup_is_a_refusal_event_that_closes():
    from rpc_reading_service.protocol import Refused, encode_reject

    link = Link()
    link.trainer.send(Setup(b"g", 0, 1))
    assert link.deliver(encode_reject("server busy: 4 sessions"), link.trainer) == [Refused("server busy: 4 sessions")]
    assert (link.trainer.state, link.trainer.closed_by) == (SessionState.CLOSED, "peer")
    with pytest.raises(RemoteProtocolError, match="REJECT, which a trainer never sends"):
        link.deliver(encode_reject("no"), link.worker)


def test_leaving_ends_the_session_on_both_sides_in_an_epoch_between_epochs_and_in_setup():
    link = Link().set_up().start(1)
    link.to_trainer(Data(1, 0, items(b"a")))
    assert link.to_trainer(Leaving("the worker server drains")) == [Leaving("the worker server drains")]
    assert (link.worker.state, link.worker.closed_by) == (SessionState.CLOSED, "us")
    assert (link.trainer.state, link.trainer.closed_by) == (SessionState.CLOSED, "peer")
    with pytest.raises(LocalProtocolError, match="after the session closed"):
        link.worker.send(EndOfShard(1, 1))
    between = Link().set_up()
    assert between.to_trainer(Leaving()) == [Leaving()] and between.trainer.closed_by == "peer"
    setting_up = Link()
    setting_up.to_worker(Setup(b"graph", 0, 1))
    assert setting_up.to_trainer(Leaving()) == [Leaving()] and setting_up.trainer.state is SessionState.CLOSED
    early = Link()  # the worker drains before the trainer's SETUP reached it
    early.trainer.send(Setup(b"graph", 0, 1))
    assert early.deliver(early.worker.send(Leaving()), early.trainer) == [Leaving()]
    assert early.trainer.closed_by == "peer" and early.worker.closed_by == "us"
    with pytest.raises(RemoteProtocolError, match="LEAVING, which a trainer never sends"):
        Link().set_up().deliver(Leaving().encode(), Link().set_up().worker)


def _stuck(epoch: int, stuck_epoch: int) -> ItemTimedOut:
    return ItemTimedOut(epoch, stuck_epoch, position=5, item_timeout=1.0, seconds=1.2, stack="tb")


def test_an_item_timeout_error_ends_the_session_on_both_sides():
    link = Link().set_up().start(1)
    (error,) = link.to_trainer(_stuck(1, 1))
    assert error == _stuck(1, 1)
    assert (link.worker.state, link.worker.closed_by) == (SessionState.CLOSED, "us")
    assert (link.trainer.state, link.trainer.closed_by) == (SessionState.CLOSED, "peer")


def test_an_item_timeout_error_of_an_abandoned_epoch_is_still_reported():
    link = Link().set_up().start(1)
    stale = link.worker.send(_stuck(1, 1))  # crosses the trainer's START_EPOCH 2
    link.trainer.send(StartEpoch(2, 0, 0, 1))
    (error,) = link.deliver(stale, link.trainer)
    assert error.stuck_epoch == 1 and link.trainer.closed_by == "peer"


def _setting_up(link):
    link.to_worker(Setup(b"g", 0, 1))
    return link


#: A malformed frame of each failure kind, where the table lets it come: what the trainer says.
MALFORMED_FAILURES = [
    (_setting_up, encode_control(MessageKind.SETUP_FAILED, {}), "without its field 'exception'"),
    (_setting_up, encode_control(MessageKind.SETUP_FAILED, {"exception": {}}), "field 'exception' is empty"),
    (_setting_up, encode_control(MessageKind.SETUP_REFUSED, {"reason": "transport"}), "without its field 'message'"),
    (_setting_up, encode_control(MessageKind.SETUP_REFUSED, {"reason": "mood", "message": "m"}), "unknown reason 'mood'"),
    (_in_epoch, encode_control(MessageKind.SHARD_FAILED, {"epoch": 1, "exception": "bad"}), "'exception' is str"),
    (_in_epoch, encode_frame(MessageKind.SHARD_FAILED, [b"not a pickle"]), "SHARD_FAILED"),
    (
        _in_epoch,
        encode_control(
            MessageKind.ITEM_TIMED_OUT,
            {"epoch": 1, "stuck_epoch": 1, "position": -1, "item_timeout": 1.0, "seconds": 2.0, "stack": ""},
        ),
        "field 'position' is negative",
    ),
    (_in_epoch, encode_control(MessageKind.ITEM_TIMED_OUT, {"epoch": 1, "phase": "item_timeout"}), "without its field"),
]


@pytest.mark.parametrize(
    "prepare, chunks, words", MALFORMED_FAILURES, ids=[f"{frames_of(c[1])[0].kind.name}-{c[2][:30]}" for c in MALFORMED_FAILURES]
)
def test_a_malformed_failure_frame_is_a_clear_remote_error_and_closes(prepare, chunks, words):
    link = prepare(Link())
    kind = frames_of(chunks)[0].kind.name
    with pytest.raises(RemoteProtocolError) as info:
        link.deliver(chunks, link.trainer)
    text = str(info.value)
    assert text.startswith(f"{WORKER} broke the session protocol: it sent a malformed {kind} (")
    assert words in text and "check that both sides run the same rpc_reading_service version" in text
    assert (link.trainer.state, link.trainer.closed_by) == (SessionState.CLOSED, "error")


def test_a_lenient_worker_drops_frames_about_epochs_never_started():
    link = Link()
    link.worker = WorkerProtocol(TRAINER, clock=link.clock, lenient=True)
    link.set_up()
    sloppy = Credit(1000, 5).encode() + StopEpoch(1 << 40).encode() + encode_frame(MessageKind.HEARTBEAT, [b"x"], [b"y"])
    assert link.deliver(sloppy, link.worker) == [] and link.worker.stale_frames == 2
    link.start(7, credits=1)
    assert link.worker.credits == 1  # the session goes on
    with pytest.raises(RemoteProtocolError, match="DATA, which a trainer never sends"):
        link.deliver(Data(7, 0, []).encode(), link.worker)  # lenient is not lawless


def test_setup_options_are_typed_and_travel_as_a_dict():
    from rpc_reading_service.protocol import SessionOptions

    setup = Setup(b"g", 0, 1, {"peer_timeout": 2.5, "item_timeout": 0.5, "from_a_newer_trainer": 1})
    assert setup.options == SessionOptions(peer_timeout=2.5, item_timeout=0.5)
    (frame,) = frames_of(setup.encode())
    assert decode_message(frame) == setup
    with pytest.raises(LocalProtocolError, match="option 'item_timeout' is str"):
        Setup(b"g", 0, 1, {"item_timeout": "soon"})


def test_a_join_reaches_the_worker_as_a_join_and_is_refused_with_a_reason():
    from rpc_reading_service.protocol import Join

    join = Join("torch_rpc", 1, "tcp://127.0.0.1:1234", 1, "s1", "t", "c0ffee", 5.0, 60.0, transports=["shm"])
    link = Link()
    (event,) = link.deliver(join.encode(), link.worker)
    assert event == join and link.worker.state is SessionState.SETTING_UP
    refusal = SetupRefused("transport", "start it with --transport torch_rpc")
    link.trainer.send(Setup(b"g", 0, 1))  # the trainer's side of this session, for the test
    (error,) = link.to_trainer(refusal)
    assert (error.reason, error.message) == ("transport", "start it with --transport torch_rpc")
    assert link.worker.closed_by == "us" and link.trainer.closed_by == "peer"


# -- leases ("dynamic" epochs) -------------------------------------------------------------------
def test_leased_chunks_are_reported_done_in_order_with_the_items_since_the_last_report():
    link = Link().set_up().start(1, credits=1 << 20, leased=True)
    with pytest.raises(RemoteProtocolError, match="DATA frame 0 of epoch 1 with items but holds no lease"):
        forged = Link().set_up().start(1, leased=True)
        forged.deliver(Data(1, 0, items(b"x")).encode(), forged.trainer)
    assert link.to_worker(Lease(1, 0)) == [Lease(1, 0)] and link.to_worker(Lease(1, 2, skip=1)) == [Lease(1, 2, 1)]
    with pytest.raises(LocalProtocolError, match="LEASE of chunk 1 of epoch 1 after chunk 2: .* must increase"):
        link.trainer.send(Lease(1, 1))
    with pytest.raises(LocalProtocolError, match="LEASE of chunk 3 of epoch 1 from position 2, before the end of the previous"):
        link.trainer.send(Lease(1, 3, start=2, size=4))  # chunk 2 was position 2: chunk 3 must start past it
    link.to_trainer(Data(1, 0, items(b"a", b"b")))
    with pytest.raises(LocalProtocolError, match="CHUNK_DONE for chunk 2 of epoch 1 where chunk 0 was due"):
        link.worker.send(ChunkDone(1, 2, (0,)))
    with pytest.raises(LocalProtocolError, match="with 1 items, but its DATA frames carried 2 since the previous"):
        link.worker.send(ChunkDone(1, 0, (1,)))
    assert link.to_trainer(ChunkDone(1, 0, (3,))) == [ChunkDone(1, 0, (3,))]  # its third item is still packed
    assert link.trainer.leases_outstanding == [2] == link.worker.leases_outstanding
    # One frame: the last item of chunk 0, then chunk 2's first; a DATA past the reports needs a lease.
    link.to_trainer(Data(1, 1, items(b"c", b"d")))
    with pytest.raises(LocalProtocolError, match="with 0 items, but its DATA frames carried 1 since the previous"):
        link.worker.send(ChunkDone(1, 2, (0,)))
    assert link.to_worker(Lease(1, final=True)) == [Lease(1, final=True)]
    with pytest.raises(LocalProtocolError, match="after its final LEASE"):
        link.trainer.send(Lease(1, 5))
    assert link.to_trainer(ChunkDone(1, 2, (2,))) == [ChunkDone(1, 2, (2,))]
    with pytest.raises(LocalProtocolError, match="with items but holds no lease"):
        link.worker.send(Data(1, 2, items(b"e", b"f")))  # one item is chunk 2's, the other nobody's
    with pytest.raises(LocalProtocolError, match="after 4 items, but its CHUNK_DONEs reported 5"):
        link.worker.send(EndOfShard(1, 4))
    link.to_trainer(Data(1, 2, items(b"e")))
    assert link.to_trainer(EndOfShard(1, 5)) == [EndOfShard(1, 5)] and link.trainer.leases_outstanding == []
    # END_OF_SHARD ends the leases still outstanding (past the stream's end); a LEASE crossing it is dropped.
    ended = Link().set_up().start(1, leased=True)
    ended.to_worker(Lease(1, 0))
    assert ended.to_trainer(EndOfShard(1, 0)) == [EndOfShard(1, 0)] and ended.trainer.leases_outstanding == []


def test_a_lease_grants_a_run_of_chunks_and_a_chunk_done_reports_several():
    link = Link().set_up().start(1, credits=1 << 20, leased=True)
    assert link.to_worker(Lease(1, 0, skip=1, count=3)) == [Lease(1, 0, 1, count=3)]
    link.to_worker(Lease(1, 5, count=2))
    assert link.trainer.leases_outstanding == [0, 1, 2, 5, 6] == link.worker.leases_outstanding
    with pytest.raises(LocalProtocolError, match="LEASE of chunk 6 of epoch 1 after chunk 6"):
        link.trainer.send(Lease(1, 6))
    link.to_trainer(Data(1, 0, items(b"a", b"b")))
    with pytest.raises(LocalProtocolError, match="with 1 items, but its DATA frames carried 2"):
        link.worker.send(ChunkDone(1, 0, (1, 9)))  # the DATA so far holds the first chunk's items only
    with pytest.raises(LocalProtocolError, match="for 6 chunks from chunk 0 of epoch 1, but holds 5 leases"):
        link.worker.send(ChunkDone(1, 0, (2, 0, 0, 0, 0, 0)))
    assert link.to_trainer(ChunkDone(1, 0, (2, 3, 1, 4))) == [ChunkDone(1, 0, (2, 3, 1, 4))]
    assert link.trainer.leases_outstanding == [6] == link.worker.leases_outstanding
    link.to_trainer(Data(1, 1, items(b"c", b"d", b"e", b"f", b"g", b"h", b"i", b"j")))
    with pytest.raises(LocalProtocolError, match="where chunk 6 was due"):
        link.worker.send(ChunkDone(1, 5, (0,)))
    assert link.to_trainer(ChunkDone(1, 6, (0,), 97)) == [ChunkDone(1, 6, (0,), 97)]
    assert link.to_trainer(EndOfShard(1, 10)) == [EndOfShard(1, 10)]


def test_a_dispatched_leased_epoch_leases_each_item_before_the_frame_that_carries_it():
    """"dynamic" with a dispatch point: a unit is one dispatched item, paired with its LEASE in order."""
    link = Link().set_up().start(1, credits=2, dispatched=True, leased=True)
    link.to_trainer(ItemCredit(1, 2))
    with pytest.raises(LocalProtocolError, match="ITEMS frame 0 of epoch 1 with items 0 to 0 .* leased only 0 units"):
        link.trainer.send(Items(1, 0, items(b"u0")))
    link.to_worker(Lease(1, 0))
    link.to_worker(Lease(1, 3))
    (event,) = link.to_worker(Items(1, 0, items(b"u0", b"u3")))
    assert payloads(event) == [b"u0", b"u3"]
    link.to_trainer(Data(1, 0, items(b"out0")))
    assert link.to_trainer(ChunkDone(1, 0, (1,))) == [ChunkDone(1, 0, (1,))]
    forged = Link().set_up().start(1, dispatched=True, leased=True)
    forged.to_worker(Lease(1, 0))
    with pytest.raises(RemoteProtocolError, match="with items 0 to 1 of its input, but leased only 1 units"):
        forged.deliver(Items(1, 0, items(b"a", b"b")).encode(), forged.worker)
    assert forged.worker.state is SessionState.CLOSED


def test_leases_belong_to_leased_epochs_and_a_forged_report_is_remote():
    link = Link().set_up().start(1)
    with pytest.raises(LocalProtocolError, match="not started with leased=True"):
        link.trainer.send(Lease(1, 0))
    forged = Link().set_up().start(1, leased=True)
    forged.to_worker(Lease(1, 4))
    with pytest.raises(RemoteProtocolError, match="CHUNK_DONE for chunk 3 of epoch 1 where chunk 4 was due"):
        forged.deliver(ChunkDone(1, 3, (0,)).encode(), forged.trainer)
    assert forged.trainer.state is SessionState.CLOSED
    crossing = Link().set_up().start(1, leased=True)
    crossing.to_trainer(EndOfShard(1, 0))
    assert crossing.to_worker(Lease(1, 0)) == []  # sent before the trainer saw the END: dropped
