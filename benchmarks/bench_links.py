"""Link-rate benchmark: how much of a capped network link each transport delivers.

A trainer host and a worker host, as network namespaces joined by a bridge (the cluster
of ``tests/cluster.py``), with the worker's sending side capped by a ``tc`` token bucket
at 1 and 10 Gbit/s. One worker server per transport runs in the worker host
(``--host 0.0.0.0`` with a key); the trainer, inside the trainer host, times the second
of two epochs (the first one connects and warms up) of

- **8 MiB tensors**: a fresh ``uint8`` tensor per item, reported as payload Gbit/s and as a
  fraction of the link rate (TCP/IP headers take about 3 % of it at MTU 1500);
- **tiny items**: ints, reported as items/s (their payload is a negligible part of the link).

Contenders: ``RPCReadingService`` over the socket transport and over the torch_rpc transport,
and rpcdataloader 0.2.1 if it is installed. Both hosts share this machine's cores, so the
10 Gbit/s rows are CPU-bound on a small machine. TensorPipe would move tensors between the
namespaces by cross-memory attach or shared memory (same machine, no link at all), so the
trainer offers it only what it has between real hosts (``cluster.restrict_tensorpipe_to_links``).

Needs root (network namespaces) and iproute2; prints a markdown table::

    sudo .venv/bin/python benchmarks/bench_links.py [--rates 1,10] [--sessions 2] [--results-md benchmarks/LINKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # tests/cluster.py: the namespaces, and nothing of pytest

TENSOR_BYTES = 8 << 20
TINY_ITEMS = {"socket": 20000, "torch_rpc": 20000, "rpcdataloader": 3000}
RPCDATALOADER_PORT = 29650  # a fresh namespace: every port is free


# -- the graphs (imported by reference by the workers: benchmarks/ is on their PYTHONPATH) ----
def fresh_tensor(_item: int):
    import torch

    return torch.empty(TENSOR_BYTES, dtype=torch.uint8)


class TensorDataset:
    """rpcdataloader's side: a map-style dataset of fresh 8 MiB tensors, or of ints."""

    def __init__(self, n: int, tiny: bool):
        self.n, self.tiny = n, tiny

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return index if self.tiny else fresh_tensor(index)


# -- the trainer (runs inside the trainer host) --------------------------------------------------
def _timed_second_epoch(loader_epochs, payload_bytes) -> Dict[str, float]:
    epochs = loader_epochs()
    for _ in next(epochs):  # warm-up: connections, imports, first allocations
        pass
    start = time.perf_counter()
    count = sum(1 for _ in next(epochs))
    seconds = time.perf_counter() - start
    return {"items": count, "seconds": seconds, "bits_per_s": count * payload_bytes * 8 / seconds}


def _dataloader2_epochs(datapipe, **options):
    from torchdata.dataloader2 import DataLoader2

    from rpc_reading_service import RPCReadingService

    def epochs():
        with DataLoader2(datapipe, reading_service=RPCReadingService(**options)) as dl:
            yield iter(dl)
            yield iter(dl)

    return epochs


def _rpcdataloader_epochs(addresses: List[str], n: int, tiny: bool):
    import rpcdataloader

    def epochs():
        from bench_links import TensorDataset

        dataset = rpcdataloader.RPCDataset(addresses, TensorDataset, n, tiny)
        loader = rpcdataloader.RPCDataloader(dataset, batch_size=None, timeout=120)
        yield iter(loader)
        yield iter(loader)

    return epochs


def trainer_main(config: dict) -> None:
    from torchdata.datapipes.iter import IterableWrapper

    # By reference (benchmarks/ is on the workers' path), not as this __main__'s copy.
    from bench_links import fresh_tensor

    from cluster import restrict_tensorpipe_to_links

    restrict_tensorpipe_to_links()
    n_tensors = config["tensors"]
    for transport in ("socket", "torch_rpc", "rpcdataloader"):
        if transport not in config["addresses"]:
            continue
        addresses = config["addresses"][transport]
        for workload in ("tensors", "tiny"):
            n = n_tensors if workload == "tensors" else TINY_ITEMS[transport]
            payload = TENSOR_BYTES if workload == "tensors" else 8
            if transport == "rpcdataloader":
                epochs = _rpcdataloader_epochs(addresses, n, workload == "tiny")
            else:
                datapipe = IterableWrapper(range(n)).sharding_filter()
                if workload == "tensors":
                    datapipe = datapipe.map(fresh_tensor)
                epochs = _dataloader2_epochs(
                    datapipe, workers=addresses, num_workers=config["sessions"],
                    auth_key=config["key"], transport=transport,
                )  # fmt: skip
            try:
                result = _timed_second_epoch(epochs, payload)
            except Exception as exc:  # noqa: BLE001 - one failed row must not lose the table
                result = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            print(json.dumps({"transport": transport, "workload": workload, **result}), flush=True)


# -- the driver (root namespace) -------------------------------------------------------------
def _start_servers(cluster, key: str, env: Dict[str, str], sessions: int, workdir: Path) -> Dict[str, List[str]]:
    from rpc_reading_service.trainer.local_fleet import read_listening_address

    worker = cluster["w0"]
    addresses: Dict[str, List[str]] = {}
    pending = {}
    for transport in ("socket", "torch_rpc"):
        argv = [sys.executable, "-m", "rpc_reading_service.worker", "--host", "0.0.0.0", "--port", "0",
                "--transport", transport, "--log-level", "WARNING"]  # fmt: skip
        log = open(workdir / f"{transport}.log", "wb")
        pending[transport] = worker.popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(workdir))
    try:
        import rpcdataloader  # noqa: F401

        ports = [RPCDATALOADER_PORT + i for i in range(sessions)]
        for port in ports:
            worker.popen([sys.executable, "-m", "rpcdataloader.launch", "--host", "0.0.0.0", "--port", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=str(workdir))  # fmt: skip
        addresses["rpcdataloader"] = [f"{worker.address}:{port}" for port in ports]
    except ImportError:
        print("rpcdataloader is not installed: its rows are left out", file=sys.stderr)
    for transport, proc in pending.items():
        port = read_listening_address(proc, 120).rsplit(":", 1)[1]
        addresses[transport] = [f"{worker.address}:{port}"]
    return addresses


def _gbit(bits: float) -> str:
    return f"{bits / 1e9:.2f}"


CONTENDER_NAMES = {"socket": "RPCReadingService, socket", "torch_rpc": "RPCReadingService, torch_rpc",
                   "rpcdataloader": "rpcdataloader 0.2.1"}
TARGET = (1.0, "socket", 0.9)  # link Gbit/s, transport, fraction of the link for 8 MiB tensors


def _utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime())


def links_table(rows: List[Dict]) -> str:
    """The markdown table of one run's results (rows as the trainers reported them)."""
    lines = ["| link | contender | 8 MiB tensors: Gbit/s | fraction of link | tiny items: items/s |",
             "|---|---|---|---|---|"]  # fmt: skip
    by_key = {(r["rate"], r["transport"], r["workload"]): r for r in rows}
    for rate in sorted({r["rate"] for r in rows}):
        for transport, name in CONTENDER_NAMES.items():
            tensors, tiny = by_key.get((rate, transport, "tensors")), by_key.get((rate, transport, "tiny"))
            if tensors is None:
                continue
            if "error" in tensors:
                big = f"failed: {tensors['error']}", "-"
            else:
                big = _gbit(tensors["bits_per_s"]), f"{tensors['bits_per_s'] / (rate * 1e9):.2f}"
            if tiny is None:
                small = "-"
            else:
                small = f"failed: {tiny['error']}" if "error" in tiny else f"{tiny['items'] / tiny['seconds']:,.0f}"
            lines.append(f"| {rate:g} Gbit/s | {name} | {big[0]} | {big[1]} | {small} |")
    return "\n".join(lines)


def links_markdown(run: Dict, rows: List[Dict], table: str) -> str:
    """benchmarks/LINKS.md: the table with the facts of the run that made it (``run``: started,
    ended, load_start, load_end, command, sessions)."""
    from benchsuite.report.results_md import source_revision

    rate, transport, needed = TARGET
    measured = next((r["bits_per_s"] / (rate * 1e9) for r in rows if (r["rate"], r["transport"], r["workload"])
                     == (rate, transport, "tensors") and "error" not in r), None)  # fmt: skip
    verdict = "not measured" if measured is None else f"{measured:.3f}: {'pass' if measured >= needed else 'MISS'}"
    return "\n".join([
        "# Link-rate benchmark",
        "",
        "Written by `benchmarks/bench_links.py --results-md benchmarks/LINKS.md` (as root) from the run it",
        "describes; `make bench` rewrites RESULTS.md, not this file. A trainer host and a worker host are",
        "network namespaces joined by a bridge; what the worker host sends is capped with `tc tbf` at each",
        "link rate. Payload only: TCP/IP headers take about 3 % of a link at MTU 1500.",
        "",
        f"- **Date**: {run['started']} to {run['ended']} UTC",
        f"- **Machine**: {os.cpu_count()} CPUs shared by both hosts (the 10 Gbit/s rows are CPU-bound on it); "
        f"package at `{source_revision(str(REPO))}`",
        f"- **Load average (1 min)**: {run['load_start']:.1f} at start, {run['load_end']:.1f} at the end "
        "(other jobs on the machine included: every number moves with it)",
        f"- **Command**: `{run['command']}`; {run['sessions']} sessions per contender, second of two epochs timed",
        f"- **Target**: 8 MiB tensors over the {transport} transport at {rate:g} Gbit/s deliver >= {needed} "
        f"of the link: {verdict}",
        "",
        table,
        "",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1,10", help="link rates to cap at, Gbit/s (default 1,10)")
    parser.add_argument("--sessions", type=int, default=2, help="worker sessions per contender (default 2)")
    parser.add_argument("--seconds", type=float, default=3.0, help="aim of a timed 8 MiB epoch at the link rate")
    parser.add_argument("--results-md", metavar="FILE", help="also write the table and the run's facts to FILE "
                        "(the published one: benchmarks/LINKS.md)")
    parser.add_argument("--trainer", help=argparse.SUPPRESS)  # the trainer's half, inside the trainer host
    args = parser.parse_args(argv)
    if args.trainer:
        trainer_main(json.loads(args.trainer))
        return 0

    import cluster as cluster_module

    reason = cluster_module.unavailable_reason()
    if reason:
        print(f"cannot build the namespaces: {reason}", file=sys.stderr)
        return 2
    run = {"started": _utc_now(), "load_start": os.getloadavg()[0], "command": " ".join(sys.argv)}
    key = secrets.token_hex(32)
    pythonpath = os.pathsep.join([str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONWARNINGS="ignore", RPC_READING_SERVICE_AUTH_KEY=key)
    workdir = Path(subprocess.check_output(["mktemp", "-d", "/tmp/bench-links.XXXXXX"], text=True).strip())
    cluster = cluster_module.Cluster.create({"trainer": [1], "w0": [1]})
    rows = []
    try:
        addresses = _start_servers(cluster, key, env, args.sessions, workdir)
        for rate in (float(r) for r in args.rates.split(",")):
            cluster["w0"].cap_link(int(rate * 1e9))
            tensors = max(8, int(args.seconds * rate * 1e9 / 8 / TENSOR_BYTES))
            config = {"addresses": addresses, "key": key, "sessions": args.sessions, "tensors": tensors}
            trainer = cluster["trainer"].popen(
                [sys.executable, __file__, "--trainer", json.dumps(config)],
                stdout=subprocess.PIPE, stderr=open(workdir / f"trainer-{rate:g}.log", "wb"), env=env, cwd=str(workdir),
            )  # fmt: skip
            for line in trainer.stdout:
                result = json.loads(line)
                rows.append({"rate": rate, **result})
                print(f"{rate:g} Gbit/s {result}", file=sys.stderr, flush=True)
            trainer.wait()
    finally:
        cluster.destroy()
    table = links_table(rows)
    print(f"\nLinks capped with tc tbf; {os.cpu_count()} CPUs shared by both hosts, load average "
          f"{os.getloadavg()[0]:.1f}; {args.sessions} sessions; second epoch timed.\n")  # fmt: skip
    print(table)
    if args.results_md:
        run.update(ended=_utc_now(), load_end=os.getloadavg()[0], sessions=args.sessions)
        Path(args.results_md).write_text(links_markdown(run, rows, table))
        print(f"{args.results_md} written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
