"""The reading service's checkpoint: small, versioned, and checked before it is used.

A checkpoint holds seeds and positions, never data: the epoch number, the epoch's shared
seed, how many items of each worker's shard the trainer has consumed, whose turn
is next in the round-robin, the distribution policy's name and own state ("dynamic": which
chunks were delivered, and how much of the partly delivered ones; "sticky": a digest of the
servers the keys were placed on). Resuming replays each worker's shard from the same seed and
skips the consumed items, so the rest of the epoch comes out exactly as it would have.
The document carries a SHA-256 digest of its content: an edited or corrupted state is refused
(docs/checkpointing.md says why it is not keyed).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import ConfigurationError, malformed_checkpoint
from ..graph_utils import DataPipe, list_dps, traverse_dps
from ..settings import MAX_POSITION, NumberRule, check_number

__all__ = [
    "CHECKPOINT_VERSION",
    "ReadingServiceState",
    "checkpoint_digest",
    "graph_fingerprint",
    "seed_generator_state",
    "load_seed_generator_state",
    "run_state",
    "check_resume",
]

CHECKPOINT_VERSION = 1


def graph_fingerprint(datapipe: DataPipe) -> List[str]:
    """The DataPipe classes of a graph, in traversal order: a cheap, process-independent identity."""
    return [f"{type(dp).__module__}.{type(dp).__qualname__}" for dp in list_dps(traverse_dps(datapipe))]


_RNGS = ("_shared_rng", "_worker_rng")
_ENGINE_FIELDS = ("_seed", "_ctr", "_generated_seeds", "_spawn_seed")


def seed_generator_state(generator: Any) -> Optional[Dict[str, Dict[str, Any]]]:
    """The exact state of a torchdata ``SeedGenerator``, as JSON-able ints (None if unknown).

    A snapshot, in the form JSON gives back (lists, not tuples or the engine's own counter
    list, which later draws change in place): states compare equal across a checkpoint.
    """
    try:
        engines = {rng: getattr(generator, rng) for rng in _RNGS}
        return {rng: {f: _snapshot(getattr(e, f)) for f in _ENGINE_FIELDS} for rng, e in engines.items()}
    except AttributeError:
        return None


def _copy_json(value: Any) -> Any:
    """A copy of the dicts and lists of a JSON value (tuples become lists, as JSON gives them back)."""
    if isinstance(value, dict):
        return {key: _copy_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy_json(item) for item in value]
    return value


def _snapshot(value: Any) -> Any:
    return [int(word) for word in value] if isinstance(value, (list, tuple)) else value


def load_seed_generator_state(generator: Any, state: Dict[str, Dict[str, Any]]) -> None:
    """Put a state from :func:`seed_generator_state` back into ``generator``, in place."""
    for rng in _RNGS:
        engine, values = getattr(generator, rng), state[rng]
        engine._seed = tuple(int(v) for v in values["_seed"])
        engine._ctr = [int(v) for v in values["_ctr"]]
        generated = values["_generated_seeds"]
        engine._generated_seeds = None if generated is None else [int(v) for v in generated]
        engine._spawn_seed = tuple(int(v) for v in values["_spawn_seed"])


@dataclass
class ReadingServiceState:
    """Everything needed to continue an epoch where a checkpoint left it."""

    num_workers: int
    graph: List[str]
    epoch: int = 0
    epoch_seed: int = 0
    consumed: List[int] = field(default_factory=list)
    next_rank: int = 0
    in_epoch: bool = False
    version: int = CHECKPOINT_VERSION
    #: DataLoader2's seed generator at the checkpoint: resuming puts it back, because reading
    #: services before ours (DistributedReadingService) draw from it again when the epoch resumes.
    seed_generator: Optional[Dict[str, Dict[str, Any]]] = None
    #: This trainer's place in a torch.distributed job: each rank resumes its own shards.
    dist_rank: int = 0
    dist_world_size: int = 1
    #: DataLoader2's seed generator as it was when the checkpointed epoch began (absent in
    #: checkpoints written before it was recorded): see :meth:`replays_epoch`.
    epoch_start_seed_generator: Optional[Dict[str, Dict[str, Any]]] = None
    #: The distribution policy's state of the checkpointed epoch (None for policies whose workers
    #: own a fixed shard: ``consumed`` says it all). Its policy checks it when resuming.
    distribution: Optional[Dict[str, Any]] = None
    #: The distribution policy's registered name (absent in checkpoints written before it was
    #: recorded), and its digest of what decides which worker owns which item besides their
    #: number ("sticky": the servers' addresses), recorded in an epoch.
    distribution_name: Optional[str] = None
    placement: Optional[str] = None

    def to_bytes(self) -> bytes:
        """Serialise as JSON (readable, and nothing to unpickle), with its digest."""
        return json.dumps(self.to_dict(), sort_keys=True).encode("utf-8")

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a dict of JSON values (its own copies: a caller may change them), with their digest."""
        values = {f.name: _copy_json(getattr(self, f.name)) for f in fields(self)}
        values[DIGEST_FIELD] = checkpoint_digest(values)
        return values

    @classmethod
    def from_bytes(cls, data: bytes) -> "ReadingServiceState":
        """Parse a checkpoint, refusing other versions, malformed data and a digest that does not match."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ConfigurationError(
                f"not an RPCReadingService checkpoint: the reading service's state must be bytes (what "
                f"state_dict() gave), got a {type(data).__name__}"
            )
        try:
            values: Any = json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ConfigurationError(f"not an RPCReadingService checkpoint: {exc}") from exc
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: Any) -> "ReadingServiceState":
        """A state from :meth:`to_dict`'s form, refusing other versions and malformed fields."""
        version = values.get("version") if isinstance(values, dict) else None
        if type(version) is not int or version != CHECKPOINT_VERSION:  # not True, which == 1
            raise ConfigurationError(
                f"checkpoint has version {version!r}, this rpc_reading_service reads version {CHECKPOINT_VERSION}"
            )
        values = dict(values)  # the caller's dict stays as it was
        digest = values.pop(DIGEST_FIELD, None)
        _check_fields(values)
        state = cls(**_copy_json(values))
        _check_digest(digest, asdict(state))
        return state

    def replays_epoch(self, seed_generator: Any) -> bool:
        """Whether DataLoader2 hands back the generator the checkpointed epoch began with.

        ``DataLoader2._restore_checkpoint_beginning_of_epoch()`` puts that generator back to ask
        for the epoch again from its first item; a mid-epoch resume hands over the advanced one.
        (Without ``dl.seed()``, DataLoader2 reseeds from torch's RNG instead, so a resumed run whose
        torch RNG is where the checkpointed epoch's was replays that epoch too.)
        """
        start = self.epoch_start_seed_generator
        return self.in_epoch and start is not None and seed_generator_state(seed_generator) == start

    def check_compatible(
        self, num_workers: int, graph: List[str], dist_rank: int = 0, dist_world_size: int = 1, elastic: bool = False
    ) -> None:
        """Refuse to resume with another graph or trainer rank, or in an epoch with another number
        of workers unless the policy is ``elastic`` (its positions are the stream's, not per rank)."""
        if (dist_rank, dist_world_size) != (self.dist_rank, self.dist_world_size):
            raise ConfigurationError(
                f"checkpoint was taken by trainer rank {self.dist_rank} of {self.dist_world_size}, this is "
                f"rank {dist_rank} of {dist_world_size}: each rank must resume from its own state, with the "
                "same world size"
            )
        resized = self.in_epoch and num_workers != self.num_workers
        if resized and not elastic:
            raise ConfigurationError(
                f"checkpoint was taken in an epoch with num_workers={self.num_workers}, this reading service has "
                f"num_workers={num_workers}: each worker's shard depends on their number, so resume with "
                f"{self.num_workers} worker sessions, or from a checkpoint taken between epochs (any number of "
                "sessions may start the next epoch), or use distribution='dynamic' (any number resumes an epoch)"
            )
        if resized and 0 in (num_workers, self.num_workers):
            raise ConfigurationError(
                f"checkpoint was taken in an epoch with num_workers={self.num_workers}, this reading service has "
                f"num_workers={num_workers}: an epoch of the trainer's own graph (num_workers=0) and one on worker "
                "servers do not resume each other; resume with the same kind of run, or from a checkpoint taken "
                "between epochs"
            )
        # An empty graph: checkpointed before DataLoader2 ever iterated (no position to check).
        if self.graph and graph != self.graph:
            raise ConfigurationError(
                "checkpoint was taken with a different DataPipe graph "
                f"({' -> '.join(c.rsplit('.', 1)[-1] for c in self.graph)}); resume with the same graph"
            )

    def check_distribution(self, name: str) -> None:
        """Refuse to resume an epoch taken with another distribution policy (between epochs the next
        one starts afresh: any policy may take it)."""
        recorded = self.distribution_name
        if self.in_epoch and recorded is not None and recorded != name:
            raise ConfigurationError(
                f"checkpoint was taken in an epoch with distribution={recorded!r}, this reading service has "
                f"distribution={name!r}: the workers' shards differ; resume with distribution={recorded!r} "
                "(or from a checkpoint taken between epochs)"
            )

    def check_placement(self, placement: Optional[str]) -> None:
        """Refuse to resume an epoch whose items were placed on other workers (``"sticky"``: other
        server addresses, or the same ones in another order): each rank would replay another shard."""
        if self.in_epoch and placement != self.placement and self.distribution_name is not None:
            raise ConfigurationError(
                f"checkpoint was taken with distribution={self.distribution_name!r} over other worker "
                f"servers (placement {self.placement}, this run's is {placement}): its shards belong to "
                "those servers; resume with the same worker addresses in the same order"
            )


#: The field that holds :func:`checkpoint_digest` (not a dataclass field: it covers them all).
DIGEST_FIELD = "digest"


def checkpoint_digest(values: Dict[str, Any]) -> str:
    """``"sha256:<hex>"`` of the canonical JSON of a state's fields (``asdict`` of the state)."""
    canonical = json.dumps(values, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _check_digest(digest: Any, values: Dict[str, Any]) -> None:
    """Refuse a state whose digest does not match its fields; warn about one without a digest."""
    if digest is None:
        warnings.warn(
            "this RPCReadingService checkpoint has no digest (written before checkpoints carried one, or the "
            "digest was removed): its fields are checked, but an edit of a position inside a shard cannot be "
            "detected. Take a new checkpoint with this version",
            UserWarning, stacklevel=4,
        )  # fmt: skip
        return
    if not isinstance(digest, str) or digest != checkpoint_digest(values):
        raise ConfigurationError(
            f"RPCReadingService checkpoint does not match its digest ({digest!r:.80}): it was edited, truncated or "
            "corrupted after state_dict() wrote it. Resume from an unmodified state_dict()"
        )


def run_state(
    engine: Any,
    graph: List[str],
    dist: Any,
    seed_generator: Any,
    epoch_start_seed_generator: Optional[Dict[str, Dict[str, Any]]],
    delivered: Optional[int] = None,
    ended: Optional[bool] = None,
) -> ReadingServiceState:
    """The state of a front end's run now: ``engine`` (an :class:`~rpc_reading_service.trainer.engine.Engine`)
    at its current epoch's positions.

    Args:
        graph: The graph's :func:`graph_fingerprint`. dist: the trainer's ``DistributedInfo``.
        seed_generator: The front end's generator (recorded exactly; None: none).
        epoch_start_seed_generator: Its state as the current epoch began.
        delivered: Items the consumer really received, if a stage after the stream holds some back.
        ended: Whether the epoch ended for the consumer (default: every item of it was taken).
    """
    epoch = engine.epoch
    positions = epoch.positions(delivered) if epoch is not None else None
    if ended is None:
        ended = epoch is None or epoch.finished
    config = engine.config
    return ReadingServiceState(
        num_workers=engine.num_workers, graph=graph, epoch=engine.epoch_number,
        epoch_seed=epoch.seed if epoch is not None else 0,
        consumed=list(positions.consumed) if positions is not None else [],
        next_rank=positions.next_rank if positions is not None else 0, in_epoch=not ended,
        seed_generator=None if seed_generator is None else seed_generator_state(seed_generator),
        dist_rank=dist.rank, dist_world_size=dist.world_size,
        epoch_start_seed_generator=epoch_start_seed_generator,
        distribution=None if positions is None or positions.policy is None else dict(positions.policy),
        distribution_name=config.distribution.name,
        placement=None if ended else engine.placement(),
    )  # fmt: skip


def check_resume(
    state: ReadingServiceState, engine: Any, graph: List[str], dist: Any, close: Callable[[], None]
) -> None:
    """Refuse a state that ``engine``'s run (its workers found, not started) could not have produced:
    another number of workers, graph (its :func:`graph_fingerprint`), trainer rank (``dist``),
    distribution policy or placement. Finding the placement may start a local server: ``close``
    stops it when the placement is refused."""
    elastic = engine.config.distribution.elastic
    state.check_compatible(engine.num_workers, graph, dist.rank, dist.world_size, elastic)
    if state.in_epoch and engine.num_workers > 0:  # the trainer's own graph resumes by position
        policy = engine.config.distribution
        policy.check_state(state.distribution)
        state.check_distribution(policy.name)
        try:
            state.check_placement(engine.placement())
        except BaseException:
            close()
            raise


_UINT32 = 2**32 - 1
_SEED_GENERATOR_LENGTHS = {"_seed": 2, "_ctr": 4, "_generated_seeds": 4, "_spawn_seed": 2}


#: Fields a version-1 checkpoint written before they existed lacks (they default to None).
_ADDED_IN_VERSION_1 = ("epoch_start_seed_generator", "distribution", "distribution_name", "placement")


def _refuse(field_name: str, problem: str) -> ConfigurationError:
    return malformed_checkpoint(f"field {field_name!r} {problem}")


def _check_int(field_name: str, value: Any, minimum: int = 0, maximum: Optional[int] = None) -> int:
    try:
        check_number(NumberRule("value", integer=True, minimum=minimum, maximum=maximum), value)
    except ConfigurationError as exc:
        raise _refuse(field_name, str(exc).replace("value must", "must", 1)) from None
    return value


def _check_list(field_name: str, value: Any, lengths: Optional[Tuple[int, ...]] = None) -> List[Any]:
    if not isinstance(value, list):
        raise _refuse(field_name, f"must be a list, got {value!r} of type {type(value).__name__}")
    if lengths is not None and len(value) not in lengths:
        wanted = " or ".join(str(n) for n in lengths)
        raise _refuse(field_name, f"has {len(value)} entries, expected {wanted}")
    return value


def _check_seed_generator(state: Any, field_name: str = "seed_generator") -> None:
    if not isinstance(state, dict) or set(state) != set(_RNGS):
        problem = f"must be null or an object with the keys {list(_RNGS)}, got {state!r}"
        raise _refuse(field_name, problem)
    for rng in _RNGS:
        engine = state[rng]
        if not isinstance(engine, dict) or set(engine) != set(_ENGINE_FIELDS):
            problem = f"must be an object with the keys {list(_ENGINE_FIELDS)}, got {engine!r}"
            raise _refuse(f"{field_name}.{rng}", problem)
        for name, length in _SEED_GENERATOR_LENGTHS.items():
            path = f"{field_name}.{rng}.{name}"
            if name == "_generated_seeds" and engine[name] is None:
                continue
            for index, word in enumerate(_check_list(path, engine[name], (length,))):
                _check_int(f"{path}[{index}]", word, 0, _UINT32)


#: How deep a policy's state may nest objects and lists ("dynamic": 3): copying and hashing a
#: deeper one would recurse past Python's limit.
MAX_POLICY_DEPTH = 16


def _nested_at_most(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests objects and lists at most ``limit`` deep (no recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= limit:
                return False
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


def _check_fields(values: Dict[str, Any]) -> None:
    """Refuse a checkpoint with a missing, unknown or out-of-range field, naming the field."""
    expected = [f.name for f in fields(ReadingServiceState)]
    missing = [name for name in expected if name not in values and name not in _ADDED_IN_VERSION_1]
    if missing:
        raise _refuse(missing[0], "is missing")
    unknown = sorted(set(values) - set(expected))
    if unknown:
        raise _refuse(unknown[0], "is not a field of this checkpoint version")
    num_workers = _check_int("num_workers", values["num_workers"])
    for index, name in enumerate(_check_list("graph", values["graph"])):
        if not isinstance(name, str):
            raise _refuse(f"graph[{index}]", f"must be a DataPipe class name, got {name!r}")
    _check_int("epoch", values["epoch"], 0, MAX_POSITION)
    _check_int("epoch_seed", values["epoch_seed"], 0, 2**64 - 1)
    if not isinstance(values["in_epoch"], bool):
        raise _refuse("in_epoch", f"must be true or false, got {values['in_epoch']!r}")
    ranks = max(1, num_workers)  # the trainer's own graph (num_workers=0) has one position
    # Taken before the first epoch, a checkpoint holds no positions; in an epoch, one per worker.
    lengths = (ranks,) if values["in_epoch"] else (0, ranks)
    for rank, position in enumerate(_check_list("consumed", values["consumed"], lengths)):
        _check_int(f"consumed[{rank}]", position, 0, MAX_POSITION)
    _check_int("next_rank", values["next_rank"], 0, ranks - 1)
    world_size = _check_int("dist_world_size", values["dist_world_size"], 1)
    _check_int("dist_rank", values["dist_rank"], 0, world_size - 1)
    for name in ("seed_generator", "epoch_start_seed_generator"):
        if values.get(name) is not None:
            _check_seed_generator(values[name], name)
    policy_state = values.get("distribution")
    if policy_state is not None and not isinstance(policy_state, dict):
        raise _refuse("distribution", f"must be null or an object, got {policy_state!r:.80}")
    if not _nested_at_most(policy_state, MAX_POLICY_DEPTH):
        raise _refuse("distribution", f"nests objects and lists more than {MAX_POLICY_DEPTH} deep")
    for name in ("distribution_name", "placement"):
        if values.get(name) is not None and not isinstance(values[name], str):
            raise _refuse(name, f"must be null or a string, got {values[name]!r:.80}")
