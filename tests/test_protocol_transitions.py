"""The session protocol's transition table, entry by entry, on both ends: in memory, no sockets.

Every (role, state, kind) of the table moves the sender (``send``) and the peer
(``receive_frame``) to the listed state; every kind missing from a state's row is refused as
the sender's bug (LocalProtocolError, state unchanged) and as the peer's fault
(RemoteProtocolError, session closed by "error").
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest

from rpc_reading_service.errors import LocalProtocolError, RemoteProtocolError
from rpc_reading_service.protocol import (
    ChunkDone,
    Close,
    Credit,
    Data,
    EncodedItem,
    EndOfInput,
    EndOfShard,
    Heartbeat,
    ItemCredit,
    Items,
    ItemTimedOut,
    Lease,
    Leaving,
    Message,
    MessageKind,
    Ready,
    Refused,
    SessionState,
    Setup,
    SetupFailed,
    SetupRefused,
    ShardFailed,
    StartEpoch,
    StopEpoch,
    encode_reject,
)
from rpc_reading_service.protocol.session import SENDS, TRANSITIONS
from test_session_protocol import EXCEPTION, Link

K, S = MessageKind, SessionState
ROLES = {"trainer": "worker", "worker": "trainer"}
OPEN_STATES = [S.NEW, S.SETTING_UP, S.READY, S.IN_EPOCH]
#: A well-formed message of each kind a session sends (REJECT is the server's raw frame, below).
SAMPLES: Dict[MessageKind, Message] = {
    K.SETUP: Setup(b"graph", 0, 1),
    K.READY: Ready(4242, "host", "0.1.0"),
    K.START_EPOCH: StartEpoch(2, 7, 0, 1),
    K.STOP_EPOCH: StopEpoch(1),
    K.SETUP_FAILED: SetupFailed(EXCEPTION),
    K.SETUP_REFUSED: SetupRefused("transport", "start it with --transport torch_rpc"),
    K.SHARD_FAILED: ShardFailed(1, EXCEPTION),
    K.ITEM_TIMED_OUT: ItemTimedOut(1, 1, 5, 1.0, 1.2, "tb"),
    K.CLOSE: Close(),
    K.LEAVING: Leaving("drains"),
    K.CREDIT: Credit(1, 1),
    K.DATA: Data(1, 0, []),
    K.END_OF_SHARD: EndOfShard(1, 0),
    K.HEARTBEAT: Heartbeat(),
    K.ITEM_CREDIT: ItemCredit(1, 1),
    K.ITEMS: Items(1, 0, [EncodedItem(b"x")]),
    K.END_OF_INPUT: EndOfInput(1, 0),
    K.LEASE: Lease(1, 0),
    K.CHUNK_DONE: ChunkDone(1, 0, (0,)),
}
SESSION_KINDS = sorted(set(SAMPLES) | {K.REJECT})


def chunks_of(kind: MessageKind) -> list:
    """The frame of ``kind`` as a peer would write it, bypassing its state machine."""
    return encode_reject("server busy") if kind is K.REJECT else SAMPLES[kind].encode()


# -- links in each state, both ends alike, with what a legal message needs --------------------------
def in_state(state: SessionState) -> Link:
    """A trainer and a worker both in ``state``; an epoch (1) is "dynamic" and dispatched."""
    link = Link()
    if state is S.SETTING_UP:
        link.to_worker(Setup(b"graph", 0, 1))
    if state in (S.READY, S.IN_EPOCH):
        link.set_up()
    if state is S.IN_EPOCH:
        link.start(1, credits=2, dispatched=True, leased=True)
    return link


def ended(link: Link) -> Link:
    """READY after epoch 1's END_OF_SHARD (its credits and dispatched input still open)."""
    link.start(1, credits=2, dispatched=True, leased=True)
    link.to_trainer(ItemCredit(1, 1))
    link.to_trainer(EndOfShard(1, 0))
    return link


def with_item_credit_and_lease(link: Link) -> Link:
    link.to_trainer(ItemCredit(1, 1))
    link.to_worker(Lease(1, 0))
    return link


def with_lease(link: Link) -> Link:
    link.to_worker(Lease(1, 0))
    return link


def stopped(link: Link) -> Link:
    """READY after the trainer stopped epoch 1: the worker's frames of it still in flight are stale."""
    link.start(1, credits=2, dispatched=True, leased=True)
    link.to_worker(StopEpoch(1))
    return link


Prepare = Callable[[Link], Link]
#: Per (sender, state, kind): what makes the sample legal there (default: nothing). ``None``: the
#: sender never sends it legally in that state (its content breaks a rule); the kind is in the row
#: because such a frame, sent before the peer stopped or ended the epoch, still arrives there stale.
PREPARE: Dict[Tuple[str, SessionState, MessageKind], Prepare] = {
    ("trainer", S.READY, K.STOP_EPOCH): ended,
    ("trainer", S.READY, K.CREDIT): ended,
    ("trainer", S.READY, K.ITEMS): ended,
    ("trainer", S.READY, K.END_OF_INPUT): ended,
    ("trainer", S.READY, K.LEASE): ended,
    ("trainer", S.IN_EPOCH, K.ITEMS): with_item_credit_and_lease,
    ("worker", S.IN_EPOCH, K.CHUNK_DONE): with_lease,
}
STALE_ONLY = {
    ("worker", S.READY, kind) for kind in (K.DATA, K.END_OF_SHARD, K.SHARD_FAILED, K.ITEM_CREDIT, K.CHUNK_DONE)
}
#: Never sent legally there either, but reported when it crossed the trainer's STOP_EPOCH: it ends the session.
CROSSED = {("worker", S.READY, K.ITEM_TIMED_OUT)}

LEGAL = [
    (role, state, kind, after)
    for role, table in TRANSITIONS.items()
    for state, row in table.items()
    for kind, after in row.items()
]
ILLEGAL = [
    (role, state, kind)
    for role in ROLES
    for state in OPEN_STATES
    for kind in SESSION_KINDS
    if kind not in TRANSITIONS[role][state]
]


def ids(entries) -> List[str]:
    return ["-".join(getattr(part, "name", str(part)) for part in entry) for entry in entries]


def not_now_words(role: str, state: SessionState, kind: MessageKind) -> List[str]:
    """The words of the table's refusals (not of a rule about the message's contents)."""
    return [f"{kind.name}, which a {role} never sends", f"{kind.name} while the session is {state.value}"]


SENT_LEGALLY = [entry for entry in LEGAL if entry[2] is not K.REJECT and entry[:3] not in STALE_ONLY | CROSSED]


@pytest.mark.parametrize("role, state, kind, after", SENT_LEGALLY, ids=ids(SENT_LEGALLY))
def test_every_legal_message_moves_both_ends_to_the_listed_state(role, state, kind, after):
    link = PREPARE.get((role, state, kind), lambda link: link)(in_state(state))
    sender, receiver = getattr(link, role), getattr(link, ROLES[role])
    assert sender.state is receiver.state is state
    chunks = sender.send(SAMPLES[kind])
    assert sender.state is after
    events = link.deliver(chunks, receiver)
    assert receiver.state is after
    if after is S.CLOSED:
        assert (sender.closed_by, receiver.closed_by) == ("us", "peer")
    assert all(not isinstance(event, Heartbeat) for event in events)


@pytest.mark.parametrize("state", OPEN_STATES)
def test_a_reject_closes_the_trainers_end_in_every_state(state):
    assert TRANSITIONS["worker"][state][K.REJECT] is S.CLOSED
    link = in_state(state)
    assert link.deliver(encode_reject("server busy"), link.trainer) == [Refused("server busy")]
    assert (link.trainer.state, link.trainer.closed_by) == (S.CLOSED, "peer")


@pytest.mark.parametrize("role, state, kind", sorted(STALE_ONLY | CROSSED), ids=ids(sorted(STALE_ONLY | CROSSED)))
def test_a_frame_that_crossed_the_stop_is_dropped_or_reported(role, state, kind):
    """Stale: dropped and the state stays; an ITEM_TIMED_OUT: reported, and the session ends."""
    link = stopped(in_state(S.READY))
    receiver = getattr(link, ROLES[role])
    with pytest.raises(LocalProtocolError, match="which is over"):
        getattr(link, role).send(SAMPLES[kind])  # never legal for the sender there
    events = link.deliver(SAMPLES[kind].encode(), receiver)
    after = TRANSITIONS[role][state][kind]
    if (role, state, kind) in CROSSED:
        assert (events, receiver.state, receiver.closed_by) == ([SAMPLES[kind]], after, "peer") and after is S.CLOSED
    else:
        assert (events, receiver.state, receiver.stale_frames) == ([], after, 1)


@pytest.mark.parametrize("role, state, kind", ILLEGAL, ids=ids(ILLEGAL))
def test_every_illegal_message_is_local_on_send_and_remote_on_receive(role, state, kind):
    link = in_state(state)
    sender, receiver = getattr(link, role), getattr(link, ROLES[role])
    not_now = not_now_words(role, state, kind)
    if kind in SAMPLES:
        before = (sender.state, sender.epoch, sender.credits, sender.item_credits, sender.closed_by)
        with pytest.raises(LocalProtocolError) as local:
            sender.send(SAMPLES[kind])
        assert any(words in str(local.value) for words in not_now), local.value
        assert (sender.state, sender.epoch, sender.credits, sender.item_credits, sender.closed_by) == before
    with pytest.raises(RemoteProtocolError) as remote:
        link.deliver(chunks_of(kind), receiver)
    assert any(words in str(remote.value) for words in not_now), remote.value
    assert (receiver.state, receiver.closed_by) == (S.CLOSED, "error")


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("kind", [kind for kind in SESSION_KINDS if kind is not K.REJECT])
def test_nothing_is_sent_after_close_and_a_frame_after_the_peers_close_is_remote(role, kind):
    link = in_state(S.READY)
    sender, receiver = getattr(link, role), getattr(link, ROLES[role])
    link.deliver(sender.send(Close()), receiver)
    with pytest.raises(LocalProtocolError, match="after the session closed"):
        sender.send(SAMPLES[kind])
    assert (sender.state, sender.closed_by) == (S.CLOSED, "us")
    with pytest.raises(RemoteProtocolError, match=f"it sent {kind.name} after its CLOSE"):
        link.deliver(chunks_of(kind), receiver)


def refused_as_not_now(attempt: Callable[[], object], words: List[str]) -> bool:
    """Whether ``attempt`` fails for the table (not for a rule about the message's contents)."""
    try:
        attempt()
    except (LocalProtocolError, RemoteProtocolError) as exc:
        return any(word in str(exc) for word in words)
    return False


@pytest.mark.parametrize("state", OPEN_STATES)
@pytest.mark.parametrize("role", ROLES)
def test_what_one_role_may_send_is_exactly_what_the_other_may_receive(role, state):
    sent, received = set(), set()
    for kind in SESSION_KINDS:
        words = not_now_words(role, state, kind)
        sender = getattr(in_state(state), role)
        if kind in SAMPLES and not refused_as_not_now(lambda: sender.send(SAMPLES[kind]), words):
            sent.add(kind)
        link = in_state(state)
        if not refused_as_not_now(lambda: link.deliver(chunks_of(kind), getattr(link, ROLES[role])), words):
            received.add(kind)
    assert sent == received - {K.REJECT} == SENDS[role][state] - {K.REJECT}
    assert (K.REJECT in received) is (role == "worker")


def test_the_state_changes_only_where_the_table_is_taken():
    """No handler assigns ``state``: only ``SessionProtocol._enter`` (and ``__init__``) do."""
    protocol = Path(__file__).resolve().parents[1] / "rpc_reading_service" / "protocol"
    assigning = []
    for path in sorted(protocol.glob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                targets = node.targets if isinstance(node, ast.Assign) else []
                for target in targets:
                    for each in ast.walk(target):
                        if isinstance(each, ast.Attribute) and each.attr == "state":
                            assigning.append(f"{path.name}:{function.name}")
    assert sorted(set(assigning)) == ["session.py:__init__", "session.py:_enter"]
