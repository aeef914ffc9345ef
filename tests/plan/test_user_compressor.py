"""A compressor defined outside ddlscale plans and runs under Espresso and Cupcake like a registered one."""

import random

import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster import run_workers
from ddlscale.compress import build_compressor, class_path
from ddlscale.compress.compressor import Compressor, Context, Shape, numel_of
from ddlscale.plan.planner import configured_option, cost_model, cupcake_plan, espresso_plan
from ddlscale.plan.profile import Profile, profile_compressor
from ddlscale.plan.synthetic import random_profile
from ddlscale.sync.compressed import CupcakeSync, EspressoSync

SHAPES = {"a": (37, 5), "b": (101,), "c": (8, 8), "d": (64, 40)}


class HalfPrecisionPairs(Compressor):
    """Lossless for small integers: every element as float16, travelling in pairs (two per int32)."""

    name = "half-pairs"
    unbiased = True

    def __init__(self, pad: int = 0) -> None:
        super().__init__()
        self.pad = pad  # a constructor argument the planners must carry to rebuild it

    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], None]:
        flat = tensor.reshape(-1).to(torch.float16)
        if flat.numel() % 2:
            flat = torch.cat([flat, flat.new_zeros(1)])
        return [flat.view(torch.int32)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        flat = payload[0].view(torch.float16)[:ctx.numel]
        return flat.to(ctx.dtype).reshape(ctx.shape)

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return (numel_of(shape) + 1) // 2 * 4


def test_the_registry_builds_an_outside_class_by_its_path():
    built = build_compressor(class_path(HalfPrecisionPairs), pad=3)
    assert isinstance(built, HalfPrecisionPairs) and built.pad == 3


def test_its_profile_round_trips_and_rebuilds_it_for_both_planners(tmp_path):
    measured = profile_compressor(HalfPrecisionPairs(pad=2), 1 << 12, budget_s=0.002)
    assert measured.target == class_path(HalfPrecisionPairs) and measured.params == {"pad": 2}
    profile = random_profile(random.Random(2), 8, world_size=4)
    profile.compressors["default"] = measured
    for t in profile.tensors:
        t.kept["default"] = 1.0
    loaded = Profile.load(profile.save(tmp_path / "plan_profile.json"))
    model = cost_model(loaded)  # rebuilds the compressors from the profile
    assert isinstance(model.compressors["default"], HalfPrecisionPairs) and model.compressors["default"].pad == 2
    option = configured_option(model, "allgather")
    assert option.compressor == "default"
    for plan in (cupcake_plan(loaded, model, option), espresso_plan(loaded, model, cupcake_option=option)):
        assert plan.iteration_s > 0 and sum(len(u.names) for u in plan.units) == len(loaded.tensors)


def _planned_steps(rank, world, system):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    cls = EspressoSync if system == "espresso" else CupcakeSync
    sync = cls(HalfPrecisionPairs(), memory="none", profile_steps=1, network_bandwidth="10mbit", run_dir=None,
               settle_steps=1)
    sync.setup(params)
    exact = []
    for step in range(2 + sync.calibration_schedule()[2] + 1):  # warm-up, 1 profiled, calibration, the plan
        g = torch.Generator().manual_seed(100 * rank + step)
        grads = {name: torch.randint(-8, 9, shape, generator=g).float() for name, shape in SHAPES.items()}
        for name, p in reversed(params):
            p.grad = grads[name].clone()
            sync.grad_ready(p)
        sync.finish_step()
        for name in grads:
            grads[name] *= 1.0 / world
            dist.all_reduce(grads[name])
        exact.append(all(torch.equal(p.grad, grads[name]) for name, p in params))
    return sync.computed is not None, exact, type(sync.compressed.compressors["default"]).__name__


@pytest.mark.multiprocess
def test_espresso_and_cupcake_plan_and_run_it_exactly():
    for system in ("espresso", "cupcake"):
        for planned, exact, used in run_workers(_planned_steps, 2, system):
            assert planned and all(exact), system
            assert used == "HalfPrecisionPairs"
