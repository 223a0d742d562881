"""The trainer's byte credit window of one session: what START_EPOCH grants, and when the credit of
frames handed on goes back (docs/architecture.md, "Credits and numbering"); no I/O, not thread-safe."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

from .frames import data_cost
from .messages import Message, StartEpoch, credit_batch

__all__ = [
    "CreditWindow", "FRAMES_PAST_WINDOW", "ITEMS_IN_FLIGHT", "window_bytes", "window_frames", "with_window",
]

#: Frames a worker fills past its credit window (its open batch and the one sealed for credit):
#: their segments stay resident in the trainer too (docs/architecture.md, "Shared memory").
FRAMES_PAST_WINDOW = 2
#: A window that may grow (``grow_to``) holds at least this many items of the costliest seen, up to
#: ``grow_to`` frames: frames of a few large items need more of them in flight than frames of many.
ITEMS_IN_FLIGHT = 256


def window_bytes(frames: int, bound: int, largest: int, grow_to: int = 0, item_bytes: int = 0) -> int:
    """A credit window in bytes: ``frames`` frames of ``bound`` bytes, or of ``largest`` (the
    costliest frame so far) if larger; or :data:`ITEMS_IN_FLIGHT` items of ``item_bytes`` if more,
    up to ``grow_to`` frames of ``bound``.

    Args:
        frames: The window in frames (``prefetch``).
        bound: The session's byte bound of a DATA frame.
        largest: The costliest DATA frame handed on so far (0: none).
        grow_to: The frames the window may grow to with larger items (0: it does not).
        item_bytes: The costliest item handed on so far (a frame's cost over its items).
    """
    return max(frames * max(bound, largest), min(ITEMS_IN_FLIGHT * item_bytes, grow_to * bound))


class CreditWindow:
    """A window of ``frames`` frames in bytes (:func:`window_bytes`: each of the session's frame bound,
    or of the costliest DATA frame handed on so far if larger); and the credit handed on and not
    returned yet.

    Args:
        frame_bytes: The session's byte bound of a DATA frame (``batch_max_bytes``); None: not known
            until its SETUP (:meth:`set_bound`), and no window is in bytes before.
    """

    def __init__(self, frame_bytes: Optional[int] = None):
        #: The session's frame bound (None until known); :attr:`frame_bytes` grows past it with larger frames.
        self.bound = frame_bytes
        self.frame_bytes = frame_bytes or 0
        self.frames = 1
        #: Frames of the bound the window may grow to with larger items (0: it does not).
        self.grow_to = 0
        #: The costliest item handed on so far (a frame's cost over its items).
        self.item_bytes = 0
        #: The current epoch's window in bytes (what the worker may send ahead of the consumer).
        self.window = self.frame_bytes
        #: Bytes of frames handed on whose credit has not been returned yet.
        self.ungranted = 0

    def set_bound(self, frame_bytes: int) -> int:
        """The session's frame bound, from its SETUP (before any frame of it came): an epoch started
        before keeps its frames, now of this bound; return its window in bytes."""
        self.bound = self.frame_bytes = frame_bytes
        self.window = self._window()
        return self.window

    def start(self, frames: int, grow_to: int = 0) -> int:
        """Start an epoch of ``frames`` frames, growing to ``grow_to`` with larger items (0: not);
        return its window in bytes (START_EPOCH's ``credits``)."""
        self.frames, self.grow_to, self.ungranted = frames, grow_to, 0
        self.window = self._window()
        return self.window

    def frames_held(self) -> int:
        """The window in frames of the bound, or of the costliest item so far if larger (at least
        one): what the receive buffers' pools are bounded by (each frame of the bound or of their
        largest buffer: frames of several items count as their items)."""
        return window_frames(self.window, max(self.bound or 0, self.item_bytes) or self.frame_bytes)

    def _window(self) -> int:
        return window_bytes(self.frames, self.bound or 0, self.frame_bytes, self.grow_to, self.item_bytes)

    def handed_on(self, nbytes: int, slow: bool = False, items: int = 1) -> bool:
        """Count a frame of ``nbytes`` (``Frame.nbytes``) whose last item was handed on; True when
        a CREDIT is due.

        A frame costlier than every one before, or (with ``grow_to``) an item costlier than every
        one before, grows the window (:func:`window_bytes`); its CREDIT carries the growth.

        Args:
            slow: it was a slow stage's frame (one small item): the credit goes back a window at a time.
            items: The items the frame held.
        """
        cost = data_cost(nbytes)
        item_bytes = cost // items if items > 0 else 0
        if cost > self.frame_bytes or item_bytes > self.item_bytes:
            self.frame_bytes, self.item_bytes = max(self.frame_bytes, cost), max(self.item_bytes, item_bytes)
            grown = max(self.window, self._window())
            self.ungranted += grown - self.window
            self.window = grown
        self.ungranted += cost
        return self.ungranted >= credit_batch(self.window, slow=slow)

    def take(self) -> int:
        """The credit to return now (all that was handed on), counted as returned."""
        credits, self.ungranted = self.ungranted, 0
        return credits


def window_frames(window: int, frame_bytes: int) -> int:
    """Full frames in a byte window (at least one): what a worker sizes its pools and its
    dispatched input's ITEM_CREDIT by when START_EPOCH does not give its ``frames``.

    Args:
        window: START_EPOCH's ``credits`` (bytes).
        frame_bytes: The session's byte bound of a DATA frame.
    """
    return max(1, -(-window // max(1, frame_bytes)))


def with_window(messages: Sequence[Message], window: int) -> Tuple[Message, ...]:
    """``messages`` with each START_EPOCH's ``credits`` set to ``window`` (bytes): what a START_EPOCH
    held while its session set up is sent with, once the session's frame bound is known.

    Args:
        window: The channel's current window (:attr:`CreditWindow.window`); every epoch of a run
            starts with the same frames, and one held behind a later one is superseded at once.
    """
    return tuple(dataclasses.replace(m, credits=window) if isinstance(m, StartEpoch) else m for m in messages)
