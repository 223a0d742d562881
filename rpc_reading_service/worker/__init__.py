"""The worker server (``rpc-reading-worker``): accept, authenticate, fork one session per trainer session.

:mod:`.server` is the server, :mod:`.session` the session driver, :mod:`.inbox` and :mod:`.outbox`
its input and output. The server's API is re-exported here, so ``rpc_reading_service.worker:run``
(the console script) and ``python -m rpc_reading_service.worker`` keep working.
"""

from .server import WorkerServer, build_parser, die_with_parent, main, run, serve_until_signalled

__all__ = ["WorkerServer", "build_parser", "die_with_parent", "main", "run", "serve_until_signalled"]
