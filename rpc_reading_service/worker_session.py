"""One trainer session on a worker: graph setup, epochs, packing and credit-bound streaming.

A driver of :class:`~rpc_reading_service.protocol.WorkerProtocol`: every frame received goes
through the state machine, which decides what it means (or that the trainer broke a rule),
and every frame sent is first recorded by it. Threads (all in the session's own process
when the server forks sessions), the fewest that let graph compute overlap sending:

- the control loop (the caller of :meth:`WorkerSession.run`) moves the trainer's frames into
  the state machine and hands the events to the :class:`Outbox` and the producers; it
  sleeps in ``recv`` until a frame comes (or the connection closes);
- a producer per epoch, only while the epoch runs, iterates the graph and pickles items
  into the :class:`Outbox` (it waits for the previous epoch's producer: a graph supports
  one iterator at a time); in a dispatched epoch the graph's source is the :class:`Inbox`
  of the items the trainer deals to this worker in ITEMS frames, which the control loop
  fills and the worker asks for with ITEM_CREDIT (one per frame it takes: at most the
  epoch's credit window waits here);
- one sender, the only thread that sends after setup, writes packed DATA frames while it
  holds credits, and the heartbeats the state machine finds due; it also notices a silent
  trainer and, with ``item_timeout``, ends the session with an ERROR (the item's position
  and the producer's stack) when the producer spends longer than that on one item. At
  rest it wakes once per heartbeat. Graph compute overlaps sending and the trainer's
  memory stays bounded.

One lock guards the state machine and the outbox together, so that what the state machine
allows and what the outbox hands out never disagree.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from torchdata.datapipes.iter import IterDataPipe

from .version import __version__
from .errors import FrameTooLargeError, RemoteProtocolError
from .graph import WorkerGraphSeeds, prepare_worker_graph, reset_worker_graph, seed_chunk
from .protocol import (
    Buffer,
    ChunkDone,
    Close,
    Credit,
    Data,
    EncodedItem,
    EndOfInput,
    EndOfShard,
    Error,
    ItemCredit,
    Items,
    Join,
    Lease,
    Message,
    PeerTimedOut,
    Ready,
    SessionOptions,
    Setup,
    StartEpoch,
    StopEpoch,
    WorkerProtocol,
    credit_batch,
)
from .selection import LeaseInbox, SelectionContext, SelectionFilter
from .serialization import ItemEncoder, fallback_exception_info, loads_graph, loads_item, pack_exception
from .transports.base import Connection, PeerLostError
from .transports.shared_memory import copy_into_segment

__all__ = ["SessionOptions", "Outbox", "Inbox", "DispatchedInput", "WorkerSession"]

log = logging.getLogger(__name__)

#: Seconds a refused session waits for its trainer to read the reason (and stop sending).
REFUSAL_LINGER = 5.0
#: Longest the sender sleeps between looks at the state machine's liveness.
_MAX_SENDER_WAIT = 1.0
#: Looks at the item being produced per ``item_timeout`` (at least one a second).
_ITEM_CHECKS_PER_TIMEOUT = 4
#: Most frames the sender takes for one send (CHUNK_DONEs ride with the DATA behind them).
_FRAMES_PER_SEND = 16
#: Largest slow item a producer sends itself: bigger ones go to the sender thread, so that
#: producing the next item overlaps sending this one.
_INLINE_MAX_BYTES = 64 * 1024

#: A frame that ends an epoch: a message (encoded when it leaves) or chunks already encoded.
FinalFrame = Union[Message, List[Buffer]]


class _Cancelled(Exception):
    """The producer's epoch was superseded or the session is closing."""


class Inbox:
    """The dispatched input of one epoch on a worker: ITEMS frames from the control loop to
    the producer, whose graph iterates it (through :class:`DispatchedInput`).

    ``on_taken(epoch)`` runs each time the producer takes a frame: the session grants the
    trainer one more ITEMS frame then. ``on_wait(True)`` runs when the producer starts waiting
    for a frame, ``on_wait(False)`` when it stops.

    In a leased epoch ("dynamic" with a dispatch point) each item is one unit, leased right
    before its ITEMS frame (:meth:`lease`): with :attr:`unit_hooks` ``(started, done)`` set,
    ``started(unit, skip)`` runs before the unit's item goes into the graph and ``done(unit,
    None)`` when the graph asks for the next input (so every output of the unit was made).
    """

    def __init__(
        self, epoch: int, on_taken: Callable[[int], None], on_wait: Callable[[bool], None] = lambda waiting: None
    ):
        self.epoch = epoch
        self._on_taken = on_taken
        self._on_wait = on_wait
        self._cond = threading.Condition()
        self._frames: Deque[Sequence[EncodedItem]] = collections.deque()
        self._ended = False
        self._cancelled = False
        self._units: Deque[Tuple[int, int]] = collections.deque()
        self.unit_hooks: Optional[Tuple[Callable[[int, int], None], Callable[[int, Optional[int]], None]]] = None

    def lease(self, unit: int, skip: int) -> None:
        """The next item to come is unit ``unit``; its first ``skip`` outputs were already delivered."""
        with self._cond:
            self._units.append((unit, skip))

    def put(self, items: Sequence[EncodedItem]) -> None:
        """Add the items of one ITEMS frame."""
        with self._cond:
            self._frames.append(items)
            self._cond.notify_all()

    def end(self) -> None:
        """END_OF_INPUT arrived: iteration ends after the frames already here."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def cancel(self) -> None:
        """The epoch is over (superseded, stopped, the session closing): the producer stops."""
        with self._cond:
            self._cancelled = True
            self._frames.clear()
            self._cond.notify_all()

    def __iter__(self) -> Iterator[Any]:
        while True:
            with self._cond:
                if not (self._frames or self._ended or self._cancelled):
                    self._on_wait(True)
                    while not (self._frames or self._ended or self._cancelled):
                        self._cond.wait()
                    self._on_wait(False)
                if self._cancelled:
                    raise _Cancelled()
                if not self._frames:
                    return
                items = self._frames.popleft()
                units = [self._units.popleft() for _ in items] if self.unit_hooks is not None else None
            self._on_taken(self.epoch)
            if units is None:
                for item in items:
                    yield loads_item(item)
                continue
            started, done = self.unit_hooks  # type: ignore[misc]
            for item, (unit, skip) in zip(items, units):
                started(unit, skip)
                yield loads_item(item)
                done(unit, None)


class DispatchedInput(IterDataPipe):
    """The source a worker puts where the trainer's dispatching part was cut off (MPRS's
    ``QueueWrapper``): it yields the items of the current epoch's :class:`Inbox`."""

    def __init__(self) -> None:
        self.inbox: Optional[Inbox] = None

    def __iter__(self) -> Iterator[Any]:
        inbox = self.inbox
        if inbox is None:
            raise RuntimeError("a dispatched graph was iterated outside a dispatched epoch")
        yield from inbox

    def __getstate__(self) -> dict:
        return {}  # torchdata traverses graphs by pickling them; the inbox (a lock) stays out

    def __setstate__(self, state: dict) -> None:
        self.inbox = None


class Outbox:
    """Bounded hand-off of packed items from a producer thread to the sender thread.

    The producer fills an open batch; a batch is sealed when it reaches the item or
    byte bound, or when the sender takes it after ``linger`` seconds. An item that comes
    more than ``linger`` after the one before it (a slow, say sleep-bound, stage) is sealed
    at once while the trainer keeps up (two credits or more left): waiting would only delay
    it, and wake the sender twice; a producer that was merely descheduled on a busy host
    must not spend the last credits on one-item frames. With fewer credits left, and the
    trainer owing a CREDIT for the frames it holds (it returns them once half the window is
    due), such an item waits for that CREDIT, which takes it along (:meth:`grant`), without
    waking the sender; nor is the sender woken for items while no credit is left. At most one sealed
    batch waits for credit; past that the producer blocks (backpressure).

    A frame is encoded through ``encode`` (a session passes its state machine's ``send``, which
    checks and records it) while the outbox holds ``lock`` (a session passes the lock of its
    state machine), and written through ``send`` (the connection's ``send_frames``) by
    :meth:`send_next` (the sender thread), or by the producer itself: a slow item sealed alone
    that is small (:data:`_INLINE_MAX_BYTES`) leaves from :meth:`put` when no other send is in
    progress, so that a slow stage costs no wake-up of the sender per item; data that waited for
    credit leaves from the thread that granted it (:meth:`write_taken`). A borrowed item
    (:attr:`~rpc_reading_service.serialization.EncodedItem.borrowed`: large buffers in the
    producer's own memory) is sealed alone and written before its :meth:`put` returns, by the
    producer itself when credit allows, so the graph cannot write that memory while it is
    still to be sent. :attr:`sending` is
    held from encoding frames to writing them: frames leave in the order recorded. The outbox
    counts the trainer's credits only to know when to block: the state machine is what
    enforces them.
    """

    def __init__(
        self,
        options: SessionOptions,
        encode: Callable[[Message], List[Buffer]] = lambda message: message.encode(),
        lock: Optional["threading.RLock"] = None,
        send: Optional[Callable[[List[List[Buffer]]], None]] = None,
    ):
        self._options = options
        self._encode = encode
        self._send = send
        self._cond = threading.Condition(lock)
        #: Held from taking frames (encoding them) to writing them; see the class docstring.
        self.sending = threading.Lock()
        #: The sender waits for :attr:`sending` while the producer writes a frame of its own; the
        #: producer waits for the sealed slot. Only then does taking a frame notify anybody.
        self._sender_waiting = False
        self._producer_waiting = False
        #: Frames a credit let go, taken by :meth:`grant` for its caller to write.
        self._taken: List[List[Buffer]] = []
        self.epoch: Optional[int] = None
        self._credits = 0
        self._open: List[EncodedItem] = []
        self._open_bytes = 0
        self._open_since = 0.0
        #: A slow item opened the batch and waits for credit: sealed without lingering once two credits are there.
        self._open_slow = False
        #: The epoch's credit window (what ``start_epoch`` granted): frames sent and not yet credited back are
        #: ``_window - _credits``.
        self._window = 0
        #: When the producer put the epoch's latest item (None before its first).
        self._last_put: Optional[float] = None
        #: Sealed batches waiting for credit, and markers (CHUNK_DONE) that follow them without credit
        #: (ahead of the open batch, which may still hold their chunks' last items).
        self._sealed: Deque[Union[List[EncodedItem], Message]] = collections.deque()
        #: ITEM_CREDIT to send (a dispatched epoch), and whether the epoch's input is still open.
        self._input_credits = 0
        self._input_open = False
        self._final: Optional[FinalFrame] = None
        self._final_ends_session = False
        #: True once a final frame queued with ``end_session`` has been taken for sending.
        self.session_over = False
        self._sequence = 0
        self._closed = False
        self.items_sent = 0
        self.bytes_sent = 0
        self.credit_wait_seconds = 0.0
        self._credit_wait_since: Optional[float] = None

    def start_epoch(self, epoch: int, credits: int) -> None:
        """Drop whatever belongs to an older epoch and start ``epoch`` with ``credits``."""
        with self._cond:
            self.epoch = epoch
            self._credits = self._window = credits
            self._open, self._open_bytes, self._open_slow = [], 0, False
            self._sealed.clear()
            self._input_credits, self._input_open = 0, True
            self._final = None
            self._final_ends_session = False
            self._sequence = 0
            self._last_put = None
            self._cond.notify_all()

    def stop_epoch(self, epoch: Optional[int] = None) -> None:
        """Cancel ``epoch`` (or the current one): its producer stops at the next item."""
        with self._cond:
            if epoch is None or epoch == self.epoch:
                self.epoch = None
                self._sealed.clear()
                self._open, self._open_bytes, self._open_slow = [], 0, False
                self._final = None
                self._cond.notify_all()

    def grant_input(self, epoch: int, credits: int) -> None:
        """Ask the trainer for ``credits`` more ITEMS frames of ``epoch`` (sent before any DATA)."""
        with self._cond:
            if epoch == self.epoch and self._input_open:
                self._input_credits += credits
                self._cond.notify_all()

    def end_input(self, epoch: int) -> None:
        """The dispatched input of ``epoch`` ended: no more ITEM_CREDIT for it."""
        with self._cond:
            if epoch == self.epoch:
                self._input_credits, self._input_open = 0, False

    def grant(self, epoch: int, credits: int) -> None:
        """Add credits for ``epoch`` (stale grants are ignored)."""
        with self._cond:
            if epoch == self.epoch:
                self._credits += credits
                if not (self._sealed or self._open):
                    return  # nobody waits for it: the sender sleeps on
                if self._send is not None and self._final is None and self.sending.acquire(blocking=False):
                    # Data waited for this credit: the caller writes it (write_taken), the sender sleeps on.
                    self._taken = self._ready_frames([], _FRAMES_PER_SEND, final=False)
                    if self._taken:
                        return
                    self.sending.release()
                self._cond.notify_all()

    def write_taken(self) -> None:
        """Write the frames a :meth:`grant` took (the caller of ``grant``, once it released ``lock``)."""
        frames, self._taken = self._taken, []
        if frames:
            self._write_inline(frames)

    def close(self) -> None:
        """Wake and stop everybody."""
        with self._cond:
            self._closed = True
            self.epoch = None
            self._cond.notify_all()

    # -- producer side ------------------------------------------------------------------------
    def put(self, epoch: int, item: EncodedItem) -> None:
        """Add one item of ``epoch``; blocks while a full batch waits for credit."""
        options = self._options
        frames: Optional[List[List[Buffer]]] = None
        with self._cond:
            self._check(epoch)
            now = time.monotonic()
            slow = self._last_put is not None and now - self._last_put > options.linger
            self._last_put = now
            opened = not self._open
            if opened:
                self._open_since = now
            self._open.append(item)
            self._open_bytes += item.nbytes
            if item.borrowed:
                pass  # sealed alone and written below, before the producer makes its next item
            elif slow and opened and not self._batch_waits() and self._credits >= 2:
                frames = self._take_inline(item)
                if frames is None:
                    self._seal()  # the sender wakes once, for a frame to send
            elif slow and opened and self._credit_owed():
                self._open_slow = True  # the CREDIT the trainer owes takes it along: no wake-up of the sender
            elif opened and self._credits > 0:
                self._cond.notify_all()  # the sender times the linger from now (without credit, grant() does)
            full = len(self._open) >= options.batch_max_items or self._open_bytes >= options.batch_max_bytes
            if full or item.borrowed:
                while self._batch_waits():
                    self._producer_waiting = True
                    self._cond.wait()
                    self._producer_waiting = False
                    self._check(epoch)
                if self._open:  # the sender may have taken it while we waited
                    self._seal(wake=not item.borrowed)
                if item.borrowed:
                    frames = self._take_borrowed()
        if frames is not None:
            self._write_inline(frames)
        if item.borrowed:
            self._until_written(epoch, item)

    def _take_borrowed(self) -> Optional[List[List[Buffer]]]:
        """The frames for the producer to write itself, its borrowed item's among them when
        the trainer's credit allows (no wake-up of the sender); else None, the sender is woken."""
        if self._send is not None and self._credits > 0 and self.sending.acquire(blocking=False):
            frames = self._ready_frames([], _FRAMES_PER_SEND, final=False)
            if frames:
                return frames
            self.sending.release()
        self._cond.notify_all()
        return None

    def _until_written(self, epoch: int, item: EncodedItem) -> None:
        """Return once ``item`` (borrowed: its buffers are the producer's memory) has been written
        out, or dropped unsent with its epoch: only then may the producer make its next item."""
        try:
            with self._cond:
                while any(type(entry) is list and entry and entry[-1] is item for entry in self._sealed):
                    self._producer_waiting = True
                    self._cond.wait()
                    self._producer_waiting = False
                    self._check(epoch)
        finally:
            with self.sending:  # held by whoever took it, from taking it until it is written
                pass

    def _take_inline(self, item: EncodedItem) -> Optional[List[List[Buffer]]]:
        """The frames for the producer to write itself (its item, sealed alone, and what was ready
        before it), holding :attr:`sending`; None when the sender is to write them."""
        if self._send is None or item.nbytes > _INLINE_MAX_BYTES or not self.sending.acquire(blocking=False):
            return None
        self._sealed.append(self._open)
        self._open, self._open_bytes, self._open_slow = [], 0, False
        return self._ready_frames([], _FRAMES_PER_SEND, final=False)

    def _write_inline(self, frames: List[List[Buffer]]) -> None:
        assert self._send is not None
        try:
            self._send(frames)
        finally:
            self.sending.release()
            # Under the lock: a sender that found the write in progress has set the flag and
            # waits by then, so it is never left waiting for a notify that came too early.
            with self._cond:
                if self._sender_waiting:
                    self._cond.notify_all()

    def mark(self, epoch: int, marker: ChunkDone) -> None:
        """Queue ``marker`` (a CHUNK_DONE, which needs no credit) after the sealed batches of ``epoch``.

        The open batch is not sealed for it: the marker leaves ahead of the items still open
        (it carries the chunk's item count, so the trainer knows where the chunk ends in the
        frames that follow), and the next chunk's items join the same batch: a chunk of tiny
        items costs no DATA frame and no wake-up of the sender of its own. A CHUNK_DONE still
        waiting with no batch sealed behind it takes the marker's counts along: one frame for
        the chunks a worker finished since its last send."""
        with self._cond:
            self._check(epoch)
            last = self._sealed[-1] if self._sealed else None
            if isinstance(last, ChunkDone):
                self._sealed[-1] = ChunkDone(
                    epoch, last.chunk, last.counts + marker.counts,
                    last.stream_length if marker.stream_length is None else marker.stream_length,
                )  # fmt: skip
            else:
                self._sealed.append(marker)
            # The walk may now wait for its next lease: that gap says nothing of how fast items
            # come, so the next chunk's first item is not sealed alone as a slow one.
            self._last_put = None
            if not self._open or self._credits <= 0:
                self._cond.notify_all()
            # else the sender wakes within ``linger`` for the open batch and takes the marker with it

    def finish(self, epoch: int, final_frame: FinalFrame, end_session: bool = False) -> None:
        """Queue the frame that ends ``epoch`` (END_OF_SHARD or ERROR) after its data.

        With ``end_session``, nothing more of ``epoch`` is accepted and :attr:`session_over`
        turns true once the frame is taken: the session ends after sending it.
        """
        with self._cond:
            self._check(epoch)  # also refuses a producer after the watchdog ended the session
            self._final = final_frame
            self._final_ends_session = end_session
            self._cond.notify_all()

    def _track_credit_wait(self, now: float) -> None:
        """Account the time data was ready but the trainer had granted no credit."""
        blocked = self._credits == 0 and bool(self._sealed or self._open)
        if blocked and self._credit_wait_since is None:
            self._credit_wait_since = now
        elif not blocked and self._credit_wait_since is not None:
            self.credit_wait_seconds += now - self._credit_wait_since
            self._credit_wait_since = None

    def _credit_owed(self) -> bool:
        """Whether the trainer holds enough of this epoch's frames that it owes a CREDIT without
        more of them (:func:`~rpc_reading_service.protocol.credit_batch`)."""
        return self._window - self._credits >= credit_batch(self._window)

    def _check(self, epoch: int) -> None:
        if self._closed or epoch != self.epoch or self._final_ends_session:
            raise _Cancelled()

    def _batch_waits(self) -> bool:
        """Whether a sealed batch of items waits for credit (markers ahead of the open batch do not count)."""
        return any(not isinstance(entry, Message) for entry in self._sealed)

    def _seal(self, wake: bool = True) -> None:
        """Close the open batch; ``wake``: notify the sender (not when the caller takes it at once)."""
        self._sealed.append(self._open)
        self._open, self._open_bytes, self._open_slow = [], 0, False
        if wake:
            self._cond.notify_all()

    # -- sender side --------------------------------------------------------------------------
    def take(self, timeout: float) -> Optional[List[Buffer]]:
        """Return the next frame to send, or None after ``timeout`` seconds with nothing to send."""
        frames = self._take_for_sending(timeout, 1)
        if frames is None:
            return None
        self.sending.release()
        return frames[0]

    def take_frames(self, timeout: float) -> Optional[List[List[Buffer]]]:
        """The next frame (waiting up to ``timeout`` seconds, None if nothing came) and the ones
        ready right behind it (a CHUNK_DONE after its chunk's DATA, more credited DATA), at most
        :data:`_FRAMES_PER_SEND`, to leave in one send: one wake-up of the trainer instead of several."""
        frames = self._take_for_sending(timeout, _FRAMES_PER_SEND)
        if frames is not None:
            self.sending.release()
        return frames

    def send_next(self, timeout: float) -> bool:
        """Write what :meth:`take_frames` takes through ``send`` (the sender thread's call);
        False when nothing came within ``timeout`` seconds."""
        assert self._send is not None
        frames = self._take_for_sending(timeout, _FRAMES_PER_SEND)
        if frames is None:
            return False
        try:
            self._send(frames)
        finally:
            self.sending.release()
        return True

    def _take_for_sending(self, timeout: float, limit: int) -> Optional[List[List[Buffer]]]:
        """Up to ``limit`` frames once one is ready (None after ``timeout`` seconds), returned
        with :attr:`sending` held for the caller to release once they are written."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                wait = deadline - now
                if not self.sending.acquire(blocking=False):  # the producer writes a frame of its own
                    self._sender_waiting = True
                else:
                    self._sender_waiting = False
                    frame, ready_in = self._next_frame(now)
                    if frame is not None:
                        return self._ready_frames([frame], limit, final=True)
                    self.sending.release()
                    wait = min(wait, ready_in)
                if wait <= 0:
                    return None
                self._cond.wait(wait)
            return None

    def _ready_frames(self, frames: List[List[Buffer]], limit: int, final: bool) -> List[List[Buffer]]:
        """``frames`` and the ones ready behind them, at most ``limit``; with ``final``, also the
        epoch's final frame (then nothing more)."""
        while len(frames) < limit and not self._closed and not self.session_over:
            if not final and self._final is not None:
                break
            frame, _wait = self._next_frame(time.monotonic())
            if frame is None:
                break
            frames.append(frame)
        return frames

    def _wake_producer(self) -> None:
        """The sealed slot got free: wake the producer if it waits for it (only then: a notify
        would also wake the sender)."""
        if self._producer_waiting:
            self._cond.notify_all()

    def _next_frame(self, now: float) -> Tuple[Optional[List[Buffer]], float]:
        if self.epoch is None:
            return None, float("inf")
        if self._input_credits:
            credits, self._input_credits = self._input_credits, 0
            return self._encode(ItemCredit(self.epoch, credits)), 0.0
        self._track_credit_wait(now)
        if self._sealed and isinstance(self._sealed[0], Message):
            if self._open and self._credits > 0 and self._final is None:
                lingered_until = self._open_since + self._options.linger
                if now < lingered_until:  # the marker leaves in one send with the open batch
                    return None, lingered_until - now
            marker = self._sealed.popleft()
            self._wake_producer()
            return self._encode(marker), 0.0
        if self._credits > 0:
            if not self._sealed and self._open:
                if (
                    self._final is not None
                    or (self._open_slow and self._credits >= 2)
                    or now - self._open_since >= self._options.linger
                ):
                    # Taken right below: a notify would only wake the sender to find the send in
                    # progress (twice: it then waits for the write to end), once per frame a CREDIT lets go.
                    self._seal(wake=False)
                else:
                    return None, self._open_since + self._options.linger - now
            if self._sealed:
                items = self._sealed.popleft()
                assert isinstance(items, list)
                self._wake_producer()
                self._credits -= 1
                self.items_sent += len(items)
                self.bytes_sent += sum(item.nbytes for item in items)
                chunks = self._encode(Data(self.epoch, self._sequence, items))
                self._sequence += 1
                return chunks, 0.0
        if self._final is not None and not self._sealed and not self._open:
            final, self._final = self._final, None
            chunks = self._encode(final) if isinstance(final, Message) else final
            self.session_over = self._final_ends_session
            self.epoch = None
            return chunks, 0.0
        return None, float("inf")


class _ThroughputLog:
    """Logs a session's throughput every ``interval`` seconds while it sends data."""

    def __init__(self, outbox: Outbox, peer: str, interval: float):
        self._outbox, self._peer, self._interval = outbox, peer, interval
        self._last = time.monotonic()
        self._items, self._bytes, self._waited = 0, 0, 0.0

    def maybe_log(self) -> None:
        now = time.monotonic()
        if self._interval <= 0 or now - self._last < self._interval:
            return
        outbox, span = self._outbox, now - self._last
        items, sent, waited = outbox.items_sent, outbox.bytes_sent, outbox.credit_wait_seconds
        if items > self._items:
            log.info(
                "session for %s: %.0f items/s, %.1f MB/s, waiting for trainer credit %.0f%% of the time",
                self._peer, (items - self._items) / span, (sent - self._bytes) / span / 1e6,
                min(100.0, 100 * (waited - self._waited) / span),
            )  # fmt: skip
        self._last, self._items, self._bytes, self._waited = now, items, sent, waited


class WorkerSession:
    """Serves one trainer connection until it closes, goes silent, or says CLOSE."""

    def __init__(
        self,
        conn: Connection,
        server_address: str = "",
        idle_timeout: Optional[float] = None,
        stats_interval: float = 30.0,
    ):
        self.conn = conn
        self.server_address = server_address
        self.stats_interval = stats_interval
        self.options = SessionOptions()
        if idle_timeout is not None:  # the server's --idle-timeout: how long to wait for SETUP
            self.options = dataclasses.replace(self.options, setup_timeout=idle_timeout)
        self._lock = threading.RLock()  # around every call of the state machine (and the outbox)
        self.protocol = WorkerProtocol(
            f"trainer at {conn.peer}",
            heartbeat_interval=self.options.heartbeat_interval,
            peer_timeout=self.options.peer_timeout,
            setup_timeout=self.options.setup_timeout,
            lenient=True,
        )
        self.outbox = Outbox(self.options, self.protocol.send, self._lock, self._send_frames)
        self._graph: Any = None
        self._worker_info: Any = None
        self._reset_fn: Any = None
        #: How to seed the graph each epoch (None: traverse it each time).
        self._seeds: Optional[WorkerGraphSeeds] = None
        #: The source of dealt items in a dispatched graph, and the current epoch's input.
        self._dispatched_input = DispatchedInput()
        self._inbox: Optional[Inbox] = None
        self._producer: Optional[threading.Thread] = None
        self._sender: Optional[threading.Thread] = None
        #: ``(epoch, position in the shard, monotonic start, thread id)`` while the producer
        #: waits for the graph's next item; None otherwise. Read by the sender (item_timeout).
        self._producing: Optional[Tuple[int, int, float, int]] = None
        #: The item_timeout ERROR once it fired (the session then ends with it).
        self._timed_out: Optional[Error] = None
        self._stopping = threading.Event()
        #: The worker-side selections of the graph (a policy's replacement of sharding_filter).
        self._selections: List[SelectionFilter] = []
        #: The leases of the current epoch, when it is a "dynamic" one.
        self._leases: Optional[LeaseInbox] = None
        self._on_event: Dict[type, Callable[[Any], None]] = {
            StartEpoch: self._start_epoch,
            StopEpoch: self._stop_epoch,
            Credit: lambda message: self.outbox.grant(message.epoch, message.credits),
            Items: self._on_items,
            EndOfInput: self._on_end_of_input,
            Lease: self._lease,
            Close: lambda message: self._stopping.set(),
        }

    # -- the control loop ---------------------------------------------------------------------
    def run(self) -> None:
        """Serve the session; returns when it is over. Never raises for peer or graph faults."""
        try:
            if not self._setup():
                return
            self._sender = threading.Thread(target=self._send_loop, name="rrs-sender", daemon=True)
            self._sender.start()
            self._control_loop()
        except PeerLostError as exc:
            log.info("session with %s ended: %s", self.conn.peer, exc)
        except FrameTooLargeError as exc:
            log.warning("refused a frame from %s: %s; ending its session", self.conn.peer, exc)
            self.conn.refuse(
                f"a frame from this trainer is over the worker server's size limit ({exc}). Start "
                "rpc-reading-worker with a larger --max-frame-bytes, or send less (a smaller graph)",
                REFUSAL_LINGER,
            )
        except RemoteProtocolError as exc:  # a malformed frame, or one the protocol does not allow now
            log.warning("refused a frame from %s: %s; ending its session", self.conn.peer, exc)
            self.conn.refuse(f"refused a malformed frame: {exc}", REFUSAL_LINGER)
        except Exception as exc:  # noqa: BLE001 - a session must never take its server down
            log.exception("session with %s failed", self.conn.peer)
            # E.g. "can't start new thread" at a process limit: the trainer learns why.
            self.conn.refuse(f"the worker session failed: {exc!r} (its traceback is in the worker server's log)")
        finally:
            self._shutdown()

    def _receive(self, frame: Any) -> List[Any]:
        with self._lock:
            return self.protocol.receive_frame(frame)

    def _send(self, message: Message) -> None:
        """Send ``message`` from the control loop (only before the sender starts)."""
        with self._lock:
            chunks = self.protocol.send(message)
        self.conn.send(chunks)

    def _setup(self) -> bool:
        timeout = self.options.setup_timeout
        deadline = time.monotonic() + timeout
        while True:
            # No heartbeats before SETUP: a bootstrapping connection cannot send before its first recv.
            frame = self.conn.recv(timeout=max(0.0, deadline - time.monotonic()))
            if frame is None:
                log.warning("%s sent no SETUP within %.0f s; closing", self.conn.peer, timeout)
                self.conn.refuse(f"no SETUP within {timeout:g} s of connecting (the server's --idle-timeout)")
                return False
            for event in self._receive(frame):
                if isinstance(event, Setup):
                    return self._set_up(event)
                if isinstance(event, Join):
                    self._refuse_join(event)
                    return False
                return False  # CLOSE

    def _set_up(self, setup: Setup) -> bool:
        self.options = setup.options
        self.outbox = Outbox(self.options, self.protocol.send, self._lock, self._send_frames)
        try:
            from torchdata.dataloader2.utils import WorkerInfo

            datapipe, init_fn, self._reset_fn = loads_graph(setup.graph)
            self._worker_info = WorkerInfo(setup.num_workers, setup.worker_rank)
            # Seeds found once, not at every epoch's start; a worker_reset_fn may rebuild the graph.
            prepared = prepare_worker_graph(
                datapipe, self._worker_info, init_fn, self._dispatched_input, find_seeds=self._reset_fn is None
            )
            self._graph, self._selections, self._seeds = prepared.datapipe, prepared.selections, prepared.seeds
        except BaseException as exc:  # noqa: BLE001 - includes SystemExit from user code
            info = _describe(exc)
            log.warning("session setup for %s failed: %s: %s", self.conn.peer, info["type_name"], info["message"])
            self._send(Error(None, "setup", info))
            return False
        self._send(Ready(os.getpid(), socket.gethostname(), __version__))
        return True

    def _refuse_join(self, join: Join) -> None:
        """A bootstrap request of another transport (torch_rpc's rendezvous): say which one to start."""
        message = (
            f"the trainer at {self.conn.peer} uses transport {join.transport!r}, but this worker server at "
            f"{self.server_address or '?'} was started with another --transport (socket, the default): start it with "
            f"`rpc-reading-worker --transport {join.transport}`, or pass the worker's transport to RPCReadingService"
        )
        log.warning("refused the session of %s: %s", self.conn.peer, message)
        self._send(Error(None, "setup", message=message, reason="transport"))

    def _control_loop(self) -> None:
        while not self._stopping.is_set():
            # No timeout: the sender watches liveness, and ends the session by closing the
            # connection, which wakes this recv.
            frame = self.conn.recv()
            if frame is None:
                continue
            try:
                with self._lock:  # the outbox follows the state machine in the same step
                    for event in self.protocol.receive_frame(frame):
                        handler = self._on_event.get(type(event))
                        if handler is not None:
                            handler(event)
            finally:
                self.outbox.write_taken()  # data a CREDIT let go leaves from here: no wake-up of the sender

    def _start_epoch(self, request: StartEpoch) -> None:
        """Start ``request.epoch`` (called with the lock held): its producer, or the report
        of an item of an earlier epoch that got stuck."""
        self.outbox.start_epoch(request.epoch, request.credits)
        self._cancel_input()
        if request.dispatched:
            self._inbox = Inbox(request.epoch, lambda epoch: self.outbox.grant_input(epoch, 1), self._waiting_for_trainer)
            self.outbox.grant_input(request.epoch, max(1, request.credits))
        if self._leases is not None:
            self._leases.cancel()  # the superseded epoch's producer stops waiting for leases
        self._leases = LeaseInbox() if request.leased else None
        if self._timed_out is not None:
            self._report_item_timeout(request.epoch)
            return
        previous = self._producer
        self._producer = threading.Thread(
            target=self._produce, args=(request, previous, self._inbox), name=f"rrs-producer-{request.epoch}",
            daemon=True,
        )  # fmt: skip
        self._producer.start()

    def _stop_epoch(self, message: StopEpoch) -> None:
        self.outbox.stop_epoch(message.epoch)
        if self._inbox is not None and self._inbox.epoch == message.epoch:
            self._cancel_input()

    def _cancel_input(self) -> None:
        """End the dispatched input of the current epoch (its producer stops)."""
        if self._inbox is not None:
            self._inbox.cancel()
            self._inbox = None

    def _on_items(self, message: Items) -> None:
        if self._inbox is not None and self._inbox.epoch == message.epoch:
            self._inbox.put(message.items)

    def _on_end_of_input(self, message: EndOfInput) -> None:
        self.outbox.end_input(message.epoch)
        if self._inbox is not None and self._inbox.epoch == message.epoch:
            self._inbox.end()
        if self._leases is not None:
            self._leases.cancel()

    def _lease(self, message: Lease) -> None:
        """A run of chunks leased for the current epoch (called with the lock held); in a
        dispatched epoch, the units of the next dispatched items."""
        if self._inbox is not None and self._inbox.epoch == message.epoch:
            for unit in message.chunks:
                self._inbox.lease(unit, message.skip if unit == message.chunk else 0)
            return
        if self._leases is None:
            return
        if message.final:
            self._leases.finish()
        else:
            self._leases.add(message.chunk, message.skip, message.count)

    # -- producer -----------------------------------------------------------------------------
    def _produce(self, request: StartEpoch, previous: Optional[threading.Thread], inbox: Optional[Inbox]) -> None:
        epoch, sent = request.epoch, 0
        leases = self._leases if request.leased else None
        # The graph supports one iterator at a time: wait for the old epoch's producer to
        # reach an item boundary and notice it was cancelled (one stuck in an item never does).
        while previous is not None and previous.is_alive():
            previous.join(timeout=0.1)
            if self._stopping.is_set() or self.outbox.epoch != epoch:
                return
        self._dispatched_input.inbox = inbox
        try:
            try:
                watched = self.options.item_timeout is not None
                if watched:  # worker_reset_fn and the graph's reset count as producing item 0
                    self._producing = (epoch, 0, time.monotonic(), threading.get_ident())
                self._graph = reset_worker_graph(
                    self._graph, self._worker_info, request.seed, request.global_worker_id, self._reset_fn,
                    self._seeds,
                )  # fmt: skip
                skip = request.skip
                # Large buffers go out uncopied from the producer's memory where the send is
                # synchronous (the outbox then writes each one before the next item is made).
                borrow = self.options.batch_max_bytes if self.conn.sends_synchronously else None
                encode, put = ItemEncoder(copy_into_segment, borrow).encode, self.outbox.put
                chunks = _ChunkCount(epoch, request.seed, self.outbox) if leases is not None else None
                context = SelectionContext(request.epoch, request.seed, request.global_worker_id, leases)
                if chunks is not None:
                    context.chunk_started, context.chunk_done = chunks.started, chunks.done
                    if inbox is not None:  # "dynamic" with a dispatch point: a unit is one dispatched item
                        inbox.unit_hooks = (chunks.started, chunks.done)
                for selection in self._selections:
                    selection.set_context(context)
                items = self._graph
                if watched:
                    items, put = self._watched(epoch, iter(self._graph)), self._unwatched(put)
                    if leases is not None:
                        leases.waiting = self._waiting_for_trainer
                for index, item in enumerate(items):
                    if index < skip:
                        continue
                    if chunks is not None and chunks.skip > 0:
                        chunks.skip -= 1  # delivered before the chunk was leased again
                        continue
                    put(epoch, encode(item))
                    sent += 1
                    if chunks is not None:
                        chunks.items += 1
            except _Cancelled:
                raise
            except BaseException as exc:  # noqa: BLE001 - report everything, even SystemExit
                self._producing = None
                info = _describe(exc)
                log.info("epoch %d raised %s: %s after %d items", epoch, info["type_name"], info["message"], sent)
                self.outbox.finish(epoch, Error(epoch, "epoch", info))
                return
            self.outbox.finish(epoch, EndOfShard(epoch, sent))
        except _Cancelled:
            log.debug("epoch %d cancelled after %d items", epoch, sent)
        except BaseException as failure:  # noqa: BLE001 - the epoch must end with an error, never in silence
            log.exception("producer of epoch %d failed in its own error handling", epoch)
            info = fallback_exception_info(None, failure)
            try:
                self.outbox.finish(epoch, Error(epoch, "epoch", info))
            except _Cancelled:
                pass

    def _waiting_for_trainer(self, waiting: bool) -> None:
        """Waiting for the trainer (its next lease, or the items its dispatcher deals, which set
        that pace) is not producing an item: item_timeout does not count it, and the item's
        clock restarts after it."""
        producing = self._producing
        if producing is not None:
            epoch, position, _started, ident = producing
            self._producing = (epoch, position, float("inf") if waiting else time.monotonic(), ident)

    def _watched(self, epoch: int, iterator: Iterator[Any]) -> Iterator[Any]:
        """Yield ``iterator``'s items, telling the item_timeout check (the sender) which one the producer works on
        (computing and pickling it, until :meth:`_unwatched` hands it to the outbox)."""
        ident, clock, index = threading.get_ident(), time.monotonic, 0
        while True:
            self._producing = (epoch, index, clock(), ident)
            try:
                item = next(iterator)
            except StopIteration:
                self._producing = None
                return
            yield item
            index += 1

    def _unwatched(self, put: Callable[[int, EncodedItem], None]) -> Callable[[int, EncodedItem], None]:
        """``put``, first telling the item_timeout check the item is done: waiting for the trainer's
        credit is not producing (the trainer sets that pace)."""

        def put_done(epoch: int, item: EncodedItem) -> None:
            self._producing = None
            put(epoch, item)

        return put_done

    # -- item_timeout -------------------------------------------------------------------------
    def _check_item(self, now: float, limit: float) -> None:
        """End the session when the producer has spent longer than ``limit`` (``item_timeout``)
        on one item (the sender's call, at least every ``limit / _ITEM_CHECKS_PER_TIMEOUT``)."""
        producing = self._producing
        if self._timed_out is not None or producing is None or now - producing[2] <= limit:
            return
        epoch, position, started, ident = producing
        frame = sys._current_frames().get(ident)  # noqa: SLF001 - documented for exactly this use
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(the producer thread is gone)\n"
        seconds = time.monotonic() - started
        log.warning(
            "epoch %d: item %d of the shard took more than %.1f s (item_timeout); ending the session of %s. "
            "The producer's stack:\n%s", epoch, position, limit, self.conn.peer, stack,
        )  # fmt: skip
        with self._lock:
            self._timed_out = Error(
                epoch, "item_timeout", stuck_epoch=epoch, position=position, item_timeout=limit,
                seconds=seconds, stack=stack,
            )  # fmt: skip
            if self.outbox.epoch is not None:  # else the trainer hears of it in the next epoch it starts
                self._report_item_timeout(self.outbox.epoch)

    def _report_item_timeout(self, epoch: int) -> None:
        """Queue the item_timeout error as the end of ``epoch`` (the stuck one, or the one the
        trainer started after it) and of the session (called with the lock held)."""
        assert self._timed_out is not None
        try:
            self.outbox.finish(epoch, dataclasses.replace(self._timed_out, epoch=epoch), end_session=True)
        except _Cancelled:  # the outbox is closing
            pass

    # -- sender -------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        throughput = _ThroughputLog(self.outbox, self.conn.peer, self.stats_interval)
        next_tick, limit = 0.0, self.options.item_timeout
        try:
            while not self._stopping.is_set():
                throughput.maybe_log()
                now = time.monotonic()
                if now >= next_tick:
                    with self.outbox.sending:  # a heartbeat leaves in the order recorded, too
                        with self._lock:
                            due = self.protocol.tick(now)
                        timed_out = any(isinstance(event, PeerTimedOut) for event in due.events)
                        if due.chunks and not timed_out:
                            self.conn.send(due.chunks)
                    if timed_out:
                        log.warning(
                            "trainer %s silent for %.1f s; ending its session", self.conn.peer, self.protocol.peer_timeout
                        )
                        self._end()
                        return
                    next_tick = now + min(due.wait, _MAX_SENDER_WAIT)
                    if limit is not None:
                        self._check_item(now, limit)
                        next_tick = min(next_tick, now + limit / _ITEM_CHECKS_PER_TIMEOUT)
                if not self.outbox.send_next(timeout=max(0.0, next_tick - time.monotonic())):
                    continue
                if self.outbox.session_over:
                    log.info("session for %s ended after its last frame", self.conn.peer)
                    self._end()
                    return
        except PeerLostError as exc:
            log.info("lost trainer %s while sending: %s", self.conn.peer, exc)
            self._end()
        except Exception:  # noqa: BLE001
            log.exception("sender for %s failed", self.conn.peer)
            self._end()

    def _send_frames(self, frames: List[List[Buffer]]) -> None:
        """The outbox's writes (from the sender, or a producer sending a slow item itself): a
        trainer lost meanwhile ends the session."""
        try:
            self.conn.send_frames(frames)
        except PeerLostError as exc:
            log.info("lost trainer %s while sending: %s", self.conn.peer, exc)
            self._end()

    def _end(self) -> None:
        """Stop the session from the sender: the control loop wakes up on the closed connection."""
        self._stopping.set()
        self.conn.close()

    def _shutdown(self) -> None:
        self._stopping.set()
        with self._lock:
            self._cancel_input()
        if self._leases is not None:
            self._leases.cancel()
        self.outbox.close()
        self.conn.close()
        if self._sender is not None:
            self._sender.join(timeout=2.0)


class _ChunkCount:
    """The producer's count of the items of the leased chunk it walks: what CHUNK_DONE reports,
    and how many of the chunk's first items to leave out (delivered before it was leased again)."""

    def __init__(self, epoch: int, seed: int, outbox: Outbox):
        self.epoch, self.seed, self.outbox = epoch, seed, outbox
        self.items = 0
        self.skip = 0

    def started(self, chunk: int, skip: int) -> None:
        """The walk entered leased ``chunk``: its randomness is the chunk's own."""
        self.skip = skip
        seed_chunk(self.seed, chunk)

    def done(self, chunk: int, stream_length: Optional[int]) -> None:
        """``chunk`` is done: its CHUNK_DONE leaves ahead of its items not sent yet."""
        self.outbox.mark(self.epoch, ChunkDone(self.epoch, chunk, (self.items,), stream_length))
        self.items, self.skip = 0, 0


def _describe(exc: BaseException) -> Dict[str, Any]:
    """:func:`pack_exception`, falling back to a description built without user code."""
    try:
        return pack_exception(exc)
    except BaseException as failure:  # noqa: BLE001 - pack_exception is meant to be total; be sure
        return fallback_exception_info(exc, failure)
