"""Finding worker servers: through torch's ``TCPStore`` (the store torchrun uses) or a hostfile.

Store discovery
---------------
A worker started with ``rpc-reading-worker --store HOST:PORT --job NAME`` registers the
address the trainer should dial; ``RPCReadingService(workers=StoreDiscovery("HOST:PORT", job="NAME",
min_workers=N))`` waits until N registered workers answer, then uses them. Keys, all
under ``rpc_reading_service/<job>/``::

    count       a TCPStore ``add`` counter: how many registrations ever happened
    worker/<i>  the advertised ``host:port`` of registration ``i`` (1-based); a worker
                deletes its key when it shuts down cleanly

``add`` is atomic, so concurrent workers never overwrite each other's slot.

Workers that restart, and stale entries: a restarted worker registers again under a new
slot. If it comes back on the same address (a fixed ``--port``), the trainer sees the
address twice and keeps one. If it comes back elsewhere (``--port 0``), its old slot
was deleted on a clean shutdown; after a crash (``kill -9``, a lost node) the old slot
stays. So the trainer does not trust the registry blindly: it probes every registered
address with a TCP connect and counts only the ones that answer, and it waits for
``min_workers`` *live* workers. Entries left by an earlier run of the same job in a
long-lived store are handled the same way (dead ones are skipped); to keep runs apart
entirely, use a job name per run (``$SLURM_JOB_ID``, ``$TORCHELASTIC_RUN_ID``) or a store
that lives as long as the run (a trainer-hosted store, torchrun's own store).

Who hosts the store: the trainer (``StoreDiscovery("0.0.0.0:PORT",
host_store=True)``, on one rank only), torchrun's existing store
(``$MASTER_ADDR:$MASTER_PORT``), or a stand-alone one::

    python -m rpc_reading_service.discovery serve --port 29700   # --host 127.0.0.1: loopback only
    python -m rpc_reading_service.discovery list --store HOST:29700 --job NAME

Workers wait (``--store-timeout``) for the store to come up, so start order does not matter.
A store that goes away (restarted, or the trainer that hosted it exited) loses every entry:
each worker notices at once (it holds an idle connection to the store), logs it once, and
registers again when a store answers at the same address, so the next trainer finds it.

Hostfile
--------
One ``host:port`` per line; ``#`` starts a comment; blank lines are ignored.
"""

from ..errors import DiscoveryTimeoutError
from .hostfile import read_hostfile, wait_for_hostfile
from .lookup import check_discovery_options, discover_workers, wait_for_workers
from .registration import WorkerRegistration, advertised_address
from .store import KEY_PREFIX, connect_store, registered_workers

__all__ = [
    "DiscoveryTimeoutError",
    "check_discovery_options",
    "KEY_PREFIX",
    "advertised_address",
    "connect_store",
    "discover_workers",
    "read_hostfile",
    "registered_workers",
    "wait_for_hostfile",
    "wait_for_workers",
    "WorkerRegistration",
]
