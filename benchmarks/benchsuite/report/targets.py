"""The targets of the issues: each a ratio of two measured numbers, PASS / MISS, in one table."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from benchsuite.report.format import GB, fmt_ratio, point_value, points_of, render_table


@dataclasses.dataclass
class Target:
    """A goal: ``measured(results) >= threshold``; measured returns (value, why-missing)."""

    goal: str
    threshold: float
    measured: Callable[[dict], tuple[Optional[float], str]]


def outcome_of(all_results: dict, scenario: str, contender: str) -> tuple[Optional[dict], str]:
    """A contender's data in a scenario, or (None, why not)."""
    if scenario not in all_results:
        return None, f"{scenario} not run"
    outcome = all_results[scenario]["contenders"].get(contender)
    if outcome is None:
        return None, f"{contender} not run"
    if not outcome.get("ok"):
        return None, f"{contender}: {outcome.get('reason', '?')}"
    return outcome["data"], ""


def rate_text(key: str, rate: float) -> str:
    return f"{rate / GB:.2f} GB/s" if key == "bytes_per_s" else f"{rate:,.0f}/s"


def ratio_at(scenario: str, key: str, contender: tuple[str, int], reference: tuple[str, int]):
    """A measure: ``contender``'s ``key`` at its W over ``reference``'s at its W."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        if scenario not in all_results:
            return None, f"{scenario} not run"
        results = all_results[scenario]["contenders"]
        values = []
        for name, workers in (contender, reference):
            v = point_value(results, name, key, workers)
            if v is None:
                outcome = results.get(name)
                return None, (f"{name} not run" if outcome is None else
                              outcome.get("reason") or f"{name}: no W={workers} point")
            values.append(v)
        return values[0] / values[1], f"{rate_text(key, values[0])} vs {rate_text(key, values[1])}"
    return measured


def best_ratio(scenario: str, key: str, contender: str, reference: str):
    """A measure: the best W of ``contender`` over the best W of ``reference`` (labelled)."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        if scenario not in all_results:
            return None, f"{scenario} not run"
        results = all_results[scenario]["contenders"]
        best = []
        for name in (contender, reference):
            points = [p for p in points_of(results, name) if "error" not in p and p.get(key)]
            if not points:
                outcome = results.get(name) or {}
                return None, outcome.get("reason") or f"{name}: no point"
            best.append(max(points, key=lambda p: p[key]))
        (a, b) = best
        return a[key] / b[key], (f"W={a['workers']} {rate_text(key, a[key])} vs "
                                 f"W={b['workers']} {rate_text(key, b[key])}")
    return measured


def efficiency_at(contender: str, workers: int):
    """A measure: ``contender``'s scaling efficiency at ``workers`` workers."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        if "scaling" not in all_results:
            return None, "scaling not run"
        outcome = all_results["scaling"]["contenders"].get(contender) or {}
        points = (outcome.get("data") or {}).get("points") or outcome.get("partial") or []
        for p in points:
            if p.get("workers") == workers and p.get("efficiency") is not None:
                ideal = workers / all_results["scaling"]["params"]["sleep_s"]
                return p["efficiency"], f"{p['items_per_s']:,.0f} of {ideal:,.0f} items/s"
        return None, outcome.get("reason") or f"no W={workers} point"
    return measured


TARGETS = [
    Target("tiny: RPCRS-local W=2 items/s >= 50x MPRS W=2", 50,
           ratio_at("tiny", "items_per_s", ("RPCRS-local", 2), ("MPRS", 2))),
    Target("tiny: RPCRS-tcp W=2 items/s >= 50x MPRS W=2", 50,
           ratio_at("tiny", "items_per_s", ("RPCRS-tcp", 2), ("MPRS", 2))),
    Target("tensor8m: RPCRS-tcp W=1 >= 0.8x raw-socket (both one stream)", 0.8,
           ratio_at("tensor8m", "bytes_per_s", ("RPCRS-tcp", 1), ("raw-socket", 1))),
    Target("tensor8m: RPCRS-tcp >= 2x RPCDataloader (best W of each) *", 2,
           best_ratio("tensor8m", "bytes_per_s", "RPCRS-tcp", "RPCDataloader")),
    Target("tensor8m: RPCRS-local W=2 >= 1x MPRS W=2", 1,
           ratio_at("tensor8m", "bytes_per_s", ("RPCRS-local", 2), ("MPRS", 2))),
    Target("scaling: RPCRS-local efficiency at W=16 >= 0.9", 0.9, efficiency_at("RPCRS-local", 16)),
    Target("scaling: RPCRS-tcp efficiency at W=16 >= 0.9", 0.9, efficiency_at("RPCRS-tcp", 16)),
]
TARGET_NOTES = [
    "* best W of each side (W=1 or 2, labelled in 'detail'); the same-W ratios are in the tensor8m table "
    "(column 'vs RPCDataloader (same W)')",
    "raw-socket is one TCP stream, so it is compared with RPCRS-tcp at W=1 (one stream); at W=2 three busy "
    "processes share 2 cores",
]


def evaluate_targets(all_results: dict) -> list[dict]:
    """Each target with its measured value and PASS / MISS / n/a."""
    rows = []
    for target in TARGETS:
        measured, detail = target.measured(all_results)
        status = "n/a" if measured is None else ("PASS" if measured >= target.threshold else "MISS")
        rows.append({"goal": target.goal, "threshold": target.threshold, "measured": measured,
                     "status": status, "detail": detail})
    return rows


def report_targets(rows: list[dict]) -> str:
    table_rows = []
    for row in rows:
        if row["measured"] is None:
            table_rows.append((row["goal"], f"n/a ({row['detail'][:80]})"))
        else:
            efficiency = "efficiency" in row["goal"]
            measured = f"{row['measured']:.2f}" if efficiency else fmt_ratio(row["measured"])
            table_rows.append([row["goal"], measured,
                               str(row["threshold"]) if efficiency else f"{row['threshold']}x",
                               row["status"], row["detail"]])
    return render_table("== targets ==", ["goal", "measured", "needed", "status", "detail"], table_rows,
                        notes=TARGET_NOTES)
