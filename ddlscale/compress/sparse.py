"""What the sparsifiers share: a (values, indices) payload and exact top-k selection."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ddlscale.compress.compressor import (
    Compressed,
    Compressor,
    Context,
    Shape,
    float_bytes,
    index_dtype,
    numel_of,
)


def top_indices(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the ``k`` largest entries of a 1-D tensor, exactly ``k`` of them.

    Ties at the k-th value go to the lowest positions, so every rank and every run picks the same
    set (``torch.topk`` leaves ties unspecified). O(numel): one top-k for the k-th value, then one
    comparison pass — no full sort.
    """
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=magnitude.device)
    if k >= magnitude.numel():
        return torch.arange(magnitude.numel(), device=magnitude.device)
    kth = torch.topk(magnitude, k, sorted=False).values.min()
    idx = torch.nonzero(magnitude >= kth).reshape(-1)  # ascending; more than k only on ties
    surplus = idx.numel() - k
    if surplus > 0:
        tied = torch.nonzero(magnitude[idx] == kth).reshape(-1)
        keep = torch.ones_like(idx, dtype=torch.bool)
        keep[tied[-surplus:]] = False  # drop the highest-positioned ties
        idx = idx[keep]
    return idx


class SparseCompressor(Compressor):
    """Payload: ``[values (input dtype, kept), indices (int32, or int64 past 2**31 elements)]``,
    indices ascending. Decoding scatters the values into zeros."""

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """Ascending int64 positions to keep (override)."""
        raise NotImplementedError

    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], None]:
        flat = tensor.reshape(-1)
        idx = self.select(flat, name)
        return [flat[idx], idx.to(index_dtype(flat.numel()))], None

    def context(self, shape: Shape, dtype: torch.dtype, name: str = "", segments=None) -> Context:
        # Indices travel in the payload: the context is shape and dtype. (Selecting from zeros to
        # learn that costs an exact top-k over the whole tensor: DGC's threshold passes everything.)
        self._steps[name] = self._steps.get(name, 0) + 1
        return Context(torch.Size([shape] if isinstance(shape, int) else shape), dtype, None)

    def entries(self, payload: list[torch.Tensor], ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, positions) a payload stands for (override where the positions travel elsewhere)."""
        values, idx = payload
        return values, idx

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        values, idx = self.entries(payload, ctx)
        out = values.new_zeros(ctx.numel)
        out[idx] = values
        return out

    def decompress_sum(self, items: Sequence[Compressed]) -> torch.Tensor:
        """Every payload's entries added into one zeroed tensor: one pass over the dense tensor, not
        a zeroed tensor per rank and a sum pass each (what decoding costs most, at 1% kept)."""
        if not items:
            raise ValueError("decompress_sum needs at least one compressed tensor")
        ctx = items[0].ctx
        entries = [self.entries(item.payload, item.ctx) for item in items]
        total = torch.zeros(ctx.numel, dtype=ctx.dtype, device=entries[0][0].device)
        for values, idx in entries:
            total.index_add_(0, idx, values.to(ctx.dtype))
        return total.reshape(ctx.shape)

    def kept_max(self, numel: int) -> int:
        """Largest number of elements one tensor may keep (override)."""
        return numel

    def kept_count(self, numel: int, kept: int | None) -> int:
        if self.fixed_size or kept is None:
            return self.kept_max(numel)
        return kept

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        n = numel_of(shape)
        per = float_bytes(dtype) + index_dtype(n).itemsize
        return self.kept_count(n, kept) * per

    def kept_max_many(self, numels: np.ndarray) -> np.ndarray:
        """:meth:`kept_max` of each of ``numels`` (override with a vectorized formula)."""
        return np.array([self.kept_max(n) for n in numels.tolist()], dtype=np.int64)

    def payload_bytes_many(self, numels: np.ndarray, dtype: torch.dtype, kept: np.ndarray | None = None) -> np.ndarray:
        numels = np.asarray(numels, dtype=np.int64)
        counts = self.kept_max_many(numels)
        if not self.fixed_size and kept is not None:
            counts = np.where(kept >= 0, kept, counts)
        index_bytes = np.where(numels <= torch.iinfo(torch.int32).max, 4, 8)  # index_dtype's choice
        return (counts * (float_bytes(dtype) + index_bytes)).astype(float)
