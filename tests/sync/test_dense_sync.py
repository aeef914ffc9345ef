"""DenseAllreduce through the GradSync seam: exact averages, unused and sparse gradients, bytes."""

import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster import run_workers
from ddlscale.comm import volume
from ddlscale.sync import DenseAllreduce
from ddlscale.sync.dense import to_sparse_slices


class TwoTowers(torch.nn.Module):
    """Parameters of several sizes, one optional branch, and a row-sparse embedding."""

    def __init__(self, sparse: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 4, sparse=sparse)
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, ids, use_branch):
        h = self.b(self.a(self.emb(ids)))
        if use_branch:
            h = h + self.unused.weight.sum()
        return h.sum()


def _integer_model(model, rank):
    # Small integers and power-of-two scales keep every product and sum exact in fp32.
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randint(-2, 3, p.shape, generator=torch.Generator().manual_seed(i)).float())


def _run(rank, world, sparse, bucket_mb, steps):
    torch.manual_seed(0)
    model = TwoTowers(sparse)
    _integer_model(model, rank)
    sync = DenseAllreduce(bucket_mb=bucket_mb, first_bucket_mb=bucket_mb)
    named = list(model.named_parameters())
    sync.setup(named)
    for _, p in named:
        p.register_post_accumulate_grad_hook(sync.grad_ready)
    outs = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        ids = torch.tensor([rank, 3 * rank + step, 7])
        use_branch = rank == 0  # the branch is unused on every other rank
        model(ids, use_branch).backward()
        local = {n: (p.grad.to_dense() if p.grad is not None else torch.zeros_like(p)).clone() for n, p in named}
        stats = sync.finish_step()
        # Oracle: DDP's definition, allreduce of each local gradient scaled by 1/n; with n a power
        # of two that is also exactly the sum divided by n.
        oracle = {}
        for n, g in local.items():
            scaled = g * (1.0 / world)
            dist.all_reduce(scaled)
            if world in (1, 2, 4):
                total = g.clone()
                dist.all_reduce(total)
                assert torch.equal(scaled, total / world)
            oracle[n] = scaled
        synced = {n: p.grad.clone() for n, p in named}  # gradients alias the buckets
        outs.append((oracle, synced, stats.bytes_sent, stats.bytes_recv, len(stats.collectives),
                     [sync.names[i] for i in sync.backward_order]))
    return outs


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("sparse", [False, True])
def test_dense_equals_allreduce_average_exactly(world, sparse):
    for steps_out in run_workers(_run, world, sparse, 25.0, 3):
        for oracle, synced, sent, recv, _n_coll, _order in steps_out:
            for name, expected in oracle.items():
                got = synced[name]
                if name == "emb.weight" and sparse:
                    assert got.is_sparse, "a sparse gradient comes back sparse"
                    got = got.to_dense()
                if world == 3:  # 1/3 is not representable: summation order may differ in the last bit
                    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
                else:
                    assert torch.equal(got, expected), name
            numel = sum(t.numel() for t in oracle.values())
            assert (sent, recv) == volume.ring_allreduce(numel, 4, world, 0) or world > 1
        # The backward order is learned after the first step and never includes a duplicate.
        assert sorted(steps_out[-1][-1]) == sorted(oracle)


@pytest.mark.multiprocess
def test_small_buckets_split_and_still_exact():
    # 64-byte buckets force one bucket per parameter: more collectives, same exact result.
    outs = run_workers(_run, 3, False, 64 / 2**20, 2)
    for steps_out in outs:
        oracle, synced, *_, n_coll, _ = steps_out[-1]
        assert n_coll >= 4  # tiny biases may share a bucket; large tensors cannot
        for name, expected in oracle.items():
            torch.testing.assert_close(synced[name], expected, rtol=1e-6, atol=1e-6)


def test_bucket_size_is_validated():
    with pytest.raises(ValueError, match="sync.bucket_mb"):
        DenseAllreduce(bucket_mb=-1)
    with pytest.raises(ValueError, match="sync.first_bucket_mb"):
        DenseAllreduce(first_bucket_mb=0)


def test_to_sparse_slices_matches_to_sparse():
    dense = torch.zeros(200, 6)
    dense[torch.randint(0, 200, (30,), generator=torch.Generator().manual_seed(0))] = 1.5
    dense[5, 2], dense[7, 1], dense[9, 3] = float("nan"), -0.0, 2.0
    for sparse_dim in (1, 2):
        fast, reference = to_sparse_slices(dense, sparse_dim), dense.to_sparse(sparse_dim).coalesce()
        assert fast.is_coalesced() and fast.sparse_dim() == sparse_dim
        assert torch.equal(fast.indices(), reference.indices())
        torch.testing.assert_close(fast.values(), reference.values(), equal_nan=True, rtol=0, atol=0)
