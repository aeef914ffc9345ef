"""8-bit linear quantization with one scale per tensor."""

from __future__ import annotations

import torch

from ddlscale.compress.base import Compressor, Context, Shape, numel_of, wide


class Int8(Compressor):
    """Symmetric: q = round(g / s) with s = max|g| / 127, so the largest magnitude maps to +-127 and
    zero stays exactly zero. Round-to-nearest (biased, error <= s / 2 per element): pair it with
    error feedback. Not summable — every rank has its own scale.

    Payload: ``[q (int8, numel), s (float32, 1)]``.
    """

    name = "int8"

    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], None]:
        flat = wide(tensor.reshape(-1))
        peak = flat.abs().max() if flat.numel() else flat.new_zeros(())
        scale = (peak / 127).to(torch.float32)
        safe = scale if scale > 0 else scale.new_ones(())  # all-zero tensor: any scale decodes to 0
        q = torch.round(flat / safe).clamp_(-127, 127).to(torch.int8)
        return [q, scale.reshape(1)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        q, scale = payload
        return q.to(scale.dtype) * scale

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return numel_of(shape) + 4
