"""The trainer process's torch RPC world: one dynamic world, shared by every connection while
any is open (reference-counted), shut down with the last one and at exit."""

from __future__ import annotations

import atexit
import logging
import secrets
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import List, Optional, Set, Tuple

from ...addresses import format_address, parse_address
from ...errors import ConfigurationError
from .agent import agent_exists, current_agent_name, leave_group, rpc_api, shutdown_agent
from .connection import TorchRPCConnection
from .interfaces import pin_tensorpipe_interface

log = logging.getLogger(__name__)

# torch keeps the dynamic group's member list in the world's store under this key
# (torch/csrc/distributed/rpc/agent_utils.cpp, "names" prefix); see RPCWorld.prepare_join.
_MEMBER_LIST_PREFIX = "names"
_MEMBER_LIST_KEY = "_ALL_WORKER_INFOS"
_GROUP_TOKEN_KEY = "RpcGroupManagementToken"
# ... and each member's TensorPipe URL ("uv://HOST:PORT") under its name, "addrs" prefix.
_URL_PREFIX = "addrs"
_UV_SCHEME = "uv://"


class RPCWorld:
    """The trainer process's RPC world: rank 0, a rendezvous store, sessions joining one at a time."""

    def __init__(self, loopback: bool, advertise_host: str, rpc_timeout: float, num_worker_threads: int):
        import torch.distributed as dist

        rpc = rpc_api()
        self.loopback = loopback
        self.advertise_host = advertise_host = "127.0.0.1" if loopback else advertise_host
        self.rpc_timeout = rpc_timeout
        self.id = secrets.token_hex(4)
        # No "-" in RPC names: torch's member list is "name-rank," and splits on "-".
        self.name = f"rrs_trainer_{self.id}"
        self.refs = 0
        self.join_lock = threading.Lock()
        self._next_rank = 1
        self._abandoned: Set[str] = set()
        self._retired: List[TorchRPCConnection] = []  # closed; their sessions wait for our goodbye
        self._undrained: List[TorchRPCConnection] = []  # ended with calls still in flight
        # Loopback: shared memory only, no TCP listener; else TensorPipe's defaults.
        if loopback and sys.platform.startswith("linux"):
            self.transports: Optional[List[str]] = ["shm"]
            self.channels: Optional[List[str]] = ["basic"]
        else:
            self.transports = self.channels = None
            pin_tensorpipe_interface(advertise_host)
        bind_host = "127.0.0.1" if loopback else ("::" if ":" in advertise_host else "0.0.0.0")
        listener = socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((bind_host, 0))
            listener.listen(128)
            self.port = listener.getsockname()[1]
            # The store takes over the listening socket; init_rpc below finds it by port
            # (multi_tenant), so the bind address is ours to choose.
            self._store = dist.TCPStore(
                advertise_host, self.port, None, True, timedelta(seconds=rpc_timeout),
                wait_for_workers=False, multi_tenant=True, master_listen_fd=listener.fileno(), use_libuv=True,
            )  # fmt: skip
            listener.detach()
        except BaseException:
            listener.close()
            raise
        self.init_method = f"tcp://{format_address(advertise_host, self.port)}"
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=self.init_method,
            rpc_timeout=rpc_timeout,
            num_worker_threads=num_worker_threads,
            _transports=self.transports,
            _channels=self.channels,
        )
        # init_rpc namespaces the store by a per-process counter ("rpc_prefix_<n>"). A session
        # process counts its own inits, so the trainer starts every world at 0 (each world has
        # a fresh store, nothing can collide) and tells sessions the value to use.
        with rpc._init_counter_lock:  # noqa: SLF001
            rpc._init_counter = 0  # noqa: SLF001
        self.store_prefix_index = 0
        try:
            rpc.init_rpc(self.name, rank=0, world_size=None, rpc_backend_options=options)
        except BaseException:
            self._store = None
            raise
        agent = rpc.api._get_current_rpc_agent()  # noqa: SLF001
        self._members = dist.PrefixStore(_MEMBER_LIST_PREFIX, agent.store)
        self._group_store = agent.store
        self._own_entry = f"{self.name}-0,"
        try:
            self._can_reset = self._members.get(_MEMBER_LIST_KEY).decode() == self._own_entry
        except Exception:  # noqa: BLE001 - another torch layout: fall back to torch's own joins
            self._can_reset = False
        if not self._can_reset:
            log.debug("torch RPC member list not found in the store; joins will contact every member")
        #: Where this process's TensorPipe listens (``host``, ``port``), which every session must
        #: reach: one address per process, as torch picks it once (None when not known).
        self.tensorpipe_address: Optional[Tuple[str, int]] = None
        if not loopback:
            try:
                url = dist.PrefixStore(_URL_PREFIX, agent.store).get(self.name).decode()
                if url.startswith(_UV_SCHEME):
                    self.tensorpipe_address = parse_address(url[len(_UV_SCHEME) :])
            except Exception as exc:  # noqa: BLE001 - another torch layout: sessions then cannot check first
                log.debug("torch RPC URL of %s not found in the store: %s", self.name, exc)
        log.info("torch RPC world %s open, rendezvous %s", self.name, self.init_method)

    def next_member(self) -> Tuple[int, str]:
        """The rank and RPC name of the next session that joins this world."""
        rank = self._next_rank
        self._next_rank += 1
        return rank, f"rrs_session_{self.id}_{rank}"

    def init_method_for(self, local_host: str) -> str:
        """The rendezvous address for a session that reached this host at ``local_host``.

        A remote world's store listens on every interface, and a trainer on several networks
        has one address per network: each session gets the one on its own network.
        """
        return self.init_method if self.loopback else f"tcp://{format_address(local_host, self.port)}"

    def prepare_join(self) -> None:
        """Make the next join contact the trainer only (called with ``join_lock`` held)."""
        for name in list(self._abandoned):
            self._release_token(name)
        if self._can_reset:
            self._members.set(_MEMBER_LIST_KEY, self._own_entry)

    def _list_members(self, conns: List[TorchRPCConnection]) -> None:
        """Put the sessions of ``conns`` back on the member list (``prepare_join`` took them off):
        leaving the group removes one's own entry from it, and fails without one."""
        if not self._can_reset:
            return
        infos = [conn.peer_worker_info for conn in conns if conn.peer_worker_info is not None]
        try:
            self._members.set(_MEMBER_LIST_KEY, self._own_entry + "".join(f"{i.name}-{i.id}," for i in infos))
        except Exception as exc:  # noqa: BLE001 - the sessions then leave with warnings, nothing worse
            log.debug("could not list the sessions of %s as members: %s", self.name, exc)

    def abandon(self, name: str) -> None:
        """A session gave up (or was given up on) while joining: free the join token it may hold."""
        self._abandoned.add(name)
        self._release_token(name)

    def _release_token(self, name: str) -> None:
        # compare_set swaps only if the abandoned joiner still holds the token; a slow
        # joiner may take it later, so abandoned names are checked before every join.
        try:
            self._group_store.compare_set(_GROUP_TOKEN_KEY, f"Token_for_{name}_join", "")
        except Exception as exc:  # noqa: BLE001
            log.debug("could not release the join token of %s: %s", name, exc)

    def retire(self, conn: TorchRPCConnection) -> None:
        """Keep a closed connection's bootstrap socket until the world shuts down: its session
        leaves the world only after the trainer has left the group (see ``shutdown``)."""
        self._retired.append(conn)
        for done in [c for c in self._retired if not c.awaits_goodbye]:  # left already, or never joined
            self._retired.remove(done)
            done._end()
            self._undrained.append(done)
        self._undrained = [c for c in self._undrained if not c.drained]

    def shutdown(self) -> None:
        """Leave the group, let every retired session leave (bounded), then shut the agent down."""
        retired, self._retired = self._retired, []
        try:
            if agent_exists():
                # Leaving waits for every call in flight: only once every connection closed
                # (not at exit with connections still open) and none left a call behind.
                if self.refs == 0 and all(conn.drained for conn in retired + self._undrained):
                    self._list_members(retired)
                    leave_group()
                for conn in retired:
                    conn._say_goodbye()
                deadline = time.monotonic() + TorchRPCConnection.goodbye_seconds
                for conn in retired:
                    conn._wait_peer_gone(deadline - time.monotonic())
                shutdown_agent()
        except Exception as exc:  # noqa: BLE001 - shutting down must not fail a close
            log.warning("torch RPC shutdown of %s failed: %s", self.name, exc)
        finally:
            for conn in retired:
                conn._end()
        self._store = None
        self._members = None
        self._group_store = None
        log.info("torch RPC world %s closed", self.name)


_world_lock = threading.Lock()
_world: Optional[RPCWorld] = None


def _foreign_agent_error() -> ConfigurationError:
    return ConfigurationError(
        f"torch.distributed.rpc is already initialised in this process (agent {current_agent_name()!r}, "
        "from an earlier rpc.init_rpc). torch allows one RPC agent per process, and transport='torch_rpc' "
        "needs a world of its own with the worker sessions. Call rpc.shutdown() first, run the data "
        "loading in a process without RPC, or use transport='socket'"
    )


def check_no_foreign_agent() -> None:
    """Refuse to start when an RPC agent that is not this package's world runs in the process."""
    with _world_lock:
        if _world is None and agent_exists():
            raise _foreign_agent_error()


def acquire_world(loopback: bool, advertise_host: str, rpc_timeout: float, num_worker_threads: int) -> RPCWorld:
    """The process's torch RPC world (opened on first use), with one more reference."""
    global _world
    with _world_lock:
        world = _world
        if world is None:
            if agent_exists():
                raise _foreign_agent_error()
            world = RPCWorld(loopback, advertise_host, rpc_timeout, num_worker_threads)
            _world = world
        elif world.loopback != loopback:
            where = "on this host (loopback)" if world.loopback else "on other hosts"
            raise ConfigurationError(
                f"this process's torch RPC world serves workers {where} while it is open; torch_rpc cannot mix "
                "loopback and remote workers in one trainer process at the same time. Finalize the other "
                "reading service first, give every worker a non-loopback address, or use transport='socket'"
            )
        world.refs += 1
        return world


def release_world(world: RPCWorld, conn: TorchRPCConnection) -> None:
    """Drop ``conn`` and one reference to ``world``; the last one shuts the world down."""
    global _world
    with _world_lock:
        world.retire(conn)
        world.refs -= 1
        if world.refs > 0 or _world is not world:
            return
        _world = None
        world.shutdown()


@atexit.register
def _shutdown_world_at_exit() -> None:
    # An RPC agent still alive when the interpreter exits aborts the process.
    global _world
    with _world_lock:
        world, _world = _world, None
    if world is not None:
        world.shutdown()
