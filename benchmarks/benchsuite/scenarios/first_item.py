"""First item: from building the loader (DataLoader2 init, worker startup) to the first item."""

from __future__ import annotations

import statistics
import time
from typing import Callable

from workloads import Workload

from benchsuite.contenders.base import Contender
from benchsuite.report.format import fmt_num, fmt_ratio, outcome_rows, ratio, render_table, value
from benchsuite.scenarios.base import DATALOADERS, STARTUP_ALLOWANCE_S, Scenario


def plan_first_item(quick: bool) -> dict:
    """A short epoch of ints on 2 workers, repeated (the first epoch is the cold one)."""
    return {"workload": Workload("ints", 32).to_dict(), "workers": 2, "repeats": 2 if quick else 3}


def timeout_first_item(params: dict) -> float:
    """Startup allowance plus 20 s per repeat."""
    return STARTUP_ALLOWANCE_S + 20 * params["repeats"]


def measure_first_item(contender: Contender, params: dict, emit: Callable[[dict], None]) -> dict:
    """Time from building the loader (DataLoader2 init, worker startup) to the first item, after
    importing the contender's package (timed apart)."""
    workload = Workload.from_dict(params["workload"])
    t0 = time.perf_counter()
    contender.load()
    import_s = time.perf_counter() - t0
    first, shutdown = [], []
    for _ in range(params["repeats"]):
        t0 = time.perf_counter()
        with contender.epoch(workload, params["workers"]) as loader:
            iterator = iter(loader)
            next(iterator)
            t1 = time.perf_counter()
            for _ in iterator:  # finish the short epoch: MPRS can hang if shut down mid-epoch
                pass
            t2 = time.perf_counter()
            del iterator
        shutdown.append(time.perf_counter() - t2)
        first.append(t1 - t0)
    return {
        "import_s": import_s,
        "cold_s": first[0],
        "warm_s": statistics.median(first[1:]) if len(first) > 1 else None,
        "all_s": first,
        "shutdown_s": statistics.median(shutdown),
    }


def report_first_item(scenario: Scenario, params: dict, results: dict) -> str:
    """The first_item table: import, cold and warm time to the first item, vs MPRS, shutdown."""
    mprs = value(results, "MPRS", "cold_s")
    rows = outcome_rows(results, lambda _name, d: [
        fmt_num(d.get("import_s"), ".3f", " s"), fmt_num(d["cold_s"], ".3f", " s"), fmt_num(d["warm_s"], ".3f", " s"),
        fmt_ratio(ratio(d["cold_s"], mprs)), fmt_num(d["shutdown_s"], ".3f", " s"),
    ])
    title = (f"== first_item: loader construction + iter() to first item, {params['workers']} workers, "
             f"{params['repeats']} epochs ==")
    return render_table(title, ["contender", "import", "first epoch", "later (median)", "vs MPRS", "shutdown"], rows,
                        notes=["RPCRS-tcp / RPCDataloader servers were already running (started untimed)",
                               "import: the contender's own package, before its first loader (the parent imported "
                               "torch and torchdata.dataloader2 before forking every contender's process)"])


SCENARIOS = [
    Scenario("first_item", DATALOADERS + ("RPCDataloader",), plan_first_item, measure_first_item,
             report_first_item, timeout_first_item),
]
