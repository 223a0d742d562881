"""A worker session's outbox: the bounded, credit-bound hand-off of packed items from the
producer thread to the sender, which packs them into DATA frames and writes them in order."""

from __future__ import annotations

import collections
import operator
import threading
import time
from typing import Callable, Deque, List, Optional, Tuple, Union

from ..errors import ItemTooLargeError
from ..protocol import (
    Buffer,
    ChunkDone,
    Data,
    EncodedItem,
    ItemCredit,
    Message,
    SessionOptions,
    WorkerProtocol,
    credit_batch,
)
from .inbox import Cancelled

__all__ = ["Outbox", "FinalFrame"]

#: Most frames the sender takes for one send (CHUNK_DONEs ride with the DATA behind them).
_FRAMES_PER_SEND = 16
#: Largest slow item a producer sends itself when the connection has no room: bigger ones go to
#: the sender thread, so that producing the next item overlaps a send that waits.
_INLINE_MAX_BYTES = 64 * 1024
#: While the producer puts items, the sender looks for a batch it left open (a stall) after
#: ``linger``, then twice as long each time it finds the producer still putting, up to this many
#: ``linger`` (docs/architecture.md, "The outbox": each look takes the interpreter lock).
_STALL_LOOKS_MAX_LINGERS = 16

_nbytes = operator.attrgetter("nbytes")

#: A frame that ends an epoch: a message (encoded when it leaves) or chunks already encoded.
FinalFrame = Union[Message, List[Buffer]]


class Outbox:
    """Bounded hand-off of packed items from a producer thread to the sender thread (docs/architecture.md).

    Args:
        options: The session's packing bounds, linger and credits.
        protocol: The session's state machine: it encodes and records each frame, and owns the
            credits and the numbers of DATA frames the outbox reads.
        lock: Held while encoding: the session's state machine's lock.
        send: Writes frames (the connection's ``send_frames``); None: frames are only taken (:meth:`take`).
        room: Whether the connection takes a frame now without blocking (its ``has_room``).
    """

    def __init__(
        self,
        options: SessionOptions,
        protocol: WorkerProtocol,
        lock: Optional["threading.RLock"] = None,
        send: Optional[Callable[[List[List[Buffer]]], None]] = None,
        room: Callable[[], bool] = lambda: True,
    ):
        self._options = options
        self._largest_item = options.largest_item_bytes()
        self._protocol = protocol
        self._send = send
        self._room = room
        lock = lock if lock is not None else threading.RLock()
        #: The sender waits on ``_cond``, the producer on ``_producer_cond`` (one lock): waking one
        #: does not wake the other.
        self._lock = lock
        self._cond = threading.Condition(lock)
        self._producer_cond = threading.Condition(lock)
        #: Held from taking frames (encoding them) to writing them (docs/architecture.md, "The outbox").
        self.sending = threading.Lock()
        #: The sender waits for :attr:`sending` while the producer writes a frame of its own; the
        #: producer waits for the sealed slot. Only then does taking a frame notify anybody.
        self._sender_waiting = False
        self._producer_waiting = False
        #: When the sender, waiting on the condition, wakes on its own (inf: it does not wait): a
        #: batch opened before that, less the longest look for a stall, needs no notify.
        self._sender_wakes_at = float("inf")
        #: How long the sender waits before it looks again for a batch the producer left open.
        self._stall_look = options.linger
        self._stall_look_max = options.linger * _STALL_LOOKS_MAX_LINGERS
        #: Frames a credit let go, taken by :meth:`grant` for its caller to write.
        self._taken: List[List[Buffer]] = []
        self.epoch: Optional[int] = None
        #: The open batch, its bytes in all and pickled in band (both bound a frame), when it opened;
        #: and whether a slow item opened it and waits for credit (sealed without lingering once credit comes).
        self._open: List[EncodedItem] = []
        self._open_bytes = self._open_in_band = 0
        self._open_since = 0.0
        self._open_slow = False
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
        self._closed = False
        self.items_sent = 0
        self.bytes_sent = 0
        self.credit_wait_seconds = 0.0
        self._credit_wait_since: Optional[float] = None

    def start_epoch(self, epoch: int) -> None:
        """Drop whatever belongs to an older epoch and start ``epoch`` (its START_EPOCH just recorded)."""
        with self._lock:
            self.epoch = epoch
            self._new_batch()
            self._sealed.clear()
            self._input_credits, self._input_open = 0, True
            self._final = None
            self._final_ends_session = False
            self._last_put = None
            self._wake_all()

    def stop_epoch(self, epoch: Optional[int] = None) -> None:
        """Cancel ``epoch`` (or the current one): its producer stops at the next item."""
        with self._lock:
            if epoch is None or epoch == self.epoch:
                self.epoch = None
                self._sealed.clear()
                self._new_batch()
                self._final = None
                self._wake_all()

    def grant_input(self, epoch: int, credits: int) -> None:
        """Ask the trainer for ``credits`` more ITEMS frames of ``epoch`` (sent before any DATA)."""
        with self._lock:
            if epoch == self.epoch and self._input_open:
                self._input_credits += credits
                self._cond.notify_all()

    def end_input(self, epoch: int) -> None:
        """The dispatched input of ``epoch`` ended: no more ITEM_CREDIT for it."""
        with self._lock:
            if epoch == self.epoch:
                self._input_credits, self._input_open = 0, False

    def grant(self, epoch: int) -> None:
        """The state machine just recorded a CREDIT for ``epoch``: let the data waiting for it go."""
        with self._lock:
            if epoch == self.epoch:
                if not (self._sealed or self._open):
                    return  # nobody waits for it: the sender sleeps on
                if self._send is not None and self._final is None and self.sending.acquire(blocking=False):
                    # Data waited for this credit: the caller writes it (write_taken), the sender sleeps on.
                    self._taken = self._ready_frames([], _FRAMES_PER_SEND, final=False)
                    if self._taken:
                        return
                    self.sending.release()
                    if not self._sealed and self._sender_wakes_at <= time.monotonic() + self._stall_look_max:
                        return  # only a batch still filling: its producer seals it, the sender looks in time
                self._cond.notify_all()

    def write_taken(self) -> None:
        """Write the frames a :meth:`grant` took (the caller of ``grant``, once it released ``lock``)."""
        frames, self._taken = self._taken, []
        if frames:
            self._write_inline(frames)

    def close(self) -> None:
        """Wake and stop everybody."""
        with self._lock:
            self._closed = True
            self.epoch = None
            self._wake_all()

    # -- producer side ------------------------------------------------------------------------
    def put(self, epoch: int, item: EncodedItem) -> None:
        """Add one item of ``epoch``; blocks while a full batch waits for credit. Raises
        ItemTooLargeError for an item no frame the trainer accepts can hold."""
        # The hot path: its checks inline, the lock entered directly (no Condition.__enter__).
        if item.nbytes > self._largest_item:
            raise self._too_large(item.nbytes)
        options = self._options
        frames: Optional[List[List[Buffer]]] = None
        settled = False  # the item's batch written by this call: no wait for it below
        with self._lock:
            if self._closed or epoch != self.epoch or self._final_ends_session:
                raise Cancelled()
            now = time.monotonic()
            last = self._last_put
            slow = last is not None and now - last > options.linger
            self._last_put = now
            batch = self._open
            opened = not batch
            if opened:
                self._open_since = now
            batch.append(item)
            self._open_bytes += item.nbytes
            self._open_in_band += len(item.payload)
            # Full at its bounds, or open for ``linger``: the producer seals and writes it itself.
            full = (
                len(batch) >= options.batch_max_items or self._open_bytes >= options.frame_max_bytes
                or self._open_in_band >= options.batch_max_bytes
                or (not opened and now - self._open_since >= options.linger)
            )  # fmt: skip
            itself = item.borrowed or full
            # The credit left, read once (0: not needed for this item, not read).
            credits = self._protocol.credits if opened and not itself else 0
            if itself:
                pass  # sealed and written below (a borrowed item before the producer makes its next one)
            elif slow and opened and not self._batch_waits() and credits > 0:
                full = False  # the batch of this item alone is sealed here
                frames = self._take_inline(item)
                if frames is None:
                    self._seal()  # the sender wakes once, for a frame to send
            elif slow and opened and self._credit_owed():
                self._open_slow = True  # the CREDIT the trainer owes takes it along: no wake-up of the sender
            elif opened and credits > 0 and self._sender_wakes_at > now + self._stall_look_max:
                self._cond.notify_all()  # the sender looks for a stall from now (else grant() does)
            if itself:
                while self._sealed and self._batch_waits():
                    self._producer_waiting = True
                    self._producer_cond.wait()
                    self._producer_waiting = False
                    self._check(epoch)
                if self._open:  # the sender may have taken it while we waited
                    self._seal(wake=False)
                frames = self._take_for_producer()
                settled = frames is not None and not self._sealed
        if frames is not None:
            self._write_inline(frames)
        if (item.borrowed or item.staged) and not settled:
            self._until_written(epoch, item, written=item.borrowed)

    def _too_large(self, nbytes: int) -> ItemTooLargeError:
        limit = self._options.trainer_max_frame_bytes
        return ItemTooLargeError(
            f"an item of {nbytes:,} bytes (pickled, with its tensors' storage) does not fit in a frame of the "
            f"{limit:,} bytes the trainer accepts, which holds items of up to {self._largest_item:,} bytes: "
            f"make the items smaller (a smaller batch), or raise the trainer's "
            f"TransportConfig(max_frame_bytes=...) (now {limit})"
        )

    def producer_idle(self) -> None:
        """The producer waits for the trainer (its next lease, dispatched input): the open batch
        leaves after ``linger`` (the sender is woken if it would look later), and the next item
        is not a slow one."""
        with self._lock:
            self._last_put = None
            if self._open and self._protocol.credits > 0 and self._sender_looks_late():
                self._cond.notify_all()

    def _take_for_producer(self) -> Optional[List[List[Buffer]]]:
        """The frames for the producer to write itself, its sealed batch's among them when the
        trainer's credit allows and no send is in progress (no wake-up of the sender); else None,
        the sender is woken (not for want of credit: the thread that grants it takes the frames,
        see :meth:`grant`)."""
        if self._send is not None and self._protocol.credits > 0 and self.sending.acquire(blocking=False):
            frames = self._ready_frames([], _FRAMES_PER_SEND, final=False)
            if frames:
                return frames
            self.sending.release()
        if self._send is None or self._protocol.credits > 0:
            self._cond.notify_all()
        return None

    def _until_written(self, epoch: int, item: EncodedItem, written: bool = True) -> None:
        """Return once ``item``'s sealed batch has been taken for sending and, with ``written``
        (borrowed: its buffers are the producer's memory), written out, or dropped unsent with its
        epoch: only then may the producer make its next item."""
        try:
            with self._lock:
                while self._sealed_with(item):
                    self._producer_waiting = True
                    self._producer_cond.wait()
                    self._producer_waiting = False
                    self._check(epoch)
        finally:
            if written:
                with self.sending:  # held by whoever took it, from taking it until it is written
                    pass

    def _sealed_with(self, item: EncodedItem) -> bool:
        """Whether a sealed batch ending with ``item`` waits to be taken."""
        for entry in self._sealed:
            if type(entry) is list and entry and entry[-1] is item:
                return True
        return False

    def _take_inline(self, item: EncodedItem) -> Optional[List[List[Buffer]]]:
        """The frames for the producer to write itself (its item, sealed alone, and what was ready
        before it), holding :attr:`sending`; None when the sender is to write them."""
        if self._send is None or (item.nbytes > _INLINE_MAX_BYTES and not self._room()):
            return None
        if not self.sending.acquire(blocking=False):
            return None
        self._sealed.append(self._open)
        self._new_batch()
        return self._ready_frames([], _FRAMES_PER_SEND, final=False)

    def _write_inline(self, frames: List[List[Buffer]]) -> None:
        assert self._send is not None
        try:
            self._send(frames)
        finally:
            self.sending.release()
            # Under the lock: a sender that found the write in progress has set the flag and
            # waits by then, so it is never left waiting for a notify that came too early.
            with self._lock:
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
        with self._lock:
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
            if not self._open or self._protocol.credits <= 0 or self._sender_looks_late():
                self._cond.notify_all()
            # else the sender wakes within ``linger`` for the open batch and takes the marker with it

    def finish(self, epoch: int, final_frame: FinalFrame, end_session: bool = False) -> None:
        """Queue the frame that ends ``epoch`` (END_OF_SHARD, SHARD_FAILED or ITEM_TIMED_OUT) after its data.

        With ``end_session``, nothing more of ``epoch`` is accepted and :attr:`session_over`
        turns true once the frame is taken: the session ends after sending it.
        """
        with self._lock:
            self._check(epoch)  # also refuses a producer after the watchdog ended the session
            self._final = final_frame
            self._final_ends_session = end_session
            self._wake_all()

    def credit_wait_total(self) -> float:
        """Seconds data waited for trainer credit so far, the wait going on now included."""
        with self._lock:
            since = self._credit_wait_since
            return self.credit_wait_seconds + (max(0.0, time.monotonic() - since) if since is not None else 0.0)

    def _credit_owed(self) -> bool:
        """Whether the trainer holds enough of this epoch's frames that it owes a slow stage a
        CREDIT without more of them (:func:`~rpc_reading_service.protocol.credit_batch`)."""
        window = self._protocol.window
        return window - self._protocol.credits >= credit_batch(window, slow=True)

    def _sender_looks_late(self) -> bool:
        """Whether the sender's next look is more than ``linger`` away (one armed for a busy producer)."""
        return self._sender_wakes_at > time.monotonic() + self._options.linger

    def _check(self, epoch: int) -> None:
        if self._closed or epoch != self.epoch or self._final_ends_session:
            raise Cancelled()

    def _batch_waits(self) -> bool:
        """Whether a sealed batch of items waits for credit (markers ahead of the open batch do not count)."""
        for entry in self._sealed:
            if type(entry) is list:
                return True
        return False

    def _new_batch(self) -> None:
        """Start an empty open batch."""
        self._open, self._open_bytes, self._open_in_band, self._open_slow = [], 0, 0, False

    def _seal(self, wake: bool = True) -> None:
        """Close the open batch; ``wake``: notify the sender (not when the caller takes it at once),
        if credit is left (else the thread that grants it takes the batch, see :meth:`grant`)."""
        self._sealed.append(self._open)
        self._open, self._open_bytes, self._open_in_band, self._open_slow = [], 0, 0, False  # _new_batch(), inline
        if wake and self._protocol.credits > 0:
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
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                wait = deadline - now
                if not self.sending.acquire(blocking=False):  # the producer writes a frame of its own
                    # Woken at the end of that write only for what is ready behind it; else timed as below.
                    self._sender_waiting = self._ready_behind_write()
                    if not self._sender_waiting:
                        wait = min(wait, self._next_look(now, self._linger_left(now)))
                else:
                    self._sender_waiting = False
                    frame, ready_in = self._next_frame(now)
                    if frame is not None:
                        return self._ready_frames([frame], limit, final=True)
                    self.sending.release()
                    wait = min(wait, self._next_look(now, ready_in))
                if wait <= 0:
                    return None
                self._sender_wakes_at = now + wait
                self._cond.wait(wait)
                self._sender_wakes_at = float("inf")
            return None

    def _ready_behind_write(self) -> bool:
        """Whether the sender has something to send once a write in progress ends (not an open
        batch still lingering)."""
        return bool(self._sealed or self._input_credits or self._final is not None or self._open_slow)

    def _linger_left(self, now: float) -> float:
        """Seconds until the open batch is to be sent (inf: none open, or no credit for it)."""
        if not self._open or self._protocol.credits <= 0:
            return float("inf")
        return self._open_since + self._options.linger - now

    def _next_look(self, now: float, ready_in: float) -> float:
        """Seconds until the sender looks again at an open batch due in ``ready_in``: while the
        producer puts items it seals that batch itself, so the sender only looks for a stall, each
        time later (a look takes the interpreter lock from the producer: docs/architecture.md)."""
        linger = self._options.linger
        if self._open and self._last_put is not None and now - self._last_put < linger:
            look = self._stall_look
            self._stall_look = min(2 * look, self._stall_look_max)
            return max(ready_in, look)
        self._stall_look = linger
        return ready_in

    def _ready_frames(self, frames: List[List[Buffer]], limit: int, final: bool) -> List[List[Buffer]]:
        """``frames`` and the ones ready behind them, at most ``limit``; with ``final``, also the
        epoch's final frame (then nothing more)."""
        while len(frames) < limit and not self._closed and not self.session_over:
            if not final and self._final is not None:
                break
            if not (self._sealed or self._open or self._input_credits or self._final is not None):
                break  # nothing left to look at
            frame, _wait = self._next_frame(time.monotonic())
            if frame is None:
                break
            frames.append(frame)
        return frames

    def _wake_all(self) -> None:
        self._cond.notify_all()
        self._producer_cond.notify_all()

    def _next_frame(self, now: float) -> Tuple[Optional[List[Buffer]], float]:
        if self.epoch is None:
            return None, float("inf")
        if self._input_credits:
            credits, self._input_credits = self._input_credits, 0
            return self._protocol.send(ItemCredit(self.epoch, credits)), 0.0
        credits = self._protocol.credits
        # The time data was ready but the trainer had granted no credit (inline: once per frame).
        if credits <= 0 and (self._sealed or self._open):
            if self._credit_wait_since is None:
                self._credit_wait_since = now
        elif self._credit_wait_since is not None:
            self.credit_wait_seconds += now - self._credit_wait_since
            self._credit_wait_since = None
        if self._sealed and isinstance(self._sealed[0], Message):
            if self._open and credits > 0 and self._final is None:
                lingered_until = self._open_since + self._options.linger
                if now < lingered_until:  # the marker leaves in one send with the open batch
                    return None, lingered_until - now
            marker = self._sealed.popleft()
            if self._producer_waiting:  # the sealed slot got free
                self._producer_cond.notify_all()
            return self._protocol.send(marker), 0.0
        if credits > 0:
            if not self._sealed and self._open:
                if (
                    self._final is not None
                    or self._open_slow
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
                if self._producer_waiting:  # the sealed slot got free
                    self._producer_cond.notify_all()
                self.items_sent += len(items)
                self.bytes_sent += sum(map(_nbytes, items))
                return self._protocol.send(Data(self.epoch, self._protocol.next_sequence, items)), 0.0
        if self._final is not None and not self._sealed and not self._open:
            final, self._final = self._final, None
            chunks = self._protocol.send(final) if isinstance(final, Message) else final
            self.session_over = self._final_ends_session
            self.epoch = None
            return chunks, 0.0
        return None, float("inf")
