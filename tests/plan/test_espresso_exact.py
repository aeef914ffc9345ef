"""Espresso's search is brute force: zero gap to the optimum over the full option set (every
scheme, zen included, flat and hierarchical) on 1000 random instances."""

import random

import numpy as np

from ddlscale.comm.timeline import TensorTask, iteration_time
from ddlscale.plan.espresso import espresso, search
from ddlscale.plan.frontier import pareto
from ddlscale.plan.planner import cost_model
from ddlscale.plan.pricing import Option, units_of
from ddlscale.plan.result import plan_time
from ddlscale.plan.synthetic import random_profile


def brute_force(tasks, backward_end, optimizer, options=None, model=None):
    """Every assignment of options to units at once: ``tasks[i][k]`` is unit i under option k. The
    simulator's forward recursion (state: comm end, stolen compute, last decode), vectorized over
    all K^N assignments, each task with its own lag; with ``options`` and ``model``, each assignment
    also pays zen's rounds once per layout it uses zen in. Returns (best time, best assignment,
    every time, the assignments)."""
    count, width = len(tasks), len(tasks[0])
    picks = np.indices((width,) * count).reshape(count, -1).T  # row-major: assignment k's digits in base K
    comm_end = np.zeros(len(picks))
    stolen = np.zeros(len(picks))
    last = np.full(len(picks), -np.inf)
    for i in range(count):
        cost = np.array([[t.encode_s, t.comm_s, t.decode_s, t.lag_s] for t in tasks[i]])[picks[:, i]]
        ready = tasks[i][0].ready_s
        comm_end = np.maximum(ready + stolen + cost[:, 0] + cost[:, 3], comm_end) + cost[:, 1]
        stolen += cost[:, 0] + cost[:, 2]
        last = np.maximum(last, comm_end + cost[:, 2])
    times = np.maximum(last, backward_end + stolen) + optimizer
    for hier in (False, True) if options is not None else ():
        zen = np.array([o.scheme == "zen" and o.hierarchical == hier for o in options])
        times = times + np.where(zen[picks].any(axis=1), model.zen_rounds_s(hier), 0.0)
    best = int(np.argmin(times))
    return float(times[best]), picks[best], times, picks


def with_measured_families(rng, profile, options):
    """``profile`` with random measured cpu and lag for some of ``options``' families, sometimes a
    compressor's fallback (``default/*``) too: what calibration adds."""
    for option in options:
        if rng.random() < 0.5:
            terms = {"cpu_s": rng.uniform(0, 2e-3)} if rng.random() < 0.7 else {}
            if rng.random() < 0.7:
                terms["lag_s"] = rng.uniform(0, 5e-3)
            profile = profile.with_family(option.family, **terms)
    if rng.random() < 0.3:
        profile = profile.with_family("default/*", cpu_s=rng.uniform(0, 1e-3))
    return profile


def test_zero_gap_to_brute_force_on_the_full_option_set():
    rng = random.Random(43)
    offered, schemes, hierarchical, instances = set(), set(), 0, 1000
    for trial in range(instances):
        profile = random_profile(rng, rng.randint(1, 5))
        options = cost_model(profile).options()  # every scheme x layout, dense included
        profile = with_measured_families(rng, profile, options)
        model = cost_model(profile)
        units = units_of(profile)
        by_option = [model.tasks(units, o) for o in options]
        tasks = [[row[i] for row in by_option] for i in range(len(units))]
        best, pick, times, picks = brute_force(tasks, profile.backward_end_s, profile.rest_s, options, model)
        # The vectorized recursion is the simulator: checked on the optimum and two random plans.
        for row in (pick, picks[rng.randrange(len(picks))], picks[rng.randrange(len(picks))]):
            expected = plan_time(units, [options[k] for k in row], model, profile.backward_end_s, profile.rest_s)
            index = int(np.ravel_multi_index(tuple(row), (len(options),) * len(units)))
            assert (picks[index] == row).all()
            assert abs(expected - times[index]) <= 1e-12 * max(1.0, expected)
        found = search(units, model, profile.backward_end_s, profile.rest_s)
        assert found.iteration_s <= best * (1 + 1e-9), (trial, found.iteration_s, best, found.steps)
        assert abs(plan_time(units, found.options, model, profile.backward_end_s, profile.rest_s)
                   - found.iteration_s) <= 1e-12  # the time it reports is its plan's
        chosen = [options[k] for k in pick]
        offered |= {o.scheme for o in options}
        schemes |= {o.scheme for o in chosen if o.compressed}
        hierarchical += any(o.hierarchical for o in chosen)
    # The instances exercised the whole space: every scheme offered, optima under most of them
    # (gather, whose root decodes n payloads, is seldom best) and the hierarchical layout.
    assert offered == {"allreduce", "allgather", "alltoall", "gather", "zen"}, offered
    assert {"allreduce", "allgather", "alltoall", "zen"} <= schemes, schemes
    assert hierarchical > 0


def test_the_full_plan_is_never_worse_than_the_per_tensor_optimum():
    rng = random.Random(7)
    for trial in range(100):
        profile = random_profile(rng, rng.randint(1, 4))
        profile = with_measured_families(rng, profile, cost_model(profile).options())
        model = cost_model(profile)
        units, options = units_of(profile), model.options()
        tasks = [[model.task(u, o) for o in options] for u in units]
        best = brute_force(tasks, profile.backward_end_s, profile.rest_s, options, model)[0]
        plan = espresso(units, model, profile.backward_end_s, profile.rest_s,
                        cupcake_option=Option("default", "allgather"), offload=trial % 2 == 0)
        assert plan.iteration_s <= best * (1 + 1e-9), trial


def test_pareto_keeps_exactly_the_points_nothing_beats():
    rng = np.random.default_rng(3)
    for _ in range(200):
        alpha, beta = rng.integers(0, 6, 30).astype(float), rng.integers(0, 6, 30).astype(float)
        kept_alpha, kept_beta, index = pareto(alpha, beta, np.arange(30))
        for a, b in zip(alpha, beta, strict=True):  # every point is matched or beaten by a kept one
            assert ((kept_alpha <= a) & (kept_beta <= b)).any()
        for k, (a, b) in enumerate(zip(kept_alpha, kept_beta, strict=True)):  # no kept point is beaten
            others = np.delete(np.arange(kept_alpha.size), k)
            assert not ((kept_alpha[others] <= a) & (kept_beta[others] <= b)).any()
            assert (alpha[index[k]], beta[index[k]]) == (a, b)


def test_search_refuses_what_the_dp_cannot_model():
    profile = random_profile(random.Random(1), 3)
    model = cost_model(profile)
    units = units_of(profile)
    side = [o.on("side") for o in model.options() if o.compressed]
    try:
        search(units, model, profile.backward_end_s, profile.rest_s, [*model.options(), *side])
    except ValueError as err:
        assert "offload" in str(err)
    else:
        raise AssertionError("side-device options were accepted")
    shuffled = [units[2], units[0], units[1]] if units[2].ready_s > units[0].ready_s else units[::-1]
    try:
        search(shuffled, model, profile.backward_end_s, profile.rest_s)
    except ValueError as err:
        assert "backward order" in str(err)
    else:
        raise AssertionError("units out of backward order were accepted")


def test_the_search_is_what_the_simulator_says_of_its_plan():
    profile = random_profile(random.Random(11), 60)
    model = cost_model(profile)
    found = search(units_of(profile), model, profile.backward_end_s, profile.rest_s)
    plan = [model.task(u, o) for u, o in zip(found.units, found.options, strict=True)]
    fixed = model.fixed_s(found.options)
    assert iteration_time(plan, profile.backward_end_s, profile.rest_s + fixed) == found.iteration_s
    assert all(isinstance(t, TensorTask) for t in plan)


def test_thinned_fronts_stay_within_their_proven_gap():
    """Fronts capped at 2 points: the plan may miss the optimum, never by more than the gap it reports."""
    rng = random.Random(99)
    thinned = 0
    for trial in range(300):
        profile = random_profile(rng, rng.randint(3, 5))
        model = cost_model(profile)
        units, options = units_of(profile), model.options()
        by_option = [model.tasks(units, o) for o in options]
        tasks = [[row[i] for row in by_option] for i in range(len(units))]
        best = brute_force(tasks, profile.backward_end_s, profile.rest_s, options, model)[0]
        found = search(units, model, profile.backward_end_s, profile.rest_s, cap=2)
        assert best * (1 - 1e-9) <= found.iteration_s <= (best + found.gap_s) * (1 + 1e-9), (trial, found.steps)
        thinned += found.gap_s > 0
    assert thinned > 10  # the cap bit: the bound was exercised, not only zero gaps


def test_pareto_keeps_the_first_of_equal_points_sorted_by_alpha():
    rng = np.random.default_rng(5)
    for _ in range(200):
        alpha, beta = rng.integers(0, 4, 40).astype(float), rng.integers(0, 4, 40).astype(float)
        kept_alpha, kept_beta, index = pareto(alpha, beta, np.arange(40))
        assert (np.diff(kept_alpha) > 0).all() and (np.diff(kept_beta) < 0).all()
        for a, b, k in zip(kept_alpha, kept_beta, index, strict=True):
            assert k == np.flatnonzero((alpha == a) & (beta == b)).min()


def test_skipping_zen_subsets_finds_what_searching_each_one_does():
    """One search with zen's rounds uncharged, then only the subsets whose cheaper rounds leave a chance:
    the same time as searching every subset of zen's layouts (4 ranks per machine: flat and hierarchical)."""
    from ddlscale.plan.espresso import _search_within, zen_subsets

    rng, both = random.Random(17), 0
    for trial in range(16):
        profile = random_profile(rng, rng.randint(20, 60), world_size=16)
        profile.network = {**profile.network, "gpus_per_machine": 4}
        model = cost_model(profile)
        units, options = units_of(profile), model.options()
        both += len(zen_subsets(options)) == 4  # zen offered flat and hierarchical (a sparse compressor)
        every = min(_search_within(units, model, profile.backward_end_s, profile.rest_s, subset, None).iteration_s
                    for subset in zen_subsets(options))
        found = search(units, model, profile.backward_end_s, profile.rest_s, cap=None)
        assert found.iteration_s == every, trial
    assert both >= 4
