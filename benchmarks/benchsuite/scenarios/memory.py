"""Memory: the trainer's peak RSS above its baseline while a slow consumer reads 1 MiB tensors."""

from __future__ import annotations

import gc
from typing import Callable

from workloads import MIB, Workload

from benchsuite.contenders.base import Contender
from benchsuite.measure import drain, read_all
from benchsuite.report.format import budget_note, fmt_num, fmt_ratio, outcome_rows, ratio, render_table, value
from benchsuite.rss import PeakRss, rss_kib
from benchsuite.scenarios.base import DATALOADERS, Scenario, timeout_budgeted


def plan_memory(quick: bool) -> dict:
    """1 MiB tensors on 2 workers, a consumer that reads each and sleeps 5 ms."""
    return {"workload": Workload("tensor", 40 if quick else 250, item_bytes=MIB).to_dict(),
            "workers": 2, "consumer_sleep_s": 0.005, "budget_s": 20.0}


def warm_up_consumer(workload: Workload, items: int = 64) -> None:
    """Run the consumer on local items first, so that torch's thread pool and the
    allocator's arenas (tens of MiB, whoever the contender) are in the baseline."""
    from workloads import item_function

    make = item_function(workload)
    for index in range(items):
        read_all(make(index))


def measure_memory(contender: Contender, params: dict, emit: Callable[[dict], None]) -> dict:
    """Peak trainer RSS above baseline while a slow consumer reads 1 MiB tensors."""
    workload = Workload.from_dict(params["workload"])
    warm_up_consumer(workload)
    gc.collect()
    baseline = rss_kib() or 0
    with PeakRss() as peak:
        data = drain(contender, workload, params["workers"], params["budget_s"],
                     consume=read_all, consumer_sleep_s=params["consumer_sleep_s"])
    window = contender.credit_window_bytes(workload, params["workers"])
    data.update(baseline_mib=baseline / 1024, peak_mib=peak.peak_kib / 1024,
                growth_mib=max(0, peak.peak_kib - baseline) / 1024,
                credit_window_mib=window / MIB if window else None)
    return data


def report_memory(scenario: Scenario, params: dict, results: dict) -> str:
    """The memory table: peak growth, baseline, credit window and ratios."""
    w = Workload.from_dict(params["workload"])
    mprs = value(results, "MPRS", "growth_mib")
    dataloader = value(results, "torch-DataLoader", "growth_mib")
    rows = outcome_rows(results, lambda _name, d: [
        fmt_num(d["growth_mib"], ".1f", " MiB"), fmt_num(d["baseline_mib"], ".0f", " MiB"),
        f"{d['items']:,}", fmt_num(d.get("credit_window_mib"), ".0f", " MiB"),
        fmt_ratio(ratio(d["growth_mib"], d.get("credit_window_mib"))),
        fmt_ratio(ratio(d["growth_mib"], mprs)), fmt_ratio(ratio(d["growth_mib"], dataloader)),
        budget_note(d),
    ])
    title = (f"== memory: trainer peak RSS above baseline, {w.n_items} x {w.item_bytes // MIB} MiB tensors, "
             f"consumer reads each and sleeps {params['consumer_sleep_s'] * 1000:.0f} ms, "
             f"{params['workers']} workers ==")
    headers = ["contender", "peak growth", "baseline", "items", "credit window", "vs window", "vs MPRS",
               "vs DataLoader", "note"]
    return render_table(title, headers, rows, notes=[
        "credit window: W x prefetch (default) x item size, what RPCReadingService may hold in flight "
        "by design"])


SCENARIOS = [
    Scenario("memory", DATALOADERS + ("RPCDataloader",), plan_memory, measure_memory,
             report_memory, timeout_budgeted),
]
