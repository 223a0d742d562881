"""What every loader-neutral front end does with the engine: ship a source, seed its epochs,
record and resume their positions. The front ends (torch's DataLoader, torchdata.nodes) only
translate their host library's calls to these."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence

from ..checkpoint import (
    ReadingServiceState,
    check_resume,
    graph_fingerprint,
    load_seed_generator_state,
    run_state,
    seed_generator_state,
)
from ..config import ReadingServiceConfig
from ..engine import Engine, Positions
from ...errors import ConfigurationError
from ...graph import (
    DistributedInfo,
    advance_trainer_rng,
    apply_distributed_sharding,
    destroy_seed_group,
    distributed_info,
    draw_epoch_seed,
    new_seed_group,
    split_dispatching,
)
from ...graph_utils import DispatchPlaceholder, find_dps, replace_dp, traverse_dps
from ...seed_generator import SeedGenerator, dist_share_seed
from ...settings import NumberRule, check_number
from ..stats import ReadingServiceStats
from .sources import FactorySource, as_graph

__all__ = ["RemoteRun", "RunFrontEnd", "run_config"]

#: The policies under which each worker keeps a fixed shard by rank (a factory shards itself by rank).
_FIXED_SHARD_POLICIES = ("round_robin", "first_ready")


def _nothing() -> None:
    """Nothing to stop (the run's workers are already in use)."""


#: A front end's ``__init__`` arguments that are not settings of the run's configuration.
_NOT_SETTINGS = ("self", "__class__", "source", "seed", "fn")


def run_config(arguments: Dict[str, Any]) -> ReadingServiceConfig:
    """The checked configuration from a front end's ``__init__`` arguments (its ``locals()``)."""
    return ReadingServiceConfig.create(**{k: v for k, v in arguments.items() if k not in _NOT_SETTINGS})


class RemoteRun:
    """One source run on the workers, epoch after epoch, with seeds and exact positions.

    Args:
        source: A DataPipe graph or a picklable factory ``fn(worker_info) -> iterable``.
        config: The run's checked configuration.
        seed: The run's seed (None: each epoch's seed comes from torch's global generator).
    """

    def __init__(
        self, source: Any, config: ReadingServiceConfig, seed: Optional[int] = None, dispatching: Any = None
    ):
        self.graph = as_graph(source)
        #: A trainer-side DataPipe whose items are dealt to the workers, where ``source`` has a
        #: :class:`~rpc_reading_service.graph_utils.DispatchPlaceholder` (None: the graph's own, if any).
        self.dispatching = dispatching
        policy = config.distribution
        if isinstance(self.graph, FactorySource) and policy.name not in _FIXED_SHARD_POLICIES:
            raise ConfigurationError(
                f"distribution={policy.name!r} splits a DataPipe graph at its sharding_filter, and a factory "
                "source builds each worker's shard itself: use distribution='round_robin' or 'first_ready', or "
                "pass a DataPipe graph with .sharding_filter()"
            )
        self.config = config
        self.engine = Engine(config)
        self.fingerprint: List[str] = graph_fingerprint(self.graph)
        if dispatching is not None:
            self.fingerprint += graph_fingerprint(dispatching)
        check_number(NumberRule("seed", integer=True, minimum=0, optional=True, maximum=2**64 - 1), seed)
        self.generator: Optional[SeedGenerator] = None if seed is None else SeedGenerator(seed)
        self.dist = DistributedInfo()
        self._started = False
        self._seed_group: Any = None
        self._resume: Optional[ReadingServiceState] = None
        self._epoch_start_generator: Optional[Dict[str, Dict[str, Any]]] = None

    def _start(self) -> None:
        """Find and start the workers and ship them the graph (once)."""
        engine, graph, dispatching = self.engine, self.graph, self.dispatching
        self.dist = dist = distributed_info()
        if dispatching is None:
            apply_distributed_sharding(graph, dist)
        if engine.discover() == 0:  # the graph runs here, its dispatched items put back in place
            if dispatching is not None:
                placeholder = find_dps(traverse_dps(graph), DispatchPlaceholder)[0]
                graph = list(replace_dp(traverse_dps(graph), placeholder, dispatching).values())[0][0]
            engine.start(graph, dist)
            self._started = True
            return
        if dispatching is None:
            dispatching, graph = split_dispatching(graph)  # the part before sharding_round_robin_dispatch
        if dispatching is not None:
            apply_distributed_sharding(dispatching, dist)
        try:
            self._seed_group = new_seed_group(dist)
            engine.start(graph, dist, dispatching)
        except BaseException:
            self.close()
            raise
        self._started = True

    def epoch(self) -> Iterator[Any]:
        """Start the next epoch (or the resumed one) on every worker and return its items."""
        engine = self.engine
        with engine.guard.held("starting an epoch"):
            if not self._started:
                self._start()
            resume, self._resume = self._resume, None
            if resume is not None and resume.in_epoch:  # its seed, skipping what was consumed
                self._epoch_start_generator = resume.epoch_start_seed_generator
                positions = Positions(tuple(resume.consumed), resume.next_rank, resume.distribution)
                advance_trainer_rng()
                epoch = engine.start_epoch(resume.epoch_seed, positions, number=resume.epoch)
            else:
                # Unseeded: a generator seeded from torch's global one, every epoch (as DataLoader2 does).
                generator = self.generator if self.generator is not None else SeedGenerator()
                self._epoch_start_generator = seed_generator_state(self.generator)
                seed = draw_epoch_seed(generator)
                if self._seed_group is not None:
                    seed = dist_share_seed(seed, self._seed_group)
                advance_trainer_rng()
                epoch = engine.start_epoch(seed)
        return iter(epoch)

    def state(self) -> Dict[str, Any]:
        """The run's position: seeds and items consumed per worker, JSON-able (no data)."""
        with self.engine.guard.held("taking a state_dict"):
            if self._resume is not None:  # loaded and not started yet: the same state again
                return self._resume.to_dict()
            state = run_state(
                self.engine, self.fingerprint, self.dist if self._started else distributed_info(),
                self.generator, self._epoch_start_generator,
            )  # fmt: skip
            return state.to_dict()

    def load_state(self, state_dict: Dict[str, Any]) -> None:
        """Resume from :meth:`state`: the next epoch continues the recorded one exactly."""
        state = ReadingServiceState.from_dict(state_dict)
        with self.engine.guard.held("restoring a checkpoint"):
            self.engine.discover()  # num_workers may come from discovery
            # Finding the placement may start a local server: a refused state stops it before the run starts.
            close = self.close if not self._started else _nothing
            check_resume(state, self.engine, self.fingerprint, distributed_info(), close)
            if state.seed_generator is not None:
                if self.generator is None:
                    raise ConfigurationError(
                        "the state was taken by a run with a seed and this one has none: pass the same seed="
                    )
                load_seed_generator_state(self.generator, state.seed_generator)
            self.engine.epoch_number = state.epoch
            if not state.in_epoch:  # e.g. "dynamic"'s next chunks follow the recorded epoch's length
                self.engine.first_hint = self.config.distribution.hint_from_state(state.distribution)
            self._resume = state

    def close(self) -> None:
        """Close every session and stop local workers; idempotent."""
        self.engine.close()
        destroy_seed_group(self._seed_group)
        self._seed_group = None


class RunFrontEnd:
    """What a front end over a :class:`RemoteRun` (its ``_run``) offers besides its host library's calls."""

    _run: RemoteRun

    def stats(self) -> ReadingServiceStats:
        """Throughput per worker and the trainer's data stall for the current (or last) epoch."""
        return self._run.engine.stats()

    def add_workers(self, addresses: Sequence[str]) -> List[str]:
        """Add worker servers to the started run (docs/deployment.md); returns the ones added.

        Args:
            addresses: ``"host:port"`` of each server (one the run has already is skipped).
        """
        return self._run.engine.add_workers(addresses)

    @property
    def num_workers(self) -> int:
        """Worker sessions of the run (with discovery: known once they are found)."""
        return self._run.engine.num_workers

    @property
    def worker_addresses(self) -> List[str]:
        """Addresses of the connected worker sessions, by rank."""
        return self._run.engine.worker_addresses

    def close(self) -> None:
        """Close every session and stop local workers; idempotent (also at interpreter exit)."""
        self._run.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
