#!/usr/bin/env python
"""The front ends without DataLoader2 side by side with what users run in their place.

Runs in the environment with torchdata >= 0.10 (``make bench-nodes``: .venv-nodes)::

    python benchmarks/bench_frontends.py --quick
    python benchmarks/bench_frontends.py --results-md benchmarks/RESULTS.md   # (re)writes its section there

``RemoteMapper`` vs ``ParallelMapper(method="process")`` and ``RemoteIterable`` under torch's
DataLoader vs ``DataLoader(num_workers=W)``: the same items made the same way, tiny ints and
8 MiB tensors, each task in a forked child, paired rounds (``benchsuite``: the runner, the
measurement and the tables of ``bench.py``).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Optional

import bench
from benchsuite.contenders import CONTENDERS
from benchsuite.contenders.frontends import FRONT_ENDS
from benchsuite.processes import become_subreaper
from benchsuite.runner import Runner, load_average, progress
from benchsuite.scenarios import SCENARIOS
from benchsuite.scenarios.frontends import SCENARIOS as FRONT_END_SCENARIOS

SECTION = "## Front ends side by side"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: shorter epochs, two rounds")
    parser.add_argument("--results-md", metavar="PATH", help=f"write the tables into PATH's '{SECTION}' section")
    parser.add_argument("--verbose", action="store_true", help="show the children's output")
    args = parser.parse_args(argv)
    args.contender, args.sizes = None, None  # what benchsuite's Runner reads besides
    return args


def with_section(text: str, section: str) -> str:
    """``text`` (a RESULTS.md) with its front ends section replaced by ``section``, or ``section`` appended."""
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        return pattern.sub(lambda _: section, text, count=1)
    return text.rstrip("\n") + "\n\n" + section


def main(argv: Optional[list[str]] = None) -> int:
    """Run both tables, print them, write the section asked for."""
    args = parse_args(argv)
    bench.setup_environment()
    become_subreaper()
    CONTENDERS.update({contender.name: contender for contender in FRONT_ENDS})
    SCENARIOS.update({scenario.name: scenario for scenario in FRONT_END_SCENARIOS})
    started, load_start = bench.utc_now(), load_average()
    t0 = time.monotonic()
    runner = Runner(args)
    tables = []
    try:
        import torch  # noqa: F401  (imported once here, before forking the children)
        import torchdata.nodes  # noqa: F401

        versions = f"torch {torch.__version__}, torchdata {torchdata.__version__}"
        for scenario in FRONT_END_SCENARIOS:
            result = runner.run_scenario(scenario)
            tables.append(scenario.report(scenario, result["params"], result["contenders"]))
            print(tables[-1] + "\n", flush=True)
    except KeyboardInterrupt:
        progress("interrupted: stopping every process started")
        return 130
    finally:
        runner.close()
    run = (f"{'Quick' if args.quick else 'Full'} run {started} to {bench.utc_now()} UTC "
           f"({time.monotonic() - t0:.0f} s), {versions}, load average {load_start} at start and "
           f"{load_average()} at end: `python benchmarks/bench_frontends.py{' --quick' if args.quick else ''}` "
           "in the torchdata 0.11 environment (`make bench-nodes`).")
    print(run)
    if args.results_md:
        section = f"{SECTION}\n\n{run}\n\n```\n" + "\n\n".join(tables) + "\n```\n"
        try:
            with open(args.results_md) as handle:
                text = handle.read()
        except FileNotFoundError:
            text = ""
        with open(args.results_md, "w") as handle:
            handle.write(with_section(text, section))
        print(f"section '{SECTION}' written to {args.results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
