"""Sizing a run's fleet by the data stall (:class:`~rpc_reading_service.Autoscale`).

:func:`decide` is the rule, with no I/O: from the epochs seen so far (sessions, items/s, data
stall) it says whether to open a session, close one or hold, and why. An :class:`Autoscaler`
keeps one run's epochs and decisions (for ``stats()``), picks the server a new session goes to and
calls the user's ``on_scale``; the engine acts on its answer before an epoch starts
(:meth:`Engine.resize <rpc_reading_service.trainer.engine.Engine.resize>`). The rule and its
reasons: docs/deployment.md, autoscaling.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Deque, List, Optional, Sequence, Tuple

from ..config import Autoscale
from ..stats import KEPT_DECISIONS, ReadingServiceStats, ScaleDecision

__all__ = ["Autoscaler", "EpochSample", "decide"]

log = logging.getLogger(__name__)

#: A data stall below this share of ``target_stall`` counts as none: nearly every item was ready
#: when the trainer asked, so the workers waited on the trainer (their credits used up). Between
#: it and the target the fleet holds (a band, so that it does not flap).
IDLE_SHARE = 0.5


@dataclass(frozen=True)
class EpochSample:
    """What the rule reads of one epoch."""

    sessions: int
    items_per_second: float
    data_stall: float


def _ceiling(samples: Sequence[EpochSample], settings: Autoscale) -> Optional[Tuple[int, float]]:
    """The fewest sessions whose last one added less than ``min_gain`` (Cachew's rule), with that gain."""
    found: Optional[Tuple[int, float]] = None
    for before, after in zip(samples, samples[1:]):
        if after.sessions == before.sessions + 1 and before.data_stall > settings.target_stall:
            gain = after.items_per_second / max(before.items_per_second, 1e-9) - 1.0
            if gain < settings.min_gain and (found is None or after.sessions < found[0]):
                found = (after.sessions, gain)
    return found


def decide(samples: Sequence[EpochSample], settings: Autoscale) -> Tuple[str, int, str]:
    """The decision after the last of ``samples``: ``(action, sessions, reason)``, the action
    ``"grow"``, ``"shrink"`` or ``"hold"``.

    Args:
        samples: The run's epochs so far, oldest first (at least one).
        settings: The bounds, target stall and minimal gain.
    """
    last = samples[-1]
    n, stall, target = last.sessions, last.data_stall, settings.target_stall
    if n < settings.min_sessions:
        return "grow", settings.min_sessions, f"{n} sessions is below min_sessions={settings.min_sessions}"
    if n > settings.max_sessions:
        return "shrink", settings.max_sessions, f"{n} sessions is above max_sessions={settings.max_sessions}"
    if stall > target:
        ceiling = _ceiling(samples, settings)
        if ceiling is not None and n >= ceiling[0]:
            return "hold", n, (
                f"data stall {stall:.1%} above the target {target:.1%}, but session {ceiling[0]} raised items/s "
                f"by {ceiling[1]:+.1%} (less than min_gain={settings.min_gain:.0%}): more sessions do not help"
            )
        if n >= settings.max_sessions:
            return "hold", n, f"data stall {stall:.1%} above the target {target:.1%}, at max_sessions={n}"
        return "grow", n + 1, f"data stall {stall:.1%} above the target {target:.1%}"
    if stall > target * IDLE_SHARE:
        return "hold", n, f"data stall {stall:.1%} within the target {target:.1%}"
    if n <= settings.min_sessions:
        return "hold", n, f"data stall {stall:.1%} below half the target, at min_sessions={n}"
    starved = [sample.sessions for sample in samples if sample.data_stall > target and sample.sessions >= n - 1]
    if starved:
        return "hold", n, f"data stall {stall:.1%} below half the target, but the trainer starved with {min(starved)} sessions"
    return "shrink", n - 1, f"data stall {stall:.1%} below half the target: the workers wait on the trainer"


class Autoscaler:
    """One run's autoscaling: its epochs, decisions and counts.

    Args:
        settings: The user's :class:`~rpc_reading_service.Autoscale`.
        per_server: The most sessions one server hosts.
    """

    def __init__(self, settings: Autoscale, per_server: int):
        self.settings, self.per_server = settings, per_server
        self.samples: List[EpochSample] = []
        self.decisions: Deque[ScaleDecision] = collections.deque(maxlen=KEPT_DECISIONS)
        self.ups = self.downs = 0
        self.wanted_servers: Optional[int] = None
        self._asked: Optional[int] = None
        self._warming = True

    def plan(
        self, stats: ReadingServiceStats, sample: EpochSample, ranks: Sequence[str], servers: Sequence[str], joined: int = 0
    ) -> Tuple[ScaleDecision, List[str]]:
        """The decision after the epoch of ``stats`` (``sample``: its sessions, items/s and data stall
        past its first item), and the ranks to run the next epoch on: ``ranks`` (the server of each
        now) grown on ``servers`` (the servers known) or cut; logged. Not judged: the run's first
        epoch (its graphs were new: started, warmed up, caches cold) and a fleet that ``joined``
        servers since (it is judged after the next epoch)."""
        sessions = len(ranks)
        if not self._warming:
            self.samples.append(sample)
        if self._warming or joined:
            why = "the run's first epoch is a warm-up" if self._warming else f"{joined} servers joined the run"
            action, wanted, reason = "hold", sessions, why
        else:
            action, wanted, reason = decide(self.samples, self.settings)
        self._warming = False
        decision = ScaleDecision(stats.epoch + 1, action, sessions, wanted, reason)
        self.ask(wanted, len(servers), stats)
        placed = list(ranks[:wanted])
        while len(placed) < wanted:
            server = self.place(placed, servers)
            if server is None:
                reason += f"; the {len(servers)} servers known host {len(placed)} sessions"
                decision = ScaleDecision(decision.epoch, action, sessions, wanted, reason)
                break
            placed.append(server)
        log.log(logging.INFO if action != "hold" else logging.DEBUG, "autoscale before epoch %d: %s %d -> %d sessions (%s)",
                decision.epoch, action, sessions, wanted, reason)  # fmt: skip
        return decision, placed

    def done(self, decision: ScaleDecision, sessions: int) -> None:
        """Record ``decision``, carried out up to ``sessions`` sessions."""
        self.decisions.append(decision)
        self.ups += max(0, sessions - decision.sessions_before)
        self.downs += max(0, decision.sessions_before - sessions)

    def place(self, ranks: Sequence[str], servers: Sequence[str]) -> Optional[str]:
        """The server of ``servers`` a new session goes to: the one with the fewest sessions among
        ``ranks`` (the server of each rank) that has room; None when none has."""
        counts = {server: 0 for server in servers}
        for address in ranks:
            counts[address] = counts.get(address, 0) + 1
        room = [server for server in servers if counts[server] < self.per_server]
        return min(room, key=lambda server: counts[server]) if room else None

    def ask(self, wanted: int, servers: int, stats: ReadingServiceStats) -> None:
        """Call ``on_scale`` if the ``wanted`` sessions need another number of servers than the
        ``servers`` known (once per number asked for); a failing callback is logged."""
        needed = -(-wanted // self.per_server)
        self.wanted_servers = needed
        on_scale = self.settings.on_scale
        if on_scale is None or needed == servers or needed == self._asked:
            return
        self._asked = needed
        log.info("autoscale asks for %d worker servers (the run knows %d)", needed, servers)
        try:
            on_scale(needed, stats)
        except Exception:  # noqa: BLE001 - the user's scaling code must not end the training
            log.exception("Autoscale.on_scale(%d, stats) failed; the run goes on with the servers it has", needed)
