"""A cluster in miniature: trainer and worker "hosts" as Linux network namespaces.

Each host is a network namespace with ``lo`` up and one veth link per network it is on;
the other ends of the links sit on one bridge per network inside a "switch" namespace,
so the root namespace gets no interface at all. Every address is inside :data:`TEST_RANGE`.

Safety: before anything else, :meth:`Cluster.create` installs a blackhole route for the
whole test range in the root namespace (its own route, told apart from other runs' by its
metric, the run's pid), so no packet for the range can ever leave the machine; it talks
to no address outside the namespaces it made. Every object is named ``rrsc<pid>...``;
:meth:`Cluster.destroy` removes them all (processes first), and every new cluster first
sweeps what a crashed or interrupted run with a dead pid left behind.

Host names: ``ip netns exec`` bind-mounts ``/etc/netns/<netns>/hosts`` over ``/etc/hosts``,
so every host resolves ``<name>.cluster.test`` (written there, removed with the cluster).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from _server_helpers import reap

TEST_RANGE = "10.231.0.0/16"
PREFIX = "rrsc"
DOMAIN = "cluster.test"
_NETNS_ETC = Path("/etc/netns")
_RUN_PATTERN = re.compile(rf"^{PREFIX}(\d+)-")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unavailable_reason() -> Optional[str]:
    """Why network namespaces cannot be made here (None when they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def sweep_leftovers() -> None:
    """Remove namespaces, hosts files and blackhole routes of earlier runs whose process is gone."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _RUN_PATTERN.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _ip("netns", "del", name, check=False)
    if _NETNS_ETC.is_dir():
        for entry in _NETNS_ETC.iterdir():
            match = _RUN_PATTERN.match(entry.name)
            if match and not _pid_alive(int(match.group(1))):
                shutil.rmtree(entry, ignore_errors=True)
    for line in _ip("route", "show", "type", "blackhole", TEST_RANGE, check=False).stdout.splitlines():
        metric = re.search(r"\bmetric (\d+)", line)
        if metric and not _pid_alive(int(metric.group(1))):
            _ip("route", "del", "blackhole", TEST_RANGE, "metric", metric.group(1), check=False)


def leftovers(run_pid: int) -> List[str]:
    """Objects of run ``run_pid`` still present (namespaces, hosts dirs, routes): empty after destroy."""
    found = [n for n in _ip("netns", "list", check=False).stdout.split() if n.startswith(f"{PREFIX}{run_pid}-")]
    if _NETNS_ETC.is_dir():
        found += [str(e) for e in _NETNS_ETC.iterdir() if e.name.startswith(f"{PREFIX}{run_pid}-")]
    routes = _ip("route", "show", "type", "blackhole", TEST_RANGE, check=False).stdout
    found += [line for line in routes.splitlines() if re.search(rf"\bmetric {run_pid}\b", line)]
    return found


@dataclass
class Host:
    """One host of the cluster: a network namespace, its links (``eth<k>`` on network ``k``) and addresses."""

    name: str
    netns: str
    addresses: Dict[int, str]  # network index -> this host's IPv4 address on it
    cluster: "Cluster" = field(repr=False)

    @property
    def address(self) -> str:
        """The host's address on its first network."""
        return self.addresses[min(self.addresses)]

    @property
    def fqdn(self) -> str:
        return f"{self.name}.{DOMAIN}"

    def link(self, network: Optional[int] = None) -> str:
        """The host's interface on ``network`` (default: its first)."""
        return f"eth{min(self.addresses) if network is None else network}"

    def command(self, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside this host (``ip netns exec`` execs it: the pid stays the command's)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in this host in its own process group; the cluster reaps it at the end."""
        proc = subprocess.Popen(self.command(argv), start_new_session=True, **kwargs)
        self.cluster.processes.append(proc)
        return proc

    def set_link(self, up: bool, network: Optional[int] = None) -> None:
        """Bring the host's link up or down (down: a network partition, the host's processes live on)."""
        _ip("-n", self.netns, "link", "set", self.link(network), "up" if up else "down")

    def route(self, network: int, via: str, add: bool = True) -> None:
        """Add (or delete) a route from this host to ``network`` through ``via`` (a router on its own network)."""
        _ip("-n", self.netns, "route", "add" if add else "del", str(Cluster.subnet(network)), "via", via)

    def cap_link(self, rate_bits: Optional[int], network: Optional[int] = None) -> None:
        """Cap what the host sends on its link with a token bucket (``tc tbf``); ``None`` removes the cap."""
        device = self.link(network)
        if rate_bits is None:
            subprocess.run(["tc", "-n", self.netns, "qdisc", "del", "dev", device, "root"],
                           capture_output=True, timeout=20)  # fmt: skip
            return
        # A bucket of at least 1 ms at the rate and of a whole GSO packet (64 KiB): smaller
        # ones drop the large packets veth hands over.
        burst = max(rate_bits // 8 // 1000, 256 * 1024)
        subprocess.run(
            ["tc", "-n", self.netns, "qdisc", "replace", "dev", device, "root", "tbf",
             "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "20ms"],
            check=True, capture_output=True, timeout=20,
        )  # fmt: skip


class Cluster:
    """Hosts on networks ``10.231.<k>.0/24`` joined by bridges in a switch namespace."""

    def __init__(self) -> None:
        self.run_pid = os.getpid()
        self.prefix = f"{PREFIX}{self.run_pid}-"
        self.switch = f"{self.prefix}switch"
        self.hosts: Dict[str, Host] = {}
        self.processes: List[subprocess.Popen] = []
        self._route = False
        self._made_etc = False

    @staticmethod
    def subnet(network: int) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"10.231.{network}.0/24")

    @classmethod
    def create(cls, hosts: Dict[str, Sequence[int]]) -> "Cluster":
        """Make a cluster of ``{host name: [network, ...]}``; host ``i`` gets ``10.231.<k>.<i+1>``.

        Removes everything it made if any step fails.
        """
        sweep_leftovers()
        cluster = cls()
        try:
            cluster._build(hosts)
        except BaseException:
            cluster.destroy()
            raise
        return cluster

    def _build(self, hosts: Dict[str, Sequence[int]]) -> None:
        # First of all: nothing for the test range may ever leave this machine.
        _ip("route", "add", "blackhole", TEST_RANGE, "metric", str(self.run_pid))
        self._route = True
        networks = sorted({n for nets in hosts.values() for n in nets})
        assert all(0 < n < 256 for n in networks), networks
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        for network in networks:
            _ip("-n", self.switch, "link", "add", f"br{network}", "type", "bridge")
            _ip("-n", self.switch, "link", "set", f"br{network}", "up")
        for index, (name, nets) in enumerate(hosts.items()):
            host = Host(name, f"{self.prefix}{name}", {}, self)
            _ip("netns", "add", host.netns)
            self.hosts[name] = host
            _ip("-n", host.netns, "link", "set", "lo", "up")
            for network in nets:
                port = f"{name}-{network}"[:15]
                # Both ends are created inside their namespaces: the root namespace never holds them.
                _ip("link", "add", host.link(network), "netns", host.netns, "type", "veth",
                    "peer", "name", port, "netns", self.switch)  # fmt: skip
                _ip("-n", self.switch, "link", "set", port, "master", f"br{network}", "up")
                address = str(self.subnet(network)[index + 1])
                _ip("-n", host.netns, "addr", "add", f"{address}/24", "dev", host.link(network))
                _ip("-n", host.netns, "link", "set", host.link(network), "up")
                host.addresses[network] = address
        self._made_etc = not _NETNS_ETC.exists()
        names = "".join(f"{a} {h.fqdn} {h.name}\n" for h in self.hosts.values() for a in h.addresses.values())
        for host in self.hosts.values():
            etc = _NETNS_ETC / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{names}")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def reap(self) -> None:
        """SIGKILL every process started in a host (and its process group) and wait for it."""
        for proc in self.processes:
            reap(proc)
        self.processes.clear()

    def destroy(self) -> None:
        """Reap the processes, then remove every namespace (their links go with them), hosts file and route."""
        self.reap()
        for host in self.hosts.values():
            _ip("netns", "del", host.netns, check=False)
            shutil.rmtree(_NETNS_ETC / host.netns, ignore_errors=True)
        _ip("netns", "del", self.switch, check=False)
        if self._made_etc:
            with contextlib.suppress(OSError):
                _NETNS_ETC.rmdir()
        if self._route:
            _ip("route", "del", "blackhole", TEST_RANGE, "metric", str(self.run_pid), check=False)
            self._route = False


def restrict_tensorpipe_to_links() -> None:
    """Offer TensorPipe, in this process, only what it has between real hosts.

    Between namespaces of one machine TensorPipe would move tensors by cross-memory attach
    (the cma channel) or shared memory, past the links (a "1 Gbit/s" link then carries
    5 Gbit/s). Sessions follow: a channel is used only when both ends offer it.
    """
    import torch.distributed.rpc as rpc

    class BetweenHosts(rpc.TensorPipeRpcBackendOptions):
        def __init__(self, *args, _transports=None, _channels=None, **kwargs):
            super().__init__(*args, _transports=_transports or ["uv"], _channels=_channels or ["mpt_uv", "basic"],
                             **kwargs)  # fmt: skip

    rpc.TensorPipeRpcBackendOptions = BetweenHosts


def json_lines(stream):
    """Yield the JSON objects a trainer script prints, one per line of ``stream``, until it ends."""
    for line in stream:
        line = line.strip()
        if line.startswith(b"{"):
            yield json.loads(line)
