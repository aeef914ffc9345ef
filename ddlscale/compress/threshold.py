"""Threshold sparsification: keep every element with |g| >= threshold."""

from __future__ import annotations

import torch

from ddlscale.compress.sparse import SparseCompressor


class Threshold(SparseCompressor):
    """The kept count depends on the data (anywhere from 0 to numel), so payload sizes differ across
    ranks and steps: a backend exchanges sizes before gathering. No selection pass beyond one
    comparison — the cheapest sparsifier, at the price of an unpredictable volume.

    Elementwise (one absolute threshold, no statistic): a fused buffer keeps, bit for bit, the
    elements its members keep alone.

    Payload: ``[values (kept), indices (kept, int32)]``.
    """

    name = "threshold"
    fixed_size = False

    def __init__(self, threshold: float = 1e-3) -> None:
        super().__init__()
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise ValueError(f"compressor.threshold must be a number >= 0, got {threshold!r}")
        self.threshold = float(threshold)

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nonzero(flat.abs() >= self.threshold).reshape(-1)
