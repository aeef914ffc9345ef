"""Top-k sparsification: keep the k largest magnitudes."""

from __future__ import annotations

import torch

from ddlscale.compress.base import check_ratio, count_of
from ddlscale.compress.sparse import SparseCompressor, top_indices


class TopK(SparseCompressor):
    """Keeps exactly k = ceil(ratio * numel) elements (at least one): every kept magnitude >= every
    dropped one, ties broken towards lower positions. Biased — use error feedback.

    Payload: ``[values (k), indices (k, int32)]``.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01) -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return top_indices(flat.abs(), count_of(self.ratio, flat.numel()))

    def kept_max(self, numel: int) -> int:
        return count_of(self.ratio, numel)
