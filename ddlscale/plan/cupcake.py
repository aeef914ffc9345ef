"""Cupcake: the optimal partition of the tensors, in backward order, into contiguous fusion groups.

Each group is one flat buffer compressed once: fewer groups pay the per-call compression cost and
the per-message latency fewer times, larger groups start later (a group is complete only when its
last gradient is). Cupcake finds the partition that minimizes the simulated iteration time
(:func:`ddlscale.comm.timeline.simulate`) exactly, by dynamic programming over split points.

**Why a scalar state is not enough, and what is.** With compression on the compute stream
(GPU kernels, or the training thread on a CPU — what CompressSync does), group g with ready time
r_g (its last member's), encode e_g, comm c_g and decode d_g follows the simulator's recursion

    S_g        = S_{g-1} + e_g + d_g                       (compute time stolen so far)
    comm_end_g = max(r_g + S_{g-1} + e_g + l_g, comm_end_{g-1}) + c_g
    T          = max(B + S_G, max_g comm_end_g + d_g) + optimizer

(the encode starts as soon as the group is ready: ready times are non-decreasing and each ready
time already includes every earlier encode; l_g, the slowest rank's lag, delays the collective). Every term is "C + const" or "S + const", so for a
fixed partition of the tensors i..N-1 entered with comm-stream end C and stolen time S,

    T - optimizer = S + max(C - S + alpha, beta)

for two constants (alpha, beta) of that suffix partition. The suffix DP keeps, for each i, the
Pareto set of (alpha, beta) over all partitions of i..N-1 (smaller is better in both, as T is
non-decreasing in each): a partition off the front can never be optimal, whatever prefix precedes
it. A first group [i, j) followed by (alpha', beta') from suffix j gives

    alpha = c + max(d, alpha')
    beta  = max(r + l + e + alpha, e + d + beta')

with the empty suffix (alpha, beta) = (-inf, B). The answer is min over the front at 0 of
max(alpha, beta) (C = S = 0). This is exact for every input of the recursion — any group cost
function, not only linear ones — which the tests check against brute force over all 2^(N-1)
partitions. With encode and decode folded into the communication stream (e = d = 0, c = comp +
comm), it is the C[j] = min_i max(C[i], ready_{j-1}) + h + g recursion of SYSTEMS.md §3.

Side-stream compression (``encode_on_compute`` false with a non-zero encode or decode) also queues
decodes behind encodes on the side stream: the state is no longer two numbers, and
:func:`optimal_partition` refuses such groups rather than return a non-optimal answer.

The fronts are small in practice (tens of points); the work is O(N^2 * front) vectorized per split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ddlscale.comm.timeline import TensorTask, iteration_time
from ddlscale.plan.frontier import THIN_FRONT, best_path, sweep
from ddlscale.plan.pricing import CostModel, Option, Unit, fuse

GroupCost = Callable[[int, int], "tuple[float, ...] | None"]


def optimal_partition(count: int, group_cost: GroupCost, backward_end_s: float,
                      optimizer_s: float = 0.0) -> tuple[list[tuple[int, int]], float]:
    """Split ``range(count)`` into contiguous groups minimizing the simulated iteration time.

    ``group_cost(i, j)`` gives (ready_s, encode_s, comm_s, decode_s[, lag_s]) of items i..j-1
    fused and compressed on the compute stream (TensorTask's fields; lag 0 when left out), or None
    where they cannot be fused (then no group spans them). Returns the groups as (start, end) ranges and the iteration time the DP computed.

    ``group_cost`` must refuse every group that spans a forbidden pair, whatever its bounds.
    """
    def row_cost(i: int) -> tuple[list[int], np.ndarray]:
        js, costs = [], []
        for j in range(i + 1, count + 1):
            cost = group_cost(i, j)
            if cost is None:
                break  # fusing i..j-1 is not allowed, so neither is any longer group from i
            js.append(j)
            costs.append((*cost, 0.0)[:5])
        return js, np.array(costs, dtype=float).reshape(len(js), 5).T

    return partition_rows(count, row_cost, backward_end_s, optimizer_s)


def partition_rows(count: int, row_cost: Callable[[int], tuple[list[int], np.ndarray]], backward_end_s: float,
                   optimizer_s: float = 0.0) -> tuple[list[tuple[int, int]], float]:
    """:func:`optimal_partition` with the group costs given a row at a time: ``row_cost(i)`` returns
    the allowed ends j = i+1, i+2, ... (consecutive) and a (5, len) array of the groups [i, j)'s
    (ready_s, encode_s, comm_s, decode_s, lag_s) — priced together, as arrays.

    Pruning (exact): with ``bound`` the time of a known partition, a point of front[i] is dropped
    when even the most favourable prefix — communication done by the time item i-1 is ready, and
    the least compute any partition of items 0..i-1 steals (a 1-D DP over the same group costs):
    C >= ready_{i-1}, S >= stolen_i — gives a time T = max(C + alpha, S + beta) above ``bound``. The known partitions: every
    item alone, all in one group, and the answer of a first sweep that keeps only
    :data:`THIN_FRONT` points per front — near the optimum, so the exact sweep keeps few points
    (superlinear compression costs otherwise grow the fronts to thousands of points).
    """
    if count == 0:
        return [], backward_end_s + optimizer_s

    def task(name: str, cost: Sequence[float]) -> TensorTask:
        ready, encode, comm, decode, lag = (float(c) for c in cost)
        return TensorTask(name, ready, encode, comm, decode, True, lag)

    # Every group's cost once: both sweeps below read them.
    rows: list[tuple[list[int], np.ndarray]] = []
    for i in range(count):
        js, costs = row_cost(i)
        if not js or js[0] != i + 1:
            raise ValueError(f"item {i} cannot form a group on its own (no group [{i}, {i + 1}))")
        rows.append((list(js), costs))
    singles = [tuple(costs[:, 0].tolist()) for _, costs in rows]
    alone = [task(str(i), cost) for i, cost in enumerate(singles)]
    bound = iteration_time(alone, backward_end_s, optimizer_s)
    if rows[0][0][-1] == count:  # one group, where allowed: often the better bound
        bound = min(bound, iteration_time([task("all", rows[0][1][:, -1])], backward_end_s, optimizer_s))
    # stolen[i]: the least compute any partition of items 0..i-1 steals (its encodes and decodes).
    stolen = np.full(count + 1, np.inf)
    stolen[0] = 0.0
    for h, (js, costs) in enumerate(rows):
        span = slice(h + 1, h + 1 + len(js))
        stolen[span] = np.minimum(stolen[span], stolen[h] + costs[1] + costs[3])
    # A first sweep keeping only a few points per front finds a partition near the optimum; its time
    # bounds the exact sweep, which then prunes almost every point that cannot win.
    # Entered from a prefix of items 0..i-1: C >= ready_{i-1} and S >= stolen[i].
    table = [(np.asarray(js), costs) for js, costs in rows]
    floor_c = [0.0] + [single[0] for single in singles[:-1]]
    rough, _ = best_path(table, sweep(table, floor_c, stolen, backward_end_s, optimizer_s, bound, thin=THIN_FRONT)[0])
    rough_tasks = [task(str(i), rows[i][1][:, column]) for i, column in rough]
    bound = min(bound, iteration_time(rough_tasks, backward_end_s, optimizer_s))
    path, seconds = best_path(table, sweep(table, floor_c, stolen, backward_end_s, optimizer_s, bound)[0])
    return [(i, rows[i][0][column]) for i, column in path], seconds + optimizer_s


class Prefix:
    """Costs of fused units over any range without fusing them: prefix sums of sizes, tensors and kept elements."""

    def __init__(self, units: Sequence[Unit]):
        self.units = list(units)
        self.numel = np.concatenate(([0], np.cumsum([u.numel for u in units], dtype=np.int64)))
        self.tensors = np.concatenate(([0], np.cumsum([u.tensors for u in units], dtype=np.int64)))
        # Per key, kept elements and how many units lack the key: a range prices by the key only when
        # all its units have it (as fuse() does), so one unprofiled unit spoils only its own groups.
        keys = set().union(*(u.kept for u in units))
        self.kept = {key: np.concatenate(([0.0], np.cumsum([u.kept.get(key, 0.0) * u.numel for u in units])))
                     for key in keys}
        self.lacking = {key: np.concatenate(([0], np.cumsum([key not in u.kept for u in units], dtype=np.int64)))
                        for key in keys}
        # run_end[i]: first index after i with another dtype (a fused buffer has one dtype).
        self.run_end = [len(units)] * len(units)
        for i in range(len(units) - 2, -1, -1):
            same = units[i + 1].dtype == units[i].dtype
            self.run_end[i] = self.run_end[i + 1] if same else i + 1

    def row_costs(self, i: int, end: int, model: CostModel, option: Option) -> tuple[np.ndarray, ...]:
        """``model.costs`` of units i..j-1 fused under ``option`` for every j in i+1..end, as arrays
        (encode, comm, decode); ``end`` at most ``run_end[i]``."""
        if not i < end <= self.run_end[i]:
            raise ValueError(f"groups from unit {i} end in ({i}, {self.run_end[i]}], not at {end}")
        return self.rows_costs([i], {i: end}, model, option)[0]

    def rows_costs(self, rows: Sequence[int], ends: Sequence[int] | Mapping[int, int], model: CostModel,
                   option: Option) -> list[tuple[np.ndarray, ...]]:
        """:meth:`row_costs` of each of ``rows`` (units of one dtype, each row ``i`` to its ``ends[i]``),
        priced in one call: the same numbers, without a call's overhead per row (a fusion DP has
        hundreds of rows, most of them short)."""
        starts = np.asarray(rows, dtype=np.int64)
        lengths = np.asarray([ends[i] - i for i in rows], dtype=np.int64)
        first_of = np.repeat(starts, lengths)  # each group's first unit
        js = first_of + 1 + np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        numel, key = self.numel[js] - self.numel[first_of], option.compressor
        kept = np.full(js.size, np.nan)
        if key in self.kept:
            whole = self.lacking[key][js] == self.lacking[key][first_of]
            kept = np.where(whole, (self.kept[key][js] - self.kept[key][first_of]) / np.maximum(1, numel), np.nan)
        alone = np.flatnonzero(js == first_of + 1)  # a unit alone: its own fraction and shape
        kept[alone] = [self.units[i].kept.get(key, np.nan) for i in first_of[alone].tolist()]
        shapes: list = [None] * js.size
        for at, i in zip(alone.tolist(), first_of[alone].tolist(), strict=True):
            shapes[at] = self.units[i].shape
        costs = model.costs_many(numel, self.units[rows[0]].dtype, option, kept,
                                 self.tensors[js] - self.tensors[first_of], shapes)
        cuts = np.cumsum(lengths)[:-1]
        return list(zip(*(np.split(c, cuts) for c in costs), strict=True))


@dataclass
class Fusion:
    """Groups as (start, end) ranges over the units, each one fused unit with its option."""

    groups: list[tuple[int, int]]
    units: list[Unit]  # the fused units, one per group
    options: list[Option]
    tasks: list[TensorTask]
    iteration_s: float


def plan_fusion(units: Sequence[Unit], model: CostModel, option_of: Callable[[int], Option] | Option,
                backward_end_s: float, optimizer_s: float = 0.0) -> Fusion:
    """The optimal contiguous fusion of ``units`` where every group takes its members' common option.

    ``option_of``: one option for all (Cupcake) or a per-unit option (fusing an Espresso plan:
    only runs of equal options fuse). Options must compress on the compute stream.
    """
    option_at = (lambda _: option_of) if isinstance(option_of, Option) else option_of
    prefix = Prefix(units)
    options = [option_at(i) for i in range(len(units))]
    for i, opt in enumerate(options):
        if opt.device != "compute" and opt.compressed:
            raise ValueError(f"fusion DP is exact for compute-stream compression only; unit {i} uses {opt.label()}")

    run_end = list(range(1, len(units) + 1))  # run_end[i]: first index after i with another option
    for i in range(len(units) - 2, -1, -1):
        if options[i + 1] == options[i]:
            run_end[i] = run_end[i + 1]

    readies = np.array([u.ready_s for u in units], dtype=float)
    ends = [min(run_end[i], prefix.run_end[i]) for i in range(len(units))]
    # Every row's groups priced together, one call per option and dtype (a row's groups share both).
    priced: dict[int, tuple[np.ndarray, ...]] = {}
    kinds: dict[tuple[Option, str], list[int]] = {}
    for i, unit in enumerate(units):
        kinds.setdefault((options[i], unit.dtype), []).append(i)
    for (option, _), rows in kinds.items():
        priced.update(zip(rows, prefix.rows_costs(rows, ends, model, option), strict=True))

    def row_cost(i: int) -> tuple[list[int], np.ndarray]:
        end = ends[i]
        ready = readies[i:end]  # group [i, j) is complete when its last gradient, j - 1, is
        tensors = prefix.tensors[i + 1:end + 1] - prefix.tensors[i]  # a fused group waits for its family's fused lag
        lag = np.broadcast_to(model.lag(ready, options[i], tensors), ready.shape)
        return list(range(i + 1, end + 1)), np.vstack([ready, *priced[i], lag])

    # Fusing changes no unit's option, so the plan's fixed cost per step (zen's rounds) is known.
    optimizer_s = optimizer_s + model.fixed_s(options)
    groups, _ = partition_rows(len(units), row_cost, backward_end_s, optimizer_s)
    fused = [fuse(units[i:j]) for i, j in groups]
    chosen = [options[i] for i, _ in groups]
    tasks = [model.task(u, o) for u, o in zip(fused, chosen, strict=True)]
    # The simulator has the last word: it is the model, the DP only searches it.
    return Fusion(groups, fused, chosen, tasks, iteration_time(tasks, backward_end_s, optimizer_s))
