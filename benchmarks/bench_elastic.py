#!/usr/bin/env python
"""Elastic fleets: throughput while worker servers join and drain, and the autoscaler against fixed fleets.

Two measurements on loopback worker servers (``python -m rpc_reading_service.worker``, the
``rpc-reading-worker`` command), ``distribution="dynamic"``, on a sleep-bound graph: each item
waits ``--ms`` milliseconds in its worker (what reading from remote storage looks like), so the
CPUs of a small shared machine are not what limits, and N sessions should give N times the rate.

* **Timeline**: one session on the first server; the other servers join one at a time
  (``add_workers``, one session each) and then drain one at a time (SIGTERM), the last joined
  first. A phase is planned to last ``--phase-s`` at the ideal rate, so the events come after item
  counts, not times: the epoch ends with the last phase, and its items are checked (every item
  exactly once, in the order of a fixed fleet; ``--timeline-epochs K`` splits the items into K epochs
  back to back, which shows what changes at epoch boundaries). Items/s in windows of ``--window-s`` against time,
  each phase's plateau (the median window past its first second), how long each step took (from
  the event to the first of two windows past the middle of the two plateaus), with verdicts: after
  each event the plateau is the new fleet's (its servers times the first phase's rate, within half
  a session's) and the step took at most 3 s.
* **Autoscaler**: ``Autoscale(min_sessions=1, max_sessions=N)`` from one session, against fixed
  fleets of 1..N sessions, all loaders open at once on one server, one epoch of each per round
  (the order reversed every other round), so a burst of load hits all alike. The trainer spends
  ``--train-ms`` per item (a training step), so more sessions stop helping past the knee
  ``train_ms / ms``. Verdict: the round from which the autoscaled epoch stays within 10 % of the
  best fixed count's in the same round, and the epochs and seconds the autoscaled run took to get
  there.

Run standalone, from the repo root (a few minutes; ``--quick``: a smoke run under a minute)::

    PYTHONPATH=$PWD python benchmarks/bench_elastic.py [--quick] [--plot benchmarks/elastic.svg] \\
        [--results-md benchmarks/ELASTIC.md]

Prints markdown tables and verdicts; the figure is an SVG made with the standard library. Every
server started here is stopped on exit.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from bench import setup_environment, utc_now  # noqa: E402
from bench_distribution import SleepPerItem, table  # noqa: E402
from benchsuite.processes import ServerPool, become_subreaper, launch_rpcrs_server  # noqa: E402
from benchsuite.runner import load_average  # noqa: E402

TOLERANCE = 0.10  # the autoscaler's epoch within this share of the best fixed fleet's
STEP_WITHIN_S = 3.0  # a join or drain shows in the rate within this long
SETTLE_S = 1.0  # a phase's plateau starts this long after its event


def graph(items: int, ms: float) -> Any:
    """``range(items)``, each item after ``ms`` milliseconds of waiting in its worker."""
    from torchdata.datapipes.iter import IterableWrapper

    return IterableWrapper(range(items)).sharding_filter().map(SleepPerItem(ms / 1000))


def service(address: str, key: str, sessions: int, **options: Any) -> Any:
    """``sessions`` "dynamic" sessions on the server at ``address``."""
    from rpc_reading_service import RPCReadingService

    return RPCReadingService(workers=[address], num_workers=sessions, auth_key=key, distribution="dynamic",
                             timeout=30.0, **options)  # fmt: skip


# -- the timeline -------------------------------------------------------------------------------


@dataclass
class Event:
    """A join or a drain: when (seconds since the first item) and the servers after it."""

    kind: str
    at: float
    servers: int
    address: str


@dataclass
class Timeline:
    """What one elastic epoch gave: item arrival times, the events, and whether the items were right."""

    times: List[float]
    events: List[Event]
    window_s: float
    exactly_once: bool
    in_order: bool
    phases: List[int] = field(default_factory=list)
    sessions: List[Tuple[int, int]] = field(default_factory=list)  # (sessions, their servers) at each phase's end

    def rates(self) -> List[Tuple[float, float]]:
        """``(window end, items/s)`` of each whole window from the first item on."""
        if not self.times:
            return []
        windows = int(self.times[-1] // self.window_s)
        counts = [0] * max(windows, 0)
        for at in self.times:
            index = int(at // self.window_s)
            if index < windows:
                counts[index] += 1
        return [((i + 1) * self.window_s, count / self.window_s) for i, count in enumerate(counts)]

    def bounds(self) -> List[Tuple[float, float, int]]:
        """``(start, end, servers)`` of each phase."""
        starts = [0.0] + [event.at for event in self.events]
        ends = [event.at for event in self.events] + [self.times[-1] if self.times else 0.0]
        return list(zip(starts, ends, self.phases))

    def plateau(self, start: float, end: float) -> Optional[float]:
        """The median rate of the windows in ``[start + SETTLE_S, end]`` (None if none fits)."""
        inside = [rate for stop, rate in self.rates() if stop - self.window_s >= start + SETTLE_S and stop <= end]
        return statistics.median(inside) if inside else None

    def step_seconds(self, event: Event, before: float, after: float) -> Optional[float]:
        """Seconds from ``event`` to the end of the first of two windows in a row past the middle of
        ``before`` and ``after`` (None if none are)."""
        middle = (before + after) / 2
        rates = self.rates()
        past = [stop - self.window_s >= event.at and (rate > middle if after > before else rate < middle)
                for stop, rate in rates]  # fmt: skip
        return next((rates[i][0] - event.at for i in range(len(rates) - 1) if past[i] and past[i + 1]), None)


def phase_plan(servers: int) -> List[int]:
    """The servers of each phase: 1 up to ``servers`` and back, ``[1, 2, 3, 4, 3, 2, 1]``."""
    return list(range(1, servers + 1)) + list(range(servers - 1, 0, -1))


def run_timeline(pool: ServerPool, key: str, servers: int, ms: float, phase_s: float, window_s: float,
                 epochs: int = 1) -> Timeline:  # fmt: skip
    """``epochs`` epochs, back to back, on the first server while the others join and drain; each phase
    ``phase_s`` at the ideal rate."""
    from torchdata.dataloader2 import DataLoader2

    addresses = pool.ensure(servers)
    plan = phase_plan(servers)
    per_phase = [round(count * phase_s * 1000 / ms) for count in plan]
    triggers = [sum(per_phase[: i + 1]) for i in range(len(plan) - 1)]
    epoch_items = -(-sum(per_phase) // epochs)
    events: List[Event] = []
    items, times, sessions = [], [], []
    with DataLoader2(graph(epoch_items, ms), reading_service=service(addresses[0], key, 1)) as loader:
        loader.seed(0)
        start = time.perf_counter()
        for epoch in range(epochs):
            for item in loader:
                now = time.perf_counter()
                start = now if not items else start  # from the first item on
                items.append(epoch * epoch_items + item)
                times.append(now - start)
                if len(events) < len(triggers) and len(items) == triggers[len(events)]:
                    sessions.append(sessions_now(loader))
                    events.append(change_fleet(loader, pool, addresses, plan, len(events), now - start))
        sessions.append(sessions_now(loader))
    total = epochs * epoch_items
    exactly_once, in_order = sorted(items) == list(range(total)), items == list(range(total))
    return Timeline(times, events, window_s, exactly_once, in_order, plan, sessions)


def sessions_now(loader: Any) -> Tuple[int, int]:
    """The run's sessions now and the number of servers they are on."""
    workers = loader.reading_service.stats().workers
    return len(workers), len({worker.address for worker in workers})


def change_fleet(loader: Any, pool: ServerPool, addresses: List[str], plan: List[int], index: int, at: float,
                 ) -> Event:  # fmt: skip
    """Event ``index`` of ``plan``: add the next server, or SIGTERM the last one added."""
    before, after = plan[index], plan[index + 1]
    if after > before:
        address = addresses[after - 1]
        added = loader.reading_service.add_workers([address])
        if added != [address]:
            raise RuntimeError(f"server {address} did not join the run (add_workers returned {added})")
        return Event("join", at, after, address)
    address = addresses[before - 1]
    os.kill(pool.procs[before - 1].pid, signal.SIGTERM)
    return Event("drain", at, after, address)


def timeline_report(timeline: Timeline, ms: float, epochs: int = 1) -> Tuple[str, List[Tuple[str, bool]]]:
    """The phases' table and the timeline's checks as ``(text, passed)``."""
    ideal = 1000 / ms
    rows, checks = [], []
    plateaus = [timeline.plateau(start, end) for start, end, _n in timeline.bounds()]
    one = plateaus[0] / timeline.phases[0] if plateaus[0] else None  # one server's rate
    for index, ((start, end, count), rate) in enumerate(zip(timeline.bounds(), plateaus)):
        event = timeline.events[index - 1] if index else None
        step = "-"
        if event is not None and rate is not None and plateaus[index - 1] is not None:
            step, check = step_check(timeline, event, plateaus[index - 1], rate, one or ideal)
            checks.append(check)
        rows.append((
            f"{start:.1f}-{end:.1f}", event.kind + f" {event.address}" if event else "start", str(count),
            "{} on {}".format(*timeline.sessions[index]) if index < len(timeline.sessions) else "?",
            "-" if rate is None else f"{rate:.0f}", f"{count * ideal:.0f}",
            "-" if rate is None or not one else f"{rate / one:.2f}x", step,
        ))  # fmt: skip
    most = max(timeline.phases)
    peak = plateaus[timeline.phases.index(most)]  # the first phase with every server
    if peak is not None and one:
        checks.append((f"{most} servers give {peak / one:.2f}x one server's rate (ideal {most}x): at least "
                       f"{0.8 * most:.1f}x", peak / one >= 0.8 * most))  # fmt: skip
    checks.append((f"every item exactly once ({len(timeline.times)} items)", timeline.exactly_once))
    checks.append(("in the order of a fixed fleet", timeline.in_order))
    text = table(
        f"Throughput while servers join and drain: {ms:g} ms items, windows of {timeline.window_s:g} s"
        + (f", {epochs} epochs back to back" if epochs > 1 else ", one epoch"),
        ("phase s", "event", "servers", "sessions on servers at its end", "plateau items/s", "ideal items/s",
         "vs 1 server", "step s"), rows,
    )  # fmt: skip
    kept = [(event, timeline.sessions[index + 1]) for index, event in enumerate(timeline.events)
             if event.kind == "drain" and index + 1 < len(timeline.sessions)
             and timeline.sessions[index + 1][0] > event.servers]  # fmt: skip
    if kept:
        event, (count, hosts) = kept[0]
        text += (f"\nAfter a drain the run kept its sessions: {count} on {servers_text(hosts)} after the drain at "
                 f"{event.at:.1f} s. The drained server's sessions were opened again on the servers left, so "
                 "the rate of a sleep-bound graph does not fall (a CPU-bound one would crowd the servers left).\n")
    return text, checks


def step_check(timeline: Timeline, event: Event, before: float, after: float, session: float,
               ) -> Tuple[str, Tuple[str, bool]]:  # fmt: skip
    """How long ``event`` took to show (``"none"`` if the plateau did not reach the new fleet's rate:
    its servers times ``session``, one session's rate, within half of it), and its check."""
    target = event.servers * session
    reached = abs(after - target) <= 0.5 * session and abs(after - before) >= 0.5 * session
    took = timeline.step_seconds(event, before, after) if reached else None
    step = "none" if took is None else f"{took:.1f}"
    took_text = "no step" if took is None else f"step {took:.1f} s"
    text = (f"{event.kind} at {event.at:.1f} s ({before:.0f} -> {after:.0f} items/s, {took_text}): the rate "
            f"{'rises' if event.kind == 'join' else 'falls'} to that of {servers_text(event.servers)} ({target:.0f} +- "
            f"{0.5 * session:.0f}) within {STEP_WITHIN_S:g} s")
    return step, (text, took is not None and took <= STEP_WITHIN_S)


def servers_text(count: int) -> str:
    """``1 server``, ``3 servers``."""
    return f"{count} server{'s' * (count != 1)}"


def windows_table(timeline: Timeline) -> str:
    """Every window's rate, the events marked."""
    marks: Dict[int, List[str]] = {}
    for event in timeline.events:
        marks.setdefault(int(event.at // timeline.window_s), []).append(f"{event.kind} ({servers_text(event.servers)})")
    rows = [(f"{stop:.1f}", f"{rate:.0f}", ", ".join(marks.get(i, [])))
            for i, (stop, rate) in enumerate(timeline.rates())]  # fmt: skip
    return table("Items/s per window", ("window end s", "items/s", "event in it"), rows)


# -- the autoscaler against fixed fleets ---------------------------------------------------------


@dataclass
class EpochResult:
    """One epoch of one loader: items/s past its first item, its wall seconds and sessions."""

    rate: float
    wall: float
    sessions: int
    stall: float


def timed_epoch(loader: Any, train_s: float) -> EpochResult:
    """One epoch, ``train_s`` of training per item; items/s from the first item on."""
    started = time.perf_counter()
    first = last = None
    count = 0
    for _item in loader:
        last = time.perf_counter()
        first = last if first is None else first
        count += 1
        if train_s:
            time.sleep(train_s)
    stats = loader.reading_service.stats()
    rate = (count - 1) / (last - first) if count > 1 and last > first else 0.0
    return EpochResult(rate, time.perf_counter() - started, len(stats.workers), stats.data_stall)


def autoscale_rounds(address: str, key: str, ms: float, train_ms: float, most: int, items: int, rounds: int,
                     ) -> Tuple[Dict[str, List[EpochResult]], List[str]]:  # fmt: skip
    """``rounds`` rounds of one epoch of each fixed count 1..``most`` and of the autoscaled loader."""
    from torchdata.dataloader2 import DataLoader2

    from rpc_reading_service import Autoscale

    autoscale = Autoscale(min_sessions=1, max_sessions=most, sessions_per_server=most)
    services = {f"fixed {k}": service(address, key, k) for k in range(1, most + 1)}
    services["autoscale"] = service(address, key, 1, autoscale=autoscale)
    loaders = {name: DataLoader2(graph(items, ms), reading_service=rs) for name, rs in services.items()}
    results: Dict[str, List[EpochResult]] = {name: [] for name in loaders}
    try:
        for name, loader in loaders.items():
            loader.seed(0)
        for round_index in range(rounds):
            order = list(loaders) if round_index % 2 == 0 else list(reversed(loaders))
            for name in order:
                results[name].append(timed_epoch(loaders[name], train_ms / 1000))
        decisions = [f"before epoch {d.epoch}: {d.action} {d.sessions_before} -> {d.sessions} ({d.reason})"
                     for d in loaders["autoscale"].reading_service.stats().scale_decisions]  # fmt: skip
    finally:
        for loader in loaders.values():
            loader.shutdown()
    return results, decisions


def default_target_stall() -> float:
    """``Autoscale``'s default ``target_stall``, which the run uses."""
    from rpc_reading_service import Autoscale

    return Autoscale(min_sessions=1, max_sessions=1).target_stall


def autoscale_report(results: Dict[str, List[EpochResult]], decisions: List[str], ms: float, train_ms: float,
                     ) -> Tuple[str, List[Tuple[str, bool]]]:  # fmt: skip
    """The rounds' table, the autoscaler's ``decisions`` and its verdict."""
    fixed = [name for name in results if name != "autoscale"]
    auto = results["autoscale"]
    rows, within = [], []
    for index, epoch in enumerate(auto):
        best_name = max(fixed, key=lambda name: results[name][index].rate)
        best = results[best_name][index].rate
        within.append(epoch.rate >= (1 - TOLERANCE) * best)
        rows.append((str(index), *(f"{results[name][index].rate:.0f}" for name in fixed), best_name.split()[1],
                     f"{epoch.sessions}", f"{epoch.stall:.0%}", f"{epoch.rate:.0f}", f"{epoch.rate / best:.2f}",
                     f"{sum(e.wall for e in auto[: index + 1]):.1f}"))  # fmt: skip
    reached = next((i for i in range(len(within)) if all(within[i:])), None)
    if reached is None:
        verdict = (f"the autoscaler never stays within {TOLERANCE:.0%} of the best fixed fleet "
                   f"(last round: {auto[-1].rate:.0f} items/s with {auto[-1].sessions} sessions)", False)  # fmt: skip
    else:
        verdict = (f"the autoscaler is within {TOLERANCE:.0%} of the best fixed fleet from epoch {reached} on "
                   f"({reached + 1} epochs, {sum(e.wall for e in auto[: reached + 1]):.1f} s of its run, "
                   f"{auto[reached].sessions} sessions)", True)  # fmt: skip
    text = table(
        f"Autoscale(min_sessions=1, max_sessions={len(fixed)}) against fixed fleets: {ms:g} ms items, "
        f"{train_ms:g} ms of training per item (items/s, each round's epochs side by side)",
        ("round", *(f"{name} items/s" for name in fixed), "best fixed", "autoscale sessions", "its stall",
         "autoscale items/s", "vs best", "its run s"), rows,
    )  # fmt: skip
    last, target = auto[-1], default_target_stall()
    means = {int(name.split()[1]): statistics.mean(epoch.rate for epoch in results[name]) for name in fixed}
    knee = min(count for count, rate in means.items() if rate >= 0.95 * max(means.values()))
    if last.stall > target and decisions and "min_gain" in decisions[-1]:
        text += (f"\nAt its last size ({last.sessions} sessions) the autoscaled run's data stall is still "
                 f"{last.stall:.0%}, above the target {target:.0%}, though more sessions add nothing (the fewest "
                 f"fixed sessions within 5 % of the best mean rate: {knee}): the rule stops growing by `min_gain` "
                 "(its decisions below).\n")
    text += "\nThe autoscaler's decisions:\n\n" + "\n".join(f"- {line}" for line in decisions) + "\n"
    return text, [verdict]


# -- output --------------------------------------------------------------------------------------


def svg_plot(timeline: Timeline, path: str, title: str) -> str:
    """Items/s per window against time, joins (green) and drains (red) marked, as an SVG at ``path``."""
    rates = timeline.rates()
    width, height, left, bottom, top, right = 760, 360, 60, 40, 30, 20
    span_t = max([stop for stop, _r in rates] + [1.0])
    span_r = max([rate for _s, rate in rates] + [1.0]) * 1.1

    def x(at: float) -> float:
        return left + (width - left - right) * at / span_t

    def y(rate: float) -> float:
        return height - bottom - (height - bottom - top) * rate / span_r

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13">{title}</text>',
             f'<line x1="{left}" y1="{y(0)}" x2="{width - right}" y2="{y(0)}" stroke="black"/>',
             f'<line x1="{left}" y1="{y(0)}" x2="{left}" y2="{top}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 6}" text-anchor="middle">seconds since the first item</text>',
             f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">'
             f'items/s per {timeline.window_s:g} s window</text>']  # fmt: skip
    for rate in ticks(span_r):
        parts.append(f'<text x="{left - 4}" y="{y(rate) + 4:.1f}" text-anchor="end">{rate:g}</text>')
    for at in ticks(span_t):
        parts.append(f'<text x="{x(at):.1f}" y="{y(0) + 14:.1f}" text-anchor="middle">{at:g}</text>')
    for event in timeline.events:
        color = "green" if event.kind == "join" else "red"
        parts.append(f'<line x1="{x(event.at):.1f}" y1="{y(0)}" x2="{x(event.at):.1f}" y2="{top}" stroke="{color}" '
                     f'stroke-dasharray="4 3"/><text x="{x(event.at) + 3:.1f}" y="{top + 10}" fill="{color}">'
                     f'{event.kind} ({event.servers})</text>')  # fmt: skip
    points = " ".join(f"{x(stop - timeline.window_s / 2):.1f},{y(rate):.1f}" for stop, rate in rates)
    parts.append(f'<polyline points="{points}" fill="none" stroke="steelblue" stroke-width="2"/></svg>')
    with open(path, "w") as out:
        out.write("\n".join(parts) + "\n")
    return f"figure written to {path}"


def ticks(span: float) -> List[float]:
    """Round tick values from 0 to ``span``: steps of 1, 2 or 5 times a power of ten, at most 7 ticks."""
    power = 10 ** math.floor(math.log10(span / 5)) if span > 0 else 1
    step = next(factor * power for factor in (1, 2, 5, 10) if span / (factor * power) <= 6)
    return [round(index * step, 9) for index in range(int(span / step + 1e-9) + 1)]


def verdict_lines(checks: Sequence[Tuple[str, bool]]) -> str:
    """The checks as a markdown list, each with PASS or MISS."""
    return "\n".join(f"- **{'PASS' if passed else 'MISS'}**: {text}" for text, passed in checks) + "\n"


def results_markdown(run: Dict[str, Any], printed: str) -> str:
    """benchmarks/ELASTIC.md: the run's facts, then what it printed."""
    from benchsuite.report.results_md import source_revision

    return "\n".join([
        "# Elastic fleets: joins, drains and the autoscaler",
        "",
        "Written by `benchmarks/bench_elastic.py --results-md benchmarks/ELASTIC.md` from the run it describes",
        "(`make bench-elastic`). Loopback worker servers, `distribution=\"dynamic\"`, sleep-bound items: the",
        "items wait in their workers, so a shared 2-core machine is not what limits the rates.",
        "",
        f"- **Date**: {run['started']} to {run['ended']} UTC; package at `{source_revision(REPO_ROOT)}`",
        f"- **Machine**: {os.cpu_count()} CPUs; load average (1 min) {run['load_start']} at the start, "
        f"{run['load_end']} at the end (other jobs on the machine included)",
        f"- **Command**: `{run['command']}`",
        f"- **Figure**: {run['plot'] or 'none asked for (`--plot`)'} (items/s per window, joins and drains marked; "
        "written by each run, not committed, as `results.png` of `make bench`)",
        "",
        printed,
    ])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the timeline and the autoscaler rounds; print tables and verdicts; exit 1 on a MISS."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=4, help="servers the fleet grows to (default 4)")
    parser.add_argument("--ms", type=float, default=10.0, help="milliseconds each item waits in its worker")
    parser.add_argument("--phase-s", type=float, default=4.0, help="seconds of each timeline phase at the ideal rate")
    parser.add_argument("--window-s", type=float, default=0.5, help="the rate's window, seconds")
    parser.add_argument("--timeline-epochs", type=int, default=1, help="epochs the timeline's items are split into, "
                        "back to back (default 1: one epoch, as a long epoch sees servers come and go)")  # fmt: skip
    parser.add_argument("--max-sessions", type=int, default=4, help="the autoscaler's max_sessions (fixed 1..N)")
    parser.add_argument("--train-ms", type=float, default=4.0, help="the trainer's milliseconds per item")
    parser.add_argument("--epoch-items", type=int, default=400, help="items per epoch of the autoscaler rounds")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the autoscaler against the fixed counts")
    parser.add_argument("--only", choices=("timeline", "autoscale"), help="run one of the two measurements")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 servers, short phases, 3 rounds")
    parser.add_argument("--plot", metavar="PATH", help="write the timeline's figure (SVG) to PATH")
    parser.add_argument("--results-md", metavar="PATH", help="write the run's facts, tables and verdicts to PATH "
                        "(the published one: benchmarks/ELASTIC.md)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.servers, args.phase_s, args.max_sessions, args.epoch_items, args.rounds = 2, 2.5, 2, 150, 3
    setup_environment()
    become_subreaper()
    started, load_start, printed, checks = utc_now(), load_average(), [], []

    def show(text: str) -> None:
        print(text, flush=True)
        printed.append(text)

    key = secrets.token_hex(16)
    pool = ServerPool("elastic", launch_rpcrs_server(key))
    try:
        pool.ensure(max(args.servers, 1))  # started untimed, all at once, as in a deployment
        if args.only in (None, "timeline"):
            timeline = run_timeline(pool, key, args.servers, args.ms, args.phase_s, args.window_s,
                                    args.timeline_epochs)
            text, found = timeline_report(timeline, args.ms, args.timeline_epochs)
            show(text)
            show(windows_table(timeline))
            checks += found
            if args.plot:
                print(svg_plot(timeline, args.plot, f"{args.ms:g} ms items: servers join, then drain"))
        if args.only in (None, "autoscale"):
            results, decisions = autoscale_rounds(pool.ensure(1)[0], key, args.ms, args.train_ms, args.max_sessions,
                                                  args.epoch_items, args.rounds)  # fmt: skip
            text, found = autoscale_report(results, decisions, args.ms, args.train_ms)
            show(text)
            checks += found
    except KeyboardInterrupt:
        return 130
    finally:
        pool.close()
    show("### Verdicts\n\n" + verdict_lines(checks))
    if args.results_md:
        command = " ".join(["python benchmarks/bench_elastic.py", *(sys.argv[1:] if argv is None else argv)])
        run = {"started": started, "ended": utc_now(), "load_start": load_start, "load_end": load_average(),
               "command": command, "plot": args.plot}  # fmt: skip
        text = results_markdown(run, "\n".join(printed))
        with open(args.results_md, "w") as out:
            out.write(text)
        print(f"results written to {args.results_md}")
    return 0 if all(passed for _text, passed in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
