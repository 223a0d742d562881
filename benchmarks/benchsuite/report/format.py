"""Formatting of results: numbers, ratios, plain-text tables, and reading a scenario's points."""

from __future__ import annotations

import math
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
    rates = data.get("round_rates") or []
    if len(rates) < 2:
        return "-"
    return " / ".join(fmt_num(r / scale if r else None, spec) for r in rates)


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


def point_value(results: dict, contender: str, key: str, workers: int) -> Optional[float]:
    """``key`` of a contender's point at ``workers`` workers (one-stream contenders: any)."""
    for p in points_of(results, contender):
        if "error" not in p and (p.get("workers") == workers or contender in ONE_STREAM):
            return p.get(key)
    return None


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
    """The note under a table whose rates are the best of several rounds."""
    if params.get("rounds", 1) < 2:
        return []
    return [f"rate: the best of {params['rounds']} rounds (all contenders once per round, interleaved; "
            f"'rounds' lists each round's rate); {', '.join(ONE_ROUND)}: one round"]
