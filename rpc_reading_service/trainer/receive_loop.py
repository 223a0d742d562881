"""One thread that receives for every worker session of a trainer: a ``selectors`` event loop."""

from __future__ import annotations

import logging
import math
import selectors
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from ..tasks import TaskGroup

__all__ = ["ReceiveLoop", "Watched"]

log = logging.getLogger(__name__)

#: Sweeps of the liveness checks are at least this fraction of the longest wait a session
#: asked for (about a heartbeat interval) apart: a heartbeat leaves at most that much late,
#: and one sweep serves many sessions instead of one sweep per session's due time.
_SWEEP_SLACK = 0.25
_MIN_SWEEP_SECONDS = 0.001
#: A due send that could not be made (another send held the connection, or it had no room)
#: is retried after this long, doubling up to the maximum while it still cannot: bounded
#: lateness, and no spinning while a send to a worker that stopped reading is stuck.
_RETRY_SECONDS = 0.001
_MAX_RETRY_SECONDS = 0.064
#: A turn hands on what it holds once it holds this many: a turn that finds many sessions'
#: backlogs (a host too busy for the loop to keep up) would keep the consumer waiting for all of
#: them, seconds with 128 sessions on 2 saturated cores.
HAND_OVER_MAX = 256
#: Frames a session takes in per turn of the loop (the rest wait in its connection for the next
#: turns): the sessions of a turn that finds many backlogs are served in turns, each a little.
FRAMES_PER_TURN = 16


class Watched(Protocol):
    """What the loop drives: one session's receiving end."""

    def fileno(self) -> Optional[int]:
        """The descriptor that turns readable when the session's frames arrive."""

    def on_readable(self) -> bool:
        """Take in what arrived (at most :data:`FRAMES_PER_TURN` frames; a session that keeps
        more calls :meth:`ReceiveLoop.again`); True when the session is over (the loop stops watching it)."""

    def on_tick(self, now: float) -> Optional[float]:
        """Liveness at ``now``: seconds until the next check, or None when the session is over."""

    def send_due(self) -> bool:
        """Make the sends found due (without blocking); False: not possible now, retry later."""


class ReceiveLoop:
    """Receives for many sessions in one thread (started with the first session added).

    Args:
        name: The thread's name, after ``rrs-``.
    """

    def __init__(self, name: str = "receive-loop"):
        self._name = name
        self._tasks = TaskGroup("the trainer's receive loop")
        self._selector = selectors.DefaultSelector()
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        self._wake_out.setblocking(False)
        self._selector.register(self._wake_in, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        #: Additions and removals for the loop's thread to apply: (session, add?, done).
        self._changes: List[Tuple[Watched, bool, threading.Event]] = []
        self._watched: Dict[int, Watched] = {}  # by id(): a channel is not hashable by contract
        self._next_sweep = 0.0
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        #: Sessions with sends due (by id()), and whether the loop's thread waits in ``select``
        #: and was woken already: a session made due while the loop runs needs no wake-up.
        self._due: Dict[int, Watched] = {}
        self._selecting = self._woken = False
        self._retry = _RETRY_SECONDS
        #: What sessions handed on in this turn of the loop: (deliver, item), in order.
        self._handed: List[Tuple[Callable[[Any], None], Any]] = []
        #: Sessions (by id()) that hold frames for the next turn, readable or not: :meth:`again`.
        self._again: Dict[int, Watched] = {}
        self._ident: Optional[int] = None

    def add(self, session: Watched) -> None:
        """Watch ``session`` from now on (its frames already received are taken at once)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this receive loop is closed")
            self._changes.append((session, True, threading.Event()))
            if self._thread is None:
                self._thread = self._tasks.start(self._name, self._run)
        self._wake()

    def remove(self, session: Watched, timeout: float = 2.0) -> None:
        """Stop watching ``session``; returns once the loop no longer touches its connection
        (or after ``timeout``), so that it may be closed."""
        done = threading.Event()
        with self._lock:
            if self._thread is None or self._closed:
                return
            self._changes.append((session, False, done))
        if threading.current_thread() is self._thread:
            self._apply_changes()
            self._deliver_handed()  # before its owner reports it closed
            return
        self._wake()
        done.wait(timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the loop's thread (idempotent). Closing the sessions is their owner's job."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._wake()
        self._tasks.stop(timeout)  # not the loop's thread itself, if it closes the loop
        if thread is None or not thread.is_alive():
            self._selector.close()
            self._wake_in.close()
            self._wake_out.close()

    def due(self, session: Watched) -> None:
        """Have the loop call ``session.send_due()`` in its turn (from any thread): soon, since
        a worker may wait for what it sends; the loop is woken only if it waits in ``select``."""
        with self._lock:
            self._due[id(session)] = session
            wake = self._selecting and not self._woken
            self._woken = self._woken or wake
        if wake:
            self._wake()

    def again(self, session: Watched) -> None:
        """Call ``session.on_readable()`` in the loop's next turn even if its descriptor is not
        readable (the loop's thread only: from ``on_readable``)."""
        self._again[id(session)] = session

    def hand_over(self, deliver: Callable[[Any], None], item: Any) -> None:
        """``deliver(item)``, at the end of the loop's current turn when called in the loop's
        thread (in order with the others handed over; at once with them when the turn holds
        :data:`HAND_OVER_MAX`; after the next turn when sessions hold frames for it), else at once."""
        if threading.get_ident() == self._ident:
            self._handed.append((deliver, item))
            if len(self._handed) >= HAND_OVER_MAX:
                self._deliver_handed()
        else:
            deliver(item)

    # -- the loop's thread ---------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_out.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # full (a wake-up is pending anyway) or closed

    def _run(self) -> None:
        self._ident = threading.get_ident()
        try:
            self._turns()
        finally:
            self._ident = None
            self._deliver_handed()

    def _turns(self) -> None:
        while True:
            # (each step only when there is something to do: a Python call less per turn)
            if self._handed and not self._again:  # before the loop may wait (else in batches)
                self._deliver_handed()
            if self._changes:  # read without the lock: a change made after this wakes the loop
                self._deliver_handed()  # before a removal is done: its owner reports it closed next
                self._apply_changes()
                if not self._again:
                    self._deliver_handed()  # an added session's first frames
            if self._closed:
                return
            timeout = max(0.0, self._next_sweep - time.monotonic()) if self._watched else None
            with self._lock:
                if self._due:  # retries (new ones are sent below before the loop waits)
                    timeout = self._retry if timeout is None else min(timeout, self._retry)
                self._selecting = True
            events = self._selector.select(0.0 if self._again else timeout)
            with self._lock:
                self._selecting = self._woken = False
            again, self._again = self._again, {}
            for key, _events in events:
                session = key.data
                if session is None:
                    self._drain_wake()
                    continue
                if again:  # served now: once a turn
                    again.pop(id(session), None)
                if id(session) in self._watched and self._call(session.on_readable, True):
                    self._unwatch(session)
            for session in again.values():
                if id(session) in self._watched and self._call(session.on_readable, True):
                    self._unwatch(session)
            if self._due:  # read without the lock: one made due later is sent after the next select
                self._send_due()
            now = time.monotonic()
            if now >= self._next_sweep:
                self._sweep(now)

    def _deliver_handed(self) -> None:
        """Hand on what the sessions handed over in this turn (before the loop waits)."""
        handed, self._handed = self._handed, []
        for deliver, item in handed:
            try:
                deliver(item)
            except Exception:  # noqa: BLE001 - one consumer's bug must not stop the others' receiving
                log.exception("the receive loop's hand-over %r failed", deliver)

    def _send_due(self) -> None:
        """One pass over the sessions with sends due; those that cannot send now stay due."""
        with self._lock:
            due, self._due = self._due, {}
        if not due:
            return
        left = {key: each for key, each in due.items() if key in self._watched and not self._call(each.send_due, True)}
        with self._lock:
            if left:
                self._due.update(left)
                self._retry = min(self._retry * 2, _MAX_RETRY_SECONDS)
            else:
                self._retry = _RETRY_SECONDS

    def _apply_changes(self) -> None:
        with self._lock:
            changes, self._changes = self._changes, []
        for session, add, done in changes:
            if add:
                self._watch(session)
            else:
                self._unwatch(session)
            done.set()

    def _watch(self, session: Watched) -> None:
        fd = session.fileno()
        try:
            try:
                self._selector.register(fd, selectors.EVENT_READ, session)  # type: ignore[arg-type]
            except KeyError:  # a session whose removal timed out had this descriptor number
                self._unwatch(self._selector.get_key(fd).data)
                self._selector.register(fd, selectors.EVENT_READ, session)  # type: ignore[arg-type]
        except (ValueError, KeyError, OSError) as exc:  # closed meanwhile: reading it reports why
            log.debug("cannot watch %r: %s", session, exc)
            self._call(session.on_readable, True)
            return
        self._watched[id(session)] = session
        self._next_sweep = 0.0  # its first liveness check now
        # Bytes read along with its last frame before it was added (setup's READY) raise no event.
        if self._call(session.on_readable, True):
            self._unwatch(session)

    def _unwatch(self, session: Watched) -> None:
        self._watched.pop(id(session), None)
        self._again.pop(id(session), None)
        with self._lock:
            self._due.pop(id(session), None)
        for key in list(self._selector.get_map().values()):
            if key.data is session:
                self._selector.unregister(key.fileobj)

    def _sweep(self, now: float) -> None:
        """Every session's liveness; the next sweep when the soonest one is due (plus slack)."""
        soonest, longest = math.inf, 0.0
        for session in list(self._watched.values()):
            wait = self._call(lambda: session.on_tick(now), None)
            if wait is None:
                self._unwatch(session)
            else:
                soonest, longest = min(soonest, wait), max(longest, wait)
        if soonest == math.inf:
            self._next_sweep = math.inf
        else:
            self._next_sweep = now + max(soonest, longest * _SWEEP_SLACK, _MIN_SWEEP_SECONDS)

    def _call(self, method: Callable[[], Any], over: Any) -> Any:
        """``method()``; a failure (a bug: drivers report their sessions' faults themselves)
        is logged and ends that session only, never the loop."""
        try:
            return method()
        except Exception:  # noqa: BLE001 - one session's bug must not stop the others' receiving
            log.exception("the receive loop's call %r failed", method)
            return over

    def _drain_wake(self) -> None:
        try:
            while self._wake_in.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
