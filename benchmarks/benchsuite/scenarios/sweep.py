"""The item-size sweep: GB/s of every way of moving items from 1 KiB to 64 MiB, side by side."""

from __future__ import annotations

from typing import Callable

from workloads import MIB, Workload

from benchsuite.contenders import ONE_STREAM
from benchsuite.contenders.base import Contender
from benchsuite.measure import drain
from benchsuite.report.format import (
    COPY_LIMIT,
    GB,
    PER_ITEM_LIMITS,
    PIPELINE_LIMITS,
    ceiling_at,
    fmt_ratio,
    fmt_size,
    paired_ratio_at,
    point_at,
    render_table,
)
from benchsuite.scenarios.base import (
    ROUNDS,
    STARTUP_ALLOWANCE_S,
    Scenario,
    measure_points,
    worker_counts,
)
from benchsuite.scenarios.throughput import PAIRED_ROUNDS

KIB = 1 << 10
#: From a token block to a large batch: 224x224 RGB is 147 KiB, 512x512 RGB 768 KiB.
SIZES = (KIB, 16 * KIB, 64 * KIB, 128 * KIB, 256 * KIB, 512 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB)
#: (contender, W) in the order of the table's rate columns; the raw streams are one stream.
COLUMNS = (("raw-socket", 1), ("raw-unix", 1), ("graph-limit", 1), ("graph-limit", 2), ("loader-limit", 1),
           ("copy-limit", 2), ("pipeline-limit", 1), ("pipeline-limit-unix", 2),
           ("RPCRS-tcp", 1), ("RPCRS-tcp", 2), ("RPCRS-local", 2), ("MPRS", 2), ("torch-DataLoader", 2),
           ("RPCDataloader", 2))
#: The ratio columns (and the targets'): (contender, W, reference at W=2 or its one stream).
RATIOS = (("RPCRS-tcp", 1, "raw-socket"), ("RPCRS-tcp", 2, "raw-socket"), ("RPCRS-local", 2, "raw-unix"),
          ("RPCRS-local", 2, "MPRS"), ("RPCRS-local", 2, "torch-DataLoader"))
#: The ceiling columns (and the targets' info rows): (contender, W, the raw reference of its targets),
#: under the lowest of that reference and the per-item limits (``report.format.ceiling_at``).
CEILINGS = (("RPCRS-tcp", 1, "raw-socket"), ("RPCRS-local", 2, "raw-unix"))
#: A round runs each of these next to the one it is compared with (see ``runner.round_order``); the
#: per-item limits run in every round too, each next to a reading service it bounds.
PAIRED_ORDER = ("loader-limit", "raw-socket", "RPCRS-tcp", "pipeline-limit", "graph-limit", "RPCRS-local",
                "copy-limit", "pipeline-limit-unix", "raw-unix")
CONTENDER_NAMES = tuple(dict.fromkeys(name for name, _ in COLUMNS))
#: MPRS runs its epochs to the end (see ``contenders.alternatives.MPRS``): at most this many items.
MPRS_MAX_ITEMS = 1500


def plan_sweep(quick: bool) -> dict:
    """Every size of :data:`SIZES`; an epoch of ``epoch_bytes`` (between ``min_items`` and
    ``max_items`` items) that every contender but MPRS stops at the time budget."""
    return {"sizes": list(SIZES), "epoch_bytes": (256 if quick else 2048) * MIB, "min_items": 8 if quick else 32,
            "max_items": 200_000, "mprs_epoch_bytes": (64 if quick else 256) * MIB,
            "workers": [2], "workers_by_contender": {"RPCRS-tcp": [1, 2], "graph-limit": [1, 2],
                                                     "pipeline-limit": [1],
                                                     **{name: [1] for name in ONE_STREAM}},
            "budget_s": 0.3 if quick else 1.0, "warmup_s": 0.3 if quick else 0.5, "rounds": 1 if quick else PAIRED_ROUNDS,
            "rounds_of_all": 1 if quick else ROUNDS, "paired": list(PAIRED_ORDER),
            "round_order": list(PAIRED_ORDER), "rate_key": "bytes_per_s"}


def sweep_workload(params: dict, name: str, item_bytes: int) -> Workload:
    """The epoch contender ``name`` runs at ``item_bytes``: fresh tensors (``workloads.make_tensor``);
    the per-item limits, which hold no more than a few items, run ``max_items`` (to the time budget)."""
    items = max(params["min_items"], min(params["max_items"], params["epoch_bytes"] // item_bytes))
    if name in PER_ITEM_LIMITS or name in PIPELINE_LIMITS.values() or name == COPY_LIMIT:
        items = params["max_items"]
    if name == "MPRS":
        items = min(items, max(params["min_items"], min(MPRS_MAX_ITEMS, params["mprs_epoch_bytes"] // item_bytes)))
    return Workload("tensor", items, item_bytes=item_bytes)


def measure_sweep(contender: Contender, params: dict, emit: Callable[[dict], None]) -> dict:
    """One epoch per (item size, worker count), smallest size first, after an untimed short one
    per worker count (so that the first size does not carry what only a first epoch pays)."""
    counts = worker_counts(params, contender.name)
    if params.get("descending_workers"):  # a reversed round (see runner.round_order)
        counts = counts[::-1]

    for workers in counts:  # untimed: what a process's first epoch alone pays (imports, first allocations)
        drain(contender, Workload("tensor", params["min_items"], item_bytes=min(params["sizes"])), workers,
              params["budget_s"])

    def point(workers: int, item_bytes: int) -> dict:
        data = drain(contender, sweep_workload(params, contender.name, item_bytes), workers, params["budget_s"],
                     warmup_s=params["warmup_s"])
        if data["cpu_steady_s"] is not None and data["steady_items"]:
            data["cpu_us_per_item"] = 1e6 * data["cpu_steady_s"] / data["steady_items"]
        return data

    return measure_points(counts, point, emit, coordinates=[{"item_bytes": size} for size in params["sizes"]])


def timeout_sweep(params: dict) -> float:
    """Startup allowance, then per point (a loader started per size) its budget twice and slack."""
    return STARTUP_ALLOWANCE_S + len(params["sizes"]) * 2 * (15 + 2 * (params["budget_s"] + params["warmup_s"]))


def cpu_text(results: dict, name: str, workers: int, item_bytes: int) -> str:
    """The trainer's CPU microseconds per item of one point, or ``-``."""
    point = point_at(results, name, workers, item_bytes) or {}
    return f"{point['cpu_us_per_item']:,.0f}" if point.get("cpu_us_per_item") is not None else "-"


def report_sweep(scenario: Scenario, params: dict, results: dict) -> str:
    """One row per item size: every contender's GB/s, the paired ratios, the trainer's CPU per item."""
    columns = [(name, w) for name, w in COLUMNS if name in results]
    ratios = [(name, w, ref) for name, w, ref in RATIOS if name in results and ref in results]
    ceilings = [(name, w, ref) for name, w, ref in CEILINGS
                if all(n in results for n in (name, ref, *PER_ITEM_LIMITS))]
    pipelines = [(name, w, ref) for name, w, ref in CEILINGS
                 if all(n in results for n in (name, ref, PIPELINE_LIMITS[ref]))]
    rows = []
    for size in params["sizes"]:
        rates = []
        for name, workers in columns:
            point = point_at(results, name, workers, size)
            rates.append(f"{point['bytes_per_s'] / GB:.3g}" if point and point.get("bytes_per_s") else "-")
        paired = [paired_ratio_at(results, name, w, ref, 2, size) for name, w, ref in ratios]
        cpu = [cpu_text(results, name, w, size) for name, w in (("RPCRS-tcp", 1), ("raw-socket", 1),
                                                              ("RPCRS-local", 2), ("raw-unix", 1))]
        bounded = [ceiling_at(results, name, w, ref, size) for name, w, ref in ceilings]
        bounded += [ceiling_at(results, name, w, ref, size, (PIPELINE_LIMITS[ref],))
                    for name, w, ref in pipelines]
        rows.append([fmt_size(size)] + rates + [fmt_ratio(p and p["median"]) for p in paired]
                    + [f"{fmt_ratio(c['median'])} {c['binding'].split('-')[0]}" if c else "-" for c in bounded]
                    + [" / ".join(cpu)])
    short = {"RPCRS-tcp": "tcp", "RPCRS-local": "local", "torch-DataLoader": "DataLoader"}
    headers = (["item size"] + [name if name in ONE_STREAM else f"{short.get(name, name)} W={w}"
                                for name, w in columns]
               + [f"{short[name]}{w}/{short.get(ref, ref)}" for name, w, ref in ratios]
               + [f"{short[name]}{w}/ceiling" for name, w, _ in ceilings]
               + [f"{short[name]}{w}/pipeline" for name, w, _ in pipelines]
               + ["CPU us/item: tcp1 / raw-socket / local2 / raw-unix"])
    failed = [f"{name}: n/a ({outcome.get('reason', '?')[:120]})" for name, outcome in results.items()
              if not outcome.get("ok")]
    errors = sorted({f"{name} at {fmt_size(p['item_bytes'])} W={p['workers']}: {p['error'][:120]}"
                     for name, outcome in results.items() if outcome.get("ok")
                     for p in outcome["data"]["points"] if "error" in p})
    rounds = (f"rate: the best of {params['rounds_of_all']} rounds ({params['rounds']} for {', '.join(params['paired'])}); "
              "ratios: the median of the per-round ratios (paired), each contender next to its reference in a round"
              if params.get("rounds", 1) > 1 else "one round")
    title = (f"== {scenario.name}: GB/s by item size, fresh torch.uint8 tensors made in the workers "
             f"(W = workers; raw-* one stream) ==")
    return render_table(title, headers, rows, notes=[
        "GB = 1e9 bytes; every item a fresh tensor with every byte written (workloads.make_tensor), the raw "
        "senders' too; first and last byte of every item read; ratios vs MPRS and DataLoader at W=2",
        f"epoch per size: {params['epoch_bytes'] // MIB} MiB of items ({params['min_items']:,} to "
        f"{params['max_items']:,} items), stopped after {params['budget_s']:g} s of timed items; MPRS runs its "
        f"epochs to the end: at most {params['mprs_epoch_bytes'] // MIB} MiB and {MPRS_MAX_ITEMS:,} items",
        f"a new loader per size (its start is not timed: rates count from {params['warmup_s']:g} s after its "
        "first item, or from the middle of a shorter epoch), after an untimed short epoch per contender and W",
        "graph-limit W: ONE process iterating worker 0's part of the same DataPipe graph (torch's sharding for "
        "W workers and per-item hooks, the same make_tensor), nothing encoded or moved, each item counted W times: "
        "W workers each as fast as one alone; loader-limit: DataLoader2 (no reading service) over items made "
        "before, each copied into one of 4 reused buffers and handed on as a fresh tensor (torch.frombuffer)",
        "pipeline-limit[-unix] W: W processes iterating their part of the same graph as workers do and "
        "sending each tensor's bytes over TCP [a Unix socket] to a DataLoader2 (no reading service) that "
        "receives each into one of 4 reused buffers and hands it on as a fresh tensor: graph, move and loader"
        " at once, nothing encoded, framed or credited; x/pipeline: the reading service over its stream's "
        "pipeline-limit at its W (paired, per round), 'raw' where the raw stream is lower; not a bound "
        "(batched sends and shared memory can pass it)",
        "x/ceiling: the reading service over the lowest of its raw stream, graph-limit at its W and loader-limit "
        "(paired, per round), and which of them is the lowest (raw, graph, loader): the most any DataLoader2 "
        "reading service could deliver here",
        "copy-limit W: W processes making their share of the items as workers do and copying each once into the "
        "next of 4 warm shared segments, nothing moved: what making and copying each item once costs local "
        "workers (their default hand-over), with nothing else paid",
        "CPU us/item: the trainer process's CPU time (all its threads) per item over the timed part",
        rounds] + failed + errors)


SCENARIOS = [Scenario("sweep", CONTENDER_NAMES, plan_sweep, measure_sweep, report_sweep, timeout_sweep)]
