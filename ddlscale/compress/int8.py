"""8-bit linear quantization with one scale per tensor (per member of a fused buffer)."""

from __future__ import annotations

import torch

from ddlscale.compress.compressor import (
    Compressor,
    Context,
    Segment,
    Shape,
    member_max,
    numel_of,
    per_element,
    wide,
)


class Int8(Compressor):
    """Symmetric: q = round(g / s) with s = max|g| / 127, so the largest magnitude maps to +-127 and
    zero stays exactly zero. Round-to-nearest (biased, error <= s / 2 per element): pair it with
    error feedback. Not summable — every rank has its own scale.

    Unchanged by fusion: a fused buffer given its members keeps one scale per member, so it decodes
    bit for bit as each member compressed alone (one scale per group would round a 1e-3-scale layer
    fused with a unit-scale one to zero). Each member past the first adds its 4-byte scale.

    Payload: ``[q (int8, numel), s (float32, one per member)]``.
    """

    name = "int8"
    per_member, member_bytes = True, 4

    def encode(self, tensor: torch.Tensor, name: str, segments: tuple[Segment, ...] | None = None
               ) -> tuple[list[torch.Tensor], None]:
        flat = wide(tensor.reshape(-1))
        scale = (member_max(flat.abs(), segments) / 127).to(torch.float32)
        safe = torch.where(scale > 0, scale, 1.0)  # an all-zero member: any scale decodes to 0
        q = torch.round(flat / per_element(safe, segments, flat.numel())).clamp_(-127, 127).to(torch.int8)
        return [q, scale], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        q, scale = payload
        return q.to(scale.dtype) * per_element(scale, ctx.members, ctx.numel)

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return numel_of(shape) + 4
