"""``transport="torch_rpc"``: frames move as torch.distributed.rpc calls (TensorPipe backend).

How a session joins its trainer's RPC world: docs/transports.md; the design: docs/architecture.md."""

from __future__ import annotations

from .connection import TorchRPCConnection
from .session import TorchRPCListener
from .transport import TorchRPCTransport

__all__ = ["TorchRPCTransport", "TorchRPCConnection", "TorchRPCListener"]
