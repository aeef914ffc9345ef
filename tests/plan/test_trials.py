"""One trial for both planned backends: one default (Python and YAML), Cupcake's candidates, and a
summary that says whether the model or the trial chose the kept plan."""

import inspect
import random

import torch
import yaml

from ddlscale.cluster import run_workers
from ddlscale.compress import TopK
from ddlscale.paths import CONF_DIR
from ddlscale.plan.planner import cost_model
from ddlscale.plan.synthetic import random_profile
from ddlscale.sync.compressed import CupcakeSync, EspressoSync
from ddlscale.sync.compressed.planned import TRIAL_STEPS, PlannedSync

CONF = CONF_DIR / "sync"


def test_one_trial_default_in_python_and_yaml():
    assert TRIAL_STEPS == 0  # calibration of every family took the trial's place (its steps too)
    assert inspect.signature(PlannedSync.__init__).parameters["trial_steps"].default == TRIAL_STEPS
    for name in ("espresso", "cupcake"):
        assert yaml.safe_load((CONF / f"{name}.yaml").read_text())["trial_steps"] == TRIAL_STEPS, name
    assert CupcakeSync(TopK(), run_dir=None).session.trial_steps == TRIAL_STEPS
    assert EspressoSync(TopK(), run_dir=None).session.trial_steps == TRIAL_STEPS


def test_cupcake_offers_its_plan_layer_wise_and_dense():
    profile = random_profile(random.Random(5), 12, world_size=4)
    model = cost_model(profile)
    plans = CupcakeSync(TopK(ratio=0.01), run_dir=None).candidate_plans(profile, model)
    name = profile.compressors["default"].name
    assert [p.context["candidate"] for p in plans] == ["cupcake", f"layer-wise {name}/allgather", "dense, DDP buckets"]
    assert plans[0].system == "cupcake" and len(plans[1].units) == 12  # layer-wise: every tensor alone
    # Cupcake's partition is optimal over groupings that include every tensor alone.
    assert plans[0].iteration_s <= plans[1].iteration_s * (1 + 1e-9)


SHAPES = {"a": (40,), "b": (8, 8), "c": (30,)}


def _cupcake_trial(rank, world, steps):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sync = CupcakeSync(TopK(ratio=0.5), memory="none", profile_steps=1, network_bandwidth="10mbit", run_dir=None,
                       trial_steps=1, calibrate_steps=1, settle_steps=1)
    sync.setup(params)
    phases = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * rank + step)
        for name, p in reversed(params):
            p.grad = torch.randn(SHAPES[name], generator=g)
            sync.grad_ready(p)
        sync.finish_step()
        phases.append(sync.step_phase)
    return phases, sync.plan_report(), sync.computed.to_dict()


def test_cupcake_runs_the_trial_and_the_summary_names_who_chose():
    (phases, report, plan), (_, report1, plan1) = run_workers(_cupcake_trial, 2, 12)
    assert plan == plan1 and report == report1
    trial = [p for p in phases if p.startswith("trial")]
    assert trial[:2] == ["trial settle: cupcake", "trial: cupcake"] and len(trial) >= 4
    assert report["plan_state"] == "kept after its trial on the cluster"
    assert set(report["plan_trial_step_s"]) == {p.split(": ")[1] for p in trial}
    assert report["plan_chosen_by"] == ("model" if report["plan_candidate"] == "cupcake" else "trial")
    assert plan["context"]["model_choice"] == "cupcake"


def test_without_a_trial_the_model_chose():
    profile = random_profile(random.Random(2), 5, world_size=2)
    sync = CupcakeSync(TopK(ratio=0.01), run_dir=None, trial_steps=0)
    sync.computed = sync.compute_plan(profile, cost_model(profile))
    report = sync.plan_report()
    assert report["plan_state"] == "chosen by the cost model" and report["plan_chosen_by"] == "model"
