"""The trainer's side of a DataLoader2 graph: the stream from the workers and what follows it.

DataPipes after the replicable part (fullsync, prefetch, a user's non-replicable DataPipe)
stay in the trainer, untouched. This module holds what the DataLoader2 front end does with
them: stand in for the workers' part, count what the training loop received (with torch's
own iterator hook, so the graph stays the user's), pause, resume and shut them down.
"""

from __future__ import annotations

import logging
from concurrent.futures import wait as wait_futures
from typing import Any, Iterator, List, Optional

from torch.utils.data import IterDataPipe

from .engine import Engine
from ..graph_utils import DataPipe, list_dps, traverse_dps

__all__ = [
    "RemoteStream",
    "delivered_count",
    "trainer_side_dps",
    "pause_trainer_side",
    "resume_trainer_side",
    "shutdown_trainer_side",
]

log = logging.getLogger(__name__)


class RemoteStream(IterDataPipe):
    """The trainer-side stand-in for the graph that runs on the workers: the current epoch's items."""

    #: Not a fork's child: torch's per-item iterator check looks this up, and without it raises
    #: (and formats) an AttributeError for every item (see graph.settle_iterator_checks).
    _is_child_datapipe = False

    def __init__(self, engine: Engine):
        self._engine: Optional[Engine] = engine

    def __iter__(self) -> Iterator[Any]:
        engine = self._engine
        assert engine is not None and engine.epoch is not None, "initialize_iteration() must run first"
        items = iter(engine.epoch)
        # torch's iterator hook hands this on as it is, not wrapped in its per-item checks
        # (docs/architecture.md, "The path of one item").
        self._fast_forward_iterator = items
        return items

    def __getstate__(self) -> dict:
        return {}  # torchdata traverses graphs by pickling them; the engine (sockets, threads) stays out

    def __setstate__(self, state: dict) -> None:
        self._engine = None  # a detached copy: iterating it is an error


def delivered_count(
    end: Optional[DataPipe], stream: Optional[DataPipe], iterator_id_at_start: Any
) -> Optional[int]:
    """Items the training loop received this epoch from ``end``, the last DataPipe of the
    trainer's graph; ``None`` when ``end`` is the ``stream`` itself (nothing held back).

    torch's iterator hook counts ``_number_of_samples_yielded`` on every DataPipe and resets it
    when a new iterator starts, which changes ``_valid_iterator_id``: an id still equal to the
    one at the start of the epoch means the epoch's iteration has not begun there yet.
    """
    if end is None or end is stream:
        return None
    if end._valid_iterator_id == iterator_id_at_start:
        return 0
    return end._number_of_samples_yielded


def trainer_side_dps(end: DataPipe) -> List[DataPipe]:
    """Every DataPipe of the trainer's graph ending in ``end``."""
    return list_dps(traverse_dps(end))


def pause_trainer_side(end: DataPipe) -> None:
    """Pause the trainer-side DataPipes that can pause (prefetchers)."""
    for dp in trainer_side_dps(end):
        if callable(getattr(dp, "pause", None)):
            dp.pause()


def resume_trainer_side(end: DataPipe) -> None:
    """Resume them, in reverse order (as torchdata does)."""
    for dp in reversed(trainer_side_dps(end)):
        if callable(getattr(dp, "resume", None)):
            dp.resume()


def shutdown_trainer_side(end: DataPipe, timeout: float = 10.0) -> None:
    """Stop the threads of the trainer-side DataPipes (fullsync's prefetcher), from ``finalize``."""
    for dp in trainer_side_dps(end):
        if callable(getattr(dp, "shutdown", None)):
            _shutdown(dp, timeout)


def _shutdown(dp: DataPipe, timeout: float) -> None:
    # Left to the garbage collector, FullSync.__del__ joins its thread at an arbitrary moment
    # (FullSync and its executor form a reference cycle), which can deadlock a thread start.
    # FullSync's pending prefetch ends in an all_reduce that the other ranks' pending prefetches
    # pair with: let it finish instead of cancelling it on this rank only.
    pending = list(getattr(getattr(dp, "_executor", None), "_futures", None) or ())
    if pending and wait_futures(pending, timeout=timeout).not_done:
        log.warning(
            "trainer-side %s still waits for other ranks after %.0f s; not stopping it",
            type(dp).__name__,
            timeout,
        )
        return
    try:
        dp.shutdown()
    except Exception:  # noqa: BLE001 - finalize must go on
        log.warning("shutting down trainer-side %s failed", type(dp).__name__, exc_info=True)
