"""From a profile to a :class:`CompressionPlan`: Cupcake's fusion, Espresso's per-tensor choices.

The runtime backends (``sync=cupcake``, ``sync=espresso``) and ``python -m ddlscale.tools.plan``
both call these two functions, so a plan recomputed offline from a saved profile is the plan the
run used (for the same cluster).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ddlscale import clock
from ddlscale.comm.network import NetworkModel
from ddlscale.comm.timeline import TensorTask, iteration_time
from ddlscale.compress import Compressor
from ddlscale.plan.aggregation import SCHEMES, check_scheme
from ddlscale.plan.cupcake import plan_fusion
from ddlscale.plan.espresso import espresso
from ddlscale.plan.pricing import DENSE, CostModel, Option, Unit, element_size, fuse, units_of
from ddlscale.plan.profile import Profile
from ddlscale.plan.result import CompressionPlan, per_unit_savings, plan_time, uniform_time


def cost_model(profile: Profile, compressors: dict[str, Compressor] | None = None, world_size: int | None = None,
               network: NetworkModel | None = None) -> CostModel:
    """The cost model of ``profile``; compressors are rebuilt from the profile unless given."""
    compressors = compressors or {key: c.build() for key, c in profile.compressors.items()}
    return CostModel(profile, compressors, world_size, network)


def configured_option(model: CostModel, comm: str = "allgather", hierarchical: bool = False) -> Option:
    """The uniform choice of the config: the configured compressor under ``sync.comm``, or dense
    allreduce when no compressor is configured (then fusion alone is planned)."""
    check_scheme(comm, "sync.comm")  # an unknown name is named as such, not as an unsummable payload
    if "default" not in model.compressors or model.compressors["default"].name == "none":
        return Option("none", "allreduce", hierarchical and model.hierarchical_possible)
    option = Option("default", comm, hierarchical and model.hierarchical_possible)
    if not model.allows(option):
        carriers = [s for s in SCHEMES if model.allows(replace(option, scheme=s))]
        raise ValueError(f"sync.comm={comm} cannot carry compressor {model.compressors['default'].name}; use "
                         f"{', '.join(carriers)}")
    return option


def _solve(predicted: Callable[[float], float], measured_s: float, low: float, high: float) -> float:
    """The ``x`` in [low, high] where the non-decreasing ``predicted(x)`` reaches ``measured_s``:
    ``low`` where the model already says that much or more, ``high`` where even that falls short.

    False position with the Illinois step (a stale end's value halved), not bisection: the
    simulated step is piecewise linear in a cost, so a chord lands near the root in a few
    evaluations where halving takes twenty — the fits nest two of these solves."""
    below, above = predicted(low) - measured_s, predicted(high) - measured_s
    if below >= 0:
        return low
    if above < 0:
        return high
    stale = 0  # which end stayed put last time: -1 low, +1 high
    while high - low > 1e-6 * max(1.0, abs(low), abs(high)):
        x = (low * above - high * below) / (above - below)
        if not low < x < high:  # rounding at a tiny bracket
            x = (low + high) / 2
        value = predicted(x) - measured_s
        if value < 0:
            low, below = x, value
            if stale == -1:
                above /= 2
            stale = -1
        else:
            high, above = x, value
            if value == 0:
                break
            if stale == 1:
                below /= 2
            stale = 1
    return high if above == 0 else (low + high) / 2


def fused_units(units: list[Unit]) -> list[Unit]:
    """Every unit of one dtype fused into one group (in backward order): calibration's fused step."""
    by_dtype: dict[str, list[Unit]] = {}
    for unit in units:
        by_dtype.setdefault(unit.dtype, []).append(unit)
    return sorted((fuse(group) for group in by_dtype.values()), key=lambda u: u.ready_s)


class _Layout:
    """A calibration step's groups under one option, priced once with the family's CPU left out;
    :meth:`time` adds a CPU correction of ``group_s`` per group and ``element_s`` per element to each
    group's encode (as :meth:`CostModel.costs_many` charges a family's terms: never below zero in
    total), fast enough for the nested solves of :func:`family_cpu`."""

    def __init__(self, profile: Profile, option: Option, units: list[Unit], compressors: dict[str, Compressor]):
        model = CostModel(profile.with_family(option.family, cpu_s=0.0, cpu_per_element_s=0.0), compressors)
        self.tasks = model.tasks(units, option)
        self.numel = np.array([u.numel for u in units], dtype=float)
        self.base = np.array([t.encode_s for t in self.tasks])
        self.backward_end_s, self.optimizer_s = profile.backward_end_s, profile.rest_s + model.fixed_s([option])

    def time(self, group_s: float, element_s: float) -> float:
        encodes = np.maximum(0.0, self.base + group_s + element_s * self.numel).tolist()
        # Built directly: dataclasses.replace took three quarters of a fit's time.
        tasks = [TensorTask(t.name, t.ready_s, e, t.comm_s, t.decode_s, t.encode_on_compute, t.lag_s)
                 for t, e in zip(self.tasks, encodes, strict=True)]
        return iteration_time(tasks, self.backward_end_s, self.optimizer_s, check=False)

    def per_group(self, element_s: float, measured_s: float) -> float:
        """The ``group_s`` that makes :meth:`time` ``measured_s`` at ``element_s``: at most every
        group's encode at zero (the model then says more even with no CPU at all), at least so
        much that every group's encode alone takes the measured step."""
        reach = self.base + element_s * self.numel
        return _solve(lambda g: self.time(g, element_s), measured_s, -float(reach.max()),
                      measured_s - float(reach.min()))


def family_cpu(profile: Profile, option: Option, layerwise_s: float, fused_s: float | None = None,
               compressors: dict[str, Compressor] | None = None) -> tuple[float, float]:
    """(seconds per group, seconds per element) of ``option``'s family on the training thread that
    make the model's layer-wise step under it (every tensor its own group) take ``layerwise_s``
    and, where given, its fused step (each dtype's tensors one group) take ``fused_s`` — both
    measured in training, with the family's lags (``lag_s``, ``fused_lag_s``) already in ``profile``.

    What a compressed group costs beyond its benchmarked encode/decode and its collectives — the
    scheme's Python, issuing the collective, the other ranks' compression competing for shared
    cores — or less than they say (a benchmark at a fused size that training does not reproduce:
    DGC's fused encode ran at half its benchmarked time in espresso_cupcake): the correction goes
    either way, bounded only where a group's encode would fall below zero in total. One layer-wise
    step cannot tell a cost per group from a cost per element; charged all per group, a family's
    cost measured on N groups is under-charged to a plan of a few large groups by about (N - 1) / N
    (plans of one or two compressed groups predicted 10-41% under, compression_schemes_dilated), so
    the fused step, where given, is the second point. (The outer solve takes the fused step's
    prediction to grow with the per-element share, as it does where one group holds every tensor
    and the layer-wise step holds it fixed.) 0, 0 for an uncompressed option."""
    if not option.compressed:
        return 0.0, 0.0
    compressors = compressors or {key: c.build() for key, c in profile.compressors.items()}
    units = units_of(profile)
    alone = _Layout(profile, option, units, compressors)
    fused = fused_units(units)
    if fused_s is None or len(fused) == len(units):  # one step, or two that are the same step
        return alone.per_group(0.0, layerwise_s), 0.0
    together = _Layout(profile, option, fused, compressors)
    # Solved in seconds per largest fused group (``spread``), where _solve's tolerance is meant.
    largest = float(together.numel.max())

    def fused_time(spread: float) -> float:
        return together.time(alone.per_group(spread / largest, layerwise_s), spread / largest)

    element_s = _solve_outward(fused_time, fused_s, layerwise_s + fused_s) / largest
    return alone.per_group(element_s, layerwise_s), element_s


def _solve_outward(predicted: Callable[[float], float], measured_s: float, scale: float) -> float:
    """:func:`_solve` with no bounds given: the bracket grows from [-scale, scale] by doubling. Where
    ``predicted`` levels off below, above ``measured_s`` (every cost it moves already at zero), the
    edge of that floor: the least correction that gives what the most would."""
    low, high = -scale, scale
    for _ in range(60):
        if predicted(high) >= measured_s:
            break
        low, high = high, 2 * high
    for _ in range(60):
        if predicted(low) <= measured_s:
            break
        floor = predicted(2 * low)
        if floor >= predicted(low):  # levelled off: the edge of the floor
            return _solve(predicted, floor + 1e-9 * max(1.0, floor), low, high)
        low, high = 2 * low, low
    return _solve(predicted, measured_s, low, high)


@dataclass(frozen=True)
class FamilySteps:
    """What calibration measured of one option family in training: the median period of its
    layer-wise steps (every tensor its own group) and of its fused ones (each dtype's tensors one
    group; None: not run), and how far behind the slowest rank ended backward in each (None: not
    measured, the dense lag stands)."""

    layerwise_s: float
    fused_s: float | None = None
    lag_s: float | None = None
    fused_lag_s: float | None = None


def fit_families(profile: Profile, measured: dict[Option, FamilySteps], configured: Option,
                 mixed_s: float | None = None, compressors: dict[str, Compressor] | None = None) -> Profile:
    """``profile`` with each measured family's own terms (:attr:`Profile.families`): its lags, then
    the CPU per group and per element that make its layer-wise and fused steps what they measured
    (:func:`family_cpu`: a correction either way, so a family the benchmark over-prices is priced
    down). The ``configured`` family's CPU stands for the compressor's families calibration left
    out (``default/*``); a hierarchical uncompressed group (``none/*``) pays its per-group part where
    that is a cost (it runs the same per-group machinery, but compresses nothing a negative
    correction could be taken off). Then, from ``mixed_s`` (the mixed step of ``configured``, where
    run), what a dense group costs beside compression (:func:`beside_overhead`)."""
    compressors = compressors or {key: c.build() for key, c in profile.compressors.items()}
    for option, steps in measured.items():
        if not option.compressed:
            continue
        lags = {term: value for term, value in (("lag_s", steps.lag_s), ("fused_lag_s", steps.fused_lag_s))
                if value is not None}
        profile = profile.with_family(option.family, **lags)
        per_group, per_element = family_cpu(profile, option, steps.layerwise_s, steps.fused_s, compressors)
        profile = profile.with_family(option.family, cpu_s=per_group, cpu_per_element_s=per_element)
    mine = profile.families.get(configured.family, {})
    if "cpu_s" in mine:
        profile = (profile.with_family("default/*", cpu_s=mine["cpu_s"], cpu_per_element_s=mine["cpu_per_element_s"])
                   .with_family("none/*", cpu_s=max(0.0, mine["cpu_s"])))
    if mixed_s is not None and configured.compressed:
        profile = profile.with_family(DENSE.family, beside_compression_s=beside_overhead(
            profile, configured, mixed_s, compressors))
    return profile


def mixed_options(units: list[Unit], option: Option) -> list[Option]:
    """Calibration's mixed step: the largest unit (the first of equals) under ``option``, every other
    one dense allreduce alone (uniform_starts' "largest only")."""
    largest = max(range(len(units)), key=lambda i: (units[i].numel, -i))
    return [option if i == largest else DENSE for i in range(len(units))]


def beside_overhead(profile: Profile, option: Option, measured_s: float,
                    compressors: dict[str, Compressor] | None = None) -> float:
    """Seconds per uncompressed group that make the model's mixed step (:func:`mixed_options`: the
    largest tensor under ``option``, the rest dense alone) take ``measured_s``, measured in training
    after ``option``'s own family was calibrated; 0 where the model already says that much or more.
    (:meth:`CostModel.beside_compression` charges it to every uncompressed group of a plan that
    compresses.)"""
    if not option.compressed:
        return 0.0
    compressors = compressors or {key: c.build() for key, c in profile.compressors.items()}
    units = units_of(profile)
    options = mixed_options(units, option)

    def predicted(per_group: float) -> float:
        model = CostModel(profile.with_family(DENSE.family, beside_compression_s=per_group), compressors)
        return plan_time(units, options, model.beside_compression(), profile.backward_end_s, profile.rest_s)

    return _solve(predicted, measured_s, 0.0, max(0.0, measured_s))


def allreduce_efficiency(profile: Profile, compressors: dict[str, Compressor] | None = None,
                         first_bytes: float = 1 << 20, bucket_bytes: float = 25 << 20) -> float:
    """The factor on the model's allreduce times (``NetworkModel.efficiency``) that makes its dense
    step in DDP's buckets take what the profiled dense steps took (``profile.step_s``); 1 where the
    model already says that much or more. On hosts whose CPU also carries the traffic (an emulated
    cluster: every machine's reductions, copies and TCP stack on the same cores, beside backward) an
    allreduce takes several times what the link alone explains, and overlaps backward less."""
    if profile.step_s is None or profile.world_size < 2:
        return 1.0
    compressors = compressors or {key: c.build() for key, c in profile.compressors.items()}

    def predicted(factor: float) -> float:
        network = {**profile.network, "efficiency": {**profile.network.get("efficiency", {}), "allreduce": factor}}
        profiled = replace(profile, network=network)
        return dense_plan(profiled, CostModel(profiled, compressors), first_bytes, bucket_bytes).iteration_s

    return _solve(predicted, profile.step_s, 1.0, 100.0)


def option_label(model: CostModel, option: Option | None) -> str:
    """An option as plans name it, with the configured compressor's name ("-": no option)."""
    if option is None:
        return "-"
    return option.label({"default": model.compressors["default"].name} if "default" in model.compressors else {})


def _context(profile: Profile, model: CostModel) -> dict:
    net = profile.network
    default = model.compressors.get("default")
    return {"world_size": model.n, "bandwidth": f"{model.network.bandwidth_bps / 1e9:g} Gbit/s",
            "latency": f"{model.network.latency_s * 1e6:g} us", "gpus_per_machine": model.network.gpus_per_machine,
            "compressor": repr(default) if default is not None else "none",
            "compressor_name": default.name if default is not None else "none", "device": profile.device,
            "measured_dense_step_s": profile.step_s if model.n == profile.world_size else None,
            "network_config": dict(net)}


def _notes(profile: Profile, plan: CompressionPlan) -> list[str]:
    notes = ["times: backward starts at the first gradient hook; the step's rest (forward, optimizer, "
             "data, the loss's backward) is added after the last decode"]
    if profile.device == "cpu":
        notes.append("compression device 'compute' is the training thread of this CPU-only host "
                     "(TensorTask.encode_on_compute: it delays the rest of backward), which is where "
                     "CompressSync compresses; the GPU/CPU dimension is modeled, not measured")
    if plan.offloaded:
        notes.append(f"{plan.offloaded} unit(s) compress on the side device (@side): modeled only; CompressSync "
                     "compresses every unit on the training thread, so that part of the prediction does not run")
    return notes


def _baselines(profile: Profile, model: CostModel, option: Option) -> dict[str, float]:
    """The reference plans a plan is compared with: dense allreduce in DDP's buckets (what sync=dense
    and DDP run, not one allreduce per tensor, which no one runs) and the configured option layer-wise."""
    out = {"dense, DDP buckets": dense_plan(profile, model).iteration_s}
    if option.compressed:
        out[f"layer-wise {option_label(model, option)}"] = uniform_time(units_of(profile), option, model,
                                                                  profile.backward_end_s, profile.rest_s)
    return out


def ddp_buckets(units: list[Unit], first_bytes: float = 1 << 20, bucket_bytes: float = 25 << 20) -> list[Unit]:
    """sync=dense's groups (DDP's rule): fill in backward order, close a bucket once it reaches its cap
    (the first one smaller), never mix dtypes."""
    groups: list[list[Unit]] = []
    size = float("inf")
    for unit in units:
        cap = first_bytes if len(groups) == 1 else bucket_bytes
        if size >= cap or groups[-1][-1].dtype != unit.dtype:
            groups.append([])
            size = 0
        groups[-1].append(unit)
        size += unit.numel * element_size(unit.dtype)
    return [fuse(g) for g in groups]


def dense_plan(profile: Profile, model: CostModel, first_bytes: float = 1 << 20,
               bucket_bytes: float = 25 << 20) -> CompressionPlan:
    """Dense allreduce in DDP's buckets, as a plan: what sync=dense runs, priced by the same model."""
    units = ddp_buckets(units_of(profile), first_bytes, bucket_bytes)
    options = [DENSE] * len(units)
    tasks = [model.task(u, DENSE) for u in units]
    plan = CompressionPlan("dense", units, options, iteration_time(tasks, profile.backward_end_s, profile.rest_s),
                           f"{len(units)} DDP buckets ({first_bytes / 2**20:g} MiB first, then "
                           f"{bucket_bytes / 2**20:g} MiB)", [0.0] * len(units), context=_context(profile, model))
    plan.notes = _notes(profile, plan)
    return plan


def layerwise_plan(profile: Profile, model: CostModel, option: Option) -> CompressionPlan:
    """Every tensor alone under ``option``: what sync=compress runs, priced by the same model."""
    units = units_of(profile)
    options = [option] * len(units)
    plan = CompressionPlan("layer-wise", units, options,
                           uniform_time(units, option, model, profile.backward_end_s, profile.rest_s),
                           "none (each tensor alone)", context=_context(profile, model))
    plan.notes = _notes(profile, plan)
    return plan


def cupcake_plan(profile: Profile, model: CostModel, option: Option) -> CompressionPlan:
    """Cupcake: every group under ``option``, the partition optimal for the simulator."""
    started = clock.now()
    fusion = plan_fusion(units_of(profile), model, option, profile.backward_end_s, profile.rest_s)
    elapsed = clock.now() - started
    plan = CompressionPlan("cupcake", fusion.units, fusion.options, fusion.iteration_s,
                           f"{len(fusion.groups)} contiguous groups (optimal partition by dynamic programming)",
                           per_unit_savings(fusion.units, fusion.options, model, profile.backward_end_s,
                                            profile.rest_s),
                           _baselines(profile, model, option), context=_context(profile, model))
    plan.notes = [*_notes(profile, plan), f"planning took {elapsed:.3f} s"]
    return plan


def espresso_plan(profile: Profile, model: CostModel, cupcake_option: Option | None = None,
                  offload: bool = False, fuse: bool = True, options: list[Option] | None = None,
                  first_bytes: float = 1 << 20, bucket_bytes: float = 25 << 20) -> CompressionPlan:
    """Espresso over the model's option space (or ``options``); ``cupcake_option`` adds the search
    over Cupcake's groups of that option as a candidate. With ``fuse``, a plan that compresses
    nothing runs in the profiled dense steps' buckets (:func:`ddp_buckets` of these sizes)."""
    units = units_of(profile)
    result = espresso(units, model, profile.backward_end_s, profile.rest_s, options=options, offload=offload,
                      fuse=fuse, cupcake_option=cupcake_option,
                      dense_groups=ddp_buckets(units, first_bytes, bucket_bytes) if fuse else None)
    fusion = {"per tensor": "none (each tensor alone)",
              "dense buckets": "none: compresses nothing, in the profiled dense steps' buckets (DDP's rule)",
              "fused runs": "runs of consecutive tensors with the same option fused (Cupcake's DP)",
              "cupcake groups": f"Cupcake's groups of {option_label(model, cupcake_option)} as units"}[result.fusion]
    priced = model.beside_compression() if any(o.compressed for o in result.options) else model
    plan = CompressionPlan("espresso", result.units, result.options, result.iteration_s, fusion,
                           per_unit_savings(result.units, result.options, priced, profile.backward_end_s,
                                            profile.rest_s),
                           _baselines(profile, model, cupcake_option or DENSE), context=_context(profile, model))
    plan.notes = [*_notes(profile, plan), *(f"search: {step}" for step in result.steps)]
    return plan
