"""Every scenario by name, in the order a run measures them.

One module per scenario family holds its plan (parent side), its measurement (child side) and
its table.  Later tables go here as modules of their own: distribution policies, a sleep-bound
stage and one slow worker, the worker-side cache, scaling to 2-128 sessions.
"""

from __future__ import annotations

from benchsuite.scenarios import first_item, memory, scaling, sessions, sweep, throughput
from benchsuite.scenarios.base import Scenario

SCENARIOS: dict[str, Scenario] = {
    s.name: s for module in (throughput, sweep, scaling, sessions, memory, first_item) for s in module.SCENARIOS
}
