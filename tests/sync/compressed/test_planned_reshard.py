"""A planned sync (sync=cupcake, sync=espresso) resumed at another world size profiles and plans again
for it, losing none of the error feedback the saved ranks held; at the same size it keeps its plan."""

import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster import run_workers
from ddlscale.compress import TopK
from ddlscale.sync.compressed import CompressSync, CupcakeSync
from ddlscale.sync.compressed.regroup import _unchunk

SHAPES = {"a": (37, 5), "b": (101,), "c": (8, 8), "d": (64, 40)}
PLAN_STEPS = 3  # steps run on the kept plan, so that its residuals are not the first step's


def _sync(calibrate_steps=0, **keys):
    params = [(name, torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))) for name, shape in SHAPES.items()]
    sync = CupcakeSync(TopK(ratio=0.1), trial_steps=0, comm="allgather", memory="residual", profile_steps=1,
                       calibrate_steps=calibrate_steps, settle_steps=1, network_bandwidth="10mbit", run_dir=None,
                       bench_budget_s=0.002, **keys)
    sync.setup(params)
    return sync, params


def _step(sync, params, rank, step, sent, true):
    """One step of small-integer gradients (every sum exact in float64); adds what the ranks received
    to ``sent`` and this rank's averaged gradients to ``true``."""
    g = torch.Generator().manual_seed(1000 * dist.get_world_size() + 100 * rank + step)
    grads = {name: torch.randint(-8, 9, shape, generator=g).double() for name, shape in SHAPES.items()}
    for name, p in reversed(params):  # backward order: last parameter first
        p.grad = grads[name].clone()
        sync.grad_ready(p)
    sync.finish_step()
    for name, p in params:
        sent[name] += p.grad
        true[name] += grads[name] / dist.get_world_size()
    return sync.step_phase


def _residuals(sync):
    """The residuals summed over ranks, per tensor (fused groups split by member), and the memory's
    keys that no current group names (state the plan would never send)."""
    per_tensor = {name: torch.zeros(torch.Size(shape).numel(), dtype=torch.float64) for name, shape in SHAPES.items()}
    layouts = sync.compressed._layouts()
    for key, layout in layouts.items():
        kept = sync.compressed.memory.residual(key)
        if kept is not None:
            flat = _unchunk(kept.reshape(-1), layout)
            for (name, _), piece in zip(layout.members, flat.split([n for _, n in layout.members]), strict=True):
                per_tensor[name] += piece
    for tensor in per_tensor.values():
        dist.all_reduce(tensor)
    orphans = sorted(set(sync.compressed.memory.state_dict()["residuals"]) - set(layouts))
    return {name: t.reshape(SHAPES[name]) for name, t in per_tensor.items()}, orphans


def _saved_run(rank, world):
    """Warm-up, a profiled step, then PLAN_STEPS on the plan; the state a checkpoint takes then, the
    residual total it holds, and whether a same-size resume from it continues exactly."""
    sync, params = _sync()
    sent = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in SHAPES.items()}
    true = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in SHAPES.items()}
    phases = [_step(sync, params, rank, step, sent, true) for step in range(2 + PLAN_STEPS)]
    state = sync.state_dict()
    carried, _ = _residuals(sync)
    # Same size: the plan is kept (no profiling again), with its residuals: the next step is the same.
    resumed, resumed_params = _sync()
    resumed.load_state_dict(state)
    kept = (resumed.session.label, resumed.computed.to_dict() == sync.computed.to_dict())
    scratch = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in SHAPES.items()}
    _step(sync, params, rank, 99, scratch, dict(scratch))
    _step(resumed, resumed_params, rank, 99, scratch, dict(scratch))
    continues = all(torch.equal(p.grad, q.grad) for (_, p), (_, q) in zip(params, resumed_params, strict=True))
    return state, sync.computed.to_dict(), phases, carried, kept, continues


def _resharded_run(rank, world, states, calibrate_steps):
    """Loaded from ``states`` (another world size): phases and plan from there on, what was sent, the
    true sum of the averaged gradients and the residuals left."""
    sync, params = _sync(calibrate_steps)
    sync.load_resharded(states, rank, world)
    loaded = (sync.session.label, sync.computed)
    sent = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in SHAPES.items()}
    true = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in SHAPES.items()}
    steps = 2 + (sync.calibration_schedule()[2] if calibrate_steps else 0) + PLAN_STEPS
    phases = [_step(sync, params, rank, step, sent, true) for step in range(steps)]
    for tensor in true.values():
        dist.all_reduce(tensor)
    residual, orphans = _residuals(sync)
    return loaded, phases, sync.computed.to_dict(), sent, true, residual, orphans


@pytest.mark.multiprocess
@pytest.mark.parametrize("saved,resumed,calibrate_steps", [(4, 2, 0), (2, 4, 1)])
def test_a_resharded_planned_sync_plans_again_and_loses_no_error_feedback(saved, resumed, calibrate_steps):
    before = run_workers(_saved_run, saved)
    state, old_plan, phases, carried, kept, continues = before[0]
    assert phases == ["warmup", "profile"] + ["plan"] * PLAN_STEPS
    assert old_plan["context"]["world_size"] == saved
    assert any(t.abs().max() > 0 for t in carried.values())  # there is error feedback to carry
    # (c) a same-size resume keeps the plan and continues exactly.
    assert all(r[4] == ("plan", True) and r[5] for r in before)

    states = [r[0] for r in before]
    for rank, (loaded, phases, plan, sent, true, residual, orphans) in enumerate(
            run_workers(_resharded_run, resumed, states, calibrate_steps)):
        # (a) no plan from the other size: warm-up and profiling again, then a plan made for this one.
        assert loaded == ("warmup", None), rank
        # layer-wise, then fused: a settling step and the calibration steps each
        calibration = (["settle"] + ["calibrate"] * calibrate_steps) * 2 if calibrate_steps else []
        assert phases == ["warmup", "profile", *calibration] + ["plan"] * PLAN_STEPS, rank
        assert plan["context"]["world_size"] == resumed
        # (b) sent + residuals left = the true sum + the residuals carried in: nothing lost, on every
        # group the new plan made, and no residual left where no group will send it.
        assert orphans == [], rank
        for name in SHAPES:
            torch.testing.assert_close(sent[name] + residual[name], true[name] + carried[name], rtol=0, atol=1e-9,
                                       msg=lambda m, name=name: f"{name}: {m}")


def _compress_sync():
    params = [(name, torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))) for name, shape in SHAPES.items()]
    sync = CompressSync(TopK(ratio=0.1), comm="allgather", memory="residual")
    sync.setup(params)
    return sync, params


def _hierarchical_saved(rank, world, make):
    sync, _ = make()
    state = sync.state_dict()
    # Two saved ranks' chunks of a hierarchical group: equal shapes, different positions in the buffer.
    chunked = [{**state, "memory": {"residuals": {"b@machine": torch.full((51,), float(r))}}} for r in range(2)]
    try:
        make()[0].load_resharded(chunked, rank, world)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.multiprocess
@pytest.mark.parametrize("make", [_sync, _compress_sync], ids=["cupcake", "compress"])
def test_a_hierarchical_groups_chunks_are_refused_not_summed(make):
    (said,) = run_workers(_hierarchical_saved, 1, make)
    assert said is not None and "b@machine" in said and "resume at 2 workers" in said


def _resumed_mid_calibration(rank, world, families, saved_steps):
    """Saved in a calibration layout other than the first one (``saved_steps`` in), resumed at the same
    size: the phases before the plan run again from the first layout, and the saved residuals are
    carried into it, neither lost nor orphaned."""
    def zeros():
        return {name: torch.zeros(shape, dtype=torch.float64) for name, shape in SHAPES.items()}

    def make():
        sync, params = _sync(calibrate_steps=2, calibrate_fused=True, calibrate_families=families,
                             gpus_per_machine=2 if families else 1)
        return sync, params

    sync, params = make()
    saved_phases = [_step(sync, params, rank, step, zeros(), zeros()) for step in range(saved_steps)]
    saved_layout = sorted(sync.compressed.state_layouts)
    state = sync.state_dict()
    carried, _ = _residuals(sync)
    resumed, resumed_params = make()
    resumed.load_state_dict(state)
    sent, true = zeros(), zeros()
    layouts = 2 * (1 + len(families))  # each family layer-wise and fused
    phases = [_step(resumed, resumed_params, rank, 10 + step, sent, true) for step in range(2 + 3 * layouts + PLAN_STEPS)]
    assert resumed.calibration_schedule()[2] == 3 * layouts
    for tensor in true.values():
        dist.all_reduce(tensor)
    residual, orphans = _residuals(resumed)
    return saved_phases, saved_layout, carried, phases, sent, true, residual, orphans


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,families,saved_steps,saved_layout", [
    (2, (), 7, ["d+c+b+a"]),  # every tensor alone first, then fused: saved fused
    # the configured family alone and fused, then a hierarchical one alone and fused: saved in the last
    (4, ("allgather/hier",), 13, ["d+c+b+a@machine"]),
])
def test_a_planned_sync_resumed_mid_calibration_carries_its_error_feedback_into_the_next_layout(
        world, families, saved_steps, saved_layout):
    calibration = ["settle", "calibrate", "calibrate"] * 2 * (1 + len(families))
    for rank, (saved_phases, saved, carried, phases, sent, true, residual, orphans) in enumerate(
            run_workers(_resumed_mid_calibration, world, families, saved_steps)):
        assert saved_phases == ["warmup", "profile", *calibration[:saved_steps - 2]], rank
        assert saved == saved_layout, rank  # the second layout of the queue, not the one a resume builds first
        assert any(t.abs().max() > 0 for t in carried.values())  # there is error feedback to carry
        assert phases == ["warmup", "profile", *calibration] + ["plan"] * PLAN_STEPS, rank
        assert orphans == [], rank
        for name in SHAPES:
            torch.testing.assert_close(sent[name] + residual[name], true[name] + carried[name], rtol=0, atol=1e-9,
                                       msg=lambda m, name=name: f"{name}: {m}")
