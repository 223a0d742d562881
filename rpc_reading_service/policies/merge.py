"""Merging the workers' streams into one epoch: round-robin or as completed, and the epoch's progress.

The consumer side of the :class:`~rpc_reading_service.trainer.channel.WorkerChannel` events: a
frame grants its worker a credit again once its last item is handed on (so the trainer holds at
most the credit window, and a consumer that keeps items never holds up a credit), and
:class:`EpochProgress` records how many items of each worker's shard were handed on (what a
checkpoint stores).
"""

from __future__ import annotations

import collections
import itertools
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Iterator, List, Optional, Sequence, Set, Tuple

from ..trainer.channel import (
    ChannelClosed,
    ChannelStats,
    Event,
    Failure,
    FrameReceived,
    SessionLost,
    ShardEnded,
    WorkerChannel,
    slow_frame,
)
from ..errors import ItemUnpicklingError, RemoteProtocolError, WorkerLostError
from ..protocol import decode_data_parts
from ..frame_items import loads_payloads
from ..serialization import exception_summary
from ..safe_text import printable

__all__ = [
    "EpochProgress",
    "ReplaceFn",
    "RUN_MAX_ITEMS",
    "flatten_runs",
    "iterate_in_order",
    "iterate_as_completed",
    "runs_in_order",
    "runs_as_completed",
]

#: At most this many items in one run (:func:`runs_in_order`): a checkpoint gives back the items
#: of a run not handed on yet from ``EpochProgress.recent`` (1024 ranks), with room to spare.
RUN_MAX_ITEMS = 256


@dataclass
class _Cursor:
    channel: WorkerChannel
    pending: Deque[Any] = field(default_factory=collections.deque)
    #: The credit of the frame ``pending`` holds, owed once its last item is handed on: its bytes,
    #: whether it was a slow one and its items (None: nothing owed).
    owed: Optional[Tuple[int, bool, int]] = None

    def settle(self, epoch: int) -> None:
        """Give the frame's credit back if all its items were handed on (called at the consumer's
        next request: the layers above let go of the item before by then, a consumer that keeps
        items asks for the next one anyway)."""
        if not self.pending and self.owed is not None:
            self.channel.grant(epoch, *self.owed)
            self.owed = None


def next_frame(event_source: "queue.SimpleQueue[Event]", progress: EpochProgress, stats: Optional[ChannelStats] = None) -> Event:
    """The next event of this epoch from ``event_source`` (a frame, a loss or a close), dropping stale frames."""
    epoch = progress.epoch
    while True:
        event = progress.wait(event_source, stats)
        if isinstance(event, (SessionLost, ChannelClosed)) or event.epoch == epoch:
            return event
        # A stale frame of an abandoned epoch: drop it.


def report_held_losses(channels: Sequence[WorkerChannel], events: "queue.SimpleQueue[Event]") -> None:
    """Queue the losses held back from an earlier epoch (a worker lost after its stream ended there)."""
    for channel in channels:
        if channel.held_loss is not None:
            events.put(channel.held_loss)
            channel.held_loss = None


def take_items(event: Event, epoch: int, cursor: Optional[_Cursor] = None) -> List[Any]:
    """Return the unpickled items of a current-epoch event, raising for errors and lost workers;
    the frame's credit goes back now, or with ``cursor``, once its last item is handed on
    (:meth:`_Cursor.settle`: the items go to its ``pending``)."""
    if isinstance(event, Failure):
        raise event.error
    if isinstance(event, FrameReceived):
        frame = event.frame
        try:
            _epoch, _sequence, payloads, buffers = decode_data_parts(frame)
        except RemoteProtocolError as exc:  # its item table, read here and not by the receiver
            channel = event.channel
            raise WorkerLostError(f"{channel.name} broke the session protocol: {exc}", channel.rank, channel.address) from exc
        nbytes = frame.nbytes
        owed = (nbytes, slow_frame(len(payloads), nbytes), len(payloads))
        if cursor is None or not payloads:
            event.channel.grant(epoch, *owed)
        else:
            cursor.owed = owed
        event.channel.stats.items += len(payloads)
        try:
            return loads_payloads(payloads, buffers)
        except Exception as exc:  # noqa: BLE001 - whatever an item's rebuild raises, say whose item it was
            raise unreadable_items(event.channel, exc) from exc
    return []


def unreadable_items(channel: WorkerChannel, exc: Exception) -> ItemUnpicklingError:
    """The error of a DATA frame of ``channel``'s worker whose items this trainer cannot unpickle (``exc``)."""
    cause = printable(exception_summary(exc), limit=300)
    return ItemUnpicklingError(
        f"{channel.name} sent an item this trainer cannot unpickle ({cause}): every "
        "class of an item must be importable here, from the same versions of its modules as on the worker",
        channel.rank, channel.address,
    )  # fmt: skip


@dataclass
class EpochProgress:
    """How far the trainer has consumed one epoch: what a checkpoint records, and stall time."""

    epoch: int
    consumed: List[int]
    next_rank: int = 0
    finished: bool = False
    started: float = field(default_factory=time.perf_counter)
    ended: Optional[float] = None
    wait_seconds: float = 0.0
    #: Of ``wait_seconds``, the wait for the epoch's first item (sessions setting up, graphs starting).
    startup_wait: float = 0.0
    #: Items handed on, and the worker rank of the latest ones: trainer-side DataPipes after
    #: the stream (fullsync prefetches one item) may hold some that a checkpoint gives back.
    yielded: int = 0
    recent: Deque[int] = field(default_factory=lambda: collections.deque(maxlen=1024), repr=False)
    #: Items the training loop received (counted at the end of the trainer's graph), when the
    #: graph has trainer-side DataPipes; and whether that graph ended the epoch.
    delivered: Optional[int] = None
    delivered_all: bool = False
    #: Ranks whose session ended before the epoch (a drained session's take-over, its chunks
    #: delivered): no longer sessions of the run.
    left: Set[int] = field(default_factory=set)
    def __post_init__(self) -> None:
        self._resumed_at = sum(self.consumed)  # a resumed epoch starts with the checkpoint's positions
        #: The run being handed on (:meth:`count_run`): its items not handed on yet, last first, and
        #: its iterator's turns (one per item: emptied, the iterator ends).
        self._run: List[Any] = []
        self._turns: List[int] = []
        self._dropped = 0  # items of a dropped run (:meth:`drop_run`): counted, never handed on

    @property
    def ahead(self) -> int:
        """Of ``yielded``, items counted with their run (:meth:`count_run`) and not handed on yet."""
        return len(self._run) + self._dropped

    def count(self, rank: int, next_rank: Optional[int] = None) -> None:
        """Record one item of worker ``rank`` handed on (hot path: no lock, see :meth:`positions`)."""
        self.consumed[rank] += 1
        if next_rank is not None:
            self.next_rank = next_rank
        self.recent.append(rank)
        self.yielded += 1  # last: positions() checks it against the sum of ``consumed``

    def count_run(self, ranks: Sequence[int], rounds: int, items: List[Any], next_rank: Optional[int] = None) -> Iterator[Any]:
        """Record a run of ``items`` before it is handed on (``rounds`` turns of ``ranks``, one item
        each) and return the iterator that hands them on: each item leaves the run (and the run
        lets go of it) as it is handed on, with no Python call per item; ``ahead`` counts the rest."""
        consumed = self.consumed
        for rank in ranks:
            consumed[rank] += rounds
        if next_rank is not None:
            self.next_rank = next_rank
        self.recent.extend(ranks if rounds == 1 else list(ranks) * rounds)
        items.reverse()
        # Not iter(items.pop, end mark): that compares every item with the mark (a tensor's == with
        # another object costs ~40 us). A list iterator over the turns stops once they are cleared.
        self._run, self._turns = items, [-1] * len(items)
        self.yielded += len(items)  # last, as in count()
        return map(items.pop, self._turns)

    def drop_run(self) -> None:
        """Let go of the items of the run not handed on yet: its iterator ends (a superseded
        epoch's); they still count as not handed on (``ahead``)."""
        self._turns.clear()
        self._dropped += len(self._run)
        self._run.clear()

    @property
    def undelivered(self) -> int:
        """Items counted that the training loop has not received (yet to be handed on, or held
        by trainer-side DataPipes)."""
        delivered = self.delivered
        return self.ahead if delivered is None else self.yielded - delivered

    def _snapshot(self) -> Tuple[List[int], int, List[int], int, int]:
        # The iterating thread may count while another one checkpoints: copy until the copy is
        # consistent. count() updates consumed, then recent, then yielded; copying in the
        # reverse order and checking yielded around it catches any interleaving.
        while True:
            yielded, ahead, undelivered = self.yielded, self.ahead, self.undelivered
            recent = list(self.recent)
            next_rank = self.next_rank
            consumed = list(self.consumed)
            if sum(consumed) - self._resumed_at == yielded == self.yielded:
                return consumed, next_rank, recent, ahead, undelivered

    def handed_on(self) -> List[int]:
        """Items of each worker's shard handed on (``consumed`` less a run not handed on yet)."""
        consumed, _next_rank, recent, ahead, _undelivered = self._snapshot()
        for rank in recent[len(recent) - ahead :]:
            consumed[rank] -= 1
        return consumed

    def positions(self) -> Tuple[List[int], int]:
        """``(consumed, next_rank)`` as of the last item the training loop received."""
        consumed, next_rank, recent, _ahead, undelivered = self._snapshot()
        if not 0 <= undelivered <= len(recent):
            raise RuntimeError(
                f"cannot checkpoint: the trainer-side DataPipes after the workers' part took {self.yielded} items and "
                f"passed on {self.delivered}; a checkpoint needs them to pass items one for one (as fullsync and "
                f"pin_memory do) and to hold at most {len(recent)}"
            )
        for rank in reversed(recent[len(recent) - undelivered :]):
            consumed[rank] -= 1  # taken from worker ``rank`` but not delivered: replay it
            next_rank = rank
        return consumed, next_rank

    def wait(self, source: "queue.SimpleQueue[Event]", stats: Optional[ChannelStats] = None) -> Event:
        """Take the next event from ``source``, counting the time blocked as data stall."""
        if not source.empty():  # most events wait already: no stall to time (two clock reads per item)
            return source.get()
        start = time.perf_counter()
        event = source.get()
        waited = time.perf_counter() - start
        self.wait_seconds += waited
        if not self.yielded:
            self.startup_wait += waited
        if stats is not None:
            stats.wait_seconds += waited
        return event

    def finish(self) -> None:
        """Mark the epoch as fully consumed."""
        self.finished = True
        self.ended = time.perf_counter()

    @property
    def elapsed(self) -> float:
        """Seconds since the epoch started (until it ended)."""
        return (self.ended or time.perf_counter()) - self.started


ReplaceFn = Callable[[WorkerChannel, WorkerLostError], WorkerChannel]


def _take_or_replace(cursor: "_Cursor", event: Event, epoch: int, replace: Optional[ReplaceFn]) -> None:
    try:
        cursor.pending.extend(take_items(event, epoch, cursor))
    except WorkerLostError as exc:
        if replace is None:
            raise
        # The replacement replays the shard after the consumed items: drop what it resends.
        cursor.pending.clear()
        cursor.owed = None
        cursor.channel = replace(cursor.channel, exc)


def _whole_turns(ring: Sequence[_Cursor]) -> int:
    """Whole turns over ``ring`` its cursors' pending items hold (the fewest any holds); at most
    one as soon as one cursor holds at most one: a slow stage's frames hold one item each, and
    the ring's other cursors are not looked at (no cost per session per item)."""
    rounds = len(ring[0].pending)
    if rounds > 1:
        for each in ring:
            held = len(each.pending)
            if held < rounds:
                rounds = held
                if held <= 1:
                    break
    return rounds


def flatten_runs(runs: Iterator[Iterator[Any]]) -> Iterator[Any]:
    """The items of ``runs`` (the iterators :meth:`EpochProgress.count_run` returns) one at a time."""
    return itertools.chain.from_iterable(runs)


def iterate_in_order(
    channels: Sequence[WorkerChannel], progress: EpochProgress, replace: Optional[ReplaceFn] = None
) -> Iterator[Any]:
    """The items of :func:`runs_in_order`, one at a time."""
    return flatten_runs(runs_in_order(channels, progress, replace))


def runs_in_order(
    channels: Sequence[WorkerChannel], progress: EpochProgress, replace: Optional[ReplaceFn] = None
) -> Iterator[Iterator[Any]]:
    """Yield items round-robin over workers, one item each in turn, in runs; finished workers drop out.

    A run is as many whole turns as every worker's received frame still holds (one item
    when one of them has none yet), counted in ``progress`` at once (:meth:`EpochProgress.count_run`).
    The rotation starts at ``progress.next_rank``. With ``replace``, a lost worker's channel
    is swapped for the one ``replace`` returns.
    """
    epoch, count = progress.epoch, len(channels)
    ring = collections.deque(_Cursor(channels[(progress.next_rank + k) % count]) for k in range(count))
    handed: Sequence[_Cursor] = ()  # where the items handed on last came from
    while ring:
        for last in handed:
            last.settle(epoch)
        cursor = ring[0]
        while not cursor.pending:
            event = next_frame(cursor.channel.queue, progress, cursor.channel.stats)
            if isinstance(event, ShardEnded):
                break
            _take_or_replace(cursor, event, epoch, replace)
        if not cursor.pending:
            ring.popleft()
            handed = ()
            continue
        rounds = _whole_turns(ring)
        if rounds <= 1:  # another worker's next frame is not taken yet: one item, as its turn comes
            ring.rotate(-1)
            handed = (cursor,)
            yield progress.count_run((cursor.channel.rank,), 1, [cursor.pending.popleft()], ring[0].channel.rank)
            continue
        handed = tuple(ring)
        rounds = min(rounds, max(1, RUN_MAX_ITEMS // len(handed)))
        if len(handed) == 1:
            run = [cursor.pending.popleft() for _ in range(rounds)]
            yield progress.count_run((cursor.channel.rank,), rounds, run, cursor.channel.rank)
            continue
        run = [each.pending.popleft() for _ in range(rounds) for each in handed]
        yield progress.count_run([each.channel.rank for each in handed], rounds, run, cursor.channel.rank)
    progress.finish()


def iterate_as_completed(
    channels: Sequence[WorkerChannel],
    events: "queue.SimpleQueue[Event]",
    progress: EpochProgress,
    replace: Optional[ReplaceFn] = None,
    reassign: bool = True,
) -> Iterator[Any]:
    """The items of :func:`runs_as_completed`, one at a time."""
    return flatten_runs(runs_as_completed(channels, events, progress, replace, reassign))


def runs_as_completed(
    channels: Sequence[WorkerChannel],
    events: "queue.SimpleQueue[Event]",
    progress: EpochProgress,
    replace: Optional[ReplaceFn] = None,
    reassign: bool = True,
) -> Iterator[Iterator[Any]]:
    """Yield items in arrival order from a queue shared by all channels, a frame's items as one
    run (counted in ``progress`` at once).

    A worker lost after its shard ended is reported at the next epoch, which needs it (as
    in order, where its own queue keeps the loss): this epoch has every one of its items;
    with ``reassign`` (a failed worker is replaced, too) it is replaced at once.
    """
    epoch = progress.epoch
    current = {channel.rank: _Cursor(channel) for channel in channels}
    report_held_losses(channels, events)
    finished: set[int] = set()  # ranks whose END_OF_SHARD arrived
    while len(finished) < len(current):
        event = next_frame(events, progress)
        cursor = current.get(event.channel.rank)
        if cursor is None or event.channel is not cursor.channel:
            continue  # left over from a replaced (or retired) channel
        held = cursor.channel.rank in finished and (replace is None or not reassign)
        if isinstance(event, SessionLost) and held:
            cursor.channel.held_loss = event
            continue
        if isinstance(event, ShardEnded):
            # A worker lost after its END is replaced too, and its replacement (which skips
            # the whole shard) ends it again: count every rank once.
            finished.add(cursor.channel.rank)
            continue
        _take_or_replace(cursor, event, epoch, replace)
        pending = cursor.pending
        while pending:
            run = [pending.popleft() for _ in range(min(len(pending), RUN_MAX_ITEMS))]
            yield progress.count_run((cursor.channel.rank,), len(run), run)
            cursor.settle(epoch)  # at the next request
    progress.finish()
