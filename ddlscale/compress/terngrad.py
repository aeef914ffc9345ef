"""TernGrad: stochastic ternary quantization to {-s, 0, +s} with s = max|g|."""

from __future__ import annotations

import torch

from ddlscale.compress import bits
from ddlscale.compress.base import Compressor, Context, Shape, check_seed, numel_of, wide

# 2-bit codes: 0 -> 0, 1 -> +s, 2 -> -s (3 is never sent)
_VALUES = (0.0, 1.0, -1.0, 0.0)


class TernGrad(Compressor):
    """Element i becomes sign(g_i) * s with probability |g_i| / s, else 0: unbiased, with variance
    |g_i| (s - |g_i|) per element. One scale per tensor (the paper's layer-wise scaling without
    gradient clipping). Random draws come from (seed, rank, name, step), so runs replay exactly.

    Payload: ``[codes (uint8, ceil(numel / 4), 2 bits each), s (float32, 1)]``.
    """

    name = "terngrad"
    unbiased = True  # default memory: none

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = check_seed(seed)

    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], None]:
        flat = wide(tensor.reshape(-1))
        magnitude = flat.abs()
        scale = magnitude.max() if flat.numel() else flat.new_zeros(())
        u = torch.rand(flat.shape, generator=self.generator(name, flat.device), device=flat.device,
                       dtype=flat.dtype)
        keep = u * scale < magnitude  # P = |g| / s; never true when s = 0
        codes = keep.to(torch.uint8) * (1 + (flat < 0).to(torch.uint8))
        return [bits.pack(codes, 2), scale.to(torch.float32).reshape(1)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        packed, scale = payload
        values = torch.tensor(_VALUES, dtype=scale.dtype, device=scale.device) * scale
        return bits.lookup(packed, 2, ctx.numel, values)

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return bits.packed_bytes(numel_of(shape), 2) + 4
