"""Runs each (scenario, contender) as a task in a fresh child, with the worker servers it needs."""

from __future__ import annotations

import argparse
import os
import platform
import resource
import secrets
import sys
import time
from typing import Any, Callable, Optional

from benchsuite.contenders import CONTENDERS, ONE_ROUND, QUICK_SKIPS
from benchsuite.isolation import describe_exception, run_task
from benchsuite.processes import (
    ServerPool,
    launch_rpcdataloader_server,
    launch_rpcrs_server,
    reap_adopted_children,
)
from benchsuite.report.format import fmt_num
from benchsuite.scenarios import SCENARIOS
from benchsuite.scenarios.base import Scenario, worker_counts


def probe() -> dict:
    """Versions and which contenders can run here (import / construction checks)."""
    import torch
    import torchdata

    info: dict[str, Any] = {
        "python": platform.python_version(), "platform": f"{platform.system()} {platform.release()}",
        "torch": torch.__version__, "torchdata": torchdata.__version__, "cpus": os.cpu_count(),
        "unavailable": {},
    }
    try:
        import rpc_reading_service
        from rpc_reading_service import RPCReadingService

        info["rpc_reading_service"] = os.path.dirname(rpc_reading_service.__file__)
        RPCReadingService(num_workers=1)
    except Exception as exc:
        for name in ("RPCRS-local", "RPCRS-tcp", "RPCRS-torch_rpc"):
            info["unavailable"][name] = describe_exception(exc)
    else:
        transports = getattr(rpc_reading_service, "available_transports", lambda: ["socket"])()
        info["transports"] = list(transports)
        if "torch_rpc" not in transports:
            info["unavailable"]["RPCRS-torch_rpc"] = (f"transport 'torch_rpc' not available; "
                                                      f"available: {', '.join(transports)}")
    try:
        import importlib.metadata

        import rpcdataloader  # noqa: F401

        info["rpcdataloader"] = importlib.metadata.version("rpcdataloader")
    except Exception as exc:
        info["unavailable"]["RPCDataloader"] = describe_exception(exc)
    return info


def execute(task: dict, emit: Callable[[dict], None]) -> Any:
    """Run one task inside the child: a probe, or one contender on one scenario."""
    if task["kind"] == "probe":
        return probe()
    contender = CONTENDERS[task["contender"]](task.get("servers"))
    return SCENARIOS[task["scenario"]].measure(contender, task["params"], emit)


def progress(message: str) -> None:
    """A line of progress on stderr (the tables go to stdout)."""
    print(message, file=sys.stderr, flush=True)


def best_of_rounds(outcomes: list[dict], rate_key: Optional[str]) -> dict:
    """One outcome from a contender's rounds: for each W (and item size, in a scenario whose
    points have one: :func:`point_key`), the point of the best round, with
    every round's rate in ``round_rates`` (index: the round; None where it was not measured)
    and its place in that round's order in ``round_positions`` (which of two contenders went
    first, see :func:`benchsuite.report.format.paired_ratio`).  One round: returned as it is."""
    if len(outcomes) == 1 or not rate_key:
        return outcomes[0]
    total = max(o.get("round", i) for i, o in enumerate(outcomes)) + 1
    by_key: dict[tuple[int, int], list[tuple[int, float, dict]]] = {}
    for i, outcome in enumerate(outcomes):
        if outcome.get("ok"):
            for k, p in enumerate(outcome["data"]["points"]):
                position = outcome.get("position", 0) + k / 100  # the task's points run one after another
                by_key.setdefault(point_key(p), []).append((outcome.get("round", i), position, p))
    points = []
    for _, candidates in sorted(by_key.items()):
        good = [p for _, _, p in candidates if "error" not in p and p.get(rate_key)]
        best = dict(max(good, key=lambda p: p[rate_key])) if good else dict(candidates[0][2])
        rates: list[Optional[float]] = [None] * total
        positions: list[Optional[float]] = [None] * total
        for round_index, position, p in candidates:
            rates[round_index] = p.get(rate_key) if "error" not in p else None
            positions[round_index] = position
        best["round_rates"], best["round_positions"] = rates, positions
        points.append(best)
    merged = {"ok": any(o.get("ok") for o in outcomes), "data": {"points": points}, "partial": [],
              "rounds": len(outcomes)}
    if not merged["ok"]:
        merged.update(outcomes[0])
    for key in ("wall_s", "cpu_s"):
        merged[key] = sum(o.get(key, 0.0) for o in outcomes)
    return merged


def point_key(point: dict) -> tuple[int, int]:
    """What tells a contender's points apart within a scenario: (item size or 0, W)."""
    return point.get("item_bytes") or 0, point["workers"]


def round_order(names: list[str], params: dict, round_index: int) -> list[str]:
    """The contenders of one round in the order they run: ``params['round_order']`` first (the
    ones compared in a paired ratio, each next to its reference), then the others; every other
    round reversed, so that of two contenders compared, each goes first in turn.  After the
    first ``params['rounds_of_all']`` rounds, only the ``params['paired']`` ones run."""
    first = [name for name in params.get("round_order", ()) if name in names]
    order = [name for name in names if name not in first] + first
    if round_index >= params.get("rounds_of_all", params.get("rounds", 1)):
        order = [name for name in order if name in params.get("paired", ())]
    return order[::-1] if round_index % 2 else order


def children_cpu_s() -> float:
    """User + system CPU seconds of every reaped descendant so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def servers_needed(name: str, params: dict) -> int:
    """Worker servers contender ``name`` needs in a scenario: one RPCRS server serves any
    number of sessions (RPCRS-2servers spreads them over two); rpcdataloader needs one
    launcher process per worker."""
    fixed = getattr(CONTENDERS.get(name), "servers_needed", None)
    if fixed:
        return fixed
    return max(worker_counts(params, name))


class Runner:
    """Runs each (scenario, contender) as a child task, with the server pools it needs."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.unavailable: dict[str, str] = {}
        auth_key = secrets.token_hex(16)
        self.auth_keys = {"RPCRS-tcp": auth_key, "RPCRS-2servers": auth_key}
        rpcrs = ServerPool("rpcrs", launch_rpcrs_server(auth_key))  # both RPCRS-tcp and RPCRS-2servers
        self.pools = {
            "RPCRS-tcp": rpcrs,
            "RPCRS-2servers": rpcrs,
            "RPCDataloader": ServerPool("rpcdataloader", launch_rpcdataloader_server),
        }

    def server_pids(self) -> frozenset:
        """The pids of every pool's servers: the processes a finished task must not reap."""
        return frozenset(pid for pool in self.pools.values() for pid in pool.pids())

    def probe(self) -> dict:
        """Versions and unavailable contenders (checked in a child, once)."""
        outcome = run_task({"kind": "probe"}, execute, 120, self.args.verbose, keep=self.server_pids())
        if not outcome.get("ok"):
            progress(f"probe failed: {outcome.get('reason')}")
        info = outcome.get("data") or {"unavailable": {}}
        self.unavailable = dict(info["unavailable"])
        return info

    def servers_for(self, name: str, count: int) -> Optional[dict]:
        """Addresses (and key) of ``count`` running servers for a pooled contender."""
        if name not in self.pools:
            return None
        t0 = time.monotonic()
        addresses = self.pools[name].ensure(count)
        if time.monotonic() - t0 > 0.05:
            progress(f"  started {name} servers: {len(addresses)} running ({time.monotonic() - t0:.1f} s, untimed)")
        return {"addresses": addresses, "auth_key": self.auth_keys.get(name)}

    def plan(self, scenario: Scenario) -> dict:
        """``scenario``'s parameters for this run: its plan, with ``--sizes`` as its item sizes
        and ``--workers`` as its worker counts when it measures several (``params['sizes']``,
        ``params['workers_list']``)."""
        params = scenario.plan(self.args.quick)
        if getattr(self.args, "sizes", None) and "sizes" in params:
            params["sizes"] = list(self.args.sizes)
        if getattr(self.args, "workers", None) and "workers_list" in params:
            params["workers_list"] = list(self.args.workers)
        return params

    def selected(self, scenario: Scenario) -> list[str]:
        """The contenders of ``scenario`` this run measures (``--only`` / ``--contender``)."""
        chosen = self.args.contender
        return [name for name in scenario.contenders if not chosen or name in chosen]

    def servers_wanted(self, scenarios: list[Scenario]) -> dict[str, int]:
        """How many servers each pooled contender of the selected scenarios needs."""
        needed: dict[str, int] = {}
        for scenario in scenarios:
            params = self.plan(scenario)
            for name in self.selected(scenario):
                if name in self.pools and name not in self.unavailable:
                    needed[name] = max(needed.get(name, 0), servers_needed(name, params))
        return needed

    def launch_servers(self, scenarios: list[Scenario]) -> None:
        """Start, untimed and without waiting, the servers the selected scenarios will need,
        so that their startups overlap each other and this process's own imports."""
        for name, count in self.servers_wanted(scenarios).items():
            self.pools[name].launch_missing(count)

    def start_servers(self, scenarios: list[Scenario]) -> None:
        """:meth:`launch_servers`, then wait until they are ready.  A failure is left for
        :meth:`run_one` to report (its pool is stopped, and restarted there)."""
        self.launch_servers(scenarios)
        needed = self.servers_wanted(scenarios)
        wanted_pools = {id(self.pools[name]) for name in needed}
        for pool in self.pools.values():
            if id(pool) not in wanted_pools:
                pool.stop()  # launched for a contender the probe found unavailable
        if not needed:
            return
        t0 = time.monotonic()
        for name, count in needed.items():
            try:
                self.pools[name].ensure(count)
            except Exception:
                self.pools[name].stop()
        progress(f"  started servers of {', '.join(needed)} (waited {time.monotonic() - t0:.1f} s, untimed)")

    def run_one(self, scenario: Scenario, name: str, params: dict) -> dict:
        """One contender on one scenario; never raises for a contender's failure."""
        if name in self.unavailable:
            return {"ok": False, "reason": self.unavailable[name], "wall_s": 0.0}
        try:
            servers = self.servers_for(name, servers_needed(name, params))
        except Exception as exc:
            self.pools[name].stop()
            return {"ok": False, "reason": "servers did not start: " + describe_exception(exc), "wall_s": 0.0}
        task = {"kind": "measure", "scenario": scenario.name, "contender": name, "params": params,
                "servers": servers}
        keep = self.server_pids()
        cpu_before = children_cpu_s()
        outcome = run_task(task, execute, scenario.timeout_s(params), self.args.verbose, keep=keep,
                           on_partial=lambda p: progress(f"    {name} W={p.get('workers')}"
                                                         + (f" {p['item_bytes']:,} B" if p.get("item_bytes") else "") + ": "
                                                         f"{fmt_num(p.get('items_per_s'), ',.0f')} items/s"))
        outcome["cpu_s"] = children_cpu_s() - cpu_before  # the task's processes (not the servers')
        if not outcome.get("ok") and name in self.pools:
            self.pools[name].stop()  # a failed session may have left its servers unusable
        return outcome

    def run_scenario(self, scenario: Scenario) -> dict:
        """Every selected contender of ``scenario``: its params and outcomes.

        With ``params['rounds'] > 1`` every contender runs once per round, interleaved
        (round 1: all contenders, then round 2...), so that a burst of load from other
        jobs hits all of them alike; each (contender, W) keeps its best round, and every
        round's rate.  The order of a round is :func:`round_order`'s; a reversed round also
        runs each contender's worker counts from the largest down (``descending_workers``),
        so that the point next to its reference is still the one compared with it.
        """
        params = self.plan(scenario)
        rounds: dict[str, list[dict]] = {}
        for round_index in range(params.get("rounds", 1)):
            round_params = dict(params, descending_workers=bool(round_index % 2))
            for position, name in enumerate(round_order(self.selected(scenario), params, round_index)):
                if self.args.quick and name in QUICK_SKIPS and not self.args.contender:
                    rounds[name] = [{"ok": False, "wall_s": 0.0,
                                     "reason": "skipped with --quick (select it with --contender)"}]
                    continue
                if round_index and (name in ONE_ROUND or not rounds[name][0].get("ok")):
                    continue  # failed once: do not pay its timeout again
                outcome = self.run_one(scenario, name, round_params)
                outcome.update(round=round_index, position=position)
                rounds.setdefault(name, []).append(outcome)
                status = "ok" if outcome.get("ok") else f"n/a: {outcome.get('reason')}"
                progress(f"  {scenario.name:<10} {name:<16} {outcome['wall_s']:6.1f} s wall "
                         f"{outcome.get('cpu_s', 0):6.1f} s cpu  {status}"
                         + (f"  (round {round_index + 1})" if params.get("rounds", 1) > 1 else ""))
                if not outcome.get("ok") and self.args.verbose:
                    progress(outcome.get("traceback") or outcome.get("log_tail") or "")
        outcomes = {name: best_of_rounds(rounds[name], params.get("rate_key"))
                    for name in self.selected(scenario) if name in rounds}  # the table's order
        return {"params": params, "contenders": outcomes}

    def close(self) -> None:
        """Stop every server pool and reap anything left."""
        for pool in {id(pool): pool for pool in self.pools.values()}.values():
            pool.close()
        reap_adopted_children(set())


def header_text(info: dict, quick: bool) -> str:
    """The first lines of a run's output: versions, where the package is, the load."""
    return "\n".join([
        f"rpc_reading_service benchmark ({'quick' if quick else 'full'} run): "
        f"python {info.get('python')}, torch {info.get('torch')}, torchdata {info.get('torchdata')}, "
        f"{info.get('cpus')} CPUs, rpcdataloader {info.get('rpcdataloader', 'n/a')}",
        f"rpc_reading_service: {info.get('rpc_reading_service') or 'n/a'}"
        + (f" (transports: {', '.join(info['transports'])})" if info.get("transports") else ""),
        f"load average at start: {load_average()} (other jobs on this machine make every number noisy)",
    ])


def load_average() -> str:
    """The 1-minute load average, or '?'."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"
