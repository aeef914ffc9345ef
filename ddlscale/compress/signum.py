"""Signum: the sign of a per-tensor momentum, one bit per element."""

from __future__ import annotations

from typing import Any

import torch

from ddlscale.compress.base import Compressor, Context, Shape, check_unit_interval, numel_of, wide
from ddlscale.compress.signsgd import decode_signs, encode_signs, mean_abs, sign_bytes


class Signum(Compressor):
    """m_t = momentum * m_{t-1} + (1 - momentum) * g_t per tensor name (each rank its own, from its
    local gradient); sends sign(m_t). The momentum is state: it is checkpointed, and restoring it
    replays the same outputs bit for bit.

    ``scaled``: multiply by mean|m_t| (one float32 on the wire), so the step keeps the gradient's
    magnitude and a dense learning rate still fits; off, elements decode to +-1 and the learning
    rate alone sets the step (the original Signum). Use the optimizer without its own momentum.

    Payload: ``[signs (uint8, ceil(numel / 8)), scale (float32, 1; 1.0 when not scaled)]``.
    """

    name = "signum"
    member_bytes = 4

    def __init__(self, momentum: float = 0.9, scaled: bool = True) -> None:
        super().__init__()
        self.momentum = check_unit_interval(momentum, "compressor.momentum")
        if not isinstance(scaled, bool):
            raise ValueError(f"compressor.scaled must be true or false, got {scaled!r}")
        self.scaled = scaled
        self.per_member = scaled  # one scale per member of a fused buffer; unscaled has none to keep
        self._momenta: dict[str, torch.Tensor] = {}

    def encode(self, tensor: torch.Tensor, name: str, segments: tuple[int, ...] | None = None
               ) -> tuple[list[torch.Tensor], None]:
        flat = wide(tensor.reshape(-1))
        previous = self._momenta.get(name)
        if previous is None:
            m = (1 - self.momentum) * flat
        elif previous.shape != flat.shape:
            raise ValueError(f"signum: tensor {name!r} changed size from {previous.numel()} to "
                             f"{flat.numel()}; names must identify tensors")
        else:
            m = self.momentum * previous.to(flat.device) + (1 - self.momentum) * flat
        self._momenta[name] = m
        if self.scaled:
            scale = mean_abs(m, segments)
        else:
            scale = m.new_ones(())
        return encode_signs(m, scale), None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        return decode_signs(payload, ctx.numel, ctx.segments)

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        return sign_bytes(numel_of(shape))

    def group_states(self) -> list[dict[str, torch.Tensor]]:
        return [self._momenta]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "momenta": {k: v.clone() for k, v in self._momenta.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._momenta = {k: v.clone() for k, v in state["momenta"].items()}
