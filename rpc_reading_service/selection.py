"""Worker-side selection: which items of the sharded stream one worker keeps.

A policy other than round-robin replaces every ``sharding_filter`` of the graph it ships by a
:class:`SelectionFilter` holding its :class:`WorkerSelection`. Pure graph code: no I/O; the
session driver feeds the :class:`LeaseInbox` and sends what it reports."""

from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Deque, Iterator, List, Optional, Sequence, Tuple

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES, ShardingFilterIterDataPipe

from .graph_utils import DataPipe, DataPipeGraph, find_dps, list_dps, replace_dp, set_datapipes_seed, traverse_dps

__all__ = [
    "SelectionContext",
    "WorkerSelection",
    "StopSelection",
    "SelectionFilter",
    "LeaseInbox",
    "selection_in_place",
    "selections_in",
    "datapipes_before",
    "share_seeds_before_selections",
]


class StopSelection(Exception):
    """Raised by :meth:`WorkerSelection.keep`: nothing later in the stream is this worker's; stop the walk."""


#: What a selection reports for a finished chunk: ``(chunk, stream_length)`` (length None
#: unless the stream ended in or before that chunk).
ChunkReport = Callable[[int, Optional[int]], None]


def _no_report(chunk: int, stream_length: Optional[int]) -> None:
    """Report of a selection outside a worker session (the trainer's own graph): nobody listens."""


@dataclass
class SelectionContext:
    """What a worker session gives its selection at the start of every epoch.

    Attributes:
        epoch: The epoch's wire number. seed: the epoch's shared seed.
        global_worker_id: This session's global shard index (torch.distributed rank * num_workers + rank).
        leases: The chunks the trainer leases to this session ("dynamic"); None otherwise.
        chunk_started: The walk entered a chunk leased here, whose first ``skip`` items the
            session must not send (they were delivered before a resume or a reassignment).
        chunk_done: Report a finished chunk; the session sends CHUNK_DONE with its item count.
    """

    epoch: int
    seed: int
    global_worker_id: int
    leases: Optional["LeaseInbox"] = None
    chunk_started: Callable[[int, int], None] = lambda chunk, skip: None
    chunk_done: ChunkReport = _no_report


class WorkerSelection:
    """Decides, on one worker, which positions of the sharded stream this worker keeps.

    Positions count the items at the sharding point from 0 in every epoch, the same on
    every worker (shuffles before the sharding point share one seed). A selection is
    pickled with the graph and lives in the worker's process; one instance per session.
    """

    #: Set by :meth:`bind` (torchdata's ``apply_sharding`` at the workers' level).
    worker_rank: int = 0
    num_workers: int = 1
    #: True when the session must start its epochs with leases (START_EPOCH ``leased``).
    leased: bool = False

    def bind(self, worker_rank: int, num_workers: int) -> None:
        """This worker's rank among the run's ``num_workers`` worker sessions."""
        self.worker_rank, self.num_workers = worker_rank, num_workers

    def bind_outer(self, instance_id: int, num_instances: int) -> bool:
        """Called before every walk with the levels of sharding above the workers'
        (torch.distributed's): this graph is instance ``instance_id`` of ``num_instances``.
        Return True to split them yourself (:meth:`keep` then sees every item of the stream,
        and positions count them all); False (the default) has :class:`SelectionFilter`
        split them by position first."""
        return False

    def start_epoch(self, context: SelectionContext) -> None:
        """Called by the session before every epoch's walk (also without a session: defaults)."""

    def keep(self, position: int, item: Any) -> bool:
        """Whether the item at ``position`` is this worker's; may raise :class:`StopSelection`."""
        raise NotImplementedError

    def keep_span(self, position: int, item: Any) -> Tuple[bool, int]:
        """:meth:`keep` for ``position``, and the position up to which (not included) the same
        answer holds without asking again (the default: ``position + 1``). A selection that
        decides runs of positions at once (chunks) saves the walk a call per position."""
        return self.keep(position, item), position + 1

    def passed(self, position: int) -> None:
        """The item at ``position``, the last of a span :meth:`keep_span` decided (every position
        with the default one), went through the rest of the graph (kept or not)."""

    def end(self, length: Optional[int]) -> None:
        """The walk ended: the stream had ``length`` positions (None: stopped early)."""


class SelectionFilter(ShardingFilterIterDataPipe):
    """A ``sharding_filter`` whose workers' level of sharding is decided by a :class:`WorkerSelection`.

    Other levels (torch.distributed's, DEFAULT) still split the stream by position as
    ``sharding_filter`` does, unless the selection splits them itself
    (:meth:`WorkerSelection.bind_outer`); the positions the selection sees count what is left.
    """

    def __init__(self, source_datapipe: DataPipe, selection: WorkerSelection, sharding_group_filter: Any = None):
        super().__init__(source_datapipe, sharding_group_filter)
        self.selection = selection
        self._context: Optional[SelectionContext] = None

    def apply_sharding(self, num_of_instances: int, instance_id: int, sharding_group: Any = SHARDING_PRIORITIES.DEFAULT):
        """Record the level like ``sharding_filter``; the workers' level binds the selection."""
        super().apply_sharding(num_of_instances, instance_id, sharding_group)
        if sharding_group == SHARDING_PRIORITIES.MULTIPROCESSING:
            self.selection.bind(instance_id, num_of_instances)

    def set_context(self, context: Optional[SelectionContext]) -> None:
        """The session's context for the next walk (None outside a session)."""
        self._context = context

    def _outer(self) -> Tuple[int, int]:
        """``(instances, id)`` of the levels other than the workers' one."""
        instances, instance_id = 1, 0
        groups = sorted(self.groups)
        for group in reversed(groups):
            if group == SHARDING_PRIORITIES.MULTIPROCESSING:
                continue
            if self.sharding_group_filter is not None and group != self.sharding_group_filter:
                continue
            count, index = self.groups[group]
            instance_id += instances * index
            instances *= count
        return instances, instance_id

    def __iter__(self) -> Iterator[Any]:
        selection = self.selection
        context = self._context or SelectionContext(epoch=0, seed=0, global_worker_id=0)
        selection.start_epoch(context)
        instances, instance_id = self._outer()
        if selection.bind_outer(instance_id, instances):
            instances, instance_id = 1, 0
        position, decided_until, kept = 0, 0, False
        try:
            for index, item in enumerate(self.source_datapipe):
                if instances > 1 and index % instances != instance_id:
                    continue
                if position >= decided_until:
                    kept, decided_until = selection.keep_span(position, item)
                if kept:
                    yield item
                position += 1
                if position == decided_until:  # a span's end (every position, with the default keep_span)
                    selection.passed(position - 1)
        except StopSelection:
            selection.end(None)
            return
        selection.end(position)

    def __len__(self) -> int:
        raise TypeError(f"{type(self).__name__} has no length: the items a worker keeps are known as it walks")


@contextlib.contextmanager
def selection_in_place(graph: DataPipe, selection: WorkerSelection) -> Iterator[DataPipe]:
    """``graph`` with a :class:`SelectionFilter` holding ``selection`` in place of each ``sharding_filter``,
    for as long as the context lasts (to pickle it for the workers); then the graph is put back as it was."""
    found = [dp for dp in list_dps(traverse_dps(graph)) if type(dp) is ShardingFilterIterDataPipe]
    swaps = []
    for dp in found:
        replacement = SelectionFilter(dp.source_datapipe, selection, dp.sharding_group_filter)
        replacement.groups = dict(dp.groups)
        replacement._update_num_of_instances()
        swaps.append((dp, replacement))
    shipped = graph
    try:
        for dp, replacement in swaps:
            if dp is shipped:
                shipped = replacement
            else:
                replace_dp(traverse_dps(shipped), dp, replacement)
        yield shipped
    finally:
        for dp, replacement in reversed(swaps):
            if replacement is not shipped:
                replace_dp(traverse_dps(graph), replacement, dp)


def share_seeds_before_selections(datapipe: DataPipe, seed_generator: Any) -> DataPipe:
    """Seed the random DataPipes before each :class:`SelectionFilter` from the shared stream of
    ``seed_generator``, as torchdata seeds the ones before a ``sharding_filter`` (it does not know
    this subclass): every worker then walks the same stream. Runs as torchdata's ``iter_reset_fn``."""

    set_datapipes_seed(datapipes_before(selections_in(datapipe)), seed_generator, distributed_shared=True)
    return datapipe


def datapipes_before(points: Sequence[DataPipe]) -> List[DataPipe]:
    """The DataPipes before each of ``points`` (DataPipes of one graph), each once, in the order
    torchdata's ``set_graph_random_seed`` lists those before its sharding filters."""
    seen, before = set(), []
    for point in points:
        for dp in list_dps(traverse_dps(point)):
            if id(dp) not in seen:
                seen.add(id(dp))
                before.append(dp)
    return before


def selections_in(graph: DataPipe, traversal: Optional[DataPipeGraph] = None) -> List[SelectionFilter]:
    """The :class:`SelectionFilter` DataPipes of a graph (a worker session hands them their context).
    ``traversal``: the graph's ``traverse_dps``, if the caller has it (else it is traversed)."""
    return list(find_dps(traverse_dps(graph) if traversal is None else traversal, SelectionFilter))


# -- dynamic: leased chunks -----------------------------------------------------------------------
class LeaseInbox:
    """The chunks the trainer leased to one session in one epoch, fed by the control loop and
    waited on by the producer (thread-safe); ``finish()`` says no more leases will come.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: ``(first chunk, first position, positions per chunk, stop position, skip of the first
        #: chunk)`` of the runs leased and not passed by the walk, in order.
        self._runs: Deque[Tuple[int, int, int, int, int]] = collections.deque()
        self._end = 0  # the position after the latest lease
        self._final = False
        self._cancelled = False
        #: Called with True before the producer waits for a decision and False after, outside
        #: the lock (the session's item watchdog does not count waiting for the trainer as producing).
        self.waiting: Optional[Callable[[bool], None]] = None

    def add(self, chunk: int, skip: int = 0, count: int = 1, start: Optional[int] = None, size: int = 1) -> None:
        """Lease the ``count`` chunks from ``chunk`` on to this session, of ``size`` positions each
        from position ``start`` on (default: ``chunk``); the first ``skip`` items of ``chunk`` were
        already delivered."""
        start = chunk if start is None else start
        stop = start + count * size
        with self._cond:
            self._runs.append((chunk, start, size, stop, skip))
            self._end = max(self._end, stop)
            self._cond.notify_all()

    def finish(self) -> None:
        """No more leases this epoch."""
        with self._cond:
            self._final = True
            self._cond.notify_all()

    def cancel(self) -> None:
        """The epoch is over (superseded, stopped, or the session closes): wake and stop the producer."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def decide(self, position: int) -> Tuple[Optional[int], int, int]:
        """Block until ``position`` is decided: ``(chunk, skip, stop)`` when it lies in a chunk leased
        here (``position`` is then that chunk's first one: the walk enters chunks at their start;
        ``stop`` is the chunk's end), ``(None, 0, stop)`` when the positions up to ``stop`` are
        another's. Positions are asked about in increasing order.

        Raises :class:`StopSelection` when no lease will ever come for it (or the epoch ended).
        """
        waiting = self.waiting
        announced = False  # waiting(True) was called: waiting(False) follows, both outside the lock
        try:
            while True:
                with self._cond:
                    decision = self._decision(position)
                    if decision is not None:
                        return decision
                    if announced or waiting is None:
                        self._cond.wait()
                        continue
                announced = True
                waiting(True)
        finally:
            if announced:
                waiting(False)  # type: ignore[misc]

    def _decision(self, position: int) -> Optional[Tuple[Optional[int], int, int]]:
        """:meth:`decide`'s answer for ``position`` as the leases stand (the caller holds the lock);
        None while it is not decided yet."""
        if self._cancelled:
            raise StopSelection()
        runs = self._runs
        while runs and runs[0][3] <= position:
            runs.popleft()  # passed: every chunk of it was walked and reported
        if runs and runs[0][1] <= position:
            chunk, start, size, _stop, skip = runs[0]
            index = (position - start) // size
            return chunk + index, skip if index == 0 else 0, start + (index + 1) * size
        if position < self._end:
            return None, 0, runs[0][1] if runs else self._end
        if self._final:
            raise StopSelection()
        return None

    def outstanding(self, done: int) -> List[int]:
        """The leased chunks after ``done`` (the last one reported), in order."""
        with self._cond:
            return [
                chunk for first, start, size, stop, _skip in self._runs
                for chunk in range(max(first, done + 1), first + (stop - start) // size)
            ]  # fmt: skip
