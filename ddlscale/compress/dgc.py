"""Deep Gradient Compression's selection: top-k by a threshold estimated from a random sample."""

from __future__ import annotations

import math

import torch

from ddlscale.compress.base import check_ratio, check_seed, count_of
from ddlscale.compress.sparse import SparseCompressor, top_indices

MIN_SAMPLE = 1024  # below this many sampled magnitudes the estimate is too noisy to be worth it


class DGC(SparseCompressor):
    """Estimates a threshold from a sample of ``sample_ratio * numel`` magnitudes (at least
    ``MIN_SAMPLE``, drawn with replacement), then keeps every element at or above it — one
    comparison pass instead of an exact top-k over the whole tensor.

    With k = ceil(ratio * numel) and k_s = k * samples / numel its share of the sample, the estimate
    is the sample's min(1.5 k_s, k_s + 3 sqrt(k_s))-th largest magnitude: three binomial standard
    deviations above k (aiming at k itself would undershoot half the time and pay for an exact
    top-k), capped at the middle of the accepted range. Large samples thus land within a few
    percent above k; small ones near 1.5k. The rule when the count still misses
    (c = elements passing the estimate):
    - k <= c <= 2k: keep all c (the payload is at most twice top-k's);
    - c > 2k (estimate too low): exact top-k among those c candidates — they contain the true top-k,
      so the result equals exact top-k at a fraction of its cost;
    - c < k (estimate too high): exact top-k over the whole tensor.
    So the kept count is always in [k, 2k] and every kept magnitude >= every dropped one. Tensors
    too small to sample (sample >= numel) use exact top-k directly.

    Payload: ``[values (kept), indices (kept, int32)]``; kept varies with the data.
    """

    name = "dgc"
    fixed_size = False

    def __init__(self, ratio: float = 0.01, sample_ratio: float = 0.01, seed: int = 0) -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)
        self.sample_ratio = check_ratio(sample_ratio, "compressor.sample_ratio")
        self.seed = check_seed(seed)

    def estimate(self, magnitude: torch.Tensor, name: str) -> torch.Tensor | None:
        """The threshold, or None where the tensor is too small to sample."""
        n = magnitude.numel()
        samples = max(MIN_SAMPLE, math.ceil(self.sample_ratio * n))
        if samples >= n:
            return None
        gen = self.generator(name, magnitude.device)
        sample = magnitude[torch.randint(n, (samples,), generator=gen, device=magnitude.device)]
        share = count_of(self.ratio, n) * samples / n
        rank = min(samples, max(1, math.ceil(min(1.5 * share, share + 3 * math.sqrt(share)))))
        return torch.topk(sample, rank, sorted=False).values.min()

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        k = count_of(self.ratio, flat.numel())
        magnitude = flat.abs()
        threshold = self.estimate(magnitude, name)
        if threshold is None:
            return top_indices(magnitude, k)
        candidates = torch.nonzero(magnitude >= threshold).reshape(-1)
        if k <= candidates.numel() <= 2 * k:
            return candidates
        if candidates.numel() > 2 * k:
            return candidates[top_indices(magnitude[candidates], k)]
        return top_indices(magnitude, k)

    def kept_max(self, numel: int) -> int:
        return min(numel, 2 * count_of(self.ratio, numel))
