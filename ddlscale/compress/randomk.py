"""Random-k sparsification: keep k elements drawn uniformly without replacement."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ddlscale.compress.compressor import (
    Compressor,
    Context,
    Segment,
    Shape,
    check_ratio,
    check_seed,
    count_of,
    counts_of,
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


def sample_segments(sizes: Sequence[int], counts: Sequence[int], gen: torch.Generator,
                    device: torch.device) -> torch.Tensor:
    """For every segment of a flat buffer (``sizes`` in order), ``counts[i]`` distinct positions
    drawn uniformly inside it; all of them ascending, as buffer offsets.

    Segments with few draws go together: i.i.d. draws, each segment's own ones uniform inside it,
    keeping each segment's first ``counts[i]`` distinct values in draw order (as
    :func:`sample_without_replacement` does for one tensor). Segments sampled densely
    (4k >= n) take a permutation each.
    """
    sizes_t = torch.tensor(list(sizes), dtype=torch.long)
    counts_t = torch.tensor(list(counts), dtype=torch.long)
    starts = torch.cumsum(sizes_t, 0) - sizes_t
    dense = 4 * counts_t >= sizes_t
    out = [starts[i] + torch.randperm(int(sizes_t[i]), generator=gen, device=device)[: int(counts_t[i])]
           for i in torch.nonzero(dense & (counts_t > 0)).reshape(-1).tolist()]
    sparse = torch.nonzero(~dense & (counts_t > 0)).reshape(-1)
    slack = 1
    while sparse.numel():
        segment = sparse.repeat_interleave(slack * (counts_t[sparse] + counts_t[sparse] // 4 + 16))
        # float64 draws: floor(u * n) is uniform for any n below 2**53
        u = torch.rand(segment.numel(), generator=gen, dtype=torch.float64, device=device)
        draws = starts[segment].to(device) + (u * sizes_t[segment].to(device)).long()
        distinct, inverse = torch.unique(draws, return_inverse=True)
        order = torch.arange(draws.numel(), device=device)
        first = torch.full_like(distinct, draws.numel()).scatter_reduce_(0, inverse, order, "amin")
        owner = segment.to(device)[first]  # the segment each distinct value was drawn for
        by_draw = torch.argsort(owner * draws.numel() + first)  # per segment, in draw order
        owner, chosen = owner[by_draw], distinct[by_draw]
        seen = torch.bincount(owner, minlength=len(sizes))
        rank = torch.arange(owner.numel(), device=device) - (torch.cumsum(seen, 0) - seen)[owner]
        if bool((seen[sparse.to(device)] >= counts_t[sparse].to(device)).all()):
            out.append(chosen[rank < counts_t.to(device)[owner]])
            break
        slack *= 2  # duplicates left a segment short (rare): draw again, more
    if not out:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.cat([o.to(device) for o in out]).sort().values


class RandomK(SparseCompressor):
    """k = ceil(ratio * numel) positions drawn without replacement.

    ``unbiased``: kept values are scaled by numel / k, so E[D(C(g))] = g (variance
    g_i^2 (numel / k - 1) per element): it runs without error feedback by default, and must (scaled
    by numel / k it is no contraction, so a residual grows until the loss is NaN). Without it the
    output is a biased, smaller estimate, and error feedback (the default then) keeps what it drops.

    ``seed``: when set, every rank draws the same positions for the same tensor and step (the
    positions derive from (seed, name, step) only). Indices then need not travel — each rank
    regenerates them — and payloads are summable: allreduce the values. When null, each rank draws
    its own positions and sends them.

    Payload: shared seed ``[values (k)]`` (indices live in ``Context.extra``, identical on every
    rank); otherwise ``[values (k), indices (k, int32)]``.

    A fused buffer given its ``segments`` draws k = ceil(ratio * n) positions in each member, as
    compressing each member alone would (and scales each by its own n / k): fusing changes what a
    step sends only by the rounding, never which tensors are sampled how densely. Each member past
    the first may add one kept element (``member_bytes``). Unchanged by fusion in distribution, not
    bit for bit: the group draws its positions from its own stream, in one pass for all members.
    """

    name = "randomk"
    per_member = True

    def __init__(self, ratio: float = 0.01, unbiased: bool = True, seed: int | None = None) -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)
        if not isinstance(unbiased, bool):
            raise ValueError(f"compressor.unbiased must be true or false, got {unbiased!r}")
        self.unbiased = unbiased
        self.shared = seed is not None
        self.seed = check_seed(seed) if self.shared else 0
        self.summable = self.shared
        self.member_bytes = 4 if self.shared else 8  # one more value (and index) at most

    def select(self, flat: torch.Tensor, name: str, segments: Sequence[int] | None = None) -> torch.Tensor:
        """``segments``: the members' sizes (one member when None or one)."""
        n = flat.numel()
        gen = self.generator(name, flat.device, shared=self.shared)
        if segments is None or len(segments) == 1:
            return sample_without_replacement(n, count_of(self.ratio, n), gen, flat.device)
        return sample_segments(segments, [count_of(self.ratio, m) for m in segments], gen, flat.device)

    def encode(self, tensor: torch.Tensor, name: str, segments: tuple[Segment, ...] | None = None
               ) -> tuple[list[torch.Tensor], Any]:
        flat = tensor.reshape(-1)
        sizes = None if segments is None or len(segments) == 1 else tuple(m.numel for m in segments)
        idx = self.select(flat, name, sizes)
        values = flat[idx]
        if self.unbiased and idx.numel():
            values = values * (flat.numel() / idx.numel()) if sizes is None else (
                values.double() * self._scales(idx, sizes)).to(values.dtype)
        idx = idx.to(index_dtype(flat.numel()))
        return ([values], idx) if self.shared else ([values, idx], None)

    def _scales(self, idx: torch.Tensor, segments: tuple[int, ...]) -> torch.Tensor:
        """n / k of the member each kept position lies in (float64)."""
        sizes = torch.tensor(segments, dtype=torch.float64)
        counts = torch.tensor([count_of(self.ratio, m) for m in segments], dtype=torch.float64)
        per_member = (sizes / counts.clamp(min=1)).to(idx.device)
        ends = torch.cumsum(torch.tensor(segments), 0).to(idx.device)
        return per_member[torch.searchsorted(ends, idx, right=True)]

    context = Compressor.context  # shared indices live in the context: draw them

    def entries(self, payload: list[torch.Tensor], ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        return (payload[0], ctx.extra) if self.shared else super().entries(payload, ctx)

    def kept_max(self, numel: int) -> int:
        return count_of(self.ratio, numel)

    def kept_max_many(self, numels: np.ndarray) -> np.ndarray:
        return counts_of(self.ratio, numels)

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        if self.shared:
            return self.kept_max(numel_of(shape)) * float_bytes(dtype)
        return super().payload_bytes(shape, dtype, kept)

    def payload_bytes_many(self, numels: np.ndarray, dtype: torch.dtype, kept: np.ndarray | None = None) -> np.ndarray:
        if self.shared:
            return (self.kept_max_many(numels) * float_bytes(dtype)).astype(float)
        return super().payload_bytes_many(numels, dtype, kept)
