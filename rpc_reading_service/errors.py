"""Typed exceptions of rpc_reading_service.

Every message says what happened, where (worker address and rank when known) and
what to do about it. All inherit from :class:`RPCReadingServiceError`.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from typing import Optional

__all__ = [
    "thread_stack",
    "past_the_end",
    "malformed_checkpoint",
    "RPCReadingServiceError",
    "ConfigurationError",
    "MissingDependencyError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "FrameTooLargeError",
    "AuthenticationError",
    "WorkerRefusedError",
    "WorkerLostError",
    "ItemTimeoutError",
    "ItemUnpicklingError",
    "WorkerDrainedError",
    "WorkerStartupError",
    "RemoteWorkerError",
    "DiscoveryTimeoutError",
    "CacheKeyError",
    "DispatchStalledError",
    "StickyKeyError",
    "ItemPicklingError",
    "DATALOADER2_MISSING",
]

#: The ImportError of a DataLoader2 front end where torchdata has no DataLoader2 (``name``: what was imported).
DATALOADER2_MISSING = (
    "{name} is the torchdata DataLoader2 front end, and this torchdata has no DataLoader2 (torchdata "
    "removed it in 0.10): pip install 'rpc-reading-service[dataloader2]' (torchdata>=0.7,<0.10) to use it, "
    "or keep this torchdata and use RemoteIterable with torch's DataLoader or StatefulDataLoader "
    "(from rpc_reading_service import RemoteIterable)"
)


def describe_worker(rank: Optional[int], address: Optional[str], noun: str = "worker") -> str:
    """Return a short human description of a worker, e.g. ``worker 1 (10.0.0.2:29600)``.

    ``noun`` names it otherwise: ``"worker process"`` gives MPRS's words for remote errors.
    """
    if rank is None and address is None:
        return noun
    if rank is None:
        return f"{noun} at {address}"
    if address is None:
        return f"{noun} {rank}"
    return f"{noun} {rank} ({address})"


def thread_stack(ident: Optional[int], gone: str = "(the thread is gone)") -> str:
    """The Python stack of the running thread ``ident``, formatted (``gone`` if it ended), for a message."""
    frame = sys._current_frames().get(ident) if ident is not None else None  # noqa: SLF001 - made for this
    return "".join(traceback.format_stack(frame)) if frame is not None else gone + "\n"


class RPCReadingServiceError(Exception):
    """Base class of every error raised by rpc_reading_service."""


class ConfigurationError(RPCReadingServiceError, ValueError):
    """The reading service or worker server was configured in a way that cannot work."""


class MissingDependencyError(ConfigurationError, ImportError):
    """A feature was asked for whose optional package is not installed (``prometheus_client`` for
    metrics). The message says what to install: ``pip install 'rpc-reading-service[EXTRA]'``."""


class ProtocolError(RPCReadingServiceError):
    """A rule of the wire protocol was broken; see which side broke it in the subclass.

    Catch this to handle both kinds; the message names the side and the rule.
    """


class LocalProtocolError(ProtocolError):
    """This process tried to send something the protocol does not allow at this point.

    Nothing was sent. It is a bug in rpc_reading_service (or in a transport or driver
    built on it): please report it with the message.
    """


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that are not a valid frame or message, or a message the
    protocol does not allow at this point. The session with that peer cannot continue."""


class FrameTooLargeError(RemoteProtocolError):
    """A peer announced a frame larger than the configured maximum; it was refused unread."""


class AuthenticationError(RPCReadingServiceError):
    """The shared-key challenge-response failed: the two sides do not hold the same auth key."""


class WorkerRefusedError(RPCReadingServiceError, ConnectionError):
    """A worker server refused a connection and said why (at its ``--max-sessions`` limit,
    TLS required, ...). The message names the server and carries its reason."""


class WorkerLostError(RPCReadingServiceError, ConnectionError):
    """A worker stopped answering (process died, host unreachable, or heartbeats stopped)."""

    def __init__(self, message: str, rank: Optional[int] = None, address: Optional[str] = None):
        super().__init__(message)
        self.rank = rank
        self.address = address


class ItemTimeoutError(WorkerLostError):
    """A worker spent longer than ``item_timeout`` producing one item and ended its session.

    ``position`` is the item's index in the worker's shard and ``stack`` the Python stack of
    the worker's producer thread at that moment (also in the message). A lost worker as far
    as ``on_worker_failure="reassign"`` is concerned: its shard is replayed elsewhere.

    The trainer's dispatcher (the DataPipes before ``sharding_round_robin_dispatch``) stuck on
    one item raises it too, with ``rank`` None, its item's index and its thread's stack: not
    replayed (no worker is at fault), and a later epoch dispatches from a copy of that part.
    """

    def __init__(
        self, message: str, rank: Optional[int] = None, address: Optional[str] = None, position: int = -1, stack: str = ""
    ):
        super().__init__(message, rank, address)
        self.position = position
        self.stack = stack


class WorkerDrainedError(WorkerLostError):
    """A worker's server drained (SIGTERM) and its session left. Not a failure: the trainer
    hands the worker's work to other servers whatever ``on_worker_failure`` says. Raised only
    when no other server could take it (every server of the run drained or is gone): the
    message names them; start more servers, or pass more addresses."""


class WorkerStartupError(RPCReadingServiceError):
    """A worker could not set up a session (graph failed to unpickle, or worker_init_fn raised)."""


class RemoteWorkerError(RPCReadingServiceError, RuntimeError):
    """An exception raised inside a remote graph whose original type could not be rebuilt here.

    Where the original type can be rebuilt, that type is raised instead, carrying the same
    attributes: ``worker_rank``, ``worker_address`` and ``remote_traceback``.
    """


class DiscoveryTimeoutError(RPCReadingServiceError, TimeoutError):
    """Fewer workers than ``min_workers`` registered in the store (or answered, or were
    listed in the hostfile) before the ``timeout`` of ``StoreDiscovery``/``Hostfile``. The message says how
    many came."""


class CacheKeyError(RPCReadingServiceError, TypeError):
    """``cached_map`` could not turn an item's key into a cache key (the key cannot be pickled).
    The message names the function; pass a ``key_fn`` that returns a str, bytes, int or tuple."""


class DispatchStalledError(RPCReadingServiceError, RuntimeError):
    """Dispatching could not go on without holding more than a worker's pipeline of items for one
    worker (``sharding_round_robin_dispatch`` with ``in_order=True``): the workers' outputs do
    not keep pace with their inputs (a filter after the dispatch point, for example). The message
    names both workers; ``in_order=False`` lets the trainer take whatever is ready. Also raised when
    a new epoch cannot copy a dispatching part that an earlier epoch's thread is stuck in."""


class StickyKeyError(RPCReadingServiceError, TypeError):
    """The sticky distribution could not hash an item's key to a worker: the key is not one of
    the accepted types (bytes, str, int, float, None, and tuples or lists of them). The message
    names the worker and the key; pass a ``key_fn`` that returns such a key (e.g. the file path)."""


class ItemPicklingError(RPCReadingServiceError, TypeError):
    """An item holds a tensor that cannot be pickled to cross to the other side (an MKL-DNN
    tensor, for example). The message names the tensor's kind; convert it in the graph into one
    that can cross (``.to_dense()``, or a plain strided tensor) before yielding it."""


class ItemTooLargeError(RPCReadingServiceError, ValueError):
    """An item is larger than the trainer accepts in one frame (``TransportConfig.max_frame_bytes``,
    2 GiB by default); raised in the worker's graph, so the trainer reports it as the graph's own
    error, naming the worker. Raise the trainer's ``max_frame_bytes`` or make the items smaller."""


class ItemUnpicklingError(RPCReadingServiceError, pickle.UnpicklingError):
    """The trainer could not unpickle an item a worker sent (a class or module of the item missing
    here, another version of a library, or corrupt bytes). ``rank`` and ``address`` name the worker;
    the original exception is the ``__cause__``."""

    def __init__(self, message: str, rank: Optional[int] = None, address: Optional[str] = None):
        super().__init__(message)
        self.rank = rank
        self.address = address


def malformed_checkpoint(
    problem: str, cause: str = "edited, truncated or written by another program", same: str = ""
) -> ConfigurationError:
    """The error of a checkpoint that cannot be resumed, with the advice to resume an unmodified one.

    Args:
        problem: What is wrong with it (``field 'consumed' is missing``).
        cause: How it can have come to be so, after "The checkpoint was".
        same: What must also be as when it was taken (``over the same data``), if anything.
    """
    advice = f"resume from an unmodified state_dict() {same}".rstrip()
    return ConfigurationError(f"malformed RPCReadingService checkpoint: {problem}. The checkpoint was {cause}: {advice}")


def past_the_end(field_name: str, what: str, position: int, length: int) -> ConfigurationError:
    """The error of a worker whose resumed position (field ``field_name``) lies past the end of ``what``."""
    return malformed_checkpoint(
        f"field {field_name} says {position} items of {what} were consumed, but it has {length} in this epoch",
        "edited, or the data or the graph changed since it was taken", "over the same data",
    )
