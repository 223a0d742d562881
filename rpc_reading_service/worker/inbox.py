"""A worker's dispatched input: the items the trainer deals to one epoch, handed from the
session's control loop to the producer, whose graph iterates them."""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Deque, Iterator, Optional, Sequence, Tuple

from torch.utils.data import IterDataPipe

from ..protocol import EncodedItem
from ..serialization import loads_item


__all__ = ["Inbox", "DispatchedInput", "Cancelled"]


class Cancelled(Exception):
    """The signal that stops a worker session's producer: its epoch was superseded or the session is closing."""


class Inbox:
    """The dispatched input of one epoch on a worker: ITEMS frames from the control loop to
    the producer, whose graph iterates it (through :class:`DispatchedInput`).

    ``on_taken(epoch)`` runs each time the producer takes a frame: the session grants the
    trainer one more ITEMS frame then. ``on_wait(True)`` runs when the producer starts waiting
    for a frame, ``on_wait(False)`` when it stops (both outside the inbox's lock).

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
                ready = self._ready()
                if ready:
                    if self._cancelled:
                        raise Cancelled()
                    if not self._frames:
                        return
                    items = self._frames.popleft()
                    units = [self._units.popleft() for _ in items] if self.unit_hooks is not None else None
            if not ready:
                self._on_wait(True)  # outside the lock, as is on_wait(False)
                try:
                    with self._cond:
                        while not self._ready():
                            self._cond.wait()
                finally:
                    self._on_wait(False)
                continue
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

    def _ready(self) -> bool:
        """Whether the producer has something to take or to stop for (the caller holds the lock)."""
        return bool(self._frames or self._ended or self._cancelled)


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
