"""Formatting of results: numbers, ratios, plain-text tables, and reading a scenario's points."""

from __future__ import annotations

import math
import statistics
from typing import Callable, Iterable, Optional

from benchsuite.contenders import ONE_ROUND, ONE_STREAM

GB = 1e9

def fmt_ratio(value: Optional[float]) -> str:
    """``79.8x``, ``0.86x``, ``0.0047x`` (three significant digits at most), or ``-``."""
    if value is None or not math.isfinite(value):
        return "-"
    if value >= 100:
        return f"{value:,.0f}x"
    if value >= 10:
        return f"{value:.1f}x"
    if value >= 0.01:
        return f"{value:.2f}x"
    return f"{value:.2g}x"


def fmt_size(nbytes: int) -> str:
    """``1 KiB``, ``256 KiB``, ``64 MiB``."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def fmt_num(value: Optional[float], spec: str, unit: str = "") -> str:
    """``value`` formatted with ``spec`` and ``unit``, or ``-``."""
    if value is None:
        return "-"
    return f"{value:{spec}}{unit}"


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b``, or None when either is missing (or ``b`` is zero)."""
    return a / b if a is not None and b else None


def na(outcome: dict, width: int = 90) -> str:
    """``n/a (reason)`` for a contender that did not produce a result."""
    reason = outcome.get("reason", "unknown")
    if len(reason) > width:
        reason = reason[: width - 3] + "..."
    return f"n/a ({reason})"


def render_table(title: str, headers: list[str], rows: list, notes: Iterable[str] = ()) -> str:
    """A plain-text table.  A row is a list of cells, or ``(first_cell, text)`` for a
    row whose text spans all the other columns (``n/a (...)``)."""
    widths = [len(h) for h in headers]
    for row in rows:
        cells = [row[0]] if isinstance(row, tuple) else row
        widths = [max(w, len(str(c))) for w, c in zip(widths, cells)] + widths[len(cells):]

    text_last = headers[-1] in ("note", "detail")  # a text column: left-aligned

    def line(cells: list[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        rest = [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:])]
        if text_last and len(cells) == len(headers):
            rest[-1] = str(cells[-1])
        return "  ".join([first] + rest).rstrip()

    out = [title, line(headers), line(["-" * w for w in widths])]
    for row in rows:
        out.append(f"{str(row[0]).ljust(widths[0])}  {row[1]}" if isinstance(row, tuple) else line(row))
    out.extend(f"  {note}" for note in notes)
    return "\n".join(out)


def value(results: dict, contender: str, key: str) -> Optional[float]:
    """``key`` of a contender's data in one scenario's results, or None."""
    outcome = results.get(contender) or {}
    return (outcome.get("data") or {}).get(key) if outcome.get("ok") else None


def rounds_text(data: dict, scale: float, spec: str) -> str:
    """Every round's rate of a point (the best one is the point's rate), or '-'."""
    rates = list(data.get("round_rates") or [])
    while rates and rates[-1] is None:  # rounds it did not run in (only the paired ones run the last)
        rates.pop()
    if len(rates) < 2:
        return "-"
    return " / ".join(fmt_num(r / scale if r else None, spec) for r in rates)


def paired_ratio(point: Optional[dict], reference: Optional[dict], key: str) -> Optional[dict]:
    """``point``'s rate over ``reference``'s, paired round by round: the median of the ratios of
    the rounds that measured both (each round's two rates taken minutes apart at most, with
    the load of that moment, and who went first alternating: see ``runner.round_order``),
    not the best round of one over the best round of the other.  Points of one round only:
    that round's ratio.

    Returns ``{"median", "ratios", "first", "rates"}`` (``ratios[i]`` the i-th common round's,
    ``first[i]`` whether ``point`` ran before ``reference`` in it, ``rates`` the two rates of
    the round whose ratio is nearest the median), or None when a side is missing."""
    if not point or not reference:
        return None
    rates = point.get("round_rates")
    reference_rates = reference.get("round_rates")
    if not rates or not reference_rates:
        if not point.get(key) or not reference.get(key):
            return None
        value = point[key] / reference[key]
        return {"median": value, "ratios": [value], "first": [None], "rates": (point[key], reference[key])}
    positions = point.get("round_positions") or [None] * len(rates)
    reference_positions = reference.get("round_positions") or [None] * len(reference_rates)
    rounds = [(a, b, pa, pb) for a, b, pa, pb in zip(rates, reference_rates, positions, reference_positions)
              if a and b]
    if not rounds:
        return None
    ratios = [a / b for a, b, _, _ in rounds]
    median = statistics.median(ratios)
    nearest = min(range(len(ratios)), key=lambda i: abs(ratios[i] - median))
    first = [None if pa is None or pb is None else pa < pb for _, _, pa, pb in rounds]
    return {"median": median, "ratios": ratios, "first": first, "rates": rounds[nearest][:2]}


def paired_ratio_at(results: dict, contender: str, workers: int, reference: str, reference_workers: int,
                    item_bytes: Optional[int] = None, key: str = "bytes_per_s") -> Optional[dict]:
    """:func:`paired_ratio` of two contenders' points (:func:`point_at`), or None."""
    return paired_ratio(point_at(results, contender, workers, item_bytes),
                        point_at(results, reference, reference_workers, item_bytes), key)


#: The per-item limits (``contenders.limits``) no DataLoader2 reading service passes: what W workers'
#: DataPipe graphs make at most (``graph-limit``, at the same W) and what a trainer's DataLoader2
#: hands on at most (``loader-limit``, one stream).
PER_ITEM_LIMITS = ("graph-limit", "loader-limit")
#: Both at once with a plain move between them, by the raw stream whose kind of socket it moves items
#: over: W processes' graphs sending each tensor's bytes to a DataLoader2 that hands them on (nothing
#: encoded, framed or credited), at the same W as the reading service it is set beside.
PIPELINE_LIMITS = {"raw-socket": "pipeline-limit", "raw-unix": "pipeline-limit-unix"}
#: W processes making the items and copying each once into warm shared memory (``contenders.limits``):
#: what making and copying each item costs local workers whose hand-over copies it, nothing else paid.
COPY_LIMIT = "copy-limit"


def paired_ceiling(point: Optional[dict], limits: dict, key: str = "bytes_per_s") -> Optional[dict]:
    """``point``'s rate over the lowest of ``limits``' rates (name -> point), paired round by round
    as :func:`paired_ratio` pairs two points: the median over the rounds that measured them all.

    Returns ``{"median", "ratios", "binding", "rates", "limit_rates"}`` of the round whose ratio is
    nearest the median: ``binding`` the lowest limit's name, ``rates`` the point's rate and that
    limit's, ``limit_rates`` every limit's rate by name; or None when a point is missing."""
    if not point or not all(limits.values()):
        return None
    series = {name: limit.get("round_rates") for name, limit in limits.items()}
    ours = point.get("round_rates")
    if not ours or not all(series.values()):  # points of one round
        ours, series = [point.get(key)], {name: [limit.get(key)] for name, limit in limits.items()}
    rounds = []
    for index, rate in enumerate(ours):
        rates = {name: rates_of[index] if index < len(rates_of) else None for name, rates_of in series.items()}
        if rate and all(rates.values()):
            rounds.append((rate / min(rates.values()), rate, rates))
    if not rounds:
        return None
    median = statistics.median(ratio_ for ratio_, _, _ in rounds)
    _, rate, rates = min(rounds, key=lambda found: abs(found[0] - median))
    binding = min(rates, key=rates.get)
    return {"median": median, "ratios": [ratio_ for ratio_, _, _ in rounds], "binding": binding,
            "rates": (rate, rates[binding]), "limit_rates": rates}


def ceiling_at(results: dict, contender: str, workers: int, reference: str,
               item_bytes: Optional[int] = None, limits: tuple = PER_ITEM_LIMITS) -> Optional[dict]:
    """:func:`paired_ceiling` of ``contender`` at ``workers`` under the lowest of ``reference`` (one
    stream) and ``limits`` (at the same W; the :data:`PER_ITEM_LIMITS` unless given), or None."""
    limits = {name: point_at(results, name, workers, item_bytes) for name in (reference, *limits)}
    return paired_ceiling(point_at(results, contender, workers, item_bytes), limits)


def paired_text(paired: dict) -> str:
    """Every round's ratio of a :func:`paired_ratio`, ``*`` after those in which the first
    contender ran first: ``0.91* / 0.97 / 1.02*``."""
    return " / ".join(f"{r:.2f}" + ("*" if first else "") for r, first in zip(paired["ratios"], paired["first"]))


def budget_note(data: dict) -> str:
    """Why an epoch has fewer items than it should: time budget, or items lost (a bug)."""
    if data.get("stopped_by_budget"):
        return "stopped at time budget"
    if data.get("items", 0) != data.get("expected_items", data.get("items")):
        return f"WRONG COUNT: {data['items']} of {data['expected_items']} items"
    return ""




def points_of(results: dict, contender: str) -> list[dict]:
    """A contender's points in a per-worker-count scenario (partial ones if it failed)."""
    outcome = results.get(contender) or {}
    return (outcome.get("data") or {}).get("points") or outcome.get("partial") or []


def point_at(results: dict, contender: str, workers: int, item_bytes: Optional[int] = None) -> Optional[dict]:
    """A contender's point at ``workers`` workers (one-stream contenders: any) and, in a scenario
    of several item sizes, at ``item_bytes``; or None."""
    for p in points_of(results, contender):
        if ("error" not in p and (p.get("workers") == workers or contender in ONE_STREAM)
                and (item_bytes is None or p.get("item_bytes") == item_bytes)):
            return p
    return None


def point_value(results: dict, contender: str, key: str, workers: int,
                item_bytes: Optional[int] = None) -> Optional[float]:
    """``key`` of a contender's :func:`point_at` ``workers`` (and ``item_bytes``), or None."""
    point = point_at(results, contender, workers, item_bytes)
    return None if point is None else point.get(key)


def rss_per_session_mib(results: dict, contender: str) -> tuple[Optional[float], str]:
    """The slope of the trainer's sleep-bound peak RSS from the smallest W to the largest."""
    points = [p for p in points_of(results, contender) if "error" not in p and p.get("peak_rss_mib")]
    if len(points) < 2:
        return None, f"{contender}: fewer than two points"
    low, high = min(points, key=lambda p: p["workers"]), max(points, key=lambda p: p["workers"])
    slope = (high["peak_rss_mib"] - low["peak_rss_mib"]) / (high["workers"] - low["workers"])
    return slope, (f"{low['peak_rss_mib']:.0f} MiB at W={low['workers']}, "
                   f"{high['peak_rss_mib']:.0f} MiB at W={high['workers']}")


def outcome_rows(results: dict, cells: Callable[[str, dict], list]) -> list:
    """One table row per contender (``[name] + cells(name, data)``); ``n/a`` rows for failures."""
    return [[name] + cells(name, outcome["data"]) if outcome.get("ok") else (name, na(outcome))
            for name, outcome in results.items()]


def point_rows(results: dict, cells: Callable[[str, dict], list]) -> list:
    """One table row per (contender, worker count); ``n/a`` rows for failures."""
    rows = []
    for name, outcome in results.items():
        for p in points_of(results, name):
            label = f"{name} W={p['workers']}" if name not in ONE_STREAM else name
            rows.append((label, f"n/a ({p['error'][:90]})") if "error" in p else [label] + cells(name, p))
        if not outcome.get("ok"):
            rows.append((name, na(outcome)))
    return rows


def rounds_notes(params: dict) -> list[str]:
    """The note under a table whose rates are the best of several rounds (and, with
    ``params['paired']``, whose ratios are paired round by round)."""
    if params.get("rounds", 1) < 2:
        return []
    paired = params.get("paired")
    best = f"the best of {params.get('rounds_of_all', params['rounds'])} rounds"
    if paired:
        best += f" ({params['rounds']} for {', '.join(paired)})"
    notes = [f"rate: {best} (all contenders once per round, interleaved; "
             f"'rounds' lists each round's rate); {', '.join(ONE_ROUND)}: one round"]
    if paired:
        notes.append(
            "vs ...: the median of per-round ratios (each round's rate over the reference's rate in the same round), "
            "not best over best; every round's ratio is in the paired-ratios table below. Each round runs the "
            "contenders compared in it next to each other, every other round in reverse order (worker counts too), "
            "so that each side goes first in turn")
    return notes
