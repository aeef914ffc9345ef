"""QSGD: stochastic rounding onto s uniform levels of each bucket's L2 norm."""

from __future__ import annotations

import itertools
import math

import torch

from ddlscale.compress import bits
from ddlscale.compress.compressor import (
    Compressor,
    Context,
    Segment,
    Shape,
    check_int,
    check_seed,
    numel_of,
    wide,
)


def code_width(levels: int) -> int:
    """Bits per element for the 2s + 1 signed levels: packed widths 1/2/4/8, else 16 (int16)."""
    return next((w for w in bits.WIDTHS if 2**w >= 2 * levels + 1), 16)


class QSGD(Compressor):
    """Per bucket v of ``bucket_size`` consecutive elements: r_i = s |v_i| / ||v||_2, rounded to
    floor(r_i) or floor(r_i) + 1 with probability frac(r_i), then v_i ~ ||v||_2 sign(v_i) l_i / s.
    Unbiased; E||Q(v) - v||^2 <= min(n / s^2, sqrt(n) / s) ||v||^2 with n = bucket_size, so smaller
    buckets trade more norms on the wire for less variance.

    Unchanged by fusion: a fused buffer given its members buckets each member from its own start
    (its last bucket short, as alone), so no bucket and no norm spans two tensors; given the same
    uniform draws (:meth:`~ddlscale.compress.compressor.Compressor.uniform`: a group draws from its own
    name's stream) it decodes bit for bit as each member compressed alone. Each member past the first
    adds at most one norm (4 bytes).

    A simplification of the paper, by design: levels travel as fixed-width codes l_i sign(v_i) + s
    at ``code_width(levels)`` bits each, not in the paper's Elias integer coding (which shrinks the
    many small levels further but needs a sequential decoding pass); payloads are therefore of
    fixed size.

    Payload: ``[codes (uint8 bit-packed, or int16 when s > 127), norms (float32, one per bucket)]``.
    """

    name = "qsgd"
    unbiased = True  # default memory: none
    per_member, member_bytes = True, 4

    def __init__(self, levels: int = 127, bucket_size: int = 512, seed: int = 0) -> None:
        super().__init__()
        self.levels = check_int(levels, "compressor.levels", 1, 2**15 - 1)
        self.bucket_size = check_int(bucket_size, "compressor.bucket_size", 1)
        self.seed = check_seed(seed)
        self.width = code_width(self.levels)

    def _spread(self, flat: torch.Tensor, members: tuple[Segment, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(buckets, where): ``flat`` laid out in rows of ``bucket_size``, each member from a row's start
        and zero-padded to whole rows; ``where`` the position of each element there (None for one
        member: the first ``numel``)."""
        b, sizes = self.bucket_size, [m.numel for m in members]
        if len(sizes) == 1:
            return torch.nn.functional.pad(flat, (0, (-flat.numel()) % b)).view(-1, b), None
        rows = [math.ceil(n / b) for n in sizes]
        row_starts, starts = itertools.accumulate(rows[:-1], initial=0), itertools.accumulate(sizes[:-1], initial=0)
        shift = [b * r - n for r, n in zip(row_starts, starts, strict=True)]  # the padding before each member
        where = torch.arange(flat.numel(), device=flat.device) + torch.repeat_interleave(
            torch.tensor(shift, device=flat.device), torch.tensor(sizes, device=flat.device), output_size=flat.numel())
        buckets = flat.new_zeros(b * sum(rows))
        buckets[where] = flat
        return buckets.view(-1, b), where

    def encode(self, tensor: torch.Tensor, name: str, segments: tuple[Segment, ...] | None = None
               ) -> tuple[list[torch.Tensor], None]:
        flat = wide(tensor.reshape(-1))
        members = segments or (Segment(flat.numel()),)
        s = self.levels
        buckets, where = self._spread(flat, members)
        # Each member's norms in a call of its own: a reduction's order may depend on how many rows it
        # has (a GPU kernel splits rows differently), so the same rows as alone give the same bits.
        rows = [math.ceil(m.numel / self.bucket_size) for m in members]
        norms = torch.cat([torch.linalg.vector_norm(b, dim=1, keepdim=True) for b in buckets.split(rows)])
        r = buckets.abs().mul_(s / torch.where(norms > 0, norms, 1))  # in [0, s]
        # One draw per element; the padding draws 0, so it rounds to level 0.
        u, _ = self._spread(self.uniform(name, flat), members)
        # floor(r + u) is floor(r) + 1 with probability frac(r): stochastic rounding in one pass.
        # The clamp catches r a rounding error above s (a bucket with one non-zero element).
        level = r.add_(u).floor_().clamp_(max=s)
        codes = level.copysign_(buckets).add_(s).reshape(-1)  # signed level + s, in [0, 2s]
        codes = codes[: flat.numel()] if where is None else codes[where]
        if self.width == 16:
            codes = codes.to(torch.int16)
        else:
            codes = bits.pack(codes.to(torch.uint8), self.width)
        return [codes, norms.reshape(-1).to(torch.float32)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        codes, norms = payload
        n, s = ctx.numel, self.levels
        if self.width == 16:
            level = codes.to(norms.dtype) - s
        else:
            level = bits.lookup(codes, self.width, n, torch.arange(2**self.width, dtype=norms.dtype,
                                                                  device=norms.device) - s)
        padded, where = self._spread(level, ctx.members)
        out = padded.mul_(norms.unsqueeze(1) / s).reshape(-1)
        return out[:n] if where is None else out[where]

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        n = numel_of(shape)
        code_bytes = 2 * n if self.width == 16 else bits.packed_bytes(n, self.width)
        return code_bytes + 4 * math.ceil(n / self.bucket_size)
