"""Sessions: many workers per trainer, W = 2..128, sleep-bound and tiny items.

Per worker count, two epochs: a sleep-bound stage (10 ms per item: the CPU is mostly idle,
so what limits the rate is the cost per session) and tiny items (the trainer's receive
path at full speed). For each: items/s, the trainer's CPU seconds per 1,000 items (every
thread of it, steady part only) and its peak RSS; the RSS per session is the slope of the
sleep-bound peak from the smallest W to the largest.
"""

from __future__ import annotations

import gc
from typing import Callable

from workloads import Workload

from benchsuite.contenders.base import Contender
from benchsuite.measure import drain
from benchsuite.report.format import (
    fmt_num,
    fmt_ratio,
    point_rows,
    point_value,
    ratio,
    render_table,
    rss_per_session_mib,
)
from benchsuite.rss import PeakRss
from benchsuite.scenarios.base import STARTUP_ALLOWANCE_S, Scenario, measure_points

# MPRS (torchdata 0.9) cannot run the block-sharded graph: flatmap after sharding_filter fails in
# its workers with "Can not expect any response without submitted request"
CONTENDERS = ("torch-DataLoader", "RPCRS-local", "RPCRS-2servers")
MPRS_NOTE = ("MPRS: not run: on this graph (flatmap after sharding_filter) its workers fail with "
             "\"Can not expect any response without submitted request\" (torchdata 0.9)")


def plan_sessions(quick: bool) -> dict:
    """W = 2, 16, 64, 128 (``--quick``: 2 and 32, a smoke run); 10 ms sleeps; tiny ints.

    300 sleep-bound items per worker: an epoch of about 3 s. With 100 (1 s), what a long epoch
    amortises weighed on the rate: the sessions' start spread in the epoch, its ragged end and
    each session's per-epoch work (about 0.02 of efficiency at W = 64, 64 sessions); and the
    efficiency of one epoch spread over up to 0.09 among four epochs of one loader (0.84 to
    0.93), wider than the margins the targets are judged by (with 300: at most 0.03).
    """
    return {"workers_list": [2, 32] if quick else [2, 16, 64, 128], "sleep_s": 0.01,
            "sleep_items_per_worker": 30 if quick else 300, "tiny_items": 20_000 if quick else 100_000,
            # sharded by blocks: an epoch's work does not grow with W (see workloads.build_datapipe)
            "sleep_block": 10, "tiny_block": 64,
            # a sleep-bound epoch of 3 s at efficiency 1 (under 4 s at 0.8) runs whole; far slower
            # ones stop at this budget, with their rate measured as before
            "budget_s": 1.0 if quick else 3.0, "sleep_budget_s": 1.0 if quick else 6.0}


def timeout_sessions(params: dict) -> float:
    """Startup allowance, then per worker count four epochs (two warm-up ones) of their budget, startup and slack."""
    sleep_budget_s = params.get("sleep_budget_s", params["budget_s"])
    return STARTUP_ALLOWANCE_S + len(params["workers_list"]) * 2 * (30 + sleep_budget_s + 2 * params["budget_s"])


def _epoch(contender: Contender, workload: Workload, workers: int, budget_s: float, warmup_epochs: int = 0) -> dict:
    gc.collect()
    with PeakRss(interval_s=0.05) as peak:  # few wake-ups: its CPU counts in the trainer's
        point = drain(contender, workload, workers, budget_s, warmup_fraction=0.1, warmup_epochs=warmup_epochs)
    point["peak_rss_mib"] = peak.peak_kib / 1024
    steady, cpu = point.get("steady_items"), point.get("cpu_steady_s")
    point["cpu_per_1k_s"] = cpu / steady * 1000 if steady and cpu is not None else None
    # The rate from the first item to the last, past each worker's first item. Not the steady
    # rate of drain(): W sessions starting for seconds on a loaded host fill their credit
    # windows meanwhile, and the burst that follows counted above the ideal.
    span = point["total_s"] - (point["first_item_s"] or 0.0)
    point["items_per_s"] = (point["items"] - workers) / span if point["items"] > workers and span > 0 else None
    return point


def measure_sessions(contender: Contender, params: dict, emit: Callable[[dict], None]) -> dict:
    """Per worker count: the sleep-bound epoch, then the tiny one, as one point."""
    def point(workers: int) -> dict:
        sleep = Workload("sleep", workers * params["sleep_items_per_worker"], sleep_s=params["sleep_s"],
                         block=params["sleep_block"])
        # the second epoch of one loader, as the target defines the efficiency: the cost per session
        # of a running fleet, not its start (the first item column is the first epoch's)
        data = _epoch(contender, sleep, workers, params.get("sleep_budget_s", params["budget_s"]), warmup_epochs=1)
        ideal = workers / params["sleep_s"]
        data["efficiency"] = data["items_per_s"] / ideal if data["items_per_s"] else None
        n = params["tiny_items"]
        # The receive path at full speed: the second epoch of one loader too, as the sleep-bound one
        # (the first epoch's rate, from its first item, counted the start of W sessions as well; it
        # counted it once the first item came, which each contender brings at its own point of that
        # start). A longer budget: many sessions on a loaded host.
        tiny = _epoch(contender, Workload("ints", n, block=params["tiny_block"]), workers, 2 * params["budget_s"],
                      warmup_epochs=1)
        data.update({f"tiny_{key}": value for key, value in tiny.items()})
        return data

    return measure_points(params["workers_list"], point, emit)


def report_sessions(scenario: Scenario, params: dict, results: dict) -> str:
    """Two tables: the sleep-bound one (efficiency, vs torch's DataLoader) and the tiny one."""
    def sleep_cells(name: str, p: dict) -> list:
        reference = point_value(results, "torch-DataLoader", "efficiency", p["workers"])
        gap = p["efficiency"] - reference if p.get("efficiency") is not None and reference is not None else None
        return [f"{p['items']:,}", fmt_num(p["items_per_s"], ",.0f"), fmt_num(p["efficiency"], ".2f"),
                fmt_num(gap, "+.2f"), fmt_num(p["loader_first_item_s"], ".2f", " s"),
                fmt_num(p["cpu_per_1k_s"], ".3f", " s"), fmt_num(p["peak_rss_mib"], ".0f", " MiB")]

    def tiny_cells(name: str, p: dict) -> list:
        rate = p.get("tiny_items_per_s")
        return [f"{p.get('tiny_items', 0):,}", fmt_num(rate, ",.0f"),
                fmt_ratio(ratio(rate, point_value(results, name, "tiny_items_per_s", params["workers_list"][0]))),
                fmt_ratio(ratio(rate, point_value(results, "torch-DataLoader", "tiny_items_per_s", p["workers"]))),
                fmt_num(p.get("tiny_cpu_per_1k_s"), ".3f", " s")]

    sizes = ", ".join(map(str, params["workers_list"]))
    sleep_table = render_table(
        f"== sessions: map(sleep {params['sleep_s'] * 1000:.0f} ms) per item, {params['sleep_items_per_worker']} "
        f"items per worker (sharded in blocks of {params['sleep_block']}), W = {sizes} ==",
        ["contender", "items", "items/s", "efficiency", "vs DataLoader", "first item", "CPU / 1k items",
         "trainer peak RSS"],
        point_rows(results, sleep_cells),
        notes=["efficiency = items/s / (W / sleep), in the second epoch of one loader (every contender keeps its "
               "workers: torch-DataLoader with persistent_workers=True); items/s: from its first item to the last, "
               "past each worker's first; vs DataLoader: efficiency minus torch.utils.data.DataLoader's at the same W",
               "first item: from building the loader to its first item (the first epoch)",
               "CPU / 1k items: the trainer process's CPU seconds (all its threads) per 1,000 steady items",
               "RPCRS-2servers: the W sessions on two running worker servers, W/2 on each (one process per "
               "session); the trainer and the servers' sessions share one CPU scheduling group (autogroup), "
               "as local workers share the trainer's"]
        + [f"{name}: trainer RSS per session {fmt_num(rss_per_session_mib(results, name)[0], '.2f', ' MiB')} "
           f"({rss_per_session_mib(results, name)[1]})" for name in results])
    first = params["workers_list"][0]
    tiny_table = render_table(
        f"== sessions: tiny items, up to {params['tiny_items']:,} ints sharded in blocks of "
        f"{params['tiny_block']} (each worker reads only its own blocks), W = {sizes} ==",
        ["contender", "items", "items/s", f"vs W={first}", "vs DataLoader", "CPU / 1k items"],
        point_rows(results, tiny_cells),
        notes=[f"items/s: in the second epoch of one loader (workers kept), from its first item to the last, as in "
               f"the table above; vs W={first}: the rate over the same contender's at W={first}", MPRS_NOTE])
    return sleep_table + "\n\n" + tiny_table


SCENARIOS = [
    Scenario("sessions", CONTENDERS, plan_sessions, measure_sessions, report_sessions, timeout_sessions),
]
