"""Cupcake: the DP's partition is the brute-force optimum of the simulator; sync=cupcake runs it."""

import json
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster import run_workers
from ddlscale.comm.timeline import TensorTask, iteration_time, simulate
from ddlscale.compress import FP16, TopK
from ddlscale.plan.cupcake import optimal_partition, plan_fusion
from ddlscale.plan.fit import CostFit
from ddlscale.plan.planner import (
    allreduce_efficiency,
    configured_option,
    cost_model,
    dense_plan,
    family_cpu,
    fused_units,
)
from ddlscale.plan.pricing import DENSE, Option, Unit, fuse, units_of
from ddlscale.plan.profile import CompressorProfile, Profile
from ddlscale.plan.result import uniform_time
from ddlscale.plan.synthetic import random_profile
from ddlscale.sync.compressed import CupcakeSync
from ddlscale.sync.compressed.planned import PLAN_FILE, WORK_EVERY, WORK_FILE
from ddlscale.sync.compressed.schemes import GroupWork

ROOT = Path(__file__).resolve().parents[2]


def partitions(count):
    """Every split of range(count) into contiguous (start, end) groups: 2^(count-1) of them."""
    for mask in range(1 << max(0, count - 1)):
        groups, start = [], 0
        for k in range(count - 1):
            if mask >> k & 1:
                groups.append((start, k + 1))
                start = k + 1
        yield [*groups, (start, count)]


def brute_force(count, group_cost, backward_end, optimizer):
    best = None
    for groups in partitions(count):
        costs = [group_cost(i, j) for i, j in groups]
        if any(c is None for c in costs):
            continue
        tasks = [as_task(f"{i}:{j}", c) for (i, j), c in zip(groups, costs, strict=True)]
        t = iteration_time(tasks, backward_end, optimizer)
        if best is None or t < best[0]:
            best = (t, groups)
    return best


def as_task(name, cost):
    """A group cost (ready, encode, comm, decode[, lag]) as the compute-stream task it stands for."""
    return TensorTask(name, *cost[:4], True, *cost[4:])


def random_instance(rng, count):
    """Random sorted ready times and a random group cost — sometimes linear, sometimes arbitrary;
    in half the instances the slowest rank lags, more so the later a group is ready."""
    ready = sorted(rng.uniform(0, 1e-2) for _ in range(count))
    backward_end = (ready[-1] if ready else 0.0) + rng.uniform(0, 3e-3)
    sizes = [2 ** rng.uniform(4, 20) for _ in range(count)]
    kind = rng.choice(["linear", "comm_stream", "table"])
    e, c, d = ((rng.uniform(0, 3e-4), rng.uniform(0, 2e-9)) for _ in range(3))
    lag = rng.choice([None, rng.uniform(0, 5e-3)])
    table = {}

    def group_cost(i, j):
        cost = unlagged(i, j)
        return cost if lag is None else (*cost, lag * (1e-3 + ready[j - 1]) / (1e-3 + backward_end))

    def unlagged(i, j):
        size = sum(sizes[i:j])
        if kind == "table":  # any cost at all: the DP must not rely on linearity or monotonicity
            if (i, j) not in table:
                table[(i, j)] = tuple(rng.uniform(0, 2e-3) for _ in range(3))
            return (ready[j - 1], *table[(i, j)])
        encode, comm, decode = (max(a, b * size) for a, b in (e, c, d))
        if kind == "comm_stream":  # compression on the communication stream: SYSTEMS.md's C[j] recursion
            return ready[j - 1], 0.0, encode + comm + decode, 0.0
        return ready[j - 1], encode, comm + 1e-4, decode

    return group_cost, backward_end, rng.uniform(0, 1e-3)


def test_dp_equals_brute_force_on_every_instance_up_to_12_tensors():
    rng = random.Random(2024)
    counts = [rng.randint(1, 12) for _ in range(200)]
    for trial, count in enumerate(counts):
        group_cost, backward_end, optimizer = random_instance(rng, count)
        groups, value = optimal_partition(count, group_cost, backward_end, optimizer)
        best, _ = brute_force(count, group_cost, backward_end, optimizer)
        tasks = [as_task(str(g), group_cost(*g)) for g in groups]
        simulated = simulate(tasks, backward_end, optimizer).iteration_s
        assert simulated == pytest.approx(best, rel=1e-12, abs=1e-15), (trial, count, groups)
        assert value == pytest.approx(best, rel=1e-12, abs=1e-15), (trial, count)


def test_dp_respects_forbidden_groups():
    """Groups that group_cost refuses (dtype changes) never appear, and the optimum among the rest is found."""
    rng = random.Random(7)
    for _ in range(60):
        count = rng.randint(2, 9)
        group_cost, backward_end, optimizer = random_instance(rng, count)
        wall = rng.randrange(1, count)  # no group may span items wall-1 and wall

        def split(i, j, wall=wall, group_cost=group_cost):
            return None if i < wall < j else group_cost(i, j)

        groups, value = optimal_partition(count, split, backward_end, optimizer)
        assert all(not i < wall < j for i, j in groups)
        assert value == pytest.approx(brute_force(count, split, backward_end, optimizer)[0], rel=1e-12)


def test_plan_fusion_on_the_cost_model_is_optimal_and_keeps_dtypes_apart():
    rng = random.Random(11)
    for _ in range(25):
        profile = random_profile(rng, rng.randint(1, 8))
        model = cost_model(profile)
        units = units_of(profile)
        if len(units) > 2:  # a float16 tensor in the middle: it can never share a buffer
            middle = len(units) // 2
            units[middle] = Unit(units[middle].names, units[middle].numel, "torch.float16", units[middle].ready_s,
                                 units[middle].shape, units[middle].kept)
        option = rng.choice([o for o in (DENSE, Option("default", "allgather"), Option("default", "alltoall"))
                             if model.allows(o)])  # a vote (signsgd) is not carried by alltoall
        if rng.random() < 0.5:  # a calibrated family: its fused groups wait for another lag than one tensor
            profile = profile.with_family(option.family, lag_s=rng.uniform(0, 3e-3), fused_lag_s=rng.uniform(0, 3e-3))
            model = cost_model(profile)
        plan = plan_fusion(units, model, option, profile.backward_end_s, profile.rest_s)
        for unit in plan.units:
            assert len({u.dtype for u in units if u.names[0] in unit.names}) == 1

        def group_cost(i, j, units=units, model=model, option=option):
            if len({u.dtype for u in units[i:j]}) > 1:
                return None
            task = model.task(fuse(units[i:j]), option)
            return task.ready_s, task.encode_s, task.comm_s, task.decode_s, task.lag_s

        best, _ = brute_force(len(units), group_cost, profile.backward_end_s, profile.rest_s)
        assert plan.iteration_s == pytest.approx(best, rel=1e-12)


def test_fusion_beats_layer_wise_on_many_small_tensors():
    """Cupcake's case: per-call compression cost and latency dominate small tensors."""
    rng = random.Random(3)
    profile = random_profile(rng, 60, world_size=8, min_exp=8, max_exp=12)
    model = cost_model(profile)
    units = units_of(profile)
    option = Option("default", "allgather")
    plan = plan_fusion(units, model, option, profile.backward_end_s, profile.rest_s)
    layer_wise = iteration_time([model.task(u, option) for u in units], profile.backward_end_s, profile.rest_s)
    assert len(plan.groups) < len(units)
    assert plan.iteration_s < layer_wise


def test_side_stream_groups_are_refused():
    profile = random_profile(random.Random(1), 4)
    with pytest.raises(ValueError, match="compute-stream"):
        plan_fusion(units_of(profile), cost_model(profile), Option("default", "allgather", device="side"),
                    profile.backward_end_s)


# -- the backend -----------------------------------------------------------------------------------
SHAPES = {"a": (37, 5), "b": (101,), "c": (8, 8), "d": (64, 40)}


def _sync_steps(rank, world, steps, bandwidth, state=None):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sync = CupcakeSync(TopK(ratio=1.0), trial_steps=0, comm="allgather", memory="none", profile_steps=2,
                       network_bandwidth=bandwidth, run_dir=None, settle_steps=1)
    sync.setup(params)
    if state is not None:
        sync.load_state_dict(state)
    exact, ops = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        grads = {name: torch.randint(-8, 9, shape, generator=g).float() for name, shape in SHAPES.items()}
        for name, p in reversed(params):  # backward order: last parameter first
            p.grad = grads[name].clone()
            sync.grad_ready(p)
        stats = sync.finish_step()
        for name in grads:
            grads[name] *= 1.0 / world
            dist.all_reduce(grads[name])
        exact.append(all(torch.equal(p.grad, grads[name]) for name, p in params))
        ops.append([r.op for r in stats.collectives])
    return sync.computed.to_dict(), exact, ops, sync.state_dict()


@pytest.mark.multiprocess
@pytest.mark.parametrize("bandwidth", ["10mbit", "100gbit"])
def test_cupcake_sync_profiles_plans_identically_and_runs_the_groups(bandwidth):
    results = run_workers(_sync_steps, 2, 12, bandwidth)
    (plan0, exact, ops, state), (plan1, *_rest) = results
    assert plan0 == plan1  # rank 0's plan, broadcast
    assert all(exact)  # top-k with ratio 1 is lossless: every step equals dense allreduce
    assert ops[0] == ops[1] == ops[2] == ["allreduce"]  # warm-up + 2 profiled steps: dense buckets
    # then a settling and 3 calibration steps with every tensor alone, and as many fused (one group)
    assert all(step == ["allgather_uneven"] * len(SHAPES) for step in ops[3:7])
    assert all(step == ["allgather_uneven"] for step in ops[7:11])
    groups = len(plan0["units"])
    assert ops[-1] == ["allgather_uneven"] * groups  # top-k is fixed-size: no size exchange, one message per group
    assert sum(len(u["names"]) for u in plan0["units"]) == len(SHAPES)
    # Resuming from the state dict keeps the plan: no profiling, the same groups from the first step.
    again = run_workers(_sync_steps, 2, 1, bandwidth, state)
    assert again[0][0] == plan0 and again[0][2][0] == ops[-1]


# Rank 1's late start, which the tests that check the measured lag see through a busy host's scheduling
# noise between two ranks' steps (tens of ms; 30 ms of lag was within it); where no lag is checked, a
# short one keeps the steps quick.
LAG_S, SHORT_LAG_S = 0.25, 0.03


def _calibrated(rank, world, run_dir, warmup=1, families=(), fused=False, lag_s=LAG_S, bandwidth="10mbit"):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sync = CupcakeSync(TopK(ratio=0.5), trial_steps=0, comm="allgather", memory="residual", profile_steps=1, calibrate_steps=2,
                       network_bandwidth=bandwidth, run_dir=run_dir, warmup_steps=warmup, settle_steps=2,
                       calibrate_families=list(families), calibrate_fused=fused)
    sync.setup(params)
    ops = []
    layouts = (len(families) + 1) * (2 if fused else 1)
    for step in range(warmup + 1 + 4 + 3 * (layouts - 1)):  # the first layout settles 2 steps, later ones 1
        g = torch.Generator().manual_seed(100 * rank + step)
        if rank == 1:
            time.sleep(lag_s)  # a slower worker: every collective waits for it
        for name, p in reversed(params):
            p.grad = torch.randn(SHAPES[name], generator=g)
            sync.grad_ready(p)
        ops.append([r.op for r in sync.finish_step().collectives])
    return ops, sync.computed is not None and sync.computed.notes[-1], sync.compressed.work


def _executed(rank, world, run_dir, steps):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sync = CupcakeSync(TopK(ratio=0.5), trial_steps=0, comm="allgather", memory="residual", profile_steps=1, calibrate_steps=0,
                       network_bandwidth="10mbit", run_dir=run_dir)
    sync.setup(params)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        if rank == 1:
            time.sleep(LAG_S)  # rank 0 waits for it in every group's collective
        for name, p in reversed(params):
            p.grad = torch.randn(SHAPES[name], generator=g)
            sync.grad_ready(p)
        sync.finish_step()


@pytest.mark.multiprocess
def test_the_kept_plans_groups_are_timed_as_they_run(tmp_path):
    # A warm-up and a profiled step, then the plan: its first step rebuilds the groups, untimed; 5 timed.
    run_workers(_executed, 2, str(tmp_path), 2 + 1 + WORK_EVERY)
    work = json.loads((tmp_path / WORK_FILE).read_text())
    plan = json.loads((tmp_path / PLAN_FILE).read_text())
    assert work["steps"] == WORK_EVERY
    assert sorted(tuple(g["names"]) for g in work["groups"]) == sorted(tuple(u["names"]) for u in plan["units"])
    options = {tuple(u["names"]): o for u, o in zip(plan["units"], plan["options"], strict=True)}
    for group in work["groups"]:
        compressed = options[tuple(group["names"])]["compressor"] != "none"
        assert group["numel"] == sum(torch.Size(SHAPES[n]).numel() for n in group["names"])
        assert (group["encode_s"] > 0 and group["decode_s"] > 0) if compressed else group["encode_s"] == 0
        assert group["finish_s"] >= group["decode_s"]  # the allgather's decode runs inside its finish
    # Rank 1 starts every step LAG_S late; rank 0's first collective of the step waits for it.
    assert sum(g["finish_s"] for g in work["groups"]) > 0.5 * LAG_S


@pytest.mark.multiprocess
def test_warmup_steps_run_dense_before_the_profiled_ones(tmp_path):
    (ops, planned, _), _ = run_workers(_calibrated, 2, str(tmp_path), 3, (), False, SHORT_LAG_S)
    # 3 warm-up and 1 profiled step dense, 2 settling and 2 calibration steps layer-wise, then the plan.
    assert ops[:4] == [["allreduce"]] * 4 and ops[4:] == [["allgather_uneven"] * len(SHAPES)] * 4
    assert planned and Profile.load(tmp_path / "plan_profile.json").steps == 1
    with pytest.raises(ValueError, match="sync.warmup_steps"):
        CupcakeSync(TopK(), warmup_steps=0)


@pytest.mark.multiprocess
def test_calibration_steps_time_the_compressor_in_layer_wise_steps_and_scale_its_fits(tmp_path):
    # Modelled at 100 Gbit/s the network leaves the step to the CPU, which the fit then matches.
    (ops, planned, work), _ = run_workers(_calibrated, 2, str(tmp_path), 1, (), False, LAG_S, "100gbit")
    # Warm-up and 1 profiled step dense; 2 settling and 2 calibration steps layer-wise (one top-k
    # allgather per tensor); the plan comes after the 6th.
    assert ops[:2] == [["allreduce"]] * 2 and ops[2:] == [["allgather_uneven"] * len(SHAPES)] * 4
    assert "calibrated in training" in planned and work is None  # the timings went into the plan
    profile = Profile.load(tmp_path / "plan_profile.json")
    calibration = profile.compressors["default"].calibration
    # Only the calibration steps' work counts, not the settling steps'.
    assert calibration["groups"] == 2 * len(SHAPES) and calibration["steps"] == 2
    assert calibration["encode"] > 0 and calibration["decode"] > 0
    assert profile.compressors["none"].calibration == {}  # only the configured compressor's fits are scaled
    # Rank 1 starts every step LAG_S late: the profile says the slowest rank ends backward that much behind.
    assert LAG_S * 0.8 < profile.lag_s < LAG_S * 3 and "the slowest rank" in planned
    # The configured option's family: its own lag, measured in the calibration steps (rank 0's
    # blocking size exchanges wait for rank 1 inside backward, so it may be far less than the dense
    # one), and its CPU per group, which the compressor's other families take until measured and a
    # hierarchical uncompressed group where it is a cost.
    families = profile.families
    assert 0 <= families["default/allgather"]["lag_s"] < LAG_S * 3
    assert "under default/allgather the slowest rank" in planned
    assert families["default/allgather"]["cpu_s"] == families["default/*"]["cpu_s"] == calibration["group_s"]
    assert families["none/*"]["cpu_s"] == max(0.0, calibration["group_s"])
    # The per-group CPU, either way, makes the model's layer-wise step what the calibration steps took.
    model = cost_model(profile)
    layerwise = uniform_time(units_of(profile), configured_option(model), model, profile.backward_end_s,
                             profile.rest_s)
    # (unless it ran faster than the model can say with no CPU at all: then at that floor)
    assert layerwise == pytest.approx(calibration["layerwise_step_s"], rel=1e-3) or (
        layerwise > calibration["layerwise_step_s"]
        and all(model.task(u, configured_option(model)).encode_s < 1e-6 for u in units_of(profile)))
    assert "ms per group and" in planned and "beyond the model" in planned
    # The allreduce efficiency makes the model's dense step (DDP's buckets) what the profiled steps took.
    factor = profile.network["efficiency"]["allreduce"]
    dense = dense_plan(profile, model).iteration_s
    # (at 1 the model already says as much or more; at the search's bound, 100, a host so loaded that
    # even that leaves the model's dense step short of the measured one)
    assert 1 <= factor <= 100
    if factor == 1:
        assert dense >= profile.step_s
    elif factor == 100:
        assert dense <= profile.step_s
    else:
        assert dense == pytest.approx(profile.step_s, rel=1e-3)
    assert f"allreduce x{factor:.2f} the network model" in planned


def test_each_family_of_calibrate_families_is_calibrated_in_turn_after_the_configured_one(tmp_path):
    (ops, planned, _), _ = run_workers(_calibrated, 2, str(tmp_path), 1, ["alltoall"])
    # Warm-up and profiled step dense; 2 settling and 2 calibration steps under the configured
    # allgather, then 1 settling and 2 under alltoall; the plan after the 9th.
    assert ops[:2] == [["allreduce"]] * 2
    assert ops[2:6] == [["allgather_uneven"] * len(SHAPES)] * 4
    # alltoall: the partitions' all-to-all per group, then the owners' sums allgathered (after backward).
    assert ops[6:] == [["all_to_all"] * len(SHAPES) + ["allgather_uneven"] * len(SHAPES)] * 3
    assert planned and "under default/alltoall the slowest rank" in planned
    profile = Profile.load(tmp_path / "plan_profile.json")
    for key in ("default/alltoall", "default/allgather"):  # rank 1 starts every step LAG_S late
        assert "cpu_s" in profile.families[key] and LAG_S * 0.5 < profile.families[key]["lag_s"] < LAG_S * 3
    # Both families' work scaled the fits: 2 measured steps each.
    assert profile.compressors["default"].calibration["groups"] == 4 * len(SHAPES)
    assert profile.compressors["default"].calibration["steps"] == 4


def _calibrated_fused(rank, world, run_dir, families):
    """_calibrated with calibrate_fused, and what each family's fit was given."""
    from ddlscale.sync.compressed import planned as planned_module

    given, real = [], planned_module.fit_families

    def recording(profile, measured, *args, **kwargs):
        given.extend((option.family, steps.fused_s is not None, steps.fused_lag_s is not None)
                     for option, steps in measured.items())
        return real(profile, measured, *args, **kwargs)

    planned_module.fit_families = recording
    return (*_calibrated(rank, world, run_dir, 1, families, True, SHORT_LAG_S), given)


def test_a_fused_calibration_follows_each_familys_layer_wise_one_and_splits_its_cost(tmp_path):
    (ops, planned, _, given), _ = run_workers(_calibrated_fused, 2, str(tmp_path), ["alltoall"])
    # Each family fitted from its layer-wise and fused steps, the slowest rank's lag in both.
    assert sorted(given) == [("default/allgather", True, True), ("default/alltoall", True, True)]
    assert ops[:2] == [["allreduce"]] * 2
    # The configured allgather layer-wise (2 settling, 2 timed), then fused: one group (every
    # tensor is float32), 1 settling and 2 timed; then alltoall the same way.
    assert ops[2:6] == [["allgather_uneven"] * len(SHAPES)] * 4
    assert ops[6:9] == [["allgather_uneven"]] * 3
    assert ops[9:12] == [["all_to_all"] * len(SHAPES) + ["allgather_uneven"] * len(SHAPES)] * 3
    assert ops[12:15] == [["all_to_all", "allgather_uneven"]] * 3
    profile = Profile.load(tmp_path / "plan_profile.json")
    for key in ("default/alltoall", "default/allgather"):
        terms = profile.families[key]
        assert {"cpu_s", "cpu_per_element_s", "lag_s", "fused_lag_s"} <= set(terms), key
    assert not any(key.endswith("@fused") for key in profile.families)
    assert profile.compressors["default"].calibration["groups"] == 2 * 2 * (len(SHAPES) + 1)
    assert planned and "calibrated in training" in planned and "fused" in planned


def test_calibrate_families_are_checked_naming_the_key():
    with pytest.raises(ValueError, match="sync.calibrate_families: 'ring'"):
        CupcakeSync(TopK(), calibrate_families=["ring"])
    with pytest.raises(ValueError, match="sync.calibrate_families: 'zen/flat'"):
        CupcakeSync(TopK(), calibrate_families=["zen/flat"])
    with pytest.raises(ValueError, match="sync.calibrate_families must be all or a list"):
        CupcakeSync(TopK(), calibrate_families="zen")
    with pytest.raises(ValueError, match="sync.calibrate_families"):
        CupcakeSync(FP16(), calibrate_families=["zen"])  # zen carries sparsifiers alone


def test_calibration_is_the_weighted_median_of_measured_over_fitted():
    sync = CupcakeSync(TopK(ratio=0.5), run_dir=None)
    fit = CostFit.fit([1000, 4000], [1e-3, 4e-3])
    costs = {"default": CompressorProfile("topk", {}, fit, fit, fit, fit)}

    def group(numel, encode_s, decode_s):  # one call to encode, one decode per rank of 2
        return GroupWork({"encode": encode_s, "decode": decode_s}, {"encode": [(numel, 1)], "decode": [(numel, 2)]})

    # Encode takes twice the fit, decode what the fit says; one small group hit a 100 ms stall.
    sync.calibration_work = [group(1000, 2e-3, 2e-3), group(4000, 8e-3, 8e-3), group(1000, 0.1, 2e-3)]
    sync.calibration_steps = 3
    prof = sync.calibrate(costs)["default"]
    assert prof.calibration == {"encode": pytest.approx(2.0), "decode": pytest.approx(1.0), "groups": 3, "steps": 3}
    assert prof.encode(2500) == pytest.approx(2 * fit(2500)) and prof.decode(2500) == pytest.approx(fit(2500))
    assert prof.side_encode == prof.encode  # a CPU host: the side device is the same CPU
    assert sync.calibration_work == [] and sync.calibrate(costs) is costs  # used once; nothing measured: unchanged
    with pytest.raises(ValueError, match="sync.calibrate_steps"):
        CupcakeSync(TopK(), calibrate_steps=-1)
    with pytest.raises(ValueError, match="sync.settle_steps must be an integer >= 1, got 0"):
        CupcakeSync(TopK(), settle_steps=0)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_a_fused_step_splits_a_familys_cost_into_per_group_and_per_element(seed):
    """Steps measured on a cluster whose family costs g per group and e per element, layer-wise and
    fused, give back g and e; one layer-wise step alone would charge it all per group."""
    profile = random_profile(random.Random(seed), 20, world_size=4)
    model = cost_model(profile)
    option, units = configured_option(model), units_of(profile)
    fused = fused_units(units)
    assert len(fused) == 1 and fused[0].numel == sum(u.numel for u in units)
    elements = fused[0].numel
    group_s, element_s = 3e-4, 2e-3 / elements  # 2 ms a step over all elements

    def measured(p, over):
        return uniform_time(over, option, cost_model(p), p.backward_end_s, p.rest_s)

    truth = profile.with_family(option.family, cpu_s=group_s, cpu_per_element_s=element_s)
    layerwise_s, fused_s = measured(truth, units), measured(truth, fused)
    got_group, got_element = family_cpu(profile, option, layerwise_s, fused_s)
    assert got_group == pytest.approx(group_s, rel=1e-2, abs=1e-6)
    assert got_element * elements == pytest.approx(element_s * elements, rel=1e-2, abs=1e-6)
    # Per group alone, the fused step is predicted short by about (N - 1) / N of the per-element cost.
    per_group_only = profile.with_family(option.family, cpu_s=family_cpu(profile, option, layerwise_s)[0])
    assert measured(per_group_only, fused) < fused_s - 0.5 * element_s * elements
    assert family_cpu(profile, DENSE, layerwise_s, fused_s) == (0.0, 0.0)


def test_a_layer_wise_step_alone_is_charged_per_group_either_way():
    profile = random_profile(random.Random(3), 20, world_size=4)
    model = cost_model(profile)
    option, units = configured_option(model), units_of(profile)

    def layerwise(p):
        return uniform_time(units, option, cost_model(p), p.backward_end_s, p.rest_s)

    extra = 4e-4
    measured = layerwise(profile.with_family(option.family, cpu_s=extra))
    assert measured > layerwise(profile) + extra  # every group pays it, on the training thread
    assert family_cpu(profile, option, measured) == (pytest.approx(extra, abs=1e-7), 0.0)
    # Measured below what the model says: the family is priced down (dev clamped this at 0).
    cheaper, _ = family_cpu(profile, option, 0.9 * layerwise(profile))
    assert cheaper < 0
    assert layerwise(profile.with_family(option.family, cpu_s=cheaper)) == pytest.approx(0.9 * layerwise(profile),
                                                                                         rel=1e-5)
    assert family_cpu(profile, DENSE, measured) == (0.0, 0.0)  # nothing compressed: no compressor to charge
    with pytest.raises(ValueError, match="CostFit.plus"):
        CostFit().plus(-1.0)


def test_allreduce_efficiency_makes_the_dense_prediction_what_the_profile_measured():
    profile = random_profile(random.Random(5), 30, world_size=8)
    profile.network = {**profile.network, "bandwidth": "1gbit"}  # communication that shows in the step

    def dense(factor):
        slowed = replace(profile, network={**profile.network, "efficiency": {"allreduce": factor}})
        return dense_plan(slowed, cost_model(slowed)).iteration_s

    assert dense(2.5) > dense(1.0)  # the profile's network entry reaches the model
    assert allreduce_efficiency(replace(profile, step_s=dense(2.5))) == pytest.approx(2.5, rel=1e-3)
    assert allreduce_efficiency(replace(profile, step_s=0.5 * dense(1.0))) == 1.0  # the model already says more
    assert allreduce_efficiency(replace(profile, step_s=None)) == 1.0  # nothing measured


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match="sync.profile_steps"):
        CupcakeSync(TopK(), profile_steps=0)
    with pytest.raises(ValueError, match="sync.network_bandwidth"):
        CupcakeSync(TopK(), network_bandwidth="fast")
    with pytest.raises(ValueError, match="sync.gpus_per_machine"):
        CupcakeSync(TopK(), gpus_per_machine=0)
    with pytest.raises(ValueError, match="sync.comm"):
        CupcakeSync(TopK(), comm="allreduce")  # top-k payloads cannot be summed


@pytest.mark.e2e
def test_train_py_with_cupcake_and_topk(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "sync=cupcake", "compressor=topk", "model=cnn",
         "model.num_samples=512", "trainer.max_steps=8", "sync.profile_steps=2", "sync.settle_steps=1",
         "sync.calibrate_steps=1", f"hydra.run.dir={out}",
         "trainer.enable_progress_bar=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sync"] == "cupcake" and summary["steps"] == 8
    plan = json.loads((out / "plan.json").read_text())
    assert plan["system"] == "cupcake" and (out / "plan_profile.json").exists()
    assert "predicted iteration" in (out / "plan.txt").read_text()
