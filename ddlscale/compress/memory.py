"""Error-feedback memories: what a rank adds back of what compression dropped earlier.

A backend drives one per run, per tensor name, around the compressor::

    p = memory.compensate(grad, name)          # p_t = g_t + e_{t-1}
    c = compressor.compress(p, name)
    memory.update(name, p, compressor.decompress(c))   # e_t from p_t and D(C(p_t))

In a synchronized step the "decompressed" tensor is this rank's *share* of what the scheme
returned — the shares of all ranks sum to it: its own payload decoded, plus, where it owns a
partition that a scheme compresses a second time (alltoall, gather), the error of that second
compression; for PowerSGD's ``reduce``, P (M^T P)^T with its own M. So nothing any compression
drops is lost: sum over steps of what the ranks received + sum over ranks of e_T = sum of gradients.

Residuals live in float32 (float64 for float64 gradients) whatever the gradient's dtype: a bf16
residual would round away exactly the small values error feedback exists to keep. ``compensate``
therefore returns that wider dtype; cast the synchronized result back into the gradient.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ddlscale.compress.compressor import check_unit_interval


class Memory:
    """No error feedback: ``compensate`` returns the gradient itself, ``update`` forgets."""

    name: ClassVar[str] = "none"
    widens: ClassVar[bool] = False  # compensate promotes a bf16/fp16 gradient to float32

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def update(self, name: str, compensated: torch.Tensor, decompressed: torch.Tensor) -> None:
        pass

    def residual(self, name: str) -> torch.Tensor | None:
        """The error carried into the next step for ``name`` (None if there is none)."""
        return None

    def forget(self, name: str) -> None:
        """``name`` was sent whole this step (nothing dropped): it carries no error."""

    def group_states(self) -> list[dict[str, torch.Tensor]]:
        """The per-name tensors laid out like their name's gradient, which a backend that regroups
        tensors into new fused buffers must re-lay out (:func:`ddlscale.sync.compressed.regroup`)."""
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


NoMemory = Memory


class ResidualMemory(Memory):
    """True error feedback: p_t = g_t + e_{t-1}, e_t = p_t - D(C(p_t)).

    Invariant (telescoping): sum_t D(C(p_t)) + e_T = sum_t g_t, exactly up to floating-point
    rounding — nothing a compressor drops is ever lost, only delayed. Subclasses must keep it.
    """

    name = "residual"
    widens = True

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        wide = tensor.to(torch.promote_types(tensor.dtype, torch.float32))
        residual = self._residuals.get(name)
        if residual is None:
            return wide.clone() if wide is tensor else wide  # never hand out the gradient itself
        if residual.numel() != wide.numel():  # the shape may differ: regrouping keeps residuals flat
            raise ValueError(f"memory: tensor {name!r} changed shape from {tuple(residual.shape)} "
                             f"to {tuple(wide.shape)}; names must identify tensors")
        return wide + residual.to(wide.device).reshape(wide.shape)

    def update(self, name: str, compensated: torch.Tensor, decompressed: torch.Tensor) -> None:
        self._residuals[name] = self.next_residual(compensated - decompressed.to(compensated.dtype))

    def next_residual(self, error: torch.Tensor) -> torch.Tensor:
        return error

    def residual(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)

    def forget(self, name: str) -> None:
        self._residuals.pop(name, None)

    def group_states(self) -> list[dict[str, torch.Tensor]]:
        return [self._residuals]

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}


class DecayedMemory(ResidualMemory):
    """e_t = beta * (p_t - D(C(p_t))): the damped residual some published systems use.

    A *different* memory from :class:`ResidualMemory`: the (1 - beta) share of every error is
    dropped for good, so the telescoping identity does not hold (sum_t D(C(p_t)) + e_T falls short
    of sum_t g_t). beta = 0 is no memory; beta -> 1 approaches true error feedback.
    """

    name = "decayed"

    def __init__(self, beta: float = 0.9) -> None:
        super().__init__()
        self.beta = check_unit_interval(beta, "memory.beta")

    def next_residual(self, error: torch.Tensor) -> torch.Tensor:
        return error * self.beta


# The memories by name: what ``sync.memory`` and ``ddlscale/conf/memory/<name>.yaml`` select.
MEMORIES: dict[str, type[Memory]] = {cls.name: cls for cls in (NoMemory, ResidualMemory, DecayedMemory)}
