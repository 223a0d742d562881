"""``"dynamic"``: chunks of the stream leased on demand, results resequenced by chunk.

The guarantees: docs/distribution.md; the design: docs/architecture.md."""

from __future__ import annotations

from typing import Any, Optional

from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe

from ...errors import ConfigurationError
from ...graph import check_per_item_after_dispatch
from ...graph_utils import DispatchPlaceholder, find_dps, find_lca_round_robin_sharding_dp, traverse_dps
from ...selection import WorkerSelection
from ...settings import MAX_POSITION, NumberRule, check_number
from ..base import DistributionPolicy, EpochRun, FleetView, Merger
from .dispatched import DispatchedMerger
from .leases import check_book_state
from .merger import DynamicMerger
from .schedule import LARGEST
from .worker import LeasedChunks

__all__ = ["Dynamic", "DEFAULT_CHUNK_SIZE", "DEFAULT_MAX_CHUNK_SIZE"]

#: Positions per chunk while the stream's length is unknown, unless given: measured with
#: benchmarks/bench_distribution.py (see DISTRIBUTION.md).
DEFAULT_CHUNK_SIZE = 16
#: The largest chunk of a guided schedule, unless given (see :mod:`.schedule`).
DEFAULT_MAX_CHUNK_SIZE = LARGEST
#: The credit window of a "dynamic" epoch's workers (DATA frames; see :meth:`Dynamic.credits`).
CREDITS = 32


def _positive(name: str, value: Any) -> int:
    try:
        check_number(NumberRule(name, integer=True, minimum=1), value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"Dynamic.{exc}") from None
    return value


class Dynamic(DistributionPolicy):
    """Work handed out on demand in chunks of the stream, delivered resequenced (``"dynamic"``).

    Args:
        chunk_size: Consecutive positions of the sharded stream per chunk while the stream's
            length is unknown (a run's first epoch, or past the previous epoch's length), and
            at most this for each worker's first leases of a guided epoch, before its speed is
            measured (default :data:`DEFAULT_CHUNK_SIZE`). Smaller balances better at the end
            of an epoch, larger costs fewer messages.
        max_chunk_size: The largest chunk of a guided epoch (default :data:`DEFAULT_MAX_CHUNK_SIZE`):
            chunks are ``ceil(left / (8 * workers))`` positions of what is left of the expected
            stream, at most this, shrinking to 1 at the end (:mod:`.schedule`).
        guided: True (default): once the stream's length is known from the previous epoch, a
            guided schedule; False: chunks of ``chunk_size`` always.
        depth: Chunks each worker holds ahead (not yet reported done); 2 keeps it busy while
            its report travels.
        window: At most this many chunks past the oldest one not yet delivered are leased
            (bounds the trainer's buffer). Default: ``4 * depth * num_workers``, growing while
            the items are small to as many chunks as hold 4 MiB per worker (up to
            ``128 * num_workers``), so that fast workers of tiny items get their leases in
            few sends (:class:`~.leases.LeaseBook`).
        in_order: True (default): resequenced by chunk, deterministic for a seed; False:
            items in arrival order (also ``RPCReadingService(distribution="dynamic", in_order=False)``).

    With a dispatch point a unit is one dispatched item (:mod:`.dispatched`): ``depth`` and
    ``window`` count units, and the default window is ``chunk_size`` times the chunks' (the
    same bound in items).
    """

    name = "dynamic"
    shared_queue = True
    leased = True
    dispatch_units = True
    elastic = True

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, depth: int = 2, window: Optional[int] = None,
                 in_order: bool = True, max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE, guided: bool = True):  # fmt: skip
        self.chunk_size = _positive("chunk_size", chunk_size)
        self.max_chunk_size = _positive("max_chunk_size", max_chunk_size)
        if not isinstance(guided, bool):
            raise ConfigurationError(f"Dynamic.guided must be True or False, got {guided!r}")
        self.guided = guided
        self.depth = _positive("depth", depth)
        self.window = None if window is None else _positive("window", window)
        if not isinstance(in_order, bool):
            raise ConfigurationError(f"Dynamic.in_order must be True or False, got {in_order!r}")
        self._in_order = in_order

    @property
    def in_order(self) -> bool:
        """Whether delivery is resequenced by chunk (deterministic for a seed)."""
        return self._in_order

    def __repr__(self) -> str:
        return (
            f"Dynamic(chunk_size={self.chunk_size}, depth={self.depth}, window={self.window}, in_order={self._in_order}, "
            f"max_chunk_size={self.max_chunk_size}, guided={self.guided})"
        )

    def check_graph(self, graph: Any) -> None:
        """Refuse a graph without ``sharding_filter``, or with a dispatch point and DataPipes
        after it that do not map each dispatched item to its outputs alone.

        The engine checks the workers' part of a dispatching graph, in which torchdata's
        placeholder stands for the dispatch point."""
        dps = traverse_dps(graph)  # pickles every DataPipe of the graph: once
        if find_lca_round_robin_sharding_dp(dps) is not None or find_dps(dps, DispatchPlaceholder):
            check_per_item_after_dispatch(graph, self.name)
            return
        if not find_dps(dps, ShardingFilterIterDataPipe):
            raise ConfigurationError(
                "distribution='dynamic' leases chunks of the stream at a sharding_filter, and this graph has "
                "none: add .sharding_filter() where the items should be split among the workers"
            )

    def worker_selection(self, fleet: FleetView) -> WorkerSelection:
        """Each worker keeps the chunks leased to it."""
        return LeasedChunks()

    def credits(self, prefetch: int) -> int:
        """At least :data:`CREDITS`: the lease window bounds what waits in the trainer, so credits
        only pace the socket (docs/architecture.md)."""
        return max(prefetch, CREDITS)

    def hint_from_state(self, state: Any) -> Optional[int]:
        """The stream's length the checkpointed epoch found (what the next epoch's schedule follows)."""
        length = state.get("stream_length") if isinstance(state, dict) else None
        valid = isinstance(length, int) and not isinstance(length, bool) and 0 <= length <= MAX_POSITION
        return length if valid else None

    def skip(self, progress: Any, rank: int) -> int:
        """Nothing is skipped by position: leases carry what was delivered of their chunk."""
        return 0

    def merger(self, run: EpochRun) -> Merger:
        """Lease, receive and resequence one epoch (with a dispatch point: its dispatched items)."""
        if run.dispatched is not None:
            return DispatchedMerger(self, run)
        return DynamicMerger(self, run)

    def check_state(self, state: Any) -> None:
        """A checkpoint of a "dynamic" epoch must hold its chunk book."""
        if state is None:
            raise ConfigurationError(
                "the checkpoint was taken mid-epoch with a distribution other than 'dynamic' (it holds per-worker "
                "positions only): resume it with the distribution it was taken with"
            )
        check_book_state(state, self.chunk_size)
