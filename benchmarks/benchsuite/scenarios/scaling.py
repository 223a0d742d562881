"""Scaling: a sleep-bound stage at W = 1..16 workers, efficiency against W / sleep."""

from __future__ import annotations

from typing import Callable

from workloads import Workload

from benchsuite.contenders.base import Contender
from benchsuite.isolation import describe_exception
from benchsuite.measure import drain
from benchsuite.report.format import fmt_num, na, render_table
from benchsuite.scenarios.base import STARTUP_ALLOWANCE_S, Scenario


def plan_scaling(quick: bool) -> dict:
    """A 10 ms sleep per item at W = 1..16 (``--quick``: 1 and 4)."""
    # RPCRS-tcp: the W sessions of every point run on ONE worker server (it forks a
    # process per session), as a deployment with one rpc-reading-worker per host.
    return {"workers_list": [1, 4] if quick else [1, 2, 4, 8, 16], "sleep_s": 0.01,
            "point_s": 0.25 if quick else 1.0, "budget_s": 1.0 if quick else 3.0}


def timeout_scaling(params: dict) -> float:
    """Startup allowance, then per worker count its budget twice and some slack."""
    return STARTUP_ALLOWANCE_S + len(params["workers_list"]) * (10 + 2 * params["budget_s"])


def measure_scaling(contender: Contender, params: dict, emit: Callable[[dict], None]) -> dict:
    """One epoch of the sleep-bound stage per worker count; efficiency vs W / sleep."""
    points = []
    for workers in params["workers_list"]:
        workload = Workload("sleep", int(workers * params["point_s"] / params["sleep_s"]) + workers,
                            sleep_s=params["sleep_s"])
        try:
            point = drain(contender, workload, workers, params["budget_s"], warmup_fraction=0.1)
            ideal = workers / params["sleep_s"]
            point["efficiency"] = point["items_per_s"] / ideal if point["items_per_s"] else None
        except Exception as exc:  # one broken worker count must not hide the others
            point = {"error": describe_exception(exc)}
        point["workers"] = workers
        emit(point)
        points.append(point)
    return {"points": points}


def report_scaling(scenario: Scenario, params: dict, results: dict) -> str:
    """The scaling table: items/s against the ideal W / sleep, per worker count."""
    rows = []
    for name, outcome in results.items():
        points = (outcome.get("data") or {}).get("points") or outcome.get("partial") or []
        for p in points:
            if "error" in p:
                rows.append((f"{name} W={p['workers']}", f"n/a ({p['error'][:90]})"))
                continue
            rows.append([name, str(p["workers"]), f"{p['items']:,}", fmt_num(p["items_per_s"], ",.0f"),
                         fmt_num(p["workers"] / params["sleep_s"], ",.0f"), fmt_num(p["efficiency"], ".2f"),
                         fmt_num(p["first_item_s"], ".2f", " s")])
        if not outcome.get("ok"):
            rows.append((name, na(outcome)))
    title = (f"== scaling: map(sleep {params['sleep_s'] * 1000:.0f} ms) per item, "
             f"W = {', '.join(map(str, params['workers_list']))} workers ==")
    headers = ["contender", "W", "items", "items/s", "ideal/s", "efficiency", "first item"]
    notes = ["efficiency = steady items/s / (W / sleep); first 10% of items excluded"]
    notes.append("RPCRS-tcp: the W sessions of each point run on one worker server (one process per session)")
    return render_table(title, headers, rows, notes=notes)


SCENARIOS = [
    Scenario("scaling", ("MPRS", "torch-DataLoader", "RPCRS-local", "RPCRS-tcp"), plan_scaling,
             measure_scaling,
             report_scaling, timeout_scaling),
]
