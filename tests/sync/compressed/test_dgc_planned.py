"""DGC under the planned syncs with its four techniques on: the momentum moved out of the optimizer is
DGC's for every tensor — its correction (with masking and clipping) where a group goes compressed, the
optimizer's rule where a group goes dense — and it survives groups moving between the two."""

import types

import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster import run_workers
from ddlscale.compress import build_compressor
from ddlscale.compress.compressor import count_of
from ddlscale.compress.dgc import DGC
from ddlscale.sync.compressed import Choices, CompressSync, CupcakeSync, EspressoSync, TensorChoice
from ddlscale.trainer.app import move_momentum

SHAPES = {"a": (37, 5), "b": (101,), "c": (8, 8)}
M = 0.9


def _params():
    return [(name, torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))) for name, shape in SHAPES.items()]


def _grads(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return {name: torch.randn(shape, generator=g, dtype=torch.float64) for name, shape in SHAPES.items()}


def _step(sync, params, grads):
    for name, p in reversed(params):  # backward order: last parameter first
        p.grad = grads[name].clone()
        sync.grad_ready(p)
    sync.finish_step()
    return {name: p.grad.clone() for name, p in params}


def _averaged(grads):
    out = {}
    for name, g in grads.items():
        out[name] = g / dist.get_world_size()
        dist.all_reduce(out[name])
    return out


# -- the four techniques are on under both planners ---------------------------------------------------
@pytest.mark.parametrize("planned", [EspressoSync, CupcakeSync])
def test_under_both_planners_dgc_runs_its_four_techniques_with_the_optimizers_momentum(planned):
    """compressor=dgc's defaults under sync=espresso and sync=cupcake: the optimizer's momentum moves into
    DGC (the optimizer then runs without it), and masking, clipping and the warm-up stay on; the planned
    sync's dense steps get DGC's momentum too."""
    sync = planned(build_compressor("dgc", momentum=M))
    model = types.SimpleNamespace(optimizer_name="sgd", momentum=M)
    assert move_momentum(sync, model) and model.momentum == 0.0
    dgc = sync.compressed.compressors["default"]
    assert (dgc.momentum, dgc.momentum_masking) == (M, True)
    assert dgc.clip_norm is not None and dgc.warmup_steps > 0
    assert sync.dense.before_launch is not None


def test_dgcs_dense_momentum_is_the_optimizers():
    """One rank: SGD without momentum on what precondition_dense makes of each gradient moves the
    parameter bit for bit as SGD with the momentum does on the gradients themselves."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(50, generator=gen) for _ in range(6)]
    with_momentum, plain = torch.nn.Parameter(torch.zeros(50)), torch.nn.Parameter(torch.zeros(50))
    sgd_m, sgd = torch.optim.SGD([with_momentum], lr=0.1, momentum=M), torch.optim.SGD([plain], lr=0.1)
    dgc = DGC(momentum=M, momentum_masking=True, clip_norm=1.0)  # neither masks nor clips a dense send
    for g in grads:
        with_momentum.grad, plain.grad = g.clone(), dgc.precondition_dense(g, "w").clone()
        sgd_m.step()
        sgd.step()
    assert torch.equal(with_momentum, plain)
    assert DGC(momentum=0.0).precondition_dense(grads[0], "w") is grads[0] and not DGC(momentum=0.0).prepares_dense


# -- a plan's compressed group is DGC's own; its dense groups get the optimizer's momentum ------------
def _dgc(**keys):
    return DGC(**{"ratio": 0.1, "momentum": M, "momentum_masking": True, "clip_norm": 1.0, "warmup_steps": 3, **keys})


def _mixed_plan(rank, world):
    plan = Choices(default=TensorChoice("none", "allreduce"), tensors={"a": TensorChoice("default", "allgather")})
    planned, params = CompressSync(_dgc(), choices=plan, memory="residual"), _params()
    alone, alone_params = CompressSync(_dgc(), comm="allgather", memory="residual"), _params()  # sync=compress
    planned.setup(params)
    alone.setup(alone_params)
    out, momentum = [], {}
    for step in range(6):
        grads = _grads(rank, step)
        got, want = _step(planned, params, grads), _step(alone, alone_params, grads)
        for name, g in _averaged(grads).items():
            momentum[name] = g.clone() if step == 0 else M * momentum[name] + g  # torch.optim.SGD's buffer
        out.append((got, want, {n: m.clone() for n, m in momentum.items()}))
    # Masked: zero (exactly, among random float64 values) where this rank sent, somewhere in what all sent.
    zero = planned.compressors["default"].state_dict()["velocity"]["a"] == 0
    return out, int(zero.sum()), bool((out[-1][0]["a"].reshape(-1)[zero] != 0).all())


@pytest.mark.multiprocess
def test_a_compressed_group_updates_as_dgc_and_the_dense_ones_as_the_optimizer():
    """A plan compressing tensor a with DGC (allgather) and sending b and c dense, 2 ranks, 6 steps
    through the warm-up: a's update is, bit for bit, what DGC alone under sync=compress sends (momentum
    correction, masking, clipping, warm-up), and a's velocity is masked where it was sent; b's and c's
    are SGD's momentum of the averaged gradient (to float64 rounding)."""
    for steps, masked, where_sent in run_workers(_mixed_plan, 2):
        assert masked >= count_of(0.1, 37 * 5) and where_sent
        for got, want, momentum in steps:
            assert torch.equal(got["a"], want["a"])
            for name in ("b", "c"):
                torch.testing.assert_close(got[name], momentum[name], rtol=1e-12, atol=1e-12)
                assert not torch.equal(got[name], want[name])  # DGC would have sparsified them


# -- moving between dense and compressed keeps the momentum --------------------------------------------
PLANS = [
    Choices(default=TensorChoice("none", "allreduce")),  # all dense, each alone
    Choices(default=TensorChoice("default", "allgather"), groups=[["a", "b"], ["c"]]),  # a and b fused, compressed
    Choices(default=TensorChoice("none", "allreduce"), tensors={"a": TensorChoice("default", "alltoall")}),
    Choices(default=TensorChoice("none", "allreduce"), groups=[["a", "b", "c"]]),  # all dense, fused
    Choices(default=TensorChoice("default", "allgather")),  # all compressed, each alone
]


def _replanned(rank, world):
    # Keeping everything without masking or clipping, DGC sends sum_r u_r: SGD's momentum, whichever
    # way a group goes. A momentum lost or restarted when a tensor changes groups would show.
    sync, params = CompressSync(_dgc(ratio=1.0, momentum_masking=False, clip_norm=None, warmup_steps=0),
                                memory="residual"), _params()
    sync.setup(params)
    out, momentum = [], {}
    for step in range(2 * len(PLANS)):
        if step % 2 == 0:
            sync.choices = PLANS[step // 2]
            sync.on_setup()
        grads = _grads(rank, step)
        got = _step(sync, params, grads)
        for name, g in _averaged(grads).items():
            momentum[name] = g.clone() if step == 0 else M * momentum[name] + g
        out.append((got, {n: m.clone() for n, m in momentum.items()}))
    return out


@pytest.mark.multiprocess
def test_momentum_follows_a_tensor_between_dense_and_compressed_groups():
    for steps in run_workers(_replanned, 2):
        for step, (got, momentum) in enumerate(steps):
            for name in SHAPES:
                torch.testing.assert_close(got[name], momentum[name], rtol=1e-12, atol=1e-12,
                                           msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")


def _planned_run(rank, world, planned):
    dgc = _dgc(ratio=1.0, momentum_masking=False, clip_norm=None, warmup_steps=0)
    sync = planned(dgc, trial_steps=1, comm="allgather", memory="residual", profile_steps=1, calibrate_steps=1,
                   settle_steps=1, network_bandwidth="10mbit", network_latency="100us", run_dir=None,
                   bench_budget_s=0.001)
    params = _params()
    sync.setup(params)
    phases, out, momentum = [], [], {}
    # Warm-up, profiling, the default calibration (every family, fused, mixed), 3 candidates x a
    # turn of 2 steps, then the plan.
    for step in range(2 + sync.calibration_schedule()[2] + 3 * 2 + 2):
        grads = _grads(rank, step)
        got = _step(sync, params, grads)
        phases.append(sync.step_phase)
        for name, g in _averaged(grads).items():
            momentum[name] = g.clone() if step == 0 else M * momentum[name] + g
        out.append((got, {n: m.clone() for n, m in momentum.items()}))
    return phases, out


@pytest.mark.multiprocess
@pytest.mark.parametrize("planned", [EspressoSync, CupcakeSync])
def test_a_planned_run_keeps_the_momentum_through_its_phases(planned):
    """Through both planners' phases (dense warm-up and profiling, layer-wise calibration, the trial's
    candidates, the plan), every tensor gets SGD's momentum (DGC keeping everything, unmasked)."""
    for phases, steps in run_workers(_planned_run, 2, planned):
        assert phases[:4] == ["warmup", "profile", "settle", "calibrate"] and phases[-1] == "plan"
        for step, (got, momentum) in enumerate(steps):
            for name in SHAPES:
                torch.testing.assert_close(got[name], momentum[name], rtol=1e-12, atol=1e-12,
                                           msg=lambda m, name=name, at=f"{phases[step]} step {step}": f"{at}, {name}: {m}")
