"""Espresso: choose, per tensor, how to use compression so that the simulated iteration is shortest.

The option space per tensor is :meth:`CostModel.options` (compress or not, scheme, flat or
hierarchical, compression device); brute force over N tensors is |options|^N, so Espresso searches:

1. **Start** from *uniform* plans: every tensor dense, every tensor under one compressed option, or
   only the largest tensor compressed. (The paper starts from no compression.) The search below
   runs from each of the 3 best of them and keeps the best result: every step only accepts
   improvements, so the plan is never worse than any uniform plan, and greedy descents from
   different starts end in different local optima — three starts cost three descents and closed
   every gap to brute force we saw on small random instances (one start missed by up to 6% on
   about 1 in 500). On large models a descent costs thousands of simulations; the extra starts
   then run only within a budget of simulations (``max_simulations``).
2. **Algorithm 1** — visit the tensors in descending size (*Property 2*: large tensors decide most)
   and give each the option that minimizes the simulated iteration time with all others fixed.
   *Property 1*: a tensor whose message lies in a busy span of the communication stream that an
   idle gap follows (a later message waits for its gradient; for the last span: the iteration ends
   with backward, not with the last decode) gains nothing from a shorter message — that only
   widens the bubble. What can still help is taking less from the compute stream (compute-stream
   encodes delay the rest of backward), so for such a tensor only options with a smaller
   compute-stream cost than its current one are tried: no compression first of all (the paper's
   reading, "do not compress it"), or a cheaper compressed option when the uncompressed message
   would not fit the bubble. Bubbles move with every decision, so the check runs against the
   timeline of the current plan. Passes repeat until one changes nothing (the paper makes one).
   Options that another option matches or beats on encode, comm and decode at once are skipped
   (exact: the simulator is monotone in each; see :meth:`Evaluator.useful`).
   One-at-a-time moves stop at plans where only a *joint* change helps (compress tensor a instead
   of a similar tensor b). So the search then tries every pair of options for every pair among the
   6 largest tensors (:func:`pair_moves`, our addition) and, when that helps, runs Algorithm 1 again.
   On random instances of <= 5 tensors this closes the last gaps to brute force (tests).
3. **Fusion** (Cupcake, composed): runs of consecutive tensors with the same option may be fused
   into one buffer compressed once; :func:`~ddlscale.plan.cupcake.plan_fusion` finds the best such
   fusion exactly. Espresso also runs its search over the Cupcake groups of the configured
   compressor as units. The best of per-tensor, fused runs and Cupcake units is the plan; the plan
   says which.
4. **Algorithm 2** (``offload``) — compute-stream compression steals time from backward; a side
   device (the CPU) does not, but is slower and shared. Compressed units are grouped by
   (size, option); for each group in descending size, every prefix length (in backward order) of
   the group is tried on the side device and the best kept. It runs last, on the chosen units:
   the fusion DP is exact for compute-stream compression only.

All candidates are scored by :func:`ddlscale.comm.timeline.iteration_time` on
:meth:`CostModel.task` — the one simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ddlscale import clock
from ddlscale.comm.timeline import Swaps, TensorTask, Timeline, iteration_time, merged_busy, simulate
from ddlscale.plan.cupcake import Fusion, plan_fusion
from ddlscale.plan.pricing import DENSE, CostModel, Option, Unit

_TOL = 1e-12  # seconds: an "improvement" below this is float noise


@dataclass
class Search:
    """A plan over units: one option per unit, its simulated iteration time and provenance."""

    units: list[Unit]
    options: list[Option]
    iteration_s: float
    fusion: str = "per tensor"  # per tensor | fused runs | cupcake groups
    steps: list[str] = field(default_factory=list)  # what the search did, for the report
    simulations: int = 0


class Evaluator:
    """Iteration time of an assignment of options to units, with the tasks precomputed per option."""

    def __init__(self, units: Sequence[Unit], model: CostModel, backward_end_s: float, optimizer_s: float):
        self.units, self.model = list(units), model
        self.backward_end_s, self.optimizer_s = backward_end_s, optimizer_s
        self._tasks: dict[Option, list[TensorTask]] = {}  # every unit's task per option, priced together
        self._useful: dict[tuple, list[Option]] = {}
        self.evaluations = 0

    def task(self, i: int, option: Option) -> TensorTask:
        found = self._tasks.get(option)
        if found is None:
            found = self._tasks[option] = self.model.tasks(self.units, option)
        return found[i]

    def tasks(self, options: Sequence[Option]) -> list[TensorTask]:
        return [self.task(i, o) for i, o in enumerate(options)]

    def useful(self, i: int, options: Sequence[Option]) -> list[Option]:
        """``options`` without those another one matches or beats on every cost of unit ``i``.

        With compute-stream tasks only (Algorithm 1's plans) the simulator is a max-plus recursion,
        so the iteration time never decreases when an encode, comm or decode time grows: such an
        option can never be strictly better and dropping it is exact. It spares many simulations
        on small tensors, where several schemes cost the same constants. (A side stream queues
        jobs, where a longer job can reorder the queue, so side options are never pruned.)
        """
        key = (i, tuple(options))
        if key not in self._useful:
            if any(o.device != "compute" for o in options):
                self._useful[key] = list(options)
            else:
                costs = [(o, (t.encode_s, t.comm_s, t.decode_s)) for o in options for t in [self.task(i, o)]]

                def dominated(k: int) -> bool:
                    mine = costs[k][1]
                    for m, (_, other) in enumerate(costs):
                        if m != k and all(a <= b for a, b in zip(other, mine, strict=True)):
                            if other != mine or m < k:  # equal costs: keep the first such option
                                return True
                    return False

                self._useful[key] = [o for k, (o, _) in enumerate(costs) if not dominated(k)]
        return self._useful[key]

    def stolen(self, i: int, option: Option) -> float:
        """Compute-stream time unit ``i`` takes under ``option`` (what delays the rest of backward)."""
        task = self.task(i, option)
        return task.encode_s + task.decode_s if task.encode_on_compute else 0.0

    def time(self, tasks: Sequence[TensorTask]) -> float:
        self.evaluations += 1
        return iteration_time(tasks, self.backward_end_s, self.optimizer_s, check=False)

    def scorer(self, tasks: Sequence[TensorTask], options: Sequence[Option]) -> Swaps | None:
        """``tasks`` prepared for scoring changes of one or two of them in O(1) each, where every
        option keeps to the compute stream (else None: every candidate is simulated in full)."""
        if all(o.device == "compute" for o in options):
            return Swaps.of(tasks, self.backward_end_s, self.optimizer_s)
        return None

    def time_changed(self, base: Swaps | None, tasks: Sequence[TensorTask], changes: dict[int, TensorTask]) -> float:
        """Iteration time of ``tasks`` with ``changes`` made; ``base``: their scorer, if any."""
        if base is None:
            return self.time([changes.get(i, t) for i, t in enumerate(tasks)])
        self.evaluations += 1
        return base.time(changes)

    def timeline(self, tasks: Sequence[TensorTask]) -> Timeline:
        return simulate(tasks, self.backward_end_s, self.optimizer_s, check=False)


def before_bubble(timeline: Timeline) -> list[bool]:
    """Property 1, per task: is its message in a busy span of the communication stream that an idle
    gap follows — a later message starts after a gap, or, for the last span, the iteration ends with
    backward (every decode done before it: communication had slack)?"""
    last_decode = max((span.decode_end for span in timeline.tensors), default=0.0)
    return _before_bubble([(span.comm_start, span.comm_end) for span in timeline.tensors], timeline.comm_busy,
                          last_decode, timeline.backward_end_s)


def _before_bubble(comm: Sequence[tuple[float, float]], busy: Sequence[tuple[float, float]], last_decode: float,
                   backward_end_s: float) -> list[bool]:
    compute_bound = last_decode < backward_end_s - _TOL
    followed = [k + 1 < len(busy) or compute_bound for k in range(len(busy))]
    out, k = [], 0
    for start, end in comm:
        if end <= start:
            out.append(False)  # sends nothing: no bubble to widen
            continue
        while busy[k][1] < end - _TOL:
            k += 1
        out.append(followed[k])
    return out


def bubbles(ev: Evaluator, tasks: Sequence[TensorTask], base: Swaps | None) -> list[bool]:
    """:func:`before_bubble` of the plan ``tasks``, read off its scorer where there is one."""
    if base is None:
        return before_bubble(ev.timeline(tasks))
    return _before_bubble(base.comm, merged_busy(base.comm), base.last_decode_s, base.backward_end_s)


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


def algorithm1(ev: Evaluator, start: list[Option], options: Sequence[Option], max_passes: int = 4,
               use_property1: bool = True) -> tuple[list[Option], float, int]:
    """Greedy per-tensor search in descending size; returns (options, iteration time, passes run)."""
    current = list(start)
    tasks = ev.tasks(current)
    best_time = ev.time(tasks)
    base = ev.scorer(tasks, options)
    order = sorted(range(len(current)), key=lambda i: (-ev.units[i].numel, i))  # Property 2
    passes = 0
    while passes < max_passes:
        passes += 1
        changed = False
        bubbles_now = bubbles(ev, tasks, base) if use_property1 else None
        for i in order:
            candidates = ev.useful(i, options)
            if bubbles_now is not None and bubbles_now[i]:  # Property 1: only a lighter compute load can help
                candidates = [o for o in candidates if ev.stolen(i, o) < ev.stolen(i, current[i])]
            chosen = current[i]
            for option in candidates:
                if option == current[i]:
                    continue
                t = ev.time_changed(base, tasks, {i: ev.task(i, option)})
                if t < best_time - _TOL:
                    best_time, chosen = t, option
            if chosen != current[i]:
                current[i], tasks[i] = chosen, ev.task(i, chosen)
                base = ev.scorer(tasks, options)
                changed = True
                if use_property1:  # compression moved the bubbles: re-check against the new timeline
                    bubbles_now = bubbles(ev, tasks, base)
        if not changed:
            break
    return current, ev.time(tasks), passes  # the simulator's own figure, not the scorer's rounding


def pair_moves(ev: Evaluator, current: list[Option], best_time: float, options: Sequence[Option],
               top: int = 6) -> tuple[list[Option], float, int]:
    """Joint changes of two of the ``top`` largest tensors: what one-at-a-time moves cannot reach
    (e.g. compressing a tensor instead of, not besides, a similar one). Returns plan, time, changes."""
    current = list(current)
    tasks = ev.tasks(current)
    base = ev.scorer(tasks, options)
    largest = sorted(range(len(current)), key=lambda i: (-ev.units[i].numel, i))[:top]
    changes = 0
    improved = True
    while improved:
        improved = False
        for a, i in enumerate(largest):
            for j in largest[a + 1:]:
                best = None
                for oi in ev.useful(i, options):
                    for oj in ev.useful(j, options):
                        if oi == current[i] or oj == current[j]:
                            continue  # single moves are algorithm 1's
                        t = ev.time_changed(base, tasks, {i: ev.task(i, oi), j: ev.task(j, oj)})
                        if t < best_time - _TOL:
                            best_time, best = t, (oi, oj)
                if best is not None:
                    current[i], current[j] = best
                    tasks[i], tasks[j] = ev.task(i, current[i]), ev.task(j, current[j])
                    base = ev.scorer(tasks, options)
                    changes += 1
                    improved = True
    return current, best_time, changes


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


def _descend(ev: Evaluator, start: list[Option], options: Sequence[Option], max_passes: int, use_property1: bool,
             pair_top: int) -> tuple[list[Option], float, list[str]]:
    """Algorithm 1 from ``start``, then pair moves and Algorithm 1 again while they help."""
    current, best_time, passes = algorithm1(ev, start, options, max_passes, use_property1)
    log = [f"algorithm 1: {sum(a != b for a, b in zip(current, start, strict=True))} tensors changed, "
           f"{passes} pass(es) -> {best_time * 1e3:.3f} ms"]
    for _ in range(max_passes):
        moved, moved_time, changes = pair_moves(ev, current, best_time, options, pair_top)
        if not changes:
            break
        current, best_time, passes = algorithm1(ev, moved, options, max_passes, use_property1)
        log.append(f"pair moves among the {pair_top} largest: {changes} -> {moved_time * 1e3:.3f} ms; "
                   f"algorithm 1 again -> {best_time * 1e3:.3f} ms")
    return current, best_time, log


def search(units: Sequence[Unit], model: CostModel, backward_end_s: float, optimizer_s: float = 0.0,
           options: Sequence[Option] | None = None, offload: bool = False, use_property1: bool = True,
           max_passes: int = 4, pair_top: int = 6, starts_tried: int = 3, max_simulations: int = 1500) -> Search:
    """Steps 1-3 over ``units`` (per tensor, no fusion). Descents after the first start only while
    fewer than ``max_simulations`` simulations ran (small models get all three)."""
    options = list(options if options is not None else model.options())
    if not options:
        raise ValueError("espresso: no option is allowed for this compressor and cluster")
    ev = Evaluator(units, model, backward_end_s, optimizer_s)
    if not units:
        return Search([], [], backward_end_s + optimizer_s)
    starts = sorted(((ev.time(ev.tasks(plan)), name, plan) for name, plan in uniform_starts(ev, options)),
                    key=lambda s: s[0])
    best_time, current, steps, descents = None, None, [], 0
    for start_time, name, start in starts[:starts_tried]:
        if descents and ev.evaluations > max_simulations:
            break  # a large model: the first descent used the budget, stop there
        plan, plan_time, log = _descend(ev, start, options, max_passes, use_property1, pair_top)
        descents += 1
        if best_time is None or plan_time < best_time - _TOL:
            best_time, current = plan_time, plan
            steps = [f"start: uniform plan '{name}' ({start_time * 1e3:.3f} ms)", *log]
    steps.insert(0, f"descents: {descents} (from the best of {len(starts)} uniform plans); the best kept")
    if offload:
        current, best_time, moved = algorithm2(ev, current, best_time)
        steps.append(f"algorithm 2: {moved} tensors offloaded to the side device -> {best_time * 1e3:.3f} ms")
    steps.append(f"{ev.evaluations} simulations")
    return Search(list(units), current, best_time, "per tensor", steps, ev.evaluations)


def fused_runs(result: Search, model: CostModel, backward_end_s: float, optimizer_s: float) -> Fusion | None:
    """The best fusion of runs of equal options in a per-tensor plan (None if it offloads)."""
    if any(o.compressed and o.device != "compute" for o in result.options):
        return None
    return plan_fusion(result.units, model, lambda i: result.options[i], backward_end_s, optimizer_s)


def espresso(units: Sequence[Unit], model: CostModel, backward_end_s: float, optimizer_s: float = 0.0,
             options: Sequence[Option] | None = None, offload: bool = False, fuse: bool = True,
             cupcake_option: Option | None = None, max_passes: int = 4) -> Search:
    """Espresso's plan: the per-tensor search; then (``fuse``) the fused runs of its equal options
    and the search over the Cupcake groups of ``cupcake_option``; the best of these, and last
    (``offload``) Algorithm 2 on its units. Fusion comes before offloading because the fusion DP
    is exact for compute-stream compression only."""
    started = clock.now()
    best = search(units, model, backward_end_s, optimizer_s, options, max_passes=max_passes)
    if fuse and units:
        candidates = [best]
        fused = fused_runs(best, model, backward_end_s, optimizer_s)
        if fused is not None:
            candidates.append(Search(fused.units, fused.options, fused.iteration_s, "fused runs",
                                     [*best.steps, f"fused runs of equal options: {len(fused.groups)} groups"],
                                     best.simulations))
        if cupcake_option is not None and model.allows(cupcake_option):
            groups = plan_fusion(units, model, cupcake_option, backward_end_s, optimizer_s)
            over = search(groups.units, model, backward_end_s, optimizer_s, options, max_passes=max_passes)
            names = {"default": model.compressors["default"].name} if "default" in model.compressors else {}
            over.fusion = "cupcake groups"
            over.steps.insert(0, f"units: the {len(groups.groups)} Cupcake groups of {cupcake_option.label(names)}")
            candidates.append(over)
        best = min(candidates, key=lambda c: c.iteration_s)  # ties: the simpler, earlier candidate
    if offload and best.units:
        ev = Evaluator(best.units, model, backward_end_s, optimizer_s)
        best.options, best.iteration_s, moved = algorithm2(ev, best.options, best.iteration_s)
        best.steps.append(f"algorithm 2: {moved} unit(s) offloaded to the side device -> "
                          f"{best.iteration_s * 1e3:.3f} ms ({ev.evaluations} simulations)")
    best.steps.append(f"planning took {clock.now() - started:.3f} s")
    return best
