"""Memory: the trainer's peak RSS above its baseline while a slow consumer reads 1 MiB and 8 MiB tensors."""

from __future__ import annotations

import dataclasses
import gc
from typing import Callable

from workloads import MIB, Workload

from benchsuite.contenders.base import Contender
from benchsuite.measure import drain, read_all
from benchsuite.report.format import (
    budget_note,
    fmt_num,
    fmt_ratio,
    fmt_size,
    point_rows,
    point_value,
    ratio,
    render_table,
)
from benchsuite.report.targets import SLACK_MIB, WINDOW_FACTOR, memory_bound_mib
from benchsuite.rss import PeakRss, rss_kib
from benchsuite.scenarios.base import DATALOADERS, STARTUP_ALLOWANCE_S, Scenario, measure_points


def plan_memory(quick: bool) -> dict:
    """1 MiB and 8 MiB tensors on 2 workers, a consumer that reads each and sleeps 5 ms."""
    return {"items": {MIB: 40 if quick else 250, 8 * MIB: 24 if quick else 64},
            "workers": 2, "consumer_sleep_s": 0.005, "budget_s": 20.0}


#: Items of the short epoch each point runs first, on a loader of its own (see :func:`warm_up`).
WARM_UP_ITEMS = 8


def warm_up(contender: Contender, workload: Workload, workers: int, budget_s: float) -> float:
    """Run a short epoch of ``workload`` on a loader of ``contender`` first and close it, so
    that what a process pays once, at its first loader (its modules: DataLoader2 and the
    contender's package, ~12 MiB; the libraries they map, ~8 MiB; threads), is in
    the baseline and not counted as items held. Returns the RSS (MiB) it left behind."""
    gc.collect()
    before = rss_kib() or 0
    drain(contender, dataclasses.replace(workload, n_items=WARM_UP_ITEMS), workers, budget_s, consume=read_all)
    gc.collect()
    return ((rss_kib() or 0) - before) / 1024


def measure_memory(contender: Contender, params: dict, emit: Callable[[dict], None]) -> dict:
    """Peak trainer RSS above baseline while a slow consumer reads the tensors, per item size."""
    def point(workers: int, item_bytes: int) -> dict:
        workload = Workload("tensor", params["items"][item_bytes], item_bytes=item_bytes)
        first_loader_mib = warm_up(contender, workload, workers, params["budget_s"])
        baseline = rss_kib() or 0
        with PeakRss(interval_s=0.001) as peak:
            data = drain(contender, workload, workers, params["budget_s"],
                         consume=read_all, consumer_sleep_s=params["consumer_sleep_s"])
        window = contender.credit_window_bytes(workload, workers)
        data.update(baseline_mib=baseline / 1024, peak_mib=peak.peak_kib / 1024, first_loader_mib=first_loader_mib,
                    growth_mib=max(0, peak.peak_kib - baseline) / 1024,
                    credit_window_mib=window / MIB if window else None)
        return data

    return measure_points([params["workers"]], point, emit,
                          coordinates=[{"item_bytes": size} for size in params["items"]])


def timeout_memory(params: dict) -> float:
    """Startup allowance, then per item size its warm-up loader, its budget and some slack."""
    return STARTUP_ALLOWANCE_S + len(params["items"]) * (20 + params["budget_s"])


def report_memory(scenario: Scenario, params: dict, results: dict) -> str:
    """The memory table: peak growth, baseline, credit window, the bound and its verdict, ratios."""
    def cells(name: str, d: dict) -> list:
        same_size = [point_value(results, ref, "growth_mib", d["workers"], d["item_bytes"])
                     for ref in ("MPRS", "torch-DataLoader")]
        bound = memory_bound_mib(d.get("credit_window_mib"))
        verdict = "-" if bound is None else "PASS" if d["growth_mib"] <= bound else "MISS"
        return ([fmt_size(d["item_bytes"]), fmt_num(d["growth_mib"], ".1f", " MiB"),
                fmt_num(d["baseline_mib"], ".0f", " MiB"), fmt_num(d.get("first_loader_mib"), ".1f", " MiB"),
                f"{d['items']:,}",
                fmt_num(d.get("credit_window_mib"), ".0f", " MiB"),
                fmt_ratio(ratio(d["growth_mib"], d.get("credit_window_mib"))),
                fmt_num(bound, ".0f", " MiB"), verdict]
                + [fmt_ratio(ratio(d["growth_mib"], ref)) for ref in same_size] + [budget_note(d)])

    items = ", ".join(f"{n} x {fmt_size(size)}" for size, n in params["items"].items())
    title = (f"== memory: trainer peak RSS above baseline, {items} tensors, consumer reads each and sleeps "
             f"{params['consumer_sleep_s'] * 1000:.0f} ms, {params['workers']} workers ==")
    headers = ["contender", "item size", "peak growth", "baseline", "warm-up kept", "items", "credit window", "vs window",
               "bound", "verdict", "vs MPRS", "vs DataLoader", "note"]
    return render_table(title, headers, point_rows(results, cells), notes=[
        f"baseline: the RSS after a warm-up epoch of {WARM_UP_ITEMS} items on a loader of the same contender, closed "
        "(what a process pays once, at its first loader: modules, libraries, threads; "
        "'warm-up kept' is what it left resident), as tests/test_memory_bound.py does; "
        "peak: the larger of VmRSS sampled every millisecond and the kernel's VmHWM",
        "credit window: W x prefetch (default) x item size, what RPCReadingService may hold in flight "
        f"by design; bound: {WINDOW_FACTOR} x credit window + {SLACK_MIB:.0f} MiB (the target)",
        "vs MPRS, vs DataLoader: at the same item size"])


SCENARIOS = [
    Scenario("memory", DATALOADERS + ("RPCDataloader",), plan_memory, measure_memory,
             report_memory, timeout_memory),
]
