"""``RPCReadingService``: the DataLoader2 front end, a thin adapter over the engine.

It knows DataLoader2 (its ``SeedGenerator``, splitting the graph around DataPipes kept in
the trainer, fullsync's shutdown, pause/resume/limit, checkpoint bytes); the workers, their
sessions and epochs are the :class:`~rpc_reading_service.trainer.engine.Engine`'s.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import cloudpickle

from ..errors import DATALOADER2_MISSING

try:
    from torchdata.dataloader2.reading_service import CheckpointableReadingServiceInterface
except ImportError as exc:  # torchdata >= 0.10 (or none): DataLoader2 is gone
    raise ImportError(DATALOADER2_MISSING.format(name="RPCReadingService")) from exc

from .checkpoint import (
    ReadingServiceState,
    check_resume,
    graph_fingerprint,
    load_seed_generator_state,
    run_state,
    seed_generator_state,
)
from .config import Liveness, ReadingServiceConfig, Reassign, TransportConfig, WorkerSource
from .engine import Engine, Positions
from ..graph import (
    InitFn,
    ResetFn,
    advance_trainer_rng,
    apply_distributed_sharding,
    destroy_seed_group,
    distributed_info,
    draw_epoch_seed,
    new_seed_group,
    split_dispatching,
    split_replicable,
)
from ..graph_utils import DataPipe, set_graph_random_seed
from ..seed_generator import SeedGenerator, dist_share_seed
from .stats import ReadingServiceStats
from .graph import (
    RemoteStream,
    delivered_count,
    pause_trainer_side,
    resume_trainer_side,
    shutdown_trainer_side,
)

__all__ = ["RPCReadingService"]


def _rebuild_service(config: bytes) -> "RPCReadingService":
    service = RPCReadingService.__new__(RPCReadingService)
    service._configure(cloudpickle.loads(config))
    return service


class RPCReadingService(CheckpointableReadingServiceInterface):
    """Run a DataPipe graph on worker servers and stream the items back to the trainer.

    Args:
        num_workers: Worker sessions. With local workers, that many on this host (``0`` runs the
            graph in the trainer's process); with remote ones, spread round-robin over the
            servers (default: one per server), each session in a process of its own. At most 4096.
        workers: Where the workers come from: :class:`~rpc_reading_service.LocalWorkers`
            (default), :class:`~rpc_reading_service.WorkerAddresses` (or a plain list of
            ``"host:port"``), :class:`~rpc_reading_service.StoreDiscovery` or
            :class:`~rpc_reading_service.Hostfile`.
        auth_key: The servers' shared key (``str`` or ``bytes``; shorter than 16 bytes warns); local
            workers get a fresh one.
        transport: A registered transport's name (``"socket"``) or a
            :class:`~rpc_reading_service.TransportConfig` (TLS, frame limit, options).
        distribution: How the work is spread and merged: ``"round_robin"`` (default: each worker
            its shard by rank, delivered one item per worker in turn, deterministic),
            ``"first_ready"`` (the same shards, delivered in arrival order), ``"dynamic"``
            (chunks of the stream leased on demand to whichever worker has room, resequenced:
            deterministic and exactly once, and the slow workers do less), a registered name
            (:func:`~rpc_reading_service.register_distribution`) or a policy object such as
            :class:`~rpc_reading_service.Dynamic` ``(chunk_size=...)``. See README "Work distribution".
        in_order: ``False`` is the shorthand for ``distribution="first_ready"`` (with
            ``"dynamic"``: its arrival-order delivery).
        prefetch: Packed frames of 1 MiB each worker may have in flight (the credit window), 1 to 2**20;
            None: 4, growing to 256 items of a kind of which a few fill a frame (at most 16 frames,
            fewer past 4 workers).
        worker_init_fn: ``fn(datapipe, worker_info) -> datapipe``, once per worker.
        worker_reset_fn: ``fn(datapipe, worker_info, seed_generator) -> datapipe``, every epoch.
        timeout: Seconds without any word from a worker before it is declared lost
            (:class:`~rpc_reading_service.errors.WorkerLostError`).
        item_timeout: Seconds one worker (or the dispatching part, before
            ``sharding_round_robin_dispatch``) may spend producing one item (``None``: no limit);
            past it :class:`~rpc_reading_service.errors.ItemTimeoutError` with its stack.
        pickle_by_value: Modules not installed on the workers whose code travels by value.
        liveness: :class:`~rpc_reading_service.Liveness` (heartbeat interval, connect timeout).
        on_worker_failure: ``"raise"`` (default), or ``"reassign"`` /
            :class:`~rpc_reading_service.Reassign` to replay a lost worker's shard on a new session
            (exactly the items of a fault-free run).
        pin_memory: Receive tensors into pinned memory when CUDA is available (from local workers:
            their shared segments, page-locked where they are mapped; no copy). Without CUDA: no effect.
        autoscale: :class:`~rpc_reading_service.Autoscale`: open and close worker sessions at epoch
            boundaries by the data stall (docs/deployment.md, autoscaling).
        worker_prefetch_cnt: MultiProcessingReadingService's name for ``prefetch``.
        main_prefetch_cnt: Items a trainer-side thread takes ahead of the training loop (default 0).
        multiprocessing_context: MPRS's name for ``LocalWorkers(start_method=...)``.
    """

    def __init__(
        self,
        num_workers: int = 0,
        workers: Union[WorkerSource, Sequence[str], None] = None,
        auth_key: Optional[Union[str, bytes]] = None,
        transport: Union[str, TransportConfig] = "socket",
        in_order: bool = True,
        prefetch: Optional[int] = None,
        worker_init_fn: Optional[InitFn] = None,
        worker_reset_fn: Optional[ResetFn] = None,
        timeout: float = 10.0,
        item_timeout: Optional[float] = None,
        pickle_by_value: Sequence[types.ModuleType] = (),
        liveness: Optional[Liveness] = None,
        on_worker_failure: Union[str, Reassign] = "raise",
        pin_memory: bool = False,
        worker_prefetch_cnt: Optional[int] = None,
        main_prefetch_cnt: int = 0,
        multiprocessing_context: Optional[str] = None,
        distribution: Any = None,
        autoscale: Any = None,
    ) -> None:
        self._configure(ReadingServiceConfig.create(
            distribution=distribution,
            num_workers=num_workers, workers=workers, auth_key=auth_key, transport=transport,
            in_order=in_order, prefetch=prefetch, worker_prefetch_cnt=worker_prefetch_cnt,
            main_prefetch_cnt=main_prefetch_cnt, multiprocessing_context=multiprocessing_context,
            worker_init_fn=worker_init_fn,
            worker_reset_fn=worker_reset_fn, timeout=timeout, item_timeout=item_timeout,
            pickle_by_value=pickle_by_value, liveness=liveness, on_worker_failure=on_worker_failure,
            pin_memory=pin_memory, autoscale=autoscale,
        ))  # fmt: skip

    def _configure(self, config: ReadingServiceConfig) -> None:
        """Keep the checked configuration; opens nothing (DataLoader2 clones us by pickling)."""
        self._config = config
        self._engine = Engine(config)
        self.in_order = config.in_order
        # MultiProcessingReadingService's attributes, for code written against it.
        self.worker_prefetch_cnt, self.main_prefetch_cnt = config.prefetch, config.main_prefetch_cnt
        self.worker_init_fn, self.worker_reset_fn = config.worker_init_fn, config.worker_reset_fn
        self.multiprocessing_context = config.workers.start_method if config.local else None  # type: ignore[union-attr]
        self._end_datapipe: Optional[DataPipe] = None
        self._stream: Optional[RemoteStream] = None
        self._main_prefetch: Optional[DataPipe] = None
        self._seed_group: Any = None
        self._seed_generator: Optional[SeedGenerator] = None
        self._resume_state: Optional[ReadingServiceState] = None  # not "_resume": DataLoader2's hook below
        self._epoch_start_generator: Optional[Dict[str, Dict[str, Any]]] = None  # its state as the epoch began
        self._fingerprint: List[str] = []
        self._end_iterator_id: Any = None  # the end DataPipe's iterator id when the epoch started
        self._ended_epoch: Any = None  # the epoch the trainer's graph ended (finalize_iteration)

    def __reduce__(self) -> Any:
        if self._engine.channels or self._engine.fleet.local_server is not None:
            raise TypeError(
                "an initialised RPCReadingService cannot be pickled; pickle it before DataLoader2 uses it"
            )
        return _rebuild_service, (cloudpickle.dumps(self._config),)  # cloudpickle: lambdas as worker_init_fn

    @property
    def num_workers(self) -> int:
        """Worker sessions (with discovery and no ``min_workers``: known once the workers are found)."""
        return self._engine.num_workers

    @property
    def _local_server(self) -> Any:
        return self._engine.fleet.local_server

    # -- ReadingServiceInterface ----------------------------------------------------------------
    def initialize(self, datapipe: DataPipe) -> DataPipe:
        """Ship the graph to the workers and return the trainer's graph that streams from them."""
        with self._engine.guard.held("setting up the workers"):
            return self._initialize(datapipe)

    def _initialize(self, datapipe: DataPipe) -> DataPipe:
        self._fingerprint = graph_fingerprint(datapipe)
        self._stream = RemoteStream(self._engine)
        if self._engine.discover() == 0:
            self._engine.start(datapipe)
            self._end_datapipe = self._stream
            return self._end_datapipe
        dist = distributed_info()
        dispatching, datapipe = split_dispatching(datapipe)  # the part before sharding_round_robin_dispatch
        branch, attach = split_replicable(datapipe)
        apply_distributed_sharding(branch, dist)
        if dispatching is not None:
            apply_distributed_sharding(dispatching, dist)
        try:
            self._seed_group = new_seed_group(dist)
            self._engine.start(branch, dist, dispatching)
        except BaseException:
            self.finalize()
            raise
        count = self._config.main_prefetch_cnt  # MPRS's trainer-side prefetch, where the workers' part was
        self._main_prefetch = self._stream.prefetch(count) if count else None
        # The user's own last DataPipe, or ours when the graph is all replicable.
        self._end_datapipe = attach(self._stream if self._main_prefetch is None else self._main_prefetch)
        return self._end_datapipe

    def initialize_iteration(
        self, seed_generator: SeedGenerator, iter_reset_fn: Optional[Callable[[DataPipe], DataPipe]] = None
    ) -> Optional[Callable[[DataPipe], DataPipe]]:
        """Start an epoch on every worker with a fresh shared seed."""
        assert self._end_datapipe is not None, "initialize() must run first"
        if self._main_prefetch is not None:
            self._main_prefetch.reset()  # stop its thread (in the last epoch's stream) first, as MPRS does
        with self._engine.guard.held("starting an epoch"):
            self._seed_generator = seed_generator  # DataLoader2's own: checkpoint() records its state
            resume, self._resume_state = self._resume_state, None
            replay_number = None
            if resume is not None and resume.replays_epoch(seed_generator):
                replay_number, resume = resume.epoch, None  # _restore_checkpoint_beginning_of_epoch()
            if resume is not None:  # continue the checkpointed epoch: its seed, skipping what was consumed
                if resume.seed_generator is not None:
                    # Undo draws made while resuming (DistributedReadingService draws every epoch),
                    # so that the epochs after this one match the uninterrupted run.
                    load_seed_generator_state(seed_generator, resume.seed_generator)
                self._epoch_start_generator = resume.epoch_start_seed_generator
                positions = Positions(tuple(resume.consumed), resume.next_rank, resume.distribution)
                advance_trainer_rng()
                self._engine.start_epoch(resume.epoch_seed, positions, number=resume.epoch)
            else:
                self._epoch_start_generator = seed_generator_state(seed_generator)
                seed = draw_epoch_seed(seed_generator)
                if self._seed_group is not None:
                    seed = dist_share_seed(seed, self._seed_group)
                advance_trainer_rng()
                self._engine.start_epoch(seed, number=replay_number)
                if self._engine.in_process_graph is None:  # trainer-side DataPipes are seeded as MPRS does
                    set_graph_random_seed(self._end_datapipe, seed_generator)
            self._end_iterator_id = self._end_datapipe._valid_iterator_id
        return None

    # -- CheckpointableReadingServiceInterface ----------------------------------------------------
    def checkpoint(self) -> bytes:
        """Seeds and per-worker positions of the current epoch (small; no data)."""
        epoch = self._engine.epoch
        delivered = delivered_count(self._end_datapipe, self._stream, self._end_iterator_id)
        # With trainer-side DataPipes, the epoch ends when the trainer's graph ends (fullsync: early).
        ended = epoch is None or (self._ended_epoch is epoch if delivered is not None else epoch.finished)
        state = run_state(
            self._engine, self._fingerprint, distributed_info(), self._seed_generator,
            self._epoch_start_generator, delivered, ended,
        )  # fmt: skip
        return state.to_bytes()

    def restore(self, datapipe: DataPipe, serialized_state: bytes) -> DataPipe:
        """Initialise from a checkpoint; the next epoch continues the checkpointed one."""
        with self._engine.guard.held("restoring a checkpoint"):
            state = ReadingServiceState.from_bytes(serialized_state)
            self._engine.discover()  # num_workers may come from discovery
            check_resume(state, self._engine, graph_fingerprint(datapipe), distributed_info(), self.finalize)
            end = self._initialize(datapipe)
            self._engine.epoch_number = state.epoch
            if not state.in_epoch:  # e.g. "dynamic"'s next chunks follow the checkpointed epoch's length
                self._engine.first_hint = self._config.distribution.hint_from_state(state.distribution)
            if state.in_epoch:
                self._resume_state = state
            return end

    def finalize_iteration(self) -> None:
        """DataLoader2 says the trainer's graph ended the epoch (also early, as fullsync does)."""
        self._ended_epoch = self._engine.epoch

    def finalize(self) -> None:
        """Stop trainer-side threads, close every session and stop local workers; idempotent."""
        end = self._end_datapipe
        if end is not None and end is not self._stream and self._engine.channels:
            shutdown_trainer_side(end)  # fullsync's or main_prefetch_cnt's thread, while the workers answer
        self._engine.close()
        destroy_seed_group(self._seed_group)
        self._seed_group = None

    # -- DataLoader2 pause / resume / limit -----------------------------------------------------
    def _pause(self, pause_fn: Optional[Callable[[DataPipe], DataPipe]] = None) -> None:
        """Pause trainer-side DataPipes; workers stop by themselves once their credits run out."""
        assert self._end_datapipe is not None
        pause_trainer_side(self._end_datapipe)

    def _resume(self, resume_fn: Optional[Callable[[DataPipe], DataPipe]] = None) -> None:
        """Resume trainer-side DataPipes (in reverse order, as torchdata does)."""
        assert self._end_datapipe is not None
        resume_trainer_side(self._end_datapipe)

    def _limit(
        self,
        num_batches: Optional[int],
        limit_fn: Optional[Callable[[DataPipe, Optional[int]], DataPipe]] = None,
    ) -> None:
        """Apply ``limit_fn`` to the trainer's graph; DataLoader2 counts and pauses itself."""
        if limit_fn is not None:
            limit_fn(self._end_datapipe, num_batches)  # type: ignore[arg-type]

    # -- the fleet ------------------------------------------------------------------------------
    def add_workers(self, addresses: Sequence[str]) -> List[str]:
        """Add worker servers to the running run (docs/deployment.md); returns the ones added.

        Call it on the reading service DataLoader2 uses (``dl.reading_service``) once the first
        epoch began. Under ``distribution="dynamic"`` their sessions take work in the current
        epoch, else from the next one on; a server that does not answer is logged and skipped.

        Args:
            addresses: ``"host:port"`` of each server (one the run has already is skipped).
        """
        return self._engine.add_workers(addresses)

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> ReadingServiceStats:
        """Throughput per worker and the trainer's data stall for the current (or last) epoch.

        Call it on the reading service DataLoader2 uses: ``dl.reading_service.stats()``.
        """
        return self._engine.stats()

    @property
    def worker_addresses(self) -> List[str]:
        """Addresses of the connected worker sessions, by rank."""
        return self._engine.worker_addresses
