"""Where a planned sync (``sync=espresso``, ``sync=cupcake``) is in its life: its phases as types.

A planned run goes through these phases, in order, each a number of steps:

    WARMUP -> PROFILE -> [SETTLE -> CALIBRATE] -> [TRIAL_SETTLE <-> TRIAL] -> PLAN

WARMUP and PROFILE run dense allreduce in DDP's buckets (PROFILE's steps are recorded); SETTLE and
CALIBRATE run one calibration layout after another (every tensor compressed alone, fused, mixed;
CALIBRATE's work and steps are timed), only with more than one rank, a compressor and
``calibrate_steps`` > 0; then the plan is computed. With several
candidate plans (Espresso's ``trial_steps`` > 0) they take turns on the cluster, a turn being one
TRIAL_SETTLE step on the candidate's groups and one measured TRIAL step; the fastest is kept and
PLAN runs it from then on. :class:`PlanningSession` holds the phase and what each phase counts;
the sync (:class:`~ddlscale.sync.compressed.planned.PlannedSync`) acts on its transitions.
"""

from __future__ import annotations

import copy
import enum
import statistics
from dataclasses import dataclass, field
from typing import Any

from ddlscale.plan.profile import StepRecorder


class Phase(enum.Enum):
    """A planned sync's phase; the value is how metrics.csv's ``sync_phase`` names it."""

    WARMUP = "warmup"
    PROFILE = "profile"
    SETTLE = "settle"
    CALIBRATE = "calibrate"
    TRIAL_SETTLE = "trial settle"
    TRIAL = "trial"
    PLAN = "plan"

    @property
    def dense(self) -> bool:
        """Whether its steps run dense allreduce (the profiling executor)."""
        return self in (Phase.WARMUP, Phase.PROFILE)


@dataclass
class Trial:
    """Candidate plans taking turns on the cluster, round robin; each turn one settling step on the
    candidate's groups, then one measured step."""

    plans: list[dict[str, Any]]  # CompressionPlan.to_dict() of each candidate, the model's choice first
    periods: list[list[float]]  # measured step periods per candidate
    index: int = 0  # the candidate in force
    turn: int = 0  # turns finished
    seen: int = 0  # steps of the current turn run
    last_end: float | None = None  # when the last step ended (clock); None: not yet timed

    @classmethod
    def of(cls, plans: list[dict[str, Any]]) -> Trial:
        return cls(plans, [[] for _ in plans])

    @property
    def label(self) -> str:
        """The candidate in force, as plan.txt and the summary name it."""
        plan = self.plans[self.index]
        return plan["context"].get("candidate", plan["system"])

    def turns(self, steps_each: int) -> int:
        """Turns the whole trial takes: every candidate ``steps_each`` times."""
        return len(self.plans) * steps_each

    def step(self, now: float, steps_each: int) -> bool:
        """Time the step that ended at ``now``; after a turn, move to the next candidate. True when the
        turn just ended (a new candidate is in force, or, past the last turn, the trial is over)."""
        self.seen += 1
        if self.seen > 1 and self.last_end is not None:  # a turn's first step settles on new groups
            self.periods[self.index].append(now - self.last_end)
        self.last_end = now
        if self.seen < 2:
            return False
        self.turn += 1
        self.seen = 0
        if not self.over(steps_each):
            self.index = self.turn % len(self.plans)
        return True

    def over(self, steps_each: int) -> bool:
        return self.turn >= self.turns(steps_each)

    def medians(self) -> list[float]:
        return [statistics.median(p) for p in self.periods]

    def state(self) -> dict[str, Any]:
        """As a checkpoint keeps it (the clock is not carried over)."""
        return {"plans": copy.deepcopy(self.plans), "index": self.index, "turn": self.turn,
                "periods": copy.deepcopy(self.periods), "seen": self.seen, "last_end": None}

    @classmethod
    def resumed(cls, state: dict[str, Any]) -> Trial:
        """From :meth:`state`; a resumed trial re-settles on its candidate's groups before it measures
        again (a checkpoint without ``turn`` resumes at its candidate's turn)."""
        saved = copy.deepcopy(state)
        return cls(saved["plans"], saved["periods"], saved["index"], saved.get("turn", saved["index"]))


@dataclass
class PlanningSession:
    """The phase a planned sync is in and the counts that move it on; pure bookkeeping, no collectives.

    warmup_steps, profile_steps: dense steps, the first not measured. settle_steps, calibrate_steps:
    the configured counts of calibration's settling and measured steps (``calibrate_steps`` 0 skips
    calibration); each layout is given its own by :meth:`start_calibration`. trial_steps: turns per
    candidate (0: no trial).
    """

    warmup_steps: int
    profile_steps: int
    settle_steps: int
    calibrate_steps: int
    trial_steps: int
    phase: Phase = Phase.WARMUP
    recorder: StepRecorder = field(default_factory=StepRecorder)  # the dense steps, as they run
    calibrated: int = 0  # the layout's calibration steps run, settling ones included
    layout_settle: int = 0  # the layout's settling steps
    layout_measured: int = 0  # the layout's measured steps
    calibration_ends: list[float] = field(default_factory=list)  # clock at each measured calibration step's end
    # Per measured calibration step: the previous step's end (where the ranks met) to backward end,
    # on this rank's clock — the compressed layout's lag between ranks, compared across ranks.
    calibration_spans: list[float] = field(default_factory=list)
    trial: Trial | None = None

    @property
    def label(self) -> str:
        """The phase as metrics.csv and ``sync_phase_steps`` name it (a trial's with its candidate)."""
        if self.trial is not None and self.phase in (Phase.TRIAL_SETTLE, Phase.TRIAL):
            return f"{self.phase.value}: {self.trial.label}"
        return self.phase.value

    # -- transitions: each returns whether the sync must act ------------------------------------------
    def profiled(self) -> bool:
        """After a dense step: move WARMUP on to PROFILE; True once every profiled step has run."""
        steps = len(self.recorder.steps)
        self.phase = Phase.WARMUP if steps < self.warmup_steps else Phase.PROFILE
        return steps >= self.warmup_steps + self.profile_steps

    def start_calibration(self, settle: int | None = None, measured: int | None = None) -> None:
        """A calibration layout begins: ``settle`` settling steps, then ``measured`` measured ones
        (default: the configured counts)."""
        self.phase, self.calibrated, self.calibration_ends, self.calibration_spans = Phase.SETTLE, 0, [], []
        self.layout_settle = self.settle_steps if settle is None else settle
        self.layout_measured = self.calibrate_steps if measured is None else measured

    def calibration_step(self, now: float, backward_end: float | None = None) -> bool:
        """After a calibration step ending at ``now`` (its backward ended at ``backward_end``, if
        given); True once the last one has run. (A settling step is not measured: its end only starts
        the next step's period.)"""
        self.calibrated += 1
        if backward_end is not None and not self.settling() and self.calibration_ends:
            self.calibration_spans.append(backward_end - self.calibration_ends[-1])
        self.calibration_ends.append(now)  # a step's end: the next one's start
        if self.settling():
            self.calibration_ends = self.calibration_ends[-1:]
        self.phase = Phase.SETTLE if self.calibrated < self.layout_settle else Phase.CALIBRATE
        return self.calibrated >= self.layout_settle + self.layout_measured

    def settling(self) -> bool:
        """Whether the calibration step that just ran was a settling one (its work is not kept)."""
        return self.calibrated <= self.layout_settle

    def calibration_periods(self) -> list[float]:
        """The measured calibration steps' periods (used once)."""
        ends, self.calibration_ends = self.calibration_ends, []
        return [b - a for a, b in zip(ends, ends[1:], strict=False)]

    def adopted(self) -> None:
        """A plan was put in force: a candidate of the trial, settling on its groups, or the kept one."""
        self.phase = Phase.TRIAL_SETTLE if self.trial is not None else Phase.PLAN

    def trial_step(self, now: float) -> bool:
        """After a step on trial; True when its turn ended."""
        ended = self.trial.step(now, self.trial_steps)
        self.phase = Phase.TRIAL_SETTLE if self.trial.seen == 0 else Phase.TRIAL
        return ended
