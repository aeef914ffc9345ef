"""Calibration that corrects both ways (issue 60, item 1): each option family's CPU and lag are
fitted from its own layer-wise and fused steps, unclamped, so a family the benchmark over-prices is
priced down and one it under-prices up; fused groups are priced from the fused steps; the default
calibration takes no more steps than the trial it replaced."""

import inspect
import random
from dataclasses import replace

import pytest
import torch
import yaml

from ddlscale.cluster import run_workers
from ddlscale.comm.timeline import iteration_time
from ddlscale.compress import PowerSGD, SignSGD, TopK, build_compressor
from ddlscale.paths import CONF_DIR
from ddlscale.plan.planner import (
    FamilySteps,
    configured_option,
    cost_model,
    cupcake_plan,
    family_cpu,
    fit_families,
    fused_units,
)
from ddlscale.plan.pricing import fuse, units_of
from ddlscale.plan.profile import Profile
from ddlscale.plan.result import uniform_time
from ddlscale.plan.synthetic import random_profile
from ddlscale.sync.compressed import CupcakeSync, EspressoSync
from ddlscale.sync.compressed.compress_config import CALIBRATE_BUDGET, TRIAL_STEPS
from ddlscale.sync.compressed.planned import PlannedSync


def _fast_network(seed, count=20):
    """A random profile on a network fast enough that the family's CPU shows in the step."""
    profile = random_profile(random.Random(seed), count, world_size=4)
    return replace(profile, network={**profile.network, "bandwidth": "100gbit"})


def _step(profile, option, units):
    return uniform_time(units, option, cost_model(profile), profile.backward_end_s, profile.rest_s)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("sign", [-1, 1], ids=["over-priced", "under-priced"])
def test_a_family_the_benchmark_over_prices_is_priced_down_and_one_it_under_prices_up(seed, sign):
    profile = _fast_network(seed)
    model = cost_model(profile)
    option, units = configured_option(model), units_of(profile)
    fused = fused_units(units)
    # The cluster's truth: per group and per element, cheaper (sign -1) or dearer than the benchmark
    # says, by less than any group's benchmarked encode (so no group's CPU is below zero).
    smallest = min(model.task(u, option).encode_s for u in units)
    whole = model.task(fused[0], option).encode_s
    group_s, element_s = sign * 0.4 * smallest, sign * 0.4 * whole / fused[0].numel
    truth = profile.with_family(option.family, cpu_s=group_s, cpu_per_element_s=element_s)
    layerwise_s, fused_s = _step(truth, option, units), _step(truth, option, fused)
    before = _step(profile, option, units), _step(profile, option, fused)
    if sign < 0:  # over-priced: the benchmark predicts both steps dearer than measured
        assert before[0] > layerwise_s and before[1] > fused_s
    fitted = fit_families(profile, {option: FamilySteps(layerwise_s, fused_s)}, option)
    terms = fitted.families[option.family]
    assert terms["cpu_s"] == pytest.approx(group_s, rel=1e-2, abs=1e-7)
    assert terms["cpu_per_element_s"] * fused[0].numel == pytest.approx(element_s * fused[0].numel, rel=1e-3)
    assert (terms["cpu_s"] < 0 and terms["cpu_per_element_s"] < 0) == (sign < 0)
    # The fitted model says what was measured, layer-wise and fused: down from the benchmark's
    # figure (which a correction clamped at zero could never do), or up.
    after = _step(fitted, option, units), _step(fitted, option, fused)
    assert after[0] == pytest.approx(layerwise_s, rel=1e-5) and after[1] == pytest.approx(fused_s, rel=1e-5)
    assert all((a < b) == (sign < 0) for a, b in zip(after, before, strict=True))
    # The compressor's families left out take this one's CPU; a hierarchical dense group its cost only.
    assert fitted.families["default/*"] == {"cpu_s": terms["cpu_s"], "cpu_per_element_s": terms["cpu_per_element_s"]}
    assert fitted.families["none/*"] == {"cpu_s": max(0.0, terms["cpu_s"])}


def test_each_family_is_fitted_from_its_own_steps():
    profile = _fast_network(7)
    model = cost_model(profile)
    configured = configured_option(model)
    other = replace(configured, scheme="alltoall" if configured.scheme != "alltoall" else "allgather")
    assert model.allows(other)
    units = units_of(profile)
    fused = fused_units(units)
    truth = (profile.with_family(configured.family, cpu_s=3e-4, cpu_per_element_s=0.0)
             .with_family(other.family, cpu_s=-2e-5, cpu_per_element_s=-1e-10))
    measured = {o: FamilySteps(_step(truth, o, units), _step(truth, o, fused)) for o in (configured, other)}
    fitted = fit_families(profile, measured, configured)
    for option in (configured, other):
        assert _step(fitted, option, units) == pytest.approx(measured[option].layerwise_s, rel=1e-5)
        assert _step(fitted, option, fused) == pytest.approx(measured[option].fused_s, rel=1e-5)
    assert fitted.families[other.family]["cpu_s"] < 0 < fitted.families[configured.family]["cpu_s"]


def test_fused_groups_are_priced_from_the_fused_steps():
    profile = _fast_network(3)
    model = cost_model(profile)
    option, units = configured_option(model), units_of(profile)
    fused = fused_units(units)
    # Their lag: a group of one tensor waits for the slowest rank's lag in layer-wise steps, a fused
    # group for the one in fused steps.
    lagged = cost_model(profile.with_family(option.family, lag_s=1e-3, fused_lag_s=5e-3))
    alone, group = units[5], fuse(units[3:6])
    assert lagged.task(group, option).lag_s == pytest.approx(5 * lagged.task(fuse([alone]), option).lag_s * (
        profile.rest_s + group.ready_s) / (profile.rest_s + alone.ready_s))
    # Cupcake's DP prices each of its groups so (its prediction is its groups' tasks simulated).
    plan = cupcake_plan(profile, lagged, option)
    assert any(len(u.names) > 1 for u in plan.units)
    tasks = [lagged.task(u, option) for u in plan.units]
    assert plan.iteration_s == pytest.approx(iteration_time(tasks, profile.backward_end_s, profile.rest_s), rel=1e-12)
    # Their CPU: a fused step measured cheaper than the layer-wise step's per-group charge predicts
    # is what the fitted model says of it; priced per group alone it would be over-priced.
    layerwise_s = 1.3 * _step(profile, option, units)
    fused_s = 0.9 * _step(profile, option, fused)
    per_group = profile.with_family(option.family, cpu_s=family_cpu(profile, option, layerwise_s)[0])
    assert _step(per_group, option, fused) > fused_s
    steps = FamilySteps(layerwise_s, fused_s, lag_s=1e-3, fused_lag_s=5e-3)
    fitted = fit_families(profile, {option: steps}, option)
    assert fitted.families[option.family]["fused_lag_s"] == 5e-3
    assert _step(fitted, option, fused) == pytest.approx(fused_s, rel=1e-5)
    assert _step(fitted, option, units) == pytest.approx(layerwise_s, rel=1e-5)


def _schedule(sync, world=4, per_machine=1):
    """The calibration schedule as it would be set up on ``world`` ranks of ``per_machine`` each."""
    sync.world_size, sync.compressed.local_size = world, per_machine
    return sync.calibration_schedule()


def test_the_default_calibration_costs_no_more_steps_than_the_trial_it_replaced():
    # One default, in Python and in the YAML users get: every family, fused, mixed, no trial.
    params = inspect.signature(PlannedSync.__init__).parameters
    espresso = yaml.safe_load((CONF_DIR / "sync" / "espresso.yaml").read_text())
    cupcake = yaml.safe_load((CONF_DIR / "sync" / "cupcake.yaml").read_text())
    for key in ("calibrate_budget", "calibrate_families", "calibrate_fused", "trial_steps", "settle_steps",
                "calibrate_steps"):
        assert espresso[key] == cupcake[key] == params[key].default, key
    assert espresso["calibrate_mixed"] is True and "calibrate_mixed" not in cupcake
    assert TRIAL_STEPS == 0 and params["calibrate_families"].default == "all"
    # What the earlier default ran in compressed steps before its plan: 3 settling and 3 layer-wise
    # steps, then a trial of 3 candidates x 3 turns x (a settling and a measured step).
    assert CALIBRATE_BUDGET == 3 + 3 + 3 * 3 * 2
    cases = [  # (sync, world, ranks per machine, layouts, measured steps each, steps in all)
        (EspressoSync(TopK(), run_dir=None), 4, 1, 9, 1, 20),  # allgather, alltoall, gather, zen; mixed
        (EspressoSync(build_compressor("efsignsgd"), run_dir=None), 4, 1, 7, 2, 23),  # no zen
        (EspressoSync(SignSGD(), run_dir=None), 4, 1, 3, 3, 14),  # a vote: allgather alone
        (EspressoSync(PowerSGD(), comm="allreduce", run_dir=None), 4, 1, 3, 3, 14),
        (EspressoSync(TopK(), run_dir=None, gpus_per_machine=2), 4, 2, 11, 1, 24),  # flat and hierarchical
        (CupcakeSync(TopK(), run_dir=None), 4, 1, 2, 3, 10),
    ]
    for sync, world, per_machine, count, each, total in cases:
        layouts, measured, steps = _schedule(sync, world, per_machine)
        assert (len(layouts), measured, steps) == (count, each, total), sync.compressed.compressors["default"]
        assert steps <= CALIBRATE_BUDGET
        assert layouts[:2] == [(sync.comm_scheme, False, ""), (sync.comm_scheme, False, "@fused")]
    # Past the budget: the configured family first, then every other one layer-wise, fused last.
    layouts, _, _ = _schedule(EspressoSync(TopK(), run_dir=None, gpus_per_machine=2), 4, 2)
    assert [layout for *_, layout in layouts[3:10]] == [""] * 7 and layouts[10][2] == "@fused"


SHAPES = {"a": (37, 5), "b": (101,), "c": (8, 8), "d": (64, 40)}


def _calibrated_run(rank, world, run_dir):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sync = CupcakeSync(TopK(ratio=0.5), memory="residual", profile_steps=2, settle_steps=2, network_bandwidth="100gbit",
                       run_dir=run_dir)  # the default calibration, layer-wise then fused
    sync.setup(params)
    for step in range(1 + 2 + sync.calibration_schedule()[2] + 1):
        g = torch.Generator().manual_seed(100 * rank + step)
        for name, p in reversed(params):
            p.grad = torch.randn(SHAPES[name], generator=g)
            sync.grad_ready(p)
        sync.finish_step()
    return sync.computed is not None


@pytest.mark.multiprocess
def test_a_calibrated_run_prices_its_layer_wise_and_fused_steps_as_they_ran(tmp_path):
    assert all(run_workers(_calibrated_run, 2, str(tmp_path)))
    profile = Profile.load(tmp_path / "plan_profile.json")
    terms = profile.families["default/allgather"]
    assert {"cpu_s", "cpu_per_element_s", "lag_s", "fused_lag_s"} <= set(terms)
    calibration = profile.compressors["default"].calibration
    model = cost_model(profile)
    option, units = configured_option(model), units_of(profile)
    fused = fused_units(units)
    for over, measured in ((units, calibration["layerwise_step_s"]), (fused, calibration["fused_step_s"])):
        predicted = uniform_time(over, option, model, profile.backward_end_s, profile.rest_s)
        # As measured, unless the step ran faster than the model can say with no CPU at all (no
        # group's encode is below zero): then at that floor.
        assert predicted == pytest.approx(measured, rel=1e-3) or (
            predicted > measured and all(model.task(u, option).encode_s < 1e-6 for u in over))
