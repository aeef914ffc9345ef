"""Recursive doubling with merging (SparCML, Zen's HC), densification profiling, per-tensor plans, drift."""

import copy

import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster import run_workers
from ddlscale.comm import Communicator
from ddlscale.sync.sparse.recursive import SparseDoubling, union_counts
from ddlscale.sync.sparse.sparcml import SparCMLSync
from ddlscale.sync.sparse.zen import ZenSync


def _doubling(rank, world, numel, nnz, threshold):
    """Rank-specific small integers at random indices; the doubling sum against allreduce."""
    g = torch.Generator().manual_seed(rank)
    indices = torch.randperm(numel, generator=g)[:nnz]
    values = torch.randint(-3, 4, (nnz,), generator=g).float()
    values[values == 0] = 5.0
    comm = Communicator()
    got_idx, got_val = SparseDoubling(comm, numel, 1, torch.float32, threshold).run(indices, values[:, None])
    got = torch.zeros(numel)
    got[got_idx] = got_val[:, 0]
    oracle = torch.zeros(numel)
    oracle[indices] = values
    dist.all_reduce(oracle)
    kinds = [(r.op, r.bytes_sent, r.bytes_recv) for r in comm.ledger.records]
    return got, oracle, bool(torch.all(got_idx[1:] > got_idx[:-1])), kinds


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("threshold", [None, 0.5, 0.05])
def test_doubling_sum_equals_allreduce_on_every_rank(world, threshold):
    results = run_workers(_doubling, world, 2000, 60, threshold)
    first = results[0][0]
    for got, oracle, ascending, _ in results:
        assert torch.equal(got, oracle)
        assert torch.equal(got, first), "every rank holds the same bits"
        assert ascending


FRAME = 8 + 8  # an exchanged message's length, then a row set's count


@pytest.mark.multiprocess
def test_doubling_bytes_follow_the_merged_units():
    """Disjoint sets of k rows each on 4 ranks: stage 0 sends k rows, stage 1 the merged 2k, one
    message per stage (its length in front)."""
    k, width = 50, 3
    pair = 4 + 4 * width  # int32 index + a row of fp32

    def run(rank, world):
        comm = Communicator()
        indices = torch.arange(rank, 4 * k, 4)  # disjoint across ranks
        SparseDoubling(comm, 1000, width, torch.float32, None).run(indices, torch.ones(k, width))
        return [(r.op, r.bytes_sent) for r in comm.ledger.records]

    for records in run_workers(run, 4):
        assert records == [("swap", FRAME + k * pair), ("swap", FRAME + 2 * k * pair)]


@pytest.mark.multiprocess
def test_dense_switch_sends_the_dense_vector():
    numel = 1000

    def run(rank, world):
        comm = Communicator()
        indices = torch.arange(rank % 2, numel, 4)  # 25% each: a pair's union is half the tensor
        SparseDoubling(comm, numel, 1, torch.float32, 0.3).run(indices, torch.ones(250, 1))
        return [r.bytes_sent for r in comm.ledger.records]

    for sent in run_workers(run, 4):
        # Stage 0: 250 pairs (below the 30% switch, sparse); the merged half-full sum goes dense.
        assert sent == [FRAME + 250 * 8, FRAME + numel * 4]


def _unions(rank, world):
    sets = [torch.tensor(members) for members in ([rank], [0, 1, 2], [rank, rank + 4])]
    return union_counts(Communicator(), sets)


@pytest.mark.multiprocess
def test_union_counts_per_stage():
    for rank, stages in enumerate(run_workers(_unions, 4)):
        # Stage 0: pairs {2j, 2j+1}; stage 1: all four ranks.
        assert stages == [[2, 3, 4], [4, 3, 8]], rank


def _profiled(rank, world, overlap):
    if overlap == "identical":  # every rank the same 2.5%: recursive doubling never grows
        numel = 40_000
        indices = torch.arange(0, numel, 40)
    else:  # independent 30% on each rank: the union nears saturation
        numel = 200_000
        indices = torch.randperm(numel, generator=torch.Generator().manual_seed(rank))[:60_000]
    local = torch.zeros(numel)
    local[indices] = 1.0
    p = torch.nn.Parameter(torch.zeros(numel))
    sync = ZenSync(profile_steps=1, network_latency="100us")  # 1 Gbit/s, 100 us: the routing the test expects
    sync.setup([("w", p)])
    for _ in range(2):
        p.grad = local.clone()
        sync.grad_ready(p)
        sync.finish_step()
    oracle = local * (1.0 / world)
    dist.all_reduce(oracle)
    return sync.routing()["w"], torch.equal(p.grad, oracle)


@pytest.mark.multiprocess
def test_gammas_are_measured_and_pick_the_scheme():
    for route, exact in run_workers(_profiled, 4, "identical"):
        assert route["gammas"] == [1.0, 1.0, 1.0]
        # Equal bytes per stage, but log2 n latencies instead of BP's 2 (n-1).
        assert (route["path"], route["plan"]) == ("sparse", "hc")
        assert exact
    for route, exact in run_workers(_profiled, 4, "random"):
        # Independent sets of density d: gamma_k = (1 - (1 - d)^k) / d.
        assert route["gammas"] == pytest.approx([1.0, 1.7, 2.533], abs=0.02)
        assert (route["path"], route["plan"]) == ("sparse", "bp-bitmap")  # dense union: bitmap pull wins
        assert exact


def _merge_priced(rank, world):
    p = torch.nn.Parameter(torch.zeros(40_000))
    # A pinned alpha: a measured one on a loaded host can make BP's rounds dearer than HC's merges.
    sync = ZenSync(profile_steps=1, network_latency="100us")
    sync.setup([("w", p)])
    local = torch.zeros(40_000)
    local[torch.arange(0, 40_000, 40)] = 1.0  # identical on every rank: HC's best case
    p.grad = local.clone()
    sync.grad_ready(p)
    sync.finish_step()
    measured = sync.merge_s_per_byte  # routing with scheme=auto measured this host's merge rate
    sync.merge_s_per_byte = 0.0
    sync.forget_plans()
    free = sync.plan_times(0)
    sync.merge_s_per_byte = 1e-6  # what merging costs on a slow CPU
    sync.forget_plans()
    return measured, free, sync.plan_times(0), sync.plan(0)


@pytest.mark.multiprocess
def test_hc_pays_for_its_merges():
    for measured, free, priced, plan in run_workers(_merge_priced, 4):
        assert 0 < measured < 1e-6
        # Two stages, each merging two partial sums of gamma d M = 1000 (index, value) pairs of 8 bytes.
        assert priced["hc"] == pytest.approx(free["hc"] + 1e-6 * 2 * 2 * 1000 * 8)
        assert priced["bp-coo"] == free["bp-coo"]
        assert plan.startswith("bp")


def _drifting_zen(numel=20000):
    """One sparse tensor "w" under Zen, re-profiled when its density drifts 2x."""
    p = torch.nn.Parameter(torch.zeros(numel))
    sync = ZenSync(profile_steps=1, sparse_params=["w"], reprofile_drift=2.0)
    sync.setup([("w", p)])
    return p, sync


def _drift(rank, world):
    numel = 20000
    p, sync = _drifting_zen(numel)
    seen = []
    for step in range(6):
        stride = 100 if step < 3 else 10  # from step 3 on, ten times the non-zeros
        local = torch.zeros(numel)
        local[torch.arange(rank, numel, stride)] = 1.0
        p.grad = local.clone()
        sync.grad_ready(p)
        sync.finish_step()
        oracle = local * (1.0 / world)
        dist.all_reduce(oracle)
        seen.append((sync.profiles, round(sync.routes[0].density, 4), torch.equal(p.grad, oracle)))
    return seen


@pytest.mark.multiprocess
def test_density_drift_triggers_a_new_profile():
    for seen in run_workers(_drift, 2):
        assert all(exact for *_, exact in seen)
        assert seen[0][:2] == (1, 0.01)
        assert seen[2][:2] == (1, 0.01)
        # Step 3 notices the drift, step 4 profiles again.
        assert seen[4][:2] == (2, 0.1)
        assert seen[5][0] == 2


def test_bad_arguments_name_the_key():
    with pytest.raises(ValueError, match="sync.dense_threshold"):
        SparCMLSync(dense_threshold=1.5)
    with pytest.raises(ValueError, match="sync.scheme"):
        ZenSync(scheme="tree")
    with pytest.raises(ValueError, match="sync.reprofile_drift"):
        ZenSync(reprofile_drift=0.5)


def _hierarchical(rank, world, scheme):
    numel = 3001  # not divisible by the 2 ranks of a machine
    g = torch.Generator().manual_seed(rank)
    local = torch.zeros(numel)
    local[torch.randint(0, numel, (150,), generator=g)] = torch.randint(1, 4, (150,), generator=g).float()
    p = torch.nn.Parameter(torch.zeros(numel))
    sync = ZenSync(scheme=scheme, sparse_params=["w"], profile_steps=1, hierarchical=True, local_size=2)
    sync.setup([("w", p)])
    for _ in range(2):
        p.grad = local.clone()
        sync.grad_ready(p)
        stats = sync.finish_step()
    oracle = local * (1.0 / world)
    dist.all_reduce(oracle)
    ops = [(r.op, r.bytes_sent) for r in stats.collectives]
    return torch.equal(p.grad, oracle), ops


@pytest.mark.multiprocess
@pytest.mark.parametrize("scheme", ["bp", "hc"])
def test_hierarchical_mode_dense_inside_sparse_across(scheme):
    for exact, ops in run_workers(_hierarchical, 4, scheme):
        assert exact
        chunk_bytes = 1501 * 4
        # Dense reduce-scatter and allgather inside the machine (one chunk each way, 2 ranks)...
        assert ops[0] == ("reduce_scatter", chunk_bytes)
        assert ops[-1][0] == "allgather" and ops[-1][1] == chunk_bytes
        # ...and only sparse traffic between the two machines in between.
        assert {op for op, _ in ops[1:-1]} == ({"push", "pull"} if scheme == "bp" else {"swap"})


def _hierarchical_routing(rank, world):
    numel = 1 << 18
    g = torch.Generator().manual_seed(rank)
    full, rare = torch.nn.Parameter(torch.zeros(numel)), torch.nn.Parameter(torch.zeros(numel))
    sync = ZenSync(profile_steps=1, hierarchical=True, local_size=2, network_latency="100us")  # 1 Gbit/s, 100 us
    sync.setup([("full", full), ("rare", rare)])
    local_rare = torch.zeros(numel)
    local_rare[torch.randint(0, numel, (100,), generator=g)] = 1.0
    for _ in range(2):
        full.grad, rare.grad = torch.randint(1, 4, (numel,), generator=g).float(), local_rare.clone()
        sync.grad_ready(rare)
        sync.grad_ready(full)
        sync.finish_step()
    return {name: route["path"] for name, route in sync.routing().items()}


@pytest.mark.multiprocess
def test_hierarchical_routing_compares_dense_over_the_same_split():
    # Dense d = 1 on 2 machines x 2 ranks: the bitmap pull of the 2^17 chunk (~0.79 MB) beats a flat
    # ring over 4 ranks (~1.57 MB) but not the ring between machines on the same chunk (~0.52 MB).
    for paths in run_workers(_hierarchical_routing, 4):
        assert paths == {"full": "dense", "rare": "sparse"}


def _gammas_dropped(rank, world):
    numel = 20000
    p, sync = _drifting_zen(numel)
    seen = []
    for step in range(5):
        local = torch.zeros(numel)
        if step < 3:
            local[torch.arange(rank, numel, 100)] = 1.0
        else:  # from step 3 on fully dense: no longer a candidate for the doubling profile
            local += 1.0
        p.grad = local.clone()
        sync.grad_ready(p)
        sync.finish_step()
        seen.append((sync.profiles, sync.routing()["w"]["gammas"]))
    return seen


@pytest.mark.multiprocess
def test_reprofile_drops_gammas_of_tensors_no_longer_candidates():
    for seen in run_workers(_gammas_dropped, 2):
        assert seen[0] == (1, [1.0, 2.0])  # disjoint 1% on two ranks
        assert seen[4] == (2, None)  # step 3 noticed the drift, step 4 profiled the dense tensor


def _relayout(rank, world):
    g = torch.Generator().manual_seed(rank)
    a, b = torch.nn.Parameter(torch.zeros(20000)), torch.nn.Parameter(torch.zeros(30000))
    sync = ZenSync(scheme="bp", profile_steps=1, sparse_params=["a", "b"], reprofile_drift=2.0)
    sync.setup([("a", a), ("b", b)])
    seen = []
    for step in range(5):
        local_a, local_b = torch.zeros(20000), torch.zeros(30000)
        local_a[torch.randperm(20000, generator=g)[: 6000 if step < 2 else 100]] = 1.0  # 30%, then 0.5%
        local_b[torch.randperm(30000, generator=g)[:150]] = 1.0
        a.grad, b.grad = local_a, local_b
        sync.grad_ready(b)
        sync.grad_ready(a)
        sync.finish_step()
        seen.append((_plans(sync), sorted(sync.partitioner._owned)))
    return seen


def _plans(sync):
    """Each tensor's Zen scheme, where chosen."""
    return {i: route.plan for i, route in enumerate(sync.routes) if route.plan is not None}


@pytest.mark.multiprocess
def test_rerouting_does_not_accumulate_owned_sets():
    for seen in run_workers(_relayout, 2):
        # One batch of two sections: the bitmap section keeps the joint space's owned sets (a's and b's units).
        assert seen[1] == ({0: "bp-bitmap", 1: "bp-coo"}, [50000])
        # Step 2 drifts, step 3 re-profiles: both pull COO as one fused group, which keeps nothing.
        assert seen[4] == ({0: "bp-coo", 1: "bp-coo"}, [])


def _resumed(rank, world):
    numel = 200_000
    identical = torch.zeros(numel)
    identical[torch.arange(0, numel, 40)] = 1.0  # 2.5% on every rank: HC's best case
    scattered = torch.zeros(numel)  # independent 30% on each rank: BP with the bitmap pull
    scattered[torch.randperm(numel, generator=torch.Generator().manual_seed(rank))[:60_000]] = 1.0
    data = [identical] * 4 + [scattered] * 4  # step 4 drifts, steps 5-6 re-profile, step 7 re-routed

    def make():
        p = torch.nn.Parameter(torch.zeros(numel))
        sync = ZenSync(profile_steps=2, sparse_params=["w"], reprofile_drift=2.0, network_latency="100us")
        sync.setup([("w", p)])
        return p, sync

    def step(p, sync, local):
        p.grad = local.clone()
        sync.grad_ready(p)
        stats = sync.finish_step()
        return [(r.op, r.bytes_sent) for r in stats.collectives], p.grad.clone(), _plans(sync)

    p, sync = make()
    straight = []
    for i, local in enumerate(data):
        straight.append(step(p, sync, local))
        if i == 5:  # mid re-profile: one of its two steps done, the plans still the last round's
            checkpoint = copy.deepcopy(sync.state_dict())
    p, sync = make()
    sync.load_state_dict(checkpoint)
    resumed = [step(p, sync, local) for local in data[6:]]
    return straight, resumed


@pytest.mark.multiprocess
def test_resume_mid_reprofile_equals_the_uninterrupted_run():
    for straight, resumed in run_workers(_resumed, 4):
        # Unprofiled, the forced tensor pulls COO (no plan kept); routed, it is planned at once.
        assert [plans for *_, plans in straight] == [{}] + [{0: "hc"}] * 5 + [{0: "bp-bitmap"}] * 2
        for (ops, grad, plans), (ops2, grad2, plans2) in zip(straight[6:], resumed, strict=True):
            assert ops == ops2 and plans == plans2 and torch.equal(grad, grad2)
