"""The worker's half of "dynamic": the selection that keeps the chunks leased to this session."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from ...selection import SelectionContext, WorkerSelection

__all__ = ["LeasedChunks"]


class LeasedChunks(WorkerSelection):
    """"dynamic" on a worker: keep the chunks leased to this session (each a run of positions
    whose bounds its LEASE gives).

    The walk waits at the first position of a chunk until the trainer decided it (it keeps
    every worker a lease or two ahead); a finished chunk is reported right after its last
    item went through the graph (its CHUNK_DONE, with the count, goes ahead of the items
    still packed). Outside a session (``num_workers=0``) it keeps everything.
    """

    leased = True

    def __init__(self) -> None:
        self._context: Optional[SelectionContext] = None
        self._mine: Optional[int] = None  # the chunk being walked, when it is this worker's
        self._until = 0  # the position up to which the current decision holds
        self._last_reported = -1

    def start_epoch(self, context: SelectionContext) -> None:
        """Start a walk with the session's leases."""
        self._context = context if context.leases is not None else None
        self._mine, self._until, self._last_reported = None, 0, -1

    def keep(self, position: int, item: Any) -> bool:
        """Whether ``position`` lies in a chunk leased here (waits for the trainer's decision)."""
        return self.keep_span(position, item)[0]

    def keep_span(self, position: int, item: Any) -> Tuple[bool, int]:
        """:meth:`keep`, decided for the rest of the chunk (or of the others' positions) at once."""
        context = self._context
        if context is None:
            return True, position + 1
        if position >= self._until:
            assert context.leases is not None
            chunk, skip, self._until = context.leases.decide(position)
            self._mine = chunk
            if chunk is not None:
                context.chunk_started(chunk, skip)
        return self._mine is not None, self._until

    def passed(self, position: int) -> None:
        """Report the chunk done once its last position went through the graph."""
        if self._mine is not None and position + 1 == self._until:
            self._report(self._mine, None)
            self._mine = None

    def end(self, length: Optional[int]) -> None:
        """The stream ended (or the walk stopped): report the chunks still leased, with the length."""
        context = self._context
        if context is None:
            return
        assert context.leases is not None
        if length is None:
            return  # stopped: every lease was reported already
        for chunk in context.leases.outstanding(self._last_reported):
            self._report(chunk, length)

    def _report(self, chunk: int, length: Optional[int]) -> None:
        assert self._context is not None
        self._last_reported = chunk
        self._context.chunk_done(chunk, length)
