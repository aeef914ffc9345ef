"""Espresso: choose, per tensor, how to use compression so that the simulated iteration is shortest.

The option space per tensor is :meth:`CostModel.options` (compress or not, every scheme — zen
included where the compressor sparsifies — flat or hierarchical); brute force over N tensors is
|options|^N. The paper searches it greedily (Properties 1-2, Algorithm 1: tensors in descending
size, each given its best option with the others fixed), which can stop short of the optimum: a
greedy search with restarts and pair moves missed brute force by up to 1.25% on random instances
of the full option set. Here the search is **exact** instead:

1. **Search** — with compression on the compute stream the simulator is a max-plus recursion, and
   the tensors i..N-1 under fixed options act on the state before them through two constants
   (alpha, beta). :mod:`ddlscale.plan.frontier` keeps, per i, the Pareto front of (alpha, beta)
   over every assignment of options to tensors i..N-1; an assignment off the front can never be
   part of an optimum, so the best point of front 0 is the brute-force optimum (the tests check
   this against brute force on >= 1000 random instances of the full option set). Options another
   option matches or beats on encode, comm and decode at once are skipped (exact: the time is
   monotone in each; :meth:`Evaluator.useful`), and points no prefix can bring under a known
   plan's time (the best uniform plan, then a thinned first sweep) are dropped (exact too).
   Properties 1 and 2 are heuristics for the greedy order and have nothing left to decide.
2. **Fusion** (Cupcake, composed): runs of consecutive tensors with the same option may be fused
   into one buffer compressed once; :func:`~ddlscale.plan.cupcake.plan_fusion` finds the best such
   fusion exactly. Espresso also runs its search over the Cupcake groups of the configured
   compressor as units. The best of per-tensor, fused runs and Cupcake units is the plan; the plan
   says which. (Each is exact over its own space; the joint space of options and arbitrary
   fusions is not searched.)
3. **Algorithm 2** (``offload``) — compute-stream compression steals time from backward; a side
   device (the CPU) does not, but is slower and shared. Compressed units are grouped by
   (size, option); for each group in descending size, every prefix length (in backward order) of
   the group is tried on the side device and the best kept. It runs last, on the chosen units:
   a side stream queues decodes behind encodes, which the exact DP's two-number state cannot
   express, so this step is the paper's heuristic and only ever improves the plan.

All candidates are scored by :func:`ddlscale.comm.timeline.iteration_time` on
:meth:`CostModel.task` — the one simulator; the DP only searches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ddlscale import clock
from ddlscale.comm.timeline import TensorTask, iteration_time
from ddlscale.plan.cupcake import Fusion, plan_fusion
from ddlscale.plan.frontier import CAP, THIN_FRONT, best_path, sweep
from ddlscale.plan.pricing import DENSE, CostModel, Option, Unit

_TOL = 1e-12  # seconds: an "improvement" below this is float noise


@dataclass
class Search:
    """A plan over units: one option per unit, its simulated iteration time and provenance."""

    units: list[Unit]
    options: list[Option]
    iteration_s: float
    fusion: str = "per tensor"  # per tensor | fused runs | cupcake groups | dense buckets
    steps: list[str] = field(default_factory=list)  # what the search did, for the report
    simulations: int = 0
    gap_s: float = 0.0  # proven: the per-unit search's plan is at most this much slower than the optimum


class Evaluator:
    """Iteration time of an assignment of options to units, with the tasks precomputed per option."""

    def __init__(self, units: Sequence[Unit], model: CostModel, backward_end_s: float, optimizer_s: float):
        self.units, self.model = list(units), model
        self.backward_end_s, self.optimizer_s = backward_end_s, optimizer_s
        self._tasks: dict[Option, list[TensorTask]] = {}  # every unit's task per option, priced together
        self._costs: dict[Option, np.ndarray] = {}
        self._useful: dict[tuple, list[list[int]]] = {}
        self.evaluations = 0

    def task(self, i: int, option: Option) -> TensorTask:
        return self._all(option)[i]

    def tasks(self, options: Sequence[Option]) -> list[TensorTask]:
        return [self.task(i, o) for i, o in enumerate(options)]

    def costs(self, option: Option) -> np.ndarray:
        """Every unit's (ready, encode, comm, decode, lag) under ``option``: a (5, units) array."""
        found = self._costs.get(option)
        if found is None:
            found = self._costs[option] = np.array(
                [[t.ready_s, t.encode_s, t.comm_s, t.decode_s, t.lag_s] for t in self._all(option)], dtype=float
            ).reshape(-1, 5).T
        return found

    def _all(self, option: Option) -> list[TensorTask]:
        found = self._tasks.get(option)
        if found is None:
            found = self._tasks[option] = self.model.tasks(self.units, option)
        return found

    def useful(self, options: Sequence[Option]) -> list[list[int]]:
        """Per unit, the indices into ``options`` of those no other one matches or beats on every cost.

        With compute-stream tasks only (the exact search's plans) the simulator is a max-plus recursion,
        so the iteration time never decreases when an encode, comm, decode or lag time grows: such an
        option can never be strictly better and dropping it is exact. It spares many front points
        on small tensors, where several schemes cost the same constants. (A side stream queues
        jobs, where a longer job can reorder the queue, so side options are never pruned.) Equal
        costs keep the first such option. Every unit at once: (options, options, units) comparisons.
        """
        key = tuple(options)
        if key not in self._useful:
            count = len(self.units)
            if any(o.device != "compute" for o in options):
                self._useful[key] = [list(range(len(options)))] * count
            else:
                cost = np.stack([self.costs(o)[1:] for o in options])  # (options, 4, units)
                no_worse = (cost[:, None] <= cost[None, :]).all(axis=2)  # [m, k, unit]: m matches or beats k
                same = (cost[:, None] == cost[None, :]).all(axis=2)
                earlier = np.tri(len(options), k=-1, dtype=bool).T[:, :, None]  # [m, k]: m < k
                other = ~np.eye(len(options), dtype=bool)[:, :, None]
                beaten = (other & no_worse & (~same | earlier)).any(axis=0)  # (options, units)
                self._useful[key] = [np.flatnonzero(~beaten[:, n]).tolist() for n in range(count)]
        return self._useful[key]

    def time(self, tasks: Sequence[TensorTask]) -> float:
        self.evaluations += 1
        return iteration_time(tasks, self.backward_end_s, self.optimizer_s, check=False)


def uniform_starts_plan(ev: Evaluator, options: Sequence[Option], name: str) -> list[Option]:
    return dict(uniform_starts(ev, options))[name]


def uniform_starts(ev: Evaluator, options: Sequence[Option]) -> list[tuple[str, list[Option]]]:
    """The uniform plans: all dense, all under each option, the largest tensor alone under each."""
    n = len(ev.units)
    largest = max(range(n), key=lambda i: (ev.units[i].numel, -i))
    starts = [("all " + o.label(), [o] * n) for o in options]
    for o in options:
        if o.compressed:
            only = [DENSE] * n
            only[largest] = o
            starts.append((f"largest only {o.label()}", only))
    return starts


def exact(ev: Evaluator, options: Sequence[Option], bound: float, cap: int | None = CAP,
          ) -> tuple[list[Option], float, int]:
    """The brute-force optimum over ``options`` (compute stream) per unit, by the suffix DP of
    :mod:`ddlscale.plan.frontier`; ``bound``: a known plan's time. Returns the plan, its proven
    distance from the optimum (0 unless a front outgrew ``cap``) and how many front points the
    sweep kept."""
    kept = ev.useful(options)
    table = np.stack([ev.costs(o) for o in options])  # (options, 5, units)
    useful = [[options[k] for k in ks] for ks in kept]
    rows = [(np.full(len(ks), i + 1), table[ks, :, i].T) for i, ks in enumerate(kept)]
    # The most favourable state any prefix 0..i-1 reaches: each cost at its least over the options
    # (the recursion is monotone in each), comm end >= that of the least costs, stolen >= their sum.
    floor_c, floor_s = [0.0], [0.0]
    for _, costs in rows:
        ready, encode, comm, decode, lag = costs
        floor_c.append(max((ready + lag + encode).min(), floor_c[-1]) + comm.min())
        floor_s.append(floor_s[-1] + float((encode + decode).min()))
    b, o = ev.backward_end_s, ev.optimizer_s
    path, _ = best_path(rows, sweep(rows, floor_c, floor_s, b, o, bound, thin=THIN_FRONT)[0])
    rough = [useful[i][col] for i, col in path]
    rough_time = ev.time(ev.tasks(rough))
    front, gap = sweep(rows, floor_c, floor_s, b, o, min(bound, rough_time), cap=cap)
    points = sum(f[0].size for f in front)
    if front[0][0].size == 0:  # only after a thinning: every survivor was above the rough plan
        return rough, gap, points
    path, _ = best_path(rows, front)
    plan = [useful[i][col] for i, col in path]
    return (plan if ev.time(ev.tasks(plan)) <= rough_time else rough), gap, points


def algorithm2(ev: Evaluator, current: list[Option], best_time: float) -> tuple[list[Option], float, int]:
    """Offload a prefix of each (size, option) group of compute-stream compressed tensors to the side
    device, trying every prefix length; groups in descending size. Returns the plan, its time and
    how many tensors moved."""
    groups: dict[tuple[int, Option], list[int]] = {}
    for i, o in enumerate(current):
        if o.compressed and o.device == "compute":
            groups.setdefault((ev.units[i].numel, o), []).append(i)
    current = list(current)
    tasks = ev.tasks(current)
    moved = 0
    for (_, option), members in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        side = option.on("side")
        if not ev.model.allows(side):
            continue
        best_p = 0
        for p in range(1, len(members) + 1):
            tasks[members[p - 1]] = ev.task(members[p - 1], side)
            t = ev.time(tasks)
            if t < best_time - _TOL:
                best_time, best_p = t, p
        for p, i in enumerate(members):
            current[i] = side if p < best_p else option
            tasks[i] = ev.task(i, current[i])
        moved += best_p
    return current, best_time, moved


def zen_subsets(options: Sequence[Option]) -> list[list[Option]]:
    """``options`` with zen kept in every subset of the layouts it is offered in (none first).

    Zen's rounds are a fixed cost per step and layout once any group uses them
    (:meth:`CostModel.fixed_s`), which the per-unit DP cannot charge once; searched within each
    subset with that subset's fixed cost added, every plan is timed at or above its true time and
    the optimum exactly under the subset of layouts it uses: the best over the subsets is exact."""
    layouts = sorted({o.hierarchical for o in options if o.scheme == "zen"})
    out = []
    for mask in range(1 << len(layouts)):
        kept = {hier for b, hier in enumerate(layouts) if mask >> b & 1}
        subset = [o for o in options if o.scheme != "zen" or o.hierarchical in kept]
        if subset:
            out.append(subset)
    return out


def search(units: Sequence[Unit], model: CostModel, backward_end_s: float, optimizer_s: float = 0.0,
           options: Sequence[Option] | None = None, offload: bool = False, cap: int | None = CAP) -> Search:
    """The optimal per-unit options (no fusion) among ``options`` (default: every compute-stream
    option of ``model``), then (``offload``) Algorithm 2. ``units`` in backward order. ``cap``: front
    size above which the DP thins with a proven loss, recorded as :attr:`Search.gap_s`. Where zen is
    offered, the search runs once per subset of its layouts (:func:`zen_subsets`)."""
    options = list(options if options is not None else model.options())
    if not options:
        raise ValueError("espresso: no option is allowed for this compressor and cluster")
    if any(o.compressed and o.device != "compute" for o in options):
        raise ValueError("espresso: the search takes compute-stream options; the side device is offload's "
                         "(Algorithm 2, sync.offload=true)")
    if not units:
        return Search([], [], backward_end_s + optimizer_s)
    readies = [u.ready_s for u in units]
    if any(later < earlier for earlier, later in zip(readies, readies[1:], strict=False)):
        raise ValueError("espresso: units must come in backward order (ready times non-decreasing)")
    subsets = zen_subsets(options)
    if len(subsets) == 1:
        runs = [_search_within(units, model, backward_end_s, optimizer_s, options, cap)]
    else:
        # Zen's rounds add a constant per layout used, so one search may leave every layout uncharged:
        # its plan, charged the rounds it uses, is the optimum of each subset whose rounds cost at least
        # as much (within that search's proven gap). Only a subset with cheaper rounds may do better, and
        # only if those rounds over the uncharged optimum leave it a chance.
        runs = [_search_within(units, model, backward_end_s, optimizer_s, options, cap, charged=0.0)]
        used = model.fixed_s(runs[0].options)
        least = runs[0].iteration_s - used - runs[0].gap_s  # no plan runs faster, uncharged
        for subset in subsets:
            rounds = model.fixed_s(subset)
            if rounds < used and least + rounds < min(r.iteration_s for r in runs) - _TOL:
                runs.append(_search_within(units, model, backward_end_s, optimizer_s, subset, cap))
    best = min(runs, key=lambda r: (r.iteration_s, model.fixed_s(r.options)))  # ties: fewer of zen's rounds
    best.simulations = sum(r.simulations for r in runs)
    best.gap_s = max(r.gap_s for r in runs)  # the uncharged search's gap also bounds the subsets it stood for
    if len(subsets) > 1:
        best.steps.insert(0, f"zen's rounds priced once per step: searched {len(runs)} times "
                             f"(every layout uncharged, then each subset of zen's {len(subsets)} whose cheaper rounds "
                             f"leave it a chance), best of {', '.join(f'{r.iteration_s * 1e3:.3f}' for r in runs)} ms")
    if offload:
        ev = Evaluator(units, model, backward_end_s, optimizer_s + model.fixed_s(best.options))
        best.options, best.iteration_s, moved = algorithm2(ev, best.options, best.iteration_s)
        best.steps.append(f"algorithm 2: {moved} tensors offloaded to the side device -> {best.iteration_s * 1e3:.3f} ms")
        best.simulations += ev.evaluations
    best.steps.append(f"{best.simulations} simulations")
    return best


def _search_within(units: Sequence[Unit], model: CostModel, backward_end_s: float, optimizer_s: float,
                   options: list[Option], cap: int | None, charged: float | None = None) -> Search:
    """:func:`search` among ``options``, every plan charged ``charged`` (default: ``options``' fixed
    cost); the result's time is its plan's own (charged only the fixed cost that plan uses)."""
    charged = model.fixed_s(options) if charged is None else charged
    ev = Evaluator(units, model, backward_end_s, optimizer_s + charged)
    uniform = min((ev.time(ev.tasks(plan)), name) for name, plan in uniform_starts(ev, options))
    current, gap, points = exact(ev, options, uniform[0], cap)
    best_time = ev.time(ev.tasks(current))  # the simulator's own figure
    if uniform[0] < best_time:  # only where thinning lost more than the uniform plan's margin
        current, best_time = uniform_starts_plan(ev, options, uniform[1]), uniform[0]
    # What this plan costs: only the fixed cost it uses (<= what the search charged it).
    best_time = iteration_time(ev.tasks(current), backward_end_s, optimizer_s + model.fixed_s(current), check=False)
    quality = "the optimum" if gap == 0 else f"within {gap * 1e3:.4f} ms of the optimum (proven; fronts thinned)"
    steps = [f"best uniform plan: '{uniform[1]}' ({uniform[0] * 1e3:.3f} ms)",
             f"search over {len(options)} options: {sum(o != DENSE for o in current)} of {len(units)} "
             f"units compressed -> {best_time * 1e3:.3f} ms, {quality} ({points} front points)"]
    return Search(list(units), current, best_time, "per tensor", steps, ev.evaluations, gap)


def fused_runs(result: Search, model: CostModel, backward_end_s: float, optimizer_s: float) -> Fusion | None:
    """The best fusion of runs of equal options in a per-tensor plan (None if it offloads)."""
    if any(o.compressed and o.device != "compute" for o in result.options):
        return None
    return plan_fusion(result.units, model, lambda i: result.options[i], backward_end_s, optimizer_s)


def _beside_s(model: CostModel) -> float:
    """What an uncompressed group costs beside compressed ones, as calibrated (0: not measured)."""
    return model.profile.family_terms(DENSE.family).get("beside_compression_s", 0.0)


def _uncompressed_if_faster(best: Search, dense_groups: list[Unit], plain: CostModel, backward_end_s: float,
                            optimizer_s: float, options: Sequence[Option], binding: bool) -> Search:
    """``best``, or the best plan that compresses nothing, priced by the plain model, if faster (or
    ``binding``, the dense buckets, and ``best`` compresses nothing): every one of ``dense_groups``
    under flat dense allreduce and, where hierarchical dense is among ``options``, the search over
    the uncompressed options on those groups."""
    fusion = "dense buckets" if binding else "per tensor"
    time_s = iteration_time([plain.task(u, DENSE) for u in dense_groups], backward_end_s, optimizer_s)
    candidates = [Search(list(dense_groups), [DENSE] * len(dense_groups), time_s, fusion, [], 0)]
    uncompressed = [o for o in options if not o.compressed]
    if len(uncompressed) > 1:
        found = search(dense_groups, plain, backward_end_s, optimizer_s, uncompressed)
        found.fusion = fusion
        candidates.append(found)
    found = min(candidates, key=lambda c: c.iteration_s)
    compresses = any(o.compressed for o in best.options)
    if found.iteration_s >= best.iteration_s - _TOL and (compresses or not binding):
        return best
    why = "compressing nothing is faster" if compresses else f"a plan that compresses nothing runs in the {fusion}"
    return Search(list(found.units), list(found.options), found.iteration_s, found.fusion,
                  [*best.steps, f"uncompressed groups priced plainly: {why}, "
                                f"{len(found.units)} group(s) -> {found.iteration_s * 1e3:.3f} ms"], best.simulations)


def espresso(units: Sequence[Unit], model: CostModel, backward_end_s: float, optimizer_s: float = 0.0,
             options: Sequence[Option] | None = None, offload: bool = False, fuse: bool = True,
             cupcake_option: Option | None = None, dense_groups: Sequence[Unit] | None = None) -> Search:
    """Espresso's plan: the per-tensor search; then (``fuse``) the fused runs of its equal options
    and the search over the Cupcake groups of ``cupcake_option``; the best of these, and last
    (``offload``) Algorithm 2 on its units. Fusion comes before offloading because the fusion DP
    is exact for compute-stream compression only.

    Where calibration measured what a dense group costs beside compressed ones
    (:meth:`CostModel.beside_compression`), every candidate is priced so — exact for the plans with
    a compressed group, an overestimate for those that compress nothing — and the best plan that
    compresses nothing, priced plainly, is one more candidate: the best of both is the optimum of
    each space. A plan that compresses nothing runs in ``dense_groups`` where they are given (the
    buckets the profiled dense steps ran in), flat or, where offered, hierarchical dense per
    group; None: every unit alone, and only beside a calibrated charge.

    Dense fusion's optimum is not a candidate: the model's overlap of dense groups with backward is
    fitted to the profiled steps' buckets alone (:func:`~ddlscale.plan.planner.allreduce_efficiency`),
    and other groupings run far from it where the host's cores carry the traffic (cnn on 4 emulated
    machines at 1 Gbit/s: three dense groups predicted 40.5 ms measured 55.1, where the one profiled
    bucket took 46.0)."""
    started = clock.now()
    plain, model = model, model.beside_compression()
    best = search(units, model, backward_end_s, optimizer_s, options)
    if fuse and units:
        candidates = [best]
        fused = fused_runs(best, model, backward_end_s, optimizer_s)
        if fused is not None:
            candidates.append(Search(fused.units, fused.options, fused.iteration_s, "fused runs",
                                     [*best.steps, f"fused runs of equal options: {len(fused.groups)} groups"],
                                     best.simulations))
        if cupcake_option is not None and model.allows(cupcake_option):
            groups = plan_fusion(units, model, cupcake_option, backward_end_s, optimizer_s)
            over = search(groups.units, model, backward_end_s, optimizer_s, options)
            names = {"default": model.compressors["default"].name} if "default" in model.compressors else {}
            over.fusion = "cupcake groups"
            over.steps.insert(0, f"units: the {len(groups.groups)} Cupcake groups of {cupcake_option.label(names)}")
            candidates.append(over)
        best = min(candidates, key=lambda c: c.iteration_s)  # ties: the simpler, earlier candidate
    allowed = plain.options() if options is None else list(options)
    if units and DENSE in allowed and (dense_groups is not None or _beside_s(plain) > 0):
        groups = list(units if dense_groups is None else dense_groups)
        best = _uncompressed_if_faster(best, groups, plain, backward_end_s, optimizer_s, allowed,
                                       binding=dense_groups is not None)
    if offload and best.units:
        ev = Evaluator(best.units, model, backward_end_s, optimizer_s + model.fixed_s(best.options))
        best.options, best.iteration_s, moved = algorithm2(ev, best.options, best.iteration_s)
        best.steps.append(f"algorithm 2: {moved} unit(s) offloaded to the side device -> "
                          f"{best.iteration_s * 1e3:.3f} ms ({ev.evaluations} simulations)")
    best.steps.append(f"planning took {clock.now() - started:.3f} s")
    return best
