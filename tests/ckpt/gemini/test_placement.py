"""Replica placement: layouts, exact recovery probabilities (count == brute force), the paper's numbers."""

import math
import subprocess
import sys
from fractions import Fraction

import pytest

from ddlscale.ckpt.gemini.placement import (
    PlacementPlan,
    enumerate_surviving_sets,
    monte_carlo,
    paper_bound,
    recovery_probability,
    surviving_sets,
)


def test_group_placement_layout():
    plan = PlacementPlan(6, 3, "group")
    assert plan.components == ((0, 1, 2), (3, 4, 5))
    assert plan.holders_of(4) == (4, 5, 3)
    assert set(plan.replicas_of(4)) == {3, 4, 5} and plan.replicas_of(4)[0] == 4
    assert plan.peers_of(0) == (1, 2)


def test_mixed_placement_puts_the_remainder_in_a_ring():
    plan = PlacementPlan(7, 2, "mixed")  # groups {0,1} {2,3} and a ring over {4,5,6}
    assert plan.components == ((0, 1), (2, 3), (4, 5, 6))
    assert [plan.holders_of(s) for s in (4, 5, 6)] == [(4, 5), (5, 6), (6, 4)]
    assert plan.replicas_of(4) == (4, 6)
    # Every shard has m distinct holders and every machine stores exactly m replicas.
    for n, m in [(7, 2), (11, 3), (9, 4), (5, 5)]:
        for kind in ("mixed", "ring"):
            p = PlacementPlan(n, m, kind)
            assert all(len(set(p.holders_of(s))) == m for s in range(n))
            assert all(len(set(p.replicas_of(x))) == m for x in range(n))
            assert all(x in p.holders_of(s) for x in range(n) for s in p.replicas_of(x))


@pytest.mark.parametrize("kind", ["mixed", "ring"])
def test_exact_count_matches_brute_force(kind):
    for n in range(1, 11):
        for m in range(1, n + 1):
            plan = PlacementPlan(n, m, kind)
            for k in range(n + 1):
                assert surviving_sets(plan, k) == enumerate_surviving_sets(plan, k), (n, m, k)


def test_paper_examples():
    plan = PlacementPlan(16, 2)
    assert recovery_probability(plan, 2) == Fraction(14, 15)  # 93.3%
    assert recovery_probability(plan, 3) == Fraction(4, 5)  # 80.0%
    assert paper_bound(16, 2, 2) == Fraction(14, 15) and paper_bound(16, 2, 3) == Fraction(4, 5)
    ring = recovery_probability(PlacementPlan(16, 2, "ring"), 3)
    assert round(float(ring), 3) == 0.629
    assert ring == Fraction(352, 560)


def test_bound_is_exact_below_2m_and_a_lower_bound_above():
    for n, m in [(12, 2), (12, 3), (12, 4), (16, 4)]:
        plan = PlacementPlan(n, m, "group")
        for k in range(n + 1):
            exact = recovery_probability(plan, k, method="count")
            if k < 2 * m:
                assert exact == paper_bound(n, m, k), (n, m, k)
            else:
                assert exact >= paper_bound(n, m, k), (n, m, k)


def test_fewer_failures_than_replicas_always_recover():
    for kind in ("mixed", "ring"):
        plan = PlacementPlan(9, 4, kind)
        assert all(recovery_probability(plan, k) == 1 for k in range(4))
        assert recovery_probability(plan, 9) == 0


def test_large_clusters_use_the_exact_count():
    plan = PlacementPlan(1000, 2)
    exact = recovery_probability(plan, 15)
    assert math.comb(1000, 15) > 10**30 and exact.denominator > 1
    estimate, stderr = monte_carlo(plan, 15, trials=4000, seed=1)
    assert abs(estimate - float(exact)) < 5 * stderr + 1e-9


def test_monte_carlo_agrees_with_exact():
    for kind in ("mixed", "ring"):
        plan = PlacementPlan(13, 3, kind)
        exact = float(recovery_probability(plan, 5))
        estimate, stderr = monte_carlo(plan, 5, trials=20000, seed=3)
        assert abs(estimate - exact) < 5 * stderr


@pytest.mark.parametrize(
    "args,name",
    [((4, 5), "m (replicas)"), ((4, 0), "m (replicas)"), ((0, 1), "N (machines)"), ((5, 2, "group"), "m (replicas)")],
)
def test_bad_placement_input_names_the_argument(args, name):
    with pytest.raises(ValueError, match=name.replace("(", r"\(").replace(")", r"\)")):
        PlacementPlan(*args)


def test_bad_k_names_the_argument():
    plan = PlacementPlan(4, 2)
    for k in (-1, 5):
        with pytest.raises(ValueError, match=r"k \(simultaneous failures\)"):
            recovery_probability(plan, k)
    with pytest.raises(ValueError, match=r"m \(replicas\)"):
        paper_bound(4, 5, 1)


@pytest.mark.multiprocess
@pytest.mark.slow  # ~10 s: a subprocess of the tool
def test_command_line():
    out = subprocess.run([sys.executable, "-m", "ddlscale.tools.placement_odds", "16", "2", "3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "80.00%" in out.stdout and "62.86%" in out.stdout and "Monte-Carlo" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "ddlscale.tools.placement_odds", "4", "5", "1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "m (replicas)" in bad.stderr
