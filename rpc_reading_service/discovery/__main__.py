"""``python -m rpc_reading_service.discovery serve|list``: host a TCPStore, list a job's workers.

A module of its own (rather than a ``__main__`` block in the package) because the package is
imported by ``rpc_reading_service`` itself: running it as ``-m`` would import it twice.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Optional, Sequence

from ..addresses import format_address
from ..errors import ConfigurationError, DiscoveryTimeoutError
from . import __doc__ as _package_doc
from . import connect_store, wait_for_workers

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m rpc_reading_service.discovery serve|list``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m rpc_reading_service.discovery", description=(_package_doc or "").splitlines()[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="host a TCPStore until interrupted")
    serve.add_argument(
        "--host", default="0.0.0.0",
        help="address to listen on (default 0.0.0.0: all interfaces; 127.0.0.1 keeps the store on loopback)",
    )  # fmt: skip
    serve.add_argument(
        "--port", type=int, default=29700, help="port to listen on (default 29700; 0 picks a free one)"
    )
    show = commands.add_parser("list", help="print the live registered workers of a job, one per line")
    show.add_argument("--store", required=True, help="HOST:PORT of the TCPStore")
    show.add_argument("--job", default="default", help="job name (default 'default')")
    show.add_argument("--min-workers", type=int, default=0, help="first wait until this many answer")
    show.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (default 60)")
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            store = connect_store(format_address(args.host, args.port), host=True)
            print(f"TCPStore listening on {format_address(args.host, store.port)}", flush=True)
            stop = threading.Event()
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: stop.set())
            stop.wait()
            return 0
        store = connect_store(args.store, timeout=args.timeout)
        for address in wait_for_workers(store, args.job, args.min_workers, args.timeout, args.store):
            print(address)
        return 0
    except (ConfigurationError, DiscoveryTimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
