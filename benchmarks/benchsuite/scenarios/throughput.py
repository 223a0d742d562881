"""Throughput: tiny items (items/s) and 1 / 8 MiB tensors (GB/s), per worker count."""

from __future__ import annotations

import dataclasses
from typing import Callable

from workloads import ITEMS_IN_FLIGHT, MIB, Workload

from benchsuite.contenders import CONTENDERS, ONE_STREAM
from benchsuite.contenders.base import Contender
from benchsuite.measure import drain
from benchsuite.report.format import (
    GB,
    budget_note,
    fmt_num,
    fmt_ratio,
    paired_ratio,
    paired_text,
    point_at,
    point_rows,
    point_value,
    points_of,
    ratio,
    render_table,
    rounds_notes,
    rounds_text,
)
from benchsuite.scenarios.base import (
    DATALOADERS,
    ROUNDS,
    Scenario,
    measure_points,
    timeout_budgeted,
    worker_counts,
)

SLOW_ON_TINY_ITEMS = ("MPRS", "RPCDataloader")  # ~1-2k items/s: capped so they finish in seconds


def plan_tiny(quick: bool) -> dict:
    """Small ints at W=2; the slow contenders' epochs capped so that they finish in seconds."""
    n, cap = (20_000, 600) if quick else (150_000, 3_000)
    return {"workload": Workload("ints", n).to_dict(), "workers": 2, "budget_s": 0.5 if quick else 3.0,
            "item_caps": {name: cap for name in SLOW_ON_TINY_ITEMS},
            "rounds": 1 if quick else ROUNDS, "rate_key": "items_per_s"}


SAME_W_REFERENCES = ("production-limit", "MPRS", "torch-DataLoader", "RPCDataloader")
#: Local workers whose graph makes its items in shared memory, and the limit of the same code (W=2 only).
MADE_IN_SHARED_MEMORY = ("production-limit-shm", "RPCRS-local-shm")
#: The limits that make their items at memory speed and move nothing.
AT_MEMORY_SPEED = ("production-limit", "production-limit-shm", "copy-limit")


#: The ratio rows of the tensor tables that their notes and the targets quote, paired round by
#: round (``report.format.paired_ratio``): (contender, W, reference).
PAIRS = (("RPCRS-tcp", 1, "raw-socket"), ("RPCRS-tcp", 2, "raw-socket"), ("RPCRS-local", 1, "raw-unix"),
         ("RPCRS-local", 1, "production-limit"), ("RPCRS-local", 2, "production-limit"),
         ("RPCRS-local", 2, "copy-limit"), ("RPCRS-local-shm", 2, "production-limit-shm"))
#: The contenders of those rows, in the order a round runs them (after the others): each next to
#: the reference it is compared with (RPCRS-local between its two limits, raw-unix one further).
PAIRED_ORDER = ("raw-socket", "RPCRS-tcp", "raw-unix", "copy-limit", "RPCRS-local", "production-limit",
                "production-limit-shm", "RPCRS-local-shm")
#: Rounds of the paired contenders in a full run (the others run ``ROUNDS``): a median of three
#: per-round ratios, so that one disturbed round does not decide it (~15 s a round more).
PAIRED_ROUNDS = 3

#: Times the base tensor epoch's items that the contenders which stop at the time budget run
#: (``--quick``: the production limits only). The production limits make items at memory
#: speed (a base epoch lasts ~50 ms), and a reading service's first few dozen items carry its
#: start-up (connections, segments made and mapped): a short epoch would measure mostly that.
LONG_EPOCH_SCALE = 8


def plan_tensor(mib: int) -> Callable[[bool], dict]:
    """Bandwidth: the reading services at W=1 and W=2 (``--quick``: W=2 only).  W=1 is one
    stream, as the raw socket limit; W=2 puts three busy processes (trainer + 2 workers)
    on a 2-core box."""
    def plan(quick: bool) -> dict:
        total = (256 if quick else 768) * MIB
        # Full run: every contender that can stop at the time budget runs the production limit's
        # epoch (LONG_EPOCH_SCALE x the items), so that no rate is mostly its start-up; MPRS
        # runs its epochs to the end (see MPRS), so it keeps a short one.
        scaled = AT_MEMORY_SPEED if quick else tuple(
            name for name, contender in CONTENDERS.items() if contender.stops_early_cleanly)
        both = [2] if quick else [1, 2]  # a smoke run: one point per contender
        return {"workload": Workload("tensor", total // (mib * MIB), item_bytes=mib * MIB).to_dict(),
                "workers": [2],  # RPCRS-torch_rpc: one point, at the default W
                "workers_by_contender": {**{name: [1] for name in ONE_STREAM},
                                         **{name: both for name in ("production-limit", "copy-limit", "MPRS",
                                                                    "torch-DataLoader", "RPCRS-local",
                                                                    "RPCRS-tcp", "RPCDataloader")},
                                         **{name: [2] for name in MADE_IN_SHARED_MEMORY}},
                # MPRS runs its epochs to the end (see MPRS): ~0.3-0.7 GB/s here, so a shorter one
                "item_caps": {"MPRS": total // 2 // (mib * MIB)},
                "epoch_scales": {name: LONG_EPOCH_SCALE for name in scaled},
                "budget_s": 0.5 if quick else 1.0, "rounds": 1 if quick else PAIRED_ROUNDS,
                "rounds_of_all": 1 if quick else ROUNDS, "paired": list(PAIRED_ORDER),
                "round_order": list(PAIRED_ORDER), "rate_key": "bytes_per_s"}
    return plan


def measure_throughput(contender: Contender, params: dict, emit: Callable[[dict], None]) -> dict:
    """One epoch of ``params['workload']`` per worker count of the contender
    (:func:`worker_counts`); one point per count.

    A contender in ``params['item_caps']`` runs a shorter epoch: slow ones finish in
    seconds, and MPRS must run its epochs to their end (see :class:`MPRS`).  One in
    ``params['epoch_scales']`` runs a longer one (that many times the items).
    """
    workload = Workload.from_dict(params["workload"])
    cap = params.get("item_caps", {}).get(contender.name)
    if cap:
        workload = dataclasses.replace(workload, n_items=min(cap, workload.n_items))
    scale = params.get("epoch_scales", {}).get(contender.name)
    if scale:
        workload = dataclasses.replace(workload, n_items=scale * workload.n_items)
    counts = worker_counts(params, contender.name)
    if params.get("descending_workers"):  # a reversed round (see runner.round_order)
        counts = counts[::-1]
    return measure_points(counts, lambda workers: drain(contender, workload, workers, params["budget_s"]), emit)


def report_tiny(scenario: Scenario, params: dict, results: dict) -> str:
    """The tiny table: items/s, vs MPRS and torch's DataLoader at the same W, vs in-process."""
    w = Workload.from_dict(params["workload"])
    base = point_value(results, "in-process", "items_per_s", 1)

    def cells(name: str, d: dict) -> list:
        same_w = [point_value(results, ref, "items_per_s", d["workers"])
                  for ref in ("MPRS", "torch-DataLoader")]
        return ([f"{d['items']:,}", fmt_num(d["steady_s"], ".2f", " s"), fmt_num(d["items_per_s"], ",.0f"),
                 rounds_text(d, 1, ",.0f")] + [fmt_ratio(ratio(d["items_per_s"], ref)) for ref in same_w]
                + [fmt_ratio(ratio(d["items_per_s"], base)), budget_note(d)])

    title = (f"== tiny: up to {w.n_items:,} small ints, IterableWrapper(range(N)).sharding_filter(), "
             f"W = {params['workers']} workers ==")
    caps = params.get("item_caps") or {}
    notes = ["vs MPRS, vs DataLoader (torch.utils.data.DataLoader): at the same W"] + rounds_notes(params)
    if caps:
        notes.append(f"{', '.join(caps)}: epoch capped at {min(caps.values()):,} items "
                     "(rate from what they did)")
    headers = ["contender", "items", "time", "items/s", "rounds", "vs MPRS", "vs DataLoader", "vs in-process",
               "note"]
    return render_table(title, headers, point_rows(results, cells), notes=notes)


def epoch_note(params: dict, workload: Workload) -> str:
    """What a tensor table says about the lengths of its epochs."""
    scales = params.get("epoch_scales") or {}
    if not scales:
        return f"every epoch: {workload.n_items:,} items"
    scale = max(scales.values())
    who = ("every contender that can stop at the time budget (MPRS cannot: its cap below)"
           if set(scales) - set(AT_MEMORY_SPEED) else ", ".join(scales))
    return (f"epoch length: {who} runs {scale} x {workload.n_items:,} = {scale * workload.n_items:,} items "
            f"and stops after {params['budget_s']:g} s of items, so that no rate is mostly start-up")


def report_tensor(scenario: Scenario, params: dict, results: dict) -> str:
    """A tensor table: GB/s, vs the raw limits, vs the production limit and the others at the same W."""
    w = Workload.from_dict(params["workload"])
    raw = {ref: point_at(results, ref, 1) for ref in ("raw-socket", "raw-unix")}

    def cells(name: str, d: dict) -> list:
        rate = d["bytes_per_s"]
        references = [CONTENDERS[name].production_limit, *SAME_W_REFERENCES[1:]]
        same_w = [point_at(results, ref, d["workers"]) for ref in references]
        ratios = [paired_ratio(d, ref, "bytes_per_s") for ref in list(raw.values()) + same_w]
        return ([f"{d['items']:,}", fmt_num(d["bytes"] / GB, ".2f", " GB"),
                 fmt_num(rate / GB if rate else None, ".2f", " GB/s"), rounds_text(d, GB, ".2f")]
                + [fmt_ratio(r and r["median"]) for r in ratios] + [budget_note(d)])

    counts = sorted({p["workers"] for name in results if name not in ONE_STREAM
                     for p in points_of(results, name)})
    longest = w.n_items * max((params.get("epoch_scales") or {}).values(), default=1)
    title = (f"== {scenario.name}: up to {longest:,} x {w.item_bytes // MIB} MiB torch.uint8 tensors made in the "
             f"workers, W = {' and '.join(map(str, counts))} workers ==")
    headers = ["contender", "items", "moved", "rate", "rounds", "vs raw-socket", "vs raw-unix",
               "vs prod. limit", "vs MPRS", "vs DataLoader", "vs RPCDataloader", "note"]
    return render_table(title, headers, point_rows(results, cells), notes=[
        "GB = 1e9 bytes; every item a fresh tensor with every byte written (workloads.make_tensor), made the "
        "same way by every contender; first and last byte of every item read",
        "vs prod. limit (production-limit), MPRS, DataLoader (torch.utils.data.DataLoader), RPCDataloader: "
        "at the same W",
        "production-limit: W processes that only make the items, nothing moved "
        "(the ceiling for local workers), each item kept alive while the next "
        f"{ITEMS_IN_FLIGHT} are made (as a hand-over holds it: no cache-hot reused buffer)",
        epoch_note(params, w),
        "raw-socket: one TCP stream over loopback; raw-unix: one Unix socket stream "
        "(RPCRS-local talks to its local server over a Unix socket, RPCRS-tcp over TCP to one worker server)",
        "raw-*: the sender makes every item as the workers do; the receiver recv_into's one reused "
        "buffer (a 1 MiB one stays in the CPU cache); the reading "
        "services hand a fresh buffer to the consumer for every item",
        "W=1 is one stream, like the raw limits; "
        "at W=2 three busy processes (trainer + 2 workers) share 2 cores",
        "in-process moves nothing: it is the cost of making the items in one process",
        "RPCRS-local-shm: RPCRS-local with the items made by rpc_reading_service.shared_empty in the "
        "session's shared segments (workloads.make_tensor_in_shared_memory: the same fill), handed over "
        "with no copy; its vs prod. limit is production-limit-shm, the same code outside a session "
        "(ordinary memory)"]
        + (["copy-limit: production-limit's processes, each copying every item it makes once into the next of "
            f"{ITEMS_IN_FLIGHT} warm shared segments (made untimed) and letting it go once it made the next (a "
            "worker's DataPipe graph holds its last item that long), nothing moved: the ceiling for RPCRS-local, "
            "whose workers make that one copy"] if "copy-limit" in results else [])
        + rounds_notes(params)
        + [f"{', '.join(caps)}: epoch capped at {min(caps.values()):,} items (runs its epochs to the end)"
           for caps in [params.get("item_caps") or {}] if caps]) + paired_table(scenario, results)


def paired_table(scenario: Scenario, results: dict) -> str:
    """The ratio rows of :data:`PAIRS` measured in this run, each with every round's ratio
    (the table above prints their medians), or '' when none was."""
    rows = []
    for name, workers, reference in PAIRS:
        paired = paired_ratio(point_at(results, name, workers), point_at(results, reference, workers),
                              "bytes_per_s")
        if paired is not None:
            ours, theirs = paired["rates"]
            rows.append([f"{name} W={workers} / {reference}", fmt_ratio(paired["median"]), str(len(paired["ratios"])),
                         paired_text(paired), f"{ours / GB:.2f} vs {theirs / GB:.2f} GB/s"])
    if not rows:
        return ""
    return "\n\n" + render_table(
        f"== {scenario.name}: paired ratios (median of the rounds that measured both) ==",
        ["ratio", "median", "rounds", "each round's ratio", "detail"], rows,
        notes=["each round's ratio: that round's rate of the first over the second's; * where the first ran "
               "first in that round (they alternate)", "detail: the two rates of the round nearest the median"])


TENSOR_CONTENDERS = (("raw-socket", "raw-unix", "production-limit") + DATALOADERS
                     + ("RPCRS-torch_rpc", "RPCDataloader"))
SCENARIOS = [
    Scenario("tiny", DATALOADERS + ("RPCRS-torch_rpc", "RPCDataloader"), plan_tiny,
             measure_throughput, report_tiny, timeout_budgeted),
    Scenario("tensor1m", TENSOR_CONTENDERS, plan_tensor(1), measure_throughput, report_tensor,
             timeout_budgeted),
    Scenario("tensor8m", TENSOR_CONTENDERS + MADE_IN_SHARED_MEMORY + ("copy-limit",), plan_tensor(8), measure_throughput, report_tensor,
             timeout_budgeted),
]
