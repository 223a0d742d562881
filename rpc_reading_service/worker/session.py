"""One trainer session on a worker: graph setup, epochs, packing and credit-bound streaming (docs/architecture.md)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..version import __version__
from ..errors import FrameTooLargeError, RemoteProtocolError, past_the_end, thread_stack
from ..graph import WorkerGraphSeeds, prepare_worker_graph, reset_worker_graph, seed_chunk
from ..graph_utils import WorkerInfo
from ..protocol import (
    FRAMES_PAST_WINDOW,
    Buffer,
    ChunkDone,
    Close,
    Credit,
    EndOfInput,
    EndOfShard,
    Items,
    ItemTimedOut,
    Join,
    Lease,
    Leaving,
    Message,
    PeerTimedOut,
    Ready,
    SessionOptions,
    SessionState,
    Setup,
    SetupFailed,
    SetupRefused,
    ShardFailed,
    StartEpoch,
    StopEpoch,
    WorkerProtocol,
    window_frames,
)
from ..selection import LeaseInbox, SelectionContext, SelectionFilter
from ..serialization import ItemEncoder, fallback_exception_info, loads_graph, pack_exception
from ..tasks import TaskGroup
from ..transports.base import Connection, PeerLostError
from .inbox import Cancelled, DispatchedInput, Inbox
from .lock_watch import LockWatch
from .outbox import Outbox

__all__ = ["SessionOptions", "Outbox", "Inbox", "DispatchedInput", "WorkerSession"]

log = logging.getLogger(__name__)

#: Seconds a refused session waits for its trainer to read the reason (and stop sending).
REFUSAL_LINGER = 5.0
#: Longest the sender sleeps between looks at the state machine's liveness.
_MAX_SENDER_WAIT = 1.0
#: What a session says when it leaves because its server drains.
_LEAVING = "its worker server is draining (SIGTERM)"
#: Looks at the item being produced per ``item_timeout`` (at least one a second).
_ITEM_CHECKS_PER_TIMEOUT = 4
#: Seconds the session's end waits for its sender, and for its producers (one stuck in an item is left behind).
SENDER_JOIN_SECONDS = 2.0
PRODUCER_JOIN_SECONDS = 1.0
#: What ``next`` gives past a graph's last item.
_END = object()


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
        counters: Any = None,
        own_process: bool = False,
        draining: Callable[[], bool] = lambda: False,
        lock_watch: bool = True,
    ):
        """``counters``: where the session publishes its counters for the server's metrics (an
        object with ``publish(outbox)``, e.g. :class:`~rpc_reading_service.metrics.counters.SessionCounters`);
        ``own_process``: the session has its process to itself (forked): with item_timeout, a
        :class:`~rpc_reading_service.worker.lock_watch.LockWatch` ends it when C code holds the
        interpreter lock for good (unless not ``lock_watch``). ``draining``: True once the server drains (the
        session then leaves)."""
        self.conn = conn
        self._draining = draining
        self._watch_lock = own_process and lock_watch
        self._lock_watch: Optional[LockWatch] = None
        self.server_address = server_address
        self.stats_interval = stats_interval
        self._counters = counters
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
        self.outbox = Outbox(self.options, self.protocol, self._lock, self._send_frames, conn.has_room)
        self._graph: Any = None
        self._worker_info: Any = None
        self._reset_fn: Any = None
        #: How to seed the graph each epoch (None: traverse it each time).
        self._seeds: Optional[WorkerGraphSeeds] = None
        #: The source of dealt items in a dispatched graph, and the current epoch's input.
        self._dispatched_input = DispatchedInput()
        self._inbox: Optional[Inbox] = None
        #: The session's own threads (the sender), and the producers of its epochs.
        self._tasks = TaskGroup(f"the session of trainer {conn.peer}")
        self.producers = TaskGroup(f"the epochs of trainer {conn.peer}")
        #: ``(epoch, position in the shard, monotonic start, thread id)`` while the producer
        #: waits for the graph's next item; None otherwise. Read by the sender (item_timeout).
        self._producing: Optional[Tuple[int, int, float, int]] = None
        #: The producers' item encoder (made at the first epoch, see :meth:`_item_encoder`).
        self._encoder: Optional[ItemEncoder] = None
        #: The ITEM_TIMED_OUT once item_timeout fired (the session then ends with it).
        self._timed_out: Optional[ItemTimedOut] = None
        self._stopping = self._tasks.stopping
        #: The worker-side selections of the graph (a policy's replacement of sharding_filter).
        self._selections: List[SelectionFilter] = []
        #: The leases of the current epoch, when it is a "dynamic" one.
        self._leases: Optional[LeaseInbox] = None
        self._on_event: Dict[type, Callable[[Any], None]] = {
            StartEpoch: self._start_epoch,
            StopEpoch: self._stop_epoch,
            Credit: lambda message: self.outbox.grant(message.epoch),
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
            if self._watch_lock and self.options.item_timeout is not None:
                self._lock_watch = LockWatch(self.options.item_timeout)
                self._lock_watch.start()
            self._tasks.start(f"sender for {self.conn.peer}", self._send_loop)
            self._control_loop()
        except PeerLostError as exc:
            log.info("session with %s ended: %s", self.conn.peer, exc)
        except FrameTooLargeError as exc:
            log.warning("refused a frame from %s: %s; ending its session", self.conn.peer, exc)
            self.conn.refuse(
                f"a frame from this trainer is over the worker server's size limit ({exc}). Start "
                "rpc-reading-worker with a larger --max-frame-bytes, or send less (a smaller graph, or smaller "
                "items to deal from the trainer's part of the graph)",
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
            if self._draining():
                self._leave_before_setup()
                return False
            # No heartbeats before SETUP: a bootstrapping connection cannot send before its first recv.
            frame = self.conn.recv(timeout=max(0.0, min(deadline - time.monotonic(), _MAX_SENDER_WAIT)))
            if frame is None and time.monotonic() < deadline:
                continue
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

    def _leave_before_setup(self) -> None:
        """The server drains before SETUP came: say LEAVING, and end once the trainer closes
        (at most :data:`REFUSAL_LINGER` later; what it sends meanwhile is dropped)."""
        log.info("session for %s: the server drains before setup; telling the trainer this worker leaves", self.conn.peer)
        self._send(Leaving(_LEAVING))
        end = time.monotonic() + REFUSAL_LINGER
        while time.monotonic() < end:
            self.conn.recv(timeout=end - time.monotonic())  # PeerLostError once it closed: run() ends the session

    def _set_up(self, setup: Setup) -> bool:
        self.options = setup.options
        self.outbox = Outbox(self.options, self.protocol, self._lock, self._send_frames, self.conn.has_room)
        try:
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
            self._send(SetupFailed(info))
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
        self._send(SetupRefused("transport", message))

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
        self.outbox.start_epoch(request.epoch)
        # The segments lent (the window), the frames filled past it and the item being made.
        options = self.options
        frames = request.frames or window_frames(request.credits, options.batch_max_bytes)
        held = window_frames(frames * options.batch_max_bytes, options.frame_max_bytes)
        self.conn.bound_buffers(held + FRAMES_PAST_WINDOW + 1, options.frame_max_bytes)
        self._cancel_input()
        if request.dispatched:
            self._inbox = Inbox(request.epoch, lambda epoch: self.outbox.grant_input(epoch, 1), self._waiting_for_trainer)
            self.outbox.grant_input(request.epoch, frames)
        if self._leases is not None:
            self._leases.cancel()  # the superseded epoch's producer stops waiting for leases
        self._leases = LeaseInbox() if request.leased else None
        if self._timed_out is not None:
            self._report_item_timeout(request.epoch)
            return
        previous = self.producers.threads  # every earlier producer: one stuck in an item too
        self.producers.start(f"producer-{request.epoch} for {self.conn.peer}", self._produce, request, previous, self._inbox)

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
            self._leases.add(message.chunk, message.skip, message.count, message.start or 0, message.size)

    # -- producer -----------------------------------------------------------------------------
    def _produce(self, request: StartEpoch, previous: List[threading.Thread], inbox: Optional[Inbox]) -> None:
        epoch, sent = request.epoch, 0
        leases = self._leases if request.leased else None
        # The graph supports one iterator at a time: join the earlier epochs' producers first.
        while self.producers.join(0.1, previous, report=False):
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
                encode, put = self._item_encoder().encode, self.outbox.put
                chunks = _ChunkCount(epoch, request.seed, self.outbox) if leases is not None else None
                context = SelectionContext(request.epoch, request.seed, request.global_worker_id, leases)
                if chunks is not None:
                    context.chunk_started, context.chunk_done = chunks.started, chunks.done
                    if inbox is not None:  # "dynamic" with a dispatch point: a unit is one dispatched item
                        inbox.unit_hooks = (chunks.started, chunks.done)
                for selection in self._selections:
                    selection.set_context(context)
                items = iter(self._graph)
                if leases is not None:
                    leases.waiting = self._waiting_for_trainer
                skipped = self._skip(epoch, items, skip, watched) if skip else 0
                if skipped < skip:  # a resumed epoch's position lies past the end of the shard
                    raise past_the_end("'consumed'", "this worker's shard", skip, skipped)
                if watched:  # item_timeout: the sender's check reads which item the producer works on
                    ident, clock, index = threading.get_ident(), time.monotonic, skipped
                    self._producing = (epoch, index, clock(), ident)
                    for item in items:
                        if chunks is not None and chunks.skip > 0:
                            chunks.skip -= 1
                        else:
                            encoded = encode(item)
                            self._producing = None  # waiting for credit is not producing: the trainer sets that pace
                            put(epoch, encoded)
                            sent += 1
                            if chunks is not None:
                                chunks.items += 1
                        index += 1
                        self._producing = (epoch, index, clock(), ident)
                    self._producing = None
                elif chunks is None:
                    for item in items:
                        put(epoch, encode(item))
                        sent += 1
                else:
                    for item in items:
                        if chunks.skip > 0:
                            chunks.skip -= 1  # delivered before the chunk was leased again
                            continue
                        put(epoch, encode(item))
                        sent += 1
                        chunks.items += 1
            except Cancelled:
                raise
            except BaseException as exc:  # noqa: BLE001 - report everything, even SystemExit
                self._producing = None
                info = _describe(exc)
                log.info("epoch %d raised %s: %s after %d items", epoch, info["type_name"], info["message"], sent)
                self.outbox.finish(epoch, ShardFailed(epoch, info))
                return
            self.outbox.finish(epoch, EndOfShard(epoch, sent))
        except Cancelled:
            log.debug("epoch %d cancelled after %d items", epoch, sent)
        except BaseException as failure:  # noqa: BLE001 - the epoch must end with an error, never in silence
            log.exception("producer of epoch %d failed in its own error handling", epoch)
            info = fallback_exception_info(None, failure)
            try:
                self.outbox.finish(epoch, ShardFailed(epoch, info))
            except Cancelled:
                pass

    def _item_encoder(self) -> ItemEncoder:
        """The session's encoder (its pickler and reused copies warm from one epoch to the next;
        one producer encodes at a time: each joins the earlier ones first)."""
        if self._encoder is None:
            # A buffer of a credit unit or more goes out uncopied from the producer's memory where
            # the send is synchronous (the outbox writes it, in a frame of its own, before the next
            # item is made); smaller ones are copied and share frames (docs/architecture.md).
            borrow = self.options.batch_max_bytes if self.conn.sends_synchronously else None
            stages = type(self.conn).stage_buffer is not Connection.stage_buffer  # else no call per buffer
            self._encoder = ItemEncoder(self.conn.stage_buffer if stages else None, borrow, self.conn.stage_min_bytes)
        return self._encoder

    def _waiting_for_trainer(self, waiting: bool) -> None:
        """Waiting for the trainer (its next lease, or the items its dispatcher deals, which set
        that pace) is not producing an item: item_timeout does not count it, and the item's
        clock restarts after it."""
        if waiting:
            self.outbox.producer_idle()
        producing = self._producing
        if producing is not None:
            epoch, position, _started, ident = producing
            self._producing = (epoch, position, float("inf") if waiting else time.monotonic(), ident)

    def _skip(self, epoch: int, items: Iterator[Any], skip: int, watched: bool) -> int:
        """Skip the first ``skip`` items of ``items`` (a resumed epoch's position); how many there were."""
        if not watched:
            return sum(1 for _ in itertools.islice(items, skip))
        ident, clock = threading.get_ident(), time.monotonic
        for index in range(skip):
            self._producing = (epoch, index, clock(), ident)
            if next(items, _END) is _END:
                return index
        return skip

    # -- item_timeout -------------------------------------------------------------------------
    def _check_item(self, now: float, limit: float) -> None:
        """End the session when the producer has spent longer than ``limit`` (``item_timeout``)
        on one item (the sender's call, at least every ``limit / _ITEM_CHECKS_PER_TIMEOUT``)."""
        producing = self._producing
        if self._timed_out is not None or producing is None or now - producing[2] <= limit:
            return
        epoch, position, started, ident = producing
        stack = thread_stack(ident, "(the producer thread is gone)")
        seconds = time.monotonic() - started
        log.warning(
            "epoch %d: item %d of the shard took more than %.1f s (item_timeout); ending the session of %s. "
            "The producer's stack:\n%s", epoch, position, limit, self.conn.peer, stack,
        )  # fmt: skip
        with self._lock:
            self._timed_out = ItemTimedOut(epoch, epoch, position, limit, seconds, stack)
            if self.outbox.epoch is not None:  # else the trainer hears of it in the next epoch it starts
                self._report_item_timeout(self.outbox.epoch)

    def _report_item_timeout(self, epoch: int) -> None:
        """Queue the ITEM_TIMED_OUT as the end of ``epoch`` (the stuck one, or the one the
        trainer started after it) and of the session (called with the lock held)."""
        assert self._timed_out is not None
        try:
            self.outbox.finish(epoch, dataclasses.replace(self._timed_out, epoch=epoch), end_session=True)
        except Cancelled:  # the outbox is closing
            pass

    # -- sender -------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        throughput = _ThroughputLog(self.outbox, self.conn.peer, self.stats_interval)
        next_tick, limit = 0.0, self.options.item_timeout
        try:
            while not self._stopping.is_set():
                if self._draining():
                    self._leave()
                    return
                throughput.maybe_log()
                self._publish()
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

    def _leave(self) -> None:
        """The server drains (the sender's call): stop producing, say LEAVING after the frames
        sent, and end the session once the trainer closes (at most :data:`REFUSAL_LINGER` later).
        Items not sent are the trainer's to have made elsewhere, from what it consumed."""
        log.info("session for %s: the server drains; telling the trainer this worker leaves", self.conn.peer)
        with self._lock:
            self._cancel_input()
            if self._leases is not None:
                self._leases.cancel()
        self.outbox.close()  # the producer stops at its next item
        with self.outbox.sending:  # after a frame a producer is writing
            with self._lock:
                chunks = None
                if self.protocol.state is not SessionState.CLOSED:
                    chunks = self.protocol.send(Leaving(_LEAVING))
            if chunks is not None:
                self.conn.send(chunks)
        self._stopping.wait(REFUSAL_LINGER)  # the trainer closes: the control loop ends the session
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
        self._tasks.stop(SENDER_JOIN_SECONDS)
        self.producers.stop(PRODUCER_JOIN_SECONDS)
        if self._lock_watch is not None:
            self._lock_watch.stop()
        self._publish(final=True)

    def _publish(self, final: bool = False) -> None:
        """Publish the session's counters (the sender: at least once a second; the session's end: ``final``)."""
        if self._counters is not None:
            self._counters.publish(self.outbox, final)


class _ChunkCount:
    """The producer's count of the items of the leased chunk it walks: what CHUNK_DONE reports,
    and how many of the chunk's first items to leave out (delivered before it was leased again)."""

    def __init__(self, epoch: int, seed: int, outbox: Outbox):
        self.epoch, self.seed, self.outbox = epoch, seed, outbox
        self.items = 0
        self.skip = self.delivered = 0

    def started(self, chunk: int, skip: int) -> None:
        """The walk entered leased ``chunk``: its randomness is the chunk's own."""
        self.skip = self.delivered = skip
        seed_chunk(self.seed, chunk)

    def done(self, chunk: int, stream_length: Optional[int]) -> None:
        """``chunk`` is done: its CHUNK_DONE leaves ahead of its items not sent yet."""
        if self.skip > 0:  # a resumed epoch says more of the chunk was delivered than it has
            raise past_the_end("'distribution' ('delivered')", f"chunk {chunk}", self.delivered, self.delivered - self.skip)
        self.outbox.mark(self.epoch, ChunkDone(self.epoch, chunk, (self.items,), stream_length))
        self.items, self.skip = 0, 0


def _describe(exc: BaseException) -> Dict[str, Any]:
    """:func:`pack_exception`, falling back to a description built without user code."""
    try:
        return pack_exception(exc)
    except BaseException as failure:  # noqa: BLE001 - pack_exception is meant to be total; be sure
        return fallback_exception_info(exc, failure)
