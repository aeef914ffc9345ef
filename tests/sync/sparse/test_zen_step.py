"""A whole model's step in one exchange (issue 59 item 2): tables that share row ids travel as one
unit set, dense tensors ride Zen's push and pull (or its HC chain) index-free, HC's chain carries
every width. Each equals dense allreduce bit for bit at n = 2, 4, 8, 16 (float32 summation-order
error at odd n) through uncoalesced duplicate indices, an empty rank, a step where the shared tables'
rows differ and an all-empty step, and issues the collectives its cost objects count."""

import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster import run_workers
from ddlscale.sync.sparse import AGSparseSync, GlooSparseSync, SparCMLSync, SparsePSSync, ZenSync

TABLES = ["emb", "first", "other"]  # emb and first are looked up with the same ids (DeepFM's two tables)
SHAPES = {"emb": (61, 8), "first": (61, 1), "other": (43, 5), "mlp": (7, 3)}
STEPS = 5  # step 0 profiles; then duplicates with an empty rank, differing rows, all empty, duplicates
# A latency so high that sharing rounds decides: the dense tensor rides Zen's carrier, not its own allreduce.
COMMON = {"sparse_params": TABLES, "profile_steps": 1, "network_latency": "1s", "reprofile_drift": None}
SYNCS = {
    "zen-bp": lambda: ZenSync(scheme="bp", pull="coo", batch="step", **COMMON),
    "zen-bitmap": lambda: ZenSync(scheme="bp", pull="bitmap", batch="step", **COMMON),
    "zen-hc": lambda: ZenSync(scheme="hc", batch="step", **COMMON),
    "zen-bucket": lambda: ZenSync(scheme="bp", pull="coo", batch="step", carry_dense=False, **COMMON),
    "agsparse": lambda: AGSparseSync(**COMMON),
    "sparcml": lambda: SparCMLSync(**COMMON),
    "sparse_ps": lambda: SparsePSSync(**COMMON),
    "gloo_sparse": lambda: GlooSparseSync(**COMMON),
}


def _lookups(rank, step, g):
    """The ids this rank looks up in each table this step (repeats included), per the step's case."""
    if step == 3 or (step == 1 and rank == 1):  # all empty; one empty rank
        return {name: torch.empty(0, dtype=torch.long) for name in TABLES}
    shared = torch.randint(0, 61, (7,), generator=g)
    shared = torch.cat([shared, shared[:3], torch.tensor([0, 60])])  # duplicates, and both end rows
    ids = {"emb": shared, "first": shared, "other": torch.randint(0, 43, (9,), generator=g).repeat(2)}
    if step == 2:  # the shared tables' rows differ: first misses some of emb's and has one of its own
        ids["first"] = torch.cat([shared[2:], torch.tensor([30 + rank])])
    return ids


def _grads(rank, step):
    """Uncoalesced sparse gradients of small integers (exact in float32) and the dense tensor's."""
    g = torch.Generator().manual_seed(100 * rank + step)
    grads = {}
    for name, ids in _lookups(rank, step, g).items():
        rows, width = SHAPES[name]
        values = torch.randint(-3, 4, (ids.numel(), width), generator=g).float()
        grads[name] = torch.sparse_coo_tensor(ids[None], values, (rows, width))
    grads["mlp"] = torch.zeros(SHAPES["mlp"]) if step == 3 else \
        torch.randint(-3, 4, SHAPES["mlp"], generator=g).float()
    return grads


def _steps(rank, world, name):
    params = {n: torch.nn.Parameter(torch.zeros(shape)) for n, shape in SHAPES.items()}
    sync = SYNCS[name]()
    sync.setup(list(params.items()), sparse_grads=TABLES)
    out = []
    for step in range(STEPS):
        grads = _grads(rank, step)
        for n in ["mlp", "other", "first", "emb"]:  # backward order
            params[n].grad = grads[n].clone()
            sync.grad_ready(params[n])
        stats = sync.finish_step()
        got = {}  # a copy: a dense gradient is a view of its bucket, which the next step overwrites
        for n, p in params.items():
            oracle = grads[n].to_dense() * (1.0 / world)
            dist.all_reduce(oracle)
            got[n] = (p.grad.is_sparse, not p.grad.is_sparse or p.grad.is_coalesced(), p.grad.to_dense().clone(), oracle)
        out.append((got, [r.op for r in stats.collectives]))
    return out, sync.routing(), sync.collectives_per_step()


def _check(per_rank, world, name):
    for rank, (steps, routing, priced) in enumerate(per_rank):
        for step, (got, _) in enumerate(steps):
            for n, (is_sparse, coalesced, grad, oracle) in got.items():
                where = f"{name} n={world} rank {rank} step {step} {n}"
                assert is_sparse == (n in TABLES) and coalesced, f"{where}: back in its own layout"
                if world & (world - 1):  # x/3 is not representable: summation order may matter
                    torch.testing.assert_close(grad, oracle, rtol=1e-6, atol=1e-6, msg=where)
                else:
                    assert torch.equal(grad, oracle), where
                assert torch.equal(grad, per_rank[0][0][step][0][n][2]), f"{where}: differs from rank 0's"
        for step in range(1, STEPS):  # the busiest rank's ledger against what the cost objects count
            busiest = max(len(other[0][step][1]) for other in per_rank)
            assert busiest == priced, f"{name} n={world} step {step}: ledger {steps[step][1]}, priced {priced}"
        assert routing["emb"]["shares_rows_with"] == ["first"], routing["emb"]
        assert routing["first"]["shares_rows_with"] == ["emb"]
        assert "shares_rows_with" not in routing["other"]
    return per_rank[0]


def _expected_ops(name, world):
    """What a routed step issues: Zen's whole step in one push and one pull, or one swap per doubling
    stage, the dense tensor inside; the others add the dense tensor's allreduce to their own."""
    stages = world.bit_length() - 1 + (0 if world & (world - 1) == 0 else 2)
    return {"zen-bp": ["push", "pull"], "zen-bitmap": ["push", "pull"], "zen-hc": ["swap"] * stages}.get(name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4, 8, pytest.param(16, marks=pytest.mark.slow)])  # 16: 2-10 s each
@pytest.mark.parametrize("name", list(SYNCS))
def test_a_whole_step_equals_dense_allreduce(world, name):
    steps, routing, _ = _check(run_workers(_steps, world, name, timeout_s=300), world, name)
    expected = _expected_ops(name, world)
    if expected is not None and world & (world - 1) == 0:
        for _, ops in steps[1:]:
            assert ops == expected, ops
    if name.startswith("zen") and name != "zen-bucket":
        assert routing["mlp"]["plan"] == ("hc-dense" if name == "zen-hc" else "bp-dense"), routing["mlp"]
    else:
        assert "allreduce" in steps[1][1], f"{name}: the dense tensor keeps its bucket"
