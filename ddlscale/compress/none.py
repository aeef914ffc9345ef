"""The identity: the gradient travels as it is. The baseline every scheme must reproduce exactly."""

from __future__ import annotations

import torch

from ddlscale.compress.compressor import Compressor, Context, Shape, float_bytes, numel_of


class NoCompression(Compressor):
    """Payload: ``[tensor.reshape(-1)]`` — a view of the input (no copy), so a backend that
    allreduces it in place writes straight into the gradient. Fused or not, the same bits."""

    name = "none"
    unbiased = True  # exact: nothing to feed back (default memory none)
    summable = True

    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], None]:
        return [tensor.reshape(-1)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        return payload[0]

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return numel_of(shape) * float_bytes(dtype)
