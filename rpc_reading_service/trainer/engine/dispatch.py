"""Dispatching: the non-replicable part of a graph, run once per epoch on the trainer, dealt to the workers (docs/architecture.md)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

from ...errors import DispatchStalledError, ItemTimeoutError, thread_stack
from ...protocol import EncodedItem, EndOfInput, EndOfShard, ItemCredit, Items, ItemTimedOut, Message, ShardFailed
from ...serialization import ItemEncoder
from ...tasks import TaskGroup

__all__ = ["Dispatch", "RankInput", "UnitDispatch"]

log = logging.getLogger(__name__)

#: Seconds between looks at whether a worker whose input is over the limit is still heard from.
_HEARD_POLL = 0.05
#: Looks at the item being pulled per ``item_timeout`` (at least one a second).
_ITEM_CHECKS_PER_TIMEOUT = 4
#: Seconds the sending thread and the item_timeout watch get to end once stopped.
_HELPERS_JOIN_SECONDS = 1.0


class RankInput:
    """The dispatched input of one worker rank in one epoch: items dealt, credit, frames sent.

    ``send`` writes one message to the rank's session (ITEMS or END_OF_INPUT). Dealing and
    granting only make messages; a sender (:meth:`drain`, or :class:`Dispatch`'s sending
    thread with :meth:`take`) sends them in order, never under ``cond``: a send stuck on a
    worker that stopped reading blocks neither :meth:`cancel` nor the dealing. A frame packs
    up to ``max_items``/``max_bytes``; the dispatcher blocks at that much pending, unless a
    rank of :attr:`peers` (which share ``cond``) waits for input, up to ``max_pending_items``
    / ``max_pending_bytes`` (a replacement's replayed input does not count), and past that
    only while ``heard_since(t)`` (is the worker alive after ``time.monotonic()`` ``t``?) has
    not said the worker lives on without asking. Thread-safe: the dispatcher thread deals,
    the receivers grant.
    """

    def __init__(
        self,
        rank: int,
        epoch: int,
        send: Callable[[Message], None],
        max_items: int,
        max_bytes: int,
        keep_history: bool = False,
        cond: Optional[threading.Condition] = None,
        max_pending_items: Optional[int] = None,
        max_pending_bytes: Optional[int] = None,
        heard_since: Optional[Callable[[float], bool]] = None,
    ):
        self.rank = rank
        self.epoch = epoch
        self._send = send
        self._heard_since = heard_since
        self._max_items, self._max_bytes = max_items, max_bytes
        self._max_pending_items = max_pending_items or 8 * max_items
        self._max_pending_bytes = max_pending_bytes or 8 * max_bytes
        self._cond = cond or threading.Condition()
        #: The ranks of the same dispatch (sharing ``cond``), this one included.
        self.peers: Sequence["RankInput"] = [self]
        self._pending: Deque[EncodedItem] = collections.deque()
        #: Messages made under ``cond``, sent outside it by the sender.
        self._outgoing: Deque[Message] = collections.deque()
        self._pending_bytes = 0
        #: Of the pending items, the oldest are a replacement's replay of the items dealt before.
        self._replay_items = self._replay_bytes = 0
        self._history: Optional[List[EncodedItem]] = [] if keep_history else None
        #: Counts the sessions that fed this rank (a replacement is the next one).
        self.session = 0
        self.credits = 0
        self._sequence = 0
        self.items_sent = 0
        self._done = False
        self._ended = False
        self._discard = False
        self._cancelled = False
        #: Times the dispatcher waited for this rank's credit (backpressure at work).
        self.waits = 0

    @property
    def cond(self) -> threading.Condition:
        """The condition this rank and its :attr:`peers` share (notified when a message is due)."""
        return self._cond

    @property
    def pending(self) -> int:
        """Items dealt to this rank and not sent yet."""
        return len(self._pending)

    def deal(self, item: EncodedItem) -> bool:
        """Add one item; frame what credit allows; block while a full frame waits for credit.

        Returns False once the input is cancelled (the dispatcher stops).
        """
        with self._cond:
            if self._cancelled:
                return False
            if self._history is not None:
                self._history.append(item)
            if self._discard:
                return True
            self._pending.append(item)
            self._pending_bytes += item.nbytes
            self._flush()
            over_since: Optional[Tuple[int, float]] = None  # (session, when) the limit was reached
            while self._full() and not self._cancelled:
                starving = self._starving_peer()
                if starving is None:
                    self.waits += 1
                    self._cond.wait()
                elif not self._over_limit():
                    break
                elif over_since is None or over_since[0] != self.session:
                    over_since = (self.session, time.monotonic())
                elif self._heard_since is None or self._heard_since(over_since[1]):
                    raise self._stalled(starving)
                else:  # silent: stopped, or lost (a replacement restarts this rank)
                    self._cond.wait(_HEARD_POLL)
            return not self._cancelled

    def finish(self) -> None:
        """Every item of this rank was dealt: END_OF_INPUT follows the last one sent."""
        with self._cond:
            self._done = True
            self._flush()

    def grant(self, epoch: int, credits: int, session: int = 0) -> None:
        """The worker allows ``credits`` more ITEMS frames of ``epoch``; grants of other epochs,
        and of a session that :meth:`restart` replaced (``session`` below :attr:`session`), are ignored."""
        with self._cond:
            if epoch != self.epoch or session != self.session or self._cancelled:
                return
            self.credits += credits
            self._flush()
            self._cond.notify_all()

    def shard_ended(self, epoch: int, session: int = 0) -> None:
        """The worker ended its shard early (its graph stopped before its input, or failed): the
        rest of its input is not sent, and never blocks the dispatcher (it is still kept for a
        replacement, which stops at the same place)."""
        with self._cond:
            if epoch != self.epoch or session != self.session:
                return
            self._discard = True
            self._pending.clear()
            self._pending_bytes = self._replay_items = self._replay_bytes = 0
            self._cond.notify_all()

    def restart(self, send: Callable[[Message], None], heard_since: Optional[Callable[[float], bool]] = None) -> None:
        """A replacement session took over the rank: feed it the rank's whole input again.

        Needs ``keep_history``. The new session starts with no credit and frame 0.
        """
        assert self._history is not None, "restart() needs keep_history=True"
        with self._cond:
            self.session += 1
            self._send, self._heard_since = send, heard_since
            self._outgoing.clear()
            self._pending = collections.deque(self._history)
            self._pending_bytes = sum(item.nbytes for item in self._pending)
            self._replay_items, self._replay_bytes = len(self._pending), self._pending_bytes
            self.credits, self._sequence, self.items_sent, self._ended, self._discard = 0, 0, 0, False, False
            self._cond.notify_all()

    def cancel(self) -> None:
        """Stop: nothing more is sent, a waiting dispatcher wakes up and stops."""
        with self._cond:
            self._cancelled = True
            self._outgoing.clear()
            self._pending.clear()
            self._pending_bytes = self._replay_items = self._replay_bytes = 0
            self._cond.notify_all()

    @property
    def starving(self) -> bool:
        """The worker asked for input (it has credit) and nothing waits to be sent to it."""
        return self.credits > 0 and not self._pending and not (self._done or self._discard or self._cancelled)

    def _starving_peer(self) -> Optional["RankInput"]:
        return next((peer for peer in self.peers if peer is not self and peer.starving), None)

    def _full(self) -> bool:
        return len(self._pending) >= self._max_items or self._pending_bytes >= self._max_bytes

    def _over_limit(self) -> bool:
        items, nbytes = len(self._pending) - self._replay_items, self._pending_bytes - self._replay_bytes
        return items >= self._max_pending_items or nbytes >= self._max_pending_bytes

    def _stalled(self, starving: "RankInput") -> DispatchStalledError:
        return DispatchStalledError(
            f"dispatching stalled: worker {self.rank} has not asked for the {len(self._pending)} items dealt to it "
            "since its last frame (the trainer has not taken its outputs) "
            f"while worker {starving.rank} waits for input. "
            "In order (in_order=True) the trainer takes one output of each worker in turn, so each worker's outputs "
            "must keep pace with the items dealt to it: a filter, or another DataPipe that yields fewer items than it "
            "takes, after sharding_round_robin_dispatch stalls it. Pass in_order=False, or move that DataPipe before "
            "the dispatch point"
        )

    def _flush(self) -> None:
        """Frame what credit allows (each packs up to a frame's bounds), then END_OF_INPUT, for
        the sender (woken through ``cond``)."""
        if self._cancelled or self._discard:
            return
        queued = len(self._outgoing)
        while self.credits > 0 and self._pending:
            items: List[EncodedItem] = []
            nbytes = 0
            while self._pending and len(items) < self._max_items and nbytes < self._max_bytes:
                item = self._pending.popleft()
                items.append(item)
                nbytes += item.nbytes
                if self._replay_items:
                    self._replay_items -= 1
                    self._replay_bytes -= item.nbytes
            self._pending_bytes -= nbytes
            self.credits -= 1
            self._outgoing.append(Items(self.epoch, self._sequence, items))
            self._sequence += 1
            self.items_sent += len(items)
        if self._done and not self._pending and not self._ended:
            self._ended = True
            self._outgoing.append(EndOfInput(self.epoch, self.items_sent))
        if len(self._outgoing) > queued:
            self._cond.notify_all()  # the sender, and a dispatcher waiting for room

    def take(self) -> Optional[Tuple[Message, Callable[[Message], None]]]:
        """The next message to send and the session's send for it (None: nothing is due).

        One sender at a time: messages leave in the order taken."""
        with self._cond:
            if not self._outgoing:
                return None
            return self._outgoing.popleft(), self._send

    def drain(self) -> None:
        """Send every message due, in the calling thread (the sender's job)."""
        while True:
            due = self.take()
            if due is None:
                return
            message, send = due
            send(message)


class Dispatch:
    """One epoch's dispatching: a thread that iterates the dispatching part and deals its items.

    Args:
        datapipe: The dispatching part, seeded for the epoch (by the caller: torch traverses a
            graph under a process-wide hook, one thread at a time).
        inputs: One :class:`RankInput` per worker rank, in rank order.
        on_error: Called with an exception of dispatching (from the thread): one that stops the
            epoch at once. The dispatching part's own ends its input instead (:attr:`failure`).
        item_timeout: Seconds the dispatching part may spend producing one item (None: no limit);
            past that, ``on_error`` gets an :class:`~rpc_reading_service.errors.ItemTimeoutError`
            with the thread's stack (:attr:`timed_out`) and dispatching stops.
        number: The epoch as messages and ``stats()`` count it (from 0).
    """

    def __init__(
        self,
        datapipe: Any,
        inputs: Sequence[RankInput],
        on_error: Callable[[BaseException], None],
        item_timeout: Optional[float] = None,
        number: int = 0,
    ):
        self.datapipe = datapipe
        self.inputs = list(inputs)
        for rank_input in self.inputs:
            rank_input.peers = self.inputs
        self._on_error = on_error
        self._item_timeout, self.number = item_timeout, number
        #: The epoch's dispatching threads: the dispatcher, the sender, the item_timeout watch.
        self.tasks = TaskGroup(f"the dispatching of epoch {number}")
        self._stopped = self.tasks.stopping
        #: When the thread started on the item it pulls from the dispatching part (None: not pulling).
        self._pulling_since: Optional[float] = None
        #: The error reported when the dispatching part spent longer than ``item_timeout`` on one item.
        self.timed_out: Optional[ItemTimeoutError] = None
        #: Items taken from the dispatching part so far this epoch.
        self.pulled = 0
        #: The exception the dispatching part raised (it ended the epoch's input there), if it did.
        self.failure: Optional[BaseException] = None
        self.epoch = self.inputs[0].epoch if self.inputs else None
        self._thread: Optional[threading.Thread] = None
        if self.inputs:
            assert all(rank_input.cond is self.inputs[0].cond for rank_input in self.inputs), "ranks share one cond"

    def start(self) -> None:
        """Start the dispatcher thread, the sending thread and the item_timeout watch."""
        self._thread = self.tasks.start(f"dispatch-{self.epoch}", self._run)
        if self.inputs:
            self.tasks.start(f"dispatch-send-{self.epoch}", self._send_loop)
        if self._item_timeout is not None:
            self.tasks.start(f"dispatch-watch-{self.epoch}", self._watch)

    def stop(self) -> None:
        """Stop dealing (a new epoch, an early exit, shutdown): nothing more is sent once this
        returns, but a frame already on its way out (the channel drops it once the next epoch
        started). The thread ends at the next item it takes (one blocked in the dispatching part's
        own code ends when that returns); the sending thread after the send it is in.
        """
        self._stopped.set()
        for rank_input in self.inputs:
            rank_input.cancel()

    @property
    def waits(self) -> int:
        """Times the dispatcher blocked for lack of a worker's credit this epoch."""
        return sum(rank_input.waits for rank_input in self.inputs)

    def input_sink(self, rank: int) -> Callable[[Any], None]:
        """The handler of the events of rank ``rank``'s current session that concern its
        input (called from its receiver): ITEM_CREDIT grants, END_OF_SHARD, SHARD_FAILED and ITEM_TIMED_OUT end it."""
        rank_input = self.inputs[rank]
        session = rank_input.session

        def handle(event: Any) -> None:
            if isinstance(event, ItemCredit):
                rank_input.grant(event.epoch, event.credits, session)
            elif isinstance(event, (EndOfShard, ShardFailed, ItemTimedOut)):
                rank_input.shard_ended(event.epoch, session)

        return handle

    def join(self, timeout: float) -> bool:
        """Join the epoch's dispatching threads, all within ``timeout``; True if they ended (or never started).

        A thread left other than the dispatcher (a send stuck on a worker that stopped reading)
        is logged with its stack; the dispatcher is the caller's to report (:attr:`dispatcher_alive`)."""
        stuck = self.tasks.join(timeout, report=False)
        others = [thread for thread in stuck if thread is not self._thread]
        if others:  # they run no user code: a moment more, then reported
            self.tasks.join(max(timeout, _HELPERS_JOIN_SECONDS), others)
        return not stuck

    @property
    def dispatcher_alive(self) -> bool:
        """Whether the dispatcher thread runs (after :meth:`stop`: stuck in the dispatching part's own code)."""
        return self._thread is not None and self._thread.is_alive()

    def stack(self) -> str:
        """The dispatcher thread's Python stack now (formatted), for messages."""
        return thread_stack(self._thread.ident if self._thread is not None else None, "(the dispatcher thread ended)")

    def _watch(self) -> None:
        """The item_timeout check: a dispatching part stuck on one item is reported, with its stack."""
        limit = self._item_timeout
        assert limit is not None
        thread = self._thread
        assert thread is not None
        while not self._stopped.wait(min(1.0, limit / _ITEM_CHECKS_PER_TIMEOUT)) and thread.is_alive():
            since = self._pulling_since
            if since is None or time.monotonic() - since <= limit:
                continue
            stack, position = self.stack(), self.pulled
            self.timed_out = ItemTimeoutError(
                f"the dispatching part (the DataPipes before sharding_round_robin_dispatch, run in the trainer's "
                f"thread {thread.name}) spent more than {limit} s (item_timeout) producing its item {position} "
                f"in epoch {self.number}; dispatching stopped. It was here:\n{stack}"
                "Fix what blocks there, or raise item_timeout if items legitimately take that long",
                position=position,
                stack=stack,
            )
            log.warning("%s", self.timed_out)
            self.stop()
            self._on_error(self.timed_out)
            return

    def _send_loop(self) -> None:
        """The sending thread: every rank's messages, in turns (one message a rank), until stopped."""
        inputs, count, turn = self.inputs, len(self.inputs), 0
        cond = inputs[0].cond
        while True:
            due = None
            with cond:
                while due is None:
                    if self._stopped.is_set():
                        return
                    for offset in range(count):
                        due = inputs[(turn + offset) % count].take()
                        if due is not None:
                            turn = (turn + offset + 1) % count
                            break
                    else:
                        cond.wait()
            message, send = due
            try:
                send(message)  # the channel reports a lost session itself
            except Exception:  # noqa: BLE001 - one session's fault must not stop the others' input
                log.exception("sending %s of epoch %s failed", message.kind.name, self.epoch)

    def _run(self) -> None:
        encode = ItemEncoder().encode
        try:
            items, index = self._pull_from(self.datapipe), 0
            for item in items:
                if self._stopped.is_set():
                    return
                self.pulled = index + 1
                if not self._deal(index, encode(item)):
                    return
                index += 1
        except BaseException as exc:  # noqa: BLE001 - the trainer must hear of it, never wait in silence
            if not self._stopped.is_set():
                log.info("dispatching failed after %d items: %s", self.pulled, type(exc).__name__)
                self._on_error(exc)
            return
        self._finish()

    def _pull_from(self, datapipe: Any) -> Iterator[Any]:
        """The dispatching part's items; an exception it raises ends them, kept in :attr:`failure`
        (raised once the workers delivered the items before it). Tells the item_timeout check
        when it works on an item."""
        clock = time.monotonic
        try:
            self._pulling_since = clock()
            for item in datapipe:
                self._pulling_since = None
                yield item
                self._pulling_since = clock()
        except Exception as exc:  # noqa: BLE001 - the user's graph: any exception
            if not self._stopped.is_set():
                log.info("the dispatching part raised %s after %d items", type(exc).__name__, self.pulled)
                self.failure = exc
        finally:
            self._pulling_since = None

    def _deal(self, index: int, item: EncodedItem) -> bool:
        """Hand on item ``index`` (False: stop): round-robin, item k to rank k % n."""
        return self.inputs[index % len(self.inputs)].deal(item)

    def _finish(self) -> None:
        """Every item was dealt."""
        for rank_input in self.inputs:
            rank_input.finish()


class UnitDispatch(Dispatch):
    """``"dynamic"`` with a dispatch point: the dispatching part's items kept by index, as units
    the epoch's merger leases to whichever worker has room (one dispatched item is one unit).

    The thread pulls items ahead of the leases, up to :attr:`limit` (the merger keeps it a few
    leases per worker ahead, within its lease window). With reassignment an item stays until
    :meth:`advance` says every unit below was delivered (a lost worker's units are sent again).
    ``notify()`` (from the thread) wakes the merger after :meth:`want`: more items, or the end.
    """

    def __init__(
        self,
        datapipe: Any,
        epoch: int,
        on_error: Callable[[BaseException], None],
        notify: Callable[[], None],
        limit: int,
        max_items: int,
        max_bytes: int,
        item_timeout: Optional[float] = None,
        number: int = 0,
    ):
        super().__init__(datapipe, [], on_error, item_timeout, number)
        self.epoch = epoch
        #: The bounds of one ITEMS frame (the session's packing bounds).
        self.max_items, self.max_bytes = max_items, max_bytes
        self._notify = notify
        self._cond = threading.Condition()
        self._items: Dict[int, EncodedItem] = {}
        self._released = 0
        #: Items pulled so far; their number in all once the dispatching part ended (else None).
        self.produced = 0
        self.total: Optional[int] = None
        #: No item at or past this index is pulled yet.
        self.limit = limit
        self._wanted = False

    def _deal(self, index: int, item: EncodedItem) -> bool:
        with self._cond:
            while index >= self.limit and not self._stopped.is_set():
                self._cond.wait()
            if self._stopped.is_set():
                return False
            self._items[index] = item
            self.produced = index + 1
            wanted, self._wanted = self._wanted, False
        if wanted:
            self._notify()
        return True

    def _finish(self) -> None:
        with self._cond:
            self.total = self.produced
            self._wanted = False
        self._notify()

    def item(self, index: int, keep: bool = True) -> EncodedItem:
        """Unit ``index``'s item (pulled, not released); ``keep=False`` forgets it (no lost worker's
        units are ever sent again: ``on_worker_failure="raise"``)."""
        return self._items[index] if keep else self._items.pop(index)

    def want(self, seen: int) -> None:
        """The merger has leased every unit below ``seen`` and wants more: notify once there are."""
        with self._cond:
            ready = self.produced > seen or self.total is not None
            self._wanted = not ready
        if ready:
            self._notify()

    def advance(self, limit: int, released: int) -> None:
        """Pull up to ``limit``; forget the items below ``released`` (every unit there was delivered)."""
        if limit <= self.limit and released <= self._released:
            return  # the usual case (called at every top-up): no lock; only the merger moves them
        with self._cond:
            if limit > self.limit:
                self.limit = limit
                self._cond.notify_all()
            while self._released < released:
                self._items.pop(self._released, None)
                self._released += 1

    def credit_sink(self, channel: Any) -> Callable[[Any], None]:
        """The input-event handler of ``channel`` (a WorkerChannel): notify when its ITEM_CREDIT
        ends a time without credit (the merger leases only what credit lets it send)."""

        def handle(event: Any) -> None:
            if isinstance(event, ItemCredit) and event.epoch == self.epoch and channel.protocol.item_credits == event.credits:
                self._notify()

        return handle

    def stop(self) -> None:
        """Stop pulling (a new epoch, an early exit, shutdown)."""
        super().stop()
        with self._cond:
            self._items.clear()
            self._cond.notify_all()
