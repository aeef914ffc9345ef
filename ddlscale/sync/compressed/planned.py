"""The planned syncs, ``sync=espresso`` and ``sync=cupcake``: profile with dense sync, plan once, execute.

1. For ``profile_steps`` steps after ``warmup_steps`` warm-up steps the backend is dense bucketed allreduce
   (exactly :class:`~ddlscale.sync.dense.DenseAllreduce`) and records, per gradient, when its hook
   fired, when backward ended and how long the step was. Then calibration times each option family
   the planner may choose (compressor x scheme x layout; ``calibrate_families``, by default all of
   them) in its own compressed training steps, one layout after another: every tensor compressed
   alone (layer-wise, as ``sync=compress`` runs), each dtype's tensors fused into one group
   (``calibrate_fused``), and for Espresso a mixed step (``calibrate_mixed``: the largest tensor
   compressed, the rest dense). The first layout settles for ``settle_steps`` steps, every later
   one for one (the trial's rule), then each takes up to ``calibrate_steps`` measured steps, the
   whole within ``calibrate_budget`` steps (:meth:`PlannedSync.calibration_schedule`). The
   compressor's work in each group is timed as it runs (:attr:`CompressSync.work`): what
   compression costs inside compressed training steps, beside the other ranks' work — on emulated
   machines sharing a host's cores several times what the same calls cost in a benchmark loop.
   (Timed inside dense steps instead, it is worse still: there it competes with the dense
   allreduce's reductions and traffic, which compressed steps do not have.)
2. Then (with ``network_latency: measured``) every rank times small collectives on the sync group,
   which gives the per-message latency the cost model's alpha stands for on this cluster; every rank
   measures the configured compressor's encode/decode cost on its device at the same time (as they
   compress in training, contending for whatever they share) over a grid of sizes, scaled by what
   the calibration steps measured against that grid at the same sizes; every rank's profiled
   steps give how far behind rank 0 the slowest rank ends backward (collectives wait for it:
   :attr:`Profile.lag_s`), and each calibrated layout's steps how far behind under it; rank 0
   builds the :class:`~ddlscale.plan.profile.Profile` (saved as ``plan_profile.json`` in the run
   directory), fits the model to the steps it measured — an allreduce factor so that the dense
   step in this backend's buckets takes what the profiled steps took
   (:func:`~ddlscale.plan.planner.allreduce_efficiency`), then per calibrated family its lags and
   its CPU per group and per element, either way, so that its layer-wise and fused steps take what
   they took (:func:`~ddlscale.plan.planner.fit_families`; :attr:`Profile.families`: the
   compressor's families left out take the configured one's CPU) — computes the plan
   (:meth:`PlannedSync.compute_plan`), writes ``plan.json`` / ``plan.txt`` and broadcasts it: every
   rank executes the identical plan, whatever its own timings were.
3. From the next step on, :class:`~ddlscale.sync.compressed.backend.CompressSync` runs the plan: per-tensor
   choices and fusion groups, each group launched as soon as it is complete, in order. Rank 0 times
   each group's encode, decode and finish as they run and keeps their medians over the last steps
   in ``plan_work.json``, to set beside what the model predicted for each group.

The phases are types (:mod:`.session`: :class:`~.session.Phase`, the trial's :class:`~.session.Trial`),
and the sync holds its two executors, running dense allreduce while it profiles and CompressSync from
calibration on. The plan is part of :meth:`state_dict`, so a resumed run keeps it instead of profiling again. A run
resumed at another world size (:meth:`PlannedSync.load_resharded`) profiles and plans again: the plan
was made for the cluster it profiled. The error-feedback residuals and compressor state it merged
from the saved ranks wait, laid out per tensor, through the dense steps and go into the groups that
follow them.
"""

from __future__ import annotations

import copy
import json
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddlscale import clock
from ddlscale.comm.probe import MEASURED, probe_latency
from ddlscale.compress.compressor import Compressor
from ddlscale.compress.memory import Memory
from ddlscale.plan.aggregation import SCHEMES
from ddlscale.plan.choices import Choices, TensorChoice
from ddlscale.plan.planner import (
    FamilySteps,
    allreduce_efficiency,
    configured_option,
    cupcake_plan,
    dense_plan,
    espresso_plan,
    fit_families,
    layerwise_plan,
    option_label,
)
from ddlscale.plan.pricing import CostModel, Option
from ddlscale.plan.profile import (
    CompressorProfile,
    Profile,
    StepRecorder,
    TensorProfile,
    family,
    matrix_kept,
    profile_compressor,
    slowest_lag,
)
from ddlscale.plan.result import CompressionPlan
from ddlscale.sync.compressed.backend import CompressSync
from ddlscale.sync.compressed.compress_config import (
    ALL,
    CALIBRATE_BUDGET,
    TRIAL_STEPS,
    EspressoConfig,
    PlannedConfig,
)
from ddlscale.sync.compressed.regroup import layouts_of, layouts_state
from ddlscale.sync.compressed.schemes import GroupWork
from ddlscale.sync.compressed.session import Phase, PlanningSession, Trial
from ddlscale.sync.dense import Bucket, DenseAllreduce
from ddlscale.sync.grad_sync import GradSync
from ddlscale.units import parse_bandwidth

PROFILE_FILE, PLAN_FILE, PLAN_TEXT, WORK_FILE = "plan_profile.json", "plan.json", "plan.txt", "plan_work.json"
PLAN_SOURCES = {"espresso": "espresso search", "cupcake": "cupcake", "dense": "dense", "layer-wise": "layer-wise"}
# Calibration layouts: every tensor alone; each dtype's tensors in one group (sync.calibrate_fused); the
# largest tensor alone under the family, the rest dense alone (sync.calibrate_mixed). Also the suffix
# of a family's key in the steps kept per layout.
ALONE, FUSED, MIXED = "", "@fused", "@mixed"
WORK_STEPS, WORK_EVERY = 20, 5  # plan_work.json: medians over the kept plan's last 20 steps, rewritten every 5


def _hydra_run_dir() -> str | None:
    """The Hydra run directory when built inside a Hydra app (train.py), else None."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return str(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None
    except Exception:  # composed configs without a run (tests) have no output_dir
        return None


class PlannedSync(GradSync):
    """Base of the planned backends. It holds its executors and runs one per phase
    (:class:`~ddlscale.sync.compressed.session.Phase`): dense allreduce in DDP's buckets while it
    warms up and profiles (:attr:`dense`), then CompressSync (:attr:`compressed`) on the calibration
    groups, the candidates on trial and the kept plan. Where the session is lives in :attr:`session`.

    Args:

    compressor, memory: as CompressSync takes them (``compressor=`` and ``memory=`` groups; a null
        memory is the compressor's default: residual for a biased one, none for an unbiased one).
    comm, hierarchical: the configured uniform choice — Cupcake's option for every group,
        Espresso's layer-wise baseline and the option of its Cupcake candidate.
    profile_steps: dense steps measured before planning.
    warmup_steps: dense steps run before those and not measured (the first allocates; on a busy host
        the first second of a run is often slower than the rest: start-up work of the other ranks);
        with the profiled ones, at least the compressor's own warm-up (DGC's ``warmup_steps``), whose
        steps the dense ones stand in for, so calibration measures the compressor as the plan runs it.
    calibrate_steps: measured steps per calibration layout, at most (the budget may allow fewer, at
        least one): their compressor work scales the benchmarked costs, their lengths and lags fit
        each family's terms (0: no calibration; trust the benchmark and the network model).
    calibrate_families: the option families calibration times, each in its own steps: ``all`` (the
        default) every family the planner may choose — Cupcake's configured one; Espresso's every
        scheme that carries the compressor, flat and (with machines) hierarchical — or a list of
        scheme names (``/hier`` for the hierarchical layout: ``[alltoall, zen]``) beside the
        configured one. Each gets its own CPU and lags in :attr:`Profile.families`; a family left
        out takes the configured family's CPU and the dense lag. A list is refused where no
        calibration runs (``calibrate_steps=0`` or ``compressor=none``).
    calibrate_fused: also time every calibrated family with each dtype's tensors fused into one
        group. The layer-wise and fused steps give its cost per group and per element and its lag
        in each layout (:func:`~ddlscale.plan.planner.family_cpu`): fused groups are priced from
        fused steps. One layer-wise step alone charges everything per group, which under-prices
        plans of a few large groups, and its lag is not a fused group's.
    settle_steps: steps the first calibration layout runs first, not measured; every later layout
        settles for one step on its new groups (as a trial's turn does). The compressed path's
        first steps run slow (measured on the emulated cluster, lstm: 305, 214, 137 ms, then
        100-120 like the layer-wise run's steady steps): measured in them, the per-group overhead
        came out ~5 ms too high and the prediction of a fused plan over by as much per group.
    calibrate_budget: the most steps calibration may take, settling included
        (:meth:`calibration_schedule`): the default, 24, is what the earlier default spent in
        compressed steps before its plan ran (3 settling and 3 layer-wise steps, then an 18-step
        trial: 3 candidates x 3 turns x a settling and a measured step), so calibrating every family
        costs no more steps than the trial it replaces.
    network_bandwidth, network_latency: the network the plan assumes (tc units: ``1gbit``, ``100us``),
        as the sparse backends take them; ``network_latency: measured`` times small collectives on
        the sync group before planning and takes the alpha that explains them (:func:`probe_latency`).
    gpus_per_machine: ranks per machine; above 1 hierarchical options exist (and machine groups
        are built at set-up).
    run_dir: where ``plan_profile.json``, ``plan.json`` and ``plan.txt`` go (default: the Hydra run
        directory; ``null`` outside Hydra: not saved).
    bench_budget_s: seconds per measured (compressor, size) point.
    bucket_mb, first_bucket_mb: DDP's buckets while profiling, and the dense candidate's.
    trial_steps: 0 (the default) trusts the calibrated model. Above 0, the backend's candidate plans
        (:meth:`candidate_plans`; the model's choice first) take ``trial_steps`` turns each on the
        cluster, round robin, a turn being one settling step on the candidate's groups and one
        measured step; the plan with the lowest median measured step on rank 0 is kept, with the
        measured and predicted times of every candidate in its notes. The model's errors then cost
        a few steps, not the run. Turns, not blocks: steps right after planning run slow and speed
        up over several steps, which in sequential blocks favours whichever candidate goes last.
    """

    system = "?"
    schema = PlannedConfig  # its keys and their checks
    calibrate_mixed = False  # Espresso's key (EspressoSync): a mixed calibration step

    def __init__(self, compressor: Compressor | None = None, comm: str = "allgather",
                 memory: Memory | str | None = None, memory_beta: float = 0.9, hierarchical: bool = False, profile_steps: int = 3,
                 network_bandwidth: str = "1gbit", network_latency: str = MEASURED, gpus_per_machine: int = 1,
                 run_dir: str | None = None, bench_budget_s: float = 0.02, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, trial_steps: int = TRIAL_STEPS,
                 calibrate_steps: int = 3, warmup_steps: int = 1, settle_steps: int = 3,
                 calibrate_families: Sequence[str] | str = ALL, calibrate_fused: bool = True,
                 calibrate_budget: int = CALIBRATE_BUDGET):
        self.schema(comm=comm, memory=memory if isinstance(memory, str) else None, memory_beta=memory_beta,
                    hierarchical=hierarchical, profile_steps=profile_steps, network_bandwidth=network_bandwidth,
                    network_latency=network_latency, gpus_per_machine=gpus_per_machine, run_dir=run_dir,
                    bench_budget_s=bench_budget_s, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb,
                    trial_steps=trial_steps, calibrate_steps=calibrate_steps, warmup_steps=warmup_steps,
                    settle_steps=settle_steps, calibrate_families=calibrate_families, calibrate_fused=calibrate_fused,
                    calibrate_budget=calibrate_budget, **self._own_keys())  # refuses what no run can use
        super().__init__()
        self.compressed = CompressSync(compressor=compressor, comm=comm, memory=memory, memory_beta=memory_beta,
                                       hierarchical=False, local_size=gpus_per_machine, fusion="tensor",
                                       bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb)
        self.dense = DenseAllreduce(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb)
        if compressor is not None and compressor.prepares_dense:
            self.dense.before_launch = self._dense_precondition  # DGC's momentum in the dense steps too
        # A compressor's warm-up (DGC's sparsity schedule) runs as dense steps, which it counts
        # (Compressor.synced_dense): calibration then measures it as the plan will run it. Calibrated
        # inside the warm-up, lstm's DGC groups cost 2-4x what they did after it (espresso_cupcake:
        # Cupcake predicted 232-259 ms for a plan that ran 61-65 ms).
        compressor_warmup = compressor.warmup_steps_left() if compressor is not None else 0
        self.session = PlanningSession(max(warmup_steps, compressor_warmup - profile_steps), profile_steps,
                                       settle_steps, calibrate_steps, trial_steps)
        self.calibrate_families = _families(calibrate_families)  # None: all the planner may choose
        for scheme, _ in (self.calibrate_families or []) if compressor is not None else ():
            self.compressed.check_choice(TensorChoice("default", scheme, False), "sync.calibrate_families")
        self.calibrate_fused, self.calibrate_budget = bool(calibrate_fused), int(calibrate_budget)
        if self.calibrate_families and (not calibrate_steps or compressor is None or compressor.name == "none"):
            # Calibration runs only for a compressor, on calibration steps: a list of families asked
            # for is refused rather than ignored (the defaults, all of them fused and mixed, are
            # what calibration does when it runs).
            why = "sync.calibrate_steps=0" if not calibrate_steps else "compressor=none (nothing to calibrate)"
            raise ValueError(f"sync.calibrate_families needs calibration steps with a compressor; got {why}")
        # Calibration's queue of (scheme, hierarchical, layout: alone, fused or mixed).
        self._families_left: list[tuple[str, bool, str]] = []
        self._calibrating: tuple[str, bool, str] | None = None  # the queue's entry in force
        self._families_done: dict[str, dict[str, Any]] = {}  # per layout calibrated: periods, spans, option
        # The compressor's work in every measured calibration step (mixed ones aside), and those steps.
        self.calibration_work: list[GroupWork] = []
        self.calibration_steps = 0
        self.comm_scheme, self.hierarchical = comm, bool(hierarchical)
        self.network_config = {"bandwidth": network_bandwidth, "latency": network_latency,
                               "gpus_per_machine": gpus_per_machine}
        self.latency_requested = network_latency
        self.run_dir = run_dir if run_dir is not None else _hydra_run_dir()
        self.bench_budget_s = float(bench_budget_s)
        self.computed: CompressionPlan | None = None  # the plan in force (None until planning)
        self._executed: list[list[GroupWork]] = []  # the kept plan's work per group, per step (rank 0, the last WORK_STEPS)
        self._work_steps = 0
        self._machines_built = False

    def _own_keys(self) -> dict[str, Any]:
        """A subclass's keys beyond these, which its constructor set before calling this one's."""
        return {k: getattr(self, k) for k in self.schema.keys() if k not in PlannedConfig.keys() and hasattr(self, k)}

    # -- what a subclass decides -------------------------------------------------------------------
    def compute_plan(self, profile: Profile, model: CostModel) -> CompressionPlan:
        raise NotImplementedError

    def candidate_plans(self, profile: Profile, model: CostModel) -> list[CompressionPlan]:
        """The plans worth trying on the cluster when ``trial_steps`` > 0, the model's choice first."""
        return [self.compute_plan(profile, model)]

    # -- the executors -----------------------------------------------------------------------------
    @property
    def executor(self) -> DenseAllreduce:
        """The executor of this phase's steps: dense allreduce while profiling, else CompressSync."""
        return self.dense if self.session.phase.dense else self.compressed

    def _hierarchical_possible(self) -> bool:
        k = self.compressed.local_size or 1
        return 1 < k < self.world_size and self.world_size % k == 0

    def on_setup(self) -> None:
        self.dense.serve(self)
        self.compressed.serve(self)
        if not self._machines_built:  # every rank, once: plans may use the machine groups later
            self._machines_built = True
            compressed = self.compressed
            compressed.intra = compressed.inter = None
            if self._hierarchical_possible():
                compressed.local_size, compressed.intra, compressed.inter = compressed.machine_communicators(
                    compressed.local_size)
            elif self.hierarchical and self.rank == 0:
                warnings.warn(f"sync.hierarchical=true needs machines of 1 < sync.gpus_per_machine < {self.world_size} "
                              f"ranks dividing them (got {compressed.local_size}): planning flat groups only",
                              UserWarning, stacklevel=2)
        if self.session.phase.dense:
            # Dense buckets use no error feedback, and keep compressor state (DGC's momentum) per
            # tensor: what state there is while they run (that, and what a resharded resume carried
            # in) waits per tensor, and is regrouped from there into the groups that follow
            # (calibration's, a plan's) when they are built.
            self.dense.on_setup()
            self.compressed.state_layouts = self.compressed.per_tensor_layouts()
        else:
            self.compressed.on_setup()

    def _dense_precondition(self, bucket: Bucket) -> None:
        """A dense step's bucket, each member as a plan's dense group sends it
        (:meth:`CompressSync.dense_precondition`: DGC's momentum), its state kept per tensor, the
        layout state waits in through the dense steps."""
        for slot, i in enumerate(bucket.members):
            bucket.views[slot].copy_(self.compressed.dense_precondition(bucket.views[slot], self.names[i]))

    def on_grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        if self.session.phase.dense:
            self.session.recorder.ready(index)
        self.executor.on_grad_ready(index, param)

    def finish(self) -> None:
        session = self.session
        self.step_phase = session.label  # what this step did, for the trainer's metrics (it may move on below)
        if session.phase.dense:
            session.recorder.backward_end()
            self.dense.finish()
            session.recorder.step_end()
            if session.profiled():
                for compressor in self.compressed.compressors.values():
                    compressor.synced_dense(len(session.recorder.steps))
                if session.calibrate_steps and self.world_size > 1 and self.compressed.compressors["default"].name != "none":
                    self._start_calibration()
                else:
                    self._plan_and_switch()
            return
        backward_end = clock.now()
        self.compressed.finish()
        if session.phase in (Phase.SETTLE, Phase.CALIBRATE):
            if session.calibration_step(clock.now(), backward_end) and self._family_calibrated():
                self._plan_and_switch()
            elif session.settling():  # residuals and buffers allocated, warming up: its work is not kept
                self.compressed.work.clear()
        elif session.trial is not None:
            self._trial_step()
        else:
            self._record_work()

    def summary_fields(self) -> dict[str, Any]:
        return self.compressed.summary_fields()

    def report(self) -> dict[str, Any]:
        return {**self.plan_report(), **super().report()}

    def default_compressor(self) -> Compressor:
        return self.compressed.default_compressor()

    # -- what the trainer reports: the phase of each step (metrics.csv), the kept plan (summary.json) --
    def plan_report(self) -> dict[str, Any]:
        """The plan the run kept, for its summary: where it came from, its predicted step, and in what
        state the run left it (a short run can end before planning or during the trial)."""
        plan, trial = self.computed, self.session.trial
        if plan is None:
            return {"plan_source": None, "plan_state": f"none: the run ended in the {self.session.label} phase, "
                                                      "before planning"}
        if trial is not None:
            return {"plan_source": None, "plan_state": f"none kept: the run ended in turn {trial.turn + 1} "
                                                       f"of {trial.turns(self.session.trial_steps)} of the trial "
                                                       f"({self.session.label})"}
        report = {"plan_source": PLAN_SOURCES.get(plan.system, plan.system),
                  "plan_candidate": plan.context.get("candidate"),
                  "plan_predicted_step_s": plan.iteration_s, "plan_units": len(plan.units)}
        if "trial_step_s" in plan.context:
            report["plan_state"] = "kept after its trial on the cluster"
            report["plan_trial_step_s"] = dict(plan.context["trial_step_s"])
        else:
            report["plan_state"] = "chosen by the cost model"
        # Who decided: the model (its choice kept, with or without a trial) or the trial (it measured
        # another candidate faster than the model's choice).
        model_choice = plan.context.get("model_choice", plan.context.get("candidate"))
        report["plan_chosen_by"] = "model" if plan.context.get("candidate") == model_choice else "trial"
        return report

    # -- calibration -----------------------------------------------------------------------------
    def option_families(self) -> list[tuple[str, bool]]:
        """The option families (scheme, hierarchical) of the configured compressor the planner may
        choose: Cupcake's configured one (every group takes it)."""
        return [self._configured_family()]

    def calibration_layouts(self) -> list[tuple[str, bool, str]]:
        """What calibration times, most needed first: the configured family layer-wise and fused,
        Espresso's mixed step, then each other family layer-wise, then each fused (a family whose
        fused step the budget leaves out is still priced from its own layer-wise one)."""
        configured = self._configured_family()
        families = self.option_families() if self.calibrate_families is None else [configured,
                                                                                   *self.calibrate_families]
        others = [f for f in dict.fromkeys(families) if f != configured]
        fused = [FUSED] if self.calibrate_fused else []
        return ([(*configured, layout) for layout in [ALONE, *fused, *([MIXED] if self.calibrate_mixed else [])]]
                + [(*f, ALONE) for f in others] + [(*f, layout) for f in others for layout in fused])

    def calibration_schedule(self) -> tuple[list[tuple[str, bool, str]], int, int]:
        """(the layouts calibration runs, measured steps each, steps in all): the most layouts of
        :meth:`calibration_layouts` that fit ``calibrate_budget`` with one measured step each, then
        as many measured steps each (up to ``calibrate_steps``) as still fit. Steps in all:
        ``settle_steps`` for the first layout, one settling step for each later one, and the
        measured ones. (The first layout is run whatever the budget.)"""
        layouts, settle = self.calibration_layouts(), self.session.settle_steps

        def steps(count: int, each: int) -> int:
            return settle + count * each + count - 1

        count = len(layouts)
        while count > 1 and steps(count, 1) > self.calibrate_budget:
            count -= 1
        each = max(1, min(self.session.calibrate_steps, (self.calibrate_budget - settle - count + 1) // count))
        return layouts[:count], each, steps(count, each)

    def _start_calibration(self) -> None:
        """Each layout of :meth:`calibration_schedule` in turn, its work timed (CompressSync.work)."""
        for scheme, hier in self.calibrate_families or []:
            if hier and not self._hierarchical_possible():
                raise ValueError(f"sync.calibrate_families: {scheme}/hier needs several machines of several "
                                 f"ranks each (sync.gpus_per_machine / sync.local_size)")
        layouts, self._measured_each, total = self.calibration_schedule()
        if self.rank == 0:
            left = [_layout_label(entry) for entry in self.calibration_layouts()[len(layouts):]]
            print(f"ddlscale {self.system}: calibrating {len(layouts)} layout(s), {self._measured_each} measured "
                  f"step(s) each, {total} steps in all (sync.calibrate_budget={self.calibrate_budget}): "
                  + ", ".join(map(_layout_label, layouts))
                  + (f"; left out for the budget: {', '.join(left)}" if left else ""), flush=True)
        self._families_left, self._families_done = list(layouts), {}
        self.calibration_work, self.calibration_steps = [], 0
        self._calibrate_next(first=True)

    def _configured_family(self) -> tuple[str, bool]:
        """The configured option's (scheme, hierarchical), as calibration runs it."""
        return self.comm_scheme, self.hierarchical and self._hierarchical_possible()

    def _calibrate_next(self, first: bool = False) -> None:
        """Settle and calibrate the next layout of the queue: every tensor alone, each dtype's
        tensors in one group (fused), or the largest tensor alone under it and every other one
        dense alone (mixed)."""
        scheme, hierarchical, layout = self._calibrating = self._families_left.pop(0)
        self.session.start_calibration(self.session.settle_steps if first else 1, self._measured_each)
        compressed = self.compressed
        compressed.work = []
        choice = TensorChoice("default", scheme, hierarchical)
        if layout == MIXED:
            largest = max(range(len(self.params)), key=lambda i: (self.params[i].numel(), -self.backward_order.index(i)))
            compressed.choices = Choices(default=TensorChoice("none", "allreduce", False),
                                         tensors={self.names[largest]: choice})
        else:
            by_dtype: dict[torch.dtype, list[str]] = {}
            for name, p in zip(self.names, self.params, strict=True):
                by_dtype.setdefault(p.dtype, []).append(name)
            compressed.choices = Choices(default=choice, groups=list(by_dtype.values()) if layout == FUSED else None)
        configured = (scheme, hierarchical) == self._configured_family()
        compressed.check_choice(choice, "sync.comm" if configured else "sync.calibrate_families")
        self.on_setup()

    def _family_calibrated(self) -> bool:
        """After a layout's last calibration step: keep its periods, spans and work, then start the
        next layout (False), or True after the last one."""
        scheme, hierarchical, layout = self._calibrating
        periods = self.session.calibration_periods()
        self._families_done[family("default", scheme, hierarchical) + layout] = {
            "periods": periods, "spans": list(self.session.calibration_spans),
            "option": Option("default", scheme, hierarchical), "layout": layout}
        if layout != MIXED:  # its groups are the compressor's alone (a mixed step's are mostly dense)
            self.calibration_work += self.compressed.work or []
            self.calibration_steps += len(periods)
        if not self._families_left:
            return True
        self._calibrate_next()
        return False

    def calibrate(self, costs: dict[str, CompressorProfile]) -> dict[str, CompressorProfile]:
        """The configured compressor's fits scaled by what its work cost in the calibration steps (every
        family's measured layer-wise and fused steps; a mixed step's groups are mostly dense), encode
        and decode each: the median over groups and steps of
        (seconds in training) / (seconds the fit says), weighted by the latter — the large groups
        that dominate a step dominate it, and one group caught by a scheduling stall (tens of ms on
        an oversubscribed host) does not."""
        work, steps = self.calibration_work, self.calibration_steps
        self.calibration_work, self.calibration_steps, self.compressed.work = [], 0, None
        if not work or "default" not in costs:
            return costs
        prof = costs["default"]
        ratio = {kind: _weighted_median([(g.seconds[kind] / fitted, fitted) for g in work
                                         if (fitted := sum(c * fit(n) for n, c in g.calls[kind])) > 0]) or 1.0
                 for kind, fit in (("encode", prof.encode), ("decode", prof.decode))}
        return {**costs, "default": prof.calibrated(ratio["encode"], ratio["decode"], groups=len(work),
                                                    steps=steps)}

    def calibrate_network(self, profile: Profile) -> Profile:
        """``profile`` with the allreduce efficiency that makes the model's dense step in this
        backend's buckets what the profiled dense steps took (with calibration steps on)."""
        if not self.session.calibrate_steps:
            return profile
        factor = allreduce_efficiency(profile, self._planning_compressors(), self.dense.first_bucket_bytes,
                                      self.dense.bucket_bytes)
        efficiency = {**profile.network.get("efficiency", {}), "allreduce": factor}
        return replace(profile, network={**profile.network, "efficiency": efficiency})

    def fit_families(self, profile: Profile, lags: dict[str, float]) -> Profile:
        """``profile`` with what calibration measured of each family it timed, layer-wise and fused
        (their median periods on this rank, the slowest rank's lags: :func:`~ddlscale.plan.planner.fit_families`),
        and of Espresso's mixed step."""
        done, self._families_done = self._families_done, {}
        if "default" not in profile.compressors or not done:
            return profile

        def median(key: str) -> float | None:
            periods = done.get(key, {}).get("periods")
            return statistics.median(periods) if periods else None

        measured = {entry["option"]: FamilySteps(median(key), median(key + FUSED), lags.get(key), lags.get(key + FUSED))
                    for key, entry in done.items() if entry["layout"] == ALONE and entry["periods"]}
        compressors = self._planning_compressors()
        configured = configured_option(CostModel(profile, compressors), self.comm_scheme, self.hierarchical)
        profile = fit_families(profile, measured, configured, median(configured.family + MIXED), compressors)
        if configured in measured:  # for the record (plan.txt's note, the experiments' tables)
            terms, default = profile.families[configured.family], profile.compressors["default"]
            steps = measured[configured]
            facts = {"group_s": terms["cpu_s"], "element_s": terms["cpu_per_element_s"],
                     "layerwise_step_s": steps.layerwise_s,
                     **({} if steps.fused_s is None else {"fused_step_s": steps.fused_s})}
            profile = replace(profile, compressors={**profile.compressors, "default": replace(
                default, calibration={**default.calibration, **facts})})
        return profile

    # -- planning --------------------------------------------------------------------------------
    def _plan_and_switch(self) -> None:
        if self.latency_requested == MEASURED:
            self._measure_latency()
        # Every rank at once, so the measured costs carry the contention training runs under (on
        # emulated machines sharing cores, several times the cost measured alone); rank 0's are used.
        try:
            costs, failure = self.calibrate(self.profile_compressors()), None
        except Exception as exc:  # said in the gather below, so no rank waits in it for this one
            costs, failure = None, exc
        lag, family_lags = self._slowest_lag(failure)

        def plan() -> list[dict[str, Any]]:
            before = self.calibrate_network(replace(self.build_profile(costs), lag_s=lag))
            profile = self.fit_families(before, family_lags)
            model = CostModel(profile, self._planning_compressors())
            plans = (self.candidate_plans(profile, model) if self.session.trial_steps
                     else [self.compute_plan(profile, model)])
            note = _calibration_note(profile)
            for candidate in plans if note else ():
                candidate.notes.append(note)
            self._save(plans[0], profile)
            return [candidate.to_dict() for candidate in _distinct(plans)]

        plans = self._decided_on_rank0(plan, "planning")
        self.session.trial = Trial.of(plans) if len(plans) > 1 else None
        self.adopt(CompressionPlan.from_dict(plans[0]))
        if self.session.trial is not None:
            self.session.trial.last_end = clock.now()

    def _decided_on_rank0(self, decide: Callable[[], Any], what: str) -> Any:
        """``decide()`` run on rank 0 and broadcast to every rank. An error there is raised on every
        rank, naming ``what``, instead of leaving the others waiting in the broadcast."""
        message: list[Any] = [None]
        if self.rank == 0:
            try:
                message = [decide()]
            except Exception as exc:  # tell the other ranks instead of leaving them in the broadcast
                message = [{"error": f"{type(exc).__name__}: {exc}"}]
        self._broadcast(message)
        if isinstance(message[0], dict) and "error" in message[0]:
            raise RuntimeError(f"sync={self.system}: {what} failed on rank 0: {message[0]['error']}")
        return message[0]

    def _broadcast(self, message: list[Any]) -> None:
        if self.world_size > 1:
            # One-off, outside the accounted traffic, like the backward order: set-up, not sync.
            dist.broadcast_object_list(message, src=self.comm._global(0), group=self.comm.group)

    def _trial_step(self) -> None:
        """After each step on trial: time it; after a turn, hand over to the next candidate, and after
        the last turn keep the fastest."""
        trial = self.session.trial
        if not self.session.trial_step(clock.now()):
            return
        if not trial.over(self.session.trial_steps):
            self.adopt(CompressionPlan.from_dict(trial.plans[trial.index]))
            return
        measured = [trial.medians()]
        self._broadcast(measured)  # rank 0's clock decides for everyone
        medians = measured[0]
        plans = [CompressionPlan.from_dict(d) for d in trial.plans]
        labels = [p.context.get("candidate", p.system) for p in plans]
        checked = ", ".join(f"{label} {m * 1e3:.1f} ms (predicted {p.iteration_s * 1e3:.1f})"
                            for label, p, m in zip(labels, plans, medians, strict=True))
        best = min(range(len(medians)), key=medians.__getitem__)
        kept = plans[best]
        kept.notes.append(f"checked on the cluster, median of {self.session.trial_steps} steps each (taken in turns) "
                          f"on rank 0: {checked}; "
                          f"kept {labels[best]}")
        kept.context["trial_step_s"] = dict(zip(labels, medians, strict=True))
        kept.context["model_choice"] = labels[0]
        self.session.trial = None
        self.adopt(kept)
        self._save(kept)

    def _record_work(self) -> None:
        """Rank 0, once a plan is kept: each group's work in each step (encode, decode, and the time
        it held the training thread after backward), their medians over the last ``WORK_STEPS``
        steps written to ``plan_work.json`` — where the plan's time went, to set beside the model's
        prediction. The first step after adopting a plan is not timed (it rebuilds the groups)."""
        if self.rank != 0 or self.run_dir is None:
            return
        compressed = self.compressed
        step, compressed.work = compressed.work, []
        if step is None or len(step) != len(compressed.buckets):
            return
        self._executed = [*self._executed[1 - WORK_STEPS:], step]
        self._work_steps += 1
        if self._work_steps % WORK_EVERY:
            return
        groups = [{"names": [self.names[i] for i in bucket.members], "numel": bucket.numel,
                   **{f"{kind}_s": statistics.median(done[b].seconds[kind] for done in self._executed)
                      for kind in ("encode", "decode", "finish")}}
                  for b, bucket in enumerate(compressed.buckets)]
        report = {"steps": len(self._executed), "groups": groups}
        (Path(self.run_dir) / WORK_FILE).write_text(json.dumps(report, indent=1))

    def adopt(self, plan: CompressionPlan) -> None:
        """Execute ``plan`` from the next step on (rebuilds the groups): a trial's candidate while the
        session has a trial, else the kept plan."""
        self._put_in_force(plan)
        self.session.recorder = StepRecorder()
        self.compressed.work, self._executed, self._work_steps = None, [], 0  # recorded again from the next step's end
        self.session.adopted()
        if self.is_set_up:
            self.on_setup()

    def _put_in_force(self, plan: CompressionPlan) -> None:
        """``plan`` made CompressSync's choices (checked against its compressors and schemes)."""
        choices = plan.to_choices()
        for name, choice in choices.tensors.items():
            self.compressed.check_choice(choice, f"plan[{name}]")
        self.computed, self.compressed.choices = plan, choices

    def _measure_latency(self) -> None:
        """Every rank: time small collectives; rank 0's figures go into the profile's network."""
        probe = probe_latency(self.comm.group, self.world_size, parse_bandwidth(self.network_config["bandwidth"]))
        self.network_config.update(latency=f"{probe['allreduce_alpha_s'] * 1e6:.1f}us",
                                   exchange_latency=f"{probe['allgather_alpha_s'] * 1e6:.1f}us", latency_probe=probe)

    def _slowest_lag(self, failure: Exception | None = None) -> tuple[float, dict[str, float]]:
        """Every rank: how much later than this one the slowest rank ended backward in the profiled
        dense steps (:func:`slowest_lag` over every rank's :meth:`StepRecorder.spans`), and in each
        calibrated layout's steps (by its key: :func:`family` plus the layout). The gather also
        carries ``failure``, this rank's error in profiling its compressors: every rank raises then,
        naming the rank that failed, where the others would wait for it in the next collective."""
        if self.world_size < 2:
            if failure is not None:
                raise failure
            return 0.0, {}
        mine = {"spans": self.session.recorder.spans(self.session.warmup_steps),
                "families": {key: done["spans"] for key, done in self._families_done.items()},
                "error": None if failure is None else f"{type(failure).__name__}: {failure}"}
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.comm.group)  # set-up, not sync
        failed = [(rank, g["error"]) for rank, g in enumerate(gathered) if g["error"] is not None]
        if failed:
            said = "; ".join(f"rank {self.comm._global(rank)}: {error}" for rank, error in failed)
            raise RuntimeError(f"sync={self.system}: profiling the compressors failed on {said}") from failure
        families = {key: [g["families"].get(key, []) for g in gathered] for key in self._families_done}
        lags = {key: slowest_lag(spans, self.rank) for key, spans in families.items() if all(spans)}
        return slowest_lag([g["spans"] for g in gathered], self.rank), lags

    def _planning_compressors(self) -> dict[str, Compressor]:
        compressors = self.compressed.compressors
        default = compressors["default"]
        return {"none": compressors["none"]} if default.name == "none" else {
            "none": compressors["none"], "default": default}

    def profile_compressors(self) -> dict[str, CompressorProfile]:
        """The planning compressors' per-group costs on this rank's device, up to everything fused."""
        total = sum(p.numel() for p in self.params)  # Cupcake may fuse everything into one buffer
        return {key: profile_compressor(comp, total, self.device, self.bench_budget_s, self.compressed.memory)
                for key, comp in self._planning_compressors().items()}

    def build_profile(self, compressors: dict[str, CompressorProfile]) -> Profile:
        """This rank's measurements as a Profile, with ``compressors`` from :meth:`profile_compressors`."""
        order = list(self.backward_order)
        summary = self.session.recorder.summary(order, self.session.warmup_steps)
        default = self.compressed.compressors["default"]
        variable = default.name != "none" and not default.fixed_size
        probe = copy.deepcopy(default) if variable else None
        tensors = []
        for position, i in enumerate(order):
            p = self.params[i]
            factors = matrix_kept(default, p.shape, p.dtype)  # PowerSGD: its factors, from the shape
            kept = {} if factors is None else {"default": factors}
            if probe is not None:
                # What one rank compresses is about its share of the average (residuals aside); a tensor
                # without a gradient is sent as zeros. Every unit gets a fraction: one missing would
                # price its fused groups at the largest payload.
                if p.grad is None:
                    grad = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                else:
                    grad = (p.grad.to_dense() if p.grad.is_sparse else p.grad).reshape(-1) / self.world_size
                kept["default"] = probe.compress(grad, f"probe/{self.names[i]}").payload[0].numel() / max(1, p.numel())
            tensors.append(TensorProfile(self.names[i], p.numel(), tuple(p.shape), str(p.dtype),
                                         summary["ready_s"][position], kept))
        return Profile(tensors, summary["backward_end_s"], summary["rest_s"], self.world_size,
                       dict(self.network_config), compressors, str(self.device), summary["step_s"],
                       summary["steps"], widens=self.compressed.memory.widens)

    def _save(self, plan: CompressionPlan, profile: Profile | None = None) -> None:
        """Print ``plan`` and write it (with ``profile``, when given) into the run directory (rank 0)."""
        if self.rank != 0:
            return
        text = plan.describe()
        when = f"after {profile.steps} profiled steps" if profile is not None else "kept after its trial"
        print(f"ddlscale {self.system}: plan {when}\n{text}", flush=True)
        if self.run_dir is None:
            return
        out = Path(self.run_dir)
        if profile is not None:
            profile.save(out / PROFILE_FILE)
        (out / PLAN_FILE).write_text(json.dumps(plan.to_dict(), indent=1))
        (out / PLAN_TEXT).write_text(text + "\n")

    def written_files(self) -> list[Path]:
        """The plan in force, as :meth:`_save` wrote it (on rank 0; none before planning)."""
        if self.run_dir is None:
            return []
        return [path for path in (Path(self.run_dir) / PLAN_FILE, Path(self.run_dir) / PLAN_TEXT) if path.is_file()]

    # -- checkpointed state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # CompressSync's state as it saves it, with the groups of the executor in force (DDP's
        # buckets while profiling), then the plan and the trial.
        trial = self.session.trial
        return {**super().state_dict(), **self.compressed.carried_state(),
                "groups": [list(b.members) for b in self.executor.buckets],
                "state_layouts": layouts_state(self.compressed.state_layouts),
                "planned": None if self.computed is None else self.computed.to_dict(),
                "trial": None if trial is None else trial.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_plan(state)
        self.compressed.load_carried(state)
        if self.computed is None and "state_layouts" in state:
            # Saved before a plan (warm-up, profiling, calibration): this run goes through those phases
            # again, so the state waits per tensor, as after a resharded resume, not in the groups of
            # a calibration layout that may not come back (a fused one's residuals would be orphaned).
            self.compressed.wait_per_tensor(layouts_of(state["state_layouts"]))
        super().load_state_dict(state)

    def load_resharded(self, states: list[dict[str, Any]], rank: int, world_size: int) -> None:
        """Restore from the states of a run of ``len(states)`` ranks: the saved plan is not loaded
        (made from a profile of other ranks, another network, perhaps other machines), so this run
        warms up, profiles (and calibrates, trials) again at its own size and plans for it.

        The merged residuals and compressor state (total kept) are carried, not flushed into the first
        dense step: compressor state such as momenta cannot be sent and must be carried into the new
        plan's groups anyway, and residuals ride along the same way — error feedback stays exact however
        many steps they wait. They wait laid out per tensor (:meth:`CompressSync.carry_per_tensor`)
        through the dense steps. (A saved hierarchical group's state is refused.)"""
        self.compressed.carry_per_tensor(states, world_size)
        super().load_resharded(states, rank, world_size)

    def _load_plan(self, state: dict[str, Any]) -> None:
        trial = state.get("trial")
        self.session.trial = None if trial is None else Trial.resumed(trial)
        saved = state.get("planned")
        if saved is not None:  # before the groups are rebuilt for the restored order
            self._put_in_force(CompressionPlan.from_dict(saved))
        if self.computed is not None:
            self.session.adopted()


class EspressoSync(PlannedSync):
    """``sync=espresso``: per tensor, whether and how to compress, chosen on the simulated iteration.

    After profiling, Espresso (:mod:`ddlscale.plan.espresso`) picks for every tensor one option — dense
    allreduce, or the configured compressor under allreduce (summable payloads), allgather, alltoall,
    gather or zen (sparsifiers), flat or hierarchical — and may fuse tensors (runs of equal options, or
    Cupcake's groups of the configured option) where the model says it is faster. The plan, with each
    tensor's predicted saving, is printed and saved as ``plan.txt``.

    With ``trial_steps`` > 0 (0 by default: calibration took its place) the plan is checked on the
    cluster before it is kept: Espresso's plan, Cupcake's and dense allreduce take turns for a few
    steps each and the fastest measured stays, so a cost-model error costs those steps only.

    Args (besides :class:`PlannedSync`'s):

    offload: run Algorithm 2 (move some compressions to the CPU side device). CompressSync compresses
        on the training thread only, so offloaded choices are predictions of what a side stream would
        give, not what runs: off by default, and the plan says so when on.
    fuse: consider fused plans (equal-option runs, Cupcake groups of ``comm``); off: one tensor each.
    calibrate_mixed: also settle and time a mixed step (on by default), after the configured
        family's layer-wise and fused ones: the largest tensor under the configured option, every
        other one dense alone. What its dense groups cost beyond the model is charged to every
        uncompressed group (flat or hierarchical) of a plan that compresses
        (:func:`~ddlscale.plan.planner.beside_overhead`,
        :meth:`~ddlscale.plan.pricing.CostModel.beside_compression`); without it such groups are
        priced as if they ran alone.
    """

    system = "espresso"
    schema = EspressoConfig

    def __init__(self, *args, offload: bool = False, fuse: bool = True, calibrate_mixed: bool = True, **kwargs):
        # Checked by the schema, with the rest.
        self.offload, self.fuse, self.calibrate_mixed = offload, fuse, calibrate_mixed
        super().__init__(*args, **kwargs)

    def option_families(self) -> list[tuple[str, bool]]:
        """Every family Espresso may choose for the configured compressor: each scheme that carries
        it, flat and, where machines of several ranks exist, hierarchical (the cost model's options)."""
        out = []
        for hierarchical in (False, True) if self._hierarchical_possible() else (False,):
            for name in SCHEMES:
                try:
                    self.compressed.check_choice(TensorChoice("default", name, hierarchical), "sync.calibrate_families")
                except ValueError:
                    continue
                out.append((name, hierarchical))
        return out

    def compute_plan(self, profile: Profile, model: CostModel) -> CompressionPlan:
        option = configured_option(model, self.comm_scheme, self.hierarchical)
        return espresso_plan(profile, model, cupcake_option=option, offload=self.offload, fuse=self.fuse,
                             first_bytes=self.dense.first_bucket_bytes, bucket_bytes=self.dense.bucket_bytes)

    def candidate_plans(self, profile: Profile, model: CostModel) -> list[CompressionPlan]:
        """Espresso's plan, then the others it must never lose to: Cupcake's groups of the configured
        option and dense allreduce in DDP's buckets."""
        option = configured_option(model, self.comm_scheme, self.hierarchical)
        plans = {"espresso search": self.compute_plan(profile, model),
                 f"cupcake groups of {option_label(model, option)}":
                     cupcake_plan(profile, model, option),
                 "dense, DDP buckets": dense_plan(profile, model, self.dense.first_bucket_bytes,
                                                          self.dense.bucket_bytes)}
        for label, plan in plans.items():
            plan.context["candidate"] = label
        return list(plans.values())


class CupcakeSync(PlannedSync):
    """``sync=cupcake``: the configured compressor on fusion groups chosen by Cupcake's exact DP.

    Tensors are partitioned, in backward order, into contiguous groups; each group is one flat buffer
    compressed once with the configured compressor and aggregated by ``sync.comm`` (flat, or
    hierarchical with ``sync.hierarchical``). The partition minimizes the simulated iteration time
    (:mod:`ddlscale.plan.cupcake`) on the profile of the first steps. With ``compressor=none`` it plans
    the fusion of dense allreduce alone (optimal buckets). Every argument is :class:`PlannedSync`'s.

    With ``trial_steps`` > 0 (the default) it offers Espresso's trial: Cupcake's groups, the same option
    layer-wise and dense allreduce take turns on the cluster and the fastest measured stays.
    """

    system = "cupcake"

    def compute_plan(self, profile: Profile, model: CostModel) -> CompressionPlan:
        return cupcake_plan(profile, model, configured_option(model, self.comm_scheme, self.hierarchical))

    def candidate_plans(self, profile: Profile, model: CostModel) -> list[CompressionPlan]:
        """Cupcake's plan, then what it must never lose to: the configured option on every tensor
        alone (layer-wise) and dense allreduce in DDP's buckets."""
        option = configured_option(model, self.comm_scheme, self.hierarchical)
        plans = {"cupcake": self.compute_plan(profile, model),
                 f"layer-wise {option_label(model, option)}": layerwise_plan(profile, model, option),
                 "dense, DDP buckets": dense_plan(profile, model, self.dense.first_bucket_bytes,
                                                  self.dense.bucket_bytes)}
        for label, plan in plans.items():
            plan.context["candidate"] = label
        return list(plans.values())


def _families(value: Sequence[str] | str | None) -> list[tuple[str, bool]] | None:
    """``sync.calibrate_families`` as (scheme, hierarchical) pairs: scheme names, ``/hier`` for the
    hierarchical layout; None for ``all``."""
    if value == ALL:
        return None
    if value is None:
        return []
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"sync.calibrate_families must be {ALL} or a list of scheme names (e.g. "
                         f"[alltoall, zen/hier]), got {value!r}")
    out = []
    for text in value:
        scheme, _, layout = text.partition("/")
        if scheme not in SCHEMES or layout not in ("", "hier"):
            raise ValueError(f"sync.calibrate_families: {text!r} is not one of {', '.join(SCHEMES)}, "
                             f"optionally with /hier")
        if (scheme, layout == "hier") not in out:
            out.append((scheme, layout == "hier"))
    return out


def _layout_label(entry: tuple[str, bool, str]) -> str:
    """A calibration layout as the schedule names it: ``allgather``, ``zen/hier fused``, ``allgather mixed``."""
    scheme, hierarchical, layout = entry
    return scheme + ("/hier" if hierarchical else "") + {ALONE: "", FUSED: " fused", MIXED: " mixed"}[layout]


def _calibration_note(profile: Profile) -> str:
    """What calibration changed in the model, for plan.txt ("" when nothing)."""
    calibration = profile.compressors["default"].calibration if "default" in profile.compressors else {}
    parts = []
    if profile.lag_s:
        parts.append(f"the slowest rank {profile.lag_s * 1e3:.2f} ms behind at backward end")
    if "allreduce" in profile.network.get("efficiency", {}):
        parts.append(f"allreduce x{profile.network['efficiency']['allreduce']:.2f} the network model, for the "
                     f"profiled dense steps' {profile.step_s * 1e3:.1f} ms")
    if "encode" in calibration:
        parts.append(f"encode x{calibration['encode']:.2f}, decode x{calibration['decode']:.2f} the benchmark "
                     f"({calibration['groups']} groups over {calibration['steps']} layer-wise steps)")
    for key, terms in sorted(profile.families.items()):
        if "lag_s" in terms or "fused_lag_s" in terms:
            parts.append(f"under {key} the slowest rank " + " and ".join(
                f"{terms[term] * 1e3:.2f} ms behind at backward end {where}"
                for term, where in (("lag_s", "layer-wise"), ("fused_lag_s", "fused")) if term in terms))
        if terms.get("beside_compression_s"):
            parts.append(f"each uncompressed group {terms['beside_compression_s'] * 1e3:.3f} ms more beside compressed "
                         "ones (a mixed step)")
        if "cpu_s" in terms and not key.endswith("/*"):
            parts.append(f"under {key} {terms['cpu_s'] * 1e3:+.3f} ms per group and "
                         f"{terms.get('cpu_per_element_s', 0.0) * 1e9:+.2f} ms per million elements beyond the model "
                         f"(its layer-wise and fused steps)")
    return "calibrated in training: " + "; ".join(parts) if parts else ""


def _weighted_median(samples: list[tuple[float, float]]) -> float | None:
    """The value at half the total weight of (value, weight) samples (None when there are none)."""
    ordered = sorted(samples)
    half, seen = sum(w for _, w in ordered) / 2, 0.0
    for value, weight in ordered:
        seen += weight
        if seen >= half:
            return value
    return None


def _distinct(plans: list[CompressionPlan]) -> list[CompressionPlan]:
    """``plans`` without those that execute like an earlier one (same groups, same choices)."""
    out: list[CompressionPlan] = []
    for plan in plans:
        if all(plan.to_choices() != kept.to_choices() for kept in out):
            out.append(plan)
    return out
