"""RESULTS.md, written from one run: every sentence in it is made from the same numbers as
the tables it quotes verbatim."""

from __future__ import annotations

import subprocess
from typing import Optional

from benchsuite.report.targets import measured_text, needed_text

PUBLISHED_FILES = ("benchmarks/RESULTS.md", "benchmarks/results.json", "benchmarks/results.png", "benchmarks/LINKS.md",
                   "benchmarks/ELASTIC.md")


# Kept in its own file: bench_links.py (root, network namespaces) writes it, not this run.
LINKS_SECTION = ("## Over capped network links\n\nWhat each transport delivers through links capped at 1 and "
                 "10 Gbit/s between two network namespaces: [LINKS.md](LINKS.md) (`benchmarks/bench_links.py`).")


def source_revision(repo_root: str) -> str:
    """``abc1234`` (the commit measured), with ``+ uncommitted changes`` when the tree
    differs from it outside the published result files; ``unknown`` without git."""
    try:
        commit = subprocess.run(["git", "-C", repo_root, "rev-parse", "--short", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        status = subprocess.run(["git", "-C", repo_root, "status", "--porcelain", "--untracked-files=no"],
                                check=True, capture_output=True, text=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = [line[3:] for line in status if line[3:] not in PUBLISHED_FILES]
    return f"{commit} + uncommitted changes" if changed else commit


def target_sentence(row: dict) -> str:
    """One target as a sentence, from the same row the targets table prints."""
    if row["measured"] is None:
        return f"- **not measured**: {row['goal']} ({row['detail']})."
    if row["status"] == "info":
        return f"- **info**: {row['goal']}: {measured_text(row)} ({row['detail']})."
    return (f"- **{row['status']}**: {row['goal']}: measured {measured_text(row)}, needed "
            f"{needed_text(row)} ({row['detail']}).")


def summary_sentence(rows: list[dict]) -> str:
    """How many targets passed, missed, were not measured."""
    judged = [r for r in rows if r["threshold"] is not None]
    counts = {status: sum(r["status"] == status for r in judged) for status in ("PASS", "MISS", "n/a")}
    return (f"{counts['PASS']} of {len(judged)} targets pass, {counts['MISS']} missed, "
            f"{counts['n/a']} not measured in this run.")


#: The prose about local workers: (target goal, how the sentence names its reference).
LOCAL_PROSE = (
    ("tensor8m: RPCRS-local W=2 >= 0.6x production-limit W=2", "the production limit"),
    ("tensor8m: RPCRS-local W=2 >= 4x MPRS W=2", "MPRS"),
    ("tensor8m: RPCRS-local W=2 >= 3x torch-DataLoader W=2", "torch's DataLoader"),
)
TCP_PROSE = "tensor8m: RPCRS-tcp W=1 >= 0.85x raw-socket (both one stream)"
MADE_IN_SHARED_MEMORY_PROSE = ("tensor8m: RPCRS-local-shm W=2 >= 0.6x production-limit-shm W=2 "
                               "(items made with shared_empty)")


def quoted_rates(detail: str) -> tuple[str, str]:
    """The two rates a ratio target's detail starts with (``"1.77 GB/s vs 1.80 GB/s; ..."``)."""
    ours, _, theirs = detail.partition(";")[0].partition(" vs ")
    return ours, theirs


def local_workers_paragraph(rows: list[dict]) -> Optional[str]:
    """What local workers reached in this run, in words, from the target rows (the
    numbers are the targets table's); None when the run measured none of them."""
    by_goal = {row["goal"]: row for row in rows if row["measured"] is not None}
    parts, rate = [], None
    for goal, reference in LOCAL_PROSE:
        row = by_goal.get(goal)
        if row is None:
            continue
        ours, theirs = quoted_rates(row["detail"])
        rate = ours
        parts.append(f"{measured_text(row)} {reference} ({theirs})")
    sentences = []
    if parts:
        sentences.append(f"Two local workers, which hand every 8 MiB tensor over in shared memory, delivered "
                         f"{rate} in this run: {', '.join(parts)}.")
    made = by_goal.get(MADE_IN_SHARED_MEMORY_PROSE)
    if made is not None:
        ours, theirs = quoted_rates(made["detail"])
        sentences.append(f"Two local workers whose graph makes its tensors with shared_empty (no copy at all) "
                         f"delivered {ours}, {measured_text(made)} the production limit of the same code "
                         f"({theirs}).")
    tcp = by_goal.get(TCP_PROSE)
    if tcp is not None:
        ours, theirs = quoted_rates(tcp["detail"])
        sentences.append(f"One worker over TCP delivered {ours}, {measured_text(tcp)} the raw TCP stream with the "
                         f"same production cost ({theirs}).")
    return " ".join(sentences) if sentences else None


def results_markdown(run: dict, info: dict, targets: list[dict], printed: str,
                     plot_file: Optional[str], json_file: Optional[str]) -> str:
    """The whole of RESULTS.md.  ``run``: started / ended (UTC text), wall_s, load_start,
    load_end, revision, command, quick."""
    files = [f"`{name}`" for name in (json_file, plot_file) if name]
    lines = [
        "# Benchmark results",
        "",
        "Written by `benchmarks/bench.py --results-md` from the run it describes (do not edit by hand:",
        "rerun `make bench`). Every number below is the one its table prints.",
        "",
        f"- **Date**: {run['started']} to {run['ended']} UTC ({'quick' if run['quick'] else 'full'} run)",
        f"- **Machine**: {info.get('cpus')} CPUs, {info.get('platform', 'Linux')}, "
        f"python {info.get('python')}, "
        f"torch {info.get('torch')}, torchdata {info.get('torchdata')}, "
        f"rpcdataloader {info.get('rpcdataloader', 'n/a')}; package at `{run['revision']}`",
        f"- **Load average (1 min)**: {run['load_start']} at start, {run['load_end']} at the end (which "
        "includes the benchmark's own busy processes); on a 2-core machine other jobs move every number.",
        f"- **Command**: `{run['command']}`",
        f"- **Runtime**: {run['wall_s']:.0f} s wall",
    ]
    if files:
        lines.append(f"- **Files**: {', '.join(files)} (every number of this run; written by the run, not committed)")
    lines += ["", "## Targets", "", summary_sentence(targets), ""]
    lines += [target_sentence(row) for row in targets]
    paragraph = local_workers_paragraph(targets)
    if paragraph:
        lines += ["", paragraph]
    if plot_file:  # a figure, not a link: the figure is not committed
        lines += ["", f"The figure of this run: `{plot_file}` (the panels of the scenarios it ran: scaling, bandwidth, throughput by item size)."]
    lines += ["", "## Printed tables (verbatim)", "", "```", printed.rstrip("\n"), "```", "",
              "The profile of an earlier run and what bounded its numbers: [ANALYSIS.md](ANALYSIS.md).", "",
              LINKS_SECTION, ""]
    return "\n".join(lines)
