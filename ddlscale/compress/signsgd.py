"""signSGD with a magnitude: one bit per element plus one scale, mean |g|."""

from __future__ import annotations

import torch

from ddlscale.compress import bits
from ddlscale.compress.base import Compressor, Context, Shape, numel_of, wide


def encode_signs(flat: torch.Tensor, scale: torch.Tensor) -> list[torch.Tensor]:
    """[packed sign bits (1 = negative; zero counts as positive), scale (float32, 1)]."""
    return [bits.pack(flat < 0, 1), scale.to(torch.float32).reshape(1)]


def decode_signs(payload: list[torch.Tensor], numel: int) -> torch.Tensor:
    packed, scale = payload
    return bits.lookup(packed, 1, numel, torch.cat([scale, -scale]))


def sign_bytes(numel: int) -> int:
    return bits.packed_bytes(numel, 1) + 4


class SignSGD(Compressor):
    """D(C(g)) = mean|g| * sign(g). Every element decodes to +-scale (zeros to +scale), so the L1
    norm is preserved exactly: ||D(C(g))||_1 = numel * mean|g| = ||g||_1. Biased — pair with
    error feedback (that pairing is EF-signSGD; see ``efsignsgd``).

    Payload: ``[signs (uint8, ceil(numel / 8), bit-packed), scale (float32, 1)]``.
    """

    name = "signsgd"

    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], None]:
        flat = wide(tensor.reshape(-1))
        scale = flat.abs().mean() if flat.numel() else flat.new_zeros(())
        return encode_signs(flat, scale), None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        return decode_signs(payload, ctx.numel)

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return sign_bytes(numel_of(shape))
