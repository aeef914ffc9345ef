"""TernGrad (Wen et al. 2017): stochastic ternary quantization to {-s, 0, +s}, with the paper's
per-layer gradient clipping and scaler sharing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddlscale.compress import bits
from ddlscale.compress.compressor import (
    Compressor,
    Context,
    Segment,
    Shape,
    check_seed,
    member_max,
    numel_of,
    per_element,
    wide,
)

# 2-bit codes: 0 -> 0, 1 -> +s, 2 -> -s (3 is never sent)
_VALUES = (0.0, 1.0, -1.0, 0.0)


class TernGrad(Compressor):
    """Element i becomes sign(g_i) * s with probability |g_i| / s, else 0: unbiased for the clipped
    gradient, with variance |g_i| (s - |g_i|) per element. Random draws come from (seed, rank, name,
    step), so runs replay exactly. The paper's two techniques, on by default:

    - ``clip`` (per-layer gradient clipping; null: off): each tensor is first clipped to
      [-clip * sigma, clip * sigma], sigma its standard deviation (the paper's c = 2.5): s shrinks
      from the largest outlier to a few sigma, and the variance with it.
    - ``shared_scale`` (scaler sharing): every rank uses the same s per tensor, the maximum of the
      ranks' own (one max-allreduce per group, of one scalar per member, before compressing), so
      every rank's payload is ternary in the same unit.

    Unchanged by fusion: both are per layer, so a fused buffer given its members clips each by its
    own sigma and keeps one s per member (shared member by member); given the same uniform draws
    (:meth:`~ddlscale.compress.compressor.Compressor.uniform`: a group draws from its own name's stream) it
    decodes bit for bit as each member compressed alone. Each member past the first adds its 4-byte s.
    A divisible scheme's partition holds pieces of members: each piece is clipped by its own sigma and
    shares its member's agreed s.

    Payload: ``[codes (uint8, ceil(numel / 4), 2 bits each), s (float32, one per member)]``.
    """

    name = "terngrad"
    unbiased = True  # default memory: none (the paper runs without error feedback)
    per_member, member_bytes = True, 4

    def __init__(self, seed: int = 0, clip: float | None = 2.5, shared_scale: bool = True) -> None:
        super().__init__()
        self.seed = check_seed(seed)
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"compressor.clip must be a number > 0 or null, got {clip!r}")
        if not isinstance(shared_scale, bool):
            raise ValueError(f"compressor.shared_scale must be true or false, got {shared_scale!r}")
        self.clip = None if clip is None else float(clip)
        self.shared_scale = shared_scale
        # While a group compresses: the ranks' common s per member, where each member ends in the
        # group, and [how far into the group the compressions inside ``agreed`` have come, its size].
        self._agreed: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None

    def clipped(self, flat: torch.Tensor) -> torch.Tensor:
        if self.clip is None or flat.numel() < 2:
            return flat
        limit = self.clip * flat.std()
        return flat.clamp(-limit, limit)

    def clipped_scales(self, flat: torch.Tensor, members: tuple[Segment, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the members each clipped by its own sigma, their largest magnitudes: s per member)."""
        if len(members) == 1:
            flat = self.clipped(flat)
        else:
            flat = torch.cat([self.clipped(p) for p in flat.split([m.numel for m in members])])
        return flat, member_max(flat.abs(), members)

    @contextlib.contextmanager
    def agreed(self, tensor: torch.Tensor, comm: Any, segments: Sequence[int | Segment] | None = None
               ) -> Iterator[None]:
        if not self.shared_scale or comm is None or comm.size < 2:
            yield
            return
        members = self._members(tensor, segments)
        _, scale = self.clipped_scales(wide(tensor.reshape(-1)), members)
        scale = scale.to(torch.float32)
        comm.allreduce(scale, dist.ReduceOp.MAX).wait()
        ends = torch.tensor([m.numel for m in members], device=scale.device).cumsum(0)
        self._agreed = (scale, ends, [0, tensor.numel()])
        try:
            yield
        finally:
            self._agreed = None

    def _shared(self, members: tuple[Segment, ...], numel: int) -> torch.Tensor:
        """The agreed s of the member each of ``members`` (this compression's pieces of the group, next
        in order) lies in."""
        scale, ends, at = self._agreed
        (start, total), sizes = at, [m.numel for m in members]
        if start + numel > total:
            raise RuntimeError("terngrad: the compressions inside agreed() went past the group it agreed on")
        at[0] += numel
        if start == 0 and numel == total and len(sizes) == scale.numel():  # the group's members themselves
            return scale
        # Pieces (none empty): each lies in the member whose end is the first past its start.
        starts = start + torch.tensor([0, *sizes[:-1]], device=ends.device).cumsum(0)
        return scale[torch.searchsorted(ends, starts, right=True).clamp_(max=scale.numel() - 1)]

    def encode(self, tensor: torch.Tensor, name: str, segments: tuple[Segment, ...] | None = None
               ) -> tuple[list[torch.Tensor], None]:
        members = segments or (Segment(tensor.numel()),)
        flat, scale = self.clipped_scales(wide(tensor.reshape(-1)), members)
        if self._agreed is not None:  # the ranks' maximum, never below this piece's own
            scale = torch.maximum(scale, self._shared(members, flat.numel()).to(scale.device, scale.dtype))
        u = self.uniform(name, flat)
        keep = u * per_element(scale, members, flat.numel()) < flat.abs()  # P = |g| / s; never true when s = 0
        codes = keep.to(torch.uint8) * (1 + (flat < 0).to(torch.uint8))
        return [bits.pack(codes, 2), scale.to(torch.float32)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        packed, scale = payload
        values = torch.tensor(_VALUES, dtype=scale.dtype, device=scale.device) * scale.unsqueeze(1)
        members = ctx.members
        if len(members) == 1:
            return bits.lookup(packed, 2, ctx.numel, values[0])
        return bits.lookup_segments(packed, 2, tuple(m.numel for m in members), values)

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return bits.packed_bytes(numel_of(shape), 2) + 4
