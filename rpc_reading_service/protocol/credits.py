"""The trainer's byte credit window of one session: what START_EPOCH grants, and when the credit of
frames handed on goes back (docs/architecture.md, "Credits and numbering"); no I/O, not thread-safe."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

from .frames import data_cost
from .messages import Message, StartEpoch, credit_batch

__all__ = ["CreditWindow", "FRAMES_PAST_WINDOW", "window_frames", "with_window"]

#: Frames a worker fills past its credit window (its open batch and the one sealed for credit):
#: their segments stay resident in the trainer too (docs/architecture.md, "Shared memory").
FRAMES_PAST_WINDOW = 2


class CreditWindow:
    """A window of ``frames`` frames, each of the session's frame bound or of the costliest DATA frame
    handed on so far if larger, in bytes; and the credit handed on and not returned yet.

    Args:
        frame_bytes: The session's byte bound of a DATA frame (``batch_max_bytes``); None: not known
            until its SETUP (:meth:`set_bound`), and no window is in bytes before.
    """

    def __init__(self, frame_bytes: Optional[int] = None):
        #: The session's frame bound (None until known); :attr:`frame_bytes` grows past it with larger frames.
        self.bound = frame_bytes
        self.frame_bytes = frame_bytes or 0
        self.frames = 1
        #: The current epoch's window in bytes (what the worker may send ahead of the consumer).
        self.window = self.frame_bytes
        #: Bytes of frames handed on whose credit has not been returned yet.
        self.ungranted = 0

    def set_bound(self, frame_bytes: int) -> int:
        """The session's frame bound, from its SETUP (before any frame of it came): an epoch started
        before keeps its frames, now of this bound; return its window in bytes."""
        self.bound = self.frame_bytes = frame_bytes
        self.window = self.frames * frame_bytes
        return self.window

    def start(self, frames: int) -> int:
        """Start an epoch of ``frames`` frames; return its window in bytes (START_EPOCH's ``credits``)."""
        self.frames, self.ungranted = frames, 0
        self.window = frames * self.frame_bytes
        return self.window

    def handed_on(self, nbytes: int, slow: bool = False) -> bool:
        """Count a frame of ``nbytes`` (``Frame.nbytes``) whose last item was handed on; True when
        a CREDIT is due.

        A frame costlier than every one before grows the window to ``frames`` of its cost: items
        larger than a frame still have ``frames`` of them in flight.

        Args:
            slow: it was a slow stage's frame (one small item): the credit goes back a window at a time.
        """
        cost = data_cost(nbytes)
        if cost > self.frame_bytes:
            grown = self.frames * cost
            self.ungranted += grown - self.window
            self.frame_bytes, self.window = cost, grown
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
