"""signSGD with a magnitude: one bit per element plus one scale, mean |g|."""

from __future__ import annotations

import torch

from ddlscale.compress import bits
from ddlscale.compress.base import Compressor, Context, Shape, numel_of, wide


def encode_signs(flat: torch.Tensor, scale: torch.Tensor) -> list[torch.Tensor]:
    """[packed sign bits (1 = negative; zero counts as positive), scales (float32, one per member)]."""
    return [bits.pack(flat < 0, 1), scale.to(torch.float32).reshape(-1)]


def decode_signs(payload: list[torch.Tensor], numel: int, segments: tuple[int, ...] | None = None) -> torch.Tensor:
    packed, scale = payload
    if segments is None:
        return bits.lookup(packed, 1, numel, torch.cat([scale, -scale]))
    # +-1 over the whole buffer, then each member's scale in place (exact: a product by +-1): one
    # lookup pass instead of one per member and a join, which made a fused decode ~2x a whole one.
    out = bits.lookup(packed, 1, numel, scale.new_tensor([1.0, -1.0]))
    for member, member_scale in zip(out.split(list(segments)), scale, strict=True):
        member.mul_(member_scale)
    return out


def mean_abs(flat: torch.Tensor, segments: tuple[int, ...] | None = None) -> torch.Tensor:
    """mean |x| of the whole tensor, or of each member (0 for an empty one)."""
    parts = [flat] if segments is None else flat.split(segments)
    means = [p.abs().mean() if p.numel() else p.new_zeros(()) for p in parts]
    return means[0] if segments is None else torch.stack(means)


def sign_bytes(numel: int) -> int:
    return bits.packed_bytes(numel, 1) + 4


class SignSGD(Compressor):
    """D(C(g)) = mean|g| * sign(g). Every element decodes to +-scale (zeros to +scale), so the L1
    norm is preserved exactly: ||D(C(g))||_1 = numel * mean|g| = ||g||_1. Biased — pair with
    error feedback (that pairing is EF-signSGD; see ``efsignsgd``). Per member of a fused buffer:
    one scale each, so a fused group decodes exactly as its members compressed alone would.

    Payload: ``[signs (uint8, ceil(numel / 8), bit-packed), scale (float32, 1 per member)]``.
    """

    name = "signsgd"
    per_member, member_bytes = True, 4

    def encode(self, tensor: torch.Tensor, name: str, segments: tuple[int, ...] | None = None
               ) -> tuple[list[torch.Tensor], None]:
        flat = wide(tensor.reshape(-1))
        return encode_signs(flat, mean_abs(flat, segments)), None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        return decode_signs(payload, ctx.numel, ctx.segments)

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return sign_bytes(numel_of(shape))
