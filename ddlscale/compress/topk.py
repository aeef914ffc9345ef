"""Top-k sparsification: keep the k largest magnitudes."""

from __future__ import annotations

import numpy as np
import torch

from ddlscale.compress.compressor import check_ratio, count_of, counts_of
from ddlscale.compress.sparse import SparseCompressor, top_indices


class TopK(SparseCompressor):
    """Keeps exactly k = ceil(ratio * numel) elements (at least one): every kept magnitude >= every
    dropped one, ties broken towards lower positions. Biased — use error feedback.

    Fusion: top-k of a fused buffer is top-k of the whole group, k = ceil(ratio * its numel) — the
    operator Cupcake and Espresso fuse tensors for (one selection per merged tensor). A top-k per
    member would be the layer-wise selection again, so ``segments`` are ignored: what fusion keeps is
    the group's count and the rule (every kept magnitude >= every dropped one, across members). A
    member with small magnitudes may then send nothing for a while; error feedback holds it back,
    never drops it.

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

    def kept_max_many(self, numels: np.ndarray) -> np.ndarray:
        return counts_of(self.ratio, numels)
