#!/usr/bin/env python
"""Side-by-side benchmark of RPCReadingService and the alternatives.

One command measures every contender on every scenario in one run and prints a
plain-text table per scenario (measured value, ratios), then a table of targets::

    python benchmarks/bench.py                  # full run
    python benchmarks/bench.py --quick          # smaller sizes, fewer points
    python benchmarks/bench.py --scenario tiny --contender MPRS --contender RPCRS-tcp
    python benchmarks/bench.py --scenario tensor8m --json out.json --plot out.png

Contenders: ``in-process`` (plain iteration of the graph), ``MPRS`` (torchdata
MultiProcessingReadingService), ``RPCRS-local`` / ``RPCRS-torch_rpc``
(RPCReadingService with local workers, socket / torch_rpc transport), ``RPCRS-tcp``
(RPCReadingService with ``worker_addresses=[addr] * W``: all W sessions on ONE
``python -m rpc_reading_service.worker`` that the benchmark starts itself, as a
deployment runs one worker server per host), ``RPCDataloader`` (the rpcdataloader
package, map-style, one ``python -m rpcdataloader.launch`` process per worker, as its
README says), ``raw-socket`` (sendall / recv_into over loopback TCP, one stream: the
transport limit) and ``raw-unix`` (the same over a Unix socket, the path RPCRS-local
takes to its local server).

Scenarios: ``tiny`` (items/s, W=2), ``tensor1m`` / ``tensor8m`` (GB/s; the reading
services at W=1 and W=2), ``scaling`` (a sleep-bound stage at W = 1..16), ``memory``
(trainer peak RSS with a slow consumer), ``first_item`` (loader construction to first
item).  Then a table of targets (PASS / MISS with the measured ratio and both rates).

How it measures:

* Every (scenario, contender) runs in a forked child process in its own process group,
  with a timeout; on exit, error, timeout or Ctrl-C the whole group is killed and
  reaped.  A contender that is missing or fails is printed as ``n/a (reason)``.
* Throughputs are steady-state: counted from the first item received (worker startup
  is what the ``first_item`` scenario measures).  GB/s uses 1 GB = 1e9 bytes.
* Each received buffer has its first and last byte read, so lazy transfers cannot
  cheat.  Slow contenders get shorter epochs (item caps) and stop at a time budget;
  their rate is computed from what they did.  MPRS always runs its epoch to the end
  (its mid-epoch shutdown can hang).
* Full run: the throughput scenarios (tiny, tensor1m, tensor8m) run in two rounds,
  every contender once per round, interleaved, and keep each (contender, W)'s best
  round; every round's rate is printed.  A burst of load from other jobs then hits
  all contenders alike instead of one.
* Worker servers (one RPCRS server, two rpcdataloader launchers) are started once,
  before the clock starts, as they would be in a deployment, and reused by every
  scenario.  A failed task restarts its contender's servers.
* The trainer (the measuring child) runs torch with one intra-op thread.
* The machine's load average is printed: other jobs on a 2-core box move every number.
  Cost measured on the 2-core machine at a load of 1-3: full run ~100 s, --quick ~35 s.  Per-task
  wall and CPU times go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from typing import Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from benchsuite.contenders import CONTENDERS  # noqa: E402
from benchsuite.plot import write_plot  # noqa: E402
from benchsuite.processes import become_subreaper  # noqa: E402
from benchsuite.report.targets import evaluate_targets, report_targets  # noqa: E402
from benchsuite.runner import Runner, load_average, print_header, progress  # noqa: E402
from benchsuite.scenarios import SCENARIOS  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, budgets and worker counts")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                        help="run only this scenario (repeatable)")
    parser.add_argument("--contender", action="append", choices=list(CONTENDERS),
                        help="run only this contender (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="write all results to PATH")
    parser.add_argument("--plot", metavar="PATH", help="write a scaling + bandwidth figure (needs matplotlib)")
    parser.add_argument("--verbose", action="store_true", help="show the children's output")
    return parser.parse_args(argv)


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


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    setup_environment()
    become_subreaper()
    signal.signal(signal.SIGTERM, _interrupt)
    import torch  # noqa: F401  (imported once here, before forking the children)
    import torchdata.dataloader2  # noqa: F401

    started = time.monotonic()
    selected = [SCENARIOS[s] for s in (args.scenario or list(SCENARIOS))]
    all_results: dict[str, dict] = {}
    runner = Runner(args)
    try:
        info = runner.probe()
        print_header(info, args.quick)
        for scenario in selected:
            result = all_results[scenario.name] = runner.run_scenario(scenario)
            print(scenario.report(scenario, result["params"], result["contenders"]) + "\n", flush=True)
    except KeyboardInterrupt:
        progress("interrupted: stopping every process started")
        return 130
    finally:
        runner.close()
    targets = evaluate_targets(all_results)
    print(report_targets(targets))
    print(f"\ntotal wall time {time.monotonic() - started:.1f} s, load average at end: {load_average()}")
    if args.json:
        write_json(args.json, {"info": info, "quick": args.quick, "results": all_results, "targets": targets})
        print(f"results written to {args.json}")
    if args.plot:
        print(write_plot(args.plot, all_results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
