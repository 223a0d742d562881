"""``RemoteNode`` and ``RemoteMapper``: the front end for ``torchdata.nodes`` (torchdata >= 0.10).

::

    node = RemoteNode(source, num_workers=4, seed=0)              # a DataPipe graph or a factory
    node = RemoteMapper(IterableWrapper(paths), decode, num_workers=4)  # the source runs here, fn there
    loader = Loader(Prefetcher(Batcher(node, 32), 2))

Each is a ``BaseNode``: ``reset()`` starts an epoch on the workers, ``state_dict()`` /
``reset(initial_state)`` resume it exactly.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Union

from ..config import Liveness, Reassign, TransportConfig, WorkerSource
from ...errors import ConfigurationError
from ...graph_utils import DispatchPlaceholder
from .remote_map import HiddenItems
from .remote_run import RemoteRun, RunFrontEnd, run_config

try:
    from torchdata.nodes import BaseNode
except ImportError as exc:  # torchdata < 0.10 (or none)
    raise ImportError(
        "RemoteNode and RemoteMapper are the torchdata.nodes front end, and this torchdata has no "
        "torchdata.nodes (added in 0.10): pip install 'rpc-reading-service[nodes]' (torchdata>=0.10), or "
        "use RemoteIterable with torch's DataLoader"
    ) from exc

__all__ = ["RemoteNode", "RemoteMapper"]


class _RemoteBase(RunFrontEnd, BaseNode):
    """A ``BaseNode`` over a :class:`~.remote_run.RemoteRun`: one epoch per ``reset()``."""

    def __init__(self, run: RemoteRun):
        super().__init__()
        self._run = run
        self._items: Optional[Iterator[Any]] = None

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        """Start the next epoch on the workers, or the one ``initial_state`` (a ``state_dict()``) resumes."""
        super().reset(initial_state)
        if initial_state is not None:
            self._run.load_state(initial_state)
        self._items = self._run.epoch()

    def next(self) -> Any:
        """The epoch's next item (StopIteration at its end)."""
        assert self._items is not None, "reset() must run first"
        return next(self._items)

    def get_state(self) -> Dict[str, Any]:
        """The position in the current epoch (seeds and items taken per worker; no data)."""
        return self._run.state()


class RemoteNode(_RemoteBase):
    """A ``BaseNode`` whose items come from a pipeline run on worker servers.

    Args:
        source: A DataPipe graph (sharded at its ``sharding_filter``) or a picklable factory
            ``fn(worker_info) -> iterable`` building worker ``worker_info.worker_id`` of
            ``worker_info.num_workers``'s items.
        num_workers, workers, auth_key, transport, distribution, in_order, prefetch, seed,
        worker_init_fn, worker_reset_fn, timeout, item_timeout, pickle_by_value, liveness,
        on_worker_failure, pin_memory, autoscale: as for :class:`~rpc_reading_service.RemoteIterable`.
    """

    def __init__(
        self,
        source: Any,
        num_workers: int = 0,
        workers: Union[WorkerSource, Sequence[str], None] = None,
        auth_key: Optional[Union[str, bytes]] = None,
        transport: Union[str, TransportConfig] = "socket",
        distribution: Any = None,
        in_order: bool = True,
        prefetch: Optional[int] = None,
        seed: Optional[int] = None,
        worker_init_fn: Optional[Callable[..., Any]] = None,
        worker_reset_fn: Optional[Callable[..., Any]] = None,
        timeout: float = 10.0,
        item_timeout: Optional[float] = None,
        pickle_by_value: Sequence[types.ModuleType] = (),
        liveness: Optional[Liveness] = None,
        on_worker_failure: Union[str, Reassign] = "raise",
        pin_memory: bool = False,
        autoscale: Any = None,
    ) -> None:
        super().__init__(RemoteRun(source, run_config(locals()), seed))


class NodeItems(HiddenItems):
    """The items of a ``BaseNode``, from its start at every iteration: a RemoteMapper's source,
    run in the trainer and dealt to the workers (the node, with its threads and queues, never pickled)."""

    def __iter__(self) -> Iterator[Any]:
        node = self.items
        assert isinstance(node, BaseNode), "a copy of NodeItems has no node"
        node.reset(None)
        yield from node


class RemoteMapper(_RemoteBase):
    """``fn`` applied on worker servers to the items of ``source``, a ``BaseNode`` run in the trainer
    (as ``ParallelMapper`` does with local threads or processes): the items are dealt to the workers
    under credit and come back in ``source``'s order (``distribution="round_robin"`` or ``"dynamic"``).

    Args:
        source: The ``BaseNode`` whose items are mapped; it restarts (``reset()``) every epoch, and a
            resumed epoch deals from its start again (the workers skip what was consumed).
        fn: A picklable ``fn(item) -> result`` (by reference, or by value with ``pickle_by_value``).
        num_workers, workers, auth_key, transport, distribution, in_order, prefetch, seed, timeout,
        item_timeout, pickle_by_value, liveness, on_worker_failure, pin_memory, autoscale: as for
        :class:`~rpc_reading_service.RemoteIterable`.
    """

    def __init__(
        self,
        source: BaseNode,
        fn: Callable[[Any], Any],
        num_workers: int = 0,
        workers: Union[WorkerSource, Sequence[str], None] = None,
        auth_key: Optional[Union[str, bytes]] = None,
        transport: Union[str, TransportConfig] = "socket",
        distribution: Any = None,
        in_order: bool = True,
        prefetch: Optional[int] = None,
        seed: Optional[int] = None,
        timeout: float = 10.0,
        item_timeout: Optional[float] = None,
        pickle_by_value: Sequence[types.ModuleType] = (),
        liveness: Optional[Liveness] = None,
        on_worker_failure: Union[str, Reassign] = "raise",
        pin_memory: bool = False,
        autoscale: Any = None,
    ) -> None:
        if not isinstance(source, BaseNode):
            raise ConfigurationError(
                f"RemoteMapper's source must be a torchdata.nodes BaseNode, got {type(source).__name__}: wrap an "
                "iterable as torchdata.nodes.IterableWrapper(items)"
            )
        if not callable(fn):
            raise ConfigurationError(f"RemoteMapper's fn must be callable, got {type(fn).__name__}")
        config = run_config(locals())
        super().__init__(RemoteRun(DispatchPlaceholder().map(fn), config, seed, dispatching=NodeItems(source)))
