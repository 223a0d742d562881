#!/usr/bin/env python
"""Side-by-side benchmark of RPCReadingService and the alternatives.

One command measures every contender on every scenario in one run and prints a
plain-text table per scenario (measured value, ratios), then a table of targets::

    python benchmarks/bench.py                  # full run
    python benchmarks/bench.py --quick          # smoke run: small sizes, fewer points
    python benchmarks/bench.py --only tiny --only MPRS --only RPCRS-tcp
    python benchmarks/bench.py --only tensor8m --json out.json --plot out.png --results-md out.md
    python benchmarks/bench.py --quick --only sweep   # the item-size sweep alone (a few minutes)
    python benchmarks/bench.py --only sessions --only RPCRS-2servers --workers 128   # one point

Contenders: ``in-process`` (plain iteration of the graph), ``production-limit`` (W
processes that only make the items, nothing moved: the ceiling for local workers; each
item stays alive while the next ``workloads.ITEMS_IN_FLIGHT`` are made, as a hand-over
holds it, so no item is written into the previous one's cache-hot buffer), ``copy-limit``
(the same processes, each copying every item once into a warm shared segment: the ceiling
of local workers' default hand-over, which makes that one copy),
``MPRS`` (torchdata MultiProcessingReadingService), ``torch-DataLoader``
(``torch.utils.data.DataLoader(graph, num_workers=W, batch_size=None)``, what most users
run), ``RPCRS-local`` / ``RPCRS-torch_rpc``
(RPCReadingService with local workers, socket / torch_rpc transport), ``RPCRS-tcp``
(RPCReadingService with ``workers=[addr] * W``: all W sessions on ONE
``python -m rpc_reading_service.worker`` that the benchmark starts itself, as a
deployment runs one worker server per host), ``RPCDataloader`` (the rpcdataloader
package, map-style, one ``python -m rpcdataloader.launch`` process per worker, as its
README says), ``raw-socket`` (sendall / recv_into over loopback TCP, one stream: the
transport limit) and ``raw-unix`` (the same over a Unix socket, the path RPCRS-local
takes to its local server); in the sweep also ``graph-limit`` (one process iterating one
worker's part of the same DataPipe graph, nothing moved, each item counted W times: what W
workers' graphs make at most) and ``loader-limit`` (DataLoader2 without a reading service
handing on items made before, a fresh tensor each: what a trainer hands on at most), the
per-item ceilings no DataLoader2 reading service passes, ``copy-limit`` at W=2 (set beside the
target against MPRS: what making and copying each item once allows, nothing else paid), and ``pipeline-limit`` /
``pipeline-limit-unix`` (W processes iterating their part of the same graph and sending each
tensor's bytes over TCP / a Unix socket to a DataLoader2 that hands them on: the graph, the
move and the loader added up, as on cores the trainer and workers share; not a bound, as
batched sends or shared memory can pass it).  Every contender makes the same items the same way
(``workloads.make_tensor``: a fresh tensor per item, every byte written), the raw
senders and the production limit too.

Scenarios: ``tiny`` (items/s, W=2), ``tensor1m`` / ``tensor8m`` (GB/s; the reading
services at W=1 and W=2, ``--quick``: W=2), ``sweep`` (GB/s at item sizes from 1 KiB to
64 MiB: the raw streams, RPCRS-tcp at W=1 and 2, the others at W=2; ``--sizes`` picks
others; beside its targets against the raw streams, an ``info`` row of each reading service
over its ceiling, the lowest of the raw stream and the per-item limits, and one over its
stream's pipeline limit), ``scaling`` (a sleep-bound stage at W = 1..16), ``memory``
(trainer peak RSS with a slow consumer, 1 MiB and 8 MiB items, above the RSS after a warm-up
epoch on a loader of the same contender: what a process loads once at its first loader, ~20 MiB of
modules and libraries, is no item held and is printed apart), ``first_item`` (loader construction to first
item, after the contender's own package was imported, timed apart).  Then a table of targets (PASS / MISS with the measured ratio and both rates).

How it measures:

* Every (scenario, contender) runs in a forked child process in its own process group,
  with a timeout; on exit, error, timeout or Ctrl-C the whole group is killed and
  reaped.  A contender that is missing or fails is printed as ``n/a (reason)``.
* Throughputs are steady-state: counted from the first item received (worker startup
  is what the ``first_item`` scenario measures).  GB/s uses 1 GB = 1e9 bytes.
* Each received buffer has its first and last byte read and compared (every item is
  one fill value), so lazy or partial transfers cannot cheat.  The memory scenario's
  consumer reads every byte (``max``, which allocates nothing).  Slow contenders get
  shorter epochs (item caps) and stop at a time budget; their rate is computed from
  what they did.  MPRS always runs its epoch to the end (its mid-epoch shutdown can
  hang).  In the tensor scenarios every other contender runs the production limit's
  longer epoch, so that no rate is mostly its start-up.
* Full run: the throughput scenarios (tiny, tensor1m, tensor8m) run in two rounds,
  every contender once per round, interleaved, and keep each (contender, W)'s best
  round; every round's rate is printed.  A burst of load from other jobs then hits
  all contenders alike instead of one.  In the tensor tables every ratio is paired:
  the median of the per-round ratios (a rate over its reference's rate in the same
  round), not best over best; a round runs each reading service next to the limits it
  is compared with, every other round in reverse order, and those contenders run a
  third round, so that one disturbed round does not decide a ratio.
* Worker servers (one RPCRS server, two rpcdataloader launchers) are started once,
  all at once and before the clock starts, as they would be in a deployment, and
  reused by every scenario.  A failed task restarts its contender's servers.
* The trainer (the measuring child) runs torch with one intra-op thread.
* The machine's load average is printed: other jobs on a 2-core box move every number.
  Per-task wall and CPU times go to stderr.  Cost on the 2-core machine at a load of
  5-9 from other jobs: full run ~250 s, ``--quick`` ~55 s, ``--quick --only tensor8m``
  25-30 s; the sweep adds to them (``--quick --only sweep``: ~3-4 min at a load of 10-13).
* The sweep runs a new loader per size, after one untimed short epoch per contender and W,
  and counts its rate from ``warmup_s`` after its first item (a new fleet's first items are slow);
  its table also gives the trainer's CPU time per item, which the load moves far less than
  rates (``cpu_per_item.py`` measures both sides apart).  Where the middle sizes lose their
  time: SWEEP.md.
* ``--results-md`` writes RESULTS.md: the run's details, each target as a sentence made
  from the same row as the targets table, and every table verbatim.

The code is in ``benchsuite/`` (its ``__init__`` lists the modules); this file is the
entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from datetime import datetime, timezone
from typing import Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from benchsuite.contenders import CONTENDERS  # noqa: E402
from benchsuite.plot import write_plot  # noqa: E402
from benchsuite.processes import become_subreaper  # noqa: E402
from benchsuite.report.results_md import results_markdown, source_revision  # noqa: E402
from benchsuite.report.targets import evaluate_targets, report_targets  # noqa: E402
from benchsuite.runner import Runner, header_text, load_average, progress  # noqa: E402
from benchsuite.scenarios import SCENARIOS  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line, checked: ``--only`` names become ``--scenario`` / ``--contender``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: smaller sizes, budgets and worker counts, one round")
    parser.add_argument("--only", action="append", metavar="NAME", default=[],
                        help="run only this scenario or contender (repeatable); scenarios: "
                             f"{', '.join(SCENARIOS)}; contenders: {', '.join(CONTENDERS)}")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                        help="run only this scenario (repeatable)")
    parser.add_argument("--contender", action="append", choices=list(CONTENDERS),
                        help="run only this contender (repeatable)")
    parser.add_argument("--sizes", type=item_sizes, metavar="SIZES",
                        help="the sweep's item sizes instead of its own: comma-separated, such as 64K,1M,1024")
    parser.add_argument("--workers", type=worker_list, metavar="W",
                        help="the worker counts of a scenario that measures several (sessions, scaling) instead "
                             "of its own: comma-separated, such as 128 or 64,128")
    parser.add_argument("--json", metavar="PATH", help="write all results to PATH")
    parser.add_argument("--plot", metavar="PATH", help="write a scaling + bandwidth figure (needs matplotlib)")
    parser.add_argument("--results-md", metavar="PATH",
                        help="write RESULTS.md (run details, targets as sentences, tables verbatim) to PATH")
    parser.add_argument("--verbose", action="store_true", help="show the children's output")
    args = parser.parse_args(argv)
    for name in args.only:
        if name in SCENARIOS:
            args.scenario = (args.scenario or []) + [name]
        elif name in CONTENDERS:
            args.contender = (args.contender or []) + [name]
        else:
            parser.error(f"--only {name}: not a scenario ({', '.join(SCENARIOS)}) "
                         f"nor a contender ({', '.join(CONTENDERS)})")
    return args


def item_sizes(text: str) -> list[int]:
    """``64K,1M,1024`` as bytes (K = KiB, M = MiB), for ``--sizes``."""
    scales = {"K": 1 << 10, "M": 1 << 20}
    try:
        sizes = [int(part[:-1]) * scales[part[-1].upper()] if part[-1:].upper() in scales else int(part)
                 for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a list of sizes such as 64K,1M,1024") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be at least 1 byte")
    return sizes


def worker_list(text: str) -> list[int]:
    """``64,128`` as worker counts, for ``--workers``."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a list of worker counts such as 64,128") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every worker count must be at least 1")
    return counts


def setup_environment() -> None:
    """PYTHONPATH for every process started from here: the work tree's package, then
    this directory (workloads are pickled by reference).  Also quiet known warnings."""
    paths = [REPO_ROOT, BENCH_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    for path in (REPO_ROOT, BENCH_DIR):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning")
    warnings.filterwarnings("ignore", category=UserWarning)


def _interrupt(signum, frame) -> None:
    """SIGTERM handler: unwind like Ctrl-C so every child is stopped."""
    raise KeyboardInterrupt


def write_json(path: str, document: dict) -> None:
    """Every result of the run as JSON."""
    with open(path, "w") as out:
        json.dump(document, out, indent=2, default=str)


def utc_now() -> str:
    """The current UTC time as ``2026-12-01 13:33``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")


def main(argv: Optional[list[str]] = None) -> int:
    """Run the selected scenarios, print their tables and the targets, write the files asked for."""
    args = parse_args(argv)
    setup_environment()
    become_subreaper()
    signal.signal(signal.SIGTERM, _interrupt)
    started, started_utc, load_start = time.monotonic(), utc_now(), load_average()
    selected = [SCENARIOS[s] for s in (args.scenario or list(SCENARIOS))]
    all_results: dict[str, dict] = {}
    printed: list[str] = []

    def show(text: str) -> None:
        print(text + "\n", flush=True)
        printed.append(text + "\n")

    runner = Runner(args)
    try:
        runner.launch_servers(selected)  # they import torch while this process does
        import torch  # noqa: F401  (imported once here, before forking the children)
        import torchdata.dataloader2  # noqa: F401

        info = runner.probe()
        show(header_text(info, args.quick))
        runner.start_servers(selected)
        for scenario in selected:
            result = all_results[scenario.name] = runner.run_scenario(scenario)
            show(scenario.report(scenario, result["params"], result["contenders"]))
    except KeyboardInterrupt:
        progress("interrupted: stopping every process started")
        return 130
    finally:
        runner.close()
    targets = evaluate_targets(all_results)
    show(report_targets(targets))
    wall_s, load_end = time.monotonic() - started, load_average()
    print(f"total wall time {wall_s:.1f} s, load average at end: {load_end}")
    if args.json:
        write_json(args.json, {"info": info, "quick": args.quick, "results": all_results, "targets": targets})
        print(f"results written to {args.json}")
    if args.plot:
        print(write_plot(args.plot, all_results))
    if args.results_md:
        run = {"started": started_utc, "ended": utc_now(), "wall_s": wall_s, "load_start": load_start,
               "load_end": load_end, "revision": source_revision(REPO_ROOT), "quick": args.quick,
               "command": " ".join(["python benchmarks/bench.py", *(sys.argv[1:] if argv is None else argv)])}
        with open(args.results_md, "w") as out:
            out.write(results_markdown(run, info, targets, "".join(printed), args.plot, args.json))
        print(f"RESULTS.md written to {args.results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
