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

    Payload: ``[bits (uint8, ceil(numel / 8); 1 = negative), means (float32, 2: [non-negative,
    negative]; 0 for an empty side)]``.
    """

    name = "onebit"

    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], None]:
        flat = wide(tensor.reshape(-1))
        negative = flat < 0
        n_neg = negative.sum()
        n_pos = flat.numel() - n_neg
        sum_neg = torch.where(negative, flat, 0).sum()
        sum_pos = flat.sum() - sum_neg
        means = torch.stack([sum_pos / n_pos.clamp(min=1), sum_neg / n_neg.clamp(min=1)])
        return [bits.pack(negative, 1), means.to(torch.float32)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        packed, means = payload
        return bits.lookup(packed, 1, ctx.numel, means)

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return bits.packed_bytes(numel_of(shape), 1) + 8
