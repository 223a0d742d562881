"""benchmarks/bench.py --quick end to end: every contender gets its row, the files are written,
and nothing the benchmark started outlives it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _server_helpers import reap, session_members, wait_until

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

from benchsuite.contenders import CONTENDERS, QUICK_SKIPS  # noqa: E402
from benchsuite.scenarios import SCENARIOS  # noqa: E402

# the scenario nearly every contender takes part in (the others have scenarios of their own)
SCENARIO = "tensor8m"


def test_every_contender_takes_part_in_a_scenario():
    assert set(CONTENDERS) == {name for scenario in SCENARIOS.values() for name in scenario.contenders}


def test_copy_limit_keeps_its_last_item_until_the_next_as_a_graph_does():
    # A worker's DataPipe graph holds its last output until it makes the next (torch's iterator
    # hook), so its next item never gets the same cache-hot buffer: neither may copy-limit's.
    import weakref

    import numpy
    from workloads import SegmentRing, make_array

    ring = SegmentRing(4096)
    first = make_array(1, 4096)
    ref = weakref.ref(first)
    ring.append(first)
    del first
    assert ref() is not None
    ring.append(make_array(2, 4096))
    assert ref() is None
    assert int(numpy.frombuffer(ring._segments[1], dtype=numpy.uint8)[-1]) == 2


def table_of(output: str, scenario: str) -> str:
    """The text of one scenario's table in the benchmark's output."""
    match = re.search(rf"^== {scenario}\b.*?(?=\n\n|\Z)", output, re.M | re.S)
    assert match, f"no {scenario} table in:\n{output}"
    return match.group(0)


def run_bench(tmp_path: Path, arguments: list[str], timeout: float, script: str = "bench.py",
              exit_codes: tuple = (0,)) -> str:
    """Run ``script`` (bench.py) with ``arguments`` in ``tmp_path``; its stdout, once it exited with
    one of ``exit_codes`` and left nothing running."""
    command = [sys.executable, str(BENCH_DIR / script), *arguments]
    pythonpath = os.pathsep.join([str(BENCH_DIR.parent), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=pythonpath)
    with open(tmp_path / "stdout.txt", "wb") as stdout, open(tmp_path / "stderr.txt", "wb") as stderr:
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(tmp_path), start_new_session=True)
    try:
        proc.wait(timeout=timeout)
        assert wait_until(lambda: not session_members(proc.pid), timeout=5), \
            f"left running: {session_members(proc.pid)}"
    finally:
        reap(proc)
    output = (tmp_path / "stdout.txt").read_text()
    assert proc.returncode in exit_codes, output + (tmp_path / "stderr.txt").read_text()
    return output


@pytest.mark.timeout(90)
def test_quick_run_prints_a_row_for_every_contender(tmp_path):
    """--quick --only tensor8m: a row per contender (numbers for all but the skipped or
    uninstalled ones), the targets, JSON, RESULTS.md quoting both tables, a figure; no leftovers."""
    results_json, results_md, plot = (tmp_path / f for f in ("results.json", "RESULTS.md", "results.png"))
    output = run_bench(tmp_path, ["--quick", "--only", SCENARIO, "--json", str(results_json),
                                  "--results-md", str(results_md), "--plot", str(plot)], timeout=80)

    table = table_of(output, SCENARIO)
    rows = {line.split()[0]: line for line in table.splitlines()[3:]  # after title, header, dashes
            if line.strip() and not line.startswith("  ")}  # notes are indented
    assert set(rows) == set(SCENARIOS[SCENARIO].contenders), table
    may_be_missing = set(QUICK_SKIPS)
    try:
        import rpcdataloader  # noqa: F401
    except ImportError:
        may_be_missing.add("RPCDataloader")
    failed = {name: row for name, row in rows.items() if "n/a" in row and name not in may_be_missing}
    assert not failed, table

    targets = table_of(output, "targets")
    assert "tensor8m: RPCRS-local W=2 >= 0.6x production-limit W=2" in targets
    document = json.loads(results_json.read_text())
    assert set(document["results"][SCENARIO]["contenders"]) == set(SCENARIOS[SCENARIO].contenders)
    markdown = results_md.read_text()
    assert table in markdown and targets in markdown
    assert "[LINKS.md](LINKS.md)" in markdown  # bench_links.py's own file, kept across regenerations
    for row in document["targets"]:
        assert row["goal"] in markdown
    local = [row for row in document["targets"] if row["goal"].startswith("tensor8m: RPCRS-local") and row["measured"]]
    for row in local:  # the prose quotes the targets table's numbers
        assert row["detail"].partition(" vs ")[2] in markdown.split("## Printed tables")[0]
    if importlib.util.find_spec("matplotlib") is None:  # the bench extra; `make test` does not install it
        assert "matplotlib is not installed, no figure written" in output
    else:
        assert plot.stat().st_size > 0


def test_the_prose_quotes_the_targets_rows():
    from benchsuite.report.results_md import local_workers_paragraph

    rows = [
        {"goal": "tensor8m: RPCRS-local W=2 >= 0.6x production-limit W=2", "measured": 0.4123,
         "detail": "5.10 GB/s vs 12.37 GB/s"},
        {"goal": "tensor8m: RPCRS-local W=2 >= 4x MPRS W=2", "measured": 6.07, "detail": "5.10 GB/s vs 0.84 GB/s"},
        {"goal": "tensor8m: RPCRS-tcp W=1 >= 0.85x raw-socket (both one stream)", "measured": 0.9158,
         "detail": "1.85 GB/s vs 2.02 GB/s"},
        {"goal": "tensor8m: RPCRS-local W=2 >= 3x torch-DataLoader W=2", "measured": None, "detail": "not run"},
        {"goal": "tensor8m: RPCRS-local-shm W=2 >= 0.6x production-limit-shm W=2 (items made with shared_empty)",
         "measured": 0.7312, "detail": "9.02 GB/s vs 12.34 GB/s"},
    ]
    paragraph = local_workers_paragraph(rows)
    assert "delivered 5.10 GB/s in this run: 0.41x the production limit (12.37 GB/s), 6.07x MPRS (0.84 GB/s)." in paragraph
    assert "One worker over TCP delivered 1.85 GB/s, 0.92x the raw TCP stream" in paragraph
    assert "shared_empty (no copy at all) delivered 9.02 GB/s, 0.73x the production limit of the same code (12.34 GB/s)" in paragraph
    assert "DataLoader" not in paragraph
    assert local_workers_paragraph([]) is None


def test_tensor_ratios_pair_the_rounds_that_measured_both():
    from benchsuite.report.targets import ratio_at
    from benchsuite.runner import best_of_rounds, round_order
    from benchsuite.scenarios.throughput import PAIRED_ORDER

    params = SCENARIOS["tensor8m"].plan(False)
    names = list(SCENARIOS["tensor8m"].contenders)
    orders = [round_order(names, params, r) for r in range(params["rounds"])]
    assert orders[1] == orders[0][::-1] and set(orders[2]) == set(PAIRED_ORDER)  # extra rounds: paired ones only
    for order in orders:  # each contender of a target ratio runs right next to its reference
        for ours, reference in (("RPCRS-tcp", "raw-socket"), ("RPCRS-local", "production-limit"),
                                ("RPCRS-local-shm", "production-limit-shm")):
            assert abs(order.index(ours) - order.index(reference)) == 1

    def outcome(name, rates):  # one outcome per round; round 1 is the reversed one
        return best_of_rounds([{"ok": True, "round": r, "position": orders[r].index(name),
                                "data": {"points": [{"workers": 1, "items": 200, "bytes": 1.6e9, "bytes_per_s": rate and rate * 1e9}]}}
                               for r, rate in enumerate(rates)], "bytes_per_s")

    # the reference's best round (a quiet moment) pairs with ours at a busy one: best/best says 0.75x,
    # the rounds say ours keeps up (0.95, 1.0, 1.05)
    results = {"tensor8m": {"params": params, "contenders": {
        "raw-socket": outcome("raw-socket", [2.0, 1.6, 2.0]), "RPCRS-tcp": outcome("RPCRS-tcp", [1.9, 1.6, 2.1])}}}
    value, detail = ratio_at("tensor8m", "bytes_per_s", ("RPCRS-tcp", 1), ("raw-socket", 1))(results)
    assert value == pytest.approx(1.0)
    assert detail == ("1.60 GB/s vs 1.60 GB/s; median of 3 paired rounds (rates: the one nearest it), "
                      "each round: 0.95 / 1.00* / 1.05")  # * : RPCRS-tcp ran first (the reversed round)
    results["tensor8m"]["contenders"]["RPCRS-tcp"] = outcome("RPCRS-tcp", [1.9, None, 2.1])  # a failed round
    value, detail = ratio_at("tensor8m", "bytes_per_s", ("RPCRS-tcp", 1), ("raw-socket", 1))(results)
    assert value == pytest.approx(1.0) and "median of 2 paired rounds" in detail
    table = SCENARIOS["tensor8m"].report(SCENARIOS["tensor8m"], params, results["tensor8m"]["contenders"])
    assert re.search(r"RPCRS-tcp W=1 / raw-socket\s+1\.00x\s+2\s+0\.95 / 1\.05", table), table


@pytest.mark.timeout(60)
def test_the_sweep_runs_alone_at_the_sizes_asked(tmp_path):
    """--only sweep --sizes: a row for the size with both contenders' rates and their ratio, the
    sweep's target judged, the point in the JSON; no leftovers."""
    results_json = tmp_path / "results.json"
    output = run_bench(tmp_path, ["--quick", "--only", "sweep", "--sizes", "256K", "--only", "raw-unix",
                                  "--only", "RPCRS-local", "--only", "graph-limit", "--only", "loader-limit",
                                  "--json", str(results_json)], timeout=50)
    table = table_of(output, "sweep")
    rows = {line.split("  ")[0].strip(): line.split() for line in table.splitlines()[3:] if line[:1].isdigit()}
    assert set(rows) == {"256 KiB"}, table
    # size (two words), raw-unix, graph-limit W=1 and W=2, loader-limit, local W=2, local2/raw-unix,
    # local2/ceiling and the limit that sets it, CPU per item
    for cells in rows.values():
        assert all(float(cell) > 0 for cell in cells[2:7]) and cells[7].endswith("x"), table
        assert cells[8].endswith("x") and cells[9] in ("raw", "graph", "loader"), table
    targets = table_of(output, "targets")
    assert re.search(r"sweep: RPCRS-local W=2 >= 1.0x raw-unix at every size \(the worst size\)\s+\S+x\s+1.0x\s+"
                     r"(PASS|MISS)\s+worst at 256 KiB", targets), targets
    assert re.search(r"sweep: RPCRS-local W=2 / ceiling at every size: the lowest of raw-unix, graph-limit W=2, "
                     r"loader-limit \(the worst size\)\s+\S+x\s+-\s+info\s+worst at 256 KiB: .* each size, ours / "
                     r"ceiling \(ceiling / raw-unix, the limit that sets it\): 256 KiB \S+x \(\S+x, "
                     r"(raw-unix|graph-limit|loader-limit)\)", targets), targets
    contenders = json.loads(results_json.read_text())["results"]["sweep"]["contenders"]
    assert [p["item_bytes"] for p in contenders["RPCRS-local"]["data"]["points"]] == [256 * 1024]
    assert [p["workers"] for p in contenders["graph-limit"]["data"]["points"]] == [1, 2]


def test_sweep_targets_judge_the_worst_size_in_their_range():
    from benchsuite.report.targets import TARGETS, evaluate_targets

    sizes = [1024, 64 * 1024, 1 << 20]
    rates = {"raw-socket": [1.0, 2.0, 2.0], "RPCRS-tcp": [0.75, 1.9, 1.6]}  # GB/s by size
    results = {"sweep": {"params": SCENARIOS["sweep"].plan(True) | {"sizes": sizes}, "contenders": {
        name: {"ok": True, "data": {"points": [{"workers": 1, "item_bytes": size, "bytes_per_s": rate * 1e9}
                                               for size, rate in zip(sizes, by_size)]}}
        for name, by_size in rates.items()}}}
    rows = {row["goal"]: row for row in evaluate_targets(results)}
    large = rows["sweep: RPCRS-tcp W=1 >= 0.85x raw-socket at every size from 64 KiB up (the worst size)"]
    assert large["status"] == "MISS" and large["measured"] == pytest.approx(0.8)
    assert large["detail"].startswith("worst at 1 MiB: 1.60 GB/s vs 2.00 GB/s; each size: 64 KiB 0.95x, 1 MiB 0.80x")
    small = rows["sweep: RPCRS-tcp W=1 >= 0.7x raw-socket at every size below 64 KiB (the worst size)"]
    assert small["status"] == "PASS" and small["measured"] == pytest.approx(0.75)
    assert rows["sweep: RPCRS-local W=2 >= 3x MPRS W=2 at every size (the worst size)"]["status"] == "n/a"
    del results["sweep"]["contenders"]["raw-socket"]["data"]["points"][1]  # 64 KiB not measured
    rows = {row["goal"]: row for row in evaluate_targets(results)}
    assert rows[large["goal"]]["status"] == "MISS"  # the sizes measured miss already
    results["sweep"]["contenders"]["RPCRS-tcp"]["data"]["points"][2]["bytes_per_s"] = 1.9e9
    row = {row["goal"]: row for row in evaluate_targets(results)}[large["goal"]]
    assert row["status"] == "n/a" and row["detail"].endswith("not measured at 64 KiB")  # no "every size" from one
    judged = [t for t in TARGETS if t.goal.startswith("sweep:") and t.threshold is not None]
    assert sum(row["goal"].startswith("sweep:") for row in rows.values()) == sum(
        t.goal.startswith("sweep:") for t in TARGETS) == len(judged) + 7 == 12  # two per raw target, one by MPRS's


def test_the_sweeps_copy_limit_row_names_the_sizes_where_the_copy_alone_misses_the_target():
    """Beside the target against MPRS: ours over copy-limit at each size, and copy-limit over MPRS,
    with the sizes where that is under the target's ratio."""
    from benchsuite.report.targets import evaluate_targets

    sizes = [1 << 20, 64 << 20]
    rates = {"RPCRS-local": [7.0, 6.0], "copy-limit": [17.5, 6.0], "MPRS": [0.7, 3.0]}  # GB/s by size
    results = {"sweep": {"params": SCENARIOS["sweep"].plan(True) | {"sizes": sizes}, "contenders": {
        name: {"ok": True, "data": {"points": [{"workers": 2, "item_bytes": size, "bytes_per_s": rate * 1e9}
                                               for size, rate in zip(sizes, by_size)]}}
        for name, by_size in rates.items()}}}
    rows = [row for row in evaluate_targets(results) if row["goal"].startswith("sweep: RPCRS-local W=2 / copy-limit")]
    assert len(rows) == 1 and rows[0]["status"] == "info" and rows[0]["measured"] == pytest.approx(0.4)
    assert rows[0]["detail"] == (
        "worst at 1 MiB: 7.00 GB/s vs 17.50 GB/s; each size, ours / copy-limit (copy-limit / MPRS): "
        "1 MiB 0.40x (25.0x), 64 MiB 1.00x (2.00x); copy-limit itself under 3x MPRS at 64 MiB")
    results["sweep"]["contenders"]["copy-limit"]["data"]["points"][1]["bytes_per_s"] = 9e9  # 3x MPRS
    row = [row for row in evaluate_targets(results) if row["goal"] == rows[0]["goal"]][0]
    assert "under 3x" not in row["detail"] and row["detail"].endswith("64 MiB 0.67x (3.00x)")


def test_the_sweeps_per_item_limits_run_each_item_made_fresh():
    """graph-limit counts each item its one process makes W times (the epoch's items, no more);
    loader-limit hands on a fresh tensor per item, rebuilt from bytes made before."""
    from benchsuite.contenders.limits import GraphLimit, LoaderLimit
    from benchsuite.measure import drain
    from workloads import Workload, fill_value

    for workers in (1, 2):
        data = drain(GraphLimit(), Workload("tensor", 301, item_bytes=1024), workers, budget_s=30.0)
        assert data["items"] == 301 and not data["stopped_by_budget"] and data["bytes_per_s"] > 0, data
    workload = Workload("tensor", 9, item_bytes=64 * 1024)
    with LoaderLimit().epoch(workload, 1) as loader:
        items = list(loader)
    assert [int(item[-1]) for item in items] == [fill_value(index % 4) for index in range(9)]
    assert len({id(item) for item in items}) == 9 and all(item.numel() == 64 * 1024 for item in items)
    assert drain(LoaderLimit(), workload, 1, budget_s=30.0)["items"] == 9


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, workers", [("pipeline-limit", 1), ("pipeline-limit-unix", 2)])
def test_the_pipeline_limit_hands_on_every_item_its_senders_graphs_made(name, workers, monkeypatch):
    """pipeline-limit[-unix]: W sender processes, each iterating its part of the workload's graph,
    and a DataLoader2 that hands on every item in the order torch's sharding dealt them, each a
    fresh tensor of the bytes its sender made; an epoch left early stops its senders."""
    from benchsuite.measure import drain
    from workloads import Workload, fill_value

    paths = [str(BENCH_DIR.parent), str(BENCH_DIR), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path for path in paths if path))  # as bench.py sets

    contender = CONTENDERS[name]()
    workload = Workload("tensor", 9, item_bytes=64 * 1024)
    with contender.epoch(workload, workers) as loader:  # each read before the next (4 buffers go round)
        seen = [(int(item[0]), int(item[-1]), item.numel()) for item in loader]
    assert seen == [(fill_value(i), fill_value(i), 64 * 1024) for i in range(9)]
    data = drain(contender, Workload("tensor", 200_000, item_bytes=16 * 1024), workers, budget_s=0.3)
    assert data["stopped_by_budget"] and data["bytes_per_s"] > 0, data


def test_sweep_pipeline_rows_set_each_size_beside_the_same_graph_and_loader_on_a_plain_socket():
    """The second info row beside a sweep target: per size, ours over its stream's pipeline limit at
    the same W (paired, the median of the rounds), and that limit over the raw stream."""
    from benchsuite.report.targets import evaluate_targets

    sizes = [1024, 64 * 1024]
    rates = {  # GB/s by size, three paired rounds each
        "raw-socket": [[0.25, 0.25, 0.25], [3.0, 3.0, 3.0]],
        "pipeline-limit": [[0.1, 0.125, 0.1], [2.0, 2.4, 2.0]],
        "RPCRS-tcp": [[0.05, 0.1, 0.08], [1.0, 1.2, 1.5]],
    }
    results = {"sweep": {"params": SCENARIOS["sweep"].plan(True) | {"sizes": sizes}, "contenders": {
        name: {"ok": True, "data": {"points": [
            {"workers": 1, "item_bytes": size, "bytes_per_s": max(r) * 1e9,
             "round_rates": [x * 1e9 for x in r]}
            for size, r in zip(sizes, by_size)]}} for name, by_size in rates.items()}}}
    rows = {row["goal"]: row for row in evaluate_targets(results)}
    small = rows["sweep: RPCRS-tcp W=1 / pipeline-limit W=1 below 64 KiB (the worst size)"]
    # 1 KiB rounds: 0.5, 0.8, 0.8: median 0.8 (the first such round); the limit 0.125 / 0.25 of raw
    assert small["status"] == "info" and small["measured"] == pytest.approx(0.8), small
    assert small["detail"] == ("worst at 1 KiB: 0.10 GB/s vs 0.12 GB/s (pipeline-limit); each size, ours / "
                               "ceiling (ceiling / raw-socket, the limit that sets it): 1 KiB 0.80x (0.50x, "
                               "pipeline-limit)")
    large = rows["sweep: RPCRS-tcp W=1 / pipeline-limit W=1 from 64 KiB up (the worst size)"]
    assert large["measured"] == pytest.approx(0.5)
    assert large["detail"].endswith("64 KiB 0.50x (0.67x, pipeline-limit)")
    local = "sweep: RPCRS-local W=2 / pipeline-limit-unix W=2 at every size (the worst size)"
    assert rows[local]["status"] == "n/a"
    sweep = results["sweep"]
    report = SCENARIOS["sweep"].report(SCENARIOS["sweep"], sweep["params"], sweep["contenders"])
    assert "tcp1/pipeline" in report and "tcp1/ceiling" not in report


def test_sweep_ceiling_rows_pair_each_round_under_its_lowest_limit():
    """The info row beside a sweep target: per size, ours over the lowest of the raw stream and the
    per-item limits in the same round (the median of the rounds), the ceiling over the raw stream,
    and the limit that sets it; the targets' verdicts stay as they are."""
    from benchsuite.report.targets import evaluate_targets

    sizes = [1024, 64 * 1024]
    rates = {  # GB/s by size, three paired rounds each
        "raw-socket": [[0.25, 0.25, 0.25], [3.0, 2.0, 3.0]],
        "graph-limit": [[0.2, 0.25, 0.3], [9.0, 9.0, 9.0]],
        "loader-limit": [[0.18, 0.1, 0.2], [8.0, 8.0, 8.0]],
        "RPCRS-tcp": [[0.045, 0.05, 0.04], [1.0, 1.0, 1.5]],
    }

    def points(name, by_size):
        workers = [1, 2] if name == "graph-limit" else [1]
        return [{"workers": w, "item_bytes": size, "bytes_per_s": max(r) * 1e9, "round_rates": [r_ * 1e9 for r_ in r]}
                for size, r in zip(sizes, by_size) for w in workers]

    results = {"sweep": {"params": SCENARIOS["sweep"].plan(True) | {"sizes": sizes}, "contenders": {
        name: {"ok": True, "data": {"points": points(name, by_size)}} for name, by_size in rates.items()}}}
    rows = {row["goal"]: row for row in evaluate_targets(results)}
    small = rows["sweep: RPCRS-tcp W=1 / ceiling below 64 KiB: the lowest of raw-socket, graph-limit W=1, "
                 "loader-limit (the worst size)"]
    # 1 KiB rounds: 0.045 / 0.18, 0.05 / 0.1, 0.04 / 0.2: 0.25, 0.5, 0.2; median 0.25 (round 1, loader-limit)
    assert small["status"] == "info" and small["measured"] == pytest.approx(0.25), small
    assert small["detail"] == ("worst at 1 KiB: 0.04 GB/s vs 0.18 GB/s (loader-limit); each size, ours / ceiling "
                               "(ceiling / raw-socket, the limit that sets it): 1 KiB 0.25x (0.72x, loader-limit)")
    large = rows["sweep: RPCRS-tcp W=1 / ceiling from 64 KiB up: the lowest of raw-socket, graph-limit W=1, "
                 "loader-limit (the worst size)"]
    assert large["measured"] == pytest.approx(0.5) and large["detail"].endswith("64 KiB 0.50x (1.00x, raw-socket)")
    verdict = rows["sweep: RPCRS-tcp W=1 >= 0.7x raw-socket at every size below 64 KiB (the worst size)"]
    assert verdict["status"] == "MISS" and verdict["measured"] == pytest.approx(0.18)  # against raw, as before
    del results["sweep"]["contenders"]["loader-limit"]
    rows = {row["goal"]: row for row in evaluate_targets(results)}
    assert rows[small["goal"]]["status"] == "n/a" and "loader-limit: not run" in rows[small["goal"]]["detail"]
    report = SCENARIOS["sweep"].report(SCENARIOS["sweep"], results["sweep"]["params"], results["sweep"]["contenders"])
    assert "tcp1/ceiling" not in report  # a ceiling needs every limit


def test_the_sweeps_figure_draws_every_limit_dashed_and_each_line_in_a_colour_of_its_own():
    from benchsuite.plot import plot_sweep

    class Axes:
        """Records what plot_sweep draws (matplotlib is the bench's extra, not the tests')."""

        def __init__(self):
            self.lines = {}
            self.colors = []

        def plot(self, xs, ys, style, color, label):
            self.lines[label] = style
            self.colors.append(color)

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    point = {"workers": 1, "item_bytes": 1024, "bytes_per_s": 1e8}
    names = ("raw-socket", "graph-limit", "loader-limit", "pipeline-limit-unix", "RPCRS-tcp")
    axes = Axes()
    plot_sweep(axes, {"sweep": {"params": {"sizes": [1024]}, "contenders": {
        name: {"ok": True, "data": {"points": [point]}} for name in names}}})
    assert axes.lines == {"raw-socket": "--", "graph-limit W=1": "--", "loader-limit": "--",
                          "pipeline-limit-unix W=1": "--", "RPCRS-tcp W=1": "o-"}
    assert len(set(axes.colors)) == len(axes.colors)


def test_memory_targets_bound_growth_by_the_credit_window_at_each_size():
    from benchsuite.report.targets import evaluate_targets

    def point(size, growth):
        window = 2 * 4 * size / (1 << 20)
        return {"workers": 2, "item_bytes": size, "growth_mib": growth, "credit_window_mib": window}

    results = {"memory": {"params": SCENARIOS["memory"].plan(True), "contenders": {
        "RPCRS-local": {"ok": True, "data": {"points": [point(1 << 20, 15.0), point(8 << 20, 80.0)]}}}}}
    rows = {row["goal"]: row for row in evaluate_targets(results)}
    one = rows["memory: RPCRS-local trainer peak growth <= 1.25x credit window + 4 MiB, 1 MiB items (bound / measured)"]
    eight = rows["memory: RPCRS-local trainer peak growth <= 1.25x credit window + 4 MiB, 8 MiB items (bound / measured)"]
    assert (one["status"], eight["status"]) == ("MISS", "PASS")  # bounds: 14 MiB and 84 MiB
    assert one["measured"] == pytest.approx(14 / 15) and eight["detail"].startswith("80.0 MiB vs bound 84 MiB")


def test_memory_scenario_counts_what_an_epoch_holds_not_what_a_first_loader_loads_once():
    # A process's first loader imports and maps what it needs once (DataLoader2, the package and
    # the libraries they load: ~20 MiB); each point's baseline comes after a warm-up loader of the
    # same contender, so only what its epoch holds counts. Here a first loader keeps 32 MiB (as an
    # import would) and every epoch keeps each 1 MiB item it yields (16 in the measured one).
    import contextlib
    import mmap

    import torch
    from benchsuite.contenders.base import Contender
    from benchsuite.scenarios.memory import measure_memory

    def fresh(nbytes, value):
        """A tensor on pages of its own (an anonymous mapping), every byte written: resident."""
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).fill_(value)

    loaded_once, held = [], []

    class LoadsOnceKeepsItems(Contender):
        @contextlib.contextmanager
        def epoch(self, workload, num_workers):
            if not loaded_once:
                loaded_once.append(fresh(32 << 20, 1))

            def items():
                for index in range(workload.n_items):
                    held.append(fresh(workload.item_bytes, index % 251))
                    yield held[-1]

            yield items()

    params = {"items": {1 << 20: 16}, "workers": 1, "consumer_sleep_s": 0.0, "budget_s": 10.0}
    (point,) = measure_memory(LoadsOnceKeepsItems(), params, lambda point: None)["points"]
    assert point["items"] == 16 and loaded_once
    assert 12 <= point["growth_mib"] <= 24, point  # the 16 items held, not the 32 MiB loaded once
    assert point["first_loader_mib"] >= 32, point  # reported apart: what the warm-up left resident


def test_sizes_are_read_in_kib_and_mib():
    import bench

    assert bench.parse_args(["--sizes", "1K,64k,1M,100"]).sizes == [1024, 65536, 1 << 20, 100]
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "1G"])


def test_workers_replace_the_worker_counts_of_a_scenario_that_has_several():
    import bench
    from benchsuite.runner import Runner

    args = bench.parse_args(["--only", "sessions", "--workers", "128"])
    runner = Runner.__new__(Runner)  # plan() reads only the arguments: no server pool started
    runner.args = args
    assert runner.plan(SCENARIOS["sessions"])["workers_list"] == [128]
    assert runner.plan(SCENARIOS["tensor8m"]) == SCENARIOS["tensor8m"].plan(False)  # no list of W: untouched
    with pytest.raises(SystemExit):
        bench.parse_args(["--workers", "0"])


def test_front_ends_tables_write_their_own_section_of_results_md():
    import bench_frontends
    from benchsuite.contenders.frontends import FRONT_ENDS
    from benchsuite.scenarios.frontends import PAIRS, SCENARIOS as FRONT_END_SCENARIOS

    known = set(CONTENDERS) | {contender.name for contender in FRONT_ENDS}
    for scenario in FRONT_END_SCENARIOS:
        assert set(scenario.contenders) <= known and scenario.name not in SCENARIOS
        assert {name for pair in PAIRS for name in pair} == set(scenario.contenders)
    results = "# Benchmark results\n\n## Targets\n\nt\n\n## Over capped network links\n\nl\n"
    first = bench_frontends.with_section(results, f"{bench_frontends.SECTION}\n\nrun 1\n")
    assert first.startswith(results.rstrip("\n")) and first.endswith("run 1\n")
    again = bench_frontends.with_section(first, f"{bench_frontends.SECTION}\n\nrun 2\n")
    assert again == first.replace("run 1", "run 2")
    moved = first.replace("## Over capped", "") + "\n## Over capped network links\n\nl\n"  # a section after it stays
    assert bench_frontends.with_section(moved, f"{bench_frontends.SECTION}\n\nrun 2\n\n").endswith(
        "run 2\n\n## Over capped network links\n\nl\n"
    )


@pytest.mark.timeout(120)
def test_elastic_quick_run_checks_every_item_and_writes_its_figure(tmp_path):
    """bench_elastic.py --quick: the timeline (a server joins, then drains; two epochs back to back)
    and the autoscaler's rounds, their verdicts (exit 1 on a MISS), every item once, the SVG and
    ELASTIC.md; no leftovers."""
    import xml.etree.ElementTree as ElementTree

    svg, markdown = tmp_path / "elastic.svg", tmp_path / "ELASTIC.md"
    output = run_bench(tmp_path, ["--quick", "--timeline-epochs", "2", "--plot", str(svg), "--results-md", str(markdown)],
                       timeout=110,
                       script="bench_elastic.py", exit_codes=(0, 1))
    verdicts = output.split("### Verdicts")[1].split("results written to")[0].strip()
    assert "**PASS**: every item exactly once" in verdicts and "**PASS**: in the order of a fixed fleet" in verdicts
    assert re.search(r"\*\*(PASS|MISS)\*\*: join at [0-9.]+ s", verdicts), verdicts
    assert re.search(r"\*\*(PASS|MISS)\*\*: the autoscaler (is|never)", verdicts), verdicts
    assert "### Autoscale(min_sessions=1, max_sessions=2) against fixed fleets" in output
    assert "2 epochs back to back" in output
    figure = ElementTree.parse(svg).getroot()
    marks = [text.text for text in figure.iter("{http://www.w3.org/2000/svg}text") if text.text]
    assert "join (2)" in marks and "drain (1)" in marks
    assert len(list(figure.iter("{http://www.w3.org/2000/svg}polyline"))) == 1
    written = markdown.read_text()
    assert "load average (1 min)" in written and verdicts in written


def synthetic_timeline(before_rate: float, after_rate: float, kind: str, servers: int):
    """``before_rate`` items/s for 4 s, then ``after_rate`` for 4 s, a ``kind`` event at 4 s leaving ``servers``."""
    from bench_elastic import Event, Timeline

    times = [i / before_rate for i in range(int(4 * before_rate))]
    times += [4 + i / after_rate for i in range(int(4 * after_rate))]
    return Timeline(times, [Event(kind, 4.0, servers, "127.0.0.1:1")], 0.5, True, True, [3 - servers, servers],
                    [(3 - servers, 3 - servers), (servers, servers)])


@pytest.mark.parametrize("kind, before_rate, after_rate, servers, passed", [
    ("join", 100.0, 200.0, 2, True), ("join", 100.0, 100.0, 2, False), ("join", 100.0, 400.0, 2, False),
    ("drain", 200.0, 100.0, 1, True), ("drain", 200.0, 200.0, 1, False), ("drain", 200.0, 160.0, 1, False),
])  # fmt: skip
def test_elastic_step_checks_want_the_new_fleets_rate(kind, before_rate, after_rate, servers, passed):
    """A join or drain passes when the plateau after it is the new fleet's rate (servers times one
    session's, within half of it), reached within a few seconds."""
    from bench_elastic import step_check

    timeline = synthetic_timeline(before_rate, after_rate, kind, servers)
    before, after = (timeline.plateau(start, end) for start, end, _n in timeline.bounds())
    assert before == pytest.approx(before_rate, rel=0.05) and after == pytest.approx(after_rate, rel=0.05)
    step, (text, verdict) = step_check(timeline, timeline.events[0], before, after, 100.0)
    assert verdict is passed, text
    assert (step == "none") is (not passed) and (not passed or float(step) <= 1.0), step


@pytest.mark.parametrize("after, said", [((1, 1), False), ((2, 1), True)])
def test_elastic_report_says_when_a_drain_kept_its_sessions(after, said):
    from bench_elastic import timeline_report

    timeline = synthetic_timeline(200.0, 100.0 * after[0], "drain", 1)
    timeline.sessions = [(2, 2), after]
    text, checks = timeline_report(timeline, 10.0)
    assert ("After a drain the run kept its sessions: 2 on 1 server " in text) is said, text
    assert [passed for line, passed in checks if line.startswith("drain")] == [not said]


@pytest.mark.parametrize("auto_rates, verdict", [
    ([90, 100, 185, 200], "within 10% of the best fixed fleet from epoch 2 on (3 epochs, 3.0 s of its run, 2 sessions)"),
    ([90, 185, 100, 200], "within 10% of the best fixed fleet from epoch 3 on"),  # it must stay there
    ([90, 100, 150, 170], "never stays within 10% of the best fixed fleet"),
])  # fmt: skip
def test_elastic_autoscale_verdict_is_the_round_from_which_it_stays_within_10_percent(auto_rates, verdict):
    from bench_elastic import EpochResult, autoscale_report

    fixed = {"fixed 1": [EpochResult(100.0, 1.0, 1, 0.6)] * 4, "fixed 2": [EpochResult(200.0, 1.0, 2, 0.1)] * 4}
    auto = [EpochResult(rate, 1.0, 1 if rate < 150 else 2, 0.5) for rate in auto_rates]
    text, [(line, passed)] = autoscale_report({**fixed, "autoscale": auto}, ["before epoch 1: hold"], 10.0, 4.0)
    assert verdict in line and passed is ("never" not in verdict), line
    assert "| 3 | 100 | 200 | 2 |" in text
