"""This process's torch RPC agent: torch.distributed.rpc imported on first use, and what it can tell."""

from __future__ import annotations

import logging
from typing import Any

from ...errors import ConfigurationError

log = logging.getLogger(__name__)


def rpc_api() -> Any:
    """``torch.distributed.rpc``, imported on first use (a worker server never needs it)."""
    import torch.distributed.rpc as rpc

    if not rpc.is_available():  # pragma: no cover - builds without distributed support
        raise ConfigurationError(
            "transport 'torch_rpc' needs torch.distributed.rpc, which this torch build lacks; use transport='socket'"
        )
    return rpc


def agent_exists() -> bool:
    """Whether this process already runs a torch RPC agent (ours or the user's)."""
    rpc = rpc_api()
    return bool(rpc._is_current_rpc_agent_set())  # noqa: SLF001 - the only way to ask without raising


def current_agent_name() -> str:
    """The name of this process's RPC agent, for error messages (``"?"`` without one)."""
    try:
        return rpc_api().get_worker_info().name
    except Exception:  # noqa: BLE001
        return "?"


def short_error(exc: BaseException) -> str:
    """The first line of a (often many-line, C++) torch error, for one-line messages."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def leave_group() -> None:
    """Leave this process's dynamic RPC world before shutting its agent down.

    TensorPipe logs a warning for every pipe that closes under an agent which has not left
    its group (about ten lines per shutdown); after leaving, it takes them as expected. It
    waits until no call of this agent is in flight and removes the agent's name from the
    world's store, so call it only when both are known to be true: every call was answered
    and the trainer (which hosts the store) is still there.
    """
    rpc = rpc_api()
    if not agent_exists():
        return
    try:
        rpc.api._get_current_rpc_agent().join(shutdown=True)  # noqa: SLF001 - a dynamic group's leave
    except Exception as exc:  # noqa: BLE001 - leaving only quietens the shutdown that follows
        log.debug("torch RPC agent could not leave its group: %s", exc)


def shutdown_agent() -> None:
    """Shut this process's RPC agent down at once, without waiting for the other members."""
    if agent_exists():
        rpc_api().shutdown(graceful=False)
