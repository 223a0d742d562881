"""``RemoteIterable``: the front end for torch's ``DataLoader`` and torchdata's ``StatefulDataLoader``.

::

    loader = DataLoader(RemoteIterable(source, num_workers=4), batch_size=None)
    loader = StatefulDataLoader(RemoteIterable(source, num_workers=4, seed=0), batch_size=32)

The loader runs in the trainer with ``num_workers=0``: the pipeline runs on the worker servers.
"""

from __future__ import annotations

import types
from typing import Any, Dict, Iterator, Optional, Sequence, Union

import torch.utils.data

from ..config import Liveness, Reassign, TransportConfig, WorkerSource
from ...errors import ConfigurationError
from ...graph import InitFn, ResetFn
from .remote_run import RemoteRun, RunFrontEnd, run_config

__all__ = ["RemoteIterable"]


class RemoteIterable(RunFrontEnd, torch.utils.data.IterableDataset):
    """An ``IterableDataset`` whose items come from a pipeline run on worker servers, one epoch per ``iter()``.

    Args:
        source: A DataPipe graph (sharded at its ``sharding_filter``, as under DataLoader2) or a
            picklable factory ``fn(worker_info) -> iterable`` that builds worker
            ``worker_info.worker_id`` of ``worker_info.num_workers``'s items itself (global ones
            under torch.distributed), as a ``worker_init_fn`` would shard a Dataset.
        num_workers: Worker sessions (``0`` runs the source in the trainer's process); with remote
            workers, default one per server.
        workers: :class:`~rpc_reading_service.LocalWorkers` (default),
            :class:`~rpc_reading_service.WorkerAddresses` (or a list of ``"host:port"``),
            :class:`~rpc_reading_service.StoreDiscovery` or :class:`~rpc_reading_service.Hostfile`.
        auth_key: The servers' shared key; local workers get a fresh one.
        transport: A registered transport's name or a :class:`~rpc_reading_service.TransportConfig`.
        distribution: ``"round_robin"`` (default), ``"first_ready"``, ``"dynamic"``, ``"sticky"``
            or a policy object (a factory source: the first two).
        in_order: ``False`` is the shorthand for ``distribution="first_ready"``.
        prefetch: Packed frames each worker may have in flight (the credit window; None: as
            :class:`~rpc_reading_service.RPCReadingService` sizes it).
        seed: The run's seed: two runs with one seed give the same epochs, and its epochs differ.
            None: each epoch's seed is drawn from torch's global generator (``torch.manual_seed(s)``
            before an epoch reproduces it).
        worker_init_fn: ``fn(datapipe, worker_info) -> datapipe``, once per worker (DataPipe sources).
        worker_reset_fn: ``fn(datapipe, worker_info, seed_generator) -> datapipe``, every epoch.
        timeout: Seconds without a word from a worker before it is declared lost.
        item_timeout: Seconds one worker may spend producing one item (None: no limit).
        pickle_by_value: Modules not installed on the workers whose code travels by value.
        liveness: :class:`~rpc_reading_service.Liveness` (heartbeats, connect timeout).
        on_worker_failure: ``"raise"`` (default), or ``"reassign"`` /
            :class:`~rpc_reading_service.Reassign` to replay a lost worker's shard on a new session.
        pin_memory: Receive tensors into pinned memory when CUDA is available (from local workers:
            their shared segments, page-locked where they are mapped; no copy). Without CUDA: no effect.
        autoscale: :class:`~rpc_reading_service.Autoscale`: open and close worker sessions at epoch
            boundaries by the data stall (docs/deployment.md, autoscaling).
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
        worker_init_fn: Optional[InitFn] = None,
        worker_reset_fn: Optional[ResetFn] = None,
        timeout: float = 10.0,
        item_timeout: Optional[float] = None,
        pickle_by_value: Sequence[types.ModuleType] = (),
        liveness: Optional[Liveness] = None,
        on_worker_failure: Union[str, Reassign] = "raise",
        pin_memory: bool = False,
        autoscale: Any = None,
    ) -> None:
        self._run = RemoteRun(source, run_config(locals()), seed)

    def __iter__(self) -> Iterator[Any]:
        """Start an epoch on the workers (the next one, or the one a loaded state resumes)."""
        if torch.utils.data.get_worker_info() is not None:
            raise ConfigurationError(
                "RemoteIterable runs its pipeline on the worker servers: give the DataLoader num_workers=0 "
                "(the default) and RemoteIterable(num_workers=N) the workers"
            )
        return self._run.epoch()

    def state_dict(self) -> Dict[str, Any]:
        """The position in the current epoch (seeds and items taken per worker; no data).
        StatefulDataLoader (``num_workers=0``) calls it from its own ``state_dict()``."""
        return self._run.state()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Resume: the next ``iter()`` continues the recorded epoch exactly where it was."""
        self._run.load_state(state_dict)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a RemoteIterable is not pickled: it runs in the trainer (DataLoader num_workers=0) and ships its "
            "source to the worker servers itself"
        )

