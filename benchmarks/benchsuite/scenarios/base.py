"""What a scenario is, and what every scenario shares: worker counts, rounds, timeouts."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from benchsuite.contenders import CONTENDERS
from benchsuite.contenders.base import Contender
from benchsuite.isolation import describe_exception

ROUNDS = 2  # full run: throughput scenarios run every contender twice, interleaved; best round kept
STARTUP_ALLOWANCE_S = 40.0


@dataclasses.dataclass
class Scenario:
    """A named measurement: which contenders, their parameters, how to report them."""

    name: str
    contenders: tuple[str, ...]
    plan: Callable[[bool], dict]
    measure: Callable[[Contender, dict, Callable], dict]
    report: Callable[["Scenario", dict, dict], str]
    timeout_s: Callable[[dict], float]


def worker_counts(params: dict, name: str) -> list[int]:
    """The worker counts contender ``name`` runs in a scenario, smallest first."""
    if "workers_list" in params:
        return list(params["workers_list"])
    counts = (params.get("workers_by_contender") or {}).get(name, params.get("workers", 1))
    return list(counts) if isinstance(counts, (list, tuple)) else [counts]


def measure_points(workers_list: list[int], measure_point: Callable[..., dict],
                   emit: Callable[[dict], None], coordinates: Sequence[dict] = ({},)) -> dict:
    """``{"points": [...]}``: ``measure_point(W, **c)`` for each coordinate ``c`` (such as
    ``{"item_bytes": 65536}``; by default none) and each worker count, emitted as it comes; each
    point holds its coordinates and ``workers``.  A failing point becomes a point with its
    ``error`` (one broken point must not hide the others); if every point fails, the first
    error is raised."""
    points = []
    for coordinate in coordinates:
        for workers in workers_list:
            try:
                point = measure_point(workers, **coordinate)
            except Exception as exc:
                point = {"error": describe_exception(exc)}
            point.update(coordinate, workers=workers)
            emit(point)
            points.append(point)
    if all("error" in p for p in points):
        raise RuntimeError(points[0]["error"])
    return {"points": points}


def timeout_budgeted(params: dict) -> float:
    """A task's timeout: startup allowance, then per point its budget twice and some slack."""
    points = max(len(worker_counts(params, name)) for name in CONTENDERS)
    return STARTUP_ALLOWANCE_S + points * (10 + 2 * params["budget_s"])


# the contenders of most scenarios
DATALOADERS = ("in-process", "MPRS", "torch-DataLoader", "RPCRS-local", "RPCRS-tcp")
