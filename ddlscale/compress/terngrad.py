"""TernGrad (Wen et al. 2017): stochastic ternary quantization to {-s, 0, +s}, with the paper's
per-layer gradient clipping and scaler sharing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ddlscale.compress import bits
from ddlscale.compress.base import Compressor, Context, Shape, check_seed, numel_of, wide

# 2-bit codes: 0 -> 0, 1 -> +s, 2 -> -s (3 is never sent)
_VALUES = (0.0, 1.0, -1.0, 0.0)


class TernGrad(Compressor):
    """Element i becomes sign(g_i) * s with probability |g_i| / s, else 0: unbiased for the clipped
    gradient, with variance |g_i| (s - |g_i|) per element. Random draws come from (seed, rank, name,
    step), so runs replay exactly. The paper's two techniques, on by default:

    - ``clip`` (per-layer gradient clipping; null: off): each tensor (group) is first clipped to
      [-clip * sigma, clip * sigma], sigma its standard deviation (the paper's c = 2.5): s shrinks
      from the largest outlier to a few sigma, and the variance with it.
    - ``shared_scale`` (scaler sharing): every rank uses the same s, the maximum of the ranks' own
      (one max-allreduce of a scalar per group before compressing), so every rank's payload is
      ternary in the same unit.

    Payload: ``[codes (uint8, ceil(numel / 4), 2 bits each), s (float32, 1)]``.
    """

    name = "terngrad"
    unbiased = True  # default memory: none (the paper runs without error feedback)

    def __init__(self, seed: int = 0, clip: float | None = 2.5, shared_scale: bool = True) -> None:
        super().__init__()
        self.seed = check_seed(seed)
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"compressor.clip must be a number > 0 or null, got {clip!r}")
        if not isinstance(shared_scale, bool):
            raise ValueError(f"compressor.shared_scale must be true or false, got {shared_scale!r}")
        self.clip = None if clip is None else float(clip)
        self.shared_scale = shared_scale
        self._agreed: torch.Tensor | None = None  # the ranks' common s, while a group compresses

    def clipped(self, flat: torch.Tensor) -> torch.Tensor:
        if self.clip is None or flat.numel() < 2:
            return flat
        limit = self.clip * flat.std()
        return flat.clamp(-limit, limit)

    @contextlib.contextmanager
    def agreed(self, tensor: torch.Tensor, comm: Any) -> Iterator[None]:
        if not self.shared_scale or comm is None or comm.size < 2:
            yield
            return
        flat = self.clipped(wide(tensor.reshape(-1)))
        scale = (flat.abs().max() if flat.numel() else flat.new_zeros(())).reshape(1).to(torch.float32)
        comm.allreduce(scale, dist.ReduceOp.MAX).wait()
        self._agreed = scale[0]
        try:
            yield
        finally:
            self._agreed = None

    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], None]:
        flat = self.clipped(wide(tensor.reshape(-1)))
        magnitude = flat.abs()
        scale = magnitude.max() if flat.numel() else flat.new_zeros(())
        if self._agreed is not None:  # the ranks' maximum, never below this tensor's own
            scale = torch.maximum(scale, self._agreed.to(scale.device, scale.dtype))
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
