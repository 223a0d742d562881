"""``python -m rpc_reading_service.worker``: the worker server."""

from .server import run

run()
