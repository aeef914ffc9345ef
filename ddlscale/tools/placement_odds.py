"""Checkpoint replica placement and the chance of surviving k simultaneous machine failures.

    python -m ddlscale.tools.placement_odds N m k [--kind mixed|group|ring] [--trials T] [--seed S]

prints where each machine's checkpoint replicas go, then for k failures the exact recovery
probability, Gemini's bound and a Monte-Carlo estimate (and ring placement's exact value beside it).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from ddlscale.ckpt.gemini.placement import (
    ENUMERATION_LIMIT,
    KINDS,
    PlacementPlan,
    monte_carlo,
    paper_bound,
    recovery_probability,
)

# Beyond this many machines the per-machine table is summarized.
_TABLE_LIMIT = 64


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddlscale.tools.placement_odds", description=__doc__.split("\n\n")[0])
    parser.add_argument("N", type=int, help="machines")
    parser.add_argument("m", type=int, help="replicas of each machine's checkpoint (itself included)")
    parser.add_argument("k", type=int, help="simultaneous machine failures")
    parser.add_argument("--kind", choices=KINDS, default="mixed",
                        help="mixed (the paper's: groups, ring in the last group when m does not divide N)")
    parser.add_argument("--trials", type=int, default=100_000, help="Monte-Carlo samples")
    parser.add_argument("--seed", type=int, default=0, help="Monte-Carlo seed")
    return parser


def _percent(value: float) -> str:
    return f"{100 * float(value):.2f}%"


def _count(good: object, total: int) -> str:
    # Counts past 10^12 are unreadable; the percentage says it.
    return f"{good}/{total} failure sets survivable" if total < 10**12 else f"of C(N, k) = {total:.3e} failure sets"


def report(n: int, m: int, k: int, kind: str = "mixed", trials: int = 100_000, seed: int = 0) -> str:
    """The tool's whole output as text (raises ValueError on bad input, naming the argument)."""
    plan = PlacementPlan(n, m, kind)
    lines = [f"placement of m={m} replicas over N={n} machines: {plan.describe()}"]
    if n <= _TABLE_LIMIT:
        lines.append(f"  {'machine':>7}  {'sends to':<20} holds shards of")
        for machine in range(n):
            peers = " ".join(map(str, plan.peers_of(machine))) or "-"
            held = " ".join(map(str, plan.replicas_of(machine)))
            lines.append(f"  {machine:>7}  {peers:<20} {held}")
    else:
        lines.append(f"  {len(plan.components)} components of sizes {sorted({len(c) for c in plan.components})}")
    exact = recovery_probability(plan, k)
    total = math.comb(n, k)
    method = "enumeration" if total <= ENUMERATION_LIMIT else "combinatorial count"
    estimate, stderr = monte_carlo(plan, k, trials, seed)
    lines += [
        f"k={k} simultaneous failures (uniformly chosen machines):",
        f"  exact Pr(recover)      {_percent(exact):>8}   ({_count(exact * total, total)}, {method})",
    ]
    if n % m == 0:
        exact_note = " (exact: m <= k < 2m)" if m <= k < 2 * m else (" (k < m)" if k < m else "")
        lines.append(f"  paper's bound          {_percent(paper_bound(n, m, k)):>8}{exact_note}")
    else:
        lines.append("  paper's bound               n/a (stated for group placement with m | N)")
    lines.append(f"  Monte-Carlo            {_percent(estimate):>8} +- {_percent(stderr)} ({trials} trials)")
    if kind != "ring":
        ring = recovery_probability(PlacementPlan(n, m, "ring"), k)
        lines.append(f"  ring placement, exact  {_percent(ring):>8}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        print(report(args.N, args.m, args.k, args.kind, args.trials, args.seed))
    except ValueError as exc:
        print(f"placement: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
