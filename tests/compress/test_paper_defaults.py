"""Compressors as their papers define them, by default: each paper's defining property."""

import types

import pytest
import torch
import torch.distributed as dist
import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ddlscale.cluster import run_workers
from ddlscale.compress import build_compressor
from ddlscale.compress.powersgd import PowerSGD
from ddlscale.compress.qsgd import QSGD
from ddlscale.compress.terngrad import TernGrad
from ddlscale.paths import CONF_DIR
from ddlscale.sync.compressed import CompressSync
from ddlscale.trainer.app import move_momentum

CONF = CONF_DIR / "compressor"


def _from_yaml(name, model):
    cfg = OmegaConf.create({"model": model, "compressor": yaml.safe_load((CONF / f"{name}.yaml").read_text())})
    return instantiate(cfg.compressor)


# -- DGC: its four techniques on, momentum correction tied to the optimizer's momentum ----------------
def test_dgc_config_turns_on_the_four_techniques_with_the_optimizers_momentum():
    dgc = _from_yaml("dgc", {"momentum": 0.9, "optimizer": "sgd"})
    assert (dgc.momentum, dgc.momentum_masking) == (0.9, True)
    assert dgc.clip_norm is not None and dgc.warmup_steps > 0
    assert _from_yaml("dgc", {"momentum": 0.0, "optimizer": "adam"}).momentum == 0.0  # no momentum to correct


def test_the_optimizers_momentum_moves_into_dgc_so_it_applies_once():
    model = types.SimpleNamespace(optimizer_name="sgd", momentum=0.9)
    assert move_momentum(CompressSync(build_compressor("dgc", momentum=0.9)), model) and model.momentum == 0.0
    kept = types.SimpleNamespace(optimizer_name="sgd", momentum=0.9)
    assert not move_momentum(CompressSync(build_compressor("topk")), kept) and kept.momentum == 0.9
    assert not move_momentum(CompressSync(build_compressor("dgc", momentum=0.0)), kept) and kept.momentum == 0.9


def test_dgc_warm_up_keeps_more_first():
    dgc = _from_yaml("dgc", {"momentum": 0.0})
    flat = torch.randn(4096)
    kept_first = dgc.compress(dgc.precondition(flat, "w"), "w").payload[0].numel()
    assert kept_first >= 0.25 * 4096  # the warm-up's first stage: 25% kept, not the configured 1%


def test_dgc_counts_steps_synced_dense_as_warm_up_steps():
    from ddlscale.compress.dgc import DGC

    dgc = DGC(ratio=0.01, warmup_steps=12)
    assert dgc.warmup_steps_left() == 12 and dgc.density() == 0.25
    dgc.synced_dense(8)  # a planned sync's dense steps: they sent everything
    assert dgc.warmup_steps_left() == 4
    dgc.precondition(torch.randn(64), "w")  # step 8 of the schedule: its third stage
    assert dgc.density() == pytest.approx(0.25 / 16) and dgc.warmup_steps_left() == 3
    restored = DGC(ratio=0.01, warmup_steps=12)
    restored.load_state_dict(dgc.state_dict())
    assert restored.warmup_steps_left() == 3 and restored.density() == dgc.density()
    dgc.synced_dense(4)
    dgc.precondition(torch.randn(64), "w")
    assert dgc.density() == 0.01 and dgc.warmup_steps_left() == 0
    with pytest.raises(ValueError, match="steps"):
        dgc.synced_dense(-1)


def _planned_dgc(rank, world, warmup):
    from ddlscale.compress.dgc import DGC
    from ddlscale.sync.compressed import CupcakeSync

    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(256))) for i in range(3)]
    sync = CupcakeSync(DGC(ratio=0.01, warmup_steps=warmup), trial_steps=0, profile_steps=2, warmup_steps=1,
                       calibrate_steps=1, settle_steps=1, network_bandwidth="1gbit", network_latency="100us")
    sync.setup(params)
    densities, ops = [], []
    for step in range(sync.session.warmup_steps + 2 + 3):
        for _, p in reversed(params):
            p.grad = torch.randn(256, generator=torch.Generator().manual_seed(10 * rank + step))
            sync.grad_ready(p)
        ops.append(sorted({r.op for r in sync.finish_step().collectives}))
        densities.append(sync.compressed.compressors["default"].density())
    return sync.session.warmup_steps, ops, densities


@pytest.mark.multiprocess
def test_a_planned_sync_runs_dgcs_warm_up_dense_and_calibrates_it_as_the_plan_runs_it():
    """DGC's warm-up longer than the planned sync's dense steps: the sync's dense warm-up grows to cover
    it (with the profiled steps), so the first compressed step (calibration's) keeps DGC's ratio."""
    (warmup, ops, densities), _ = run_workers(_planned_dgc, 2, 9)
    assert warmup == 9 - 2  # the profiled steps count too
    dense = warmup + 2
    assert all(step == ["allreduce"] for step in ops[:dense])
    assert all("allreduce" not in step for step in ops[dense:dense + 2])  # calibration: compressed alone
    assert densities[dense:] == [0.01] * (len(ops) - dense)
    (warmup, _, _), _ = run_workers(_planned_dgc, 2, 0)  # no warm-up: the sync's own
    assert warmup == 1


# -- PowerSGD: one shared Q, a rank-r sum -----------------------------------------------------------
def _powersgd(rank, world):
    torch.manual_seed(10 + rank)  # every rank its own full-rank gradient
    params = [("w", torch.nn.Parameter(torch.zeros(32, 24)))]
    sync = CompressSync(PowerSGD(rank=2), comm="allreduce", memory="residual")
    sync.setup(params)
    results = []
    for _ in range(3):
        params[0][1].grad = torch.randn(32, 24)
        sync.grad_ready(params[0][1])
        sync.finish_step()
        results.append(params[0][1].grad.clone())
    q = dict(sync.compressors["default"]._q)
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: v.tolist() for k, v in q.items()})
    return results, gathered


def test_powersgd_shares_one_q_and_sums_to_rank_r():
    for results, gathered in run_workers(_powersgd, 3):
        assert gathered[0] and all(g == gathered[0] for g in gathered)  # the same warm start on every rank
        for result in results:
            assert torch.linalg.matrix_rank(result).item() <= 2  # the sum of the ranks' factors: rank r


@pytest.mark.parametrize("comm", ["allgather", "gather", "alltoall"])
def test_powersgd_is_refused_where_it_could_not_share_q(comm):
    with pytest.raises(ValueError, match="sync.comm"):
        CompressSync(PowerSGD(rank=1), comm=comm)


# -- TernGrad: per-layer clipping and a shared scalar ------------------------------------------------
def test_terngrad_clips_each_layer_to_its_sigma_multiple():
    flat = torch.randn(10000)
    flat[0] = 1000.0  # an outlier would otherwise set s
    payload = TernGrad().compress(flat, "w").payload
    sigma = flat.std().item()
    assert payload[1].item() == pytest.approx(2.5 * sigma, rel=1e-5)
    assert TernGrad(clip=None).compress(flat, "w").payload[1].item() == 1000.0


def _terngrad(rank, world):
    params = [("w", torch.nn.Parameter(torch.zeros(256)))]
    sync = CompressSync(TernGrad(), comm="allgather", memory="none")
    sync.setup(params)
    compressor = sync.compressors["default"]
    tensor = torch.randn(256, generator=torch.Generator().manual_seed(rank)) * (1 + rank)  # scales differ
    with compressor.agreed(tensor, sync.comm):
        shared = compressor.compress(tensor, "w").payload[1].item()
    own = TernGrad().compress(tensor, "w").payload[1].item()
    return shared, own


def test_terngrad_ranks_share_the_largest_scalar():
    results = run_workers(_terngrad, 3)
    shared = {s for s, _ in results}
    assert len(shared) == 1 and shared.pop() == max(own for _, own in results)
    assert len({own for _, own in results}) == 3  # their own scalars differ


# -- signSGD: majority vote, ties 0 --------------------------------------------------------------------
def test_signsgd_vote_is_the_sign_of_the_sum_with_ties_at_zero():
    vote = build_compressor("signsgd").combine(torch.tensor([3.0, 0.0, -1.0, 2.0, -2.0]), 4)
    assert vote.tolist() == [1.0, 0.0, -1.0, 1.0, -1.0]


# -- QSGD: fixed-width codes (the paper's Elias coding left out), as its doc says -----------------------
def test_qsgd_codes_are_fixed_width_whatever_the_data():
    compressor = QSGD(levels=7, bucket_size=64)
    sparse, dense = torch.zeros(1024), torch.randn(1024)
    sparse[3] = 1.0
    sizes = {sum(p.numel() * p.element_size() for p in compressor.compress(t, "w").payload) for t in (sparse, dense)}
    assert sizes == {1024 * 4 // 8 + 16 * 4}  # 4 bits per element, one float32 norm per bucket
    assert "fixed-width" in QSGD.__doc__ and "Elias" in QSGD.__doc__
