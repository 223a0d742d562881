"""Every contender by name (the registry the scenarios and the runner use).

``ours`` holds RPCReadingService's ways of running, ``alternatives`` what users run
instead, ``limits`` what no reading service can beat.  A later contender (RPCReadingService
with a distribution policy or one slow worker; with the worker-side cache; with many trainer
sessions on one server) is a class in ``ours`` listed here.
"""

from __future__ import annotations

from benchsuite.contenders.alternatives import MPRS, RPCDataloaderContender, TorchDataLoader
from benchsuite.contenders.base import Contender
from benchsuite.contenders.limits import (
    CopyLimit,
    GraphLimit,
    InProcess,
    LoaderLimit,
    PipelineLimit,
    PipelineLimitUnix,
    ProductionLimit,
    ProductionLimitMadeInSharedMemory,
    RawSocket,
    RawUnixSocket,
)
from benchsuite.contenders.ours import (
    RPCRSLocal,
    RPCRSLocalMadeInSharedMemory,
    RPCRSTcp,
    RPCRSTorchRPC,
    RPCRSTwoServers,
)

CONTENDERS: dict[str, type[Contender]] = {
    c.name: c for c in (InProcess, ProductionLimit, ProductionLimitMadeInSharedMemory, CopyLimit, MPRS, TorchDataLoader,
                        RPCRSLocal, RPCRSLocalMadeInSharedMemory, RPCRSTcp, RPCRSTwoServers, RPCRSTorchRPC,
                        RPCDataloaderContender, RawSocket, RawUnixSocket, GraphLimit, LoaderLimit,
                        PipelineLimit, PipelineLimitUnix)
}
ONE_STREAM = tuple(name for name, c in CONTENDERS.items() if c.one_stream)  # no worker count
ONE_ROUND = tuple(name for name, c in CONTENDERS.items() if c.one_round)
QUICK_SKIPS = tuple(name for name, c in CONTENDERS.items() if c.skipped_when_quick)
