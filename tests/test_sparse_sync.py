"""Sparse backends equal dense allreduce: exactly on representable data, on every rank, every case."""

import time

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ddlscale.cluster import run_workers
from ddlscale.sync.sparse import (
    AGSparseSync,
    GlooSparseSync,
    HashPartitioner,
    OmniReduceSync,
    SparCMLSync,
    SparsePSSync,
    ZenSync,
)
from ddlscale.sync.sparse.coo import coo_slices, scatter_dense, to_flat_coo
from ddlscale.sync.sparse.zen import merge_seconds_per_element

BACKENDS = {
    "zen-coo": lambda: ZenSync(scheme="bp", pull="coo", sparse_params=["w"], profile_steps=1),
    "zen-bitmap": lambda: ZenSync(scheme="bp", pull="bitmap", sparse_params=["w"], profile_steps=1),
    "zen-hc": lambda: ZenSync(scheme="hc", sparse_params=["w"], profile_steps=1),
    "sparcml": lambda: SparCMLSync(sparse_params=["w"], profile_steps=1),
    "gloo_sparse": lambda: GlooSparseSync(sparse_params=["w"], profile_steps=1),
    "sparse_ps": lambda: SparsePSSync(sparse_params=["w"], profile_steps=1),
    "agsparse": lambda: AGSparseSync(sparse_params=["w"], profile_steps=1),
    "omnireduce": lambda: OmniReduceSync(sparse_params=["w"], profile_steps=1),
}
CASES = ["random", "endpoints", "uneven_M", "empty_on_some", "identical", "disjoint", "full", "cancel", "nan"]


def _local_grad(case, rank, world, dtype):
    """Rank-specific small-integer gradients (exact in fp32 and bf16) for each case."""
    M = 1001 if case == "uneven_M" else 1024
    g = torch.Generator().manual_seed(1000 * rank + CASES.index(case))
    grad = torch.zeros(M)
    if case in ("random", "uneven_M", "endpoints"):
        idx = torch.randint(0, M, (60,), generator=g)
        grad[idx] = torch.randint(-4, 5, (60,), generator=g).float()
        if case == "endpoints":
            grad[0], grad[M - 1] = 1.0 + rank, -2.0
    elif case == "empty_on_some":
        if rank % 2 == 0:
            grad[torch.randint(0, M, (40,), generator=g)] = 3.0
    elif case == "identical":
        grad[torch.arange(0, M, 7)] = float(rank + 1)
    elif case == "disjoint":
        grad[torch.arange(rank, M, world * 5)] = 2.0
    elif case == "full":
        grad = torch.randint(1, 5, (M,), generator=g).float()
    elif case == "cancel":
        grad[torch.arange(10, 200)] = 1.0 if rank % 2 == 0 else -1.0
    elif case == "nan":
        grad[torch.arange(0, M, 13)] = 1.0
        if rank == 0:
            grad[5] = float("nan")
    return grad.to(dtype)


def _run(rank, world, backend):
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for case in CASES:
            if case == "cancel" and world % 2:
                continue
            local = _local_grad(case, rank, world, dtype)
            p = torch.nn.Parameter(torch.zeros_like(local))
            sync = BACKENDS[backend]()
            sync.setup([("w", p)])
            outs = []
            for _ in range(2):  # step 0 profiles over the dense path, step 1 goes sparse
                p.grad = local.clone()
                sync.grad_ready(p)
                stats = sync.finish_step()
                outs.append(p.grad.clone())
            oracle = local * (1.0 / world)
            dist.all_reduce(oracle)
            results[(str(dtype), case)] = (outs[1], oracle, sync.routing()["w"]["path"], stats.bytes_sent)
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_sparse_backend_equals_dense_allreduce(backend, world):
    for rank_results in run_workers(_run, world, backend):
        for (dtype, case), (got, oracle, path, _) in rank_results.items():
            assert path == "sparse"
            where = f"{backend} n={world} {dtype} {case}"
            if world == 3 and dtype == "torch.float32":  # x/3 is not representable: order may matter
                torch.testing.assert_close(got, oracle, rtol=1e-6, atol=1e-6, equal_nan=True, msg=where)
            elif world == 3:
                torch.testing.assert_close(got, oracle, rtol=1e-2, atol=1e-2, equal_nan=True, msg=where)
            else:
                assert torch.equal(torch.isnan(got), torch.isnan(oracle)), where
                ok = ~torch.isnan(oracle)
                assert torch.equal(got[ok], oracle[ok]), where


def _random_fp32(rank, world):
    torch.manual_seed(rank)
    local = torch.zeros(5000)
    idx = torch.randint(0, 5000, (300,))
    local[idx] = torch.randn(300)
    reference = local.double()
    dist.all_reduce(reference)
    p = torch.nn.Parameter(torch.zeros(5000))
    sync = ZenSync(sparse_params=["w"], profile_steps=1)
    sync.setup([("w", p)])
    for _ in range(2):
        p.grad = local.clone()
        sync.grad_ready(p)
        sync.finish_step()
    return p.grad, reference / world


def test_random_fp32_close_to_float64_reference():
    for got, reference in run_workers(_random_fp32, 3):
        torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-6)


def _measured_latency(rank, world):
    numel = 1 << 20  # 4 MB: tens of ms dense at 1 Gbit/s, against a few messages of 400 non-zeros
    big, small = torch.nn.Parameter(torch.zeros(numel)), torch.nn.Parameter(torch.zeros(8))
    sync = ZenSync(profile_steps=1, network_latency="measured")
    sync.setup([("w", big), ("b", small)])
    exact = []
    for step in range(3):
        local = torch.zeros(numel)
        local[torch.randint(0, numel, (400,), generator=torch.Generator().manual_seed(10 * rank + step))] = 1.0
        big.grad, small.grad = local.clone(), torch.full((8,), float(rank))
        sync.grad_ready(small)
        sync.grad_ready(big)
        sync.finish_step()
        oracle = local * (1.0 / world)
        dist.all_reduce(oracle)
        exact.append(torch.equal(big.grad, oracle))
    restored = ZenSync(profile_steps=1, network_latency="measured")
    restored.setup([("w", torch.nn.Parameter(torch.zeros(numel))), ("b", torch.nn.Parameter(torch.zeros(8)))])
    restored.load_state_dict(sync.state_dict())
    return (sync.network.latency_s, sync.merge_s_per_element, sync.routing(), all(exact),
            (restored.network.latency_s, restored.merge_s_per_element, restored.measure_latency))


def test_measured_latency_is_rank_0s_on_every_rank():
    results = run_workers(_measured_latency, 3)
    latency, merge, routing, _, _ = results[0]
    assert latency > 0 and merge > 0
    assert routing["w"]["path"] == "sparse"
    assert routing["b"]["path"] == "dense"  # 32 bytes: a sparse scheme's messages cost more than they save
    for rank_latency, rank_merge, rank_routing, exact, restored in results:
        assert (rank_latency, rank_merge, rank_routing) == (latency, merge, routing)  # else ranks would deadlock
        assert exact
        assert restored == (latency, merge, False)  # a resumed run routes as the checkpointed one, no new probe


def test_merge_cost_is_timed_long_enough_for_ranks_to_overlap():
    """Ranks time HC's merge together after a barrier; each must run long enough that they do."""
    start = time.perf_counter()
    seconds = merge_seconds_per_element(size=1 << 10, calls=1, budget_s=0.05)
    assert time.perf_counter() - start >= 0.05 and seconds > 0


def _embedding(rank, world):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(100, 4, sparse=True)
    sync = ZenSync(sparse_params=["weight"], profile_steps=1)
    sync.setup(list(emb.named_parameters()))
    grads = []
    for step in range(2):
        emb.zero_grad()
        emb(torch.tensor([0, 99, 3 * rank + step])).sum().backward()
        local = emb.weight.grad.to_dense()
        sync.grad_ready(emb.weight)
        sync.finish_step()
        oracle = local * (1.0 / world)
        dist.all_reduce(oracle)
        grads.append((emb.weight.grad.is_sparse, emb.weight.grad.to_dense(), oracle))
    return grads


def test_sparse_coo_embedding_gradients():
    for rank_grads in run_workers(_embedding, 2):
        for is_sparse, got, oracle in rank_grads:
            assert is_sparse, "a sparse gradient comes back sparse"
            assert torch.equal(got, oracle)


def test_flat_coo_of_sparse_gradients_matches_dense():
    # An all-padding batch leaves an Embedding(sparse=True) gradient with no stored rows.
    emb = torch.nn.Embedding(10, 3, sparse=True, padding_idx=0)
    emb(torch.tensor([0, 0])).sum().backward()
    assert emb.weight.grad._nnz() == 0
    # Two sparse dims: slices (1, 0) and (0, 1) have the same first index as (1, 2) and (0, 2).
    coords = torch.tensor([[1, 0, 1, 0], [0, 1, 2, 2]])
    two_dims = torch.sparse_coo_tensor(coords, torch.arange(1.0, 17.0).view(4, 2, 2), (2, 3, 2, 2))
    for grad in (emb.weight.grad, two_dims):
        dense = grad.to_dense()
        indices, values = to_flat_coo(grad)
        assert torch.equal(scatter_dense(indices, values, dense), dense)
        assert torch.equal(coo_slices(indices, values, dense, grad.sparse_dim()).to_dense(), dense)


def _padding_embedding(rank, world):
    emb = torch.nn.Embedding(20, 4, sparse=True, padding_idx=0)
    sync = ZenSync(sparse_params=["weight"], profile_steps=1)
    sync.setup(list(emb.named_parameters()))
    grads = []
    for step in range(2):
        emb.zero_grad()
        batch = torch.tensor([0, 0]) if rank == 1 else torch.tensor([0, 5 + step, 7])  # rank 1: padding only
        emb(batch).sum().backward()
        local = emb.weight.grad.to_dense()
        sync.grad_ready(emb.weight)
        sync.finish_step()
        oracle = local * (1.0 / world)
        dist.all_reduce(oracle)
        grads.append((emb.weight.grad.to_dense(), oracle))
    return grads


def test_all_padding_batch_on_one_rank():
    for rank_grads in run_workers(_padding_embedding, 2):
        for got, oracle in rank_grads:
            assert torch.equal(got, oracle)


def _bf16_routing(rank, world):
    numel = 10_000
    params = {"fp32": torch.nn.Parameter(torch.zeros(numel)),
              "bf16": torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16))}
    sync = AGSparseSync(profile_steps=1, network_latency="0us")
    sync.setup(list(params.items()))
    # 14% on each rank, n = 4: AGsparse's 6-byte bf16 pairs (int32 index + 2-byte value) beat bf16's
    # dense bytes below 2 / (3n) = 16.7%; priced as 8-byte pairs they would lose past 1 / (2n) = 12.5%.
    local = torch.zeros(numel)
    local[torch.randperm(numel, generator=torch.Generator().manual_seed(rank))[:1400]] = 1.0
    for p in params.values():
        p.grad = local.to(p.dtype)
        sync.grad_ready(p)
    sync.finish_step()
    zen = ZenSync(profile_steps=1)
    zen.setup([("bf16", torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16)))])
    zen.density[0], zen.gamma[0] = 0.01, 2.0
    return {name: route["path"] for name, route in sync.routing().items()}, zen.plan_times(0), zen.network


def test_routing_prices_values_at_their_element_size():
    for paths, times, network in run_workers(_bf16_routing, 4):
        assert paths == {"fp32": "sparse", "bf16": "sparse"}
        # Zen's COO pull for bf16: 6-byte pairs, 6 d M (1 + gamma)(n-1)/n bytes.
        nbytes = 6 * 0.01 * 10_000 * 3 * 3 / 4
        assert times["bp-coo"] == pytest.approx(nbytes * 8 / network.bandwidth_bps + 6 * network.latency_s)


def _capped_groups(rank, world):
    a, b = torch.nn.Parameter(torch.zeros(1000)), torch.nn.Parameter(torch.zeros(1000))
    sync = ZenSync(scheme="bp", pull="coo", sparse_params=["a", "b"], profile_steps=1)
    sync.max_group_numel = 1500  # stands for the 2**31 elements int32 indices address
    sync.setup([("a", a), ("b", b)])
    local = torch.zeros(1000)
    local[torch.arange(rank, 1000, 7)] = 1.0
    for _ in range(2):
        a.grad, b.grad = local.clone(), 2 * local
        sync.grad_ready(b)
        sync.grad_ready(a)
        sync.finish_step()
    oracle = local * (1.0 / world)
    dist.all_reduce(oracle)
    groups = sync._sparse_groups()
    sync.max_group_numel = 999
    with pytest.raises(ValueError, match="more than the 999"):
        sync._sparse_groups()
    return groups, torch.equal(a.grad, oracle) and torch.equal(b.grad, 2 * oracle)


def test_fused_groups_stay_within_the_index_range():
    for groups, exact in run_workers(_capped_groups, 2):
        assert sorted(groups) == [[0], [1]]  # 2000 elements would overflow the 1500: two groups
        assert exact


def test_sparse_params_from_hydra_config():
    names = OmegaConf.create(["emb.weight", "out.weight"])  # what Hydra's instantiate passes
    assert ZenSync(sparse_params=names).sparse_params == ["emb.weight", "out.weight"]
    with pytest.raises(ValueError, match="sync.sparse_params"):
        ZenSync(sparse_params="emb.weight")


def test_hash_partition_invariants_and_balance():
    M = 1_000_003
    for n in (1, 2, 3, 8):
        part = HashPartitioner(n, seed=7)
        owned, position = part.layout(M)
        union = torch.cat(owned)
        assert union.numel() == M and torch.equal(torch.sort(union).values, torch.arange(M)), "disjoint + covering"
        for s, members in enumerate(owned):
            assert torch.equal(members, torch.sort(members).values)
            assert torch.equal(part.server_of(members), torch.full_like(members, s))
            assert torch.equal(position[members], torch.arange(members.numel()))
    # Zipf-skewed indices (hot ids first): hash stays balanced, a contiguous split does not.
    n = 8
    ranks = torch.arange(1, M + 1, dtype=torch.float64)
    indices = torch.unique(torch.multinomial(ranks ** -1.0, 1_000_000, replacement=True,
                                             generator=torch.Generator().manual_seed(0)))
    assert indices.numel() >= 1e5 and 0 in indices.tolist()
    hashed = torch.bincount(HashPartitioner(n).server_of(indices), minlength=n).double()
    contiguous = torch.bincount(indices * n // M, minlength=n).double()
    hash_imbalance = float(hashed.max() / hashed.mean())
    contiguous_imbalance = float(contiguous.max() / contiguous.mean())
    print(f"imbalance: hash {hash_imbalance:.3f}, contiguous {contiguous_imbalance:.2f}")
    assert hash_imbalance <= 1.1 and contiguous_imbalance > 3


def test_bad_arguments_name_the_key():
    with pytest.raises(ValueError, match="sync.pull"):
        ZenSync(pull="carrier-pigeon")
    with pytest.raises(ValueError, match="sync.profile_steps"):
        ZenSync(profile_steps=0)
