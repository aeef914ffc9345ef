"""EF-signSGD: scaled signSGD with its error feedback built in."""

from __future__ import annotations

import torch

from ddlscale.compress.base import Context
from ddlscale.compress.memory import ResidualMemory
from ddlscale.compress.signsgd import SignSGD


class EFSignSGD(SignSGD):
    """The published algorithm defines the compressor together with its residual (it is what makes
    scaled signs converge), so this class carries its own :class:`ResidualMemory`: compress(g)
    sends C(g + e) and keeps e = (g + e) - D(C(g + e)) per tensor name. Give it ``memory=none`` —
    an outer residual memory would compensate twice (``has_memory`` tells a backend so).

    Payload: as ``signsgd``.
    """

    name = "efsignsgd"
    has_memory = True

    def __init__(self) -> None:
        super().__init__()
        self.memory = ResidualMemory()

    def encode(self, tensor: torch.Tensor, name: str, segments: tuple[int, ...] | None = None
               ) -> tuple[list[torch.Tensor], None]:
        compensated = self.memory.compensate(tensor, name)
        payload, _ = super().encode(compensated, name, segments)
        decoded = self.decode(payload, Context(tensor.shape, tensor.dtype, None, segments)).reshape(tensor.shape)
        self.memory.update(name, compensated, decoded)
        return payload, None

    def group_states(self) -> list[dict[str, torch.Tensor]]:
        return self.memory.group_states()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.memory.load_state_dict(state["memory"])
