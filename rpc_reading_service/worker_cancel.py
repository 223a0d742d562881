"""The signal that stops a worker session's producer: its epoch was superseded or the session is closing."""

from __future__ import annotations


class _Cancelled(Exception):
    """The producer's epoch was superseded or the session is closing."""
