"""Each option's own cost: the terms calibration measures per option family (CPU on the training
thread, the slowest rank's lag), zen's rounds once per step, the owners' float32 sum of a 16-bit
allreduce under error feedback, TernGrad's shared scalar. Each term moves the predicted step by
what it should, and only for the options it belongs to."""

import random
from dataclasses import replace

import pytest

from ddlscale.comm.network import NetworkModel
from ddlscale.comm.timeline import iteration_time
from ddlscale.compress import FP16, NoCompression, TopK
from ddlscale.compress.cast import BF16
from ddlscale.compress.terngrad import TernGrad
from ddlscale.plan.espresso import search
from ddlscale.plan.planner import cost_model
from ddlscale.plan.pricing import DENSE, Option, Unit, units_of
from ddlscale.plan.profile import Profile, family
from ddlscale.plan.result import plan_time
from ddlscale.plan.synthetic import random_profile

NET = NetworkModel.of("1gbit", "200us", 1)
FLAT_AG, FLAT_A2A = Option("default", "allgather"), Option("default", "alltoall")


def _profile(seed: int = 5, count: int = 6, lag: float = 1e-3) -> Profile:
    return replace(random_profile(random.Random(seed), count, world_size=8), lag_s=lag)


def _topk(profile: Profile, world: int = 8):
    return cost_model(profile, {"none": NoCompression(), "default": TopK(0.01)}, world, NET)


def test_a_familys_cpu_is_charged_per_group_to_its_options_alone():
    base = _profile()
    measured = base.with_family(FLAT_AG.family, cpu_s=2e-3)
    before, after = _topk(base), _topk(measured)
    unit = units_of(base)[0]
    assert after.costs(unit, FLAT_AG)[0] == pytest.approx(before.costs(unit, FLAT_AG)[0] + 2e-3, abs=1e-15)
    for other in (FLAT_A2A, DENSE, Option("default", "zen")):
        assert after.costs(unit, other) == before.costs(unit, other)
    # The predicted step on a fast network (compute-bound): each of a layer-wise plan's groups
    # steals 2 ms more from backward on the one training thread.
    fast_net = NetworkModel.of("100gbit", "5us", 1)
    units = units_of(base)
    slow, fast = (plan_time(units, [FLAT_AG] * len(units),
                            cost_model(p, {"none": NoCompression(), "default": TopK(0.01)}, 8, fast_net),
                            base.backward_end_s, base.rest_s) for p in (measured, base))
    assert slow - fast == pytest.approx(2e-3 * len(units), rel=1e-9)


def test_a_compressors_fallback_applies_where_a_family_has_no_entry_of_its_own():
    profile = _profile().with_family("default/*", cpu_s=1e-3).with_family(FLAT_AG.family, cpu_s=4e-3)
    assert profile.family_terms(FLAT_A2A.family) == {"cpu_s": 1e-3}
    assert profile.family_terms(FLAT_AG.family) == {"cpu_s": 4e-3}
    assert profile.family_terms(family("none", "allreduce")) == {}
    bare = _topk(_profile())
    model = _topk(profile)
    unit = units_of(profile)[1]
    assert model.costs(unit, FLAT_A2A)[0] == pytest.approx(bare.costs(unit, FLAT_A2A)[0] + 1e-3, abs=1e-15)
    assert model.costs(unit, FLAT_AG)[0] == pytest.approx(bare.costs(unit, FLAT_AG)[0] + 4e-3, abs=1e-15)
    assert model.costs(unit, DENSE) == bare.costs(unit, DENSE)  # dense allreduce's own path: nothing per group
    with pytest.raises(ValueError, match="unknown family terms"):
        profile.with_family(FLAT_AG.family, cpu=1.0)


def test_a_familys_lag_replaces_the_dense_lag_for_its_options_and_moves_the_step_by_it():
    base = _profile(lag=1e-3)
    measured = base.with_family(FLAT_AG.family, lag_s=6e-3)
    model, dense_lag = _topk(measured), _topk(base)
    unit = Unit(("big",), 1 << 24, "torch.float32", base.backward_end_s, None, {"default": 0.01})
    scale = (base.rest_s + unit.ready_s) / (base.rest_s + base.backward_end_s)
    assert model.task(unit, FLAT_AG).lag_s == pytest.approx(6e-3 * scale)
    assert model.task(unit, FLAT_A2A).lag_s == pytest.approx(1e-3 * scale)  # unmeasured: the dense lag
    assert model.task(unit, FLAT_A2A).lag_s == dense_lag.task(unit, FLAT_A2A).lag_s
    # One group, ready at backward end: its collective starts after encode and lag, so the step
    # is later by exactly the lag's difference.
    step = {m: iteration_time([m.task(unit, FLAT_AG)], base.backward_end_s, base.rest_s) for m in (model, dense_lag)}
    assert step[model] - step[dense_lag] == pytest.approx(5e-3 * scale, rel=1e-9)


def test_families_survive_the_profiles_json(tmp_path):
    profile = _profile().with_family(FLAT_AG.family, cpu_s=1e-3, lag_s=2e-3)
    loaded = Profile.load(profile.save(tmp_path / "p.json"))
    assert loaded.families == {"default/allgather": {"cpu_s": 1e-3, "lag_s": 2e-3}}


def test_zen_pays_its_two_rounds_once_per_step_not_per_group():
    profile = _profile(count=10)
    model = _topk(profile)
    units, zen = units_of(profile), Option("default", "zen")
    rounds = model.zen_rounds_s()
    assert rounds == pytest.approx(2 * float(model.exchange.all_to_all(0.0, 8)))
    assert rounds >= 2 * 7 * 200e-6 * 0.99  # a message to each of 7 peers per round, 200 us each
    # A group's exchanges carry no latency: a tiny selection costs next to nothing to move.
    assert model.costs_of(64, "torch.float32", zen, 0.01)[1] < 1e-5
    assert model.fixed_s([zen, DENSE, zen]) == rounds
    assert model.fixed_s([DENSE, FLAT_AG]) == 0.0
    tasks = [model.task(u, zen) for u in units]
    assert plan_time(units, [zen] * len(units), model, profile.backward_end_s, profile.rest_s) == \
        iteration_time(tasks, profile.backward_end_s, profile.rest_s + rounds)


def test_the_search_charges_zen_once_and_skips_it_where_the_rounds_do_not_pay():
    """The search runs with and without zen; its reported time is its plan's, rounds counted once."""
    for seed in range(30):
        profile = _profile(seed, count=5)
        model = _topk(profile)
        units = units_of(profile)
        found = search(units, model, profile.backward_end_s, profile.rest_s)
        assert found.iteration_s == pytest.approx(plan_time(units, found.options, model, profile.backward_end_s,
                                                            profile.rest_s), abs=1e-12)
        without = search(units, model, profile.backward_end_s, profile.rest_s,
                         [o for o in model.options() if o.scheme != "zen"])
        assert found.iteration_s <= without.iteration_s + 1e-12


def test_a_16_bit_allreduce_under_error_feedback_is_priced_as_the_owners_sum():
    profile = _profile()
    plain = cost_model(profile, {"none": NoCompression(), "default": FP16()}, 8, NET)
    feedback = cost_model(replace(profile, widens=True), {"none": NoCompression(), "default": FP16()}, 8, NET)
    unit, allreduce = units_of(profile)[-1], Option("default", "allreduce")
    assert feedback.costs(unit, allreduce) == feedback.costs(unit, FLAT_A2A)  # reduce-scatter to owners, allgather
    assert plain.costs(unit, allreduce) != plain.costs(unit, FLAT_A2A)  # no feedback: the ring allreduce
    # bf16 of a bf16 gradient loses nothing in the sum's precision: a plain allreduce still.
    bf16 = cost_model(replace(profile, widens=True), {"none": NoCompression(), "default": BF16()}, 8, NET)
    half = replace(unit, dtype="torch.bfloat16")
    assert bf16.costs(half, allreduce) != bf16.costs(half, FLAT_A2A)


def test_terngrads_shared_scalar_costs_one_small_allreduce_per_group():
    profile = _profile()
    shared, own = (cost_model(profile, {"none": NoCompression(), "default": TernGrad(shared_scale=flag)}, 8, NET)
                   for flag in (True, False))
    unit = units_of(profile)[2]
    for scheme in ("allgather", "gather"):
        option = Option("default", scheme)
        (e1, c1, d1), (e0, c0, d0) = shared.costs(unit, option), own.costs(unit, option)
        assert e1 - e0 == pytest.approx(float(NET.allreduce(4.0, 8)), rel=1e-12)
        assert (c1, d1) == (c0, d0)


def test_zens_exchanges_wait_for_backward_end():
    """They block, so CompressSync runs them after backward: a zen group ready early still
    communicates after backward (and the slowest rank's backward) ended."""
    profile = _profile(lag=2e-3)
    model = _topk(profile)
    early = replace(units_of(profile)[0], ready_s=0.0)
    task = model.task(early, Option("default", "zen"))
    assert task.lag_s == pytest.approx(profile.backward_end_s + 2e-3)
    step = iteration_time([task], profile.backward_end_s, profile.rest_s)
    assert step >= profile.backward_end_s + 2e-3 + task.encode_s + task.comm_s + task.decode_s + profile.rest_s - 1e-12
    assert model.task(early, FLAT_AG).lag_s < task.lag_s  # an asynchronous collective starts at once
