"""PowerSGD as a planner option (issue 60, item 4): offered under allreduce alone (its factors sum;
any other scheme would run a power iteration per rank), priced as it runs, and a plan using it
trains and syncs as dense allreduce does where PowerSGD is exact (gradients of low rank)."""

import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster import run_workers
from ddlscale.compress import NoCompression, PowerSGD
from ddlscale.plan.planner import configured_option, cost_model, cupcake_plan, espresso_plan
from ddlscale.plan.pricing import DENSE, Option, fuse, units_of
from ddlscale.plan.profile import Profile, TensorProfile, matrix_kept, profile_compressor
from ddlscale.sync.compressed import CupcakeSync, EspressoSync

SHAPES = {"w1": (48, 32), "b1": (48,), "w2": (32, 24), "w3": (16, 8, 3)}


def _profile(bandwidth, world=4, per_machine=2):
    compressor = PowerSGD(rank=2)
    tensors, ready = [], 0.0
    for name, shape in reversed(SHAPES.items()):  # backward order
        numel = torch.Size(shape).numel()
        ready += 1e-4 + 1e-8 * numel
        kept = matrix_kept(compressor, shape, torch.float32)
        tensors.append(TensorProfile(name, numel, shape, "torch.float32", ready, {"default": kept}))
    total = sum(t.numel for t in tensors)
    costs = {"none": profile_compressor(NoCompression(), total, budget_s=0.002),
             "default": profile_compressor(compressor, total, budget_s=0.002)}
    network = {"bandwidth": bandwidth, "latency": "50us", "gpus_per_machine": per_machine}
    return Profile(tensors, ready + 1e-4, 1e-3, world, network, costs)


def test_powersgd_is_an_option_under_allreduce_alone():
    profile = _profile("10mbit")
    model = cost_model(profile)
    compressed = [o for o in model.options() if o.compressed]
    assert {(o.scheme, o.hierarchical) for o in compressed} == {("allreduce", False), ("allreduce", True)}
    with pytest.raises(ValueError, match="sync.comm=allgather cannot carry compressor powersgd; use allreduce"):
        configured_option(model, "allgather")
    option = configured_option(model, "allreduce")
    # Its payload is each member matrix's factors (a vector's elements), summed over a fused group.
    w1 = next(u for u in units_of(profile) if u.names == ("w1",))
    assert w1.kept["default"] * w1.numel == (48 + 32) * 2
    assert next(u for u in units_of(profile) if u.names == ("b1",)).kept["default"] == 1.0
    group = fuse(units_of(profile))
    assert group.kept["default"] * group.numel == pytest.approx((48 + 32) * 2 + 48 + (32 + 24) * 2 + (16 + 24) * 2)
    # Its collectives run after backward (the power iteration runs in the scheme's finish): they
    # wait from the tensor's ready time to backward end.
    assert model.after_backward(option) and not model.after_backward(DENSE)
    assert model.task(w1, option).lag_s == pytest.approx(profile.backward_end_s - w1.ready_s)
    # Both planners plan with it; on a slow network (dense allreduce 3-4x their step) they compress.
    plans = cupcake_plan(profile, model, option), espresso_plan(profile, model, cupcake_option=option)
    for plan in plans:
        assert any(o.compressed for o in plan.options), plan.system
        assert all(o.scheme == "allreduce" for o in plan.options)


def test_both_planners_refuse_powersgd_under_another_scheme():
    for cls in (EspressoSync, CupcakeSync):
        with pytest.raises(ValueError, match="Use sync.comm=allreduce"):
            cls(PowerSGD(), comm="allgather", run_dir=None)
    assert EspressoSync(PowerSGD(), comm="allreduce", run_dir=None).compressed.compressors["default"].name == "powersgd"


def _low_rank(rank, step):
    """Each rank's gradients: per matrix a fixed rank-1 direction of its own, scaled anew every step
    (so the ranks' sum has rank 2 in a subspace that stays, which PowerSGD of rank 2 reproduces
    exactly, warm start and error feedback included), a vector for the bias."""
    fixed = torch.Generator().manual_seed(rank)
    scale = float(torch.randn(1, generator=torch.Generator().manual_seed(100 * rank + step)))
    out = {}
    for name, shape in SHAPES.items():
        if len(shape) == 1:
            out[name] = scale * torch.randn(shape, generator=fixed, dtype=torch.float64)
        else:
            rows, cols = shape[0], torch.Size(shape[1:]).numel()
            u = torch.randn(rows, 1, generator=fixed, dtype=torch.float64)
            v = torch.randn(1, cols, generator=fixed, dtype=torch.float64)
            out[name] = (scale * u @ v).reshape(shape)
    return out


def _planned(rank, world, system):
    params = [(name, torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))) for name, shape in SHAPES.items()]
    cls = EspressoSync if system == "espresso" else CupcakeSync
    sync = cls(PowerSGD(rank=2), comm="allreduce", profile_steps=1, settle_steps=1, network_bandwidth="10mbit",
               run_dir=None, bench_budget_s=0.002)
    sync.setup(params)
    layouts = [f"{s}{'/hier' if h else ''}{layout}" for s, h, layout in sync.calibration_schedule()[0]]
    errors, phases = [], []
    for step in range(2 + sync.calibration_schedule()[2] + 3):  # warm-up, profiled, calibration, the plan
        grads = _low_rank(rank, step)
        for name, p in reversed(params):
            p.grad = grads[name].clone()
            sync.grad_ready(p)
        sync.finish_step()
        phases.append(sync.step_phase)
        for name in grads:
            grads[name] /= world
            dist.all_reduce(grads[name])
        errors.append(max(float((p.grad - grads[name]).abs().max()) for name, p in params))
    options = [Option(**o) if isinstance(o, dict) else o for o in sync.computed.options]
    return layouts, phases, errors, [(o.compressor, o.scheme) for o in options]


@pytest.mark.multiprocess
@pytest.mark.parametrize("system", ["espresso", "cupcake"])
def test_a_plan_with_powersgd_trains_and_syncs_as_dense_allreduce(system):
    for layouts, phases, errors, options in run_workers(_planned, 2, system):
        # Calibrated under allreduce alone: layer-wise, fused (and Espresso's mixed step).
        assert layouts == ["allreduce", "allreduce@fused"] + (["allreduce@mixed"] if system == "espresso" else [])
        assert phases[-1] == "plan" and "calibrate" in phases
        assert ("default", "allreduce") in options and all(s == "allreduce" for _, s in options)
        # Every step, in every phase, gives the ranks' average (PowerSGD exact on these gradients).
        assert max(errors) < 1e-9, list(zip(phases, errors, strict=True))
