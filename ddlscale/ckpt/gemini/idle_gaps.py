"""Training's communication as Gemini's sender sees it: whether the wire is busy now, and where its gaps are.

The checkpointer marks each iteration's start; the sender thread polls :meth:`TrainingWire.now` (the
sync backend's ledger: busy periods completed, one in flight, or the iteration's sync over). Until the
chunk plan is settled, every iteration's gaps between training collectives are recorded
(:meth:`TrainingWire.record`); the plan settles once the iterations are stable, or after 3x
``profile_steps`` with what there is (:mod:`~ddlscale.ckpt.gemini.interleave` has the arithmetic).
"""

from __future__ import annotations

import statistics
from typing import Any

from ddlscale import clock
from ddlscale.ckpt.gemini.interleave import Wire, busy_periods, chunks_per_gap, gaps, is_stable, profile_gaps


class TrainingWire:
    """The sync backend's collectives, watched. ``sync``: the strategy's backend (None: no ledger, the
    wire always reads idle and finished); ``summary``: how the plan was settled, for the run's figures."""

    def __init__(self, sync: Any, profile_steps: int, mu: float) -> None:
        self.sync, self.profile_steps, self.mu = sync, profile_steps, mu
        self.steps_at_start = 0
        self.profiled: list[list[float]] = []  # gaps per profiled iteration
        self.horizons: list[float] = []  # each profiled iteration's span, start to deadline
        self.summary: dict[str, Any] = {}

    def iteration_started(self) -> None:
        self.steps_at_start = self.sync.steps if self.sync is not None else 0

    def now(self) -> Wire:
        """The training communication now (the sender thread polls this)."""
        if self.sync is None or self.sync.steps != self.steps_at_start:
            return Wire(completed=0, idle=True, finished=True)  # this iteration's sync is over
        spans = [(r.start, r.end if r.end is not None else float("inf")) for r in list(self.sync.ledger.records)]
        periods = busy_periods(spans)
        in_flight = bool(periods) and periods[-1][1] == float("inf")
        return Wire(completed=len(periods) - in_flight, idle=not in_flight, finished=False)

    def record(self, start: float, chunk_s: float | None) -> list[int] | None:
        """One iteration's gaps (it began at ``start``; now is its deadline); the chunk plan once the
        profile is settled (chunks of ``chunk_s`` seconds, measured by the sender), else None."""
        now = clock.now()
        records = self.sync.last_stats.collectives if self.sync is not None else []
        busy = [(r.start - start, (r.end if r.end is not None else now) - start) for r in records]
        self.profiled.append(gaps(busy, now - start))
        self.horizons.append(now - start)
        recent = slice(-self.profile_steps, None)
        if len(self.horizons) < self.profile_steps or chunk_s is None:
            return None
        stable = is_stable(self.horizons[recent])
        if not stable and len(self.horizons) < 3 * self.profile_steps:
            return None  # keep profiling; after 3x the steps, go with what there is
        gap_s = profile_gaps(self.profiled[recent])
        plan = chunks_per_gap(gap_s, chunk_s, self.mu)
        self.summary = {"profiled_steps": len(self.horizons), "stable": stable, "gaps": len(gap_s),
                        "idle_s": sum(gap_s), "horizon_s": statistics.median(self.horizons[recent]),
                        "chunk_s": chunk_s, "planned_chunks": sum(plan)}
        return plan
