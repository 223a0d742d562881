"""This process's torch RPC agent: torch.distributed.rpc imported on first use, and what it can tell."""

from __future__ import annotations

from typing import Any

from ...errors import ConfigurationError


def _rpc() -> Any:
    """``torch.distributed.rpc``, imported on first use (a worker server never needs it)."""
    import torch.distributed.rpc as rpc

    if not rpc.is_available():  # pragma: no cover - builds without distributed support
        raise ConfigurationError(
            "transport 'torch_rpc' needs torch.distributed.rpc, which this torch build lacks; use transport='socket'"
        )
    return rpc


def _agent_exists() -> bool:
    """Whether this process already runs a torch RPC agent (ours or the user's)."""
    rpc = _rpc()
    return bool(rpc._is_current_rpc_agent_set())  # noqa: SLF001 - the only way to ask without raising


def _current_agent_name() -> str:
    """The name of this process's RPC agent, for error messages (``"?"`` without one)."""
    try:
        return _rpc().get_worker_info().name
    except Exception:  # noqa: BLE001
        return "?"


def _short(exc: BaseException) -> str:
    """The first line of a (often many-line, C++) torch error, for one-line messages."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
