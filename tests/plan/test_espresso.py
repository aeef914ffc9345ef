"""Espresso: near brute force on small instances, never worse than uniform plans, fast on 300
tensors; the cost of an option; profiles; the plan tool; sync=espresso in a run."""

import csv
import dataclasses
import itertools
import json
import random
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster import run_workers
from ddlscale.comm.network import NetworkModel
from ddlscale.comm.timeline import TensorTask, iteration_time, simulate
from ddlscale.compress import FP16, NoCompression, PowerSGD, SignSGD, TopK
from ddlscale.compress.memory import Memory, ResidualMemory
from ddlscale.plan import profile as profile_module
from ddlscale.plan.cupcake import Prefix
from ddlscale.plan.espresso import Evaluator, espresso, search, uniform_starts
from ddlscale.plan.fit import CostFit
from ddlscale.plan.planner import configured_option, cost_model, espresso_plan
from ddlscale.plan.pricing import DENSE, CostModel, Option, fuse, units_of
from ddlscale.plan.profile import (
    MEMBER_COSTS,
    CompressorProfile,
    Profile,
    StepRecorder,
    TensorProfile,
    measure_costs,
    profile_compressor,
    slowest_lag,
)
from ddlscale.plan.result import CompressionPlan
from ddlscale.plan.synthetic import random_profile
from ddlscale.sync.compressed import EspressoSync
from ddlscale.tools import plan as plan_tool
from ddlscale.units import parse_bandwidth, parse_time

ROOT = Path(__file__).resolve().parents[2]


def _reduced(model):
    """Dense, and the compressor under allreduce (summable only), allgather or alltoall; at most 4."""
    return [o for o in model.options() if o.scheme in ("allreduce", "allgather", "alltoall")][:4]


def _brute_force(units, model, profile, options):
    ev = Evaluator(units, model, profile.backward_end_s, profile.rest_s)
    return min(ev.time(ev.tasks(combo)) for combo in itertools.product(options, repeat=len(units)))


def test_brute_force_optimum_up_to_5_tensors_offloading_or_not():
    rng = random.Random(17)
    for trial in range(150):
        profile = random_profile(rng, rng.randint(1, 5))
        model = cost_model(profile)
        units, options = units_of(profile), _reduced(model)
        best = _brute_force(units, model, profile, options)
        found = search(units, model, profile.backward_end_s, profile.rest_s, options, offload=trial % 2 == 0)
        assert found.iteration_s <= best * (1 + 1e-9) and found.gap_s == 0, (trial, found.steps)
        # The reported time is the simulator's for the reported plan.
        tasks = [model.task(u, o) for u, o in zip(found.units, found.options, strict=True)]
        assert simulate(tasks, profile.backward_end_s, profile.rest_s).iteration_s == pytest.approx(found.iteration_s)


def test_never_worse_than_the_best_uniform_plan():
    rng = random.Random(5)
    for trial in range(40):
        profile = random_profile(rng, rng.randint(1, 40))
        model = cost_model(profile)
        units = units_of(profile)
        ev = Evaluator(units, model, profile.backward_end_s, profile.rest_s)
        uniform = min(ev.time(ev.tasks(plan)) for _, plan in uniform_starts(ev, model.options()))
        result = espresso(units, model, profile.backward_end_s, profile.rest_s, offload=trial % 3 == 0,
                          cupcake_option=Option("default", "allgather"))
        assert result.iteration_s <= uniform + 1e-12, trial


def _plan_300_tensors():
    profile = random_profile(random.Random(300), 300, world_size=16)
    model = cost_model(profile)
    started = time.perf_counter()
    plan = espresso_plan(profile, model, cupcake_option=Option("default", "allgather"), offload=True)
    return plan, time.perf_counter() - started


def test_300_tensors_plan_whole():
    plan, _ = _plan_300_tensors()
    assert sum(len(u.names) for u in plan.units) == 300


@pytest.mark.slow  # a speed check (1.1 s on 2 cores at load 5): a busy host can make it anything
def test_300_tensors_plan_in_under_5_seconds():
    plan, elapsed = _plan_300_tensors()
    assert sum(len(u.names) for u in plan.units) == 300
    assert elapsed < 5.0, f"planning 300 tensors took {elapsed:.2f} s"


def test_algorithm2_offloads_only_when_it_helps():
    """A compute-bound iteration with a free side device: moving encodes off the compute stream wins."""
    tensors = [TensorProfile(f"t{i}", 1 << 20, (1 << 20,), "torch.float32", 0.01 * (i + 1)) for i in range(6)]
    slow = CostFit(1e-3, 0.0, 1e-8)
    comps = {"none": CompressorProfile("none", {}, CostFit(), CostFit(), CostFit(), CostFit()),
             "default": CompressorProfile("topk", {"ratio": 0.01}, slow, slow, slow, slow, 40)}
    profile = Profile(tensors, 0.07, 0.0, 4, {"bandwidth": "100mbit", "latency": "50us"}, comps)
    model = cost_model(profile)
    units = units_of(profile)
    plain = search(units, model, profile.backward_end_s, 0.0)
    offloaded = search(units, model, profile.backward_end_s, 0.0, offload=True)
    assert offloaded.iteration_s < plain.iteration_s
    assert any(o.device == "side" for o in offloaded.options)
    plan = espresso_plan(profile, model, cupcake_option=Option("default", "allgather"), offload=True, fuse=False)
    assert plan.offloaded and any("modeled only" in note for note in plan.notes)


# -- the cost of an option ---------------------------------------------------------------------------
def _model(world=4, gpus_per_machine=1, compressor=None):
    compressor = compressor or TopK(ratio=0.01)
    fit = CostFit(1e-4, 0.0, 1e-9)
    comps = {"none": CompressorProfile("none", {}, CostFit(), CostFit(), CostFit(), CostFit()),
             "default": CompressorProfile(compressor.name, {}, fit, fit, fit, fit, 40)}
    tensors = [TensorProfile("w", 1 << 20, (1024, 1024), "torch.float32", 0.001)]
    profile = Profile(tensors, 0.002, 0.0, world, {"bandwidth": "1gbit", "latency": "50us",
                                                    "gpus_per_machine": gpus_per_machine}, comps)
    return profile, CostModel(profile, {"none": NoCompression(), "default": compressor})


def test_incompatible_options_are_not_options():
    _, model = _model()
    labels = {o.label() for o in model.options()}
    assert "default/allreduce" not in labels  # top-k payloads cannot be summed
    assert "none/allreduce" in labels and "default/allgather" in labels and "default/alltoall" in labels
    assert not any(o.hierarchical for o in model.options())  # one rank per machine
    _, summable = _model(compressor=FP16())
    assert "default/allreduce" in {o.label() for o in summable.options()}
    _, machines = _model(world=8, gpus_per_machine=4)
    assert {o.label() for o in machines.options()} >= {"none/allreduce/hier", "default/allgather/hier"}


def test_option_costs_come_from_payload_bytes_the_network_model_and_the_fits():
    profile, model = _model()
    unit = units_of(profile)[0]
    net = NetworkModel.of("1gbit", "50us")
    payload = TopK(ratio=0.01).payload_bytes((1024, 1024), torch.float32) + 40
    encode, comm, decode = model.costs(unit, Option("default", "allgather"))
    fit = profile.compressors["default"].encode
    assert encode == pytest.approx(fit(1 << 20))  # top-k is fixed-size: no size exchange to wait for
    assert comm == pytest.approx(net.all_to_all(payload, 4))  # direct allgather of equal pieces
    assert decode == pytest.approx(4 * fit(1 << 20))  # every rank's payload
    assert model.costs(unit, DENSE) == pytest.approx((0.0, net.allreduce(4 << 20, 4), 0.0))
    task = model.task(unit, Option("default", "allgather", device="side"))
    assert not task.encode_on_compute


def test_error_feedback_prices_bf16_payloads_as_the_float32_they_travel_in():
    profile, _ = _model()
    profile.tensors[0] = dataclasses.replace(profile.tensors[0], dtype="torch.bfloat16")
    comps = {"none": NoCompression(), "default": TopK(ratio=0.01)}
    sent = {}
    for widens in (False, True):
        model = CostModel(dataclasses.replace(profile, widens=widens), comps)
        one = np.array([1 << 20])
        sent[widens] = model._payload("torch.bfloat16", np.array([np.nan]), np.array([1]), one,
                                      Option("default", "allgather"), one, [None])[0]
        assert model.costs(units_of(model.profile)[0], DENSE)[1] == pytest.approx(
            NetworkModel.of("1gbit", "50us").allreduce(2 << 20, 4))  # dense stays bf16 either way
    kept = TopK(ratio=0.01).kept_max(1 << 20)
    assert sent[True] - sent[False] == kept * 2  # values 4 bytes instead of 2; indices as they were
    # What CompressSync really sends under residual memory: float32 values.
    residual = ResidualMemory().compensate(torch.ones(8, dtype=torch.bfloat16), "w")
    assert ResidualMemory.widens and not Memory.widens and residual.dtype == torch.float32


def test_a_per_member_compressor_pays_for_every_fused_member(monkeypatch):
    profile = random_profile(random.Random(5), 6, world_size=4)
    signs = CompressorProfile("efsignsgd", {}, CostFit(1e-5, 0.0, 1e-9), CostFit(1e-5, 0.0, 1e-9),
                              CostFit(1e-5, 0.0, 1e-9), CostFit(1e-5, 0.0, 1e-9), member_encode_s=1e-4,
                              member_decode_s=2e-5, fused_encode_per_element_s=3e-10,
                              fused_decode_per_element_s=5e-10)
    free = dataclasses.replace(signs, **dict.fromkeys(MEMBER_COSTS, 0.0))
    priced = {}
    for key, per_member in (("signs", signs), ("free", free)):
        fused = dataclasses.replace(profile, compressors={**profile.compressors, "default": per_member})
        model = cost_model(fused)
        units = units_of(fused)
        group = fuse(units[:4])
        priced[key] = model.costs(group, Option("default", "allgather"))
        # Cupcake's unnamed groups count their tensors as fuse() does, so the DP prices what runs.
        row = Prefix(units).row_costs(0, 4, model, Option("default", "allgather"))
        assert [float(a[-1]) for a in row] == pytest.approx(priced[key], rel=1e-12)
        assert model.costs(units[0], Option("default", "allgather"))[0] == pytest.approx(signs.encode(units[0].numel))
    (encode, comm, decode), (encode0, comm0, decode0) = priced["signs"], priced["free"]
    numel = group.numel
    assert encode - encode0 == pytest.approx(3 * 1e-4 + 3e-10 * numel) and comm == comm0
    assert decode - decode0 == pytest.approx(4 * (3 * 2e-5 + 5e-10 * numel))  # every rank's payload decoded
    # Calibration scales them with the fits; the benchmark finds them for a per-member compressor only.
    assert signs.calibrated(2.0, 3.0).member_encode_s == pytest.approx(2e-4)
    assert signs.calibrated(2.0, 3.0).fused_decode_per_element_s == pytest.approx(1.5e-9)
    assert Profile.from_dict(dataclasses.replace(
        profile, compressors={"default": signs}).to_dict()).compressors["default"] == signs
    probed = []  # not timed here (a loaded host can time the difference as 0): who gets probed
    monkeypatch.setattr(profile_module, "member_costs",
                        lambda c, *a, **k: probed.append(c.name) or {"member_encode_s": 1e-6})
    assert profile_compressor(SignSGD(scaled=True, vote=False), 1 << 12).member_encode_s == 1e-6
    assert profile_compressor(TopK(ratio=0.01), 1 << 12).member_encode_s == 0.0
    assert probed == ["efsignsgd"]


def test_member_costs_separate_a_cost_per_member_from_a_pass_over_the_buffer(monkeypatch):
    """Fusing timed at two sizes with as many members: what grows with the size is per element,
    the rest per member."""
    per_member, per_element = {"encode": 4e-6, "decode": 1e-6}, {"encode": 0.0, "decode": 3e-10}

    def measure(compressor, sizes, device, budget_s, memory, members=1):
        fused = members > 1
        return None, None, [{f"{w}_s": 1e-3 + 1e-9 * sizes[0] + fused * ((members - 1) * per_member[w]
                             + sizes[0] * per_element[w]) for w in ("encode", "decode")}]

    monkeypatch.setattr(profile_module, "measure_costs", measure)
    got = profile_module.member_costs(SignSGD(scaled=True, vote=False))
    assert set(got) == set(MEMBER_COSTS)
    for what in ("encode", "decode"):
        assert got[f"member_{what}_s"] == pytest.approx(per_member[what])
        assert got[f"fused_{what}_per_element_s"] == pytest.approx(per_element[what], abs=1e-15)


def test_a_unit_without_a_kept_fraction_spoils_only_the_groups_holding_it():
    profile = random_profile(random.Random(9), 6, world_size=4)
    model, option = cost_model(profile), Option("default", "allgather")
    assert not model.compressors["default"].fixed_size  # DGC: the payload follows the kept fraction
    units = units_of(profile)
    units[4] = dataclasses.replace(units[4], kept={})  # no gradient when profiled
    prefix = Prefix(units)
    for i in range(6):
        row = prefix.row_costs(i, 6, model, option)
        for j in range(i + 1, 7):
            group = fuse(units[i:j])
            assert ("default" in group.kept) == (not i <= 4 < j)
            assert [float(a[j - i - 1]) for a in row] == pytest.approx(model.costs(group, option), rel=1e-12)


def test_cost_fit_recovers_constant_then_linear():
    truth = CostFit(2e-5, -1e-5, 3e-9)
    sizes = [2**e for e in range(8, 23, 2)]
    fitted = CostFit.fit(sizes, [truth(s) for s in sizes])
    for s in [*sizes, 3000, 700_000, 1 << 24]:  # measured, between measured, beyond the largest
        assert fitted(s) == pytest.approx(truth(s), rel=0.05)
    assert fitted(1) == fitted(sizes[0]) and fitted(0) == 0.0
    assert CostFit.from_dict(json.loads(json.dumps(fitted.to_dict()))) == fitted


def test_cost_fit_prices_arrays_as_it_prices_one_size():
    rng = random.Random(1)
    fits = [CostFit(2e-5, -1e-5, 3e-9), CostFit.fit([1000], [1e-4])]
    fits += [CostFit.fit(sorted(rng.sample(range(1, 10**6), k)), [rng.uniform(0, 1e-3) for _ in range(k)])
             for k in (2, 3, 7)]
    for fit in fits:
        sizes = np.array([0, -3, 1, 999, 1000, 10**6, 3 * 10**6] + [s for s, _ in fit.points])
        extra = np.array([rng.uniform(0, 1e-4) for _ in sizes])
        per_element = np.array([rng.choice([0.0, 1e-9]) for _ in sizes])
        assert fit.many(sizes) == pytest.approx([fit(s) for s in sizes], rel=1e-12, abs=1e-18)
        assert fit.many(sizes, extra, per_element) == pytest.approx(  # a fused group's fit, built per member count
            [fit.plus(e, p)(s) for s, e, p in zip(sizes, extra, per_element, strict=True)], rel=1e-12, abs=1e-18)


def test_cost_fit_follows_a_bent_curve_and_never_falls_with_size():
    # Measured on this host (DGC, residual memory): the per-element cost jumps between 1M and 4M.
    sizes = [256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304]
    seconds = [7.4e-5, 7.6e-5, 1.2e-4, 1.6e-4, 3.7e-4, 1.2e-3, 4.5e-3, 8.9e-2]
    fitted = CostFit.fit(sizes, seconds)
    assert fitted(262144) == pytest.approx(1.2e-3) and fitted(327680) == pytest.approx(1.2e-3 + 3.3e-3 / 12)
    noisy = CostFit.fit([1, 2, 3, 4], [1.0, 3.0, 2.0, 4.0])  # the dip at 3 pooled with its neighbour
    assert [noisy(s) for s in (1, 2, 3, 4)] == [1.0, 2.5, 2.5, 4.0]
    with pytest.raises(ValueError, match="finite"):
        CostFit.fit([1, 2], [1.0, float("nan")])
    samples = measure_costs(TopK(ratio=0.01), [256, 4096], budget_s=0.001)[2]
    assert all(s["encode_s"] > 0 and s["decode_s"] > 0 for s in samples)


def test_profile_json_round_trip_and_recorder(tmp_path):
    profile = random_profile(random.Random(0), 5)
    again = Profile.load(profile.save(tmp_path / "p.json"))
    assert again == profile
    recorder = StepRecorder()
    for _ in range(3):
        for i in (2, 1, 0):
            recorder.ready(i)
        recorder.backward_end()
        recorder.step_end()
    summary = recorder.summary([2, 1, 0])
    assert summary["steps"] == 2 and summary["ready_s"][0] == 0.0
    assert len(recorder.spans()) == 2 and all(s >= 0 for s in recorder.spans())
    assert summary["ready_s"] == sorted(summary["ready_s"]) and summary["ready_s"][-1] <= summary["backward_end_s"]


def test_slowest_lag_is_the_median_lead_of_the_slowest_rank_and_grows_through_the_step():
    spans = [[1.0, 1.0, 1.0, 1.0], [1.2, 0.9, 1.5, 1.1], [1.1, 1.3, 0.8, 1.0]]  # seconds, 3 ranks x 4 steps
    assert slowest_lag(spans, rank=0) == pytest.approx(0.25)  # median of 0.2, 0.3, 0.5, 0.1
    assert slowest_lag(spans, rank=2) == pytest.approx(0.1)  # median of 0.1, 0, 0.7, 0.1
    assert slowest_lag([[1.0, 2.0]]) == 0.0 and slowest_lag([[], []]) == 0.0
    # The model grows it from the previous step's end (rest, then backward) to backward end.
    profile = dataclasses.replace(random_profile(random.Random(1), 4), lag_s=0.01)
    model = cost_model(profile)
    assert model.lag(profile.backward_end_s) == pytest.approx(0.01)
    assert model.lag(0.0) == pytest.approx(0.01 * profile.rest_s / (profile.rest_s + profile.backward_end_s))
    assert model.task(units_of(profile)[0], DENSE).lag_s == model.lag(profile.tensors[0].ready_s)
    assert cost_model(dataclasses.replace(profile, lag_s=0.0)).lag(profile.backward_end_s) == 0.0


def test_plan_round_trips_and_becomes_a_compress_plan():
    profile = random_profile(random.Random(9), 12)
    plan = espresso_plan(profile, cost_model(profile), cupcake_option=Option("default", "allgather"))
    again = CompressionPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.to_dict() == plan.to_dict()
    executable = plan.to_choices()
    assert set(executable.tensors) == {t.name for t in profile.tensors}
    text = plan.describe()
    assert "predicted iteration" in text and "saved (ms)" in text


# -- the tool ----------------------------------------------------------------------------------------
def test_plan_tool_recomputes_a_saved_profile_for_another_cluster(tmp_path):
    path = random_profile(random.Random(4), 20, world_size=4).save(tmp_path / "plan_profile.json")
    text = plan_tool.report(["--profile", str(path), "--workers", "64", "--bandwidth", "25gbit",
                             "--json", str(tmp_path / "plans.json")])
    assert "cupcake plan" in text and "espresso plan" in text and "64 workers" in text
    assert set(json.loads((tmp_path / "plans.json").read_text())) == {"cupcake", "espresso"}
    with pytest.raises(ValueError, match="--bandwidth"):
        plan_tool.report(["--profile", str(path), "--bandwidth", "fast"])


def test_plan_tool_profiles_a_model(tmp_path):
    text = plan_tool.report(["--model", "cnn", "--compressor", "topk", "--steps", "3",
                             "--system", "espresso", "--save", str(tmp_path / "p.json")])
    assert "espresso plan" in text and "compressor TopK" in text
    # The speed-up stated is against dense allreduce as it runs (DDP's buckets), priced by the same model.
    assert re.search(r"vs dense, DDP buckets: [0-9.]+ ms \(speed-up [0-9.]+x\)", text)
    assert "per tensor" not in text.split("fusion:")[0]
    # top-k's default error feedback is residual: timed with it, p = g + e in float32.
    assert Profile.load(tmp_path / "p.json").widens
    with pytest.raises(ValueError, match="--memory 'bogus'"):
        plan_tool.report(["--model", "cnn", "--memory", "bogus"])


# -- the backend -------------------------------------------------------------------------------------
SHAPES = {"a": (37, 5), "b": (101,), "c": (8, 8), "d": (64, 40)}


def _exact_step(sync, params, rank, world, step):
    """One step of integer gradients through ``sync``; whether it equals dense allreduce exactly."""
    g = torch.Generator().manual_seed(100 * rank + step)
    grads = {name: torch.randint(-8, 9, shape, generator=g).float() for name, shape in SHAPES.items()}
    for name, p in reversed(params):
        p.grad = grads[name].clone()
        sync.grad_ready(p)
    sync.finish_step()
    for name in grads:
        grads[name] *= 1.0 / world
        dist.all_reduce(grads[name])
    return all(torch.equal(p.grad, grads[name]) for name, p in params)


def _espresso_steps(rank, world, bandwidth, latency="100us"):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sync = EspressoSync(TopK(ratio=1.0), trial_steps=0, memory="none", profile_steps=1, network_bandwidth=bandwidth,
                        network_latency=latency, run_dir=None, settle_steps=1)
    sync.setup(params)
    exact = []
    # Warm-up, 1 profiled, the default calibration (every family Espresso may choose, layer-wise and
    # fused, and a mixed step: each layout's steps exact too), then 2 on the plan.
    for step in range(2 + sync.calibration_schedule()[2] + 2):
        exact.append(_exact_step(sync, params, rank, world, step))
    return sync.computed.to_dict(), exact, sync.state_dict()["planned"], dict(sync.network_config)


@pytest.mark.multiprocess
@pytest.mark.parametrize("bandwidth", ["10mbit", "100gbit"])
def test_espresso_sync_broadcasts_one_plan_and_stays_exact(bandwidth):
    (plan0, exact, state, _), (plan1, exact1, _, _) = run_workers(_espresso_steps, 2, bandwidth)
    assert plan0 == plan1 == state
    assert all(exact) and all(exact1)


def _failing_profile_steps(rank, world):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sync = EspressoSync(TopK(ratio=1.0), trial_steps=0, memory="none", profile_steps=1, network_bandwidth="10mbit", run_dir=None,
                        settle_steps=1)
    sync.setup(params)
    if rank == 1:
        def fails():
            raise MemoryError("no room for the benchmark buffers")
        sync.profile_compressors = fails
    try:
        for step in range(2 + sync.calibration_schedule()[2] + 1):
            _exact_step(sync, params, rank, world, step)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.multiprocess
def test_a_profiling_failure_on_one_rank_is_raised_on_every_rank():
    """Rank 1 failing in its compressor benchmark left rank 0 waiting for it in the next collective."""
    said = run_workers(_failing_profile_steps, 2)
    assert all("failed on rank 1: MemoryError: no room for the benchmark buffers" in s for s in said), said


def _trial_steps(rank, world, steps, state=None):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sync = EspressoSync(TopK(ratio=1.0), memory="none", profile_steps=1, network_bandwidth="10mbit",
                        run_dir=None, trial_steps=2, calibrate_steps=0)
    sync.setup(params)
    if state is not None:
        sync.load_state_dict(state)
    exact, layouts, saved = [], [], None
    for step in range(steps):
        exact.append(_exact_step(sync, params, rank, world, step))
        layouts.append(None if sync.computed is None else sync.computed.context.get("candidate"))
        if step == 4:
            saved = sync.state_dict()
    return sync.computed.to_dict(), exact, layouts, sync.session.trial, saved


@pytest.mark.multiprocess
def test_trial_runs_every_candidate_then_keeps_the_fastest_measured_on_every_rank():
    (plan0, exact, layouts, trial, saved), (plan1, exact1, _, _, _) = run_workers(_trial_steps, 2, 16)
    assert plan0 == plan1 and trial is None and all(exact) and all(exact1)
    tried = plan0["context"]["trial_step_s"]
    k = len(tried)
    assert k >= 2 and plan0["context"]["candidate"] == min(tried, key=tried.get)
    assert "checked on the cluster" in plan0["notes"][-1]
    # warm-up + 1 profiled step dense, then the candidates take turns of 1 settling + 1 measured step,
    # 2 turns each, round robin (the layout listed is the one in force after the step).
    assert layouts[:3] == [None, "espresso search", "espresso search"]
    turns = [layouts[1 + 2 * t] for t in range(2 * k)]
    assert turns[:k] == turns[k:] and len(set(turns)) == k and turns[0] == "espresso search"
    assert layouts[1 + 4 * k] == plan0["context"]["candidate"]  # kept after the last turn
    # A checkpoint taken mid-trial resumes the trial on the same candidate and finishes it.
    assert saved["trial"] is not None and (saved["trial"]["index"], saved["trial"]["turn"]) == (1, 1)
    (again, exact2, layouts2, trial2, _), _ = run_workers(_trial_steps, 2, 12, saved)
    assert trial2 is None and all(exact2) and layouts2[0] == layouts[4]
    assert again["context"]["candidate"] in tried and "checked on the cluster" in again["notes"][-1]


@pytest.mark.multiprocess
def test_measured_latency_goes_into_the_profile_and_the_plan_stays_exact():
    (plan0, exact, _, network), (plan1, exact1, _, _) = run_workers(_espresso_steps, 2, "1gbit", "measured")
    assert plan0 == plan1 and all(exact) and all(exact1)
    probe = network["latency_probe"]
    assert probe["calls"] > 0 and probe["allgather_s"] > 0 and probe["allreduce_s"] > 0
    assert parse_time(network["latency"]) == pytest.approx(probe["allreduce_alpha_s"], rel=1e-3, abs=1e-7)
    assert parse_time(network["exchange_latency"]) == pytest.approx(probe["allgather_alpha_s"], rel=1e-3, abs=1e-7)
    # Each alpha makes the model reproduce its collective's measured time.
    reduce = NetworkModel(parse_bandwidth("1gbit"), probe["allreduce_alpha_s"], 1)
    exchange = NetworkModel(parse_bandwidth("1gbit"), probe["allgather_alpha_s"], 1)
    assert reduce.allreduce(4, 2) == pytest.approx(probe["allreduce_s"], rel=1e-6)
    assert exchange.allgather(4, 2, "ring") == pytest.approx(probe["allgather_s"], rel=1e-6)


def test_an_exchange_latency_prices_allgather_and_not_allreduce():
    profile, base = _model()
    slow = dataclasses.replace(profile, network={**profile.network, "exchange_latency": "5ms"})
    exchange = CostModel(slow, {"none": NoCompression(), "default": TopK(ratio=0.01)})
    unit = units_of(profile)[0]
    gather = Option("default", "allgather")
    assert exchange.costs(unit, DENSE) == base.costs(unit, DENSE)
    # direct allgather of 4 ranks: (n-1) exchange steps, each now 5 ms instead of 50 us
    assert exchange.costs(unit, gather)[1] == pytest.approx(base.costs(unit, gather)[1] + 3 * (5e-3 - 50e-6))


def test_trial_candidates_without_a_compressor():
    """sync=espresso with the config's compressor=none: the trial's three candidates are built and
    named, Cupcake's being groups of dense allreduce (this once raised KeyError: 'default')."""
    profile = random_profile(random.Random(11), 6, world_size=4)
    profile = dataclasses.replace(profile, compressors={"none": profile.compressors["none"]})
    plans = EspressoSync(None, run_dir=None).candidate_plans(profile, cost_model(profile))
    assert [plan.context["candidate"] for plan in plans] == [
        "espresso search", "cupcake groups of none/allreduce", "dense, DDP buckets"]


def _hierarchical_steps(rank, world):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sync = EspressoSync(None, trial_steps=0, memory="none", profile_steps=1, gpus_per_machine=2, run_dir=None, calibrate_steps=0)
    sync.setup(params)
    exact = []
    for step in range(4):
        if step == 2:  # every unit hierarchical: the machine groups must exist on every rank
            plan = sync.computed
            sync.adopt(CompressionPlan(plan.system, plan.units, [Option(o.compressor, o.scheme, True)
                                                                 for o in plan.options], plan.iteration_s))
        g = torch.Generator().manual_seed(100 * rank + step)
        grads = {name: torch.randint(-8, 9, shape, generator=g).float() for name, shape in SHAPES.items()}
        for name, p in reversed(params):
            p.grad = grads[name].clone()
            sync.grad_ready(p)
        stats = sync.finish_step()
        for name in grads:
            grads[name] *= 1.0 / world
            dist.all_reduce(grads[name])
        exact.append(all(torch.equal(p.grad, grads[name]) for name, p in params))
    return exact, [r.op for r in stats.collectives]


@pytest.mark.multiprocess
def test_espresso_sync_with_machines_builds_their_groups():
    for exact, ops in run_workers(_hierarchical_steps, 4):
        assert all(exact)
        assert "reduce_scatter" in ops and "allgather" in ops  # inside the machine, around the scheme


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match="sync.offload"):
        EspressoSync(TopK(), offload="yes")
    with pytest.raises(ValueError, match="sync.network_latency"):
        EspressoSync(TopK(), network_latency="soon")
    with pytest.raises(ValueError, match="sync.trial_steps"):
        EspressoSync(TopK(), trial_steps=-1)
    EspressoSync(TopK(), network_latency="measured")  # probed on the sync group before planning
    # PowerSGD is an option under allreduce alone: another scheme is refused, naming it.
    with pytest.raises(ValueError, match="sync.comm: compressor powersgd .* Use sync.comm=allreduce"):
        EspressoSync(PowerSGD(), comm="allgather")
    EspressoSync(PowerSGD(), comm="allreduce")
    with pytest.raises(ValueError, match="sync.comm must be one of"):
        configured_option(_model()[1], "broadcast")


def _flat_machines(rank, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EspressoSync(TopK(), hierarchical=True, run_dir=None).setup([("w", torch.nn.Parameter(torch.zeros(4)))])
    return [str(w.message) for w in caught]


@pytest.mark.multiprocess
def test_hierarchical_without_machines_says_so():
    rank0, rank1 = run_workers(_flat_machines, 2)
    assert len(rank0) == 1 and "sync.hierarchical=true" in rank0[0] and "sync.gpus_per_machine" in rank0[0]
    assert rank1 == []


@pytest.mark.e2e
def test_train_py_with_espresso_and_topk(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "sync=espresso", "compressor=topk", "model=cnn",
         "model.num_samples=512", "trainer.max_steps=23", "sync.profile_steps=2", "sync.settle_steps=1", f"hydra.run.dir={out}",
         "trainer.enable_progress_bar=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sync"] == "espresso" and summary["steps"] == 23
    assert json.loads((out / "plan.json").read_text())["system"] == "espresso"
    profile = Profile.load(out / "plan_profile.json")
    assert profile.world_size == 2 and profile.compressors["default"].name == "topk"
    assert "predicted iteration" in (out / "plan.txt").read_text()
    # The default calibration: every family top-k may take (allgather, alltoall, gather, zen),
    # layer-wise and fused, and a mixed step: 9 layouts, a measured step each, every layout after
    # the first settling for one step. No trial: the calibrated model's plan runs.
    schemes = ("allgather", "alltoall", "gather", "zen")
    assert all({"cpu_s", "lag_s", "fused_lag_s"} <= set(profile.families[f"default/{s}"]) for s in schemes)
    with (out / "metrics.csv").open() as handle:
        phases = [row["sync_phase"] for row in csv.DictReader(handle) if row.get("sync_phase")]
    assert phases == ["warmup", "profile", "profile", *["settle", "calibrate"] * 9, "plan", "plan"]
    assert summary["plan_source"] is not None and summary["plan_state"] == "chosen by the cost model"
    assert summary["sync_phase_steps"] == {"warmup": 1, "profile": 2, "settle": 9, "calibrate": 9, "plan": 2}


def test_iteration_time_is_simulate():
    tasks = [TensorTask("a", 0.0, 1e-3, 2e-3, 1e-3, True), TensorTask("b", 1e-3, 1e-3, 1e-3, 2e-3, False)]
    assert iteration_time(tasks, 3e-3, 1e-3) == simulate(tasks, 3e-3, 1e-3).iteration_s


def test_dense_groups_beside_compression_are_charged_and_the_dense_plan_is_still_a_candidate():
    """A cost per flat dense group in plans that compress: the mixed step's prediction grows by it
    per dense group, beside_overhead recovers it from that step, and Espresso prices every plan
    that compresses with it while still offering the plan that compresses nothing, priced plainly."""
    from ddlscale.plan.planner import beside_overhead, mixed_options
    from ddlscale.plan.result import plan_time

    profile = random_profile(random.Random(11), 12, world_size=4)
    model = cost_model(profile)
    option, units = configured_option(model), units_of(profile)
    mixed = mixed_options(units, option)
    assert sum(o == option for o in mixed) == 1 and mixed[max(range(len(units)), key=lambda i: units[i].numel)] == option
    per_group = 2e-3
    charged = profile.with_family(DENSE.family, beside_compression_s=per_group)

    def time_of(p, options, beside=True):
        m = cost_model(p)
        return plan_time(units, options, m.beside_compression() if beside else m, p.backward_end_s, p.rest_s)

    measured = time_of(charged, mixed)
    # Paid by each of the other (dense) units after its allreduce, on the training thread: at least
    # once past the step's critical path, at most once per dense unit.
    assert time_of(profile, mixed) + per_group - 1e-12 <= measured
    assert measured <= time_of(profile, mixed) + (len(units) - 1) * per_group + 1e-12
    assert beside_overhead(profile, option, measured) == pytest.approx(per_group, abs=1e-6)
    assert beside_overhead(profile, option, 0.5 * time_of(profile, mixed)) == 0.0
    # A unit's saving is against the plan with it dense: where that leaves only dense groups, they
    # are priced as they run alone.
    from ddlscale.plan.result import per_unit_savings

    model = cost_model(charged).beside_compression()
    saved = per_unit_savings(units, mixed, model, profile.backward_end_s, profile.rest_s)
    alone = time_of(profile, [DENSE] * len(units), beside=False)
    assert saved[mixed.index(option)] == pytest.approx(alone - measured)
    plain = model.plainly()
    assert plain.beside is False and plain.plainly() is plain and model.beside_compression() is model
    # Every uncompressed group pays it, hierarchical ones too; compressed ones do not.
    two = cost_model(dataclasses.replace(charged, network={**charged.network, "gpus_per_machine": 2}))
    hier = Option("none", "allreduce", True)
    assert two.allows(hier)
    for o in (DENSE, hier):
        assert two.beside_compression().costs(units[0], o)[2] == pytest.approx(two.costs(units[0], o)[2] + per_group)
    assert model.costs(units[0], option) == plain.costs(units[0], option)


@pytest.mark.parametrize("seed", [2, 5])
def test_espresso_prices_dense_groups_beside_compression_and_keeps_the_all_dense_candidate(seed):
    from ddlscale.plan.cupcake import plan_fusion
    from ddlscale.plan.result import plan_time

    profile = random_profile(random.Random(seed), 12, world_size=4)
    units = units_of(profile)
    b, rest = profile.backward_end_s, profile.rest_s
    plain = espresso(units, cost_model(profile), b, rest)
    assert any(o == DENSE for o in plain.options)  # both instances keep flat dense groups when they cost nothing more
    for per_group in (2e-3, 10.0):
        charged = profile.with_family(DENSE.family, beside_compression_s=per_group)
        plan = espresso(units, cost_model(charged), b, rest)
        assert plan.iteration_s >= plain.iteration_s - 1e-12  # nothing got cheaper
        dense = plan_fusion(units, cost_model(profile), DENSE, b, rest)  # the best flat dense plan, priced plainly
        if not any(o.compressed for o in plan.options):  # the best plan that compresses nothing, priced plainly
            assert plan.iteration_s <= dense.iteration_s + 1e-12
            assert plan.iteration_s == pytest.approx(plan_time(plan.units, plan.options, cost_model(profile), b, rest))
        else:  # it mixes: every uncompressed group pays, so the plan has few of them, and it beats all-dense
            assert plan.iteration_s < dense.iteration_s
            if per_group == 10.0:
                assert all(o.compressed for o in plan.options)
    kept = {per_group: espresso(units, cost_model(profile.with_family(DENSE.family, beside_compression_s=per_group)),
                                b, rest).options for per_group in (2e-3, 10.0)}
    if seed == 2:  # its hierarchical dense groups saved most: compressing nothing wins
        assert not any(o.compressed for o in kept[2e-3] + kept[10.0])
        assert any(o.hierarchical for o in kept[10.0])  # hierarchical dense among them: the search over uncompressed
    else:  # compressing most units is worth the dense groups' cost, and every unit when they are dear
        assert DENSE in kept[2e-3] and any(o.compressed for o in kept[2e-3])
        assert all(o.compressed for o in kept[10.0])
    # One tensor each (sync.fuse=false): the all-dense candidate is per tensor too.
    charged = profile.with_family(DENSE.family, beside_compression_s=10.0 if seed == 2 else 2e-3)
    alone = espresso(units, cost_model(charged), b, rest, fuse=False)
    assert alone.fusion == "per tensor" and len(alone.options) == len(units)
    # Without dense among the options, no all-dense plan is offered.
    compressed_only = [o for o in cost_model(charged).options() if o != DENSE]
    assert DENSE not in espresso(units, cost_model(charged), b, rest, options=compressed_only).options


@pytest.mark.parametrize("seed", range(8))
def test_a_plan_that_compresses_nothing_runs_in_the_profiled_dense_buckets(seed):
    """Espresso's plans that compress nothing are the profiled dense steps' buckets (the one dense
    layout calibration fits the model to), flat or hierarchical per bucket, never dense fusion's
    optimum, whose overlap with backward the model extrapolates."""
    from ddlscale.plan.cupcake import plan_fusion
    from ddlscale.plan.planner import ddp_buckets, dense_plan

    profile = random_profile(random.Random(seed), 14, world_size=4, max_exp=20)
    units, model = units_of(profile), cost_model(profile)
    b, rest = profile.backward_end_s, profile.rest_s
    buckets = ddp_buckets(units, 64 << 10, 256 << 10)  # several buckets on these sizes
    assert len(buckets) > 1
    flat_only = [DENSE]
    # Dense alone offered: the per-tensor search and its fused runs compress nothing, so the plan
    # is the buckets, priced as dense_plan prices them, whatever dense fusion's optimum says.
    plan = espresso_plan(profile, model, options=flat_only, first_bytes=64 << 10, bucket_bytes=256 << 10)
    assert [u.names for u in plan.units] == [u.names for u in buckets] and plan.options == [DENSE] * len(buckets)
    assert plan.fusion.startswith("none: compresses nothing")
    assert plan.iteration_s == pytest.approx(dense_plan(profile, model, 64 << 10, 256 << 10).iteration_s)
    unbound = espresso(units, model, b, rest, options=flat_only)  # no buckets given: fusion's runs, as before
    assert unbound.iteration_s == pytest.approx(plan_fusion(units, model, DENSE, b, rest).iteration_s)
    # Beside a calibrated charge, with every option: compressing nothing means the buckets, hierarchical
    # dense allowed per bucket; a plan that compresses is priced with the charge and kept only if faster.
    for per_group in (1e-4, 10.0):
        charged = cost_model(profile.with_family(DENSE.family, beside_compression_s=per_group))
        plan = espresso_plan(profile, charged, first_bytes=64 << 10, bucket_bytes=256 << 10)
        if not any(o.compressed for o in plan.options):
            assert [u.names for u in plan.units] == [u.names for u in buckets]
            assert plan.iteration_s <= dense_plan(profile, charged, 64 << 10, 256 << 10).iteration_s + 1e-12
        else:
            assert plan.iteration_s < dense_plan(profile, charged, 64 << 10, 256 << 10).iteration_s


def _mixed_calibration(rank, world, run_dir):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sync = EspressoSync(TopK(ratio=0.5), trial_steps=0, comm="allgather", memory="residual", profile_steps=1,
                        calibrate_steps=2, settle_steps=2, network_bandwidth="10mbit", run_dir=run_dir,
                        calibrate_families=[], calibrate_fused=False, calibrate_mixed=True)
    sync.setup(params)
    ops, mixed_choices = [], None
    for step in range(1 + 1 + 4 + 3):
        g = torch.Generator().manual_seed(100 * rank + step)
        for name, p in reversed(params):
            p.grad = torch.randn(SHAPES[name], generator=g)
            sync.grad_ready(p)
        ops.append([r.op for r in sync.finish_step().collectives])
        if step == 6:  # in the mixed step's settling
            mixed_choices = {name: (c.compressor, c.scheme) for name, c in sync.compressed.choices.tensors.items()}
    return ops, sync.computed is not None, mixed_choices


@pytest.mark.multiprocess
def test_a_mixed_calibration_step_runs_the_largest_tensor_compressed_and_the_rest_dense(tmp_path):
    (ops, planned, choices), _ = run_workers(_mixed_calibration, 2, str(tmp_path))
    assert planned
    assert choices == {"d": ("default", "allgather")}  # the largest, as the model's mixed_options picks it
    assert ops[:2] == [["allreduce"]] * 2
    assert ops[2:6] == [["allgather_uneven"] * len(SHAPES)] * 4  # the configured family alone first
    # Mixed (1 settling, 2 timed): "d" (the largest) under allgather, the other three dense alone.
    assert all(sorted(step) == sorted(["allgather_uneven"] + ["allreduce"] * 3) for step in ops[6:9])
    profile = Profile.load(tmp_path / "plan_profile.json")
    assert profile.families[DENSE.family]["beside_compression_s"] >= 0
    assert "default/allgather" in profile.families


def test_calibrate_mixed_is_espressos_and_checked():
    with pytest.raises(ValueError, match="sync.calibrate_mixed"):
        EspressoSync(TopK(), calibrate_mixed="yes")
    with pytest.raises(ValueError, match="sync.calibrate_budget"):
        EspressoSync(TopK(), calibrate_budget="many")
    # A list of families asked for where no calibration runs is refused, not ignored.
    with pytest.raises(ValueError, match="sync.calibrate_families needs"):
        EspressoSync(TopK(), calibrate_families=["zen"], calibrate_steps=0)
    EspressoSync(TopK(), calibrate_steps=0)  # the defaults (every family, fused and mixed) then do nothing
    from ddlscale.sync.compressed import CupcakeSync
    with pytest.raises(TypeError):
        CupcakeSync(TopK(), calibrate_mixed=True)
