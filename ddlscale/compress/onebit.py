"""1-bit quantization in the manner of 1-bit SGD: one bit per element, two reconstruction values."""

from __future__ import annotations

import torch

from ddlscale.compress import bits
from ddlscale.compress.base import Compressor, Context, Shape, numel_of, wide


class OneBit(Compressor):
    """Splits the tensor at zero and sends, besides the bit, the mean of each side: elements >= 0
    decode to the mean of the non-negative ones, elements < 0 to the mean of the negative ones.
    Unlike a scaled sign, this keeps the sum exactly (n+ mean+ + n- mean- = sum g) and adapts to
    skewed distributions. Biased per element — 1-bit SGD relies on error feedback.

    Payload: ``[bits (uint8, ceil(numel / 8); 1 = negative), means (float32, 2 per member: [non-negative,
    negative]; 0 for an empty side)]``.
    """

    name = "onebit"
    per_member, member_bytes = True, 8

    def encode(self, tensor: torch.Tensor, name: str, segments: tuple[int, ...] | None = None
               ) -> tuple[list[torch.Tensor], None]:
        flat = wide(tensor.reshape(-1))
        negative = flat < 0
        parts = [(flat, negative)] if segments is None else zip(flat.split(segments), negative.split(segments), strict=True)
        means = torch.stack([_side_means(*part) for part in parts])
        return [bits.pack(negative, 1), means.reshape(-1).to(torch.float32)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        packed, means = payload
        if ctx.segments is None:
            return bits.lookup(packed, 1, ctx.numel, means)
        return bits.lookup_segments(packed, 1, ctx.segments, means.reshape(-1, 2))

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return bits.packed_bytes(numel_of(shape), 1) + 8


def _side_means(flat: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """[mean of the non-negative elements, mean of the negative ones] (0 for an empty side)."""
    n_neg = negative.sum()
    n_pos = flat.numel() - n_neg
    sum_neg = torch.where(negative, flat, 0).sum()
    sum_pos = flat.sum() - sum_neg
    return torch.stack([sum_pos / n_pos.clamp(min=1), sum_neg / n_neg.clamp(min=1)])
