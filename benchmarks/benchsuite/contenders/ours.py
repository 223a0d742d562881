"""RPCReadingService: local workers (socket and torch_rpc transports), and over TCP to one
running worker server."""

from __future__ import annotations

from typing import Optional

from workloads import made_in_shared_memory

from benchsuite.contenders.base import DataLoader2Contender


class RPCRSContender(DataLoader2Contender):
    """What every RPCReadingService contender shares: its package and its credit window."""

    def load(self) -> None:
        from rpc_reading_service import RPCReadingService  # noqa: F401

    def credit_window_bytes(self, workload, num_workers: int) -> Optional[int]:
        """``num_workers`` credit windows of frames of one item each, as the package sizes them at
        its default ``prefetch``: what the trainer may hold in flight by design."""
        from rpc_reading_service.trainer.config import ReadingServiceConfig

        if not workload.item_bytes:
            return None
        return ReadingServiceConfig().in_flight_bytes(num_workers, workload.item_bytes)


class RPCRSLocal(RPCRSContender):
    """RPCReadingService with ``num_workers`` local workers (socket transport)."""

    name = "RPCRS-local"
    transport = "socket"

    def reading_service(self, num_workers):
        from rpc_reading_service import RPCReadingService

        if self.transport == "socket":
            return RPCReadingService(num_workers=num_workers)
        return RPCReadingService(num_workers=num_workers, transport=self.transport)


class RPCRSLocalMadeInSharedMemory(RPCRSLocal):
    """:class:`RPCRSLocal` whose graph makes its tensors with ``rpc_reading_service.shared_empty``
    (``workloads.make_tensor_in_shared_memory``): in the session's shared segments, which the
    transport hands over with no copy. Compared with ``production-limit-shm``, the same code."""

    name = "RPCRS-local-shm"
    production_limit = "production-limit-shm"

    def epoch(self, workload, num_workers):
        return super().epoch(made_in_shared_memory(workload), num_workers)


class RPCRSTorchRPC(RPCRSLocal):
    """RPCReadingService with local workers over the torch_rpc transport."""

    name = "RPCRS-torch_rpc"
    one_round = True  # no target depends on it; its worker startup costs seconds
    skipped_when_quick = True  # a second transport: same code path, its own worker startup
    transport = "torch_rpc"


class RPCRSTcp(RPCRSContender):
    """RPCReadingService against ONE running ``python -m rpc_reading_service.worker``.

    As in a deployment (one ``rpc-reading-worker`` per host): the server forks one
    session process per worker, so all ``num_workers`` sessions name the same address.
    """

    name = "RPCRS-tcp"
    servers_needed = 1

    def reading_service(self, num_workers):
        from rpc_reading_service import RPCReadingService

        (address,) = self.servers["addresses"]
        return RPCReadingService(workers=[address] * num_workers, auth_key=self.servers["auth_key"])


class RPCRSTwoServers(RPCRSContender):
    """RPCReadingService against TWO running worker servers, its ``num_workers`` sessions
    dealt round-robin over them (half on each): a trainer fed by two CPU hosts."""

    name = "RPCRS-2servers"
    servers_needed = 2

    def reading_service(self, num_workers):
        from rpc_reading_service import RPCReadingService

        addresses = list(self.servers["addresses"][: self.servers_needed])
        return RPCReadingService(num_workers=num_workers, workers=addresses, auth_key=self.servers["auth_key"])
