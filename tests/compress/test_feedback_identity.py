"""Error feedback is exact on float32 data: for every scheme x compressor it carries, flat and
hierarchical, the sum over steps of what the ranks received plus the residuals summed over ranks
equals the sum of the averaged float32 gradients, up to float32 rounding — fp16/bf16 under
allreduce included (the 16-bit sum's rounding is fed back). Small integers would hide every 16-bit
rounding, so the gradients are random floats."""

import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster import run_workers
from ddlscale.compress import build_compressor
from ddlscale.compress.none import NoCompression
from ddlscale.compress.sparse import SparseCompressor
from ddlscale.sync.compressed import CompressSync
from ddlscale.sync.compressed.regroup import _unchunk

SHAPES = {"a": (37, 5), "b": (101,), "c": (8, 8)}
# DGC with its momentum correction off: on, what is sent sums to the corrected velocities, not the
# gradients (tests/compress/test_paper_defaults.py checks that on its own).
COMPRESSORS = {"none": {}, "fp16": {}, "bf16": {}, "int8": {}, "topk": {"ratio": 0.2},
               "dgc": {"ratio": 0.2, "momentum": 0.0, "clip_norm": None},
               "randomk": {"ratio": 0.3, "unbiased": False}, "randomk-shared": {"ratio": 0.3, "seed": 1},
               "threshold": {"threshold": 0.01}, "efsignsgd": {}, "onebit": {}, "qsgd": {"levels": 2, "bucket_size": 16},
               "terngrad": {}, "powersgd": {"rank": 1}}


def _grads(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {n: 0.01 * torch.randn(shape, generator=g) for n, shape in SHAPES.items()}


def _cases(rank, world, scheme):
    base = CompressSync(NoCompression(), comm="allgather", hierarchical=True, local_size=2)
    base.setup([(n, torch.nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()])  # the machine groups, once
    out = {}
    for hierarchical in (False, True):
        for name, kwargs in COMPRESSORS.items():
            compressor = build_compressor(name.split("-")[0], **kwargs)
            if scheme == "allreduce" and not (compressor.summable or hasattr(compressor, "reduce")):
                continue
            if scheme == "alltoall" and compressor.needs_matrices:
                continue
            if scheme == "zen" and not isinstance(compressor, SparseCompressor):
                continue
            if scheme != "allreduce" and hasattr(compressor, "reduce"):  # PowerSGD: allreduce only (refused)
                continue
            sync = CompressSync(compressor, comm=scheme, memory="residual", hierarchical=hierarchical, local_size=2)
            sync.intra, sync.inter = base.intra, base.inter
            params = [(n, torch.nn.Parameter(torch.zeros(shape))) for n, shape in SHAPES.items()]
            sync.setup(params)
            received = {n: torch.zeros(shape, dtype=torch.float64) for n, shape in SHAPES.items()}
            true = {n: torch.zeros(shape, dtype=torch.float64) for n, shape in SHAPES.items()}
            for step in range(4):
                grads = _grads(rank, step)
                for n, p in reversed(params):
                    p.grad = grads[n].clone()
                    sync.grad_ready(p)
                sync.finish_step()
                for n, p in params:
                    received[n] += p.grad.double()
                    true[n] += grads[n].double() / world
            residual = {}
            for key, layout in sync._layouts().items():
                kept = sync.memory.residual(key)
                flat = torch.zeros(layout.numel) if kept is None else _unchunk(kept, layout)
                residual[layout.members[0][0]] = flat.double().reshape(SHAPES[layout.members[0][0]])
            for n in SHAPES:
                dist.all_reduce(true[n])
                dist.all_reduce(residual[n])
            out[(name, hierarchical)] = (received, residual, true)
    return out


@pytest.mark.parametrize("scheme", ["allreduce", "allgather", "alltoall", "gather", "zen"])
def test_received_plus_residuals_is_the_true_sum_on_float32(scheme):
    """Tolerance: float32 roundings — 32 ulps of the largest value involved (a few 1e-9 on these
    ~0.01 gradients); a 16-bit rounding left out is ~2^-11 of a value (fp16) or ~2^-8 (bf16),
    hundreds of times more."""
    for cases in run_workers(_cases, 4, scheme):
        for (name, hierarchical), (received, residual, true) in cases.items():
            for n in SHAPES:
                error = (received[n] + residual[n] - true[n]).abs().max().item()
                scale = max(t.abs().max().item() for t in (received[n], residual[n], true[n]))
                assert error <= 32 * 2**-24 * scale, (f"{scheme} {name} hierarchical={hierarchical} {n}: identity off "
                                                      f"by {error:.3g} at scale {scale:.3g}")
            if name != "none":
                assert any((received[n] - true[n]).abs().max() > 1e-7 for n in SHAPES), (name, "dropped nothing")
