"""Zen's one push and one pull per step: the batched exchange equals the per-tensor one bit for bit,
equals dense allreduce, hands sparse gradients back sparse, issues the collectives its cost objects
count, and overlaps backward."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from ddlscale.cluster import run_workers
from ddlscale.comm import CollectiveRecord
from ddlscale.comm.collectives import Message
from ddlscale.paths import CONF_DIR
from ddlscale.sync.grad_sync import in_flight
from ddlscale.sync.sparse import (
    AGSparseSync,
    GlooSparseSync,
    OmniReduceSync,
    SparCMLSync,
    SparsePSSync,
    ZenSync,
    sections,
)
from ddlscale.sync.sparse.pushpull import pack_rows, unpack_rows
from ddlscale.sync.sparse.traffic import doubling_rounds

CONF = str(CONF_DIR)
NAMES = ["emb", "bias", "table", "half"]


def _params():
    """Four tensors a step syncs together: two sparse-COO tables of widths 8 and 1, a dense matrix
    whose zeros come in rows (width 5) and a bf16 table (width 4)."""
    return {"emb": torch.nn.Parameter(torch.zeros(97, 8)), "bias": torch.nn.Parameter(torch.zeros(61, 1)),
            "table": torch.nn.Parameter(torch.zeros(43, 5)),
            "half": torch.nn.Parameter(torch.zeros(37, 4, dtype=torch.bfloat16))}


def _grads(rank, step):
    """Small-integer rows (exact in fp32 and bf16), rank-specific, index 0 and the last row included."""
    g = torch.Generator().manual_seed(100 * rank + step)
    out = {}
    for name, p in _params().items():
        rows, width = p.shape
        touched = torch.unique(torch.cat([torch.randint(0, rows, (9,), generator=g), torch.tensor([0, rows - 1])]))
        values = torch.randint(1, 5, (touched.numel(), width), generator=g).to(p.dtype)
        sparse = torch.sparse_coo_tensor(touched[None], values, (rows, width)).coalesce()
        out[name] = sparse if name in ("emb", "bias") else sparse.to_dense()
    return out


def _sync_steps(sync, rank, world, steps=3):
    params = _params()
    sync.setup(list(params.items()))
    got = []
    for step in range(steps):
        grads = _grads(rank, step)
        for name in reversed(NAMES):  # backward order: the last tensor's gradient is ready first
            params[name].grad = grads[name].clone()
            sync.grad_ready(params[name])
        stats = sync.finish_step()
        got.append(({n: (p.grad.is_sparse, p.grad.is_sparse and p.grad.is_coalesced(), p.grad.to_dense())
                     for n, p in params.items()}, [r.op for r in stats.collectives]))
    return got


def _batched_and_alone(rank, world, pull):
    out = {}
    for batch in ("step", "width", "tensor"):
        sync = ZenSync(scheme="bp", pull=pull, batch=batch, sparse_params=NAMES, profile_steps=1,
                       network_latency="10ms")
        out[batch] = _sync_steps(sync, rank, world)
    oracle = []
    for step in range(3):
        grads = _grads(rank, step)
        summed = {}
        for name, grad in grads.items():
            dense = grad.to_dense() * (1.0 / world)
            dist.all_reduce(dense)
            summed[name] = dense
        oracle.append(summed)
    return out, oracle


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("pull", ["coo", "bitmap", "auto"])
def test_batched_exchange_equals_per_tensor_and_dense(world, pull):
    for out, oracle in run_workers(_batched_and_alone, world, pull):
        for step in range(3):
            step_grads, step_ops = out["step"][step]
            for batch in ("width", "tensor"):
                for name in NAMES:  # bit for bit: a server adds in source-rank order either way
                    assert torch.equal(step_grads[name][2], out[batch][step][0][name][2]), (batch, name, step)
            for name in NAMES:
                is_sparse, coalesced, grad = step_grads[name]
                assert is_sparse == (name in ("emb", "bias")), f"{name} comes back in its own layout"
                assert coalesced or not is_sparse
                if world & (world - 1):  # x/3 is not representable: the ring's order may differ
                    torch.testing.assert_close(grad, oracle[step][name], rtol=1e-2, atol=1e-2)
                else:
                    assert torch.equal(grad, oracle[step][name]), (name, step)
            if step >= 1:  # after the profiling step: one push and one pull for all four tensors
                assert sorted(step_ops) == ["pull", "push"], step_ops
                assert sorted(out["tensor"][step][1]) == ["pull"] * 4 + ["push"] * 4


def _every_backend_counts(rank, world, name):
    make = {"zen": lambda **k: ZenSync(**k), "zen-width": lambda **k: ZenSync(batch="width", **k),
            "zen-hc": lambda **k: ZenSync(scheme="hc", **k), "agsparse": AGSparseSync,
            "gloo_sparse": GlooSparseSync, "sparse_ps": SparsePSSync, "sparcml": SparCMLSync,
            "omnireduce": lambda **k: OmniReduceSync(block_size=8, **k)}[name]
    sync = make(sparse_params=NAMES[:3], profile_steps=1, network_latency="100us", reprofile_drift=None)
    params = {**_params(), "dense": torch.nn.Parameter(torch.zeros(6))}
    sync.setup(list(params.items()))
    counts = []
    for step in range(3):
        grads = _grads(rank, step)
        for n in ["dense", *reversed(NAMES)]:
            params[n].grad = grads[n].clone() if n in grads else torch.ones(6)
            sync.grad_ready(params[n])
        counts.append(len(sync.finish_step().collectives))
    return counts[1:], sync.collectives_per_step()


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("name", ["zen", "zen-width", "zen-hc", "agsparse", "gloo_sparse", "sparse_ps", "sparcml",
                                  "omnireduce"])
def test_collectives_per_step_are_what_the_cost_objects_count(world, name):
    results = run_workers(_every_backend_counts, world, name)
    priced = {p for _, p in results}
    assert len(priced) == 1, "every rank prices the same step"
    busiest = [max(counts[s] for counts, _ in results) for s in range(2)]
    assert busiest == [priced.pop()] * 2, f"{name}: ledger {busiest} against the cost objects"


def test_doubling_rounds_count_the_busiest_rank():
    assert [doubling_rounds(n) for n in (2, 3, 4, 5, 8)] == [1, 3, 2, 4, 3]


def _plans(rank, world, batch):
    names = [f"t{k}" for k in range(4)]
    params = {n: torch.nn.Parameter(torch.zeros(100_000, 4)) for n in names}
    sync = ZenSync(sparse_params=names, batch=batch, profile_steps=1, network_latency="100us")
    sync.setup(list(params.items()))
    for route in sync.routes:  # identical index sets on every worker: BP's pull is as small as it gets
        route.density, route.gamma, route.gammas, route.width = 0.01, 1.0, [1.0, 1.0, 1.0], 4
    sync.decide_routes()
    return [sync.plan(i) for i in range(len(names))]


def test_carriers_rounds_are_paid_once_per_step_when_choosing_plans():
    """Each table: BP sends 30 KB (240 us at 1 Gbit/s) in a push and a pull to 3 peers (6 x 100 us), HC
    40 KB (320 us) in 2 swaps (200 us). Alone, HC is faster by more than the margin; batched, the four
    tables share either carrier's rounds (BP 1.56 ms, HC 1.48 ms), within the margin of each other, and
    the fewer bytes decide: BP."""
    alone = run_workers(_plans, 4, "width")
    together = run_workers(_plans, 4, "step")
    assert all(plans == ["hc"] * 4 for plans in alone), alone
    assert all(plans == ["bp-coo"] * 4 for plans in together), together


def test_sections_frame_round_trip_and_reject_bad_lengths():
    pieces = [pack_rows(torch.tensor([0, 5]), torch.ones(2, 3)).payload,
              pack_rows(torch.tensor([7]), torch.full((1, 1), 2.0, dtype=torch.bfloat16)).payload,
              pack_rows(torch.empty(0, dtype=torch.int64), torch.empty(0, 2)).payload]
    message = sections.frame(pieces, "cpu")
    back = sections.unframe(message.payload, 3)
    ids, values = unpack_rows(back[1], 1, torch.bfloat16)
    assert ids.tolist() == [7] and values.tolist() == [[2.0]]
    assert torch.equal(unpack_rows(back[0], 3, torch.float32)[1], torch.ones(2, 3))
    assert unpack_rows(back[2], 2, torch.float32)[0].numel() == 0
    with pytest.raises(ValueError, match="past its"):
        sections.unframe(message.payload, 2)
    bad = Message.of(message.payload.clone())
    bad.payload[:8].copy_(torch.tensor([1 << 40], dtype=torch.int64).view(torch.uint8))
    with pytest.raises(ValueError, match="overruns"):
        sections.unframe(bad.payload, 3)


def test_in_flight_is_the_union_cut_where_the_wait_began():
    records = [CollectiveRecord("a", 0, 0, 0.0), CollectiveRecord("b", 0, 0, 1.0), CollectiveRecord("c", 0, 0, 5.0)]
    records[0].end, records[1].end, records[2].end = 2.0, 3.0, 6.0
    assert in_flight(records, 2.5, 10.0) == (4.0, 2.5)
    records[2].end = None  # never completed: counts to now
    assert in_flight(records, 2.5, 10.0) == (8.0, 2.5)
    assert in_flight([], 1.0, 2.0) == (0.0, 0.0)


def _overlap(rank, world):
    params = _params()
    sync = ZenSync(sparse_params=NAMES, scheme="bp", profile_steps=1, network_latency="100us")
    sync.setup(list(params.items()))
    stats = []
    for step in range(2):
        grads = _grads(rank, step)
        for name in reversed(NAMES):
            params[name].grad = grads[name].clone()
            sync.grad_ready(params[name])
        time.sleep(1.0)  # the rest of backward: long enough for the sync to finish in it on a busy host too
        stats.append(sync.finish_step())
    return stats[1].in_flight_s, stats[1].overlapped_s


def test_the_step_reports_how_much_of_its_sync_overlapped_backward():
    for total, hidden in run_workers(_overlap, 3):
        assert total > 0 and hidden > 0.9 * total, (total, hidden)


def test_paper_shaped_workloads_are_configs():
    with initialize_config_dir(os.path.abspath(CONF), version_base=None):
        deepfm = compose("config", overrides=["model=deepfm_large"]).model
        lstm = compose("config", overrides=["model=lstm_large"]).model
    assert deepfm.num_fields * deepfm.field_size >= 1_000_000 and deepfm.sparse_embedding
    assert lstm.vocab_size >= 100_000 and lstm.sparse_embedding


def test_every_sparse_sync_routes_on_the_same_measured_alpha_and_configured_bandwidth():
    with initialize_config_dir(os.path.abspath(CONF), version_base=None):
        for name in ("zen", "agsparse", "gloo_sparse", "sparse_ps", "sparcml", "omnireduce"):
            cfg = compose("config", overrides=[f"sync={name}", "cluster=emulated", "cluster.bandwidth=100mbit"])
            assert cfg.sync.network_latency == "measured", name
            assert cfg.sync.network_bandwidth == "100mbit", name


def _cut(rank, world, pause_s, scheme, early="sparse"):
    """Two tables of different widths whose gradients come ``pause_s`` of 'backward' apart; the early
    one sparse, or dense and carried in Zen's exchange (early="dense")."""
    params = {"late": torch.nn.Parameter(torch.zeros(50, 3)), "early": torch.nn.Parameter(torch.zeros(40, 4))}
    sparse = list(params) if early == "sparse" else ["late"]
    sync = ZenSync(scheme=scheme, pull="coo", sparse_params=sparse, profile_steps=1, network_latency="10ms")
    sync.setup(list(params.items()))
    seen = []
    for step in range(3):
        grads = {n: torch.sparse_coo_tensor(torch.tensor([[rank, 7 + step]]), torch.ones(2, p.shape[1]), p.shape).coalesce()
                 for n, p in params.items()}
        if early == "dense":
            grads["early"] = torch.full((40, 4), float(rank + step))
        params["early"].grad = grads["early"].clone()
        sync.grad_ready(params["early"])
        time.sleep(pause_s)  # backward's computation between the two gradients
        resumed = time.perf_counter()
        params["late"].grad = grads["late"].clone()
        sync.grad_ready(params["late"])
        stats = sync.finish_step()
        exact = all(torch.equal(params[n].grad.to_dense(), _summed(grads[n], world)) for n in params)
        seen.append(([(r.op, r.start < resumed) for r in stats.collectives], exact, len(sync.groups)))
    assert early == "sparse" or sync.routing()["early"]["plan"] == f"{scheme}-dense"
    return seen


def _summed(grad, world):
    total = grad.to_dense() * (1.0 / world)
    dist.all_reduce(total)
    return total


@pytest.mark.parametrize("scheme", ["bp", "hc"])
@pytest.mark.parametrize("early", ["sparse", "dense"])
def test_a_batch_is_cut_where_backward_computes_longer_than_its_rounds(scheme, early):
    # BP's batch: a push and a pull; HC's chain: 2 swaps at 4 ranks, whatever the widths it carries,
    # a dense tensor's values among them. 1 s of computation against 6 message steps of 10 ms: the
    # first batch's rounds end inside it, on a busy host too (4 ranks' lane threads must each get the CPU).
    rounds = ["push", "pull"] if scheme == "bp" else ["swap", "swap"]
    for seen in run_workers(_cut, 4, 1.0, scheme, early):
        for ops, exact, groups in seen[1:]:
            assert exact and groups == 2
            assert ops == [(op, True) for op in rounds] + [(op, False) for op in rounds], ops
    for seen in run_workers(_cut, 4, 0.0, scheme, early):  # no computation between them: one batch
        for ops, exact, groups in seen[1:]:
            assert exact and groups == 1 and [op for op, _ in ops] == rounds, ops


def _train(out, *overrides):
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # the checkout: train.py
    result = subprocess.run([sys.executable, os.path.join(root, "train.py"), "model=lstm", "model.sparse_embedding=true",
                             "sync=zen", "trainer.devices=3", "trainer.max_steps=5", "seed=0",
                             "trainer.enable_progress_bar=false", f"hydra.run.dir={out}", *overrides],
                            cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow  # the default run's time: make test-slow runs it
def test_training_with_the_batched_exchange_is_bit_identical_to_per_tensor(tmp_path):
    # One routing for both (auto's would differ: batched, rounds are shared), so only the exchange differs:
    # the same tensors sparse, BP for each, the dense ones in their buckets.
    fixed = ("sync.route=sparse", "sync.scheme=bp", "sync.carry_dense=false")
    batched = _train(tmp_path / "batched", "sync.batch=step", *fixed)
    alone = _train(tmp_path / "alone", "sync.batch=tensor", *fixed)
    assert batched["param_sha256"] == alone["param_sha256"]
    sparse = [name for name, route in batched["routing"].items() if route["path"] == "sparse"]
    assert len(sparse) >= 2, batched["routing"]
    for summary in (batched, alone):  # the ledger's busiest rank against what the cost objects count
        assert summary["collectives_per_step"] == summary["collectives_priced"]
        assert 0 <= summary["comm_overlap"] <= 1 and summary["comm_in_flight_s"] > 0
    assert batched["collective_ops"]["push"]["per_step"] == 1
    # The routing's decisions, as made: the step's as a whole batched, each tensor's alone.
    step, = batched["route_decisions"]
    assert step["tensors"] == "the step's tensors" and step["chosen"] in step["options"]
    assert batched["route_margin"] == 0.15 and {d["chosen"] for d in alone["route_decisions"]} <= {"bucket", "bp-coo",
                                                                                                  "bp-bitmap"}


def _auto_routes(rank, world, batch, latency):
    """route=auto on eight 1000 x 4 tables at 1% density whose workers touch disjoint rows."""
    names = [f"t{k}" for k in range(8)]
    params = {n: torch.nn.Parameter(torch.zeros(1000, 4)) for n in names}
    sync = ZenSync(batch=batch, profile_steps=1, network_latency=latency)
    sync.setup(list(params.items()))
    for route in sync.routes:
        route.seen, route.density, route.gamma, route.gammas, route.width = True, 0.01, 4.0, [1.0, 2.0, 4.0], 4
    sync.decide_routes()
    return sync.sparse, sync.route_decisions


def test_auto_routing_under_a_batch_charges_rounds_once_per_step():
    """At a 130 us alpha each table alone is faster dense (24 KB, 192 us, its bucket's allreduce shared)
    than by its fewest-bytes scheme, HC (600 bytes in 2 swaps, 265 us), by more than the margin: routed
    tensor by tensor all eight stay dense. Batched, one chain's 2 swaps carry all eight, against the
    bucket's allreduce of 192 KB: all eight go sparse."""
    for chosen, decisions in run_workers(_auto_routes, 4, "tensor", "130us"):
        assert chosen == []
        assert len(decisions) == 8 and all(d["default"] == "hc" and d["chosen"] == "bucket" for d in decisions)
        for d in decisions:
            assert d["options"]["hc"]["seconds"] > (1 + d["margin"]) * d["options"]["bucket"]["seconds"]
    for chosen, decisions in run_workers(_auto_routes, 4, "step", "130us"):
        assert chosen == list(range(8))
        step, = decisions
        assert step["chosen"] == step["default"] == "hc, dense in bucket", step
