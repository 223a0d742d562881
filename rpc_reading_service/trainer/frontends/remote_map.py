"""``dp.remote_map(fn, num_workers=...)``: one stage of a DataPipe graph offloaded to worker servers.

::

    dp = IterableWrapper(paths).shuffle().sharding_filter().remote_map(decode, num_workers=4).batch(32)

The graph runs where it runs (the trainer, a DataLoader or MPRS worker process, a worker
server); only ``fn`` runs on the workers: the upstream items are dealt to them and the results
come back in order. Registered on ``IterDataPipe`` when ``rpc_reading_service`` is imported; the
engine loads on first iteration.
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing
import multiprocessing.util
import os
import types
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

from torch.utils.data import IterDataPipe, functional_datapipe

from ...errors import ConfigurationError

__all__ = ["RemoteMapperIterDataPipe", "HiddenItems"]

#: The priority of closing a run when a multiprocessing child (a DataLoader or MPRS worker) exits.
_CLOSE_PRIORITY = 10


def _module_or_none(name: str) -> Optional[types.ModuleType]:
    """The module ``name``, or None where it is not installed (a worker server that got ``fn`` by value)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class HiddenItems(IterDataPipe):
    """The items of an iterable, from its start at every iteration, kept out of torch's graph
    traversals: the engine deals them to the workers without sharding or seeding them again.

    Args:
        items: The iterable (a DataPipe graph, iterated as it was set up where it runs).
    """

    _is_child_datapipe = False  # see graph.settle_iterator_checks

    def __init__(self, items: Iterable[Any]):
        self.items: Optional[Iterable[Any]] = items

    def __iter__(self) -> Iterator[Any]:
        assert self.items is not None, "a pickled copy has no items"
        yield from self.items

    def __getstate__(self) -> dict:
        return {}  # torch traverses graphs by pickling them; what it must not touch stays out

    def __setstate__(self, state: dict) -> None:
        self.items = None


@functional_datapipe("remote_map")
class RemoteMapperIterDataPipe(IterDataPipe):
    """Apply ``fn`` to each item on worker servers (functional name ``remote_map``); the upstream
    DataPipe is iterated here and its items are dealt to the workers.

    Each process that iterates it opens its own run (its own local servers) on its first
    iteration, and each iteration is a new epoch. A pickled copy (a DataLoader's or MPRS's
    worker process) carries the settings, not the run.

    Args:
        source: The upstream DataPipe.
        fn: A picklable ``fn(item) -> result`` (by reference, or by value with ``pickle_by_value``).
        num_workers, workers, auth_key, transport, distribution, in_order, prefetch, seed, timeout,
        item_timeout, pickle_by_value, liveness, on_worker_failure, pin_memory, autoscale: as for
        :class:`~rpc_reading_service.RemoteIterable` (``num_workers=0`` with local workers: ``fn``
        runs here).
    """

    def __init__(
        self,
        source: IterDataPipe,
        fn: Callable[[Any], Any],
        num_workers: int = 0,
        workers: Any = None,
        auth_key: Optional[Union[str, bytes]] = None,
        transport: Any = "socket",
        distribution: Any = None,
        in_order: bool = True,
        prefetch: Optional[int] = None,
        seed: Optional[int] = None,
        timeout: float = 10.0,
        item_timeout: Optional[float] = None,
        pickle_by_value: Sequence[types.ModuleType] = (),
        liveness: Any = None,
        on_worker_failure: Any = "raise",
        pin_memory: bool = False,
        autoscale: Any = None,
    ) -> None:
        arguments = dict(locals())
        from .remote_run import run_config  # the engine (and torchdata) load with the first remote_map

        if not isinstance(source, IterDataPipe):
            raise ConfigurationError(f"remote_map's source must be an IterDataPipe, got {type(source).__name__}")
        if not callable(fn):
            raise ConfigurationError(f"remote_map's fn must be callable, got {type(fn).__name__}")
        self.source_datapipe = source
        self.fn = fn
        self.seed = seed
        self.config = run_config(arguments)
        self._run: Any = None
        self._owner = 0
        self._own_run()  # checks the settings that only a run checks (the seed), and starts nothing

    def _own_run(self) -> Any:
        """This process's run: a new one in a process that did not make it (a forked copy)."""
        if self._run is None or self._owner != os.getpid():
            from ...graph_utils import DispatchPlaceholder
            from .remote_run import RemoteRun

            graph = DispatchPlaceholder().map(self.fn)
            self._run = RemoteRun(graph, self.config, self.seed, dispatching=HiddenItems(self.source_datapipe))
            self._owner = os.getpid()
            if multiprocessing.parent_process() is not None:  # a child's exit runs no atexit hooks
                multiprocessing.util.Finalize(None, self._run.close, exitpriority=_CLOSE_PRIORITY)
        return self._run

    def __iter__(self) -> Iterator[Any]:
        """A new epoch: the upstream items dealt to the workers, ``fn``'s results in order (or as they come)."""
        yield from self._own_run().epoch()

    def __len__(self) -> int:
        return len(self.source_datapipe)

    def close(self) -> None:
        """Stop this process's run (its sessions and local servers); the next iteration opens a new one."""
        run, self._run = self._run, None
        if run is not None and self._owner == os.getpid():
            run.close()

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_run", "_owner")}
        # Modules do not pickle: the ones whose code travels by value go by name.
        names = tuple(module.__name__ for module in self.config.pickle_by_value)
        state["config"] = dataclasses.replace(self.config, pickle_by_value=names)
        if IterDataPipe.getstate_hook is not None:
            return IterDataPipe.getstate_hook(state)
        return state

    def __setstate__(self, state: dict) -> None:
        config = state["config"]
        modules = tuple(filter(None, map(_module_or_none, config.pickle_by_value)))
        self.__dict__.update(state, config=dataclasses.replace(config, pickle_by_value=modules), _run=None, _owner=0)
