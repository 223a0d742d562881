"""The front ends side by side (torchdata >= 0.10): ``RemoteMapper`` vs ``ParallelMapper(method="process")``
and ``RemoteIterable`` under torch's DataLoader vs ``DataLoader(num_workers=W)``, on tiny items
(items/s) and 8 MiB tensors (GB/s), W = 2, the ratios paired round by round.

Not in ``SCENARIOS``: ``bench_frontends.py`` runs them in the environment with torchdata.nodes.
"""

from __future__ import annotations

from typing import Callable

from workloads import MIB, Workload

from benchsuite.report.format import (
    GB,
    budget_note,
    fmt_num,
    fmt_ratio,
    paired_ratio,
    paired_text,
    point_at,
    point_rows,
    rounds_text,
    render_table,
)
from benchsuite.scenarios.base import Scenario, timeout_budgeted
from benchsuite.scenarios.throughput import measure_throughput

#: (ours, what users run in its place): each ratio row of the tables.
PAIRS = (("RemoteMapper", "ParallelMapper"), ("RemoteIterable", "torch-DataLoader"))
#: The order a round runs them in (every other round reversed): each next to the one it is compared with.
ORDER = tuple(name for pair in PAIRS for name in pair[::-1])
WORKERS = 2


def plan(kind: str) -> Callable[[bool], dict]:
    """The plan of the tiny (``"ints"``) or 8 MiB (``"tensor"``) table; every contender runs every round."""

    def make(quick: bool) -> dict:
        if kind == "ints":
            workload, budget, key = Workload("ints", 20_000 if quick else 100_000), 1.0 if quick else 2.0, "items_per_s"
        else:
            workload = Workload("tensor", 48 if quick else 128, item_bytes=8 * MIB)
            budget, key = 1.0 if quick else 2.0, "bytes_per_s"
        rounds = 2 if quick else 3
        return {"workload": workload.to_dict(), "workers": WORKERS, "budget_s": budget, "rounds": rounds,
                "rounds_of_all": rounds, "paired": list(ORDER), "round_order": list(ORDER), "rate_key": key}

    return make


def report(scenario: Scenario, params: dict, results: dict) -> str:
    """Rates per contender, and each of ours over the contender it replaces, paired by round."""
    key = params["rate_key"]
    scale, spec, unit = (1, ",.0f", " items/s") if key == "items_per_s" else (GB, ".2f", " GB/s")
    reference = {ours: theirs for ours, theirs in PAIRS}

    def cells(name: str, d: dict) -> list:
        paired = paired_ratio(d, point_at(results, reference.get(name, ""), d["workers"]), key)
        return [f"{d['items']:,}", fmt_num(d["steady_s"], ".2f", " s"), fmt_num(d[key] and d[key] / scale, spec, unit),
                rounds_text(d, scale, spec), fmt_ratio(paired and paired["median"]),
                paired_text(paired) if paired else "", budget_note(d)]

    w = Workload.from_dict(params["workload"])
    what = "small ints" if w.kind == "ints" else f"{w.item_bytes // MIB} MiB torch.uint8 tensors"
    title = f"== {scenario.name}: up to {w.n_items:,} {what}, each made from its index in the workers, W = {WORKERS} =="
    headers = ["contender", "items", "time", "rate", "rounds", "vs theirs", "each round's ratio", "note"]
    return render_table(title, headers, point_rows(results, cells), notes=[
        "vs theirs: RemoteMapper over ParallelMapper(method='process'), RemoteIterable (under torch's DataLoader, "
        "num_workers=0) over torch-DataLoader (DataLoader(graph, num_workers=W, persistent_workers=True)); "
        "the median of the rounds' ratios, * where ours ran first in that round",
        "mappers: IterableWrapper(range(N)) in the trainer, each index sent to a worker that makes the item "
        "(workloads.item_function; int for ints), read through torchdata.nodes.Loader; the DataLoaders: "
        "workloads.build_datapipe's graph made in the workers",
        "the DataLoader2 front end on the same engine: RPCRS-local's 'vs DataLoader' in bench.py's tiny and "
        "tensor8m tables (torchdata 0.9), to read against RemoteIterable's here",
        f"rate: the best of {params['rounds']} rounds ('rounds' lists each); every contender runs once per round, "
        "each next to the one it is compared with, every other round in reverse order",
    ])


SCENARIOS = [
    Scenario("frontends-tiny", ORDER, plan("ints"), measure_throughput, report, timeout_budgeted),
    Scenario("frontends-tensor8m", ORDER, plan("tensor"), measure_throughput, report, timeout_budgeted),
]
