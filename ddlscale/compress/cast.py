"""Casts to a 16-bit float: fp16 (more mantissa, max 65504) and bf16 (fp32's range, 8-bit mantissa).

One algorithm, two wire types, so one file. Casts are summable: allreduce the 16-bit payload
directly. Sums of fp16 payloads overflow past 65504, which is why a backend should divide by the
world size *before* compressing (averaging first, as PyTorch's fp16 hook does).
"""

from __future__ import annotations

import torch

from ddlscale.compress.compressor import Compressor, Context, Shape, numel_of


class Cast(Compressor):
    """Elementwise, no statistic: a fused buffer is cast bit for bit as its members alone would be.

    Payload: ``[tensor.reshape(-1).to(wire_dtype)]``."""

    wire_dtype: torch.dtype = torch.float16
    summable = True

    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], None]:
        return [tensor.reshape(-1).to(self.wire_dtype)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        return payload[0]

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return numel_of(shape) * 2


class FP16(Cast):
    name = "fp16"
    wire_dtype = torch.float16


class BF16(Cast):
    name = "bf16"
    wire_dtype = torch.bfloat16
