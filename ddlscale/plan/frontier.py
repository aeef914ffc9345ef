"""The exact suffix DP both planners run: Pareto fronts of (alpha, beta) over the choices left.

With every encode and decode on the compute stream and ready times non-decreasing, the
simulator (:mod:`ddlscale.comm.timeline`) is a max-plus recursion over the state before item i —
communication stream end C, compute stolen so far S, latest decode end M. An item (a tensor under
an option, or a fused group) with ready time r, encode e, comm c, decode d and lag l maps it to

    C' = max(r + S + e + l, C) + c,   S' = S + e + d,   M' = max(M, C' + d)

and the iteration is max(M, B + S_N) + optimizer. Every term is "C + const" or "S + const", so the
items i..N-1 under fixed choices, entered in state (C, S, M), end at max(M, C + alpha, S + beta)
for two constants of those choices; one more item in front of them gives

    alpha = c + max(d, alpha'),   beta = max(r + l + e + alpha, e + d + beta')

from the empty suffix's (-inf, B). The time is non-decreasing in alpha and beta, so a suffix that
another beats in both can never be part of an optimum, whatever precedes it: keeping, per i, only
the Pareto front of (alpha, beta) is exact. The answer is the best point of front 0 (C = S = 0).

A row gives item i's choices: each column is one way to cover items i..j-1 (``nxt`` = j; Cupcake:
a group [i, j); Espresso: one option for tensor i, j = i + 1) with its (ready, encode, comm,
decode, lag). Pruning is exact too: a point of front i whose time, entered from the most
favourable state any prefix can reach (``floor_c[i]`` <= C, ``floor_s[i]`` <= S), exceeds a known
plan's time (``bound``) is dropped. A first sweep that keeps a few points per front (``thin``)
finds a plan near the optimum cheaply; its time is the bound of the exact sweep.

**Where fronts grow too large** (choosing which of hundreds of tensors to compress is knapsack-like:
fronts of 10^5 points on 300 random tensors), ``cap`` thins a front with a *proven* loss: along the
staircase (alpha up, beta down) points whose beta lies within delta of a kept point's — which has a
smaller alpha — are dropped, so every dropped point p has a kept q <= p + slack in both coordinates.
Each step's maps are max(x + const, y + const), non-decreasing and 1-Lipschitz in the max norm, so
the optimum's suffix, continued from q instead of p, ends at most that slack later; over all steps
the best point of front 0 is within the sum of the slacks of the optimum (``Sweep.gap``). The same
holds for a point pruned by the bound after a substitution: then the known plan is that close.
With no front over ``cap`` the gap is 0 and the answer is the optimum.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

THIN_FRONT = 16  # points per front in the first, bounding sweep
CAP = 4096  # points per front above which the exact sweep thins with a proven loss (see the module doc)

Row = tuple[np.ndarray, np.ndarray]  # (nxt: the item after each column, costs: (5, columns))


def sweep(rows: Sequence[Row], floor_c: Sequence[float], floor_s: Sequence[float], backward_end_s: float,
          optimizer_s: float, bound: float, thin: int | None = None, cap: int | None = None) -> tuple[list, float]:
    """The suffix fronts from the last item to the first: front[i] holds (alpha, beta, column of
    row i, index in front[nxt]) of its non-dominated points within ``bound``; ``thin`` keeps at
    most that many points per front (a heuristic sweep); ``cap`` thins fronts above it with a proven
    loss. Returns the fronts and that proven loss: the answer is within it of the optimum (0: exact)."""
    count, gap = len(rows), 0.0
    bound = bound * (1 + 1e-9) + 1e-12  # float slack: the known plan itself must survive
    front: list = [None] * (count + 1)
    front[count] = (np.array([-np.inf]), np.array([float(backward_end_s)]), np.array([-1]), np.array([-1]))
    # The fronts built so far, i+1..count, end to end in one array each, and how many points fronts
    # j..count hold: a row whose columns lead to consecutive fronts (Cupcake's groups [i, j)) reads
    # their points as one slice instead of joining them.
    joined = any(nxt.size > 1 and nxt[0] != nxt[-1] for nxt, _ in rows)  # else no row reads them
    flat_alpha, flat_beta = front[count][0], front[count][1]
    behind = np.zeros(count + 2, dtype=np.int64)
    behind[count] = 1
    for i in range(count - 1, -1, -1):
        nxt, costs = rows[i]
        # Every column against every point of the front it leads to, in one vectorized step.
        ready, encode, comm, decode, lag = costs
        if nxt.size and (nxt == nxt[0]).all():  # one front for every column (Espresso's rows): broadcast it
            tail_alpha, tail_beta = front[int(nxt[0])][:2]
            size = tail_alpha.size
            alpha2 = comm[:, None] + np.maximum(decode[:, None], tail_alpha)
            beta = np.maximum((ready + lag + encode)[:, None] + alpha2, (encode + decode)[:, None] + tail_beta).ravel()
            alpha = alpha2.ravel()

            def column_link(index: np.ndarray, size: int = size) -> tuple[np.ndarray, np.ndarray]:
                return index // size, index % size
        else:
            if joined and (np.diff(nxt) == 1).all():  # consecutive fronts: one slice of the joined ones
                first, last = int(nxt[0]), int(nxt[-1])
                sizes = behind[first:last + 1] - behind[first + 1:last + 2]
                start = flat_alpha.size - behind[first]
                tail_alpha = flat_alpha[start:start + sizes.sum()]
                tail_beta = flat_beta[start:start + sizes.sum()]
            else:
                sizes = np.array([front[j][0].size for j in nxt.tolist()])
                tail_alpha = np.concatenate([front[j][0] for j in nxt.tolist()])
                tail_beta = np.concatenate([front[j][1] for j in nxt.tolist()])
            ready, encode, comm, decode, lag = np.repeat(costs, sizes, axis=1)
            alpha = comm + np.maximum(decode, tail_alpha)
            beta = np.maximum(ready + lag + encode + alpha, encode + decode + tail_beta)
            starts = np.cumsum(sizes) - sizes

            def column_link(index: np.ndarray, starts: np.ndarray = starts) -> tuple[np.ndarray, np.ndarray]:
                column = np.searchsorted(starts, index, side="right") - 1
                return column, index - starts[column]
        least = np.maximum(floor_c[i] + alpha, floor_s[i] + beta)
        keep = least + optimizer_s <= bound
        if thin is not None and not keep.any():  # thinned fronts may miss every known plan: keep the best
            keep = least == least.min()
        index = np.flatnonzero(keep)
        front[i] = pareto(alpha[index], beta[index], *column_link(index))
        if thin is not None and front[i][0].size > thin:
            pick = np.unique(np.linspace(0, front[i][0].size - 1, thin).round().astype(int))
            front[i] = tuple(a[pick] for a in front[i])
        elif cap is not None and front[i][0].size > cap:
            front[i], slack = thinned(front[i], cap)
            gap += slack
        if joined:
            flat_alpha, flat_beta = np.concatenate((front[i][0], flat_alpha)), np.concatenate((front[i][1], flat_beta))
            behind[i] = behind[i + 1] + front[i][0].size
    return front, gap


def thinned(front: tuple[np.ndarray, ...], cap: int) -> tuple[tuple[np.ndarray, ...], float]:
    """At most about ``cap`` points of a Pareto front (alpha ascending, beta descending): buckets of
    beta width (range / cap), each kept by its first point — the smallest alpha, a beta at most the
    width above the others'. Returns the points and the largest amount by which a kept point's beta
    exceeds that of a point it stands for (its alpha never does)."""
    beta = front[1]
    width = (beta[0] - beta[-1]) / cap
    bucket = np.floor((beta[0] - beta) / width)
    first = np.concatenate(([True], bucket[1:] != bucket[:-1]))
    kept_by = np.maximum.accumulate(np.where(first, np.arange(beta.size), 0))
    return tuple(a[first] for a in front), float((beta[kept_by] - beta).max())


def best_path(rows: Sequence[Row], front: list) -> tuple[list[tuple[int, int]], float]:
    """The choices behind the best point of front 0, as (item, column) pairs, and its time before
    the optimizer."""
    alpha, beta = front[0][:2]
    best = int(np.argmin(np.maximum(alpha, beta)))
    seconds = float(max(alpha[best], beta[best]))
    path, i = [], 0
    while i < len(rows):
        column, best = int(front[i][2][best]), int(front[i][3][best])
        path.append((i, column))
        i = int(rows[i][0][column])
    return path, seconds


def pareto(alpha: np.ndarray, beta: np.ndarray, *payload: np.ndarray) -> tuple[np.ndarray, ...]:
    """The points no other point beats in both alpha and beta (ties: the first in input order).

    Sorted by alpha alone (stable: a sweep's candidates are a few runs already sorted by alpha, which
    the stable sort merges), each point is kept if its beta is below every earlier one's; of points
    with equal alpha that leaves several, each with a smaller beta, and only the last of them is not
    beaten. The same points as sorting by (alpha, beta), at a third of the cost."""
    order = np.argsort(alpha, kind="stable")
    b = beta[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], b[:-1])))
    keep = order[b < best_before]
    if keep.size > 1:
        kept = alpha[keep]
        keep = keep[np.append(kept[1:] != kept[:-1], True)]
    return (alpha[keep], beta[keep], *(p[keep] for p in payload))
