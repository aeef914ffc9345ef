"""QSGD: stochastic rounding onto s uniform levels of each bucket's L2 norm."""

from __future__ import annotations

import math

import torch

from ddlscale.compress import bits
from ddlscale.compress.base import Compressor, Context, Shape, check_int, check_seed, numel_of, wide


def code_width(levels: int) -> int:
    """Bits per element for the 2s + 1 signed levels: packed widths 1/2/4/8, else 16 (int16)."""
    return next((w for w in bits.WIDTHS if 2**w >= 2 * levels + 1), 16)


class QSGD(Compressor):
    """Per bucket v of ``bucket_size`` consecutive elements: r_i = s |v_i| / ||v||_2, rounded to
    floor(r_i) or floor(r_i) + 1 with probability frac(r_i), then v_i ~ ||v||_2 sign(v_i) l_i / s.
    Unbiased; E||Q(v) - v||^2 <= min(n / s^2, sqrt(n) / s) ||v||^2 with n = bucket_size, so smaller
    buckets trade more norms on the wire for less variance.

    A simplification of the paper, by design: levels travel as fixed-width codes l_i sign(v_i) + s
    at ``code_width(levels)`` bits each, not in the paper's Elias integer coding (which shrinks the
    many small levels further but needs a sequential decoding pass); payloads are therefore of
    fixed size.

    Payload: ``[codes (uint8 bit-packed, or int16 when s > 127), norms (float32, one per bucket)]``.
    """

    name = "qsgd"
    unbiased = True  # default memory: none

    def __init__(self, levels: int = 127, bucket_size: int = 512, seed: int = 0) -> None:
        super().__init__()
        self.levels = check_int(levels, "compressor.levels", 1, 2**15 - 1)
        self.bucket_size = check_int(bucket_size, "compressor.bucket_size", 1)
        self.seed = check_seed(seed)
        self.width = code_width(self.levels)

    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], None]:
        flat = wide(tensor.reshape(-1))
        n, b, s = flat.numel(), self.bucket_size, self.levels
        buckets = torch.nn.functional.pad(flat, (0, (-n) % b)).view(-1, b)
        norms = torch.linalg.vector_norm(buckets, dim=1, keepdim=True)
        r = buckets.abs().mul_(s / torch.where(norms > 0, norms, 1))  # in [0, s]
        u = torch.rand(r.shape, generator=self.generator(name, flat.device), device=flat.device,
                       dtype=r.dtype)
        # floor(r + u) is floor(r) + 1 with probability frac(r): stochastic rounding in one pass.
        # The clamp catches r a rounding error above s (a bucket with one non-zero element).
        level = r.add_(u).floor_().clamp_(max=s)
        codes = level.copysign_(buckets).add_(s).reshape(-1)[:n]  # signed level + s, in [0, 2s]
        if self.width == 16:
            codes = codes.to(torch.int16)
        else:
            codes = bits.pack(codes.to(torch.uint8), self.width)
        return [codes, norms.reshape(-1).to(torch.float32)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        codes, norms = payload
        n, b, s = ctx.numel, self.bucket_size, self.levels
        if self.width == 16:
            level = codes.to(norms.dtype) - s
        else:
            level = bits.lookup(codes, self.width, n, torch.arange(2**self.width, dtype=norms.dtype,
                                                                  device=norms.device) - s)
        padded = torch.nn.functional.pad(level, (0, (-n) % b)).view(-1, b)
        return padded.mul_(norms.unsqueeze(1) / s).reshape(-1)[:n]

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        n = numel_of(shape)
        code_bytes = 2 * n if self.width == 16 else bits.packed_bytes(n, self.width)
        return code_bytes + 4 * math.ceil(n / self.bucket_size)
