"""The performance targets: each a ratio of two measured numbers, PASS / MISS, in one table.

Later targets (distribution policies, cache, many sessions) are rows
added to ``TARGETS`` with a measure built from the helpers below.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from benchsuite.contenders import ONE_STREAM
from benchsuite.report.format import (
    COPY_LIMIT,
    GB,
    PER_ITEM_LIMITS,
    PIPELINE_LIMITS,
    ceiling_at,
    fmt_ratio,
    fmt_size,
    paired_ratio,
    paired_ratio_at,
    paired_text,
    point_at,
    point_value,
    points_of,
    render_table,
    rss_per_session_mib,
)


@dataclasses.dataclass
class Target:
    """A goal: ``measured(results) >= threshold``; measured returns (value, detail or why
    missing).  A ``threshold`` of None reports the ratio without a verdict (``info``)."""

    goal: str
    threshold: Optional[float]
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
    """A rate as printed in a target's detail: ``3.10 GB/s`` or ``122,624/s``."""
    return f"{rate / GB:.2f} GB/s" if key == "bytes_per_s" else f"{rate:,.0f}/s"


def paired_measure(key: str, point: dict, reference: dict, labels: tuple[str, str] = ("", "")) -> tuple[Optional[float], str]:
    """Two points' :func:`~benchsuite.report.format.paired_ratio` as a measure: its median, and
    the rates of the round nearest it, then every round's ratio when there were several."""
    paired = paired_ratio(point, reference, key)
    if paired is None:
        return None, "no round measured both"
    ours, theirs = paired["rates"]
    detail = f"{labels[0]}{rate_text(key, ours)} vs {labels[1]}{rate_text(key, theirs)}"
    if len(paired["ratios"]) > 1:
        detail += (f"; median of {len(paired['ratios'])} paired rounds (rates: the one nearest it), "
                   f"each round: {paired_text(paired)}")
    return paired["median"], detail


def ratio_at(scenario: str, key: str, contender: tuple[str, int], reference: tuple[str, int]):
    """A measure: ``contender``'s ``key`` at its W over ``reference``'s at its W (in a scenario
    whose ratios are paired, ``params['paired']``, the median of the per-round ratios)."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        if scenario not in all_results:
            return None, f"{scenario} not run"
        results = all_results[scenario]["contenders"]
        points = []
        for name, workers in (contender, reference):
            point = point_at(results, name, workers)
            if point is None or point.get(key) is None:
                outcome = results.get(name)
                return None, (f"{name} not run" if outcome is None else
                              outcome.get("reason") or f"{name}: no W={workers} point")
            points.append(point)
        values = [p[key] for p in points]
        if all_results[scenario].get("params", {}).get("paired"):
            return paired_measure(key, *points)
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
        if all_results[scenario].get("params", {}).get("paired"):
            return paired_measure(key, a, b, labels=(f"W={a['workers']} ", f"W={b['workers']} "))
        return a[key] / b[key], (f"W={a['workers']} {rate_text(key, a[key])} vs "
                                 f"W={b['workers']} {rate_text(key, b[key])}")
    return measured


def over_sizes(all_results: dict, scenario: str, smallest: int, below: Optional[int], names: tuple,
               per_size: Callable[[dict, int], Optional[dict]]) -> tuple[dict, Optional[int], str]:
    """``per_size(results, size)`` (a dict with a ``median``) at each item size of ``scenario`` from
    ``smallest`` up, below ``below``: (what each size gave, if anything; the size of the lowest
    median, or None; ``; not measured at ...`` for sizes in range without one, or, when none had
    one, why, naming the first of ``names`` that did not run)."""
    if scenario not in all_results:
        return {}, None, f"{scenario} not run"
    results = all_results[scenario]["contenders"]
    sizes = [size for size in all_results[scenario]["params"]["sizes"]
             if size >= smallest and (below is None or size < below)]
    found = {size: value for size in sizes for value in [per_size(results, size)] if value}
    if not found:
        missing = [name for name in names if not (results.get(name) or {}).get("ok")]
        return found, None, (f"{', '.join(missing)}: {(results.get(missing[0]) or {}).get('reason', 'not run')}"
                             if missing else "no size in range measured both")
    unmeasured = [fmt_size(size) for size in sizes if size not in found]
    return (found, min(found, key=lambda size: found[size]["median"]),
            f"; not measured at {', '.join(unmeasured)}" if unmeasured else "")


def worst_text(found: dict, worst: int) -> str:
    """``worst at <size>: <ours> vs <theirs>`` from the two rates :func:`over_sizes` found at ``worst``."""
    ours, theirs = found[worst]["rates"]
    return f"worst at {fmt_size(worst)}: {rate_text('bytes_per_s', ours)} vs {rate_text('bytes_per_s', theirs)}"


def at_every_size(contender: str, workers: int, reference: str, threshold: float, smallest: int = 0,
                  below: Optional[int] = None, scenario: str = "sweep"):
    """A measure: the lowest over the item sizes of ``scenario`` (from ``smallest``, below
    ``below``) of ``contender``'s paired ratio to ``reference`` (at W=2, or its one stream);
    the detail names the worst size and lists every size's ratio.  With a size not measured,
    none unless the sizes measured already miss ``threshold``."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        found, worst, unmeasured = over_sizes(
            all_results, scenario, smallest, below, (contender, reference),
            lambda results, size: paired_ratio_at(results, contender, workers, reference, 2, size))
        if worst is None:
            return None, unmeasured
        detail = (f"{worst_text(found, worst)}; each size: "
                  + ", ".join(f"{fmt_size(size)} {fmt_ratio(found[size]['median'])}" for size in found) + unmeasured)
        if unmeasured and found[worst]["median"] >= threshold:  # no verdict of "every size" from some of them
            return None, detail
        return found[worst]["median"], detail
    return measured


def under_ceiling_at_every_size(contender: str, workers: int, reference: str, smallest: int = 0,
                                below: Optional[int] = None, scenario: str = "sweep",
                                limits: tuple = PER_ITEM_LIMITS):
    """A measure (info): the lowest over the item sizes in range of ``contender``'s paired ratio to
    its ceiling, the lowest of ``reference`` and ``limits`` (``report.format.ceiling_at``);
    the detail gives, for each size, that ratio, the ceiling over ``reference`` (where it is under a
    target's ratio to ``reference``, no DataLoader2 reading service can meet that target) and the
    limit that sets it."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        found, worst, unmeasured = over_sizes(
            all_results, scenario, smallest, below, (contender, reference, *limits),
            lambda results, size: ceiling_at(results, contender, workers, reference, size, limits))
        if worst is None:
            return None, unmeasured
        detail = (f"{worst_text(found, worst)} "
                  f"({found[worst]['binding']}); each size, ours / ceiling (ceiling / {reference}, the limit "
                  "that sets it): " + ", ".join(
                      f"{fmt_size(size)} {fmt_ratio(bounded['median'])} "
                      f"({fmt_ratio(bounded['rates'][1] / bounded['limit_rates'][reference])}, {bounded['binding']})"
                      for size, bounded in found.items()) + unmeasured)
        return found[worst]["median"], detail
    return measured


def size_range(smallest: int = 0, below: Optional[int] = None) -> str:
    """The sizes a sweep row covers, in words: from ``smallest`` up, below ``below``, or every size."""
    return f"from {fmt_size(smallest)} up" if smallest else f"below {fmt_size(below)}" if below else "at every size"


def sweep_target(contender: str, workers: int, threshold: float, reference: str, smallest: int = 0,
                 below: Optional[int] = None) -> Target:
    """``contender`` at ``workers`` >= ``threshold`` x ``reference`` at every sweep size in range."""
    one_stream = reference in ONE_STREAM
    where = size_range(smallest, below)
    goal = (f"sweep: {contender} W={workers} >= {threshold}x {reference}{'' if one_stream else ' W=2'} "
            f"{'at every size ' if smallest or below else ''}{where} (the worst size)").replace("  ", " ")
    return Target(goal, threshold, at_every_size(contender, workers, reference, threshold, smallest, below))


def sweep_ceiling(contender: str, workers: int, reference: str, smallest: int = 0,
                  below: Optional[int] = None) -> Target:
    """The info row beside a sweep target against ``reference``: ``contender`` over its ceiling at
    every size in range (:func:`under_ceiling_at_every_size`)."""
    where = size_range(smallest, below)
    goal = (f"sweep: {contender} W={workers} / ceiling {where}: the lowest of {reference}, "
            f"graph-limit W={workers}, loader-limit (the worst size)")
    return Target(goal, None, under_ceiling_at_every_size(contender, workers, reference, smallest, below))


def sweep_pipeline(contender: str, workers: int, reference: str, smallest: int = 0,
                   below: Optional[int] = None) -> Target:
    """The info row beside a sweep target against ``reference``: ``contender`` over the pipeline limit
    of that stream's kind at the same W, and that limit over ``reference``, at every size in range."""
    pipeline = PIPELINE_LIMITS[reference]
    where = size_range(smallest, below)
    goal = f"sweep: {contender} W={workers} / {pipeline} W={workers} {where} (the worst size)"
    return Target(goal, None, under_ceiling_at_every_size(contender, workers, reference, smallest, below,
                                                          limits=(pipeline,)))


def under_copy_limit_at_every_size(contender: str, workers: int, reference: str, threshold: float,
                                   scenario: str = "sweep"):
    """A measure (info): the lowest over the item sizes of ``contender``'s paired ratio to copy-limit at
    ``workers``; the detail gives each size's ratio, copy-limit's over ``reference`` (at W=2), and the
    sizes where that is under ``threshold``."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        found, worst, unmeasured = over_sizes(
            all_results, scenario, 0, None, (contender, COPY_LIMIT),
            lambda results, size: paired_ratio_at(results, contender, workers, COPY_LIMIT, workers, size))
        if worst is None:
            return None, unmeasured
        results = all_results[scenario]["contenders"]
        limit = {size: paired_ratio_at(results, COPY_LIMIT, workers, reference, 2, size) for size in found}
        under_target = [fmt_size(size) for size, ratio in limit.items() if ratio and ratio["median"] < threshold]
        detail = (f"{worst_text(found, worst)}; each size, ours / {COPY_LIMIT} ({COPY_LIMIT} / {reference}): " + ", ".join(
                      f"{fmt_size(size)} {fmt_ratio(found[size]['median'])} "
                      f"({fmt_ratio(limit[size] and limit[size]['median'])})" for size in found) + unmeasured)
        if under_target:
            detail += f"; {COPY_LIMIT} itself under {threshold:g}x {reference} at {', '.join(under_target)}"
        return found[worst]["median"], detail
    return measured


def efficiency_at(contender: str, workers: int, scenario: str = "scaling", minus: Optional[str] = None):
    """A measure: ``contender``'s efficiency at ``workers`` workers in a sleep-bound
    ``scenario``; with ``minus``, less that contender's at the same W."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        if scenario not in all_results:
            return None, f"{scenario} not run"
        found = []
        for name in (contender, minus) if minus else (contender,):
            outcome = all_results[scenario]["contenders"].get(name) or {}
            points = (outcome.get("data") or {}).get("points") or outcome.get("partial") or []
            point = next((p for p in points if p.get("workers") == workers and p.get("efficiency") is not None), None)
            if point is None:
                return None, outcome.get("reason") or f"{name}: no W={workers} point"
            found.append(point)
        ideal = workers / all_results[scenario]["params"]["sleep_s"]
        if minus:
            ours, theirs = found
            return (ours["efficiency"] - theirs["efficiency"],
                    f"{ours['efficiency']:.2f} vs {theirs['efficiency']:.2f} ({minus})")
        return found[0]["efficiency"], f"{found[0]['items_per_s']:,.0f} of {ideal:,.0f} items/s"
    return measured


def rss_per_session(contender: str):
    """A measure: 2 MiB over ``contender``'s trainer RSS per session in the sessions
    scenario (the slope of its peak from the smallest W to the largest): >= 1 is within 2 MiB."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        if "sessions" not in all_results:
            return None, "sessions not run"
        slope, detail = rss_per_session_mib(all_results["sessions"]["contenders"], contender)
        if slope is None:
            return None, detail
        return 2.0 / max(slope, 1e-3), f"{slope:.2f} MiB per session ({detail})"
    return measured


def first_item_within(contender: str, workers: int, seconds: float):
    """A measure: ``seconds`` over ``contender``'s first item at ``workers`` sessions in the
    sessions scenario (loader construction and ``iter()`` to the first item of its first
    epoch): >= 1 is within ``seconds``."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        if "sessions" not in all_results:
            return None, "sessions not run"
        value = point_value(all_results["sessions"]["contenders"], contender, "loader_first_item_s", workers)
        if not value:
            return None, f"{contender}: no W={workers} point"
        return seconds / value, f"{value:.2f} s"
    return measured


#: The bound a reading service's trainer keeps to for a slow consumer: its peak RSS above the
#: baseline at most ``WINDOW_FACTOR`` x its credit window (bytes) + ``SLACK_MIB``.
WINDOW_FACTOR, SLACK_MIB = 1.25, 4.0


def memory_bound_mib(window_mib: Optional[float]) -> Optional[float]:
    """The most a trainer with a credit window of ``window_mib`` may grow by (see :data:`WINDOW_FACTOR`)."""
    return None if window_mib is None else WINDOW_FACTOR * window_mib + SLACK_MIB


def memory_within_bound(contender: str, item_bytes: int):
    """A measure: :func:`memory_bound_mib` over ``contender``'s trainer peak growth with a slow
    consumer of ``item_bytes`` items: >= 1 is within the bound."""
    def measured(all_results: dict) -> tuple[Optional[float], str]:
        if "memory" not in all_results:
            return None, "memory not run"
        results = all_results["memory"]["contenders"]
        point = point_at(results, contender, all_results["memory"]["params"]["workers"], item_bytes)
        if point is None:
            return None, (results.get(contender) or {}).get("reason") or f"{contender}: no {fmt_size(item_bytes)} point"
        bound = memory_bound_mib(point.get("credit_window_mib"))
        if bound is None:
            return None, f"{contender}: credit window unknown"
        others = [f"{name} {growth:.1f} MiB" for name in ("MPRS", "torch-DataLoader")
                  for growth in [point_value(results, name, "growth_mib", point["workers"], item_bytes)]
                  if growth is not None]
        return (bound / max(point["growth_mib"], 1e-3),
                f"{point['growth_mib']:.1f} MiB vs bound {bound:.0f} MiB (window {point['credit_window_mib']:.0f} MiB)"
                + (f" ({', '.join(others)})" if others else ""))
    return measured


def ratio_target(scenario: str, contender: str, workers: int, threshold: float, reference: str,
                 reference_workers: Optional[int] = None, note: str = "") -> Target:
    """``contender`` at ``workers`` >= ``threshold`` x ``reference`` (at the same W unless
    given; a one-stream reference has no W), its goal text made from the same arguments."""
    key = "items_per_s" if scenario == "tiny" else "bytes_per_s"
    one_stream = reference in ONE_STREAM
    reference_workers = 1 if one_stream else (reference_workers or workers)
    goal = (f"{scenario}: {contender} W={workers} {'items/s ' if key == 'items_per_s' else ''}>= "
            f"{threshold}x {reference}{'' if one_stream else f' W={reference_workers}'}{note}")
    measure = ratio_at(scenario, key, (contender, workers), (reference, reference_workers))
    return Target(goal, threshold, measure)


TARGETS = [
    ratio_target("tiny", "RPCRS-local", 2, 50, "MPRS"),
    ratio_target("tiny", "RPCRS-tcp", 2, 50, "MPRS"),
    ratio_target("tiny", "RPCRS-local", 2, 5, "torch-DataLoader"),
    ratio_target("tiny", "RPCRS-tcp", 2, 5, "torch-DataLoader"),
    ratio_target("tensor8m", "RPCRS-local", 2, 0.6, "production-limit"),
    ratio_target("tensor8m", "RPCRS-local-shm", 2, 0.6, "production-limit-shm",
                 note=" (items made with shared_empty)"),
    Target("tensor8m: RPCRS-local W=2 / copy-limit W=2 (what one copy into shared memory allows)", None,
           ratio_at("tensor8m", "bytes_per_s", ("RPCRS-local", 2), ("copy-limit", 2))),
    ratio_target("tensor8m", "RPCRS-local", 2, 4, "MPRS"),
    ratio_target("tensor8m", "RPCRS-local", 2, 3, "torch-DataLoader"),
    ratio_target("tensor8m", "RPCRS-tcp", 1, 0.85, "raw-socket", note=" (both one stream)"),
    Target("tensor8m: RPCRS-tcp >= 2x RPCDataloader (best W of each) *", 2,
           best_ratio("tensor8m", "bytes_per_s", "RPCRS-tcp", "RPCDataloader")),
    sweep_target("RPCRS-tcp", 1, 0.85, "raw-socket", smallest=64 * 1024),
    sweep_ceiling("RPCRS-tcp", 1, "raw-socket", smallest=64 * 1024),
    sweep_pipeline("RPCRS-tcp", 1, "raw-socket", smallest=64 * 1024),
    sweep_target("RPCRS-tcp", 1, 0.7, "raw-socket", below=64 * 1024),
    sweep_ceiling("RPCRS-tcp", 1, "raw-socket", below=64 * 1024),
    sweep_pipeline("RPCRS-tcp", 1, "raw-socket", below=64 * 1024),
    sweep_target("RPCRS-local", 2, 1.0, "raw-unix"),
    sweep_ceiling("RPCRS-local", 2, "raw-unix"),
    sweep_pipeline("RPCRS-local", 2, "raw-unix"),
    sweep_target("RPCRS-local", 2, 3, "MPRS"),
    Target(f"sweep: RPCRS-local W=2 / {COPY_LIMIT} W=2 at every size, and {COPY_LIMIT} / MPRS W=2 (what one copy "
           "into shared memory allows against the 3x target; the worst size)", None,
           under_copy_limit_at_every_size("RPCRS-local", 2, "MPRS", 3)),
    sweep_target("RPCRS-local", 2, 2, "torch-DataLoader"),
    Target("scaling: RPCRS-local efficiency at W=16 >= 0.9", 0.9, efficiency_at("RPCRS-local", 16)),
    Target("scaling: RPCRS-tcp efficiency at W=16 >= 0.9", 0.9, efficiency_at("RPCRS-tcp", 16)),
    *(Target(f"memory: {name} trainer peak growth <= {WINDOW_FACTOR}x credit window + {SLACK_MIB:.0f} MiB, "
             f"{fmt_size(size)} items (bound / measured)", 1.0, memory_within_bound(name, size))
      for name in ("RPCRS-local", "RPCRS-tcp") for size in (1 << 20, 8 << 20)),
    *(Target(f"sessions: {name} efficiency at W=64 >= 0.9", 0.9, efficiency_at(name, 64, "sessions"))
      for name in ("RPCRS-local", "RPCRS-2servers")),
    *(Target(f"sessions: {name} efficiency at W=64 minus torch-DataLoader's >= -0.03", -0.03,
             efficiency_at(name, 64, "sessions", minus="torch-DataLoader")) for name in ("RPCRS-local", "RPCRS-2servers")),
    *(Target(f"sessions: {name} efficiency at W=128 >= 0.8", 0.8, efficiency_at(name, 128, "sessions"))
      for name in ("RPCRS-local", "RPCRS-2servers")),
    *(Target(f"sessions: {name} first item of 64 sessions within 1 s (1 s / measured)", 1.0,
             first_item_within(name, 64, 1.0)) for name in ("RPCRS-local", "RPCRS-2servers")),
    Target("sessions: RPCRS-local tiny items/s at W=64 >= 0.5x W=2", 0.5,
           ratio_at("sessions", "tiny_items_per_s", ("RPCRS-local", 64), ("RPCRS-local", 2))),
    Target("sessions: RPCRS-local trainer RSS per session <= 2 MiB (2 MiB / measured)", 1.0,
           rss_per_session("RPCRS-local")),
]
TARGET_NOTES = [
    "* best W of each side (W=1 or 2, labelled in 'detail'); the same-W ratios are in the tensor8m table "
    "(column 'vs RPCDataloader')",
    "production-limit: W processes that only make the items (nothing moved), the ceiling for local workers; "
    "raw-socket makes every item as the workers do",
    "production-limit-shm: the same for items made with rpc_reading_service.shared_empty (ordinary memory "
    "outside a worker session); RPCRS-local-shm: local workers whose graph makes its items that way",
    "copy-limit (info, no target): production-limit's processes, each also copying every item once into a warm "
    "shared segment, as RPCRS-local's workers do; nothing moved. In the sweep, copy-limit / MPRS at a size is "
    "what making and copying each item once allows over MPRS there, with nothing else paid (ours is within a "
    "few percent of copy-limit at 64 MiB); items made in shared memory (rpc_reading_service.shared_empty) "
    "are handed over without that copy",
    "sweep ... / ceiling (info, no target): the reading service over the lowest of the target's raw stream, "
    "graph-limit (W workers' DataPipe graphs, nothing moved) and loader-limit (DataLoader2 handing on items made "
    "before, a fresh tensor each): what no DataLoader2 reading service passes; where the ceiling / raw is under "
    "the target's ratio, the per-item work of any DataLoader2 reading service rules the target out at that size",
    "sweep ... / pipeline-limit[-unix] (info, no target): the reading service over W processes that iterate "
    "their part of the same graph and send each tensor's bytes over one socket each (TCP [Unix]) to a "
    "DataLoader2 that hands them on (nothing encoded, framed or credited); each size gives pipeline / raw: "
    "the graph, the move and DataLoader2's loop added up, as they are where the trainer and the workers share"
    " the cores. Not a bound: a reading service that batches its sends or hands items over in shared memory "
    "can pass it",
    "memory: a slow consumer (5 ms per item); the credit window is W x prefetch x item size",
    "raw-socket is one TCP stream, so it is compared with RPCRS-tcp at W=1 (one stream); at W=2 three busy "
    "processes share 2 cores",
]


def evaluate_targets(all_results: dict) -> list[dict]:
    """Each target with its measured value and PASS / MISS / n/a."""
    rows = []
    for target in TARGETS:
        measured, detail = target.measured(all_results)
        if measured is None:
            status = "n/a"
        elif target.threshold is None:
            status = "info"
        else:
            status = "PASS" if measured >= target.threshold else "MISS"
        rows.append({"goal": target.goal, "threshold": target.threshold, "measured": measured,
                     "status": status, "detail": detail})
    return rows


def needed_text(row: dict) -> str:
    """A target row's threshold as printed: ``50x``, ``0.9`` (an efficiency) or ``-``."""
    if row["threshold"] is None:
        return "-"
    return str(row["threshold"]) if "efficiency" in row["goal"] else f"{row['threshold']}x"


def measured_text(row: dict) -> str:
    """A target row's measured value as printed: ``79.8x`` or ``0.98`` (an efficiency)."""
    return f"{row['measured']:.2f}" if "efficiency" in row["goal"] else fmt_ratio(row["measured"])


def report_targets(rows: list[dict]) -> str:
    """The table of targets: goal, measured, needed, PASS / MISS / info / n/a, detail."""
    table_rows = []
    for row in rows:
        if row["measured"] is None:
            table_rows.append((row["goal"], f"n/a ({row['detail'][:80]})"))
        else:
            table_rows.append([row["goal"], measured_text(row), needed_text(row), row["status"],
                               row["detail"]])
    return render_table("== targets ==", ["goal", "measured", "needed", "status", "detail"], table_rows,
                        notes=TARGET_NOTES)
