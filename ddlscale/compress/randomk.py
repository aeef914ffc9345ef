"""Random-k sparsification: keep k elements drawn uniformly without replacement."""

from __future__ import annotations

from typing import Any

import torch

from ddlscale.compress.base import (
    Compressor,
    Context,
    Shape,
    check_ratio,
    check_seed,
    count_of,
    float_bytes,
    index_dtype,
    numel_of,
)
from ddlscale.compress.sparse import SparseCompressor


def sample_without_replacement(n: int, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """k distinct positions in [0, n), uniformly, ascending.

    A permutation costs O(n) (half a second at 2^24 elements); for k well below n it is cheaper to
    draw i.i.d. positions and keep each one's first occurrence: the first k distinct values of an
    i.i.d. uniform sequence are a uniform k-subset (sequential sampling without replacement).
    Cost O(k log k); more draws are added in the rare case duplicates leave fewer than k.
    """
    if 4 * k >= n:
        return torch.randperm(n, generator=gen, device=device)[:k].sort().values
    draws = torch.empty(0, dtype=torch.long, device=device)
    while True:
        more = torch.randint(n, (k + k // 4 + 16,), generator=gen, device=device)
        draws = torch.cat([draws, more])
        distinct, inverse = torch.unique(draws, return_inverse=True)
        if distinct.numel() >= k:
            break
    order = torch.arange(draws.numel(), device=device)
    first = torch.full_like(distinct, draws.numel()).scatter_reduce_(0, inverse, order, "amin")
    return distinct[first.argsort()[:k]].sort().values


class RandomK(SparseCompressor):
    """k = ceil(ratio * numel) positions drawn without replacement.

    ``unbiased``: kept values are scaled by numel / k, so E[D(C(g))] = g (variance
    g_i^2 (numel / k - 1) per element); without it the output is a biased, smaller estimate.

    ``seed``: when set, every rank draws the same positions for the same tensor and step (the
    positions derive from (seed, name, step) only). Indices then need not travel — each rank
    regenerates them — and payloads are summable: allreduce the values. When null, each rank draws
    its own positions and sends them.

    Payload: shared seed ``[values (k)]`` (indices live in ``Context.extra``, identical on every
    rank); otherwise ``[values (k), indices (k, int32)]``.
    """

    name = "randomk"

    def __init__(self, ratio: float = 0.01, unbiased: bool = True, seed: int | None = None) -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)
        if not isinstance(unbiased, bool):
            raise ValueError(f"compressor.unbiased must be true or false, got {unbiased!r}")
        self.unbiased = unbiased
        self.shared = seed is not None
        self.seed = check_seed(seed) if self.shared else 0
        self.summable = self.shared

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        n = flat.numel()
        gen = self.generator(name, flat.device, shared=self.shared)
        return sample_without_replacement(n, count_of(self.ratio, n), gen, flat.device)

    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], Any]:
        flat = tensor.reshape(-1)
        idx = self.select(flat, name)
        values = flat[idx]
        if self.unbiased and idx.numel():
            values = values * (flat.numel() / idx.numel())
        idx = idx.to(index_dtype(flat.numel()))
        return ([values], idx) if self.shared else ([values, idx], None)

    context = Compressor.context  # shared indices live in the context: draw them

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        return super().decode(payload if not self.shared else [payload[0], ctx.extra], ctx)

    def kept_max(self, numel: int) -> int:
        return count_of(self.ratio, numel)

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        if self.shared:
            return self.kept_max(numel_of(shape)) * float_bytes(dtype)
        return super().payload_bytes(shape, dtype, kept)
